"""Inference benchmarks: ranking from a KV cache of the history, and top-K retrieval.

    # ranking: the synthetic_benchmark_ranking model (8 layers, 1024 wide, 4 heads x 256), each
    # user with 2,000 history items and 100 candidates, batches of 1 and 64 users
    python scripts/bench_inference.py ranking --batches 1,64
    # retrieval: users/s of top-100 over the whole ML-1M catalogue (encoding + scoring)
    python scripts/bench_inference.py retrieval --config configs/ml_1m_retrieval.gin

Ranking (CUDA, or ``--device cpu`` with the reference ops and no graph) times one request (a batch of users, each with its candidate set) from the ids on the
host to the logits on the host, three ways in one process: the full recomputation (the model's
forward on history + candidates: what a server without a cache runs), `score_candidates` on the
cache (eager) and `GraphedScorer` (the same, replayed from a CUDA graph). The history cache is
encoded once beforehand (its time is reported apart). Per request: p50 / p99 / mean ms over
``--iters`` requests after ``--warmup``; the speed-ups are of the p50s. The largest difference
of the cached logits from the full ones is reported (bf16 noise).

Retrieval (CUDA or ``--device cpu``) times `Retriever.retrieve` on the dataset's users (their evaluation windows as
batches of ``--batch-size``; history excluded, top ``--top-k``), model weights as initialised
or from ``--checkpoint``: users/s for the whole pass, and apart the batch assembly.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path[:0] = [
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(__file__), ".."),
]

import torch  # noqa: E402
from bench_common import base_parser, emit_json  # noqa: E402

RANKING_CONFIG = "configs/synthetic_benchmark_ranking.gin"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _parse(argv):
    p = base_parser(__doc__, iters=30, warmup=5, device="auto", out="")
    p.add_argument("task", choices=["ranking", "retrieval"])
    p.add_argument("--config", default=None, help="gin config (default per task)")
    p.add_argument("--bindings", nargs="*", default=[], help="extra gin bindings")
    p.add_argument("--batches", default="1,64", help="ranking: users per request, comma list")
    p.add_argument("--history", type=int, default=2000, help="ranking: history items per user")
    p.add_argument("--candidates", type=int, default=100, help="ranking: candidates per user")
    p.add_argument("--no-full", action="store_true", help="ranking: skip the full recomputation")
    p.add_argument(
        "--num-splits",
        type=int,
        default=0,
        help="ranking: key splits of the compiled cached attention (0: chosen per call, 1: none)",
    )
    p.add_argument("--top-k", type=int, default=100, help="retrieval: K")
    p.add_argument("--batch-size", type=int, default=2048, help="retrieval: users per batch")
    p.add_argument("--checkpoint", default=None, help="retrieval: a run or checkpoint directory")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more pass (retrieval) or request of each kind (ranking) under torch.profiler: "
        'GPU kernel time vs wall time and the top kernels and operators ("profile" fields)',
    )
    return p.parse_args(argv)


def _stats(times_ms: list[float]) -> dict:
    ts = sorted(times_ms)
    p99 = ts[min(len(ts) - 1, int(round(0.99 * (len(ts) - 1))))]
    return {
        "p50_ms": round(statistics.median(ts), 3),
        "p99_ms": round(p99, 3),
        "mean_ms": round(statistics.fmean(ts), 3),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, iters: int, warmup: int) -> tuple[dict, object]:
    out = None
    for _ in range(warmup):
        out = fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return _stats(times), out


def _profile(fn, dev: torch.device, top: int = 12) -> dict:
    """One call of ``fn`` under torch.profiler: wall ms, GPU kernel ms, the operators with the
    most host time (inclusive) and the kernels with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    _sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        _sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    cpu = {e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    # GPU events that are not the device side of a record_function range (named like a CPU op)
    kernels = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in cpu
    ]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    host = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.cpu_time_total,
    )
    return {
        "wall_ms": round(wall * 1e3, 3),
        "kernel_ms": round(kernel_us / 1e3, 3),
        "kernels": sum(e.count for e in kernels),
        "top_kernels_ms": [
            [e.key[:100], round(e.self_device_time_total / 1e3, 3), e.count]
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
        ],
        "top_host_ops_ms": [
            [e.key[:100], round(e.cpu_time_total / 1e3, 3), e.count] for e in host[:top]
        ],
    }


def _fixed_histories(history, length: int, num_items: int, action_bits: int, gen):
    """``history`` with every user's items replaced by ``length`` random items (and actions,
    increasing times): requests of one size."""
    from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE
    from hstu.inference.kv_cache import batch_from_parts, feature_parts

    b = history.batch_size
    parts = feature_parts(history)
    n = b * length
    lengths = torch.full((b,), length, dtype=parts[ITEM_FEATURE][1].dtype)
    parts[ITEM_FEATURE] = (torch.randint(1, num_items + 1, (n,), generator=gen), lengths)
    parts[ACTION_FEATURE] = (torch.randint(0, 1 << action_bits, (n,), generator=gen), lengths)
    gaps = torch.randint(1, 10_000, (b, length), generator=gen)
    times = (1_700_000_000 + torch.cumsum(gaps, 1)).reshape(-1)
    timed = history.timestamps is not None
    return batch_from_parts(
        parts, history, torch.zeros(b, dtype=torch.int64), times if timed else None
    )


def bench_ranking(args) -> None:
    from hstu.config.gin_utils import load_config
    from hstu.data.registry import build_samples, load_sequence_data
    from hstu.inference.kv_cache import split_candidates
    from hstu.models.builder import build_model

    config = args.config or RANKING_CONFIG
    batches = [int(x) for x in args.batches.split(",")]
    bindings = [
        "EmbeddingArgs.embedding_backend='dense'",
        "DatasetArgs.synthetic_num_users=512",
        f"DatasetArgs.max_history_seqlen={args.history}",
        f"DatasetArgs.max_num_candidates={args.candidates}",
        *args.bindings,
    ]
    cfg = load_config("ranking", [config], bindings)
    data = load_sequence_data(cfg.dataset, num_tasks=cfg.ranking.num_tasks)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(cfg, data, device_type=dev.type).to(dev).eval()
    # CPU: float32 reference ops, as the models run there
    dtype = DTYPES[cfg.network.dtype_str] if dev.type == "cuda" else torch.float32
    samples = build_samples(data, cfg.dataset, "ranking").eval
    gen = torch.Generator().manual_seed(0)
    n_items = int(data.item_vocab_size) - 1
    for b in batches:
        base, _, _ = split_candidates(samples.collate(list(range(b))))
        history = _fixed_histories(
            base, args.history, n_items, model.preprocessor.num_action_bits, gen
        )
        cands = [torch.randint(1, n_items + 1, (args.candidates,), generator=gen) for _ in range(b)]
        row = {
            "bench": "ranking_kv_cache",
            "config": config,
            "batch": b,
            "history": args.history,
            "candidates": args.candidates,
            "layers": cfg.network.num_layers,
            "hidden": cfg.network.hidden_size,
            "dtype": str(dtype).replace("torch.", ""),
            "num_splits": args.num_splits,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        }
        row.update(_ranking_request(model, history, cands, dtype, dev, args))
        emit_json(row, args.out)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def _ranking_request(model, history, cands, dtype, dev, args) -> dict:
    """Timings of one request shape: full recomputation, cached eager, cached graph (CUDA)."""
    import contextlib

    from hstu.inference.kv_cache import (
        GraphedScorer,
        encode_history,
        score_candidates,
        with_candidates,
    )

    row: dict = {}
    cuda = dev.type == "cuda"
    amp = torch.autocast("cuda", dtype=dtype) if cuda else contextlib.nullcontext()
    with amp:
        _sync()
        t0 = time.perf_counter()
        cache = encode_history(model, history.to(dev), args.candidates)
        _sync()
        row["encode_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        row["cache_mb"] = round(cache.nbytes() / 2**20, 1)

        def full():
            batch = with_candidates(history, cands)
            if cuda:  # page-locked copies, as the cached path makes them
                batch = batch.pin_memory()
            batch = batch.to(dev, non_blocking=True)
            return model(batch)["logits"].float().cpu()

        def cached():
            return score_candidates(model, cache, cands, num_splits=args.num_splits).cpu()

        if not args.no_full:
            row["full"], ref = _time(full, args.iters, args.warmup)
        got = {}
        row["cached_eager"], got["eager"] = _time(cached, args.iters, args.warmup)
        if cuda:
            scorer = GraphedScorer(
                model,
                cache,
                [len(c) for c in cands],
                autocast_dtype=dtype,
                num_splits=args.num_splits,
            )
            row["cached_graph"], got["graph"] = _time(
                lambda: scorer(cands, to_host=True), args.iters, args.warmup
            )
        if args.profile:
            kinds = {"full": full, "cached_eager": cached}
            if cuda:
                kinds["cached_graph"] = lambda: scorer(cands, to_host=True)
            for name, fn in kinds.items():
                if name != "full" or not args.no_full:
                    row[f"profile_{name}"] = _profile(fn, dev, top=8)
    if not args.no_full:
        for name, logits in got.items():
            row[f"speedup_cached_{name}"] = round(
                row["full"]["p50_ms"] / row[f"cached_{name}"]["p50_ms"], 2
            )
            row[f"max_abs_diff_{name}"] = float((logits - ref).abs().max())
        row["max_abs_logit"] = float(ref.abs().max())
    return row


def bench_retrieval(args) -> None:
    from hstu.config.gin_utils import load_config
    from hstu.data.registry import build_samples, load_sequence_data
    from hstu.inference.retriever import Retriever
    from hstu.models.builder import build_model

    dev = torch.device(args.device)
    if args.checkpoint:
        retriever = Retriever.from_checkpoint(args.checkpoint, device=dev)
    else:
        cfg = load_config(
            "retrieval", [args.config or "configs/ml_1m_retrieval.gin"], args.bindings
        )
        # as the trainer loads it: synthetic data carries 8 action bits
        data = load_sequence_data(
            cfg.dataset, num_tasks=8 if cfg.dataset.dataset_name == "synthetic" else 0
        )
        torch.manual_seed(0)
        model = build_model(cfg, data, device_type=dev.type).to(dev)
        retriever = Retriever(model, cfg, data, device=dev)
    samples = build_samples(retriever.data, retriever.cfg.dataset, "retrieval").eval
    n = len(samples)
    bs = args.batch_size
    t0 = time.perf_counter()
    batches = [samples.collate(list(range(s, min(n, s + bs)))) for s in range(0, n, bs)]
    collate_s = time.perf_counter() - t0
    retriever.corpus_embeddings()  # cached, as a server keeps it

    def run():
        out = None
        for batch in batches:
            out = retriever.retrieve(batch, top_k=args.top_k)
        return out

    stats, _ = _time(run, max(3, args.iters // 10), 1)
    if args.profile:
        emit_json({"bench": "retrieval_profile", **_profile(run, dev)}, args.out)
    per_pass = stats["p50_ms"] / 1e3
    emit_json(
        {
            "bench": "retrieval_top_k",
            "users": n,
            "corpus": int(retriever.corpus.numel()),
            "top_k": args.top_k,
            "batch_size": bs,
            "pass_ms": stats,
            "users_per_s": round(n / per_pass, 1),
            "users_per_s_with_batch_assembly": round(n / (per_pass + collate_s), 1),
            "batch_assembly_s": round(collate_s, 3),
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        },
        args.out,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.task == "ranking":
        bench_ranking(args)
    else:
        bench_retrieval(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
