"""One exit convention: an expected failure is one ``error:`` line and exit 2 (config, usage, data)
or 1 (runtime), with no traceback, launched directly or under torchrun; a bug keeps its traceback.
"""

from __future__ import annotations

import errno
import json
import re

import pytest
import torch
from dist_helpers import ROOT, TINY_BINDINGS, error_lines, launch

from hstu.config.gin_utils import ConfigError
from hstu.errors import RunError, UsageError, error_line, exit_code_for
from hstu.training import launcher
from hstu.training.gpu_policy import GPURefusedError

REFUSAL = (
    "RuntimeError: This code is optimized for A100 GPU (SM 8.0) only. Detected no CUDA GPU "
    "(SM n/a). Please use an A100 GPU."
)


# ---- the classification --------------------------------------------------------------------------


class _Custom(Exception):
    exit_code = 2


@pytest.mark.parametrize(
    "exc, code",
    [
        (ConfigError("Unknown field"), 2),
        (ValueError("bad value"), 2),
        (TypeError("bad type"), 2),
        (FileNotFoundError(errno.ENOENT, "No such file", "data/x"), 2),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "runs"), 2),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "x.npz"), 2),
        (UsageError("--nproc_per_node too large"), 2),
        (_Custom("decides itself"), 2),
        (FloatingPointError("loss became nan at step 3"), 1),
        (OSError(errno.ENOSPC, "No space left on device"), 1),
        (PermissionError(errno.EACCES, "Permission denied", "/ro"), 1),
        (OSError(errno.EIO, "Input/output error"), 1),
        (MemoryError(), 1),
        (torch.OutOfMemoryError("CUDA out of memory."), 1),
        (RunError("disk full while saving"), 1),
        (RunError("told", exit_code=2), 2),
        (GPURefusedError("refused"), 1),
        (RuntimeError("a bug"), None),
        (KeyError("momentum"), None),
        (AttributeError("a bug"), None),
        (IndexError("a bug"), None),
    ],
)
def test_exit_code_for(exc, code):
    assert exit_code_for(exc) == code


def test_exit_code_attribute_wins_over_the_class():
    exc = PermissionError(errno.EACCES, "Permission denied")
    exc.exit_code = 2  # e.g. an unwritable output directory named in the config
    assert exit_code_for(exc) == 2
    exc.exit_code = True  # not an exit code
    assert exit_code_for(exc) == 1


def test_error_line_is_one_line():
    assert error_line(ValueError("a\n  b\n\nc ")) == "error: a b c"
    assert error_line(MemoryError()) == "error: MemoryError"
    assert error_line("plain text") == "error: plain text"


# ---- main() in this process: the reporting -------------------------------------------------------


@pytest.fixture
def quiet_main(monkeypatch):
    """launcher.main without its logging set-up and with a CPU GPU policy that passes."""
    monkeypatch.setattr(launcher, "_setup_logging", lambda level: None)
    monkeypatch.setenv("HSTU_ALLOW_NON_A100", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _failing_training(monkeypatch, exc: BaseException) -> None:
    import hstu.training.trainer as trainer

    def run_training(cfg, device_type="cpu"):
        raise exc

    monkeypatch.setattr(trainer, "run_training", run_training)


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (
            FileNotFoundError("dataset data/ml-1m not found"),
            2,
            "error: dataset data/ml-1m not found",
        ),
        (FloatingPointError("loss became nan at step 2"), 1, "error: loss became nan at step 2"),
        (
            OSError(errno.ENOSPC, "No space left on device", "runs/x/checkpoints"),
            1,
            "error: [Errno 28] No space left on device: 'runs/x/checkpoints'",
        ),
        (KeyboardInterrupt(), 130, "error: interrupted (Ctrl-C)"),
    ],
)
def test_main_expected_failure_is_one_line(quiet_main, monkeypatch, capsys, exc, code, line):
    _failing_training(monkeypatch, exc)
    assert launcher.main("ranking", []) == code
    err = capsys.readouterr().err
    assert err.splitlines() == [line]


def test_main_unexpected_exception_propagates(quiet_main, monkeypatch, tmp_path, capsys):
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    _failing_training(monkeypatch, KeyError("momentum"))
    with pytest.raises(KeyError):
        launcher.main("ranking", [])
    assert not error_lines(capsys.readouterr().err)
    # as torch's @record: the traceback goes into torchrun's failure summary
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "KeyError: 'momentum'"
    assert "Traceback (most recent call last)" in record["extraInfo"]["py_callstack"]


def test_bad_flag_and_bad_config_exit_2(quiet_main, capsys):
    assert launcher.main("ranking", ["--log-level", "loud"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: argument --log-level: --log-level 'loud' is not supported")
    assert line.endswith("(see pretrain_gr_ranking.py --help)")
    assert launcher.main("ranking", ["--gin-bindings", "TrainerArgs.nope=1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: Unknown field 'TrainerArgs.nope'")


def test_gpu_refusal_keeps_the_policy_text(quiet_main, monkeypatch, capsys):
    monkeypatch.delenv("HSTU_ALLOW_NON_A100")
    assert launcher.main("retrieval", []) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {REFUSAL}"]


def test_one_line_per_torchrun_attempt(quiet_main, monkeypatch, tmp_path, capsys):
    """Every failing worker writes its error file; only the first prints the line."""
    _failing_training(monkeypatch, FloatingPointError("loss became inf at step 7"))
    attempt = tmp_path / "attempt_0"
    for local_rank in (1, 0):
        error_file = attempt / str(local_rank) / "error.json"
        error_file.parent.mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert launcher.main("ranking", []) == 1
        record = json.loads(error_file.read_text())["message"]
        assert record["message"] == (
            "none (expected failure, exit code 1): loss became inf at step 7"
        )
        assert "py_callstack" not in record["extraInfo"]
    assert capsys.readouterr().err.splitlines() == ["error: loss became inf at step 7"]


# ---- the launchers as a user runs them -------------------------------------------------------------

# (case, task, extra bindings as a function of tmp_path, exit code, text of the error line)
CASES = {
    "bad_binding": (
        "ranking",
        lambda tmp: ["TrainerArgs.not_a_field=3"],
        2,
        "error: Unknown field 'TrainerArgs.not_a_field'",
    ),
    "missing_dataset": (
        "retrieval",
        lambda tmp: [
            "DatasetArgs.dataset_name='ml-1m'",
            f"DatasetArgs.dataset_path='{tmp}/nowhere'",
        ],
        2,
        "error: ",
    ),
    "divergence": (
        "ranking",
        lambda tmp: ["OptimizerArgs.learning_rate=1e30"],
        1,
        "error: loss became nan at step",
    ),
}


def _args(tmp_path, extra: list[str]) -> list[str]:
    bindings = TINY_BINDINGS + [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'"]
    return [x for b in bindings + extra for x in ("--gin-bindings", b)]


def _check_line(stderr: str, case: str, tmp_path) -> str:
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith(CASES[case][3]), lines
    if case == "missing_dataset":
        assert "nowhere" in lines[0] and "hstu.data.prepare" in lines[0]
    if case == "divergence":
        assert "OptimizerArgs.learning_rate" in lines[0]
    assert f'File "{ROOT / "hstu"}' not in stderr, "a traceback through our code"
    return lines[0]


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_direct_launch(case, tmp_path):
    task, extra, code, _ = CASES[case]
    proc = launch(task, _args(tmp_path, extra(tmp_path)))
    assert proc.returncode == code, proc.stderr[-4000:]
    _check_line(proc.stderr, case, tmp_path)
    assert "Traceback" not in proc.stderr


def _check_torchrun(proc, case: str, tmp_path) -> None:
    code = CASES[case][2]
    # torchrun turns any failed worker into its own exit code 1 and a ChildFailedError summary
    assert proc.returncode == 1, proc.stderr[-4000:]
    line = _check_line(proc.stderr, case, tmp_path)
    # our line comes first; the one traceback is torchrun's own, after it
    assert proc.stderr.count("Traceback") == 1
    assert proc.stderr.index(line) < proc.stderr.index("Traceback")
    assert "ChildFailedError" in proc.stderr[proc.stderr.index("Traceback") :]
    # the worker's exit code and our message are in torchrun's summary (its error file)
    assert re.search(rf"exitcode\s+: {code} ", proc.stderr)
    assert f"traceback : none (expected failure, exit code {code}): " in proc.stderr


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_torchrun_one_process(case, tmp_path):
    task, extra, _, _ = CASES[case]
    _check_torchrun(launch(task, _args(tmp_path, extra(tmp_path)), nproc=1), case, tmp_path)


@pytest.mark.cpu_only
@pytest.mark.parametrize("case", ["bad_binding", "divergence"])
def test_torchrun_two_gloo_processes(case, tmp_path):
    """Both ranks fail the same way; the job still prints one line."""
    task, extra, _, _ = CASES[case]
    _check_torchrun(launch(task, _args(tmp_path, extra(tmp_path)), nproc=2), case, tmp_path)
