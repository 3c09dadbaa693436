"""Dense optimizers, LR schedules and gradient clipping built from OptimizerArgs."""

from __future__ import annotations

import math

import pytest
import torch

from hstu.config.args import OptimizerArgs
from hstu.training.optim import build_dense_optimizer, build_lr_scheduler, clip_grad_norm


def _params():
    torch.manual_seed(0)
    return list(torch.nn.Linear(4, 3).parameters())


def _lrs(args: OptimizerArgs, max_iters: int, steps: int) -> list[float]:
    """LR used by optimizer steps 0..steps-1, driven the way the trainer drives it."""
    opt = build_dense_optimizer(_params(), args)
    sched = build_lr_scheduler(opt, args, max_iters)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_optimizer_types_and_hyperparameters():
    adam = build_dense_optimizer(
        _params(),
        OptimizerArgs(
            optimizer_str="adam",
            learning_rate=2e-3,
            adam_beta1=0.8,
            adam_beta2=0.95,
            adam_eps=1e-6,
            weight_decay=0.01,
        ),
    )
    assert type(adam) is torch.optim.Adam
    g = adam.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (2e-3, (0.8, 0.95), 1e-6, 0.01)

    adamw = build_dense_optimizer(_params(), OptimizerArgs(optimizer_str="adamw", weight_decay=0.1))
    assert type(adamw) is torch.optim.AdamW
    g = adamw.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.98), 1e-8, 0.1)

    sgd = build_dense_optimizer(
        _params(),
        OptimizerArgs(optimizer_str="sgd", learning_rate=0.1, momentum=0.9, weight_decay=1e-4),
    )
    assert type(sgd) is torch.optim.SGD
    g = sgd.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"]) == (0.1, 0.9, 1e-4)


def test_sgd_step_matches_hand_update():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build_dense_optimizer([w], OptimizerArgs(optimizer_str="sgd", learning_rate=0.5))
    (w**2).sum().backward()  # grad = 2w
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([0.0, 0.0]))


def test_frozen_params_dropped_and_errors():
    a, b = _params()
    b.requires_grad_(False)
    opt = build_dense_optimizer([a, b], OptimizerArgs())
    assert opt.param_groups[0]["params"] == [a]
    with pytest.raises(ValueError, match="no trainable dense parameters"):
        build_dense_optimizer([b], OptimizerArgs())
    with pytest.raises(ValueError, match="OptimizerArgs.optimizer_str='lamb'"):
        build_dense_optimizer(_params(), OptimizerArgs(optimizer_str="lamb"))
    args = OptimizerArgs()
    args.optimizer_str = "lamb"  # bypassing the dataclass validation still fails clearly
    with pytest.raises(
        ValueError, match="OptimizerArgs.optimizer_str='lamb'.*'adam', 'adamw', 'sgd'"
    ):
        build_dense_optimizer(_params(), args)
    args = OptimizerArgs()
    args.lr_scheduler = "step"
    with pytest.raises(ValueError, match="OptimizerArgs.lr_scheduler='step'"):
        build_lr_scheduler(build_dense_optimizer(_params(), OptimizerArgs()), args, 10)


def test_warmup_then_constant():
    lrs = _lrs(OptimizerArgs(learning_rate=1.0, warmup_iters=4), max_iters=10, steps=8)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert _lrs(OptimizerArgs(learning_rate=0.5), max_iters=10, steps=3) == [0.5, 0.5, 0.5]


def test_cosine_endpoints_and_midpoint():
    args = OptimizerArgs(learning_rate=1.0, warmup_iters=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    lrs = _lrs(args, max_iters=12, steps=15)
    assert lrs[:2] == pytest.approx([0.5, 1.0])
    assert lrs[2] == pytest.approx(1.0)  # decay starts at full LR right after warmup
    assert lrs[7] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 10 decay steps
    assert lrs[12] == pytest.approx(0.1)  # min_lr_ratio * lr at max_iters
    assert lrs[13:] == pytest.approx([0.1, 0.1])  # and stays there
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    lrs0 = _lrs(OptimizerArgs(learning_rate=2.0, lr_scheduler="cosine"), max_iters=4, steps=5)
    assert lrs0 == pytest.approx(
        [2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4), 0.0]
    )


def test_linear_endpoints():
    args = OptimizerArgs(learning_rate=1.0, warmup_iters=1, lr_scheduler="linear", min_lr_ratio=0.2)
    lrs = _lrs(args, max_iters=5, steps=7)
    # warmup step 0 at full LR (1 warmup step), then 1.0 -> 0.2 over steps 1..5
    assert lrs == pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])


def test_scheduler_state_round_trip():
    args = OptimizerArgs(learning_rate=1.0, warmup_iters=3, lr_scheduler="cosine")
    opt = build_dense_optimizer(_params(), args)
    sched = build_lr_scheduler(opt, args, 10)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_dense_optimizer(_params(), args)
    sched2 = build_lr_scheduler(opt2, args, 10)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_clip_grad_norm():
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([w], 0.0) is None
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 4.0]))  # untouched when off
    norm = clip_grad_norm([w], 1.0)
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]), atol=1e-5, rtol=1e-5)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == 0.0  # no grads yet
    with pytest.raises(ValueError, match="grad_clip_norm"):
        clip_grad_norm([w], -1.0)


def test_adam_is_foreach_on_cpu():
    opt = build_dense_optimizer(_params(), OptimizerArgs())
    assert not opt.param_groups[0]["fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_fused_adam_on_gpu_matches_foreach(name):
    """CUDA parameters get the fused Adam/AdamW; its updates match the foreach implementation."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(64, 32, device="cuda")) for _ in range(3)]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    args = OptimizerArgs(optimizer_str=name, weight_decay=0.01)
    opt = build_dense_optimizer(mine, args)
    assert opt.param_groups[0]["fused"]
    base = (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(
        ref,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=0.01,
        foreach=True,
    )
    for _ in range(5):
        for a, b in zip(ref, mine):
            g = torch.randn_like(a)
            a.grad, b.grad = g, g.clone()
        base.step()
        opt.step()
    for a, b in zip(ref, mine):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
