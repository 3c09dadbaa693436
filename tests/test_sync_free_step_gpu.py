"""GPU: the training forward reads nothing back from the GPU (no host<->device syncs).

One step of a shrunken synthetic_benchmark_ranking model (fused layers, compiled attention,
dynamic item/user tables, bf16) runs its forward, from the model call to the loss, under
``torch.cuda.set_sync_debug_mode("error")``: any blocking device->host read or pageable copy
raises. Nothing is scoped out on one GPU: the input dist of the torchrec-sharded
EmbeddingCollection of the small contextual tables would sync on a recat index tensor built on
the device from a Python list each step, which `install_torchrec_recat_cache`
(hstu.training.distributed) builds once instead. The dynamic tables, including their inserts,
must not sync. The same with every table in torchrec at a width that the planner would place
row-wise (on one rank they are placed table-wise: a row-wise lookup reads its bucketized lengths
back).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("compiled_attention", "dynamic_embedding_kernels"),
]

BINDINGS = [
    "TrainerArgs.train_batch_size=8",
    "TrainerArgs.max_train_iters=10",
    "TrainerArgs.ckpt_save_interval=-1",
    "TrainerArgs.progress_bar=False",
    "DatasetArgs.synthetic_num_users=2000",
    "DatasetArgs.synthetic_num_items=5000",
    "DatasetArgs.max_history_seqlen=256",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=256",
    "NetworkArgs.kv_channels=64",
    "EmbeddingArgs.item_capacity=100000",
    "EmbeddingArgs.user_capacity=100000",
    "NetworkArgs.cuda_graphs=False",  # the eager forward, op by op (a capture synchronises)
]


@contextlib.contextmanager
def _sync_debug(mode):
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


# every table in torchrec, rows of 48 floats: torchrec's planner alone would place these tables
# row-wise, whose lookup reads the bucketized lengths back (`distributed.planner_constraints`)
TORCHREC = [
    "EmbeddingArgs.embedding_backend='torchrec'",
    "EmbeddingArgs.contextual_tables='torchrec'",
    "NetworkArgs.hidden_size=48",
]


@pytest.mark.parametrize("tables", ["dynamic", "torchrec"])
def test_training_forward_has_no_host_device_sync(tmp_path, monkeypatch, run_dir_bindings, tables):
    from hstu.config.gin_utils import load_config
    from hstu.training.trainer import Trainer

    monkeypatch.setenv("HSTU_ALLOW_NON_A100", "1")
    cfg = load_config(
        "ranking",
        [ROOT / "configs" / "synthetic_benchmark_ranking.gin"],
        BINDINGS + run_dir_bindings(tmp_path) + (TORCHREC if tables == "torchrec" else []),
    )
    trainer = Trainer(cfg, "cuda")
    try:
        # warm-up: lazy initialisation (cuBLAS handles, torch.compile of the fused stages, ...)
        # and DDP's one-time bucket rebuild, which (static graph) runs in the 3rd forward and syncs
        for _ in range(4):
            trainer.train_step()
        torch.cuda.synchronize()
        trainer.model.train()
        host_batch = next(trainer.train_iter)
        assert host_batch.features.values().is_pinned()
        batch = host_batch.to(trainer.device, non_blocking=True)
        assert batch.host is host_batch
        with trainer._autocast(), _sync_debug("error"):
            out = trainer.model(batch, loss_normalizer=1.0)
            loss = out["loss"]
        loss.backward()
        torch.cuda.synchronize()
        assert torch.isfinite(loss).item()
        attn = trainer.core.last_attention_inputs
        assert attn.host_seq_offsets is not None
        assert torch.equal(attn.host_seq_offsets, attn.seq_offsets.cpu())
        if tables == "torchrec":
            plan = trainer.model.plan.get_plan_for_module("embeddings.embedding_collection")
            assert {p.sharding_type for p in plan.values()} == {"table_wise"}
            return
        dynamic = trainer.core.embeddings.dynamic_collection.tables.values()
        assert all(t._padded_insert for t in dynamic)  # the compiled, sync-free insert path
        stats = trainer.core.embeddings.dynamic_collection.stats()
        assert stats["item_table/inserts"] > 0 and stats["item_table/lookups"] > 0
    finally:
        trainer.close()


def test_compiled_attention_takes_cpu_metadata_without_sync():
    """The compiled op given CPU offsets/contexts/targets: same output and gradients as with the
    GPU tensors, and forward + backward (new tensors, then the cached check) never sync."""
    from hstu.ops.cuda_attention import hstu_attention_cuda

    torch.manual_seed(0)
    lengths = torch.tensor([70, 1, 130, 64, 0, 200])
    offs = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    offs[1:] = torch.cumsum(lengths, 0)
    ctx = torch.tensor([3, 0, 5, 2, 0, 6])
    tgt = torch.tensor([10, 1, 0, 7, 0, 20])
    t, dev = int(offs[-1]), torch.device("cuda")
    q, k, v = (torch.randn(t, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    kw = dict(target_group_size=2, deterministic=True)

    def run(o, c, g):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = hstu_attention_cuda(*leaves, o, 200, num_contexts=c, num_targets=g, **kw)
        out.backward(dout)
        return [out.detach()] + [x.grad for x in leaves]

    ref = run(offs.to(dev), ctx.to(dev), tgt.to(dev))
    torch.cuda.synchronize()
    with _sync_debug("error"):
        got = run(offs.clone(), ctx.clone(), tgt.clone())
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # bad CPU metadata is still refused before launch, with the usual message
    bad = offs.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="seq_offsets\\[-1\\]"):
        hstu_attention_cuda(q, k, v, bad, 200)
