"""Dynamic embedding benchmarks (JSON lines on stdout).

(a) hash table: insert and find throughput (keys/s) of the CUDA kernels at load factors 0.5 and
    0.9 of a dim-128 table with 2^24 (16M) slots;
(b) one training step (lookup + backward + fused Adam) of a DynamicEmbeddingCollection vs
    torchrec's fused TBE EmbeddingCollection sharded by DistributedModelParallel (FUSED kernel),
    same dim, optimizer, ids (64K with duplicates), measured in the same run;
(c) ``--hybrid``: a training step (lookup + backward + fused row-wise Adagrad) of a table whose
    rows live in host memory with an HBM cache (``storage='hybrid'``) vs the same table entirely
    in HBM (when it fits), on the same ids: ``--ids`` per step drawn Zipf(``--zipf``) over
    ``--rows`` ids, the table filled first (``--prefill``). Reports the step time of both, their
    ratio, whether the losses were identical, and the cache's hit rate and traffic. Default: the
    target case, 120M x 128 fp32 (~61 GB of rows) with an 8 GiB cache, 64K ids per step.
(d) ``--host-issue``: the host's time to issue one training lookup and its fused backward
    (row-wise Adagrad) of a dynamic table into an idle GPU (synchronised before each step), and
    the step's time with the GPU's work, for two tables on the same ids in turn: one issuing the
    lookup's ops one by one (``eager``), one replaying them from CUDA graphs (``graphs``,
    `hstu.embeddings.lookup_graphs`; it reports its captures and whether both tables ended
    identical). ``--ids`` (+-10%) per step drawn Zipf(``--zipf``) over ``--rows`` ids, with their
    CPU copy (``host_ids``) as the trainer passes it, ``--dim`` wide rows, after ``--warmup``
    untimed steps (the captures happen there). The host's part is what a training step spends in the
    lookup's small ops; e.g. the e2e benchmark model's item table:
    ``--host-issue --rows 2000000 --dim 1024 --ids 28672``.

    python scripts/bench_embedding.py [--slots-log2 24] [--skip-tbe] [--skip-table] [--out f.jsonl]
    python scripts/bench_embedding.py --hybrid [--rows 120000000] [--cache 8589934592] [--ids 65536]
    python scripts/bench_embedding.py --host-issue [--rows 2000000] [--dim 1024] [--ids 28672]
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # this checkout's hstu; bench_common

from bench_common import base_parser, emit_json, median_ms, resolve_device  # noqa: E402

from hstu.config.limits import available_memory, format_bytes, table_memory  # noqa: E402
from hstu.embeddings import cuda_table  # noqa: E402
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig  # noqa: E402
from hstu.embeddings.dynamic_table import (  # noqa: E402
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    make_dynamic_table,
)
from hstu.embeddings.hybrid_table import HybridDynamicEmbeddingTable  # noqa: E402


def emit(out: str, **kw) -> None:
    """One JSON row (with the GPU's name) on stdout, also appended to ``out`` when given."""
    kw["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
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


# ---- (c) hybrid table vs the same table in HBM ---------------------------------------------


def zipf_ids(n: int, rows: int, s: float, gen: np.random.Generator) -> np.ndarray:
    """``n`` ids in [0, rows), id k - 1 drawn with probability ~ k^-s (inverse CDF of the
    continuous power law, floored): id 0 is the most popular."""
    u = gen.random(n)
    if abs(s - 1.0) < 1e-9:
        x = np.exp(u * np.log(rows + 1.0))
    else:
        a = 1.0 - s
        x = ((float(rows) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, rows - 1).clip(min=0)


def _table_config(args, name: str, **kw) -> DynamicEmbeddingConfig:
    """A table of ``--rows`` x ``--dim`` trained by row-wise Adagrad (modes c and d)."""
    return DynamicEmbeddingConfig(
        name, args.dim, args.rows, ["f"], optimizer="rowwise_adagrad", learning_rate=0.01, **kw
    )


def _hybrid_config(args, storage: str) -> DynamicEmbeddingConfig:
    cache = float(args.cache) if float(args.cache) <= 1.0 else int(float(args.cache))
    return _table_config(args, "bench", storage=storage, hbm_cache=cache)


def _run_table(args, storage: str, batches: list[torch.Tensor], dev: torch.device) -> dict:
    """Builds the table, fills it (``--prefill``), runs the warm-up and timed steps; returns the
    row to emit and the per-step losses."""
    t0 = time.perf_counter()
    table = make_dynamic_table(_hybrid_config(args, storage), dev)
    hybrid = isinstance(table, HybridDynamicEmbeddingTable)
    build_s = time.perf_counter() - t0
    # fill: every id of the first prefill x rows, in chunks the hybrid table's cache can take
    # (the same chunks for both tables, so that both hold the same rows), from the least to the
    # most popular id: the cache then starts with the popular rows, as after long training
    t0 = time.perf_counter()
    cfg = _hybrid_config(args, "hybrid")
    chunk = max(1, min(1 << 20, cfg.cache_rows(cfg.num_slots) // 2))
    with torch.no_grad():
        for hi in range(int(args.prefill * args.rows), 0, -chunk):
            ids = torch.arange(max(0, hi - chunk), hi)
            table(ids.to(dev), host_ids=ids)
    sync(dev)
    fill_s = time.perf_counter() - t0
    losses, times = [], []

    def step(ids: torch.Tensor) -> torch.Tensor:
        out = table(ids.to(dev, non_blocking=True), host_ids=ids)
        loss = out.square().sum()
        loss.backward()
        return loss.detach()

    for ids in batches[: args.warmup]:
        losses.append(step(ids))
    before = table.stats()
    issue = []  # host time until the step's work is queued (before waiting for the GPU)
    for ids in batches[args.warmup :]:
        sync(dev)
        t0 = time.perf_counter()
        losses.append(step(ids))
        issue.append(1000.0 * (time.perf_counter() - t0))
        sync(dev)
        times.append(1000.0 * (time.perf_counter() - t0))
    after = table.stats()
    steps = len(times)
    row = dict(
        bench="hybrid_train_step",
        impl=storage,
        rows=args.rows,
        dim=args.dim,
        ids=args.ids,
        zipf=args.zipf,
        unique=float(np.mean([torch.unique(b).numel() for b in batches[args.warmup :]])),
        steps=steps,
        ms=statistics.median(times),
        ms_mean=statistics.fmean(times),
        issue_ms=statistics.median(issue),
        table_hit_rate=(after["hits"] - before["hits"]) / (after["lookups"] - before["lookups"]),
        build_s=build_s,
        fill_s=fill_s,
        device=dev.type,
    )
    if hybrid:
        lookups = after["cache_lookups"] - before["cache_lookups"]
        hits = after["cache_hits"] - before["cache_hits"]
        row.update(
            cache=args.cache,
            cache_rows=table.cache_rows,
            cache_bytes=table.cache_rows * (table.width * 4 + 16),
            host_bytes=table.host.rows.numel() * 4,
            host_mapped=table.host.mapped,
            cache_hit_rate=hits / lookups if lookups else 0.0,
            fetched_per_step=(after["cache_fetches"] - before["cache_fetches"]) / steps,
            written_per_step=(after["cache_writebacks"] - before["cache_writebacks"]) / steps,
        )
    return {"row": row, "losses": torch.stack(losses).cpu()}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_hybrid(args) -> None:
    dev = torch.device(resolve_device(args.device))
    if dev.type == "cuda":
        cuda_table.require_kernels()
    gen = np.random.default_rng(0)
    batches = [
        torch.from_numpy(zipf_ids(args.ids, args.rows, args.zipf, gen))
        for _ in range(args.warmup + args.steps)
    ]
    if dev.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    hbm_need = table_memory(
        "dynamic",
        args.rows,
        args.dim,
        sparse_optimizer="rowwise_adagrad",
        dense_states=0,
        world_size=1,
    ).device
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_memory("host")[0]
    runs = {}
    # the all-HBM table, where it fits (with room for the step's temporaries)
    if hbm_need < 0.95 * free:
        runs["hbm"] = _run_table(args, "hbm", batches, dev)
        emit(args.out, **runs["hbm"]["row"])
        gc.collect()  # the table goes before the hybrid one is built
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    else:
        emit(
            args.out,
            bench="hybrid_train_step",
            impl="hbm",
            rows=args.rows,
            dim=args.dim,
            skipped=f"does not fit: needs {format_bytes(hbm_need)}, free {format_bytes(free)}",
        )
    runs["hybrid"] = _run_table(args, "hybrid", batches, dev)
    emit(args.out, **runs["hybrid"]["row"])
    if "hbm" in runs:
        emit(
            args.out,
            bench="hybrid_over_hbm",
            rows=args.rows,
            hybrid_over_hbm=runs["hybrid"]["row"]["ms"] / runs["hbm"]["row"]["ms"],
            same_losses=bool(torch.equal(runs["hybrid"]["losses"], runs["hbm"]["losses"])),
        )


def bench_host_issue(args) -> None:
    """(d): see the module docstring."""
    dev = torch.device("cuda")
    tables = {}
    for graphs in (False, True):
        cfg = _table_config(args, "items", lookup_graphs=graphs)
        tables["graphs" if graphs else "eager"] = DynamicEmbeddingTable(cfg, dev)
    gen = np.random.default_rng(0)
    steps = args.warmup + args.steps
    # the id count varies like a batch's item count (+-10%): a few padded counts for the graphs
    counts = gen.integers(int(args.ids * 0.9), int(args.ids * 1.1) + 1, steps)
    host_ids = [torch.from_numpy(zipf_ids(int(c), args.rows, args.zipf, gen)) for c in counts]
    grad = torch.randn(
        int(counts.max()), args.dim, device=dev, generator=torch.Generator(dev).manual_seed(0)
    )
    grad = grad.to(getattr(torch, cfg.output_dtype))  # the lookup's output dtype
    issue = {k: [] for k in tables}
    total = {k: [] for k in tables}
    for i, h in enumerate(host_ids):
        ids = h.to(dev)
        for name, table in tables.items():  # alternating, on the same ids
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            out = table(ids, host_ids=h)
            out.backward(grad[: ids.numel()])
            t1 = time.perf_counter()
            torch.cuda.synchronize(dev)
            t2 = time.perf_counter()
            if i >= args.warmup:
                issue[name].append(1e3 * (t1 - t0))
                total[name].append(1e3 * (t2 - t0))
    graphs = tables["graphs"]._graphs.stats
    same = all(
        torch.equal(getattr(tables["eager"].state, k), getattr(tables["graphs"].state, k))
        for k in ("keys", "scores", "touched", "values")
    )
    stats = tables["graphs"].stats()
    emit(
        args.out,
        bench="dynamic_table_host_issue",
        rows=args.rows,
        dim=args.dim,
        ids_per_step=args.ids,
        zipf=args.zipf,
        steps=args.steps,
        **{f"host_issue_ms_{k}": statistics.median(v) for k, v in issue.items()},
        **{f"host_issue_range_ms_{k}": [min(v), max(v)] for k, v in issue.items()},
        **{f"step_ms_{k}": statistics.median(v) for k, v in total.items()},
        graph_captures=graphs.captures,
        graph_capture_s=graphs.capture_seconds,
        graph_replays=graphs.replays,
        same_tables=same,
        hit_rate=stats["hit_rate"],
        occupancy=stats["occupancy"],
    )


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__, out="", device="auto", steps=50, warmup=20)
    p.add_argument("--slots-log2", type=int, default=24)
    p.add_argument("--skip-tbe", action="store_true")
    p.add_argument("--skip-table", action="store_true")
    p.add_argument("--hybrid", action="store_true", help="(c): hybrid table vs all-HBM table")
    p.add_argument(
        "--host-issue", action="store_true", help="(d): host time of a training lookup + backward"
    )
    p.add_argument("--rows", type=int, default=120_000_000, help="(c, d) table rows (capacity)")
    p.add_argument("--dim", type=int, default=128, help="(c, d) embedding width")
    p.add_argument("--ids", type=int, default=65536, help="(c, d) ids per step")
    p.add_argument(
        "--cache",
        type=float,
        default=8 * 2**30,
        help="(c) HBM cache: bytes (> 1) or a fraction of the rows (<= 1)",
    )
    p.add_argument("--zipf", type=float, default=1.05, help="(c, d) Zipf exponent of the ids")
    p.add_argument(
        "--prefill", type=float, default=1.0, help="(c) fraction of the rows inserted first"
    )
    args = p.parse_args(argv)
    if args.hybrid:
        bench_hybrid(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_embedding.py needs a CUDA GPU (except --hybrid)")
    cuda_table.require_kernels()
    if args.host_issue:
        bench_host_issue(args)
        return
    if not args.skip_table:
        bench_table(args.slots_log2, args.out)
        torch.cuda.empty_cache()
    bench_train_step(args.skip_tbe, args.out)


if __name__ == "__main__":
    main()
