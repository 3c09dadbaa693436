"""The one HSTU attention entry point the models call.

CUDA tensors go to the compiled CUTLASS kernel (`hstu.ops.cuda_attention`); CPU tensors use the
PyTorch reference (CPU development mode only, see docs/design.md "Hardware policy"). The reference is
not a selectable backend on GPU: a CUDA call without a built kernel is an error that says how to
build it.

Benchmarking only: ``HSTU_FORCE_REFERENCE_ATTENTION=1`` sends CUDA tensors to the reference too,
so `scripts/bench_e2e.py` can time the same model with the reference attention in one run. It is
not a training option (the reference is slow and memory-hungry: dense [B, H, N, N] scores).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from hstu.ops import reference

# head dims the compiled kernel is instantiated for; others are zero-padded to the next one
KERNEL_HEAD_DIMS = (32, 64, 128, 256)

__all__ = ["hstu_attention", "compiled_attention_available", "reference_attention_forced"]

FORCE_REFERENCE_ENV = "HSTU_FORCE_REFERENCE_ATTENTION"

_BUILD_HINT = (
    "the compiled HSTU attention kernel is not available for this GPU. Build it with "
    '`HSTU_CUDA_ARCH_LIST="8.0" pip install --no-build-isolation -e .` (add ";9.0" for '
    "H100/H200 test machines) with nvcc and nvidia-cutlass==4.2.0.0 installed"
)


def compiled_attention_available() -> bool:
    try:
        from hstu.ops import cuda_attention
    except ImportError:
        return False
    return bool(cuda_attention.is_available())


def reference_attention_forced() -> bool:
    """True when HSTU_FORCE_REFERENCE_ATTENTION=1 (benchmarks only; see the module docstring)."""
    return os.environ.get(FORCE_REFERENCE_ENV, "0") == "1"


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    *,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: int = 0,
    alpha: float | None = None,
    scaling_seqlen: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Jagged HSTU attention; same signature and semantics as `hstu.ops.reference.hstu_attention`.

    With CUDA q, ``seq_offsets`` / ``num_contexts`` / ``num_targets`` may be CPU tensors (e.g.
    `AttentionInputs.kernel_metadata`): the compiled op then validates them on the host and copies
    them to the GPU without a host<->GPU sync; the reference path moves them to q's device."""
    if not q.is_cuda or reference_attention_forced():
        seq_offsets, num_contexts, num_targets = (
            None if t is None else t.to(q.device, non_blocking=True)
            for t in (seq_offsets, num_contexts, num_targets)
        )
    kwargs = dict(
        num_contexts=num_contexts,
        num_targets=num_targets,
        target_group_size=target_group_size,
        window_size=window_size,
        alpha=alpha,
        scaling_seqlen=scaling_seqlen,
        causal=causal,
    )
    if q.is_cuda and not reference_attention_forced():
        if not compiled_attention_available():
            raise RuntimeError(_BUILD_HINT)
        from hstu.ops.cuda_attention import hstu_attention_cuda

        d = q.shape[-1]
        padded = next((h for h in KERNEL_HEAD_DIMS if h >= d), None)
        if padded is None or padded == d or v.shape[-1] != d:
            return hstu_attention_cuda(q, k, v, seq_offsets, max_seqlen, **kwargs)
        # Zero columns change neither <q, k> nor the used output columns: run the kernel at the next
        # compiled head dim (alpha keeps its 1/sqrt(d) default) and drop the padding.
        if kwargs["alpha"] is None:
            kwargs["alpha"] = 1.0 / math.sqrt(d)
        pad = (0, padded - d)
        out = hstu_attention_cuda(
            F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), seq_offsets, max_seqlen, **kwargs
        )
        return out[..., :d]
    return reference.hstu_attention(q, k, v, seq_offsets, max_seqlen, **kwargs)
