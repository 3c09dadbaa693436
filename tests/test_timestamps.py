"""Timestamps through the data pipeline: which datasets have real ones, `Batch.timestamps` (jagged
like item_id) and `Batch.target_timestamps` equal to the data's per-interaction times, surviving
collation, rank splits, prefetching and device copies; bad times are clear errors; the synthetic
generator's planted time effect; the time-aware configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from hstu.data import (
    ITEM_FEATURE,
    BatchIterator,
    SequenceData,
    build_ranking_samples,
    build_retrieval_samples,
    generate_synthetic,
    load_sequence_data,
)
from hstu.data.features import FeatureInfo, require_timestamps
from hstu.data.loader import PrefetchIterator
from hstu.data.prepare import prepare_dataset
from hstu.data.sequences import DATA_FILE, MANIFEST_FILE, array_record
from hstu.data.sources import DATASETS, DataFormatError
from hstu.data.synthetic import (
    TIME_EFFECT_GAP_THRESHOLD_S,
    generate_synthetic_with_latents,
)
from hstu.errors import EXIT_CONFIG, exit_code_for

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass
class Args:
    """Stand-in for `DatasetArgs` (the fields the data layer reads)."""

    dataset_name: str = "synthetic"
    dataset_path: str = ""
    max_history_seqlen: int = 16
    max_num_candidates: int = 4
    synthetic_num_users: int = 300
    synthetic_num_items: int = 200
    synthetic_seed: int = 0
    synthetic_time_effect: float = 0.0


def _toy(lengths: list[int], has_timestamps: bool = True) -> SequenceData:
    """One user per length; item = 100 * user + position; time = 10^6 * user + 7 * position^2
    (distinct everywhere, so a misplaced time shows)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    items = np.concatenate([100 * u + np.arange(n) for u, n in enumerate(lengths)])
    times = np.concatenate([10**6 * u + 7 * np.arange(n) ** 2 for u, n in enumerate(lengths)])
    u = len(lengths)
    return SequenceData(
        name="toy",
        user_ids=np.arange(u, dtype=np.int64),
        offsets=offsets,
        item_ids=items.astype(np.int64),
        actions=np.ones(int(offsets[-1]), dtype=np.int64),
        timestamps=times.astype(np.int64),
        user_features=np.arange(u, dtype=np.int64)[:, None],
        user_feature_names=["user_id"],
        action_names=["a"],
        has_timestamps=has_timestamps,
    )


def _segments(values: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [s.tolist() for s in torch.split(values, lengths.tolist())]


def _expected(data: SequenceData, starts, ends) -> tuple[list[list[int]], list[list[int]]]:
    """Per sample, the items and times of global positions [start, end)."""
    items = [data.item_ids[s:e].tolist() for s, e in zip(starts, ends)]
    times = [data.timestamps[s:e].tolist() for s, e in zip(starts, ends)]
    return items, times


def _check_ranking(data: SequenceData, samples, idx) -> None:
    batch = samples.collate(idx)
    lengths = batch.item_lengths()
    assert batch.timestamps is not None and batch.timestamps.dtype == torch.int64
    assert batch.timestamps.shape == batch.features[ITEM_FEATURE].values().shape
    items, times = _expected(data, samples.history_starts[idx], samples.candidate_ends[idx])
    assert _segments(batch.features[ITEM_FEATURE].values(), lengths) == items
    assert _segments(batch.timestamps, lengths) == times
    # the candidates (the last num_candidates of each sample) carry their own times
    cand_times = [t[len(t) - k :] for t, k in zip(times, batch.num_candidates.tolist())]
    _, want = _expected(data, samples.candidate_starts[idx], samples.candidate_ends[idx])
    assert cand_times == want
    assert batch.target_timestamps is None


def _check_retrieval(data: SequenceData, samples, idx) -> None:
    batch = samples.collate(idx)
    lengths = batch.item_lengths()
    items, times = _expected(data, samples.starts[idx], samples.ends[idx])
    assert _segments(batch.features[ITEM_FEATURE].values(), lengths) == items
    assert _segments(batch.timestamps, lengths) == times
    if samples.is_eval:
        assert batch.target_item_ids.tolist() == data.item_ids[samples.ends[idx]].tolist()
        assert batch.target_timestamps.tolist() == data.timestamps[samples.ends[idx]].tolist()
        # the target comes at or after the last history item
        last = [t[-1] for t in times]
        assert all(a >= b for a, b in zip(batch.target_timestamps.tolist(), last))
    else:
        assert batch.target_timestamps is None


# ---- batches carry each item's time -------------------------------------------------------
@pytest.mark.parametrize("lengths", [[25, 1, 3, 11], [2, 2], [40]])
def test_toy_batches_carry_item_times(lengths):
    data = _toy(lengths)
    for split in build_ranking_samples(data, max_history_seqlen=5, max_num_candidates=4):
        _check_ranking(data, split, np.arange(len(split)))
    for split in build_retrieval_samples(data, max_history_seqlen=6):
        _check_retrieval(data, split, np.arange(len(split)))


@pytest.mark.parametrize("time_effect", [0.0, 1.0])
def test_synthetic_batches_carry_item_times(time_effect):
    data = generate_synthetic(300, 200, seed=0, time_effect=time_effect)
    assert data.has_timestamps
    rng = np.random.default_rng(0)
    for split in build_ranking_samples(data, 16, 4):
        _check_ranking(data, split, rng.choice(len(split), 37, replace=False))
    for split in build_retrieval_samples(data, 16):
        _check_retrieval(data, split, rng.choice(len(split), 37, replace=False))


def test_data_without_timestamps_gives_batches_without():
    data = _toy([6, 4], has_timestamps=False)
    for split in (*build_ranking_samples(data, 5, 2), *build_retrieval_samples(data, 5)):
        batch = split.collate(np.arange(len(split)))
        assert batch.timestamps is None and batch.target_timestamps is None
        moved = batch.to("cpu")
        assert moved.timestamps is None and moved.target_timestamps is None


def test_timestamps_survive_ranks_prefetch_and_copies():
    data = generate_synthetic(300, 200, seed=1)
    train, _ = build_ranking_samples(data, 16, 4)
    lin = 3.0
    per_rank = [
        BatchIterator(train, 16, seed=3, rank=r, world_size=2, balance="cost", linear_cost=lin)
        for r in range(2)
    ]
    for _ in range(3):
        for it in per_rank:
            state = it.state_dict()
            batch = next(it)
            it.load_state_dict(state)
            idx = it.next_indices()  # the same step again: this rank's sample indices
            ref = train.collate(idx)
            assert torch.equal(batch.timestamps, ref.timestamps)
            _check_ranking(data, train, idx)
    # prefetching (the trainer's path) hands over the same batches
    plain = BatchIterator(train, 16, seed=5)
    fetched = PrefetchIterator(BatchIterator(train, 16, seed=5), depth=2)
    try:
        for _ in range(4):
            a, b = next(plain), next(fetched)
            assert torch.equal(a.timestamps, b.timestamps)
    finally:
        fetched.close()
    # Batch.to keeps them (and the CPU twin's)
    batch = train.collate(np.arange(9))
    moved = batch.to("cpu")
    assert torch.equal(moved.timestamps, batch.timestamps)
    assert moved.host_batch() is not None and torch.equal(
        moved.host_batch().timestamps, batch.timestamps
    )


@pytest.mark.gpu
def test_timestamps_survive_pinning_and_the_copy_to_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    data = generate_synthetic(300, 200, seed=1)
    _, ev = build_retrieval_samples(data, 16)
    batch = ev.collate(np.arange(11))
    pinned = batch.pin_memory()
    assert pinned.timestamps.is_pinned() and pinned.target_timestamps.is_pinned()
    gpu = pinned.to("cuda", non_blocking=True)
    assert gpu.timestamps.is_cuda and gpu.target_timestamps.is_cuda
    assert torch.equal(gpu.timestamps.cpu(), batch.timestamps)
    assert torch.equal(gpu.target_timestamps.cpu(), batch.target_timestamps)
    assert gpu.host_batch().timestamps is pinned.timestamps


# ---- which datasets have real timestamps --------------------------------------------------
def _prepare(name: str, fixture: str, tmp_path: Path, source_file: str = "") -> SequenceData:
    src = tmp_path / "raw" / fixture
    shutil.copytree(FIXTURES / fixture, src)
    res = prepare_dataset(
        name, src / source_file if source_file else src, tmp_path / name, progress=False
    )
    assert res.manifest["has_timestamps"] is (name not in ("sequences", "amazon-beauty"))
    return SequenceData.load(res.output_dir)


@pytest.mark.parametrize(
    ("name", "fixture", "source_file"),
    [
        ("ml-1m", "ml-1m", ""),
        ("ml-100k", "ml-100k", ""),
        ("ml-20m", "ml-20m", ""),
        ("kuairand-pure", "kuairand-pure", ""),
        ("sequences", "sequences", "pairs.txt"),
        ("amazon-beauty", "sequences", "lines.txt"),
    ],
)
def test_prepared_datasets_say_whether_they_have_timestamps(tmp_path, name, fixture, source_file):
    data = _prepare(name, fixture, tmp_path, source_file)
    real = name not in ("sequences", "amazon-beauty")
    assert data.has_timestamps is real
    splits = build_retrieval_samples(data, 8)
    batch = splits.eval.collate(np.arange(len(splits.eval)))
    if real:
        _check_retrieval(data, splits.eval, np.arange(len(splits.eval)))
    else:
        assert batch.timestamps is None and batch.target_timestamps is None


def test_every_dataset_is_classified():
    """Every converter is either known to have real timestamps or listed as positions only."""
    info = FeatureInfo([], [], 2, 1, 8)
    with pytest.raises(ValueError) as err:
        require_timestamps(info, "NetworkArgs.relative_attention_bias='time'")
    for name in [*DATASETS, "synthetic"]:
        assert name in str(err.value), name


@pytest.mark.parametrize(
    ("dataset", "extra", "expected"),
    [
        ("ml-100k", {}, True),
        ("kuairand-1k", {}, True),
        ("sequences", {"timestamps": "position in the file"}, False),
        ("amazon-beauty", {"format": "lines"}, False),
        ("ml-1m", {"timestamps": "position in the file"}, False),  # sasrec file as data/ml-1m
        (None, {}, True),
    ],
)
def test_manifests_without_the_flag(tmp_path, dataset, extra, expected):
    """Datasets prepared before the flag existed: real timestamps unless SASRec-style."""
    data = _toy([3, 4])
    data.save(tmp_path / "d")
    man = tmp_path / "d" / MANIFEST_FILE
    meta = json.loads(man.read_text())
    del meta["has_timestamps"]
    meta["extra"] = extra
    if dataset is not None:
        meta["dataset"] = dataset
    man.write_text(json.dumps(meta))
    assert SequenceData.load(tmp_path / "d").has_timestamps is expected


def test_the_flag_round_trips(tmp_path):
    for flag in (True, False):
        _toy([3, 4], has_timestamps=flag).save(tmp_path / str(flag))
        assert SequenceData.load(tmp_path / str(flag)).has_timestamps is flag


def test_require_timestamps_names_the_setting():
    with_ts = FeatureInfo(["user_id"], [5], 10, 1, 8, has_timestamps=True)
    require_timestamps(with_ts, "NetworkArgs.relative_attention_bias='time'")  # no error
    without = FeatureInfo(["user_id"], [5], 10, 1, 8)
    assert without.has_timestamps is False  # the default: no timestamps unless the data says so
    for setting in ("NetworkArgs.relative_attention_bias='position_time'", "position_time"):
        with pytest.raises(ValueError) as err:
            require_timestamps(without, setting)
        msg = str(err.value)
        assert "NetworkArgs.relative_attention_bias='position_time'" in msg
        assert "no timestamps" in msg and "ml-100k" in msg and "sequences" in msg
        assert "'position'" in msg  # what to use instead


# ---- bad timestamps -------------------------------------------------------------------------
def _write_arrays(directory: Path, **overrides) -> Path:
    """A prepared dataset whose arrays are edited after the fact (with a matching manifest)."""
    data = _toy([3, 2])
    data.save(directory)
    with np.load(directory / DATA_FILE) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(overrides)
    np.savez(directory / DATA_FILE, **arrays)
    man = directory / MANIFEST_FILE
    meta = json.loads(man.read_text())
    meta["arrays"] = {k: array_record(v) for k, v in arrays.items()}
    meta["data_file"]["bytes"] = (directory / DATA_FILE).stat().st_size
    meta["command"] = (
        f"python -m hstu.data.prepare --dataset toy --source /raw --output {directory}"
    )
    man.write_text(json.dumps(meta))
    return directory


@pytest.mark.parametrize(
    ("times", "problem"),
    [
        ([0, 7, 28, 10**6, 10**6 - 1], "timestamps go backwards inside user 1 (row 4: 1000000 -> 999999)"),
        ([0, -7, 28, 10**6, 10**6 + 7], "negative timestamp -7 at row 1 (user 0)"),
    ],
)  # fmt: skip
def test_bad_prepared_timestamps_name_the_file_setting_and_fix(tmp_path, times, problem):
    d = _write_arrays(tmp_path / "toy", timestamps=np.array(times, dtype=np.int64))
    with pytest.raises(ValueError) as err:
        load_sequence_data(Args(dataset_name="toy", dataset_path=str(d)))
    msg = str(err.value)
    assert msg.startswith(f"{d / DATA_FILE}: ") and problem in msg
    assert "DatasetArgs.dataset_name='toy'" in msg
    assert "re-create it with: python -m hstu.data.prepare --dataset toy" in msg
    assert "\n" not in msg and exit_code_for(err.value) == EXIT_CONFIG


def test_a_new_user_may_start_earlier_than_the_previous_one_ended(tmp_path):
    d = _write_arrays(tmp_path / "toy", timestamps=np.array([5, 6, 7, 1, 2], dtype=np.int64))
    assert load_sequence_data(Args(dataset_name="toy", dataset_path=str(d))).num_users == 2


@pytest.mark.parametrize(
    ("fixture", "file", "line", "text", "column"),
    [
        ("ml-100k", "u.data", 3, "196\t377\t1\t-878887116", "timestamp"),
        ("ml-1m", "ratings.dat", 2, "1::661::3::-978302109", "Timestamp"),
        ("ml-20m", "ratings.csv", 3, "1,29,3.5,-1112484676", "timestamp"),
        (
            "kuairand-pure",
            "log_standard_4_08_to_4_21_pure.csv",
            2,
            "0,4354972,20220409,900,-1649467982289,0,0,0,0,0,0,0,0,70100,0,0,0,0,1",
            "time_ms",
        ),
    ],
)
def test_negative_raw_timestamps_report_the_line(tmp_path, fixture, file, line, text, column):
    src = tmp_path / "raw"
    shutil.copytree(FIXTURES / fixture, src)
    lines = (src / file).read_text().split("\n")
    lines[line - 1] = text
    (src / file).write_text("\n".join(lines))
    with pytest.raises(DataFormatError) as err:
        prepare_dataset(fixture, src, tmp_path / "out", progress=False)
    msg = str(err.value)
    assert f"{file}: 1 bad row(s): column '{column}' must be >= 0 (timestamps are Unix" in msg
    assert f"line {line}: {text!r}" in msg and "negative ids" not in msg


def test_prepare_cli_refuses_negative_timestamps_with_exit_2(tmp_path):
    src = tmp_path / "raw"
    shutil.copytree(FIXTURES / "ml-100k", src)
    text = (src / "u.data").read_text().replace("880606923", "-880606923")
    (src / "u.data").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "hstu.data.prepare", "--dataset", "ml-100k", "--source", str(src),
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "must be >= 0 (timestamps are Unix times" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# ---- the synthetic generator's planted time effect -----------------------------------------
# sha256 (first 16 hex digits) of the default generator's arrays, recorded before the time
# effect existed: the default data must not change
GOLDEN = {
    (300, 200, 0, 8): {
        "item_ids": "f14f7527aa2d5412",
        "actions": "742d4e8e11126aa7",
        "timestamps": "c4ee7f611bfffa54",
        "offsets": "d303738ab5b06e3a",
    },
    (600, 300, 7, 3): {
        "item_ids": "9e03cedaa4297b48",
        "actions": "be37dfcd02f639f0",
        "timestamps": "96a1b57ceafb17b2",
        "offsets": "1743db2a4c09bcb5",
    },
}


@pytest.mark.parametrize("args", sorted(GOLDEN))
def test_time_effect_is_off_by_default_and_the_default_data_unchanged(args):
    default = generate_synthetic(*args)
    off = generate_synthetic(*args, time_effect=0.0)
    for key, digest in GOLDEN[args].items():
        assert array_record(getattr(default, key))["sha256"][:16] == digest, key
        np.testing.assert_array_equal(getattr(off, key), getattr(default, key), err_msg=key)
    assert "time_effect" not in default.extra
    assert load_sequence_data(Args(synthetic_num_users=args[0], synthetic_num_items=args[1],
                                   synthetic_seed=args[2]), num_tasks=args[3]).extra == default.extra  # fmt: skip


def test_time_effect_is_deterministic_and_changes_the_data():
    a = generate_synthetic(300, 200, seed=4, time_effect=0.7)
    b = generate_synthetic(300, 200, seed=4, time_effect=0.7)
    base = generate_synthetic(300, 200, seed=4)
    for key in ("offsets", "item_ids", "actions", "timestamps", "user_features"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    np.testing.assert_array_equal(a.offsets, base.offsets)  # same users and lengths
    assert (a.item_ids != base.item_ids).mean() > 0.3
    assert a.extra["time_effect"] == 0.7
    assert (
        generate_synthetic(300, 200, seed=5, time_effect=0.7).item_ids[:50] != a.item_ids[:50]
    ).any()


def _next_steps(data: SequenceData, latents):
    """Per step (an interaction after an earlier one of the same user): its position, the gap
    before it, the previous item's cluster, its own cluster and its action bitmask."""
    row = np.repeat(np.arange(data.num_users), data.lengths())
    nxt = np.flatnonzero(row[1:] == row[:-1]) + 1
    gap = data.timestamps[nxt] - data.timestamps[nxt - 1]
    cluster = latents.item_cluster[data.item_ids]
    return nxt, gap, cluster[nxt - 1], cluster[nxt], data.actions[nxt]


def test_time_effect_plants_a_signal_only_time_reveals():
    data, lat = generate_synthetic_with_latents(2000, 1000, seed=0, time_effect=1.0)
    pos, gap, prev, nxt, actions = _next_steps(data, lat)
    long = gap > TIME_EFFECT_GAP_THRESHOLD_S
    # two regimes, cleanly apart (the threshold recovers the generator's own): minutes or days
    np.testing.assert_array_equal(long, lat.long_gap[pos])
    assert 0.45 < long.mean() < 0.55
    assert np.median(gap[~long]) < 3600 and np.median(gap[long]) > 86400
    # the gaps do not depend on the previous item: nothing before the gap predicts it
    busiest = np.bincount(prev).argmax()
    assert abs(long[prev == busiest].mean() - long.mean()) < 0.05
    # after a short gap the user stays in the cluster; after a long one they go to evergreens
    assert (nxt[~long] == prev[~long]).all()
    top = int(np.argmax(lat.cluster_popularity))
    assert (nxt[long] == prev[long]).mean() < 0.4 and (nxt[long] == top).mean() > 0.3
    # predicting the next cluster: knowing the gap beats the best rule that ignores it
    blind = max((nxt == prev).mean(), (nxt == top).mean())
    aware = np.where(long, nxt == top, nxt == prev).mean()
    assert aware > blind + 0.05, (aware, blind)
    # labels follow the gap too: clicks are likelier after a long gap
    click = actions & 1
    assert click[long].mean() > click[~long].mean() + 0.05


def test_time_effect_strength_is_checked():
    with pytest.raises(ValueError, match="time_effect must be in"):
        generate_synthetic(30, 20, seed=0, time_effect=1.5)
    with pytest.raises(ValueError, match=r"DatasetArgs\.synthetic_time_effect=-0\.5"):
        load_sequence_data(Args(synthetic_time_effect=-0.5))
    data = load_sequence_data(Args(synthetic_time_effect=0.5))
    assert data.extra["time_effect"] == 0.5


# ---- the time-aware configs -----------------------------------------------------------------
def test_synthetic_time_retrieval_config():
    from hstu.config.gin_utils import load_config

    cfg = load_config("retrieval", [REPO / "configs" / "synthetic_time_retrieval.gin"])
    assert cfg.dataset.dataset_name == "synthetic" and cfg.dataset.synthetic_time_effect > 0
    assert cfg.network.relative_attention_bias == "position_time"
    assert cfg.network.hidden_size <= 64 and cfg.trainer.max_train_iters <= 1000  # < 1 min CPU


def test_ml_100k_retrieval_config_is_the_paper_model_with_time():
    from hstu.config.gin_utils import load_config

    cfg = load_config("retrieval", [REPO / "configs" / "ml_100k_retrieval.gin"])
    n, d, r = cfg.network, cfg.dataset, cfg.retrieval
    assert d.dataset_name == "ml-100k" and d.max_history_seqlen == 200
    assert (n.num_layers, n.num_attention_heads, n.hidden_size, n.kv_channels) == (2, 1, 50, 50)
    assert n.relative_attention_bias == "position_time" and n.num_time_buckets == 128
    assert (r.num_negatives, r.temperature, cfg.optimizer.learning_rate) == (128, 0.05, 1e-3)
    assert r.eval_exclude_history and "HR@10" in r.eval_metrics and "NDCG@10" in r.eval_metrics


def test_real_ml_100k_batches_carry_the_raw_times(tmp_path, shared_data):
    src = shared_data("ml-100k")
    res = prepare_dataset("ml-100k", src, tmp_path / "ml-100k", progress=False)
    data = SequenceData.load(res.output_dir)
    assert data.has_timestamps and res.manifest["has_timestamps"] is True
    raw = np.loadtxt(src / "u.data", dtype=np.int64)  # user, item, rating, time
    train, ev = build_retrieval_samples(data, 200)
    batch = ev.collate(np.arange(len(ev)))
    hist = _segments(batch.timestamps, batch.item_lengths())
    items = _segments(batch.features[ITEM_FEATURE].values(), batch.item_lengths())
    for b in range(0, len(ev), 97):
        user = int(batch.user_ids[b])
        rows = raw[raw[:, 0] == user]
        rows = rows[np.argsort(rows[:, 3], kind="stable")]  # the converter's order
        n = len(hist[b])
        assert (
            hist[b] == rows[-1 - n : -1, 3].tolist() and items[b] == rows[-1 - n : -1, 1].tolist()
        )
        assert int(batch.target_timestamps[b]) == rows[-1, 3]
        assert int(batch.target_item_ids[b]) == rows[-1, 1]
    _check_retrieval(data, train, np.arange(0, len(train), 13))
    _check_ranking(data, build_ranking_samples(data, 50, 10).eval, np.arange(0, 943, 31))


def test_ml_100k_retrieval_config_runs_on_cpu(tmp_path, shared_data):
    """Prepare the real ML-100K and train the time-aware config a few steps (CPU mode)."""
    from hstu.config.gin_utils import load_config
    from hstu.training.trainer import run_training

    res = prepare_dataset("ml-100k", shared_data("ml-100k"), tmp_path / "ml-100k", progress=False)
    cfg = load_config(
        "retrieval",
        [REPO / "configs" / "ml_100k_retrieval.gin"],
        [
            f"DatasetArgs.dataset_path='{res.output_dir}'",
            f"TrainerArgs.log_dir='{tmp_path / 'runs'}'",
            "TrainerArgs.run_name='ml100k'",
            "TrainerArgs.max_train_iters=3",
            "TrainerArgs.train_batch_size=32",
            "TrainerArgs.eval_batch_size=128",
            "TrainerArgs.max_eval_iters=1",
            "TrainerArgs.eval_interval=0",
            "TrainerArgs.ckpt_save_interval=-1",
            "TrainerArgs.progress_bar=False",
        ],
    )
    result = run_training(cfg)
    assert len(result.losses) == 3 and all(np.isfinite(loss) for _, loss in result.losses)
    assert {"HR@10", "NDCG@10"} <= set(result.final_metrics)


@pytest.mark.cpu_only
def test_launcher_refuses_timestamps_out_of_order(tmp_path):
    """Through the launcher: exit 2, one ``error:`` line naming the file and the fix."""
    from dist_helpers import launcher_env

    d = _write_arrays(tmp_path / "toy", timestamps=np.array([0, 9, 8, 1, 2], dtype=np.int64))
    bindings = [
        'DatasetArgs.dataset_name="toy"',
        f'DatasetArgs.dataset_path="{d}"',
        "DatasetArgs.max_history_seqlen=4",
        "TrainerArgs.train_batch_size=1",
        "TrainerArgs.max_train_iters=1",
        f"TrainerArgs.log_dir='{tmp_path / 'runs'}'",
        "NetworkArgs.hidden_size=8",
        "NetworkArgs.kv_channels=4",
        "RetrievalArgs.num_negatives=2",
    ]
    cmd = [sys.executable, str(REPO / "scripts" / "pretrain_gr_retrieval.py")]
    for b in bindings:
        cmd += ["--gin-bindings", b]
    proc = subprocess.run(
        cmd, cwd=REPO, env=launcher_env(allow_non_a100=True), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {d / DATA_FILE}: timestamps go backwards inside user 0")
    assert errors[0].endswith(
        f"re-create it with: python -m hstu.data.prepare --dataset toy --source /raw --output {d} "
        "--force"
    )
