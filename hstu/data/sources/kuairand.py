"""KuaiRand converters (pure, 1k, 27k): https://kuairand.com, release on Zenodo (record 10439422).

Sequences come from the two *standard* logs (``log_standard_4_08_to_4_21_<v>.csv`` then
``log_standard_4_22_to_5_08_<v>.csv``; 27k ships each as ``_part1``/``_part2``), ordered by
``time_ms``. The random-exposure log is not used. Items are ``video_id``s; actions are the 8
binary feedback signals packed as a bitmask in ``ACTION_NAMES`` order (bit k = signal k).
Contextual features: ``user_id`` plus the categorical columns of ``user_features_<v>.csv`` listed
in ``USER_FEATURES`` (strings mapped to ids 1..V, 0 = missing / "UNKNOWN").
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hstu.data.sources.common import (
    TIME_HINT,
    BuildOptions,
    BuildResult,
    Column,
    DataFormatError,
    build_sequence_data,
    encode_categorical,
    find_file,
    read_table,
)

__all__ = ["ACTION_NAMES", "USER_FEATURES", "VARIANTS", "locate_kuairand", "build_kuairand"]

ACTION_NAMES = [
    "is_click",
    "is_like",
    "is_follow",
    "is_comment",
    "is_forward",
    "is_hate",
    "long_view",
    "is_profile_enter",
]
USER_FEATURES = [
    "user_active_degree",
    "is_lowactive_period",
    "is_live_streamer",
    "is_video_author",
    "follow_user_num_range",
    "fans_user_num_range",
    "friend_user_num_range",
    "register_days_range",
]
# Value orders from the official README (ids 1..V in this order; values not listed there are
# appended, sorted; missing and "UNKNOWN" -> 0).
OFFICIAL_VOCABULARIES: dict[str, list[str]] = {
    "user_active_degree": ["full_active", "high_active", "middle_active"],
    "is_lowactive_period": ["0", "1"],
    "is_live_streamer": ["0", "1"],
    "is_video_author": ["0", "1"],
    "follow_user_num_range": [
        "0", "(0,10]", "(10,50]", "(50,100]", "(100,150]", "(150,250]", "(250,500]", "500+",
    ],
    "fans_user_num_range": [
        "0", "[1,10)", "[10,100)", "[100,1k)", "[1k,5k)", "[5k,1w)", "[1w,10w)",
    ],
    "friend_user_num_range": [
        "0", "[1,5)", "[5,30)", "[30,60)", "[60,120)", "[120,250)", "250+",
    ],
    "register_days_range": ["15-30", "31-60", "61-90", "91-180", "181-365", "366-730", "730+"],
}  # fmt: skip
VARIANTS = ("pure", "1k", "27k")
LOG_PERIODS = ("4_08_to_4_21", "4_22_to_5_08")
_SUBDIRS = ("", "data", "KuaiRand-Pure/data", "KuaiRand-1K/data", "KuaiRand-27K/data")


def _log_files(source: Path, variant: str, period: str) -> list[Path]:
    """The standard log of one period: one file, or the official ``_partN`` pieces in order."""
    name = f"log_standard_{period}_{variant}.csv"
    try:
        return [find_file(source, [name], f"KuaiRand-{variant} standard log", _SUBDIRS)]
    except FileNotFoundError as missing:
        pattern = re.compile(rf"log_standard_{period}_{variant}_part(\d+)\.csv(\.gz)?$")
        for sub in _SUBDIRS:
            base = source / sub if sub else source
            if not base.is_dir():
                continue
            parts = [(int(m.group(1)), p) for p in base.iterdir() if (m := pattern.match(p.name))]
            if parts:
                return [p for _, p in sorted(parts)]
        raise missing


def locate_kuairand(source: Path, variant: str) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for period in LOG_PERIODS:
        paths = _log_files(source, variant, period)
        for i, p in enumerate(paths):
            files[f"log_standard_{period}" + (f"_part{i + 1}" if len(paths) > 1 else "")] = p
    files["user_features"] = find_file(
        source, [f"user_features_{variant}.csv"], f"KuaiRand-{variant} user feature file", _SUBDIRS
    )
    return files


def _pack(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per chunk: 8 flag columns -> one uint8 mask; compact id dtypes (27k has 322M rows)."""
    mask = np.zeros(a["user_id"].shape, dtype=np.uint8)
    for k, name in enumerate(ACTION_NAMES):
        mask |= a[name].astype(np.uint8) << np.uint8(k)
    return {
        "user_id": a["user_id"].astype(np.int32),
        "video_id": a["video_id"].astype(np.int32),
        "time_ms": a["time_ms"],
        "actions": mask,
    }


def build_kuairand(files: dict[str, Path], opts: BuildOptions) -> BuildResult:
    int32_max = float(np.iinfo(np.int32).max)
    log_cols = [
        Column("user_id", min_value=0, max_value=int32_max),
        Column("video_id", min_value=0, max_value=int32_max),
        Column("time_ms", min_value=0, negative_hint=TIME_HINT),
        *[Column(a, min_value=0, max_value=1) for a in ACTION_NAMES],
    ]
    pieces: list[dict[str, np.ndarray]] = []
    rows_read: dict[str, int] = {}
    for role, path in files.items():
        if not role.startswith("log_standard"):
            continue
        arrays, n = read_table(
            path, sep=",", header=True, columns=log_cols, progress=opts.progress, on_chunk=_pack
        )
        pieces.append(arrays)
        rows_read[role] = n
    logs = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
    del pieces  # 27k: ~5 GB of packed columns; keep only one copy

    uf_path = files["user_features"]
    feats, n_users = read_table(
        uf_path,
        sep=",",
        header=True,
        columns=[
            Column("user_id", min_value=0),
            *[Column(f, kind="str", required=False) for f in USER_FEATURES],
        ],
        progress=opts.progress,
    )
    rows_read["user_features"] = n_users
    uids = feats["user_id"]
    uniq, counts = np.unique(uids, return_counts=True)
    if (counts > 1).any():
        raise DataFormatError(
            f"{uf_path}: user id(s) {uniq[counts > 1][:5].tolist()} appear on more than one line; "
            f"each user must be listed once."
        )
    table: dict[str, dict[int, int]] = {}
    vocabs: dict[str, list[str]] = {}
    for f in USER_FEATURES:
        ids, vocab = encode_categorical(feats[f], OFFICIAL_VOCABULARIES.get(f))
        table[f] = dict(zip(uids.tolist(), ids.tolist()))
        vocabs[f] = vocab

    data, stats = build_sequence_data(
        opts.name,
        users=logs["user_id"],
        items=logs["video_id"],
        actions=logs["actions"],
        timestamps=logs["time_ms"],
        action_names=ACTION_NAMES,
        user_feature_table=table,
        extra={"action_encoding": "bit k set iff action_names[k] == 1", "logs": "standard"},
    )
    stats["feature_vocabularies"] = vocabs
    stats["users_in_user_file_without_logs"] = int(np.setdiff1d(uniq, data.user_ids).size)
    return BuildResult(data=data, rows_read=rows_read, dropped={}, stats=stats)
