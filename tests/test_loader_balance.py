"""Cost-balanced split of a global batch over ranks (BatchIterator balance='cost')."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hstu.config.args import TrainerArgs
from hstu.data import build_ranking_samples, build_retrieval_samples, generate_synthetic
from hstu.data.loader import (
    BatchIterator,
    balanced_split,
    linear_cost_coefficient,
    sequence_lengths,
)


@dataclass
class _Lengths:
    """Samples whose only property is a sequence length."""

    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def sequence_lengths(self) -> np.ndarray:
        return self.lengths

    def collate(self, indices):
        return np.asarray(indices)


def _heavy_tailed(n: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths (median ~150, long tail) capped at 4096, like the benchmark data."""
    rng = np.random.default_rng(seed)
    return np.minimum(np.exp(rng.normal(5.0, 1.0, n)), 4096).astype(np.int64) + 1


def _rank_costs(costs: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    return np.array([costs[p].sum() for p in parts])


def test_split_keeps_local_batch_sizes_and_partitions():
    costs = np.array([5.0, 1.0, 9.0, 9.0, 2.0, 7.0, 3.0])
    for w in (1, 2, 3, 7):
        parts = balanced_split(costs, w)
        assert [len(p) for p in parts] == [len(range(r, 7, w)) for r in range(w)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(7))
        for p in parts:
            assert np.all(np.diff(p) > 0)  # global-batch order inside a rank
    # LPT by hand: 9 -> r0, 9 -> r1, 7 -> r2, 5 -> r2 (7 < 9), 3 -> r0, 2 -> r1, 1 -> r0 (cap 3)
    parts = balanced_split(costs, 3)
    assert [p.tolist() for p in parts] == [[1, 2, 6], [3, 4], [0, 5]]


def test_balance_beats_strided_on_heavy_tailed_lengths():
    c = linear_cost_coefficient(hidden_size=1024, num_heads=4, head_dim=256)
    assert c == pytest.approx(30 * 1024 / 7)
    lengths = _heavy_tailed(64 * 8 * 200)
    world, local = 8, 64
    ratios_balanced, ratios_strided = [], []
    for b in range(200):
        glob = np.arange(b * world * local, (b + 1) * world * local)
        cost = lengths[glob] ** 2 + c * lengths[glob]
        strided = _rank_costs(cost, [np.arange(r, len(glob), world) for r in range(world)])
        balanced = _rank_costs(cost, balanced_split(cost, world))
        assert balanced.sum() == pytest.approx(strided.sum())
        ratios_strided.append(strided.max() / strided.mean())
        ratios_balanced.append(balanced.max() / balanced.mean())
    rb, rs = np.array(ratios_balanced), np.array(ratios_strided)
    # the slowest rank sets the step time: strided leaves it far above the mean
    assert rs.mean() > 1.15, rs.mean()
    assert rb.mean() < 1.02, rb.mean()
    assert np.all(rb <= rs + 1e-9)


def test_iterator_ranks_agree_and_cover_the_same_global_batch_as_one_process():
    samples = _Lengths(_heavy_tailed(997, seed=3))
    single = BatchIterator(samples, 24, seed=1, balance="cost", linear_cost=10.0)
    ranks = [
        BatchIterator(samples, 24, seed=1, rank=r, world_size=4, balance="cost", linear_cost=10.0)
        for r in range(4)
    ]
    strided_ranks = [BatchIterator(samples, 24, seed=1, rank=r, world_size=4) for r in range(4)]
    differs = 0
    for _ in range(2 * len(single)):  # crosses an epoch boundary
        glob = next(single)
        parts = [next(it) for it in ranks]
        assert [len(p) for p in parts] == [6, 6, 6, 6]
        assert sorted(np.concatenate(parts).tolist()) == sorted(glob.tolist())
        differs += any(not np.array_equal(p, next(s)) for p, s in zip(parts, strided_ranks))
    assert differs > 0  # the policy does move samples


def test_cost_balanced_stream_resumes_exactly_on_another_world_size():
    samples = _Lengths(_heavy_tailed(500, seed=4))

    def it(rank, world):
        return BatchIterator(samples, 12, seed=9, rank=rank, world_size=world, balance="cost")

    ref = [it(r, 3) for r in range(3)]
    for _ in range(30):
        for x in ref:
            next(x)
    state = ref[0].state_dict()
    expected = [sorted(np.concatenate([next(x) for x in ref]).tolist()) for _ in range(5)]
    resumed = [it(r, 2) for r in range(2)]
    for x in resumed:
        x.load_state_dict(state)
    got = [sorted(np.concatenate([next(x) for x in resumed]).tolist()) for _ in range(5)]
    assert got == expected


def test_sequence_lengths_match_the_collated_batches():
    data = generate_synthetic(num_users=60, num_items=50, seed=0, num_tasks=8)
    ctx = len(data.user_feature_names)
    for train, _ in (build_ranking_samples(data, 16, 4), build_retrieval_samples(data, 16)):
        idx = np.arange(min(20, len(train)))
        batch = train.collate(idx)
        items = batch.features["item_id"].lengths().numpy()
        np.testing.assert_array_equal(sequence_lengths(train)[idx], items + ctx)


def test_bad_policy_and_unknown_samples_are_clear_errors():
    with pytest.raises(ValueError, match="TrainerArgs.rank_balance='lpt' is not supported"):
        TrainerArgs(rank_balance="lpt")

    class Opaque:
        def __len__(self):
            return 10

        def collate(self, idx):
            return idx

    with pytest.raises(TypeError, match="rank_balance='strided'"):
        BatchIterator(Opaque(), 4, rank=0, world_size=2, balance="cost")
    with pytest.raises(ValueError, match="rank_balance='x'"):
        BatchIterator(Opaque(), 4, balance="x")
    # one process: no lengths needed, the split is the identity
    one = BatchIterator(Opaque(), 4, shuffle=False, balance="cost")
    assert next(one).tolist() == [0, 1, 2, 3]
