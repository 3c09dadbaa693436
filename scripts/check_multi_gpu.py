"""Multi-GPU correctness check: 1 vs N processes give the same loss curve; N -> 1 resume.

Runs the real launcher (scripts/pretrain_gr_ranking.py under torchrun) on the synthetic ranking
config three times per precision:

1. one process, global batch B, S steps;
2. N processes, the same global batch and seed (B / N samples per GPU), S steps, saving a
   checkpoint at step S/2;
3. one process resumed from run 2's step-S/2 checkpoint (saved by N processes) to step S.

and prints one JSON object per precision: the largest relative loss difference over the curves
(smoothed by a trailing mean over --window steps, default 20; raw per-step values are reported
too) and at the last step, for 1 vs N and for the resumed run vs run 2. Exit code 1 when any
smoothed difference exceeds --tolerance (default 1%), 2 when a run fails or the GPUs are missing.

Settings that make the comparison meaningful (set unless --bindings override them):
- NetworkArgs.hidden_dropout=0: dropout masks are drawn per rank, so they differ with N.
- NetworkArgs.scaling_seqlen fixed (max history + candidates): the default (0) normalises the
  attention by the *local* batch's longest sequence, which depends on how the global batch is
  split over ranks.
- precision fp32 runs the attention through the PyTorch reference (the compiled kernel is
  bf16/fp16 only; HSTU_FORCE_REFERENCE_ATTENTION=1), so only reduction order differs; precision
  bf16 is the production path (compiled kernel, bf16 autocast), where bf16 rounding of differently
  ordered sums also enters.

    python scripts/check_multi_gpu.py --nproc 2 --allow-non-a100 --json $OUT/multi_gpu.jsonl
    python scripts/check_multi_gpu.py --device cpu --nproc 2 --steps 20      # gloo, CPU
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# this checkout's hstu, not another installed copy; bench_common next to this file
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from bench_common import base_parser, emit_json, run_launch  # noqa: E402

LAUNCHER = REPO / "scripts" / "pretrain_gr_ranking.py"
PRECISIONS = ("fp32", "bf16")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser(
        __doc__,
        steps=200,
        device="auto",
        config="",
        out="",
        out_aliases=("--json",),
        helps={
            "steps": "training steps of each run",
            "config": "gin file (default: the embedded synthetic one)",
            "bindings": "extra gin bindings",
        },
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) compared with one")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
    p.add_argument(
        "--precision",
        default="",
        help="comma list of fp32, bf16 (default: fp32,bf16 on GPU; fp32 on CPU, which has no "
        "bf16 path)",
    )
    p.add_argument("--tolerance", type=float, default=0.01, help="max relative loss difference")
    p.add_argument(
        "--window",
        type=int,
        default=20,
        help="trailing-mean window (steps) of the compared loss curves; 1 = raw per-step losses",
    )
    p.add_argument("--no-resume", action="store_true", help="skip the N -> 1 resume check")
    p.add_argument("--allow-non-a100", action="store_true", help="passed to the launcher")
    p.add_argument("--work-dir", default="", help="run directories (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=1800.0,
        help="seconds one launcher run may take; a run still going then has every process's "
        "Python stacks written to its log, is stopped, and the check fails showing them (a hung "
        "collective reports where each rank waits)",
    )
    args = p.parse_args(argv)
    if not args.run_timeout > 0:
        p.error(f"--run-timeout must be > 0 seconds (got {args.run_timeout:g})")
    return args


def _trailing_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def relative_differences(
    reference: list[tuple[int, float]], other: list[tuple[int, float]], window: int = 1
) -> dict[str, float | int]:
    """Relative differences |other - reference| / |reference| over the steps both curves have.

    Raw per-step values (``max_rel_diff``, ``rel_diff_final``) and, with ``window`` > 1, those of
    the curves smoothed by a trailing mean over ``window`` steps (``smoothed_*``, compared from
    step ``window`` on): one step's loss is the loss of one mini-batch, and on a GPU the 1- and
    N-process trajectories drift apart chaotically from reduction-order rounding, so the raw
    per-step difference measures batch noise more than agreement of the curves.
    """
    ref, oth = dict(reference), dict(other)
    steps = sorted(set(ref) & set(oth))
    if not steps:
        raise ValueError("the two loss curves share no step")
    rel = [abs(oth[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps]
    worst = max(range(len(steps)), key=rel.__getitem__)
    out = {
        "steps_compared": len(steps),
        "max_rel_diff": rel[worst],
        "max_rel_diff_step": steps[worst],
        "rel_diff_final": rel[-1],
        "final_step": steps[-1],
    }
    if window > 1:
        a = _trailing_mean([ref[s] for s in steps], window)
        b = _trailing_mean([oth[s] for s in steps], window)
        srel = [abs(y - x) / max(abs(x), 1e-12) for x, y in zip(a, b)]
        first = min(window - 1, len(steps) - 1)
        sworst = max(range(first, len(steps)), key=srel.__getitem__)
        out.update(
            smoothing_window=window,
            smoothed_max_rel_diff=srel[sworst],
            smoothed_max_rel_diff_step=steps[sworst],
            smoothed_rel_diff_final=srel[-1],
        )
    return out


def _agree(d: dict, tolerance: float) -> bool:
    """Pass rule: the smoothed curves agree at every compared step (raw values when unsmoothed)."""
    if "smoothed_max_rel_diff" in d:
        return d["smoothed_max_rel_diff"] <= tolerance and d["smoothed_rel_diff_final"] <= tolerance
    return d["max_rel_diff"] <= tolerance and d["rel_diff_final"] <= tolerance


def _device(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cpu":
        return "cpu"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto" and have == 0:
        return "cpu"
    if have < args.nproc:
        raise SystemExit(
            f"check_multi_gpu: --nproc {args.nproc} needs {args.nproc} GPUs but {have} are "
            "visible (CUDA_VISIBLE_DEVICES); lower --nproc or use --device cpu (gloo)"
        )
    return "cuda"


def _bindings(args: argparse.Namespace, precision: str, device: str) -> list[str]:
    from hstu.config.gin_utils import load_config

    files = [args.config] if args.config else []
    cfg = load_config("ranking", files, list(args.bindings))
    if args.batch_size % args.nproc:
        raise SystemExit(
            f"check_multi_gpu: --batch-size {args.batch_size} must be divisible by --nproc "
            f"{args.nproc} (the global batch is split over the ranks)"
        )
    scaling = cfg.network.scaling_seqlen or (
        cfg.dataset.max_history_seqlen + cfg.dataset.max_num_candidates
    )
    fixed = [
        f"TrainerArgs.train_batch_size={args.batch_size}",
        f"TrainerArgs.max_train_iters={args.steps}",
        "TrainerArgs.log_interval=1",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.max_eval_iters=4",
        "TrainerArgs.progress_bar=False",
        "NetworkArgs.hidden_dropout=0.0",
        f"NetworkArgs.scaling_seqlen={scaling}",
    ]
    if device == "cuda":
        dtype = "float32" if precision == "fp32" else "bfloat16"
        fixed.append(f"NetworkArgs.dtype_str='{dtype}'")
    # the user's bindings win
    return fixed + list(args.bindings)


def _launch(
    args: argparse.Namespace,
    nproc: int,
    bindings: list[str],
    run_dir: Path,
    device: str,
    precision: str,
) -> tuple[list[tuple[int, float]], dict[str, float], float]:
    """One launcher run; returns (loss curve, final eval metrics, wall seconds)."""
    from hstu.training.logger import read_scalars

    run_dir.mkdir(parents=True, exist_ok=True)
    all_bindings = bindings + [
        f"TrainerArgs.log_dir='{run_dir}'",
        "TrainerArgs.run_name='run'",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(LAUNCHER),
        *(["--gin-config-file", args.config] if args.config else []),
        *[x for b in all_bindings for x in ("--gin-bindings", b)],
        "--log-level",
        "WARNING",
    ]
    if args.allow_non_a100:
        cmd.append("--allow-non-a100")
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["HSTU_FORCE_REFERENCE_ATTENTION"] = "1" if precision == "fp32" else "0"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    log = run_dir / "launcher.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        done, stopped = run_launch(
            cmd, args.run_timeout, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        )
    if stopped:
        tail = log.read_text(errors="replace")[-40000:]  # every rank's stacks
        sys.stderr.write(
            f"check_multi_gpu: run in {run_dir} did not finish within {args.run_timeout:g} s "
            f"(--run-timeout); its processes' stacks (log {log}):\n{tail}\n"
        )
        raise SystemExit(2)
    rc = done.returncode
    wall = time.perf_counter() - start
    if rc != 0:
        tail = log.read_text()[-4000:]
        sys.stderr.write(f"check_multi_gpu: run in {run_dir} failed (exit {rc}):\n{tail}\n")
        raise SystemExit(2)
    scalars = read_scalars(str(run_dir / "run"))
    losses = scalars.get("train/loss", [])
    metrics = {
        tag[len("eval/") :]: points[-1][1]
        for tag, points in scalars.items()
        if tag.startswith("eval/") and points
    }
    return losses, metrics, wall


def check(args: argparse.Namespace, precision: str, device: str, work: Path) -> dict:
    n = args.nproc
    bindings = _bindings(args, precision, device)
    half = max(args.steps // 2, 1)
    # a reused --work-dir: this check's own run directories start empty (runs never write into
    # an earlier run's directory, so stale ones would divert the new runs to "run-2")
    for stale in work.glob(f"{precision}_*"):
        shutil.rmtree(stale, ignore_errors=True)
    ckpt_root = work / f"{precision}_ckpt"
    one, m1, t1 = _launch(
        args,
        1,
        bindings + ["TrainerArgs.ckpt_save_interval=-1"],
        work / f"{precision}_1",
        device,
        precision,
    )
    many, mn, tn = _launch(
        args,
        n,
        bindings
        + [f"TrainerArgs.ckpt_save_interval={half}", f"TrainerArgs.ckpt_save_dir='{ckpt_root}'"],
        work / f"{precision}_{n}",
        device,
        precision,
    )
    if len(one) != args.steps or len(many) != args.steps:
        raise SystemExit(
            f"check_multi_gpu: expected {args.steps} logged losses, got {len(one)} (1 process) "
            f"and {len(many)} ({n} processes)"
        )
    curve = relative_differences(one, many, args.window)
    row = {
        "check": "multi_gpu_loss_curve",
        "precision": precision,
        "device": _device_name(device),
        "nproc": n,
        "steps": args.steps,
        "global_batch": args.batch_size,
        "batch_per_process": args.batch_size // n,
        "loss_final_1": one[-1][1],
        f"loss_final_{n}": many[-1][1],
        **curve,
        "eval_1": m1,
        f"eval_{n}": mn,
        "wall_s": {"1": round(t1, 1), str(n): round(tn, 1)},
        "tolerance": args.tolerance,
    }
    row["losses_1"] = [round(v, 6) for _, v in one]
    row[f"losses_{n}"] = [round(v, 6) for _, v in many]
    ok = _agree(curve, args.tolerance)
    if not args.no_resume:
        ckpt = ckpt_root / f"step_{half:08d}"
        resumed, _, tr = _launch(
            args,
            1,
            bindings + ["TrainerArgs.ckpt_save_interval=-1", f"TrainerArgs.ckpt_load_dir='{ckpt}'"],
            work / f"{precision}_resume",
            device,
            precision,
        )
        if [s for s, _ in resumed] != list(range(half + 1, args.steps + 1)):
            raise SystemExit(
                f"check_multi_gpu: the resumed run logged steps {[s for s, _ in resumed][:3]}..., "
                f"expected {half + 1}..{args.steps}"
            )
        res = relative_differences(many, resumed, args.window)
        row["resume"] = {"saved_by": n, "loaded_by": 1, "from_step": half, **res}
        row["wall_s"]["resume"] = round(tr, 1)
        ok = ok and _agree(res, args.tolerance)
    row["pass"] = ok
    return row


def _device_name(device: str) -> str:
    if device == "cpu":
        return "cpu (gloo)"
    import torch

    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.nproc < 2:
        raise SystemExit("check_multi_gpu: --nproc must be >= 2 (it is compared with 1)")
    if args.steps < 2:
        raise SystemExit("check_multi_gpu: --steps must be >= 2")
    device = _device(args)
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()] or (
        list(PRECISIONS) if device == "cuda" else ["fp32"]
    )
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"check_multi_gpu: --precision {p!r}: use fp32 and/or bf16")
        if p == "bf16" and device == "cpu":
            raise SystemExit("check_multi_gpu: --precision bf16 needs a GPU (CPU runs fp32)")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="hstu_multi_"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        for p in precisions:
            row = check(args, p, device, work)
            emit_json(row, args.out)
            ok = ok and row["pass"]
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
