"""`SequenceData`: the one in-memory (and cached on-disk) form of every dataset.

Every source (the synthetic generator, MovieLens, KuaiRand, SASRec-style files) becomes per-user,
time-ordered interaction sequences in CSR form. Training datasets and the evaluation protocol
read only this, so a new source needs only a converter.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "ARRAY_NAMES",
    "CHECKSUM",
    "DATA_FILE",
    "MANIFEST_FILE",
    "POSITION_TIMESTAMP_DATASETS",
    "PreparedDataError",
    "SequenceData",
    "array_checksum",
    "check_output_dir",
    "manifest_has_timestamps",
    "time_order_problem",
]

logger = logging.getLogger(__name__)

DATA_FILE = "sequences.npz"
MANIFEST_FILE = "manifest.json"
# the arrays of sequences.npz, each recorded in the manifest (shape, dtype, checksum)
ARRAY_NAMES = ("user_ids", "offsets", "item_ids", "actions", "timestamps", "user_features")
# hashlib algorithm of the array checksums: sha256 runs at ~1.7 GB/s on this project's CPU
# (hardware SHA), blake2b at ~0.9 GB/s; the manifest key names the algorithm
CHECKSUM = "sha256"
# converters whose "timestamps" are only the interaction's position in the file (SASRec-style
# files): a prepared dataset of theirs without the manifest key ``has_timestamps`` (written before
# the key existed) is read as having no real timestamps; every other one as having them
POSITION_TIMESTAMP_DATASETS = ("sequences", "amazon-beauty")
_POSITION_MARKER = "position in the file"  # extra["timestamps"] of those converters


@dataclass
class SequenceData:
    """Per-user time-ordered sequences.

    user_ids [U] int64 (raw user id, >= 0), offsets [U+1] int64 (CSR into the item arrays),
    item_ids [N] int64 (>= 0; 0 is a valid id, the models reserve no padding id),
    actions [N] int64 (bitmask over ``action_names``: bit k set = task k positive),
    timestamps [N] int64 (non-decreasing within each user),
    user_features [U, F] int64 (categorical contextual features, ids >= 0).

    ``has_timestamps``: whether ``timestamps`` are real times (Unix seconds or milliseconds, as
    the source gives them). False for the SASRec-style files, whose "timestamps" are only the
    order of the file; batches of such data carry no timestamps (`Batch.timestamps` is None).
    """

    name: str
    user_ids: np.ndarray
    offsets: np.ndarray
    item_ids: np.ndarray
    actions: np.ndarray
    timestamps: np.ndarray
    user_features: np.ndarray
    user_feature_names: list[str] = field(default_factory=list)
    action_names: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    has_timestamps: bool = True

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_users(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_interactions(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def num_tasks(self) -> int:
        return len(self.action_names)

    @property
    def item_vocab_size(self) -> int:
        """max item id + 1 (ids need not be dense)."""
        return int(self.item_ids.max()) + 1 if self.item_ids.size else 0

    @property
    def user_feature_cardinalities(self) -> list[int]:
        """max id + 1 per contextual feature."""
        if self.user_features.size == 0:
            return [1] * self.user_features.shape[1]
        return [int(x) + 1 for x in self.user_features.max(axis=0)]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def item_corpus(self) -> np.ndarray:
        """Sorted unique item ids: the full corpus that retrieval ranks against."""
        ids = self.item_ids
        # ids are >= 0 (validate): a presence mask is ~100x faster than sorting when the id
        # range is not much larger than the number of ids (ML-20M: 0.1 s instead of 10 s)
        if ids.size and int(ids.min()) >= 0 and int(ids.max()) < max(1 << 20, 4 * ids.size):
            seen = np.zeros(int(ids.max()) + 1, dtype=bool)
            seen[ids] = True
            return np.flatnonzero(seen).astype(ids.dtype, copy=False)
        return np.unique(ids)

    def user_slice(self, u: int) -> slice:
        return slice(int(self.offsets[u]), int(self.offsets[u + 1]))

    def user_rows(self, user_ids) -> np.ndarray:
        """Row of each raw user id (int64 array), -1 for an id not in the data: one sorted
        search for the whole array (the sorted index is built on first use)."""
        index = self.__dict__.get("_user_index")
        if index is None:
            ids = np.asarray(self.user_ids, dtype=np.int64)
            order = np.argsort(ids, kind="stable")
            index = self.__dict__["_user_index"] = (ids[order], order)
        sorted_ids, rows = index
        uids = np.asarray(user_ids, dtype=np.int64).reshape(-1)
        if not len(sorted_ids):
            return np.full(uids.shape, -1, dtype=np.int64)
        pos = np.searchsorted(sorted_ids, uids).clip(max=len(sorted_ids) - 1)
        return np.where(sorted_ids[pos] == uids, rows[pos], -1).astype(np.int64)

    def histories_before_last(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every item of each row's user but the last (the leave-one-out target), jagged:
        (item ids, offsets [len(rows) + 1]), gathered at once."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = np.asarray(self.offsets, dtype=np.int64)
        lo = starts[rows]
        lengths = np.maximum(starts[rows + 1] - 1 - lo, 0)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # index of every history element: its row's start + its position inside the row
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
        values = np.asarray(self.item_ids)[np.repeat(lo, lengths) + within]
        return values.astype(np.int64, copy=False), offsets

    # ---- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first broken invariant."""
        u = self.user_ids.shape[0]
        arrays = {
            "user_ids": self.user_ids,
            "offsets": self.offsets,
            "item_ids": self.item_ids,
            "actions": self.actions,
            "timestamps": self.timestamps,
            "user_features": self.user_features,
        }
        for key, arr in arrays.items():
            if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{self.name}: {key} must be an integer numpy array")
        if self.offsets.shape != (u + 1,):
            raise ValueError(f"{self.name}: offsets must have shape [{u + 1}]")
        if u and (self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0)):
            raise ValueError(f"{self.name}: offsets must start at 0 and be non-decreasing")
        n = int(self.offsets[-1]) if u else 0
        for key in ("item_ids", "actions", "timestamps"):
            if arrays[key].shape != (n,):
                raise ValueError(f"{self.name}: {key} must have shape [{n}]")
        if self.user_features.ndim != 2 or self.user_features.shape[0] != u:
            raise ValueError(f"{self.name}: user_features must have shape [{u}, F]")
        if self.user_features.shape[1] != len(self.user_feature_names):
            raise ValueError(f"{self.name}: user_feature_names must name each user feature column")
        if n and self.item_ids.min() < 0:
            bad = int(np.argmax(self.item_ids < 0))
            raise ValueError(
                f"{self.name}: negative item id {int(self.item_ids[bad])} at row {bad}"
            )
        if u and self.user_ids.min() < 0:
            raise ValueError(f"{self.name}: negative user id")
        if self.user_features.size and self.user_features.min() < 0:
            raise ValueError(f"{self.name}: negative contextual feature id")

    # ---- cache ---------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays written to ``sequences.npz``, by name (in `ARRAY_NAMES` order)."""
        return {name: getattr(self, name) for name in ARRAY_NAMES}

    def save(self, directory: str | Path, manifest: dict | None = None) -> Path:
        """Write ``sequences.npz`` + ``manifest.json`` into ``directory``, all or nothing.

        Both files are written into a temporary directory next to (or, when it exists, inside)
        ``directory`` and moved into place at the end, so a failure (a full disk, a kill) leaves
        the previous files as they were and no partial file behind. The manifest records each
        array's shape, dtype and sha256 (`SequenceData.load` checks them). An unusable
        location raises NotADirectoryError / PermissionError / OSError with a one-line message
        naming it.
        """
        directory = Path(directory)
        arrays = self.arrays()
        meta = {
            "name": self.name,
            "num_users": self.num_users,
            "num_items": int(self.item_corpus().size),
            "num_interactions": self.num_interactions,
            "item_id_range": [int(self.item_ids.min()), int(self.item_ids.max())]
            if self.num_interactions
            else [0, -1],
            "user_feature_names": list(self.user_feature_names),
            "user_feature_cardinalities": self.user_feature_cardinalities,
            "action_names": list(self.action_names),
            "has_timestamps": bool(self.has_timestamps),
            "extra": self.extra,
        }
        meta.update(manifest or {})
        meta["arrays"] = {name: array_record(a) for name, a in arrays.items()}
        nbytes = sum(a.nbytes for a in arrays.values())
        stage = make_stage_dir(directory)
        try:
            np.savez(stage / DATA_FILE, **arrays)
            meta["data_file"] = {"name": DATA_FILE, "bytes": (stage / DATA_FILE).stat().st_size}
            (stage / MANIFEST_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            _commit(stage, directory)
        except OSError as err:
            raise write_error(err, directory, nbytes) from err
        finally:
            if stage.exists():
                shutil.rmtree(stage, ignore_errors=True)
        return directory

    @classmethod
    def load(cls, directory: str | Path, *, fix: str | None = None) -> SequenceData:
        """Read a prepared dataset and check it against its manifest.

        Raises FileNotFoundError (files missing) or `PreparedDataError` (a ValueError: a
        manifest that is not JSON, a data file that is empty, truncated, unreadable or does not
        match the manifest's sizes, shapes, dtypes, checksums or counts), each one line naming
        the file and the command that re-creates it: the manifest's own ``command`` (with
        ``--force``), else ``fix``, else a generic one. A manifest without checksums (written
        before they existed) loads with a one-line warning.
        """
        directory = Path(directory)
        data_path, man_path = directory / DATA_FILE, directory / MANIFEST_FILE
        if not data_path.exists() or not man_path.exists():
            raise FileNotFoundError(
                f"no prepared dataset in {directory} (expected {DATA_FILE} and {MANIFEST_FILE}); "
                f"prepare it with: python -m hstu.data.prepare --dataset <name> --source <raw files>"
            )
        generic = fix or (
            "python -m hstu.data.prepare --dataset <name> --source <raw files> "
            f"--output {directory} --force"
        )
        try:
            meta = json.loads(man_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PreparedDataError(
                f"{man_path}: unreadable manifest ({_one_line(err)}); re-create the dataset "
                f"with: {generic}"
            ) from None
        if not isinstance(meta, dict):
            raise PreparedDataError(
                f"{man_path}: the manifest is not a JSON object; re-create the dataset with: "
                f"{generic}"
            )
        command = rerun_command(meta, generic)
        arrays = read_verified_arrays(directory, meta, command)
        try:
            return cls(
                name=meta["name"],
                user_feature_names=list(meta.get("user_feature_names", [])),
                action_names=list(meta.get("action_names", [])),
                extra=dict(meta.get("extra", {})),
                has_timestamps=manifest_has_timestamps(meta),
                **arrays,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise PreparedDataError(
                f"{data_path}: invalid prepared dataset ({_one_line(err)}); re-create it with: "
                f"{command}"
            ) from None


def manifest_has_timestamps(meta: dict) -> bool:
    """Whether a prepared dataset's timestamps are real, from its manifest: the key
    ``has_timestamps``, else (manifests written before it existed) False only for the
    SASRec-style converters, whose timestamps are file positions."""
    flag = meta.get("has_timestamps")
    if isinstance(flag, bool):
        return flag
    extra = meta.get("extra")
    if isinstance(extra, dict) and extra.get("timestamps") == _POSITION_MARKER:
        return False
    return meta.get("dataset") not in POSITION_TIMESTAMP_DATASETS


def time_order_problem(data: SequenceData) -> str | None:
    """What is wrong with ``data``'s timestamps, or None: a negative timestamp, or timestamps
    going backwards inside a user (samples are cut by position, so positions must be in time
    order). One sentence naming the first offending row."""
    ts = data.timestamps
    if ts.size and int(ts.min()) < 0:
        i = int(np.argmax(ts < 0))
        row = int(np.searchsorted(data.offsets, i, side="right")) - 1
        return (
            f"negative timestamp {int(ts[i])} at row {i} (user {int(data.user_ids[row])}); "
            "timestamps must be >= 0 (Unix time)"
        )
    if ts.size < 2:
        return None
    back = np.diff(ts) < 0
    # a step from one user's last row to the next user's first row may go back: not a problem
    starts = data.offsets[1:-1]
    back[starts[(starts > 0) & (starts < ts.size)] - 1] = False
    if not back.any():
        return None
    i = int(np.argmax(back)) + 1
    row = int(np.searchsorted(data.offsets, i, side="right")) - 1
    return (
        f"timestamps go backwards inside user {int(data.user_ids[row])} (row {i}: "
        f"{int(ts[i - 1])} -> {int(ts[i])}); each user's interactions must be sorted by time"
    )


# ---- the manifest's proof of the arrays ----------------------------------------------------------


class PreparedDataError(ValueError):
    """A prepared dataset that does not match its manifest (or cannot be read); the message is
    one line naming the file and the command that re-creates it."""


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def array_checksum(a: np.ndarray) -> str:
    """Hex sha256 of an array's bytes in memory (C order); ~1.7 GB/s here (docs/datasets.md)."""
    h = hashlib.new(CHECKSUM)
    if a.size:  # (a memoryview of a shape with a zero, e.g. [U, 0] features, cannot be cast)
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def array_record(a: np.ndarray) -> dict:
    """What the manifest records of one array: shape, dtype and checksum."""
    return {"shape": list(a.shape), "dtype": a.dtype.str, CHECKSUM: array_checksum(a)}


def rerun_command(meta: dict, fallback: str) -> str:
    """The command that re-creates a prepared dataset: its manifest's (``--force`` added, so
    it rebuilds even when the inputs did not change), else ``fallback``."""
    command = meta.get("command")
    if isinstance(command, str) and command.startswith("python -m hstu.data.prepare"):
        return command if " --force" in command else f"{command} --force"
    return fallback


def read_verified_arrays(directory: Path, meta: dict, command: str) -> dict[str, np.ndarray]:
    """The arrays of ``directory/sequences.npz``, checked against ``meta`` (the manifest): file
    size, array names, shapes, dtypes, checksums and the manifest's counts. One-line
    `PreparedDataError` naming the file and ``command`` on any mismatch."""
    data_path, man_path = directory / DATA_FILE, directory / MANIFEST_FILE

    def bad(problem: str) -> PreparedDataError:
        return PreparedDataError(
            f"{data_path}: {problem}; the prepared dataset is damaged or was replaced, "
            f"re-create it with: {command}"
        )

    size = data_path.stat().st_size
    if size == 0:
        raise bad("the file is empty (0 bytes)")
    records = meta.get("arrays")
    recorded_size = (meta.get("data_file") or {}).get("bytes")
    if isinstance(recorded_size, int) and size != recorded_size:
        raise bad(f"the file has {size} bytes but {MANIFEST_FILE} records {recorded_size}")
    try:
        with np.load(data_path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise bad(f"not a readable .npz archive ({_one_line(err)})") from None
    if set(arrays) != set(ARRAY_NAMES):
        missing = sorted(set(ARRAY_NAMES) - set(arrays))
        extra = sorted(set(arrays) - set(ARRAY_NAMES))
        raise bad(f"holds arrays {sorted(arrays)} (missing {missing}, unexpected {extra})")
    if not isinstance(records, dict):
        logger.warning(
            "%s has no checksums (written before prepared data carried them): %s loaded "
            "unverified; re-create it to add them: %s",
            man_path,
            data_path,
            command,
        )
    else:
        for name in ARRAY_NAMES:
            rec, a = records.get(name), arrays[name]
            if not isinstance(rec, dict):
                raise bad(f"{MANIFEST_FILE} has no record of array {name!r}")
            shape, dtype = list(a.shape), a.dtype.str
            if rec.get("shape") != shape or rec.get("dtype") != dtype:
                raise bad(
                    f"array {name!r} is {dtype}{shape} but {MANIFEST_FILE} records "
                    f"{rec.get('dtype')}{rec.get('shape')}"
                )
            want = rec.get(CHECKSUM)
            if want is None:
                raise bad(f"{MANIFEST_FILE} records no {CHECKSUM} of array {name!r}")
            got = array_checksum(a)
            if got != want:
                raise bad(
                    f"array {name!r} has {CHECKSUM} {got[:12]}... but {MANIFEST_FILE} records "
                    f"{str(want)[:12]}..."
                )
    _check_counts(meta, arrays, bad)
    return arrays


def _check_counts(meta: dict, arrays: dict[str, np.ndarray], bad) -> None:
    """The manifest's counts must describe the arrays (also for manifests without checksums)."""
    items, users, feats = arrays["item_ids"], arrays["user_ids"], arrays["user_features"]
    actual = {
        "num_users": int(users.shape[0]),
        "num_interactions": int(items.shape[0]),
        "item_id_range": [int(items.min()), int(items.max())] if items.size else [0, -1],
    }
    for key, value in actual.items():
        if key in meta and meta[key] != value:
            raise bad(f"{MANIFEST_FILE} records {key}={meta[key]} but the arrays hold {value}")
    names = meta.get("user_feature_names")
    if isinstance(names, list) and feats.ndim == 2 and len(names) != feats.shape[1]:
        raise bad(
            f"{MANIFEST_FILE} names {len(names)} user features but user_features has "
            f"{feats.shape[1]} columns"
        )


# ---- writing a prepared dataset ------------------------------------------------------------------


def check_output_dir(directory: Path) -> None:
    """NotADirectoryError (one line) when ``directory`` or one of its parents is a file."""
    for p in (directory, *directory.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == directory else f"is inside {p}, which is a file"
            raise NotADirectoryError(
                f"output directory {directory} {where}, not a directory; pass --output a "
                "directory (it is created if missing)"
            )


def make_stage_dir(directory: Path) -> Path:
    """A new temporary directory for writing ``directory``'s files: inside it when it exists
    (same file system, no write access to its parent needed), else next to it. Checks the
    location first (`check_output_dir`); one-line errors for an unwritable place."""
    check_output_dir(directory)
    try:
        parent = directory if directory.is_dir() else directory.parent
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{directory.name}.writing-", dir=parent))
    except OSError as err:
        raise write_error(err, directory, 0) from err


def _commit(stage: Path, directory: Path) -> None:
    """Move the staged files into ``directory``: one rename when it does not exist yet, else
    the stale manifest is removed first, the data file replaced, then the new manifest moved
    in (a crash in between leaves data without a manifest: "not prepared", never a mismatch
    that looks valid)."""
    if not directory.exists():
        os.rename(stage, directory)
        return
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    os.replace(stage / DATA_FILE, directory / DATA_FILE)
    os.replace(stage / MANIFEST_FILE, directory / MANIFEST_FILE)


def write_error(err: OSError, directory: Path, nbytes: int) -> OSError:
    """A one-line OSError of the same kind for a failed write into ``directory``."""
    code = err.errno
    if code == errno.ENOSPC or code == errno.EDQUOT:
        size = f" (the dataset needs about {nbytes / 1e6:.0f} MB)" if nbytes else ""
        out = OSError(
            f"no space left on the device of {directory} while writing the prepared "
            f"dataset{size}; free space or pass --output on another disk (nothing was "
            "changed there)"
        )
    elif isinstance(err, PermissionError) or code in (errno.EACCES, errno.EPERM, errno.EROFS):
        out = PermissionError(
            f"cannot write to {err.filename or directory}: "
            f"{os.strerror(code) if code else 'permission denied'}; pass --output a writable "
            "directory"
        )
    elif isinstance(err, NotADirectoryError):
        out = NotADirectoryError(
            f"cannot write to {directory}: {err.filename or 'a path component'} is not a "
            "directory; pass --output a directory"
        )
    else:
        out = OSError(f"cannot write the prepared dataset to {directory}: {_one_line(err)}")
    out.errno = code
    return out
