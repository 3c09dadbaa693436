"""Samples, batches and the batch iterator: exact cuts, no leakage, distribution and resume."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hstu.data import (
    ACTION_FEATURE,
    ITEM_FEATURE,
    BatchIterator,
    SequenceData,
    build_ranking_samples,
    build_retrieval_samples,
    build_samples,
    generate_synthetic,
    load_sequence_data,
)
from hstu.data.sequences import DATA_FILE, MANIFEST_FILE


@dataclass
class Args:
    """Stand-in for `DatasetArgs` (the fields this module reads)."""

    dataset_name: str = "synthetic"
    dataset_path: str = ""
    max_history_seqlen: int = 16
    max_num_candidates: int = 4
    synthetic_num_users: int = 300
    synthetic_num_items: int = 200
    synthetic_seed: int = 0


def _toy(lengths: list[int]) -> SequenceData:
    """One user per length; item id = 100 * user + position, action = position, time = position."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    items = np.concatenate([100 * u + np.arange(n) for u, n in enumerate(lengths)]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    u = len(lengths)
    return SequenceData(
        name="toy",
        user_ids=np.arange(10, 10 + u, dtype=np.int64),
        offsets=offsets,
        item_ids=items,
        actions=pos % 4,
        timestamps=pos,
        user_features=np.stack([np.arange(u), np.arange(u) % 2], axis=1).astype(np.int64),
        user_feature_names=["uid", "parity"],
        action_names=["a", "b"],
    )


def _cuts(samples, starts, mids, ends):
    """Per sample (user row, start, mid, end) with positions relative to the user's sequence."""
    data = samples.data
    base = data.offsets[samples.user_rows]
    return [
        (int(r), int(s), int(m), int(e))
        for r, s, m, e in zip(samples.user_rows, starts - base, mids - base, ends - base)
    ]


@pytest.fixture(scope="module")
def synth() -> SequenceData:
    return generate_synthetic(300, 200, seed=0)


# ---- exact sample construction ---------------------------------------------------------------
def test_ranking_cuts_exact():
    data = _toy([25, 1, 3, 11])
    train, ev = build_ranking_samples(data, max_history_seqlen=5, max_num_candidates=10)
    assert ev.num_skipped_users == 1 and train.num_skipped_users == 1
    # (user, history start, candidate start, candidate end)
    assert _cuts(ev, ev.history_starts, ev.candidate_starts, ev.candidate_ends) == [
        (0, 10, 15, 25),
        (2, 0, 1, 3),
        (3, 0, 1, 11),
    ]
    assert _cuts(train, train.history_starts, train.candidate_starts, train.candidate_ends) == [
        (0, 0, 1, 5),
        (0, 0, 5, 15),
    ]


def test_retrieval_cuts_exact():
    data = _toy([25, 1, 9, 8, 2])
    train, ev = build_retrieval_samples(data, max_history_seqlen=5)
    assert ev.num_skipped_users == 1
    assert _cuts(ev, ev.starts, ev.ends, ev.ends) == [
        (0, 19, 24, 24),
        (2, 3, 8, 8),
        (3, 2, 7, 7),
        (4, 0, 1, 1),
    ]
    windows = [(r, s, e) for r, s, _, e in _cuts(train, train.starts, train.ends, train.ends)]
    assert windows == [
        (0, 0, 6),
        (0, 6, 12),
        (0, 12, 18),
        (0, 18, 24),
        (2, 0, 2),
        (2, 2, 8),
        (3, 1, 7),  # the lone item 0 of user 3 would make a 1-item window: dropped
    ]


def test_no_user_long_enough_is_an_error():
    with pytest.raises(ValueError, match="no user has >= 2 interactions"):
        build_ranking_samples(_toy([1, 1]), 5, 2)


def test_bad_sizes_name_the_binding():
    with pytest.raises(ValueError, match="DatasetArgs.max_num_candidates"):
        build_ranking_samples(_toy([5]), 5, 0)
    with pytest.raises(ValueError, match="DatasetArgs.max_history_seqlen"):
        build_retrieval_samples(_toy([5]), 0)


# ---- leakage ---------------------------------------------------------------------------------
def test_ranking_no_leakage(synth):
    train, ev = build_ranking_samples(synth, max_history_seqlen=16, max_num_candidates=4)
    eval_start = dict(zip(ev.user_rows.tolist(), ev.candidate_starts.tolist()))
    assert len(eval_start) == len(ev)  # one eval sample per user
    for r, cs, ce in zip(train.user_rows, train.candidate_starts, train.candidate_ends):
        assert ce <= eval_start[int(r)]
        # strictly earlier in time, too
        assert synth.timestamps[ce - 1] < synth.timestamps[eval_start[int(r)]]
        assert cs >= synth.offsets[r] + 1  # at least one history item
    # Train candidates of a user tile its pre-eval region once each (after the first item).
    covered = np.zeros(synth.num_interactions, dtype=int)
    for cs, ce in zip(train.candidate_starts, train.candidate_ends):
        covered[cs:ce] += 1
    assert covered.max() == 1
    assert (train.history_lengths() >= 1).all() and (train.history_lengths() <= 16).all()
    assert (ev.num_candidates() == 4).all()  # synthetic users are long enough


def test_retrieval_no_leakage(synth):
    train, ev = build_retrieval_samples(synth, max_history_seqlen=16)
    target = dict(zip(ev.user_rows.tolist(), ev.target_positions().tolist()))
    for r, s, e in zip(train.user_rows, train.starts, train.ends):
        t = target[int(r)]
        assert e <= t and not (s <= t < e)
        assert e - s >= 2 and e - s <= 17
    assert (ev.target_positions() == synth.offsets[1:][ev.user_rows] - 1).all()
    assert (ev.ends - ev.starts <= 16).all() and (ev.ends - ev.starts >= 1).all()


# ---- batches ---------------------------------------------------------------------------------
def test_ranking_batch_well_formed(synth):
    train, _ = build_ranking_samples(synth, max_history_seqlen=16, max_num_candidates=4)
    idx = np.array([3, 0, 17, 5, 9])
    batch = train.collate(idx)
    kjt = batch.features
    names = synth.user_feature_names
    assert kjt.keys() == [*names, ITEM_FEATURE, ACTION_FEATURE]
    assert batch.contextual_feature_names == names
    assert kjt.values().dtype == torch.int64 and batch.labels.dtype == torch.int64
    hist = train.history_lengths()[idx]
    ncand = train.num_candidates()[idx]
    for f, name in enumerate(names):
        assert kjt[name].lengths().tolist() == [1] * 5
        assert kjt[name].values().tolist() == synth.user_features[train.user_rows[idx], f].tolist()
    assert batch.item_lengths().tolist() == (hist + ncand).tolist()
    assert batch.history_lengths().tolist() == hist.tolist()
    assert batch.num_candidates.tolist() == ncand.tolist()
    assert batch.labels.numel() == int(batch.num_candidates.sum())
    assert batch.user_ids.tolist() == synth.user_ids[train.user_rows[idx]].tolist()
    assert batch.target_item_ids is None
    # Values are the right slices, in sample order.
    items = kjt[ITEM_FEATURE].values().tolist()
    actions = kjt[ACTION_FEATURE].values().tolist()
    exp_items, exp_actions, exp_labels = [], [], []
    for i in idx:
        hs, cs, ce = train.history_starts[i], train.candidate_starts[i], train.candidate_ends[i]
        exp_items += synth.item_ids[hs:ce].tolist()
        exp_actions += synth.actions[hs:cs].tolist()
        exp_labels += synth.actions[cs:ce].tolist()
    assert items == exp_items and actions == exp_actions and batch.labels.tolist() == exp_labels


def test_retrieval_batches_well_formed(synth):
    train, ev = build_retrieval_samples(synth, max_history_seqlen=16)
    b = ev.collate([0, 1, 2])
    assert b.num_candidates.tolist() == [0, 0, 0] and b.labels is None
    assert b.target_item_ids.tolist() == synth.item_ids[ev.ends[:3]].tolist()
    assert b.item_lengths().tolist() == b.history_lengths().tolist()
    assert (
        b.features[ITEM_FEATURE].values().tolist()
        == synth.item_ids[ev.starts[0] : ev.ends[0]].tolist()
        + synth.item_ids[ev.starts[1] : ev.ends[1]].tolist()
        + synth.item_ids[ev.starts[2] : ev.ends[2]].tolist()
    )
    t = train.collate([4, 7])
    assert t.target_item_ids is None
    assert t.item_lengths().tolist() == (train.ends - train.starts)[[4, 7]].tolist()
    assert t.history_lengths().tolist() == t.item_lengths().tolist()
    assert train.max_seqlen == 17 and ev.max_seqlen == 16


def test_empty_and_bad_indices(synth):
    train, _ = build_ranking_samples(synth, 16, 4)
    b = train.collate([])
    assert b.batch_size == 0 and b.labels.numel() == 0
    with pytest.raises(IndexError, match="out of range"):
        train.collate([len(train)])


# ---- iterator --------------------------------------------------------------------------------
class _Ids:
    """Samples whose batch is just the indices (to test the iterator alone)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def collate(self, indices):
        return np.asarray(indices)


def test_epochs_are_permutations_and_deterministic():
    it = BatchIterator(_Ids(100), 10, seed=3)
    assert len(it) == 10
    epoch0 = np.concatenate([next(it) for _ in range(10)])
    epoch1 = np.concatenate([next(it) for _ in range(10)])
    assert sorted(epoch0) == list(range(100)) and sorted(epoch1) == list(range(100))
    assert not np.array_equal(epoch0, epoch1)
    again = BatchIterator(_Ids(100), 10, seed=3)
    np.testing.assert_array_equal(np.concatenate([next(again) for _ in range(10)]), epoch0)
    other = BatchIterator(_Ids(100), 10, seed=4)
    assert not np.array_equal(np.concatenate([next(other) for _ in range(10)]), epoch0)
    unshuffled = BatchIterator(_Ids(25), 10, shuffle=False)
    assert [next(unshuffled).tolist() for _ in range(3)][-1] == list(range(10))  # 2 per epoch


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_rebuild_the_global_batch(world_size):
    single = BatchIterator(_Ids(103), 8, seed=1)
    ranks = [
        BatchIterator(_Ids(103), 8, seed=1, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for _ in range(30):  # crosses epoch boundaries (12 batches per epoch)
        glob = next(single)
        parts = [next(it) for it in ranks]
        assert all(len(p) == 8 // world_size for p in parts)
        rebuilt = np.empty(8, dtype=np.int64)
        for r, p in enumerate(parts):
            rebuilt[r::world_size] = p
        np.testing.assert_array_equal(rebuilt, glob)


def test_rank_batches_partition_the_global_batch(synth):
    train, _ = build_ranking_samples(synth, 16, 4)
    single = BatchIterator(train, 8, seed=2)
    ranks = [BatchIterator(train, 8, seed=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        glob = next(single)
        parts = [next(it) for it in ranks]
        assert sorted(glob.user_ids.tolist()) == sorted(
            sum((p.user_ids.tolist() for p in parts), [])
        )
        assert int(glob.num_candidates.sum()) == sum(int(p.num_candidates.sum()) for p in parts)
        assert glob.labels.numel() == sum(p.labels.numel() for p in parts)


def test_resume_continues_with_the_same_batches(synth):
    train, _ = build_ranking_samples(synth, 16, 4)
    ref = BatchIterator(train, 32, seed=5)
    n_per_epoch = len(ref)
    stop = n_per_epoch - 2  # resume just before an epoch boundary
    for _ in range(stop):
        next(ref)
    state = ref.state_dict()
    expected = [next(ref) for _ in range(5)]
    resumed = BatchIterator(train, 32, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON/pickle round trip
    for exp in expected:
        got = next(resumed)
        assert torch.equal(got.features.values(), exp.features.values())
        assert torch.equal(got.features.lengths(), exp.features.lengths())
        assert torch.equal(got.labels, exp.labels)
    # A different world size may resume the same global stream.
    halves = [BatchIterator(train, 32, seed=5, rank=r, world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    glob = expected[0]
    got = [next(h) for h in halves]
    assert sorted(glob.user_ids.tolist()) == sorted(
        got[0].user_ids.tolist() + got[1].user_ids.tolist()
    )


def test_resume_rejects_a_different_stream():
    it = BatchIterator(_Ids(100), 10, seed=1)
    with pytest.raises(ValueError, match="TrainerArgs.train_batch_size"):
        BatchIterator(_Ids(100), 20, seed=1).load_state_dict(it.state_dict())
    with pytest.raises(ValueError, match="seed"):
        BatchIterator(_Ids(100), 10, seed=2).load_state_dict(it.state_dict())


@pytest.mark.parametrize("n, batch_size", [(130, 64), (129, 64), (128, 64), (7, 4), (3, 64)])
def test_eval_covers_every_sample_once(n, batch_size):
    world = 2
    its = [
        BatchIterator(_Ids(n), batch_size, shuffle=False, rank=r, world_size=world, drop_last=False)
        for r in range(world)
    ]
    per_rank = [list(it.eval_batches()) for it in its]
    assert len(per_rank[0]) == len(per_rank[1])  # lockstep: same number of forwards
    assert all(len(b) > 0 for batches in per_rank for b in batches)
    seen = np.concatenate([b for batches in per_rank for b in batches])
    assert sorted(seen.tolist()) == list(range(n))
    single = list(BatchIterator(_Ids(n), batch_size, shuffle=False, drop_last=False).eval_batches())
    assert np.concatenate(single).tolist() == list(range(n))
    assert len(single) == -(-n // batch_size)


def test_eval_pass_leaves_training_position(synth):
    _, ev = build_retrieval_samples(synth, 16)
    it = BatchIterator(ev, 64, shuffle=False, drop_last=False)
    batches = list(it.eval_batches())
    assert sum(b.batch_size for b in batches) == len(ev)
    assert it.state_dict()["position"] == 0 and it.state_dict()["epoch"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "TrainerArgs.train_batch_size must be > 0; got 0"),
        ({"batch_size": -3}, "TrainerArgs.train_batch_size must be > 0"),
        ({"batch_size": 200}, "TrainerArgs.train_batch_size=200 is larger than the 100"),
        ({"batch_size": 10, "world_size": 4}, "divisible by the number of processes"),
        ({"batch_size": 0, "batch_size_binding": "TrainerArgs.eval_batch_size"}, "eval_batch_size"),
    ],
)
def test_iterator_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchIterator(_Ids(100), **kwargs)


# ---- registry --------------------------------------------------------------------------------
def test_load_synthetic_from_args():
    args = Args()
    data = load_sequence_data(args)
    ref = generate_synthetic(300, 200, seed=0)
    np.testing.assert_array_equal(data.item_ids, ref.item_ids)
    splits = build_samples(data, args, "retrieval")
    assert len(splits.eval) == 300
    with pytest.raises(ValueError, match="unknown task"):
        build_samples(data, args, "ranking-ish")
    with pytest.raises(ValueError, match="DatasetArgs.synthetic_num_users"):
        load_sequence_data(Args(synthetic_num_users=0))


def test_load_prepared_dataset(tmp_path, monkeypatch):
    data = generate_synthetic(40, 50, seed=1)
    data.save(tmp_path / "mine")
    loaded = load_sequence_data(Args(dataset_name="mine", dataset_path=str(tmp_path / "mine")))
    np.testing.assert_array_equal(loaded.item_ids, data.item_ids)
    data.save(tmp_path / "data" / "other")
    monkeypatch.chdir(tmp_path)
    loaded = load_sequence_data(Args(dataset_name="other"))
    np.testing.assert_array_equal(loaded.actions, data.actions)


def test_missing_dataset_says_where_and_how(tmp_path, monkeypatch):
    import hstu.data.registry as registry

    # Hermetic: neither the working directory nor the "checkout" holds a prepared ml-1m.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_REPO_ROOT", tmp_path / "checkout")
    with pytest.raises(FileNotFoundError) as err:
        load_sequence_data(Args(dataset_name="ml-1m"))
    msg = str(err.value)
    assert str(tmp_path / "data" / "ml-1m") in msg
    assert str(tmp_path / "checkout" / "data" / "ml-1m") in msg
    assert "python -m hstu.data.prepare --dataset ml-1m --source" in msg
    with pytest.raises(FileNotFoundError, match="nowhere") as err:
        load_sequence_data(Args(dataset_name="ml-1m", dataset_path=str(tmp_path / "nowhere")))
    assert f"--output {tmp_path / 'nowhere'}" in str(err.value)


def _write_raw(directory, **overrides):
    """Write sequences.npz + manifest.json directly (bypassing SequenceData's checks)."""
    arrays = {
        "user_ids": np.array([0, 1], dtype=np.int64),
        "offsets": np.array([0, 3, 5], dtype=np.int64),
        "item_ids": np.array([1, 2, 3, 4, 5], dtype=np.int64),
        "actions": np.zeros(5, dtype=np.int64),
        "timestamps": np.arange(5, dtype=np.int64),
        "user_features": np.zeros((2, 1), dtype=np.int64),
    }
    arrays.update(overrides)
    directory.mkdir(parents=True)
    np.savez(directory / DATA_FILE, **arrays)
    manifest = {"name": "bad", "user_feature_names": ["f"], "action_names": ["click"]}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    return directory


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"item_ids": np.array([1, -2, 3, 4, 5], dtype=np.int64)}, "negative item id -2"),
        ({"item_ids": np.array([1.0, 2.5, 3, 4, 5])}, "item_ids must be an integer"),
        ({"user_ids": np.array([0, -1], dtype=np.int64)}, "negative user id"),
        ({"actions": np.array([0, 1, -1, 0, 0], dtype=np.int64)}, "actions holds a negative id"),
        ({"timestamps": np.array([0, 2, 1, 3, 4], dtype=np.int64)}, "timestamps go backwards"),
    ],
)
def test_bad_ids_name_the_file(tmp_path, overrides, match):
    d = _write_raw(tmp_path / "bad", **overrides)
    with pytest.raises(ValueError, match=match) as err:
        load_sequence_data(Args(dataset_name="bad", dataset_path=str(d)))
    assert str(d / DATA_FILE) in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "user_ids": np.zeros(0, dtype=np.int64),
            "offsets": np.zeros(1, dtype=np.int64),
            "item_ids": np.zeros(0, dtype=np.int64),
            "actions": np.zeros(0, dtype=np.int64),
            "timestamps": np.zeros(0, dtype=np.int64),
            "user_features": np.zeros((0, 1), dtype=np.int64),
        },
        {
            "offsets": np.zeros(3, dtype=np.int64),
            "item_ids": np.zeros(0, dtype=np.int64),
            "actions": np.zeros(0, dtype=np.int64),
            "timestamps": np.zeros(0, dtype=np.int64),
        },
    ],
    ids=["no-users", "no-interactions"],
)
def test_empty_dataset_is_a_clear_error(tmp_path, overrides):
    d = _write_raw(tmp_path / "empty", **overrides)
    with pytest.raises(ValueError, match="is empty"):
        load_sequence_data(Args(dataset_name="empty", dataset_path=str(d)))


def test_eval_smaller_than_world_keeps_ranks_in_lockstep():
    its = [
        BatchIterator(_Ids(1), 4, shuffle=False, rank=r, world_size=2, drop_last=False)
        for r in range(2)
    ]
    per_rank = [list(it.eval_batches()) for it in its]
    assert [len(b) for b in per_rank] == [1, 1]
    assert per_rank[0][0].tolist() == [0] and per_rank[1][0].tolist() == []


# ---- real data (skipped where ../shared/data is absent) --------------------------------------


def test_real_sequences_cut_without_leakage(shared_data):
    """Amazon Beauty (22k users, 198k interactions): both tasks, vectorised leakage checks."""
    lines = shared_data("amazon-beauty", "Beauty.txt").read_text().split("\n")
    seqs = [np.array(line.split(), dtype=np.int64) for line in lines if line.strip()]
    lengths = np.array([len(s) - 1 for s in seqs])
    data = SequenceData(
        name="amazon-beauty",
        user_ids=np.array([s[0] for s in seqs], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        item_ids=np.concatenate([s[1:] for s in seqs]),
        actions=np.ones(int(lengths.sum()), dtype=np.int64),
        timestamps=np.concatenate([np.arange(n) for n in lengths]).astype(np.int64),
        user_features=np.array([s[0] for s in seqs], dtype=np.int64)[:, None],
        user_feature_names=["user_id"],
        action_names=["interact"],
    )
    assert data.num_interactions == 198_502
    train, ev = build_ranking_samples(data, max_history_seqlen=50, max_num_candidates=10)
    eval_start = np.full(data.num_users, -1)
    eval_start[ev.user_rows] = ev.candidate_starts
    assert (train.candidate_ends <= eval_start[train.user_rows]).all()
    assert (train.history_lengths() >= 1).all() and (ev.history_lengths() >= 1).all()
    per_user = np.bincount(ev.user_rows, weights=ev.num_candidates(), minlength=data.num_users)
    per_user += np.bincount(
        train.user_rows, weights=train.num_candidates(), minlength=data.num_users
    )
    np.testing.assert_array_equal(per_user, lengths - 1)  # every item but the first is a candidate

    rtrain, rev = build_retrieval_samples(data, max_history_seqlen=50)
    target = np.full(data.num_users, -1)
    target[rev.user_rows] = rev.target_positions()
    assert (rtrain.ends <= target[rtrain.user_rows]).all()
    assert len(rev) == data.num_users
    it = BatchIterator(rev, 4096, shuffle=False, drop_last=False)
    seen = sum(b.batch_size for b in it.eval_batches())
    assert seen == data.num_users
    batch = next(BatchIterator(rtrain, 256, seed=0))
    assert batch.features["user_id"].values().tolist() == batch.user_ids.tolist()
