"""GPU end-to-end: both launchers through torchrun on a CUDA GPU (compiled attention, NCCL)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstu.training.logger import read_scalars

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu

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


def _run(task: str, tmp_path: Path) -> subprocess.CompletedProcess:
    args = []
    for b in COMMON + [f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='run'"]:
        args += ["--gin-bindings", b]
    env = dict(os.environ, HSTU_ALLOW_NON_A100="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(ROOT / "scripts" / f"pretrain_gr_{task}.py"),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(autouse=True)
def _need_gpu_and_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hstu.ops import compiled_attention_available

    if not compiled_attention_available():
        pytest.skip("compiled attention kernel not built")


@pytest.mark.parametrize("task,metric", [("ranking", "eval/auc/mean"), ("retrieval", "eval/HR@10")])
def test_launcher_trains_on_gpu(task, metric, tmp_path):
    proc = _run(task, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(str(tmp_path / "run"))
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 6
    assert losses[-1] < losses[0], losses
    assert metric in scalars and len(scalars[metric]) == 2
    assert "perf/gpu_mem_peak_gb" in scalars
