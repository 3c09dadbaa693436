"""Batch.global_counts: the loader attaches the global batch's loss terms and samples, the same
numbers the trainer's per-step all-reduce of the local counts gives (which it then skips)."""

from __future__ import annotations

import numpy as np
import pytest

from hstu.config.gin_utils import load_config
from hstu.data.loader import BatchIterator
from hstu.data.registry import build_samples, load_sequence_data
from hstu.training.trainer import _loss_count


def _samples(task: str):
    cfg = load_config(
        task,
        [],
        [
            "DatasetArgs.synthetic_num_users=120",
            "DatasetArgs.synthetic_num_items=80",
            "DatasetArgs.max_history_seqlen=30",
        ],
    )
    data = load_sequence_data(cfg.dataset, num_tasks=8)
    return build_samples(data, cfg.dataset, task).train


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
@pytest.mark.parametrize(("world", "balance"), [(1, "strided"), (2, "cost"), (3, "strided")])
def test_global_counts_equal_the_sum_of_local_counts(task, world, balance):
    samples = _samples(task)
    iters = [
        BatchIterator(
            samples,
            12,
            seed=3,
            rank=r,
            world_size=world,
            balance=balance,
            loss_counts=samples.loss_counts(),
        )
        for r in range(world)
    ]
    for _ in range(len(iters[0]) + 2):  # crosses an epoch boundary
        batches = [next(it) for it in iters]
        expected = (
            float(sum(_loss_count(b, task) for b in batches)),
            float(sum(b.batch_size for b in batches)),
        )
        for b in batches:
            assert b.global_counts == expected
    assert next(BatchIterator(samples, 12, seed=3)).global_counts is None  # not asked for


def test_bad_loss_counts_are_refused():
    samples = _samples("ranking")
    with pytest.raises(ValueError, match="loss_counts"):
        BatchIterator(samples, 12, loss_counts=np.ones(3))
    with pytest.raises(ValueError, match="loss_counts"):
        BatchIterator(samples, 12, loss_counts=-np.ones(len(samples)))
