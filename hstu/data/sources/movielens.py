"""MovieLens (GroupLens) converters: ml-1m, ml-100k, ml-20m.

Items are movie ids. Actions are the rating as a 5-bit mask: bit k is set iff rating >= k + 1
(k = 0..4), so e.g. the task "rating >= 4" is bit 3 and ``action_names`` has 5 entries. For whole
star ratings (ml-1m, ml-100k) the mask encodes the rating exactly (bit 0 is always set); ml-20m's
half stars round down (3.5 -> bits 0..2, like 3.0; 0.5 -> no bit). Contextual features: ``user_id``
(all three) plus sex, age group, occupation and zip prefix (ml-1m, ml-100k), 0 = unknown.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.data.sources.common import (
    ID_MAX,
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

__all__ = [
    "RATING_ACTION_NAMES",
    "rating_to_actions",
    "locate_ml_1m",
    "build_ml_1m",
    "locate_ml_100k",
    "build_ml_100k",
    "locate_ml_20m",
    "build_ml_20m",
]

RATING_ACTION_NAMES = [f"rating>={k + 1}" for k in range(5)]
ML_1M_AGE_GROUPS = ["1", "18", "25", "35", "45", "50", "56"]  # README: under 18, 18-24, ..., 56+
ML_1M_OCCUPATIONS = [str(i) for i in range(21)]  # README: 0 "other" .. 20 "writer"
SEXES = ["F", "M"]
ZIP_PREFIX_LEN = 3  # US sectional-center prefix
USER_FEATURES = ["sex", "age_group", "occupation", "zip_prefix"]
_ENC = "latin-1"  # the official ml-1m encoding; ASCII-compatible for the other files


def rating_to_actions(ratings: np.ndarray) -> np.ndarray:
    """Bitmask with bit k set iff rating >= k + 1, k = 0..4."""
    r = np.asarray(ratings, dtype=np.float64)
    out = np.zeros(r.shape, dtype=np.int64)
    for k in range(5):
        out |= (r >= k + 1).astype(np.int64) << k
    return out


def _age_group(age: int) -> str:
    """Bucket a raw age into the ml-1m age groups (so ml-100k and ml-1m share the feature)."""
    for lo in reversed(ML_1M_AGE_GROUPS):
        if age >= int(lo):
            return lo
    return ML_1M_AGE_GROUPS[0]


def _check_unique_users(path: Path, uids: np.ndarray) -> None:
    uniq, first, counts = np.unique(uids, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1]
        raise DataFormatError(
            f"{path}: user id(s) {dup[:5].tolist()} appear on more than one line "
            f"(first at data row(s) {(first[counts > 1][:5] + 1).tolist()}); "
            f"each user must be listed once."
        )


def _user_feature_table(
    uids: np.ndarray, columns: dict[str, list[str]], vocabularies: dict[str, list[str] | None]
) -> tuple[dict[str, dict[int, int]], dict[str, list[str]]]:
    table: dict[str, dict[int, int]] = {}
    vocabs: dict[str, list[str]] = {}
    for feat, values in columns.items():
        ids, vocab = encode_categorical(np.asarray(values, dtype=object), vocabularies.get(feat))
        table[feat] = dict(zip(uids.tolist(), ids.tolist()))
        vocabs[feat] = vocab
    return table, vocabs


def _result(
    name: str,
    ratings: dict[str, np.ndarray],
    cols: tuple[str, str, str, str],
    users_path: Path,
    uids: np.ndarray,
    feature_values: dict[str, list[str]],
    vocabularies: dict[str, list[str] | None],
    rows_read: dict[str, int],
) -> BuildResult:
    """Encode the user file's features and build the sequences (ml-1m, ml-100k)."""
    _check_unique_users(users_path, uids)
    table, vocabs = _user_feature_table(uids, feature_values, vocabularies)
    u, i, r, t = cols
    data, stats = build_sequence_data(
        name,
        users=ratings[u],
        items=ratings[i],
        actions=rating_to_actions(ratings[r]),
        timestamps=ratings[t],
        action_names=RATING_ACTION_NAMES,
        user_feature_table=table,
        extra={"action_encoding": "bit k set iff rating >= k+1 (k = 0..4)"},
    )
    stats["users_in_user_file_without_ratings"] = int(np.setdiff1d(uids, data.user_ids).size)
    stats["feature_vocabularies"] = vocabs
    return BuildResult(data=data, rows_read=rows_read, dropped={}, stats=stats)


def _read_star_ratings(
    path: Path, sep: str, names: tuple[str, str, str, str], opts: BuildOptions
) -> tuple[dict[str, np.ndarray], int]:
    """A headerless ``user item rating time`` file with whole-star ratings 1..5."""
    user, item, rating, time = names
    return read_table(
        path,
        sep=sep,
        header=False,
        names=list(names),
        columns=[
            Column(user, min_value=0, max_value=ID_MAX),
            Column(item, min_value=0, max_value=ID_MAX),
            Column(rating, min_value=1, max_value=5),
            Column(time, min_value=0, negative_hint=TIME_HINT),
        ],
        encoding=_ENC,
        progress=opts.progress,
    )


# ---- ml-1m ---------------------------------------------------------------------------------------
def locate_ml_1m(source: Path) -> dict[str, Path]:
    sub = ("", "ml-1m")
    return {
        "ratings": find_file(source, ["ratings.dat"], "ml-1m ratings file", sub),
        "users": find_file(source, ["users.dat"], "ml-1m user file", sub),
    }


def build_ml_1m(files: dict[str, Path], opts: BuildOptions) -> BuildResult:
    cols = ("UserID", "MovieID", "Rating", "Timestamp")
    ratings, n = _read_star_ratings(files["ratings"], "::", cols, opts)
    users, n_users = read_table(
        files["users"],
        sep="::",
        header=False,
        names=["UserID", "Gender", "Age", "Occupation", "Zip-code"],
        columns=[
            Column("UserID", min_value=0, max_value=ID_MAX),
            Column("Gender", kind="str", required=False),
            Column("Age", min_value=0),
            Column("Occupation", min_value=0),
            Column("Zip-code", kind="str", required=False),
        ],
        encoding=_ENC,
        progress=opts.progress,
    )
    return _result(
        opts.name,
        ratings,
        cols,
        files["users"],
        users["UserID"],
        {
            "sex": list(users["Gender"]),
            "age_group": [str(a) for a in users["Age"]],
            "occupation": [str(o) for o in users["Occupation"]],
            "zip_prefix": [z[:ZIP_PREFIX_LEN] for z in users["Zip-code"]],
        },
        {"sex": SEXES, "age_group": ML_1M_AGE_GROUPS, "occupation": ML_1M_OCCUPATIONS},
        {"ratings": n, "users": n_users},
    )


# ---- ml-100k -------------------------------------------------------------------------------------
def locate_ml_100k(source: Path) -> dict[str, Path]:
    sub = ("", "ml-100k")
    files = {
        "ratings": find_file(source, ["u.data"], "ml-100k ratings file", sub),
        "users": find_file(source, ["u.user"], "ml-100k user file", sub),
    }
    try:  # optional: fixes the occupation vocabulary order
        files["occupations"] = find_file(source, ["u.occupation"], "ml-100k occupation list", sub)
    except FileNotFoundError:
        pass
    return files


def build_ml_100k(files: dict[str, Path], opts: BuildOptions) -> BuildResult:
    cols = ("user_id", "item_id", "rating", "timestamp")
    ratings, n = _read_star_ratings(files["ratings"], "\t", cols, opts)
    users, n_users = read_table(
        files["users"],
        sep="|",
        header=False,
        names=["user_id", "age", "gender", "occupation", "zip_code"],
        columns=[
            Column("user_id", min_value=0, max_value=ID_MAX),
            Column("age", min_value=0),
            Column("gender", kind="str", required=False),
            Column("occupation", kind="str", required=False),
            Column("zip_code", kind="str", required=False),
        ],
        encoding=_ENC,
        progress=opts.progress,
    )
    rows_read = {"ratings": n, "users": n_users}
    occupations: list[str] | None = None
    if "occupations" in files:
        text = files["occupations"].read_text(encoding=_ENC)
        occupations = [line.strip() for line in text.splitlines() if line.strip()]
        rows_read["occupations"] = len(occupations)
        unknown = sorted(set(users["occupation"]) - set(occupations) - {""})
        if unknown:
            raise DataFormatError(
                f"{files['users']}: occupation(s) {unknown[:5]} are not listed in "
                f"{files['occupations']}; is this the right u.occupation?"
            )
    return _result(
        opts.name,
        ratings,
        cols,
        files["users"],
        users["user_id"],
        {
            "sex": list(users["gender"]),
            "age_group": [_age_group(int(a)) for a in users["age"]],
            "occupation": list(users["occupation"]),
            "zip_prefix": [z[:ZIP_PREFIX_LEN] for z in users["zip_code"]],
        },
        {"sex": SEXES, "age_group": ML_1M_AGE_GROUPS, "occupation": occupations},
        rows_read,
    )


# ---- ml-20m --------------------------------------------------------------------------------------
def locate_ml_20m(source: Path) -> dict[str, Path]:
    return {"ratings": find_file(source, ["ratings.csv"], "ml-20m ratings file", ("", "ml-20m"))}


def build_ml_20m(files: dict[str, Path], opts: BuildOptions) -> BuildResult:
    half_stars = tuple(x / 2 for x in range(1, 11))

    def shrink(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # 20M rows: keep compact dtypes per chunk (ratings become the 5-bit mask right away).
        return {
            "userId": a["userId"].astype(np.int32),
            "movieId": a["movieId"].astype(np.int32),
            "rating": rating_to_actions(a["rating"]).astype(np.int8),
            "timestamp": a["timestamp"],
        }

    ratings, n = read_table(
        files["ratings"],
        sep=",",
        header=True,
        columns=[
            Column("userId", min_value=0, max_value=np.iinfo(np.int32).max),
            Column("movieId", min_value=0, max_value=np.iinfo(np.int32).max),
            Column("rating", kind="float", allowed=half_stars),
            Column("timestamp", min_value=0, negative_hint=TIME_HINT),
        ],
        encoding=_ENC,
        progress=opts.progress,
        on_chunk=shrink,
    )
    data, stats = build_sequence_data(
        opts.name,
        users=ratings["userId"],
        items=ratings["movieId"],
        actions=ratings["rating"],
        timestamps=ratings["timestamp"],
        action_names=RATING_ACTION_NAMES,
        extra={"action_encoding": "bit k set iff rating >= k+1 (k = 0..4); half stars round down"},
    )
    return BuildResult(data=data, rows_read={"ratings": n}, dropped={}, stats=stats)
