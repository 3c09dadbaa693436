"""The one HSTU attention entry point the models call, and the one place attention is chosen.

`attention_path` decides, from the device and two explicit requests, what runs:

- CUDA tensors: the compiled CUTLASS kernel (`hstu.ops.cuda_attention`); on a GPU without a
  built kernel the call is an error that says how to build it;
- CPU tensors: the PyTorch reference (CPU development mode only, see docs/design.md
  "Hardware policy");
- a dense attention ``bias`` tensor: the reference on any device (the kernel takes no dense
  bias). The relative attention bias (``pos_weight`` / ``time_weight`` / ``timestamps``,
  docs/design.md) is no such tensor: the kernel computes it in-kernel, so it follows the
  device like everything else;
- ``force_reference=True``: the reference on CUDA too. Only for tests and benchmarks that ask
  for it explicitly (`HSTUEncoder(reference_attention=True)`, e.g. `scripts/bench_e2e.py`'s
  reference path); no config field selects it: it is not a training option (slow and
  memory-hungry: dense [B, H, N, N] scores).

`hstu_attention` runs that choice; `compiled_attention_ops` hands the fused layer the kernel's
forward and backward ops when the choice is the kernel; `describe_attention` says what was chosen
(for `HSTUEncoder.kernel_choices()`). Nothing here reads the environment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hstu.ops import reference

# head dims the compiled kernel is instantiated for; others are zero-padded to the next one
KERNEL_HEAD_DIMS = (32, 64, 128, 256)
# what `attention_path` returns
ATTENTION_PATHS = ("cutlass", "reference")

__all__ = [
    "ATTENTION_PATHS",
    "FORCE_REFERENCE_ENV",
    "KERNEL_HEAD_DIMS",
    "attention_path",
    "compiled_attention_available",
    "compiled_attention_ops",
    "describe_attention",
    "force_reference_from_env",
    "hstu_attention",
    "hstu_attention_cached",
]

# Benchmark-only environment switch: read once at model build by the caller that builds the model
# (never here), parsed by `force_reference_from_env`, handed down as reference_attention=True.
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


def force_reference_from_env(environ: Mapping[str, str]) -> bool:
    """Parse ``HSTU_FORCE_REFERENCE_ATTENTION`` from ``environ`` (the caller passes `os.environ`
    once, at model build): "1" True, unset/""/"0" False, anything else a ValueError."""
    value = environ.get(FORCE_REFERENCE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{FORCE_REFERENCE_ENV}={value!r} is not supported: 1 (the PyTorch reference "
            "attention on CUDA too; benchmarks only) or 0/unset (the hardware policy)"
        )
    return value == "1"


def attention_path(
    device: torch.device | str, *, bias: bool = False, force_reference: bool = False
) -> str:
    """'cutlass' (the compiled kernel) or 'reference' (PyTorch) for tensors on ``device``; the
    only place that choice is made (module docstring). ``bias``: an attention bias is given."""
    if torch.device(device).type != "cuda" or bias or force_reference:
        return "reference"
    return "cutlass"


def _require_kernel() -> None:
    if not compiled_attention_available():
        raise RuntimeError(_BUILD_HINT)


def compiled_attention_ops(
    device: torch.device | str, head_dim: int, *, force_reference: bool = False
) -> tuple[Callable, Callable] | None:
    """(torch.ops.hstu_attention.fwd, .bwd) when `attention_path` picks the kernel on ``device``
    and it is instantiated for ``head_dim`` (the fused layer calls them directly and uses the
    kernel's own backward); None otherwise (the caller goes through `hstu_attention`, which
    zero-pads other head dims or runs the reference). Raises with the build command when the
    kernel is picked but not built."""
    if attention_path(device, force_reference=force_reference) != "cutlass":
        return None
    _require_kernel()
    if head_dim not in KERNEL_HEAD_DIMS:
        return None
    ops = getattr(torch.ops, "hstu_attention", None)
    if ops is None or not hasattr(ops, "fwd") or not hasattr(ops, "bwd"):
        return None
    return ops.fwd, ops.bwd


# NetworkArgs.relative_attention_bias values, as the attention report names them
_RELATIVE_BIAS_TEXT = {"position": "position", "time": "time", "position_time": "position + time"}


def describe_attention(
    device: torch.device | str,
    *,
    bias: bool = False,
    force_reference: bool = False,
    relative_bias: str = "none",
) -> str:
    """What `attention_path` picks on ``device``, with the reason, for logs (never raises):
    'cutlass', 'cutlass (not built: ...)' or 'reference (<why>)'; with a ``relative_bias``
    (NetworkArgs.relative_attention_bias) where it is computed in brackets, e.g.
    'cutlass (relative position + time bias in-kernel)'."""
    rel = _RELATIVE_BIAS_TEXT.get(relative_bias)
    if attention_path(device, bias=bias, force_reference=force_reference) == "cutlass":
        notes = [f"relative {rel} bias in-kernel"] if rel else []
        if not compiled_attention_available():
            notes.append("not built: the forward raises with the build command")
        return f"cutlass ({'; '.join(notes)})" if notes else "cutlass"
    if torch.device(device).type != "cuda":
        why = "CPU development mode"
    elif bias:
        why = "dense attention bias: the kernel takes none"
    else:
        why = "reference_attention=True: benchmarks only"
    if rel:
        why += f"; relative {rel} bias as a dense [B, H, N, N] tensor"
    return f"reference ({why})"


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
    bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    max_pos: int = 0,
    last_query_time: torch.Tensor | None = None,
    inv_scale_tensor: torch.Tensor | None = None,
    force_reference: bool = False,
) -> torch.Tensor:
    """Jagged HSTU attention; same signature and semantics as `hstu.ops.reference.hstu_attention`
    (``bias`` and the relative attention bias ``timestamps`` / ``pos_weight`` / ``time_weight``
    / ``max_pos`` included), plus ``force_reference`` (tests and benchmarks only). What runs is
    `attention_path(q.device, bias=..., force_reference=...)`: the relative attention bias runs
    in-kernel on CUDA, a dense ``bias`` only in the reference.

    With CUDA q, ``seq_offsets`` / ``num_contexts`` / ``num_targets`` may be CPU tensors (e.g.
    `AttentionInputs.kernel_metadata`): the compiled op then validates them on the host and copies
    them to the GPU without a host<->GPU sync; the reference path moves them to q's device.
    ``timestamps`` must live on q's device for the kernel. ``inv_scale_tensor`` (compiled kernel
    only): 1 / scaling_seqlen read from device memory (`hstu.ops.cuda_attention`)."""
    path = attention_path(q.device, bias=bias is not None, force_reference=force_reference)
    if inv_scale_tensor is not None and path != "cutlass":
        raise ValueError(
            "inv_scale_tensor is read by the compiled kernel only; this call runs the "
            f"{path} attention (pass scaling_seqlen instead)"
        )
    if path == "reference":
        seq_offsets, num_contexts, num_targets, timestamps, last_query_time = (
            None if t is None else t.to(q.device, non_blocking=True)
            for t in (seq_offsets, num_contexts, num_targets, timestamps, last_query_time)
        )
    kwargs = dict(
        num_contexts=num_contexts,
        num_targets=num_targets,
        target_group_size=target_group_size,
        window_size=window_size,
        alpha=alpha,
        scaling_seqlen=scaling_seqlen,
        causal=causal,
        timestamps=timestamps,
        pos_weight=pos_weight,
        time_weight=time_weight,
        max_pos=max_pos,
        last_query_time=last_query_time,
    )
    if path == "cutlass":
        _require_kernel()
        from hstu.ops.cuda_attention import hstu_attention_cuda

        kwargs["inv_scale_tensor"] = inv_scale_tensor
        return _at_kernel_head_dim(hstu_attention_cuda, q, k, v, seq_offsets, max_seqlen, **kwargs)
    return reference.hstu_attention(q, k, v, seq_offsets, max_seqlen, bias=bias, **kwargs)


def _at_kernel_head_dim(op: Callable, q, k, v, *args, **kwargs) -> torch.Tensor:
    """``op(q, k, v, *args, **kwargs)`` at a head dim the kernel is compiled for: zero columns
    change neither <q, k> nor the used output columns, so other head dims run at the next
    compiled one (alpha keeps its 1/sqrt(d) default) with the padding dropped. The relative bias
    does not depend on the head dim."""
    d = q.shape[-1]
    padded = next((h for h in KERNEL_HEAD_DIMS if h >= d), None)
    if padded is None or padded == d or v.shape[-1] != d:
        return op(q, k, v, *args, **kwargs)
    if kwargs.get("alpha") is None:
        kwargs["alpha"] = 1.0 / math.sqrt(d)
    pad = (0, padded - d)
    return op(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), *args, **kwargs)[..., :d]


# the cached kernel's largest key split (kMaxKeySplits in kernels/hstu_attention/api.cpp)
MAX_KEY_SPLITS = 64


def hstu_attention_cached(
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
    force_reference: bool = False,
) -> torch.Tensor:
    """Each sequence's last queries against its whole (cached) keys and values, forward only:
    `hstu.ops.reference.hstu_attention_cached` (semantics and arguments), on the compiled kernel
    where `attention_path` picks it (other head dims zero-padded, as in `hstu_attention`).
    ``max_q_seqlen`` / ``max_seqlen``: the compiled kernel's grid under CUDA graph capture
    (`hstu.ops.cuda_attention.hstu_attention_cached_cuda`); ignored otherwise. ``num_splits``:
    the kernel's key splits (1: none, 0: chosen per call); the reference ignores it."""
    # checked on every path, so that a setting the kernel would refuse fails on the CPU too
    if not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_KEY_SPLITS:
        raise ValueError(
            f"num_splits={num_splits!r} must be an int in [0, {MAX_KEY_SPLITS}] "
            "(1: no key splits, 0: chosen per call)"
        )
    kwargs = dict(
        kv_lengths=kv_lengths,
        num_contexts=num_contexts,
        num_targets=num_targets,
        target_group_size=target_group_size,
        window_size=window_size,
        alpha=alpha,
        scaling_seqlen=scaling_seqlen,
        timestamps=timestamps,
        pos_weight=pos_weight,
        time_weight=time_weight,
        max_pos=max_pos,
        last_query_time=last_query_time,
    )
    if attention_path(q.device, force_reference=force_reference) == "reference":
        return reference.hstu_attention_cached(q, k, v, q_offsets, kv_offsets, **kwargs)
    _require_kernel()
    kwargs.update(max_q_seqlen=max_q_seqlen, max_seqlen=max_seqlen, num_splits=num_splits)
    from hstu.ops.cuda_attention import hstu_attention_cached_cuda

    return _at_kernel_head_dim(hstu_attention_cached_cuda, q, k, v, q_offsets, kv_offsets, **kwargs)
