"""Python face of the compiled CUTLASS/CuTe HSTU attention kernel (`hstu._hstu_attention_C`).

Same signature and semantics as `hstu.ops.reference.hstu_attention` (plus `deterministic`,
minus the reference-only dense ``bias``): jagged q, k, v [T, H, D] with D in {32, 64, 128, 256}
and Dqk == Dv, fp16 or bf16, on CUDA. The ops are `torch.ops.hstu_attention.fwd` / `.bwd`
(CUDA + Meta implementations, registered by the extension); this module wraps them in a
`torch.autograd.Function`.

The relative attention bias (position and/or time, docs/design.md) is computed in-kernel from
the int64 token timestamps, the two fp32 weight tensors and `reference.time_bucket_edges`: no
[N, N] tensor exists. ``bwd`` returns (dq, dk, dv, d_pos_weight, d_time_weight); a weight
gradient is empty (numel 0) when that weight is absent. Weight gradients are fp32 sums of atomic
adds, so they are not bitwise reproducible even with ``deterministic=True`` (dq, dk, dv are).
"""

from __future__ import annotations

import math

import torch

from hstu.ops import reference

__all__ = ["hstu_attention_cached_cuda", "hstu_attention_cuda", "is_available", "load_extension"]

_REBUILD_HINT = (
    'rebuild it with `HSTU_CUDA_ARCH_LIST="8.0" pip install --no-build-isolation -e .` '
    '(H100/H200: HSTU_CUDA_ARCH_LIST="8.0;9.0a"); nvcc and nvidia-cutlass==4.2.0.0 '
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


def has_sm90_kernels() -> bool:
    """True when the extension was built with sm_90a code (HSTU_CUDA_ARCH_LIST "9.0a"): on a
    9.0 device (H100/H200) the attention then runs its wgmma kernels where they apply (d256
    forward of a training call and d256 backward; no relative bias, not deterministic);
    HSTU_ATTN_SM90=0 keeps the SM80 kernels."""
    if not load_extension():
        return False
    import hstu._hstu_attention_C as ext

    return bool(ext.has_sm90_kernels())


def _check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The extension is built and q, k, v are 3-D (the ops check the rest)."""
    if not load_extension():
        raise RuntimeError(f"hstu._hstu_attention_C is not built; {_REBUILD_HINT}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be jagged [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)}"
        )


def _bias_tensors(pos_weight, time_weight, timestamps, device):
    """(pos_weight, time_weight, time_edges, timestamps) as the kernels read them: fp32
    contiguous weights (no-ops for fp32 parameters), the bucket edges of the time weight."""
    time_edges = None
    if pos_weight is not None:
        pos_weight = pos_weight.float().contiguous()
    if time_weight is not None:
        time_weight = time_weight.float().contiguous()
        time_edges = reference.time_bucket_edges(time_weight.shape[1] - 1, device)
        timestamps = timestamps.contiguous()
    return pos_weight, time_weight, time_edges, timestamps


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
        timestamps: torch.Tensor | None,
        pos_weight: torch.Tensor | None,
        time_weight: torch.Tensor | None,
        time_edges: torch.Tensor | None,
        max_pos: int,
        last_query_time: torch.Tensor | None,
        inv_scale_tensor: torch.Tensor | None,
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
            timestamps=timestamps,
            pos_weight=pos_weight,
            time_weight=time_weight,
            time_edges=time_edges,
            max_pos=max_pos,
            last_query_time=last_query_time,
            inv_scale_tensor=inv_scale_tensor,
        )
        ctx.save_for_backward(
            q,
            k,
            v,
            seq_offsets,
            num_contexts,
            num_targets,
            timestamps,
            pos_weight,
            time_weight,
            time_edges,
            last_query_time,
            inv_scale_tensor,
        )
        ctx.args = (
            max_seqlen,
            target_group_size,
            window_size,
            alpha,
            inv_scale,
            causal,
            deterministic,
            max_pos,
        )
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (q, k, v, seq_offsets, num_contexts, num_targets, timestamps, pos_weight, time_weight,
         time_edges, last_query_time, inv_scale_tensor) = ctx.saved_tensors  # fmt: skip
        max_seqlen, tgs, window, alpha, inv_scale, causal, deterministic, max_pos = ctx.args
        dq, dk, dv, d_pos, d_time = torch.ops.hstu_attention.bwd(
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
            timestamps=timestamps,
            pos_weight=pos_weight,
            time_weight=time_weight,
            time_edges=time_edges,
            max_pos=max_pos,
            last_query_time=last_query_time,
            inv_scale_tensor=inv_scale_tensor,
        )
        d_pos = d_pos if pos_weight is not None else None
        d_time = d_time if time_weight is not None else None
        # seq_offsets .. deterministic (10 arguments), timestamps, time_edges, max_pos,
        # last_query_time and inv_scale_tensor get no gradient
        return (dq, dk, dv, *(None,) * 11, d_pos, d_time, None, None, None, None)


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
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    max_pos: int = 0,
    last_query_time: torch.Tensor | None = None,
    inv_scale_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention on the compiled kernel; q, k, v: [T, H, D] -> [T, H, D].

    ``inv_scale_tensor``: float32 [1] on q's device, read by the kernels in place of
    1 / scaling_seqlen (a captured CUDA graph takes each batch's scaling from it; see
    `hstu.modules.graphed_encoder`). Under graph capture the metadata must be GPU tensors and
    ``max_seqlen`` may be any upper bound of the lengths: nothing is validated here, the caller
    checks each batch before it replays.

    ``pos_weight`` [Hw, 2 * max_pos + 1], ``time_weight`` [Hw, NB + 1] (Hw = 1 or H) and
    ``timestamps`` (int64 [T] on q's device, given iff ``time_weight`` is) add the in-kernel
    relative attention bias of `hstu.ops.reference` (its module docstring); the weights are
    passed as fp32 and receive gradients.

    ``seq_offsets``, ``num_contexts`` and ``num_targets`` may live on q's GPU or on the CPU. CPU
    tensors are validated on the host and copied to the GPU asynchronously (pinned staging); GPU
    tensors must be read back for validation (a host<->GPU sync). Either way the check runs once
    per tensor object and is cached for the other layers and the backward.
    `deterministic=True` makes dQ bitwise reproducible (key blocks add their dQ contributions in
    a fixed order) at some backward speed. Bad inputs raise ValueError/TypeError before launch.
    """
    _check_call(q, k, v)
    reference.check_relative_bias(
        q.shape[0],
        q.shape[1],
        timestamps,
        pos_weight,
        time_weight,
        max_pos,
        alpha,
        last_query_time,
        seq_offsets.numel() - 1,
    )
    alpha = 1.0 / math.sqrt(q.shape[2]) if alpha is None else float(alpha)
    scaling = float(max_seqlen if scaling_seqlen is None else scaling_seqlen)
    if not scaling > 0:
        raise ValueError(f"scaling_seqlen must be > 0; got {scaling}")
    for name, t in (
        ("timestamps", timestamps),
        ("pos_weight", pos_weight),
        ("time_weight", time_weight),
        ("last_query_time", last_query_time),
    ):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {t.device}")
    pos_weight, time_weight, time_edges, timestamps = _bias_tensors(
        pos_weight, time_weight, timestamps, q.device
    )
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
        timestamps,
        pos_weight,
        time_weight,
        time_edges,
        int(max_pos) if pos_weight is not None else 0,
        None if last_query_time is None else last_query_time.contiguous(),
        _check_inv_scale_tensor(inv_scale_tensor, q),
    )


def _check_inv_scale_tensor(t: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    if t is not None and (t.dtype != torch.float32 or t.numel() != 1 or t.device != q.device):
        raise ValueError(
            f"inv_scale_tensor must be one float32 value on q's device {q.device}; got "
            f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
        )
    return t


def hstu_attention_cached_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    kv_lengths: torch.Tensor | None = None,
    num_contexts: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    target_group_size: int = 1,
    window_size: int = 0,
    alpha: float | None = None,
    scaling_seqlen: int | None = None,
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    max_pos: int = 0,
    last_query_time: torch.Tensor | None = None,
    max_q_seqlen: int = 0,
    max_seqlen: int = 0,
    num_splits: int = 1,
) -> torch.Tensor:
    """`hstu.ops.reference.hstu_attention_cached` on the compiled forward kernel
    (`torch.ops.hstu_attention.fwd_cached`: only the query rows are computed; no autograd).
    The metadata may live on the CPU (no sync) or on q's GPU (read back to be checked). Under
    CUDA graph capture it must be on the GPU, already validated by the caller (e.g. with
    `reference.cached_layout`), with ``scaling_seqlen``, ``max_q_seqlen`` (the most queries of a
    sequence) and ``max_seqlen`` (the longest sequence) given. ``num_splits``: how many CTAs
    share each query block's keys (their fp32 partial outputs add; 1: none, 0: the op chooses
    from the shape, to fill the GPU when few sequences x heads x query blocks would leave SMs
    idle)."""
    _check_call(q, k, v)
    reference.check_relative_bias(
        k.shape[0], q.shape[1], timestamps, pos_weight, time_weight, max_pos, alpha,
        last_query_time, kv_offsets.numel() - 1,
    )  # fmt: skip
    alpha = 1.0 / math.sqrt(q.shape[2]) if alpha is None else float(alpha)
    if scaling_seqlen is None:
        lengths = kv_lengths if kv_lengths is not None else kv_offsets[1:] - kv_offsets[:-1]
        scaling_seqlen = int(lengths.max()) if lengths.numel() else 1
    if not float(scaling_seqlen) > 0:
        raise ValueError(f"scaling_seqlen must be > 0; got {scaling_seqlen}")
    pos_weight, time_weight, time_edges, timestamps = _bias_tensors(
        pos_weight, time_weight, timestamps, q.device
    )
    return torch.ops.hstu_attention.fwd_cached(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        kv_lengths,
        num_contexts,
        num_targets,
        int(target_group_size),
        int(window_size),
        alpha,
        1.0 / float(scaling_seqlen),
        timestamps,
        pos_weight,
        time_weight,
        time_edges,
        int(max_pos) if pos_weight is not None else 0,
        None if last_query_time is None else last_query_time.contiguous(),
        int(max_q_seqlen),
        int(max_seqlen),
        int(num_splits),
    )
