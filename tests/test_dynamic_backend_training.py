"""EmbeddingArgs.embedding_backend='dynamic' end to end on CPU (reference dynamic tables in DMP)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hstu.config.gin_utils import load_config
from hstu.data.registry import load_sequence_data
from hstu.embeddings import DynamicEmbeddingCollection
from hstu.models.builder import build_model
from hstu.training.logger import read_scalars
from hstu.training.trainer import run_training

TINY = [
    "DatasetArgs.synthetic_num_users=300",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=16",
    "DatasetArgs.max_num_candidates=4",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=8",
    "RankingArgs.prediction_head_arch=(16,)",
    "TrainerArgs.progress_bar=False",
    "TrainerArgs.train_batch_size=16",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "EmbeddingArgs.embedding_backend='dynamic'",
    "EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'",  # has a CPU kernel for both kinds
    "EmbeddingArgs.sparse_learning_rate=0.05",
    "OptimizerArgs.learning_rate=3e-3",
]


def _cfg(tmp_path: Path, *extra: str):
    return load_config(
        "ranking",
        [],
        TINY + [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'", *extra],
    )


def test_dynamic_backend_builds_item_and_user_tables(tmp_path):
    cfg = _cfg(tmp_path, "EmbeddingArgs.item_capacity=1000")
    data = load_sequence_data(cfg.dataset, num_tasks=cfg.ranking.num_tasks)
    model = build_model(cfg, data)
    assert isinstance(model.embeddings.dynamic_collection, DynamicEmbeddingCollection)
    caps = {c.name: c.capacity for c in model.embeddings.dynamic_collection.embedding_configs()}
    # item capacity from the binding; user_id: 0 -> twice the dataset's user vocabulary
    user_card = data.user_feature_cardinalities[list(data.user_feature_names).index("user_id")]
    assert caps == {"item_table": 1000, "ctx_user_id": 2 * user_card}
    assert sorted(model.embeddings.dynamic_features) == ["item_id", "user_id"]
    # the other contextual tables stay ordinary torchrec tables
    static = {c.name for c in model.embeddings.embedding_collection.embedding_configs()}
    assert static == {"ctx_segment", "ctx_age_group", "ctx_region"}


def test_dynamic_backend_trains_and_resumes_exactly(tmp_path):
    common = ["TrainerArgs.log_interval=4", "NetworkArgs.hidden_dropout=0.1"]
    full = run_training(
        _cfg(
            tmp_path / "a",
            "TrainerArgs.max_train_iters=24",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        )
    )
    losses = [loss for _, loss in full.losses]
    assert np.mean(losses[-6:]) < np.mean(losses[:6]), losses
    scalars = read_scalars(str(full.run_dir))
    for tag in (
        "perf/tflops_per_gpu",
        "embeddings/item_table/rows",
        "embeddings/item_table/hit_rate",
        "embeddings/ctx_user_id/occupancy",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    assert "perf/mfu" not in scalars  # CPU: TFLOP/s only
    assert scalars["embeddings/item_table/rows"][-1][1] > 0
    assert all(v > 0 for _, v in scalars["perf/tflops_per_gpu"])

    first = run_training(_cfg(tmp_path / "b", "TrainerArgs.max_train_iters=12", *common))
    assert first.checkpoint_dir is not None
    np.testing.assert_allclose([v for _, v in first.losses], losses[:12], rtol=1e-6)
    resumed = run_training(
        _cfg(
            tmp_path / "c",
            "TrainerArgs.max_train_iters=24",
            f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        )
    )
    assert [s for s, _ in resumed.losses] == list(range(13, 25))
    np.testing.assert_allclose([v for _, v in resumed.losses], losses[12:], rtol=1e-6, atol=1e-7)

    # a dynamic-table checkpoint does not load into a torchrec-table run: a clear error
    with pytest.raises(ValueError, match="embedding_backend='dynamic'"):
        try:
            run_training(
                _cfg(
                    tmp_path / "d",
                    f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
                    "EmbeddingArgs.embedding_backend='torchrec'",
                )
            )
        finally:
            if torch.distributed.is_initialized():  # the Trainer failed before owning cleanup
                torch.distributed.destroy_process_group()


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hstu.embeddings import cuda_table
    from hstu.ops import compiled_attention_available

    return compiled_attention_available() and cuda_table.available()


@pytest.mark.gpu
@pytest.mark.skipif(
    not _gpu_ready(), reason="needs CUDA, the compiled attention and dynamic embedding kernels"
)
def test_dynamic_backend_trains_on_gpu_bf16(tmp_path):
    """GPU path: bf16 autocast, fused layer + compiled attention, dynamic tables built on meta and
    sharded onto the GPU by DynamicEmbeddingSharder; loss falls, perf and table stats logged,
    checkpoint resume continues (losses within 5%: GPU atomics are not bitwise reproducible)."""
    gpu = [
        "NetworkArgs.hidden_size=64",
        "NetworkArgs.kv_channels=64",
        "NetworkArgs.dtype_str='bfloat16'",
        "TrainerArgs.peak_tflops=0.0",
    ]
    common = ["TrainerArgs.log_interval=4", *gpu]
    full = run_training(
        _cfg(
            tmp_path / "a",
            "TrainerArgs.max_train_iters=40",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        ),
        "cuda",
    )
    losses = [loss for _, loss in full.losses]
    assert np.mean(losses[-8:]) < np.mean(losses[:8]), losses
    scalars = read_scalars(str(full.run_dir))
    for tag in (
        "perf/tflops_per_gpu",
        "perf/mfu",
        "perf/gpu_mem_peak_gb",
        "embeddings/item_table/rows",
    ):
        assert tag in scalars, (tag, sorted(scalars))
    assert scalars["embeddings/item_table/rows"][-1][1] > 0
    first = run_training(_cfg(tmp_path / "b", "TrainerArgs.max_train_iters=20", *common), "cuda")
    resumed = run_training(
        _cfg(
            tmp_path / "c",
            "TrainerArgs.max_train_iters=40",
            f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
            "TrainerArgs.ckpt_save_interval=-1",
            *common,
        ),
        "cuda",
    )
    assert [s for s, _ in resumed.losses] == list(range(21, 41))
    np.testing.assert_allclose([v for _, v in resumed.losses], losses[20:], rtol=5e-2)


def test_dense_contextual_tables_with_dynamic_backend(tmp_path):
    """contextual_tables='dense': item/user tables dynamic, the other contextual tables plain
    nn.Embedding trained by the dense optimizer (no torchrec collection); trains, resumes
    exactly, and a checkpoint refuses a run with torchrec contextual tables."""
    dense = "EmbeddingArgs.contextual_tables='dense'"
    cfg = _cfg(tmp_path / "m", dense)
    data = load_sequence_data(cfg.dataset, num_tasks=cfg.ranking.num_tasks)
    model = build_model(cfg, data)
    assert model.embeddings.embedding_collection is None
    assert set(model.embeddings.dense_tables.tables) == {
        "ctx_segment",
        "ctx_age_group",
        "ctx_region",
    }
    assert sorted(model.embeddings.dynamic_features) == ["item_id", "user_id"]

    full = run_training(
        _cfg(tmp_path / "a", dense, "TrainerArgs.max_train_iters=16", "TrainerArgs.log_interval=4")
    )
    losses = [loss for _, loss in full.losses]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
    first = run_training(
        _cfg(tmp_path / "b", dense, "TrainerArgs.max_train_iters=8", "TrainerArgs.log_interval=4")
    )
    resumed = run_training(
        _cfg(
            tmp_path / "c",
            dense,
            "TrainerArgs.max_train_iters=16",
            "TrainerArgs.log_interval=4",
            f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
            "TrainerArgs.ckpt_save_interval=-1",
        )
    )
    np.testing.assert_allclose([v for _, v in resumed.losses], losses[8:], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="contextual_tables='dense'"):
        try:
            run_training(
                _cfg(tmp_path / "d", f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'")
            )
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def test_dense_contextual_tables_need_dynamic_backend():
    with pytest.raises(ValueError, match="contextual_tables='dense' needs"):
        load_config(
            "ranking",
            [],
            [
                "EmbeddingArgs.embedding_backend='torchrec'",
                "EmbeddingArgs.contextual_tables='dense'",
            ],
        )
