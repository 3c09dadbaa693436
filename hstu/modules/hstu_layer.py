"""The HSTU layer (DESIGN.md "Fused HSTU layer") and a stack of them, on jagged [T, D] tokens.

n = LayerNorm(x); u, v, q, k = split(SiLU(n @ W_uvqk + b)); a = attention(q, k, v)
y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hstu.modules.softmax_attention import ATTENTION_TYPES, softmax_attention
from hstu.ops import hstu_attention

__all__ = ["AttentionInputs", "HSTULayer", "HSTUEncoder"]


@dataclass
class AttentionInputs:
    """Jagged layout shared by every layer of one forward pass."""

    seq_offsets: torch.Tensor  # [B+1] int64
    max_seqlen: int
    num_contexts: torch.Tensor | None = None  # [B]
    num_targets: torch.Tensor | None = None  # [B]


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
        nn.init.xavier_uniform_(self.uvqk.weight)
        nn.init.zeros_(self.uvqk.bias)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        t = x.shape[0]
        h, d = self.num_heads, self.head_dim
        n = self.input_norm(x)
        uvqk = F.silu(self.uvqk(n))
        u, v, q, k = torch.split(uvqk, h * d, dim=-1)
        attention = softmax_attention if self.attention_type == "softmax" else hstu_attention
        a = attention(
            q.reshape(t, h, d).contiguous(),
            k.reshape(t, h, d).contiguous(),
            v.reshape(t, h, d).contiguous(),
            attn.seq_offsets,
            attn.max_seqlen,
            num_contexts=attn.num_contexts,
            num_targets=attn.num_targets,
            target_group_size=self.target_group_size,
            window_size=self.window_size,
            alpha=self.alpha,
            scaling_seqlen=self.scaling_seqlen,
        ).reshape(t, h * d)
        y = self.dropout(self.attn_norm(a) * u)
        return x + self.out_proj(y)


class HSTUEncoder(nn.Module):
    """N HSTU layers followed by a final LayerNorm.

    ``fused=True`` builds `FusedHSTULayer`s (one autograd Function per layer, hand-written
    backward; the recompute options apply only to them); ``False`` the unfused `HSTULayer`.
    Both have the same parameters, so their state dicts are interchangeable.
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        *,
        fused: bool = False,
        recompute_input_layernorm: bool = False,
        recompute_uvqk_silu: bool = False,
        **layer_kwargs,
    ) -> None:
        super().__init__()
        if fused:
            from hstu.modules.fused_hstu_layer import FusedHSTULayer  # imports this module

            layers = [
                FusedHSTULayer(
                    hidden_size,
                    recompute_input_layernorm=recompute_input_layernorm,
                    recompute_uvqk_silu=recompute_uvqk_silu,
                    **layer_kwargs,
                )
                for _ in range(num_layers)
            ]
        else:
            layers = [HSTULayer(hidden_size, **layer_kwargs) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(hidden_size, eps=1e-6)

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attn)
        return self.final_norm(x)
