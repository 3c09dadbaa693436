"""TensorBoard logging (rank 0 only) and a reader for tests and tools."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["MetricLogger", "read_scalars"]


class MetricLogger:
    """Thin wrapper over SummaryWriter; a disabled logger (ranks != 0) does nothing."""

    def __init__(self, log_dir: str | None, enabled: bool = True) -> None:
        self.enabled = bool(enabled and log_dir)
        self._writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=log_dir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None and value is not None:
            self._writer.add_scalar(tag, float(value), step)

    def scalars(self, values: Mapping[str, float | None], step: int, prefix: str = "") -> None:
        for tag, value in values.items():
            if value is None:
                continue
            self.scalar(f"{prefix}{tag}", value, step)

    def hparams(self, hparams: Mapping[str, object], metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        clean_h = {
            k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()
        }
        clean_m = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._writer.add_hparams(clean_h, clean_m, run_name=".")

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars under ``log_dir`` (event files, also in sub-directories) as tag -> [(step, value)]."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    dirs = sorted({p.parent for p in Path(log_dir).rglob("events.out.tfevents*")})
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    for tag in out:
        out[tag].sort()
    return out
