"""GPU tests: the CUDA kernels against the pure-PyTorch reference over long random sequences."""

from __future__ import annotations

import pytest
import torch

from hstu.embeddings import cuda_table
from hstu.embeddings import reference_table as R
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import DynamicEmbeddingCollection, DynamicEmbeddingTable

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("dynamic_embedding_kernels")]

DEV = torch.device("cuda")


def cfg(**kw) -> DynamicEmbeddingConfig:
    base = dict(name="t", embedding_dim=16, capacity=256, feature_names=["f"], optimizer="adam")
    base.update(kw)
    return DynamicEmbeddingConfig(**base)


def pair(c: DynamicEmbeddingConfig) -> tuple[DynamicEmbeddingTable, DynamicEmbeddingTable]:
    return DynamicEmbeddingTable(c, DEV), DynamicEmbeddingTable(c, "cpu")


def assert_same_tables(
    a: DynamicEmbeddingTable, b: DynamicEmbeddingTable, atol=2e-5, counters=True
) -> None:
    da, db = a.dump(), b.dump()
    for k in ("keys", "scores", "step", "embedding_dim", "optimizer"):
        assert torch.equal(da[k], db[k]), k
    torch.testing.assert_close(da["values"], db["values"], atol=atol, rtol=1e-4)
    torch.testing.assert_close(da["optimizer_state"], db["optimizer_state"], atol=atol, rtol=1e-4)
    sa, sb = a.stats(), b.stats()
    for k in ("rows", "inserts", "evictions", "overflows", "lookups", "hit_rate")[
        : 6 if counters else 1
    ]:
        assert sa[k] == sb[k], (k, sa[k], sb[k])


def run_sequence(c, steps=40, batch=300, hi=2000, seed=0, eval_every=7):
    kt, rt = pair(c)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        n = 0 if step % 11 == 5 else int(torch.randint(1, batch, (1,), generator=g))
        ids = torch.randint(-hi, hi, (n,), generator=g)
        ids[: n // 3] = ids[n // 3 : 2 * (n // 3)]  # plenty of duplicates
        if step % eval_every == 6:
            kt.eval(), rt.eval()
            with torch.no_grad():
                torch.testing.assert_close(kt(ids.to(DEV)).cpu(), rt(ids), atol=2e-5, rtol=1e-4)
            kt.train(), rt.train()
            continue
        coef = torch.randn(n, c.embedding_dim, generator=g)
        ok, orf = kt(ids.to(DEV)), rt(ids)
        torch.testing.assert_close(ok.detach().cpu(), orf.detach(), atol=2e-5, rtol=1e-4)
        (ok * coef.to(DEV)).sum().backward()
        (orf * coef).sum().backward()
    assert_same_tables(kt, rt)
    return kt, rt


@pytest.mark.parametrize("opt", ["sgd", "adam", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_kernel_matches_reference_long_sequence(opt, policy):
    kt, _ = run_sequence(cfg(optimizer=opt, eviction_policy=policy, learning_rate=0.05))
    s = kt.stats()
    assert s["evictions"] > 0 and s["occupancy"] == 1.0  # the table filled up and evicted


def test_odd_dim_weight_decay_and_initializers():
    for init, params in [
        ("normal", {"std": 0.5}),
        ("truncated_normal", {"a": -1.0, "b": 1.5}),
        ("constant", {"value": 0.25}),
        ("uniform", {"low": -0.2, "high": 0.3}),
    ]:
        c = cfg(embedding_dim=10, initializer=init, init_params=params, weight_decay=0.01, seed=3)
        run_sequence(c, steps=12)


def test_overflow_and_protection_match():
    c = cfg(capacity=32, optimizer="sgd")  # one bucket, batches larger than it
    kt, _ = run_sequence(c, steps=10, batch=80, hi=100)
    assert kt.stats()["overflows"] > 0


def test_custom_scores_and_collection():
    c = cfg(eviction_policy="custom", capacity=64, optimizer="rowwise_adagrad")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    mk = DynamicEmbeddingCollection([c], DEV)
    mr = DynamicEmbeddingCollection([c], "cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        ids = torch.randint(0, 300, (40,), generator=g)
        w = torch.randint(0, 1000, (40,), generator=g).float()
        x = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([15, 25]), weights=w)
        ok = mk(x.to(DEV))["f"].values()
        orf = mr(x)["f"].values()
        torch.testing.assert_close(ok.detach().cpu(), orf.detach(), atol=2e-5, rtol=1e-4)
        ok.sum().backward()
        orf.sum().backward()
    assert_same_tables(mk.tables["t"], mr.tables["t"])


def test_dump_load_across_backends_and_erase_export():
    c = cfg(optimizer="adam", capacity=512, eviction_policy="lfu")
    kt, rt = run_sequence(c, steps=10)
    k2 = DynamicEmbeddingTable(c, DEV)
    k2.load(rt.dump())
    assert_same_tables(k2, rt, counters=False)  # lifetime counters are not part of a dump
    r2 = DynamicEmbeddingTable(c, "cpu")
    r2.load(kt.dump())
    assert_same_tables(kt, r2, counters=False)
    keys = kt.dump()["keys"][:20]
    assert kt.erase(keys) == 20 and rt.erase(keys) == 20
    assert kt.size() == rt.size()
    assert_same_tables(kt, rt)


def test_large_insert_find_and_hash_agree():
    keys = torch.unique(torch.randint(-(2**62), 2**62, (200_000,), device=DEV))
    assert torch.equal(cuda_table.bucket_of(keys, 12345).cpu(), R.bucket_of(keys.cpu(), 12345))
    t = DynamicEmbeddingTable(cfg(capacity=1 << 19, optimizer="sgd", embedding_dim=32), DEV)
    with torch.no_grad():
        t(keys)
    assert t.size() == keys.numel()
    slots = cuda_table.find(t.state, keys)
    assert torch.all(slots >= 0) and torch.equal(t.state.keys[slots], keys)
    miss = cuda_table.find(t.state, keys + 1)
    assert int((miss >= 0).sum()) == int(torch.isin(keys + 1, keys).sum())
    want = R.init_rows(keys[:1000].cpu(), 32, 0, t.config.init_args())
    got = t.state.values[slots[:1000], :32].cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_dmp_sharder_on_cuda_one_rank_matches_unsharded():
    """DistributedModelParallel (NCCL, 1 rank) places the dynamic table with DynamicEmbeddingSharder
    next to a fused-TBE torchrec table; training matches an unsharded reference collection."""
    import os
    import socket

    import torch.distributed as dist
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hstu.embeddings.sharding import DynamicEmbeddingSharder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        c = cfg(optimizer="adam", capacity=4096, learning_rate=0.01)

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.static = EmbeddingCollection(
                    tables=[
                        EmbeddingConfig(
                            name="s", embedding_dim=16, num_embeddings=64, feature_names=["s"]
                        )
                    ],
                    device=torch.device("meta"),
                )
                self.dyn = DynamicEmbeddingCollection([c], device="meta")

            def forward(self, a, b, coef):
                return (self.dyn(b)["f"].values() * coef).sum() + self.static(a)["s"].values().sum()

        dmp = DistributedModelParallel(
            M(), device=DEV, sharders=[EmbeddingCollectionSharder(), DynamicEmbeddingSharder()]
        )
        assert type(dmp.module.dyn).__name__ == "ShardedDynamicEmbeddingCollection"
        assert dmp.plan.get_plan_for_module("dyn")["t"].sharding_type == "row_wise"
        ref = DynamicEmbeddingCollection([c], "cpu")
        g = torch.Generator().manual_seed(0)
        a = KeyedJaggedTensor(
            keys=["s"], values=torch.tensor([1, 2]), lengths=torch.tensor([2])
        ).to(DEV)
        for _ in range(6):
            ids = torch.randint(0, 500, (200,), generator=g)
            coef = torch.randn(200, 16, generator=g)
            b = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([120, 80]))
            dmp(a, b.to(DEV), coef.to(DEV)).backward()
            (ref(b)["f"].values() * coef).sum().backward()
        assert_same_tables(dmp.module.dyn.tables["t"], ref.tables["t"])
    finally:
        dist.destroy_process_group()


def test_bad_input_to_the_raw_ops_raises_instead_of_crashing():
    """The compiled ops' own checks raise a Python error naming the problem (run in a child
    process: a crash there fails this test instead of ending the suite)."""
    import subprocess
    import sys

    code = (
        "import torch, hstu._dynamic_embedding_C\n"
        "k = torch.zeros(33, dtype=torch.int64, device='cuda')\n"
        "t = k[:32].clone()\n"
        "def touch(step):\n"
        "    return torch.ops.hstu_dynemb.find_touch(k[:32], t, t.clone(), k[:1], None, 0, False,"
        " step)\n"
        "for call in (lambda: torch.ops.hstu_dynemb.find(k, k),\n"
        "             lambda: torch.ops.hstu_dynemb.find(k[:32], k.int()),\n"
        "             lambda: touch(k[:2]),\n"
        "             lambda: touch(k[:1].int()),\n"
        "             lambda: touch(k[:1].cpu())):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as e:\n"
        "        print('raised:', str(e).splitlines()[0])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "raised: keys: the slot count must be a positive multiple of 32, got 33"
    assert lines[1] == "raised: query must be int64, got Int"
    # the step a CUDA graph replays (hstu.embeddings.lookup_graphs): one int64 on the table's GPU
    assert lines[2] == "raised: step_tensor must hold one int64, got 2 of Long"
    assert lines[3] == "raised: step_tensor must hold one int64, got 1 of Int"
    assert lines[4].startswith("raised: step_tensor must be on cuda") and lines[4].endswith("cpu")
