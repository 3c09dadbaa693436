"""Hybrid dynamic tables (rows in host memory, hot rows cached in HBM) give exactly what the
all-HBM table gives: same embeddings, losses, rows, optimizer state, scores, stats and dumps,
with the cache far smaller than the working set (rows evicted from the cache and written back to
the host tier at every step), for every sparse optimizer and eviction policy; sharded over ranks;
and the CUDA table (mapped host memory, side-stream write-backs) against the all-HBM CUDA table.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.config.args import EmbeddingArgs
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    apply_increment,
    concat_dumps,
    make_dynamic_table,
)
from hstu.embeddings.hybrid_table import HybridDynamicEmbeddingTable

OPTIMIZERS = ["sgd", "adam", "adagrad", "rowwise_adagrad"]
ROWS = ("keys", "values", "optimizer_state", "scores", "step", "embedding_dim", "optimizer")


def config(**kw) -> DynamicEmbeddingConfig:
    base = dict(
        name="t",
        embedding_dim=6,
        capacity=256,
        feature_names=["f"],
        optimizer="adam",
        learning_rate=0.05,
        weight_decay=0.01,
    )
    base.update(kw)
    return DynamicEmbeddingConfig(**base)


def pair(device: str = "cpu", cache: float | int = 0.25, **kw):
    """An all-HBM table and its hybrid twin (same config but the storage)."""
    hbm = DynamicEmbeddingTable(config(**kw), device)
    hybrid = make_dynamic_table(config(storage="hybrid", hbm_cache=cache, **kw), device)
    assert isinstance(hybrid, HybridDynamicEmbeddingTable)
    return hbm, hybrid


def assert_same_dumps(a: dict, b: dict, keys=None) -> None:
    if keys is None:
        assert set(a) == set(b)
    for k in keys or a:
        assert torch.equal(a[k], b[k]), k


def train_both(hbm, hybrid, steps, gen, vocab=600, batch=60, eval_every=7, policy="lru"):
    """Trains both tables on the same ids; outputs and losses must be bit-equal at every step.
    Returns the hybrid table's write-backs per training step."""
    dev = hbm.device
    writebacks = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch,), generator=gen)
        coef = torch.randn(batch, hbm.dim, generator=gen).to(dev)
        if step % eval_every == eval_every - 1:
            hbm.eval(), hybrid.eval()
            with torch.no_grad():
                assert torch.equal(hbm(ids.to(dev)), hybrid(ids.to(dev)))
            hbm.train(), hybrid.train()
            continue
        scores = torch.randint(0, 1000, (batch,), generator=gen) if policy == "custom" else None
        before = hybrid.stats()["cache_writebacks"]
        losses = []
        for t in (hbm, hybrid):
            out = t(ids.to(dev), None if scores is None else scores.to(dev), host_ids=ids)
            loss = (out * coef).square().sum()
            loss.backward()
            losses.append((out.detach(), loss.detach()))
        assert torch.equal(losses[0][0], losses[1][0]), step
        assert torch.equal(losses[0][1], losses[1][1]), step
        writebacks.append(hybrid.stats()["cache_writebacks"] - before)
    return writebacks


def assert_same_tables(hbm, hybrid) -> None:
    assert_same_dumps(hbm.dump(), hybrid.dump())
    sa, sb = hbm.stats(), hybrid.stats()
    for k, v in sa.items():
        assert sb[k] == v, (k, v, sb[k])


# ---- CPU development mode: the reference backend as the device tier --------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu", "custom"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_hybrid_equals_hbm_with_evictions_every_step(opt, policy):
    # 256 slots for 600 ids (the table evicts) and a cache of 64 rows for ~57 distinct ids per
    # batch: nearly every row is fetched from the host tier and written back at every step
    hbm, hybrid = pair(cache=0.25, optimizer=opt, eviction_policy=policy)
    assert hybrid.cache_rows == 64
    gen = torch.Generator().manual_seed(0)
    writebacks = train_both(hbm, hybrid, 24, gen, policy=policy)
    assert min(writebacks[1:]) > 0  # the cache wrote rows back at every step after the first
    assert_same_tables(hbm, hybrid)
    s = hybrid.stats()
    assert s["evictions"] > 0 and s["cache_fetches"] > 0 and s["cache_hit_rate"] < 0.5


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hybrid_equals_hbm_when_every_id_is_held_and_rows_come_from_the_host(policy, monkeypatch):
    """The steady state of a large table: the directory holds every id (no inserts) and the
    cache a part of them, so lookups fetch rows from the host tier and background evictions
    write rows back. The host's bound on the free rows (reads of the free count queued without
    waiting) keeps room ahead: no lookup has to read the free count and wait for it."""
    hbm, hybrid = pair(cache=0.25, capacity=2048, eviction_policy=policy)
    assert hybrid.cache_rows == 512
    for t in (hbm, hybrid):
        for chunk in torch.arange(600).split(100):
            with torch.no_grad():
                t(chunk.to(t.device), host_ids=chunk)
    inserted = hybrid.stats()["inserts"]
    waits = []
    real = HybridDynamicEmbeddingTable._reserve

    def reserve(table, n):  # the lookups that found the host's bound too low
        before = table.free_lb
        real(table, n)
        waits.append(before < n)

    monkeypatch.setattr(HybridDynamicEmbeddingTable, "_reserve", reserve)
    gen = torch.Generator().manual_seed(1)
    writebacks = train_both(hbm, hybrid, 16, gen, batch=120)
    assert len(waits) == 14 and not any(waits)
    assert sum(writebacks) > 0
    assert_same_tables(hbm, hybrid)
    s = hybrid.stats()
    assert s["inserts"] == inserted and s["cache_fetches"] > 0 and s["cache_writebacks"] > 0
    assert 0 <= hybrid.free_lb <= hybrid.n_free


def test_lookups_awaiting_backward_keep_their_rows():
    """Two training lookups, then one backward (gradient accumulation): the cache must not drop
    the first lookup's rows while the second one brings in its own."""
    hbm, hybrid = pair(cache=0.5, optimizer="adagrad")
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        a = torch.randint(0, 500, (50,), generator=gen)
        b = torch.randint(0, 500, (50,), generator=gen)
        losses = [t(a).sum() + t(b).square().sum() for t in (hbm, hybrid)]
        assert torch.equal(losses[0], losses[1])
        for loss in losses:
            loss.backward()
    assert_same_tables(hbm, hybrid)
    assert hybrid._pending == []


def test_no_grad_training_lookups_erase_and_rescore_match():
    hbm, hybrid = pair(cache=0.25, optimizer="rowwise_adagrad", eviction_policy="lfu")
    gen = torch.Generator().manual_seed(2)
    train_both(hbm, hybrid, 6, gen)
    for t in (hbm, hybrid):
        with torch.no_grad():  # training mode, no backward: inserts and touches, no update
            t(torch.arange(1000, 1040))
    keys = hbm.dump()["keys"]
    assert hbm.erase(keys[:7]) == hybrid.erase(keys[:7]) == 7
    for t in (hbm, hybrid):
        t.set_scores(keys[7:12], torch.full((5,), 10**6))
    train_both(hbm, hybrid, 6, gen)
    assert_same_tables(hbm, hybrid)


def test_dump_load_and_incremental_dumps_cover_both_tiers():
    """A hybrid table's dump equals the all-HBM table's (cached and host rows alike); dumps
    load either way; increments equal the all-HBM table's."""
    hbm, hybrid = pair(cache=0.25, eviction_policy="lru")
    gen = torch.Generator().manual_seed(3)
    train_both(hbm, hybrid, 5, gen)
    bases = hbm.dump(mark=1), hybrid.dump(mark=1)
    assert_same_dumps(*bases)
    train_both(hbm, hybrid, 5, gen)
    incs = hbm.dump(since=1, mark=2), hybrid.dump(since=1, mark=2)
    assert_same_dumps(*incs)
    assert incs[1]["deleted_keys"].numel() > 0
    assert_same_dumps(apply_increment(bases[1], incs[1]), hybrid.dump(), ROWS)
    # in the middle of training, rows are spread over the cache and the host tier
    cached = int((hybrid.slot_row >= 0).sum())
    assert 0 < cached < hybrid.size()
    # cross loads, then the same training continues identically
    hbm2, hybrid2 = pair(cache=0.25, eviction_policy="lru")
    hbm2.load(hybrid.dump())
    hybrid2.load(hbm.dump())
    assert_same_dumps(hbm2.dump(), hybrid.dump())
    assert_same_dumps(hybrid2.dump(), hbm.dump())
    assert int((hybrid2.slot_row >= 0).sum()) == 0  # a load fills the host tier only
    for tables in ((hbm, hybrid), (hbm2, hybrid2)):
        train_both(*tables, 6, torch.Generator().manual_seed(4))
    assert_same_dumps(hbm.dump(), hybrid2.dump())
    assert_same_dumps(hbm2.dump(), hybrid.dump())


def test_large_loads_place_keys_in_chunks_of_whole_buckets(monkeypatch):
    """A load places many keys at once; the directory takes them in chunks of whole buckets
    (here 40 keys a chunk instead of 2^20), with the same result as in one piece."""
    import hstu.embeddings.hybrid_table as H

    hbm, hybrid = pair(cache=0.25, capacity=1024)
    train_both(hbm, hybrid, 10, torch.Generator().manual_seed(7), vocab=3000, batch=60)
    monkeypatch.setattr(H, "_PLACE_CHUNK", 40)
    chunked = make_dynamic_table(config(capacity=512, storage="hybrid", hbm_cache=0.25))
    whole = DynamicEmbeddingTable(config(capacity=512))
    for t in (chunked, whole):
        t.load(hybrid.dump())  # ~540 rows into 512 slots: some do not fit
    assert_same_dumps(chunked.dump(), whole.dump())
    assert whole.size() < hybrid.size()


def test_dumps_move_between_rank_counts():
    hbm, hybrid = pair(cache=0.25, capacity=2048)
    train_both(hbm, hybrid, 6, torch.Generator().manual_seed(5))
    shards = [
        make_dynamic_table(config(capacity=2048, storage="hybrid"), world_size=3, rank=r)
        for r in range(3)
    ]
    for s in shards:
        s.load(hybrid.dump())
    assert_same_dumps(concat_dumps([s.dump() for s in shards]), hbm.dump())


def test_collection_builds_hybrid_tables_and_matches():
    def coll(storage):
        return DynamicEmbeddingCollection(
            [
                config(name="items", feature_names=["item"], storage=storage, hbm_cache=0.3),
                config(name="users", embedding_dim=4, feature_names=["user"], storage=storage),
            ]
        )

    a, b = coll("hbm"), coll("hybrid")
    assert isinstance(b.tables["items"], HybridDynamicEmbeddingTable)
    gen = torch.Generator().manual_seed(6)
    for _ in range(8):
        ids = torch.randint(0, 400, (70,), generator=gen)
        kjt = KeyedJaggedTensor(keys=["item", "user"], values=ids, lengths=torch.tensor([50, 20]))
        losses = [sum(jt.values().square().sum() for jt in m(kjt).values()) for m in (a, b)]
        assert torch.equal(losses[0], losses[1])
        for loss in losses:
            loss.backward()
    assert_same_dumps(a.dump(), b.dump())
    assert b.stats()["items/cache_rows"] == b.tables["items"].cache_rows


def test_cache_smaller_than_a_batch_is_a_clear_error():
    table = make_dynamic_table(config(capacity=4096, storage="hybrid", hbm_cache=0.01))
    assert table.cache_rows == 64
    with pytest.raises(
        ValueError,
        match=r"HBM cache of 64 rows is too small: this lookup needs room for its 100 distinct ids but only 64 rows.*hbm_cache",
    ):
        table(torch.arange(100)).sum().backward()


def test_cache_size_settings():
    c = config(capacity=10_000, storage="hybrid", hbm_cache=0.1)
    assert c.cache_rows(c.num_slots) == 1024  # 10% of 10,016 slots, in whole buckets
    # bytes: rows of 12 floats (6 + Adam's 13 state columns -> 20 floats) + 16 B each
    c = config(capacity=10_000, storage="hybrid", hbm_cache=104 * 100)  # 80 B row + 24 B
    assert c.row_width == 20 and c.cache_rows(c.num_slots) == 96
    assert config(storage="hybrid", hbm_cache=1.0).cache_rows(256) == 256
    assert config(storage="hybrid", hbm_cache=10**12).cache_rows(256) == 256  # at most all
    with pytest.raises(ValueError, match=r"DynamicEmbeddingConfig\(name='t'\)\.storage='ssd'"):
        config(storage="ssd")
    with pytest.raises(ValueError, match=r"\.hbm_cache=0 is not a cache size"):
        config(hbm_cache=0)


@pytest.mark.parametrize(
    "kw, error, needle",
    [
        (
            dict(storage="hybrid"),
            ValueError,
            "EmbeddingArgs.storage='hybrid' applies to dynamic tables, but "
            "EmbeddingArgs.embedding_backend='torchrec'; set "
            "EmbeddingArgs.embedding_backend='dynamic'",
        ),
        (dict(storage="disk"), ValueError, "EmbeddingArgs.storage='disk' is not supported"),
        (dict(hbm_cache=1), ValueError, "EmbeddingArgs.hbm_cache=1 is not a cache size"),
        (dict(hbm_cache=1.5), ValueError, "EmbeddingArgs.hbm_cache=1.5 is not a cache size"),
        (dict(hbm_cache=-0.1), ValueError, "EmbeddingArgs.hbm_cache=-0.1 is not a cache size"),
        (dict(hbm_cache="8GB"), TypeError, "EmbeddingArgs.hbm_cache='8GB' must be a number"),
    ],
)
def test_embedding_args_name_the_binding(kw, error, needle, clean_gin):
    with pytest.raises(error) as info:
        EmbeddingArgs(**kw)
    assert needle in str(info.value)


def test_embedding_args_cache_forms(clean_gin):
    args = EmbeddingArgs(embedding_backend="dynamic", storage="hybrid", hbm_cache=8e9)
    assert args.hbm_cache == 8_000_000_000 and isinstance(args.hbm_cache, int)
    assert EmbeddingArgs(hbm_cache=1.0).hbm_cache == 1.0
    assert EmbeddingArgs(hbm_cache=2**33).hbm_cache == 2**33


# ---- sharded over ranks (2 gloo processes, DistributedModelParallel) --------------------------


def _shard_configs(storage: str) -> list[DynamicEmbeddingConfig]:
    return [
        config(name="items", feature_names=["item"], capacity=512, storage=storage, hbm_cache=0.3),
        config(name="users", embedding_dim=4, capacity=256, feature_names=["user"],
               optimizer="rowwise_adagrad", eviction_policy="lfu", storage=storage,
               hbm_cache=0.75),
    ]  # fmt: skip


class _Model(torch.nn.Module):
    def __init__(self, storage: str) -> None:
        super().__init__()
        self.dyn = DynamicEmbeddingCollection(_shard_configs(storage), "meta")
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        out = self.dyn(kjt)
        return out["item"].values().square().sum() + self.lin(out["user"].values()).sum()


def _worker(rank: int, port: int, path: str, storage: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same dense weights in both runs
    from torchrec.distributed import DistributedModelParallel

    from hstu.embeddings.sharding import DynamicEmbeddingSharder

    dmp = DistributedModelParallel(
        _Model(storage), device=torch.device("cpu"), sharders=[DynamicEmbeddingSharder()]
    )
    dyn = dmp.module.dyn
    types = {n: type(t).__name__ for n, t in dyn.tables.items()}
    for step in range(10):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(0, 700, (90,), generator=g)
        kjt = KeyedJaggedTensor(keys=["item", "user"], values=ids, lengths=torch.tensor([60, 30]))
        dmp(kjt).backward()
    torch.save({"dump": dyn.dump(), "types": types}, os.path.join(path, f"{storage}{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_rank_shard_is_hybrid_and_matches_hbm_shards(tmp_path):
    for storage in ("hbm", "hybrid"):
        mp.spawn(_worker, args=(_free_port(), str(tmp_path), storage), nprocs=2, join=True)
    for rank in range(2):
        hbm = torch.load(tmp_path / f"hbm{rank}.pt")
        hybrid = torch.load(tmp_path / f"hybrid{rank}.pt")
        assert set(hybrid["types"].values()) == {"HybridDynamicEmbeddingTable"}
        assert set(hbm["types"].values()) == {"DynamicEmbeddingTable"}
        assert_same_dumps(hbm["dump"], hybrid["dump"])


# ---- the benchmark, tiny, on the CPU -----------------------------------------------------------


def test_bench_embedding_hybrid_runs_on_cpu(load_script, tmp_path):
    bench = load_script("bench_embedding")
    out = tmp_path / "rows.jsonl"
    argv = ["--hybrid", "--device", "cpu", "--rows", "4096", "--dim", "8", "--ids", "256"]
    argv += ["--cache", "0.25", "--steps", "2", "--warmup", "1", "--out", str(out)]
    bench.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_impl = {r["impl"]: r for r in rows if r["bench"] == "hybrid_train_step"}
    assert set(by_impl) == {"hbm", "hybrid"}
    hyb = by_impl["hybrid"]
    assert hyb["rows"] == 4096 and hyb["ids"] == 256 and hyb["cache_rows"] == 1024
    assert 0.0 <= hyb["cache_hit_rate"] <= 1.0 and hyb["ms"] > 0 and hyb["steps"] == 2
    ratio = [r for r in rows if r["bench"] == "hybrid_over_hbm"][0]
    assert ratio["hybrid_over_hbm"] == pytest.approx(hyb["ms"] / by_impl["hbm"]["ms"])
    assert ratio["same_losses"] is True


# ---- CUDA: mapped host memory, side-stream write-backs ---------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_cuda_hybrid_equals_cuda_hbm_table(opt, policy):
    hbm, hybrid = pair("cuda", cache=0.25, optimizer=opt, eviction_policy=policy)
    assert hybrid.host.mapped, "host tier not mapped into the GPU's address space"
    gen = torch.Generator().manual_seed(0)
    writebacks = train_both(hbm, hybrid, 30, gen)
    assert min(writebacks[1:]) > 0
    assert_same_tables(hbm, hybrid)


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_cuda_hybrid_without_mapped_host_memory_still_matches(monkeypatch):
    """Where host memory cannot be mapped for the GPU, rows go through the CPU: same results."""
    from hstu.embeddings.hybrid_table import HostRows

    monkeypatch.setattr(HostRows, "_map", lambda self: None)
    hbm, hybrid = pair("cuda", cache=0.25, optimizer="rowwise_adagrad", eviction_policy="lfu")
    assert not hybrid.host.mapped
    writebacks = train_both(hbm, hybrid, 16, torch.Generator().manual_seed(3))
    assert min(writebacks[1:]) > 0
    assert_same_tables(hbm, hybrid)


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_cuda_hybrid_large_batches_dump_load_and_increments():
    """Thousands of ids per step through a cache of a fifth of them; dumps and increments equal
    the all-HBM table's; a dump of one loads into the other and training goes on identically."""
    hbm, hybrid = pair("cuda", cache=0.2, capacity=40_000, embedding_dim=64, optimizer="adam")
    gen = torch.Generator().manual_seed(1)
    train_both(hbm, hybrid, 12, gen, vocab=60_000, batch=4000)
    base = hybrid.dump(mark=1)
    assert_same_dumps(hbm.dump(mark=1), base)
    train_both(hbm, hybrid, 8, gen, vocab=60_000, batch=4000)
    inc = hybrid.dump(since=1, mark=2)
    assert_same_dumps(hbm.dump(since=1, mark=2), inc)
    assert_same_dumps(apply_increment(base, inc), hbm.dump(), ROWS)
    hbm2, hybrid2 = pair("cuda", cache=0.2, capacity=40_000, embedding_dim=64, optimizer="adam")
    hbm2.load(hybrid.dump())
    hybrid2.load(hbm.dump())
    train_both(hbm2, hybrid2, 6, torch.Generator().manual_seed(2), vocab=60_000, batch=4000)
    assert_same_tables(hbm2, hybrid2)
    assert hybrid2.stats()["cache_writebacks"] > 0


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_copy_rows_kernel_matches_reference_on_device_and_mapped_host_rows():
    """The masked row copy (the hybrid tables' fetch and write-back) against its PyTorch twin:
    pairs with -1 or out-of-range indices are skipped, whether the source or the destination is
    device memory or page-locked host memory mapped for the GPU."""
    from hstu.embeddings import cuda_table
    from hstu.embeddings import reference_table as R
    from hstu.embeddings.hybrid_table import HostRows

    gen = torch.Generator().manual_seed(0)
    host = HostRows(300, 12, torch.device("cuda"), cuda_table.copy_rows)
    assert host.mapped
    host.rows.copy_(torch.randn(300, 12, generator=gen))
    mapped = host.view.view(torch.float32)
    for src_on_host in (True, False):
        dst = torch.randn(200, 12, generator=gen).cuda()
        src = mapped if src_on_host else torch.randn(300, 12, generator=gen).cuda()
        dst_idx = torch.randperm(200, generator=gen)[:150]
        src_idx = torch.randint(0, 300, (150,), generator=gen)
        dst_idx[::7] = -1
        src_idx[::5] = -1
        dst_idx[3], src_idx[4] = 200, 300  # out of range: skipped as well
        want = dst.clone()
        R.copy_rows(want, dst_idx.cuda(), src, src_idx.cuda())
        cuda_table.copy_rows(dst, dst_idx.cuda(), src, src_idx.cuda())
        assert torch.equal(dst, want)
    # into mapped host memory (the write-back)
    rows = torch.randn(40, 12, generator=gen).cuda()
    slots = torch.randperm(300, generator=gen)[:40]
    slots[::3] = -1
    want = host.rows.clone()
    keep = slots >= 0
    want[slots[keep]] = rows.cpu()[keep]
    cuda_table.copy_rows(mapped, slots.cuda(), rows, torch.arange(40, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(host.rows, want)
    with pytest.raises(ValueError, match="dst rows have 12 floats, src rows 8"):
        cuda_table.copy_rows(dst, dst_idx.cuda(), src[:, :8].contiguous(), src_idx.cuda())


def _placement_case(gen, init):
    """A cache of 64 rows (30 holding slots) over 200 slots, and a lookup of 48 unique ids:
    hits, rows to fetch, fresh keys in slots with and without a cached row, overflows."""
    from hstu.embeddings import reference_table as R

    rows, slots_n, width, dim = 64, 200, 8, 5
    cache = torch.randn(rows, width, generator=gen)
    host = torch.randn(slots_n, width, generator=gen)
    held = torch.randperm(slots_n, generator=gen)[:30]
    held_rows = torch.randperm(rows, generator=gen)[:30]
    slot_row = torch.full((slots_n + 1,), -1, dtype=torch.int32)
    slot_row[held] = held_rows.int()
    row_keys = torch.full((rows + 1,), R.EMPTY_KEY)
    cache_slot = torch.full((rows + 1,), -1)
    row_keys[held_rows] = held * 10
    cache_slot[held_rows] = held
    free = torch.zeros(rows + 1, dtype=torch.int64)
    unused = torch.tensor(sorted(set(range(rows)) - set(held_rows.tolist())))
    free[: unused.numel()] = unused
    n_free = torch.tensor(unused.numel())
    slots = torch.cat([held[:12], torch.randperm(slots_n, generator=gen)[:36]])
    slots = torch.unique(slots)[:48]
    slots[::9] = -1
    miss = torch.zeros(slots.numel(), dtype=torch.bool)
    miss[::4] = True  # some in held slots (stale row reused), some not
    # a key found in its slot is the one the slot holds (slot x 10 here); fresh keys are new
    uniq = torch.where(miss, torch.randint(0, 2**40, (slots.numel(),), generator=gen), slots * 10)
    counters = torch.zeros(4, dtype=torch.int64)
    return [
        cache,
        row_keys,
        cache_slot,
        slot_row,
        free,
        n_free,
        host,
        slots,
        miss,
        uniq,
        dim,
        3,
        init,
        counters,
    ]


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
@pytest.mark.parametrize(
    "init",
    [
        (0, -0.5, 0.25, 0.0, 0.0),
        (1, 0.1, 2.0, 0.0, 0.0),
        (2, 0.0, 1.0, -2.0, 2.0),
        (3, 0.7, 0.0, 0.0, 0.0),
    ],
)
def test_place_rows_kernel_matches_reference(init):
    """The cache placement of a hybrid table's training lookup (one kernel) against its PyTorch
    twin: the same rows fetched, initialised (every initializer) or kept, the same bookkeeping;
    only which free row an id gets may differ."""
    from hstu.embeddings import cuda_table
    from hstu.embeddings import reference_table as R

    ref = _placement_case(torch.Generator().manual_seed(6), init)
    dev = [x.cuda() if isinstance(x, torch.Tensor) else x for x in ref]
    slot_row_before = ref[3].clone()
    rows_ref = R.place_rows(*ref)
    rows_dev = cuda_table.place_rows(*dev).cpu()
    cache, row_keys, cache_slot, slot_row, free, n_free, _, slots, miss, uniq = ref[:10]
    dcache, drow_keys, dcache_slot, dslot_row, dfree, dn_free = (x.cpu() for x in dev[:6])
    assert torch.equal(rows_dev < 0, rows_ref < 0) and torch.equal(rows_ref < 0, slots < 0)
    live = slots >= 0
    assert live.sum() > 30 and (miss & live).sum() > 5
    torch.testing.assert_close(dcache[rows_dev[live]], cache[rows_ref[live]], atol=1e-6, rtol=0)
    for keys, slot_of, row_of, got in (
        (row_keys, cache_slot, slot_row, rows_ref),
        (drow_keys, dcache_slot, dslot_row, rows_dev),
    ):
        assert torch.equal(keys[got[live]], uniq[live])
        assert torch.equal(slot_of[got[live]], slots[live])
        assert torch.equal(row_of[slots[live]].long(), got[live])
    assert int(dn_free) == int(n_free)
    assert set(dfree[: int(n_free)].tolist()) == set(free[: int(n_free)].tolist())
    assert torch.equal(dev[13].cpu(), ref[13])
    hits = live & ~miss & (slot_row_before[slots.clamp(min=0)] >= 0)
    assert int(ref[13][2]) == int(hits.sum()) and int(ref[13][3]) == int(live.sum())


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_keys_only_insert_matches_reference_directory():
    """The compiled insert on a table without rows (a hybrid table's directory) places the keys
    exactly where the reference does, evictions included."""
    from hstu.embeddings import cuda_table
    from hstu.embeddings import reference_table as R

    gen = torch.Generator().manual_seed(2)
    dev_state = R.TableState.empty(256, 8, torch.device("cuda"))
    dev_state.values = dev_state.values[:0]
    ref_state = R.TableState.empty(256, 8, torch.device("cpu"))
    ref_state.values = ref_state.values[:0]
    for step in range(1, 30):
        keys = torch.unique(torch.randint(0, 5000, (60,), generator=gen))
        bucket = R.bucket_of(keys, 8)
        order = torch.argsort(bucket, stable=True)
        keys, bucket = keys[order], bucket[order]
        segs, counts = torch.unique_consecutive(bucket, return_counts=True)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        scores = torch.randint(0, 100, keys.shape, generator=gen)
        want, ev_want = R.insert(
            ref_state, keys, offsets, segs, scores, step, 4, 0, (0, -1, 1, 0, 0)
        )
        got, ev_got = cuda_table.insert(
            dev_state,
            keys.cuda(),
            offsets.cuda(),
            segs.cuda(),
            scores.cuda(),
            step,
            4,
            0,
            (0, -1.0, 1.0, 0.0, 0.0),
        )
        assert torch.equal(got.cpu(), want) and int(ev_got) == int(ev_want)
    assert torch.equal(dev_state.keys.cpu(), ref_state.keys)
    assert torch.equal(dev_state.scores.cpu(), ref_state.scores)


@pytest.mark.gpu
@pytest.mark.usefixtures("dynamic_embedding_kernels")
def test_cuda_hybrid_training_step_does_not_wait_for_the_gpu():
    """Once the cache has room ahead, a training step (lookup with inserts and fetches from the
    host tier, backward with the fused update, background evictions) makes no blocking read of
    the GPU (``torch.cuda.set_sync_debug_mode('error')``), and gives the all-HBM table's rows."""
    hbm, hybrid = pair(
        "cuda", cache=0.25, capacity=40_000, embedding_dim=32, optimizer="rowwise_adagrad"
    )
    assert hybrid.host.mapped
    gen = torch.Generator().manual_seed(4)
    train_both(hbm, hybrid, 6, gen, vocab=60_000, batch=1000)
    writebacks = hybrid.stats()["cache_writebacks"]
    batches = [torch.randint(0, 60_000, (1000,), generator=gen) for _ in range(16)]
    pinned = [b.pin_memory() for b in batches]
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in pinned:
            out = hybrid(ids.cuda(non_blocking=True), host_ids=ids)
            out.square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    for ids in batches:
        hbm(ids.cuda(), host_ids=ids).square().sum().backward()
    assert hybrid.stats()["cache_writebacks"] > writebacks  # evictions ran in the background
    assert_same_tables(hbm, hybrid)
