"""A quiet, informative console: no third-party deprecation noise, the resolved configuration in
the run directory (one console line), progress lines with wall time, steps/s and an ETA, and an
end-of-run summary (best metric and its step, wall time, checkpoints, TensorBoard)."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
from dist_helpers import TINY_BINDINGS, error_lines, launch

from hstu.config.gin_utils import load_config
from hstu.training import warnings_filter
from hstu.training.launcher import main_metric, run_summary
from hstu.training.logger import format_duration
from hstu.training.trainer import TrainResult

# text of every third-party warning a CPU run printed before the filters
NOISE = (
    "is now DEPRECATED",
    "Failed to import: fbgemm_gpu",
    "HeuristicalStorageReservation",
    "broadcast_buffers",
    "deprecating ShardedTensor",
    "is_fx_tracing",
    "TopologyFactory",
    "known issue with TorchRec",
    "torch.jit.script",
    "torch.jit.interface",
    "This API is deprecated",
    "Warning:",  # any `<Category>Warning: ` line of the warnings module
)

PROGRESS = re.compile(
    r"step (\d+)/(\d+) \((\d+)%\) loss [\d.]+ lr [\d.e+-]+ \| ([\d.]+) steps/s ([\d.]+) samples/s "
    r"\| elapsed (\d+:\d\d:\d\d) ETA (\d+:\d\d:\d\d)$"
)


def _run(task: str, tmp_path: Path, nproc: int | None, extra: list[str]):
    bindings = TINY_BINDINGS + [
        f"TrainerArgs.log_dir='{tmp_path}'",
        "TrainerArgs.run_name='run'",
        "TrainerArgs.max_train_iters=6",
        "TrainerArgs.eval_interval=2",
        *extra,
    ]
    args = [x for b in bindings for x in ("--gin-bindings", b)]
    # every warning category shown (as `python -W default`): the filters must hold on their own
    proc = launch(task, args, nproc=nproc, PYTHONWARNINGS="default", CI="1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr, tmp_path / "run"


def _check_console(stderr: str, run: Path, metric: str) -> None:
    for text in NOISE:
        assert text not in stderr, f"{text!r} on the console:\n{stderr[-4000:]}"
    assert not error_lines(stderr) and "Traceback" not in stderr

    # the configuration: a file in the run directory, one line on the console
    assert "TrainerArgs:" not in stderr and "DatasetArgs:" not in stderr
    assert stderr.count("configuration: ") == 1
    summary_file = run / "config_summary.txt"
    assert f"{run / 'config.gin'}" in stderr and f"{summary_file}" in stderr
    summary = summary_file.read_text()
    assert "TrainerArgs:" in summary and re.search(r"\* max_train_iters += 6\n", summary)
    assert len(stderr.splitlines()) < 40, stderr

    # progress: every log_interval steps, with elapsed time, steps/s and an ETA
    progress = [m for line in stderr.splitlines() if (m := PROGRESS.search(line))]
    assert [int(m.group(1)) for m in progress] == [2, 4, 6]
    assert [int(m.group(3)) for m in progress] == [33, 66, 100]
    assert all(float(m.group(4)) > 0 and float(m.group(5)) > 0 for m in progress)
    assert progress[-1].group(7) == "0:00:00"  # nothing left at the last step

    # the end-of-run summary
    tail = stderr[stderr.index("run finished in ") :]
    assert re.match(r"run finished in \d+:\d\d:\d\d \(wall time\): 6 steps trained", tail)
    best = re.search(rf"  best {re.escape(metric)}: ([\d.]+) at step (\d+) \(3 evaluations\)", tail)
    assert best and int(best.group(2)) in (2, 4, 6), tail
    assert "  final eval @ step 6: " in tail and f"{metric}=" in tail
    assert f"  checkpoints: {run / 'checkpoints'} (latest: step_00000006)" in tail
    assert f"  TensorBoard: tensorboard --logdir {run}" in tail


@pytest.mark.cpu_only
def test_ranking_console(tmp_path):
    stderr, run = _run("ranking", tmp_path, None, [])
    _check_console(stderr, run, "auc/mean")


@pytest.mark.cpu_only
def test_retrieval_console_two_processes(tmp_path):
    stderr, run = _run("retrieval", tmp_path, 2, ["RetrievalArgs.eval_metrics=('NDCG@10', 'MRR')"])
    _check_console(stderr, run, "NDCG@10")
    assert "[rank1] INFO" not in stderr  # other ranks speak only to warn


# ---- pieces ------------------------------------------------------------------------------------


def test_format_duration():
    assert format_duration(0) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
    assert format_duration(3 * 3600 + 25 * 60 + 7) == "3:25:07"
    assert format_duration(86400 + 61) == "1 day, 0:01:01"
    assert format_duration(3 * 86400) == "3 days, 0:00:00"
    assert format_duration(None) == format_duration(float("inf")) == format_duration(-1) == "?"


def test_main_metric_and_summary(clean_gin, tmp_path):
    ranking = load_config("ranking", [], [])
    assert main_metric(ranking, ["auc/click", "auc/mean", "loss"]) == "auc/mean"
    assert main_metric(ranking, ["loss", "auc/click"]) == "auc/click"
    retrieval = load_config("retrieval", [], ["RetrievalArgs.eval_metrics=('NDCG@10', 'HR@10')"])
    assert main_metric(retrieval, ["HR@10", "NDCG@10", "MRR"]) == "NDCG@10"

    result = TrainResult(
        run_dir=tmp_path / "run",
        losses=[(s, 1.0) for s in range(1, 11)],
        evals=[(5, {"HR@10": 0.2, "NDCG@10": 0.12}), (10, {"HR@10": 0.3, "NDCG@10": 0.11})],
        checkpoint_dir=tmp_path / "run" / "checkpoints" / "step_00000010",
    )
    text = run_summary(retrieval, result, 3725.0)
    lines = text.splitlines()
    assert lines[0] == "run finished in 1:02:05 (wall time): 10 steps trained, now at step 10/200"
    assert lines[1] == "  best NDCG@10: 0.1200 at step 5 (2 evaluations)"
    assert lines[2] == "  final eval @ step 10: HR@10=0.3000, NDCG@10=0.1100"
    assert lines[3] == f"  checkpoints: {tmp_path / 'run' / 'checkpoints'} (latest: step_00000010)"
    assert lines[-1] == f"  TensorBoard: tensorboard --logdir {tmp_path / 'run'}"

    bare = run_summary(ranking, TrainResult(run_dir=tmp_path), 1.0)
    assert "final eval: none" in bare and "checkpoints: none saved" in bare


def test_warning_filters_are_targeted():
    """The known messages are dropped; another warning of the same category still shows."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings_filter.install()
        warnings_filter.install()  # idempotent
        known = [
            (DeprecationWarning, "\x1b[93m\n The Python module fbgemm_gpu.x is now DEPRECATED", "fbgemm_gpu.x"),
            (FutureWarning, "HeuristicalStorageReservation is known to cause issues, ...", "torchrec.a"),
            (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor.", "hstu.r"),
            (DeprecationWarning, "`torch.jit.script` is deprecated. Please switch", "torch.jit._script"),
        ]  # fmt: skip
        for category, message, module in known:
            warnings.warn_explicit(message, category, "f.py", 1, module=module)
        assert seen == []
        warnings.warn_explicit("something else is deprecated", DeprecationWarning, "f.py", 1, "m")
        warnings.warn_explicit("HeuristicalStorageReservation", FutureWarning, "f.py", 1, "mine")
        assert [str(w.message) for w in seen] == [
            "something else is deprecated",
            "HeuristicalStorageReservation",  # same text from another module: shown
        ]


def test_log_filters_are_targeted(caplog):
    warnings_filter.install()
    planner = logging.getLogger("torchrec.distributed.planner.types")
    with caplog.at_level(logging.WARNING):
        planner.warning("The topology was constructed directly rather than via TopologyFactory.")
        planner.warning("Sharding plan does not fit in memory")
    assert [r.getMessage() for r in caplog.records] == ["Sharding plan does not fit in memory"]
