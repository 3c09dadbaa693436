"""The two torchrun launchers, as a user runs them (subprocesses on this CPU machine)."""

from __future__ import annotations

import pytest
from dist_helpers import TINY_BINDINGS, error_lines, launch

REFUSAL = "This code is optimized for A100 GPU (SM 8.0) only."

pytestmark = pytest.mark.cpu_only


def _torchrun(task: str, args: list[str], allow: bool, nproc: int = 1, timeout: int = 300):
    return launch(task, args, nproc=nproc, allow_non_a100=allow, timeout=timeout)


@pytest.fixture
def run_args(tmp_path, run_dir_bindings) -> list[str]:
    """--gin-bindings arguments: the tiny model, its run directory tmp_path / "run"."""
    bindings = TINY_BINDINGS + run_dir_bindings(tmp_path)
    return [x for b in bindings for x in ("--gin-bindings", b)]


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_launcher_refuses_without_a100(task, tmp_path, run_args):
    proc = _torchrun(task, run_args, allow=False)
    assert proc.returncode == 1  # torchrun's own code for any failed worker
    # the hardware policy's text (docs/design.md) as the one error line
    refusal = f"RuntimeError: {REFUSAL} Detected no CUDA GPU (SM n/a). Please use an A100 GPU."
    assert error_lines(proc.stderr) == [f"error: {refusal}"]
    assert "exitcode  : 1" in proc.stderr  # the worker's code, in torchrun's summary
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
    assert "final eval @ step 4" in proc.stderr
    assert not error_lines(proc.stderr) and "Traceback" not in proc.stderr
