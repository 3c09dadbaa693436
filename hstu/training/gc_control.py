"""Python garbage collection at fixed steps during training.

CPython's automatic collector runs whenever enough container objects were allocated; a full
(oldest-generation) pass over the many objects a training process holds (modules, torch.compile
and torchrec state) takes tens of milliseconds. With several ranks, such a pause on any one rank
delays every rank at the next collective, at random steps. `StepGC` turns automatic collection
off for the training loop and collects the young generations every ``interval`` steps instead,
on every rank at the same step (torchtitan does the same); the oldest generation is collected at
`full()` points the trainer chooses (before evaluation), again on every rank together.
"""

from __future__ import annotations

import gc

__all__ = ["StepGC"]


class StepGC:
    """``with StepGC(interval):`` around a training loop, ``step()`` once per step.

    ``interval <= 0`` leaves Python's automatic collection alone (every method is a no-op).
    Automatic collection is restored on exit, also when the loop raises."""

    def __init__(self, interval: int) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool):
            raise TypeError(f"TrainerArgs.gc_interval must be an integer; got {interval!r}")
        self.interval = interval
        self.active = False
        self._was_enabled = True
        self._steps = 0

    def __enter__(self) -> StepGC:
        if self.interval > 0 and not self.active:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect(1)
            self.active = True
            self._steps = 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.active = False
            if self._was_enabled:
                gc.enable()

    def step(self) -> None:
        """Counts one training step; collects generations 0 and 1 every ``interval`` steps."""
        if not self.active:
            return
        self._steps += 1
        if self._steps % self.interval == 0:
            gc.collect(1)

    def full(self) -> None:
        """A full collection now (call it at a point every rank reaches at the same step)."""
        if self.active:
            gc.collect()
