"""`BatchIterator`: deterministic, resumable, rank-sliced batches of samples.

Batches are defined globally: epoch e visits the samples in the permutation drawn from
``(seed, e)``, cut into consecutive global batches of ``batch_size`` indices. Rank r of
``world_size`` takes positions ``r::world_size`` of each global batch, so one process and N
processes see exactly the same global batches (and the same loss, up to reduction order), and a
run resumed from ``state_dict()`` continues with exactly the batch it would have seen next, even
under a different world size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from hstu.data.batch import Batch
from hstu.data.datasets import Samples

__all__ = ["BatchIterator"]

logger = logging.getLogger(__name__)


class BatchIterator:
    """Global-batch iterator over ``samples`` (anything with ``__len__`` and ``collate``).

    Training (``drop_last=True``): ``next(it)`` runs forever over epochs, dropping each epoch's
    last partial batch. Evaluation: ``eval_batches()`` makes one ordered pass that keeps every
    sample; with several ranks each sample goes to exactly one rank.

    ``batch_size`` is global (all ranks together) and must be a multiple of ``world_size``.
    ``batch_size_binding`` names the config field in error messages.
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
        """This rank's share of a global batch: positions ``rank::world_size``."""
        return global_indices[self.rank :: self.world_size]

    # ---- training: infinite -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.samples.collate(self.next_indices())

    def next_indices(self) -> np.ndarray:
        """Advance by one global batch and return this rank's sample indices."""
        if len(self) == 0:
            raise ValueError(f"no samples to iterate over ({self.batch_size_binding})")
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        idx = self.local_indices(self.global_batch_indices(self.epoch, self.position))
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
