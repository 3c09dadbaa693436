"""Causal softmax attention on jagged tokens: the SASRec-style baseline of the HSTU harness.

``NetworkArgs.attention_type = "softmax"`` swaps this in for HSTU's pointwise SiLU attention inside
the very same layer (projections, gating, norms), encoder, embeddings, loss and evaluation, so a
comparison between the two isolates the attention rule. For query i of one sequence:

    out_i = sum_j softmax_j(alpha * <q_i, k_j> | valid(i, j)) * v_j

where ``valid`` is exactly ``hstu.ops.reference.hstu_attention_mask`` (causal, contextual rows,
target groups, local window): the two attentions see the same keys. Pure PyTorch (padded dense
math through ``scaled_dot_product_attention``), so it runs on CPU and GPU alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hstu.config.args import ATTENTION_TYPES
from hstu.ops.reference import (
    check_attention_bias,
    check_attention_inputs,
    hstu_attention_mask,
    jagged_to_padded,
    padded_to_jagged,
)

__all__ = ["ATTENTION_TYPES", "softmax_attention"]


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    *,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: int = 0,
    alpha: float | None = None,
    scaling_seqlen: int | None = None,
    causal: bool = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged masked softmax attention. q, k: [T, H, Dqk], v: [T, H, Dv] -> [T, H, Dv].

    Same signature as ``hstu.ops.hstu_attention`` so a layer can call either. ``alpha`` (default
    1/sqrt(Dqk)) scales the logits; ``scaling_seqlen`` is accepted and ignored (softmax weights
    already sum to one). ``bias`` (optional, broadcastable to [B, H, N, N]) is added to the
    scaled logits of valid pairs, as in ``hstu.ops.reference.hstu_attention``. Computes in fp32
    and returns the input dtype.
    """
    check_attention_inputs(
        q,
        k,
        v,
        seq_offsets,
        max_seqlen,
        num_contexts,
        num_targets,
        target_group_size,
        window_size,
        causal,
    )
    del scaling_seqlen  # HSTU-only normalisation
    dqk = q.shape[2]
    scale = 1.0 / math.sqrt(dqk) if alpha is None else float(alpha)
    if q.shape[0] == 0 or max_seqlen == 0:
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    offs = seq_offsets.to(q.device).long()
    lengths = offs[1:] - offs[:-1]
    qp = jagged_to_padded(q.float(), offs, max_seqlen).transpose(1, 2)  # [B, H, N, D]
    kp = jagged_to_padded(k.float(), offs, max_seqlen).transpose(1, 2)
    vp = jagged_to_padded(v.float(), offs, max_seqlen).transpose(1, 2)
    mask = hstu_attention_mask(
        lengths,
        max_seqlen,
        num_contexts.to(q.device) if num_contexts is not None else None,
        num_targets.to(q.device) if num_targets is not None else None,
        target_group_size,
        window_size,
        causal,
    )
    # Padding rows have no valid key; letting them see themselves keeps the softmax finite
    # (no NaN in forward or backward). Their outputs are dropped by padded_to_jagged.
    pos = torch.arange(max_seqlen, device=q.device)
    pad_row = pos.view(1, -1) >= lengths.view(-1, 1)  # [B, N]
    mask = mask | (torch.diag_embed(pad_row))
    attn_mask = mask.unsqueeze(1)
    if bias is not None:
        check_attention_bias(bias, torch.Size((qp.shape[0], qp.shape[1], max_seqlen, max_seqlen)))
        # a float mask is added to the scaled logits; -inf removes the invalid pairs
        attn_mask = bias.float().masked_fill(~attn_mask, float("-inf"))
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=attn_mask, scale=scale)
    return padded_to_jagged(out.transpose(1, 2), offs).to(q.dtype)
