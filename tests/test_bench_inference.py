"""scripts/bench_inference.py ranking on CPU: the three timings of one request shape and the
cached logits equal to the full recomputation (float32 reference ops)."""

from __future__ import annotations

import json

TINY = [
    "DatasetArgs.synthetic_num_users=64",
    "DatasetArgs.synthetic_num_items=500",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "RankingArgs.prediction_head_arch=(16,)",
]


def test_bench_inference_ranking_on_cpu(load_script, tmp_path):
    bench = load_script("bench_inference")
    out = tmp_path / "rows.jsonl"
    argv = ["ranking", "--device", "cpu", "--batches", "1,3", "--history", "40"]
    argv += ["--candidates", "5", "--iters", "2", "--warmup", "1", "--out", str(out)]
    assert bench.main([*argv, "--bindings", *TINY]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["history"] == 40 and r["candidates"] == 5 and r["device"] == "cpu"
        assert r["full"]["p50_ms"] > 0 and r["cached_eager"]["p50_ms"] > 0
        assert r["speedup_cached_eager"] > 0
        assert r["max_abs_diff_eager"] <= 1e-5 * max(1.0, r["max_abs_logit"])
        assert "cached_graph" not in r  # CUDA only


def test_bench_inference_retrieval_on_cpu(load_script, tmp_path):
    from pathlib import Path

    bench = load_script("bench_inference")
    out = tmp_path / "rows.jsonl"
    config = str(Path(__file__).resolve().parents[1] / "configs" / "synthetic_retrieval.gin")
    argv = ["retrieval", "--device", "cpu", "--config", config, "--batch-size", "64"]
    argv += ["--iters", "3", "--top-k", "20", "--out", str(out), "--bindings", *TINY[:2]]
    argv += ["DatasetArgs.max_history_seqlen=16", *TINY[2:]]
    assert bench.main(argv) == 0
    row = json.loads(out.read_text().strip().splitlines()[-1])
    assert row["users"] == 64 and row["corpus"] > 0 and row["top_k"] == 20
    assert row["users_per_s"] > 0 and row["pass_ms"]["p50_ms"] > 0
