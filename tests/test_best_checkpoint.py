"""The best evaluation's checkpoint and early stopping (TrainerArgs.best_metric,
best_metric_mode, early_stop_patience; hstu.training.best).

Unit: the tracker (max / min, NaN, patience, its state), the metric's resolution and the config's
errors. Trainer (CPU): with scripted evaluation scores the best step's checkpoint is saved,
marked in best.json and spared by pruning, the run stops after `patience` evaluations without
improvement, and a resumed run keeps its best and its count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hstu.config.args import TrainerArgs
from hstu.config.gin_utils import load_config
from hstu.inference.retriever import locate_checkpoint
from hstu.training.best import (
    BestMetric,
    eval_metric_names,
    headline_metric,
    resolve_best_metric,
)
from hstu.training.checkpoint import BEST_FILE, Checkpointer
from hstu.training.launcher import run_summary
from hstu.training.trainer import Trainer, run_training

SMALL = [
    "DatasetArgs.synthetic_num_users=200",
    "DatasetArgs.synthetic_num_items=100",
    "DatasetArgs.max_history_seqlen=16",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=8",
    "TrainerArgs.train_batch_size=8",
    "TrainerArgs.log_interval=1",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.progress_bar=False",
]


def test_the_tracker_keeps_the_best_and_counts_evaluations_without_improvement():
    best = BestMetric("NDCG@10", "max", patience=2)
    assert best.update(2, {"NDCG@10": 0.10}) and (best.value, best.step) == (0.10, 2)
    assert not best.update(4, {"NDCG@10": 0.10})  # equal is no improvement
    assert not best.update(6, {"NDCG@10": math.nan})  # nor is NaN
    assert best.stale == 2 and best.should_stop
    assert best.update(8, {"NDCG@10": 0.2}) and best.stale == 0 and not best.should_stop
    low = BestMetric("loss", "min")
    assert low.update(1, {"loss": 2.0}) and low.update(2, {"loss": 1.5})
    assert not low.update(3, {"loss": 1.6}) and not low.should_stop  # patience 0: never
    with pytest.raises(ValueError, match="reported no 'loss'"):
        low.update(4, {"auc/mean": 0.5})
    again = BestMetric("loss", "min")
    assert again.load_state_dict(low.state_dict())
    assert (again.value, again.step, again.stale) == (1.5, 2, 1)
    assert not BestMetric("loss", "max").load_state_dict(low.state_dict())  # another mode


def test_the_metric_resolves_against_the_evaluation_names():
    ranking = eval_metric_names("ranking", ["click", "like"], [])
    assert ranking == ["auc/click", "auc/like", "auc/mean", "loss"]
    retrieval = eval_metric_names("retrieval", [], [10, 50])
    assert retrieval == ["HR@10", "HR@50", "NDCG@10", "NDCG@50", "MRR"]
    head = headline_metric("retrieval", ["ndcg@10", "hr@10"], retrieval)
    assert head == "NDCG@10"
    assert resolve_best_metric("auto", "auto", retrieval, head) == ("NDCG@10", "max")
    assert resolve_best_metric("hr@50", "auto", retrieval, head) == ("HR@50", "max")
    assert resolve_best_metric("loss", "auto", ranking, "auc/mean") == ("loss", "min")
    assert resolve_best_metric("auc/click", "min", ranking, "auc/mean") == ("auc/click", "min")
    with pytest.raises(ValueError, match=r"best_metric='NDCG@20' is not one of .*'NDCG@10'"):
        resolve_best_metric("NDCG@20", "auto", retrieval, head)


def test_the_settings_are_checked():
    with pytest.raises(
        ValueError, match="needs the metric it watches: set TrainerArgs.best_metric"
    ):
        TrainerArgs(early_stop_patience=3)
    with pytest.raises(ValueError, match="TrainerArgs.eval_interval=0 evaluates only at the end"):
        TrainerArgs(early_stop_patience=3, best_metric="auto", eval_interval=0)
    with pytest.raises(ValueError, match="best_metric_mode"):
        TrainerArgs(best_metric="auto", best_metric_mode="up")
    with pytest.raises(ValueError, match="early_stop_patience"):
        TrainerArgs(best_metric="auto", early_stop_patience=-1)
    cfg = load_config("ranking", [], SMALL + ["TrainerArgs.best_metric='NDCG@10'"])
    with pytest.raises(ValueError, match=r"not one of this run's evaluation metrics \['auc/"):
        Trainer(cfg)


def _scripted_scores(monkeypatch, scores: dict[int, float]) -> list[int]:
    """Trainer.evaluate returns ``scores[step]`` as auc/mean (and 1 - it as the loss); returns the
    list the evaluated steps are appended to."""
    steps: list[int] = []

    def evaluate(self):
        steps.append(self.step)
        return {"auc/mean": scores[self.step], "loss": 1.0 - scores[self.step]}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    return steps


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config(
        "ranking",
        [],
        SMALL
        + [
            f"TrainerArgs.log_dir='{tmp_path}'",
            f"TrainerArgs.run_name='{name}'",
            "TrainerArgs.eval_interval=2",
            "TrainerArgs.best_metric='auto'",
            "TrainerArgs.early_stop_patience=2",
            "TrainerArgs.ckpt_keep_last=1",
            "TrainerArgs.ckpt_save_interval=3",
            *extra,
        ],
    )


def _run_without_patience(tmp_path: Path, steps: int, save_interval: int):
    """A run of ``steps`` steps that tracks the best but never stops early."""
    return run_training(
        _cfg(
            tmp_path,
            "a",
            f"TrainerArgs.max_train_iters={steps}",
            "TrainerArgs.early_stop_patience=0",
            f"TrainerArgs.ckpt_save_interval={save_interval}",
        )
    )


def test_the_best_checkpoint_is_kept_and_the_run_stops_early(tmp_path, monkeypatch):
    scores = {2: 0.5, 4: 0.7, 6: 0.6, 8: 0.65, 10: 0.69, 12: 0.71, 14: 0.5}
    evaluated = _scripted_scores(monkeypatch, scores)
    result = run_training(_cfg(tmp_path, "a", "TrainerArgs.max_train_iters=20"))
    # best at step 4; 6 and 8 did not improve: stopped at 8 (no second evaluation of step 8)
    assert evaluated == [2, 4, 6, 8] and result.stopped_early_at == 8
    assert [s for s, _ in result.losses] == list(range(1, 9))
    root = tmp_path / "a" / "checkpoints"
    best_dir = root / "step_00000004"
    assert result.best == {
        "metric": "auc/mean",
        "mode": "max",
        "value": 0.7,
        "step": 4,
        "checkpoint": str(best_dir),
    }
    record = json.loads((root / BEST_FILE).read_text())
    assert record == {"dir": "step_00000004", "step": 4, "metric": "auc/mean", "mode": "max",
                      "value": 0.7}  # fmt: skip
    # keep_last=1: the final checkpoint (step 8) and the best one; step 6's was pruned
    assert [p.name for p in Checkpointer.list_checkpoints(root)] == [
        "step_00000004",
        "step_00000008",
    ]
    assert Checkpointer.best_checkpoint(root) == best_dir
    with pytest.raises(ValueError, match="is not a complete checkpoint of"):
        Checkpointer(root).mark_best(tmp_path / "elsewhere", {"step": 1})
    # best.json names the checkpoint to resume, evaluate or export from
    assert Checkpointer.resolve(root / BEST_FILE) == best_dir
    assert locate_checkpoint(root / BEST_FILE)[0] == best_dir
    assert Checkpointer.read_meta(best_dir)["step"] == 4
    summary = run_summary(_cfg(tmp_path, "x"), result, 1.0)
    assert "stopped early at step 8: auc/mean did not improve in 2 evaluations" in summary
    assert (
        f"best auc/mean (max): 0.7000 at step 4 (4 evaluations; checkpoint {best_dir})" in summary
    )
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["result"]["stopped_early_at"] == 8 and run["result"]["best"]["step"] == 4

    # resumed from the last checkpoint: the best and the count come back, so the next
    # evaluation without improvement (step 10: 0.69 < 0.7) stops the run again
    evaluated.clear()
    resumed = run_training(
        _cfg(tmp_path, "b", "TrainerArgs.max_train_iters=20", f"TrainerArgs.ckpt_load_dir='{root}'")
    )
    assert evaluated == [10] and resumed.stopped_early_at == 10
    assert resumed.best["step"] == 4 and resumed.best["value"] == 0.7


def test_without_patience_the_run_goes_on_and_keeps_the_best(tmp_path, monkeypatch):
    scores = {2: 0.5, 4: 0.7, 6: 0.6, 8: 0.8, 10: 0.75}
    evaluated = _scripted_scores(monkeypatch, scores)
    result = _run_without_patience(tmp_path, 10, 0)  # the final one only, and the best ones
    assert evaluated == [2, 4, 6, 8, 10] and result.stopped_early_at is None
    assert result.best["step"] == 8 and result.best["value"] == 0.8
    root = tmp_path / "a" / "checkpoints"
    # the best moved from 4 to 8, so 4 was pruned with keep_last=1; the final one is 10
    assert [p.name for p in Checkpointer.list_checkpoints(root)] == [
        "step_00000008",
        "step_00000010",
    ]
    assert Checkpointer.best_checkpoint(root).name == "step_00000008"
    (root / BEST_FILE).write_text('{"dir": "step_00000004"}')  # pruned since
    with pytest.raises(FileNotFoundError, match="names no complete checkpoint"):
        Checkpointer.resolve(root / BEST_FILE)


def test_best_tracking_without_checkpoints_saves_nothing(tmp_path, monkeypatch):
    _scripted_scores(monkeypatch, {2: 0.5, 4: 0.4, 6: 0.3})
    result = _run_without_patience(tmp_path, 6, -1)
    assert result.best["step"] == 2 and result.best["checkpoint"] is None
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_the_last_checkpoint_holds_the_last_evaluation(tmp_path, monkeypatch):
    """The interval's save at the last step comes before the final evaluation: when that
    evaluation changes the best, the step is written again, so the checkpoint that best.json
    names (and the latest) carry the tracker as it ends."""
    _scripted_scores(monkeypatch, {2: 0.5, 4: 0.7, 5: 0.0, 6: 0.6, 8: 0.8, 10: 0.9})
    result = _run_without_patience(tmp_path, 10, 5)
    assert result.best["step"] == 10 and result.best["value"] == 0.9
    root = tmp_path / "a" / "checkpoints"
    assert Checkpointer.best_checkpoint(root).name == "step_00000010"
    step, state, _ = Checkpointer.load(root)
    assert step == 10 and state["best_metric"]["value"] == 0.9
    assert state["best_metric"]["step"] == 10 and state["best_metric"]["stale"] == 0
