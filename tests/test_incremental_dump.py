"""Incremental dumps of dynamic tables: a full dump plus the chain of increments equals the full
dump at the end (rows inserted, trained, rescored, evicted and erased in between)."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    apply_collection_increment,
    apply_increment,
    concat_dumps,
    make_dynamic_table,
)

ROWS = ("keys", "values", "optimizer_state", "scores")


def _table(
    policy: str = "lru", optimizer: str = "adam", capacity: int = 64, device: str = "cpu", **kw
):
    cfg = DynamicEmbeddingConfig(
        name="t",
        embedding_dim=8,
        capacity=capacity,
        feature_names=["f"],
        optimizer=optimizer,
        eviction_policy=policy,
        learning_rate=0.1,
        **kw,
    )
    return make_dynamic_table(cfg, device)


def _train(table: DynamicEmbeddingTable, gen: torch.Generator, steps: int, vocab: int) -> None:
    table.train()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (24,), generator=gen).to(table.device)
        table(ids).square().sum().backward()


def _assert_same(a: dict, b: dict) -> None:
    for k in (*ROWS, "step"):
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "policy,device,storage",
    [
        ("lru", "cpu", "hbm"),
        ("lfu", "cpu", "hbm"),
        # rows in host memory, a 32-row cache: rows changed in either tier
        ("lru", "cpu", "hybrid"),
        ("lfu", "cpu", "hybrid"),
        pytest.param("lru", "cuda", "hbm", marks=pytest.mark.gpu),
        pytest.param("lru", "cuda", "hybrid", marks=pytest.mark.gpu),
    ],
)
def test_full_dump_plus_increments_equals_full_dump(policy, device, storage):
    gen = torch.Generator().manual_seed(0)
    # 64 slots, 200 ids: evictions all along
    table = _table(policy, device=device, storage=storage, hbm_cache=0.5)
    _train(table, gen, 4, vocab=200)
    chain = [table.dump(mark=1)]
    for token in (2, 3, 4):
        _train(table, gen, 3, vocab=200)
        if token == 3:  # changes outside training: an erase and a rescore
            present = chain[0]["keys"][:3]
            table.erase(present[:1])
            table.set_scores(present[1:], torch.tensor([10**6, 10**6]))
        chain.append(table.dump(since=token - 1, mark=token))
    increments = chain[1:]
    assert all(inc["keys"].numel() < table.size() for inc in increments)  # only what changed
    assert sum(inc["deleted_keys"].numel() for inc in increments) > 0  # evictions were seen
    merged = chain[0]
    for inc in increments:
        merged = apply_increment(merged, inc)
    _assert_same(merged, table.dump())
    # the merged dump loads like a full one
    fresh = _table(policy, device=device, storage=storage)
    fresh.load(merged)
    _assert_same(fresh.dump(), table.dump())


def test_untouched_rows_are_not_in_the_increment():
    gen = torch.Generator().manual_seed(1)
    table = _table(capacity=256)
    _train(table, gen, 2, vocab=50)
    table.dump(mark=7)
    table.train()
    table(torch.tensor([3, 4])).sum().backward()
    inc = table.dump(since=7)
    assert sorted(inc["keys"].tolist()) == [3, 4]
    assert inc["deleted_keys"].numel() == 0
    table.eval()
    table(torch.tensor([5, 6]))  # evaluation changes nothing
    assert sorted(table.dump(since=7)["keys"].tolist()) == [3, 4]


def test_errors_name_the_problem():
    table = _table()
    _train(table, torch.Generator().manual_seed(2), 1, vocab=20)
    with pytest.raises(ValueError, match="names no marked dump"):
        table.dump(since=1)
    full = table.dump(mark=1)
    inc = table.dump(since=1, mark=2)
    with pytest.raises(ValueError, match="incremental dump"):
        _table().load(inc)
    with pytest.raises(ValueError, match="continues dump token 1"):
        apply_increment(inc, inc)
    with pytest.raises(ValueError, match="not incremental"):
        apply_increment(full, full)
    # loading replaces the contents: earlier marks no longer describe the table
    table.load(full)
    with pytest.raises(ValueError, match="names no marked dump"):
        table.dump(since=2)


def test_collection_chain_and_per_rank_merge():
    """Collection-level tokens; increments of two shard-like tables merge like full dumps."""
    gen = torch.Generator().manual_seed(3)
    configs = [
        DynamicEmbeddingConfig(
            name=n, embedding_dim=4, capacity=64, feature_names=[f], optimizer="rowwise_adagrad"
        )
        for n, f in (("a", "fa"), ("b", "fb"))
    ]
    coll = DynamicEmbeddingCollection(configs, "cpu")
    coll.train()

    def step():
        ids = torch.randint(0, 150, (20,), generator=gen)
        kjt = KeyedJaggedTensor(keys=["fa", "fb"], values=ids, lengths=torch.full((4,), 5))
        out = coll(kjt)
        (out["fa"].values().sum() + out["fb"].values().square().sum()).backward()

    step()
    base = coll.dump(mark=True)
    assert int(base["a/token"]) == 1
    chain = []
    for _ in range(2):
        step()
        step()
        chain.append(coll.dump(since=int(chain[-1]["a/token"]) if chain else 1, mark=True))
    merged = apply_collection_increment(base, chain)
    end = coll.dump()
    for key in end:
        assert torch.equal(merged[key], end[key]), key
    # an increment split by key parity (as two ranks would dump it) merges back
    inc = {k.split("/", 1)[1]: v for k, v in chain[0].items() if k.startswith("a/")}
    parts = []
    for r in (0, 1):
        keep = inc["keys"] % 2 == r
        gone = inc["deleted_keys"] % 2 == r
        part = {k: inc[k][keep] for k in ROWS}
        part.update({k: inc[k] for k in ("step", "embedding_dim", "optimizer", "token", "since")})
        part["deleted_keys"] = inc["deleted_keys"][gone]
        parts.append(part)
    rejoined = concat_dumps(parts)
    for k in (*ROWS, "deleted_keys", "token", "since"):
        assert torch.equal(rejoined[k], inc[k]), k
