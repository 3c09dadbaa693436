"""Two GPUs (NCCL): CUDA graphs replay on every rank and train as the eager steps do.

The whole step is graphed on every rank (each captures its own keys, which follow its share of
the batch) and averages the dense gradients inside its graphs (`FlatGradients`, no DDP). With
torchrec or dynamic tables (sharded: ids to their owner ranks and rows back) the tables are
looked up before each replay and updated after it, and the steps that run eagerly are split
the same way, so every rank issues its collectives in one order. With
`cuda_graph_scope="encoder"` the encoder's graphs run under DDP: the backward replay hands the
parameter gradients to autograd at its end, where DDP's hooks all-reduce them. These tests run
two processes of the real trainer (`dist_train_worker.py`) with the graphs on and off and
compare rank 0's loss curves.
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
    "TrainerArgs.max_train_iters=80",
    "TrainerArgs.log_interval=1",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.eval_batch_size=32",
    "TrainerArgs.ckpt_save_interval=-1",
    "TrainerArgs.progress_bar=False",
]


@pytest.mark.parametrize(
    "backend,scope",
    [("torchrec", "step"), ("dynamic", "step"), ("dense", "step"), ("dynamic", "encoder")],
)
def test_two_gpus_replay_graphs_with_the_eager_losses(tmp_path, backend, scope):
    """The whole step's graphs, the gradients averaged inside them (`FlatGradients`, no DDP):
    plain tables, and torchrec or dynamic ones (contextual features in torchrec tables beside
    them) looked up before each replay; the encoder's graphs under DDP."""
    needs_compiled_kernels()
    losses, info = {}, {}
    for graphs in (True, False):
        out = tmp_path / f"graphs_{graphs}"
        bindings = SMALL + [
            f"EmbeddingArgs.embedding_backend='{backend}'",
            f"NetworkArgs.cuda_graphs={graphs}",
            f"NetworkArgs.cuda_graph_scope='{scope}'",
            f"TrainerArgs.log_dir='{out}'",
        ]
        if backend == "dense":  # no torchrec table at all
            bindings.append("NetworkArgs.use_contextual_features=False")
        losses[graphs] = torchrun_losses(2, bindings, out, device="cuda")
        info[graphs] = json.loads((out / "info.json").read_text())
    on, off = info[True], info[False]
    assert not on["graphs_disabled"], on
    # rank 0 replayed half of its 80 steps or more (a new shape runs eagerly or is captured)
    assert on["graph_captures"] >= 1 and on["graph_replays"] >= 40, on
    whole = scope == "step"
    assert (on["flat_gradients"], on["ddp"]) == (whole, not whole), on
    assert off["graph_replays"] is None and off["ddp"] and not off["flat_gradients"], off
    a, b = torch.tensor(losses[True]), torch.tensor(losses[False])
    assert a.shape == b.shape == (80,)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
