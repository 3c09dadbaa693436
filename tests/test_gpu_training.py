"""GPU end-to-end: both launchers through torchrun on a CUDA GPU (compiled attention, NCCL)."""

from __future__ import annotations

import subprocess

import pytest
from dist_helpers import ROOT, launcher_env, torchrun_command

from hstu.training.logger import read_scalars

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_attention")]

COMMON = [
    "TrainerArgs.max_train_iters=60",
    "TrainerArgs.log_interval=10",
    "TrainerArgs.eval_interval=30",
    "TrainerArgs.train_batch_size=64",
    "DatasetArgs.synthetic_num_users=1000",
    "DatasetArgs.synthetic_num_items=500",
    "DatasetArgs.max_history_seqlen=64",
    "NetworkArgs.hidden_size=64",
    "NetworkArgs.kv_channels=32",
    "OptimizerArgs.learning_rate=3e-3",
    "EmbeddingArgs.sparse_optimizer_str='adam'",
]


def _run(task: str, bindings: list[str]) -> subprocess.CompletedProcess:
    args = [x for b in COMMON + bindings for x in ("--gin-bindings", b)]
    return subprocess.run(
        torchrun_command(ROOT / "scripts" / f"pretrain_gr_{task}.py", 1, *args),
        cwd=ROOT,
        env=launcher_env(allow_non_a100=True),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("task,metric", [("ranking", "eval/auc/mean"), ("retrieval", "eval/HR@10")])
def test_launcher_trains_on_gpu(task, metric, tmp_path, run_dir_bindings):
    proc = _run(task, run_dir_bindings(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(str(tmp_path / "run"))
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 6
    assert losses[-1] < losses[0], losses
    assert metric in scalars and len(scalars[metric]) == 2
    assert "perf/gpu_mem_peak_gb" in scalars
