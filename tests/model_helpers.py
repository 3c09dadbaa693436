"""Shared setup of the small CPU models the model tests build (not a test module)."""

from __future__ import annotations

import torch

from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples, load_sequence_data
from hstu.models.builder import build_model


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
