"""Compiled dynamic hash table: the twin of `reference_table.py` (same functions, same semantics)
running the CUDA kernels of kernels/dynamic_embedding (ops `torch.ops.hstu_dynemb.*`)."""

from __future__ import annotations

import torch

from hstu.embeddings.reference_table import TableState

__all__ = [
    "available",
    "require_kernels",
    "bucket_of",
    "find",
    "insert",
    "gather",
    "copy_rows",
    "place_rows",
    "update",
    "erase",
    "export",
    "size",
]

_BUILD = (
    'HSTU_KERNELS=dynamic_embedding HSTU_CUDA_ARCH_LIST="8.0" python setup.py build_ext --inplace'
)
_error: Exception | None = None
try:
    import hstu._dynamic_embedding_C  # noqa: F401  (registers torch.ops.hstu_dynemb)
except Exception as e:  # ImportError, or a library built for another torch
    _error = e


def available() -> bool:
    return _error is None


def require_kernels() -> None:
    if _error is not None:
        raise RuntimeError(
            f"the dynamic embedding CUDA kernels are not built ({_error}); build them with "
            f"`{_BUILD}` (add ';9.0' to the arch list on H100), or pass backend='reference'"
        )


def _ops():
    return torch.ops.hstu_dynemb


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    return _ops().bucket_of(keys.contiguous(), num_buckets)


def find(
    state: TableState,
    query: torch.Tensor,
    touch: bool = False,
    step: int = 0,
    score_vals: torch.Tensor | None = None,
    accumulate: bool = False,
    step_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """``step_tensor`` (int64 [1] on the table's device, optional): the step the kernel reads
    instead of ``step``, so that a CUDA graph replays the step of the moment."""
    query = query.contiguous()
    if not touch:
        return _ops().find(state.keys, query)
    if score_vals is not None:
        score_vals = score_vals.to(torch.int64).contiguous()
    return _ops().find_touch(
        state.keys, state.scores, state.touched, query, score_vals, step, accumulate, step_tensor
    )


def insert(
    state: TableState,
    keys: torch.Tensor,
    seg_offsets: torch.Tensor,
    seg_buckets: torch.Tensor,
    score_vals: torch.Tensor,
    step: int,
    dim: int,
    seed: int,
    init: tuple[int, float, float, float, float],
    step_tensor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_tensor``: as in `find`."""
    kind, p0, p1, p2, p3 = init
    return _ops().insert(
        state.keys,
        state.scores,
        state.touched,
        state.values,
        keys.contiguous(),
        seg_offsets.contiguous(),
        seg_buckets.contiguous(),
        score_vals.to(torch.int64).contiguous(),
        step,
        dim,
        seed,
        kind,
        p0,
        p1,
        p2,
        p3,
        step_tensor,
    )


def gather(state: TableState, dim: int, slots: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _ops().gather(state.values, dim, slots.contiguous(), inverse.contiguous())


def copy_rows(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    for name, t in (("dst", dst), ("src", src)):
        if t.dim() != 2 or t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1] % 4:
            raise ValueError(
                f"copy_rows: {name} must be a contiguous [rows, 4k] float32 tensor, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
    if dst.shape[1] != src.shape[1] or dst_idx.shape != src_idx.shape:
        raise ValueError(
            f"copy_rows: dst rows have {dst.shape[1]} floats, src rows {src.shape[1]}; "
            f"{dst_idx.numel()} destination and {src_idx.numel()} source indices"
        )
    _ops().copy_rows(dst, dst_idx.contiguous(), src, src_idx.contiguous())


def place_rows(
    cache: torch.Tensor,
    row_keys: torch.Tensor,
    cache_slot: torch.Tensor,
    slot_row: torch.Tensor,
    free_rows: torch.Tensor,
    n_free: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    miss: torch.Tensor,
    uniq: torch.Tensor,
    dim: int,
    seed: int,
    init: tuple[int, float, float, float, float],
    counters: torch.Tensor,
) -> torch.Tensor:
    kind, p0, p1, p2, p3 = init
    return _ops().place_rows(
        cache,
        row_keys,
        cache_slot,
        slot_row,
        free_rows,
        n_free,
        host,
        slots.contiguous(),
        miss.contiguous(),
        uniq.contiguous(),
        dim,
        seed,
        kind,
        p0,
        p1,
        p2,
        p3,
        counters,
    )


def update(
    state: TableState,
    dim: int,
    uniq: torch.Tensor,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    perm: torch.Tensor,
    offsets: torch.Tensor,
    grad: torch.Tensor,
    opt: tuple[int, float, float, float, float, float],
) -> None:
    del inverse
    code, lr, b1, b2, eps, wd = opt
    _ops().update(
        state.values,
        dim,
        state.keys,
        uniq,
        slots.contiguous(),
        perm,
        offsets,
        grad.to(torch.float32).contiguous(),
        code,
        lr,
        b1,
        b2,
        eps,
        wd,
    )


def erase(state: TableState, keys: torch.Tensor) -> torch.Tensor:
    return _ops().erase(state.keys, state.scores, state.touched, keys.contiguous())


def export(state: TableState) -> torch.Tensor:
    s = _ops().export(state.keys)
    return s[torch.argsort(state.keys[s])]


def size(state: TableState) -> int:
    return int(_ops().size(state.keys))
