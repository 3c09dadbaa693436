"""The dynamic tables' graphed training lookup (hstu.embeddings.lookup_graphs): the padded
deduplication against the exact one (CPU), and graphed tables against eager ones (GPU): the
same rows, slots, evictions, counters and updates, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import DynamicEmbeddingTable, UniqueIds
from hstu.embeddings.lookup_graphs import BYTES_PER_ID, ID_SIZES_PER_OCTAVE, LookupGraphs
from hstu.embeddings.reference_table import EMPTY_KEY
from hstu.graph_capture import padded_token_count

I64 = torch.iinfo(torch.int64)


def _ids(g: torch.Generator, n: int) -> torch.Tensor:
    """Ids with many duplicates and, now and then, the int64 extremes (EMPTY_KEY excluded)."""
    ids = torch.randint(-30, 30, (n,), generator=g) * 1_000_003
    if n and torch.rand(1, generator=g).item() < 0.5:
        ids[torch.randint(0, n, (3,), generator=g)] = I64.max
        ids[torch.randint(0, n, (2,), generator=g)] = I64.min + 1
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_padded_unique_ids_match_the_exact_ones(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        n = int(torch.randint(0, 200, (1,), generator=g))
        pad = int(torch.randint(0 if n else 1, 40, (1,), generator=g))
        ids = _ids(g, n)
        padding = _ids(g, pad)  # any values, the int64 maximum included
        p = UniqueIds.padded(torch.cat([ids, padding]), torch.tensor(n))
        size = n + pad
        assert p.uniq.shape == p.counts.shape == p.inverse.shape == p.perm.shape == (size,)
        assert p.offsets.shape == (size + 1,)
        exact_uniq = torch.unique(ids)
        u = exact_uniq.numel()
        assert int(p.num_unique) == u
        assert torch.equal(p.valid, torch.arange(size) < u)
        assert torch.equal(p.uniq[:u], exact_uniq)
        assert bool((p.uniq[u:] == EMPTY_KEY).all())
        assert bool((p.counts[u:] == 0).all()) and bool((p.offsets[u:] == n).all())
        first = p.first(n)
        if n:
            e = UniqueIds(ids)
            for name in ("counts", "offsets", "inverse", "perm"):
                assert torch.equal(
                    getattr(first, name)[: getattr(e, name).numel()], getattr(e, name)
                ), name
        # every real position's id is its unique id; each segment of perm holds one id
        assert torch.equal(first.uniq[first.inverse], ids)
        assert torch.equal(torch.sort(first.perm).values, torch.arange(n))
        for k in range(u):
            seg = first.perm[p.offsets[k] : p.offsets[k + 1]]
            assert bool((ids[seg] == p.uniq[k]).all())


def test_new_counts_past_the_limits_run_eagerly():
    seen = []

    def body(ids, n, step):  # the first lookup of a count runs eagerly on the entry's buffers
        seen.append((ids.numel(), int(n), int(step[0])))
        return ids.clone(), ids.clone()

    def count(n):
        return padded_token_count(n, ID_SIZES_PER_OCTAVE)

    held = count(10) + count(1500)
    g = LookupGraphs(torch.device("cpu"), "t", max_graphs=3, max_bytes=held * BYTES_PER_ID)
    first = g.run(body, torch.arange(10), 7)
    assert first is not None and first[2] is None and torch.equal(first[0][:10], torch.arange(10))
    assert g.run(body, torch.arange(1500), 8) is not None
    assert seen == [(count(10), 10, 7), (count(1500), 1500, 8)]
    assert g.run(body, torch.arange(1000), 9) is None  # its buffers would pass max_bytes
    g.max_bytes *= 10
    g.max_graphs = 2
    assert g.run(body, torch.arange(1000), 9) is None  # a third count
    assert g.stats.eager == 4  # two first lookups, two refused
    assert len(seen) == 2


DEV = torch.device("cuda")


def _table(graphs: bool, **kw) -> DynamicEmbeddingTable:
    base = dict(
        name="t",
        embedding_dim=16,
        capacity=1024,  # 32 buckets: ids from a range of 6,000 evict
        feature_names=["f"],
        optimizer="adam",
        seed=5,
        lookup_graphs=graphs,
    )
    base.update(kw)
    return DynamicEmbeddingTable(DynamicEmbeddingConfig(**base), DEV)


def _same(a: DynamicEmbeddingTable, b: DynamicEmbeddingTable) -> None:
    for name in ("keys", "scores", "touched", "values"):
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name
    assert a.stats() == b.stats() and a.step == b.step


def _train(tables, sizes, id_range, seed=0, two_lookups=False, no_grad_at=()):
    g = torch.Generator(device=DEV).manual_seed(seed)
    for i, n in enumerate(sizes):
        ids = torch.randint(0, id_range, (n,), device=DEV, generator=g)
        w = torch.randn(n, 16, device=DEV, generator=g)
        outs = []
        for t in tables:
            if i in no_grad_at:
                with torch.no_grad():
                    outs.append(t(ids, host_ids=ids.cpu()))
                continue
            out = t(ids, host_ids=ids.cpu())
            loss = (out * w).sum()
            if two_lookups:  # the same count again before the backward: runs eagerly
                loss = loss + t(ids.flip(0), host_ids=ids.flip(0).cpu()).square().sum()
            loss.backward()
            outs.append(out.detach())
        for o in outs[1:]:
            assert torch.equal(outs[0], o)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad", "sgd"])
@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_graphed_lookups_match_eager_ones(policy, optimizer):
    eager, graphed = (_table(gr, eviction_policy=policy, optimizer=optimizer) for gr in (0, 1))
    sizes = [300, 300, 300, 1000, 300, 1000, 1000, 5, 300, 5, 5, 2000, 2000, 2000]
    _train([eager, graphed], sizes, 6000, no_grad_at=(9,))
    _same(eager, graphed)
    gs = graphed._graphs.stats
    # counts 384, 1024, 128, 2048: each eager once, then captured and replayed
    assert gs.captures == 4 and gs.replays == 10 and not gs.disabled
    assert graphed.stats()["evictions"] > 0
    assert eager._graphs is None


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_pending_graphs_and_load():
    eager, graphed = _table(False), _table(True)
    _train([eager, graphed], [700] * 4, 3000, seed=1, two_lookups=True)
    _same(eager, graphed)
    # step 0: the first lookup eager, the second captured; later the second ran eagerly
    assert graphed._graphs.stats.replays == 4
    dump = eager.dump()
    for t in (eager, graphed):
        t.load(dump)
    assert graphed._graphs.stats.captures == 1 and not graphed._graphs._entries
    _train([eager, graphed], [700] * 4, 3000, seed=2)
    _same(eager, graphed)
    # a lookup whose output is dropped without a backward leaves no entry pending
    ids = torch.arange(700, device=DEV)
    for t in (eager, graphed):
        t(ids, host_ids=ids.cpu())
    replays = graphed._graphs.stats.replays
    _train([eager, graphed], [700], 3000, seed=3)
    assert graphed._graphs.stats.replays == replays + 1
    _same(eager, graphed)


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_graphed_lookup_rejects_the_reserved_id():
    t = _table(True)
    ids = torch.tensor([3, EMPTY_KEY, 4], device=DEV)
    for host in (ids.cpu(), None):
        with pytest.raises(ValueError, match="reserved"):
            t(ids, host_ids=host)
    assert t.step == 0 and t.stats()["lookups"] == 0
