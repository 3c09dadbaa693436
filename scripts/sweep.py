#!/usr/bin/env python
"""A grid of training runs of one config, several at once on one machine, and their results.

Small models leave most of a GPU idle, so a sweep runs ``--parallel`` of them at once (each a
separate process of the launcher, with ``TrainerArgs.cpu_threads=1``: with PyTorch's default
thread pools, eight runs on one GPU evaluated 8.5x slower; docs/benchmarks.md "Several runs on one
GPU"). Every run gets its own run directory under ``--out`` (named after its grid values, with
its TensorBoard files, config.gin, metrics.jsonl and checkpoints) and its console output in
``<out>/logs/<run>.log``.

    python scripts/sweep.py --config configs/amazon_beauty_retrieval.gin --out runs/sweep-beauty \\
        --grid "OptimizerArgs.learning_rate=1e-3,5e-4" "NetworkArgs.hidden_dropout=0.2,0.5" \\
        --seeds 1,2 --parallel 8

Each ``--grid`` item is ``Class.field=v1,v2,...`` (gin values; commas inside quotes, brackets or
parentheses stay with their value); the runs are every combination, times ``--seeds``.
``--bindings`` apply to every run. All run configurations are checked before anything starts.

At the end (and when interrupted) ``<out>/sweep.csv`` holds one row per run: its grid values,
status (finished, failed, interrupted, not run), the main metric's best value and step, the step
early stopping ended it at (``TrainerArgs.early_stop_patience``), the final metrics and the
seconds of its fit (training, evaluations, checkpoints); the console gets the
table sorted by the main metric. A failed run does not stop the others; the exit code is 1 when
any failed (their error lines are printed).

Running the same command again skips the runs that finished with the same configuration and
steps, or that early stopping ended (their results are read back from their run directories)
and runs the others again: from
their latest checkpoint where one was saved (so more ``TrainerArgs.max_train_iters`` continue the
finished runs), else from the start.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]

EXIT_INTERRUPTED = 130


@dataclass
class Run:
    name: str
    values: dict[str, str]  # grid binding -> value (text, as given)
    fingerprint: str = ""
    max_steps: int = 0
    main_metric: str = ""
    status: str = "not run"
    best: float | None = None
    best_step: int | None = None
    stopped_early_at: int | None = None  # TrainerArgs.early_stop_patience ended it there
    final_metrics: dict[str, float] = field(default_factory=dict)
    fit_s: float | None = None  # the run's fit (training, evaluations, checkpoints)
    error: str = ""
    device: str = ""  # CUDA_VISIBLE_DEVICES of its process ("" = inherited)

    @property
    def bindings(self) -> list[str]:
        return [f"{n}={v}" for n, v in self.values.items()]


# ---- the grid ----------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
    """``text`` split at the commas outside quotes, brackets and parentheses, each stripped."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def parse_grid(items: list[str], seeds: str) -> list[tuple[str, list[str]]]:
    """``[(binding name, values)]`` from ``--grid`` items and ``--seeds``; raises ValueError
    naming the bad item."""
    grid: list[tuple[str, list[str]]] = []
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"\w+\.\w+", name):
            raise ValueError(f"--grid {item!r}: expected Class.field=v1,v2,...")
        vals = split_values(values)
        if not all(vals):
            raise ValueError(f"--grid {item!r}: an empty value")
        if len(set(vals)) != len(vals):
            raise ValueError(f"--grid {item!r}: a value given twice")
        if any(name == n for n, _ in grid):
            raise ValueError(f"--grid: {name} given twice")
        grid.append((name, vals))
    if seeds:
        if any(n == "TrainerArgs.seed" for n, _ in grid):
            raise ValueError("--seeds and --grid TrainerArgs.seed=...: give the seeds once")
        grid.append(("TrainerArgs.seed", split_values(seeds)))
    if not grid:
        raise ValueError("nothing to sweep: give --grid Class.field=v1,v2 and/or --seeds")
    return grid


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "x"


def expand(grid: list[tuple[str, list[str]]]) -> list[Run]:
    """Every combination of the grid's values, each a `Run` named after them."""
    fields_ = [n.split(".", 1)[1] for n, _ in grid]
    # a field name that two classes share is written with its class
    labels = [
        n.replace(".", "-") if fields_.count(f) > 1 else f for (n, _), f in zip(grid, fields_)
    ]
    runs = []
    for combo in itertools.product(*(vals for _, vals in grid)):
        values = {n: v for (n, _), v in zip(grid, combo)}
        name = "_".join(f"{label}-{_slug(v)}" for label, v in zip(labels, combo))
        runs.append(Run(name=name, values=values))
    names = [r.name for r in runs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ValueError(
            f"--grid: values that differ only in characters a directory name cannot hold give "
            f"runs the same name ({clashes[0]}); write them differently"
        )
    return runs


# ---- one run -----------------------------------------------------------------------------------


def _run_bindings(args: argparse.Namespace, run: Run, out: Path) -> list[str]:
    """Every binding of ``run``: one CPU thread, the sweep's --bindings, its grid values, then
    where it writes (last: the sweep decides that)."""
    return [
        "TrainerArgs.cpu_threads=1",
        *args.bindings,
        *run.bindings,
        f"TrainerArgs.log_dir='{out}'",
        f"TrainerArgs.run_name='{run.name}'",
        "TrainerArgs.progress_bar=False",
    ]


def check_runs(args: argparse.Namespace, runs: list[Run], out: Path) -> None:
    """Loads every run's configuration (errors name the run and the binding) and sets its
    fingerprint and main metric."""
    from hstu.config.gin_utils import load_config
    from hstu.training.launcher import main_metric
    from hstu.training.rundir import fingerprint

    for run in runs:
        try:
            cfg = load_config(args.task, [args.config], _run_bindings(args, run, out))
        except Exception as exc:  # noqa: BLE001 - reported with the run's name
            raise ValueError(f"run {run.name} ({', '.join(run.bindings)}): {exc}") from None
        run.fingerprint = fingerprint(cfg)
        run.max_steps = cfg.trainer.max_train_iters
        if args.task == "ranking":
            names = ["auc/mean"]
        else:
            names = list(cfg.retrieval.eval_metrics)
        run.main_metric = main_metric(cfg, names) or ""


def read_result(run: Run, out: Path) -> bool:
    """Fills ``run`` from its run directory when it finished with its configuration and
    steps."""
    from hstu.training.rundir import read_metrics, read_run_file

    run_dir = out / run.name
    info = read_run_file(run_dir)
    if not info or info.get("status") != "finished" or info.get("fingerprint") != run.fingerprint:
        return False
    result = info.get("result") or {}
    stopped = result.get("stopped_early_at")
    if int(result.get("step", -1)) < run.max_steps and stopped is None:
        return False  # fewer steps than asked now: continued from its checkpoint
    # a run early stopping ended is done: more steps would stop it again at its next evaluation
    run.stopped_early_at = None if stopped is None else int(stopped)
    run.final_metrics = dict(result.get("final_metrics") or {})
    run.fit_s = result.get("fit_s")
    evals = [
        (e["step"], e["metrics"][run.main_metric])
        for e in read_metrics(run_dir)
        if run.main_metric in e.get("metrics", {})
        and not math.isnan(e["metrics"][run.main_metric])  # e.g. an AUC of one-class labels
    ]
    if evals:
        run.best_step, run.best = max(evals, key=lambda p: (p[1], -p[0]))
    run.status = "finished"
    return True


def _resume_binding(out: Path, run: Run) -> list[str]:
    """How an unfinished run starts again: from its latest complete checkpoint where it saved
    one, else afresh in its own directory."""
    from hstu.training.rundir import latest_checkpoint

    run_dir = out / run.name
    if not run_dir.is_dir():
        return []
    latest = latest_checkpoint(run_dir / "checkpoints")
    if latest is not None:
        return [f"TrainerArgs.ckpt_load_dir='{latest}'"]
    return ["TrainerArgs.allow_existing_run_dir=True"]


def _command(args: argparse.Namespace, run: Run, out: Path) -> list[str]:
    script = os.path.join(SCRIPTS, f"pretrain_gr_{args.task}.py")
    cmd = [sys.executable, script, "--gin-config-file", args.config]
    for b in _run_bindings(args, run, out) + _resume_binding(out, run):
        cmd += ["--gin-bindings", b]
    if args.allow_non_a100:
        cmd.append("--allow-non-a100")
    return cmd


def _error_line(log: Path) -> str:
    """The launcher's ``error: ...`` line in a run's log, else its last line."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[-1]
    return lines[-1].strip() if lines else ""


# ---- the sweep ---------------------------------------------------------------------------------


def pick_device(devices: list[str], running: list[Run]) -> str:
    """The device of ``devices`` with the fewest ``running`` runs (the first of equals)."""
    load = [sum(r.device == d for r in running) for d in devices]
    return devices[load.index(min(load))]


def run_all(args: argparse.Namespace, runs: list[Run], out: Path) -> bool:
    """Runs the runs that have no result yet, ``args.parallel`` at a time; False when
    interrupted."""
    from tqdm import tqdm

    todo = [r for r in runs if r.status != "finished"]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    active: dict[str, tuple[Run, subprocess.Popen, object]] = {}
    devices = [d for d in args.devices.split(",") if d.strip()] if args.devices else []
    bar = tqdm(
        total=len(runs),
        initial=len(runs) - len(todo),
        desc="sweep",
        unit="run",
        disable=not sys.stderr.isatty() or bool(os.environ.get("CI")),
    )
    try:
        while todo or active:
            while todo and len(active) < args.parallel:
                run = todo.pop(0)
                env = None
                if devices:
                    run.device = pick_device(devices, [a[0] for a in active.values()])
                    env = {**os.environ, "CUDA_VISIBLE_DEVICES": run.device}
                fh = open(logs / f"{run.name}.log", "ab")
                proc = subprocess.Popen(
                    _command(args, run, out),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_child_signals,
                )
                run.status = "running"
                active[run.name] = (run, proc, fh)
            time.sleep(0.2)
            for name, (run, proc, fh) in list(active.items()):
                if proc.poll() is None:
                    continue
                fh.close()
                del active[name]
                if proc.returncode == 0 and read_result(run, out):
                    shown = f"{run.main_metric}={run.best:.4f}" if run.best is not None else ""
                    bar.write(f"finished {run.name} ({run.fit_s or 0:.0f} s) {shown}")
                else:
                    run.status = "failed"
                    run.error = _error_line(logs / f"{run.name}.log")
                    bar.write(f"failed {run.name} (exit {proc.returncode}): {run.error}")
                bar.update(1)
        return True
    except KeyboardInterrupt:
        _stop([(proc, fh) for _run, proc, fh in active.values()])
        for run, _proc, _fh in active.values():
            run.status = "interrupted"
        return False
    finally:
        bar.close()


STOP_WAIT_S = 30.0


def _stop(procs: list[tuple[subprocess.Popen, object]]) -> None:
    """Stops the running runs: SIGINT (a launcher leaves nothing half-written and exits), then
    SIGTERM, then SIGKILL for any still running after `STOP_WAIT_S` each (at once when the sweep
    is interrupted again meanwhile)."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            alive = [p for p, _ in procs if p.poll() is None]
            for p in alive:
                p.send_signal(sig)
            deadline = time.monotonic() + STOP_WAIT_S
            for p in alive:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
    except KeyboardInterrupt:  # interrupted again: no more waiting
        pass
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for _, fh in procs:
        fh.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _child_signals() -> None:
    """In a run's process before it starts: SIGINT as the default (a sweep started where SIGINT
    is ignored, e.g. in the background of a script, would pass that on)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def write_table(runs: list[Run], out: Path) -> Path:
    """``<out>/sweep.csv``: one row per run (written to a temporary file, then renamed)."""
    keys = list(runs[0].values)
    metrics = sorted({k for r in runs for k in r.final_metrics})
    path = out / "sweep.csv"
    tmp = out / "sweep.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "run",
                *keys,
                "status",
                "device",
                "main_metric",
                "best",
                "best_step",
                "stopped_early_at",
                "fit_s",
                *(f"final {m}" for m in metrics),
                "error",
            ]
        )
        for r in runs:
            w.writerow(
                [
                    r.name,
                    *(r.values[k] for k in keys),
                    r.status,
                    r.device,
                    r.main_metric,
                    "" if r.best is None else f"{r.best:.6f}",
                    "" if r.best_step is None else r.best_step,
                    "" if r.stopped_early_at is None else r.stopped_early_at,
                    "" if r.fit_s is None else f"{r.fit_s:.1f}",
                    *(f"{r.final_metrics[m]:.6f}" if m in r.final_metrics else "" for m in metrics),
                    r.error,
                ]
            )
    os.replace(tmp, path)
    return path


def summary(runs: list[Run]) -> str:
    """The runs as a table, best main metric first (runs without a result last)."""
    keys = list(runs[0].values)
    ordered = sorted(runs, key=lambda r: (r.best is None, -(r.best or 0.0)))
    metric = next((r.main_metric for r in runs if r.main_metric), "metric")
    rows = [[*keys, "status", f"best {metric}", "step"]]
    for r in ordered:
        best = "" if r.best is None else f"{r.best:.4f}"
        step = "" if r.best_step is None else str(r.best_step)
        rows.append([*(r.values[k] for k in keys), r.status, best, step])
    return _table(rows)


def _table(rows: list[list[str]]) -> str:
    """``rows`` (the first a header) as left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, var**0.5


def seed_summary(runs: list[Run]) -> str:
    """With several seeds: per setting of the other grid values, the mean and standard deviation
    (over its finished seeds) of the best and the final main metric, best mean first; "" without
    seeds."""
    keys = [k for k in runs[0].values if k != "TrainerArgs.seed"]
    if len(keys) == len(runs[0].values):
        return ""
    metric = next((r.main_metric for r in runs if r.main_metric), "metric")
    groups: dict[tuple[str, ...], list[Run]] = {}
    for r in runs:
        groups.setdefault(tuple(r.values[k] for k in keys), []).append(r)
    stats = []
    for setting, members in groups.items():
        done = [r for r in members if r.best is not None]
        best = _mean_std([r.best for r in done]) if done else None
        finals = [r.final_metrics[metric] for r in done if metric in r.final_metrics]
        final = _mean_std(finals) if finals else None
        stats.append((setting, f"{len(done)}/{len(members)}", best, final))
    stats.sort(key=lambda s: (s[2] is None, -(s[2][0] if s[2] else 0.0)))

    def shown(ms: tuple[float, float] | None) -> str:
        return "" if ms is None else f"{ms[0]:.4f} +- {ms[1]:.4f}"

    rows = [[*keys, "seeds", f"best {metric}", f"final {metric}"]]
    rows += [[*setting, n, shown(b), shown(f)] for setting, n, b, f in stats]
    return _table(rows)


def _print_tables(runs: list[Run]) -> None:
    print(summary(runs))
    by_seed = seed_summary(runs)
    if by_seed:
        print("mean +- standard deviation over the seeds:")
        print(by_seed)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="gin config file of every run")
    p.add_argument(
        "--task",
        default="",
        choices=("", "retrieval", "ranking"),
        help="default: ranking when the config's name says so, else retrieval",
    )
    p.add_argument("--grid", nargs="*", default=[], help="Class.field=v1,v2,... (repeatable)")
    p.add_argument("--seeds", default="", help="TrainerArgs.seed values, e.g. 1,2,3")
    p.add_argument("--bindings", nargs="*", default=[], help="gin bindings for every run")
    p.add_argument("--out", required=True, help="directory of the sweep's runs and sweep.csv")
    p.add_argument("--parallel", type=int, default=4, help="runs at once (default 4)")
    p.add_argument(
        "--allow-non-a100",
        action="store_true",
        help="passed to each run (non-A100 GPUs, CPU development mode)",
    )
    p.add_argument(
        "--devices",
        default="",
        help="GPUs to spread the runs over, e.g. 0,1,2,3 (each run gets CUDA_VISIBLE_DEVICES of "
        "the one with the fewest runs at its start); default: the devices the sweep sees",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the runs and the results of those finished, start none",
    )
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1 (got {args.parallel})")
    if not os.path.isfile(args.config):
        p.error(f"--config {args.config}: no such file")
    if not args.task:
        args.task = "ranking" if "ranking" in os.path.basename(args.config) else "retrieval"
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out).resolve()
    try:
        runs = expand(parse_grid(args.grid, args.seeds))
        check_runs(args, runs, out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    done = sum(read_result(r, out) for r in runs)
    print(
        f"sweep: {len(runs)} runs of {args.config} ({done} finished before), {args.parallel} "
        f"at once, under {out}"
    )
    if args.dry_run:
        for r in runs:
            print(f"  {r.name}: {r.status}; {' '.join(r.bindings)}")
        if done:  # the results so far (e.g. of a sweep still running elsewhere)
            _print_tables(runs)
        return 0
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: --out {out} cannot be created ({exc.strerror or exc})", file=sys.stderr)
        return 2
    # SIGINT and SIGTERM interrupt the sweep (also where SIGINT was ignored at its start)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        completed = run_all(args, runs, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    path = write_table(runs, out)
    _print_tables(runs)
    print(f"results: {path}")
    failed = [r for r in runs if r.status == "failed"]
    for r in failed:
        print(
            f"failed: {r.name}: {r.error} (log: {out / 'logs' / (r.name + '.log')})",
            file=sys.stderr,
        )
    if not completed:
        return EXIT_INTERRUPTED
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
