"""End-to-end training on CPU (development mode): learning, resume, TensorBoard, distributed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import torchrun_losses

from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples, load_sequence_data
from hstu.modules.metrics import RetrievalEvaluator, popularity_scores
from hstu.training.logger import read_scalars
from hstu.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "DatasetArgs.synthetic_num_users=600",
    "DatasetArgs.synthetic_num_items=300",
    "DatasetArgs.max_history_seqlen=32",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "TrainerArgs.progress_bar=False",
]


def _cfg(task: str, tmp_path: Path, *extra: str):
    return load_config(
        task,
        [],
        SMALL + [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'", *extra],
    )


def test_ranking_learns_planted_signal(tmp_path):
    cfg = _cfg(
        "ranking",
        tmp_path,
        "TrainerArgs.max_train_iters=150",
        "TrainerArgs.train_batch_size=32",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.log_interval=25",
        "TrainerArgs.ckpt_save_interval=-1",
        "OptimizerArgs.learning_rate=3e-3",
        "EmbeddingArgs.sparse_learning_rate=0.05",
    )
    result = run_training(cfg)
    auc = result.final_metrics
    main_task = next(k for k in auc if k.startswith("auc/") and k != "auc/mean")
    assert auc[main_task] > 0.65, auc
    first = np.mean([loss for _, loss in result.losses[:10]])
    last = np.mean([loss for _, loss in result.losses[-10:]])
    assert last < first
    scalars = read_scalars(str(result.run_dir))
    for tag in (
        "train/loss",
        "train/lr",
        "perf/samples_per_s",
        "perf/tokens_per_s",
        "perf/step_time_ms",
        "eval/loss",
        f"eval/{main_task}",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars["train/loss"]] == [25, 50, 75, 100, 125, 150]


def test_retrieval_beats_popularity(tmp_path):
    cfg = _cfg(
        "retrieval",
        tmp_path,
        "TrainerArgs.max_train_iters=150",
        "TrainerArgs.train_batch_size=32",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.ckpt_save_interval=-1",
        "OptimizerArgs.learning_rate=3e-3",
        "EmbeddingArgs.sparse_learning_rate=0.05",
        "RetrievalArgs.num_negatives=64",
    )
    result = run_training(cfg)
    model_hr = result.final_metrics["HR@10"]
    # popularity baseline over the same eval split and protocol
    data = load_sequence_data(cfg.dataset)
    splits = build_samples(data, cfg.dataset, "retrieval")
    corpus = torch.from_numpy(data.item_corpus())
    train_items = []
    for i in range(len(splits.train)):
        train_items.append(splits.train.collate([i]).features["item_id"].values())
    pop = popularity_scores(torch.cat(train_items), corpus)
    ev = RetrievalEvaluator(corpus, ks=(10,), exclude_history=True)
    for start in range(0, len(splits.eval), 256):
        idx = list(range(start, min(start + 256, len(splits.eval))))
        batch = splits.eval.collate(idx)
        hist = []
        for uid in batch.user_ids.tolist():
            row = int(np.flatnonzero(data.user_ids == uid)[0])
            hist.append(
                torch.from_numpy(data.item_ids[data.offsets[row] : data.offsets[row + 1] - 1])
            )
        ev.update_scores(pop, batch.target_item_ids, hist)
    pop_hr = ev.compute()["HR@10"]
    assert model_hr > 1.3 * pop_hr, (model_hr, pop_hr)


def test_resume_continues_exactly(tmp_path):
    common = [
        "TrainerArgs.train_batch_size=16",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.max_eval_iters=1",
        "TrainerArgs.log_interval=5",
        "NetworkArgs.hidden_dropout=0.2",
    ]
    full = run_training(
        _cfg(
            "ranking",
            tmp_path / "a",
            "TrainerArgs.max_train_iters=12",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        )
    )
    first = run_training(_cfg("ranking", tmp_path / "b", "TrainerArgs.max_train_iters=6", *common))
    ckpt = first.checkpoint_dir
    assert ckpt is not None and (Path(ckpt) / "meta.json").exists()
    resumed = run_training(
        _cfg(
            "ranking",
            tmp_path / "c",
            "TrainerArgs.max_train_iters=12",
            f"TrainerArgs.ckpt_load_dir='{ckpt}'",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        )
    )
    assert [s for s, _ in resumed.losses] == list(range(7, 13))
    expected = [loss for _, loss in full.losses[6:]]
    got = [loss for _, loss in resumed.losses]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        [loss for _, loss in first.losses], [loss for _, loss in full.losses[:6]], rtol=1e-6
    )


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="hstu.data.prepare"):
        run_training(
            _cfg(
                "ranking",
                tmp_path,
                "DatasetArgs.dataset_name='ml-1m'",
                f"DatasetArgs.dataset_path='{tmp_path / 'none'}'",
            )
        )
    with pytest.raises(ValueError, match="train_batch_size"):
        run_training(_cfg("ranking", tmp_path, "TrainerArgs.train_batch_size=100000"))


def test_single_process_trains_without_ddp(tmp_path, monkeypatch):
    """One rank: the dense parameters are not under DDP (nothing to average, and its per-parameter
    gradient copies cost host time every step); HSTU_SINGLE_PROCESS_DDP=1 puts them back under
    DDP. Same losses, same state-dict keys (checkpoints load either way)."""
    from torch.nn.parallel import DistributedDataParallel

    from hstu.training.trainer import Trainer

    common = [
        "TrainerArgs.train_batch_size=16",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.max_train_iters=6",
        "TrainerArgs.ckpt_save_interval=-1",
        "NetworkArgs.hidden_dropout=0.0",
    ]
    losses, keys, under_ddp = {}, {}, {}
    for ddp in ("0", "1"):
        monkeypatch.setenv("HSTU_SINGLE_PROCESS_DDP", ddp)
        trainer = Trainer(_cfg("ranking", tmp_path / ddp, *common), "cpu")
        try:
            under_ddp[ddp] = any(
                isinstance(m, DistributedDataParallel) for m in trainer.model.modules()
            )
            keys[ddp] = sorted(trainer.model.state_dict())
            losses[ddp] = [loss for _, loss in trainer.fit().losses]
        finally:
            trainer.close()
    assert under_ddp == {"0": False, "1": True}
    assert keys["0"] == keys["1"] and not any(k.startswith("module.") for k in keys["0"])
    assert len(losses["0"]) == 6
    np.testing.assert_allclose(losses["0"], losses["1"], rtol=1e-6)


def test_single_process_ddp_switch_rejects_other_values(monkeypatch):
    from hstu.training.distributed import use_ddp

    monkeypatch.setenv("HSTU_SINGLE_PROCESS_DDP", "yes")
    with pytest.raises(ValueError, match="HSTU_SINGLE_PROCESS_DDP='yes'"):
        use_ddp(1)
    monkeypatch.setenv("HSTU_SINGLE_PROCESS_DDP", "0")
    assert not use_ddp(1) and use_ddp(2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU equivalence test")
@pytest.mark.parametrize(
    "tables",
    [
        (),
        # plain tables trained by the sparse optimizer: DDP averages their gradients, every
        # rank applies the same row-wise Adagrad update to its replica
        ("EmbeddingArgs.embedding_backend='dense'", "EmbeddingArgs.plain_table_optimizer='sparse'"),
    ],
)
def test_two_processes_match_one(tmp_path, tables):
    curves = {}
    for nproc in (1, 2):
        bindings = SMALL + [
            f"TrainerArgs.log_dir='{tmp_path / str(nproc)}'",
            "TrainerArgs.run_name='run'",
            "TrainerArgs.max_train_iters=20",
            "TrainerArgs.train_batch_size=16",
            "TrainerArgs.eval_interval=0",
            "TrainerArgs.max_eval_iters=1",
            "TrainerArgs.ckpt_save_interval=-1",
            "NetworkArgs.hidden_dropout=0.0",
            *tables,
        ]
        curves[nproc] = torchrun_losses(nproc, bindings, tmp_path / f"out_{nproc}")
    a, b = np.array(curves[1]), np.array(curves[2])
    assert a.shape == b.shape == (20,)
    np.testing.assert_allclose(b, a, rtol=1e-2)


def test_resume_keeps_this_runs_optimizer_implementation(tmp_path):
    """The dense optimizer's fused/foreach flags come from the resuming run, not the checkpoint (a
    file written by a fused-Adam GPU run resumes on CPU without the fused kernel, and a file from
    before the fused Adam resumes fused on a GPU)."""
    from hstu.training.trainer import Trainer

    common = ["TrainerArgs.train_batch_size=16", "TrainerArgs.eval_interval=0"]
    first = run_training(_cfg("ranking", tmp_path / "b", "TrainerArgs.max_train_iters=2", *common))
    rank_file = Path(first.checkpoint_dir) / "rank_0.pt"
    state = torch.load(rank_file, weights_only=False)
    for group in state["dense_optimizer"]["param_groups"]:
        group["fused"], group["foreach"] = True, False  # as if written by another implementation
    torch.save(state, rank_file)
    cfg = _cfg(
        "ranking",
        tmp_path / "c",
        "TrainerArgs.max_train_iters=3",
        f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
        "TrainerArgs.ckpt_save_interval=-1",
        *common,
    )
    trainer = Trainer(cfg, "cpu")
    try:
        assert trainer.step == 2  # resumed
        for group in trainer.optimizer.param_groups:
            assert not group["fused"] and group["foreach"] is not False
        assert trainer.fit().losses[-1][0] == 3
    finally:
        trainer.close()


def test_train_mode_is_set_after_evaluation_not_at_every_step(tmp_path, monkeypatch):
    """A training step puts the model in train mode only when it is not (after an evaluation):
    the walk over every module is not repeated at each step, and dropout is on again after
    `evaluate()` switched every module to eval."""
    from hstu.training.trainer import Trainer

    cfg = _cfg(
        "ranking",
        tmp_path,
        "TrainerArgs.max_train_iters=4",
        "TrainerArgs.train_batch_size=16",
        "TrainerArgs.ckpt_save_interval=-1",
        "TrainerArgs.max_eval_iters=1",
    )
    trainer = Trainer(cfg, "cpu")
    try:
        calls = []
        real_train = torch.nn.Module.train
        monkeypatch.setattr(
            torch.nn.Module,
            "train",
            lambda self, mode=True: calls.append(mode) or real_train(self, mode),
        )
        trainer.train_step()
        trainer.train_step()
        assert calls == [], "model.train() walked the module tree at every step"
        trainer.evaluate()
        assert not any(m.training for m in trainer.model.modules())
        calls.clear()
        trainer.train_step()
        assert calls and all(m.training for m in trainer.model.modules())
        calls.clear()
        trainer.train_step()
        assert calls == []
    finally:
        trainer.close()


def test_float16_warns_that_it_has_no_loss_scaling():
    from hstu.training.trainer import precision_note

    assert precision_note(None) == ""  # CPU: float32
    assert precision_note(torch.bfloat16) == "" and precision_note(torch.float32) == ""
    note = precision_note(torch.float16)
    assert "without loss scaling" in note and "'bfloat16'" in note
