"""Dynamic embedding benchmarks (JSON lines on stdout).

(a) hash table: insert and find throughput (keys/s) of the CUDA kernels at load factors 0.5 and
    0.9 of a dim-128 table with 2^24 (16M) slots;
(b) one training step (lookup + backward + fused Adam) of a DynamicEmbeddingCollection vs
    torchrec's fused TBE EmbeddingCollection sharded by DistributedModelParallel (FUSED kernel),
    same dim, optimizer, ids (64K with duplicates), measured in the same run.

    python scripts/bench_embedding.py [--slots-log2 24] [--skip-tbe] [--skip-table] [--out f.jsonl]
"""

from __future__ import annotations

import os
import sys

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # this checkout's hstu; bench_common

from bench_common import base_parser, emit_json, median_ms  # noqa: E402

from hstu.embeddings import cuda_table  # noqa: E402
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig  # noqa: E402
from hstu.embeddings.dynamic_table import (  # noqa: E402
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
)


def emit(out: str, **kw) -> None:
    """One JSON row (with the GPU's name) on stdout, also appended to ``out`` when given."""
    kw["gpu"] = torch.cuda.get_device_name()
    emit_json(kw, out)


def bench_table(slots_log2: int, out: str = "") -> None:
    dev = torch.device("cuda")
    cap = 1 << slots_log2
    cfg = DynamicEmbeddingConfig("bench", 128, cap, ["f"], optimizer="sgd")
    g = torch.Generator(device=dev).manual_seed(0)
    warm = DynamicEmbeddingTable(DynamicEmbeddingConfig("w", 128, 1 << 16, ["w"]), dev)
    for _ in range(3):  # first-call costs (sort kernels, allocator) stay out of the timings
        k = torch.unique(torch.randint(0, 2**40, (1 << 14,), device=dev, generator=g))
        warm._insert_grouped(k, torch.ones_like(k), 1)
    del warm
    t = DynamicEmbeddingTable(cfg, dev)
    inserted = []
    loaded = evicted = 0
    chunk = 1 << 20
    for load in (0.5, 0.9):
        target = int(cap * load)
        ins_ms = 0.0
        n_ins = 0
        while loaded < target:
            n = min(chunk, target - loaded)
            keys = torch.randint(-(2**62), 2**62, (n,), device=dev, generator=g)
            keys = torch.unique(keys)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t.step += 1
            a.record()
            _, n_ev = t._insert_grouped(keys, torch.full_like(keys, t.step), t.step)
            evicted += int(n_ev)
            b.record()
            b.synchronize()
            ins_ms += a.elapsed_time(b)  # bucket hash + grouping sort + insert kernel
            n_ins += keys.numel()
            loaded += keys.numel()
            inserted.append(keys)
        allk = torch.cat(inserted)
        q = allk[torch.randint(0, allk.numel(), (1 << 23,), device=dev, generator=g)]
        find_ms = median_ms(lambda q=q: cuda_table.find(t.state, q), 20, 3)
        miss = q ^ 0x5A5A5A5A  # almost surely absent keys
        miss_ms = median_ms(lambda q=miss: cuda_table.find(t.state, q), 20, 3)
        hit = float((cuda_table.find(t.state, q) >= 0).float().mean())
        emit(
            out,
            bench="hash_table",
            slots=cap,
            dim=128,
            load_factor=round(t.size() / cap, 4),
            insert_keys_per_s=n_ins / (ins_ms / 1e3),
            find_keys_per_s=q.numel() / (find_ms / 1e3),
            find_miss_keys_per_s=miss.numel() / (miss_ms / 1e3),
            find_hit_rate=hit,
            inserted_keys=loaded,
            evictions=evicted,
        )


def make_batch(n_ids: int, vocab: int, seed: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    # Power-law ids: many duplicates, like item popularity.
    ids = (torch.rand(n_ids, generator=g) ** 3 * vocab).long()
    lengths = torch.full((n_ids // 64,), 64, dtype=torch.int64)
    return KeyedJaggedTensor(keys=["f"], values=ids, lengths=lengths).to("cuda"), ids


def bench_train_step(skip_tbe: bool, out: str = "") -> None:
    dev = torch.device("cuda")
    n_ids, vocab, dim, lr = 65536, 1 << 20, 128, 1e-3
    kjt, ids = make_batch(n_ids, vocab, 0)
    n_unique = int(torch.unique(ids).numel())
    coef = torch.randn(n_ids, dim, device=dev)

    cfg = DynamicEmbeddingConfig("f", dim, 2 * vocab, ["f"], optimizer="adam", learning_rate=lr)
    dyn = DynamicEmbeddingCollection([cfg], dev)

    def dyn_step():
        out = dyn(kjt)["f"].values()
        (out * coef).sum().backward()

    dyn_ms = median_ms(dyn_step, iters=50, warmup=5)
    emit(out, bench="train_step", impl="dynamic", ids=n_ids, unique=n_unique, dim=dim, ms=dyn_ms)
    if skip_tbe:
        return
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    ec = EmbeddingCollection(
        tables=[
            EmbeddingConfig(name="f", embedding_dim=dim, num_embeddings=vocab, feature_names=["f"])
        ],
        device=torch.device("meta"),
    )
    sharder = EmbeddingCollectionSharder(
        fused_params={"optimizer": EmbOptimType.ADAM, "learning_rate": lr, "eps": 1e-8}
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cuda"),
        constraints={
            "f": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        },
    )
    plan = planner.collective_plan(ec, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(ec, device=dev, plan=plan, sharders=[sharder])

    def tbe_step():
        out = model(kjt)["f"].values()
        (out * coef).sum().backward()

    tbe_ms = median_ms(tbe_step, iters=50, warmup=5)

    from hstu.embeddings.sharding import DynamicEmbeddingSharder

    class DynModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dyn = DynamicEmbeddingCollection([cfg], torch.device("meta"))

        def forward(self, x):
            return self.dyn(x)

    dyn_dmp = DistributedModelParallel(DynModel(), device=dev, sharders=[DynamicEmbeddingSharder()])

    def dyn_dmp_step():
        out = dyn_dmp(kjt)["f"].values()
        (out * coef).sum().backward()

    dmp_ms = median_ms(dyn_dmp_step, iters=50, warmup=5)
    emit(
        out,
        bench="train_step",
        impl="dynamic_dmp_sharder",
        ids=n_ids,
        unique=n_unique,
        dim=dim,
        ms=dmp_ms,
    )
    emit(
        out,
        bench="train_step",
        impl="torchrec_fused_tbe_dmp",
        ids=n_ids,
        unique=n_unique,
        dim=dim,
        ms=tbe_ms,
    )
    emit(out, bench="train_step_ratio", dynamic_over_tbe=dyn_ms / tbe_ms, target="<= 1.25")


def main() -> None:
    p = base_parser(__doc__, out="")
    p.add_argument("--slots-log2", type=int, default=24)
    p.add_argument("--skip-tbe", action="store_true")
    p.add_argument("--skip-table", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_embedding.py needs a CUDA GPU")
    cuda_table.require_kernels()
    if not args.skip_table:
        bench_table(args.slots_log2, args.out)
        torch.cuda.empty_cache()
    bench_train_step(args.skip_tbe, args.out)


if __name__ == "__main__":
    main()
