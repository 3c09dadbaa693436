"""Dynamic tables given the ids' CPU copy (host_ids): the same results as without, exactly, while
the sizes come from the host. Also the insert grouping against a straightforward reference."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.embeddings import reference_table as R
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    UniqueIds,
    padded_segments,
)


def _cfg(**kw) -> DynamicEmbeddingConfig:
    base = dict(name="t", embedding_dim=8, capacity=48, feature_names=["f"], optimizer="adam")
    base.update(kw)
    return DynamicEmbeddingConfig(**base)


@pytest.mark.parametrize("n,hi", [(0, 5), (1, 5), (7, 3), (200, 50), (200, 10**12)])
def test_unique_ids_with_host_count_equal(n, hi):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(-hi, hi, (n,), generator=g)
    a = UniqueIds(ids)
    b = UniqueIds(ids, num_unique=int(torch.unique(ids).numel()))
    for name in ("uniq", "counts", "perm", "offsets", "inverse"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(b.uniq[b.inverse], ids)


def _segments_by_loop(sorted_bucket: list[int], n_new: int) -> tuple[list[int], list[int]]:
    """padded_segments written as a loop: the runs of equal buckets among the first n_new
    positions, then empty segments at offset n_new with bucket 0."""
    n = len(sorted_bucket)
    runs = [p for p in range(n_new) if p == 0 or sorted_bucket[p] != sorted_bucket[p - 1]]
    offsets = runs + [n_new] * (n + 1 - len(runs))
    buckets = [sorted_bucket[p] for p in runs] + [0] * (n - len(runs))
    return offsets, buckets


@pytest.mark.parametrize("seed", range(6))
def test_padded_segments_against_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        n = int(torch.randint(0, 40, (1,), generator=g))
        nb = int(torch.randint(1, 9, (1,), generator=g))
        n_new = int(torch.randint(0, n + 1, (1,), generator=g))
        absent = sorted(torch.randint(0, nb, (n_new,), generator=g).tolist())
        sorted_bucket = absent + [nb] * (n - n_new)
        ids = torch.tensor(sorted_bucket, dtype=torch.int64)
        offsets, buckets = padded_segments(ids, nb, torch.tensor(n_new))
        assert (offsets.tolist(), buckets.tolist()) == _segments_by_loop(sorted_bucket, n_new)
        assert offsets.dtype == buckets.dtype == torch.int64


def _old_insert_order(uniq, slots, num_buckets):
    """The grouping the table used before: missing ids in id order, stable-sorted by bucket."""
    missing = torch.nonzero(slots < 0).flatten()
    keys = uniq[missing]
    b = R.bucket_of(keys, num_buckets)
    order = torch.argsort(b, stable=True)
    seg_buckets, seg_counts = torch.unique_consecutive(b[order], return_counts=True)
    return missing[order], seg_buckets, seg_counts


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_training_with_host_ids_matches_without(policy, monkeypatch):
    """Several training steps with inserts, evictions and overflows: outputs, fused updates,
    table contents and counters equal with and without host ids, and the insert kernel gets the
    grouping the table used before (missing ids in id order, stable-sorted by bucket)."""
    kw = dict(eviction_policy=policy, capacity=40)
    tables = [DynamicEmbeddingTable(_cfg(**kw)), DynamicEmbeddingTable(_cfg(**kw))]
    calls = []
    orig = R.insert

    def spy(state, keys, seg_offsets, seg_buckets, *args):
        calls.append((keys.clone(), seg_offsets.clone(), seg_buckets.clone()))
        return orig(state, keys, seg_offsets, seg_buckets, *args)

    monkeypatch.setattr(R, "insert", spy)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 90, (70,), generator=g)
        scores = torch.randint(0, 1000, (70,), generator=g) if policy == "custom" else None
        u = UniqueIds(ids)
        slots = R.find(tables[1].state, u.uniq)
        ref_idx, ref_b, ref_counts = _old_insert_order(u.uniq, slots, tables[1].state.num_buckets)
        outs = []
        for i, t in enumerate(tables):
            calls.clear()
            out = t(ids, scores, host_ids=ids.clone() if i == 1 else None)
            if ref_idx.numel():
                keys, seg_offsets, seg_buckets = calls[0]
                assert torch.equal(keys, u.uniq[ref_idx])
                assert torch.equal(seg_buckets, ref_b)
                assert torch.equal(seg_offsets.diff(), ref_counts)
            else:
                assert not calls
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1])
    a, b = tables[0].dump(), tables[1].dump()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert tables[0].stats() == tables[1].stats()
    assert tables[0].stats()["evictions"] + tables[0].stats()["overflows"] > 0


def test_eval_and_collection_with_host_ids():
    coll = [DynamicEmbeddingCollection([_cfg(feature_names=["f", "g"])]) for _ in range(2)]
    kjt = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([5, 7, 5, 9, 1, 7]),
        lengths=torch.tensor([2, 1, 2, 1]),
    )
    host = {"f": torch.tensor([5, 7, 5]), "g": torch.tensor([9, 1, 7])}
    for mode in ("train", "eval"):
        for c in coll:
            getattr(c, mode)()
        a = coll[0](kjt)
        b = coll[1](kjt, host_ids=host)
        for k in a:
            assert torch.equal(a[k].values(), b[k].values())
    # a table missing one feature's host ids falls back to the device path (same results)
    c = coll[1](kjt, host_ids={"f": host["f"]})
    assert torch.equal(c["g"].values(), a["g"].values())


def test_host_ids_errors():
    t = DynamicEmbeddingTable(_cfg())
    with pytest.raises(ValueError, match="host_ids must be the ids on the CPU"):
        t(torch.tensor([1, 2, 3]), host_ids=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="reserved"):
        t(torch.tensor([R.EMPTY_KEY, 2]), host_ids=torch.tensor([R.EMPTY_KEY, 2]))
    assert t.size() == 0  # rejected before anything was inserted


def _kernel_like_insert(orig):
    """The reference insert behaving like the compiled kernel on padded input: empty trailing
    segments are skipped and the output entries past the last segment are left unwritten
    (filled with junk here, which the table must ignore)."""

    def insert(state, keys, seg_offsets, seg_buckets, scores, *args):
        counts = seg_offsets[1:] - seg_offsets[:-1]
        n_seg = int((counts > 0).sum())
        assert torch.all(counts[n_seg:] == 0), "padding segments must be trailing and empty"
        n = int(seg_offsets[n_seg])
        slots, evicted = orig(
            state, keys[:n], seg_offsets[: n_seg + 1], seg_buckets[:n_seg], scores[:n], *args
        )
        junk = torch.full((keys.numel() - n,), 123456789, dtype=torch.int64)
        return torch.cat([slots, junk]), evicted

    return insert


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
def test_padded_insert_matches_exact_sizes(policy, monkeypatch):
    """The GPU path (insert input padded to the unique-id count, no device read) leaves the table
    exactly as the exact-size path, through inserts, evictions and overflows."""
    monkeypatch.setattr(R, "insert", _kernel_like_insert(R.insert))
    kw = dict(eviction_policy=policy, capacity=40)
    exact, padded = DynamicEmbeddingTable(_cfg(**kw)), DynamicEmbeddingTable(_cfg(**kw))
    padded._padded_insert = True
    g = torch.Generator().manual_seed(7)
    for step in range(8):
        ids = torch.randint(0, 90, (70,), generator=g) if step != 3 else torch.tensor([1, 1])
        scores = torch.randint(0, 1000, (ids.numel(),), generator=g)
        scores = scores if policy == "custom" else None
        outs = []
        for t in (exact, padded):
            out = t(ids, scores, host_ids=ids.clone())
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1])
    a, b = exact.dump(), padded.dump()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert exact.stats() == padded.stats()
    assert exact.stats()["evictions"] > 0 and exact.stats()["overflows"] >= 0
