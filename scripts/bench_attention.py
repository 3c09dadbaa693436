"""Benchmark the compiled HSTU attention kernel against the PyTorch reference (same run).

Shapes, lengths, FLOP counting and timing follow docs/design.md "Benchmarks": bf16 (fp16 with
`--dtype fp16`), causal, alpha = 1/sqrt(d), lengths ~ randint(N // 2, N + 1) with seed 0, forward
FLOPs sum_b H * L_b^2 * (Dqk + Dv), forward+backward = 3.5x, CUDA events, median of >= 20 runs.
Prints one JSON object per line:

    python scripts/bench_attention.py [--shapes short_d64,mid_d128] [--iters 30] [--warmup 10]
        [--graph] [--extra] [--bias position_time] [--out f.jsonl]

--bias adds the relative attention bias (docs/design.md) to the kernel and the reference alike:
one weight row shared by the heads, positions up to N - 1, 128 time buckets, timestamps with
gaps spread over 1 .. 10^6 on a log scale; rows carry "bias".

"cutlass" rows time eager calls (Python, autograd and launch overhead included, as an eager
training step sees them); "cutlass_op" "bwd" rows time the backward op alone (2.5x forward
FLOPs); with --graph, "cutlass_cudagraph" rows time the same calls replayed from a CUDA graph
(GPU time alone).

Rows record the kernel-selection environment variables that are set (HSTU_ATTN_MAX_SMEM: tile
configurations by shared-memory budget; HSTU_ATTN_DQ_CONVERT=kernel: separate dQ convert
kernel; HSTU_ATTN_SM90=0: the SM80 backward on an H100 whose build has the wgmma one), so A/B runs of one build can be told apart, e.g.
`HSTU_ATTN_MAX_SMEM=229375 python scripts/bench_attention.py --graph --shapes long_d256`.

The reference pads every sequence and materialises fp32 [B, H, N, N] scores: it is measured with
fewer iterations (--ref-iters) and, when the full batch does not fit or --ref-max-elems is
exceeded, on a batch prefix whose time is scaled up by the FLOP ratio; such rows say so in
"ref_note".
"""

from __future__ import annotations

import math
import os
import sys

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # this checkout's hstu; bench_common

from bench_common import base_parser, emit_json, median_ms  # noqa: E402

from hstu.ops import reference  # noqa: E402

SHAPES = {
    # name: (B, H, d, N, targets, contextual)
    "short_d64": (64, 4, 64, 256, 0, 0),
    "long_d64": (16, 4, 64, 4096, 0, 0),
    "mid_d128": (32, 4, 128, 1024, 0, 0),
    "long_d128": (16, 4, 128, 4096, 0, 0),
    "long_d256": (8, 4, 256, 4096, 0, 0),
    "rank_targets": (32, 4, 128, 2048, 100, 6),
    # the attention of the e2e benchmark model (configs/synthetic_benchmark_ranking.gin): heavy-
    # tailed lengths, shifted lognormal with mean ~1024 (sigma 1) clipped to [8, N]
    "e2e_d256": (32, 4, 256, 4096, 0, 0),
}
# shapes whose lengths follow the e2e model's lognormal instead of randint(N // 2, N + 1)
LOGNORMAL_SHAPES = {"e2e_d256"}

# Environment variables that change which kernel configuration runs (kernels/hstu_attention).
KERNEL_ENV = (
    "HSTU_ATTN_MAX_SMEM",
    "HSTU_ATTN_DQ_CONVERT",
    "HSTU_ATTN_PAIR_GROUP",
    "HSTU_ATTN_LAST_GROUP",
    "HSTU_ATTN_SM90",
    "HSTU_ATTN_COMPACT_GRID",
    "HSTU_ATTN_POSITION_BWD",
)


def make_inputs(
    b: int,
    h: int,
    d: int,
    n: int,
    targets: int,
    contexts: int,
    device="cuda",
    lognormal=False,
    dtype=torch.bfloat16,
):
    gen = torch.Generator().manual_seed(0)
    if lognormal:  # hstu.data.synthetic's lengths: 8 + floor(lognormal(mu, 1)), mean 1024
        mu = math.log(1024 - 8) - 0.5
        normal = torch.randn(b, generator=gen, dtype=torch.float64)
        lengths = (8 + torch.floor(torch.exp(mu + normal))).long().clamp(8, n)
    else:
        lengths = torch.randint(n // 2, n + 1, (b,), generator=gen)
    offsets = torch.zeros(b + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    tg = torch.Generator().manual_seed(1)
    q, k, v, do = (
        (torch.randn(total, h, d, generator=tg) * 0.5).to(device, dtype) for _ in range(4)
    )
    kw = {}
    if targets:
        kw["num_targets"] = torch.full((b,), targets, dtype=torch.int32, device=device)
    if contexts:
        kw["num_contexts"] = torch.full((b,), contexts, dtype=torch.int32, device=device)
    return lengths, offsets.to(device), q, k, v, do, kw


BIAS_KINDS = ("none", "position", "time", "position_time")


def bias_inputs(kind: str, lengths: torch.Tensor, n: int, device="cuda") -> dict:
    """The relative-bias keyword arguments of `hstu_attention_cuda` / the reference."""
    if kind == "none":
        return {}
    gen = torch.Generator().manual_seed(2)
    total = int(lengths.sum())
    out: dict = {}
    if kind in ("position", "position_time"):
        out["pos_weight"] = (torch.randn(1, 2 * n - 1, generator=gen) * 0.1).to(device)
        out["max_pos"] = n - 1
    if kind in ("time", "position_time"):
        gaps = torch.floor(10 ** (torch.rand(total, generator=gen) * 6.0)).long()
        out["timestamps"] = torch.cumsum(gaps, 0).to(device)
        out["time_weight"] = (torch.randn(1, 129, generator=gen) * 0.1).to(device)
    return out


def fwd_flops(lengths: torch.Tensor, h: int, d: int) -> float:
    return float(h * (lengths.double() ** 2).sum() * (d + d))


def time_graph_ms(fn, iters: int, warmup: int) -> float:
    """GPU time alone: the call captured once in a CUDA graph and replayed (no Python/launch
    overhead; what a CUDA-graphed or torch.compile'd training step sees)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters, warmup)


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_impl(attn, q, k, v, do, offsets, n, kw, iters, warmup):
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            attn(q, k, v, offsets, n, **kw)

    def fwd_bwd():
        out = attn(qg, kg, vg, offsets, n, **kw)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return (
        median_ms(fwd, iters, warmup),
        median_ms(fwd_bwd, iters, warmup),
        peak_mb(fwd_bwd),
        (fwd, fwd_bwd),
    )


def main() -> None:
    ap = base_parser(__doc__, iters=30, warmup=10, out="")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ref-iters", type=int, default=5)
    ap.add_argument(
        "--ref-max-elems",
        type=float,
        default=2.5e9,
        help="max B*H*N*N score elements the reference may materialise at once",
    )
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="also time the kernel calls replayed from a CUDA graph (GPU time alone)",
    )
    ap.add_argument("--bias", choices=BIAS_KINDS, default="none")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="q, k, v and dO")
    ap.add_argument(
        "--bound-factor",
        type=float,
        default=1.0,
        help="the compiled kernel's max_seqlen is this times the shape's N (an upper bound of the "
        "lengths, as a CUDA graph's power of two is; it sizes the grid), the attention scaling "
        "staying 1 / N",
    )
    ap.add_argument(
        "--extra",
        action="store_true",
        help="also: rank_targets lengths without masks, deterministic backward",
    )
    args = ap.parse_args()
    if not args.bound_factor >= 1.0:
        ap.error(
            f"--bound-factor must be >= 1 (max_seqlen bounds the lengths); got {args.bound_factor}"
        )

    from hstu.ops.cuda_attention import hstu_attention_cuda, is_available

    if not is_available():
        sys.exit("hstu._hstu_attention_C is not built / no CUDA GPU")
    gpu = torch.cuda.get_device_name()
    knobs = {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}

    def emit(rec: dict) -> None:
        rec = {"bench": "hstu_attention", "gpu": gpu, **rec}
        if args.bias != "none":
            rec["bias"] = args.bias
        if args.dtype != "bf16":
            rec["dtype"] = args.dtype
        if knobs:
            rec["env"] = knobs
        emit_json(rec, args.out)

    runs = []
    for name in args.shapes.split(","):
        runs.append((name, SHAPES[name], {}, name))
        if args.extra and name == "rank_targets":
            runs.append((name + "_nomask", SHAPES[name][:4] + (0, 0), {}, name + "_nomask"))
            runs.append((name + "_det", SHAPES[name], {"deterministic": True}, name))
    for label, (b, h, d, n, tgt, ctx), extra, _ in runs:
        lengths, offsets, q, k, v, do, kw = make_inputs(
            b,
            h,
            d,
            n,
            tgt,
            ctx,
            lognormal=label in LOGNORMAL_SHAPES,
            dtype=torch.float16 if args.dtype == "fp16" else torch.bfloat16,
        )
        bound = int(args.bound_factor * n)
        kw.update(bias_inputs(args.bias, lengths, n))
        flops = fwd_flops(lengths, h, d)
        shape = dict(
            shape=label, B=b, H=h, d=d, N=n, targets=tgt, contextual=ctx, tokens=int(lengths.sum())
        )
        if bound != n:
            shape["max_seqlen"] = bound

        def cuda_fn(q_, k_, v_, offsets_, _n, _extra=extra, _bound=bound, _scaling=n, **k2):
            # the grid bound `bound`, the scaling of N
            return hstu_attention_cuda(
                q_, k_, v_, offsets_, _bound, scaling_seqlen=_scaling, **k2, **_extra
            )

        f_ms, fb_ms, mem, fns = bench_impl(
            cuda_fn, q, k, v, do, offsets, n, kw, args.iters, args.warmup
        )
        emit(
            {
                **shape,
                "impl": "cutlass",
                "pass": "fwd",
                "ms": f_ms,
                "tflops": flops / f_ms / 1e9,
                "iters": args.iters,
            }
        )
        emit(
            {
                **shape,
                "impl": "cutlass",
                "pass": "fwd+bwd",
                "ms": fb_ms,
                "tflops": 3.5 * flops / fb_ms / 1e9,
                "iters": args.iters,
                "peak_mem_mb": mem,
                "peak_mem_bytes_per_token": mem * 2**20 / max(int(lengths.sum()), 1),
            }
        )
        # The backward alone: the raw op (no autograd), same arguments as the autograd wrapper.
        bias_kw = {
            key: kw[key]
            for key in ("timestamps", "pos_weight", "time_weight", "max_pos")
            if key in kw
        }
        if "time_weight" in bias_kw:
            bias_kw["time_edges"] = reference.time_bucket_edges(128, q.device)
        bwd_args = (
            do,
            q,
            k,
            v,
            offsets,
            bound,
            kw.get("num_contexts"),
            kw.get("num_targets"),
            1,
            0,
            1.0 / math.sqrt(d),
            1.0 / n,
            True,
            bool(extra.get("deterministic", False)),
        )

        def bwd_op(_a=bwd_args, _b=bias_kw):
            torch.ops.hstu_attention.bwd(*_a, **_b)

        b_ms = median_ms(bwd_op, args.iters, args.warmup)
        emit(
            {
                **shape,
                "impl": "cutlass_op",
                "pass": "bwd",
                "ms": b_ms,
                "tflops": 2.5 * flops / b_ms / 1e9,
                "iters": args.iters,
            }
        )
        if args.graph:
            try:
                g_b = time_graph_ms(bwd_op, args.iters, args.warmup)
                emit(
                    {
                        **shape,
                        "impl": "cutlass_cudagraph",
                        "pass": "bwd",
                        "ms": g_b,
                        "tflops": 2.5 * flops / g_b / 1e9,
                        "iters": args.iters,
                    }
                )
                g_f = time_graph_ms(fns[0], args.iters, args.warmup)
                g_fb = time_graph_ms(fns[1], args.iters, args.warmup)
                emit(
                    {
                        **shape,
                        "impl": "cutlass_cudagraph",
                        "pass": "fwd",
                        "ms": g_f,
                        "tflops": flops / g_f / 1e9,
                        "iters": args.iters,
                    }
                )
                emit(
                    {
                        **shape,
                        "impl": "cutlass_cudagraph",
                        "pass": "fwd+bwd",
                        "ms": g_fb,
                        "tflops": 3.5 * flops / g_fb / 1e9,
                        "iters": args.iters,
                    }
                )
            except Exception as exc:  # report, keep benchmarking
                emit({**shape, "impl": "cutlass_cudagraph", "error": repr(exc)[:300]})
        if args.no_ref or extra:
            continue
        # Reference: a batch prefix small enough for its dense [B, H, N, N] fp32 buffers.
        nb = b
        while nb > 1 and nb * h * n * n > args.ref_max_elems:
            nb //= 2
        note = "full batch" if nb == b else f"first {nb} of {b} sequences, time scaled by FLOPs"
        note += f", {args.ref_iters} iterations (median)"
        while True:
            try:
                sub_len = lengths[:nb]
                sub_tok = int(sub_len.sum())
                sub_kw = {
                    key: val[:nb] if key in ("num_targets", "num_contexts") else val
                    for key, val in kw.items()
                }
                if "timestamps" in kw:
                    sub_kw["timestamps"] = kw["timestamps"][:sub_tok]
                r_f, r_fb, r_mem, _ = bench_impl(
                    reference.hstu_attention,
                    q[:sub_tok],
                    k[:sub_tok],
                    v[:sub_tok],
                    do[:sub_tok],
                    offsets[: nb + 1],
                    n,
                    sub_kw,
                    args.ref_iters,
                    args.warmup,
                )
                break
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                if nb == 1:
                    r_f = r_fb = r_mem = math.nan
                    note = "out of memory even for one sequence"
                    break
                nb //= 2
                note = (
                    f"first {nb} of {b} sequences (OOM above), time scaled by FLOPs, "
                    f"{args.ref_iters} iterations (median)"
                )
        scale = flops / fwd_flops(lengths[:nb], h, d)
        r_f, r_fb = r_f * scale, r_fb * scale
        emit(
            {
                **shape,
                "impl": "reference",
                "pass": "fwd",
                "ms": r_f,
                "tflops": flops / r_f / 1e9,
                "ref_note": note,
                "speedup": r_f / f_ms,
            }
        )
        emit(
            {
                **shape,
                "impl": "reference",
                "pass": "fwd+bwd",
                "ms": r_fb,
                "tflops": 3.5 * flops / r_fb / 1e9,
                "ref_note": note,
                "speedup": r_fb / fb_ms,
                "peak_mem_mb_measured_batch": r_mem,
            }
        )
        del q, k, v, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
