"""Worker for the multi-process tests: ``torchrun ... dist_train_worker.py ROOT BINDINGS OUT
[DEVICE [flat_gradients | flat_gradients_mixed]]``.

Trains the ranking task with the gin ``BINDINGS`` (a JSON list) on DEVICE (``cpu``: gloo, the
default; ``cuda``: one GPU per rank, NCCL; ``flat_gradients``: the ranks average the dense
gradients with `FlatGradients` instead of DDP, as graphed steps on several processes do;
``flat_gradients_mixed``: that, with the ranks taking the graphed steps' code path and the eager
one alternately, `_MixedSteps`), writes rank 0's loss curve to
``OUT/losses.json`` and, right after a checkpoint was loaded (before any step), every rank's
restored state to ``OUT/loaded_rank_<r>.pt`` (sharded tensors as offset records), so a test can
compare it with the saved files; rank 0 also writes ``OUT/info.json`` (whether the ids of the
dynamic tables were routed ahead of the steps; its CUDA graphs' replays and captures). With
``DIST_WORKER_DUMP_AFTER_S`` set, a worker still running after that many seconds writes every
thread's stack to ``OUT/stacks_rank<r>.txt`` and exits (`dist_helpers.torchrun_losses` sets it
shortly before its timeout and shows the stacks when the launch fails).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402

from hstu.config.gin_utils import load_config  # noqa: E402
from hstu.training.reshard import to_portable  # noqa: E402
from hstu.training.trainer import Trainer  # noqa: E402


class _MixedSteps:
    """Stands in for `StepGraphs` on CPU: every other step (offset by the rank, so the ranks
    differ at every step) runs `Trainer._optimize` as a graphed step would (with dynamic or
    torchrec tables: looked up before it, updated after it), the others are handed back to the
    trainer's own eager step (which then splits its step the same way, `split_eager`). Both
    must issue the same collectives."""

    def __init__(self, trainer) -> None:
        from hstu.graph_capture import GraphStats

        self.trainer, self.count, self.stats = trainer, 0, GraphStats()
        self.split_eager = trainer.core.embeddings.has_sparse_tables

    def lookup_sparse(self, batch, sparse_input=None):
        core = self.trainer.core
        with torch.enable_grad():
            return core.embeddings.lookup_sparse(batch, *core.fixed_extra_ids(), sparse_input)

    def step(self, host, normalizer, sparse_input=None):
        from hstu.training.step_graphs import staged, update_tables

        self.count += 1
        if (self.count + self.trainer.info.rank) % 2:
            return None
        self.stats.replays += 1
        batch = host.to(self.trainer.device)
        rows = self.lookup_sparse(batch, sparse_input) if self.split_eager else {}
        with staged(self.trainer.core.embeddings, rows) as leaves:
            outputs = self.trainer._optimize(batch, normalizer)
        update_tables(rows, leaves)
        lengths = self.trainer.core.last_attention_inputs.real_lengths()
        return outputs, lengths, int(lengths.sum())


def _dump_stacks_if_still_running(out: Path) -> None:
    """With DIST_WORKER_DUMP_AFTER_S set (tests/dist_helpers.py): after that many seconds, write
    every thread's Python stack to OUT/stacks_rank<r>.txt and exit, so a test whose ranks hang
    reports where each one waits."""
    after = float(os.environ.get("DIST_WORKER_DUMP_AFTER_S", "0") or 0)
    if after <= 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    stream = open(out / f"stacks_rank{rank}.txt", "w")  # noqa: SIM115 - open until the exit
    faulthandler.dump_traceback_later(after, exit=True, file=stream)


def main() -> None:
    bindings, out = json.loads(sys.argv[2]), Path(sys.argv[3])
    _dump_stacks_if_still_running(out)
    device_type = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    if len(sys.argv) > 5 and sys.argv[5].startswith("flat_gradients"):
        # the gradient averaging of graphed steps on several processes, without the graphs
        Trainer._averages_gradients_itself = lambda self: self.info.world_size > 1
    cfg = load_config("ranking", [], bindings)
    trainer = Trainer(cfg, device_type)
    rank = trainer.info.rank
    if len(sys.argv) > 5 and sys.argv[5] == "flat_gradients_mixed":
        trainer.step_graphs = _MixedSteps(trainer)
    try:
        if cfg.trainer.ckpt_load_dir:
            loaded = {
                "model": to_portable(trainer.model.state_dict()),
                "fused_optimizer": to_portable(trainer.model.fused_optimizer.state_dict()),
                "dense_optimizer": trainer.optimizer.state_dict(),
                "train_iter": trainer.train_iter.state_dict(),
                "step": trainer.step,
            }
            if trainer.core.embeddings.dynamic_collection is not None:
                loaded["dynamic_embeddings"] = trainer.core.embeddings.dynamic_collection.dump()
            torch.save(loaded, out / f"loaded_rank_{rank}.pt")
        result = trainer.fit()
    finally:
        trainer.close()
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(result.losses))
        graphs = trainer.graph_stats()
        info = {
            "input_dist_ahead": trainer.pipeline.ahead,
            "flat_gradients": trainer.grad_reducer is not None,
            "ddp": type(getattr(trainer.model, "_dmp_wrapped_module", None)).__name__
            == "DistributedDataParallel",
            "graph_replays": None if graphs is None else graphs.replays,
            "graph_captures": None if graphs is None else graphs.captures,
            "graphs_disabled": None if graphs is None else graphs.disabled,
        }
        (out / "info.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
