"""The sequence preprocessor's token assembly as one compiled kernel each way, plus its PyTorch
twin.

`SequencePreprocessor` builds the encoder input x [rows, D] from the item embeddings, the
position and action embeddings and the contextual tokens. In PyTorch that is a chain of passes
over [tokens, D] fp32 tensors: the position gather, the item + position add, the action tokens'
gather and broadcast add, their `index_add_` into the history rows, the copy into x's rows and
the dropout; the backward as many again (dropout, two row gathers, the embedding backwards with
their sorts, a reduction for the history embedding). On the benchmark model (~28k tokens, D =
1024) they took ~1.4 ms of GPU time a step in ~80 kernels (docs/benchmarks.md). Here each
direction is one kernel (kernels/layer_norm_mul_dropout/tokens_kernel.h):

- forward, per row r of x from its source (`row_src[r]`: item t, contextual token k as
  -2 - k, padding -1):
  ``x[r] = dropout((values[t] * item_scale + pos_weight[pos_ids[t]]) + act_table[code(t)])``
  where the last term is present for history items only, ``code(t)`` is the item's action word
  masked to ``num_action_bits`` and ``act_table`` is the table of every bit combination's
  action-embedding sum plus the history embedding (`SequencePreprocessor.action_tokens`' table,
  built with the same matmul here); contextual rows are copied, padding rows are zero. Every
  addition rounds as the PyTorch path rounds it, so without dropout x is bitwise the PyTorch
  path's x;
- backward, deterministic (no atomics): one work item per position (its items from a
  host-computed, stable position order) gives each item's value gradient and the position's
  gradient row as a sum in item order; history items add their gradient to the sums of their
  set action bits and of the history embedding in per-lane-group partial rows, summed in a fixed
  order. The action embedding's gradient is those per-bit sums (fp32; the PyTorch path rounds
  the combination table's gradient to the autocast dtype first).

Dropout draws its keep mask from (seed, offset, row, column) with the LayerNorm * u * dropout
kernels' Philox scheme (`layer_norm_mul_dropout.keep_mask` is the NumPy oracle), so the
backward regenerates it instead of storing it; the masks differ from torch's `nn.Dropout`
draws, with the same distribution.

The kernel runs where `applies` holds (CUDA, fp32 inputs, D a multiple of 8, the backward's
shared-memory sums fitting: `max_action_bits`); `NetworkArgs.fused_token_assembly=False`
keeps the PyTorch path everywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from hstu.modules import layer_norm_mul_dropout as lnmd

__all__ = [
    "TokenIndex",
    "applies",
    "assemble",
    "combination_sums",
    "combination_table",
    "host_token_index",
    "kernel_available",
    "max_action_bits",
    "reference_assemble",
    "supported",
]

_SMEM_BUDGET = 96 * 1024  # tokens.cu, kTokensSmemMax: the backward's action sums per block


def max_action_bits(hidden: int) -> int:
    """The widest action word whose per-bit gradient sums fit the backward's shared memory at
    width ``hidden`` (tokens.cu, `tokens_max_bits`)."""
    return _SMEM_BUDGET // (4 * hidden) - 1


@functools.cache
def kernel_available() -> bool:
    """The extension is built with the token-assembly ops (looked up once)."""
    return lnmd.load_extension() and hasattr(torch.ops.hstu_lnmd, "tokens_fwd")


def supported(hidden: int, num_action_bits: int) -> bool:
    """Whether a model of this width and action word takes the kernel (on CUDA, fp32)."""
    return hidden % 8 == 0 and 1 <= num_action_bits <= max_action_bits(hidden)


@dataclass
class TokenIndex:
    """The layout's index tensors the kernels read (int64, on the device): ``row_src`` [rows],
    ``pos_ids``, ``action_index``, ``dest``, ``pos_order`` [N_items], ``pos_offsets``
    [positions + 1], ``ctx_rows`` [B*F] (empty without contextual tokens)."""

    row_src: torch.Tensor
    pos_ids: torch.Tensor
    action_index: torch.Tensor
    dest: torch.Tensor
    pos_order: torch.Tensor
    pos_offsets: torch.Tensor
    ctx_rows: torch.Tensor


def host_token_index(
    rows: int,
    dest: np.ndarray,
    position_ids: np.ndarray,
    is_hist: np.ndarray,
    ctx_rows: np.ndarray | None,
    max_positions: int,
) -> dict[str, np.ndarray]:
    """The host arrays `TokenIndex` adds to the preprocessor's layout: each row's source, the
    items in position order (stable) with each position's start, each item's index into the
    history's action words (-1 for candidates)."""
    n = dest.shape[0]
    row_src = np.full(rows, -1, dtype=np.int64)
    row_src[dest] = np.arange(n, dtype=np.int64)
    if ctx_rows is not None and ctx_rows.shape[0]:
        row_src[ctx_rows] = -2 - np.arange(ctx_rows.shape[0], dtype=np.int64)
    pos_order = np.argsort(position_ids, kind="stable").astype(np.int64, copy=False)
    pos_offsets = np.zeros(max_positions + 1, dtype=np.int64)
    np.cumsum(np.bincount(position_ids, minlength=max_positions), out=pos_offsets[1:])
    action_index = np.where(is_hist, np.cumsum(is_hist) - 1, -1).astype(np.int64, copy=False)
    return {
        "row_src": row_src,
        "pos_order": pos_order,
        "pos_offsets": pos_offsets,
        "action_index": action_index,
    }


def applies(values: torch.Tensor, pos_weight: torch.Tensor, contextual: list) -> bool:
    """Whether this call's tensors take the kernel: CUDA, fp32 everywhere (the caller's layout
    carries the kernels' arrays only where `kernel_available` and `supported` hold)."""
    return (
        values.is_cuda
        and values.dtype == torch.float32
        and pos_weight.dtype == torch.float32
        and all(c.dtype == torch.float32 and c.device == values.device for c in contextual)
    )


def combination_sums(action_embedding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[2^bits, D]: every action-bit combination's sum of action_embedding rows, one
    [2^bits, bits] x [bits, D] matmul in ``dtype`` (under the caller's autocast, in its dtype);
    `SequencePreprocessor.action_tokens` gathers its rows per token."""
    bits = action_embedding.shape[0]
    shifts = torch.arange(bits, device=action_embedding.device)
    combos = torch.arange(1 << bits, device=action_embedding.device).view(-1, 1) >> shifts
    return (combos & 1).to(dtype) @ action_embedding


def combination_table(
    action_embedding: torch.Tensor, history_embedding: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[2^bits, D] fp32: `combination_sums` plus the history embedding, the action term of a
    history token with that code."""
    sums = combination_sums(action_embedding, dtype)
    return (sums + history_embedding).float().contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read [rows, D] fp32 tensors: last dim contiguous, a row stride that
    is a multiple of 8 and a 16-byte aligned start (a copy only when ``t`` is not already)."""
    ok = t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
    return t if ok or t.numel() == 0 else t.contiguous()


class _Tokens(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, idx: TokenIndex, drop: tuple, item_scale: float, values, pos_weight,
        action_embedding, history_embedding, actions, *contextual,
    ):  # fmt: skip
        bits, d = action_embedding.shape[0], values.shape[1]
        table = combination_table(action_embedding, history_embedding, values.dtype)
        if contextual:
            ctx_t = torch.stack(contextual, 1).view(-1, d)
        else:
            ctx_t = values.new_empty((0, d))
        p, seed, offset, seed_offset = drop
        x = torch.ops.hstu_lnmd.tokens_fwd(
            _rows(values), item_scale,
            pos_weight.contiguous(), idx.pos_ids, table, actions, idx.action_index, bits, ctx_t,
            idx.row_src, p, seed, offset, seed_offset,
        )  # fmt: skip
        ctx.idx, ctx.drop, ctx.item_scale, ctx.bits = idx, drop, item_scale, bits
        ctx.save_for_backward(actions)
        ctx.num_ctx = len(contextual)
        ctx.dtypes = (pos_weight.dtype, action_embedding.dtype, history_embedding.dtype)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (actions,) = ctx.saved_tensors
        idx, (p, seed, offset, seed_offset) = ctx.idx, ctx.drop
        grad = _rows(grad)
        d_values, d_pos, d_act, d_ctx = torch.ops.hstu_lnmd.tokens_bwd(
            grad, ctx.item_scale, idx.dest, idx.pos_order, idx.pos_offsets, actions,
            idx.action_index, ctx.bits, idx.ctx_rows, p, seed, offset, seed_offset,
        )  # fmt: skip
        dt_pos, dt_act, dt_hist = ctx.dtypes
        f = ctx.num_ctx
        d_ctx_list = []
        if f:
            per = d_ctx.view(-1, f, d_ctx.shape[1])
            d_ctx_list = [per[:, i] for i in range(f)]
        return (
            None, None, None, d_values, d_pos.to(dt_pos), d_act[: ctx.bits].to(dt_act),
            d_act[ctx.bits].to(dt_hist), None, *d_ctx_list,
        )  # fmt: skip


def assemble(
    idx: TokenIndex,
    values: torch.Tensor,
    item_scale: float,
    pos_weight: torch.Tensor,
    action_embedding: torch.Tensor,
    history_embedding: torch.Tensor,
    actions: torch.Tensor,
    contextual: list[torch.Tensor],
    p: float,
) -> torch.Tensor:
    """x [rows, D] by the kernels (module docstring), differentiable in values, pos_weight,
    action_embedding, history_embedding and the contextual tokens. ``actions``: the history
    items' action words (int64 [N_hist]); ``p``: the dropout probability (0 in evaluation).
    Each call draws its dropout seed from the default CUDA generator (inside a CUDA graph
    capture by a kernel of the graph, so each replay draws anew)."""
    dev = values.device
    seed_offset = None
    seed = offset = 0
    if p > 0.0:
        if torch.cuda.is_current_stream_capturing():
            seed_offset = lnmd.draw_seed_tensor(dev)
        else:
            seed, offset = lnmd.draw_seed(dev)
    return _Tokens.apply(
        idx, (float(p), seed, offset, seed_offset), float(item_scale), values, pos_weight,
        action_embedding, history_embedding, actions, *contextual,
    )  # fmt: skip


def reference_assemble(
    rows: int,
    values: torch.Tensor,
    item_scale: float,
    pos_weight: torch.Tensor,
    pos_ids: torch.Tensor,
    action_embedding: torch.Tensor,
    history_embedding: torch.Tensor,
    actions: torch.Tensor,
    action_index: torch.Tensor,
    dest: torch.Tensor,
    ctx_rows: torch.Tensor | None,
    contextual: list[torch.Tensor],
    p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """The PyTorch twin of `assemble` (differentiable, any device): the same x, with the same
    keep mask (`layer_norm_mul_dropout.keep_mask`) when ``p`` > 0."""
    bits = action_embedding.shape[0]
    d = values.shape[1]
    table = combination_table(action_embedding, history_embedding, values.dtype)
    scaled = values * item_scale if item_scale != 1.0 else values
    tok = scaled + pos_weight[pos_ids]
    hist = (action_index >= 0).nonzero().view(-1)
    codes = actions[action_index[hist]] & ((1 << bits) - 1)
    tok = tok.index_add(0, hist, table[codes])
    x = values.new_zeros((rows, d)).index_copy(0, dest, tok)
    if contextual:
        x = x.index_copy(0, ctx_rows, torch.stack(contextual, 1).view(-1, d))
    if p > 0.0:
        keep = lnmd.keep_mask(seed, offset, rows, d, p, device=x.device)
        _, scale = lnmd.dropout_threshold(p)
        x = x * keep.to(x.dtype) * scale
    return x
