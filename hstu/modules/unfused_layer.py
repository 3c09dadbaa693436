"""The unfused HSTU layer (docs/design.md "Fused HSTU layer"), on jagged [T, D] tokens.

n = LayerNorm(x); u, v, q, k = split(SiLU(n @ W_uvqk + b)); a = attention(q, k, v)
y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o

Plain PyTorch autograd around the attention op: the reference twin `FusedHSTULayer`
(hstu/modules/fused_hstu_layer.py) subclasses and the tests compare against.

Optionally (``relative_attention_bias``) each layer learns a relative attention bias, as Meta's
reference HSTU does: ``SiLU(alpha * <q_i, k_j> + rab(i, j))`` with a weight per relative position
and/or per bucket of the time gap (`RelativeAttentionBias`, hstu/modules/relative_bias.py). The
compiled kernel computes it in-kernel; the PyTorch reference densely (docs/design.md).

Imports go one way: attention_inputs <- relative_bias <- unfused_layer <- fused_hstu_layer <-
hstu_layer (the encoder and the public names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hstu.config.args import ATTENTION_TYPES
from hstu.modules.attention_inputs import AttentionInputs
from hstu.modules.relative_bias import RelativeAttentionBias
from hstu.modules.softmax_attention import softmax_attention
from hstu.ops.attention import describe_attention, hstu_attention

__all__ = ["HSTULayer"]


class HSTULayer(nn.Module):
    """One HSTU layer: pointwise-aggregated (SiLU, no softmax) jagged attention with gating.

    ``attention_type``: "hstu" (`hstu.ops.hstu_attention`: the compiled kernel on CUDA, the
    reference on CPU) or "softmax" (the SASRec-style baseline).
    ``reference_attention=True`` (tests and benchmarks only) runs the reference on CUDA too.

    ``relative_attention_bias`` ("none" | "position" | "time" | "position_time") adds this
    layer's `RelativeAttentionBias` (attribute ``relative_bias``) with ``max_relative_position``
    (P: the longest token sequence - 1), ``num_time_buckets`` and ``relative_bias_per_head``;
    a time term needs `AttentionInputs.timestamps`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        *,
        target_group_size: int = 1,
        window_size: int = 0,
        alpha: float | None = None,
        scaling_seqlen: int | None = None,
        eps: float = 1e-6,
        attention_type: str = "hstu",
        relative_attention_bias: str = "none",
        max_relative_position: int = 0,
        num_time_buckets: int = 128,
        relative_bias_per_head: bool = False,
        uvqk_init_std: float = 0.0,
        reference_attention: bool = False,
    ) -> None:
        super().__init__()
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"NetworkArgs.attention_type={attention_type!r} is not supported: "
                f"one of {list(ATTENTION_TYPES)}"
            )
        # "softmax" = SASRec-style baseline: same layer, softmax instead of SiLU attention
        self.attention_type = attention_type
        # tests and benchmarks only: the PyTorch reference attention on CUDA too (no config field
        # selects it; hstu.ops.attention)
        self.reference_attention = bool(reference_attention)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.target_group_size = target_group_size
        self.window_size = window_size
        self.alpha = alpha
        self.scaling_seqlen = scaling_seqlen
        inner = num_heads * head_dim
        self.input_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.uvqk = nn.Linear(hidden_size, 4 * inner)
        self.attn_norm = nn.LayerNorm(inner, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(inner, hidden_size)
        # 0: Xavier uniform; Meta's reference HSTU draws W_uvqk from N(0, 0.02)
        if uvqk_init_std > 0:
            nn.init.normal_(self.uvqk.weight, std=uvqk_init_std)
        else:
            nn.init.xavier_uniform_(self.uvqk.weight)
        nn.init.zeros_(self.uvqk.bias)
        # created here (after W_uvqk's init, before W_o's) so that seeded runs draw the same
        # initial weights as before the time term existed
        self.relative_attention_bias = relative_attention_bias
        self.relative_bias = (
            RelativeAttentionBias(
                relative_attention_bias,
                num_heads,
                max_relative_position,
                num_time_buckets=num_time_buckets,
                per_head=relative_bias_per_head,
            )
            if relative_attention_bias != "none"
            else None
        )
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def attention_choice(self, device: torch.device) -> str:
        """The attention this layer runs on ``device`` (`hstu.ops.attention.describe_attention`
        for "hstu"), for `HSTUEncoder.kernel_choices`."""
        if self.attention_type == "softmax":
            return "softmax (SASRec-style baseline, PyTorch)"
        return describe_attention(
            device,
            force_reference=self.reference_attention,
            relative_bias=self.relative_attention_bias,
        )

    def kernel_choices(self, device: torch.device) -> dict[str, str]:
        """`HSTUEncoder.kernel_choices` of a stack of unfused layers."""
        na = "n/a (unfused layer)"
        return {
            "layer": "unfused (HSTULayer, PyTorch autograd)",
            "attention": self.attention_choice(device),
            "gate_kernel": na,
            "elementwise_kernels": na,
            "layernorm_kernel": na,
            "stage_compile": na,
            "residual_gemm": na,
            "recompute": na,
        }

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        u, v, q, k = self.project(x)
        return self.finish(x, self.attend(q, k, v, attn), u)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(u, v, q, k), each [T, H * D]: SiLU(LayerNorm(x) @ W_uvqk + b) split in four."""
        uvqk = F.silu(self.uvqk(self.input_norm(x)))
        return torch.split(uvqk, self.num_heads * self.head_dim, dim=-1)

    def finish(self, x: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """x + W_o(dropout(LayerNorm(a) * u)): the layer output from its attention output."""
        return x + self.out_proj(self.dropout(self.attn_norm(a) * u))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn: AttentionInputs,
        scaling_seqlen: int | None = None,
    ) -> torch.Tensor:
        """The attention of [T, H * D] q, k, v over ``attn``'s layout -> [T, H * D].
        ``scaling_seqlen`` overrides the layer's own (`hstu.inference.kv_cache` scores candidate
        rows of a longer sequence than the one it is handed)."""
        t = q.shape[0]
        h, d = self.num_heads, self.head_dim
        scaling = self.scaling_seqlen if scaling_seqlen is None else scaling_seqlen
        if self.attention_type == "softmax":
            attention = softmax_attention
            offsets, contexts, targets = attn.seq_offsets, attn.num_contexts, attn.num_targets
            extra = {}
        else:  # hstu_attention picks kernel or reference (hstu.ops.attention.attention_path)
            attention = hstu_attention
            # CPU metadata on CUDA: the kernel validates it on the host, no device sync
            offsets, contexts, targets = attn.kernel_metadata(q.device)
            extra = {"force_reference": self.reference_attention}
            if scaling is None and attn.inv_max_seqlen is not None:
                extra["inv_scale_tensor"] = attn.inv_max_seqlen
        if self.relative_bias is not None:  # softmax: a dense bias; hstu: the op's weights
            dense = self.attention_type == "softmax"
            extra.update(self.relative_bias.attention_kwargs(attn, dense=dense))
        return attention(
            q.reshape(t, h, d).contiguous(),
            k.reshape(t, h, d).contiguous(),
            v.reshape(t, h, d).contiguous(),
            offsets,
            attn.max_seqlen,
            num_contexts=contexts,
            num_targets=targets,
            target_group_size=self.target_group_size,
            window_size=self.window_size,
            alpha=self.alpha,
            scaling_seqlen=scaling,
            **extra,
        ).reshape(t, h * d)
