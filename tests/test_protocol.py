"""The retrieval evaluation protocol on hand-built cases (HSTU paper / SASRec protocol).

Leave-one-out split, history exclusion through the trainer's own path
(``metrics.held_out_histories`` feeding ``RetrievalEvaluator``), and metric values (HR@K, NDCG@K, MRR, ties) small enough to
rank by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hstu.data.datasets import build_retrieval_samples
from hstu.data.sequences import SequenceData
from hstu.modules.metrics import RetrievalEvaluator, held_out_histories, retrieval_metrics

# Three users (raw ids 10, 11, 12), time-ordered items. User 11 re-consumes item 3 as its last
# item; user 12 has a single interaction (no usable sample).
SEQS = {10: [1, 2, 3, 4, 5, 6, 7], 11: [3, 8, 9, 3], 12: [5]}


def _data() -> SequenceData:
    users = list(SEQS)
    items = np.concatenate([np.array(SEQS[u], dtype=np.int64) for u in users])
    offsets = np.concatenate([[0], np.cumsum([len(SEQS[u]) for u in users])]).astype(np.int64)
    return SequenceData(
        name="hand",
        user_ids=np.array(users, dtype=np.int64),
        offsets=offsets,
        item_ids=items,
        actions=np.zeros(items.shape[0], dtype=np.int64),
        timestamps=np.arange(items.shape[0], dtype=np.int64),
        user_features=np.zeros((len(users), 0), dtype=np.int64),
    )


def _windows(samples, data):
    """(user id, item list) of every sample, in order."""
    return [
        (int(data.user_ids[r]), data.item_ids[s:e].tolist())
        for r, s, e in zip(samples.user_rows, samples.starts, samples.ends)
    ]


# ---- leave-one-out split -----------------------------------------------------------------------


def test_leave_one_out_eval_is_the_last_item_after_a_truncated_history():
    data = _data()
    splits = build_retrieval_samples(data, max_history_seqlen=3)
    ev = splits.eval
    assert _windows(ev, data) == [(10, [4, 5, 6]), (11, [3, 8, 9])]
    assert data.item_ids[ev.target_positions()].tolist() == [7, 3]
    assert ev.num_skipped_users == 1  # user 12: one interaction only
    batch = ev.collate([0, 1])
    assert batch.target_item_ids.tolist() == [7, 3]
    assert batch.user_ids.tolist() == [10, 11]
    assert batch.features["item_id"].values().tolist() == [4, 5, 6, 3, 8, 9]
    assert batch.num_candidates.tolist() == [0, 0]  # the target is never an input


def test_training_never_sees_the_held_out_item():
    data = _data()
    for h in (1, 2, 3, 5, 10):
        splits = build_retrieval_samples(data, max_history_seqlen=h)
        tr = splits.train
        last_pos = {int(data.user_ids[r]): int(data.offsets[r + 1]) - 1 for r in range(3)}
        for r, s, e in zip(tr.user_rows, tr.starts, tr.ends):
            held_out = last_pos[int(data.user_ids[r])]
            assert e <= held_out, (h, s, e)  # neither input nor target
            assert data.offsets[r] <= s and e - s <= h + 1 and e - s >= 2
        # training targets: positions starts+1..ends-1, all strictly before the held-out item
        targets = tr.target_positions()
        assert all(t not in last_pos.values() for t in targets.tolist())
        # every training window, collated, holds only the user's first L - 1 items
        batch = tr.collate(list(range(len(tr))))
        assert batch.target_item_ids is None
        vals = batch.features["item_id"].values().tolist()
        lens = batch.features["item_id"].lengths().tolist()
        for (uid, window), n, start in zip(
            _windows(tr, data), lens, np.cumsum([0, *lens])[:-1].tolist()
        ):
            assert vals[start : start + n] == window
            _find(SEQS[uid][:-1], window)  # a contiguous run of the user's first L - 1 items


def _find(seq: list[int], window: list[int]) -> int:
    for i in range(len(seq) - len(window) + 1):
        if seq[i : i + len(window)] == window:
            return i
    raise AssertionError(f"{window} is not a contiguous part of {seq}")


def test_training_windows_cover_all_but_the_last_item():
    data = _data()
    tr = build_retrieval_samples(data, max_history_seqlen=2).train
    # user 10: items[:-1] = 1..6 cut from the end into windows of 3 items; user 11: [3, 8, 9]
    assert _windows(tr, data) == [(10, [1, 2, 3]), (10, [4, 5, 6]), (11, [3, 8, 9])]
    # next-item targets: 2, 3 | 5, 6 | 8, 9 (the held-out 7 and the final 3 of user 11 never)
    assert data.item_ids[tr.target_positions()].tolist() == [2, 3, 5, 6, 8, 9]


# ---- history exclusion through the trainer's path -----------------------------------------------


def test_full_history_excludes_items_outside_the_truncated_window():
    data = _data()
    ev = build_retrieval_samples(data, max_history_seqlen=2).eval
    batch = ev.collate([0, 1])
    assert batch.features["item_id"].values().tolist() == [5, 6, 8, 9]  # windows of 2
    hist = held_out_histories(data, batch.user_ids)
    values, offsets = hist
    assert offsets.tolist() == [0, 6, 9]
    assert values.tolist() == [1, 2, 3, 4, 5, 6, 3, 8, 9]

    corpus = torch.from_numpy(data.item_corpus())  # items 1..9 -> columns 0..8
    assert corpus.tolist() == list(range(1, 10))
    # user 10 (target 7): item 1 (outside the window, in the full history) scores highest,
    # then 8, then the target 7, then 9. user 11 (target 3, a repeat): 8 (history) > 3 > rest.
    scores = torch.tensor(
        [
            [9.0, 0.1, 0.2, 0.3, 0.4, 0.5, 7.0, 8.0, 6.0],
            [0.0, 0.0, 5.0, 0.1, 0.2, 0.3, 0.4, 9.0, 0.5],
        ]
    )
    full = RetrievalEvaluator(corpus, ks=(1, 2), exclude_history=True)
    full.update_scores(scores, batch.target_item_ids, hist)
    m = full.compute()
    # user 10: 1 excluded -> rank 2 (behind 8); user 11: 8 excluded, 3 kept (target) -> rank 1
    assert m["HR@1"] == pytest.approx(0.5)
    assert m["HR@2"] == pytest.approx(1.0)
    assert m["MRR"] == pytest.approx((1 / 2 + 1) / 2)
    assert m["NDCG@2"] == pytest.approx((1 / math.log2(3) + 1.0) / 2)

    # only the truncated window excluded: item 1 stays ahead of user 10's target (rank 3)
    windows = [torch.tensor([5, 6]), torch.tensor([8, 9])]
    trunc = RetrievalEvaluator(corpus, ks=(1, 2), exclude_history=True)
    trunc.update_scores(scores, batch.target_item_ids, windows)
    assert trunc.compute()["MRR"] == pytest.approx((1 / 3 + 1) / 2)

    # no exclusion at all: user 10 rank 3 (1, 8 ahead), user 11 rank 2 (8 ahead)
    none = RetrievalEvaluator(corpus, ks=(1, 2), exclude_history=False)
    none.update_scores(scores, batch.target_item_ids)
    assert none.compute()["MRR"] == pytest.approx((1 / 3 + 1 / 2) / 2)


def test_exclusion_with_query_and_item_embeddings():
    """The trainer's path end to end: dot-product scores of queries against the corpus."""
    data = _data()
    ev = build_retrieval_samples(data, max_history_seqlen=1).eval
    batch = ev.collate([0])
    hist = held_out_histories(data, batch.user_ids)
    corpus = torch.from_numpy(data.item_corpus())
    emb = torch.zeros(9, 2)
    emb[:, 1] = 1.0  # every item: score 0 on axis 0 ...
    emb[2, 0], emb[6, 0], emb[8, 0] = 3.0, 2.0, 1.0  # ... except 3 (history), 7 (target), 9
    query = torch.tensor([[1.0, 0.0]])
    ev_full = RetrievalEvaluator(corpus, ks=(1,), exclude_history=True)
    ev_full.update(query, emb, batch.target_item_ids, hist)
    assert ev_full.compute()["HR@1"] == 1.0  # 3 is in the full history: excluded
    ev_win = RetrievalEvaluator(corpus, ks=(1,), exclude_history=True)
    ev_win.update(query, emb, batch.target_item_ids, [batch.features["item_id"].values()])
    assert ev_win.compute()["MRR"] == pytest.approx(0.5)  # window [6] does not hide item 3


# ---- metric values by hand ---------------------------------------------------------------------


def test_metric_values_by_hand():
    scores = torch.tensor(
        [
            [0.9, 0.8, 0.7, 0.6, 0.5],  # target col 0: rank 1
            [0.9, 0.8, 0.7, 0.6, 0.5],  # target col 2: rank 3
            [0.1, 0.2, 0.3, 0.4, 0.5],  # target col 0: rank 5
        ]
    )
    m = retrieval_metrics(scores, torch.tensor([0, 2, 0]), ks=(1, 3, 4))
    assert m["hr@1"].tolist() == [1.0, 0.0, 0.0]
    assert m["hr@3"].tolist() == [1.0, 1.0, 0.0]
    assert m["hr@4"].tolist() == [1.0, 1.0, 0.0]
    torch.testing.assert_close(
        m["ndcg@3"], torch.tensor([1.0, 1 / math.log2(4), 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(m["mrr"], torch.tensor([1.0, 1 / 3, 1 / 5], dtype=torch.float64))
    # the evaluator averages them and names them as RetrievalArgs.eval_metrics
    ev = RetrievalEvaluator(torch.tensor([10, 11, 12, 13, 14]), ks=(1, 3), exclude_history=False)
    ev.update_scores(scores, torch.tensor([10, 12, 10]))
    out = ev.compute()
    assert out["HR@1"] == pytest.approx(1 / 3)
    assert out["HR@3"] == pytest.approx(2 / 3)
    assert out["NDCG@3"] == pytest.approx((1 + 0.5) / 3)
    assert out["MRR"] == pytest.approx((1 + 1 / 3 + 1 / 5) / 3)


def test_ties_count_against_the_target():
    # target col 1 tied with cols 0 and 3: two others >= it -> rank 3
    scores = torch.tensor([[0.5, 0.5, 0.1, 0.5], [1.0, 1.0, 1.0, 1.0]])
    m = retrieval_metrics(scores, torch.tensor([1, 2]), ks=(1, 3))
    assert m["mrr"].tolist() == pytest.approx([1 / 3, 1 / 4])  # a constant model ranks last
    assert m["hr@3"].tolist() == [1.0, 0.0]
    # an excluded (-inf) candidate never counts ahead, even of a tied-low target
    ev = RetrievalEvaluator(torch.tensor([1, 2, 3, 4]), ks=(1,), exclude_history=True)
    ev.update_scores(
        torch.tensor([[0.5, 0.5, 0.1, 0.5]]), torch.tensor([2]), [torch.tensor([1, 4])]
    )
    assert ev.compute()["HR@1"] == 1.0


def test_target_scored_like_excluded_items_is_ranked_after_the_rest():
    scores = torch.tensor([[float("-inf"), 0.2, float("-inf"), 0.1]])
    m = retrieval_metrics(scores, torch.tensor([0]), ks=(1,))
    assert m["mrr"].tolist() == [pytest.approx(1 / 3)]  # behind the two finite scores only


def test_user_rows_and_held_out_histories_of_any_users():
    """The shared lookup of evaluation users: rows by raw id (-1 when absent, any order, repeats)
    and each row's items before its last one; a missing user is a clear error."""
    data = _data()
    rows = data.user_rows([11, 10, 99, 11])
    assert rows.tolist() == [1, 0, -1, 1]
    values, offsets = data.histories_before_last(np.array([1, 0], dtype=np.int64))
    assert offsets.tolist() == [0, 3, 9]
    assert values.tolist() == [3, 8, 9, 1, 2, 3, 4, 5, 6]
    one = data.histories_before_last(np.array([2], dtype=np.int64))  # user 12: one item only
    assert one[0].tolist() == [] and one[1].tolist() == [0, 0]
    v, o = held_out_histories(data, torch.tensor([11]))
    assert v.tolist() == [3, 8, 9] and o.tolist() == [0, 3]
    with pytest.raises(ValueError, match=r"evaluation users \[99\] are not in the dataset"):
        held_out_histories(data, torch.tensor([10, 99]))
