"""Dense optimizers, learning-rate schedules and gradient clipping, built from OptimizerArgs.

Embedding tables carry their own fused (sparse) optimizers; everything here is for the dense
parameters (HSTU layers, heads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from hstu.config.args import DENSE_OPTIMIZERS, LR_SCHEDULERS

if TYPE_CHECKING:
    from hstu.config.args import OptimizerArgs

__all__ = ["build_dense_optimizer", "build_lr_scheduler", "clip_grad_norm", "lr_factor"]


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


def build_dense_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], args: OptimizerArgs
) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD (with momentum) over ``params`` (tensors or param-group dicts).

    Parameters that do not require grad are dropped; an empty parameter list is an error.
    """
    name = str(args.optimizer_str).lower()
    if name not in DENSE_OPTIMIZERS:
        raise ValueError(
            f"OptimizerArgs.optimizer_str={args.optimizer_str!r} is not supported: "
            f"choose one of {_choices(DENSE_OPTIMIZERS)}"
        )
    params = list(params)
    if params and not isinstance(params[0], dict):
        params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError(
            "build_dense_optimizer: no trainable dense parameters were given (all frozen or empty)"
        )
    lr = float(args.learning_rate)
    wd = float(args.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(args.momentum), weight_decay=wd)
    betas = (float(args.adam_beta1), float(args.adam_beta2))
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    # On the GPU the fused implementation updates every parameter in a few kernels (the
    # foreach one launches several per tensor group and costs ~3 ms of host time per step on
    # the 8-layer benchmark model); same update rule, same state_dict format.
    flat = [q for g in params for q in g["params"]] if isinstance(params[0], dict) else params
    fused = all(q.is_cuda and q.is_floating_point() for q in flat)
    return cls(
        params, lr=lr, betas=betas, eps=float(args.adam_eps), weight_decay=wd, fused=fused or None
    )


def lr_factor(step: int, args: OptimizerArgs, max_iters: int) -> float:
    """Multiplier of ``learning_rate`` for the optimizer step with 0-based index ``step``.

    Warmup: ``(step + 1) / warmup_iters`` for ``step < warmup_iters`` (the first step already
    moves the weights; the last warmup step is at full LR). Then ``constant`` stays at 1;
    ``cosine`` / ``linear`` decay from 1 at ``step == warmup_iters`` to ``min_lr_ratio`` at
    ``step == max_iters`` and stay there afterwards.
    """
    warmup = int(args.warmup_iters)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    schedule = str(args.lr_scheduler).lower()
    if schedule == "constant":
        return 1.0
    floor = float(args.min_lr_ratio)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, max_iters - warmup)))
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ValueError(
        f"OptimizerArgs.lr_scheduler={args.lr_scheduler!r} is not supported: "
        f"choose one of {_choices(LR_SCHEDULERS)}"
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, args: OptimizerArgs, max_iters: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_iters``, then constant / cosine / linear decay (see lr_factor).

    Call ``scheduler.step()`` once after every ``optimizer.step()``.
    """
    if str(args.lr_scheduler).lower() not in LR_SCHEDULERS:
        raise ValueError(
            f"OptimizerArgs.lr_scheduler={args.lr_scheduler!r} is not supported: "
            f"choose one of {_choices(LR_SCHEDULERS)}"
        )
    if int(args.warmup_iters) < 0:
        raise ValueError(f"OptimizerArgs.warmup_iters={args.warmup_iters} must be >= 0")
    if not 0.0 <= float(args.min_lr_ratio) <= 1.0:
        raise ValueError(f"OptimizerArgs.min_lr_ratio={args.min_lr_ratio} must be in [0, 1]")
    if max_iters < 0:
        raise ValueError(
            f"build_lr_scheduler: max_iters={max_iters} (TrainerArgs.max_train_iters) must be >= 0"
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args, max_iters)
    )


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, *, as_tensor: bool = False
) -> float | torch.Tensor | None:
    """Clip the global L2 norm of the gradients to ``max_norm``; returns the norm before clipping
    (a 0-dim tensor on the gradients' device with ``as_tensor=True``: no host sync).

    A no-op returning None when ``max_norm`` is 0 (OptimizerArgs.grad_clip_norm's "off").
    """
    if max_norm < 0:
        raise ValueError(f"OptimizerArgs.grad_clip_norm={max_norm} must be >= 0 (0 = no clipping)")
    if max_norm == 0:
        return None
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(()) if as_tensor else 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return norm if as_tensor else float(norm)
