"""Prepare a real dataset: raw official files -> cached ``SequenceData`` under ``data/<name>/``.

    python -m hstu.data.prepare --dataset ml-1m [--source DIR] [--output DIR] [--force]
    python -m hstu.data.prepare --dataset sequences --source ml-1m.txt.gz [--format pairs|lines]

Without ``--source`` the official archive is downloaded to ``data/raw/`` (needs internet). The
output directory gets ``sequences.npz`` and ``manifest.json`` (counts, id ranges, sha256 of every
input, the command, the format version). A re-run whose inputs hash the same is a no-op ("up to
date") unless ``--force``. See docs/datasets.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from hstu.data.sequences import DATA_FILE, MANIFEST_FILE
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


def _command(dataset: str, source: Path | None, output: Path | None, fmt: str) -> str:
    parts = ["python", "-m", "hstu.data.prepare", "--dataset", dataset]
    if source is not None:
        parts += ["--source", str(source)]
    if output is not None:
        parts += ["--output", str(output)]
    if fmt != "auto":
        parts += ["--format", fmt]
    return shlex.join(parts)


def _range(a: np.ndarray) -> list[int]:
    return [int(a.min()), int(a.max())] if a.size else [0, -1]


def _is_up_to_date(out: Path, dataset: str, options: dict, inputs: list[dict]) -> bool:
    man_path = out / MANIFEST_FILE
    if not (man_path.is_file() and (out / DATA_FILE).is_file()):
        return False
    try:
        old = json.loads(man_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if old.get("format_version") != FORMAT_VERSION or old.get("dataset") != dataset:
        return False
    if old.get("options") != options:
        return False
    old_inputs = [(i.get("role"), i.get("sha256")) for i in old.get("inputs", [])]
    return old_inputs == [(i["role"], i["sha256"]) for i in inputs]


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
    DataFormatError (malformed input: names file, line numbers and text), DownloadError
    (offline / bad archive) and ValueError (bad arguments).
    """
    spec = get_spec(dataset)
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {FORMATS}")
    if fmt != "auto" and spec.build is not build_sequences:
        raise ValueError(f"--format applies to the sequence-file datasets only, not {dataset!r}")
    progress = progress_default() if progress is None else progress
    out = Path(output) if output is not None else default_output_dir(dataset)

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

    logger.info("%s: building from %s", dataset, ", ".join(str(p) for p in files.values()))
    result = spec.build(files, BuildOptions(name=dataset, progress=progress, fmt=fmt))
    data = result.data
    for entry in inputs:
        entry["rows"] = result.rows_read.get(entry["role"])
    dropped_total = int(sum(result.dropped.values()))
    manifest = {
        "format_version": FORMAT_VERSION,
        "dataset": dataset,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": _command(dataset, None if source is None else Path(source), output, fmt),
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
    # A stale manifest must not vouch for a half-written output if this run dies while saving;
    # a failed build above leaves the previous output untouched.
    (out / MANIFEST_FILE).unlink(missing_ok=True)
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
    """CLI entry point; returns the exit code (0 ok, 1 a reported error)."""
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
    except (FileNotFoundError, DataFormatError, DownloadError, ValueError) as e:
        logger.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
