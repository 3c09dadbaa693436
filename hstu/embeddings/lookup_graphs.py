"""CUDA graphs of a dynamic table's training lookup.

A training lookup (`DynamicEmbeddingTable.forward`) is ~40 small ops per table: the sort and
deduplication of the ids, the find that touches the rows, the insert of the absent ids grouped by
bucket, the counters. Their GPU work is small; issuing them is not (docs/benchmarks.md: the
dynamic tables were the largest part of the graphed ranking step's host time). `LookupGraphs`
captures them once per padded id count and replays them with one launch.

Shapes. The ids are copied into a buffer of `padded_token_count(n, ID_SIZES_PER_OCTAVE)`
entries (8 sizes per power of two, multiples of 128 below 1024); `UniqueIds.padded`
deduplicates the first n at sizes fixed by the buffer, so the capture needs no count from the
device. The padding entries of the unique ids
are EMPTY_KEY (never found, never inserted), so they touch, insert and train nothing.

What a replay reads. The ids and their count from the entry's buffers, the table's step from
`LookupGraphs.step` (the find and insert kernels read it from device memory: a CUDA graph
bakes scalar arguments in). The table's tensors keep their addresses between steps; a `load`
replaces them and drops the graphs (`DynamicEmbeddingTable.load`).

Outside the graph. The gather of the rows (its [n, dim] output would be held per graph) and the
fused optimizer's update in backward: one op each. The update reads the entry's unique ids, so
an entry is pending from a lookup with gradients until its backward has run (or its autograd
graph is gone). The table's graphs share one memory pool, so a replay may overwrite what
another graph left: while any entry is pending, lookups (the same table twice in one step) run
eagerly.

When. The first lookup of a count runs the padded ops eagerly (also setting up their kernels),
the second captures and replays; later ones replay. Up to `MAX_GRAPHS` counts per table and
`MAX_GRAPH_BYTES` of their buffers (~64 bytes per padded id); new counts past either run
eagerly. A capture that fails turns the table's graphs off (eager from then on; the table's
state is untouched: a capture runs nothing). `LookupGraphs.stats` counts it all (`GraphStats`).
Results are those of the eager lookup: the same rows, slots, evictions, counters and updates
(GPU test `tests/test_dynamic_lookup_graphs.py`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hstu.graph_capture import GraphStats, padded_token_count, release_generator

__all__ = ["LookupGraphs", "MAX_GRAPHS", "MAX_GRAPH_BYTES", "ID_SIZES_PER_OCTAVE"]

logger = logging.getLogger(__name__)

ID_SIZES_PER_OCTAVE = 8  # padded id counts per power of two
MAX_GRAPHS = 32  # counts captured per table; the others run eagerly
# What a graph keeps per padded id: its buffers and outputs (ids, sort, unique ids, counts,
# offsets, inverse, slots: ~7 int64 and a mask), rounded up. The counts held per table stop
# where they would keep more than MAX_GRAPH_BYTES (32 counts of 250k ids; huge lookups fewer).
BYTES_PER_ID = 64
MAX_GRAPH_BYTES = 512 << 20


@dataclass
class _Entry:
    ids: torch.Tensor  # int64 [N], the first n the lookup's ids
    n: torch.Tensor  # int64 0-d
    uses: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple | None = None  # the graph's (UniqueIds, slots)
    # the autograd node of a lookup whose backward has not run (weak: a graph dropped without
    # a backward releases the entry)
    pending: weakref.ref | None = None

    def is_pending(self) -> bool:
        return self.pending is not None and self.pending() is not None


class LookupGraphs:
    """One table's lookup graphs, keyed by padded id count. ``body(ids, n, step)`` runs the
    lookup's ops on the padded ids and returns (UniqueIds, slots), both of the padded size."""

    def __init__(
        self,
        device: torch.device,
        name: str,
        max_graphs: int = MAX_GRAPHS,
        max_bytes: int = MAX_GRAPH_BYTES,
    ) -> None:
        self.device = device
        self.name = name
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self._entries: dict[int, _Entry] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self.stats = GraphStats()

    def clear(self) -> None:
        """Drops every graph (the table's tensors were replaced)."""
        self._entries.clear()
        self._pool = None

    def run(self, body: Callable, ids: torch.Tensor, step: int):
        """(UniqueIds of the padded size, slots, the entry) for ``ids`` at table step ``step``,
        or None where this lookup runs eagerly (graphs off, a new count past `max_graphs` or
        `max_bytes`, or an entry pending). The caller marks the entry pending while a backward
        is due (`hold`; the backward calls `release`)."""
        if self.stats.disabled or any(e.is_pending() for e in self._entries.values()):
            self.stats.eager += 1
            return None
        n = ids.numel()
        size = padded_token_count(n, ID_SIZES_PER_OCTAVE)
        entry = self._entries.get(size)
        if entry is None:
            held = sum(e.ids.numel() for e in self._entries.values())
            if (
                len(self._entries) >= self.max_graphs
                or (held + size) * BYTES_PER_ID > self.max_bytes
            ):
                self.stats.eager += 1
                return None
            entry = _Entry(
                ids=torch.empty(size, dtype=torch.int64, device=self.device),
                n=torch.zeros((), dtype=torch.int64, device=self.device),
            )
            self._entries[size] = entry
        entry.ids[:n].copy_(ids)
        entry.n.fill_(n)
        self.step.fill_(step)
        entry.uses += 1
        # the first lookup of a count runs its ops on the buffers (setting their kernels up),
        # the second captures them; a failed capture runs them too
        if entry.graph is None and (entry.uses == 1 or not self._capture(body, entry, size)):
            self.stats.eager += 1
            return (*body(entry.ids, entry.n, self.step), None)
        entry.graph.replay()
        self.stats.replays += 1
        return (*entry.outputs, entry)

    def _capture(self, body: Callable, entry: _Entry, size: int) -> bool:
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outputs = body(entry.ids, entry.n, self.step)
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - any failure: eager from now on, say why
            # nothing ran: the table is as it was; the random generator loses its capture mark
            torch.cuda.synchronize(self.device)
            release_generator(self.device)
            self.stats.disabled = f"capture failed: {type(e).__name__}: {e}"
            logger.warning(
                "dynamic table %r: CUDA graphs of the lookup off (%s); eager lookups from now",
                self.name,
                self.stats.disabled,
            )
            self._entries.clear()
            return False
        finally:
            current.wait_stream(self._stream)
        entry.graph, entry.outputs = graph, outputs
        took = time.perf_counter() - start
        self.stats.record_capture(f"ids={size}", took, len(self._entries))
        logger.info(
            "dynamic table %r: captured the lookup of %d ids in %.3f s (%d counts held)",
            self.name,
            size,
            took,
            len(self._entries),
        )
        return True

    @staticmethod
    def hold(entry: _Entry | None, node) -> None:
        """``entry``'s outputs are needed by the backward of autograd ``node`` (the lookup's)."""
        if entry is not None:
            entry.pending = weakref.ref(node)

    @staticmethod
    def release(entry: _Entry | None) -> None:
        """The backward of ``entry``'s lookup has run: its outputs may be overwritten."""
        if entry is not None:
            entry.pending = None
