"""`SparseDistPipeline`: the next batch's embedding input dist overlaps the current step.

torchrec's `TrainPipelineSparseDist` splits a step the same way: while step i runs, the input
dist (the id all-to-all) of batch i+1 is already under way, so that a sharded table's lookup
finds its ids at their owner ranks. torchrec finds the sharded modules' inputs by tracing the
model's forward with torch.fx from batch attributes to the modules; our lookups' KJTs are
assembled by `EmbeddingStack` from several batch fields and the CPU twin of the batch (host-side
sizes, no device->host reads), a path fx cannot follow. This pipeline keeps the stage split and
asks the stack directly: `EmbeddingStack.start_input_dist(batch)` starts batch i+1's input dist
(the gloo exchange of its dynamic-table ids, on the tables' exchange thread) when batch i is
handed out, and the model's forward takes it as ``sparse_input``.

Batches come from a `PrefetchIterator` (collated and pinned on a background thread); the input
dist starts through its lookahead hook, one `next()` before the batch is returned, in the order
the batches are returned, on every rank alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from hstu.data.batch import Batch
from hstu.data.loader import PrefetchIterator
from hstu.embeddings.stack import EmbeddingStack, SparseInput

__all__ = ["SparseDistPipeline"]


class SparseDistPipeline:
    """Iterates ``(batch, sparse_input)`` over ``batches``: ``sparse_input`` is the batch's
    embedding input dist started a step ahead, or None where it does not apply (one rank, no
    sharded dynamic tables, lookups with ids not in the batch, or ``ahead=False``).

    ``start``: starts a batch's input dist (default `EmbeddingStack.start_input_dist`; the
    whole training step's CUDA graphs start that of the padded batch and the corpus,
    `StepGraphs.start_input_dist`, and pass ``fixed_extra_ids=True``). Constructing it is a
    collective call when ``ahead`` is set (the stack's exchange group is created): every rank at
    the same point. `state_dict()` is the position after the last batch returned, as for
    `PrefetchIterator`."""

    def __init__(
        self,
        batches: PrefetchIterator,
        stack: EmbeddingStack,
        *,
        ahead: bool,
        start: Callable[[Batch], SparseInput | None] | None = None,
        fixed_extra_ids: bool = False,
    ) -> None:
        self.batches = batches
        self.stack = stack
        self.ahead = bool(ahead) and stack.enable_input_dist_ahead(fixed_extra_ids)
        self._start_fn = start if start is not None else stack.start_input_dist
        self._started: deque[SparseInput | None] = deque()
        if self.ahead:
            batches.set_lookahead(self._start)

    def _start(self, batch: Batch) -> None:
        self._started.append(self._start_fn(batch))

    def __iter__(self) -> SparseDistPipeline:
        return self

    def __next__(self) -> tuple[Batch, SparseInput | None]:
        batch = next(self.batches)
        if not self.ahead:
            return batch, None
        # the lookahead started one input dist per batch, in the order they are returned
        return batch, self._started.popleft()

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves to ``state``; input dists started for batches that will not be returned are
        dropped (every rank drops the same ones)."""
        self.batches.load_state_dict(state)
        self._drain()

    def _drain(self) -> None:
        while self._started:
            started = self._started.popleft()
            if started is not None:
                started.dist_input.wait()

    def close(self) -> None:
        self.batches.close()
        self._drain()
        self.stack.close()
