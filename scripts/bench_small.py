"""Wall time of a whole training run of a small public-dataset config, as a user runs it.

The models most users train first (MovieLens, Amazon, Yelp: a few layers, width ~50, batch 128)
are limited by the host, not the GPU, so their throughput is tracked as a run: start-up (data
and model), the training steps, and the evaluations, each timed separately, plus steps/s and
samples/s of the training steps alone (and of the steady state, ``steady_samples_per_s``) and the
final metrics.

    python -m hstu.data.prepare --dataset sequences --source ml-1m.txt.gz --output data/ml-1m
    python scripts/bench_small.py --config configs/ml_1m_retrieval.gin --steps 10000 --evals 5
    python scripts/bench_small.py --config configs/amazon_beauty_retrieval.gin --steps 2000 --evals 1

One JSON object per line: config, steps, evals, startup_s, train_s, eval_s, wall_s, steps_per_s,
samples_per_s, the first window's step time (``first_steps_ms``, includes one-time costs such as
compilation) against the rest (``steady_step_ms``), the final metrics and the device.
``--bindings`` adds gin bindings (e.g. "OptimizerArgs.learning_rate=5e-4").

``--processes N`` runs N copies of the run at once on the same device, as a sweep shares one
GPU: each copy starts its training when all have started up (a barrier), and one row reports
each copy's samples/s, their sum, and the samples of all over the span from the common start to
the last copy's end (``fit_window_samples_per_s``, evaluations inside that span included).

    python scripts/bench_small.py --config configs/amazon_beauty_retrieval.gin --steps 2000 \
        --processes 8
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

# run from a checkout: this repository's hstu, not another installed copy; bench_common
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]

from bench_common import base_parser, emit_json, resolve_device  # noqa: E402


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(
        __doc__,
        steps=2000,
        device="auto",
        config="configs/ml_1m_retrieval.gin",
        out="",
    )
    p.add_argument("--task", default="retrieval", choices=("ranking", "retrieval"))
    p.add_argument(
        "--evals", type=int, default=1, help="evaluations: every steps/evals steps (>= 1)"
    )
    p.add_argument(
        "--first-steps",
        type=int,
        default=50,
        help="steps counted as the first window (one-time costs land there)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="after the run, --profile-steps more steps under torch.profiler; the trace goes to "
        "this directory and a summary (GPU kernel time vs step time, top kernels and host "
        'operators) into the row\'s "profile"',
    )
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="with --profile: also record Python call stacks (the row's "
        "top_host_sites_ms_per_step: host time by the hstu code that issued it)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="copies of the run at once on the device (a sweep sharing one GPU); one row for all",
    )
    # a copy started by --processes: the directory of the start barrier and the number of copies
    p.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    p.add_argument("--barrier-parties", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be >= 1 (got {args.processes})")
    if args.processes > 1 and args.profile:
        p.error("--profile profiles one run: leave out --processes")
    if args.profile_stack and not args.profile:
        p.error("--profile-stack needs --profile DIR")
    if args.steps < 1 or args.evals < 1 or args.steps % args.evals:
        p.error(f"--steps ({args.steps}) must be a positive multiple of --evals ({args.evals})")
    if not 0 < args.first_steps < args.steps:
        p.error(f"--first-steps must lie in (0, --steps={args.steps})")
    return args


def run(args: argparse.Namespace) -> dict:
    from hstu.config.gin_utils import load_config
    from hstu.training.trainer import Trainer

    device_type = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        bindings = [
            *args.bindings,
            f"TrainerArgs.max_train_iters={args.steps}",
            f"TrainerArgs.eval_interval={args.steps // args.evals}",
            f"TrainerArgs.log_interval={args.first_steps}",
            "TrainerArgs.ckpt_save_interval=-1",
            "TrainerArgs.progress_bar=False",
            f"TrainerArgs.log_dir='{tmp}'",
            "TrainerArgs.run_name='bench_small'",
        ]
        cfg = load_config(args.task, [args.config], bindings)
        t0 = time.perf_counter()
        trainer = Trainer(cfg, device_type)
        startup = time.perf_counter() - t0
        eval_s = 0.0
        evaluate = trainer.evaluate
        # wall time of each step window, from the trainer's own log points
        marks: list[tuple[int, float]] = []
        scalars = trainer.tb.scalars

        def timed_evaluate():
            nonlocal eval_s
            start = time.perf_counter()
            try:
                return evaluate()
            finally:
                eval_s += time.perf_counter() - start

        def marking_scalars(values, step):
            if "train/loss" in values:
                marks.append((step, time.perf_counter() - eval_s))
            return scalars(values, step)

        trainer.evaluate = timed_evaluate
        trainer.tb.scalars = marking_scalars
        try:
            if args.barrier:
                _wait_for_all(args.barrier, args.barrier_parties)
            fit_start_epoch = time.time()
            t1 = time.perf_counter()
            eval_before = eval_s
            result = trainer.fit()
            fit_s = time.perf_counter() - t1
            profiled = _profile(trainer, args) if args.profile else None
        finally:
            trainer.close()
        train_s = fit_s - (eval_s - eval_before)
        samples = args.steps * cfg.trainer.train_batch_size
        first = marks[0][1] - (t1 - eval_before) if marks else float("nan")
        steady = (
            (marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0])
            if len(marks) > 1
            else float("nan")
        )
        return {
            "config": args.config,
            "steps": args.steps,
            "evals": len(result.evals),
            "batch": cfg.trainer.train_batch_size,
            "startup_s": startup,
            "train_s": train_s,
            "eval_s": eval_s,
            "wall_s": startup + fit_s,
            "steps_per_s": args.steps / train_s,
            "samples_per_s": samples / train_s,
            "first_steps_ms": 1000.0 * first / args.first_steps,
            "steady_step_ms": 1000.0 * steady,
            # the steps after the first window only (one-time costs such as captures excluded)
            "steady_samples_per_s": cfg.trainer.train_batch_size / steady if steady > 0 else 0.0,
            "metrics": result.final_metrics,
            # CUDA graphs of the encoder: captures (one-time, inside train_s) and their seconds
            **_graph_fields(trainer),
            **({"profile": profiled} if profiled else {}),
            "device": torch.cuda.get_device_name() if device_type == "cuda" else "cpu",
            # wall-clock seconds since the epoch: when the training (fit) began and ended
            "fit_start_epoch": fit_start_epoch,
            "fit_end_epoch": fit_start_epoch + fit_s,
        }


BARRIER_TIMEOUT_S = 900.0


def _wait_for_all(directory: str, parties: int) -> None:
    """Marks this copy ready in ``directory`` and waits until ``parties`` copies are."""
    with open(os.path.join(directory, f"ready.{os.getpid()}"), "w"):
        pass
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while len(glob.glob(os.path.join(directory, "ready.*"))) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"bench_small --processes: {parties} copies did not all start within "
                f"{BARRIER_TIMEOUT_S:.0f} s (see the other copies' errors)"
            )
        time.sleep(0.01)


def _copy_argv(args: argparse.Namespace, barrier: str) -> list[str]:
    """The command line of one copy of the run (``args`` without --processes and --out)."""
    argv = [sys.executable, os.path.abspath(__file__), "--config", args.config]
    argv += ["--device", args.device, "--steps", str(args.steps), "--task", args.task]
    argv += ["--evals", str(args.evals), "--first-steps", str(args.first_steps)]
    argv += ["--barrier", barrier, "--barrier-parties", str(args.processes)]
    return argv + ["--bindings", *args.bindings]


def run_copies(args: argparse.Namespace) -> dict:
    """``args.processes`` copies of the run at once (`run` in each), summarised in one row."""
    n = args.processes
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as barrier:
        outs = [open(os.path.join(barrier, f"copy{k}.out"), "w+") for k in range(n)]
        logs = [open(os.path.join(barrier, f"copy{k}.err"), "w+") for k in range(n)]
        procs = [
            subprocess.Popen(_copy_argv(args, barrier), stdout=outs[k], stderr=logs[k])
            for k in range(n)
        ]
        try:
            texts = _collect(procs, outs, logs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for f in outs + logs:
                f.close()
    rows = [json.loads(text.strip().splitlines()[-1]) for text in texts]
    t0 = min(r["fit_start_epoch"] for r in rows)
    window = max(r["fit_end_epoch"] for r in rows) - t0
    samples = sum(r["steps"] * r["batch"] for r in rows)
    return {
        "config": args.config,
        "processes": n,
        "steps": args.steps,
        "evals": rows[0]["evals"],
        "batch": rows[0]["batch"],
        "wall_s": time.perf_counter() - start,
        # each copy's training alone (its evaluations excluded), as in a one-copy row
        "samples_per_s": [r["samples_per_s"] for r in rows],
        "steady_step_ms": [r["steady_step_ms"] for r in rows],
        "sum_samples_per_s": sum(r["samples_per_s"] for r in rows),
        "startup_s": [r["startup_s"] for r in rows],
        "eval_s": [r["eval_s"] for r in rows],
        # all copies' samples over [the common start, the last copy's end of fit]
        "fit_window_s": window,
        "fit_window_samples_per_s": samples / window,
        # each copy's fit as [start, end] seconds after the common start
        "fit_spans_s": [[r["fit_start_epoch"] - t0, r["fit_end_epoch"] - t0] for r in rows],
        "metrics": [r["metrics"] for r in rows],
        "device": rows[0]["device"],
    }


def _collect(procs: list[subprocess.Popen], outs: list, logs: list) -> list[str]:
    """Each copy's standard output (files ``outs``), once all have exited; the first failure
    raises with the end of its error output (files ``logs``)."""
    texts: list[str | None] = [None] * len(procs)
    while any(t is None for t in texts):
        for k, proc in enumerate(procs):
            if texts[k] is not None or proc.poll() is None:
                continue
            outs[k].seek(0)
            text = outs[k].read()
            if proc.returncode != 0 or not text.strip():
                logs[k].seek(0)
                tail = "".join(logs[k].readlines()[-20:])
                raise RuntimeError(
                    f"bench_small --processes: copy {k} exited with {proc.returncode}:\n{tail}"
                )
            texts[k] = text
        time.sleep(0.05)
    return [t for t in texts if t is not None]


def _profile(trainer, args: argparse.Namespace) -> dict:
    """--profile-steps steps of the trained model under torch.profiler (bench_e2e's summary)."""
    from bench_e2e import _profile as profile_steps

    stem = os.path.splitext(os.path.basename(args.config))[0]
    with trainer.gc:
        return profile_steps(trainer, args, stem)


def _graph_fields(trainer) -> dict:
    stats = trainer.graph_stats()
    # the dynamic tables' lookup graphs (hstu.embeddings.lookup_graphs), where there are any
    lookups = {f"lookup_graph_{k}": v for k, v in trainer.embeddings.lookup_graph_stats().items()}
    if stats is None or trainer.device.type != "cuda":
        return lookups
    if stats.disabled:
        return {"graphs_off": stats.disabled, **lookups}
    return {
        **lookups,
        # what one graph replays: the whole training step or the encoder's forward + backward
        "graph_scope": "step" if getattr(trainer, "step_graphs", None) is not None else "encoder",
        "graph_captures": stats.captures,
        "graph_capture_s": round(stats.capture_seconds, 3),
        "graph_replays": stats.replays,
        "graph_eager_steps": stats.eager,
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = _parse(argv)
    emit_json(run_copies(args) if args.processes > 1 else run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
