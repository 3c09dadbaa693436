"""Shared helper of the multi-process CPU tests: run `dist_train_worker.py` under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_train_worker.py"


def torchrun_losses(
    nproc: int, bindings: list[str], out: Path, timeout: float = 600
) -> list[float]:
    """Trains the ranking task with ``bindings`` on ``nproc`` gloo processes (one OpenMP thread
    each, HSTU_* variables of the caller dropped) and returns rank 0's loss per step."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSTU_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(WORKER),
            str(ROOT),
            json.dumps(bindings),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [loss for _, loss in json.loads((out / "losses.json").read_text())]
