"""The HSTU layer (docs/design.md "Fused HSTU layer") and a stack of them, on jagged [T, D] tokens.

n = LayerNorm(x); u, v, q, k = split(SiLU(n @ W_uvqk + b)); a = attention(q, k, v)
y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o

Optionally (``relative_bias_len > 0``) each layer learns a relative position bias, as Meta's
reference HSTU does: ``SiLU(alpha * <q_i, k_j> + w[j - i])`` with one weight per relative offset
of key j to query i inside the sequence. The compiled kernel has no bias input, so biased
attention runs the PyTorch reference (padded [B, H, N, N]; fine for the paper's N ~ 200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hstu.modules.softmax_attention import ATTENTION_TYPES, softmax_attention
from hstu.ops import hstu_attention
from hstu.ops.reference import hstu_attention as reference_hstu_attention

__all__ = ["AttentionInputs", "HSTULayer", "HSTUEncoder", "RelativePositionBias"]


@dataclass
class AttentionInputs:
    """Jagged layout shared by every layer of one forward pass.

    ``host_*``: optional CPU int64 copies of the metadata (the preprocessor makes them from the
    batch's CPU twin). The compiled attention op validates CPU metadata on the host and copies it
    to the GPU asynchronously; given the device tensors instead it must read them back first, a
    host<->GPU sync. `kernel_metadata()` picks what to hand the op."""

    seq_offsets: torch.Tensor  # [B+1] int64
    max_seqlen: int
    num_contexts: torch.Tensor | None = None  # [B]
    num_targets: torch.Tensor | None = None  # [B]
    host_seq_offsets: torch.Tensor | None = None  # [B+1] CPU int64, same values as seq_offsets
    host_num_contexts: torch.Tensor | None = None  # [B] CPU int64 (None iff num_contexts is None)
    host_num_targets: torch.Tensor | None = None  # [B] CPU int64 (None iff num_targets is None)
    # trailing sequences that only hold padding rows (`SequencePreprocessor` pads the token count
    # so matmul shapes repeat across batches); not part of the batch: no FLOPs, no outputs read
    padding_sequences: int = 0

    def __post_init__(self) -> None:
        if self.padding_sequences < 0 or self.padding_sequences > self.seq_offsets.numel() - 1:
            raise ValueError(
                f"AttentionInputs: padding_sequences={self.padding_sequences} is not within the "
                f"{self.seq_offsets.numel() - 1} sequences"
            )
        pairs = (
            ("seq_offsets", self.seq_offsets, self.host_seq_offsets),
            ("num_contexts", self.num_contexts, self.host_num_contexts),
            ("num_targets", self.num_targets, self.host_num_targets),
        )
        if self.host_seq_offsets is None:
            if self.host_num_contexts is not None or self.host_num_targets is not None:
                raise ValueError(
                    "AttentionInputs: host_num_contexts/host_num_targets need host_seq_offsets"
                )
            return
        for name, dev, host in pairs:
            if (dev is None) != (host is None):
                raise ValueError(
                    f"AttentionInputs: {name} and host_{name} must both be given or both None"
                )
            if host is None:
                continue
            if host.device.type != "cpu" or host.dtype != torch.int64:
                raise TypeError(
                    f"AttentionInputs: host_{name} must be a CPU int64 tensor; got "
                    f"{host.dtype} on {host.device}"
                )
            if host.shape != dev.shape:
                raise ValueError(
                    f"AttentionInputs: host_{name} has shape {tuple(host.shape)} but {name} has "
                    f"{tuple(dev.shape)}"
                )

    def kernel_metadata(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(seq_offsets, num_contexts, num_targets) for the compiled op on ``device``: the CPU
        copies when the model runs on CUDA and they exist (no sync), else the device tensors."""
        if device.type == "cuda" and self.host_seq_offsets is not None:
            return self.host_seq_offsets, self.host_num_contexts, self.host_num_targets
        return self.seq_offsets, self.num_contexts, self.num_targets

    def real_lengths(self) -> torch.Tensor:
        """Token lengths of the batch's own sequences (padding sequences left out), from the CPU
        copy of the offsets when there is one."""
        offs = self.host_seq_offsets if self.host_seq_offsets is not None else self.seq_offsets
        lengths = offs[1:] - offs[:-1]
        return lengths[: lengths.numel() - self.padding_sequences]


class RelativePositionBias(nn.Module):
    """A learned attention bias per relative position: ``bias[i, j] = w[j - i + max_len - 1]``
    for query i and key j of one sequence (positions counted from the sequence start, so the
    bias is the same for every sequence of the batch). Meta HSTU's position bias, N(0, 0.02)."""

    def __init__(self, max_len: int, init_std: float = 0.02) -> None:
        super().__init__()
        if max_len < 1:
            raise ValueError(f"RelativePositionBias needs max_len >= 1; got {max_len}")
        self.max_len = max_len
        self.weight = nn.Parameter(torch.randn(2 * max_len - 1) * init_std)

    def forward(self, n: int) -> torch.Tensor:
        """The [n, n] bias over padded positions 0..n-1."""
        if n > self.max_len:
            raise ValueError(
                f"a sequence of {n} tokens exceeds the relative attention bias's {self.max_len} "
                "positions (contextual tokens + NetworkArgs.num_position_embeddings + candidates)"
            )
        pos = torch.arange(n, device=self.weight.device)
        return self.weight[pos.view(1, n) - pos.view(n, 1) + (self.max_len - 1)]


class HSTULayer(nn.Module):
    """One HSTU layer: pointwise-aggregated (SiLU, no softmax) jagged attention with gating."""

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
        relative_bias_len: int = 0,
        uvqk_init_std: float = 0.0,
    ) -> None:
        super().__init__()
        if attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"NetworkArgs.attention_type={attention_type!r} is not supported: "
                f"one of {list(ATTENTION_TYPES)}"
            )
        # "softmax" = SASRec-style baseline: same layer, softmax instead of SiLU attention
        self.attention_type = attention_type
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
        self.relative_bias = RelativePositionBias(relative_bias_len) if relative_bias_len else None
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        t = x.shape[0]
        h, d = self.num_heads, self.head_dim
        n = self.input_norm(x)
        uvqk = F.silu(self.uvqk(n))
        u, v, q, k = torch.split(uvqk, h * d, dim=-1)
        extra = {}
        if self.attention_type == "softmax":
            attention = softmax_attention
        elif self.relative_bias is not None:
            attention = reference_hstu_attention  # the compiled kernel takes no bias
        else:
            attention = hstu_attention
        if self.relative_bias is not None:
            extra["bias"] = self.relative_bias(attn.max_seqlen)
        offsets, contexts, targets = attn.seq_offsets, attn.num_contexts, attn.num_targets
        if attention is hstu_attention:  # takes CPU metadata on CUDA: no device sync
            offsets, contexts, targets = attn.kernel_metadata(x.device)
        a = attention(
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
            scaling_seqlen=self.scaling_seqlen,
            **extra,
        ).reshape(t, h * d)
        y = self.dropout(self.attn_norm(a) * u)
        return x + self.out_proj(y)


class HSTUEncoder(nn.Module):
    """N HSTU layers followed by a final LayerNorm.

    ``fused=True`` builds `FusedHSTULayer`s (one autograd Function per layer, hand-written
    backward; the recompute options apply only to them); ``False`` the unfused `HSTULayer`.
    Both have the same parameters, so their state dicts are interchangeable.
    ``final_layernorm=False`` drops the closing LayerNorm (Meta's reference HSTU has none: its
    outputs go straight to the L2 normalisation of retrieval).
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        *,
        fused: bool = False,
        recompute_input_layernorm: bool = False,
        recompute_uvqk_silu: bool = False,
        gate_kernel: str | None = None,
        final_layernorm: bool = True,
        relative_bias_len: int = 0,
        uvqk_init_std: float = 0.0,
        **layer_kwargs,
    ) -> None:
        super().__init__()
        if gate_kernel is not None and not fused:
            raise ValueError(
                f"HSTUEncoder(gate_kernel={gate_kernel!r}) applies only to the fused layer "
                "(NetworkArgs.fused_layer=True)"
            )
        if fused and relative_bias_len:
            raise ValueError(
                "the fused layer (NetworkArgs.fused_layer=True) has no attention bias: set "
                "NetworkArgs.fused_layer=False (the unfused layer runs biased attention through "
                "the PyTorch reference) or NetworkArgs.relative_attention_bias='none'"
            )
        layer_kwargs["uvqk_init_std"] = uvqk_init_std
        if relative_bias_len:
            layer_kwargs["relative_bias_len"] = relative_bias_len
        if fused:
            from hstu.modules.fused_hstu_layer import FusedHSTULayer  # imports this module

            layers = [
                FusedHSTULayer(
                    hidden_size,
                    recompute_input_layernorm=recompute_input_layernorm,
                    recompute_uvqk_silu=recompute_uvqk_silu,
                    gate_kernel=gate_kernel,
                    **layer_kwargs,
                )
                for _ in range(num_layers)
            ]
        else:
            layers = [HSTULayer(hidden_size, **layer_kwargs) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(hidden_size, eps=1e-6) if final_layernorm else None

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attn)
        return self.final_norm(x) if self.final_norm is not None else x
