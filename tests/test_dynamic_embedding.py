"""CPU tests of the dynamic embedding reference table and collection: hashing and
initialisation, lookup and insert, eviction, the fused optimizers, dump and load."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.embeddings import reference_table as R
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    concat_dumps,
)


def cfg(**kw) -> DynamicEmbeddingConfig:
    base = dict(name="t", embedding_dim=8, capacity=64, feature_names=["f"], optimizer="sgd")
    base.update(kw)
    return DynamicEmbeddingConfig(**base)


def kjt(ids: list[int], lengths: list[int], key: str = "f", weights=None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=[key],
        values=torch.tensor(ids, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=None if weights is None else torch.tensor(weights, dtype=torch.float32),
    )


def _mix_py(z: int) -> int:
    m = 2**64 - 1
    z &= m
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & m
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_hash_matches_unsigned_splitmix():
    ks = [0, 1, -5, 2**62 + 3, -(2**63) + 1, 123456789]
    got = R.mix64(torch.tensor(ks)).tolist()
    assert [g & (2**64 - 1) for g in got] == [_mix_py(k) for k in ks]


def test_init_deterministic_and_distributions():
    ids = torch.arange(4000, dtype=torch.int64) * 7919 - 10**12
    u = R.init_rows(ids, 16, 3, (0, -0.5, 0.25, 0, 0))
    assert torch.equal(u, R.init_rows(ids, 16, 3, (0, -0.5, 0.25, 0, 0)))
    assert u.min() >= -0.5 and u.max() <= 0.25 and abs(u.mean().item() + 0.125) < 0.01
    assert not torch.equal(u, R.init_rows(ids, 16, 4, (0, -0.5, 0.25, 0, 0)))
    n = R.init_rows(ids, 16, 0, (1, 1.0, 2.0, 0, 0))
    assert abs(n.mean().item() - 1.0) < 0.05 and abs(n.std().item() - 2.0) < 0.05
    t = R.init_rows(ids, 16, 0, (2, 0.0, 1.0, -1.0, 1.5))
    assert t.min() >= -1.0 and t.max() <= 1.5 and t.std() < 0.8
    c = R.init_rows(ids, 4, 0, (3, 0.5, 0, 0, 0))
    assert torch.all(c == 0.5)


def test_same_id_same_vector_in_any_table():
    a = DynamicEmbeddingTable(cfg(capacity=64, seed=5))
    b = DynamicEmbeddingTable(cfg(capacity=4096, seed=5))
    with torch.no_grad():
        x = a(torch.tensor([3, 99, -7]))
        y = b(torch.tensor([-7, 3]))
    assert torch.equal(x[0], y[1]) and torch.equal(x[2], y[0])


def test_lookup_insert_hit_eval_defaults():
    m = DynamicEmbeddingCollection([cfg()])
    out = m(kjt([5, 6, 5], [2, 1]))
    assert out["f"].values().shape == (3, 8) and torch.equal(
        out["f"].lengths(), torch.tensor([2, 1])
    )
    assert torch.equal(out["f"].values()[0], out["f"].values()[2])
    m(kjt([5, 6], [2]))
    s = m.stats()
    assert (
        s["t/rows"] == 2 and s["t/inserts"] == 2 and s["t/lookups"] == 4 and s["t/hit_rate"] == 0.5
    )
    m.eval()
    ev = m(kjt([5, 1000], [1, 1]))["f"].values()
    assert torch.all(ev[1] == 0) and torch.allclose(ev[0], out["f"].values()[0])
    assert m.stats()["t/rows"] == 2  # eval never inserts


def test_lru_evicts_oldest_unprotected():
    t = DynamicEmbeddingTable(cfg(capacity=32, eviction_policy="lru"))  # one bucket
    with torch.no_grad():
        for i in range(32):
            t(torch.tensor([i]))
        t(torch.tensor([0]))  # refresh id 0
        t(torch.tensor([100, 101]))  # evicts 1 and 2 (oldest), not 0
    keys = set(t.dump()["keys"].tolist())
    assert 0 in keys and 1 not in keys and 2 not in keys and {100, 101} <= keys
    assert t.stats()["evictions"] == 2 and t.size() == 32


def test_lfu_counts_every_occurrence_and_ties_by_key():
    t = DynamicEmbeddingTable(cfg(capacity=32, eviction_policy="lfu"))
    with torch.no_grad():
        t(torch.arange(32).repeat_interleave(2))  # every id count 2
        t(torch.tensor([7, 7, 7, 9]))  # 7 -> 5, 9 -> 3
        t(torch.tensor([4, 4, 4, 4]))  # 4 -> 6
        t(torch.tensor([200, 201, 202]))  # lowest counts (2): smallest keys 0, 1, 2 go
    d = t.dump()
    keys = d["keys"].tolist()
    assert {0, 1, 2}.isdisjoint(keys) and {4, 7, 9, 200, 201, 202} <= set(keys)
    sc = dict(zip(keys, d["scores"].tolist()))
    assert sc[7] == 5 and sc[9] == 3 and sc[4] == 6 and sc[200] == 1


def test_custom_scores_from_kjt_weights():
    m = DynamicEmbeddingCollection([cfg(capacity=32, eviction_policy="custom")])
    ids = list(range(32))
    with torch.no_grad():
        m(kjt(ids, [32], weights=[float(100 - i) for i in ids]))  # id 31 has the lowest score
        m(kjt([500], [1], weights=[1000.0]))
    keys = set(m.tables["t"].dump()["keys"].tolist())
    assert 31 not in keys and 500 in keys and 0 in keys
    m.tables["t"].set_scores(torch.tensor([0]), torch.tensor([-1]))
    with torch.no_grad():
        m(kjt([501], [1], weights=[5.0]))
    assert 0 not in set(m.tables["t"].dump()["keys"].tolist())


def test_batch_keys_are_protected_and_overflow_is_defined():
    t = DynamicEmbeddingTable(cfg(capacity=32, optimizer="sgd", learning_rate=1.0))
    ids = torch.arange(40)  # 40 new keys for one 32-slot bucket
    out = t(ids)
    out.sum().backward()
    assert t.size() == 32 and t.stats()["overflows"] == 8 and t.stats()["evictions"] == 0
    assert torch.all(out[32:] == 0) and torch.all(out[:32].abs().sum(1) > 0)
    assert set(t.dump()["keys"].tolist()) == set(range(32))  # smallest keys win


def _dense_ref(opt: str, w0: torch.Tensor, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    if opt == "sgd":
        o = torch.optim.SGD([w], lr=lr)
    elif opt == "adam":
        o = torch.optim.Adam([w], lr=lr, betas=(0.9, 0.99), eps=1e-6)
    elif opt == "adagrad":
        o = torch.optim.Adagrad([w], lr=lr, eps=1e-6)
    else:
        acc = torch.zeros(w0.shape[0])
        x = w0.clone()
        for g in grads:
            acc += (g * g).mean(1)
            x -= lr * g / (acc.sqrt() + 1e-6)[:, None]
        return x
    for g in grads:
        o.zero_grad()
        w.grad = g.clone()
        o.step()
    return w.detach()


@pytest.mark.parametrize("opt", ["sgd", "adam", "adagrad", "rowwise_adagrad"])
def test_fused_optimizers_match_dense_with_duplicates(opt):
    c = cfg(optimizer=opt, learning_rate=0.05, beta1=0.9, beta2=0.99, eps=1e-6, capacity=256)
    t = DynamicEmbeddingTable(c)
    keys = torch.tensor([11, 22, 33])
    with torch.no_grad():
        w0 = t(keys).clone()
    gen = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(4):
        ids = torch.tensor([22, 11, 33, 11, 11, 33])  # duplicates: gradients must add up
        coef = torch.randn(6, 8, generator=gen)
        out = t(ids)
        (out * coef).sum().backward()
        g = torch.zeros(3, 8)
        g.index_add_(0, torch.tensor([1, 0, 2, 0, 0, 2]), coef)
        grads.append(g)
    with torch.no_grad():
        got = t(keys)
    want = _dense_ref(opt, w0, grads, 0.05)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_weight_decay_sgd_and_lr_change():
    t = DynamicEmbeddingTable(cfg(optimizer="sgd", learning_rate=0.1, weight_decay=0.5))
    with torch.no_grad():
        w0 = t(torch.tensor([1])).clone()
    t.set_learning_rate(0.2)
    t(torch.tensor([1])).sum().backward()
    with torch.no_grad():
        w1 = t(torch.tensor([1]))
    torch.testing.assert_close(w1, w0 - 0.2 * (1.0 + 0.5 * w0))


def test_empty_batch_and_no_parameters():
    m = DynamicEmbeddingCollection([cfg()])
    out = m(kjt([], [0, 0]))
    assert out["f"].values().shape == (0, 8)
    out["f"].values().sum().backward()
    assert list(m.parameters()) == [] and m.state_dict() == {}
    assert m.fused_optimizer["t"]["optimizer"] == "sgd"


def test_shared_table_features_and_unknown_feature():
    m = DynamicEmbeddingCollection([cfg(feature_names=["a", "b"])])
    x = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 2, 1]), lengths=torch.tensor([1, 1, 1, 0])
    )
    out = m(x)
    assert torch.equal(out["a"].values()[0], out["b"].values()[0])
    with pytest.raises(ValueError, match="no dynamic table"):
        m(kjt([1], [1], key="zzz"))


def _train(t: DynamicEmbeddingTable, steps: int, seed: int, hi: int = 200) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, hi, (50,), generator=g)
        (t(ids) ** 2).sum().backward()


@pytest.mark.parametrize("opt", ["adam", "rowwise_adagrad"])
def test_dump_load_round_trip_continues_identically(opt):
    c = cfg(optimizer=opt, capacity=128, eviction_policy="lfu", learning_rate=0.01)
    a = DynamicEmbeddingTable(c)
    _train(a, 10, 0)
    b = DynamicEmbeddingTable(c)
    b.load(a.dump())
    for k, v in a.dump().items():
        assert torch.equal(v, b.dump()[k]), k
    _train(a, 5, 1)
    _train(b, 5, 1)
    for k, v in a.dump().items():
        assert torch.equal(v, b.dump()[k]), k


def test_dump_load_across_world_sizes_and_smaller_capacity():
    c = cfg(capacity=512, eviction_policy="lru")
    full = DynamicEmbeddingTable(c)
    with torch.no_grad():
        full(torch.arange(300))
    d = full.dump()
    shards = [DynamicEmbeddingTable(c, world_size=3, rank=r) for r in range(3)]
    for s in shards:
        s.load(d)
    assert sum(s.size() for s in shards) == 300
    merged = concat_dumps([s.dump() for s in shards])
    back = DynamicEmbeddingTable(c)
    back.load(merged)
    for k, v in d.items():
        assert torch.equal(v, back.dump()[k]), k
    small = DynamicEmbeddingTable(cfg(capacity=32))
    d2 = dict(d, scores=torch.arange(300))  # highest scores must survive
    small.load(d2)
    kept = small.dump()["keys"]
    assert kept.numel() <= 32 and int(kept.min()) >= 300 - 64


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="embedding_dim"):
        cfg(embedding_dim=0)
    with pytest.raises(ValueError, match="capacity"):
        cfg(capacity=-1)
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        cfg(optimizer="lamb")
    with pytest.raises(ValueError, match="eviction_policy"):
        cfg(eviction_policy="fifo")
    with pytest.raises(ValueError, match="initializer"):
        cfg(initializer="xavier")
    with pytest.raises(ValueError, match="unknown keys"):
        cfg(initializer="normal", init_params={"low": 1.0})
    t = DynamicEmbeddingTable(cfg())
    with pytest.raises(TypeError, match="int32/int64"):
        t(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="reserved"):
        t(torch.tensor([R.EMPTY_KEY]))
    with torch.no_grad():
        t(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="embedding_dim=8, table has 16"):
        DynamicEmbeddingTable(cfg(embedding_dim=16)).load(t.dump())
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        DynamicEmbeddingTable(cfg(optimizer="adam")).load(t.dump())
    with pytest.raises(TypeError, match="int32/int64"):
        DynamicEmbeddingCollection([cfg()])(
            KeyedJaggedTensor(keys=["f"], values=torch.tensor([1.5]), lengths=torch.tensor([1]))
        )
    with pytest.raises(ValueError, match="feature 'f' is mapped"):
        DynamicEmbeddingCollection([cfg(), cfg(name="u")])


def test_erase_and_backward_after_eviction_is_skipped():
    t = DynamicEmbeddingTable(cfg(capacity=32, optimizer="sgd", learning_rate=1.0))
    assert t.erase(torch.tensor([1])) == 0
    out = t(torch.arange(32))  # forward of step 1 holds slots of ids 0..31
    with torch.no_grad():
        t(torch.arange(100, 132))  # step 2 evicts all of them
    before = t.dump()
    out.sum().backward()  # must not update the rows now owned by ids 100..131
    after = t.dump()
    assert torch.equal(before["values"], after["values"])
    assert t.erase(torch.tensor([100, 101, 5])) == 2 and t.size() == 30


def test_low_precision_output_and_stats_keys():
    t = DynamicEmbeddingTable(cfg(output_dtype="bfloat16", optimizer="adagrad"))
    out = t(torch.tensor([1, 2, 2]))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert set(t.stats()) >= {"rows", "occupancy", "inserts", "evictions", "hit_rate", "overflows"}
    with pytest.raises(ValueError, match="output_dtype"):
        cfg(output_dtype="float64")


def test_insert_keys_places_keys_exactly_as_insert():
    """The metadata-only insert (the slot directory of hybrid tables) takes the same slots,
    evicts the same keys and sets the same scores as the insert op; it writes no rows."""
    gen = torch.Generator().manual_seed(0)
    full = R.TableState.empty(128, 8, torch.device("cpu"))
    meta = R.TableState.empty(128, 8, torch.device("cpu"))
    meta.values = torch.empty(0, 8)  # a directory holds no rows
    for step in range(1, 30):
        keys = torch.unique(torch.randint(0, 400, (40,), generator=gen))
        found = R.find(full, keys, True, step)
        assert torch.equal(found, R.find(meta, keys, True, step))
        new = keys[found < 0]
        b = R.bucket_of(new, full.num_buckets)
        order = torch.argsort(b, stable=True)
        seg_b, counts = torch.unique_consecutive(b[order], return_counts=True)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        scores = torch.randint(0, 50, (new.numel(),), generator=gen)
        args = (new[order], offsets, seg_b, scores[order], step)
        s1, e1 = R.insert(full, *args, 6, 3, (1, 0.0, 1.0, 0.0, 0.0))
        s2, e2 = R.insert_keys(meta, *args)
        assert torch.equal(s1, s2) and int(e1) == int(e2)
        for name in ("keys", "scores", "touched"):
            assert torch.equal(getattr(full, name), getattr(meta, name)), name
        ok = s1 >= 0
        want = R.init_rows(new[order][ok], 6, 3, (1, 0.0, 1.0, 0.0, 0.0))
        assert torch.equal(full.values[s1[ok], :6], want)
    assert int(e1) >= 0 and R.size(full) == 128  # the table filled and evicted
