"""Ranking with a cache of the history: encode a user's history once, score candidate sets.

In HSTU a history token never attends to a candidate (the target mask, docs/design.md), so the
history's tokens, and each layer's keys and values of them, do not depend on the candidates.
`encode_history` runs the histories through the model once and keeps, per layer, their keys and
values (`HistoryCache`). `score_candidates` then runs only the candidate tokens through the
layers: their input tokens (item embedding and position), their projections, the attention of
their queries over the cached history keys plus the candidates' own keys
(`hstu.ops.attention.hstu_attention_cached`: the compiled forward kernel on CUDA, which computes
the candidate rows only; its PyTorch twin on the CPU), the gating and residual, the final norm
and the head. `full_scores` is the plain recomputation (the model's forward on history +
candidates) that the cached path equals.

Cache layout: per user a slot of ``history tokens + capacity`` rows in each layer's key and value
buffers ([rows, H, D]); the candidates of a call write their keys and values (and times) into
the slot's tail, so the attention reads one buffer, and nothing of the history is copied per
call. A call with more candidates than the capacity re-lays the cache out once.

What has to hold for the cached and full scores to be equal:

- **Scaling.** With the model's default `NetworkArgs.scaling_seqlen` (0: the batch's longest
  sequence), every token's attention is divided by a length that counts the candidates; the
  cache records it (``num_candidates`` per user at encoding), and candidate sets of that size
  are scored exactly. A model with a fixed `scaling_seqlen` scores sets of any size.
- **Time bias.** The last history token queries the relative time bias at the first
  candidate's time; the cache is encoded at ``query_time`` (default the last history time) and
  a candidate set's first time must equal it (its default).
"""

from __future__ import annotations

import contextlib
import copy as copy_module
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.embeddings.stack import ItemLookup
from hstu.models.ranking import RankingGR
from hstu.modules.preprocessor import host_lengths, segment_ranges
from hstu.ops.attention import hstu_attention_cached
from hstu.ops.reference import cached_layout

__all__ = [
    "CachedLayout",
    "batch_from_parts",
    "feature_parts",
    "GraphedScorer",
    "HistoryCache",
    "encode_history",
    "full_scores",
    "score_candidates",
    "split_candidates",
    "with_candidates",
]


@dataclass
class CachedLayout:
    """The per-token inputs of the relative bias for the cached attention (k/v slot layout):
    what `RelativeAttentionBias.attention_kwargs` reads of an `AttentionInputs`."""

    timestamps: torch.Tensor | None
    last_query_time: torch.Tensor | None = None


@dataclass
class HistoryCache:
    """Per layer, the history tokens' keys and values, in per-user slots (module docstring)."""

    keys: list[torch.Tensor]  # per layer [rows, H, D]
    values: list[torch.Tensor]
    slot_offsets: torch.Tensor  # [B + 1] CPU int64: user b's slot starts at slot_offsets[b]
    history_tokens: torch.Tensor  # [B] CPU int64: contextual + history tokens of each user
    num_contextual: int  # contextual tokens leading every sequence
    capacity: int  # candidate rows per slot
    timestamps: torch.Tensor | None  # [rows] int64 on the device (time bias only)
    history: Batch  # the encoded histories (CPU)
    num_candidates: int  # candidates per user that the attention scaling assumes
    scaling_seqlen: int  # the scaling the history was encoded with
    query_time: torch.Tensor | None  # [B] CPU: the time the last history token queried at

    @property
    def batch_size(self) -> int:
        return int(self.history_tokens.numel())

    @property
    def history_items(self) -> torch.Tensor:
        """[B] history items of each user (the candidates' position id)."""
        return self.history_tokens - self.num_contextual

    def nbytes(self) -> int:
        """Bytes of the cached keys, values and times."""
        n = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        return n + (0 if self.timestamps is None else self.timestamps.numel() * 8)


def feature_parts(batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """feature -> (values, lengths) of ``batch``'s features."""
    feats = batch.features
    return {k: (feats[k].values(), feats[k].lengths()) for k in feats.keys()}


def batch_from_parts(parts, like: Batch, counts: torch.Tensor, timestamps) -> Batch:
    """A `Batch` of the features ``parts`` (`feature_parts` form), with ``like``'s users and
    contextual feature names, ``counts`` candidates per user and item ``timestamps``."""
    keys = list(parts)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat([parts[k][0] for k in keys]),
        lengths=torch.cat([parts[k][1] for k in keys]),
    )
    return Batch(
        features=features,
        contextual_feature_names=list(like.contextual_feature_names),
        num_candidates=counts,
        user_ids=like.user_ids,
        timestamps=timestamps,
    )


def with_candidates(
    history: Batch,
    candidates: list[list[int]] | list[torch.Tensor],
    timestamps: list[list[int]] | None = None,
    query_time: torch.Tensor | None = None,
) -> Batch:
    """``history`` (no candidates) with each user's candidate items appended (ranking layout:
    history items, then candidates); candidate times default to ``query_time[b]`` if given, else
    the history's last time."""
    if history.batch_size != len(candidates):
        raise ValueError(
            f"{len(candidates)} candidate sets for {history.batch_size} users; give one per user"
        )
    if int(history.num_candidates.sum()) != 0:
        raise ValueError("the history batch already holds candidates")
    if timestamps is not None and len(timestamps) != len(candidates):
        raise ValueError(f"{len(timestamps)} timestamp lists for {len(candidates)} candidate sets")
    parts = feature_parts(history)
    item_v, item_l = parts[ITEM_FEATURE]
    cands = [torch.as_tensor(c, dtype=torch.int64).reshape(-1) for c in candidates]
    counts = torch.tensor([c.numel() for c in cands], dtype=torch.int64)
    starts = torch.cumsum(item_l, 0) - item_l
    values, times = [], []
    for b, c in enumerate(cands):
        lo, n = int(starts[b]), int(item_l[b])
        values += [item_v[lo : lo + n], c]
        if history.timestamps is not None:
            hist_t = history.timestamps[lo : lo + n]
            times += [hist_t, _candidate_times(b, c, hist_t, timestamps, query_time)]
    parts[ITEM_FEATURE] = (torch.cat(values), item_l + counts)
    return batch_from_parts(parts, history, counts, torch.cat(times) if times else None)


def _candidate_times(b, cands, hist_t, timestamps, query_time) -> torch.Tensor:
    if timestamps is not None:
        t = torch.as_tensor(timestamps[b], dtype=torch.int64).reshape(-1)
        if t.numel() != cands.numel():
            raise ValueError(f"user {b}: {t.numel()} timestamps for {cands.numel()} candidates")
        return t
    if query_time is not None:
        return query_time[b].reshape(1).to(torch.int64).expand(cands.numel())
    if hist_t.numel():
        return hist_t[-1:].expand(cands.numel())
    return torch.zeros(cands.numel(), dtype=torch.int64)


def split_candidates(batch: Batch) -> tuple[Batch, list[torch.Tensor], list[torch.Tensor] | None]:
    """(the histories alone, each user's candidate items, their times or None) of a ranking
    ``batch`` (CPU): the inverse of `with_candidates`."""
    parts = feature_parts(batch)
    item_v, item_l = parts[ITEM_FEATURE]
    hist = batch.history_lengths()
    starts = torch.cumsum(item_l, 0) - item_l
    keep, cands, times, hist_times = [], [], [], []
    for b in range(batch.batch_size):
        lo, h, n = int(starts[b]), int(hist[b]), int(item_l[b])
        keep.append(item_v[lo : lo + h])
        cands.append(item_v[lo + h : lo + n])
        if batch.timestamps is not None:
            hist_times.append(batch.timestamps[lo : lo + h])
            times.append(batch.timestamps[lo + h : lo + n])
    parts[ITEM_FEATURE] = (torch.cat(keep), hist.clone())
    history = batch_from_parts(
        parts,
        batch,
        torch.zeros_like(batch.num_candidates),
        torch.cat(hist_times) if hist_times else None,
    )
    return history, cands, (times if batch.timestamps is not None else None)


def _check_model(model: RankingGR) -> None:
    if model.training:
        raise ValueError("the KV cache needs the model in eval mode (model.eval())")
    for layer in model.encoder.layers:
        if getattr(layer, "attention_type", "hstu") != "hstu":
            raise ValueError(
                f"the KV cache serves HSTU attention layers; this model's layers use "
                f"attention_type={layer.attention_type!r}"
            )


def _scaling(layer, cache_scaling: int) -> int:
    return cache_scaling if layer.scaling_seqlen is None else int(layer.scaling_seqlen)


def _bias_kwargs(layer, layout: CachedLayout) -> dict:
    if layer.relative_bias is None:
        return {}
    return layer.relative_bias.attention_kwargs(layout)


def _rows(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """CPU int64 concatenation of arange(starts[i], starts[i] + counts[i])."""
    return segment_ranges(starts, counts, int(counts.sum()))


def _slot_offsets(tokens: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B + 1] starts of slots of ``tokens + capacity`` rows."""
    offsets = torch.zeros(tokens.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(tokens + capacity, 0)
    return offsets


@torch.no_grad()
def encode_history(
    model: RankingGR,
    history: Batch,
    num_candidates: int,
    query_time: torch.Tensor | None = None,
) -> HistoryCache:
    """Runs ``history`` (a batch without candidates, on the model's device) through ``model``
    (eval mode) and caches each layer's history keys and values. ``num_candidates``: the
    candidates per user the scores will be for (the attention scaling counts them; also the
    slots' capacity); ``query_time`` [B]: the time of the candidates (default: each history's
    last time)."""
    _check_model(model)
    if int(history.num_candidates.sum()) != 0:
        raise ValueError("encode_history takes histories only (num_candidates all 0)")
    if num_candidates < 1:
        raise ValueError(f"num_candidates={num_candidates} must be >= 1")
    host = history.host_batch() or history
    lengths = host_lengths(host)
    pre = model.preprocessor
    needed = int(lengths.history.max()) + 1 if lengths.history.numel() else 0
    if needed > pre.max_positions:
        raise ValueError(
            f"a history needs {needed} positions (history + 1 for its candidates) but the model "
            f"has {pre.max_positions} (NetworkArgs.num_position_embeddings)"
        )
    emb = model.embeddings(history)
    contextual = [emb[name].values() for name in model.contextual_names]
    x, layout = pre(history, contextual, emb[ITEM_FEATURE])
    attn = layout.attn
    f = len(model.contextual_names)
    b = history.batch_size
    tokens = lengths.history + f
    scaling = (int(tokens.max()) if b else 0) + int(num_candidates)
    if attn.timestamps is not None:
        if query_time is None:
            ends = torch.cumsum(host.item_lengths(), 0) - 1
            query_time = host.timestamps[ends.clamp(min=0)]
        last = torch.zeros(attn.seq_offsets.numel() - 1, dtype=torch.int64, device=x.device)
        last[:b] = query_time.to(x.device, torch.int64)
        attn.last_query_time = last
    # slot rows of the history tokens (the encoder's rows are the jagged layout of tokens)
    cap = int(num_candidates)
    slot_offsets = _slot_offsets(tokens, cap)
    src = _rows(attn.host_seq_offsets[:b], tokens).to(x.device)
    dst = _rows(slot_offsets[:-1], tokens).to(x.device)
    rows = int(slot_offsets[-1])
    h, d = model.encoder.layers[0].num_heads, model.encoder.layers[0].head_dim
    keys, values = [], []
    for layer in model.encoder.layers:
        u, v, q, k = layer.project(x)
        a = layer.attend(q, k, v, attn, scaling_seqlen=_scaling(layer, scaling))
        x = layer.finish(x, a, u)
        for buf, t in ((keys, k), (values, v)):
            slots = t.new_zeros((rows, h, d))
            buf.append(slots.index_copy_(0, dst, t.index_select(0, src).view(-1, h, d)))
    ts = None
    if attn.timestamps is not None:
        ts = attn.timestamps.new_zeros(rows).index_copy_(0, dst, attn.timestamps[src])
    return HistoryCache(
        keys=keys,
        values=values,
        slot_offsets=slot_offsets,
        history_tokens=tokens.clone(),
        num_contextual=f,
        capacity=cap,
        timestamps=ts,
        history=host,
        num_candidates=int(num_candidates),
        scaling_seqlen=scaling,
        query_time=None if query_time is None else query_time.cpu(),
    )


def _grow(cache: HistoryCache, capacity: int) -> None:
    """Re-lays the cache out with ``capacity`` candidate rows per slot (in place)."""
    new_offsets = _slot_offsets(cache.history_tokens, capacity)
    dev = cache.keys[0].device if cache.keys else torch.device("cpu")
    src = _rows(cache.slot_offsets[:-1], cache.history_tokens).to(dev)
    dst = _rows(new_offsets[:-1], cache.history_tokens).to(dev)
    rows = int(new_offsets[-1])

    def move(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((rows, *t.shape[1:]))
        return out.index_copy_(0, dst, t.index_select(0, src))

    cache.keys = [move(t) for t in cache.keys]
    cache.values = [move(t) for t in cache.values]
    if cache.timestamps is not None:
        cache.timestamps = move(cache.timestamps)
    cache.slot_offsets = new_offsets
    cache.capacity = capacity


def _check_counts(model: RankingGR, cache: HistoryCache, counts: torch.Tensor) -> None:
    if counts.numel() != cache.batch_size:
        raise ValueError(
            f"{counts.numel()} candidate sets for {cache.batch_size} users; give one per user"
        )
    if bool((counts < 1).any()):
        raise ValueError("every user needs at least one candidate")
    fixed = all(layer.scaling_seqlen is not None for layer in model.encoder.layers)
    if not fixed and bool((counts != cache.num_candidates).any()):
        raise ValueError(
            f"the cache was encoded for {cache.num_candidates} candidates per user (the attention "
            f"scaling counts them); got {counts.tolist()}: encode the history for this count, or "
            "train with a fixed NetworkArgs.scaling_seqlen"
        )


def _ids(c) -> torch.Tensor:
    """Candidate ids as a 1-D int64 CPU tensor (given ones as they are: ~1.5 us a user less,
    which a request of 64 users feels)."""
    if type(c) is torch.Tensor and c.dtype == torch.int64 and c.dim() == 1 and not c.is_cuda:
        return c
    return torch.as_tensor(c, dtype=torch.int64).reshape(-1)


def _candidates(model, cache: HistoryCache, candidates, timestamps):
    """(candidate id tensors, counts [B], their times [sum] or None) of a scoring call, checked
    against the cache."""
    _check_model(model)
    cands = [_ids(c) for c in candidates]
    counts = torch.tensor([c.numel() for c in cands], dtype=torch.int64)
    _check_counts(model, cache, counts)
    if cache.timestamps is None:
        return cands, counts, None
    if timestamps is not None and len(timestamps) != len(cands):
        raise ValueError(f"{len(timestamps)} timestamp lists for {len(cands)} candidate sets")
    none = torch.zeros(0, dtype=torch.int64)
    times = [
        _candidate_times(i, c, none, timestamps, cache.query_time) for i, c in enumerate(cands)
    ]
    if not torch.equal(torch.stack([t[0] for t in times]), cache.query_time):
        raise ValueError(
            "the first candidate's time differs from the time the history was encoded at "
            "(the last history token queries the time bias at it): encode the history with "
            "query_time = the candidates' time"
        )
    return cands, counts, torch.cat(times)


def _candidate_positions(model: RankingGR, cache: HistoryCache, counts: torch.Tensor, device):
    """[sum n, D] position embeddings of the candidates: position = each user's history items
    (clamped as the preprocessor clamps them)."""
    pre = model.preprocessor
    pos = torch.repeat_interleave(cache.history_items.clamp(max=pre.max_positions - 1), counts)
    return pre.position_embedding(pos.to(device))


def _input_tokens(model: RankingGR, items: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Input tokens of candidate ``items`` rows: the item embedding scaled as the preprocessor
    scales it, plus the candidates' position embeddings (dropout is off in eval)."""
    pre = model.preprocessor
    scaled = items * pre.item_scale if pre.item_scale != 1.0 else items
    return scaled + positions


def _serving_lookup(model: RankingGR) -> ItemLookup | None:
    """The item table's host-read-free lookup (`EmbeddingStack.serving_item_lookup`), if any."""
    get = getattr(model.embeddings, "serving_item_lookup", None)
    return None if get is None else get()


def _checked_ids(lookup: ItemLookup, cands: list[torch.Tensor]) -> torch.Tensor:
    """The candidates' ids concatenated on the host, checked by the serving lookup."""
    ids = torch.cat(cands)
    lookup.check(ids)
    return ids


def _candidate_inputs(
    model: RankingGR, cache: HistoryCache, cands: list[torch.Tensor], counts: torch.Tensor, device
):
    """[sum n, D] input tokens of the candidates (``counts`` per user, `_input_tokens`). The
    item rows come from the table's serving lookup where it has one (ids checked on the host,
    one copy), else from the model's embedding lookup of a candidates-only batch."""
    lookup = _serving_lookup(model)
    if lookup is not None:
        items = lookup.rows(_checked_ids(lookup, cands).to(device))
    else:
        hist = cache.history
        parts = feature_parts(hist)
        parts[ITEM_FEATURE] = (torch.cat(cands), counts)
        actions = parts[ACTION_FEATURE][0]
        parts[ACTION_FEATURE] = (actions[:0], torch.zeros_like(counts))
        batch = batch_from_parts(parts, hist, counts, None)
        if torch.device(device).type == "cuda":
            # page-locked: the copies are queued without the host waiting on each
            batch = batch.pin_memory().to(device, non_blocking=True)
        else:
            batch = batch.to(device)
        items = model.embeddings(batch)[ITEM_FEATURE].values()
    return _input_tokens(model, items, _candidate_positions(model, cache, counts, device))


def _layout(cache: HistoryCache, counts: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(the cached attention's metadata (CPU), the candidates' rows: each slot's tail) for
    ``counts`` candidates per user."""
    q_offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    q_offsets[1:] = torch.cumsum(counts, 0)
    f = cache.num_contextual
    meta = dict(
        q_offsets=q_offsets,
        kv_offsets=cache.slot_offsets,
        kv_lengths=cache.history_tokens + counts,
        num_contexts=torch.full_like(counts, f) if f else None,
        num_targets=counts,
    )
    return meta, _rows(cache.slot_offsets[:-1] + cache.history_tokens, counts)


def _wide(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed with 16-byte elements along its last dim (the same bytes), or None where its
    layout does not allow it."""
    ratio = 16 // t.element_size()
    if t.stride(-1) != 1 or t.shape[-1] % ratio or t.storage_offset() % ratio:
        return None
    if any(s % ratio for s in t.stride()[:-1]):
        return None
    return t.view(torch.complex128)


def _write_rows(buf: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``buf[dst] = rows`` (rows [n, H, D] of buf's dtype), moving 16-byte elements where the
    layouts allow: index_copy moves one element per thread, so bf16 rows go 8x faster this way."""
    wide_buf, wide_rows = _wide(buf), _wide(rows)
    if wide_buf is None or wide_rows is None:
        buf.index_copy_(0, dst, rows)
    else:
        wide_buf.index_copy_(0, dst, wide_rows)


def _score_layers(
    model, cache: HistoryCache, x, dst, meta, times, num_splits, head=None
) -> torch.Tensor:
    """The candidates' tokens ``x`` through the layers, the final norm and the head; writes
    their keys, values and ``times`` into the slot rows ``dst``. ``num_splits``: the compiled
    cached attention's key splits (`hstu.ops.attention.hstu_attention_cached`)."""
    layout = CachedLayout(timestamps=cache.timestamps)
    if times is not None:
        cache.timestamps.index_copy_(0, dst, times)
    for layer, k_buf, v_buf in zip(model.encoder.layers, cache.keys, cache.values):
        h, d = layer.num_heads, layer.head_dim
        u, v, q, k = layer.project(x)
        _write_rows(k_buf, dst, k.reshape(-1, h, d).to(k_buf.dtype))
        _write_rows(v_buf, dst, v.reshape(-1, h, d).to(v_buf.dtype))
        a = hstu_attention_cached(
            q.reshape(-1, h, d).to(k_buf.dtype).contiguous(),
            k_buf,
            v_buf,
            target_group_size=layer.target_group_size,
            window_size=layer.window_size,
            alpha=layer.alpha,
            scaling_seqlen=_scaling(layer, cache.scaling_seqlen),
            force_reference=layer.reference_attention,
            num_splits=num_splits,
            **meta,
            **_bias_kwargs(layer, layout),
        )
        x = layer.finish(x, a.reshape(-1, h * d).to(u.dtype), u)
    x = model.encoder.final(x)
    return (model.head if head is None else head)(x).float()


@torch.no_grad()
def score_candidates(
    model: RankingGR,
    cache: HistoryCache,
    candidates: list[list[int]] | list[torch.Tensor],
    timestamps: list[list[int]] | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Logits [sum of candidates, num_tasks] of each user's candidates (users in the cache's
    order, candidates in the given order) from ``cache``. The candidates' keys and values are
    written into the cache's slots (the history's rows are left as they are). ``num_splits``:
    the compiled attention's key splits (0, the default: chosen from the shape, splitting the
    keys when few users leave most of the GPU idle; 1: none)."""
    cands, counts, times = _candidates(model, cache, candidates, timestamps)
    if int(counts.max()) > cache.capacity:
        _grow(cache, int(counts.max()))
    device = cache.keys[0].device
    x = _candidate_inputs(model, cache, cands, counts, device)
    meta, dst = _layout(cache, counts)
    times = None if times is None else times.to(device)
    return _score_layers(model, cache, x, dst.to(device), meta, times, num_splits)


class GraphedScorer:
    """`score_candidates` for one cache and fixed candidate counts per user, replayed from a CUDA
    graph (CUDA only). Scoring a small candidate set issues a few dozen small kernels per layer,
    so it is bound by the host's launch cost; the graph issues them all at once.

    Where the item table has a serving lookup (`EmbeddingStack.serving_item_lookup`: plain and
    all-HBM dynamic tables) the graph starts from the candidate ids: a call checks them on the
    host, copies them (and their times) through page-locked buffers into the graph's inputs and
    replays the lookup, the layers, the norm and the head. Otherwise (torchrec or hybrid item
    tables) the candidates' input rows are computed eagerly and copied into the graph's input.
    Built from the cache's current layout and the model's current weights (the cache must not be
    grown or re-encoded, nor the model trained, while the scorer is used).

        scorer = GraphedScorer(model, cache, counts=[100] * B)
        logits = scorer(candidates)               # equals score_candidates(model, cache, ...)
    """

    def __init__(
        self,
        model: RankingGR,
        cache: HistoryCache,
        counts: list[int],
        autocast_dtype: torch.dtype | None = None,
        num_splits: int = 0,
    ) -> None:
        _check_model(model)
        device = cache.keys[0].device if cache.keys else torch.device("cpu")
        if device.type != "cuda":
            raise ValueError("GraphedScorer needs a cache on a CUDA device")
        counts_t = torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
        _check_counts(model, cache, counts_t)
        if int(counts_t.max()) > cache.capacity:
            _grow(cache, int(counts_t.max()))
        self.model, self.cache, self.counts = model, cache, counts_t
        self.autocast_dtype = autocast_dtype
        meta, dst = _layout(cache, counts_t)
        # validated here on the host: the captured kernel takes the device copies as given
        cached_layout(
            meta["q_offsets"], meta["kv_offsets"], meta["kv_lengths"], int(counts_t.sum())
        )
        # int32, the kernel's own type: a replay converts nothing
        meta = {k: None if t is None else t.to(device, torch.int32) for k, t in meta.items()}
        meta.update(max_q_seqlen=int(counts_t.max()), max_seqlen=int(meta["kv_lengths"].max()))
        n = int(counts_t.sum())
        timed = cache.timestamps is not None
        self._lookup = _serving_lookup(model)

        # the graph's inputs (the candidate ids, or their input rows where the lookup runs
        # eagerly; their times), and page-locked staging buffers for the calls' copies of ids
        # and times into them
        def ids_and_staging() -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(n, dtype=torch.int64).pin_memory()
            return torch.zeros(n, dtype=torch.int64, device=device), host

        if self._lookup is not None:
            self._ids, self._host_ids = ids_and_staging()
        else:
            hidden = model.encoder.layers[0].hidden_size
            param_dtype = next(model.parameters()).dtype
            self._x = torch.zeros(n, hidden, dtype=param_dtype, device=device)
        if timed:
            self._times, self._host_times = ids_and_staging()
        self._staged = torch.cuda.Event()  # the last call's copies out of the staging buffers
        self._staged.record()
        # the graph reads these tensors' memory at every replay: they live as long as the scorer
        with torch.no_grad():
            self._positions = _candidate_positions(model, cache, counts_t, device)
        self._dst = dst.to(device)
        self._meta = meta
        self._head = _head_in(model.head, autocast_dtype)
        self._host_out: torch.Tensor | None = None

        def run() -> torch.Tensor:
            with self._autocast():
                if self._lookup is not None:
                    x = _input_tokens(model, self._lookup.rows(self._ids), self._positions)
                else:
                    x = self._x
                return _score_layers(
                    model,
                    cache,
                    x,
                    self._dst,
                    self._meta,
                    self._times if timed else None,
                    num_splits,
                    self._head,
                )

        # warm up on a side stream (kernel selection, lazy tables, the layers' weight casts),
        # then capture
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self._out = run()

    def _autocast(self):
        if self.autocast_dtype is None or self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        # no cast cache: a cast made outside the capture must not be read by the graph (the
        # layers keep their own weight casts, `FusedHSTULayer.project`)
        return torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)

    def _stage(self, host: torch.Tensor, staging: torch.Tensor, target: torch.Tensor) -> None:
        staging.copy_(host)
        target.copy_(staging, non_blocking=True)

    @torch.no_grad()
    def __call__(
        self,
        candidates: list[list[int]] | list[torch.Tensor],
        timestamps: list[list[int]] | None = None,
        to_host: bool = False,
    ) -> torch.Tensor:
        """Logits [sum of candidates, num_tasks] of each user's candidates, as
        `score_candidates` computes them: a copy of the graph's output buffer, on the device, or
        with ``to_host`` on the CPU (through a page-locked buffer, waiting for the replay)."""
        cands, counts, times = _candidates(self.model, self.cache, candidates, timestamps)
        if not torch.equal(counts, self.counts):
            raise ValueError(
                f"this scorer was captured for {self.counts.tolist()} candidates per user; got "
                f"{counts.tolist()}"
            )
        self._staged.synchronize()  # the previous call's copies have left the staging buffers
        if times is not None:
            self._stage(times, self._host_times, self._times)
        if self._lookup is not None:
            self._stage(_checked_ids(self._lookup, cands), self._host_ids, self._ids)
        else:
            with self._autocast():
                x = _candidate_inputs(self.model, self.cache, cands, counts, self._x.device)
            self._x.copy_(x)
        self._staged.record()
        self.graph.replay()
        if not to_host:
            return self._out.clone()
        if self._host_out is None:
            self._host_out = torch.empty(self._out.shape, dtype=self._out.dtype).pin_memory()
        self._host_out.copy_(self._out, non_blocking=True)
        torch.cuda.current_stream(self._out.device).synchronize()
        return self._host_out.clone()


def _head_in(head: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """``head`` itself, or (a bf16/fp16 ``dtype``) a copy whose Linear layers hold their
    weights in ``dtype``: under autocast the matmuls then cast nothing per call, with the same
    values (autocast rounds the float32 weights to ``dtype`` alike); other layers (the
    LayerNorm) keep their float32 parameters."""
    if dtype not in (torch.bfloat16, torch.float16):
        return head
    copy = copy_module.deepcopy(head)
    for m in copy.modules():
        if isinstance(m, torch.nn.Linear):
            m.to(dtype)
    return copy


@torch.no_grad()
def full_scores(model: RankingGR, batch: Batch) -> torch.Tensor:
    """Logits [sum of candidates, num_tasks] by the model's own forward on history +
    candidates: what `score_candidates` equals."""
    return model(batch)["logits"].float()
