"""Dataset lookup: `DatasetArgs` -> `SequenceData` (generated or loaded from data/<name>/)."""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from hstu.config.limits import MAX_ITEM_ID, check_memory, process_counts
from hstu.data.datasets import SampleSplits, build_ranking_samples, build_retrieval_samples
from hstu.data.sequences import (
    DATA_FILE,
    MANIFEST_FILE,
    PreparedDataError,
    SequenceData,
    rerun_command,
    time_order_problem,
)
from hstu.data.synthetic import generate_synthetic, synthetic_generation_memory

__all__ = [
    "SYNTHETIC_DATASET",
    "load_sequence_data",
    "resolve_dataset_dir",
    "build_samples",
]

logger = logging.getLogger(__name__)

SYNTHETIC_DATASET = "synthetic"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _prepare_command(name: str) -> str:
    return f"python -m hstu.data.prepare --dataset {name} --source <path to the raw files>"


def resolve_dataset_dir(dataset_name: str, dataset_path: str = "") -> tuple[Path, list[Path]]:
    """The directory holding ``dataset_name``'s prepared files, and every place looked at.

    An explicit ``dataset_path`` is used as given. Otherwise ``data/<name>`` is tried relative to
    the working directory, then relative to the repository checkout.
    """
    if dataset_path:
        path = Path(dataset_path).expanduser()
        return path, [path]
    candidates = [Path("data") / dataset_name, _REPO_ROOT / "data" / dataset_name]
    for path in candidates:
        if (path / DATA_FILE).exists() and (path / MANIFEST_FILE).exists():
            return path, candidates
    return candidates[0], candidates


def _load_prepared(
    name: str, directory: Path, looked: list[Path], dataset_path: str
) -> SequenceData:
    data_file, manifest = directory / DATA_FILE, directory / MANIFEST_FILE
    if not data_file.exists() or not manifest.exists():
        where = ", ".join(dict.fromkeys(str(p.resolve()) for p in looked))
        raise FileNotFoundError(
            f"dataset {name!r} is not prepared: no {DATA_FILE} + {MANIFEST_FILE} in {where} "
            f"(DatasetArgs.dataset_name={name!r}, DatasetArgs.dataset_path={dataset_path!r}). "
            f"Prepare it with: {_prepare_command(name)}"
            + ("" if directory == Path("data") / name else f" --output {directory}")
        )
    fix = _prepare_command(name) + f" --output {directory} --force"
    try:
        # checks the arrays against the manifest (sizes, shapes, dtypes, checksums, counts)
        data = SequenceData.load(directory, fix=fix)
    except PreparedDataError:
        raise  # one line naming the file and the command already
    except (ValueError, KeyError, json.JSONDecodeError, zipfile.BadZipFile, OSError) as err:
        raise PreparedDataError(
            f"{data_file}: invalid prepared dataset ({' '.join(str(err).split())}); re-create "
            f"it with: {fix}"
        ) from err
    _check_ids(data, data_file, name, rerun_command(_read_manifest(manifest), fix))
    return data


def _read_manifest(path: Path) -> dict:
    """The manifest as a dict ({} if it cannot be read: it was read once already)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _check_ids(data: SequenceData, data_file: Path, name: str, fix: str) -> None:
    """Reject empty data, negative ids and timestamps out of order with messages naming the
    file and the command that re-creates it (``fix``)."""
    if data.num_users == 0 or data.num_interactions == 0:
        raise ValueError(
            f"{data_file}: dataset {name!r} is empty ({data.num_users} users, "
            f"{data.num_interactions} interactions); re-create it with: {_prepare_command(name)}"
        )
    for key in ("user_ids", "item_ids", "actions", "user_features"):
        arr = getattr(data, key)
        if arr.size and int(arr.min()) < 0:
            flat = np.flatnonzero(arr.reshape(-1) < 0)[0]
            raise ValueError(
                f"{data_file}: {key} holds a negative id ({int(arr.reshape(-1)[flat])} at flat "
                f"index {int(flat)}); ids must be >= 0. Re-create it with: {_prepare_command(name)}"
            )
    # the item table has max id + 1 rows (static backends): ids beyond the int32 range it indexes
    if int(data.item_ids.max()) > MAX_ITEM_ID:
        flat = int(np.argmax(data.item_ids > MAX_ITEM_ID))
        raise ValueError(
            f"{data_file}: item_ids holds {int(data.item_ids[flat])} at index {flat}, above the "
            f"largest item id the tables index ({MAX_ITEM_ID} = 2^31 - 1); re-create it with "
            f"the current converter, which checks ids: {_prepare_command(name)}"
        )
    # Samples are cut by position, so positions must be in time order inside each user; the
    # time attention bias reads the timestamps themselves, which are Unix times (>= 0).
    problem = time_order_problem(data)
    if problem is not None:
        raise ValueError(
            f"{data_file}: {problem} (DatasetArgs.dataset_name={name!r}). The converters sort "
            f"each user by time and refuse negative times: re-create it with: {fix}"
        )


def load_sequence_data(dataset_args: Any, num_tasks: int = 8) -> SequenceData:
    """The `SequenceData` that ``dataset_args`` (a `DatasetArgs`) names.

    ``"synthetic"`` is generated from ``synthetic_num_users``, ``synthetic_num_items``,
    ``synthetic_seed`` and ``synthetic_time_effect`` (with ``num_tasks`` action bits); any other
    name is loaded from ``dataset_path`` or ``data/<name>/`` as written by
    ``python -m hstu.data.prepare``.
    """
    name = str(dataset_args.dataset_name)
    if name == SYNTHETIC_DATASET:
        for field in ("synthetic_num_users", "synthetic_num_items"):
            value = getattr(dataset_args, field)
            if int(value) < (1 if field == "synthetic_num_users" else 2):
                raise ValueError(
                    f"DatasetArgs.{field}={value!r} gives an empty synthetic dataset; use at least "
                    f"{1 if field == 'synthetic_num_users' else 2}"
                )
        # the generator's arrays must fit this host (each local process makes its own copy)
        local = process_counts()[1]
        plan = synthetic_generation_memory(
            int(dataset_args.synthetic_num_users), int(dataset_args.synthetic_num_items)
        )
        check_memory(
            {"host": plan.times(local)},
            what="generating the synthetic dataset"
            + (f" in each of {local} processes" if local > 1 else ""),
        )
        time_effect = _synthetic_time_effect(dataset_args)
        data = generate_synthetic(
            num_users=int(dataset_args.synthetic_num_users),
            num_items=int(dataset_args.synthetic_num_items),
            seed=int(dataset_args.synthetic_seed),
            num_tasks=int(num_tasks),
            time_effect=time_effect,
        )
        problem = time_order_problem(data)
        if problem is not None:  # the generator guarantees order; a failure here is a bug
            raise RuntimeError(f"synthetic dataset (DatasetArgs.synthetic_*): {problem}")
        logger.info(
            "synthetic dataset: %d users, %d items, %d interactions (seed %d%s)",
            data.num_users,
            int(data.item_corpus().size),
            data.num_interactions,
            int(dataset_args.synthetic_seed),
            f", time effect {time_effect:g}" if time_effect else "",
        )
        return data
    dataset_path = str(getattr(dataset_args, "dataset_path", "") or "")
    directory, looked = resolve_dataset_dir(name, dataset_path)
    data = _load_prepared(name, directory, looked, dataset_path)
    if data.num_tasks < num_tasks:
        logger.warning(
            "dataset %s has %d action types %s but %d tasks were requested; the extra tasks "
            "never fire (set RankingArgs.num_tasks=%d for ranking)",
            name,
            data.num_tasks,
            data.action_names,
            num_tasks,
            data.num_tasks,
        )
    logger.info(
        "dataset %s from %s: %d users, %d items, %d interactions",
        name,
        directory,
        data.num_users,
        int(data.item_corpus().size),
        data.num_interactions,
    )
    return data


def _synthetic_time_effect(dataset_args: Any) -> float:
    """``DatasetArgs.synthetic_time_effect`` (0 = off, where the field is absent too), checked."""
    value = getattr(dataset_args, "synthetic_time_effect", 0.0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not 0.0 <= float(value) <= 1.0
    ):
        raise ValueError(
            f"DatasetArgs.synthetic_time_effect={value!r} must be a number in [0, 1] (the share "
            "of steps whose next item follows the time gap; 0 = off)"
        )
    return float(value)


def build_samples(data: SequenceData, dataset_args: Any, task: str) -> SampleSplits:
    """Train/eval samples for ``task`` ("ranking" or "retrieval") with ``dataset_args``' sizes."""
    if task == "ranking":
        return build_ranking_samples(
            data, int(dataset_args.max_history_seqlen), int(dataset_args.max_num_candidates)
        )
    if task == "retrieval":
        return build_retrieval_samples(data, int(dataset_args.max_history_seqlen))
    raise ValueError(f"unknown task {task!r}: expected 'ranking' or 'retrieval'")
