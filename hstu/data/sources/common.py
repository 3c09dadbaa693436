"""Shared helpers for the raw-dataset converters: locating and reading files, validation with line
numbers, checksums, categorical encodings and the CSR sequence builder.

Every reader here fails loudly: a missing file names the file and where it looked; a malformed row
names the file, its line number(s) and the offending text. Nothing is ever dropped silently.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from hstu.config.limits import MAX_ITEM_ID
from hstu.data.sequences import SequenceData

__all__ = [
    "FORMAT_VERSION",
    "ID_MAX",
    "TIME_HINT",
    "DataFormatError",
    "BuildOptions",
    "BuildResult",
    "Column",
    "byte_bar",
    "line_texts",
    "progress_default",
    "sha256_file",
    "find_file",
    "open_binary",
    "read_table",
    "encode_categorical",
    "build_sequence_data",
]

logger = logging.getLogger(__name__)

# Bump when the output of any converter changes for the same inputs: old caches are then rebuilt.
FORMAT_VERSION = 1

_INT64_MAX = 2**63 - 1
# Ids of the official formats: the int32 range (item ids index the item table, user ids alike)
ID_MAX = MAX_ITEM_ID

# Column.negative_hint of the time columns
TIME_HINT = "timestamps are Unix times and never negative"

# How many offending lines an error message quotes.
_MAX_REPORTED = 5


class DataFormatError(ValueError):
    """A raw input file does not have the expected layout; the message names file and lines."""


@dataclass
class BuildOptions:
    """What a converter needs beyond its input files."""

    name: str
    progress: bool = False
    fmt: str = "auto"  # sequences only: auto | pairs | lines


@dataclass
class BuildResult:
    """A converter's output: the sequences plus bookkeeping for the manifest."""

    data: SequenceData
    rows_read: dict[str, int] = field(default_factory=dict)  # input role -> data rows read
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows dropped (0 when none)
    stats: dict = field(default_factory=dict)  # anything else worth recording (vocabularies, ...)


def progress_default() -> bool:
    """Progress bars only for people: off when stderr is not a TTY or under CI."""
    return sys.stderr.isatty() and not os.environ.get("CI")


# ---- files ---------------------------------------------------------------------------------------
def byte_bar(total: int | None, desc: str, progress: bool) -> tqdm:
    """A tqdm bar counting bytes (disabled unless ``progress``)."""
    return tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False
    )


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file's bytes (as stored: a .gz file is hashed compressed)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, byte_bar(size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def find_file(
    source: Path, names: Sequence[str], what: str, subdirs: Sequence[str] = ("",)
) -> Path:
    """First existing ``source/<subdir>/<name>[.gz]``; else FileNotFoundError saying where it looked.

    ``names`` are alternatives (e.g. an official name and a variant); ``what`` says what the file
    is for, so the message reads e.g. "ratings file ratings.dat not found in ...".
    """
    tried: list[Path] = []
    for sub in subdirs:
        base = source / sub if sub else source
        for name in names:
            for cand in (base / name, base / (name + ".gz")):
                tried.append(cand)
                if cand.is_file():
                    return cand
    looked = sorted({str(p.parent) for p in tried if p.parent.is_dir()}) or [str(source)]
    present = sorted(p.name for p in source.iterdir())[:20] if source.is_dir() else []
    raise FileNotFoundError(
        f"{what} {' or '.join(names)} not found (also tried .gz) in {', '.join(looked)}; "
        f"{source} holds: {present or 'nothing'}. Pass --source pointing at the directory with "
        f"the official files (or omit --source to download the official release, where one "
        f"exists)."
    )


class _ProgressReader(io.RawIOBase):
    """Binary reader that advances a tqdm bar by the bytes read from disk."""

    def __init__(self, f: BinaryIO, bar: tqdm) -> None:
        self._f, self._bar = f, bar

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self._f.readinto(b)
        self._bar.update(n or 0)
        return n or 0

    def close(self) -> None:
        self._f.close()
        self._bar.close()
        super().close()


class _CheckedGzip(io.RawIOBase):
    """Reads a gzip stream; a truncated, corrupt or not-gzip file raises `DataFormatError`
    naming the file (instead of EOFError / BadGzipFile / zlib.error from deep in a parser)."""

    def __init__(self, raw: BinaryIO, path: Path) -> None:
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self._path = path

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        try:
            return self._gz.readinto(b)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise gzip_error(self._path, e) from None

    def close(self) -> None:
        self._gz.close()
        super().close()


def gzip_error(path: Path, err: BaseException) -> DataFormatError:
    """One line for a gzip file that cannot be read to its end."""
    if isinstance(err, gzip.BadGzipFile):
        with open(path, "rb") as f:
            head = f.read(8)
        return DataFormatError(
            f"{path}: not a gzip file although its name ends in .gz (it starts with {head!r}); "
            "if it is plain text, rename it without .gz, else download or copy it again"
        )
    if isinstance(err, EOFError):
        return DataFormatError(
            f"{path}: the gzip file is truncated (it ends before its end-of-stream marker); "
            "download or copy it again"
        )
    return DataFormatError(f"{path}: corrupt gzip data ({err}); download or copy it again")


def open_binary(path: Path, progress: bool = False, desc: str | None = None) -> BinaryIO:
    """Open a (possibly gzip-compressed) file for binary reading; the bar counts on-disk bytes.
    A damaged ``.gz`` raises `DataFormatError` naming the file when the damage is read."""
    bar = byte_bar(path.stat().st_size, desc or f"read {path.name}", progress)
    raw = io.BufferedReader(_ProgressReader(open(path, "rb"), bar), buffer_size=1 << 20)
    if path.suffix == ".gz":
        return io.BufferedReader(_CheckedGzip(raw, path), buffer_size=1 << 20)  # type: ignore[return-value]
    return raw  # type: ignore[return-value]


def _first_line(path: Path, encoding: str) -> str:
    with open_binary(path) as f:
        return f.readline().decode(encoding, errors="replace").rstrip("\r\n")


def line_texts(path: Path, line_numbers: Iterable[int], encoding: str = "utf-8") -> dict[int, str]:
    """The text of the given 1-based physical lines (for error messages)."""
    wanted = set(line_numbers)
    out: dict[int, str] = {}
    if not wanted:
        return out
    last = max(wanted)
    with open_binary(path) as f:
        for i, raw in enumerate(f, start=1):
            if i in wanted:
                text = raw.decode(encoding, errors="replace").rstrip("\r\n")
                out[i] = text if len(text) <= 200 else text[:200] + "..."
            if i >= last:
                break
    return out


def _describe_sep(sep: str) -> str:
    return {"\t": "tab", ",": "comma", "|": "'|'", " ": "space", "::": "'::'"}.get(sep, repr(sep))


def _wrong_sep_hint(text: str, sep: str | None) -> str:
    plural = {"::": "'::'", "\t": "tabs", ",": "commas", "|": "'|'", ";": "';'", " ": "spaces"}
    others = [s for s in plural if s != sep and s in text]
    if others and sep:
        return (
            f" The line contains {plural[others[0]]} but this format is "
            f"{_describe_sep(sep)}-separated: wrong separator or wrong file?"
        )
    return ""


# ---- tables --------------------------------------------------------------------------------------
def _bad_rows_error(
    path: Path,
    lines: np.ndarray,
    problem: str,
    encoding: str,
    total: int | None = None,
    sep: str | None = None,
) -> DataFormatError:
    """Build an error quoting the first few offending lines (1-based physical line numbers)."""
    shown = [int(x) for x in np.asarray(lines)[:_MAX_REPORTED]]
    texts = line_texts(path, shown, encoding)
    quoted = "; ".join(f"line {ln}: {texts.get(ln, '')!r}" for ln in shown)
    total = int(total if total is not None else len(shown))
    more = f" (and {total - len(shown)} more)" if total > len(shown) else ""
    hint = _wrong_sep_hint(texts.get(shown[0], ""), sep) if (shown and sep) else ""
    return DataFormatError(f"{path}: {total} bad row(s): {problem}. {quoted}{more}.{hint}")


@dataclass(frozen=True)
class Column:
    """One column a reader needs: its name, kind and value constraints."""

    name: str
    kind: str = "int"  # int | float | str
    min_value: float | None = None  # inclusive
    max_value: float | None = None  # inclusive
    allowed: tuple[float, ...] | None = None  # exact allowed values (e.g. half stars)
    required: bool = True  # str columns: False -> missing values allowed (become "")
    # why a value below min_value = 0 is wrong (said in the message)
    negative_hint: str = "negative ids are not allowed"


def _check_numeric(
    chunk: pd.DataFrame, col: Column, first_line: int, path: Path, encoding: str, sep: str
) -> np.ndarray:
    """Return the column as int64/float64, raising DataFormatError with line numbers if bad."""
    s = chunk[col.name]
    problem = f"must be {'an integer' if col.kind == 'int' else 'a number'}"
    if col.kind == "int" and pd.api.types.is_integer_dtype(s.dtype):
        if pd.api.types.is_unsigned_integer_dtype(s.dtype):  # values up to 2^64 - 1
            u = s.to_numpy(dtype=np.uint64)
            huge = u > np.uint64(_INT64_MAX)
            arr = np.where(huge, np.uint64(0), u).astype(np.int64)
        else:
            huge = np.zeros(len(s), dtype=bool)
            arr = s.to_numpy(dtype=np.int64)  # the common case: exact, no float round-trip
        bad = np.zeros(arr.shape, dtype=bool)
    else:
        arr = pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad = np.isnan(arr)
        with np.errstate(invalid="ignore"):
            huge = np.abs(arr) >= 2.0**63 if col.kind == "int" else np.zeros(len(s), dtype=bool)
        if col.kind == "int":
            with np.errstate(invalid="ignore"):
                bad |= arr != np.floor(arr)
            # Text such as "1.0" parses as a number but is not an id in these formats.
            if not bad.any() and s.dtype == object:
                bad |= ~s.astype(str).str.strip().str.fullmatch(r"[+-]?\d+").to_numpy()

    def check(mask: np.ndarray, what: str, with_sep: bool = False) -> None:
        if mask.any():
            idx = np.flatnonzero(mask)
            raise _bad_rows_error(
                path,
                idx[:_MAX_REPORTED] + first_line,
                f"column {col.name!r} {what}",
                encoding,
                total=idx.size,
                sep=sep if with_sep else None,
            )

    check(bad, problem, with_sep=True)
    check(huge, "is out of the int64 range (values must be below 2^63)")
    if col.min_value is not None:
        neg = f" ({col.negative_hint})" if col.min_value == 0 and col.negative_hint else ""
        check(arr < col.min_value, f"must be >= {col.min_value:g}{neg}")
    if col.max_value is not None:
        check(arr > col.max_value, f"must be <= {col.max_value:g}")
    if col.allowed is not None:
        allowed = np.asarray(col.allowed, dtype=np.float64)
        check(~np.isin(arr, allowed), f"must be one of {sorted(set(col.allowed))}")
    if col.kind == "int":
        return arr.astype(np.int64, copy=False)
    return arr


def read_table(
    path: Path,
    *,
    sep: str,
    columns: Sequence[Column],
    header: bool,
    names: Sequence[str] | None = None,
    encoding: str = "utf-8-sig",  # plain UTF-8, tolerating a byte-order mark
    progress: bool = False,
    chunksize: int = 1_000_000,
    on_chunk: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Read a delimited file, validate ``columns`` and return ({name: array}, data rows).

    header=True: the first line names the columns (extra columns are allowed and ignored).
    header=False: ``names`` gives every column in order and each line must have exactly that many
    fields. Blank lines, short or long rows, non-numeric values and out-of-range values raise
    DataFormatError with file, line numbers and text. ``on_chunk`` may shrink each chunk (e.g.
    pack flags into a bitmask) to bound memory on huge files.
    """
    first = _first_line(path, encoding)
    if not first.strip():
        raise DataFormatError(f"{path}: line 1 is empty (an empty file or a leading blank line)")
    fields = first.split(sep)
    if header:
        found = [f.strip().strip('"') for f in fields]
        missing = [c.name for c in columns if c.name not in found]
        if missing:
            hint = _wrong_sep_hint(first, sep) if len(found) == 1 else ""
            raise DataFormatError(
                f"{path}: line 1 (header) lacks column(s) {missing}; found columns {found}.{hint} "
                f"Expected a {_describe_sep(sep)}-separated file whose header includes "
                f"{[c.name for c in columns]}."
            )
    else:
        if names is None:
            raise ValueError("read_table(header=False) needs the column names")
        if len(fields) != len(names):
            hint = _wrong_sep_hint(first, sep) if len(fields) == 1 else ""
            raise DataFormatError(
                f"{path}: line 1: expected {len(names)} {_describe_sep(sep)}-separated fields "
                f"({', '.join(names)}), found {len(fields)}: {first[:200]!r}.{hint}"
            )

    str_cols = [c.name for c in columns if c.kind == "str"]
    dtype = dict.fromkeys(str_cols, str)
    out: dict[str, list[np.ndarray]] = {}
    n_rows = 0
    header_lines = 1 if header else 0
    multi_char = len(sep) > 1
    with open_binary(path, progress=progress) as f:
        stream: BinaryIO = f
        if multi_char:
            # The fast C parser takes one-character separators only: translate in memory
            # (multi-character separators occur only in the small MovieLens .dat files).
            stream = io.BytesIO(f.read().replace(sep.encode(), b"\x1f"))
        try:
            reader = pd.read_csv(
                stream,
                sep="\x1f" if multi_char else sep,
                header=0 if header else None,
                names=None if header else list(names or []),
                dtype=dtype or None,
                keep_default_na=False,
                na_values=[""],
                skip_blank_lines=False,
                chunksize=chunksize,
                encoding=encoding,
                engine="c",
            )
            for chunk in reader:
                first_line = n_rows + header_lines + 1
                blank = chunk.isna().all(axis=1).to_numpy()
                if blank.any():
                    idx = np.flatnonzero(blank)
                    raise DataFormatError(
                        f"{path}: {idx.size} blank line(s), first at line(s) "
                        f"{[int(i) + first_line for i in idx[:_MAX_REPORTED]]}; "
                        f"every line must be a data row: remove the blank lines."
                    )
                arrays: dict[str, np.ndarray] = {}
                for col in columns:
                    if col.kind == "str":
                        s = chunk[col.name]
                        if col.required and s.isna().any():
                            idx = np.flatnonzero(s.isna().to_numpy())
                            raise _bad_rows_error(
                                path,
                                idx[:_MAX_REPORTED] + first_line,
                                f"column {col.name!r} is empty",
                                encoding,
                                total=idx.size,
                            )
                        arrays[col.name] = s.fillna("").astype(str).str.strip().to_numpy(object)
                    else:
                        arrays[col.name] = _check_numeric(
                            chunk, col, first_line, path, encoding, sep
                        )
                n_rows += len(chunk)
                if on_chunk is not None:
                    arrays = on_chunk(arrays)
                for k, v in arrays.items():
                    out.setdefault(k, []).append(v)
        except pd.errors.ParserError as e:
            m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(e))
            if not m:
                raise DataFormatError(f"{path}: cannot parse: {e}") from e
            line = int(m.group(2))
            text = line_texts(path, [line], encoding).get(line, "")
            raise DataFormatError(
                f"{path}: line {line} has {m.group(3)} {_describe_sep(sep)}-separated fields, "
                f"expected {m.group(1)}: {text!r}."
            ) from e
        except pd.errors.EmptyDataError as e:
            raise DataFormatError(f"{path}: empty file") from e
        except UnicodeDecodeError as e:
            raise DataFormatError(
                f"{path}: not {encoding} text ({e}); is this the right file?"
            ) from e
    if n_rows == 0:
        raise DataFormatError(f"{path}: no data rows")
    merged = {k: np.concatenate(v) for k, v in out.items()}
    return merged, n_rows


# ---- encodings -----------------------------------------------------------------------------------
# Only these mean "missing" (ml-100k has a real occupation called "none").
_UNKNOWN_STRINGS = frozenset({"", "unknown"})


def encode_categorical(
    values: np.ndarray, vocabulary: Sequence[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """Map values to categorical ids 1..V (0 = missing/"UNKNOWN"); return (ids, vocabulary).

    The vocabulary is ``vocabulary`` (an official value order, so ids are stable across dataset
    variants) followed by any other value seen, sorted (numbers numerically); id = index + 1. No
    value is ever mapped to 0 unless it is missing.
    """
    as_str = np.array(["" if v is None else str(v).strip() for v in values], dtype=object)
    known = np.array([s.lower() not in _UNKNOWN_STRINGS for s in as_str], dtype=bool)
    vocab = list(vocabulary or [])
    seen = set(vocab)
    vocab += sorted({s for s in as_str[known].tolist() if s not in seen}, key=_natural_key)
    index = {v: i + 1 for i, v in enumerate(vocab)}
    ids = np.array([index[s] if k else 0 for s, k in zip(as_str, known)], dtype=np.int64)
    return ids, vocab


def _natural_key(s: str) -> tuple:
    try:
        return (0, float(s), s)
    except ValueError:
        return (1, 0.0, s)


# ---- sequences -----------------------------------------------------------------------------------
def build_sequence_data(
    name: str,
    users: np.ndarray,
    items: np.ndarray,
    actions: np.ndarray,
    timestamps: np.ndarray,
    action_names: Sequence[str],
    user_feature_table: dict[str, dict[int, int]] | None = None,
    extra: dict | None = None,
    has_timestamps: bool = True,
) -> tuple[SequenceData, dict]:
    """Group interactions into per-user time-ordered CSR sequences.

    Order: users by raw id; within a user by timestamp, ties kept in input order (a stable sort).
    Contextual features: ``user_id`` = 1 + rank of the user's raw id among all users (dense,
    0 reserved), then each column of ``user_feature_table`` ({feature: {raw user id: id}}, absent
    users -> 0). ``has_timestamps=False``: the timestamps only order the interactions (file
    positions), they are no times. Returns the data and stats (users without features).
    """
    users = np.asarray(users, dtype=np.int64)
    order = np.lexsort((np.asarray(timestamps), users))  # stable: ties keep input order
    users_sorted = users[order]
    uniq, starts = np.unique(users_sorted, return_index=True)
    offsets = np.append(starts, users_sorted.size).astype(np.int64)
    names = ["user_id"]
    cols = [np.arange(1, uniq.size + 1, dtype=np.int64)]
    stats: dict = {}
    for feat, mapping in (user_feature_table or {}).items():
        ids = np.array([mapping.get(int(u), 0) for u in uniq], dtype=np.int64)
        cols.append(ids)
        names.append(feat)
        stats["users_without_features"] = int(sum(int(u) not in mapping for u in uniq))
    data = SequenceData(
        name=name,
        user_ids=uniq.astype(np.int64),
        offsets=offsets,
        item_ids=np.asarray(items, dtype=np.int64)[order],
        actions=np.asarray(actions, dtype=np.int64)[order],
        timestamps=np.asarray(timestamps, dtype=np.int64)[order],
        user_features=np.stack(cols, axis=1),
        user_feature_names=names,
        action_names=list(action_names),
        extra=dict(extra or {}),
        has_timestamps=bool(has_timestamps),
    )
    return data, stats
