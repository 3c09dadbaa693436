"""Multi-process behaviour on CPU (gloo): checkpoints saved on N processes resume on M.

The GPU counterpart (1 vs 2 GPUs, NCCL) is scripts/check_multi_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import torchrun_losses

from hstu.embeddings.sharding import merge_collection_dumps
from hstu.training.checkpoint import Checkpointer
from hstu.training.reshard import SHARDS_KEY

ROOT = Path(__file__).resolve().parents[1]

# Small enough for 2 cores; dropout off and a fixed attention scaling so that the loss of a global
# batch does not depend on how it is split over ranks (the default scaling uses the local batch's
# max length).
TINY = [
    "DatasetArgs.synthetic_num_users=300",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=24",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=8",
    "NetworkArgs.hidden_dropout=0.0",
    "NetworkArgs.scaling_seqlen=64",
    "RankingArgs.prediction_head_arch=(16,)",
    "TrainerArgs.progress_bar=False",
    "TrainerArgs.train_batch_size=24",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.eval_batch_size=24",
    "TrainerArgs.log_interval=100",
    "EmbeddingArgs.sparse_learning_rate=0.05",
]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU multi-process test")


def _torchrun(nproc: int, bindings: list[str], out: Path) -> list[float]:
    return torchrun_losses(nproc, bindings, out, timeout=300)


def _global(entry) -> torch.Tensor:
    """Assemble a saved record (or take a plain tensor) as one global tensor."""
    if not (isinstance(entry, dict) and SHARDS_KEY in entry):
        return entry
    return _assemble([entry])


def _assemble(records: list[dict]) -> torch.Tensor:
    shape = records[0]["global_shape"]
    full = torch.full(shape, float("nan"), dtype=records[0]["pieces"][0]["tensor"].dtype)
    for rec in records:
        assert rec["global_shape"] == shape
        for p in rec["pieces"]:
            sl = tuple(slice(o, o + n) for o, n in zip(p["offsets"], p["tensor"].shape))
            full[sl] = p["tensor"]
    assert not torch.isnan(full).any(), "pieces leave holes"
    return full


def _sharded_entries(states: list[dict], section: str) -> dict[str, torch.Tensor]:
    """{path: global tensor} of every sharded record in ``section`` over all rank files."""
    out: dict[str, list] = {}

    def walk(obj, path):
        if isinstance(obj, dict) and SHARDS_KEY in obj:
            out.setdefault(path, []).append(obj)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")

    for s in states:
        walk(s[section], section)
    return {k: _assemble(v) for k, v in out.items()}


def _check_restored(ckpt: Path, loaded_dir: Path, nproc: int, dynamic: bool) -> None:
    saved = Checkpointer.load_all_ranks(ckpt)
    loaded = [torch.load(loaded_dir / f"loaded_rank_{r}.pt") for r in range(nproc)]
    for section in ("model", "fused_optimizer"):
        want, got = _sharded_entries(saved, section), _sharded_entries(loaded, section)
        assert set(want) == set(got) and want, (section, sorted(want), sorted(got))
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    for r in range(nproc):  # replicated parts come from rank 0 on every rank
        for k, v in saved[0]["model"].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(loaded[r]["model"][k], v, rtol=0, atol=0)
        assert loaded[r]["train_iter"] == saved[0]["train_iter"]
        assert loaded[r]["step"] == saved[0]["step"]
    if dynamic:
        want = merge_collection_dumps([s["dynamic_embeddings"] for s in saved])
        got = merge_collection_dumps([s["dynamic_embeddings"] for s in loaded])
        for k in ("keys", "values", "optimizer_state"):
            for table in {n.split("/")[0] for n in want}:
                torch.testing.assert_close(got[f"{table}/{k}"], want[f"{table}/{k}"])
        # each rank keeps exactly the ids it owns
        from hstu.embeddings.reference_table import owner_of

        for r, s in enumerate(loaded):
            for name, keys in s["dynamic_embeddings"].items():
                if name.endswith("/keys") and keys.numel():
                    assert bool((owner_of(keys, nproc) == r).all()), name


@pytest.mark.parametrize(
    ("backend", "resume_on"),
    [("torchrec", (1, 3)), ("dynamic", (3,))],
)
def test_checkpoint_saved_on_two_resumes_on_other_counts(tmp_path, backend, resume_on):
    common = TINY + [f"EmbeddingArgs.embedding_backend='{backend}'", "TrainerArgs.run_name='r'"]
    if backend == "dynamic":
        # roomy tables: no bucket overflows (evictions would depend on the per-rank capacity)
        common += ["EmbeddingArgs.item_capacity=8192", "EmbeddingArgs.user_capacity=8192"]
    ckpt_root = tmp_path / "ckpt"
    # uninterrupted 2-process run to step 10 that also checkpoints at step 5
    full = _torchrun(
        2,
        common
        + [
            f"TrainerArgs.log_dir='{tmp_path / 'full'}'",
            "TrainerArgs.max_train_iters=10",
            "TrainerArgs.ckpt_save_interval=5",
            f"TrainerArgs.ckpt_save_dir='{ckpt_root}'",
        ],
        tmp_path / "full",
    )
    ckpt = ckpt_root / "step_00000005"
    assert Checkpointer.read_meta(ckpt)["world_size"] == 2
    for nproc in resume_on:
        out = tmp_path / f"resume{nproc}"
        resumed = _torchrun(
            nproc,
            common
            + [
                f"TrainerArgs.log_dir='{out}'",
                "TrainerArgs.max_train_iters=10",
                "TrainerArgs.ckpt_save_interval=-1",
                f"TrainerArgs.ckpt_load_dir='{ckpt}'",
            ],
            out,
        )
        _check_restored(ckpt, out, nproc, dynamic=backend == "dynamic")
        assert len(resumed) == 5
        np.testing.assert_allclose(resumed, full[5:], rtol=1e-5, atol=1e-6)


def test_ids_routed_ahead_give_the_losses_of_routing_in_the_step(tmp_path):
    """Two gloo processes, dynamic tables: exchanging the ids of batch i+1 on the router thread
    during step i (the default) trains exactly like exchanging them inside the forward."""
    common = TINY + [
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.item_capacity=8192",
        "EmbeddingArgs.user_capacity=8192",
        "TrainerArgs.max_train_iters=8",
        "TrainerArgs.ckpt_save_interval=-1",
        "TrainerArgs.run_name='r'",
    ]
    runs = {}
    for ahead in (True, False):
        out = tmp_path / f"ahead_{ahead}"
        runs[ahead] = _torchrun(
            2,
            common + [f"TrainerArgs.log_dir='{out}'", f"TrainerArgs.route_ids_ahead={ahead}"],
            out,
        )
        info = json.loads((out / "info.json").read_text())
        assert info["input_dist_ahead"] is ahead
    assert len(runs[True]) == 8
    np.testing.assert_array_equal(runs[True], runs[False])


def test_flat_gradients_train_as_ddp_does(tmp_path):
    """Two gloo processes, plain tables: averaging the dense gradients with `FlatGradients`
    (what graphed steps on several GPUs do inside their graphs) trains exactly as DDP does, and
    as one process with the whole batch."""
    common = TINY + [
        "EmbeddingArgs.embedding_backend='dense'",
        "NetworkArgs.use_contextual_features=False",
        "TrainerArgs.max_train_iters=8",
        "TrainerArgs.ckpt_save_interval=-1",
        "TrainerArgs.run_name='r'",
    ]
    runs = {}
    cases = (
        ("ddp", 2, ""),
        ("flat", 2, "flat_gradients"),
        # the ranks alternate between the graphed steps' code path and the eager one (their
        # collectives must match, or the run hangs)
        ("mixed", 2, "flat_gradients_mixed"),
        ("one", 1, ""),
    )
    for name, nproc, mode in cases:
        out = tmp_path / name
        runs[name] = torchrun_losses(
            nproc, common + [f"TrainerArgs.log_dir='{out}'"], out, timeout=180, flat_gradients=mode
        )
        info = json.loads((out / "info.json").read_text())
        want = (nproc > 1 and bool(mode), name == "ddp")
        assert (info["flat_gradients"], info["ddp"]) == want, (name, info)
        if name == "mixed":
            assert info["graph_replays"] == 4  # rank 0's even steps
    assert len(runs["flat"]) == 8
    np.testing.assert_allclose(runs["flat"], runs["ddp"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(runs["mixed"], runs["ddp"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(runs["flat"], runs["one"], rtol=1e-4, atol=1e-6)


def test_steps_split_at_sharded_tables_train_as_ddp_does(tmp_path):
    """Two gloo processes, dynamic tables sharded over them and torchrec contextual tables: the
    steps that graphed runs on several GPUs take (the tables looked up before the step and
    updated after it, the dense gradients averaged by `FlatGradients` inside it), alternating
    between the graphed steps' code path and the trainer's eager one, train as DDP's steps do."""
    common = TINY + [
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.contextual_tables='torchrec'",
        "TrainerArgs.max_train_iters=8",
        "TrainerArgs.ckpt_save_interval=-1",
        "TrainerArgs.run_name='r'",
    ]
    runs = {}
    for name, mode in (("ddp", ""), ("mixed", "flat_gradients_mixed")):
        out = tmp_path / name
        runs[name] = torchrun_losses(
            2, common + [f"TrainerArgs.log_dir='{out}'"], out, timeout=180, flat_gradients=mode
        )
        info = json.loads((out / "info.json").read_text())
        assert (info["flat_gradients"], info["ddp"]) == (name == "mixed", name == "ddp"), info
        if name == "mixed":
            assert info["graph_replays"] == 4  # rank 0's even steps
            # the ids went to their owners a step ahead, as in a DDP run
            assert info["input_dist_ahead"] is True
    assert len(runs["mixed"]) == 8
    np.testing.assert_allclose(runs["mixed"], runs["ddp"], rtol=1e-6, atol=1e-7)


# ---- scripts/check_multi_gpu.py -------------------------------------------------------------

CHECK = ROOT / "scripts" / "check_multi_gpu.py"
CHECK_TINY = [
    "DatasetArgs.synthetic_num_users=300",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=24",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.kv_channels=8",
    "RankingArgs.prediction_head_arch=(16,)",
    "TrainerArgs.eval_batch_size=24",
]


def _load_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_multi_gpu", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_check_script_compares_curves():
    mod = _load_check_module()
    a = [(1, 2.0), (2, 1.0), (3, 0.5)]
    b = [(1, 2.0), (2, 1.1), (3, 0.5025)]
    d = mod.relative_differences(a, b)
    assert d["max_rel_diff"] == pytest.approx(0.1) and d["max_rel_diff_step"] == 2
    assert d["rel_diff_final"] == pytest.approx(0.005) and d["steps_compared"] == 3
    with pytest.raises(ValueError, match="share no step"):
        mod.relative_differences(a, [(9, 1.0)])


def _check_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    """scripts/check_multi_gpu.py with ``args`` and the environment updated by ``env``, for
    its argument checks (they fail before any launch)."""
    return subprocess.run(
        [sys.executable, str(CHECK), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_check_script_refuses_missing_gpus():
    proc = _check_script("--device", "cuda", "--nproc", "2", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode != 0
    assert "--nproc 2 needs 2 GPUs but 0 are visible" in proc.stderr


def _run_check(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """scripts/check_multi_gpu.py on two gloo processes with the tiny model and ``args``."""
    return subprocess.run(
        [sys.executable, str(CHECK), "--device", "cpu", "--nproc", "2", "--batch-size", "24",
         "--allow-non-a100", *args, "--bindings", *CHECK_TINY],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if not k.startswith("HSTU_")},
    )  # fmt: skip


def test_check_script_refuses_a_run_timeout_that_is_not_positive():
    proc = _check_script("--device", "cpu", "--run-timeout", "0")
    assert proc.returncode == 2 and "--run-timeout must be > 0 seconds (got 0)" in proc.stderr


def test_check_script_on_two_gloo_processes(tmp_path):
    out = tmp_path / "check.jsonl"
    proc = _run_check("--steps", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["pass"] is True and row["precision"] == "fp32" and row["steps_compared"] == 8
    assert row["max_rel_diff"] < 1e-5 and row["resume"]["steps_compared"] == 4
    assert row["resume"]["saved_by"] == 2 and row["resume"]["max_rel_diff"] < 1e-5
    assert row["loss_final_1"] == pytest.approx(row["loss_final_2"], rel=1e-5)


def test_bench_e2e_refuses_more_processes_than_gpus():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--nproc", "1,2,4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode != 0
    assert "--nproc 1,2,4 needs 4 GPUs but 0 are visible" in proc.stderr
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--nproc", "2,2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "distinct positive GPU counts" in bad.stderr


def test_checkpoint_of_flat_gradient_ranks_resumes_under_ddp_and_back(tmp_path):
    """A checkpoint saved by two processes that average with `FlatGradients` (no DDP wrapper)
    resumes under DDP on two and on one process with the uninterrupted run's losses, and one
    saved under DDP resumes with `FlatGradients`: the wrapping leaves no trace in a checkpoint."""
    common = TINY + [
        "EmbeddingArgs.embedding_backend='dense'",
        "NetworkArgs.use_contextual_features=False",
        "TrainerArgs.run_name='r'",
        "TrainerArgs.max_train_iters=10",
    ]
    full = {}
    for mode in ("flat_gradients", ""):
        name = mode or "ddp"
        full[name] = torchrun_losses(
            2,
            common
            + [
                f"TrainerArgs.log_dir='{tmp_path / name}'",
                "TrainerArgs.ckpt_save_interval=5",
                f"TrainerArgs.ckpt_save_dir='{tmp_path / name / 'ckpt'}'",
            ],
            tmp_path / name,
            timeout=180,
            flat_gradients=mode,
        )
    np.testing.assert_allclose(full["flat_gradients"], full["ddp"], rtol=1e-6, atol=1e-7)
    cases = (("flat_gradients", 2, ""), ("flat_gradients", 1, ""), ("ddp", 2, "flat_gradients"))
    for saved_by, nproc, mode in cases:
        out = tmp_path / f"resume_{saved_by}_{nproc}_{mode}"
        ckpt = tmp_path / saved_by / "ckpt" / "step_00000005"
        resumed = torchrun_losses(
            nproc,
            common
            + [
                f"TrainerArgs.log_dir='{out}'",
                "TrainerArgs.ckpt_save_interval=-1",
                f"TrainerArgs.ckpt_load_dir='{ckpt}'",
            ],
            out,
            timeout=180,
            flat_gradients=mode,
        )
        assert len(resumed) == 5
        np.testing.assert_allclose(resumed, full[saved_by][5:], rtol=1e-5, atol=1e-6)


def test_flat_gradients_views_broadcast_and_refusal(tmp_path):
    """`FlatGradients` on one gloo process: every gradient a view of one buffer per dtype (the
    backward accumulates into them), averaging divides by the world size, and a gradient set to
    None is refused with the fix instead of being left out of the average."""
    import torch.distributed as dist

    from hstu.training.distributed import FlatGradients

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        a = torch.nn.Parameter(torch.ones(2, 3))
        b = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
        c = torch.nn.Parameter(torch.ones(5))
        flat = FlatGradients([a, b, c], world_size=1)
        assert len(flat.buffers) == 2 and flat.views_intact()
        (a.sum() * 2 + b.sum() * 3 + c.sum()).backward()
        assert torch.equal(flat.buffers[0], torch.tensor([2.0] * 6 + [1.0] * 5))
        flat.world_size = 2  # as if a second rank had sent zeros: the average halves
        flat.all_reduce()
        assert torch.equal(a.grad, torch.ones(2, 3)) and torch.equal(b.grad, torch.full((4,), 1.5))
        a.grad = None
        with pytest.raises(RuntimeError, match="set_to_none=False"):
            flat.all_reduce()
    finally:
        dist.destroy_process_group()


def test_a_worker_still_running_near_the_timeout_reports_its_stacks(tmp_path):
    """A multi-process test whose ranks hang fails with where each rank waits: the worker writes
    every thread's stack shortly before the launch's timeout and exits (here after 8 s of a run
    far longer than that)."""
    bindings = TINY + ["TrainerArgs.max_train_iters=1000000", f"TrainerArgs.log_dir='{tmp_path}'"]
    with pytest.raises(AssertionError) as failure:
        torchrun_losses(1, bindings, tmp_path, timeout=120, DIST_WORKER_DUMP_AFTER_S="8")
    message = str(failure.value)
    assert "stacks_rank0.txt (the worker was still running)" in message, message[-2000:]
    # the main thread's stack (in the trainer's construction or its loop by then)
    assert "dist_train_worker.py" in message and "in main" in message, message[-2000:]


def test_check_script_stops_a_run_past_its_time_and_shows_the_stacks(tmp_path):
    """A launcher run that does not finish within --run-timeout (a hung collective) is stopped
    and the check fails with every process's Python stack instead of waiting forever."""
    proc = _run_check(
        "--steps", "1000000", "--run-timeout", "25", "--work-dir", str(tmp_path), timeout=240
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "did not finish within 25 s (--run-timeout)" in proc.stderr, proc.stderr[-3000:]
    # the workers' stacks (where they were when stopped: the launcher's frames at least)
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-3000:]
    assert "pretrain_gr_ranking.py" in proc.stderr, proc.stderr[-3000:]


def test_bench_e2e_stops_a_launch_past_its_time_and_shows_the_stacks(tmp_path):
    """bench_e2e --nproc: a torchrun launch still going after --launch-timeout is stopped, its
    row says so, and stderr holds every worker's Python stack (where a hung collective waits)."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--device", "cpu",
         "--config", "configs/synthetic_ranking.gin", "--paths", "reference", "--nproc", "2",
         "--steps", "1000000", "--warmup", "1", "--mean-seq-len", "20", "--max-seq-len", "40",
         "--num-users", "200", "--launch-timeout", "30", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={k: v for k, v in os.environ.items() if not k.startswith("HSTU_")},
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and "did not finish within 30 s (--launch-timeout" in rows[0]["error"], rows
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-3000:]
    assert "bench_e2e.py" in proc.stderr, proc.stderr[-3000:]


def test_two_processes_stop_early_together(tmp_path):
    """Early stopping on two gloo processes: every rank takes the same decision from the
    all-reduced metrics (a rank that went on alone would hang in its next collective), and the
    best step's checkpoint is written by both and named in best.json."""
    bindings = TINY + [
        f"TrainerArgs.log_dir='{tmp_path}'",
        "TrainerArgs.run_name='r'",
        "TrainerArgs.max_train_iters=40",
        "TrainerArgs.log_interval=1",
        "TrainerArgs.eval_interval=2",
        # an evaluation that does not beat the best one ends the run; minimising the AUC makes
        # that come early (the first evaluation is the best unless the model gets worse)
        "TrainerArgs.best_metric='auc/mean'",
        "TrainerArgs.best_metric_mode='min'",
        "TrainerArgs.early_stop_patience=1",
    ]
    losses = torchrun_losses(2, bindings, tmp_path, timeout=300)
    assert 4 <= len(losses) < 40, len(losses)  # stopped at an evaluation before the end
    assert len(losses) % 2 == 0
    root = tmp_path / "r" / "checkpoints"
    best = Checkpointer.best_checkpoint(root)
    assert best is not None and Checkpointer.read_meta(best)["world_size"] == 2
    record = json.loads((root / "best.json").read_text())
    assert record["metric"] == "auc/mean" and record["mode"] == "min"
    assert record["step"] < len(losses) and record["step"] % 2 == 0
