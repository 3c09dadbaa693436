"""scripts/bench_layer.py on CPU: the SiLU-step rows (aten path timed, kernel row reporting the
missing build) and the layer row with the SiLU kernels switched off, as JSON lines."""

from __future__ import annotations

import json


def test_bench_layer_silu_rows_cpu(tmp_path, capsys, load_script):
    out = tmp_path / "rows.jsonl"
    args = ["--device", "cpu", "--batch", "2", "--max-len", "16", "--hidden", "32", "--heads",
            "2", "--head-dim", "16", "--iters", "2", "--warmup", "1", "--out", str(out),
            "--variants", "silu_op_aten,silu_op_cuda,cast_op_aten,fused_aten_elementwise"]  # fmt: skip
    assert load_script("bench_layer").main(args) == 0
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert capsys.readouterr().out.count("\n") == 4
    aten = rows["silu_op_aten"]
    assert aten["ms_fwd"] > 0 and aten["ms_bwd"] > 0 and aten["gbps_fwd"] > 0
    assert aten["ms_fwd_bwd"] > 0 and aten["tflops"] is None and aten["tokens"] >= 16
    assert rows["cast_op_aten"]["gbps"] > 0 and rows["cast_op_aten"]["dtype"] == "float32"
    assert "not built" in rows["silu_op_cuda"]["error"]  # no CUDA extension on CPU
    layer = rows["fused_aten_elementwise"]
    assert layer["ms_fwd_bwd"] > 0 and layer["tflops"] > 0
    assert layer["kernel_choices"]["elementwise_kernels"] == "off"  # this layer's switch only
