"""MetricLogger writes TensorBoard events that read_scalars / read_hparams read back."""

from __future__ import annotations

import math

import pytest
import torch

from hstu.training.logger import MetricLogger, read_hparams, read_scalars


def test_scalars_round_trip(tmp_path):
    with MetricLogger(str(tmp_path)) as tb:
        for step in (1, 2, 3):
            tb.scalar("train/loss", 1.0 / step, step)
        tb.scalar("train/lr", torch.tensor(1e-3), 3)
        tb.scalars(
            {"auc/click": 0.75, "HR@10": 0.5, "skipped": None, "undefined": math.nan},
            3,
            prefix="eval",
        )
        tb.scalars({"perf/samples_per_s": 100.0}, 3)
        tb.flush()
    scalars = read_scalars(tmp_path)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3])
    assert scalars["train/lr"] == [(3, pytest.approx(1e-3))]
    assert scalars["eval/auc/click"] == [(3, 0.75)]
    assert scalars["eval/HR@10"] == [(3, 0.5)]
    assert math.isnan(scalars["eval/undefined"][0][1])
    assert "eval/skipped" not in scalars
    assert scalars["perf/samples_per_s"] == [(3, 100.0)]


def test_hparams_and_text(tmp_path):
    tb = MetricLogger(tmp_path)
    tb.hparams(
        {
            "OptimizerArgs.learning_rate": 1e-3,
            "RankingArgs.prediction_head_arch": (256, 128),
            "task": "ranking",
            "NetworkArgs.num_layers": 2,
            "DatasetArgs.shuffle": True,
        },
        {"auc/mean": 0.71, "hparam/loss": torch.tensor(0.3)},
    )
    tb.text("config", "TrainerArgs.seed = 1234")
    tb.close()
    tb.scalar("after/close", 1.0, 0)  # a closed logger ignores calls
    hp = read_hparams(tmp_path)
    assert hp["OptimizerArgs.learning_rate"] == pytest.approx(1e-3)
    assert hp["RankingArgs.prediction_head_arch"] == "(256, 128)"
    assert hp["task"] == "ranking"
    assert hp["NetworkArgs.num_layers"] == 2
    assert hp["DatasetArgs.shuffle"] == 1.0  # torch's hparams summary stores bools as numbers
    scalars = read_scalars(tmp_path)
    # final metrics land under hparam/ so they never mix with training curves
    assert scalars["hparam/auc/mean"] == [(0, pytest.approx(0.71))]
    assert scalars["hparam/loss"] == [(0, pytest.approx(0.3))]
    assert "after/close" not in scalars


def test_disabled_logger_writes_nothing(tmp_path):
    off = MetricLogger(tmp_path / "rank1", enabled=False)
    off.scalar("x", 1.0, 0)
    off.scalars({"y": 2.0}, 0)
    off.hparams({"a": 1}, {"m": 1.0})
    off.text("t", "s")
    off.flush()
    off.close()
    assert not (tmp_path / "rank1").exists()
    none = MetricLogger(None)
    none.scalar("x", 1.0, 0)
    assert not none.enabled


def test_read_scalars_errors_and_sub_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_scalars(tmp_path / "missing")
    with MetricLogger(tmp_path / "run_a") as a:
        a.scalar("loss", 2.0, 1)
    with MetricLogger(tmp_path / "run_b") as b:
        b.scalar("acc", 0.5, 4)
    assert read_scalars(tmp_path) == {"loss": [(1, 2.0)], "acc": [(4, 0.5)]}
    with pytest.raises(TypeError, match="not a number"):
        MetricLogger(tmp_path / "c").scalar("bad", "abc", 0)
