"""End-to-end training throughput: the compiled attention vs the PyTorch reference, same run.

Builds the full training stack (data, DMP-sharded embeddings, the HSTU model, optimizers) from a
gin config, runs --warmup then --steps training steps per attention path and prints one JSON
object per line (path, steps/s, samples/s, tokens/s, TFLOP/s per GPU, MFU, peak memory), then a
summary line with the speed-ups. FLOPs are those of `hstu.training.flops` (linears + attention,
forward + backward, actual token lengths).

    python scripts/bench_e2e.py --config configs/synthetic_benchmark_ranking.gin \
        --bindings "EmbeddingArgs.item_capacity=2000000" "EmbeddingArgs.user_capacity=1000000"
    python scripts/bench_e2e.py --nproc 1,2,4 --paths compiled ...   # multi-GPU scaling

The reference path sets HSTU_FORCE_REFERENCE_ATTENTION=1 (a benchmarking-only switch, read
when the model is built: `hstu.models.builder`, `hstu.ops.attention.force_reference_from_env`)
and runs the unfused layer (--reference-fused keeps the fused one, which off the kernel replays
the attention forward in backward). It materialises fp32 [B, H, N, N] scores, so at long lengths
it may not fit: on out-of-memory its per-GPU batch is halved until it does (the row says so in
"batch_per_gpu"); compare samples/s then.

--nproc 1,2,4 runs one torchrun launch per count (same per-GPU batch, so the global batch grows
with N) and prints each launch's rows (with "nproc"; peak memory is the largest over the ranks)
and then one "scaling" row per path and count: samples/s relative to N=1 measured in the same
invocation, and the per-GPU efficiency. It refuses when fewer GPUs than the largest N are
visible. A single count > 1 (--nproc 8) runs that one launch.

The synthetic data is regenerated with --mean-seq-len / --max-seq-len (heavy-tailed lognormal
lengths) so long-sequence configs see long sequences. --device cpu runs a tiny config on CPU
(smoke test of the script; the reference is the only attention there).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

# run from a checkout: this repository's hstu, not another installed copy; bench_common
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]

from bench_common import base_parser, emit_json, resolve_device, run_launch  # noqa: E402

logger = logging.getLogger("bench_e2e")

GRAPH_SETTLE_STEPS = 20  # graph warm-up goes on until this many steps in a row replayed graphs
# untimed steps on the repeated batch (--repeat-batch) before the timed ones
REPEAT_WARMUP = 3


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(
        __doc__,
        warmup=40,
        steps=20,
        device="auto",
        config="configs/synthetic_benchmark_ranking.gin",
        out="",
        helps={
            "steps": "timed training steps per path",
            "warmup": "untimed steps first (default 40: the steady state of a long run, where "
            "cuBLAS has planned the matmuls of every padded token count the batches produce; "
            "see NetworkArgs.pad_tokens in docs/architecture.md)",
        },
    )
    p.add_argument("--task", default="ranking", choices=("ranking", "retrieval"))
    p.add_argument(
        "--paths",
        default="compiled,reference",
        help="comma list of compiled, reference (reference = HSTU_FORCE_REFERENCE_ATTENTION=1)",
    )
    p.add_argument(
        "--nproc",
        type=_nproc_list,
        default=[1],
        help="GPU counts, e.g. 1,2,4: each count > 1 (or a list) launches this script under "
        "torchrun --nproc_per_node=N (TrainerArgs.train_batch_size is multiplied by N: the "
        "config's value is per GPU); a list also prints the scaling vs N=1",
    )
    p.add_argument(
        "--launch-timeout",
        type=float,
        default=3600.0,
        help="with --nproc: seconds one torchrun launch may take (0: no limit); a launch still "
        "going then prints every process's Python stack, is stopped, and its row says so",
    )
    p.add_argument(
        "--reference-fused",
        action="store_true",
        help="keep NetworkArgs.fused_layer for the reference path too (default: the reference "
        "path runs the unfused layer, whose autograd keeps the reference attention's graph "
        "instead of replaying its forward in backward as the fused layer does off the kernel)",
    )
    p.add_argument("--mean-seq-len", type=float, default=1024.0)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--num-users", type=int, default=2000, help="synthetic users (samples)")
    p.add_argument(
        "--profile",
        default="",
        metavar="DIR",
        help="after the timed steps, run --profile-steps more under torch.profiler on every "
        "rank: writes DIR/<path>_trace.json.gz (rank 0; DIR/<path>_rank<r>_trace.json.gz for "
        "the others; chrome://tracing, Perfetto) and prints rank 0's "
        '"profile" row: GPU kernel time vs step time per step and the top kernels (with CUDA '
        f"graphs, profiled again, up to {PROFILE_RETRIES} times more, while the profiled steps "
        "captured a graph)",
    )
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument(
        "--graph-warmup",
        type=int,
        default=400,
        help="with NetworkArgs.cuda_graphs: up to this many warm-up steps more, until "
        f"{GRAPH_SETTLE_STEPS} steps in a row replayed a captured graph (the steady state of a "
        "long run; the row gives warmup_steps)",
    )
    p.add_argument(
        "--issue-probes",
        type=int,
        default=15,
        help="after the timed steps, this many more steps each issued into an idle GPU's empty "
        "queue: the median host time to issue one is host_issue_alone_ms (the host's own cost; "
        "the timed loop's host_issue_ms_per_step reaches the step time whenever the launch "
        "queue is full, host-bound or not), the fastest and slowest host_issue_alone_range_ms; "
        "0 = skip",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="with --profile: also record Python call stacks (python_function events in the "
        "trace: which Python code issues the host work; slows the profiled steps)",
    )
    p.add_argument(
        "--profile-gpu-only",
        action="store_true",
        help="with --profile: record the GPU activity and the CUDA calls only, not the CPU "
        "operators (the host then runs close to its unprofiled speed, so the GPU's idle gaps are "
        "those of the timed steps; gaps are named by the kernels around them)",
    )
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, N more steps each issued into an idle GPU under cProfile, "
        "the backward on the calling thread (torch.autograd.set_multithreading_enabled(False)) "
        "so that its Python is profiled too: host_profile lists the functions taking the most "
        "host time per step (own time and with callees); with --profile DIR the whole table "
        "goes to DIR/<path>_host_profile.txt",
    )
    p.add_argument(
        "--repeat-batch",
        action="store_true",
        help="after the warm-up on the data stream, train every further step (timed, probes, "
        f"profile) on one batch, the stream's next, after {REPEAT_WARMUP} untimed steps on it "
        "(a CUDA graph of its shape is captured there): runs of other settings (eager or "
        "graphs, old or new code) then time the same work, and a profile's kernels compare "
        "step for step; one process only",
    )
    p.add_argument(
        "--find-syncs",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, run N more with torch.cuda.set_sync_debug_mode('warn') and "
        "report each call that made the host wait for the GPU by call site (sync_sites: the "
        "innermost frame inside hstu/, the call, count per step); each such wait drains the "
        "launch queue, so the GPU idles while the host issues what follows",
    )
    p.add_argument(
        "--memory-history",
        action="store_true",
        help="record the CUDA allocator's history over each path's whole run (slower) and "
        "report memory_peak_breakdown: the tensors alive at the run's allocated peak "
        "(peak_mem_gb_run), GB by the innermost frame in hstu/ or scripts/ that allocated them",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.profile_steps < 1:
        p.error("--steps and --profile-steps must be >= 1")
    for name in (
        "warmup", "graph_warmup", "issue_probes", "find_syncs", "host_profile", "launch_timeout"
    ):  # fmt: skip
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.profile_stack and not args.profile:
        p.error("--profile-stack needs --profile DIR (it adds Python stacks to that trace)")
    if args.profile_gpu_only and not args.profile:
        p.error("--profile-gpu-only needs --profile DIR")
    if args.repeat_batch and any(n > 1 for n in args.nproc):
        p.error("--repeat-batch runs on one process (a batch's ids go to other ranks once)")
    if args.profile_gpu_only and args.profile_stack:
        p.error("--profile-gpu-only records no CPU operators, so no Python stacks: drop one")
    return args


def _nproc_list(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"--nproc {text!r}: give distinct positive GPU counts, e.g. 1 or 1,2,4"
        )
    return counts


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv minus ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == name:
            skip = True
        elif not tok.startswith(name + "="):
            out.append(tok)
    return out


def _sweep(args: argparse.Namespace, argv: list[str]) -> int:
    """One torchrun launch per GPU count; then the scaling rows."""
    import tempfile

    counts = args.nproc
    if args.device != "cpu":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < max(counts):
            raise SystemExit(
                f"bench_e2e: --nproc {','.join(map(str, counts))} needs {max(counts)} GPUs but "
                f"{have} are visible (CUDA_VISIBLE_DEVICES); drop the larger counts or use "
                "--device cpu (gloo)"
            )
    base = _without_option(_without_option(argv, "--nproc"), "--out")
    rows: dict[int, list[dict]] = {}
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
            out = os.path.join(tmp, "rows.jsonl")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={n}",
                os.path.abspath(__file__),
                *base,  # no --nproc here: torchrun's parser would take it for its own flags
                "--out",
                out,
            ]
            proc, stopped = run_launch(
                cmd,
                args.launch_timeout or None,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            if proc.returncode != 0 or stopped:
                # a stopped launch: every rank's stacks, which take more room than an error
                sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-(40000 if stopped else 6000) :])
                why = (
                    f"did not finish within {args.launch_timeout:g} s (--launch-timeout; the "
                    "processes' stacks are on stderr)"
                    if stopped
                    else f"launch failed (exit {proc.returncode})"
                )
                emit_json({"nproc": n, "error": why}, args.out)
                rows[n] = []
                continue
            with open(out) as f:
                rows[n] = [json.loads(line) for line in f if line.strip()]
        for row in rows[n]:
            emit_json({"nproc": n, **row}, args.out)
    paths = {r["path"] for rs in rows.values() for r in rs if "path" in r}
    for path in sorted(paths):
        by_n = {
            n: next((r for r in rs if r.get("path") == path and "error" not in r), None)
            for n, rs in rows.items()
        }
        one = by_n.get(1)
        for n in counts:
            r = by_n.get(n)
            if r is None:
                continue
            scale = r["samples_per_s"] / one["samples_per_s"] if one else None
            emit_json(
                {
                    "summary": "scaling",
                    "path": path,
                    "nproc": n,
                    "samples_per_s": r["samples_per_s"],
                    "tflops_per_gpu": r["tflops_per_gpu"],
                    "peak_mem_gb": r.get("peak_mem_gb"),
                    "batch_per_gpu": r["batch_per_gpu"],
                    "scaling_vs_1": scale,
                    "efficiency": scale / n if scale is not None else None,
                    "same_batch_per_gpu": one is not None
                    and one["batch_per_gpu"] == r["batch_per_gpu"],
                },
                args.out,
            )
    return 0 if all(rows.values()) else 1


def _patch_data(args: argparse.Namespace) -> None:
    """Long heavy-tailed synthetic sequences for the benchmark (the config's generator is capped)."""
    import hstu.training.trainer as trainer_mod
    from hstu.data.synthetic import generate_synthetic

    original = trainer_mod.load_sequence_data

    def load(dataset_args, num_tasks: int = 8):
        if dataset_args.dataset_name != "synthetic":
            return original(dataset_args, num_tasks=num_tasks)
        return generate_synthetic(
            num_users=args.num_users,
            num_items=int(dataset_args.synthetic_num_items),
            seed=int(dataset_args.synthetic_seed),
            num_tasks=num_tasks,
            mean_seq_len=args.mean_seq_len,
            max_seq_len=args.max_seq_len,
        )

    trainer_mod.load_sequence_data = load


def _run_path(path: str, args: argparse.Namespace, device_type: str, world: int) -> dict:
    from hstu.config.gin_utils import load_config
    from hstu.training.trainer import Trainer

    os.environ["HSTU_FORCE_REFERENCE_ATTENTION"] = "1" if path == "reference" else "0"
    cfg0 = load_config(args.task, [args.config], list(args.bindings))
    per_gpu = cfg0.trainer.train_batch_size
    while True:
        bindings = list(args.bindings) + [
            f"TrainerArgs.train_batch_size={per_gpu * world}",
            f"TrainerArgs.max_train_iters={args.warmup + args.steps}",
            "TrainerArgs.log_dir='/tmp/hstu_bench_e2e'",
            f"TrainerArgs.run_name='{path}-{os.getpid()}'",
            "TrainerArgs.ckpt_save_interval=-1",
            "TrainerArgs.progress_bar=False",
        ]
        if path == "reference" and not args.reference_fused:
            bindings.append("NetworkArgs.fused_layer=False")
        cfg = load_config(args.task, [args.config], bindings)
        trainer = None
        try:
            trainer = Trainer(cfg, device_type)
            row = _time_trainer(trainer, args, path)
            emb = cfg.embedding
            row.update(
                path=path,
                batch_per_gpu=per_gpu,
                fused_layer=cfg.network.fused_layer,
                cuda_graphs=cfg.network.cuda_graphs,
                embedding_backend=emb.embedding_backend,
                storage=emb.storage,
                item_capacity=emb.item_capacity,
            )
            if args.profile:  # every rank runs (and traces) the steps: they hold collectives
                summary = _profile(trainer, args, path)
                if trainer.info.is_main:
                    row["profile"] = summary
            return row
        except torch.OutOfMemoryError:
            if per_gpu <= 1:
                return {"path": path, "error": "out of memory at batch 1 per GPU"}
            logger.warning("%s: out of memory at %d per GPU; halving", path, per_gpu)
            per_gpu //= 2
        finally:
            if trainer is not None:
                trainer.train_iter.close()  # stops the batch-prefetch thread
                trainer.tb.close()
            del trainer
            gc.collect()
            if device_type == "cuda":
                torch.cuda.empty_cache()


# With CUDA graphs, profiles taken again (at most this many more) while the profiled steps
# captured a graph and fewer than two pairs of consecutive steps captured nothing: a capturing
# step also runs its warm-up passes eagerly, so its kernels count about twice; the "steady_"
# figures (_steady_steps) leave such steps out.
PROFILE_RETRIES = 3


def _profile(trainer, args: argparse.Namespace, path: str) -> dict:
    """`_profile_once`, repeated while the profiled steps captured a graph (at most
    `PROFILE_RETRIES` times more; each retry overwrites the trace); the summary says how many
    profiles it took (``profile_attempts``). Graphs run on one process only, so every rank of a
    multi-process run profiles once."""
    attempts = 0
    while True:
        attempts += 1
        summary = _profile_once(trainer, args, path)
        steady = summary.get("steady_steps", 0) >= 2
        if not summary.get("graph_captures_profiled") or steady or attempts > PROFILE_RETRIES:
            return {**summary, "profile_attempts": attempts}


def _profile_once(trainer, args: argparse.Namespace, path: str) -> dict:
    """--profile-steps steps under torch.profiler, run as `_time_trainer` runs them; summary of
    the exported trace: kernel time vs wall time per step, the largest GPU idle gaps, the top
    kernels."""
    import gzip
    import shutil
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [] if getattr(args, "profile_gpu_only", False) else [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":  # (main refuses --profile-gpu-only off CUDA)
        acts.append(ProfilerActivity.CUDA)
    n = args.profile_steps
    graphs = trainer.graph_stats()
    g0 = dataclasses.replace(graphs) if graphs is not None else None
    _sync(trainer)
    clean = []  # per profiled step: it replayed a graph (or ran without graphs), captured nothing
    with profile(activities=acts, with_stack=args.profile_stack) as prof:
        start = time.perf_counter()
        pending = []
        for i in range(n):
            before = dataclasses.replace(graphs) if graphs is not None else None
            with torch.profiler.record_function(f"{STEP_MARK}{i}"):
                pending.append(trainer._train_step_async())
            clean.append(
                before is None
                or (
                    graphs.captures == before.captures
                    and graphs.eager == before.eager
                    and (graphs.disabled or graphs.replays > before.replays)
                )
            )
        flops = [row["flops"] for row in trainer._resolve(pending)]
        _sync(trainer)
        wall = time.perf_counter() - start
    rank, world = trainer.info.rank, trainer.info.world_size
    # one name per world size: a --nproc sweep keeps every launch's traces
    stem = path if world == 1 else f"{path}_w{world}"
    raw = out_dir / (f"{stem}_trace.json" if rank == 0 else f"{stem}_rank{rank}_trace.json")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    events = json.loads(raw.read_text()).get("traceEvents", [])
    raw.unlink()
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"]
    )
    per_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in kernels:
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + e["dur"]
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    idle = 0.0
    if kernels:
        end = kernels[0]["ts"] + kernels[0]["dur"]
        for e in kernels[1:]:
            idle += max(0.0, e["ts"] - end)
            end = max(end, e["ts"] + e["dur"])
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:40]
    host = _host_ops(events)
    phases = _host_phases(events)
    sites = _host_sites(events)
    waits = _host_waits(events)
    gaps = _idle_gaps(events)
    steady = _steady_steps(events, clean, flops, trainer.info.world_size)
    # a profiled step that captured a graph (a token count seen for the first time) also ran its
    # warm-up passes eagerly: its kernels count about twice
    graph_counts = {}
    if g0 is not None:
        captured = graphs.captures - g0.captures
        graph_counts = {
            "graph_captures_profiled": captured,
            "graph_eager_profiled": graphs.eager - g0.eager,
            "graph_resets_profiled": graphs.resets - g0.resets,
            # which shapes were captured, and why (first seen, buffers grew, parameters moved)
            "graph_captured_profiled": graphs.recent_captures[-captured:] if captured else [],
        }
    return {
        "trace": f"{raw}.gz",
        "steps": n,
        **graph_counts,
        "step_ms_profiled": 1e3 * wall / n,
        # the GPU's view of the steps that captured nothing (module docstring of _steady_steps)
        **steady,
        "kernel_ms_per_step": sum(per_name.values()) / 1e3 / n,
        "gpu_idle_ms_per_step_between_kernels": idle / 1e3 / n,
        "kernels_per_step": len(kernels) / n,
        # [name, ms per step, calls per step]
        "top_kernels_ms_per_step": [[name[:120], t / 1e3 / n, calls[name] / n] for name, t in top],
        # host side: operators called from Python (not nested in another operator) per step,
        # and the ones taking the most host time (inclusive of what they dispatch)
        "host_ops_per_step": host["count"] / n,
        "host_op_ms_per_step": host["total_us"] / 1e3 / n,
        "top_host_ops_ms_per_step": [
            [name[:80], t / 1e3 / n, c / n] for name, (t, c) in host["top"]
        ],
        # host time inside the code's own record_function labels ("hstu/forward",
        # "hstu/step_graphs/table_lookup", ...; each inclusive of the labels inside it):
        # [label, ms per step, calls per step], largest first
        "host_phases_ms_per_step": [[name, t / 1e3 / n, c / n] for name, (t, c) in phases],
        # with --profile-stack: the same top-level operators by the innermost frame of the hstu
        # package that called them (which code issues the host work)
        **(
            {
                "top_host_sites_ms_per_step": [
                    [name[:140], t / 1e3 / n, c / n] for name, (t, c) in sites["top"]
                ]
            }
            if sites["top"]
            else {}
        ),
        # where the host blocks on the GPU: blocking calls per step, their time, the top ones
        # as "operator <- call"
        "host_waits_per_step": waits["count"] / n,
        "host_wait_ms_per_step": waits["total_us"] / 1e3 / n,
        "top_host_waits_ms_per_step": [
            [name[:100], t / 1e3 / n, c / n] for name, (t, c) in waits["top"]
        ],
        # where the GPU idles: its gaps charged to the operators that issued the work ending
        # them ("top-level operator > innermost operator" on the issuing thread)
        "idle_gaps_per_step": gaps["count"] / n,
        "idle_gap_ms_per_step": gaps["total_us"] / 1e3 / n,
        # of it: the host had not yet asked for the next work / had, and the GPU still waited
        "idle_gap_ms_per_step_host_late": gaps["host_late_us"] / 1e3 / n,
        "idle_gap_ms_per_step_launched_before": gaps["launched_before_us"] / 1e3 / n,
        "top_idle_gaps_ms_per_step": [
            [name[:140], t / 1e3 / n, c / n] for name, (t, c) in gaps["top"]
        ],
    }


class _Nest:
    """One thread's properly nested trace events (CPU operators or Python frames), sorted by
    start, an enclosing event before the ones it encloses (longer first at equal starts), with
    the top-level ones apart: which events enclose a span is then found by bisection."""

    def __init__(self, evs: list) -> None:
        self.evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
        self.tops, end = [], float("-inf")
        for e in self.evs:
            if e["ts"] >= end:  # not inside the previous top-level event
                end = e["ts"] + e["dur"]
                self.tops.append(e)

    @staticmethod
    def _last_from(evs: list, ts: float) -> int:
        return bisect.bisect_right(evs, ts, key=lambda e: e["ts"]) - 1

    def top(self, ts: float, dur: float) -> dict | None:
        """The top-level event enclosing [ts, ts + dur] (None if none does)."""
        i = self._last_from(self.tops, ts)
        if i >= 0 and self.tops[i]["ts"] + self.tops[i]["dur"] >= ts + dur:
            return self.tops[i]
        return None

    def innermost(self, ts: float, dur: float) -> dict | None:
        """The latest-starting event enclosing [ts, ts + dur] (None if none does): walks back
        from the last event starting by ts, at most to the enclosing top-level one."""
        top = self.top(ts, dur)
        if top is None:
            return None
        i = self._last_from(self.evs, ts)
        while self.evs[i] is not top and self.evs[i]["ts"] + self.evs[i]["dur"] < ts + dur:
            i -= 1
        return self.evs[i]


def _nests(events: list, keep) -> dict:
    """`_Nest` per (pid, tid) of the trace events with a duration that ``keep`` accepts."""
    by_thread: dict = {}
    for e in events:
        if "dur" in e and keep(e):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    return {tid: _Nest(evs) for tid, evs in by_thread.items()}


def _ops_by_thread(events: list) -> dict:
    """The `cpu_op` events of a chrome trace, a `_Nest` per thread."""
    return _nests(events, lambda e: e.get("cat") == "cpu_op")


def _hstu_frames(events: list) -> dict:
    """The python_function events (recorded with --profile-stack) of the hstu package, a `_Nest`
    per thread."""
    return _nests(
        events,
        lambda e: e.get("cat") == "python_function" and _is_hstu_frame(str(e.get("name"))),
    )


def _top_by(key, ops: dict) -> list:
    """Top-level operators of ``ops`` (`_ops_by_thread`) summed by ``key(tid, op)``: [(key,
    (total us, count))], largest first."""
    per: dict[str, list] = {}
    for tid, nest in ops.items():
        for e in nest.tops:
            acc = per.setdefault(key(tid, e), [0.0, 0])
            acc[0] += e["dur"]
            acc[1] += 1
    return sorted(((k, (v[0], v[1])) for k, v in per.items()), key=lambda kv: -kv[1][0])


def _host_ops(events: list) -> dict:
    """Top-level CPU operators of a chrome trace: the `cpu_op` events not inside another one
    on the same thread."""
    ops = _ops_by_thread(events)
    tops = [e for nest in ops.values() for e in nest.tops]
    top = _top_by(lambda tid, e: e["name"], ops)[:15]
    return {"count": len(tops), "total_us": sum(e["dur"] for e in tops), "top": top}


def _host_phases(events: list) -> list[tuple[str, tuple[float, int]]]:
    """(label, (host microseconds, calls)) of the trace's record_function labels of the hstu
    code (names starting "hstu/"), largest first: where a step's host time goes by phase."""
    acc: dict[str, list[float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith("hstu/") and "dur" in e:
            total = acc.setdefault(name, [0.0, 0])
            total[0] += e["dur"]
            total[1] += 1
    return sorted(((k, (t, int(c))) for k, (t, c) in acc.items()), key=lambda kv: -kv[1][0])


def _host_sites(events: list) -> dict:
    """The top-level CPU operators (as `_host_ops`) grouped by the innermost hstu frame around
    each (`_python_site`); empty without Python stacks in the trace."""
    frames = _hstu_frames(events)
    if not frames:
        return {"top": []}

    def site(tid, e):
        return _python_site(frames.get(tid), e["ts"], e["dur"]) or "(outside hstu)"

    return {"top": _top_by(site, _ops_by_thread(events))[:20]}


STEP_MARK = "bench_step_"  # record_function name of profiled step i: STEP_MARK + str(i)


def _steady_steps(
    events: list, clean: list[bool], flops: list[float] | None = None, world: int = 1
) -> dict:
    """GPU time of the profiled steps that captured nothing (``clean[i]``), from a chrome trace
    whose steps were issued inside `STEP_MARK` annotations: every kernel, copy and fill is charged
    to the step during whose host range it was issued, from any thread (CUDA runtime call ->
    correlation id -> GPU event; the step waits for its backward, which autograd's threads
    launch).
    A step's GPU period runs from its first GPU event to the next step's; periods are taken where
    both steps are clean. Per step: ``steady_gpu_step_ms`` (mean period), ``steady_kernel_ms``,
    ``steady_copy_ms`` (copies and fills, which are not kernels), ``steady_gpu_idle_ms`` (period
    less both: the GPU waiting for the host), over ``steady_steps`` periods; with the steps'
    ``flops`` (all ranks), ``steady_tflops_per_gpu`` (over the periods) and
    ``steady_kernel_tflops_per_gpu`` (over the kernel time alone), which compare runs whose
    profiled batches differ."""
    marks = sorted(
        (e for e in events if str(e.get("name", "")).startswith(STEP_MARK) and "dur" in e
         and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )  # fmt: skip
    step_of_corr: dict = {}
    for e in events:
        # runtime and driver API calls: cuBLAS launches its kernels through the driver API
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "dur" not in e:
            continue
        corr = e.get("args", {}).get("correlation")
        for m in marks:  # any thread: the backward's launches come from autograd's threads
            if m["ts"] <= e["ts"] <= m["ts"] + m["dur"]:
                step_of_corr[corr] = int(m["name"][len(STEP_MARK) :])
                break
    n = len(clean)
    first = [None] * n
    kern, copy = [0.0] * n, [0.0] * n
    for e in events:
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        i = step_of_corr.get(e.get("args", {}).get("correlation"))
        if i is None or i >= n:
            continue
        first[i] = e["ts"] if first[i] is None else min(first[i], e["ts"])
        if cat == "kernel":
            kern[i] += e["dur"]
        else:
            copy[i] += e["dur"]
    pairs = [
        i for i in range(n - 1)
        if clean[i] and clean[i + 1] and first[i] is not None and first[i + 1] is not None
    ]  # fmt: skip
    if not pairs:
        return {"steady_steps": 0}
    period = sum(first[i + 1] - first[i] for i in pairs) / len(pairs) / 1e3
    k = sum(kern[i] for i in pairs) / len(pairs) / 1e3
    c = sum(copy[i] for i in pairs) / len(pairs) / 1e3
    out = {
        "steady_steps": len(pairs),
        "steady_gpu_step_ms": period,
        "steady_kernel_ms": k,
        "steady_copy_ms": c,
        "steady_gpu_idle_ms": period - k - c,
    }
    if flops is not None and len(flops) == n:
        f = sum(flops[i] for i in pairs) / len(pairs) / max(world, 1)
        out["steady_tflops_per_gpu"] = f / (period * 1e-3) / 1e12 if period > 0 else 0.0
        out["steady_kernel_tflops_per_gpu"] = f / (k * 1e-3) / 1e12 if k > 0 else 0.0
    return out


_GAP_MIN_US = 2.0  # shorter gaps between GPU work are the launch pipeline's own


def _idle_gaps(events: list, min_us: float = _GAP_MIN_US) -> dict:
    """Where the GPU idles in a chrome trace: each gap of at least ``min_us`` in the union of
    kernels, copies and fills (all streams) is charged to the GPU work that ends it, named by the
    operators that issued it: the launch's correlation id gives the runtime or driver call, whose
    thread's top-level and innermost enclosing CPU operators name the site ("top > innermost",
    "(no operator)" outside every operator). The work after a gap is what the host issued too
    late, so these names say which host code the GPU waited for. A trace without CPU operators
    (--profile-gpu-only) names each gap "previous -> next" by the GPU work around it.

    ``host_late_us`` sums the gaps whose next work the host had not asked for when the GPU went
    idle (its launch call started at or after the gap's start: the host was behind);
    ``launched_before_us`` those whose launch came earlier (the GPU waited on something else:
    a dependency between streams, an event, a copy); gaps with no launch event known count in
    neither."""
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"), str(e.get("name")))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    launch = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch[corr] = ((e.get("pid"), e.get("tid")), e["ts"])
    ops = _ops_by_thread(events)
    # a trace without CPU operators (--profile-gpu-only): the gap is named by the GPU work on
    # both sides of it instead ("previous -> next")
    by_kernels = not ops

    def issuer(corr) -> str:
        if corr not in launch:
            return "(unknown launch)"
        tid, ts = launch[corr]
        nest = ops.get(tid)
        top = nest.top(ts, 0) if nest else None
        if top is None:
            return "(no operator)"
        inner = nest.innermost(ts, 0)
        return top["name"] if inner is top else f"{top['name']} > {inner['name']}"

    count, total, late, before = 0, 0.0, 0.0, 0.0
    per: dict[str, list] = {}
    end = None
    last = ""  # the GPU work that finished last before the gap
    for start, finish, corr, name in gpu:
        if end is not None and start - end >= min_us:
            gap = start - end
            count += 1
            total += gap
            if corr in launch:
                if launch[corr][1] >= end:
                    late += gap
                else:
                    before += gap
            site = f"{last[:60]} -> {name[:70]}" if by_kernels else issuer(corr)
            acc = per.setdefault(site, [0.0, 0])
            acc[0] += gap
            acc[1] += 1
        if end is None or finish >= end:
            end, last = finish, name
    top = sorted(((k, (v[0], v[1])) for k, v in per.items()), key=lambda kv: -kv[1][0])[:15]
    return {
        "count": count,
        "total_us": total,
        "top": top,
        "host_late_us": late,
        "launched_before_us": before,
    }


# CUDA runtime calls that block the host until the GPU reaches them (a device-to-host copy
# into pageable memory waits too; cudaMemcpyAsync counts when it took this long)
_WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_COPY_WAIT_US = 20.0


def _python_site(frames: _Nest | None, ts: float, dur: float) -> str:
    """The innermost of ``frames`` (one thread's hstu frames, `_hstu_frames`) that encloses
    [ts, ts + dur], as "hstu/<file>(<line>): <function>"; "" if none does."""
    best = frames.innermost(ts, dur) if frames is not None else None
    return "" if best is None else _hstu_relative(str(best["name"]))


def _hstu_relative(path: str) -> str:
    """``path`` (a file, or a frame name starting with one) from the hstu package on:
    "hstu/<...>"."""
    path = path.replace("\\", "/")
    return path if path.startswith("hstu/") else "hstu/" + path.rsplit("/hstu/", 1)[1]


def _is_hstu_frame(name: str) -> bool:
    """Whether a python_function event's name ("<file>(<line>): <function>", the file relative
    to the working directory or absolute) is a frame of the hstu package."""
    return name.startswith("hstu/") or "/hstu/" in name.split("(", 1)[0]


def _host_waits(events: list) -> dict:
    """Where the host waits for the GPU in a chrome trace: the blocking CUDA runtime calls
    (synchronisations, and copies that took at least `_COPY_WAIT_US`), each charged to the
    innermost CPU operator around it on its thread ("(none)" outside every operator) and, in a
    trace with Python stacks (--profile-stack), to the innermost frame of the hstu package
    ("... @ hstu/<file>(<line>): <function>"); a copy also names its GPU side's direction and
    memory ("[Memcpy HtoD (Pageable -> Device)]"). A wait
    inside a step stops the host from queueing the next work ahead of the GPU, so the GPU idles
    while the host issues what follows."""
    ops = _ops_by_thread(events)
    frames = _hstu_frames(events)  # Python frames, recorded with --profile-stack
    # the GPU side of each copy names its direction and memory ("Memcpy HtoD (Pageable ->
    # Device)": a pageable source, which the copy call stages and may wait for)
    copy_kind = {
        e.get("args", {}).get("correlation"): e.get("name")
        for e in events
        if e.get("cat") == "gpu_memcpy"
    }
    count, total = 0, 0.0
    per: dict[str, list] = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "dur" not in e:
            continue
        name = e.get("name", "")
        blocking = name in _WAIT_CALLS or (
            name in ("cudaMemcpy", "cudaMemcpyAsync") and e["dur"] >= _COPY_WAIT_US
        )
        if not blocking:
            continue
        tid = (e.get("pid"), e.get("tid"))
        inner = ops[tid].innermost(e["ts"], e["dur"]) if tid in ops else None
        owner = "(none)" if inner is None else inner["name"]
        site = _python_site(frames.get(tid), e["ts"], e["dur"])
        kind = copy_kind.get(e.get("args", {}).get("correlation"))
        count += 1
        total += e["dur"]
        key = f"{owner} <- {name}" + (f" [{kind}]" if kind else "") + (f" @ {site}" if site else "")
        acc = per.setdefault(key, [0.0, 0])
        acc[0] += e["dur"]
        acc[1] += 1
    top = sorted(((k, (v[0], v[1])) for k, v in per.items()), key=lambda kv: -kv[1][0])[:12]
    return {"count": count, "total_us": total, "top": top}


def _sync_site(stack: list, message: str) -> str:
    """A synchronising call's site: the innermost frame of the hstu package (file:line function,
    "(outside hstu)" if none) and the first line of the warning that named the call."""
    where = "(outside hstu)"
    for frame in reversed(stack):
        if "/hstu/" in frame.filename.replace("\\", "/"):
            where = f"{_hstu_relative(frame.filename)}:{frame.lineno} {frame.name}"
            break
    return f"{where} | {message.strip().splitlines()[0][:100] if message.strip() else '?'}"


def _find_syncs(trainer, steps: int) -> list:
    """Runs ``steps`` training steps with CUDA sync debugging on and counts the synchronising
    calls per call site (`_sync_site`), most frequent first, as [site, calls per step]. Calls
    made on the autograd engine's threads are reported where the engine replays their warnings
    (the backward call)."""
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        sites[_sync_site(traceback.extract_stack()[:-1], str(message))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _sync(trainer)
    return [[site, n / steps] for site, n in sites.most_common(20)]


def _sync(trainer) -> None:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def _warm_graphs(trainer, graphs, cap: int) -> int:
    """With CUDA graphs of the encoder, more warm-up steps (at most ``cap``) until
    `GRAPH_SETTLE_STEPS` steps in a row replayed a graph: each token bucket is captured the first
    time it is seen, so a long run's steady state replays nearly every step, while a fixed short
    warm-up would leave captures in the timed steps. Returns the steps added."""

    def settled(streak: int) -> bool:
        return graphs is None or graphs.disabled or streak >= GRAPH_SETTLE_STEPS

    streak = added = 0
    # with several ranks every rank runs as many steps as the slowest to settle (DDP's
    # collectives need the same step count everywhere): one host collective per warm-up step
    world = trainer.info.world_size
    while added < cap and not _all_ranks(settled(streak), world, trainer.device):
        before = None if graphs is None else (graphs.replays, graphs.eager, graphs.captures)
        trainer.train_step()
        added += 1
        if before is not None:  # (None: off here, still warming up on another rank)
            replays, eager, captures = before
            replayed = graphs.replays > replays and graphs.eager == eager
            streak = streak + 1 if replayed and graphs.captures == captures else 0
    return added


def _all_ranks(flag: bool, world: int, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank (one collective when there are several)."""
    if world == 1:
        return flag
    from hstu.training.distributed import all_reduce_sum

    return all_reduce_sum([0.0 if flag else 1.0], device)[0] == 0.0


def _issue_alone(trainer, probes: int, graphs) -> dict:
    """Median host time to issue one training step with the GPU idle and its queue empty
    (synchronised before each): the host's own cost per step, whichever of the two bounds the
    step. With CUDA graphs only the probes that replayed a graph count (a capture or an eager
    step is not the steady state)."""
    if probes < 1:
        return {}
    times = []
    for _ in range(probes):
        _sync(trainer)
        replays = graphs.replays if graphs is not None else 0
        t0 = time.perf_counter()
        pending = trainer._train_step_async()
        took = time.perf_counter() - t0
        trainer._resolve([pending])
        if graphs is None or graphs.disabled or graphs.replays > replays:
            times.append(took)
    _sync(trainer)
    if not times:
        return {"host_issue_alone_ms": None}
    times.sort()
    return {
        "host_issue_alone_ms": 1e3 * times[len(times) // 2],
        # the fastest and slowest probe: how far one run's median can move
        "host_issue_alone_range_ms": [1e3 * times[0], 1e3 * times[-1]],
        "issue_probes": len(times),
    }


def _host_profile(trainer, args: argparse.Namespace, path: str, steps: int, top: int = 25) -> dict:
    """``steps`` training steps, each issued into an idle GPU (synchronised before it), under
    cProfile with the autograd engine on the calling thread: where the host's time to issue a
    step goes, Python and the torch calls it makes, backward included. Returns the ``top``
    functions by own time and by time with callees, per step; the whole table goes to
    ``<--profile>/<path>_host_profile.txt`` when --profile is given."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    pending = []
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(steps):
            _sync(trainer)
            prof.enable()
            pending.append(trainer._train_step_async())
            prof.disable()
    trainer._resolve(pending)
    _sync(trainer)
    stats = pstats.Stats(prof)
    total = stats.total_tt  # seconds inside the profiled regions

    def name(key) -> str:
        file, line, fn = key
        file = file.replace("\\", "/")
        if "/hstu/" in file:
            file = _hstu_relative(file)
        elif "/site-packages/" in file:
            file = file.rsplit("/site-packages/", 1)[1]
        return f"{file}:{line}({fn})" if line else fn

    rows = [(name(k), tt, ct, nc) for k, (_, nc, tt, ct, _) in stats.stats.items()]

    def table(col: int) -> list:
        picked = sorted(rows, key=lambda r: -r[col])[:top]
        return [[r[0][:120], 1e3 * r[1] / steps, 1e3 * r[2] / steps, r[3] / steps] for r in picked]

    if args.profile:
        from pathlib import Path

        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(200)
        (out / f"{path}_host_profile.txt").write_text(buf.getvalue())
    # [function, own ms per step, ms per step with callees, calls per step]
    return {
        "steps": steps,
        "ms_per_step": 1e3 * total / steps,
        "top_own": table(1),
        "top_cumulative": table(2),
    }


class _OneBatch:
    """The training pipeline's next (batch, sparse input), handed out at every step
    (--repeat-batch); closing and the data position are the pipeline's."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.item = next(pipeline)

    def __iter__(self):
        return self

    def __next__(self):
        return self.item

    def close(self) -> None:
        self.pipeline.close()

    def state_dict(self) -> dict:
        return self.pipeline.state_dict()


def _time_trainer(trainer, args: argparse.Namespace, path: str = "compiled") -> dict:
    # the garbage-collection policy of Trainer.fit (TrainerArgs.gc_interval) applies here too
    graphs = trainer.graph_stats()
    with trainer.gc:
        for _ in range(args.warmup):
            trainer.train_step()
        warmup = args.warmup + _warm_graphs(trainer, graphs, args.graph_warmup)
        if args.repeat_batch:
            trainer.pipeline = _OneBatch(trainer.pipeline)
            for _ in range(REPEAT_WARMUP):
                trainer.train_step()
            warmup += REPEAT_WARMUP
        _sync(trainer)
        g0 = dataclasses.replace(graphs) if graphs is not None else None
        lookups0 = trainer.embeddings.lookup_graph_stats()
        warm_peak = (0.0, 0.0)
        if trainer.device.type == "cuda":
            # the warm-up's peaks (captures included) count in the whole run's
            warm_peak = (
                torch.cuda.max_memory_allocated(trainer.device),
                torch.cuda.max_memory_reserved(trainer.device),
            )
            torch.cuda.reset_peak_memory_stats(trainer.device)
        flops = tokens = samples = 0.0
        start = time.perf_counter()
        # as Trainer.fit runs them: statistics stay on the device and are read back once at the
        # end (inside the timed region), so the host queues step i+1 while the GPU runs step i
        pending = [trainer._train_step_async() for _ in range(args.steps)]
        # host time to issue the steps: close to the step time when the host bounds the step
        # (the GPU waits for it), well below it when the host runs ahead of the GPU
        issued = time.perf_counter() - start
        for stats in trainer._resolve(pending):
            flops += stats["flops"]
            tokens += stats["tokens"]
            samples += stats["samples"]
        _sync(trainer)
        elapsed = time.perf_counter() - start
        g1 = dataclasses.replace(graphs) if graphs is not None else None
        lookups1 = trainer.embeddings.lookup_graph_stats()
        alone = _issue_alone(trainer, args.issue_probes, graphs)
        if args.host_profile:
            alone["host_profile"] = _host_profile(trainer, args, path, args.host_profile)
        if args.find_syncs:  # (main refuses it off CUDA)
            alone["sync_sites"] = _find_syncs(trainer, args.find_syncs)
    world = trainer.info.world_size
    tflops = flops / world / elapsed / 1e12
    graph_row = {}
    if graphs is not None and not graphs.disabled and trainer.device.type == "cuda":
        # CUDA graph captures are one-time costs: counted apart, and the throughput without the
        # seconds they took inside the timed steps given next to the measured one
        timed_capture_s = g1.capture_seconds - g0.capture_seconds
        graph_row = {
            "graph_captures_warmup": g0.captures,
            "graph_capture_s_warmup": round(g0.capture_seconds, 3),
            "graph_captures_timed": g1.captures - g0.captures,
            "graph_capture_s_timed": round(timed_capture_s, 3),
            "graph_replays_timed": g1.replays - g0.replays,
            "graph_eager_timed": g1.eager - g0.eager,
            "graph_resets_timed": g1.resets - g0.resets,
            "graph_recent_captures": g1.recent_captures,  # the last ones, warm-up included
            "tflops_per_gpu_excl_capture": flops
            / world
            / max(elapsed - timed_capture_s, 1e-9)
            / 1e12,
        }
    elif graphs is not None and graphs.disabled:
        graph_row = {"graphs_off": graphs.disabled}
    if lookups0:  # the dynamic tables' lookup graphs (hstu.embeddings.lookup_graphs)
        graph_row.update(
            lookup_graph_captures_warmup=lookups0["captures"],
            lookup_graph_capture_s_warmup=round(lookups0["capture_seconds"], 3),
            lookup_graph_captures_timed=lookups1["captures"] - lookups0["captures"],
            lookup_graph_replays_timed=lookups1["replays"] - lookups0["replays"],
        )
    row = {
        "config": args.config,
        "world_size": world,
        "steps": args.steps,
        "warmup_steps": warmup,
        "repeat_batch": args.repeat_batch,
        "steps_per_s": args.steps / elapsed,
        "samples_per_s": samples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "tokens_per_step": tokens / args.steps,
        "tflops_per_gpu": tflops,
        "step_ms": 1e3 * elapsed / args.steps,
        "host_issue_ms_per_step": 1e3 * issued / args.steps,
        **alone,
        "mfu": tflops / trainer.peak_tflops if trainer.peak_tflops else None,
        "peak_tflops": trainer.peak_tflops,
        **graph_row,
        "device": torch.cuda.get_device_name(trainer.device)
        if trainer.device.type == "cuda"
        else "cpu",
    }
    if row.get("host_issue_alone_ms") is not None:
        row["host_issue_share"] = row["host_issue_alone_ms"] / row["step_ms"]
    if trainer.device.type == "cuda":
        # allocated: the tensors alive at the peak; reserved: the device memory the caching
        # allocator held, which also counts a CUDA graph pool's memory (a replay allocates
        # nothing, so the graphs' activations show as allocated only while a capture runs);
        # over the timed steps, and ("_run") over the whole run, warm-up and captures included
        timed = (
            torch.cuda.max_memory_allocated(trainer.device),
            torch.cuda.max_memory_reserved(trainer.device),
        )
        peak = (
            torch.tensor(
                [*timed, max(timed[0], warm_peak[0]), max(timed[1], warm_peak[1])],
                device=trainer.device,
                dtype=torch.float64,
            )
            / 2**30
        )
        if dist.is_initialized() and world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest rank
        row["peak_mem_gb"] = float(peak[0])
        row["peak_reserved_gb"] = float(peak[1])
        row["peak_mem_gb_run"] = float(peak[2])
        row["peak_reserved_gb_run"] = float(peak[3])
    if dist.is_initialized() and world > 1:  # the slowest rank's host
        from hstu.training.distributed import host_group

        t = torch.tensor([row["host_issue_ms_per_step"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group()[1])
        row["host_issue_ms_per_step"] = float(t)
    return row


def _alloc_site(frames: list) -> str:
    """The innermost frame of ``frames`` (a memory history's Python stack, innermost first)
    in hstu/ or scripts/, as "file.py:line:function"; the innermost frame otherwise."""
    own = [f for f in frames if "/hstu/" in f["filename"] or "/scripts/" in f["filename"]]
    f = (own or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"


def _live_at_peak(trace: list, take: str, give: str) -> tuple[int, int, dict]:
    """Replays ``trace`` (a memory history's entries) counting the bytes of entries whose action
    is ``take`` until one whose action is ``give`` names the same address: the peak, the index
    of the entry that made it (-1 if none), and the entries alive there by address."""
    live: dict[int, dict] = {}
    total, peak, peak_at = 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == take:
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == give and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    alive: dict[int, dict] = {}
    for e in trace[: peak_at + 1]:
        if e["action"] == take:
            alive[e["addr"]] = e
        elif e["action"] == give:
            alive.pop(e["addr"], None)
    return peak, peak_at, alive


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 12) -> dict:
    """The tensors alive at the allocated peak of a `torch.cuda.memory._snapshot()` taken with
    the history on: ``peak_gb`` (those the history saw allocated, plus ``before_history_gb``,
    blocks still alive that it never saw), ``by_site_gb`` (the ``top`` allocation sites by
    size, `_alloc_site`) and ``peak_site`` (the stack of the allocation that made the peak);
    for the device memory held (segments): ``reserved_seen_peak_gb``, the segments held there by
    the site whose allocation made each (``reserved_by_site_gb``) and ``reserved_peak_site``."""
    trace = snapshot["device_traces"][device]
    seen = {e["addr"] for e in trace if e["action"] == "alloc"}
    before = sum(
        b["size"]
        for seg in snapshot["segments"]
        if seg.get("device", device) == device
        for b in seg["blocks"]
        if b["state"] == "active_allocated" and b["address"] not in seen
    )
    peak, peak_at, alive = _live_at_peak(trace, "alloc", "free_requested")
    sites: dict[str, int] = {}
    for e in alive.values():
        site = _alloc_site(e.get("frames", []))
        sites[site] = sites.get(site, 0) + e["size"]
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    # the device memory the allocator held (segments), at its peak, by the site whose
    # allocation made each segment
    held_peak, held_at, open_segs = _live_at_peak(trace, "segment_alloc", "segment_free")
    held_sites: dict[str, int] = {}
    for e in open_segs.values():
        site = _alloc_site(e.get("frames", []))
        held_sites[site] = held_sites.get(site, 0) + e["size"]
    held_ranked = sorted(held_sites.items(), key=lambda kv: -kv[1])[:top]
    return {
        "reserved_seen_peak_gb": round(held_peak / 2**30, 3),
        "reserved_by_site_gb": {k: round(v / 2**30, 3) for k, v in held_ranked},
        "reserved_peak_site": [_alloc_site([f]) for f in trace[held_at].get("frames", [])][:8]
        if held_at >= 0
        else [],
        "peak_gb": round((peak + before) / 2**30, 3),
        "before_history_gb": round(before / 2**30, 3),
        "by_site_gb": {k: round(v / 2**30, 3) for k, v in ranked},
        "peak_site": [_alloc_site([f]) for f in trace[peak_at].get("frames", [])][:8]
        if peak_at >= 0
        else [],
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if "LOCAL_RANK" not in os.environ and (len(args.nproc) > 1 or args.nproc[0] > 1):
        return _sweep(args, list(argv if argv is not None else sys.argv[1:]))
    device_type = resolve_device(args.device)
    if args.find_syncs and device_type != "cuda":
        raise SystemExit(
            f"--find-syncs needs a CUDA device (CUDA sync debugging); this run is on {device_type}: "
            "drop the flag or run on a GPU"
        )
    if args.memory_history and device_type != "cuda":
        raise SystemExit(
            f"--memory-history records the CUDA allocator; this run is on {device_type}: drop "
            "the flag or run on a GPU"
        )
    if args.profile_gpu_only and device_type != "cuda":
        raise SystemExit(
            f"--profile-gpu-only traces GPU work only; this run is on {device_type}: drop the "
            "flag (a CPU run profiles its operators without it) or run on a GPU"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _patch_data(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    for p in paths:
        if p not in ("compiled", "reference"):
            raise SystemExit(f"--paths: unknown path {p!r}; use compiled and/or reference")
    if device_type == "cpu" and "compiled" in paths:
        paths = [p for p in paths if p != "compiled"] or ["reference"]
    rows = {}
    for p in paths:
        if args.memory_history:
            # each path's history alone (a second path would otherwise replay the first's too)
            torch.cuda.memory._record_memory_history(
                max_entries=5_000_000, stacks="python", clear_history=True
            )
        rows[p] = _run_path(p, args, device_type, world)
        if args.memory_history:
            rows[p]["memory_peak_breakdown"] = peak_breakdown(
                torch.cuda.memory._snapshot(), torch.cuda.current_device()
            )
            torch.cuda.memory._record_memory_history(enabled=None)
        if rank == 0:
            emit_json(rows[p], args.out)
    if rank == 0 and {"compiled", "reference"} <= rows.keys():
        c, r = rows["compiled"], rows["reference"]
        if "error" not in c and "error" not in r:
            emit_json(
                {
                    "summary": "compiled vs reference",
                    "speedup_steps_per_s": c["steps_per_s"] / r["steps_per_s"],
                    "speedup_samples_per_s": c["samples_per_s"] / r["samples_per_s"],
                    "same_batch": c["batch_per_gpu"] == r["batch_per_gpu"],
                },
                args.out,
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
