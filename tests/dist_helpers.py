"""Shared helpers of the tests that start subprocesses: a clean environment, torchrun command
lines, and `torchrun_losses` (train under torchrun with `dist_train_worker.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_train_worker.py"

# the caller's variables that would leak into a launched run: HSTU_* switches, a surrounding
# torchrun's rank/world variables
_DROPPED_ENV = ("HSTU_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")


def launcher_env(allow_non_a100: bool = False, **extra: str) -> dict[str, str]:
    """The caller's environment without HSTU_* and torchrun variables, with this checkout first
    on PYTHONPATH and one OpenMP thread per process; ``allow_non_a100`` sets
    HSTU_ALLOW_NON_A100=1; ``extra`` adds or overrides variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if allow_non_a100:
        env["HSTU_ALLOW_NON_A100"] = "1"
    env.update(extra)
    return env


def torchrun_command(script: str | os.PathLike[str], nproc: int, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N script args...``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def torchrun_losses(
    nproc: int, bindings: list[str], out: Path, timeout: float = 600
) -> list[float]:
    """Trains the ranking task with ``bindings`` on ``nproc`` gloo processes (`launcher_env`)
    and returns rank 0's loss per step."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        torchrun_command(WORKER, nproc, str(ROOT), json.dumps(bindings), str(out)),
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [loss for _, loss in json.loads((out / "losses.json").read_text())]
