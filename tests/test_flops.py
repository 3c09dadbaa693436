"""FLOP accounting of the HSTU stack (hstu.training.flops) on hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from hstu.training.flops import StackShape, peak_tflops_for, step_flops


def test_step_flops_hand_computed():
    # 2 layers, D=4, H=2 heads of d=3 (HD=6); lengths 3, 0, 5 -> T=8 tokens, sum L^2 = 34
    shape = StackShape(num_layers=2, hidden_size=4, num_heads=2, head_dim=3)
    f = step_flops(shape, torch.tensor([3, 0, 5]))
    # per layer: uvqk 2*8*4*24 = 1536, out proj 2*8*6*4 = 384 -> 1920; x2 layers
    assert f.linear_forward == 3840
    # per layer: H * sum L^2 * (d_qk + d_v) = 2 * 34 * 6 = 408; x2 layers
    assert f.attention_forward == 816
    assert f.forward == 4656
    assert f.backward == 2 * 3840 + 2.5 * 816  # linears 2x, attention 2.5x
    assert f.total == 14376


def test_step_flops_counts_actual_lengths_not_padding():
    shape = StackShape(1, 8, 1, 8)
    assert step_flops(shape, [4, 4]).total < step_flops(shape, [8]).total
    assert step_flops(shape, []).total == 0
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        step_flops(shape, [3, -1])


def test_peak_tflops():
    assert peak_tflops_for(torch.device("cpu")) is None  # CPU: TFLOP/s only, no MFU
    assert peak_tflops_for(torch.device("cpu"), 989.0) == 989.0
