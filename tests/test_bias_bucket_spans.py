"""scripts/bias_bucket_spans.py: the bucket-span classes of (query row, key tile) pairs against a
brute-force count, and the script's output on a small prepared dataset."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hstu.data.sequences import SequenceData
from hstu.ops.reference import time_bucket_edges

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bias_bucket_spans.py"
spec = importlib.util.spec_from_file_location("bias_bucket_spans", SCRIPT)
spans = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spans)


def _brute_force(ts: list[int], tile: int, edges: torch.Tensor) -> np.ndarray:
    n = len(ts)
    counts = np.zeros(4, dtype=np.int64)
    for i in range(n):
        qt = ts[i + 1] if i + 1 < n else ts[i]
        for start in range(0, i + 1, tile):
            keys = range(start, min(start + tile, i + 1))
            gaps = torch.tensor([qt - ts[j] for j in keys])
            distinct = len(set(spans.time_buckets(gaps, edges).tolist()))
            counts[min(distinct, 4) - 1] += 1
    return counts


def test_equal_timestamps_span_one_bucket_per_pair():
    edges = time_bucket_edges(128)
    counts = spans.bucket_span_counts(torch.zeros(4, dtype=torch.long), 2, edges)
    # rows 0, 1 see the first tile; rows 2, 3 both tiles
    assert counts.tolist() == [6, 0, 0, 0]


@pytest.mark.parametrize("tile", [1, 3, 8])
def test_span_counts_match_a_brute_force_count(tile):
    g = torch.Generator().manual_seed(tile)
    edges = time_bucket_edges(128)
    for _ in range(3):
        gaps = torch.floor(10 ** (torch.rand(23, generator=g) * 5)).long()
        ts = torch.cumsum(gaps, 0)
        ts[5] = ts[4]  # a repeated timestamp (gap 0)
        got = spans.bucket_span_counts(ts, tile, edges)
        assert got.tolist() == _brute_force(ts.tolist(), tile, edges).tolist()
        if tile > 1:
            assert got[1:].sum() > 0  # not all one bucket: the test can tell


def _prepared(directory, has_timestamps=True):
    offsets = np.array([0, 30, 35, 75])
    rng = np.random.default_rng(0)
    n = int(offsets[-1])
    stamps = np.concatenate([np.cumsum(rng.integers(0, 5000, k)) for k in np.diff(offsets)])
    SequenceData(
        name="spans",
        user_ids=np.arange(3),
        offsets=offsets,
        item_ids=rng.integers(0, 50, n),
        actions=np.ones(n, dtype=np.int64),
        timestamps=stamps,
        user_features=np.zeros((3, 0), dtype=np.int64),
        action_names=["interaction"],
        has_timestamps=has_timestamps,
    ).save(directory)
    return str(directory)


def test_the_script_reports_shares_of_a_prepared_dataset(tmp_path, capsys):
    data = _prepared(tmp_path / "d")
    row = spans.main(["--dataset-dir", data, "--min-length", "30", "--tile", "8"])
    assert json.loads(capsys.readouterr().out) == row
    assert row["sequences"] == 2 and row["pairs"] > 0
    shares = [row[k] for k in ("share_1_bucket", "share_2_buckets", "share_3_buckets")]
    assert abs(sum(shares) + row["share_more"] - 1.0) < 1e-12
    with pytest.raises(SystemExit, match="no sequence of 100"):
        spans.main(["--dataset-dir", data, "--min-length", "100"])
    with pytest.raises(SystemExit, match="prepare it with"):
        spans.main(["--dataset-dir", str(tmp_path / "missing")])
    with pytest.raises(SystemExit):  # argparse: --tile must be >= 1
        spans.main(["--dataset-dir", data, "--tile", "0"])


def test_a_dataset_without_real_timestamps_is_refused_unless_synthetic(tmp_path, capsys):
    data = _prepared(tmp_path / "d", has_timestamps=False)
    with pytest.raises(SystemExit, match="has no real timestamps"):
        spans.main(["--dataset-dir", data, "--min-length", "30"])
    row = spans.main(["--dataset-dir", data, "--min-length", "30", "--synthetic"])
    assert row["timestamps"].startswith("synthetic") and row["pairs"] > 0
