"""Dense optimizers and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["build_dense_optimizer", "build_lr_scheduler", "clip_grad_norm", "lr_factor"]


def build_dense_optimizer(params: Iterable[torch.nn.Parameter], args) -> torch.optim.Optimizer:
    """Adam / AdamW / SGD from OptimizerArgs."""
    params = list(params)
    name = args.optimizer_str
    if name == "adam":
        return torch.optim.Adam(
            params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, weight_decay=args.weight_decay,
        )
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, weight_decay=args.weight_decay,
        )
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=args.learning_rate, momentum=args.momentum, weight_decay=args.weight_decay
        )
    raise ValueError(
        f"OptimizerArgs.optimizer_str={name!r} is not supported: choose one of 'adam', 'adamw', 'sgd'"
    )


def lr_factor(step: int, args, max_iters: int) -> float:
    """Multiplier of the base LR after ``step`` scheduler steps: linear warmup, then the schedule."""
    warmup = int(args.warmup_iters)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if args.lr_scheduler == "constant":
        return 1.0
    span = max(1, max_iters - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    floor = float(args.min_lr_ratio)
    if args.lr_scheduler == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if args.lr_scheduler == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ValueError(
        f"OptimizerArgs.lr_scheduler={args.lr_scheduler!r} is not supported: "
        "choose one of 'constant', 'cosine', 'linear'"
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args, max_iters: int):
    lr_factor(0, args, max_iters)  # validates the schedule name up front
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args, max_iters))


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float | None:
    """Clips the global grad norm when max_norm > 0; returns the pre-clip norm (None when off)."""
    if not max_norm or max_norm <= 0:
        return None
    return float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))
