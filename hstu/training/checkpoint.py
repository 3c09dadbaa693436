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

A failed write (disk full, permission, I/O error) on any rank removes the temporary directory,
leaves ``latest`` and every earlier checkpoint as they were, and is raised on every rank as one
:class:`CheckpointWriteError` (an ``OSError``) naming the checkpoint, e.g. "disk full while
writing checkpoint ...".

Files are written with ``torch.save`` and read with ``torch.load(weights_only=True)``: a rank file
may hold tensors and plain Python values only (dicts, lists, tuples, numbers, strings), which
``save`` checks before writing. A file holding anything else (a planted pickle whose
``__reduce__`` would run code, in the zip or the legacy format) is refused on load with
:class:`UnsafeCheckpointError` naming the file; nothing in it is executed.

Format 3 (``meta.json`` ``format_version``) is format 2 with the NumPy RNG state stored as a
tensor and plain values. Format 2 stores sharded tensors as world-size-independent records
(``hstu.training.reshard``), so a checkpoint written by N ranks loads on M: every rank then reads
every rank file (memory-mapped: only the pieces it copies are read from disk). Format 2 files
hold the NumPy RNG state as a ``numpy.ndarray``: they load with exactly the NumPy array types
allowed in addition, and the state is converted on load. Format 1 files hold torchrec
``ShardedTensor`` objects, which cannot be loaded without running pickled code: they are refused
with one line.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hstu.comm import all_reduce_sum_host

__all__ = [
    "Checkpointer",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "capture_rng_state",
    "restore_rng_state",
    "BEST_FILE",
    "LATEST_FILE",
    "META_FILE",
]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
# the step directory of the run's best evaluation (TrainerArgs.best_metric) and its score;
# pruning spares that directory
BEST_FILE = "best.json"
META_FILE = "meta.json"
FORMAT_VERSION = 3


def _numpy_array_globals() -> list:
    """What format 2 files need besides tensors: the NumPy RNG state's ndarray of uint32.

    Exactly the ndarray reconstruction, ``numpy.dtype`` and the uint32 dtype class are allowed
    (pickles of anything else are still refused), under both module names NumPy has used
    (``numpy.core`` in 1.x, ``numpy._core`` in 2.x) whichever NumPy wrote the file.
    """
    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


# leaves a rank file may hold (what torch.load(weights_only=True) rebuilds without extra globals)
_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype)
_SAFE_LEAVES += (torch.device, torch.Size)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permission, I/O error); one line naming it.

    The partial write is removed and ``latest`` still names the previous checkpoint."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds objects that weights-only loading refuses (nothing in it ran)."""


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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _check_safe(obj: Any, where: str) -> None:
    """Raise TypeError unless ``obj`` holds only what weights-only loading rebuilds (tensors,
    plain values and containers of them), so that every file ``save`` writes loads back."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"{where}: key {k!r} ({type(k).__name__}) is not a plain value")
            _check_safe(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            _check_safe(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; checkpoints hold tensors "
        "and plain Python values only (they are loaded with weights_only=True): convert it "
        "before saving (sharded tensors: hstu.training.reshard.to_portable)"
    )


def _errors_in_chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain, or torch's zip writer reporting a failed write
    (``inline_container.cc``: "file write failed", "unexpected pos ...")."""
    for e in _errors_in_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        msg = str(e).lower()
        if isinstance(e, RuntimeError) and "inline_container" in msg:
            if "write" in msg or "unexpected pos" in msg:
                return True
    return False


def _free_space(path: Path) -> str:
    for p in (path, *path.parents):
        try:
            return f"{shutil.disk_usage(p).free / 2**20:.1f} MiB free"
        except OSError:
            continue
    return "free space unknown"


def _agree(ok: bool, world_size: int) -> bool:
    """True when every rank reports ``ok`` (a collective over the host group: also a barrier)."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        return all_reduce_sum_host([0.0 if ok else 1.0])[0] == 0.0
    return ok


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

    def step_dir(self, step: int) -> Path:
        """Where `save` puts the checkpoint of ``step``."""
        return self.save_dir / _step_name(step)

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
        # Three phases, each closed by an agreement of all ranks (which is also the barrier): a
        # failure on any rank makes every rank raise, after rank 0 removed the partial directory.
        error: Exception | None = None
        try:
            _check_safe(state, f"Checkpointer.save: state of rank {rank}")
        except TypeError as e:
            error = e
        if rank == 0 and error is None:
            try:
                self.save_dir.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a crashed save of the same step
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except Exception as e:
                error = e
        self._settle(error, world_size, rank, tmp, final, "create")
        own = tmp / _rank_file(rank)
        try:
            with open(own, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:
            error = e
            own.unlink(missing_ok=True)
        except BaseException:
            # interrupted: drop the partial directory so nothing half-written lingers
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._settle(error, world_size, rank, tmp, final, "write")
        if rank == 0:
            try:
                self._commit(step, tmp, final, world_size, extra_meta)
            except Exception as e:
                error = e
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self._settle(error, world_size, rank, tmp, final, "commit")
        return final

    def _settle(
        self,
        error: Exception | None,
        world_size: int,
        rank: int,
        tmp: Path,
        final: Path,
        phase: str,
    ) -> None:
        """Agree on the phase's outcome; on a failure anywhere, clean up and raise on every rank
        (this rank's own error, translated; or one naming the phase another rank failed in)."""
        if _agree(error is None, world_size):
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise CheckpointWriteError(
                f"another rank failed to {phase} checkpoint {final} (see its error); "
                f"{self._still_latest()}"
            )
        translated = self._write_error(error, final)
        if translated is error:
            raise error
        raise translated from error

    def _still_latest(self) -> str:
        try:
            name = (self.save_dir / LATEST_FILE).read_text().strip()
        except OSError:
            name = ""
        if name:
            return f"the latest checkpoint is still {self.save_dir / name}"
        return "no earlier checkpoint exists"

    def _write_error(self, error: Exception, final: Path) -> Exception:
        """One-line CheckpointWriteError for an I/O failure; other errors are returned as is."""
        io = any(isinstance(e, OSError) for e in _errors_in_chain(error))
        if _is_disk_full(error):
            e = CheckpointWriteError(
                f"disk full while writing checkpoint {final} ({_one_line(error, 160)}); the "
                f"partial write was removed and {self._still_latest()}; free space on "
                f"{self.save_dir} ({_free_space(self.save_dir)}) or point "
                "TrainerArgs.ckpt_save_dir at a larger disk"
            )
            e.errno = errno.ENOSPC
            return e
        if io or (isinstance(error, RuntimeError) and "inline_container" in str(error)):
            err_no = next(
                (x.errno for x in _errors_in_chain(error) if isinstance(x, OSError)), None
            )
            e = CheckpointWriteError(
                f"could not write checkpoint {final}: {_one_line(error, 200)}; the partial "
                f"write was removed and {self._still_latest()}"
            )
            e.errno = err_no
            return e
        return error

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
        try:
            self._prune(keep=final.name)
        except OSError as e:  # the new checkpoint is complete and latest already
            logger.warning("could not prune old checkpoints in %s: %s", self.save_dir, e)

    def _prune(self, keep: str) -> None:
        stale = [self.save_dir.glob(f"step_*.{suffix}") for suffix in ("tmp", "old", "pruned")]
        for path in [p for found in stale for p in found]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        if self.keep_last == 0:
            return
        best = self.best_checkpoint(self.save_dir)
        steps = [p for p in self.list_checkpoints(self.save_dir) if p != best]
        for path in steps[: max(len(steps) - self.keep_last, 0)]:
            if path.name != keep:
                # renamed first: a kill during the removal leaves no step directory that has a
                # meta.json but lacks rank files
                doomed = path.with_name(path.name + ".pruned")
                os.replace(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                logger.info("pruned checkpoint %s (keep_last=%d)", path, self.keep_last)

    def mark_best(self, step_dir: str | os.PathLike, info: dict[str, Any]) -> None:
        """Records ``step_dir`` (a complete checkpoint of this root) as the best one, with
        ``info`` (its metric and score), in ``best.json``; pruning spares it from then on, and the
        checkpoint it replaces as best is pruned like any other. Rank 0."""
        step_dir = Path(step_dir)
        if (
            step_dir.parent.resolve() != self.save_dir.resolve()
            or not (step_dir / META_FILE).is_file()
        ):
            raise ValueError(
                f"mark_best: {step_dir} is not a complete checkpoint of {self.save_dir}"
            )
        record = {"dir": step_dir.name, **info}
        _write_text_atomic(self.save_dir / BEST_FILE, json.dumps(record, indent=2) + "\n")

    @staticmethod
    def best_checkpoint(root: str | os.PathLike) -> Path | None:
        """The step directory ``best.json`` names under ``root`` (None: no such file, or it names
        no complete checkpoint)."""
        try:
            name = json.loads((Path(root) / BEST_FILE).read_text()).get("dir", "")
        except (OSError, ValueError, AttributeError):
            return None
        path = Path(root) / str(name)
        if not _STEP_DIR.match(str(name)) or not (path / META_FILE).is_file():
            return None
        return path

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
        """The step directory named by ``load_dir``: a step dir itself, a root with ``latest``, or
        a root's ``best.json`` (the best evaluation's checkpoint, TrainerArgs.best_metric)."""
        path = Path(load_dir)
        if not str(load_dir):
            raise ValueError("Checkpointer.load: empty checkpoint path (TrainerArgs.ckpt_load_dir)")
        if not path.exists():
            raise FileNotFoundError(
                f"checkpoint path {path} does not exist (TrainerArgs.ckpt_load_dir); give a "
                "checkpoint root (with a 'latest' file) or one of its step_XXXXXXXX directories"
            )
        if path.name == BEST_FILE and path.is_file():  # the best evaluation's checkpoint
            best = Checkpointer.best_checkpoint(path.parent)
            if best is None:
                raise FileNotFoundError(
                    f"{path} names no complete checkpoint of {path.parent} (pruned or damaged); "
                    "load the checkpoint root (its latest) or a step_XXXXXXXX directory instead"
                )
            return best
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
            if not _STEP_DIR.match(name):  # never a path elsewhere
                raise FileNotFoundError(
                    f"{latest} names {name[:80]!r}, which is not a step_XXXXXXXX directory; the "
                    "checkpoint root is damaged"
                )
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
    def _load_file(
        file: Path, map_location: Any, mmap: bool = False, format_version: int = FORMAT_VERSION
    ) -> dict[str, Any]:
        """``torch.load(weights_only=True)`` of one rank file; format 2 files also allow the
        NumPy array of their RNG state (converted to the current form on load)."""
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint file {file} is missing")
        extra = _numpy_array_globals() if format_version < 3 else []
        with warnings.catch_warnings(), torch.serialization.safe_globals(extra):
            # torch warns about pickles of a protocol it did not write itself (refused below)
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            if mmap:
                try:
                    state = torch.load(
                        file, map_location=map_location, weights_only=True, mmap=True
                    )
                    return _upgrade_rng(state)
                except pickle.UnpicklingError as e:
                    raise _unsafe(file, e, format_version) from None
                except Exception:  # e.g. a legacy (non-zip) file: read it whole below
                    logger.debug("memory-mapping %s failed; reading it whole", file)
            try:
                state = torch.load(file, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as e:
                raise _unsafe(file, e, format_version) from None
            except Exception as e:
                raise ValueError(
                    f"checkpoint file {file} is corrupt or unreadable: {_one_line(e)}"
                ) from e
        return _upgrade_rng(state)

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
        fmt = int(meta.get("format_version", 1))
        state = Checkpointer._load_file(
            step_dir / _rank_file(src_rank), map_location, format_version=fmt
        )
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
        fmt = int(meta.get("format_version", 1))
        return [
            Checkpointer._load_file(
                step_dir / _rank_file(r), map_location, mmap=mmap, format_version=fmt
            )
            for r in range(int(meta["world_size"]))
        ]


def _unsafe(file: Path, error: Exception, format_version: int) -> Exception:
    """The one-line refusal of a file that weights-only loading rejected."""
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    what = f"GLOBAL {found.group(1)}" if found else None
    if what is None:
        try:
            with open(file, "rb") as f:
                is_pickle = f.read(1) == b"\x80"  # a pickle stream starts with PROTO
        except OSError:
            is_pickle = False
        if not is_pickle:  # neither a zip archive nor a pickle: damaged
            return ValueError(f"checkpoint file {file} is corrupt or unreadable: not a torch file")
        op = re.search(r"Unsupported operand \d+", text)
        what = op.group(0) if op else "a pickle instruction weights-only loading refuses"
    if format_version < 2 and found and "sharded_tensor" in found.group(1).lower():
        return UnsafeCheckpointError(
            f"checkpoint file {file} is in checkpoint format {format_version}, whose torchrec "
            "ShardedTensor objects can only be loaded by running pickled code, so it is refused: "
            "start a new run, or resume from a checkpoint of format 2 or later"
        )
    return UnsafeCheckpointError(
        f"checkpoint file {file} holds pickled objects other than tensors and plain values "
        f"({what}): refused, since loading them could run code (nothing in it was run); it was "
        "not written by hstu or was modified, so resume from a checkpoint you trust"
    )


# ---- RNG state ---------------------------------------------------------------------------------


def _numpy_rng_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    """NumPy's legacy-generator state (``np.random.get_state(legacy=False)``) with its uint32 key
    array as an int64 tensor: loadable with weights_only=True."""
    return {
        "bit_generator": str(state["bit_generator"]),
        "key": torch.from_numpy(np.asarray(state["state"]["key"], dtype=np.int64)),
        "pos": int(state["state"]["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "gauss": float(state["gauss"]),
    }


def _numpy_rng_from_saved(saved: Any) -> Any:
    """The argument of ``np.random.set_state`` for a saved NumPy state (either form)."""
    if isinstance(saved, Mapping):
        key = saved["key"]
        key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        return {
            "bit_generator": saved["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": int(saved["pos"])},
            "has_gauss": int(saved["has_gauss"]),
            "gauss": float(saved["gauss"]),
        }
    return saved  # format 2: the tuple of np.random.get_state(), ndarray included


def _upgrade_rng(state: Any) -> Any:
    """A loaded rank file with a format-2 NumPy RNG state converted to the current form."""
    rng = state.get("rng") if isinstance(state, Mapping) else None
    if isinstance(rng, Mapping) and isinstance(rng.get("numpy"), tuple):
        name, key, pos, has_gauss, gauss = rng["numpy"][:5]
        legacy = {"state": {"key": key, "pos": pos}, "has_gauss": has_gauss, "gauss": gauss}
        rng = dict(rng, numpy=_numpy_rng_to_plain({"bit_generator": name, **legacy}))
        state = dict(state, rng=rng)
    return state


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when CUDA is in use) the current CUDA device's RNG states,
    as tensors and plain Python values.

    Only the current device is captured: touching every visible GPU would create a CUDA context
    on each of them from every rank. A process that never initialised CUDA has nothing to save.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_rng_to_plain(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (also takes the format-2 NumPy tuple); missing
    entries are left untouched."""
    if "python" in state:
        py = state["python"]
        # A round trip through some serialisers turns the inner tuple into a list.
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        np.random.set_state(_numpy_rng_from_saved(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            logger.warning("checkpoint has a CUDA RNG state but CUDA is not available; skipping it")
        else:
            torch.cuda.set_rng_state(cuda.cpu())
