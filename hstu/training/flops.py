"""FLOPs of one training step of the HSTU stack, for TFLOP/s and MFU in TensorBoard.

Counted (per HSTU layer, a multiply-add = 2 FLOPs, actual token lengths L_b of the batch,
T = sum_b L_b tokens, D = hidden_size, H heads of width d, so H*d = HD):

- linears, forward: uvqk projection 2 * T * D * 4HD, output projection 2 * T * HD * D,
  i.e. 10 * T * D * HD; backward = 2 x forward (grad of the input and of the weight).
- attention, forward: sum_b H * L_b^2 * (d_qk + d_v), the causal half of 2 * L^2 per score
  matmul (QK^T and attn @ V), counted the FlashAttention way as in the docs/design.md benchmarks;
  backward = 2.5 x forward. Contextual/target masks and local windows are not discounted.

Not counted: embeddings, LayerNorms, SiLU, gating, dropout, the preprocessor, the ranking MLP
head and the retrieval loss (all small next to the above at benchmark shapes). MFU is
total FLOPs / step time / peak.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = [
    "StackShape",
    "StepFlops",
    "step_flops",
    "A100_BF16_PEAK_TFLOPS",
    "peak_tflops_for",
]

logger = logging.getLogger(__name__)

A100_BF16_PEAK_TFLOPS = 312.0
LINEAR_BACKWARD_FACTOR = 2.0
ATTENTION_BACKWARD_FACTOR = 2.5


@dataclass(frozen=True)
class StackShape:
    """The shape of the HSTU stack that the FLOP count needs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one forward + backward over one batch."""

    linear_forward: float
    attention_forward: float

    @property
    def forward(self) -> float:
        return self.linear_forward + self.attention_forward

    @property
    def backward(self) -> float:
        return (
            LINEAR_BACKWARD_FACTOR * self.linear_forward
            + ATTENTION_BACKWARD_FACTOR * self.attention_forward
        )

    @property
    def total(self) -> float:
        return self.forward + self.backward


def step_flops(shape: StackShape, lengths: torch.Tensor | list[int]) -> StepFlops:
    """FLOPs of the HSTU stack for sequences of the given token lengths (see module docstring)."""
    lens = torch.as_tensor(lengths, dtype=torch.float64).flatten()
    if lens.numel() and bool((lens < 0).any()):
        raise ValueError(f"sequence lengths must be >= 0; got {lens.tolist()}")
    tokens = float(lens.sum())
    sum_sq = float((lens * lens).sum())
    hd = shape.num_heads * shape.head_dim
    linear = shape.num_layers * 10.0 * tokens * shape.hidden_size * hd
    attention = shape.num_layers * shape.num_heads * sum_sq * 2.0 * shape.head_dim
    return StepFlops(linear_forward=linear, attention_forward=attention)


_warned_peak = False


def peak_tflops_for(device: torch.device, configured: float = 0.0) -> float | None:
    """Peak dense TFLOP/s for MFU: TrainerArgs.peak_tflops if > 0, else 312 (A100 bf16).

    On a non-A100 GPU with no configured peak the A100 figure is used with a one-time warning;
    on CPU there is no MFU (None).
    """
    global _warned_peak
    if configured > 0:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "A100" not in name and not _warned_peak:
        _warned_peak = True
        logger.warning(
            "perf/mfu on %s is computed against the A100 bf16 peak of %.0f TFLOP/s; set "
            "TrainerArgs.peak_tflops to this GPU's dense bf16 peak for a meaningful MFU",
            name,
            A100_BF16_PEAK_TFLOPS,
        )
    return A100_BF16_PEAK_TFLOPS
