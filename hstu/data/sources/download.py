"""Download and unpack the official dataset archives (urllib + tqdm), cached under data/raw/.

Only used when ``--source`` is omitted. Machines without internet get a clear error that says how
to fetch the archive by hand and pass ``--source`` instead.
"""

from __future__ import annotations

import logging
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from hstu.data.sources.common import byte_bar

__all__ = ["DownloadError", "download", "extract", "fetch_archive"]

logger = logging.getLogger(__name__)

_TIMEOUT_S = 30


class DownloadError(RuntimeError):
    """The official files could not be fetched (offline, HTTP error, broken archive)."""


def download(url: str, dest: Path, progress: bool = False) -> Path:
    """Fetch ``url`` to ``dest`` (via ``dest.part``, renamed when complete); reuse ``dest``."""
    if dest.is_file():
        logger.info("using cached %s", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    logger.info("downloading %s -> %s", url, dest)
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as resp:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with open(part, "wb") as out, byte_bar(total, f"download {dest.name}", progress) as bar:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"could not download {url} ({e}). This machine may be offline. Download it by hand, "
            f"unpack it and pass the directory with --source (or put the archive at {dest} and "
            f"re-run)."
        ) from e
    part.replace(dest)
    return dest


def _safe_members(root: Path, names: list[str]) -> None:
    base = root.resolve()
    for n in names:
        target = (root / n).resolve()
        if base != target and base not in target.parents:
            raise DownloadError(f"refusing to unpack {n!r}: it would land outside {root}")


def extract(archive: Path, into: Path) -> Path:
    """Unpack a .zip or .tar(.gz) into ``into`` (once: a marker file records completion)."""
    marker = into / f".extracted-{archive.name}"
    if marker.is_file():
        return into
    into.mkdir(parents=True, exist_ok=True)
    logger.info("unpacking %s -> %s", archive, into)
    try:
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                _safe_members(into, z.namelist())
                z.extractall(into)
        else:
            with tarfile.open(archive) as t:
                _safe_members(into, t.getnames())
                if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.12
                    t.extractall(into, filter="data")
                else:
                    t.extractall(into)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as e:
        raise DownloadError(
            f"{archive} is not a complete archive ({e}); delete it and re-run to download again"
        ) from e
    marker.touch()
    return into


def fetch_archive(url: str, raw_dir: Path, name: str, progress: bool = False) -> Path:
    """Download (if needed) and unpack ``url`` under ``raw_dir/name``; return the unpack dir."""
    archive = raw_dir / url.rsplit("/", 1)[-1]
    download(url, archive, progress)
    return extract(archive, raw_dir / name)
