"""Shared setup of the small models the model tests build and of small GPU training runs (not a
test module)."""

from __future__ import annotations

import torch

from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples, load_sequence_data
from hstu.models.builder import build_model

# bindings of a whole run that trains and evaluates in seconds on a CPU (synthetic data, one
# small layer, small batches, two evaluation batches)
TINY_RUN = [
    "DatasetArgs.synthetic_num_users=200",
    "DatasetArgs.synthetic_num_items=100",
    "DatasetArgs.max_history_seqlen=16",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.num_attention_heads=1",
    "NetworkArgs.kv_channels=16",
    "TrainerArgs.train_batch_size=8",
    "TrainerArgs.eval_batch_size=32",
    "TrainerArgs.max_eval_iters=2",
]


def small_model(task: str, *bindings: str):
    """(cfg, data, splits, model) of a small synthetic setup: 200 users, 100 items, histories up
    to 20, no dropout; ``bindings`` override or extend these."""
    cfg = load_config(
        task,
        [],
        [
            "DatasetArgs.synthetic_num_users=200",
            "DatasetArgs.synthetic_num_items=100",
            "DatasetArgs.max_history_seqlen=20",
            "NetworkArgs.hidden_dropout=0.0",
            *bindings,
        ],
    )
    data = load_sequence_data(cfg.dataset, num_tasks=8)
    splits = build_samples(data, cfg.dataset, task)
    torch.manual_seed(0)
    return cfg, data, splits, build_model(cfg, data)


def needs_compiled_kernels():
    """Skips a GPU test without a CUDA GPU, the compiled attention or the hstu_lnmd kernels."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hstu.modules import layer_norm_mul_dropout as lnmd
    from hstu.ops import compiled_attention_available

    if not compiled_attention_available() or not lnmd.load_extension():
        pytest.skip("needs the compiled attention and hstu_lnmd kernels")


def graphed_run(tmp_path, run_dir_bindings, name, scope, *extra, task="retrieval"):
    """A small synthetic training run on the GPU with CUDA graphs of ``scope`` and plain tables;
    ``extra`` bindings override the defaults here. Returns (trainer, result); the result also
    carries ``table_rows``: the dynamic tables' row counts, read before the run closes."""
    from hstu.training.trainer import Trainer

    cfg = load_config(
        task,
        [],
        run_dir_bindings(tmp_path, name)
        + [
            "DatasetArgs.synthetic_num_users=400",
            "DatasetArgs.synthetic_num_items=150",
            "DatasetArgs.max_history_seqlen=60",
            "NetworkArgs.num_layers=2",
            "NetworkArgs.hidden_size=64",
            "NetworkArgs.num_attention_heads=1",
            "NetworkArgs.kv_channels=64",
            "NetworkArgs.fused_layer=True",
            "NetworkArgs.cuda_graphs=True",
            f"NetworkArgs.cuda_graph_scope='{scope}'",
            "NetworkArgs.relative_attention_bias='position'",
            "TrainerArgs.train_batch_size=32",
            "TrainerArgs.max_train_iters=80",
            "TrainerArgs.eval_interval=0",
            "TrainerArgs.max_eval_iters=2",
            "TrainerArgs.log_interval=10",
            "TrainerArgs.ckpt_save_interval=-1",
            "TrainerArgs.progress_bar=False",
            "OptimizerArgs.warmup_iters=10",
            "EmbeddingArgs.embedding_backend='dense'",
            *extra,
        ],
    )
    trainer = Trainer(cfg, device_type="cuda")
    try:
        result = trainer.fit()
        # (a collective when the tables are sharded: before the process group closes)
        stats = trainer.embeddings.stats()
        result.table_rows = {k: v for k, v in stats.items() if k.endswith("/rows")}
        return trainer, result
    finally:
        trainer.close()


def fail_retrieval_captures(monkeypatch) -> None:
    """Makes every CUDA graph capture of the retrieval model's forward fail: a host read of the
    loss while capturing (not allowed there)."""
    from hstu.models.retrieval import RetrievalGR

    forward = RetrievalGR.forward

    def reads_back(self, batch, *args, **kwargs):
        out = forward(self, batch, *args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            out["loss"].item()
        return out

    monkeypatch.setattr(RetrievalGR, "forward", reads_back)
