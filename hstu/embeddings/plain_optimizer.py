"""The sparse optimizers' update rules on plain tables (``EmbeddingArgs.plain_table_optimizer``).

A plain table (``nn.Embedding``, `hstu.embeddings.static.DenseEmbeddingCollection`) gets a dense
``[rows, width]`` gradient whose rows are zero except for the ids the step looked up. With
``plain_table_optimizer='dense'`` the dense optimizer (Adam) updates every row at every step, as
Meta's reference HSTU trains its item table. With ``'sparse'`` this optimizer applies
``EmbeddingArgs.sparse_optimizer_str`` at ``EmbeddingArgs.sparse_learning_rate`` the way the
dynamic tables do (`hstu.embeddings.reference_table.apply_gradients`, the same formulas): only
the rows with a gradient change, and only their optimizer state advances. So a small catalogue
keeps the optimizer a dynamic table was tuned with (row-wise Adagrad for Amazon Beauty) while its
lookup is an ordinary ``nn.Embedding``: no hash table, no host-side id counts, nothing that stops
the whole training step from being captured in a CUDA graph.

Every operation is a device tensor operation of fixed shape (no host read, no data-dependent
size), so `step` can be replayed from a CUDA graph. A row is "looked up" when its summed gradient
is nonzero: for SGD, Adagrad and row-wise Adagrad without weight decay that is exactly the
dynamic tables' rule (a zero gradient changes neither the row nor its state); with weight decay
or Adam a looked-up row whose summed gradient is exactly zero is left as it is, where a dynamic
table would decay it or advance its moments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["PLAIN_TABLE_OPTIMIZERS", "PlainTableOptimizer"]

PLAIN_TABLE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


class PlainTableOptimizer(torch.optim.Optimizer):
    """``optimizer`` (sgd | adagrad | rowwise_adagrad | adam) on plain tables' dense gradients,
    row-sparse like a dynamic table's fused update.

    ``params``: the tables' weights, or param-group dicts whose ``"dim"`` is the width the
    row-wise statistics average over (a table padded to a multiple of 4 columns has spare
    columns that never get a gradient; default: the full width). The state is allocated at
    construction (`step` allocates nothing, so a CUDA graph may replay it): ``sum`` ([rows,
    width] Adagrad, [rows] row-wise Adagrad) or ``exp_avg``, ``exp_avg_sq`` and the per-row
    ``step`` (Adam, bias corrections per row as the dynamic tables). Weight decay: L2 added to
    the gradient (SGD, Adagrads), decoupled (Adam), on looked-up rows only.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        optimizer: str,
        lr: float,
        *,
        eps: float = 1e-8,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if optimizer not in PLAIN_TABLE_OPTIMIZERS:
            raise ValueError(
                f"EmbeddingArgs.sparse_optimizer_str={optimizer!r} has no plain-table update: "
                f"one of {list(PLAIN_TABLE_OPTIMIZERS)}"
            )
        if not lr > 0:
            raise ValueError(f"plain-table optimizer: the learning rate {lr} must be > 0")
        defaults = {
            "lr": float(lr),
            "eps": float(eps),
            "betas": (float(betas[0]), float(betas[1])),
            "weight_decay": float(weight_decay),
            "dim": 0,
        }
        super().__init__(params, defaults)
        self.kind = optimizer
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"plain-table optimizer: a table weight is [rows, width], got "
                        f"{tuple(p.shape)}"
                    )
                self.state[p].update(self._new_state(p))

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = p.shape[0]
        if self.kind == "adagrad":
            return {"sum": torch.zeros_like(p, dtype=torch.float32)}
        if self.kind == "rowwise_adagrad":
            return {"sum": torch.zeros(rows, dtype=torch.float32, device=p.device)}
        if self.kind == "adam":
            return {
                "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
                "step": torch.zeros(rows, dtype=torch.float32, device=p.device),
            }
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved state, checked against this optimizer's kind and tables (the names and
        shapes of each table's state; a mismatch is refused before anything changes)."""
        params = [p for g in self.param_groups for p in g["params"]]
        expected = [{k: tuple(v.shape) for k, v in self._new_state(p).items()} for p in params]
        saved_state = state_dict.get("state", {})
        saved = [
            {k: tuple(v.shape) for k, v in saved_state.get(i, {}).items()}
            for i in range(len(params))
        ]
        if saved != expected or len(saved_state) != len(params):
            raise ValueError(
                f"plain-table optimizer state {saved} does not match "
                f"EmbeddingArgs.sparse_optimizer_str='{self.kind}' on these tables ({expected}): "
                "resume with the sparse optimizer and tables the checkpoint was written with"
            )
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        if closure is not None:
            raise ValueError("plain-table optimizer: closures are not supported")
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to(torch.float32)
                w = p.data.to(torch.float32)
                # rows the step looked up: a nonzero summed gradient ([rows, 1] bool)
                live = g.ne(0).any(dim=1, keepdim=True)
                state = self.state[p]
                if self.kind == "adam":
                    m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                    m.copy_(torch.where(live, beta1 * m + (1.0 - beta1) * g, m))
                    v.copy_(torch.where(live, beta2 * v + (1.0 - beta2) * g * g, v))
                    t.add_(live.squeeze(1).to(t.dtype))
                    tt = t.clamp(min=1.0).to(torch.float64).unsqueeze(1)
                    bc1 = (1.0 - torch.pow(beta1, tt)).to(torch.float32)
                    bc2 = (1.0 - torch.pow(beta2, tt)).to(torch.float32)
                    update = (m / bc1) / ((v / bc2).sqrt() + eps) + wd * w
                else:
                    if wd:
                        g = g + wd * w
                    if self.kind == "sgd":
                        update = g
                    elif self.kind == "adagrad":
                        acc = state["sum"]
                        acc.add_(torch.where(live, g * g, 0.0))
                        update = g / (acc.sqrt() + eps)
                    else:
                        acc = state["sum"]
                        width = group["dim"] or g.shape[1]
                        mean_sq = g[:, :width].square().sum(1) / width
                        acc.add_(torch.where(live.squeeze(1), mean_sq, 0.0))
                        update = g / (acc.sqrt() + eps).unsqueeze(1)
                p.data.copy_(torch.where(live, w - lr * update, w))
        return None
