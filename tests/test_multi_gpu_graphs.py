"""Two GPUs (NCCL, DDP): the encoder's CUDA graphs replay on every rank and train as the eager
encoder does.

Each rank captures its own graphs (their keys follow its share of the batch); the backward replay
hands the parameter gradients to autograd at its end, where DDP's hooks all-reduce them. These
tests run two processes of the real trainer (`dist_train_worker.py`) with the graphs on and off
and compare rank 0's loss curves.
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import torchrun_losses
from model_helpers import needs_compiled_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

# dropout off and a fixed attention scaling: the same losses whichever way the batch is padded
SMALL = [
    "DatasetArgs.synthetic_num_users=400",
    "DatasetArgs.synthetic_num_items=300",
    "DatasetArgs.max_history_seqlen=48",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=64",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=32",
    "NetworkArgs.hidden_dropout=0.0",
    "NetworkArgs.scaling_seqlen=64",
    "NetworkArgs.fused_layer=True",
    "TrainerArgs.train_batch_size=32",
    "TrainerArgs.max_train_iters=60",
    "TrainerArgs.log_interval=1",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.eval_batch_size=32",
    "TrainerArgs.ckpt_save_interval=-1",
    "TrainerArgs.progress_bar=False",
]


@pytest.mark.parametrize("backend", ["torchrec", "dynamic"])
def test_two_gpus_replay_the_encoder_graphs_with_the_eager_losses(tmp_path, backend):
    needs_compiled_kernels()
    losses, info = {}, {}
    for graphs in (True, False):
        out = tmp_path / f"graphs_{graphs}"
        bindings = SMALL + [
            f"EmbeddingArgs.embedding_backend='{backend}'",
            f"NetworkArgs.cuda_graphs={graphs}",
            f"TrainerArgs.log_dir='{out}'",
        ]
        losses[graphs] = torchrun_losses(2, bindings, out, HSTU_ALLOW_NON_A100="1")
        info[graphs] = json.loads((out / "info.json").read_text())
    on = info[True]
    assert not on["graphs_disabled"], on
    # rank 0 replayed most of its 60 steps (a step of a new shape is captured, then replayed)
    assert on["graph_captures"] >= 1 and on["graph_replays"] >= 40, on
    assert info[False]["graph_replays"] is None  # eager: no graphs built
    a, b = torch.tensor(losses[True]), torch.tensor(losses[False])
    assert a.shape == b.shape == (60,)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
