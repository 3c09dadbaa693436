"""Sizes that cannot fit fail at config or build time with one line, never in the allocator.

Upper bounds of every size-bearing field (config time), the memory estimate
(`hstu.config.limits.estimate_memory`, checked at model build and before the synthetic generator
runs), the shipped configs passing that check, ids range-checked at prepare time, and the
launchers turning each into an ``error:`` line with exit code 2 and no traceback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import ROOT, launcher_env, prepare_sequences_cli

from hstu.config import ConfigError, load_config
from hstu.config.limits import (
    INT32_MAX,
    INT64_MAX,
    MAX_ITEM_ID,
    SKIP_MEMORY_CHECK_ENV,
    DataSizes,
    MemoryBudgetError,
    MemoryEstimate,
    MemoryTerm,
    check_memory,
    estimate_memory,
    format_bytes,
)
from hstu.data.prepare import prepare_dataset
from hstu.data.registry import load_sequence_data
from hstu.data.sources import DataFormatError
from hstu.data.synthetic import generate_synthetic, synthetic_generation_memory, synthetic_sizes
from hstu.models.builder import build_model

pytestmark = pytest.mark.usefixtures("clean_gin")

GiB = 1024**3
CPU_24GB = {"host": (24 * GiB, "a 24 GB CPU machine")}
GPU_80GB = {"cuda": (80 * GiB, "an 80 GB GPU"), "host": (24 * GiB, "its 24 GB host")}

SMALL = [
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.kv_channels=8",
    "NetworkArgs.num_layers=1",
    "DatasetArgs.synthetic_num_users=60",
    "DatasetArgs.synthetic_num_items=40",
    "DatasetArgs.max_history_seqlen=16",
    "RetrievalArgs.num_negatives=8",
]


# ---- upper bounds at config time -----------------------------------------------------------------


@pytest.mark.parametrize(
    "task, binding, needle",
    [
        ("ranking", "DatasetArgs.max_history_seqlen=2147483648", "DatasetArgs.max_history_seqlen"),
        ("ranking", "DatasetArgs.max_num_candidates=2147483648", "DatasetArgs.max_num_candidates"),
        (
            "ranking",
            "DatasetArgs.max_history_seqlen=2147483000; DatasetArgs.max_num_candidates=1000",
            "DatasetArgs.max_history_seqlen + DatasetArgs.max_num_candidates",
        ),
        (
            "ranking",
            "DatasetArgs.synthetic_num_users=10000000000",
            "DatasetArgs.synthetic_num_users",
        ),
        ("ranking", "DatasetArgs.synthetic_num_items=4611686018427387904", "synthetic_num_items"),
        ("ranking", "NetworkArgs.hidden_size=10000000000", "NetworkArgs.hidden_size"),
        ("ranking", "NetworkArgs.num_layers=10000000000", "NetworkArgs.num_layers"),
        ("ranking", "NetworkArgs.kv_channels=4294967296", "NetworkArgs.kv_channels"),
        (
            "ranking",
            "NetworkArgs.num_attention_heads=65536; NetworkArgs.kv_channels=65536",
            "NetworkArgs.num_attention_heads x NetworkArgs.kv_channels",
        ),
        ("ranking", "NetworkArgs.max_attn_len=100000000000000000000", "NetworkArgs.max_attn_len"),
        ("ranking", "NetworkArgs.num_position_embeddings=2147483648", "num_position_embeddings"),
        ("ranking", "NetworkArgs.scaling_seqlen=2147483648", "NetworkArgs.scaling_seqlen"),
        ("ranking", "NetworkArgs.target_group_size=2147483648", "NetworkArgs.target_group_size"),
        ("ranking", "TrainerArgs.train_batch_size=1000000000000", "TrainerArgs.train_batch_size"),
        ("ranking", "TrainerArgs.eval_batch_size=100000000000000", "TrainerArgs.eval_batch_size"),
        ("ranking", "TrainerArgs.seed=100000000000000000000000", "TrainerArgs.seed"),
        ("ranking", "TrainerArgs.max_train_iters=10000000000000000000", "max_train_iters"),
        ("ranking", "RankingArgs.num_tasks=63", "RankingArgs.num_tasks=63"),
        ("ranking", "RankingArgs.prediction_head_arch=[4294967296]", "prediction_head_arch"),
        ("retrieval", "RetrievalArgs.num_negatives=10000000000", "RetrievalArgs.num_negatives"),
        ("retrieval", "RetrievalArgs.eval_metrics=['HR@100000000000000']", "eval_metrics"),
        ("ranking", "EmbeddingArgs.item_capacity=100000000000000000000", "item_capacity"),
    ],
)
def test_sizes_above_their_bound_are_config_errors(task, binding, needle):
    with pytest.raises(ConfigError) as info:
        load_config(task, None, [binding])
    msg = str(info.value)
    assert needle in msg
    assert "too large: use at most" in msg or "is too large" in msg
    assert "\n" not in msg


def test_bounds_are_inclusive():
    cfg = load_config(
        "ranking",
        None,
        [
            f"DatasetArgs.max_history_seqlen={INT32_MAX - 10}",
            f"TrainerArgs.seed={INT64_MAX}",
            "RankingArgs.num_tasks=62",
            f"NetworkArgs.hidden_size={INT32_MAX}",
        ],
    )
    assert cfg.trainer.seed == INT64_MAX and cfg.network.hidden_size == INT32_MAX


# ---- the estimate ---------------------------------------------------------------------------------


def _cfg(task: str, *bindings: str):
    return load_config(task, None, [*SMALL, *bindings])


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["NetworkArgs.relative_attention_bias='position'"],
        [
            "NetworkArgs.relative_attention_bias='position_time'",
            "NetworkArgs.relative_attention_bias_per_head=True",
            "NetworkArgs.num_time_buckets=40",
        ],
        ["NetworkArgs.relative_attention_bias='time'"],
        ["NetworkArgs.fused_layer=True", "NetworkArgs.num_position_embeddings=77"],
        ["NetworkArgs.final_layernorm=False", "NetworkArgs.use_contextual_features=False"],
        ["RankingArgs.prediction_head_arch=[32, 8]", "NetworkArgs.num_attention_heads=3"],
    ],
)
def test_dense_parameters_and_tables_match_a_built_model(task, extra):
    """The estimate's parameter count is the model's exactly (dense backend: tables counted
    with the dense optimizer's gradients and states)."""
    cfg = _cfg(task, "EmbeddingArgs.embedding_backend='dense'", *extra)
    data = generate_synthetic(60, 40, 0, 8)
    model = build_model(cfg, data)
    tables = sum(p.numel() for n, p in model.named_parameters() if n.startswith("embeddings."))
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embeddings."))
    est = estimate_memory(cfg, DataSizes.of(data), device_type="cpu")["host"]
    terms = {t.what: t.bytes for t in est.terms}
    per_param = 4 * (2 + 2)  # fp32 weights + gradients + Adam's two states
    assert terms["dense parameters"] == dense * per_param
    assert terms["embedding tables"] == tables * per_param


def test_table_bytes_per_backend():
    data = generate_synthetic(60, 40, 0, 8)
    sizes = DataSizes.of(data)
    rows = sum(max(1, c) for c in sizes.contextual_cardinalities) + sizes.item_rows
    tr = estimate_memory(_cfg("ranking", "NetworkArgs.hidden_size=14"), sizes)["host"]
    # torchrec: rows padded to a width multiple of 4, rowwise Adagrad keeps no per-element state
    assert tr.terms[0].bytes == rows * 16 * 4
    sgd_adam = _cfg("ranking", "EmbeddingArgs.sparse_optimizer_str='adam'")
    assert estimate_memory(sgd_adam, sizes)["host"].terms[0].bytes == rows * 16 * 4 * 3
    dyn = _cfg(
        "ranking",
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.item_capacity=1000",
    )
    est = estimate_memory(dyn, sizes)["host"].terms[0].bytes
    # item table: 1000 slots of 20 fp32 columns (16 + 1 state, padded) + 24 B of key/score/touched
    item = 1024 * (20 * 4 + 24)
    user = 128 * (20 * 4 + 24)  # user_id: 2 x 60 rows -> 128 slots
    others = sum(max(1, c) for c in sizes.contextual_cardinalities[1:]) * 16 * 4
    assert est == item + user + others
    # the dynamic table really allocates that much (CPU reference table)
    model = build_model(dyn, data)
    table = model.embeddings.dynamic_collection
    held = sum(
        sum(x.numel() * x.element_size() for x in vars(t.state).values())
        for t in table.tables.values()
    )
    assert held == item + user


def test_estimate_scales_with_sizes_and_ranks():
    sizes = synthetic_sizes(2000, 1000)
    layers = "NetworkArgs.num_layers=4"  # training (4 layers kept) outweighs evaluation
    base = estimate_memory(_cfg("ranking", layers), sizes)["host"]
    acts = {t.what: t.bytes for t in base.terms}["activations"]
    double = estimate_memory(_cfg("ranking", layers, "TrainerArgs.train_batch_size=64"), sizes)[
        "host"
    ]
    assert {t.what: t.bytes for t in double.terms}["activations"] == pytest.approx(2 * acts, 0.01)
    # CUDA with 8 ranks: tables split, dense replicated, the batch split
    cfg = _cfg("ranking", layers, "TrainerArgs.train_batch_size=64")
    one = estimate_memory(cfg, sizes, device_type="cuda", world_size=1)["cuda"]
    eight = estimate_memory(cfg, sizes, device_type="cuda", world_size=8)["cuda"]
    t1, t8 = ({t.what: t.bytes for t in e.terms} for e in (one, eight))
    assert t8["dense parameters"] == t1["dense parameters"]
    assert t8["embedding tables"] == pytest.approx(t1["embedding tables"] / 8, rel=0.01)
    assert t8["activations"] == pytest.approx(t1["activations"] / 8, rel=0.01)
    # the CPU attention materialises [B, H, L, L] scores, the CUDA kernel does not
    assert t1["activations"] < acts


def test_retrieval_negatives_term():
    sizes = synthetic_sizes(2000, 1000)
    # both look the whole corpus up once (1000 items <= negatives x hidden 16)
    few = estimate_memory(_cfg("retrieval", "RetrievalArgs.num_negatives=100"), sizes)["host"]
    many = estimate_memory(_cfg("retrieval", "RetrievalArgs.num_negatives=10000"), sizes)["host"]
    neg = [t for t in many.terms if t.what == "retrieval negatives"][0]
    assert neg.bytes == pytest.approx(100 * [t for t in few.terms if t.what == neg.what][0].bytes)
    assert neg.cause().label == "RetrievalArgs.num_negatives"


def test_check_memory_names_field_estimate_limit_and_fix():
    sizes = synthetic_sizes(2000, 1000)
    cfg = load_config("ranking", None, ["NetworkArgs.hidden_size=10000000"])
    est = estimate_memory(cfg, sizes)
    with pytest.raises(MemoryBudgetError) as info:
        check_memory(est, CPU_24GB)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg
    assert msg.startswith("NetworkArgs.hidden_size=10000000: this run needs an estimated ")
    assert format_bytes(est["host"].total) in msg
    assert "a 24 GB CPU machine is 24 GiB" in msg
    assert "lower NetworkArgs.hidden_size" in msg
    assert SKIP_MEMORY_CHECK_ENV in msg
    check_memory(estimate_memory(load_config("ranking"), sizes), CPU_24GB)  # the default fits


@pytest.mark.parametrize(
    "binding, named",
    [
        ("NetworkArgs.num_layers=100000000", "NetworkArgs.num_layers=100000000"),
        ("NetworkArgs.kv_channels=100000000", "NetworkArgs.kv_channels=100000000"),
        ("NetworkArgs.num_attention_heads=3000000", "NetworkArgs.num_attention_heads=3000000"),
        ("DatasetArgs.max_history_seqlen=1000000000", "DatasetArgs.max_history_seqlen=1000000000"),
        (
            "NetworkArgs.num_position_embeddings=1000000000",
            "NetworkArgs.num_position_embeddings=1000000000",
        ),
        (
            "RankingArgs.prediction_head_arch=[100000000, 100000000]",
            "RankingArgs.prediction_head_arch=(100000000, 100000000)",
        ),
        ("TrainerArgs.train_batch_size=100000000", "TrainerArgs.train_batch_size=100000000"),
        (
            "DatasetArgs.synthetic_num_items=2000000000",
            "DatasetArgs.synthetic_num_items=2000000000",
        ),
    ],
)
def test_the_setting_that_grew_is_named(binding, named):
    cfg = load_config("ranking", None, [binding])
    sizes = synthetic_sizes(cfg.dataset.synthetic_num_users, cfg.dataset.synthetic_num_items)
    with pytest.raises(MemoryBudgetError, match="^" + re.escape(named) + ": this run needs"):
        check_memory(estimate_memory(cfg, sizes), CPU_24GB)


def test_skip_switch(monkeypatch):
    est = {"host": MemoryEstimate("host", (MemoryTerm("x", 10 * GiB, "f"),))}
    with pytest.raises(MemoryBudgetError):
        check_memory(est, {"host": (GiB, "1 GiB")})
    monkeypatch.setenv(SKIP_MEMORY_CHECK_ENV, "1")
    check_memory(est, {"host": (GiB, "1 GiB")})
    check_memory(est, {"host": (0, "unknown")})  # an unknown limit never refuses


# ---- the shipped configs pass --------------------------------------------------------------------

# The sizes the real-data configs imply (published counts; KuaiRand video ids share an id space
# of ~32M: docs/datasets.md). item rows = max item id + 1, longest = the longest user sequence.
_ML_FEATURES = ("user_id", "sex", "age_group", "occupation", "zip_prefix")
_KR_FEATURES = ("user_id", *(f"f{i}" for i in range(8)))
REAL_SIZES = {
    "ml-1m": DataSizes(6040, 1000209, 3953, 3706, (6041, 3, 8, 22, 679), 5, 2314,
                       contextual_names=_ML_FEATURES),
    "ml-100k": DataSizes(943, 100000, 1683, 1682, (944, 3, 8, 22, 383), 5, 737,
                         contextual_names=_ML_FEATURES),
    "ml-20m": DataSizes(138493, 20000263, 131263, 26744, (138494,), 5, 9254,
                        contextual_names=("user_id",)),
    "kuairand-pure": DataSizes(27285, 1436609, 32_000_000, 7583, (27286,) + (16,) * 8, 8, 5000,
                               contextual_names=_KR_FEATURES),
    "kuairand-1k": DataSizes(1000, 11713045, 32_000_000, 4369953, (1001,) + (16,) * 8, 8,
                             100000, contextual_names=_KR_FEATURES),
    "kuairand-27k": DataSizes(27285, 322278385, 32_000_000, 32038725, (27286,) + (16,) * 8, 8,
                              200000, contextual_names=_KR_FEATURES),
    "sequences": DataSizes(6040, 999611, 3417, 3416, (6041,), 1, 2275,
                           contextual_names=("user_id",)),
    "amazon-beauty": DataSizes(22363, 198502, 12102, 12101, (22364,), 1, 204,
                               contextual_names=("user_id",)),
}  # fmt: skip
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.gin"))
# dynamic tables of 2 x 32M rows (hidden 128-256) are 33-64 GiB: truly more than a 24 GB host
TOO_BIG_FOR_A_24GB_CPU = {
    "kuairand_pure_ranking.gin",
    "kuairand_1k_ranking.gin",
    "kuairand_27k_ranking.gin",
    "synthetic_benchmark_ranking.gin",  # 2 x 50M-row dynamic tables, documented for 8 GPUs
}


def _shipped(name: str):
    task = "ranking" if "ranking" in name else "retrieval"
    cfg = load_config(task, [ROOT / "configs" / name])
    ds = cfg.dataset
    if ds.dataset_name == "synthetic":
        sizes = synthetic_sizes(ds.synthetic_num_users, ds.synthetic_num_items)
    else:
        sizes = REAL_SIZES[ds.dataset_name]
    return cfg, sizes


def test_every_shipped_config_is_covered():
    assert len(CONFIGS) >= 15
    for name in CONFIGS:
        _shipped(name)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_fit_a_24gb_cpu_and_an_80gb_gpu(name):
    cfg, sizes = _shipped(name)
    gpus = 8 if name == "synthetic_benchmark_ranking.gin" else 1  # as its header documents
    check_memory(
        estimate_memory(cfg, sizes, device_type="cuda", world_size=gpus, local_world_size=gpus),
        {"cuda": GPU_80GB["cuda"], "host": (24 * GiB * gpus, "host")},
    )
    cpu = estimate_memory(cfg, sizes, device_type="cpu")
    if name in TOO_BIG_FOR_A_24GB_CPU:
        with pytest.raises(MemoryBudgetError, match="embedding tables"):
            check_memory(cpu, CPU_24GB)
    else:
        check_memory(cpu, CPU_24GB)


def test_benchmark_config_on_one_gpu_needs_the_documented_capacities():
    cfg, sizes = _shipped("synthetic_benchmark_ranking.gin")
    with pytest.raises(MemoryBudgetError, match=r"^EmbeddingArgs\.(item|user)_capacity=50000000"):
        check_memory(estimate_memory(cfg, sizes, device_type="cuda"), GPU_80GB)
    smaller = load_config(
        "ranking",
        [ROOT / "configs" / "synthetic_benchmark_ranking.gin"],
        ["EmbeddingArgs.item_capacity=2000000", "EmbeddingArgs.user_capacity=1000000"],
    )
    check_memory(estimate_memory(smaller, sizes, device_type="cuda"), GPU_80GB)


def test_synthetic_sizes_bound_the_generated_data():
    """The plan is a low estimate of what the generator makes: never more interactions."""
    for users, items in ((300, 200), (2000, 1000)):
        data = generate_synthetic(users, items, 0, 8)
        plan = synthetic_sizes(users, items)
        assert plan.num_interactions <= data.num_interactions
        assert plan.item_rows >= data.item_vocab_size
        assert plan.longest_sequence >= int(data.lengths().max())
        assert tuple(plan.contextual_cardinalities) >= tuple(data.user_feature_cardinalities)


# ---- checks where the sizes are first known ------------------------------------------------------


def test_synthetic_generation_is_refused_before_allocating(monkeypatch):
    cfg = load_config("ranking", None, ["DatasetArgs.synthetic_num_users=1000000000"])
    monkeypatch.setattr(
        "hstu.data.registry.generate_synthetic", lambda **k: pytest.fail("generator ran")
    )
    with pytest.raises(MemoryBudgetError) as info:
        load_sequence_data(cfg.dataset, num_tasks=8)
    msg = str(info.value)
    assert msg.startswith("DatasetArgs.synthetic_num_users=1000000000: generating the synthetic")
    assert "lower DatasetArgs.synthetic_num_users" in msg
    plan = synthetic_generation_memory(10**9, 1000)
    assert format_bytes(plan.total) in msg


def test_build_model_refuses_before_allocating(monkeypatch):
    cfg = load_config("ranking", None, [*SMALL, "NetworkArgs.hidden_size=200000000"])
    data = generate_synthetic(60, 40, 0, 8)

    def no_alloc(*a, **k):
        pytest.fail("a table was built")

    monkeypatch.setattr("hstu.models.builder.EmbeddingStack", no_alloc)
    with pytest.raises(MemoryBudgetError, match=r"^NetworkArgs\.hidden_size=200000000: this "):
        build_model(cfg, data)


def test_real_item_ids_near_the_bound_are_blamed_on_the_table(tmp_path):
    """A prepared dataset with huge (but in-range) item ids: its static item table cannot fit;
    the message says so and points at dynamic tables."""
    data = generate_synthetic(60, 40, 0, 8)
    data = dataclasses.replace(data, item_ids=data.item_ids + (MAX_ITEM_ID - 100))
    cfg = load_config("ranking", None, SMALL)
    est = estimate_memory(cfg, dataclasses.replace(DataSizes.of(data), source="dataset 'big'"))
    with pytest.raises(MemoryBudgetError) as info:
        check_memory(est, CPU_24GB)
    msg = str(info.value)
    assert re.match(r"the item table of dataset 'big' \(max item id \+ 1 rows\)=\d{10}: ", msg)
    assert "EmbeddingArgs.embedding_backend='dynamic'" in msg


# ---- ids at prepare time -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, needle",
    [
        ("1 4611686018427387904", "item id above 2147483647"),
        ("1 2147483648", "item id above 2147483647"),
        ("9223372036854775808 5", "out of the int64 range"),
        ("1 18446744073709551616", "out of the int64 range"),
    ],
)
def test_prepare_range_checks_ids(tmp_path, line, needle):
    src = tmp_path / "seq.txt"
    src.write_text(f"1 3\n{line}\n2 4\n2 5\n")
    with pytest.raises(DataFormatError) as info:
        prepare_dataset("sequences", src, tmp_path / "out", progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{src}: 1 bad line(s): ") and needle in msg and "line 2:" in msg
    assert not (tmp_path / "out").exists()


def test_prepare_accepts_the_largest_item_id_and_raw_user_ids_up_to_int64(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text(f"{INT64_MAX} {MAX_ITEM_ID}\n{INT64_MAX} 3\n5 4\n5 6\n")
    res = prepare_dataset("sequences", src, tmp_path / "out", progress=False)
    assert res.manifest["item_id_range"] == [3, MAX_ITEM_ID]
    assert res.manifest["user_id_range"] == [5, INT64_MAX]


@pytest.mark.parametrize("value", ["2147483648", "9223372036854775808", "18446744073709551615"])
def test_prepare_movielens_ids_name_the_line(tmp_path, value):
    src = tmp_path / "ml-1m"
    src.mkdir()
    fixtures = Path(__file__).resolve().parent / "fixtures" / "ml-1m"
    for f in fixtures.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    lines = (src / "ratings.dat").read_text().splitlines()
    lines[2] = f"1::{value}::4::978302109"
    (src / "ratings.dat").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=r"ratings\.dat: 1 bad row\(s\): column 'MovieID' .*"
                       r"line 3: '1::" + value):  # fmt: skip
        prepare_dataset("ml-1m", src, tmp_path / "out", progress=False)


def test_load_refuses_item_ids_beyond_the_bound(tmp_path):
    """A prepared dataset written without the id check (by hand or an older converter)."""
    data = generate_synthetic(60, 40, 0, 8)
    big = dataclasses.replace(data, item_ids=data.item_ids + MAX_ITEM_ID)
    big.save(tmp_path / "big")
    cfg = load_config(
        "ranking",
        None,
        ['DatasetArgs.dataset_name="big"', f'DatasetArgs.dataset_path="{tmp_path / "big"}"'],
    )
    with pytest.raises(ValueError, match=r"sequences\.npz: item_ids holds \d+ at index \d+, abov"):
        load_sequence_data(cfg.dataset, num_tasks=8)


# ---- through the launchers and the prepare CLI -----------------------------------------------------


def _launch(task: str, tmp_path: Path, *bindings: str, timeout: int = 240):
    args = [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'", *bindings]
    cmd = [sys.executable, str(ROOT / "scripts" / f"pretrain_gr_{task}.py")]
    for b in args:
        cmd += ["--gin-bindings", b]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=launcher_env(allow_non_a100=True),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _assert_one_error_line(proc, *needles: str) -> str:
    """Exit code 2, no traceback, exactly one ``error:`` line holding every needle."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(("error:", "config error:"))]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.cpu_only
def test_launcher_bound_violation_is_one_line(tmp_path):
    proc = _launch("ranking", tmp_path, "DatasetArgs.max_history_seqlen=10000000000")
    _assert_one_error_line(proc, "DatasetArgs.max_history_seqlen=10000000000 is too large")
    assert not (tmp_path / "run").exists()


@pytest.mark.cpu_only
def test_launcher_memory_refusal_is_one_line(tmp_path):
    proc = _launch("ranking", tmp_path, *SMALL, "NetworkArgs.hidden_size=100000000")
    line = _assert_one_error_line(
        proc, "NetworkArgs.hidden_size=100000000: this ranking run needs an estimated"
    )
    assert "host memory" in line and "lower NetworkArgs.hidden_size" in line
    assert "DefaultCPUAllocator" not in proc.stderr


@pytest.mark.cpu_only
def test_launcher_synthetic_and_negatives_refusals(tmp_path):
    proc = _launch("retrieval", tmp_path, *SMALL, "RetrievalArgs.num_negatives=1000000000")
    _assert_one_error_line(proc, "RetrievalArgs.num_negatives=1000000000: this retrieval run")
    proc = _launch("ranking", tmp_path, "DatasetArgs.synthetic_num_users=2000000000")
    _assert_one_error_line(proc, "DatasetArgs.synthetic_num_users=2000000000: generating")


def test_prepare_cli_id_error_is_one_line(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 3\n1 9223372036854775808\n")
    proc, errors = prepare_sequences_cli(src, tmp_path / "out")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(errors) == 1 and str(src) in errors[0] and "int64 range" in errors[0]


def test_available_memory():
    """The host limit is MemAvailable (or the physical memory); without CUDA the GPU limit is
    unknown (0: the check passes)."""
    from hstu.config.limits import available_memory

    host, desc = available_memory("host")
    assert 0 < host <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert "host memory" in desc
    if not torch.cuda.is_available():
        assert available_memory("cuda")[0] == 0


# ---- hybrid dynamic tables (rows in host memory, an HBM cache) -----------------------------------

_ROWS_120M = [
    "EmbeddingArgs.embedding_backend='dynamic'",
    "EmbeddingArgs.item_capacity=120000000",
    "NetworkArgs.hidden_size=128",
    "NetworkArgs.kv_channels=64",
]
GPU_80GB_128GB_HOST = {"cuda": (80 * GiB, "an 80 GB GPU"), "host": (120 * GiB, "its host")}


def test_hybrid_tables_count_the_cache_in_hbm_and_the_rows_in_host_memory():
    from hstu.config.limits import table_memory

    sizes = synthetic_sizes(60, 40)
    kw = dict(sparse_optimizer="rowwise_adagrad", dense_states=2, world_size=1)
    hbm = table_memory("dynamic", 120_000_000, 128, **kw)
    hybrid = table_memory("dynamic", 120_000_000, 128, storage="hybrid", hbm_cache=8 * GiB, **kw)
    # rows of 128 + 1 state columns -> 132 floats (528 B); 120M slots
    assert (hbm.device, hbm.host) == (120_000_000 * (528 + 24), 0)
    assert hybrid.cache_rows == 8 * GiB // (528 + 24) // 32 * 32
    assert hybrid.device == 120_000_000 * 28 + hybrid.cache_rows * (528 + 24) + 36
    assert hybrid.host == 120_000_000 * 528
    est = estimate_memory(
        _cfg("ranking", *_ROWS_120M, "EmbeddingArgs.storage='hybrid'",
             f"EmbeddingArgs.hbm_cache={8 * GiB}"),
        sizes,
        device_type="cuda",
    )  # fmt: skip
    cuda = {t.what: t.bytes for t in est["cuda"].terms}
    host = {t.what: t.bytes for t in est["host"].terms}
    assert hybrid.device <= cuda["embedding tables"] < hybrid.device + GiB
    assert host["hybrid table rows"] >= hybrid.host
    check_memory(est, GPU_80GB_128GB_HOST)  # 12 GB of HBM, 63 GB of host memory: fits
    # the same table all in HBM does not fit on a 48 GB GPU ...
    all_hbm = estimate_memory(_cfg("ranking", *_ROWS_120M), sizes, device_type="cuda")
    with pytest.raises(MemoryBudgetError) as info:
        check_memory(all_hbm, {"cuda": (48 * GiB, "a 48 GB GPU"), "host": (120 * GiB, "host")})
    msg = str(info.value)
    assert msg.startswith("EmbeddingArgs.item_capacity=120000000: ")
    assert "dynamic table 'item_table' (120,000,000 rows x 128, hbm)" in msg
    assert "61.7 GiB of it per process" in msg and "a 48 GB GPU is 48 GiB" in msg
    assert "fewer rows (lower EmbeddingArgs.item_capacity)" in msg
    assert "more GPUs (at least 2 of this size)" in msg
    assert "EmbeddingArgs.storage='hybrid' (its rows, 59 GiB, fit in host memory" in msg
    # ... and in CPU development mode the cache is host memory too
    cpu = estimate_memory(
        _cfg("ranking", "EmbeddingArgs.embedding_backend='dynamic'",
             "EmbeddingArgs.item_capacity=100000", "EmbeddingArgs.storage='hybrid'"),
        sizes,
    )["host"]  # fmt: skip
    mem = table_memory("dynamic", 100_000, 16, storage="hybrid", **kw)
    assert {t.name: t.bytes for t in cpu.tables}["item_table"] == mem.device + mem.host


def test_table_larger_than_the_host_needs_several_hosts():
    sizes = synthetic_sizes(60, 40)
    huge = ["EmbeddingArgs.embedding_backend='dynamic'", "EmbeddingArgs.item_capacity=1500000000",
            "NetworkArgs.hidden_size=128", "NetworkArgs.kv_channels=64",
            f"EmbeddingArgs.hbm_cache={8 * GiB}"]  # fmt: skip
    with pytest.raises(MemoryBudgetError) as info:  # all in HBM: hybrid would not fit either
        check_memory(
            estimate_memory(_cfg("ranking", *huge), sizes, device_type="cuda"), GPU_80GB_128GB_HOST
        )
    msg = str(info.value)
    assert "EmbeddingArgs.storage='hybrid' does not help" in msg
    assert "needs several hosts' memory" in msg
    hybrid = _cfg("ranking", *huge, "EmbeddingArgs.storage='hybrid'")
    with pytest.raises(MemoryBudgetError) as info:  # hybrid: the rows overflow the host
        check_memory(estimate_memory(hybrid, sizes, device_type="cuda"), GPU_80GB_128GB_HOST)
    msg = str(info.value)
    assert msg.startswith("EmbeddingArgs.item_capacity=1500000000: ")
    assert "of host memory" in msg and "hybrid table rows" in msg
    assert "needs several hosts' memory" in msg and "its host is 120 GiB" in msg


def _impossible_table_cfg(storage: str):
    """A ranking config with a 10^12-row dynamic item table (no machine holds it)."""
    return _cfg(
        "ranking",
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.item_capacity=1000000000000",
        f"EmbeddingArgs.storage='{storage}'",
    )


@pytest.mark.parametrize("storage", ["hbm", "hybrid"])
def test_impossible_table_is_refused_fast_before_allocating(monkeypatch, storage):
    """A table no machine here can hold: build_model refuses it (CPU: the same code path the
    GPU takes with its own limits) within seconds, before any table exists."""
    import time

    cfg = _impossible_table_cfg(storage)
    data = generate_synthetic(60, 40, 0, 8)
    monkeypatch.setattr(
        "hstu.models.builder.EmbeddingStack", lambda *a, **k: pytest.fail("a table was built")
    )
    t0 = time.perf_counter()
    with pytest.raises(MemoryBudgetError) as info:
        build_model(cfg, data)
    assert time.perf_counter() - t0 < 10
    msg = str(info.value)
    assert msg.startswith("EmbeddingArgs.item_capacity=1000000000000: this ranking run needs")
    assert "item_table" in msg and "of host memory" in msg and "fewer rows" in msg
    # the table itself refuses too, right before it would allocate (any way it is built)
    from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
    from hstu.embeddings.dynamic_table import make_dynamic_table

    t0 = time.perf_counter()
    with pytest.raises(MemoryBudgetError, match=r"dynamic table 'big' \(rank 0 of 1: "):
        make_dynamic_table(DynamicEmbeddingConfig("big", 128, 10**12, storage=storage))
    assert time.perf_counter() - t0 < 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("storage", ["hbm", "hybrid"])
def test_impossible_table_is_refused_fast_on_the_gpu(storage):
    """On a GPU, with the device's real free memory and the host's: a table that fits neither is
    refused by build_model within seconds, before anything is allocated on the device."""
    import time

    cfg = _impossible_table_cfg(storage)
    data = generate_synthetic(60, 40, 0, 8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with pytest.raises(MemoryBudgetError) as info:
        build_model(cfg, data, device_type="cuda")
    assert time.perf_counter() - t0 < 10
    assert torch.cuda.memory_allocated() == before
    msg = str(info.value)
    assert msg.startswith("EmbeddingArgs.item_capacity=1000000000000: this ranking run needs")
    assert "item_table" in msg and "fewer rows" in msg


def test_table_allocation_check_names_the_fixes():
    from hstu.config.limits import check_table_allocation

    gpu = {"cuda": (40 * GiB, "free GPU memory"), "host": (100 * GiB, "host memory")}
    with pytest.raises(MemoryBudgetError) as info:
        check_table_allocation("table 't'", "cuda", 60 * GiB, hybrid_host_bytes=55 * GiB,
                               available=gpu)  # fmt: skip
    assert "EmbeddingArgs.storage='hybrid' (its rows, 55 GiB, fit in host memory" in str(info.value)
    with pytest.raises(MemoryBudgetError, match="lower EmbeddingArgs.hbm_cache"):
        check_table_allocation("table 't'", "cuda", 50 * GiB, 10 * GiB, storage="hybrid",
                               available=gpu)  # fmt: skip
    with pytest.raises(MemoryBudgetError, match="needs several hosts' memory"):
        check_table_allocation("table 't'", "cuda", GiB, 200 * GiB, storage="hybrid",
                               available=gpu)  # fmt: skip
    check_table_allocation("table 't'", "cuda", GiB, 50 * GiB, storage="hybrid", available=gpu)
