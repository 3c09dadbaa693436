"""`BatchIterator`: deterministic, resumable, rank-sliced batches of samples.

Batches are defined globally: epoch e visits the samples in the permutation drawn from
``(seed, e)``, cut into consecutive global batches of ``batch_size`` indices. One process and N
processes see exactly the same global batches (and the same loss, up to reduction order), and a
run resumed from ``state_dict()`` continues with exactly the batch it would have seen next, even
under a different world size.

How a global batch is split over the ranks (``balance``):

- ``"strided"``: rank r takes positions ``r::world_size``.
- ``"cost"`` (with per-sample sequence lengths): the HSTU step time of a rank grows with the
  attention cost ``sum L^2`` of its sequences plus the linear layers' ``sum L``; with jagged,
  heavy-tailed lengths a strided split leaves most ranks waiting for the one holding the longest
  sequences. Each sample gets cost ``L^2 + c * L`` (``c`` = linear FLOPs per token over
  attention FLOPs per L^2 unit, see `linear_cost_coefficient`), and the samples, longest first,
  go greedily to the rank with the least cost so far that still has room (longest processing
  time first). Every rank gets exactly as many samples as under the strided split (fixed local
  batch size), and the assignment depends only on the global batch, so every rank computes the
  same one with no communication. Ties go to the lower rank; a rank's samples keep their order
  in the global batch.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hstu.data.batch import Batch
from hstu.data.datasets import Samples

__all__ = [
    "BatchIterator",
    "PrefetchIterator",
    "BALANCE_POLICIES",
    "balanced_split",
    "linear_cost_coefficient",
    "sequence_lengths",
]

BALANCE_POLICIES = ("strided", "cost")

logger = logging.getLogger(__name__)


def linear_cost_coefficient(hidden_size: int, num_heads: int, head_dim: int) -> float:
    """``c`` in the per-sample cost ``L^2 + c * L``, from the FLOP model of
    `hstu.training.flops` (forward + backward per layer): linears ``30 * D * H*d`` per token,
    attention ``7 * H * d`` per L^2 unit, so ``c = 30 * D / 7`` (H and d cancel)."""
    if min(hidden_size, num_heads, head_dim) < 1:
        raise ValueError(
            f"linear_cost_coefficient: sizes must be positive, got hidden_size={hidden_size}, "
            f"num_heads={num_heads}, head_dim={head_dim}"
        )
    linear = 3.0 * 10.0 * hidden_size * num_heads * head_dim
    attention = 3.5 * 2.0 * num_heads * head_dim
    return linear / attention


def sequence_lengths(samples: Any) -> np.ndarray:
    """Token length of every sample's HSTU sequence (contextual + history + candidates).

    Knows `RankingSamples` and `RetrievalSamples`; other sample sets may provide a
    ``sequence_lengths()`` method.
    """
    if hasattr(samples, "sequence_lengths"):
        return np.asarray(samples.sequence_lengths(), dtype=np.int64)
    ctx = len(getattr(samples, "contextual_feature_names", []))
    if hasattr(samples, "history_starts") and hasattr(samples, "candidate_ends"):
        return (samples.candidate_ends - samples.history_starts).astype(np.int64) + ctx
    if hasattr(samples, "starts") and hasattr(samples, "ends"):
        return (samples.ends - samples.starts).astype(np.int64) + ctx
    raise TypeError(
        f"cannot tell the sequence lengths of {type(samples).__name__} samples for "
        "TrainerArgs.rank_balance='cost'; give them a sequence_lengths() method or use "
        "TrainerArgs.rank_balance='strided'"
    )


def balanced_split(costs: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Positions (into ``costs``) for each rank: longest-processing-time-first greedy with each
    rank's count fixed to that of the strided split ``r::world_size``. Deterministic."""
    costs = np.asarray(costs, dtype=np.float64)
    n = costs.shape[0]
    caps = [len(range(r, n, world_size)) for r in range(world_size)]
    count = [0] * world_size
    owner = np.empty(n, dtype=np.int64)
    # ranks with room, least loaded first (ties: lower rank)
    heap = [(0.0, r) for r in range(world_size) if caps[r] > 0]
    # longest first; equal costs in global-batch order (a stable sort of -cost)
    for pos in np.argsort(-costs, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        owner[pos] = r
        count[r] += 1
        if count[r] < caps[r]:
            heapq.heappush(heap, (load + float(costs[pos]), r))
    return [np.flatnonzero(owner == r) for r in range(world_size)]


class BatchIterator:
    """Global-batch iterator over ``samples`` (anything with ``__len__`` and ``collate``).

    Training (``drop_last=True``): ``next(it)`` runs forever over epochs, dropping each epoch's
    last partial batch. Evaluation: ``eval_batches()`` makes one ordered pass that keeps every
    sample; with several ranks each sample goes to exactly one rank.

    ``batch_size`` is global (all ranks together) and must be a multiple of ``world_size``.
    ``batch_size_binding`` names the config field in error messages. ``balance`` is
    ``"strided"`` or ``"cost"`` (see the module docstring; it needs the samples' sequence lengths
    and uses ``linear_cost`` as ``c``); with one process both are the identity.
    ``loss_counts`` (optional, one per sample): training batches then carry
    ``Batch.global_counts``, the global batch's loss terms and samples, the same on every rank.
    """

    def __init__(
        self,
        samples: Samples,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        batch_size_binding: str = "TrainerArgs.train_batch_size",
        balance: str = "strided",
        linear_cost: float = 0.0,
        loss_counts: np.ndarray | None = None,
    ) -> None:
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool):
            raise TypeError(f"{batch_size_binding} must be an integer; got {batch_size!r}")
        if batch_size <= 0:
            raise ValueError(f"{batch_size_binding} must be > 0; got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        if batch_size % world_size != 0:
            raise ValueError(
                f"{batch_size_binding}={batch_size} is the global batch size and must be divisible "
                f"by the number of processes (world_size={world_size}); use e.g. "
                f"{batch_size_binding}={max(world_size, batch_size // world_size * world_size)}"
            )
        n = len(samples)
        if drop_last and n < batch_size:
            raise ValueError(
                f"{batch_size_binding}={batch_size} is larger than the {n} training samples, so "
                f"not one full batch exists; lower {batch_size_binding} to at most {n} or use "
                f"more data"
            )
        if balance not in BALANCE_POLICIES:
            raise ValueError(
                f"TrainerArgs.rank_balance={balance!r} is not supported: choose one of "
                + ", ".join(repr(p) for p in BALANCE_POLICIES)
            )
        if not linear_cost >= 0:
            raise ValueError(f"BatchIterator: linear_cost={linear_cost} must be >= 0")
        if loss_counts is not None:
            loss_counts = np.asarray(loss_counts, dtype=np.int64)
            if loss_counts.shape != (n,) or (loss_counts < 0).any():
                raise ValueError(
                    f"BatchIterator: loss_counts must be {n} non-negative counts (one per "
                    f"sample); got shape {loss_counts.shape}"
                )
        self.loss_counts = loss_counts
        self.balance = balance
        self.linear_cost = float(linear_cost)
        self._costs: np.ndarray | None = None
        if balance == "cost" and world_size > 1:
            lengths = sequence_lengths(samples).astype(np.float64)
            if lengths.shape != (len(samples),):
                raise ValueError(
                    f"BatchIterator: {lengths.shape[0]} sequence lengths for {len(samples)} samples"
                )
            self._costs = lengths * lengths + self.linear_cost * lengths
        self.samples = samples
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self.batch_size_binding = batch_size_binding
        self.num_samples = n
        self.epoch = 0
        self.position = 0  # index of the next global batch inside the current epoch
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    # ---- sizes ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Global batches per epoch (the same on every rank)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.world_size

    # ---- order ------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of ``epoch`` in visiting order (a permutation seeded by (seed, epoch))."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        rng = np.random.default_rng([self.seed, int(epoch)])
        return rng.permutation(self.num_samples).astype(np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch or self._order is None:
            self._order = self.epoch_order(epoch)
            self._order_epoch = epoch
        return self._order

    def global_batch_indices(self, epoch: int, position: int) -> np.ndarray:
        """Sample indices of global batch ``position`` of ``epoch`` (all ranks together)."""
        order = self._order_for(epoch)
        return order[position * self.batch_size : (position + 1) * self.batch_size]

    def local_indices(self, global_indices: np.ndarray) -> np.ndarray:
        """This rank's share of a global batch (``rank::world_size``, or cost-balanced)."""
        return self.split(global_indices)[self.rank]

    def split(self, global_indices: np.ndarray) -> list[np.ndarray]:
        """Every rank's share of a global batch (the same answer on every rank)."""
        w = self.world_size
        if self._costs is None or w == 1:
            return [global_indices[r::w] for r in range(w)]
        parts = balanced_split(self._costs[global_indices], w)
        return [global_indices[p] for p in parts]

    def sample_costs(self, indices: np.ndarray) -> np.ndarray:
        """Per-sample cost ``L^2 + c * L`` of ``indices`` (needs the sequence lengths)."""
        if self._costs is None:
            lengths = sequence_lengths(self.samples)[indices].astype(np.float64)
            return lengths * lengths + self.linear_cost * lengths
        return self._costs[indices]

    # ---- training: infinite -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        global_idx = self._next_global()
        batch = self.samples.collate(self.local_indices(global_idx))
        if self.loss_counts is not None:
            batch.global_counts = (
                float(self.loss_counts[global_idx].sum()),
                float(global_idx.shape[0]),
            )
        return batch

    def next_indices(self) -> np.ndarray:
        """Advance by one global batch and return this rank's sample indices."""
        return self.local_indices(self._next_global())

    def _next_global(self) -> np.ndarray:
        """Advance by one global batch and return its sample indices (all ranks)."""
        if len(self) == 0:
            raise ValueError(f"no samples to iterate over ({self.batch_size_binding})")
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        idx = self.global_batch_indices(self.epoch, self.position)
        self.position += 1
        return idx

    # ---- evaluation: one pass ---------------------------------------------------------------
    def eval_index_batches(self) -> list[np.ndarray]:
        """This rank's sample indices for one ordered pass over every sample.

        The last partial global batch is kept. With several ranks, a remainder smaller than
        ``world_size`` is merged into the previous batch so that no rank gets an empty batch
        while others compute (sharded embeddings need every rank in every forward). Every rank
        gets the same number of batches; a local batch is empty only when the whole eval set is
        smaller than ``world_size``.
        """
        order = self.epoch_order(0) if self.shuffle else np.arange(self.num_samples)
        bounds = list(range(0, self.num_samples, self.batch_size)) + [self.num_samples]
        if len(bounds) > 2 and bounds[-1] - bounds[-2] < self.world_size:
            del bounds[-2]
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out.append(self.local_indices(order[lo:hi]))
        return out

    def eval_batches(self) -> Iterator[Batch]:
        """One pass over every sample (see `eval_index_batches`); does not touch the position."""
        for idx in self.eval_index_batches():
            yield self.samples.collate(idx)

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position of the stream: enough to continue with exactly the next global batch."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`; the world size may differ, the data may not."""
        for key in ("seed", "shuffle", "batch_size", "num_samples"):
            if key in state and state[key] != getattr(self, key):
                what = self.batch_size_binding if key == "batch_size" else key
                raise ValueError(
                    f"cannot resume the data stream: checkpoint has {what}={state[key]!r} but this "
                    f"run has {getattr(self, key)!r}; resume with the same dataset, seed and "
                    f"global batch size"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class PrefetchIterator:
    """Collates (and optionally pins) the next ``depth`` training batches of a `BatchIterator`
    in one background thread, so that building and page-locking a batch overlaps the GPU work
    of the current step.

    Same batches in the same order as the wrapped iterator. `state_dict()` is the position after
    the last batch *returned* (not the last one prefetched), so a checkpoint resumes exactly
    where training stopped. An exception in the thread is raised by the `next()` that would have
    returned that batch. ``pin_memory=True`` needs CUDA; ``device`` is the GPU the pinned batches
    are for (the thread makes it current before pinning).
    """

    def __init__(
        self,
        source: BatchIterator,
        depth: int = 2,
        *,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"PrefetchIterator: depth={depth} must be >= 1")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("PrefetchIterator: pin_memory=True needs CUDA (page-locked memory)")
        self.source = source
        self.depth = int(depth)
        self.pin_memory = bool(pin_memory)
        self.device = device
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._consumed_state = source.state_dict()
        self._lookahead: Callable[[Batch], None] | None = None
        self._prepare: Callable[[Batch], None] | None = None
        self._held: tuple[Batch, dict] | None = None  # the next batch, already looked ahead at
        self._held_error: BaseException | None = None

    def set_lookahead(self, fn: Callable[[Batch], None] | None) -> None:
        """Calls ``fn(batch)`` on the caller's thread one `next()` before that batch is returned
        (the trainer starts the exchange of the batch's embedding ids between ranks there, to
        overlap the current step). Every `next()` then takes one more batch from the thread
        first; the checkpointed position stays that of the batches returned."""
        self._lookahead = fn

    def set_prepare(self, fn: Callable[[Batch], None] | None) -> None:
        """Calls ``fn(batch)`` on the prefetch thread for every batch after it is collated (and
        pinned), before it is handed out: host work on the batch that the model would otherwise
        do on the caller's thread during the step (``fn`` keeps its results in
        ``batch.host_memo``; it must not touch the model's state). Batches already prefetched
        are collated again with it."""
        if fn is not None and not callable(fn):
            raise TypeError(
                f"PrefetchIterator.set_prepare takes a function of one batch (or None), got "
                f"{type(fn).__name__}"
            )
        self._prepare = fn
        if self._thread is not None:
            self._join()

    # the wrapped iterator's read-only facts
    def __len__(self) -> int:
        return len(self.source)

    @property
    def batch_size(self) -> int:
        return self.source.batch_size

    @property
    def local_batch_size(self) -> int:
        return self.source.local_batch_size

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        if self._lookahead is None:
            batch, state = self._get()
        else:
            if self._held_error is not None:  # the batch after the last one returned failed
                exc, self._held_error = self._held_error, None
                self._join()
                raise exc
            if self._held is None:
                self._held = self._get_ahead()
            batch, state = self._held
            self._held = None
            self._consumed_state = state
            try:
                self._held = self._get_ahead()
            except Exception as exc:  # raised by the next call: this batch is still good
                self._held_error = exc
            return batch
        self._consumed_state = state
        return batch

    def _get(self) -> tuple[Batch, dict]:
        kind, payload, state = self._queue.get()
        if kind == "error":
            self._join()
            raise payload
        return payload, state

    def _get_ahead(self) -> tuple[Batch, dict]:
        batch, state = self._get()
        self._lookahead(batch)
        return batch, state

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        # the thread holds the source, queue and stop flag, not this object: an iterator dropped
        # without close() is collected, and its __del__ stops the thread
        self._thread = threading.Thread(
            target=_prefetch_worker,
            args=(
                self.source,
                self._queue,
                self._stop,
                self.pin_memory,
                self.device,
                self._prepare,
            ),
            name="hstu-batch-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def _join(self) -> None:
        """Stops the thread, drops what it prefetched and rewinds the source to the consumed
        position (a later `next()` continues with the first batch not returned yet)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._queue = None
        self._held = None
        self._held_error = None
        self.source.load_state_dict(self._consumed_state)

    def close(self) -> None:
        self._join()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped iterator's state after the last batch returned by `next()`."""
        return dict(self._consumed_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._join()
        self.source.load_state_dict(state)
        self._consumed_state = self.source.state_dict()


_STOP_POLL_S = 0.1


def _prefetch_worker(
    source: BatchIterator,
    q: queue.Queue,
    stop: threading.Event,
    pin_memory: bool,
    device: torch.device | None,
    prepare: Callable[[Batch], None] | None = None,
) -> None:
    """`PrefetchIterator`'s thread: (batch, state after it) items, or one ("error", exc)."""
    try:
        if pin_memory and device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        while not stop.is_set():
            batch = next(source)
            if pin_memory:
                batch = batch.pin_memory()
            if prepare is not None:
                prepare(batch)
            if not _put(q, stop, ("batch", batch, source.state_dict())):
                return
    except BaseException as exc:  # handed to the consumer, raised there
        _put(q, stop, ("error", exc, None))


def _put(q: queue.Queue, stop: threading.Event, item: tuple) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_STOP_POLL_S)
            return True
        except queue.Full:
            continue
    return False
