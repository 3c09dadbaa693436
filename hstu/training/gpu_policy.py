"""Hardware policy: A100 (SM 8.0) only, with an explicit development override.

Both launchers call :func:`check_gpu` at the very start of ``main()`` on every rank, before
loading data or building models (docs/design.md "Hardware policy"). Without the override anything
but an A100 raises :class:`GPURefusedError` (a ``RuntimeError``; the launchers print
``error: RuntimeError: <refusal text>`` and exit 1); with ``--allow-non-a100`` or
``HSTU_ALLOW_NON_A100=1`` a non-A100 CUDA GPU runs with a loud warning and a machine without CUDA
runs the CPU development mode (PyTorch reference ops, gloo backend).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from hstu.errors import EXIT_RUNTIME, RunError, UsageError

__all__ = [
    "A100_CAPABILITY",
    "ALLOW_ENV_VAR",
    "DeviceMode",
    "GPURefusedError",
    "allow_non_a100_from_env",
    "check_gpu",
    "refusal_message",
]

logger = logging.getLogger(__name__)

ALLOW_ENV_VAR = "HSTU_ALLOW_NON_A100"
A100_CAPABILITY: tuple[int, int] = (8, 0)
A100_OK_MESSAGE = "[GPU Check] Detected A100 GPU (SM 8.0) - OK"
_NO_GPU_NAME = "no CUDA GPU"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class GPURefusedError(RunError):
    """The hardware policy refused this device; ``str()`` is the exact text of docs/design.md."""

    exit_code = EXIT_RUNTIME


@dataclass(frozen=True)
class DeviceMode:
    """What the run executes on, as decided by :func:`check_gpu`."""

    device: str  # "cuda" or "cpu"
    is_a100: bool
    dev_mode: bool  # True when running only because of the override
    name: str  # GPU name, or "no CUDA GPU"
    capability: tuple[int, int] | None  # (major, minor); None without a GPU
    local_rank: int = 0

    @property
    def backend(self) -> str:
        """torch.distributed backend for this mode."""
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def use_reference_ops(self) -> bool:
        """CPU development mode runs the PyTorch reference ops instead of compiled kernels."""
        return self.device == "cpu"

    @property
    def torch_device(self) -> torch.device:
        """The torch device of this rank (``cuda:<local_rank>`` or ``cpu``)."""
        if self.device == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def sm(self) -> str:
        """Capability as written in messages: ``8.0``, or ``n/a`` without a GPU."""
        return "n/a" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"


def refusal_message(name: str, sm: str) -> str:
    """The exact refusal text of docs/design.md for a detected device."""
    return (
        f"This code is optimized for A100 GPU (SM 8.0) only. Detected {name} (SM {sm}). "
        "Please use an A100 GPU."
    )


def allow_non_a100_from_env(environ: dict[str, str] | None = None) -> bool:
    """Read ``HSTU_ALLOW_NON_A100``: 1/true/yes/on enable, 0/false/no/off/unset disable."""
    env = os.environ if environ is None else environ
    raw = env.get(ALLOW_ENV_VAR, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{ALLOW_ENV_VAR}={raw!r} is not understood: use 1 (allow non-A100 development mode) "
        "or 0 / unset (A100 only)"
    )


def _local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        rank = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} must be a non-negative integer") from None
    if rank < 0:
        raise ValueError(f"LOCAL_RANK={raw!r} must be a non-negative integer")
    return rank


def check_gpu(allow_non_a100: bool = False, local_rank: int | None = None) -> DeviceMode:
    """Apply the A100-only policy to this rank's device and return the mode to run in.

    ``allow_non_a100`` (``--allow-non-a100``) or ``HSTU_ALLOW_NON_A100=1`` turns a refusal into
    a warning. ``local_rank`` defaults to ``$LOCAL_RANK`` (set by torchrun) or 0.
    Raises :class:`GPURefusedError` (a ``RuntimeError``) with the message of docs/design.md when
    the device is refused, ``UsageError`` (exit 2) when LOCAL_RANK has no device and
    ``ValueError`` (exit 2) for a malformed HSTU_ALLOW_NON_A100 or LOCAL_RANK.
    """
    allow = bool(allow_non_a100) or allow_non_a100_from_env()
    rank = _local_rank() if local_rank is None else int(local_rank)

    if not torch.cuda.is_available():
        mode = DeviceMode(
            device="cpu",
            is_a100=False,
            dev_mode=True,
            name=_NO_GPU_NAME,
            capability=None,
            local_rank=rank,
        )
        if not allow:
            raise GPURefusedError(refusal_message(mode.name, mode.sm))
        _warn_override(
            mode,
            "running the CPU DEVELOPMENT MODE: PyTorch reference ops, gloo backend. "
            "Slow; meant for CI and for debugging configs and data, not for training.",
        )
        return mode

    count = torch.cuda.device_count()
    if rank >= count:
        raise UsageError(
            f"LOCAL_RANK={rank} but only {count} CUDA device(s) are visible: start at most "
            f"{count} processes per node (torchrun --nproc_per_node={count})"
        )
    name = str(torch.cuda.get_device_name(rank))
    major, minor = (int(v) for v in torch.cuda.get_device_capability(rank))
    is_a100 = (major, minor) == A100_CAPABILITY and "A100" in name.upper()
    mode = DeviceMode(
        device="cuda",
        is_a100=is_a100,
        dev_mode=not is_a100,
        name=name,
        capability=(major, minor),
        local_rank=rank,
    )
    if is_a100:
        logger.info(A100_OK_MESSAGE)
        return mode
    if not allow:
        raise GPURefusedError(refusal_message(mode.name, mode.sm))
    _warn_override(
        mode,
        f"running on a non-A100 GPU. The compiled kernels must have been built for SM "
        f'{mode.sm} (rebuild with HSTU_CUDA_ARCH_LIST="8.0;{mode.sm}" pip install -e .). '
        "Performance numbers from this run do not represent the supported target.",
    )
    return mode


def _warn_override(mode: DeviceMode, what: str) -> None:
    bar = "!" * 100
    logger.warning(
        "\n%s\n[GPU Check] WARNING: %s\n[GPU Check] Continuing because %s=1 or "
        "--allow-non-a100 is set: %s\n%s",
        bar,
        refusal_message(mode.name, mode.sm),
        ALLOW_ENV_VAR,
        what,
        bar,
    )
