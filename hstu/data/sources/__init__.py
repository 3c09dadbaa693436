"""Raw-dataset converters and their registry: one ``DatasetSpec`` per ``--dataset`` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hstu.data.sources.common import (
    FORMAT_VERSION,
    BuildOptions,
    BuildResult,
    DataFormatError,
)
from hstu.data.sources.download import DownloadError
from hstu.data.sources.kuairand import build_kuairand, locate_kuairand
from hstu.data.sources.movielens import (
    build_ml_1m,
    build_ml_20m,
    build_ml_100k,
    locate_ml_1m,
    locate_ml_20m,
    locate_ml_100k,
)
from hstu.data.sources.sasrec import build_sequences, locate_sequences

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "BuildOptions",
    "BuildResult",
    "DataFormatError",
    "DownloadError",
    "FORMAT_VERSION",
    "get_spec",
]

GROUPLENS = "https://files.grouplens.org/datasets/movielens"
KUAIRAND_ZENODO = "https://zenodo.org/records/10439422/files"


@dataclass(frozen=True)
class DatasetSpec:
    """How to find, fetch and convert one dataset.

    locate(source) -> {role: path} finds the input files (FileNotFoundError naming what is
    missing); build(files, options) converts them. ``url`` is the official archive (None: no
    download, --source required) and ``archive_dir`` the folder inside it with the files.
    """

    name: str
    summary: str
    locate: Callable[[Path], dict[str, Path]]
    build: Callable[[dict[str, Path], BuildOptions], BuildResult]
    url: str | None = None
    archive_dir: str = ""
    source_hint: str = ""


def _kuairand(variant: str, archive: str) -> DatasetSpec:
    return DatasetSpec(
        name=f"kuairand-{variant}",
        summary=f"KuaiRand-{archive.split('-')[1]}: standard logs, 8 feedback signals, user features",
        locate=partial(locate_kuairand, variant=variant),
        build=build_kuairand,
        url=f"{KUAIRAND_ZENODO}/{archive}.tar.gz",
        archive_dir=f"{archive}/data",
        source_hint=f"the {archive}/data directory of the official release",
    )


DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec(
            name="ml-1m",
            summary="MovieLens 1M: ratings.dat + users.dat ('::'-separated)",
            locate=locate_ml_1m,
            build=build_ml_1m,
            url=f"{GROUPLENS}/ml-1m.zip",
            archive_dir="ml-1m",
            source_hint="the unzipped ml-1m directory (ratings.dat, users.dat)",
        ),
        DatasetSpec(
            name="ml-20m",
            summary="MovieLens 20M: ratings.csv (userId,movieId,rating,timestamp)",
            locate=locate_ml_20m,
            build=build_ml_20m,
            url=f"{GROUPLENS}/ml-20m.zip",
            archive_dir="ml-20m",
            source_hint="the unzipped ml-20m directory (ratings.csv)",
        ),
        DatasetSpec(
            name="ml-100k",
            summary="MovieLens 100K: u.data (tab) + u.user ('|')",
            locate=locate_ml_100k,
            build=build_ml_100k,
            url=f"{GROUPLENS}/ml-100k.zip",
            archive_dir="ml-100k",
            source_hint="the unzipped ml-100k directory (u.data, u.user)",
        ),
        _kuairand("pure", "KuaiRand-Pure"),
        _kuairand("1k", "KuaiRand-1K"),
        _kuairand("27k", "KuaiRand-27K"),
        DatasetSpec(
            name="sequences",
            summary="SASRec-style text: 'user item' or 'user item item ...' per line",
            locate=locate_sequences,
            build=build_sequences,
            source_hint="the sequence file, e.g. SASRec's ml-1m.txt (.gz accepted)",
        ),
        DatasetSpec(
            name="amazon-beauty",
            summary="Amazon Beauty (S3-Rec/ICLRec Beauty.txt): the 'sequences' format",
            locate=partial(locate_sequences, default_names=("Beauty.txt",)),
            build=build_sequences,
            source_hint="Beauty.txt (or its directory) from the S3-Rec / ICLRec repositories",
        ),
    ]
}


def get_spec(name: str) -> DatasetSpec:
    """The spec of ``name``; ValueError listing the known names otherwise."""
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(
            f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}"
        ) from None
