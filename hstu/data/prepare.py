"""Prepare a real dataset: raw official files -> cached ``SequenceData`` under ``data/<name>/``.

    python -m hstu.data.prepare --dataset ml-1m [--source DIR] [--output DIR] [--force]
    python -m hstu.data.prepare --dataset sequences --source ml-1m.txt.gz [--format pairs|lines]

Without ``--source`` the official archive is downloaded to ``data/raw/`` (needs internet). The
output directory gets ``sequences.npz`` and ``manifest.json`` (counts, id ranges, sha256 of every
input, shape, dtype and sha256 of every array, the command, the format version), written all or
nothing; training checks the arrays against the manifest when it loads them. A re-run whose inputs hash the same is a no-op ("up to
date") unless ``--force``. See docs/datasets.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from hstu.config.limits import MAX_ITEM_ID
from hstu.data.sequences import (
    DATA_FILE,
    MANIFEST_FILE,
    SequenceData,
    check_output_dir,
    make_stage_dir,
    time_order_problem,
)
from hstu.data.sources import (
    DATASETS,
    FORMAT_VERSION,
    BuildOptions,
    DataFormatError,
    DownloadError,
    get_spec,
)
from hstu.data.sources.common import progress_default, sha256_file
from hstu.data.sources.download import fetch_archive
from hstu.data.sources.sasrec import FORMATS, build_sequences

__all__ = ["PrepareResult", "prepare_dataset", "default_output_dir", "main"]

logger = logging.getLogger("hstu.data.prepare")  # not __name__: "__main__" under -m

DEFAULT_DATA_ROOT = Path("data")


@dataclass
class PrepareResult:
    """Where the prepared dataset lives, its manifest, and whether this run rebuilt it."""

    output_dir: Path
    manifest: dict
    up_to_date: bool


def default_output_dir(dataset: str) -> Path:
    """``data/<name>`` relative to the working directory (DatasetArgs.dataset_path "" uses it)."""
    return DEFAULT_DATA_ROOT / dataset


def _command(dataset: str, source: Path | None, output: Path, fmt: str) -> str:
    """The command that re-creates the output, from any directory (absolute paths)."""
    parts = ["python", "-m", "hstu.data.prepare", "--dataset", dataset]
    if source is not None:
        parts += ["--source", str(source.resolve())]
    parts += ["--output", str(output.resolve())]
    if fmt != "auto":
        parts += ["--format", fmt]
    return shlex.join(parts)


def _range(a: np.ndarray) -> list[int]:
    return [int(a.min()), int(a.max())] if a.size else [0, -1]


def _is_up_to_date(out: Path, dataset: str, options: dict, inputs: list[dict]) -> bool:
    """The output exists, was made from these inputs with these options, carries checksums and
    its arrays still match them."""
    man_path = out / MANIFEST_FILE
    if not (man_path.is_file() and (out / DATA_FILE).is_file()):
        return False
    try:
        old = json.loads(man_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(old, dict):
        return False
    if old.get("format_version") != FORMAT_VERSION or old.get("dataset") != dataset:
        return False
    if old.get("options") != options or not isinstance(old.get("arrays"), dict):
        return False  # no checksums: written before they existed, rebuild to add them
    old_inputs = [(i.get("role"), i.get("sha256")) for i in old.get("inputs", [])]
    if old_inputs != [(i["role"], i["sha256"]) for i in inputs]:
        return False
    try:
        SequenceData.load(out)
    except (OSError, ValueError) as err:
        logger.info("%s: the previous output does not check out (%s): rebuilding", dataset, err)
        return False
    return True


def prepare_dataset(
    dataset: str,
    source: str | Path | None = None,
    output: str | Path | None = None,
    *,
    force: bool = False,
    fmt: str = "auto",
    raw_dir: str | Path | None = None,
    progress: bool | None = None,
) -> PrepareResult:
    """Convert ``dataset`` from ``source`` (or the official download) into ``output``.

    Raises FileNotFoundError (a required file is missing: names it and where it looked),
    DataFormatError (malformed, truncated or mislabelled input: names file, line numbers and
    text), DownloadError (offline / bad archive), ValueError (bad arguments),
    NotADirectoryError (the output path is a file), PermissionError / OSError (the output is
    not writable, the disk is full): each one line. The output is written all or nothing.
    """
    spec = get_spec(dataset)
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {FORMATS}")
    if fmt != "auto" and spec.build is not build_sequences:
        raise ValueError(f"--format applies to the sequence-file datasets only, not {dataset!r}")
    progress = progress_default() if progress is None else progress
    out = Path(output) if output is not None else default_output_dir(dataset)
    # an output path that is a file fails now, not after the build
    check_output_dir(out)

    if source is None:
        if spec.url is None:
            raise ValueError(
                f"dataset {dataset!r} has no official download; pass --source with "
                f"{spec.source_hint}"
            )
        raw = Path(raw_dir) if raw_dir is not None else DEFAULT_DATA_ROOT / "raw"
        src = fetch_archive(spec.url, raw, dataset, progress) / spec.archive_dir
    else:
        src = Path(source)
        if not src.exists():
            raise FileNotFoundError(f"--source {src} does not exist; expected {spec.source_hint}")
    files = spec.locate(src)

    inputs = [
        {
            "role": role,
            "path": str(path.resolve()),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path, progress),
        }
        for role, path in files.items()
    ]
    options = {"format": fmt} if spec.build is build_sequences else {}
    if not force and _is_up_to_date(out, dataset, options, inputs):
        logger.info("%s: up to date in %s (inputs unchanged; --force rebuilds)", dataset, out)
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        return PrepareResult(output_dir=out, manifest=manifest, up_to_date=True)

    # an unwritable output fails now, not after the build (the probe directory is removed)
    shutil.rmtree(make_stage_dir(out), ignore_errors=True)
    logger.info("%s: building from %s", dataset, ", ".join(str(p) for p in files.values()))
    result = spec.build(files, BuildOptions(name=dataset, progress=progress, fmt=fmt))
    data = result.data
    _check_id_range(data, files)
    _check_timestamps(data, files)
    for entry in inputs:
        entry["rows"] = result.rows_read.get(entry["role"])
    dropped_total = int(sum(result.dropped.values()))
    manifest = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": _command(dataset, None if source is None else Path(source), out, fmt),
        "options": options,
        "inputs": inputs,
        "rows_read": result.rows_read,
        "rows_dropped": result.dropped,
        "rows_dropped_total": dropped_total,
        "user_id_range": _range(data.user_ids),
        "timestamp_range": _range(data.timestamps),
        "sequence_length_range": _range(data.lengths()),
        "stats": result.stats,
    }
    # written to a temporary directory and moved into place: a failed build above or a failed
    # write leaves the previous output as it was, and no partial file
    data.save(out, manifest=manifest)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    logger.info(
        "%s: %d users, %d items, %d interactions (dropped %d rows) -> %s",
        dataset,
        data.num_users,
        manifest["num_items"],
        data.num_interactions,
        dropped_total,
        out,
    )
    return PrepareResult(output_dir=out, manifest=manifest, up_to_date=False)


def _check_id_range(data: SequenceData, files: dict[str, Path]) -> None:
    """Item ids index the item table: refuse ids above `MAX_ITEM_ID` (the converters check
    their id columns with line numbers; this catches any converter that does not)."""
    if data.num_interactions and int(data.item_ids.max()) > MAX_ITEM_ID:
        where = ", ".join(str(p) for p in files.values())
        raise DataFormatError(
            f"{where}: item id {int(data.item_ids.max())} is above the largest id the item "
            f"table indexes ({MAX_ITEM_ID} = 2^31 - 1); remap the item ids to a dense range"
        )


def _check_timestamps(data: SequenceData, files: dict[str, Path]) -> None:
    """Timestamps must be >= 0 and in order inside each user (the converters check their time
    columns with line numbers and sort each user by time; this catches any converter that does
    not)."""
    problem = time_order_problem(data)
    if problem is not None:
        where = ", ".join(str(p) for p in files.values())
        raise DataFormatError(f"{where}: {problem}; fix the input's time column")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hstu.data.prepare",
        description="Convert a real dataset into the cached per-user sequence format.",
        epilog="datasets: "
        + "; ".join(f"{n} ({s.summary})" for n, s in DATASETS.items())
        + ". See docs/datasets.md.",
    )
    p.add_argument("--dataset", required=True, choices=list(DATASETS), help="dataset name")
    p.add_argument(
        "--source",
        default=None,
        help="directory with the official raw files (a file for sequences/amazon-beauty; .gz "
        "accepted); omitted: download the official archive to data/raw/",
    )
    p.add_argument("--output", default=None, help="output directory (default data/<dataset>)")
    p.add_argument("--force", action="store_true", help="rebuild even if the inputs are unchanged")
    p.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="sequence files: 'pairs' (user item per line), 'lines' (user item item ...), or auto",
    )
    p.add_argument("--raw-dir", default=None, help="download cache (default data/raw)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code: 0 ok, 2 bad input data or arguments (a missing,
    malformed, truncated or mislabelled file, an output path that is a file), 1 a runtime
    failure (download failed, output not writable, disk full). Errors are one logged line."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hstu").setLevel(logging.INFO)  # a handler may already exist (torchrec)
    try:
        prepare_dataset(
            args.dataset,
            args.source,
            args.output,
            force=args.force,
            fmt=args.format,
            raw_dir=args.raw_dir,
        )
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError) as e:
        logger.error("%s", e)  # DataFormatError and PreparedDataError are ValueErrors
        return 2
    except (DownloadError, OSError, MemoryError) as e:
        logger.error("%s", e or type(e).__name__)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
