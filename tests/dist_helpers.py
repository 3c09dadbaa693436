"""Shared helpers of the tests that start subprocesses: a clean environment, torchrun command
lines, and `torchrun_losses` (train under torchrun with `dist_train_worker.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_train_worker.py"

# the tiny synthetic model of the launcher tests (a few seconds per run on one CPU core)
TINY_BINDINGS = [
    "TrainerArgs.max_train_iters=4",
    "TrainerArgs.log_interval=2",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=2",
    "TrainerArgs.train_batch_size=8",
    "TrainerArgs.eval_batch_size=16",
    "DatasetArgs.synthetic_num_users=120",
    "DatasetArgs.synthetic_num_items=80",
    "DatasetArgs.max_history_seqlen=16",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.kv_channels=8",
    "RetrievalArgs.num_negatives=8",
]

# the caller's variables that would leak into a launched run: HSTU_* switches, a surrounding
# torchrun's rank/world variables
_DROPPED_ENV = ("HSTU_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")


def launcher_env(allow_non_a100: bool = False, **extra: str) -> dict[str, str]:
    """The caller's environment without HSTU_* and torchrun variables, with this checkout first
    on PYTHONPATH and one OpenMP thread per process; ``allow_non_a100`` sets
    HSTU_ALLOW_NON_A100=1; ``extra`` adds or overrides variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if allow_non_a100:
        env["HSTU_ALLOW_NON_A100"] = "1"
    env.update(extra)
    return env


def torchrun_command(script: str | os.PathLike[str], nproc: int, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N script args...``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def torchrun_losses(
    nproc: int,
    bindings: list[str],
    out: Path,
    timeout: float = 600,
    device: str = "cpu",
    flat_gradients: str = "",
    **env: str,
) -> list[float]:
    """Trains the ranking task with ``bindings`` on ``nproc`` processes (`launcher_env`, plus
    ``env``) on ``device`` (cpu: gloo; cuda: a GPU per rank, NCCL; ``flat_gradients``: a mode
    of `dist_train_worker.py`, e.g. "flat_gradients": the ranks average the dense gradients with
    `FlatGradients`, not DDP) and returns rank 0's loss per step."""
    out.mkdir(parents=True, exist_ok=True)
    # a worker still running shortly before the timeout writes every thread's stack to
    # OUT/stacks_rank<r>.txt and exits (`dist_train_worker.py`), so a hang fails with where
    # each rank waits instead of a bare timeout
    env.setdefault(DUMP_AFTER_ENV, str(max(timeout - STACK_DUMP_MARGIN_S, 1.0)))
    proc = subprocess.run(
        torchrun_command(
            WORKER,
            nproc,
            str(ROOT),
            json.dumps(bindings),
            str(out),
            device,
            *([flat_gradients] if flat_gradients else []),
        ),
        env=launcher_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + worker_stacks(out)
    return [loss for _, loss in json.loads((out / "losses.json").read_text())]


# `dist_train_worker.py` dumps its stacks after this many seconds (set by `torchrun_losses`)
DUMP_AFTER_ENV = "DIST_WORKER_DUMP_AFTER_S"
STACK_DUMP_MARGIN_S = 30.0  # before the launch's timeout: time to write the dumps and tear down


def worker_stacks(out: Path) -> str:
    """The stacks that timed-out workers wrote to ``out`` (empty when none did)."""
    parts = []
    for path in sorted(out.glob("stacks_rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            parts.append(f"\n--- {path.name} (the worker was still running) ---\n{text[-3000:]}")
    return "".join(parts)


def launch(
    task: str,
    args: list[str],
    nproc: int | None = None,
    allow_non_a100: bool = True,
    timeout: float = 300,
    **env: str,
) -> subprocess.CompletedProcess:
    """Runs scripts/pretrain_gr_<task>.py directly (``nproc`` None) or under torchrun with
    ``nproc`` processes, in `launcher_env`; ``env`` adds variables."""
    script = ROOT / "scripts" / f"pretrain_gr_{task}.py"
    cmd = (
        [sys.executable, str(script), *args]
        if nproc is None
        else torchrun_command(script, nproc, *args)
    )
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=launcher_env(allow_non_a100=allow_non_a100, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# packages an exported artifact must serve without (the training stack)
TRAINING_STACK = ("torchrec", "gin", "fbgemm_gpu", "tensorboard")


def run_fresh_python(code: str) -> dict:
    """Runs ``code`` (which ends by printing one JSON object) in a new interpreter with this
    checkout importable; returns that object plus "heavy": the training-stack packages the
    process had imported by then."""
    probe = (
        "\nimport sys as _sys, json as _json\n"
        "print(_json.dumps(sorted({m.split('.')[0] for m in _sys.modules} & "
        f"{set(TRAINING_STACK)!r})))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code + probe], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    *_, result, heavy = proc.stdout.strip().splitlines()
    return {**json.loads(result), "heavy": json.loads(heavy)}


def error_lines(text: str) -> list[str]:
    """The lines of ``text`` that start with ``error:`` (the launchers' failure line)."""
    return [line for line in text.splitlines() if line.startswith("error:")]


def prepare_sequences_cli(source, output) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m hstu.data.prepare --dataset sequences`` on ``source`` in a subprocess:
    (the finished process, its stderr lines that start with "ERROR")."""
    proc = subprocess.run(
        [sys.executable, "-m", "hstu.data.prepare", "--dataset", "sequences", "--source",
         str(source), "--output", str(output)],
        cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc, [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
