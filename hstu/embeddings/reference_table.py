"""Pure-PyTorch dynamic hash table: the CPU development path and the oracle of the CUDA kernels.

Every function here has a twin of the same signature in `cuda_table.py` (compiled kernels). The
semantics, shared by both (see docs/kernels.md, "Dynamic embeddings"):

- Storage: `num_slots = num_buckets * 32` slots. Per slot: key (int64, EMPTY when free), score
  (int64), touched (int64: the training step that last used the slot) and one fp32 row of
  `values` [num_slots, dim + state_dim] = embedding followed by optimizer state. The slot index is
  the row index.
- A key lives only in bucket `bucket_of(key)`; find compares the key with the 32 slots of it.
- Insert (new keys of one bucket, in the caller's priority order): the candidate slots of the
  bucket are ordered (empty slots by lane) < (slots not touched in this step, by score, then key);
  slots touched in this step are protected. The r-th new key takes the r-th candidate, evicting
  the key there; new keys beyond the candidates overflow (slot -1: default output, no update).
- A new row's embedding comes from a counter-based hash of (key, seed, column): the same key gets
  the same vector on every rank and every run. Its optimizer state starts at zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "EMPTY_KEY",
    "TableState",
    "mix64",
    "bucket_of",
    "owner_of",
    "init_rows",
    "find",
    "insert",
    "insert_keys",
    "gather",
    "copy_rows",
    "place_rows",
    "update",
    "erase",
    "export",
    "size",
]

EMPTY_KEY = -(2**63)
BUCKET = 32
_BUCKET_SALT = 0x2545F4914F6CDD1D
_OWNER_SALT = 0x5851F42D4C957F2D - 2**63  # fits int64
_SEED_SALT = 0x9E3779B97F4A7C15 - 2**64
_M1 = 0xBF58476D1CE4E5B9 - 2**64
_M2 = 0x94D049BB133111EB - 2**64
_INT64_MAX = 2**63 - 1

# Optimizer codes shared with the kernels.
OPT_CODES = {"sgd": 0, "adam": 1, "adagrad": 2, "rowwise_adagrad": 3}


@dataclass
class TableState:
    """Tensors of one table (or one shard of it). `values` holds embedding + optimizer state."""

    keys: torch.Tensor  # [S] int64
    scores: torch.Tensor  # [S] int64
    touched: torch.Tensor  # [S] int64
    values: torch.Tensor  # [S, dim + state_dim] fp32

    @staticmethod
    def empty(num_slots: int, width: int, device: torch.device) -> TableState:
        return TableState(
            keys=torch.full((num_slots,), EMPTY_KEY, dtype=torch.int64, device=device),
            scores=torch.zeros(num_slots, dtype=torch.int64, device=device),
            touched=torch.zeros(num_slots, dtype=torch.int64, device=device),
            values=torch.zeros(num_slots, width, dtype=torch.float32, device=device),
        )

    @property
    def num_buckets(self) -> int:
        return self.keys.numel() // BUCKET


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 with wrap-around arithmetic (== the kernels' uint64 one)."""
    z = z ^ _srl(z, 30)
    z = z * _M1
    z = z ^ _srl(z, 27)
    z = z * _M2
    return z ^ _srl(z, 31)


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    return (mix64(keys ^ _BUCKET_SALT) & _INT64_MAX) % num_buckets


def owner_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rank owning a key in a row-wise sharded table (a hash independent of bucket_of)."""
    return (mix64(keys ^ _OWNER_SALT) & _INT64_MAX) % world_size


def _uniform01(keys: torch.Tensor, seed: int, counters: torch.Tensor) -> torch.Tensor:
    """[n, c] float64 in (0, 1) from 24 hash bits of (key, seed, counter)."""
    seed_mix = mix64(torch.tensor(seed, dtype=torch.int64) + _SEED_SALT)
    base = mix64(keys ^ seed_mix)
    bits = _srl(mix64(base[:, None] + counters[None, :]), 40)
    return (bits.to(torch.float64) + 0.5) * (2.0**-24)


def init_rows(
    keys: torch.Tensor, dim: int, seed: int, init: tuple[int, float, float, float, float]
) -> torch.Tensor:
    """Initial embeddings [n, dim] fp32 of keys. init = (kind, p0, p1, p2, p3):
    0 uniform(low=p0, high=p1); 1 normal(mean=p0, std=p1) by Box-Muller;
    2 truncated normal(mean=p0, std=p1, bounds [p2, p3] in std units) by inverse CDF;
    3 constant(p0). Computed in float64, rounded once to fp32 (the kernels do the same)."""
    kind, p0, p1, p2, p3 = init
    cols = torch.arange(dim, dtype=torch.int64, device=keys.device)
    if kind == 3:
        return torch.full((keys.numel(), dim), p0, dtype=torch.float32, device=keys.device)
    if kind == 0:
        u = _uniform01(keys, seed, cols)
        return (p0 + (p1 - p0) * u).to(torch.float32)
    if kind == 1:
        u1 = _uniform01(keys, seed, 2 * cols)
        u2 = _uniform01(keys, seed, 2 * cols + 1)
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return (p0 + p1 * z).to(torch.float32)
    u = _uniform01(keys, seed, cols)
    cdf_a = 0.5 * (1.0 + math.erf(p2 / math.sqrt(2.0)))
    cdf_b = 0.5 * (1.0 + math.erf(p3 / math.sqrt(2.0)))
    p = cdf_a + u * (cdf_b - cdf_a)
    z = (math.sqrt(2.0) * torch.special.erfinv(2.0 * p - 1.0)).clamp(p2, p3)
    return (p0 + p1 * z).to(torch.float32)


def find(
    state: TableState,
    query: torch.Tensor,
    touch: bool = False,
    step: int = 0,
    score_vals: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Slot of each (unique, when touch) query key, -1 if absent. With touch, found slots get
    touched = step and score = score_vals (or += score_vals when accumulate; step when None)."""
    if query.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=query.device)
    b = bucket_of(query, state.num_buckets)
    rows = state.keys.view(-1, BUCKET)[b]
    match = rows == query[:, None]
    found = match.any(dim=1)
    lane = match.to(torch.int8).argmax(dim=1)
    slots = torch.where(found, b * BUCKET + lane, torch.full_like(b, -1))
    if touch:
        s = slots[found]
        state.touched[s] = step
        vals = torch.full_like(s, step) if score_vals is None else score_vals[found].to(torch.int64)
        if accumulate:
            state.scores[s] += vals
        else:
            state.scores[s] = vals
    return slots


def insert_keys(
    state: TableState,
    keys: torch.Tensor,
    seg_offsets: torch.Tensor,
    seg_buckets: torch.Tensor,
    score_vals: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`insert` without the rows: places the keys (keys, scores, touched of their slots) and
    leaves ``state.values`` alone, so ``state`` may hold no values at all (the slot directory of
    a hybrid table, `hstu.embeddings.hybrid_table`). Pure torch ops: runs on any device."""
    dev = keys.device
    n = keys.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.zeros(
            (), dtype=torch.int64, device=dev
        )
    sb = seg_buckets
    kb = state.keys.view(-1, BUCKET)[sb]
    scb = state.scores.view(-1, BUCKET)[sb]
    tb = state.touched.view(-1, BUCKET)[sb]
    cls = torch.where(kb == EMPTY_KEY, 0, torch.where(tb == step, 2, 1))
    occ = cls == 1
    # Lexicographic order (cls, score, key, lane) by stable sorts from the least significant key.
    idx = torch.argsort(torch.where(occ, kb, 0), dim=1, stable=True)
    idx = idx.gather(1, torch.argsort(torch.where(occ, scb, 0).gather(1, idx), dim=1, stable=True))
    idx = idx.gather(1, torch.argsort(cls.gather(1, idx), dim=1, stable=True))
    n_eligible = (cls != 2).sum(dim=1)
    counts = seg_offsets[1:] - seg_offsets[:-1]
    seg = torch.repeat_interleave(torch.arange(sb.numel(), device=dev), counts, output_size=n)
    rank = torch.arange(n, device=dev) - seg_offsets[:-1][seg]
    placed = torch.nonzero(rank < n_eligible[seg]).flatten()  # one size read on a GPU
    seg_p = seg[placed]
    lane = idx[seg_p, rank[placed]]
    evicted = cls[seg_p, lane] == 1
    slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
    new_slots = sb[seg_p] * BUCKET + lane
    slots[placed] = new_slots
    state.keys[new_slots] = keys[placed]
    state.scores[new_slots] = score_vals[placed].to(torch.int64)
    state.touched[new_slots] = step
    return slots, evicted.sum()


def insert(
    state: TableState,
    keys: torch.Tensor,
    seg_offsets: torch.Tensor,
    seg_buckets: torch.Tensor,
    score_vals: torch.Tensor,
    step: int,
    dim: int,
    seed: int,
    init: tuple[int, float, float, float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Insert absent, unique keys grouped by bucket (segment s = keys[seg_offsets[s]:
    seg_offsets[s+1]] all in bucket seg_buckets[s], in priority order). Returns (slots, number of
    evicted keys as a 0-d tensor). New slots: score = score_vals, touched = step, embedding from
    init_rows, optimizer state zero."""
    slots, n_evicted = insert_keys(state, keys, seg_offsets, seg_buckets, score_vals, step)
    if state.values.shape[0] == 0:  # a table of keys only (a hybrid table's slot directory)
        return slots, n_evicted
    ok = slots >= 0
    new_slots = slots[ok]
    state.values[new_slots] = 0.0
    state.values[new_slots, :dim] = init_rows(keys[ok], dim, seed, init)
    return slots, n_evicted


def gather(state: TableState, dim: int, slots: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """out[i] = embedding of slots[inverse[i]], zeros where that slot is -1."""
    s = slots[inverse]
    out = state.values[s.clamp(min=0), :dim]
    return out * (s >= 0).unsqueeze(1).to(out.dtype)


def copy_rows(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] (whole rows) for every i whose two indices are inside
    their tensors; -1 marks the pairs a padded caller does not use. Destinations are distinct."""
    ok = (dst_idx >= 0) & (dst_idx < dst.shape[0]) & (src_idx >= 0) & (src_idx < src.shape[0])
    keep = torch.nonzero(ok).flatten()
    dst.index_copy_(0, dst_idx[keep], src.index_select(0, src_idx[keep]))


def place_rows(
    cache: torch.Tensor,
    row_keys: torch.Tensor,
    cache_slot: torch.Tensor,
    slot_row: torch.Tensor,
    free_rows: torch.Tensor,
    n_free: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    miss: torch.Tensor,
    uniq: torch.Tensor,
    dim: int,
    seed: int,
    init: tuple[int, float, float, float, float],
    counters: torch.Tensor,
) -> torch.Tensor:
    """A hybrid table's training lookup: the cache row of every unique id (-1 where ``slots`` is
    -1), bringing the missing rows into the cache ``cache`` [rows, width]:

    - an id with ``miss`` (its key took its slot in this lookup) gets its initial row (`init_rows`,
      zero optimizer state) in the row its slot already had (the former key's, now stale) or in a
      free one;
    - an id whose slot has a row (``slot_row``) keeps it (a hit);
    - any other id takes a free row, filled with the host tier's row of its slot (``host``
      [slots, width], on any device).

    Free rows are taken from the top of the stack ``free_rows[: n_free]``; the caller makes sure
    there are enough. ``row_keys`` / ``cache_slot`` (per cache row) and ``slot_row`` (per slot)
    have a spare last entry, where the entries that change nothing are written. ``counters``
    (int64 [4]) gets += (rows fetched, 0, hits, ids with a slot). The compiled twin hands the
    free rows out in another order; the rows' contents are the same."""
    spare = cache.shape[0]
    live = slots >= 0
    s = slots.clamp(min=0)
    cur = torch.where(live, slot_row[s].long(), -1)
    fresh = miss & live
    take = live & (cur < 0)
    rank = torch.cumsum(take, 0) - 1
    popped = free_rows[(n_free - 1 - rank).clamp(min=0)]
    n_free -= take.sum()
    row = torch.where(take, popped, cur)
    fetch = take & ~fresh
    at = torch.nonzero(fetch).flatten()
    got = host.index_select(0, s[at].to(host.device)).to(cache.device)
    cache.index_copy_(0, row[at], got)
    at = torch.nonzero(fresh).flatten()
    new = torch.zeros(at.numel(), cache.shape[1], dtype=torch.float32, device=cache.device)
    new[:, :dim] = init_rows(uniq[at], dim, seed, init)
    cache.index_copy_(0, row[at], new)
    fill = fresh | take
    where = torch.where(fill, row, spare)
    row_keys[where] = uniq
    cache_slot[where] = slots
    slot_row[torch.where(fill, s, slot_row.numel() - 1)] = row.to(slot_row.dtype)
    n_live, n_fetch, n_fill = torch.stack([live, fetch, fill]).sum(1).unbind()
    counters += torch.stack([n_fetch, torch.zeros_like(n_fetch), n_live - n_fill, n_live])
    return row


def update(
    state: TableState,
    dim: int,
    uniq: torch.Tensor,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    perm: torch.Tensor,
    offsets: torch.Tensor,
    grad: torch.Tensor,
    opt: tuple[int, float, float, float, float, float],
) -> None:
    """Sum grad rows per unique key, then apply the optimizer to the rows still holding their key
    (a row evicted since the forward is skipped). opt = (code, lr, beta1, beta2, eps, wd)."""
    del perm, offsets  # the kernel reduces by sorted segments; here index_add is enough
    code, lr, b1, b2, eps, wd = opt
    if uniq.numel() == 0:
        return
    g = torch.zeros(uniq.numel(), dim, dtype=torch.float32, device=grad.device)
    g.index_add_(0, inverse, grad.to(torch.float32))
    live = slots >= 0
    live &= state.keys[slots.clamp(min=0)] == uniq
    s, g = slots[live], g[live]
    row = state.values[s]
    w = row[:, :dim]
    if code == 0:  # sgd
        w = w - lr * (g + wd * w)
        row[:, :dim] = w
    elif code == 2:  # adagrad
        g = g + wd * w
        acc = row[:, dim : 2 * dim] + g * g
        row[:, dim : 2 * dim] = acc
        row[:, :dim] = w - lr * g / (acc.sqrt() + eps)
    elif code == 3:  # row-wise adagrad
        g = g + wd * w
        acc = row[:, dim] + (g * g).mean(dim=1)
        row[:, dim] = acc
        row[:, :dim] = w - lr * g / (acc.sqrt() + eps).unsqueeze(1)
    else:  # adam with decoupled weight decay and a per-row step
        m = b1 * row[:, dim : 2 * dim] + (1.0 - b1) * g
        v = b2 * row[:, 2 * dim : 3 * dim] + (1.0 - b2) * g * g
        t = row[:, 3 * dim] + 1.0
        bc1 = (1.0 - torch.pow(b1, t.double())).float().unsqueeze(1)
        bc2 = (1.0 - torch.pow(b2, t.double())).float().unsqueeze(1)
        upd = (m / bc1) / ((v / bc2).sqrt() + eps)
        row[:, :dim] = w - lr * (upd + wd * w)
        row[:, dim : 2 * dim] = m
        row[:, 2 * dim : 3 * dim] = v
        row[:, 3 * dim] = t
    state.values[s] = row


def erase(state: TableState, keys: torch.Tensor) -> torch.Tensor:
    """Remove keys (absent ones are ignored); returns how many were removed (0-d tensor)."""
    slots = find(state, keys)
    s = slots[slots >= 0]
    state.keys[s] = EMPTY_KEY
    state.scores[s] = 0
    state.touched[s] = 0
    return torch.tensor(s.numel(), dtype=torch.int64, device=keys.device)


def export(state: TableState) -> torch.Tensor:
    """Slots of all live entries, ordered by key."""
    s = torch.nonzero(state.keys != EMPTY_KEY).flatten()
    return s[torch.argsort(state.keys[s])]


def size(state: TableState) -> int:
    return int((state.keys != EMPTY_KEY).sum())
