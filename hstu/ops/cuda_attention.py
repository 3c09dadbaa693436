"""Python face of the compiled CUTLASS/CuTe HSTU attention kernel (`hstu._hstu_attention_C`).

Same signature and semantics as `hstu.ops.reference.hstu_attention` (plus `deterministic`):
jagged q, k, v [T, H, D] with D in {32, 64, 128, 256} and Dqk == Dv, fp16 or bf16, on CUDA.
The ops are `torch.ops.hstu_attention.fwd` / `.bwd` (CUDA + Meta implementations, registered by
the extension); this module wraps them in a `torch.autograd.Function`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["is_available", "hstu_attention_cuda", "load_extension"]

_REBUILD_HINT = (
    'rebuild it with `HSTU_CUDA_ARCH_LIST="8.0" pip install --no-build-isolation -e .` '
    '(H100/H200 test machines: HSTU_CUDA_ARCH_LIST="8.0;9.0"); nvcc and nvidia-cutlass==4.2.0.0 '
    "must be installed"
)


def load_extension() -> bool:
    """Import `hstu._hstu_attention_C` (registers torch.ops.hstu_attention); False if absent."""
    try:
        import hstu._hstu_attention_C  # noqa: F401
    except ImportError:
        return False
    return True


def is_available() -> bool:
    """True when the extension imports and a CUDA device is present."""
    return torch.cuda.is_available() and load_extension()


class _HstuAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seqlen: int,
        num_contexts: torch.Tensor | None,
        num_targets: torch.Tensor | None,
        target_group_size: int,
        window_size: int,
        alpha: float,
        inv_scale: float,
        causal: bool,
        deterministic: bool,
    ) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.ops.hstu_attention.fwd(
            q,
            k,
            v,
            seq_offsets,
            max_seqlen,
            num_contexts,
            num_targets,
            target_group_size,
            window_size,
            alpha,
            inv_scale,
            causal,
        )
        ctx.save_for_backward(q, k, v, seq_offsets, num_contexts, num_targets)
        ctx.args = (
            max_seqlen,
            target_group_size,
            window_size,
            alpha,
            inv_scale,
            causal,
            deterministic,
        )
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, seq_offsets, num_contexts, num_targets = ctx.saved_tensors
        max_seqlen, tgs, window, alpha, inv_scale, causal, deterministic = ctx.args
        dq, dk, dv = torch.ops.hstu_attention.bwd(
            dout.contiguous(),
            q,
            k,
            v,
            seq_offsets,
            max_seqlen,
            num_contexts,
            num_targets,
            tgs,
            window,
            alpha,
            inv_scale,
            causal,
            deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def hstu_attention_cuda(
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
    deterministic: bool = False,
) -> torch.Tensor:
    """Jagged HSTU attention on the compiled kernel; q, k, v: [T, H, D] -> [T, H, D].

    ``seq_offsets``, ``num_contexts`` and ``num_targets`` may live on q's GPU or on the CPU. CPU
    tensors are validated on the host and copied to the GPU asynchronously (pinned staging); GPU
    tensors must be read back for validation (a host<->GPU sync). Either way the check runs once
    per tensor object and is cached for the other layers and the backward.
    `deterministic=True` makes dQ bitwise reproducible (key blocks add their dQ contributions in
    a fixed order) at some backward speed. Bad inputs raise ValueError/TypeError before launch.
    """
    if not load_extension():
        raise RuntimeError(f"hstu._hstu_attention_C is not built; {_REBUILD_HINT}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be jagged [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)}"
        )
    alpha = 1.0 / math.sqrt(q.shape[2]) if alpha is None else float(alpha)
    scaling = float(max_seqlen if scaling_seqlen is None else scaling_seqlen)
    if not scaling > 0:
        raise ValueError(f"scaling_seqlen must be > 0; got {scaling}")
    return _HstuAttentionFn.apply(
        q,
        k,
        v,
        seq_offsets,
        int(max_seqlen),
        num_contexts,
        num_targets,
        int(target_group_size),
        int(window_size),
        alpha,
        1.0 / scaling,
        bool(causal),
        bool(deterministic),
    )
