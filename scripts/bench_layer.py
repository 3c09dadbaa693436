"""One HSTU layer, forward + backward: FusedHSTULayer (gating kernel and recompute options) vs
the unfused HSTULayer, same weights and inputs, same run; plus the gating step alone. One JSON
object per line:

    python scripts/bench_layer.py                         # GPU: bf16 autocast, compiled attention
    python scripts/bench_layer.py --device cpu --batch 4 --max-len 128 --hidden 64 --head-dim 32

Layer variants: "fused" (the default gate_kernel, "auto"), "fused_gate_cuda" (the compiled
LayerNorm*u*dropout kernel), "fused_gate_compiled" (its torch.compiled PyTorch stages),
"fused_eager" (every elementwise stage eager), "fused_recompute_*" (memory options, default gate),
"fused_aten_elementwise" (the default layer with elementwise_kernels=False: the uvqk SiLU and the
gradient cast on the aten path instead of the hstu_lnmd kernels). Layer rows carry the layer's
"kernel_choices" (what each switch resolved to on the device).
Gating-step variants, [T, H*d] forward + backward of dropout(LayerNorm(a) * u) alone (u a column
block of a [T, 4*H*d] tensor, as in the layer): "gate_op_cuda" (torch.ops.hstu_lnmd, including
the recompute of y) and "gate_op_compiled" (the layer's torch.compiled stages gate_fwd,
gate_recompute, gate_bwd, with a dropout mask).
SiLU-step variants, z [T, 4*H*d] -> act [4, T, H*d] forward and (du, dv, dq, dk) -> dz [T, 4*H*d]
plus the uvqk bias gradient backward, alone: "silu_op_cuda" (torch.ops.hstu_lnmd.silu_chunk_major
and silu_chunk_major_backward) and "silu_op_aten" (the layer's fallback: aten.silu.out into the
transposed view, four aten.silu_backward into column blocks, dz.sum(0)); rows add ms_fwd, ms_bwd
and the effective GB/s of each (bytes read + written once).
Cast-step variants, the backward's first step on an fp32 gradient [T, hidden] (cast to the
matmul dtype + the output bias gradient): "cast_op_cuda" (torch.ops.hstu_lnmd.cast_colsum, one
pass) and "cast_op_aten" (`.to()` then a sum of the cast); rows add gbps.

Lengths are randint(N // 2, N + 1) from seed 0 (docs/design.md benchmarks). `ms_fwd_bwd` is the
median of --iters forward+backward calls after --warmup (CUDA events on GPU, perf_counter on
CPU); `host_ms` the median CPU time to enqueue one forward+backward (no sync inside: on a GPU
a layer is launch-bound when host_ms approaches ms_fwd_bwd). FLOPs as in `hstu.training.flops`
for one layer (linears + attention, forward + backward); peak memory is the CUDA peak of one
forward+backward above the inputs and weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # this checkout's hstu; bench_common

from bench_common import base_parser, emit_json, median_ms, resolve_device  # noqa: E402

import hstu.modules.fused_hstu_layer as fused_mod  # noqa: E402
from hstu.modules import layer_norm_mul_dropout as lnmd  # noqa: E402
from hstu.modules.fused_hstu_layer import FusedHSTULayer  # noqa: E402
from hstu.modules.hstu_layer import AttentionInputs, HSTULayer  # noqa: E402
from hstu.training.flops import StackShape, step_flops  # noqa: E402

# name -> FusedHSTULayer options (None: the unfused HSTULayer)
VARIANTS = {
    "unfused": None,
    "fused": {},
    "fused_gate_cuda": {"gate_kernel": "cuda"},
    "fused_gate_compiled": {"gate_kernel": "compiled"},
    "fused_eager": {"gate_kernel": "compiled", "stage_compile": False},
    "fused_recompute_ln": {"recompute_input_layernorm": True},
    "fused_recompute_silu": {"recompute_uvqk_silu": True},
    "fused_recompute_both": {"recompute_input_layernorm": True, "recompute_uvqk_silu": True},
    "fused_aten_elementwise": {"elementwise_kernels": False},
}
GATE_VARIANTS = ("gate_op_cuda", "gate_op_compiled")
SILU_VARIANTS = ("silu_op_cuda", "silu_op_aten")
CAST_VARIANTS = ("cast_op_cuda", "cast_op_aten")
STEP_VARIANTS = GATE_VARIANTS + SILU_VARIANTS + CAST_VARIANTS


def _parse(argv=None) -> argparse.Namespace:
    p = base_parser(__doc__, iters=20, warmup=3, device="auto", dtype="bfloat16", out="")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--variants", default=",".join(list(VARIANTS) + list(STEP_VARIANTS)))
    return p.parse_args(argv)


def _host_ms(fn, iters: int, cuda: bool) -> float:
    """Median CPU time of one call, the device drained before each (the enqueue cost)."""
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(1000.0 * (time.perf_counter() - t0))
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def _gate_step(variant: str, t: int, inner: int, dropout: float, dev, dtype, gen):
    """A forward+backward of the gating step alone at [T, inner] (u: a block of [T, 4*inner])."""
    attn = torch.randn(t, inner, generator=gen).to(dev, dtype)
    u = torch.randn(t, 4 * inner, generator=gen).to(dev, dtype)[:, :inner]
    dy = torch.randn(t, inner, generator=gen).to(dev, dtype)
    w = torch.ones(inner, device=dev)
    b = torch.zeros(inner, device=dev)
    eps = 1e-6
    if variant == "gate_op_cuda":
        if not lnmd.load_extension():
            raise RuntimeError(lnmd.BUILD_HINT)

        def step():
            seed = lnmd.draw_seed(dev)
            y, mean, rstd = torch.ops.hstu_lnmd.fwd(attn, u, w, b, eps, dropout, *seed)
            torch.ops.hstu_lnmd.bwd(dy, attn, u, w, b, mean, rstd, dropout, *seed, True)

        return step
    scale = 1.0 / (1.0 - dropout)

    def step():
        keep = torch.rand((t, inner), device=dev) >= dropout
        _, mean, rstd = fused_mod._stage("gate_fwd", dev, attn, w, b, u, keep, scale, eps, dtype)
        fused_mod._stage("gate_recompute", dev, attn, mean, rstd, w, b, u, keep, scale, dtype)
        fused_mod._stage("gate_bwd", dev, dy, attn, mean, rstd, w, b, u, keep, scale, dtype)

    return step


def _silu_steps(variant: str, t: int, heads: int, head_dim: int, dev, dtype, gen):
    """(forward, backward, bytes forward, bytes backward) of the uvqk SiLU step alone, with the
    gradients laid out as the layer has them (du [T, H*d], dv/dq/dk [T, H, d])."""
    inner = heads * head_dim
    z = torch.randn(t, 4 * inner, generator=gen).to(dev, dtype)
    du = torch.randn(t, inner, generator=gen).to(dev, dtype)
    dv, dq, dk = (torch.randn(t, heads, head_dim, generator=gen).to(dev, dtype) for _ in range(3))
    esize = z.element_size()
    fwd_bytes = 2 * z.numel() * esize
    bwd_bytes = 3 * z.numel() * esize + 4 * 4 * inner
    if variant == "silu_op_cuda":
        if not lnmd.load_extension() or not hasattr(torch.ops.hstu_lnmd, "silu_chunk_major"):
            raise RuntimeError(lnmd.BUILD_HINT)
        ops = torch.ops.hstu_lnmd
        rows = [g.reshape(t, inner) for g in (du, dv, dq, dk)]

        def fwd():
            ops.silu_chunk_major(z)

        def bwd():
            ops.silu_chunk_major_backward(*rows, z, True)

        return fwd, bwd, fwd_bytes, bwd_bytes

    def fwd():
        fused_mod._silu_chunk_major(z, inner)

    def bwd():
        dz = torch.empty_like(z)
        fused_mod._silu_backward_into(dz, (du, dv, dq, dk), z, inner)
        dz.sum(0, dtype=torch.float32)

    return fwd, bwd, fwd_bytes, bwd_bytes


def _cast_step(variant: str, t: int, hidden: int, dev, dtype, gen):
    """(step, bytes) of the cast + output-bias-gradient step on an fp32 [T, hidden] gradient."""
    dout = torch.randn(t, hidden, generator=gen).to(dev)
    nbytes = dout.numel() * (4 + torch.tensor([], dtype=dtype).element_size())
    if variant == "cast_op_cuda":
        if not lnmd.load_extension() or not hasattr(torch.ops.hstu_lnmd, "cast_colsum"):
            raise RuntimeError(lnmd.BUILD_HINT)
        return (lambda: torch.ops.hstu_lnmd.cast_colsum(dout, dtype)), nbytes

    def step():
        dproj = dout.to(dtype)
        dproj.sum(0, dtype=torch.float32)

    return step, nbytes


def main(argv=None) -> int:
    args = _parse(argv)
    dev = torch.device(resolve_device(args.device))
    cuda = dev.type == "cuda"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.max_len // 2, args.max_len + 1, (args.batch,), generator=gen)
    offsets = torch.zeros(args.batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    attn = AttentionInputs(seq_offsets=offsets.to(dev), max_seqlen=int(lengths.max()))
    t = int(offsets[-1])
    x = torch.randn(t, args.hidden, generator=gen).to(dev)
    grad = torch.randn(t, args.hidden, generator=gen).to(dev)
    torch.manual_seed(0)
    ref = HSTULayer(args.hidden, args.heads, args.head_dim, args.dropout).to(dev)
    flops = step_flops(StackShape(1, args.hidden, args.heads, args.head_dim), lengths).total
    autocast = cuda and dtype != torch.float32
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if variant not in VARIANTS and variant not in STEP_VARIANTS:
            raise SystemExit(
                f"--variants: unknown {variant!r}; one of {list(VARIANTS) + list(STEP_VARIANTS)}"
            )
        options = VARIANTS.get(variant)
        choices = None
        sdt = dtype if autocast else torch.float32
        try:
            if variant in SILU_VARIANTS:
                fwd, bwd, fwd_bytes, bwd_bytes = _silu_steps(
                    variant, t, args.heads, args.head_dim, dev, sdt, gen
                )
                fwd()
                bwd()  # surfaces a missing kernel before timing

                def step(fwd=fwd, bwd=bwd):
                    fwd()
                    bwd()

            elif variant in CAST_VARIANTS:
                step, cast_bytes = _cast_step(variant, t, args.hidden, dev, sdt, gen)
                step()
            elif variant in GATE_VARIANTS:
                gdt = dtype if autocast else torch.float32
                step = _gate_step(
                    variant, t, args.heads * args.head_dim, args.dropout, dev, gdt, gen
                )
            else:
                if options is None:
                    layer = ref
                else:
                    layer = FusedHSTULayer(
                        args.hidden, args.heads, args.head_dim, args.dropout, **options
                    ).to(dev)
                    layer.load_state_dict(ref.state_dict())
                choices = layer.kernel_choices(dev)
                layer.train()
                xi = x.clone().requires_grad_(True)

                def step(layer=layer, xi=xi):
                    with torch.autocast(dev.type, dtype=dtype, enabled=autocast):
                        out = layer(xi, attn)
                    out.backward(grad)

                step()  # surfaces a missing kernel before timing
        except (RuntimeError, ValueError) as exc:
            emit_json({"variant": variant, "device": name, "error": str(exc)}, args.out)
            continue

        peak = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
        ms = median_ms(step, args.iters, args.warmup, cuda)
        host = _host_ms(step, max(5, args.iters // 2), cuda)
        gate_only = variant in STEP_VARIANTS
        row = {
            "variant": variant,
            "device": name,
            "dtype": args.dtype if autocast else "float32",
            "batch": args.batch,
            "max_len": args.max_len,
            "tokens": t,
            "hidden": args.hidden,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dropout": args.dropout,
            "ms_fwd_bwd": ms,
            "host_ms": host,
            "tflops": None if gate_only else flops / (ms / 1000.0) / 1e12,
            "peak_mem_gb": peak,
        }
        if choices is not None:  # layer variants: what each kernel switch resolved to
            row["kernel_choices"] = choices
        if variant in SILU_VARIANTS:
            ms_f = median_ms(fwd, args.iters, args.warmup, cuda)
            ms_b = median_ms(bwd, args.iters, args.warmup, cuda)
            row.update(
                ms_fwd=ms_f,
                ms_bwd=ms_b,
                gbps_fwd=fwd_bytes / (ms_f / 1000.0) / 1e9,
                gbps_bwd=bwd_bytes / (ms_b / 1000.0) / 1e9,
            )
        if variant in CAST_VARIANTS:
            row["gbps"] = cast_bytes / (ms / 1000.0) / 1e9
        emit_json(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
