"""Hybrid dynamic embedding tables: every row in host memory, the hot rows cached in HBM.

A `HybridDynamicEmbeddingTable` is a `DynamicEmbeddingTable` (same hash, buckets, eviction,
initialiser and fused optimizers, so the same results) whose rows do not all fit in GPU memory.
It is split in three parts:

- the **slot directory**, on the device: key, eviction score and last-use step of every slot
  (24 B per slot), exactly the metadata of the all-HBM table. Finding, inserting and evicting
  keys run on it as on the all-HBM table (find and the training lookups' inserts with the same
  kernels, the insert writing no rows; loads and the CPU with the reference's ranking in torch
  ops, `reference_table.insert_keys`), so a key is in the table, and in which slot, exactly when
  it would be in the all-HBM table;
- the **host tier**, `HostRows`: one row (embedding + optimizer state) per slot, in host memory
  (page-locked and mapped into the GPU's address space on CUDA, so the GPU gathers and writes
  rows over PCIe without the host waiting);
- the **HBM cache**: ``cache_rows`` rows on the device, fully associative. ``slot_row[s]`` is the
  cache row holding slot ``s`` (-1: not cached). A training lookup puts every row of its batch in
  the cache (fetched from the host tier, or initialised for a new key: one `place_rows` op) and
  the fused update runs on the cached rows with the same kernels as the all-HBM table. The
  free-row count stays on the device; the host keeps a lower bound of it (`free_lb`) from reads
  queued without waiting, so a lookup waits for the GPU only when the bound is short. Ahead of
  need the cache evicts, in batches, the rows with the lowest eviction scores of the table's
  policy (LRU: last step used, LFU: use count, custom: given scores) that no pending lookup uses,
  and writes them back to the host tier: on CUDA a copy of the evicted rows is written by a side
  stream while the step goes on, and the next read of the host tier waits for it on the GPU (an
  event).

For a key, the cached row, when there is one, is the current one; otherwise the host row is.
`dump()` reads both, so a hybrid table dumps exactly what the all-HBM table dumps, and `load()`
fills the host tier. On CPU (development mode, CI) the same logic runs with the reference ops
and both tiers in ordinary memory.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from hstu.config.limits import hybrid_device_bytes
from hstu.embeddings import reference_table
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    _DTYPES,
    TABLE_CLASSES,
    DynamicEmbeddingTable,
    UniqueIds,
    _FusedLookup,
)
from hstu.embeddings.reference_table import EMPTY_KEY, TableState

__all__ = ["HybridDynamicEmbeddingTable", "HostRows"]

logger = logging.getLogger(__name__)

_INT64_MAX = 2**63 - 1
# lookups with grad whose backward has not run keep their rows cached; older ones are forgotten
MAX_PENDING_STEPS = 8
# keys per chunk when many keys are placed at once (load): bounds the [buckets, 32] temporaries
_PLACE_CHUNK = 1 << 20
# cudaHostRegisterPortable | cudaHostRegisterMapped
_HOST_REGISTER_FLAGS = 3


class _DeviceArray:
    """``__cuda_array_interface__`` of a device-visible pointer (here: mapped host memory)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": "<f4",
            "strides": None,
            "version": 2,
        }


def _unregister(cudart, tensor: torch.Tensor) -> None:
    cudart.cudaHostUnregister(tensor.data_ptr())


class HostRows:
    """The host tier of a hybrid table: rows [num_slots, width] fp32, row s for slot s.

    On CUDA the memory is page-locked (``cudaHostRegister``, mapped) and ``view`` is a CUDA
    tensor over the same bytes: `gather` is a GPU gather reading host memory over PCIe and
    `scatter` a GPU scatter writing it, on a side stream. Where the mapping is not available the
    copies go through the CPU (the host waits for them). On CPU/meta tables ``rows`` is an
    ordinary tensor of the table's device."""

    def __init__(self, num_slots: int, width: int, device: torch.device, copy_rows) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._copy_rows = copy_rows  # the table backend's masked row copy
        host = torch.device("cpu") if device.type == "cuda" else device
        self.rows = torch.empty((num_slots, width), dtype=torch.float32, device=host)
        self.view: torch.Tensor | None = None
        self.stream: torch.cuda.Stream | None = None
        self._written: torch.cuda.Event | None = None  # the last write-back
        if device.type == "cuda":
            self._map()

    def _map(self) -> None:
        """Page-locks ``rows`` and maps it for the GPU; on failure the staged path is used."""
        nbytes = self.rows.numel() * self.rows.element_size()
        if nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.rows.data_ptr(), nbytes, _HOST_REGISTER_FLAGS)
        if int(err) != 0:
            logger.warning(
                "hybrid table: page-locking %d bytes of host memory failed (%s); the host tier "
                "is copied through the CPU instead (slower, the host waits)",
                nbytes,
                err,
            )
            return
        self._finalizer = weakref.finalize(self, _unregister, cudart, self.rows)
        with torch.cuda.device(self.device):
            view = torch.as_tensor(
                _DeviceArray(self.rows.data_ptr(), tuple(self.rows.shape)), device=self.device
            )
            # the GPU must see the host's bytes through the view (unified addressing)
            probe = torch.arange(2, dtype=torch.float32) + 0.25
            self.rows.view(-1)[:2] = probe
            if view.device != self.device or not torch.equal(view.view(-1)[:2].cpu(), probe):
                logger.warning("hybrid table: mapped host memory is not visible to the GPU")
                return
            # rows move as 16-byte elements (widths are multiples of 4 floats): fewer, wider
            # PCIe transactions; the bytes are copied, never computed on
            self.view = view.view(torch.complex128)
            self.stream = torch.cuda.Stream(self.device)

    @property
    def mapped(self) -> bool:
        return self.view is not None

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` (a tensor of the table's device) on the table's device."""
        if self.view is not None:
            if self._written is not None:  # rows written back must have landed first
                torch.cuda.current_stream(self.device).wait_event(self._written)
            return self.view.index_select(0, slots).view(torch.float32)
        if self.device.type == "cuda":
            return self.rows.index_select(0, slots.cpu()).to(self.device)
        return self.rows.index_select(0, slots)

    def device_view(self) -> torch.Tensor:
        """The rows as a float32 CUDA tensor over the mapped memory, for a read by the GPU on
        the current stream: that stream first waits for the rows written back so far."""
        if self._written is not None:
            torch.cuda.current_stream(self.device).wait_event(self._written)
        return self.view.view(torch.float32)

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows[i]`` (device tensor, owned by the caller's stream) into slot
        ``slots[i]`` for every ``slots[i] >= 0``. On the mapped path the write runs on the side
        stream after the work queued so far."""
        if self.view is not None:
            main = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                every = torch.arange(slots.numel(), device=self.device)
                self._copy_rows(self.view.view(torch.float32), slots, rows, every)
            slots.record_stream(self.stream)
            rows.record_stream(self.stream)
            every.record_stream(self.stream)
            self._written = self.stream.record_event()
            return
        keep = torch.nonzero(slots >= 0).flatten()
        if self.device.type == "cuda":
            self.rows.index_copy_(0, slots[keep].cpu(), rows[keep].cpu())
        else:
            self.rows.index_copy_(0, slots[keep], rows[keep])

    def synchronize(self) -> None:
        """Waits until every queued read and write of the host tier is done."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``slots`` on the CPU (checkpoints)."""
        self.synchronize()
        return self.rows.index_select(0, slots.to(self.rows.device)).cpu()

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` into ``slots`` from the host (checkpoint loads)."""
        self.synchronize()
        self.rows.index_copy_(0, slots.to(self.rows.device), rows.to(self.rows.device))


@dataclass
class _FreeCountRead:
    """A copy of the cache's free-row count queued into page-locked ``buffer[slot]``: done when
    ``event`` (None on CPU: at once) has completed. ``since``: distinct ids of the lookups issued
    after it (rows they may have taken); ``evictions``: background evictions it accounts for."""

    slot: int
    event: torch.cuda.Event | None
    evictions: int
    since: int = 0

    def done(self) -> bool:
        return self.event is None or self.event.query()


class HybridDynamicEmbeddingTable(DynamicEmbeddingTable):
    """A `DynamicEmbeddingTable` (or one rank's shard) with ``config.storage == 'hybrid'``:
    the slot directory and a cache of ``config.cache_rows(slots)`` rows on the device, every row
    in host memory (see the module docstring). Lookups, updates, stats, dumps and loads give
    exactly what the all-HBM table gives."""

    # its lookup brings rows in from the host tier, polls free rows from the host: eager
    lookup_graphs_supported = False

    def __init__(
        self,
        config: DynamicEmbeddingConfig,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__(config, device, backend=backend, world_size=world_size, rank=rank)
        self._init = config.init_args()
        # rows fetched from the host tier, rows written back, cache hits, cache lookups
        self._cache_counters = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._pending: list[int] = []  # steps whose lookup's backward has not run

    # misses are fetched from the host tier with host reads: no graph-safe serving lookup
    serves_without_sync = False

    # -- tensors ----------------------------------------------------------------------------
    def _memory_need(self, num_slots: int) -> tuple[int, int]:
        """Directory (24 B per slot) + slot -> cache row (4 B) + the cache (row, key, slot and
        free-list entry) on the device, each index with one spare entry; every row in host
        memory."""
        rows = self.config.cache_rows(num_slots)
        return hybrid_device_bytes(num_slots, rows, self.width), num_slots * self.width * 4

    def _allocate(self, num_slots: int) -> TableState:
        """The directory (no rows), and on first use the host tier and the cache; afterwards
        (`load`) the same memory, emptied.

        The cache's index tensors (``cache_slot``, ``slot_row``, the key of each row, the free
        list) have one spare entry at the end: a padded update writes the entries it does not
        use there, so no update needs to know on the host how many entries it changes."""
        dev = self.device
        directory = TableState(
            keys=torch.full((num_slots,), EMPTY_KEY, dtype=torch.int64, device=dev),
            scores=torch.zeros(num_slots, dtype=torch.int64, device=dev),
            touched=torch.zeros(num_slots, dtype=torch.int64, device=dev),
            values=torch.empty((0, self.width), dtype=torch.float32, device=dev),
        )
        if not hasattr(self, "host"):
            self.host = HostRows(num_slots, self.width, dev, self.ops.copy_rows)
            rows = self.config.cache_rows(num_slots)
            self._row_keys = torch.empty(rows + 1, dtype=torch.int64, device=dev)
            self.cache = TableState(
                keys=self._row_keys[:rows],  # key held, EMPTY: free
                scores=torch.empty(0, dtype=torch.int64, device=dev),  # (unused)
                touched=torch.empty(0, dtype=torch.int64, device=dev),  # (unused)
                values=torch.zeros((rows, self.width), dtype=torch.float32, device=dev),
            )
            self.cache_slot = torch.empty(rows + 1, dtype=torch.int64, device=dev)
            self.slot_row = torch.empty(num_slots + 1, dtype=torch.int32, device=dev)
            # free cache rows: a stack, _free[:n_free] (n_free on the device)
            self._free = torch.empty(rows + 1, dtype=torch.int64, device=dev)
            self._n_free = torch.zeros((), dtype=torch.int64, device=dev)
            # evictions come in batches (one top-k over the cache each) of at least 1/64 of
            # the cache and start ahead, when fewer rows than that may be free, so their
            # write-back overlaps steps
            self.evict_batch = max(1, rows // 64)
            # the host's view of n_free: a lower bound (free_lb) from reads of n_free queued
            # without waiting (a pinned buffer and an event each) less the rows taken since
            self._reads: list[_FreeCountRead] = []
            self._read_bufs = torch.zeros(2, dtype=torch.int64, pin_memory=dev.type == "cuda")
            self._read_seq = 0
            self._evictions = 0  # background evictions issued
            self._evictions_seen = 0  # ... of which a completed read of n_free accounts for
        self.host.synchronize()
        self._row_keys.fill_(EMPTY_KEY)
        self.cache_slot.fill_(-1)
        self.slot_row.fill_(-1)
        rows = self.cache.keys.numel()
        self._free[:rows].copy_(torch.arange(rows - 1, -1, -1, device=dev))
        self._n_free.fill_(rows)
        self._reads.clear()
        self.free_lb = rows
        self._evictions_seen = self._evictions
        return directory

    def row_state(self) -> TableState:
        return self.cache

    @property
    def cache_rows(self) -> int:
        return self.cache.keys.numel()

    @property
    def n_free(self) -> int:
        """Free cache rows now (reads the device)."""
        return int(self._n_free)

    # -- lookup ---------------------------------------------------------------------------------
    def forward(
        self,
        ids: torch.Tensor,
        scores: torch.Tensor | None = None,
        *,
        host_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `DynamicEmbeddingTable.forward`; a training lookup also brings its rows into the
        HBM cache. With the compiled kernels it reads nothing from the GPU while the cache has
        room for the lookup's distinct ids by the host's count (`free_lb`); see `_reserve`."""
        if self._staged is not None and self.training:
            return self._staged_rows(ids)
        u = self._unique(ids, host_ids)
        n_unique = u.uniq.numel()
        dtype = _DTYPES[self.config.output_dtype]
        if not self.training:
            slots = self.ops.find(self.state, u.uniq)
            self._count_eval(n_unique, (slots >= 0).sum())
            return self._eval_rows(u, slots).to(dtype)
        self.step += 1
        self._reserve(n_unique)
        score_vals, accumulate = self._score_values(u, scores)
        slots = self.ops.find(self.state, u.uniq, True, self.step, score_vals, accumulate)
        miss = slots < 0  # (before the insert fills in the new keys' slots)
        self._count(n_unique, *self._insert_missing(u, slots, score_vals))
        rows = self._place(u, slots, miss)
        self._after_lookup(n_unique)
        if torch.is_grad_enabled():
            self._pending = [p for p in self._pending if p > self.step - MAX_PENDING_STEPS]
            self._pending.append(self.step)
            dummy = torch.empty(0, device=self.device, requires_grad=True)
            out = _FusedLookup.apply(dummy, self, u, rows)
        else:
            out = self.ops.gather(self.cache, self.dim, rows, u.inverse)
        return out.to(dtype)

    def _backward_done(self, step: int) -> None:
        if step in self._pending:
            self._pending.remove(step)

    def _place_keys(
        self,
        keys: torch.Tensor,
        seg_offsets: torch.Tensor,
        seg_buckets: torch.Tensor,
        scores: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Places keys in the directory (no rows: those are the cache's and the host tier's),
        in chunks of whole buckets when there are many (a load)."""
        n = keys.numel()
        if n <= _PLACE_CHUNK:
            return reference_table.insert_keys(
                self.state, keys, seg_offsets, seg_buckets, scores, step
            )
        offsets = seg_offsets.cpu()
        slots, evicted, s0 = [], torch.zeros((), dtype=torch.int64, device=keys.device), 0
        while s0 < seg_buckets.numel():
            lo = int(offsets[s0])
            s1 = int(torch.searchsorted(offsets, lo + _PLACE_CHUNK, right=True)) - 1
            s1 = min(max(s1, s0 + 1), seg_buckets.numel())
            hi = int(offsets[s1])
            part, ev = reference_table.insert_keys(
                self.state,
                keys[lo:hi],
                seg_offsets[s0 : s1 + 1] - lo,
                seg_buckets[s0:s1],
                scores[lo:hi],
                step,
            )
            slots.append(part)
            evicted = evicted + ev
            s0 = s1
        return torch.cat(slots), evicted

    # -- the cache --------------------------------------------------------------------------------
    def _place(self, u: UniqueIds, slots: torch.Tensor, miss: torch.Tensor) -> torch.Tensor:
        """The cache row of every unique id of a training lookup (-1 where the directory had no
        slot: overflow), bringing the missing rows in: from the host tier, or initial rows for
        the ids whose key took its slot in this lookup (``miss``). One op (`place_rows`) of the
        table's backend; with the host tier not mapped for the GPU, the PyTorch one over the
        host rows."""
        if self.host.mapped:
            ops, host = self.ops, self.host.device_view()
        else:
            ops, host = reference_table, self.host.rows
        return ops.place_rows(
            self.cache.values,
            self._row_keys,
            self.cache_slot,
            self.slot_row,
            self._free,
            self._n_free,
            host,
            slots,
            miss,
            u.uniq,
            self.dim,
            self.config.seed,
            self._init,
            self._cache_counters,
        )

    def _push_free(self, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """Frees the cache rows ``rows[mask]`` without writing them back (their keys left the
        table, or the caller wrote them back)."""
        at = torch.where(mask, rows, self.cache_rows)
        self._row_keys.index_fill_(0, at, EMPTY_KEY)  # (a scalar fill: no copy from the host)
        self.cache_slot.index_fill_(0, at, -1)
        rank = torch.cumsum(mask, 0) - 1
        self._free[torch.where(mask, self._n_free + rank, self.cache_rows)] = rows
        self._n_free += mask.sum()

    # -- how many rows are free, seen from the host ------------------------------------------
    def _poll_reads(self) -> None:
        """Applies the newest completed read of n_free: free_lb = the value read less the rows
        lookups may have taken since it was queued (rows freed since are not counted)."""
        done = None
        while self._reads and self._reads[0].done():
            done = self._reads.pop(0)
        if done is not None:
            self.free_lb = int(self._read_bufs[done.slot]) - done.since
            self._evictions_seen = done.evictions

    def _queue_read(self) -> None:
        """Queues a copy of n_free to a pinned buffer (at most two in flight)."""
        if len(self._reads) >= 2:
            return
        slot = self._read_seq % 2
        self._read_seq += 1
        self._read_bufs[slot].copy_(self._n_free, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # the copy's stream
        self._reads.append(_FreeCountRead(slot, event, self._evictions))

    def _reserve(self, n: int) -> None:
        """Makes sure ``n`` cache rows are free before a lookup of ``n`` distinct ids takes
        them. Free when the host's bound says so; otherwise it reads n_free (one wait for the
        GPU) and, if still short, evicts at once (a `ValueError` if the cache cannot hold the
        lookup)."""
        self._poll_reads()
        if self.free_lb >= n:
            return
        self._reads.clear()
        self.free_lb = self.n_free
        self._evictions_seen = self._evictions
        if self.free_lb < n:
            short = n - self.free_lb
            self._evict(max(short, self.evict_batch), needed=short)
            self.free_lb = self.n_free

    def _after_lookup(self, n: int) -> None:
        """Counts the rows a lookup of ``n`` distinct ids may have taken; starts a background
        eviction of max(evict_batch, 4n) rows when the bound falls under that many, so
        that the next lookups find room without a read while the read of the eviction's result
        is under way (one eviction at a time: the next waits until a read shows the last one);
        queues the next read of n_free."""
        self.free_lb -= n
        for read in self._reads:
            read.since += n
        ahead = max(self.evict_batch, 4 * n)
        if self.free_lb < ahead and self._evictions_seen == self._evictions:
            self._evict(ahead, needed=0)
            self._evictions += 1
        self._queue_read()

    def _evict(self, k: int, needed: int) -> None:
        """Writes back and frees up to ``k`` cached rows, lowest eviction score first, among the
        rows that no pending lookup uses (rows last used at or after the oldest step whose
        backward has not run). ``needed > 0``: at least that many, checked on the host (a
        `ValueError` if fewer are evictable); ``needed == 0``: nothing is read back, and fewer
        than ``k`` rows go when fewer are evictable."""
        oldest = min([*self._pending, self.step])
        held = self.cache_slot[: self.cache_rows] >= 0
        s = self.cache_slot[: self.cache_rows].clamp(min=0)
        evictable = held & (self.state.touched[s] < oldest)
        if needed > 0:
            n_evictable = int(evictable.sum())
            if n_evictable < needed:
                in_use = int(held.sum()) - n_evictable
                n_free = self.n_free
                raise ValueError(
                    f"table {self.config.name!r}: the HBM cache of {self.cache_rows} rows is too "
                    f"small: this lookup needs room for its {needed + n_free} distinct ids but "
                    f"only {n_free + n_evictable} rows are free or evictable (the other {in_use} hold "
                    "rows of this lookup or of lookups whose backward has not run); give the "
                    "cache room for at least two batches' distinct ids (EmbeddingArgs.hbm_cache "
                    "/ DynamicEmbeddingConfig.hbm_cache)"
                )
            k = min(k, n_evictable)
        k = min(k, self.cache_rows)
        if k == 0:
            return
        score = torch.where(evictable, self.state.scores[s], _INT64_MAX)
        victims = torch.topk(score, k, largest=False, sorted=False).indices
        ok = evictable[victims]
        vslots = torch.where(ok, self.cache_slot[victims], -1)
        self.host.scatter(vslots, self.cache.values[victims])
        self._cache_counters[1] += ok.sum()
        self.slot_row.index_fill_(0, torch.where(ok, vslots, self.slot_row.numel() - 1), -1)
        self._push_free(victims, ok)

    def _eval_rows(self, u: UniqueIds, slots: torch.Tensor) -> torch.Tensor:
        """Evaluation: embeddings of the ids in the cache or the host tier, zeros for unknown
        ids; the cache is left as it is."""
        found = slots >= 0
        rows = torch.where(found, self.slot_row[slots.clamp(min=0)].long(), -1)
        every = torch.arange(rows.numel(), device=self.device)
        vals = self.ops.gather(self.cache, self.dim, rows, every)
        from_host = torch.nonzero(found & (rows < 0)).flatten()
        if from_host.numel():
            vals[from_host] = self.host.gather(slots[from_host])[:, : self.dim]
        return vals[u.inverse]

    # -- maintenance and checkpoints ------------------------------------------------------------
    def erase(self, ids: torch.Tensor) -> int:
        ids = torch.unique(ids.to(device=self.device, dtype=torch.int64))
        slots = self.ops.find(self.state, ids)
        live = slots[slots >= 0]
        rows = self.slot_row[live].long()
        self._push_free(rows, rows >= 0)
        self.slot_row[live] = -1  # (rows only freed: the host's lower bound stays valid)
        return super().erase(ids)

    def _read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Current rows of live slots on the CPU: the cached copy where there is one, else the
        host tier's (nothing is written back)."""
        out = self.host.read(slots)
        rows = self.slot_row[slots].long()
        cached = torch.nonzero(rows >= 0).flatten()
        if cached.numel():
            out[cached.cpu()] = self.cache.values[rows[cached]].cpu()
        return out

    def _write_rows(self, slots: torch.Tensor, values: torch.Tensor, state: torch.Tensor) -> None:
        """Loads go to the host tier (the cache is empty after a load)."""
        rows = torch.zeros(values.shape[0], self.width, dtype=torch.float32)
        rows[:, : self.dim] = values.cpu()
        rows[:, self.dim : self.dim + self.config.state_dim] = state.cpu()
        self.host.write(slots, rows)

    def stats(self) -> dict[str, float]:
        """The all-HBM table's stats, plus the cache's: rows, occupancy, hit rate (ids of
        training lookups already cached / those in the table), rows fetched from and written
        back to the host tier."""
        out = super().stats()
        fetched, written, hits, lookups = self._cache_counters.tolist()
        rows = self.cache_rows
        out.update(
            {
                "cache_rows": float(rows),
                "cache_occupancy": (rows - self.n_free) / rows,
                "cache_lookups": float(lookups),
                "cache_hits": float(hits),
                "cache_hit_rate": hits / lookups if lookups else 0.0,
                "cache_fetches": float(fetched),
                "cache_writebacks": float(written),
            }
        )
        return out

    def extra_repr(self) -> str:
        where = "mapped" if self.host.mapped else self.host.rows.device.type
        return (
            f"{super().extra_repr()}, storage=hybrid, cache_rows={self.cache_rows}, "
            f"host_rows={where}"
        )


TABLE_CLASSES["hybrid"] = HybridDynamicEmbeddingTable
