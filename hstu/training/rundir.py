"""Run directories: every run gets its own, output locations are checked before any work.

A run writes its TensorBoard files, ``config.gin`` and ``run.json`` into the run directory
``TrainerArgs.log_dir/<run_name>`` and its checkpoints into ``TrainerArgs.ckpt_save_dir``
(default ``<run directory>/checkpoints``). The rules (:func:`prepare_run_dir`, decided on rank 0
and broadcast to every rank before data loading and model building):

- ``log_dir`` and an explicit ``ckpt_save_dir`` must be directories that can be created and
  written (a probe file is written and removed); otherwise one line names the path and the fix.
- A new run never writes into the directory of an earlier run: when ``<run_name>`` exists and
  holds a run that started, this run takes ``<run_name>-2`` (then ``-3``, ...) and says so. A
  directory whose run died while setting up (``run.json`` says "starting", its process is gone)
  is reused.
- Continuing a run is explicit: ``TrainerArgs.ckpt_load_dir`` names the latest checkpoint of the
  run directory's checkpoint root (the root itself, or its newest step directory). The run then
  continues in that directory, provided its configuration is the same one (compared on the
  fields that define what is trained, :func:`config_identity`); a different one is refused
  unless ``TrainerArgs.allow_existing_run_dir=True``.
- An explicit ``ckpt_save_dir`` that already holds checkpoints is refused unless this run
  resumes from its latest checkpoint with the same configuration, or
  ``TrainerArgs.allow_existing_run_dir=True`` (its checkpoints of the same steps would be
  replaced and older ones pruned).

Every refusal is a :class:`RunDirError` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hstu.comm import host_group
from hstu.config.gin_utils import CONFIG_FILENAME, RunConfig
from hstu.training.checkpoint import LATEST_FILE, Checkpointer

__all__ = [
    "RUN_FILE",
    "RunDir",
    "RunDirError",
    "check_output_dir",
    "config_identity",
    "mark_started",
    "prepare_run_dir",
    "setup_run_dir",
]

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
# one JSON line per evaluation (step, metrics, seconds): what a sweep or a script reads back
METRICS_FILE = "metrics.jsonl"

# Fields that do not change what is trained (where files go, how often to log or save, how
# long to train, which kernels compute the same math): a run continued with other values of
# these is the same run. Every other field of every class is part of the identity.
_NOT_IDENTITY = {
    "TrainerArgs": {
        "eval_batch_size",
        "max_train_iters",
        "max_eval_iters",
        "eval_interval",
        "log_interval",
        "ckpt_save_interval",
        "ckpt_keep_last",
        "ckpt_save_dir",
        "ckpt_load_dir",
        "log_dir",
        "run_name",
        "progress_bar",
        "peak_tflops",
        "rank_balance",
        "gc_interval",
        "cpu_threads",
        "route_ids_ahead",
        "allow_existing_run_dir",
        "ckpt_reset_optimizer",
    },
    "DatasetArgs": {"dataset_path"},
    "NetworkArgs": {
        "kernel_backend",
        "fused_layer",
        "recompute_input_layernorm",
        "recompute_uvqk_silu",
        "fused_gate_kernel",
        "fused_elementwise_kernels",
        "fused_layernorm_kernel",
        "fused_stage_compile",
        "pad_tokens",
    },
    # where rows live, not what they are: checkpoints are the same under either storage
    "EmbeddingArgs": {"storage", "hbm_cache"},
}
_GIN_LINE = re.compile(r"^(\w+)\.(\w+) = (.*)$")
_GIN_TASK = re.compile(r"^# Resolved HSTU configuration \(task: (\w+)\)")


class RunDirError(ValueError):
    """An output location or run directory problem, with a one-line message naming the path
    and the fix. ``exit_code`` (hstu.errors): 2 for a path or run directory the configuration
    must change (a file, another run's directory), 1 for the environment (permission denied,
    read-only or full disk)."""

    exit_code: int = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = int(exit_code)


@dataclass(frozen=True)
class RunDir:
    """Where this run writes: the run directory and the checkpoint root."""

    path: Path
    ckpt_dir: Path
    continuing: bool = False  # continues the run that owns ``path`` from its latest checkpoint


# ---- output locations ----------------------------------------------------------------------


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if exc.errno == errno.EROFS:
        return "the file system is read-only"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def check_output_dir(path: str | os.PathLike[str], binding: str) -> Path:
    """Make sure ``path`` is a directory this process can write: created when missing (with its
    parents), not a file, and a probe file written, flushed to disk and removed there. Raises
    RunDirError naming ``binding`` (e.g. "TrainerArgs.log_dir") and the fix; returns the path."""
    p = Path(path)
    fix = f"set {binding} to a writable directory"
    shown = f"{binding}='{path}'"
    if p.exists() and not p.is_dir():
        raise RunDirError(f"{shown} is a file, not a directory: {fix} (or move the file away)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(
                    f"{shown} cannot be created: {parent} is a file, not a directory; {fix}"
                )
            break
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{shown} cannot be created ({_reason(e)}): {fix}", 1) from None
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=".hstu-write-probe.", dir=p)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * 4096)  # a whole block: a full disk fails here or at the fsync
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunDirError(
                f"{shown} has no space left (the disk is full): free space there or {fix}", 1
            ) from None
        raise RunDirError(f"{shown} is not writable ({_reason(e)}): {fix}", 1) from None
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)
    return p


# ---- identity of a configuration -----------------------------------------------------------


def config_identity(cfg: RunConfig) -> dict[str, Any]:
    """``{"task": ..., "Class.field": value}`` over the fields that define what is trained (all
    but `_NOT_IDENTITY`), with values as JSON gives them back (tuples as lists)."""
    out: dict[str, Any] = {"task": cfg.task}
    for obj in cfg.args():
        cls = type(obj).__name__
        skip = _NOT_IDENTITY.get(cls, set())
        for f in fields(obj):
            if f.name not in skip:
                out[f"{cls}.{f.name}"] = getattr(obj, f.name)
    return json.loads(json.dumps(out))


def _fingerprint(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _identity_from_gin(path: Path) -> dict[str, Any] | None:
    """The identity of a run directory written before run.json existed, from its config.gin
    (one ``Class.field = literal`` line per field)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    out: dict[str, Any] = {}
    for line in lines:
        m = _GIN_TASK.match(line)
        if m:
            out["task"] = m.group(1)
            continue
        m = _GIN_LINE.match(line.strip())
        if not m or m.group(2) in _NOT_IDENTITY.get(m.group(1), set()):
            continue
        try:
            out[f"{m.group(1)}.{m.group(2)}"] = ast.literal_eval(m.group(3))
        except (ValueError, SyntaxError):
            return None
    return json.loads(json.dumps(out)) if out else None


def _read_run_file(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _saved_identity(run_dir: Path) -> dict[str, Any] | None:
    info = _read_run_file(run_dir)
    if info is not None and isinstance(info.get("identity"), dict):
        return info["identity"]
    return _identity_from_gin(run_dir / CONFIG_FILENAME)


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``Class.field: old -> new`` for the fields both know and that differ (fields added or
    removed since are not a difference: their defaults apply)."""
    keys = [k for k in current if k in saved and saved[k] != current[k]]
    return [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in keys]


def _describe(diffs: list[str], shown: int = 3) -> str:
    text = ", ".join(diffs[:shown])
    return text + (f" and {len(diffs) - shown} more" if len(diffs) > shown else "")


# ---- run directory states --------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def _abandoned(run_dir: Path) -> bool:
    """True for a run directory whose run failed while setting up (nothing of value in it): its
    run.json says "starting", it has no checkpoint, and its process on this host is gone or is
    this one (a set-up that raised; a process sets up one run at a time)."""
    info = _read_run_file(run_dir)
    if info is None or info.get("status") != "starting":
        return False
    if Checkpointer.list_checkpoints(run_dir / "checkpoints"):
        return False
    owner = info.get("owner") or {}
    if owner.get("host") != socket.gethostname():
        return False  # cannot tell whether it is still starting on another host
    pid = int(owner.get("pid", -1))
    return pid == os.getpid() or not _pid_alive(pid)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The latest complete step directory under checkpoint root ``ckpt_root`` (None: none)."""
    try:
        if not (ckpt_root / LATEST_FILE).is_file() and not Checkpointer.list_checkpoints(ckpt_root):
            return None
        return Checkpointer.resolve(ckpt_root).resolve()
    except (FileNotFoundError, ValueError, OSError):
        return None


def _write_run_file(run_dir: Path, cfg: RunConfig, status: str, **extra: Any) -> None:
    identity = config_identity(cfg)
    info = {
        "status": status,
        "task": cfg.task,
        "fingerprint": _fingerprint(identity),
        "identity": identity,
        "owner": {"host": socket.gethostname(), "pid": os.getpid()},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def _claim(path: Path) -> bool:
    """Take ``path`` for this run; False when it holds another run. Atomic against concurrent
    runs (same name, or the same automatic name in the same second): the directory is created,
    or found empty, and then whoever creates its run.json first (O_EXCL) owns it. A directory
    abandoned by a failed set-up (`_abandoned`) is taken over."""
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            return False
        if _abandoned(path):
            for stale in path.glob("events.out.tfevents*"):  # the failed set-up's empty log
                stale.unlink(missing_ok=True)
            return True
        if any(p.name != RUN_FILE for p in path.iterdir()):
            return False
    try:
        fd = os.open(path / RUN_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


# ---- the decision ------------------------------------------------------------------------------


def prepare_run_dir(cfg: RunConfig, resume: Path | None = None) -> RunDir:
    """Decide, check and create this run's directory (rank 0; see the module docstring).

    ``resume``: the step directory ``TrainerArgs.ckpt_load_dir`` resolves to, if any.
    """
    t = cfg.trainer
    log_dir = check_output_dir(t.log_dir, "TrainerArgs.log_dir")
    explicit_ckpt = (
        check_output_dir(t.ckpt_save_dir, "TrainerArgs.ckpt_save_dir") if t.ckpt_save_dir else None
    )
    name = t.run_name or f"{cfg.task}-{cfg.dataset.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    identity = config_identity(cfg)
    resume = resume.resolve() if resume is not None else None
    allow = bool(t.allow_existing_run_dir)

    def ckpt_root(run: Path) -> Path:
        return explicit_ckpt if explicit_ckpt is not None else run / "checkpoints"

    base = log_dir / name
    run, continuing = base, False
    if base.exists() and not base.is_dir():
        raise RunDirError(
            f"run directory {base} is a file, not a directory: move it away or set "
            "TrainerArgs.run_name to another name"
        )
    started = base.is_dir() and any(base.iterdir()) and not _abandoned(base)
    if started:
        continuing = resume is not None and resume == latest_checkpoint(ckpt_root(base))
        if continuing:
            saved = _saved_identity(base)
            diffs = _differences(saved, identity) if saved else []
            if diffs and not allow:
                raise RunDirError(
                    f"run directory {base} belongs to a run with another configuration "
                    f"({_describe(diffs)}): give this run its own TrainerArgs.run_name, or set "
                    f"TrainerArgs.allow_existing_run_dir=True to continue {base.name} with the "
                    "changed settings"
                )
        elif allow:
            logger.warning(
                "run directory %s holds another run; writing into it "
                "(TrainerArgs.allow_existing_run_dir=True)",
                base,
            )
        else:
            run = None  # a fresh directory, chosen below
    ckpt_dir = ckpt_root(run if run is not None else base)
    if explicit_ckpt is not None and t.ckpt_save_interval >= 0 and not allow:
        latest = latest_checkpoint(explicit_ckpt)
        if latest is not None and latest != resume:
            raise RunDirError(
                f"TrainerArgs.ckpt_save_dir='{t.ckpt_save_dir}' already holds checkpoints of "
                f"another run (latest {latest.name}), which this run would replace or prune: "
                "choose an empty directory, resume from its latest checkpoint with "
                f"TrainerArgs.ckpt_load_dir='{t.ckpt_save_dir}', or set "
                "TrainerArgs.allow_existing_run_dir=True"
            )
        if latest is not None:
            meta = Checkpointer.read_meta(latest)
            saved = meta.get("extra_meta", {}).get("config_identity")
            diffs = _differences(saved, identity) if isinstance(saved, dict) else []
            if diffs:
                raise RunDirError(
                    f"TrainerArgs.ckpt_save_dir='{t.ckpt_save_dir}' holds the checkpoints of a "
                    f"run with another configuration ({_describe(diffs)}): save this run's "
                    "checkpoints elsewhere, or set TrainerArgs.allow_existing_run_dir=True"
                )
    # claim the directory (mkdir is atomic: concurrent runs never share one)
    if run is not None and not started and not _claim(run):
        run = None  # another run took it since it was looked at
    if run is None:
        for i in itertools.count(2):
            candidate = log_dir / f"{name}-{i}"
            if _claim(candidate):
                run = candidate
                break
        ckpt_dir = ckpt_root(run)
        logger.warning(
            "run directory %s holds an earlier run; this run writes to %s (resume a run with "
            "TrainerArgs.ckpt_load_dir)",
            base,
            run,
        )
    status = "started" if continuing or (started and allow) else "starting"
    _write_run_file(run, cfg, status, resumed_from=str(resume) if resume else None)
    cfg.save(run)
    return RunDir(path=run, ckpt_dir=ckpt_dir, continuing=continuing)


def mark_started(run: RunDir, cfg: RunConfig) -> None:
    """Record in run.json that the run finished setting up (its directory is no longer reused
    by a later run of the same name), and start a fresh run's `METRICS_FILE` empty. Rank 0."""
    _set_status(run, cfg, "started")
    if not run.continuing:  # a fresh run's evaluation log starts empty (a continued one appends)
        (run.path / METRICS_FILE).write_text("")


def append_metrics(run_dir: Path, step: int, metrics: dict[str, float], eval_s: float) -> None:
    """One evaluation as a line of the run's `METRICS_FILE` (flushed). Rank 0."""
    line = {
        "step": int(step),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "eval_s": round(float(eval_s), 3),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with open(run_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations a run logged (`append_metrics`), in order; a torn last line (a run killed
    while writing it) is left out."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def mark_finished(run: RunDir, cfg: RunConfig, **result: Any) -> None:
    """Record in run.json that the run trained to its last step, with ``result`` (final step and
    metrics, checkpoint). Rank 0."""
    _set_status(run, cfg, "finished", result=result)


def _set_status(run: RunDir, cfg: RunConfig, status: str, **fields: Any) -> None:
    """run.json rewritten with ``status`` and ``fields``, keeping where the run resumed from."""
    info = _read_run_file(run.path) or {}
    extra = {k: v for k, v in info.items() if k == "resumed_from"}
    _write_run_file(run.path, cfg, status, **extra, **fields)


def read_run_file(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's run.json (None: none, or unreadable)."""
    return _read_run_file(Path(run_dir))


def fingerprint(cfg: RunConfig) -> str:
    """The run.json ``fingerprint`` of a run of ``cfg`` (equal for configurations that train the
    same model the same way)."""
    return _fingerprint(config_identity(cfg))


# ---- every rank --------------------------------------------------------------------------------

_ERRORS: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError,
    "ValueError": ValueError,
}


def _broadcast(obj: Any) -> Any:
    holder = [obj]
    _, group = host_group()
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def setup_run_dir(cfg: RunConfig, rank: int, world_size: int) -> RunDir:
    """`prepare_run_dir` on rank 0, its result (or its error) on every rank; call it on every
    rank before any work. ``TrainerArgs.ckpt_load_dir`` is resolved here, so a missing
    checkpoint is reported before data loading too."""
    result: Any = None
    error: BaseException | None = None
    if rank == 0:
        try:
            load = cfg.trainer.ckpt_load_dir
            resume = Checkpointer.resolve(load) if load else None
            result = prepare_run_dir(cfg, resume)
        except Exception as e:
            error = e
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        if rank == 0:
            payload = (
                ("ok", str(result.path), str(result.ckpt_dir), result.continuing)
                if error is None
                else ("error", type(error).__name__, str(error), getattr(error, "exit_code", None))
            )
        else:
            payload = None
        payload = _broadcast(payload)
        if rank != 0:
            if payload[0] == "error":
                _, name, message, code = payload
                if name == "RunDirError":
                    raise RunDirError(message, code)
                cls = _ERRORS.get(name, RuntimeError)
                raise cls(message if cls is not RuntimeError else f"rank 0: {name}: {message}")
            result = RunDir(Path(payload[1]), Path(payload[2]), bool(payload[3]))
    if error is not None:
        raise error
    return result
