"""The synthetic generator: deterministic, well-formed, and carrying the signal it promises."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hstu.data.sequences import SequenceData
from hstu.data.synthetic import (
    SYNTHETIC_ACTION_NAMES,
    SYNTHETIC_FEATURE_NAMES,
    generate_synthetic,
    generate_synthetic_with_latents,
)

ARRAYS = ("user_ids", "offsets", "item_ids", "actions", "timestamps", "user_features")


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Rank-based ROC AUC (ties get average ranks)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    pos = labels.astype(bool)
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


@pytest.fixture(scope="module")
def synth():
    data, latents = generate_synthetic_with_latents(2000, 1000, seed=0)
    rows = np.repeat(np.arange(data.num_users), data.lengths())
    return data, latents, rows


def test_deterministic_from_seed():
    a = generate_synthetic(300, 200, seed=7)
    b = generate_synthetic(300, 200, seed=7)
    for key in ARRAYS:
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    assert a.action_names == b.action_names and a.user_feature_names == b.user_feature_names


def test_different_seeds_differ():
    a = generate_synthetic(300, 200, seed=1)
    b = generate_synthetic(300, 200, seed=2)
    assert not np.array_equal(a.offsets, b.offsets)
    n = min(a.num_interactions, b.num_interactions)
    assert (a.item_ids[:n] != b.item_ids[:n]).mean() > 0.5


def test_fast_enough():
    generate_synthetic(50, 100, seed=0)  # warm-up (imports, allocator)
    t0 = time.perf_counter()
    data = generate_synthetic(2000, 1000, seed=3)
    elapsed = time.perf_counter() - t0
    assert 40 <= data.num_interactions / data.num_users <= 80
    assert elapsed < 2.0, f"generation took {elapsed:.2f}s"


def test_well_formed(synth):
    data, _, rows = synth
    assert data.num_users == 2000
    assert data.action_names == list(SYNTHETIC_ACTION_NAMES) and data.num_tasks == 8
    assert data.user_feature_names == list(SYNTHETIC_FEATURE_NAMES)
    np.testing.assert_array_equal(data.user_features[:, 0], data.user_ids)
    assert data.user_feature_cardinalities[1:] == [8, 6, 8]
    assert data.item_ids.min() >= 0 and data.item_ids.max() < 1000
    assert data.actions.min() >= 0 and data.actions.max() < 2**8
    # Timestamps strictly increase inside every user.
    same_user = rows[1:] == rows[:-1]
    assert (np.diff(data.timestamps)[same_user] > 0).all()
    # Repeats within a user are rare (resampled away).
    keys = rows * 1000 + data.item_ids
    assert np.unique(keys).size / keys.size > 0.85


def test_sequence_lengths_heavy_tailed(synth):
    data, _, _ = synth
    lengths = data.lengths()
    assert lengths.min() >= 8
    assert lengths.max() > 6 * np.median(lengths)
    assert (lengths > 3 * np.median(lengths)).mean() > 0.02


def test_item_popularity_heavy_tailed(synth):
    data, _, _ = synth
    counts = np.sort(np.bincount(data.item_ids, minlength=1000))[::-1]
    assert counts[:100].sum() / counts.sum() > 0.25  # top 10% of items
    assert counts[0] > 5 * np.median(counts)


def test_next_item_cluster_is_sticky(synth):
    data, latents, rows = synth
    cluster = latents.item_cluster[data.item_ids]
    same_user = rows[1:] == rows[:-1]
    same = (cluster[1:] == cluster[:-1])[same_user].mean()
    p = np.bincount(cluster) / cluster.size
    chance = float((p**2).sum())
    assert same > 0.5 and same > 5 * chance


def test_click_rate_follows_affinity(synth):
    data, latents, rows = synth
    click = data.actions & 1
    aff = latents.affinity(rows, data.item_ids)
    lo, hi = np.quantile(aff, [0.25, 0.75])
    assert click[aff >= hi].mean() > click[aff <= lo].mean() + 0.4
    assert _auc(click, aff) > 0.8
    # Every task except dislike rises with affinity; dislike falls.
    for k, name in enumerate(data.action_names):
        bit = (data.actions >> k) & 1
        auc = _auc(bit, aff)
        assert (auc < 0.35) if name == "dislike" else (auc > 0.65), (name, auc)


def test_click_learnable_from_history(synth):
    """Without latents: candidates from the user's most frequent history cluster click more."""
    data, latents, _ = synth
    top_hit, other = [], []
    for u in range(data.num_users):
        s = data.user_slice(u)
        if s.stop - s.start < 20:
            continue
        items, clicks = data.item_ids[s], data.actions[s] & 1
        c = latents.item_cluster[items]
        hist_top = np.bincount(c[:-10]).argmax()
        in_top = c[-10:] == hist_top
        top_hit.extend(clicks[-10:][in_top])
        other.extend(clicks[-10:][~in_top])
    assert np.mean(top_hit) > np.mean(other) + 0.2


def test_next_item_visible_beyond_popularity(synth):
    """Without latents: item co-occurrence from the training region beats popularity at HR@10
    on the held-out last item (history excluded), so retrieval has something to learn."""
    data, _, _ = synth
    n_items = data.item_vocab_size
    seen = np.zeros((data.num_users, n_items), dtype=np.float32)
    for u in range(data.num_users):
        seen[u, data.item_ids[data.offsets[u] : data.offsets[u + 1] - 1]] = 1.0
    norm = np.linalg.norm(seen, axis=0) + 1e-6
    sim = (seen.T @ seen) / np.outer(norm, norm)
    np.fill_diagonal(sim, 0.0)
    pop = seen.sum(axis=0)
    hits_pop = hits_knn = 0
    for u in range(data.num_users):
        hist = data.item_ids[data.offsets[u] : data.offsets[u + 1] - 1]
        target = data.item_ids[data.offsets[u + 1] - 1]
        p = pop.copy()
        p[hist] = -1
        k = sim[:, hist[-20:]].sum(axis=1) + 1e-3 * pop / pop.max()
        k[hist] = -1
        hits_pop += target in np.argpartition(-p, 10)[:10]
        hits_knn += target in np.argpartition(-k, 10)[:10]
    assert hits_knn > 2 * hits_pop and hits_knn / data.num_users > 0.12


def test_tasks_are_nested(synth):
    data, _, _ = synth
    bits = {name: (data.actions >> k) & 1 for k, name in enumerate(data.action_names)}
    assert (bits["like"] <= bits["click"]).all()
    assert (bits["share"] <= bits["like"]).all()
    assert (bits["save"] <= bits["long_view"]).all()
    assert not (bits["dislike"] & bits["click"]).any()
    rates = [b.mean() for b in bits.values()]
    assert all(0.02 < r < 0.9 for r in rates), rates


def test_contextual_features_informative(synth):
    data, latents, rows = synth
    top = latents.user_pref.argmax(axis=1)
    n_clusters = latents.user_pref.shape[1]
    segment = data.user_features[:, 1]
    assert (segment == top * 8 // n_clusters).mean() > 0.85
    # Older age groups act more: click rate rises with the age group.
    age = data.user_features[rows, 2]
    click = data.actions & 1
    assert click[age == 5].mean() > click[age == 0].mean() + 0.1


def test_other_task_counts():
    data = generate_synthetic(100, 100, seed=0, num_tasks=3)
    assert data.action_names == ["click", "long_view", "like"]
    assert data.actions.max() < 8
    data = generate_synthetic(100, 100, seed=0, num_tasks=10)
    assert data.action_names[-2:] == ["task_8", "task_9"]
    assert ((data.actions >> 9) & 1 <= data.actions & 1).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_users": 0}, "num_users"),
        ({"num_items": 1}, "num_items"),
        ({"num_tasks": 0}, "num_tasks"),
        ({"num_tasks": 63}, "num_tasks"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_users": 10, "num_items": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate_synthetic(**args)


def test_save_load_round_trip(tmp_path):
    data = generate_synthetic(50, 60, seed=5)
    data.save(tmp_path / "synthetic")
    back = SequenceData.load(tmp_path / "synthetic")
    for key in ARRAYS:
        np.testing.assert_array_equal(getattr(back, key), getattr(data, key), err_msg=key)
    assert back.action_names == data.action_names
    assert back.user_feature_names == data.user_feature_names
