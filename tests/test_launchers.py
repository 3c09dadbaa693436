"""The two torchrun launchers, as a user runs them (subprocesses on this CPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REFUSAL = "This code is optimized for A100 GPU (SM 8.0) only."

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine launcher behaviour")

TINY = [
    "TrainerArgs.max_train_iters=4",
    "TrainerArgs.log_interval=2",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=2",
    "TrainerArgs.train_batch_size=8",
    "TrainerArgs.eval_batch_size=16",
    "DatasetArgs.synthetic_num_users=120",
    "DatasetArgs.synthetic_num_items=80",
    "DatasetArgs.max_history_seqlen=16",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.kv_channels=8",
    "RetrievalArgs.num_negatives=8",
]


def _env(allow: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HSTU_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if allow:
        env["HSTU_ALLOW_NON_A100"] = "1"
    return env


def _torchrun(task: str, args: list[str], allow: bool, nproc: int = 1, timeout: int = 300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "scripts" / f"pretrain_gr_{task}.py"),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(allow), capture_output=True, text=True, timeout=timeout
    )


def _bindings(tmp_path: Path) -> list[str]:
    out = []
    for b in TINY + [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'"]:
        out += ["--gin-bindings", b]
    return out


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_launcher_refuses_without_a100(task, tmp_path):
    proc = _torchrun(task, _bindings(tmp_path), allow=False)
    assert proc.returncode != 0
    assert f"RuntimeError: {REFUSAL}" in proc.stderr
    assert "Please use an A100 GPU." in proc.stderr
    assert not (tmp_path / "run").exists(), "nothing may be built before the GPU check"


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_launcher_runs_cpu_development_mode(task, tmp_path):
    proc = _torchrun(task, _bindings(tmp_path), allow=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU DEVELOPMENT MODE" in proc.stderr
    run = tmp_path / "run"
    assert (run / "config.gin").exists()
    assert "TrainerArgs.max_train_iters = 4" in (run / "config.gin").read_text()
    assert list(run.glob("events.out.tfevents*")), "TensorBoard events missing"
    assert (run / "checkpoints" / "latest").exists()
    assert "final eval" in proc.stderr


def test_launcher_config_errors_are_messages(tmp_path):
    proc = _torchrun(
        "ranking", _bindings(tmp_path) + ["--gin-bindings", "TrainerArgs.not_a_field=3"], allow=True
    )
    # our process exits 2 with a message; torchrun then reports the failed child itself
    assert proc.returncode != 0
    assert "config error: Unknown field 'TrainerArgs.not_a_field'" in proc.stderr
    assert "exitcode: 2" in proc.stderr
    assert f'File "{ROOT / "hstu"}' not in proc.stderr, "no traceback from our code"


def test_launcher_missing_dataset_is_a_message(tmp_path):
    args = _bindings(tmp_path) + [
        "--gin-bindings",
        "DatasetArgs.dataset_name='ml-1m'",
        "--gin-bindings",
        f"DatasetArgs.dataset_path='{tmp_path / 'nowhere'}'",
    ]
    proc = _torchrun("retrieval", args, allow=True)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr
    assert "nowhere" in proc.stderr and "hstu.data.prepare" in proc.stderr
    assert f'File "{ROOT / "hstu"}' not in proc.stderr, "no traceback from our code"
