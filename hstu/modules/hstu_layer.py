"""The HSTU layer (docs/design.md "Fused HSTU layer") and a stack of them, on jagged [T, D] tokens.

n = LayerNorm(x); u, v, q, k = split(SiLU(n @ W_uvqk + b)); a = attention(q, k, v)
y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o

`HSTUEncoder` stacks `HSTULayer`s (hstu/modules/unfused_layer.py) or `FusedHSTULayer`s
(hstu/modules/fused_hstu_layer.py). Every kernel and code-path choice of the stack is a
constructor argument, resolved once from `NetworkArgs` when the model is built; nothing here
reads the environment. `HSTUEncoder.kernel_choices()` says what the choices resolved to.

This module is the top of the layer modules (attention_inputs <- relative_bias <- unfused_layer
<- fused_hstu_layer <- hstu_layer: imports go one way) and re-exports `AttentionInputs`,
`HSTULayer` and `RelativeAttentionBias`, which are imported from here elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from hstu.config.args import FUSED_GATE_KERNELS, KERNEL_BACKENDS
from hstu.modules.attention_inputs import AttentionInputs
from hstu.modules.fused_hstu_layer import FusedHSTULayer
from hstu.modules.graphed_encoder import GRAPH_PAD_SIZES_PER_OCTAVE, EncoderGraphs
from hstu.modules.relative_bias import RelativeAttentionBias
from hstu.modules.unfused_layer import HSTULayer
from hstu.ops.attention import attention_path

__all__ = ["AttentionInputs", "HSTULayer", "HSTUEncoder", "RelativeAttentionBias"]

# fused-layer-only switches: HSTUEncoder argument -> (NetworkArgs field, default)
_FUSED_ONLY = {
    "elementwise_kernels": ("fused_elementwise_kernels", True),
    "layernorm_kernel": ("fused_layernorm_kernel", True),
    "stage_compile": ("fused_stage_compile", True),
    "residual_gemm": ("fused_residual_gemm", True),
}


class HSTUEncoder(nn.Module):
    """N HSTU layers followed by a final LayerNorm.

    ``fused=True`` builds `FusedHSTULayer`s (one autograd Function per layer, hand-written
    backward; the recompute options apply only to them); ``False`` the unfused `HSTULayer`.
    Both have the same parameters, so their state dicts are interchangeable.
    ``final_layernorm=False`` drops the closing LayerNorm (Meta's reference HSTU has none: its
    outputs go straight to the L2 normalisation of retrieval).

    Kernel and code-path choices (`NetworkArgs` field in brackets):

    - ``kernel_backend`` [kernel_backend]: the compiled attention kernel on CUDA ("cutlass");
      CPU tensors run the PyTorch reference (CPU development mode, `hstu.ops.attention`);
    - ``gate_kernel`` [fused_gate_kernel]: fused layer, the LayerNorm(attn)*u*dropout step:
      "auto" | "cuda" | "compiled" (None: "auto");
    - ``elementwise_kernels`` [fused_elementwise_kernels], ``layernorm_kernel``
      [fused_layernorm_kernel], ``stage_compile`` [fused_stage_compile], ``residual_gemm``
      [fused_residual_gemm]: fused layer, the hstu_lnmd SiLU/cast kernels, its input LayerNorm
      kernels, torch.compile of the PyTorch stages, the residual added by the output
      projection's GEMM (True: where they apply);
    - ``reference_attention``: tests and benchmarks only (no config field): the PyTorch
      reference attention on CUDA too.

    Layer arguments (``**layer_kwargs``) go to every layer, among them the relative attention
    bias: ``relative_attention_bias`` [relative_attention_bias], ``max_relative_position``,
    ``num_time_buckets`` [num_time_buckets], ``relative_bias_per_head``
    [relative_attention_bias_per_head]; each layer owns its own bias weights (fused or not).

    The fused-only choices must stay at their defaults with ``fused=False``.
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        *,
        fused: bool = False,
        recompute_input_layernorm: bool = False,
        recompute_uvqk_silu: bool = False,
        gate_kernel: str | None = "auto",
        elementwise_kernels: bool = True,
        layernorm_kernel: bool = True,
        stage_compile: bool = True,
        residual_gemm: bool = True,
        kernel_backend: str = "cutlass",
        reference_attention: bool = False,
        final_layernorm: bool = True,
        uvqk_init_std: float = 0.0,
        cuda_graphs: bool = False,
        cuda_graph_pad_sizes: int = GRAPH_PAD_SIZES_PER_OCTAVE,
        **layer_kwargs,
    ) -> None:
        super().__init__()
        gate_kernel = "auto" if gate_kernel is None else gate_kernel
        if gate_kernel not in FUSED_GATE_KERNELS:
            raise ValueError(
                f"NetworkArgs.fused_gate_kernel={gate_kernel!r} is not supported: one of "
                f"{list(FUSED_GATE_KERNELS)}"
            )
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"NetworkArgs.kernel_backend={kernel_backend!r} is not supported: one of "
                f"{list(KERNEL_BACKENDS)}"
            )
        if gate_kernel != "auto" and not fused:
            raise ValueError(
                f"HSTUEncoder(gate_kernel={gate_kernel!r}) applies only to the fused layer "
                "(NetworkArgs.fused_layer=True)"
            )
        switches = {
            "elementwise_kernels": elementwise_kernels,
            "layernorm_kernel": layernorm_kernel,
            "stage_compile": stage_compile,
            "residual_gemm": residual_gemm,
        }
        for arg, value in switches.items():
            field, default = _FUSED_ONLY[arg]
            if not isinstance(value, bool):
                raise TypeError(
                    f"NetworkArgs.{field}={value!r} must be True or False, got "
                    f"{type(value).__name__}"
                )
            if value != default and not fused:
                raise ValueError(
                    f"HSTUEncoder({arg}={value!r}) applies only to the fused layer: set "
                    f"NetworkArgs.fused_layer=True or leave NetworkArgs.{field}={default}"
                )
        self.kernel_backend = kernel_backend
        layer_kwargs["uvqk_init_std"] = uvqk_init_std
        layer_kwargs["reference_attention"] = bool(reference_attention)
        if fused:
            layers = [
                FusedHSTULayer(
                    hidden_size,
                    recompute_input_layernorm=recompute_input_layernorm,
                    recompute_uvqk_silu=recompute_uvqk_silu,
                    gate_kernel=gate_kernel,
                    **switches,
                    **layer_kwargs,
                )
                for _ in range(num_layers)
            ]
        else:
            layers = [HSTULayer(hidden_size, **layer_kwargs) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(hidden_size, eps=1e-6) if final_layernorm else None
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"NetworkArgs.cuda_graphs={cuda_graphs!r} must be True or False")
        # CUDA graphs of the training forward + backward: only where every layer runs the
        # compiled HSTU attention (the PyTorch attention reads the batch's sizes on the host)
        graphable = all(
            layer.attention_type == "hstu" and not layer.reference_attention
            for layer in self.layers
        )
        self.graphs = (
            EncoderGraphs(pad_sizes_per_octave=cuda_graph_pad_sizes)
            if cuda_graphs and graphable
            else None
        )

    @property
    def uses_timestamps(self) -> bool:
        """Whether a layer has a relative time bias (the forward then needs
        `AttentionInputs.timestamps`)."""
        return any(
            layer.relative_bias is not None and layer.relative_bias.uses_time
            for layer in self.layers
        )

    def kernel_choices(self, device: torch.device | str | None = None) -> dict[str, str]:
        """What the layers run on ``device`` (default: where the encoder's parameters are), one
        string per choice, for the log at model build: keys "layer", "attention",
        "gate_kernel", "elementwise_kernels", "layernorm_kernel", "stage_compile",
        "residual_gemm", "recompute". Each value starts with the choice ("fused", "cutlass",
        "reference", "softmax", "auto", "on", "off", ...), then, in brackets, what it means on
        that device.
        Every layer of the stack is built alike, so the first one answers."""
        if device is None:
            device = next(self.parameters()).device
        device = torch.device(device)
        if not len(self.layers):
            return {"layer": "none (num_layers=0)"}
        return self.layers[0].kernel_choices(device)

    def graphed(self, device: torch.device) -> bool:
        """Whether a call on ``device`` may replay CUDA graphs (NetworkArgs.cuda_graphs)."""
        return (
            self.graphs is not None
            and self.graphs.applies(self, device)
            and attention_path(device) == "cutlass"
        )

    def forward(
        self, x: torch.Tensor, attn: AttentionInputs, final_norm: bool = True
    ) -> torch.Tensor:
        """The layers (replayed from CUDA graphs where `graphed`), then the final norm unless
        ``final_norm=False``: a caller that reads a few rows (a ranking model its candidates)
        applies `final` to those rows only, the same values (the norm is row by row) without a
        LayerNorm forward and backward over every token."""
        if self.graphed(x.device):
            y = self.graphs.run(self, x, attn)
        else:
            y = self.forward_eager(x, attn)
        return self.final(y) if final_norm else y

    def forward_eager(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        """The layers, op by op (`forward` replays CUDA graphs of this; no final norm)."""
        for layer in self.layers:
            x = layer(x, attn)
        return x

    def final(self, y: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm (identity without `NetworkArgs.final_layernorm`) of any rows of
        the layers' output."""
        return self.final_norm(y) if self.final_norm is not None else y
