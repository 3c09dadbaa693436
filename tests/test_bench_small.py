"""scripts/bench_small.py on CPU: a whole small run, timed by parts."""

from __future__ import annotations

import json
from pathlib import Path

from model_helpers import TINY_RUN

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "synthetic_retrieval.gin")

TINY = TINY_RUN


def test_bench_small_times_a_run_by_parts(load_script, tmp_path):
    bench = load_script("bench_small")
    out = tmp_path / "rows.jsonl"
    argv = ["--config", CONFIG, "--device", "cpu", "--steps", "12"]
    argv += ["--evals", "2", "--first-steps", "4", "--out", str(out), "--bindings", *TINY]
    assert bench.main(argv) == 0
    row = json.loads(out.read_text().strip().splitlines()[-1])
    assert row["steps"] == 12 and row["evals"] == 2 and row["batch"] == 8
    assert row["eval_s"] > 0 and row["train_s"] > 0 and row["startup_s"] > 0
    assert row["wall_s"] >= row["startup_s"] + row["train_s"] + row["eval_s"] - 1e-6
    assert abs(row["steps_per_s"] * row["train_s"] - 12) < 1e-6
    assert abs(row["samples_per_s"] - 8 * row["steps_per_s"]) < 1e-6
    assert row["first_steps_ms"] > 0 and row["steady_step_ms"] > 0
    assert {"HR@10", "NDCG@10"} <= set(row["metrics"])
    assert row["device"] == "cpu"


def test_graph_fields_name_what_a_graph_replays(load_script):
    from types import SimpleNamespace

    from hstu.modules.graphed_encoder import GraphStats

    bench = load_script("bench_small")
    stats = GraphStats(captures=3, capture_seconds=0.1234, replays=90, eager=4)
    cuda = SimpleNamespace(type="cuda")
    plain = SimpleNamespace(lookup_graph_stats=dict)  # no dynamic tables
    step = SimpleNamespace(
        graph_stats=lambda: stats, device=cuda, step_graphs=object(), embeddings=plain
    )
    enc = SimpleNamespace(
        graph_stats=lambda: stats, device=cuda, step_graphs=None, embeddings=plain
    )
    assert bench._graph_fields(step) == {
        "graph_scope": "step",
        "graph_captures": 3,
        "graph_capture_s": 0.123,
        "graph_replays": 90,
        "graph_eager_steps": 4,
    }
    assert bench._graph_fields(enc)["graph_scope"] == "encoder"
    off = GraphStats(disabled="capturing failed (why)")
    step.graph_stats = lambda: off
    assert bench._graph_fields(step) == {"graphs_off": "capturing failed (why)"}
    none = SimpleNamespace(graph_stats=lambda: None, device=cuda, embeddings=plain)
    assert bench._graph_fields(none) == {}
    # dynamic tables' lookup graphs are reported beside the encoder's
    dyn = {"captures": 2, "capture_seconds": 0.01, "replays": 7}
    enc.embeddings = SimpleNamespace(lookup_graph_stats=lambda: dict(dyn))
    fields = bench._graph_fields(enc)
    assert fields["lookup_graph_captures"] == 2 and fields["lookup_graph_replays"] == 7
    assert fields["graph_scope"] == "encoder"


def test_copies_start_training_together_and_are_summed(load_script, tmp_path):
    bench = load_script("bench_small")
    out = tmp_path / "rows.jsonl"
    argv = ["--config", CONFIG, "--device", "cpu", "--steps", "8", "--processes", "2"]
    argv += ["--first-steps", "4", "--out", str(out), "--bindings", *TINY]
    assert bench.main(argv) == 0
    row = json.loads(out.read_text().strip().splitlines()[-1])
    assert row["processes"] == 2 and row["steps"] == 8 and row["batch"] == 8
    assert len(row["samples_per_s"]) == 2 and min(row["samples_per_s"]) > 0
    assert abs(row["sum_samples_per_s"] - sum(row["samples_per_s"])) < 1e-6
    assert len(row["eval_s"]) == 2 and min(row["eval_s"]) > 0 and min(row["startup_s"]) > 0
    assert abs(row["fit_window_samples_per_s"] * row["fit_window_s"] - 2 * 8 * 8) < 1e-6
    starts = [span[0] for span in row["fit_spans_s"]]
    ends = [span[1] for span in row["fit_spans_s"]]
    # the barrier: both copies began training within moments of each other, before either ended
    assert min(starts) == 0.0 and max(starts) < min(ends)
    assert max(ends) == row["fit_window_s"]
    assert len(row["metrics"]) == 2 and all("HR@10" in m for m in row["metrics"])
    assert row["wall_s"] >= row["fit_window_s"]


def test_a_failing_copy_stops_the_others_with_its_error(load_script):
    import pytest

    bench = load_script("bench_small")
    argv = ["--config", CONFIG, "--device", "cpu", "--steps", "8", "--processes", "2"]
    argv += ["--first-steps", "4", "--bindings", *TINY, "NetworkArgs.num_layers=0"]
    with pytest.raises(RuntimeError, match=r"copy \d exited with 1:(.|\n)*num_layers"):
        bench.main(argv)


def test_processes_options_are_checked(load_script, capsys):
    import pytest

    bench = load_script("bench_small")
    for argv, message in [
        (["--processes", "0"], "--processes must be >= 1"),
        (["--processes", "2", "--profile", "x"], "--profile profiles one run"),
    ]:
        with pytest.raises(SystemExit):
            bench.main(["--config", CONFIG, "--device", "cpu", *argv])
        assert message in capsys.readouterr().err
