"""TensorBoard metric logging (rank 0) and a reader for tests and tools.

``MetricLogger`` is a thin, always-safe wrapper: on non-zero ranks (``enabled=False``) or without
a ``log_dir`` every call is a no-op, so the trainer never branches on rank around logging.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MetricLogger",
    "read_scalars",
    "read_hparams",
    "format_duration",
    "HPARAM_METRIC_PREFIX",
]

logger = logging.getLogger(__name__)

# hparams metrics are written under this prefix so they never collide with training curves.
HPARAM_METRIC_PREFIX = "hparam/"


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` past a day) for console lines; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {clock}" if days else clock


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"MetricLogger: expected a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        return float(value.detach().float().cpu().item())
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"MetricLogger: {value!r} ({type(value).__name__}) is not a number") from e


def _hparam_value(value: Any) -> bool | int | float | str:
    """TensorBoard's hparams plugin takes bool/int/float/str; anything else is shown as text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


class MetricLogger:
    """Scalars, hparams and text to a TensorBoard event file in ``log_dir``."""

    def __init__(self, log_dir: str | os.PathLike | None, enabled: bool = True) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.enabled = bool(enabled and log_dir)
        self._writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
            logger.info("TensorBoard logs: %s", self.log_dir)

    def scalar(self, tag: str, value: Any, step: int) -> None:
        """One point of curve ``tag``; None is skipped, nan/inf are logged as they are."""
        if self._writer is None or value is None:
            return
        self._writer.add_scalar(tag, _to_float(value), int(step))

    def scalars(self, values: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """Log each entry as ``<prefix>/<key>`` (``prefix`` may be empty or end with '/')."""
        if self._writer is None:
            return
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        for key, value in values.items():
            self.scalar(prefix + key, value, step)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """Record a run's hyper-parameters and final metrics for TensorBoard's HPARAMS tab.

        Metrics are stored as scalars ``hparam/<name>`` (step 0) so they do not land on the
        training curves of the same name. Non-scalar hyper-parameters (tuples, None) become text.
        """
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        hp = {str(k): _hparam_value(v) for k, v in hparams.items()}
        metric_values = {}
        for k, v in metrics.items():
            tag = k if k.startswith(HPARAM_METRIC_PREFIX) else HPARAM_METRIC_PREFIX + k
            metric_values[tag] = math.nan if v is None else _to_float(v)
        exp, ssi, sei = hparams_summary(hp, metric_values)
        file_writer = self._writer._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        for tag, v in metric_values.items():
            self._writer.add_scalar(tag, v, 0)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is None:
            return
        self._writer.add_text(tag, text, int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_dirs(log_dir: str | os.PathLike) -> list[Path]:
    path = Path(log_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"TensorBoard log directory {path} does not exist")
    return sorted({p.parent for p in path.rglob("events.out.tfevents*")})


def _accumulator(event_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def read_scalars(log_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve in the event files under ``log_dir`` (sub-directories included).

    Returns tag -> [(step, value)] sorted by step; tags found in several sub-runs are merged.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for event_dir in _event_dirs(log_dir):
        acc = _accumulator(event_dir)
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    return out


def read_hparams(log_dir: str | os.PathLike) -> dict[str, bool | float | str | None]:
    """The hyper-parameters recorded by :meth:`MetricLogger.hparams` under ``log_dir``."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    out: dict[str, bool | float | str | None] = {}
    for event_dir in _event_dirs(log_dir):
        acc = _accumulator(event_dir)
        for content in acc.PluginTagToContent("hparams").values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if not data.HasField("session_start_info"):
                continue
            for name, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                out[name] = getattr(value, kind) if kind else None
    return out
