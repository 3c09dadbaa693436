"""Dynamic embedding table and collection: int64 ids -> rows created on first sight, evicted when
full, trained by an optimizer fused into backward.

`DynamicEmbeddingCollection` takes a torchrec KeyedJaggedTensor and returns dict[str,
JaggedTensor] like torchrec's EmbeddingCollection. Its rows are plain tensors, not Parameters or
buffers: the dense optimizer, DDP and state_dict never see them; checkpoints go through
`dump()`/`load()`. On CUDA the compiled kernels (`cuda_table.py`) run; on CPU the pure-PyTorch
reference (`reference_table.py`) with the same semantics.
"""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.config.limits import check_table_allocation
from hstu.embeddings import reference_table
from hstu.embeddings.dynamic_config import BUCKET_SIZE, DynamicEmbeddingConfig
from hstu.embeddings.lookup_graphs import LookupGraphs
from hstu.embeddings.reference_table import EMPTY_KEY, OPT_CODES, TableState

__all__ = [
    "DynamicEmbeddingTable",
    "DynamicEmbeddingCollection",
    "UniqueIds",
    "make_dynamic_table",
    "unique_ids",
    "apply_increment",
    "apply_collection_increment",
    "concat_dumps",
]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# marked dumps a table remembers for incremental dumps (each: its step and its keys on the CPU)
MAX_DUMP_MARKS = 4


def _backend(device: torch.device, backend: str) -> ModuleType:
    if backend not in ("auto", "reference", "cuda"):
        raise ValueError(f"backend={backend!r}: one of 'auto', 'cuda', 'reference'")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference_table
    if device.type != "cuda":
        raise ValueError(f"backend='cuda' needs a CUDA device, got {device}")
    from hstu.embeddings import cuda_table

    cuda_table.require_kernels()
    return cuda_table


class UniqueIds:
    """Deduplicated ids of one lookup: uniq (sorted), counts, inverse (ids == uniq[inverse]),
    perm (argsort of ids) and offsets (segments of perm per unique id).

    ``num_unique`` (the number of distinct ids, known on the host, e.g. from the batch's CPU ids)
    lets the device build every tensor without reading a size back (`unique_consecutive` must
    sync to size its output); the results are identical either way.

    `UniqueIds.padded` builds them at sizes fixed by the input's length instead (a CUDA graph
    captures it); its ``num_unique`` is then a device tensor and ``valid`` marks the real entries
    of ``uniq`` (None otherwise: every entry is real)."""

    valid: torch.Tensor | None = None

    def __init__(self, ids: torch.Tensor, num_unique: int | None = None) -> None:
        # stable: a duplicate's gradient rows are summed in id order, as `padded` sums them
        sorted_ids, self.perm = torch.sort(ids, stable=True)
        n = ids.numel()
        dev = ids.device
        if num_unique is None:
            self.uniq, self.counts = torch.unique_consecutive(sorted_ids, return_counts=True)
            u = self.uniq.numel()
            seg = torch.repeat_interleave(torch.arange(u, device=dev), self.counts, output_size=n)
            self.offsets = torch.zeros(u + 1, dtype=torch.int64, device=dev)
            torch.cumsum(self.counts, 0, out=self.offsets[1:])
        else:
            u = int(num_unique)
            # segment id of each sorted position: +1 wherever the id changes
            seg = torch.zeros(n, dtype=torch.int64, device=dev)
            if n > 1:
                torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], 0, out=seg[1:])
            # segment k starts at the first position of id k (n past the last): few small ops,
            # each costing the host more than the GPU
            self.offsets = torch.searchsorted(seg, torch.arange(u + 1, device=dev))
            self.uniq = sorted_ids[self.offsets[:-1]]
            self.counts = self.offsets.diff()
        self.num_unique: int | torch.Tensor = u
        self.inverse = torch.empty(n, dtype=torch.int64, device=dev)
        self.inverse[self.perm] = seg

    @classmethod
    def padded(cls, ids: torch.Tensor, n: torch.Tensor) -> UniqueIds:
        """The unique ids of ``ids[:n]`` (``n`` a 0-d int64 tensor on the ids' device; the rest of
        ``ids`` is padding of any value) with every size fixed by ``len(ids)`` = N >= 1, so that
        nothing is read back and a CUDA graph can capture it: uniq, counts, inverse, perm [N],
        offsets [N + 1]. Entries k < U (``num_unique``, a 0-d tensor) are those of the real ids;
        past U, uniq holds EMPTY_KEY (which no table finds), counts 0 and offsets n. inverse and
        perm are exact on the first n positions (perm[:n] is an argsort of ids[:n]); a padding
        position's inverse is U."""
        self = cls.__new__(cls)
        big = ids.numel()
        dev = ids.device
        pos = torch.arange(big + 1, device=dev)
        real = pos[:big] < n
        # padding sorts last: the largest value, and the stable sort keeps a real id of that
        # value before it, so the first n sorted positions are exactly the real ids
        key = torch.where(real, ids, torch.iinfo(torch.int64).max)
        sorted_ids, self.perm = torch.sort(key, stable=True)
        seg = torch.zeros(big, dtype=torch.int64, device=dev)
        if big > 1:
            change = (sorted_ids[1:] != sorted_ids[:-1]) | (pos[1:big] == n)
            torch.cumsum(change, 0, out=seg[1:])
        # U = the last real position's segment + 1 (0 without ids); index_select, as indexing
        # by a 0-d tensor would read it back
        last = seg.index_select(0, (n - 1).clamp(min=0).reshape(1)).squeeze(0)
        self.num_unique = torch.where(n > 0, last + 1, 0)
        self.offsets = torch.minimum(torch.searchsorted(seg, pos), n)
        self.valid = pos[:big] < self.num_unique
        first = self.offsets[:-1].clamp(max=big - 1)
        self.uniq = torch.where(self.valid, sorted_ids[first], EMPTY_KEY)
        self.counts = self.offsets.diff()
        self.inverse = torch.empty(big, dtype=torch.int64, device=dev)
        self.inverse[self.perm] = seg
        return self

    def first(self, n: int) -> UniqueIds:
        """The same unique ids for the first ``n`` positions of the ids (a padded lookup's real
        ids): inverse and perm cut to n (perm[:n] holds exactly those positions)."""
        out = UniqueIds.__new__(UniqueIds)
        out.__dict__.update(self.__dict__)
        out.inverse, out.perm = self.inverse[:n], self.perm[:n]
        return out


def unique_ids(ids: torch.Tensor, num_unique: int | None = None) -> UniqueIds:
    return UniqueIds(ids, num_unique)


def _host_unique_count(host_ids: torch.Tensor) -> tuple[int, bool]:
    """(number of distinct ids, whether the reserved EMPTY_KEY is among them), on the CPU.

    NumPy's sort (radix/SIMD for int64) + a neighbour compare: ~1.3 ms for 131k ids on one core,
    5x faster than torch.unique."""
    if host_ids.numel() == 0:
        return 0, False
    s = np.sort(host_ids.numpy())
    return 1 + int(np.count_nonzero(s[1:] != s[:-1])), bool(s[0] == EMPTY_KEY)


def padded_segments(
    sorted_bucket: torch.Tensor, nb: int, n_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The insert op's bucket groups, padded so that nothing is read back: ``sorted_bucket``
    [n] holds the n_new absent ids' buckets (< nb) in ascending order, then nb for each present
    id; ``n_new`` is a 0-d tensor. Returns (seg_offsets [n + 1], seg_buckets [n]): the first
    n_seg segments are the runs of equal buckets among the first n_new positions, the others are
    empty at offset n_new with bucket 0 (the op skips them)."""
    n = sorted_bucket.numel()
    first = sorted_bucket < nb  # the first position of each bucket group of absent ids
    if n > 1:
        first[1:] &= sorted_bucket[1:] != sorted_bucket[:-1]
    starts = torch.cumsum(first, 0)  # group starts up to each position; n_seg at the end
    pos = torch.arange(n + 1, device=sorted_bucket.device)
    # segment k begins where the (k + 1)-th group start is; past the last one, n_new
    seg_offsets = torch.minimum(torch.searchsorted(starts, pos, right=True), n_new)
    if n == 0:
        return seg_offsets, sorted_bucket.new_zeros(0)
    head = sorted_bucket[seg_offsets[:n].clamp(max=n - 1)]
    return seg_offsets, torch.where(pos[:n] < starts[-1], head, 0)


class _FusedLookup(torch.autograd.Function):
    """Forward gathers rows; backward reduces the gradient per unique id and updates the rows and
    their optimizer state in place. `dummy` (an empty tensor requiring grad) makes autograd call
    backward although the table holds no Parameter."""

    @staticmethod
    def forward(ctx, dummy, table, u, slots, entry=None):  # type: ignore[override]
        """``entry``: the lookup graph whose outputs ``u`` and ``slots`` are, released after the
        update (`LookupGraphs`)."""
        ctx.table, ctx.u, ctx.slots, ctx.step, ctx.entry = table, u, slots, table.step, entry
        LookupGraphs.hold(entry, ctx)
        return table.ops.gather(table.row_state(), table.dim, slots, u.inverse)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        t, u = ctx.table, ctx.u
        t.ops.update(
            t.row_state(),
            t.dim,
            u.uniq,
            ctx.slots,
            u.inverse,
            u.perm,
            u.offsets,
            grad.contiguous(),
            t.optimizer_args(),
        )
        t._backward_done(ctx.step)
        LookupGraphs.release(ctx.entry)
        return None, None, None, None, None


class DynamicEmbeddingTable(nn.Module):
    """One dynamic table (or one rank's shard of it: `world_size`/`rank` keep only the ids whose
    `owner_of(id, world_size) == rank` on load, and split the capacity)."""

    # whether the training lookup may replay from CUDA graphs (`LookupGraphs`)
    lookup_graphs_supported = True

    def __init__(
        self,
        config: DynamicEmbeddingConfig,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device if device is not None else "cpu")
        self.ops = _backend(self.device, backend)
        self.world_size, self.rank = world_size, rank
        self.dim = config.embedding_dim
        per_rank = -(-config.capacity // world_size)
        num_slots = -(-per_rank // BUCKET_SIZE) * BUCKET_SIZE
        # Rows padded to 4 floats so the kernels move them as float4.
        self.width = config.row_width
        if self.device.type != "meta":
            device_bytes, host_bytes = self._memory_need(num_slots)
            check_table_allocation(
                f"dynamic table {config.name!r} (rank {rank} of {world_size}: {num_slots:,} "
                f"slots of {self.width} floats, storage={config.storage!r})",
                self.device.type,
                device_bytes,
                host_bytes,
                storage=config.storage,
                hybrid_host_bytes=num_slots * self.width * 4,
            )
        self.state = self._allocate(num_slots)
        self.step = 0
        self.lr = config.learning_rate
        self._counters = torch.zeros(5, dtype=torch.int64, device=self.device)
        # incremental dumps: token -> (step, sorted keys on the CPU, len(self._rescored)) at a
        # marked dump, and the keys whose scores were set outside training since the first mark
        self._marks: dict[int, tuple[int, torch.Tensor, int]] = {}
        self._rescored: list[torch.Tensor] = []
        # the compiled insert skips empty trailing segments, so training lookups can hand it the
        # missing ids padded to a size known on the host (no device read); the reference cannot
        self._padded_insert = self.ops is not reference_table
        self._graphs: LookupGraphs | None = None
        if config.lookup_graphs and self.lookup_graphs_supported and self._padded_insert:
            self._graphs = LookupGraphs(self.device, config.name)
        # rows that training lookups return instead of looking up (`stage`)
        self._staged: torch.Tensor | None = None

    def _memory_need(self, num_slots: int) -> tuple[int, int]:
        """(bytes on the table's device, bytes of host memory) that `_allocate` takes."""
        return num_slots * (self.width * 4 + 3 * 8), 0

    def _allocate(self, num_slots: int) -> TableState:
        """The table's tensors: every slot with its row, on the table's device."""
        return TableState.empty(num_slots, self.width, self.device)

    def row_state(self) -> TableState:
        """The state whose ``values`` the slots of a lookup index (`_FusedLookup`)."""
        return self.state

    def _backward_done(self, step: int) -> None:
        """Called when the fused update of the lookup made at ``step`` has run."""

    def _read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows [n, width] of live ``slots`` (device tensor), on the CPU."""
        return self.state.values[slots].cpu()

    def _write_rows(self, slots: torch.Tensor, values: torch.Tensor, state: torch.Tensor) -> None:
        """Writes embeddings [n, dim] and optimizer state [n, state_dim] (any device) into the
        rows of ``slots`` (a load)."""
        d = self.dim
        self.state.values[slots, :d] = values.to(self.device)
        self.state.values[slots, d : d + self.config.state_dim] = state.to(self.device)

    # -- lookup ---------------------------------------------------------------------------------
    def forward(
        self,
        ids: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        host_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings [len(ids), dim] of int ids. Training inserts unseen ids (and trains them when
        grad is enabled); eval never inserts and returns zeros for unknown ids. `scores` (same
        length as ids) sets the eviction score of each id under the 'custom' policy.

        ``host_ids``: the same ids on the CPU (e.g. from the batch's CPU twin). With them the
        reserved-id check (and, for an eager lookup, the distinct-id count) runs on the host and a
        training lookup reads nothing back; without them it reads the device once (graphed) or
        twice (eager). A training lookup on the GPU replays its ops from CUDA graphs
        (`config.lookup_graphs`, `hstu.embeddings.lookup_graphs`) unless it has custom scores."""
        dtype = _DTYPES[self.config.output_dtype]
        if self._staged is not None and self.training:
            return self._staged_rows(ids)
        # (inside a caller's CUDA graph capture the ops are captured as they are issued)
        graphs = self._graphs is not None and not torch.cuda.is_current_stream_capturing()
        if self.training and graphs and ids.numel() and scores is None:
            out = self._graphed_lookup(ids, host_ids)
            if out is not None:
                return out.to(dtype)
        u = self._unique(ids, host_ids)
        n_unique = u.uniq.numel()
        if not self.training:
            slots = self.ops.find(self.state, u.uniq)
            self._count_eval(n_unique, (slots >= 0).sum())
            out = self.ops.gather(self.state, self.dim, slots, u.inverse)
            return out.to(dtype)
        self.step += 1
        score_vals, accumulate = self._score_values(u, scores)
        slots = self.ops.find(self.state, u.uniq, True, self.step, score_vals, accumulate)
        self._count(n_unique, *self._insert_missing(u, slots, score_vals))
        if torch.is_grad_enabled():
            dummy = torch.empty(0, device=self.device, requires_grad=True)
            out = _FusedLookup.apply(dummy, self, u, slots)
        else:
            out = self.ops.gather(self.state, self.dim, slots, u.inverse)
        return out.to(dtype)

    def stage(self, rows: torch.Tensor | None) -> None:
        """Makes training lookups return ``rows`` ([n, dim] of `output_dtype`, usually a leaf
        that requires grad) instead of looking up, until ``stage(None)``: the table is neither
        read nor changed and its update does not run. The whole training step's CUDA graphs
        replay the dense part of a step this way on rows the table looked up before
        (`hstu.training.step_graphs`, "Dynamic tables")."""
        if rows is not None:
            self.check_staged(rows)
        self._staged = rows

    def check_staged(self, rows: torch.Tensor) -> None:
        """Raises unless ``rows`` can stand for this table's lookup: [n, dim] of `output_dtype`."""
        want = _DTYPES[self.config.output_dtype]
        if rows.dim() != 2 or rows.shape[1] != self.dim or rows.dtype != want:
            raise ValueError(
                f"dynamic table {self.config.name!r}: staged rows must be [n, {self.dim}] of "
                f"{want}, got {tuple(rows.shape)} of {rows.dtype}"
            )

    def _staged_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._staged
        if ids.numel() != rows.shape[0]:
            raise RuntimeError(
                f"dynamic table {self.config.name!r}: a lookup of {ids.numel()} ids met "
                f"{rows.shape[0]} staged rows (they were staged for another batch)"
            )
        return rows

    def _graphed_lookup(
        self, ids: torch.Tensor, host_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        """A training lookup through `LookupGraphs` (rows [len(ids), dim] float32), or None
        where it runs eagerly. The ids are checked first: on the host where ``host_ids`` are
        given, else with one read of the device."""
        self._check_ids(ids, host_ids)
        ids = ids.to(device=self.device, dtype=torch.int64)
        if host_ids is not None:
            if bool((host_ids == EMPTY_KEY).any()):
                self._raise_reserved()
        elif bool((ids == EMPTY_KEY).any()):
            self._raise_reserved()
        found = self._graphs.run(self._padded_lookup, ids, self.step + 1)
        if found is None:
            return None
        self.step += 1
        padded, slots, entry = found
        u = padded.first(ids.numel())
        if torch.is_grad_enabled():
            dummy = torch.empty(0, device=self.device, requires_grad=True)
            return _FusedLookup.apply(dummy, self, u, slots, entry)
        return self.ops.gather(self.state, self.dim, slots, u.inverse)

    def _padded_lookup(
        self, ids: torch.Tensor, n: torch.Tensor, step: torch.Tensor
    ) -> tuple[UniqueIds, torch.Tensor]:
        """The training lookup's ops on padded ids (`LookupGraphs`): the first ``n`` of ``ids``
        found (touched at ``step``, int64 [1] on the device) or inserted, and counted. Returns
        the padded unique ids and their slots (-1 past the real ones)."""
        u = UniqueIds.padded(ids, n)
        score_vals, accumulate = self._score_values(u, None)
        slots = self.ops.find(self.state, u.uniq, True, 0, score_vals, accumulate, step_tensor=step)
        miss = (slots < 0) & u.valid  # the padding (EMPTY_KEY) is never found
        self._count(u.num_unique, *self._insert_padded(u, slots, score_vals, miss, step))
        return u, slots

    # whether `serving_rows` may run (the hybrid table's rows may live on the host)
    serves_without_sync = True

    def serving_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Eval lookup for serving: rows [len(ids), dim] of int64 ``ids`` on the table's device
        (zeros for unknown ids), as `forward` gives them in eval mode, but without deduplication
        or counters, so nothing is read back to the host and a CUDA graph can capture it. The
        caller checks the ids on the host (`check_serving_ids`)."""
        if self.training:
            raise RuntimeError(f"table {self.config.name!r}: serving_rows needs eval mode")
        if not self.serves_without_sync:
            raise RuntimeError(
                f"table {self.config.name!r} (storage={self.config.storage!r}) cannot look up "
                "without host reads; use the table's forward"
            )
        slots = self.ops.find(self.state, ids)
        inverse = torch.arange(ids.numel(), device=ids.device)
        out = self.ops.gather(self.state, self.dim, slots, inverse)
        return out.to(_DTYPES[self.config.output_dtype])

    def check_serving_ids(self, host_ids: torch.Tensor) -> None:
        """Raises if CPU ``host_ids`` hold the reserved empty-slot key (`serving_rows`)."""
        if host_ids.numel() and bool((host_ids == EMPTY_KEY).any()):
            self._raise_reserved()

    def _unique(self, ids: torch.Tensor, host_ids: torch.Tensor | None) -> UniqueIds:
        """The checked, deduplicated ids of a lookup, on the table's device (the distinct-id
        count and the reserved-id check from ``host_ids`` when given)."""
        self._check_ids(ids, host_ids)
        num_unique = None
        if host_ids is not None:
            num_unique, reserved = _host_unique_count(host_ids.to(torch.int64))
            if reserved:
                self._raise_reserved()
        ids = ids.to(device=self.device, dtype=torch.int64)
        u = UniqueIds(ids, num_unique)
        if num_unique is None:
            self._check_reserved(u)
        return u

    def _check_ids(self, ids: torch.Tensor, host_ids: torch.Tensor | None) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"table {self.config.name!r}: ids must be int32/int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"table {self.config.name!r}: ids must be 1-D, got {tuple(ids.shape)}")
        if host_ids is not None and (host_ids.device.type != "cpu" or host_ids.shape != ids.shape):
            raise ValueError(
                f"table {self.config.name!r}: host_ids must be the ids on the CPU; got shape "
                f"{tuple(host_ids.shape)} on {host_ids.device} for ids {tuple(ids.shape)}"
            )

    def _insert_missing(
        self, u: UniqueIds, slots: torch.Tensor, score_vals: torch.Tensor | None
    ) -> tuple[int | torch.Tensor, int | torch.Tensor, int | torch.Tensor]:
        """Inserts the unique ids that `find` did not locate (``slots < 0``) and writes their new
        slots into ``slots``; returns (how many there were, how many got a row, how many rows
        were evicted for them): 0-d device tensors on the padded path, for `_count`.

        The missing ids go to the insert op grouped by bucket, ties in id order, exactly as
        `_insert_grouped` orders them. How many there are is known only on the device. The
        compiled kernel takes the grouping padded to the number of unique ids (trailing empty
        segments, which it skips), so nothing is read back; the CPU reference needs exact sizes
        and reads the missing ids back (one sync, free on the CPU)."""
        miss = slots < 0
        if self._padded_insert:
            return self._insert_padded(u, slots, score_vals, miss)
        idx = torch.nonzero(miss).flatten()  # exact sizes (the CPU reference: reading is free)
        n_new = idx.numel()
        if n_new == 0:
            return 0, 0, 0
        keys = u.uniq[idx]
        new_scores = torch.full_like(keys, self.step) if score_vals is None else score_vals[idx]
        new_slots, n_evicted = self._insert_grouped(keys, new_scores, self.step)
        slots[idx] = new_slots
        return n_new, (new_slots >= 0).sum(), n_evicted

    def _insert_padded(
        self,
        u: UniqueIds,
        slots: torch.Tensor,
        score_vals: torch.Tensor | None,
        miss: torch.Tensor,
        step: torch.Tensor | None = None,
    ) -> int | torch.Tensor:
        """`_insert_missing` without a device read: all U unique ids go to the op in `order`
        (the missing ones first, grouped by bucket as `_insert_grouped` groups them), with U
        segments of which the first n_seg are the real bucket groups and the rest empty (offset
        n_new, bucket 0). The op writes slots only for the first n_new ids; the rest of its
        output is ignored. ``step``: the step as a device tensor (a graphed lookup), else
        ``self.step``."""
        n = slots.numel()
        if n == 0:
            return 0, 0, 0
        nb = self.state.num_buckets
        bucket = torch.where(miss, self.ops.bucket_of(u.uniq, nb), nb)  # present ids sort last
        order = torch.argsort(bucket, stable=True)
        n_new = miss.sum()
        seg_offsets, seg_buckets = padded_segments(bucket[order], nb, n_new)
        keys = u.uniq[order]
        if score_vals is not None:
            new_scores = score_vals[order]
        elif step is None:
            new_scores = torch.full_like(keys, self.step)
        else:
            new_scores = step.expand(n).contiguous()
        raw, n_evicted = self._insert_op(keys, seg_offsets, seg_buckets, new_scores, step)
        valid = torch.arange(n, device=slots.device) < n_new  # the op's slots for the absent ids
        slots[order] = torch.where(valid, raw, slots[order])
        return n_new, (valid & (raw >= 0)).sum(), n_evicted

    def _insert_op(
        self,
        keys: torch.Tensor,
        seg_offsets: torch.Tensor,
        seg_buckets: torch.Tensor,
        scores: torch.Tensor,
        step: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {} if step is None else {"step_tensor": step}
        return self.ops.insert(
            self.state,
            keys,
            seg_offsets,
            seg_buckets,
            scores,
            self.step,
            self.dim,
            self.config.seed,
            self.config.init_args(),
            **kwargs,
        )

    def _count(self, n_unique: int, n_new, inserted, n_evicted) -> None:
        """Counts one training lookup for `stats` (lookups, hits, inserts, evictions,
        overflows): n_unique distinct ids, n_new of them absent, `inserted` of those given a row
        (the rest overflowed), n_evicted rows evicted for them. The insert's device counts go
        in with one op, not one per counter."""
        c = self._counters
        c.select(0, 0).add_(n_unique)
        rest = (n_unique - n_new, inserted, n_evicted, n_new - inserted)
        if all(isinstance(v, torch.Tensor) for v in rest):
            c[1:].add_(torch.stack(rest))
        else:
            for i, v in enumerate(rest, 1):
                c.select(0, i).add_(v)

    def _count_eval(self, n_unique: int, hits: torch.Tensor) -> None:
        """Counts one eval lookup (no inserts) for `stats`."""
        self._counters.select(0, 0).add_(n_unique)
        self._counters.select(0, 1).add_(hits)

    def _raise_reserved(self) -> None:
        raise ValueError(
            f"table {self.config.name!r}: id {EMPTY_KEY} (int64 min) is reserved for empty slots"
        )

    def _check_reserved(self, u: UniqueIds) -> None:
        if u.uniq.numel() and int(u.uniq[0]) == EMPTY_KEY:
            self._raise_reserved()

    def _score_values(
        self, u: UniqueIds, scores: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool]:
        policy = self.config.eviction_policy
        if policy == "lfu":
            return u.counts, True
        if policy == "custom" and scores is not None:
            if scores.numel() != u.inverse.numel():
                raise ValueError(
                    f"table {self.config.name!r}: {scores.numel()} scores for "
                    f"{u.inverse.numel()} ids"
                )
            vals = torch.full_like(u.uniq, torch.iinfo(torch.int64).min)
            vals.scatter_reduce_(0, u.inverse, scores.to(self.device, torch.int64), "amax")
            return vals, False
        return None, False

    def _insert_grouped(
        self, keys: torch.Tensor, scores: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Insert absent unique keys, given in priority order; returns their slots (-1 overflow)."""
        b = self.ops.bucket_of(keys, self.state.num_buckets)
        order = torch.argsort(b, stable=True)
        seg_buckets, seg_counts = torch.unique_consecutive(b[order], return_counts=True)
        seg_offsets = torch.zeros(seg_buckets.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(seg_counts, 0, out=seg_offsets[1:])
        slots_sorted, n_evicted = self._place_keys(
            keys[order], seg_offsets, seg_buckets, scores[order], step
        )
        slots = torch.empty_like(slots_sorted)
        slots[order] = slots_sorted
        return slots, n_evicted

    def _place_keys(
        self,
        keys: torch.Tensor,
        seg_offsets: torch.Tensor,
        seg_buckets: torch.Tensor,
        scores: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inserts keys grouped by bucket (the insert op's arguments) with their new rows."""
        return self.ops.insert(
            self.state,
            keys,
            seg_offsets,
            seg_buckets,
            scores,
            step,
            self.dim,
            self.config.seed,
            self.config.init_args(),
        )

    # -- optimizer --------------------------------------------------------------------------------
    def optimizer_args(self) -> tuple[int, float, float, float, float, float]:
        c = self.config
        return (OPT_CODES[c.optimizer], self.lr, c.beta1, c.beta2, c.eps, c.weight_decay)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = float(lr)

    # -- maintenance ------------------------------------------------------------------------------
    def erase(self, ids: torch.Tensor) -> int:
        """Remove ids from the table; returns how many were present."""
        ids = ids.to(device=self.device, dtype=torch.int64)
        return int(self.ops.erase(self.state, torch.unique(ids)))

    def set_scores(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrite the eviction score of ids already in the table (absent ones are ignored)."""
        ids = ids.to(device=self.device, dtype=torch.int64)
        slots = self.ops.find(self.state, ids)
        ok = slots >= 0
        self.state.scores[slots[ok]] = scores.to(self.device, torch.int64)[ok]
        if self._marks:  # a later incremental dump must carry these rows
            self._rescored.append(ids[ok].cpu())

    def size(self) -> int:
        return int(self.ops.size(self.state))

    def stats(self) -> dict[str, float]:
        lookups, hits, inserts, evictions, overflows = self._counters.tolist()
        rows = self.size()
        return {
            "rows": float(rows),
            "capacity": float(self.state.keys.numel()),
            "occupancy": rows / self.state.keys.numel(),
            "lookups": float(lookups),
            "hits": float(hits),
            "hit_rate": hits / lookups if lookups else 0.0,
            "inserts": float(inserts),
            "evictions": float(evictions),
            "overflows": float(overflows),
        }

    # -- checkpoint ---------------------------------------------------------------------------------
    def dump(self, since: int | None = None, mark: int | None = None) -> dict[str, torch.Tensor]:
        """Live rows ordered by key, on CPU: keys, values [n, dim], optimizer_state [n, S], scores,
        plus metadata (step, embedding_dim, optimizer code). Dumps of all ranks concatenated
        (`concat_dumps`) load into any number of ranks.

        Incremental dumps: ``mark`` (a token, e.g. a dump counter) remembers this dump's step and
        key set under that token (the last `MAX_DUMP_MARKS` marks are kept); ``since=token``
        then returns only the rows inserted or updated after that dump (trained, or rescored by
        `set_scores`) plus ``deleted_keys``, the keys of that dump no longer in the table
        (evicted or erased). `apply_increment` applies one to the earlier dump."""
        slots = self.ops.export(self.state)
        d = self.dim
        keys = self.state.keys[slots].cpu()
        base = None
        if since is not None:
            if since not in self._marks:
                raise ValueError(
                    f"table {self.config.name!r}: dump(since={since}) names no marked dump (kept: "
                    f"{sorted(self._marks)}); take a full dump with mark= first"
                )
            base = self._marks[since]
            changed = self.state.touched[slots] > base[0]
            rescored = self._rescored[base[2] :]
            if rescored:
                changed |= torch.isin(self.state.keys[slots], torch.cat(rescored).to(self.device))
            slots = slots[changed]
        rows = self._read_rows(slots)
        out = {
            "keys": self.state.keys[slots].cpu(),
            "values": rows[:, :d].contiguous(),
            "optimizer_state": rows[:, d : d + self.config.state_dim].contiguous(),
            "scores": self.state.scores[slots].cpu(),
            "step": torch.tensor(self.step, dtype=torch.int64),
            "embedding_dim": torch.tensor(d, dtype=torch.int64),
            "optimizer": torch.tensor(OPT_CODES[self.config.optimizer], dtype=torch.int64),
        }
        if base is not None:
            out["since"] = torch.tensor(int(since), dtype=torch.int64)
            out["deleted_keys"] = base[1][~torch.isin(base[1], keys)]
        if mark is not None:
            out["token"] = torch.tensor(int(mark), dtype=torch.int64)
            if not self._marks:
                self._rescored = []
            self._marks[int(mark)] = (self.step, torch.sort(keys).values, len(self._rescored))
            while len(self._marks) > MAX_DUMP_MARKS:
                self._marks.pop(next(iter(self._marks)))
        return out

    def load(self, dump: dict[str, torch.Tensor]) -> None:
        """Replace the contents with a dump (this rank keeps the ids it owns). Rows that do not fit
        (a smaller capacity) keep the highest scores; the others are dropped with a warning."""
        name = self.config.name
        missing = {"keys", "values", "optimizer_state", "scores", "step"} - set(dump)
        if missing:
            raise ValueError(f"table {name!r}: dump lacks {sorted(missing)}")
        dim = int(dump.get("embedding_dim", dump["values"].shape[1]))
        if dim != self.dim or dump["values"].shape[1] != self.dim:
            raise ValueError(f"table {name!r}: dump has embedding_dim={dim}, table has {self.dim}")
        opt = {v: k for k, v in OPT_CODES.items()}.get(int(dump.get("optimizer", -1)), "unknown")
        if "optimizer" in dump and opt != self.config.optimizer:
            raise ValueError(
                f"table {name!r}: dump was trained with optimizer={opt!r}, table uses "
                f"{self.config.optimizer!r}"
            )
        if dump["optimizer_state"].shape[1] != self.config.state_dim:
            raise ValueError(
                f"table {name!r}: dump has {dump['optimizer_state'].shape[1]} optimizer state "
                f"columns, {self.config.optimizer!r} needs {self.config.state_dim}"
            )
        # keys and scores go to the table's device; the rows stay where the dump is (the CPU)
        # until `_write_rows` puts them in place
        keys = dump["keys"].to(self.device, torch.int64)
        values = dump["values"].to(torch.float32)
        opt_state = dump["optimizer_state"].to(torch.float32)
        scores = dump["scores"].to(self.device, torch.int64)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table {name!r}: dump has duplicate keys")
        if self.world_size > 1:
            mine = reference_table.owner_of(keys, self.world_size) == self.rank
            keys, scores = keys[mine], scores[mine]
            mine = mine.to(values.device)
            values, opt_state = values[mine], opt_state[mine]
        if "deleted_keys" in dump:
            raise ValueError(
                f"table {name!r}: this is an incremental dump; apply it to the full dump it "
                "continues (apply_increment) and load the result"
            )
        self.state = self._allocate(self.state.keys.numel())
        if self._graphs is not None:  # they hold the old tensors' addresses
            self._graphs.clear()
        self._marks, self._rescored = {}, []  # earlier dumps no longer describe this table
        self.step = int(dump["step"])
        # Priority inside a bucket: higher score first, then smaller key.
        order = torch.argsort(keys, stable=True)
        order = order[torch.argsort(scores[order], descending=True, stable=True)]
        slots, _ = self._insert_grouped(keys[order], scores[order], step=-1)
        ok = slots >= 0
        pick = order[ok].to(values.device)
        self._write_rows(slots[ok], values[pick], opt_state[pick])
        self.state.touched.zero_()
        dropped = int((~ok).sum())
        if dropped:
            logger.warning(
                "table %r: %d rows of the dump did not fit and were dropped", name, dropped
            )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={c.name}, dim={c.embedding_dim}, slots={self.state.keys.numel()}, "
            f"optimizer={c.optimizer}, eviction={c.eviction_policy}, backend="
            f"{self.ops.__name__.rsplit('.', 1)[-1]}, rank={self.rank}/{self.world_size}"
        )


# the table class of each DynamicEmbeddingConfig.storage; hstu.embeddings.hybrid_table adds
# "hybrid" (the package imports it, so every user of this module has it)
TABLE_CLASSES: dict[str, type[DynamicEmbeddingTable]] = {"hbm": DynamicEmbeddingTable}


def make_dynamic_table(
    config: DynamicEmbeddingConfig,
    device: torch.device | str | None = None,
    *,
    backend: str = "auto",
    world_size: int = 1,
    rank: int = 0,
) -> DynamicEmbeddingTable:
    """The table (or one rank's shard) of ``config``: rows on the device (``storage='hbm'``)
    or in host memory with an HBM cache (``'hybrid'``, `HybridDynamicEmbeddingTable`)."""
    cls = TABLE_CLASSES[config.storage]
    return cls(config, device, backend=backend, world_size=world_size, rank=rank)


def table_host_ids(
    host_ids: dict[str, torch.Tensor] | None, feats: list[str]
) -> torch.Tensor | None:
    """The CPU ids of a table's features concatenated like its device ids, or None unless every
    feature has them."""
    if not host_ids or not feats or any(f not in host_ids for f in feats):
        return None
    return torch.cat([host_ids[f].to(torch.int64) for f in feats])


def concat_dumps(dumps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Merge the per-rank dumps of one table into one (any rank count can load the result).
    Incremental dumps of the same token merge alike (their deleted keys too)."""
    out = {
        k: torch.cat([d[k] for d in dumps]) for k in ("keys", "values", "optimizer_state", "scores")
    }
    order = torch.argsort(out["keys"])  # ordered by key, like a single table's dump
    out = {k: v[order] for k, v in out.items()}
    out["step"] = torch.stack([d["step"] for d in dumps]).max()
    for k in ("embedding_dim", "optimizer", "token", "since"):
        if k in dumps[0]:
            out[k] = dumps[0][k]
    if "deleted_keys" in dumps[0]:
        out["deleted_keys"] = torch.sort(torch.cat([d["deleted_keys"] for d in dumps])).values
    return out


def apply_increment(
    base: dict[str, torch.Tensor], increment: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The full dump that ``increment`` (``dump(since=base's token)``) continues ``base`` into:
    rows of deleted keys removed, changed rows replaced, new rows added; ordered by key. Apply a
    chain one increment after the other."""
    if "deleted_keys" not in increment:
        raise ValueError("apply_increment: the second dump is not incremental (no deleted_keys)")
    if "token" not in base or int(base["token"]) != int(increment["since"]):
        raise ValueError(
            f"apply_increment: the increment continues dump token {int(increment['since'])}, "
            f"but the base dump has token "
            f"{int(base['token']) if 'token' in base else 'none (not a marked dump)'}"
        )
    gone = torch.isin(base["keys"], increment["deleted_keys"]) | torch.isin(
        base["keys"], increment["keys"]
    )
    rows = ("keys", "values", "optimizer_state", "scores")
    out = {k: torch.cat([base[k][~gone], increment[k]]) for k in rows}
    order = torch.argsort(out["keys"])
    out = {k: v[order] for k, v in out.items()}
    for k in ("step", "embedding_dim", "optimizer"):
        out[k] = increment[k]
    if "token" in increment:
        out["token"] = increment["token"]
    return out


def _split_tables(dump: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in dump.items():
        table, field_name = key.split("/", 1)
        out.setdefault(table, {})[field_name] = value
    return out


def apply_collection_increment(
    base: dict[str, torch.Tensor], increments: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """A collection's full dump ``base`` (``dump(mark=True)``) moved forward by a chain of
    incremental dumps (each ``dump(since=the previous one's token, mark=True)``), table by
    table: equals a full dump taken when the last increment was."""
    tables = _split_tables(base)
    for inc in increments:
        inc_tables = _split_tables(inc)
        if set(inc_tables) != set(tables):
            raise ValueError(
                f"apply_collection_increment: the increment has tables {sorted(inc_tables)}, "
                f"the base {sorted(tables)}"
            )
        tables = {n: apply_increment(tables[n], inc_tables[n]) for n in tables}
    return {f"{n}/{k}": v for n, d in tables.items() for k, v in d.items()}


class DynamicEmbeddingCollection(nn.Module):
    """Dynamic tables looked up with a KeyedJaggedTensor, like torchrec's EmbeddingCollection:
    forward(features) -> {feature name: JaggedTensor of [n, dim] embeddings}. Features sharing a
    table are looked up together (one dedup, one kernel chain). Under the 'custom' eviction policy
    the KJT weights are the eviction scores."""

    def __init__(
        self,
        tables: list[DynamicEmbeddingConfig],
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self._configs = list(tables)
        self.device = torch.device(device if device is not None else "cpu")
        self._backend = backend
        self._feature_to_table: dict[str, str] = {}
        names = [c.name for c in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"DynamicEmbeddingCollection: duplicate table names in {names}")
        for c in tables:
            if not isinstance(c, DynamicEmbeddingConfig):
                raise TypeError(f"tables must be DynamicEmbeddingConfig, got {type(c).__name__}")
            for f in c.feature_names:
                if f in self._feature_to_table:
                    raise ValueError(
                        f"feature {f!r} is mapped to tables {self._feature_to_table[f]!r} and "
                        f"{c.name!r}"
                    )
                self._feature_to_table[f] = c.name
        # A plain dict (a ModuleDict would reject names such as "items" or "keys"); the tables
        # are registered as children "table_<name>" so train()/eval() reach them.
        self._dump_count = 0  # tokens of marked dumps
        self.tables: dict[str, DynamicEmbeddingTable] = {}
        for c in tables:
            self.tables[c.name] = self._make_table(c)
            self.add_module(f"table_{c.name}", self.tables[c.name])

    def _make_table(self, config: DynamicEmbeddingConfig) -> DynamicEmbeddingTable:
        return make_dynamic_table(config, self.device, backend=self._backend)

    def embedding_configs(self) -> list[DynamicEmbeddingConfig]:
        return list(self._configs)

    def table_of(self, feature: str) -> DynamicEmbeddingTable:
        """The table that serves ``feature``."""
        if feature not in self._feature_to_table:
            raise KeyError(f"feature {feature!r} has no dynamic table: {self.feature_names()}")
        return self.tables[self._feature_to_table[feature]]

    def feature_names(self) -> list[str]:
        return list(self._feature_to_table)

    def forward(
        self, features: KeyedJaggedTensor, host_ids: dict[str, torch.Tensor] | None = None
    ) -> dict[str, JaggedTensor]:
        """``host_ids``: feature -> the same ids on the CPU, where known (see
        `DynamicEmbeddingTable.forward`); a table uses them when all its features have them."""
        jts = features.to_dict()
        values = {f: jt.values() for f, jt in jts.items()}
        weights = {f: jt.weights_or_none() for f, jt in jts.items()}
        out: dict[str, JaggedTensor] = {}
        for table, feats, ids, scores, host in self._table_inputs(values, host_ids, weights):
            emb = table(ids, scores, host_ids=host)
            sizes = [jts[f].values().numel() for f in feats]
            for f, e in zip(feats, torch.split(emb, sizes)):
                out[f] = JaggedTensor(values=e, lengths=jts[f].lengths(), offsets=jts[f].offsets())
        return out

    def _table_inputs(self, values: dict[str, torch.Tensor], host_ids, weights=None, every=False):
        """(table, its features in ``values``, their ids concatenated, scores or None, CPU ids or
        None) for each table that ``values`` (feature -> ids) looks up (``every``: each table,
        the ones without a feature here with no ids). ``weights``: feature -> the ids' weights
        or None (the 'custom' policy's scores)."""
        unknown = [f for f in values if f not in self._feature_to_table]
        if unknown:
            raise ValueError(
                f"features {unknown} have no dynamic table; configured: {self.feature_names()}"
            )
        for table in self.tables.values():
            feats = [f for f in table.config.feature_names if f in values]
            if not feats:
                if every:
                    empty = torch.empty(0, dtype=torch.int64, device=self.device)
                    yield table, feats, empty, None, torch.empty(0, dtype=torch.int64)
                continue
            for f in feats:
                if values[f].dtype not in (torch.int32, torch.int64):
                    raise TypeError(
                        f"feature {f!r}: ids must be int32/int64, got {values[f].dtype}"
                    )
            ids = torch.cat([values[f].to(torch.int64) for f in feats])
            scores = None
            if table.config.eviction_policy == "custom" and weights is not None:
                ws = [weights.get(f) for f in feats]
                if all(w is not None for w in ws):
                    scores = torch.cat(ws)
            yield table, feats, ids, scores, table_host_ids(host_ids, feats)

    def lookup_tables(
        self,
        values: dict[str, torch.Tensor],
        host_ids: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Table name -> the rows that `forward` would look up for the features' ids ``values``
        (feature -> ids; a table's features concatenated in its feature order), each a table's
        plain lookup (training: inserted, touched, trained by the backward of these rows).
        ``host_ids``: the same ids on the CPU, where known. Not for the 'custom' policy (its
        scores come with the ids of a KeyedJaggedTensor)."""
        return self._lookup_tables(values, host_ids, every=False)

    def _lookup_tables(self, values, host_ids, every: bool) -> dict[str, torch.Tensor]:
        out = {}
        for table, _, ids, _, host in self._table_inputs(values, host_ids, every=every):
            if table.config.eviction_policy == "custom":
                raise ValueError(
                    f"lookup_tables: table {table.config.name!r} has eviction_policy='custom', "
                    "whose scores come with the ids (look it up through forward)"
                )
            out[table.config.name] = table(ids, host_ids=host)
        return out

    def stage(self, rows: dict[str, torch.Tensor] | None) -> None:
        """`DynamicEmbeddingTable.stage` for each table: ``rows`` maps table names to the rows
        their training lookups return (tables not named are staged with nothing); None ends
        the staging of every table."""
        rows = rows or {}
        unknown = [n for n in rows if n not in self.tables]
        if unknown:
            raise KeyError(f"stage: no dynamic tables {unknown}; tables: {list(self.tables)}")
        for name, table in self.tables.items():
            table.stage(rows.get(name))

    # -- fused optimizer, stats, checkpoint ----------------------------------------------------------
    @property
    def fused_optimizer(self) -> dict[str, dict[str, float | str]]:
        """Per-table optimizer settings; updates happen inside backward (no dense optimizer)."""
        return {
            n: {
                "optimizer": t.config.optimizer,
                "lr": t.lr,
                "beta1": t.config.beta1,
                "beta2": t.config.beta2,
                "eps": t.config.eps,
                "weight_decay": t.config.weight_decay,
            }
            for n, t in self.tables.items()
        }

    def set_learning_rate(self, lr: float, table: str | None = None) -> None:
        for n, t in self.tables.items():
            if table is None or n == table:
                t.set_learning_rate(lr)

    def stats(self) -> dict[str, float]:
        """Flat `{table}/{stat}` numbers for TensorBoard."""
        return {f"{n}/{k}": v for n, t in self.tables.items() for k, v in t.stats().items()}

    def dump(self, since: int | None = None, mark: bool = False) -> dict[str, torch.Tensor]:
        """`{table}/{field}` tensors of every table (this rank's rows when sharded).

        ``mark=True`` numbers this dump (a `{table}/token` entry) so that a later
        ``dump(since=token)`` writes only what changed since (see `DynamicEmbeddingTable.dump`;
        `apply_collection_increment` applies it). Every rank of a sharded collection must mark
        the same dumps."""
        token = None
        if mark:
            self._dump_count += 1
            token = self._dump_count
        return {
            f"{n}/{k}": v
            for n, t in self.tables.items()
            for k, v in t.dump(since=since, mark=token).items()
        }

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in self.tables.items():
            sub = {k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == n}
            if not sub:
                raise ValueError(f"load: no entries for table {n!r}")
            t.load(sub)
