"""NetworkArgs.fused_gate_kernel: validation and pass-through to every FusedHSTULayer."""

from __future__ import annotations

import pytest
import torch

from hstu.config.gin_utils import ConfigError, load_config
from hstu.data.registry import load_sequence_data
from hstu.models.builder import build_model
from hstu.modules.fused_hstu_layer import FusedHSTULayer

SMALL = [
    "DatasetArgs.synthetic_num_users=50",
    "DatasetArgs.synthetic_num_items=40",
    "DatasetArgs.max_history_seqlen=12",
]


def _layers(*bindings: str) -> list:
    cfg = load_config("ranking", [], [*SMALL, *bindings])
    data = load_sequence_data(cfg.dataset, num_tasks=8)
    torch.manual_seed(0)
    return list(build_model(cfg, data).encoder.layers)


@pytest.mark.parametrize("mode", ["cuda", "compiled"])
def test_fused_gate_kernel_reaches_every_layer(mode):
    layers = _layers("NetworkArgs.fused_layer=True", f"NetworkArgs.fused_gate_kernel='{mode}'")
    assert layers and all(isinstance(x, FusedHSTULayer) for x in layers)
    assert {x.gate_kernel for x in layers} == {mode}


def test_fused_gate_kernel_auto_keeps_the_layer_default():
    layers = _layers("NetworkArgs.fused_layer=True")
    assert {x.gate_kernel for x in layers} == {"auto"}  # kernel or stages chosen per call


def test_fused_gate_kernel_errors():
    with pytest.raises((ConfigError, ValueError), match="fused_gate_kernel"):
        load_config("ranking", [], ["NetworkArgs.fused_gate_kernel='triton'"])
    with pytest.raises((ConfigError, ValueError), match="fused_layer=True"):
        load_config("ranking", [], ["NetworkArgs.fused_gate_kernel='cuda'"])
