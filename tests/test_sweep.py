"""scripts/sweep.py on CPU: the grid, runs at once, results read back, failures, reruns."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from model_helpers import TINY_RUN

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "synthetic_retrieval.gin")

TINY = [
    *TINY_RUN,
    "TrainerArgs.max_train_iters=6",
    "TrainerArgs.eval_interval=3",
    "TrainerArgs.ckpt_save_interval=3",
]


def _rows(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "sweep.csv", newline="") as f:
        return {r["run"]: r for r in csv.DictReader(f)}


def test_values_split_at_top_level_commas_only(load_script):
    sweep = load_script("sweep")
    assert sweep.split_values("1e-3, 5e-4") == ["1e-3", "5e-4"]
    assert sweep.split_values("'a,b',(1, 2),[3,4]") == ["'a,b'", "(1, 2)", "[3,4]"]
    grid = sweep.parse_grid(["OptimizerArgs.learning_rate=1e-3,5e-4"], "1,2")
    assert grid == [
        ("OptimizerArgs.learning_rate", ["1e-3", "5e-4"]),
        ("TrainerArgs.seed", ["1", "2"]),
    ]
    runs = sweep.expand(grid)
    assert [r.name for r in runs] == [
        "learning_rate-1e-3_seed-1",
        "learning_rate-1e-3_seed-2",
        "learning_rate-5e-4_seed-1",
        "learning_rate-5e-4_seed-2",
    ]
    assert runs[1].bindings == ["OptimizerArgs.learning_rate=1e-3", "TrainerArgs.seed=2"]
    # a field name two classes share is written with its class
    two = sweep.expand(sweep.parse_grid(["A.x=1", "B.x=2"], ""))
    assert two[0].name == "A-x-1_B-x-2"


@pytest.mark.parametrize(
    "grid, seeds, message",
    [
        (["OptimizerArgs.learning_rate"], "", "expected Class.field=v1,v2"),
        (["learning_rate=1"], "", "expected Class.field=v1,v2"),
        (["A.x=1,,2"], "", "an empty value"),
        (["A.x=1,1"], "", "a value given twice"),
        (["A.x=1", "A.x=2"], "", "A.x given twice"),
        (["TrainerArgs.seed=1"], "2", "give the seeds once"),
        ([], "", "nothing to sweep"),
        (["A.x='a b','a_b'"], "", "the same name"),
    ],
)
def test_a_bad_grid_is_named(load_script, grid, seeds, message):
    sweep = load_script("sweep")
    with pytest.raises(ValueError, match=message):
        sweep.expand(sweep.parse_grid(grid, seeds))


def test_a_bad_run_configuration_stops_the_sweep_before_any_run(load_script, tmp_path, capsys):
    sweep = load_script("sweep")
    out = tmp_path / "sweep"
    argv = ["--config", CONFIG, "--out", str(out), "--grid", "NetworkArgs.num_layers=1,0"]
    assert sweep.main([*argv, "--allow-non-a100", "--bindings", *TINY]) == 2
    err = capsys.readouterr().err
    assert "error: run num_layers-0 (NetworkArgs.num_layers=0)" in err and "num_layers" in err
    assert not out.exists()


def test_a_sweep_runs_its_grid_reports_failures_and_skips_finished_runs_on_rerun(
    load_script, tmp_path, capsys
):
    sweep = load_script("sweep")
    out = tmp_path / "sweep"
    argv = ["--config", CONFIG, "--out", str(out), "--parallel", "2", "--allow-non-a100"]
    # one grid value fails at start (a checkpoint that does not exist): the others go on
    argv += ["--grid", "OptimizerArgs.learning_rate=1e-3,5e-4", "--bindings", *TINY]
    bad = ["TrainerArgs.ckpt_load_dir='/nonexistent/ckpt'"]
    assert sweep.main(argv) == 0
    rows = _rows(out)
    assert set(rows) == {"learning_rate-1e-3", "learning_rate-5e-4"}
    for name, row in rows.items():
        assert row["status"] == "finished" and row["main_metric"] == "HR@10"
        lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [3, 6]
        best = max(x["metrics"]["HR@10"] for x in lines)
        assert abs(float(row["best"]) - best) < 1e-6
        assert abs(float(row["final HR@10"]) - lines[-1]["metrics"]["HR@10"]) < 1e-6
        assert float(row["fit_s"]) > 0
        info = json.loads((out / name / "run.json").read_text())
        assert info["status"] == "finished" and info["result"]["step"] == 6
    assert "learning_rate-1e-3" in capsys.readouterr().out
    # the same command again: nothing runs (the logs do not grow), the table is the same
    logs = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    assert sweep.main(argv) == 0
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == logs
    assert _rows(out) == rows
    # --dry-run lists the runs and the finished ones' results
    capsys.readouterr()
    assert sweep.main([*argv, "--dry-run"]) == 0
    shown = capsys.readouterr().out
    assert "(2 finished before)" in shown and "learning_rate-5e-4: finished" in shown
    assert "best HR@10" in shown
    # a run that fails: reported with its error line, exit 1
    assert sweep.main([*argv, *bad, "--seeds", "7"]) == 1
    failed = _rows(out)
    assert {r["status"] for r in failed.values()} == {"failed"}
    assert (
        "checkpoint path /nonexistent/ckpt does not exist"
        in failed["learning_rate-1e-3_seed-7"]["error"]
    )
    assert "failed: learning_rate-5e-4_seed-7" in capsys.readouterr().err


def _one_finished_run(sweep, tmp_path, seed: int):
    """A sweep of one tiny run of ``seed``, finished: (its argv, out dir, run dir, run.json)."""
    out = tmp_path / "sweep"
    argv = ["--config", CONFIG, "--out", str(out), "--allow-non-a100", "--seeds", str(seed)]
    argv += ["--bindings", *TINY]
    assert sweep.main(argv) == 0
    run = out / f"seed-{seed}"
    return argv, out, run, json.loads((run / "run.json").read_text())


def test_an_unfinished_run_continues_from_its_checkpoint(load_script, tmp_path):
    sweep = load_script("sweep")
    argv, out, run, info = _one_finished_run(sweep, tmp_path, 3)
    # as if the run had died after its last checkpoint, before it finished
    info["status"] = "started"
    (run / "run.json").write_text(json.dumps(info))
    assert sweep.main(argv) == 0
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished"
    assert info["resumed_from"].endswith("step_00000006")
    # the continued run appended its evaluation to the same log
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 6, 6]


def test_more_steps_continue_the_finished_runs(load_script, tmp_path):
    sweep = load_script("sweep")
    out = tmp_path / "sweep"
    argv = ["--config", CONFIG, "--out", str(out), "--allow-non-a100", "--seeds", "4"]
    assert sweep.main([*argv, "--bindings", *TINY]) == 0
    assert sweep.main([*argv, "--bindings", *TINY, "TrainerArgs.max_train_iters=9"]) == 0
    info = json.loads((out / "seed-4" / "run.json").read_text())
    assert info["result"]["step"] == 9 and info["resumed_from"].endswith("step_00000006")
    assert _rows(out)["seed-4"]["status"] == "finished"


def test_an_interrupted_sweep_stops_its_runs_and_keeps_its_table(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "sweep"
    script = Path(__file__).resolve().parents[1] / "scripts" / "sweep.py"
    long_run = [*TINY, "TrainerArgs.max_train_iters=100000", "TrainerArgs.eval_interval=0"]
    cmd = [sys.executable, str(script), "--config", CONFIG, "--out", str(out), "--parallel", "1"]
    cmd += ["--allow-non-a100", "--seeds", "1,2", "--bindings", *long_run]
    # started with SIGINT ignored, as a background job of a script is: the sweep still stops
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 120
        # wait until the first run trains (its run.json says so)
        while time.monotonic() < deadline:
            info = out / "seed-1" / "run.json"
            if info.is_file() and json.loads(info.read_text() or "{}").get("status") == "started":
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the first run did not start")
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    rows = _rows(out)
    assert rows["seed-1"]["status"] == "interrupted" and rows["seed-2"]["status"] == "not run"
    assert "results:" in stdout
    # the run stopped on its SIGINT (the launcher's exit), not killed after the waits
    log = (out / "logs" / "seed-1.log").read_text()
    assert "interrupted" in log.lower(), log[-2000:]


def test_runs_go_to_the_least_loaded_device(load_script):
    sweep = load_script("sweep")
    run = sweep.Run
    on = [run("a", {}, device="0"), run("b", {}, device="0"), run("c", {}, device="1")]
    assert sweep.pick_device(["0", "1", "2"], on) == "2"
    assert sweep.pick_device(["0", "1"], on) == "1"
    assert sweep.pick_device(["0", "1"], []) == "0"


def test_seeds_are_summarised_per_setting(load_script):
    sweep = load_script("sweep")

    def run(lr, seed, best=None, final=None):
        r = sweep.Run(f"{lr}-{seed}", {"A.lr": lr, "TrainerArgs.seed": seed})
        r.main_metric, r.best = "HR@10", best
        r.final_metrics = {} if final is None else {"HR@10": final}
        return r

    runs = [
        run("1", "1", 0.2, 0.1),
        run("1", "2", 0.4, 0.3),
        run("2", "1", 0.5, 0.5),
        run("2", "2"),  # failed: no result
    ]
    lines = sweep.seed_summary(runs).splitlines()
    assert lines[0].split() == ["A.lr", "seeds", "best", "HR@10", "final", "HR@10"]
    # best mean first; the standard deviation is the sample one (n - 1)
    assert lines[1].split() == ["2", "1/2", "0.5000", "+-", "0.0000", "0.5000", "+-", "0.0000"]
    assert lines[2].split() == ["1", "2/2", "0.3000", "+-", "0.1414", "0.2000", "+-", "0.1414"]
    no_seeds = [sweep.Run("x", {"A.lr": "1"})]
    assert sweep.seed_summary(no_seeds) == ""


def test_an_out_directory_that_cannot_be_made_is_named(load_script, tmp_path, capsys):
    sweep = load_script("sweep")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    argv = ["--config", CONFIG, "--out", str(blocker / "sweep"), "--seeds", "1"]
    assert sweep.main([*argv, "--bindings", *TINY]) == 2
    assert f"error: --out {blocker / 'sweep'} cannot be created" in capsys.readouterr().err


def test_sweep_options_are_checked(load_script, tmp_path, capsys):
    sweep = load_script("sweep")
    out = ["--out", str(tmp_path / "s")]
    for argv, message in [
        (["--config", CONFIG, *out, "--seeds", "1", "--parallel", "0"], "--parallel must be >= 1"),
        (["--config", str(tmp_path / "none.gin"), *out, "--seeds", "1"], "none.gin: no such file"),
        ([*out, "--seeds", "1"], "--config"),
    ]:
        with pytest.raises(SystemExit) as info:
            sweep.main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_run_that_stopped_early_counts_as_finished(load_script, tmp_path):
    """A run that early stopping ended before max_train_iters is done: a rerun of the sweep does
    not continue it (it would only stop again at its next evaluation), and the table says where
    it stopped."""
    sweep = load_script("sweep")
    argv, out, run, info = _one_finished_run(sweep, tmp_path, 5)
    # as if TrainerArgs.early_stop_patience had ended it at its first evaluation
    info["result"].update(step=3, stopped_early_at=3)
    (run / "run.json").write_text(json.dumps(info))
    logs = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    assert sweep.main(argv) == 0
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == logs  # not rerun
    row = _rows(out)["seed-5"]
    assert row["status"] == "finished" and row["stopped_early_at"] == "3"
