"""Pure-PyTorch reference twins of the compiled ops.

These are the test oracles for the CUDA kernels and the CPU development-mode implementation.
They are deliberately simple (padded dense math) and follow docs/design.md exactly.

HSTU attention, for query i and key j of one sequence of length L with c leading contextual
tokens and t trailing targets (H = L - t history tokens, ids id(p) = max(p - c + 1, 0) if c > 0
else p, target group g(p) = (p - H) // target_group_size):

    valid(i, j) = (i == j or id(i) > id(j))                         # causal
                  and (not (i >= H and j >= H) or g(i) == g(j))     # targets: same group only
                  and (window == 0 or id(i) - id(j) <= window)      # local window
               or (c > 0 and id(i) == 0 and j < H)                  # contextual rows see history

    out_i = (1 / scaling_seqlen) * sum_j valid(i, j) * SiLU(alpha * <q_i, k_j>) * v_j

With ``causal=False`` every pair of the same sequence is valid (no contexts, targets or window).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "hstu_attention",
    "hstu_attention_mask",
    "check_attention_inputs",
    "check_attention_bias",
    "jagged_to_padded",
    "padded_to_jagged",
]


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    num_contexts: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    target_group_size: int,
    window_size: int,
    causal: bool,
) -> None:
    """Validate jagged attention inputs; raises ValueError/TypeError naming the problem."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be jagged [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v must share [T, H]; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(
            f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if seq_offsets.dim() != 1 or seq_offsets.numel() < 1:
        raise ValueError(f"seq_offsets must be 1-D [B+1]; got shape {tuple(seq_offsets.shape)}")
    if seq_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seq_offsets must be int32 or int64; got {seq_offsets.dtype}")
    offs = seq_offsets.detach().cpu().long()
    if int(offs[0]) != 0:
        raise ValueError(f"seq_offsets[0] must be 0; got {int(offs[0])}")
    lengths = offs[1:] - offs[:-1]
    if (lengths < 0).any():
        raise ValueError("seq_offsets must be non-decreasing")
    if int(offs[-1]) != q.shape[0]:
        raise ValueError(f"seq_offsets[-1]={int(offs[-1])} != number of tokens T={q.shape[0]}")
    if lengths.numel() and int(lengths.max()) > max_seqlen:
        raise ValueError(f"a sequence has length {int(lengths.max())} > max_seqlen={max_seqlen}")
    if target_group_size < 1:
        raise ValueError(f"target_group_size must be >= 1; got {target_group_size}")
    if window_size < 0:
        raise ValueError(f"window_size must be >= 0 (0 = no window); got {window_size}")
    b = lengths.numel()
    c = t = None
    for name, x in (("num_contexts", num_contexts), ("num_targets", num_targets)):
        if x is None:
            continue
        if x.shape != (b,):
            raise ValueError(f"{name} must have shape [B]=[{b}]; got {tuple(x.shape)}")
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64; got {x.dtype}")
        xc = x.detach().cpu().long()
        if (xc < 0).any():
            raise ValueError(f"{name} must be >= 0")
        if (xc > lengths).any():
            raise ValueError(f"{name} exceeds a sequence length")
        if name == "num_contexts":
            c = xc
        else:
            t = xc
    if c is not None and t is not None and ((c + t) > lengths).any():
        raise ValueError("num_contexts + num_targets exceeds a sequence length")
    if not causal and (num_contexts is not None or num_targets is not None or window_size > 0):
        raise ValueError("causal=False does not combine with contexts, targets or a window")


def hstu_attention_mask(
    lengths: torch.Tensor,
    max_seqlen: int,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: int = 0,
    causal: bool = True,
) -> torch.Tensor:
    """Dense validity mask [B, N, N] (N = max_seqlen) of the docs/design.md rules; False off-sequence."""
    device = lengths.device
    lengths = lengths.long()
    b = lengths.numel()
    n = max_seqlen
    pos = torch.arange(n, device=device)
    in_seq = pos.view(1, n) < lengths.view(b, 1)  # [B, N]
    pair_in = in_seq.view(b, n, 1) & in_seq.view(b, 1, n)
    if not causal:
        return pair_in
    c = (num_contexts.long() if num_contexts is not None else torch.zeros_like(lengths)).view(b, 1)
    t = (num_targets.long() if num_targets is not None else torch.zeros_like(lengths)).view(b, 1)
    h = lengths.view(b, 1) - t  # history length H (contexts included)
    p = pos.view(1, n).expand(b, n)
    ids = torch.where(c > 0, torch.clamp(p - c + 1, min=0), p)  # [B, N]
    idi, idj = ids.view(b, n, 1), ids.view(b, 1, n)
    pi, pj = p.view(b, n, 1), p.view(b, 1, n)
    eye = pi == pj
    valid = eye | (idi > idj)
    hh = h.view(b, 1, 1)
    both_targets = (pi >= hh) & (pj >= hh)
    gi = torch.div(pi - hh, target_group_size, rounding_mode="floor")
    gj = torch.div(pj - hh, target_group_size, rounding_mode="floor")
    valid = valid & (~both_targets | (gi == gj))
    if window_size > 0:
        valid = valid & ((idi - idj) <= window_size)
    context_row = (c.view(b, 1, 1) > 0) & (idi == 0) & (pj < hh)
    valid = valid | context_row
    return valid & pair_in


def jagged_to_padded(x: torch.Tensor, seq_offsets: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """[T, ...] jagged -> [B, N, ...] zero padded."""
    offs = seq_offsets.long()
    b = offs.numel() - 1
    lengths = offs[1:] - offs[:-1]
    out = x.new_zeros((b, max_seqlen) + tuple(x.shape[1:]))
    if x.shape[0] == 0:
        return out
    batch_idx = torch.repeat_interleave(torch.arange(b, device=x.device), lengths)
    pos = torch.arange(x.shape[0], device=x.device) - offs[:-1][batch_idx]
    out[batch_idx, pos] = x
    return out


def padded_to_jagged(x: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    """[B, N, ...] padded -> [T, ...] jagged (inverse of jagged_to_padded)."""
    offs = seq_offsets.long()
    b = offs.numel() - 1
    lengths = offs[1:] - offs[:-1]
    total = int(offs[-1]) if b > 0 else 0
    batch_idx = torch.repeat_interleave(torch.arange(b, device=x.device), lengths)
    pos = torch.arange(total, device=x.device) - offs[:-1][batch_idx]
    return x[batch_idx, pos]


def check_attention_bias(bias: torch.Tensor, shape: torch.Size) -> None:
    """``bias`` must be a floating tensor broadcastable to the padded scores ``shape``."""
    if not torch.is_tensor(bias) or not bias.is_floating_point():
        raise TypeError(f"bias must be a floating tensor; got {type(bias).__name__}")
    try:
        torch.broadcast_shapes(bias.shape, shape)
    except RuntimeError:
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to the padded attention "
            f"scores [B, H, N, N] = {tuple(shape)} (N = max_seqlen)"
        ) from None
    if bias.dim() > 4 or torch.broadcast_shapes(bias.shape, shape) != shape:
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} would enlarge the attention scores "
            f"{tuple(shape)}; give at most [B, H, N, N] with N = max_seqlen"
        )


def hstu_attention(
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
    """Jagged HSTU attention (see module docstring). q, k: [T, H, Dqk], v: [T, H, Dv] -> [T, H, Dv].

    Computes in fp32 and returns the input dtype. alpha defaults to 1/sqrt(Dqk); scaling_seqlen
    defaults to max_seqlen. ``bias`` (optional; the compiled kernel has none) is an additive
    attention bias over padded positions, broadcastable to [B, H, N, N] with N = max_seqlen
    (e.g. [N, N] or [B, 1, N, N]); it enters as ``SiLU(alpha * <q_i, k_j> + bias[i, j])`` (the
    relative position bias of Meta's HSTU) and receives gradients.
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
    dqk = q.shape[2]
    alpha = 1.0 / math.sqrt(dqk) if alpha is None else float(alpha)
    scaling = float(max_seqlen if scaling_seqlen is None else scaling_seqlen)
    if scaling <= 0:
        raise ValueError(f"scaling_seqlen must be > 0; got {scaling}")
    offs = seq_offsets.long()
    lengths = offs[1:] - offs[:-1]
    if q.shape[0] == 0 or max_seqlen == 0:
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    qp = jagged_to_padded(q.float(), offs, max_seqlen).transpose(1, 2)  # [B, H, N, D]
    kp = jagged_to_padded(k.float(), offs, max_seqlen).transpose(1, 2)
    vp = jagged_to_padded(v.float(), offs, max_seqlen).transpose(1, 2)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * alpha  # [B, H, N, N]
    if bias is not None:
        check_attention_bias(bias, scores.shape)
        scores = scores + bias.float()
    mask = hstu_attention_mask(
        lengths, max_seqlen, num_contexts, num_targets, target_group_size, window_size, causal
    )
    attn = F.silu(scores) * mask.unsqueeze(1).to(scores.dtype) / scaling
    out = torch.matmul(attn, vp).transpose(1, 2)  # [B, N, H, Dv]
    return padded_to_jagged(out, offs).to(q.dtype)
