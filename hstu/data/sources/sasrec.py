"""SASRec / S3-Rec style sequence files (e.g. SASRec's ml-1m.txt, S3-Rec's Beauty.txt).

Two whitespace-separated layouts, both in time order with no timestamps:
  pairs: ``user item`` per line (one interaction per line);
  lines: ``user item item ...`` per line (one user's sequence per line).
``auto`` picks pairs when every line has exactly two ids (both readings then mean the same
interactions), else lines. Timestamps are the interaction's position in the file (recorded as
``has_timestamps: false`` in the manifest: they order the sequences but are no times); actions
are 1 (one task, "interaction"); the only contextual feature is ``user_id``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.config.limits import INT64_MAX as _INT64_MAX
from hstu.config.limits import MAX_ITEM_ID
from hstu.data.sources.common import (
    BuildOptions,
    BuildResult,
    DataFormatError,
    build_sequence_data,
    find_file,
    open_binary,
)

__all__ = ["FORMATS", "ACTION_NAMES", "locate_sequences", "build_sequences", "parse_sequence_file"]

FORMATS = ("auto", "pairs", "lines")
ACTION_NAMES = ["interaction"]
_MAX_REPORTED = 5


def locate_sequences(source: Path, default_names: tuple[str, ...] = ()) -> dict[str, Path]:
    """``source`` is the file itself, or a directory holding one of ``default_names``."""
    if source.is_file():
        return {"sequences": source}
    if source.is_dir():
        if default_names:
            return {"sequences": find_file(source, list(default_names), "sequence file")}
        raise FileNotFoundError(
            f"--source {source} is a directory; for this dataset pass the sequence file itself "
            f"(e.g. --source {source}/ml-1m.txt)"
        )
    raise FileNotFoundError(f"sequence file {source} not found (from --source)")


def _quote(lines: list[str], numbers: list[int]) -> str:
    return "; ".join(f"line {n}: {lines[n - 1][:200]!r}" for n in numbers[:_MAX_REPORTED])


def parse_sequence_file(
    path: Path, fmt: str = "auto", progress: bool = False
) -> tuple[np.ndarray, np.ndarray, str, int]:
    """Return (users, items, format used, number of lines), one entry per interaction in file
    order. Raises DataFormatError with line numbers for blank lines, non-integer or negative ids,
    lines without items, and lines that do not fit a forced ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    with open_binary(path, progress=progress) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text ({e}); is this the right file?") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start a new one
    if not lines:
        raise DataFormatError(f"{path}: empty file")
    counts = np.fromiter((len(line.split()) for line in lines), dtype=np.int64, count=len(lines))

    def fail(mask: np.ndarray, problem: str, hint: str = "") -> DataFormatError:
        bad = (np.flatnonzero(mask) + 1).tolist()
        more = f" (and {len(bad) - _MAX_REPORTED} more)" if len(bad) > _MAX_REPORTED else ""
        return DataFormatError(
            f"{path}: {len(bad)} bad line(s): {problem}. {_quote(lines, bad)}{more}.{hint}"
        )

    if (counts == 0).any():
        raise fail(counts == 0, "blank line (every line must be 'user item ...')")
    tokens = text.split()
    try:
        ids = np.array(tokens).astype(np.int64)
    except (ValueError, OverflowError):
        bad_lines = np.zeros(len(lines), dtype=bool)
        huge = np.zeros(len(lines), dtype=bool)
        for i, line in enumerate(lines):
            try:
                values = [int(t) for t in line.split()]
            except ValueError:
                bad_lines[i] = True
                continue
            huge[i] = any(v > _INT64_MAX or v < -_INT64_MAX - 1 for v in values)
        if not bad_lines.any() and huge.any():
            raise fail(huge, "id out of the int64 range (ids must be below 2^63)") from None
        hint = ""
        first = lines[int(np.argmax(bad_lines))]
        if any(s in first for s in (",", ";", "|", "::")):
            hint = " The file must be whitespace-separated: wrong separator?"
        raise fail(bad_lines, "ids must be integers separated by spaces or tabs", hint) from None
    line_of_token = np.repeat(np.arange(len(lines)), counts)
    if (ids < 0).any():
        neg = np.zeros(len(lines), dtype=bool)
        neg[line_of_token[ids < 0]] = True
        raise fail(neg, "negative id")

    if fmt == "auto":
        fmt = "pairs" if (counts == 2).all() else "lines"
    if fmt == "pairs" and (counts != 2).any():
        raise fail(counts != 2, "format 'pairs' needs exactly two ids per line ('user item')")
    if fmt == "lines" and (counts < 2).any():
        raise fail(counts < 2, "a 'user item item ...' line needs at least one item")

    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    is_user = np.zeros(ids.size, dtype=bool)
    is_user[starts] = True
    users = np.repeat(ids[starts], counts - 1)
    items = ids[~is_user]
    too_big = items > MAX_ITEM_ID
    if too_big.any():  # item ids index the item table (max id + 1 rows)
        big = np.zeros(len(lines), dtype=bool)
        big[line_of_token[~is_user][too_big]] = True
        raise fail(
            big,
            f"item id above {MAX_ITEM_ID} (2^31 - 1, the largest id the item table indexes); "
            "remap the item ids to a dense range",
        )
    return users, items, fmt, len(lines)


def build_sequences(files: dict[str, Path], opts: BuildOptions) -> BuildResult:
    path = files["sequences"]
    users, items, fmt, n_lines = parse_sequence_file(path, opts.fmt, opts.progress)
    data, stats = build_sequence_data(
        opts.name,
        users=users,
        items=items,
        actions=np.ones(items.size, dtype=np.int64),
        timestamps=np.arange(items.size, dtype=np.int64),  # file order is time order
        action_names=ACTION_NAMES,
        extra={"format": fmt, "timestamps": "position in the file"},
        has_timestamps=False,  # positions, not times: batches carry no timestamps
    )
    stats["format"] = fmt
    if fmt == "lines":
        repeated = n_lines - data.num_users
        stats["repeated_user_lines"] = int(repeated)
    return BuildResult(data=data, rows_read={"sequences": n_lines}, dropped={}, stats=stats)
