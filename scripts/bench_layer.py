"""One HSTU layer, forward + backward: FusedHSTULayer (each recompute option) vs the unfused
HSTULayer, same weights and inputs, same run. One JSON object per line:

    python scripts/bench_layer.py                         # GPU: bf16 autocast, compiled attention
    python scripts/bench_layer.py --device cpu --batch 4 --max-len 128 --hidden 64 --head-dim 32

"fused_eager" is the fused layer with its elementwise stages left eager (on CUDA they are
torch.compiled by default; on CPU always eager). Lengths are randint(N // 2, N + 1) from seed 0 (DESIGN.md benchmarks). Time is the median of
--iters forward+backward calls after --warmup (CUDA events on GPU, perf_counter on CPU); FLOPs
as in `hstu.training.flops` for one layer (linears + attention, forward + backward); peak memory
is the CUDA peak of one forward+backward above the inputs and weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hstu.modules.fused_hstu_layer import FusedHSTULayer, set_stage_compile  # noqa: E402
from hstu.modules.hstu_layer import AttentionInputs, HSTULayer  # noqa: E402
from hstu.training.flops import StackShape, step_flops  # noqa: E402

VARIANTS = {
    "unfused": None,
    "fused": (False, False),
    "fused_eager": (False, False),  # elementwise stages not torch.compiled
    "fused_recompute_ln": (True, False),
    "fused_recompute_silu": (False, True),
    "fused_recompute_both": (True, True),
}


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000.0 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    args = _parse(argv)
    dev = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
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
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown {variant!r}; one of {list(VARIANTS)}")
        rec = VARIANTS[variant]
        if rec is None:
            layer = ref
        else:
            layer = FusedHSTULayer(
                args.hidden,
                args.heads,
                args.head_dim,
                args.dropout,
                recompute_input_layernorm=rec[0],
                recompute_uvqk_silu=rec[1],
            ).to(dev)
            layer.load_state_dict(ref.state_dict())
        layer.train()
        set_stage_compile(variant != "fused_eager")
        xi = x.clone().requires_grad_(True)

        def step(layer=layer, xi=xi):
            with torch.autocast(dev.type, dtype=dtype, enabled=autocast):
                out = layer(xi, attn)
            out.backward(grad)

        peak = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
        ms = _time(step, args.iters, args.warmup, cuda)
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
            "ms_fwd_bwd": ms,
            "tflops": flops / (ms / 1000.0) / 1e12,
            "peak_mem_gb": peak,
        }
        line = json.dumps(row)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
