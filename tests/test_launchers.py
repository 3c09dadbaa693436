"""The two torchrun launchers, as a user runs them (subprocesses on this CPU machine)."""

from __future__ import annotations

import subprocess

import pytest
from dist_helpers import ROOT, launcher_env, torchrun_command

REFUSAL = "This code is optimized for A100 GPU (SM 8.0) only."

pytestmark = pytest.mark.cpu_only

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


def _torchrun(task: str, args: list[str], allow: bool, nproc: int = 1, timeout: int = 300):
    return subprocess.run(
        torchrun_command(ROOT / "scripts" / f"pretrain_gr_{task}.py", nproc, *args),
        cwd=ROOT,
        env=launcher_env(allow_non_a100=allow),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def run_args(tmp_path, run_dir_bindings) -> list[str]:
    """--gin-bindings arguments: the tiny model, its run directory tmp_path / "run"."""
    return [x for b in TINY + run_dir_bindings(tmp_path) for x in ("--gin-bindings", b)]


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_launcher_refuses_without_a100(task, tmp_path, run_args):
    proc = _torchrun(task, run_args, allow=False)
    assert proc.returncode != 0
    assert f"RuntimeError: {REFUSAL}" in proc.stderr
    assert "Please use an A100 GPU." in proc.stderr
    assert not (tmp_path / "run").exists(), "nothing may be built before the GPU check"


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_launcher_runs_cpu_development_mode(task, tmp_path, run_args):
    proc = _torchrun(task, run_args, allow=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU DEVELOPMENT MODE" in proc.stderr
    run = tmp_path / "run"
    assert (run / "config.gin").exists()
    assert "TrainerArgs.max_train_iters = 4" in (run / "config.gin").read_text()
    assert list(run.glob("events.out.tfevents*")), "TensorBoard events missing"
    assert (run / "checkpoints" / "latest").exists()
    assert "final eval" in proc.stderr


def test_launcher_config_errors_are_messages(run_args):
    proc = _torchrun(
        "ranking", run_args + ["--gin-bindings", "TrainerArgs.not_a_field=3"], allow=True
    )
    # our process exits 2 with a message; torchrun then reports the failed child itself
    assert proc.returncode != 0
    assert "config error: Unknown field 'TrainerArgs.not_a_field'" in proc.stderr
    assert "exitcode: 2" in proc.stderr
    assert f'File "{ROOT / "hstu"}' not in proc.stderr, "no traceback from our code"


def test_launcher_missing_dataset_is_a_message(tmp_path, run_args):
    args = run_args + [
        "--gin-bindings",
        "DatasetArgs.dataset_name='ml-1m'",
        "--gin-bindings",
        f"DatasetArgs.dataset_path='{tmp_path / 'nowhere'}'",
    ]
    proc = _torchrun("retrieval", args, allow=True)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr
    assert "nowhere" in proc.stderr and "hstu.data.prepare" in proc.stderr
    assert f'File "{ROOT / "hstu"}' not in proc.stderr, "no traceback from our code"
