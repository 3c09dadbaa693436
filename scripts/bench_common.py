"""What the benchmark and check scripts share: one argument parser builder for their common
options, JSON-lines output, device resolution, the median timer, and `run_launch` (a torchrun
launch with a deadline that shows where its processes were when it passed).

The scripts import it from their own folder (each puts that folder and the checkout's root on
``sys.path`` first, so they also work when a test loads them from their file path):

    parser = base_parser(__doc__, iters=20, warmup=3, device="auto", out="")
    parser.add_argument("--batch", type=int, default=32)   # the script's own options
    args = parser.parse_args(argv)
    emit_json({"ms": ...}, args.out)

Common options (each added only when ``base_parser`` is given its default):

==========  ==========================================================================
option      meaning
==========  ==========================================================================
--iters     timed repetitions (the median is reported)
--warmup    untimed repetitions first
--steps     timed training steps
--device    auto | cuda | cpu (auto: cuda when a GPU is visible)
--dtype     bfloat16 | float16 | float32
--config    gin config file; with it --bindings: extra gin bindings ('Class.field=value')
--out       also append the JSON lines to this file (``out_aliases`` adds other names)
==========  ==========================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "COMMON_OPTIONS",
    "DEVICES",
    "DTYPES",
    "base_parser",
    "emit_json",
    "median_ms",
    "resolve_device",
    "run_launch",
]

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("bfloat16", "float16", "float32")

# name -> (flags, add_argument keywords); the order here is the order in --help
COMMON_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "iters": (("--iters",), {"type": int, "help": "timed repetitions (the median is reported)"}),
    "warmup": (("--warmup",), {"type": int, "help": "untimed repetitions first"}),
    "steps": (("--steps",), {"type": int, "help": "timed training steps"}),
    "device": (
        ("--device",),
        {"choices": DEVICES, "help": "auto: cuda when a GPU is visible, else cpu"},
    ),
    "dtype": (("--dtype",), {"choices": DTYPES, "help": "compute dtype"}),
    "config": (("--config",), {"help": "gin config file"}),
    "out": (("--out",), {"metavar": "PATH", "help": "also append the JSON lines to this file"}),
}


def base_parser(
    description: str | None,
    *,
    helps: dict[str, str] | None = None,
    out_aliases: Sequence[str] = (),
    **defaults: Any,
) -> argparse.ArgumentParser:
    """An ArgumentParser with the common options named in ``defaults`` (option name -> the
    script's default), in `COMMON_OPTIONS` order.

    ``config`` also adds ``--bindings`` (zero or more gin bindings, default none). ``helps``
    replaces an option's help text (keyed like ``defaults``; ``bindings`` too); ``out_aliases``
    are more flag names of ``--out`` (the value is ``args.out`` whichever is used).
    """
    unknown = sorted(set(defaults) - set(COMMON_OPTIONS))
    if unknown:
        raise TypeError(
            f"base_parser: unknown common option(s) {unknown}; known: {sorted(COMMON_OPTIONS)}"
        )
    helps = dict(helps or {})
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, (flags, kwargs) in COMMON_OPTIONS.items():
        if name not in defaults:
            continue
        kwargs = {**kwargs, "default": defaults[name]}
        if name in helps:
            kwargs["help"] = helps[name]
        if name == "out":
            flags = (*flags, *out_aliases)
            kwargs["dest"] = "out"
        parser.add_argument(*flags, **kwargs)
        if name == "config":
            parser.add_argument(
                "--bindings",
                nargs="*",
                default=[],
                help=helps.get("bindings", "gin bindings, e.g. 'TrainerArgs.seed=1'"),
            )
    return parser


def emit_json(row: dict, path: str | None = None) -> str:
    """Print ``row`` as one JSON line (flushed) and, with ``path``, append it there too."""
    line = json.dumps(row)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return line


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``; other names unchanged."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 0, cuda: bool = True) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones.

    On CUDA each call is timed by CUDA events around it on the current stream (GPU time, the
    device drained after each call); on CPU by ``time.perf_counter``.
    """
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
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


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), read from /proc; empty where there is none."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # the parent is the 2nd field after the parenthesised command name
            parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop_with_stacks(proc: subprocess.Popen) -> None:
    """Stops a launch that outlived its deadline. Its workers (torchrun starts each in a session
    of its own) get SIGABRT: with PYTHONFAULTHANDLER=1 each prints every thread's Python stack to
    its stderr as it aborts. Then torchrun gets SIGTERM (it stops any worker it started
    meanwhile), and what is left SIGKILL."""
    seen = _descendants(proc.pid)
    _signal(seen, signal.SIGABRT)
    time.sleep(5.0)  # the dumps are written before torchrun tears the workers down
    later = [p for p in _descendants(proc.pid) if p not in seen]
    _signal(later, signal.SIGABRT)  # started while the first ones aborted
    seen += later
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30.0)
            break
        except subprocess.TimeoutExpired:
            continue
    _signal(seen + _descendants(proc.pid), signal.SIGKILL)


def run_launch(
    cmd: Sequence[str], timeout: float | None, env: dict[str, str] | None = None, **popen: Any
) -> tuple[subprocess.CompletedProcess, bool]:
    """Runs ``cmd`` (a torchrun launch) as `subprocess.run` would (``popen``: stdout, stderr,
    text, cwd), but in a process group of its own with PYTHONFAULTHANDLER=1 and, past ``timeout``
    seconds (None: none), stopped by `_stop_with_stacks`, so that the output or the log holds
    every process's Python stack at that moment (where a hung collective waits). Returns (the
    completed process, whether it was stopped)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONFAULTHANDLER"] = "1"
    with subprocess.Popen(cmd, env=env, start_new_session=True, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err), False
        except subprocess.TimeoutExpired:
            _stop_with_stacks(proc)
            out, err = proc.communicate()
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err), True
