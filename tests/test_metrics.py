"""Metrics against hand-computed values, brute-force oracles and a 2-process gloo run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hstu.modules.metrics import (
    RankingMetrics,
    RetrievalEvaluator,
    binary_auc,
    ks_from_metric_names,
    popularity_scores,
    retrieval_metrics,
)

INF = float("inf")


# ---- AUC ------------------------------------------------------------------------------------


def test_binary_auc_hand_computed():
    # Pairs (pos, neg): (0.35, 0.1) win, (0.35, 0.4) loss, (0.8, *) two wins -> 3/4.
    assert binary_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert binary_auc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 1])) == 1.0
    assert binary_auc(torch.tensor([0.3, 0.2, 0.1]), torch.tensor([0, 1, 1])) == 0.0


def test_binary_auc_ties_count_half():
    # pos 0.5 vs negs {0.5, 0.5}: 2 ties = 1.0; pos 0.9 beats both = 2.0 -> 3/4.
    scores = torch.tensor([0.5, 0.5, 0.5, 0.9])
    labels = torch.tensor([0, 1, 0, 1])
    assert binary_auc(scores, labels) == pytest.approx(0.75)
    # A constant model is exactly chance.
    assert binary_auc(torch.zeros(6), torch.tensor([0, 1, 0, 1, 1, 0])) == pytest.approx(0.5)


def test_binary_auc_single_class_is_nan():
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([0, 0])))
    assert math.isnan(binary_auc(torch.zeros(0), torch.zeros(0)))


def test_binary_auc_matches_torchmetrics_with_ties():
    # imported here so the spawned distributed workers do not pay for torchmetrics
    from torchmetrics.classification import BinaryAUROC

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 7, (500,), generator=g).float() / 7  # many ties
    labels = (torch.rand(500, generator=g) < 0.3 + 0.4 * scores).long()
    ref = BinaryAUROC()(scores, labels).item()
    assert binary_auc(scores, labels) == pytest.approx(ref, abs=1e-6)


def test_ranking_metrics_bitmask_tasks_and_nan_task():
    m = RankingMetrics(3, ["click", "like", "share"])
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.4, 0.1, 0.0], [0.35, 0.2, 0.0], [0.8, 0.3, 0.0]])
    # bit0 (click) = [0,0,1,1]; bit1 (like) = [1,0,0,1]; bit2 (share) never set.
    labels = torch.tensor([0b10, 0b00, 0b01, 0b11])
    m.update(logits[:2], labels[:2])
    m.update(logits[2:], labels[2:])
    out = m.compute()
    assert set(out) == {"auc/click", "auc/like", "auc/share", "auc/mean"}
    assert out["auc/click"] == pytest.approx(0.75)
    # like: pos {0.9, 0.3} vs neg {0.1, 0.2}: 4 wins -> 1.0
    assert out["auc/like"] == pytest.approx(1.0)
    assert math.isnan(out["auc/share"])
    assert out["auc/mean"] == pytest.approx(0.875)
    m.reset()
    assert m.num_samples == 0
    assert all(math.isnan(v) for v in m.compute().values())


def test_ranking_metrics_errors():
    with pytest.raises(ValueError, match="task_names"):
        RankingMetrics(2, ["a"])
    m = RankingMetrics(2, ["a", "b"])
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        m.update(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="bitmask"):
        m.update(torch.zeros(4, 2), torch.zeros(4))


# ---- retrieval per-sample metrics -------------------------------------------------------------


def test_retrieval_metrics_hand_computed():
    scores = torch.tensor(
        [
            [0.9, 0.5, 0.7, 0.1],  # target 2: only 0.9 above -> rank 2
            [0.5, 0.5, 0.5, 0.5],  # all tied: ties count against -> rank 4 (miss at K<=3)
            [-INF, 0.2, -INF, 0.1],  # target 3: -inf items excluded -> rank 2
            [-INF, 0.3, -INF, 0.1],  # target 0 itself -inf: after both finite others -> rank 3
            [0.1, 0.2, 0.3, 0.4],  # target 3 is the max -> rank 1
        ]
    )
    target = torch.tensor([2, 0, 3, 0, 3])
    out = retrieval_metrics(scores, target, ks=(1, 2, 3))
    ranks = torch.tensor([2.0, 4.0, 2.0, 3.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(out["mrr"], 1.0 / ranks)
    torch.testing.assert_close(out["hr@1"], torch.tensor([0, 0, 0, 0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out["hr@2"], torch.tensor([1, 0, 1, 0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out["hr@3"], torch.tensor([1, 0, 1, 1, 1.0], dtype=torch.float64))
    inv = 1 / math.log2(3)
    torch.testing.assert_close(
        out["ndcg@2"], torch.tensor([inv, 0, inv, 0, 1.0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        out["ndcg@3"], torch.tensor([inv, 0, inv, 0.5, 1.0], dtype=torch.float64)
    )


def test_retrieval_metrics_errors():
    with pytest.raises(ValueError, match="target_index"):
        retrieval_metrics(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics(torch.tensor([[0.0, math.nan]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="ks"):
        retrieval_metrics(torch.zeros(1, 3), torch.tensor([0]), ks=(0,))


def test_ks_from_metric_names():
    names = ("HR@10", "NDCG@10", "HR@50", "NDCG@50", "HR@200", "NDCG@200", "MRR")
    assert ks_from_metric_names(names) == (10, 50, 200)
    with pytest.raises(ValueError, match="eval_metrics"):
        ks_from_metric_names(["recall@10"])


# ---- full-corpus evaluator --------------------------------------------------------------------

# Corpus in a non-sorted order; with D=1 and query 1.0 each item's score is its embedding value.
CORPUS = torch.tensor([30, 10, 50, 20, 40])
EMB = torch.tensor([[0.1], [0.9], [0.8], [0.5], [0.3]])


def _eval(targets, history, exclude=True, ks=(1, 2, 3)):
    ev = RetrievalEvaluator(CORPUS, ks=ks, exclude_history=exclude)
    ev.update(torch.ones(len(targets), 1), EMB, torch.tensor(targets), history)
    return ev.compute()


def test_evaluator_history_exclusion_changes_rank():
    # target 20 (0.5) is behind 10 (0.9) and 50 (0.8): rank 3.
    assert _eval([20], [torch.tensor([30])])["MRR"] == pytest.approx(1 / 3)
    assert _eval([20], [torch.tensor([10])], exclude=False)["MRR"] == pytest.approx(1 / 3)
    # excluding the user's own item 10 lifts the target to rank 2; 999 is not in the corpus.
    out = _eval([20], [torch.tensor([10, 999])])
    assert out["MRR"] == pytest.approx(1 / 2)
    assert out["HR@1"] == 0.0 and out["HR@2"] == 1.0
    assert out["NDCG@2"] == pytest.approx(1 / math.log2(3))


def test_evaluator_target_in_history_stays_rankable():
    out = _eval([20], [torch.tensor([20, 10, 50])])
    assert out["MRR"] == pytest.approx(1.0)
    assert out["HR@1"] == 1.0


def test_evaluator_aggregates_means_and_jagged_history():
    targets = [20, 10, 30]
    # ranks with exclusion: 20 with hist {50} -> 2; 10 -> 1; 30 (0.1) hist {40, 20} -> 3
    values = torch.tensor([50, 40, 20])
    offsets = torch.tensor([0, 1, 1, 3])
    out = _eval(targets, (values, offsets))
    assert out["MRR"] == pytest.approx((1 / 2 + 1 + 1 / 3) / 3)
    assert out["HR@1"] == pytest.approx(1 / 3)
    assert out["HR@2"] == pytest.approx(2 / 3)
    assert out["HR@3"] == pytest.approx(1.0)
    assert out["NDCG@3"] == pytest.approx((1 / math.log2(3) + 1 + 0.5) / 3)
    as_list = _eval(targets, [torch.tensor([50]), torch.tensor([], dtype=torch.long), values[1:]])
    assert as_list == pytest.approx(out)


def _brute_force(scores, corpus, targets, histories, ks):
    """Per-sample loop straight from the definitions."""
    sums = {f"HR@{k}": 0.0 for k in ks} | {f"NDCG@{k}": 0.0 for k in ks} | {"MRR": 0.0}
    col = {int(i): c for c, i in enumerate(corpus)}
    for b, t in enumerate(targets.tolist()):
        excluded = {col[h] for h in histories[b].tolist() if h in col and h != t}
        ts = scores[b, col[t]].item()
        rank = 1 + sum(
            1
            for c in range(len(corpus))
            if c != col[t] and c not in excluded and scores[b, c].item() >= ts
        )
        for k in ks:
            sums[f"HR@{k}"] += float(rank <= k)
            sums[f"NDCG@{k}"] += 1 / math.log2(rank + 1) if rank <= k else 0.0
        sums["MRR"] += 1 / rank
    return {k: v / len(targets) for k, v in sums.items()}


def _random_case(seed, b=24, c=40, d=4):
    g = torch.Generator().manual_seed(seed)
    corpus = torch.randperm(200, generator=g)[:c]
    # Rounded embeddings so ties occur.
    emb = torch.randint(-2, 3, (c, d), generator=g).float()
    query = torch.randint(-2, 3, (b, d), generator=g).float()
    targets = corpus[torch.randint(0, c, (b,), generator=g)]
    histories = [
        torch.cat([corpus[torch.randint(0, c, (int(n),), generator=g)], torch.tensor([999])])
        for n in torch.randint(0, 6, (b,), generator=g)
    ]
    return corpus, emb, query, targets, histories


def test_evaluator_matches_brute_force_and_chunking():
    corpus, emb, query, targets, histories = _random_case(1)
    ks = (1, 5, 10)
    ref = _brute_force(query @ emb.t(), corpus, targets, histories, ks)
    for chunk in (None, 1, 7):
        ev = RetrievalEvaluator(corpus, ks=ks, chunk_size=chunk)
        ev.update(query[:10], emb, targets[:10], histories[:10])
        ev.update(query[10:], emb, targets[10:], histories[10:])
        assert ev.num_samples == 24
        assert ev.compute() == pytest.approx(ref)


def test_popularity_scores_through_evaluator():
    corpus = torch.tensor([1, 2, 3, 4])
    train = torch.tensor([1, 1, 2, 3, 3, 3, 77])  # 77 is not in the corpus
    counts = popularity_scores(train, corpus, tie_break=False)
    torch.testing.assert_close(counts, torch.tensor([2.0, 1.0, 3.0, 0.0]))
    scores = popularity_scores(train, corpus)
    torch.testing.assert_close(scores, torch.tensor([3.0, 2.0, 4.0, 1.0]))
    # Two ids tied at count 0 are ordered by corpus position, not both ranked last.
    torch.testing.assert_close(
        popularity_scores(torch.tensor([2]), corpus), torch.tensor([3.0, 4.0, 2.0, 1.0])
    )
    ev = RetrievalEvaluator(corpus, ks=(1, 2), exclude_history=True)
    # target 1 behind 3 -> rank 2; with 3 in history -> rank 1.
    ev.update_scores(scores, torch.tensor([1, 1]), [torch.tensor([]), torch.tensor([3])])
    torch.testing.assert_close(scores, torch.tensor([3.0, 2.0, 4.0, 1.0]))  # caller's copy intact
    out = ev.compute()
    assert out["MRR"] == pytest.approx(0.75)
    assert out["HR@1"] == pytest.approx(0.5)
    assert out["HR@2"] == pytest.approx(1.0)


def test_evaluator_errors():
    with pytest.raises(ValueError, match="unique"):
        RetrievalEvaluator(torch.tensor([1, 2, 2]))
    ev = RetrievalEvaluator(CORPUS, ks=(1,))
    with pytest.raises(ValueError, match=r"\[12345\] are not in the item corpus"):
        ev.update(torch.ones(1, 1), EMB, torch.tensor([12345]), [torch.tensor([])])
    with pytest.raises(ValueError, match="eval_exclude_history"):
        ev.update(torch.ones(1, 1), EMB, torch.tensor([10]))
    with pytest.raises(ValueError, match="rows"):
        ev.update(torch.ones(1, 1), EMB[:3], torch.tensor([10]), [torch.tensor([])])
    with pytest.raises(ValueError, match="history sequences"):
        ev.update(torch.ones(2, 1), EMB, torch.tensor([10, 20]), [torch.tensor([])])


# ---- distributed: 2 gloo ranks == 1 process on the union ---------------------------------------


def _ranking_data():
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 5, (31, 2), generator=g).float()
    labels = torch.randint(0, 4, (31,), generator=g)
    labels[:] = labels & 0b01  # task 1 has no positives anywhere -> nan on every layout
    return logits, labels


def _dist_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        logits, labels = _ranking_data()
        split = [0, 9, 31]  # uneven shards exercise the padded all-gather
        rm = RankingMetrics(2, ["a", "b"])
        rm.update(logits[split[rank] : split[rank + 1]], labels[split[rank] : split[rank + 1]])
        corpus, emb, query, targets, histories = _random_case(2)
        rsplit = [0, 5, 24]
        lo, hi = rsplit[rank], rsplit[rank + 1]
        ev = RetrievalEvaluator(corpus, ks=(1, 5, 10), chunk_size=3)
        ev.update(query[lo:hi], emb, targets[lo:hi], histories[lo:hi])
        result = {"ranking": rm.compute(), "retrieval": ev.compute()}
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


def test_distributed_matches_single_process(tmp_path):
    out_file = str(tmp_path / "result.pt")
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), out_file), nprocs=2, join=True)
    result = torch.load(out_file, weights_only=False)

    logits, labels = _ranking_data()
    rm = RankingMetrics(2, ["a", "b"])
    rm.update(logits, labels)
    ref = rm.compute()
    assert result["ranking"]["auc/a"] == pytest.approx(ref["auc/a"])
    assert math.isnan(result["ranking"]["auc/b"]) and math.isnan(ref["auc/b"])
    # On this split the union AUC differs from the mean of per-shard AUCs, so per-rank averaging
    # would fail the check above.
    shard_mean = (binary_auc(logits[:9, 0], labels[:9]) + binary_auc(logits[9:, 0], labels[9:])) / 2
    assert abs(shard_mean - ref["auc/a"]) > 0.05
    corpus, emb, query, targets, histories = _random_case(2)
    ev = RetrievalEvaluator(corpus, ks=(1, 5, 10))
    ev.update(query, emb, targets, histories)
    assert result["retrieval"] == pytest.approx(ev.compute())
