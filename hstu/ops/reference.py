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

    out_i = (1 / scaling_seqlen) * sum_j valid(i, j) * SiLU(alpha * <q_i, k_j> + rab(i, j)) * v_j

With ``causal=False`` every pair of the same sequence is valid (no contexts, targets or window).

Relative attention bias (0 unless a weight is given), for query i and key j of one sequence of
length L (positions 0..L-1, contextual tokens included) and head h:

    rab(i, j) = w_pos[h', clamp(j - i, -P, P) + P] + w_time[h', bucket(qt(i) - ts(j))]
    qt(i) = ts(i + 1) for i < L - 1, qt(L - 1) = last_query_time[b] if given else ts(L - 1)

with h' = h for per-head weights ([H, ...]) and 0 for shared ones ([1, ...]), P = ``max_pos``,
w_pos [Hw, 2P + 1], w_time [Hw, NB + 1], ts the int64 token timestamps and
bucket(g) = the largest k in [0, NB] with edges[k] <= max(|g|, 1) (`time_bucket_edges`: Meta
HSTU's floor(log(max(|g|, 1)) / 0.301) clamped to [0, NB], on integers).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hstu.config.args import MAX_TIME_BUCKETS

__all__ = [
    "MAX_TIME_BUCKETS",
    "TIME_BUCKET_BASE",
    "cached_layout",
    "hstu_attention",
    "hstu_attention_cached",
    "hstu_attention_mask",
    "check_attention_inputs",
    "check_attention_bias",
    "check_relative_bias",
    "jagged_to_padded",
    "padded_to_jagged",
    "relative_attention_bias",
    "time_bucket_edges",
    "time_buckets",
]

# bucket(g) = floor(log(max(|g|, 1)) / TIME_BUCKET_BASE), clamped to [0, NB] (Meta HSTU's
# bucketization of time gaps); NB is at most MAX_TIME_BUCKETS (the compiled kernel's limit)
TIME_BUCKET_BASE = 0.301
_INT64_MAX = 2**63 - 1
_edges_cache: dict[tuple[int, str], torch.Tensor] = {}


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


def time_bucket_edges(num_buckets: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [NB + 1] lower edges of the time buckets: ``edges[0] = 1``,
    ``edges[k] = ceil(exp(0.301 * k))`` (float64, saturated at 2**63 - 1), so that
    ``bucket(g) = largest k with edges[k] <= max(|g|, 1)`` is Meta HSTU's
    ``floor(log(max(|g|, 1)) / 0.301)`` clamped to [0, NB], decided on integers. The compiled
    kernel receives this very tensor. Cached per (NB, device)."""
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int):
        raise TypeError(f"num_time_buckets must be an int; got {num_buckets!r}")
    if not 1 <= num_buckets <= MAX_TIME_BUCKETS:
        raise ValueError(
            f"num_time_buckets={num_buckets} is not supported: 1 to {MAX_TIME_BUCKETS} (the "
            "compiled attention kernel's limit; NetworkArgs.num_time_buckets)"
        )
    dev = torch.device("cpu" if device is None else device)
    key = (num_buckets, str(dev))
    edges = _edges_cache.get(key)
    if edges is None:
        values = [1] + [
            min(math.ceil(math.exp(TIME_BUCKET_BASE * k)), _INT64_MAX)
            for k in range(1, num_buckets + 1)
        ]
        edges = _edges_cache[key] = torch.tensor(values, dtype=torch.int64, device=dev)
    return edges


def time_buckets(gaps: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bucket index (int64, same shape as ``gaps``) of integer time gaps: the largest k with
    ``edges[k] <= max(|g|, 1)`` (``edges`` from `time_bucket_edges`; in [0, NB])."""
    if gaps.dtype != torch.int64 or edges.dtype != torch.int64:
        raise TypeError(f"time gaps and edges must be int64; got {gaps.dtype}, {edges.dtype}")
    mag = gaps.abs().clamp(min=1)  # |INT64_MIN| wraps to a negative value: bucket 0
    return torch.searchsorted(edges, mag.contiguous(), right=True) - 1


def _check_weight(name: str, w: torch.Tensor, num_heads: int, cols: str) -> None:
    if not torch.is_tensor(w) or not w.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor; got {getattr(w, 'dtype', type(w))}")
    if w.dim() != 2 or w.shape[0] not in (1, num_heads):
        raise ValueError(
            f"{name} must be [Hw, {cols}] with Hw = 1 (shared by the heads) or the number of "
            f"heads ({num_heads}); got shape {tuple(w.shape)}"
        )


def check_relative_bias(
    num_tokens: int,
    num_heads: int,
    timestamps: torch.Tensor | None,
    pos_weight: torch.Tensor | None,
    time_weight: torch.Tensor | None,
    max_pos: int,
    alpha: float | None,
    last_query_time: torch.Tensor | None = None,
    num_sequences: int | None = None,
) -> None:
    """Validate the relative attention bias arguments of `hstu_attention` (module docstring):
    ``pos_weight`` [Hw, 2 * max_pos + 1], ``time_weight`` [Hw, NB + 1] with 1 <= NB <= 256,
    ``timestamps`` int64 [T], given iff ``time_weight`` is, ``last_query_time`` int64 [B] (only
    with ``time_weight``), ``alpha`` != 0."""
    if last_query_time is not None:
        if time_weight is None:
            raise ValueError("last_query_time is given without time_weight (nothing uses it)")
        if not torch.is_tensor(last_query_time) or last_query_time.dtype != torch.int64:
            raise TypeError(
                "last_query_time must be an int64 tensor; got "
                f"{getattr(last_query_time, 'dtype', None)}"
            )
        if last_query_time.dim() != 1 or (
            num_sequences is not None and last_query_time.shape[0] != num_sequences
        ):
            raise ValueError(
                f"last_query_time must be [B] = [{num_sequences}] (one per sequence); got "
                f"{tuple(last_query_time.shape)}"
            )
    if pos_weight is None and time_weight is None:
        if timestamps is not None:
            raise ValueError("timestamps are given without time_weight (nothing uses them)")
        return
    if alpha is not None and float(alpha) == 0.0:
        raise ValueError(
            "alpha=0 with a relative attention bias is not supported (the compiled kernel "
            "folds alpha into the scores); use alpha=None (1/sqrt(Dqk)) or a non-zero value"
        )
    if pos_weight is not None:
        if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 0:
            raise ValueError(f"max_pos must be an int >= 0; got {max_pos!r}")
        _check_weight("pos_weight", pos_weight, num_heads, f"2 * max_pos + 1 = {2 * max_pos + 1}")
        if pos_weight.shape[1] != 2 * max_pos + 1:
            raise ValueError(
                f"pos_weight has {pos_weight.shape[1]} columns but max_pos={max_pos} needs "
                f"2 * max_pos + 1 = {2 * max_pos + 1}"
            )
    if time_weight is not None:
        _check_weight("time_weight", time_weight, num_heads, "num_time_buckets + 1")
        nb = time_weight.shape[1] - 1
        if not 1 <= nb <= MAX_TIME_BUCKETS:
            raise ValueError(
                f"time_weight has {nb + 1} columns: num_time_buckets + 1 with num_time_buckets "
                f"in [1, {MAX_TIME_BUCKETS}]"
            )
        if timestamps is None:
            raise ValueError("time_weight needs timestamps (int64 [T], one per token)")
    if timestamps is not None:
        if time_weight is None:
            raise ValueError("timestamps are given without time_weight (nothing uses them)")
        if not torch.is_tensor(timestamps) or timestamps.dtype != torch.int64:
            raise TypeError(
                f"timestamps must be an int64 tensor; got {getattr(timestamps, 'dtype', None)}"
            )
        if timestamps.dim() != 1 or timestamps.shape[0] != num_tokens:
            raise ValueError(
                f"timestamps must be [T] = [{num_tokens}] (one per token); got "
                f"{tuple(timestamps.shape)}"
            )


def relative_attention_bias(
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    timestamps: torch.Tensor | None,
    pos_weight: torch.Tensor | None,
    time_weight: torch.Tensor | None,
    max_pos: int,
    num_heads: int,
    last_query_time: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense relative attention bias [B, Hw, N, N] (N = max_seqlen; module docstring), on the
    weights' device and in their dtype; gradients flow into both weights. Entries at padded
    positions are finite and meaningless (the mask removes them). ``last_query_time`` [B]: the
    time each sequence's last token queries at (default: its own timestamp)."""
    weight = pos_weight if pos_weight is not None else time_weight
    if weight is None:
        raise ValueError("relative_attention_bias needs pos_weight, time_weight or both")
    check_relative_bias(
        0 if timestamps is None else timestamps.shape[0],
        num_heads,
        timestamps,
        pos_weight,
        time_weight,
        max_pos,
        None,
        last_query_time,
        seq_offsets.numel() - 1,
    )
    device = weight.device
    offs = seq_offsets.to(device).long()
    b, n = offs.numel() - 1, int(max_seqlen)
    pos = torch.arange(n, device=device)
    out = None
    if pos_weight is not None:
        rel = (pos.view(1, n) - pos.view(n, 1)).clamp(-max_pos, max_pos) + max_pos  # [i, j]: j - i
        # F.embedding, not pos_weight[:, rel]: its CPU backward is deterministic (index_put's
        # accumulation is not), so CPU runs with a bias repeat bit for bit
        out = F.embedding(rel, pos_weight.t()).permute(2, 0, 1).unsqueeze(0).expand(b, -1, -1, -1)
    if time_weight is not None:
        edges = time_bucket_edges(time_weight.shape[1] - 1, device)
        lengths = offs[1:] - offs[:-1]
        ts = jagged_to_padded(timestamps.to(device), offs, n)  # [B, N], 0 past the end
        # query i takes the next token's timestamp, the last token its own or last_query_time
        nxt = torch.minimum(pos.view(1, n) + 1, (lengths - 1).clamp(min=0).view(b, 1))
        query = ts.gather(1, nxt)  # [B, N]
        if last_query_time is not None:
            last = pos.view(1, n) == (lengths - 1).view(b, 1)
            query = torch.where(last, last_query_time.to(device).view(b, 1), query)
        gaps = query.view(b, n, 1) - ts.view(b, 1, n)
        time = F.embedding(time_buckets(gaps, edges), time_weight.t()).permute(0, 3, 1, 2)
        out = time if out is None else out + time
    return out


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
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    max_pos: int = 0,
    last_query_time: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention (see module docstring). q, k: [T, H, Dqk], v: [T, H, Dv] -> [T, H, Dv].

    Computes in fp32 (fp64 for fp64 inputs) and returns the input dtype. alpha defaults to
    1/sqrt(Dqk); scaling_seqlen defaults to max_seqlen.

    ``pos_weight`` [Hw, 2 * max_pos + 1], ``time_weight`` [Hw, NB + 1] and ``timestamps`` (int64
    [T]) give the relative attention bias rab(i, j) of the module docstring (what the compiled
    kernel computes in-kernel); it is built densely here ([B, Hw, N, N]) and both weights receive
    gradients. ``bias`` (reference only) is any additive attention bias over padded positions,
    broadcastable to [B, H, N, N] with N = max_seqlen (e.g. [N, N] or [B, 1, N, N]); it enters as
    ``SiLU(alpha * <q_i, k_j> + bias[i, j])`` and receives gradients.
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
    check_relative_bias(
        q.shape[0],
        q.shape[1],
        timestamps,
        pos_weight,
        time_weight,
        max_pos,
        alpha,
        last_query_time,
        seq_offsets.numel() - 1,
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
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qp = jagged_to_padded(q.to(cdtype), offs, max_seqlen).transpose(1, 2)  # [B, H, N, D]
    kp = jagged_to_padded(k.to(cdtype), offs, max_seqlen).transpose(1, 2)
    vp = jagged_to_padded(v.to(cdtype), offs, max_seqlen).transpose(1, 2)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * alpha  # [B, H, N, N]
    if bias is not None:
        check_attention_bias(bias, scores.shape)
        scores = scores + bias.to(cdtype)
    if pos_weight is not None or time_weight is not None:
        rab = relative_attention_bias(
            offs,
            max_seqlen,
            timestamps,
            pos_weight,
            time_weight,
            max_pos,
            q.shape[1],
            last_query_time,
        )
        scores = scores + rab.to(cdtype)
    mask = hstu_attention_mask(
        lengths, max_seqlen, num_contexts, num_targets, target_group_size, window_size, causal
    )
    attn = F.silu(scores) * mask.unsqueeze(1).to(scores.dtype) / scaling
    out = torch.matmul(attn, vp).transpose(1, 2)  # [B, N, H, Dv]
    return padded_to_jagged(out, offs).to(q.dtype)


def cached_layout(
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, kv_lengths: torch.Tensor | None, num_q: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the metadata of `hstu_attention_cached` (CPU or device int tensors) and returns
    (kv lengths L [B] int64, query lengths Lq [B] int64, kv offsets [B + 1] int64) on the CPU."""
    for name, t in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be a 1-D int32/int64 tensor; got {t.dtype} {tuple(t.shape)}"
            )
    if q_offsets.numel() != kv_offsets.numel() or kv_offsets.numel() < 1:
        raise ValueError(
            f"q_offsets [{q_offsets.numel()}] and kv_offsets [{kv_offsets.numel()}] must both be "
            "[B + 1]"
        )
    qo = q_offsets.detach().cpu().long()
    ko = kv_offsets.detach().cpu().long()
    for name, o in (("q_offsets", qo), ("kv_offsets", ko)):
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()):
            raise ValueError(f"{name} must start at 0 and be non-decreasing; got {o.tolist()}")
    if int(qo[-1]) != num_q:
        raise ValueError(f"q_offsets[-1]={int(qo[-1])} != the {num_q} rows of q")
    slots = ko[1:] - ko[:-1]
    lengths = slots if kv_lengths is None else kv_lengths.detach().cpu().long()
    if lengths.shape != slots.shape or bool(((lengths < 0) | (lengths > slots)).any()):
        raise ValueError(
            f"kv_lengths must be [B] with 0 <= kv_lengths[b] <= kv_offsets[b + 1] - kv_offsets[b]; "
            f"got {lengths.tolist()} for slots {slots.tolist()}"
        )
    q_lengths = qo[1:] - qo[:-1]
    bad = (q_lengths > lengths).nonzero().flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"sequence {b} has {int(q_lengths[b])} queries but only {int(lengths[b])} keys (the "
            "queries are its last positions)"
        )
    return lengths, q_lengths, ko


def hstu_attention_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    kv_lengths: torch.Tensor | None = None,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: int = 0,
    alpha: float | None = None,
    scaling_seqlen: int | None = None,
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    max_pos: int = 0,
    last_query_time: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of each sequence's last queries against its whole keys/values (inference
    with a KV cache, forward only): the query rows of `hstu_attention` on the whole sequence.

    q [Tq, H, D] is jagged by ``q_offsets`` [B + 1]: sequence b's Lq_b queries are its positions
    L_b - Lq_b .. L_b - 1. k, v [Tk, H, D] hold sequence b's L_b rows from ``kv_offsets[b]``, with
    L_b = ``kv_lengths[b]`` when given (the rest of the slot is ignored) or the slot's size.
    ``num_contexts`` / ``num_targets`` / ``timestamps`` (k's layout) and the bias weights are those
    of the whole sequence; ``scaling_seqlen`` defaults to the longest L_b. Only the query rows
    are computed (padded [B, H, max Lq, max L] scores; the mask and the bias are the whole
    sequence's rows at the query positions); the compiled twin is
    `torch.ops.hstu_attention.fwd_cached`."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be jagged [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or k.shape[1] != q.shape[1] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q [Tq, H, D], k [Tk, H, D] and v [Tk, H, Dv] do not match: q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    lengths, q_lengths, ko = cached_layout(q_offsets, kv_offsets, kv_lengths, q.shape[0])
    if q.shape[0] == 0:
        return q.new_zeros((0, q.shape[1], v.shape[2]))
    dev = q.device
    b, h = lengths.numel(), q.shape[1]
    n, nq = int(lengths.max()), int(q_lengths.max())
    alpha = 1.0 / math.sqrt(q.shape[2]) if alpha is None else float(alpha)
    scaling = float(n if scaling_seqlen is None else scaling_seqlen)
    if scaling <= 0:
        raise ValueError(f"scaling_seqlen must be > 0; got {scaling}")
    check_relative_bias(
        k.shape[0], h, timestamps, pos_weight, time_weight, max_pos, alpha, last_query_time, b
    )
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # the sequences' rows of k's layout (compacted), and the queries padded to [B, Nq]
    rows = torch.cat([torch.arange(int(ko[i]), int(ko[i]) + int(lengths[i])) for i in range(b)])
    offsets = torch.zeros(b + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    q_offs = torch.zeros(b + 1, dtype=torch.int64)
    q_offs[1:] = torch.cumsum(q_lengths, 0)
    rows, offsets, q_offs = rows.to(dev), offsets.to(dev), q_offs.to(dev)
    kp = jagged_to_padded(k.index_select(0, rows).to(cdtype), offsets, n).transpose(1, 2)
    vp = jagged_to_padded(v.index_select(0, rows).to(cdtype), offsets, n).transpose(1, 2)
    qp = jagged_to_padded(q.to(cdtype), q_offs, nq).transpose(1, 2)  # [B, H, Nq, D]
    scores = torch.matmul(qp, kp.transpose(-1, -2)) * alpha  # [B, H, Nq, N]
    # position of query row r of sequence b: L_b - Lq_b + r (rows past Lq_b are padding)
    r = torch.arange(nq, device=dev).view(1, nq)
    shift = (lengths - q_lengths).to(dev).view(b, 1)
    is_query = r < q_lengths.to(dev).view(b, 1)
    pos = torch.where(is_query, shift + r, torch.zeros_like(r))  # [B, Nq]
    gather = pos.view(b, 1, nq, 1)
    if pos_weight is not None or time_weight is not None:
        rab = relative_attention_bias(
            offsets, n, None if timestamps is None else timestamps.index_select(0, rows),
            pos_weight, time_weight, max_pos, h, last_query_time,
        )  # fmt: skip
        rab = rab.gather(2, gather.expand(b, rab.shape[1], nq, n))
        scores = scores + rab.to(cdtype)
    mask = hstu_attention_mask(
        lengths.to(dev), n,
        None if num_contexts is None else num_contexts.to(dev),
        None if num_targets is None else num_targets.to(dev),
        target_group_size, window_size,
    )  # fmt: skip
    mask = mask.gather(1, pos.view(b, nq, 1).expand(b, nq, n)) & is_query.view(b, nq, 1)
    attn = F.silu(scores) * mask.unsqueeze(1).to(scores.dtype) / scaling
    out = torch.matmul(attn, vp).transpose(1, 2)  # [B, Nq, H, Dv]
    return padded_to_jagged(out, q_offs).to(q.dtype)
