"""Atomic, per-rank checkpoints and RNG state capture.

Layout under ``save_dir``::

    step_00000100/rank_0.pt, rank_1.pt, ..., meta.json
    step_00000200/...
    latest                  # text: the name of the newest complete step dir

A checkpoint is complete exactly when its ``step_XXXXXXXX/`` directory exists: every file is
written (and fsynced) inside ``step_XXXXXXXX.tmp/`` first, rank 0 adds ``meta.json`` after all
ranks are done and renames the directory, then replaces ``latest`` atomically. A crash at any
point leaves either the previous checkpoint as ``latest`` or the new one, never half of one. With
several nodes, ``save_dir`` must be on a filesystem that every rank sees.

Files are written with ``torch.save`` and read with ``weights_only=False`` (they hold optimizer
and RNG states): load only checkpoints you wrote yourself.

Format 2 (``meta.json`` ``format_version``) stores sharded tensors as world-size-independent
records (``hstu.training.reshard``), so a checkpoint written by N ranks loads on M: every rank
then reads every rank file (memory-mapped: only the pieces it copies are read from disk).
Format 1 files hold torchrec ``ShardedTensor`` objects tied to their writer's rank and load only
on the same world size.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Checkpointer", "capture_rng_state", "restore_rng_state", "LATEST_FILE", "META_FILE"]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
META_FILE = "meta.json"
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def _fsync_dir(path: Path) -> None:
    """Persist a directory entry (rename, create); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _barrier(world_size: int) -> None:
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Checkpointer:
    """Saves per-rank state dicts atomically under ``save_dir`` and keeps the newest ``keep_last``."""

    def __init__(self, save_dir: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 0:
            raise ValueError(
                f"Checkpointer: keep_last={keep_last} must be >= 0 (0 keeps every one)"
            )
        self.save_dir = Path(save_dir)
        self.keep_last = keep_last

    # ---- save ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        extra_meta: dict[str, Any] | None = None,
    ) -> Path:
        """Write this rank's ``state`` for ``step``; returns the final step directory.

        Collective when ``world_size > 1``: every rank must call it with the same step.
        """
        if step < 0:
            raise ValueError(f"Checkpointer.save: step={step} must be >= 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"Checkpointer.save: rank={rank} not in [0, world_size={world_size})")
        final = self.save_dir / _step_name(step)
        tmp = self.save_dir / (_step_name(step) + ".tmp")
        if rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crashed save of the same step
                shutil.rmtree(tmp)
            tmp.mkdir()
        _barrier(world_size)
        try:
            with open(tmp / _rank_file(rank), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            # Best effort: drop the partial directory so nothing half-written lingers. Other ranks
            # may be blocked in the barrier below; a failing rank is expected to end the job.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _barrier(world_size)
        if rank == 0:
            try:
                self._commit(step, tmp, final, world_size, extra_meta)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        _barrier(world_size)
        return final

    def _commit(
        self, step: int, tmp: Path, final: Path, world_size: int, extra_meta: dict | None
    ) -> None:
        missing = [_rank_file(r) for r in range(world_size) if not (tmp / _rank_file(r)).is_file()]
        if missing:
            raise RuntimeError(
                f"Checkpointer.save: {tmp} lacks {missing}; is {self.save_dir} on a filesystem "
                "shared by every rank?"
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "time": time.time(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "extra_meta": extra_meta or {},
        }
        _write_text_atomic(tmp / META_FILE, json.dumps(meta, indent=2, default=str))
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap the old one out
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.save_dir)
        _write_text_atomic(self.save_dir / LATEST_FILE, final.name + "\n")
        logger.info("saved checkpoint %s (world_size=%d)", final, world_size)
        self._prune(keep=final.name)

    def _prune(self, keep: str) -> None:
        for stale in [*self.save_dir.glob("step_*.tmp"), *self.save_dir.glob("step_*.old")]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last == 0:
            return
        steps = self.list_checkpoints(self.save_dir)
        for path in steps[: max(len(steps) - self.keep_last, 0)]:
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)
                logger.info("pruned checkpoint %s (keep_last=%d)", path, self.keep_last)

    # ---- discovery -----------------------------------------------------------------------------

    @staticmethod
    def list_checkpoints(root: str | os.PathLike) -> list[Path]:
        """Complete step directories under ``root`` (with ``meta.json``), oldest first."""
        root = Path(root)
        if not root.is_dir():
            return []
        found = []
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / META_FILE).is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    @staticmethod
    def resolve(load_dir: str | os.PathLike) -> Path:
        """The step directory named by ``load_dir``: a step dir itself or a root with ``latest``."""
        path = Path(load_dir)
        if not str(load_dir):
            raise ValueError("Checkpointer.load: empty checkpoint path (TrainerArgs.ckpt_load_dir)")
        if not path.exists():
            raise FileNotFoundError(
                f"checkpoint path {path} does not exist (TrainerArgs.ckpt_load_dir); give a "
                "checkpoint root (with a 'latest' file) or one of its step_XXXXXXXX directories"
            )
        if (path / META_FILE).is_file():
            return path
        if _STEP_DIR.match(path.name) or path.name.endswith(".tmp"):
            raise FileNotFoundError(
                f"checkpoint directory {path} has no {META_FILE}: it is incomplete (a save was "
                "interrupted); load its root or an earlier step instead"
            )
        latest = path / LATEST_FILE
        if latest.is_file():
            name = latest.read_text().strip()
            target = path / name
            swapped_out = path / (name + ".old")
            if not (target / META_FILE).is_file() and (swapped_out / META_FILE).is_file():
                # A re-save of the same step was interrupted between its two renames.
                logger.warning("%s is missing; using its previous copy %s", target, swapped_out)
                return swapped_out
            if not _STEP_DIR.match(name) or not (target / META_FILE).is_file():
                raise FileNotFoundError(
                    f"{latest} names {name!r}, but {target} is not a complete checkpoint "
                    f"(no {META_FILE}); the checkpoint root is damaged"
                )
            return target
        steps = Checkpointer.list_checkpoints(path)
        if steps:
            logger.warning(
                "%s has no '%s' file; using the newest checkpoint %s", path, LATEST_FILE, steps[-1]
            )
            return steps[-1]
        raise FileNotFoundError(
            f"no checkpoint found in {path}: expected a '{LATEST_FILE}' file or "
            f"step_XXXXXXXX/{META_FILE} directories"
        )

    @staticmethod
    def read_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
        meta_file = Path(step_dir) / META_FILE
        try:
            meta = json.loads(meta_file.read_text())
            int(meta["step"]), int(meta["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint metadata {meta_file} is corrupt or unreadable: {e}"
            ) from e
        return meta

    # ---- load ----------------------------------------------------------------------------------

    @staticmethod
    def _load_file(file: Path, map_location: Any, mmap: bool = False) -> dict[str, Any]:
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint file {file} is missing")
        if mmap:
            try:
                return torch.load(file, map_location=map_location, weights_only=False, mmap=True)
            except Exception:  # e.g. a legacy (non-zip) file: read it whole below
                logger.debug("memory-mapping %s failed; reading it whole", file)
        try:
            return torch.load(file, map_location=map_location, weights_only=False)
        except Exception as e:
            raise ValueError(f"checkpoint file {file} is corrupt or unreadable: {e}") from e

    @staticmethod
    def load(
        load_dir: str | os.PathLike,
        *,
        rank: int = 0,
        world_size: int = 1,
        map_location: Any = "cpu",
    ) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """Return ``(step, state, meta)`` for this rank.

        When ``world_size`` differs from the saved one, rank 0's state is returned (dense parts
        are replicated, so any rank's copy is right) and ``meta["resharded"]`` is True; sharded
        parts must then be re-routed by the caller from :meth:`load_all_ranks`.
        """
        step_dir = Checkpointer.resolve(load_dir)
        meta = Checkpointer.read_meta(step_dir)
        saved_world = int(meta["world_size"])
        resharded = saved_world != world_size
        src_rank = 0 if resharded else rank
        if resharded:
            logger.info(
                "checkpoint %s was saved by %d ranks, loading into %d: returning rank 0's state "
                "(sharded state is regrouped from load_all_ranks())",
                step_dir,
                saved_world,
                world_size,
            )
        state = Checkpointer._load_file(step_dir / _rank_file(src_rank), map_location)
        meta = dict(meta, resharded=resharded, loaded_from_rank=src_rank, path=str(step_dir))
        return int(meta["step"]), state, meta

    @staticmethod
    def load_all_ranks(
        load_dir: str | os.PathLike, map_location: Any = "cpu", *, mmap: bool = False
    ) -> list[dict[str, Any]]:
        """Every saved rank's state, in rank order (for re-sharding to a different world size).

        ``mmap=True`` maps the files instead of reading them: a rank that copies only its own
        rows out of every file reads only those pages.
        """
        step_dir = Checkpointer.resolve(load_dir)
        meta = Checkpointer.read_meta(step_dir)
        return [
            Checkpointer._load_file(step_dir / _rank_file(r), map_location, mmap=mmap)
            for r in range(int(meta["world_size"]))
        ]


# ---- RNG state ---------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when CUDA is in use) the current CUDA device's RNG states.

    Only the current device is captured: touching every visible GPU would create a CUDA context
    on each of them from every rank. A process that never initialised CUDA has nothing to save.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; missing entries are left untouched."""
    if "python" in state:
        py = state["python"]
        # A round trip through some serialisers turns the inner tuple into a list.
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            logger.warning("checkpoint has a CUDA RNG state but CUDA is not available; skipping it")
        else:
            torch.cuda.set_rng_state(cuda.cpu())
