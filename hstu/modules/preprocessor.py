"""Turns looked-up embeddings of a `Batch` into the jagged HSTU token sequence.

Per sample the sequence is ``[ctx_1 .. ctx_F, hist_1 .. hist_h, cand_1 .. cand_k]``:
contextual tokens (one per contextual feature), history tokens (item + action + position
embeddings) and candidate tokens (item + position embeddings; every candidate gets position h, so
candidates are interchangeable and never see each other's actions). The attention treats the
first F tokens as contextual and the last k as targets.

With ``timestamps=True`` (a model with a relative time bias) it also lays out one int64 time per
token (`AttentionInputs.timestamps`) from `Batch.timestamps`: items keep their own time,
contextual tokens take their sequence's first item time, padding rows 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from hstu.config.args import PAD_TOKENS
from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.graph_capture import PAD_SIZES_PER_OCTAVE, padded_token_count
from hstu.modules import token_assembly
from hstu.modules.attention_inputs import AttentionInputs

__all__ = [
    "HostLengths",
    "StaticLayout",
    "SequenceLayout",
    "SequencePreprocessor",
    "host_lengths",
    "padded_token_count",
    "segment_ranges",
]


@dataclass
class SequenceLayout:
    """Where each item token of the batch landed in the jagged [T, D] sequence.

    Device tensors, except the ``host_*`` ones (CPU copies for index sizes and counts, so that
    the models never read a size back from the GPU)."""

    attn: AttentionInputs
    item_dest: torch.Tensor  # [N_items] row in x of each item token (history then candidates)
    item_sample: torch.Tensor  # [N_items] sample index of each item token
    item_pos: torch.Tensor  # [N_items] position of the item inside its sample's item list
    is_history: torch.Tensor  # [N_items] bool
    history_lengths: torch.Tensor  # [B]
    num_tokens: int
    item_offsets: torch.Tensor | None = None  # [B+1] start of each sample's items in N_items
    candidate_index: torch.Tensor | None = None  # [N_cand] item index of each candidate, in order
    host_history_lengths: torch.Tensor | None = None  # [B] CPU int64
    host_num_candidates: torch.Tensor | None = None  # [B] CPU int64


@dataclass
class HostLengths:
    """Per-sample lengths of a batch as CPU int64 tensors (see `host_lengths`)."""

    items: torch.Tensor  # [B] history + candidates
    history: torch.Tensor  # [B]
    candidates: torch.Tensor  # [B]


def host_lengths(batch: Batch) -> HostLengths:
    """Item, history and candidate counts of ``batch`` on the CPU.

    Read from the batch's CPU twin (`Batch.host_batch`) when there is one: no device->host copy.
    A batch built directly on a GPU is copied back (one sync), with the same results."""
    src = batch.host_batch()
    if src is None:
        src = batch
    items = src.features[ITEM_FEATURE].lengths().to("cpu", torch.int64)
    history = src.features[ACTION_FEATURE].lengths().to("cpu", torch.int64)
    candidates = src.num_candidates.to("cpu", torch.int64)
    if not torch.equal(items, history + candidates):
        raise ValueError(
            "batch: each sample's item_id list must be its history items (one per action) "
            f"followed by its candidates; item counts {items.tolist()[:8]} != history "
            f"{history.tolist()[:8]} + candidates {candidates.tolist()[:8]} (first 8 samples)"
        )
    return HostLengths(items=items, history=history, candidates=candidates)


def segment_ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of ``arange(starts[s], starts[s] + counts[s])`` over s, in order.

    ``total`` must equal ``counts.sum()``; it is passed in (known on the host) so that nothing is
    read back from the device (a boolean-mask `nonzero` would sync)."""
    dev = counts.device
    seg = torch.repeat_interleave(
        torch.arange(counts.numel(), device=dev), counts, output_size=total
    )
    first = torch.cumsum(counts, 0) - counts
    return starts[seg] + (torch.arange(total, device=dev) - first[seg])


# Padding rows go into sequences of at most this many tokens (`_attention_inputs`).
PAD_SEQUENCE_TOKENS = 256

# Action words with up to this many bits get their action tokens from a table of every bit
# combination (SequencePreprocessor.action_tokens): 2^12 rows of D at most.
MAX_COMBO_BITS = 12


class SequencePreprocessor(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_action_bits: int,
        max_positions: int,
        num_contextual: int,
        dropout: float = 0.0,
        *,
        scale_item_embeddings: bool = False,
        position_init_std: float = 0.02,
        pad_tokens: str = "auto",
        timestamps: bool = False,
        fused_tokens: bool = True,
    ) -> None:
        super().__init__()
        # the token assembly by the compiled kernels where they apply (`token_assembly`)
        self.fused_tokens = bool(fused_tokens)
        # lay out per-token timestamps for the attention (a relative time bias needs them)
        self.timestamps = bool(timestamps)
        if pad_tokens not in PAD_TOKENS:
            raise ValueError(
                f"NetworkArgs.pad_tokens={pad_tokens!r} is not supported: one of {list(PAD_TOKENS)}"
            )
        self.pad_tokens = pad_tokens
        self.hidden_size = hidden_size
        self.num_action_bits = max(1, num_action_bits)
        self.num_contextual = num_contextual
        self.max_positions = max_positions
        # SASRec / Meta HSTU: item embedding * sqrt(d) + position embedding, so the item signal
        # dominates small-initialised position rows
        self.item_scale = float(hidden_size) ** 0.5 if scale_item_embeddings else 1.0
        self.action_embedding = nn.Parameter(torch.randn(self.num_action_bits, hidden_size) * 0.02)
        self.history_embedding = nn.Parameter(torch.zeros(hidden_size))
        self.position_embedding = nn.Embedding(max_positions, hidden_size)
        nn.init.normal_(self.position_embedding.weight, std=position_init_std)
        self.dropout = nn.Dropout(dropout)
        # set only while a CUDA graph of the training step is captured (`StaticLayout`)
        self.static: StaticLayout | None = None
        # the token padding rounding of the last training forward (the model picks it per call:
        # coarser where the encoder replays CUDA graphs): `prepare_host` prepares for it
        self.train_pad_sizes = PAD_SIZES_PER_OCTAVE

    def _sizes(
        self, batch: Batch, device: torch.device, pad_sizes_per_octave: int
    ) -> tuple[HostLengths, int, int, bool, int]:
        """(host lengths, tokens, longest sequence, any targets, rows of x) of ``batch``."""
        b = batch.batch_size
        host = host_lengths(batch)
        seq_host = host.items + self.num_contextual
        num_tokens = int(seq_host.sum())
        max_seqlen = int(seq_host.max()) if b > 0 else 0
        needed = int((host.history + (host.candidates > 0).long()).max()) if b > 0 else 0
        if needed > self.max_positions:
            raise ValueError(
                f"a sample needs {needed} positions (history + 1 for its candidates) but the model "
                f"has {self.max_positions} (NetworkArgs.num_position_embeddings, default "
                f"DatasetArgs.max_history_seqlen + 1)"
            )
        has_targets = bool((host.candidates > 0).any())
        pad = self.pad_tokens == "on" or (self.pad_tokens == "auto" and device.type == "cuda")
        rows = padded_token_count(num_tokens, pad_sizes_per_octave) if pad else num_tokens
        return host, num_tokens, max_seqlen, has_targets, rows

    def _memo_key(self, device: torch.device, pad_sizes_per_octave: int) -> tuple:
        """What a batch's `HostLayout` depends on besides the batch."""
        return (
            "preprocessor_layout",
            device.type,
            int(pad_sizes_per_octave),
            self.num_contextual,
            self.max_positions,
            self.pad_tokens,
            self._kernel_tokens(device),
        )

    def _kernel_tokens(self, device: torch.device) -> bool:
        """Whether a forward on ``device`` assembles x with the compiled kernels (its layout
        then carries their index arrays; `token_assembly.applies` checks each call's tensors)."""
        return (
            device.type == "cuda"
            and self.fused_tokens
            and self.num_action_bits <= MAX_COMBO_BITS
            and token_assembly.supported(self.hidden_size, self.num_action_bits)
            and token_assembly.kernel_available()
        )

    def _compute_host_layout(
        self, batch: Batch, device: torch.device, pad_sizes_per_octave: int
    ) -> HostLayout:
        """``batch``'s `HostLayout` for a forward on ``device`` (page-locked on CUDA)."""
        sizes = self._sizes(batch, device, pad_sizes_per_octave)
        pin = device.type == "cuda"
        tokens = self._kernel_tokens(device)
        return _host_layout(sizes, self.num_contextual, self.max_positions, pin, tokens)

    def prepare_host(self, batch: Batch, device: torch.device | str) -> None:
        """Computes ``batch``'s `HostLayout` for a training forward on ``device`` ahead of the
        step (at the padding rounding of the last training forward, `train_pad_sizes`) and keeps
        it in ``batch.host_memo`` (a CPU batch; the trainer calls this on the batch-prefetch
        thread, so the host work overlaps the GPU's). Writes no module state and touches no
        device. A batch it fails on is left alone: its forward computes the layout itself and
        raises the error there."""
        device = torch.device(device)
        src = batch.host_batch()
        if src is None:
            return
        sizes = self.train_pad_sizes
        try:
            prep = self._compute_host_layout(src, device, sizes)
        except Exception:  # noqa: BLE001 - the forward recomputes it and raises there
            return
        src.host_memo[self._memo_key(device, sizes)] = prep

    def _host_layout(
        self, batch: Batch, device: torch.device, pad_sizes_per_octave: int
    ) -> HostLayout:
        """``batch``'s `HostLayout`: the one `prepare_host` left in its memo, else computed."""
        src = batch.host_batch()
        if src is not None:
            prep = src.host_memo.get(self._memo_key(device, pad_sizes_per_octave))
            if prep is not None:
                return prep
        return self._compute_host_layout(batch, device, pad_sizes_per_octave)

    def host_index(
        self,
        batch: Batch,
        device: torch.device | str,
        pad_sizes_per_octave: int = PAD_SIZES_PER_OCTAVE,
    ) -> np.ndarray:
        """The int64 values that the forward of ``batch`` on ``device`` copies to the device as
        its layout's index buffer (`StaticLayout.index`), computed on the host."""
        prep = self._compute_host_layout(batch, torch.device(device), pad_sizes_per_octave)
        return prep.buffer.numpy()

    def action_tokens(self, actions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N] action words -> [N, D]: the sum of the action_embedding rows of the word's low
        num_action_bits set bits.

        Up to MAX_COMBO_BITS bits, every bit combination's sum is computed once per step (a
        [2^bits, bits] x [bits, D] product, the same shape every step) and gathered per token:
        the direct [N, bits] x [bits, D] product has a new N every step, and on the H100 cuBLAS
        spent up to ~4.5 ms of host time per step choosing a kernel for it (its weight gradient,
        [bits, N] x [N, D], ~0.35 ms more)."""
        n_bits = self.num_action_bits
        if n_bits > MAX_COMBO_BITS:
            shifts = torch.arange(n_bits, device=actions.device)
            bits = (actions.view(-1, 1) >> shifts) & 1
            return bits.to(dtype) @ self.action_embedding
        sums = token_assembly.combination_sums(self.action_embedding, dtype)  # [2^bits, D]
        return nn.functional.embedding(actions & ((1 << n_bits) - 1), sums)

    def forward(
        self,
        batch: Batch,
        contextual: list[torch.Tensor],
        items: JaggedTensor,
        pad_sizes_per_octave: int = PAD_SIZES_PER_OCTAVE,
    ) -> tuple[torch.Tensor, SequenceLayout]:
        """contextual: F tensors [B, D]; items: jagged item embeddings (history + candidates);
        ``pad_sizes_per_octave``: how finely token padding rounds (`padded_token_count`).

        Sizes, maxima and the jagged offsets handed to the attention kernel come from the batch's
        CPU twin, and so do the layout's index tensors (computed on the host, sent in one
        non-blocking copy: `_index_layout`), so the forward reads nothing back from the GPU (see
        docs/architecture.md).

        Token padding (``pad_tokens``, on CUDA by default): x gets `padded_token_count(T)` rows;
        the extra rows are zeros, grouped into trailing padding sequences of at most
        min(max_seqlen, PAD_SEQUENCE_TOKENS) tokens (the attention scaling is unchanged) with no
        contextual tokens or targets. They never mix with the batch's rows (LayerNorm and the
        linears are per row, the attention per sequence), nothing reads their outputs, so their
        gradients are exactly zero and add nothing to the weight gradients.
        `AttentionInputs.padding_sequences` counts them."""
        device = items.values().device
        # every index tensor of the layout from the host lengths, in one host->device copy;
        # computed ahead of the step on the batch-prefetch thread where it ran `prepare_host`
        if self.training:
            self.train_pad_sizes = pad_sizes_per_octave
        prep = self._host_layout(batch, device, pad_sizes_per_octave)
        host, num_tokens, max_seqlen, has_targets, rows = prep.sizes
        lay = _index_layout(prep, device, self.static)
        item_offsets, sample, pos = lay.item_offsets, lay.sample, lay.pos
        hist_lengths, dest = lay.history_lengths, lay.dest
        hist_index, cand_index, ctx_rows = lay.history_index, lay.candidate_index, lay.ctx_rows

        values = items.values()
        actions = batch.features[ACTION_FEATURE].values().to(device)
        if lay.row_src is not None and token_assembly.applies(
            values, self.position_embedding.weight, contextual
        ):
            x = self._assemble_kernel(lay, values, actions, contextual, hist_index.shape[0])
        else:
            x = self._assemble(lay, values, actions, contextual, rows, num_tokens)
        attn = lay.attn
        if self.timestamps:
            attn.timestamps = self._token_timestamps(batch, dest, ctx_rows, item_offsets, rows)
            target_ts = batch.target_timestamps
            if target_ts is not None:
                # retrieval evaluation: the last history token queries at the held-out item's
                # time (the request time), as training rows query at their next item's
                n_seq = attn.seq_offsets.numel() - 1
                last = torch.zeros(n_seq, dtype=torch.int64, device=dest.device)
                last[: target_ts.numel()] = target_ts.to(dest.device, torch.int64)
                attn.last_query_time = last
        layout = SequenceLayout(
            attn=attn,
            item_dest=dest,
            item_sample=sample,
            item_pos=pos,
            is_history=lay.is_history,
            history_lengths=hist_lengths,
            num_tokens=num_tokens,
            item_offsets=item_offsets,
            candidate_index=cand_index,
            host_history_lengths=host.history,
            host_num_candidates=host.candidates,
        )
        return x, layout

    def _assemble(
        self,
        lay: _IndexLayout,
        values: torch.Tensor,
        actions: torch.Tensor,
        contextual: list[torch.Tensor],
        rows: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """x from PyTorch ops (every device; `token_assembly` is the compiled form)."""
        hist_index = lay.history_index
        scaled = values * self.item_scale if self.item_scale != 1.0 else values
        tok = scaled + self.position_embedding(lay.position_ids)
        action_tok = self.action_tokens(actions, values.dtype) + self.history_embedding
        # in place: tok is this call's own sum (an out-of-place op copies all of it). Each history
        # row gets exactly one addition, so index_add_ (one kernel on CUDA, its atomics touching
        # distinct rows) gives index_put_'s accumulate bit for bit without its index sort and
        # bounds checks (~20 launches; in the benchmark model's profile 0.17 ms of GPU time and
        # 0.63 ms of host time a step under the stack-recording profiler); deterministic mode
        # keeps the sorted index_put_
        if torch.are_deterministic_algorithms_enabled():
            tok.index_put_((hist_index,), action_tok, accumulate=True)
        else:
            tok.index_add_(0, hist_index, action_tok)
        x = _AssembleTokens.apply(rows, num_tokens, lay.dest, lay.ctx_rows, tok, *contextual)
        return self.dropout(x)

    def _assemble_kernel(
        self,
        lay: _IndexLayout,
        values: torch.Tensor,
        actions: torch.Tensor,
        contextual: list[torch.Tensor],
        num_history: int,
    ) -> torch.Tensor:
        """x from the compiled token-assembly kernels (`token_assembly`): the same values as
        `_assemble` (bitwise without dropout), one kernel each way."""
        if actions.shape[0] != num_history:
            raise ValueError(
                f"the batch has {actions.shape[0]} action words for {num_history} history items: "
                f"the '{ACTION_FEATURE}' feature must hold one word per history item"
            )
        p = self.dropout.p if self.training else 0.0
        return token_assembly.assemble(
            lay.token_index(), values, self.item_scale, self.position_embedding.weight,
            self.action_embedding, self.history_embedding, actions.long(), contextual, p,
        )  # fmt: skip

    def _token_timestamps(
        self,
        batch: Batch,
        dest: torch.Tensor,
        ctx_rows: torch.Tensor | None,
        item_offsets: torch.Tensor,
        rows: int,
    ) -> torch.Tensor:
        """int64 [rows]: each item token's `Batch.timestamps` value, each contextual token its
        sequence's first item time (only time differences inside a sequence matter), padding
        rows 0 (masked)."""
        if batch.timestamps is None:
            raise ValueError(
                "the model has a relative time bias (NetworkArgs.relative_attention_bias='time' "
                "or 'position_time') but the batch carries no timestamps (Batch.timestamps is "
                "None: the dataset has none); use relative_attention_bias='position' or a dataset "
                "with timestamps"
            )
        device = dest.device
        n_items = dest.shape[0]
        item_ts = batch.timestamps.to(device, torch.int64)
        if item_ts.dim() != 1 or item_ts.shape[0] != n_items:
            raise ValueError(
                f"Batch.timestamps must hold one time per item_id value ({n_items}); got shape "
                f"{tuple(batch.timestamps.shape)}"
            )
        ts = torch.zeros(rows, dtype=torch.int64, device=device).index_copy(0, dest, item_ts)
        f = self.num_contextual
        b = item_offsets.numel() - 1
        if ctx_rows is not None and b > 0 and n_items > 0:
            # a sample without items gets the next sample's first time: any constant will do
            first = item_ts[item_offsets[:-1].clamp(max=n_items - 1)]
            ts = ts.index_copy(0, ctx_rows, first.repeat_interleave(f, output_size=b * f))
        return ts


class _AssembleTokens(torch.autograd.Function):
    """x [rows, D] from the item tokens and the contextual tokens in one pass: x[dest] = tok,
    x[ctx_rows[s * F + i]] = contextual[i][s], rows from num_tokens on (padding) zero. dest and
    ctx_rows together cover rows [0, num_tokens) once each. Backward gathers each source's rows
    of the gradient. Same values and gradients as zeros + one out-of-place `index_copy` per
    source, without their copies of the whole [rows, D] tensor (one per source, forward and
    backward)."""

    @staticmethod
    def forward(ctx, rows, num_tokens, dest, ctx_rows, tok, *contextual):  # type: ignore[override]
        x = tok.new_empty((rows, tok.shape[1]))
        x[num_tokens:].zero_()
        x.index_copy_(0, dest, tok)
        if contextual:
            x.index_copy_(0, ctx_rows, torch.stack(contextual, 1).view(-1, tok.shape[1]))
        ctx.save_for_backward(dest, ctx_rows)
        ctx.num_contextual = len(contextual)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dest, ctx_rows = ctx.saved_tensors
        f = ctx.num_contextual
        d_tok = grad.index_select(0, dest) if ctx.needs_input_grad[4] else None
        d_ctx: list = [None] * f
        if f and any(ctx.needs_input_grad[5:]):
            g = grad.index_select(0, ctx_rows).view(-1, f, grad.shape[1])
            d_ctx = [g[:, i] for i in range(f)]
        return (None, None, None, None, d_tok, *d_ctx)


@dataclass
class StaticLayout:
    """Device memory that a CUDA graph of the training step reads its layout from
    (`hstu.training.step_graphs`): while `SequencePreprocessor.static` holds one, the forward
    takes the index tensors as views of ``index`` (which the graph's owner fills from
    `SequencePreprocessor.host_index` before each replay) instead of copying them from the host,
    and hands the attention ``seqlen_bound`` as its longest sequence with the scaling
    1 / longest sequence read from ``inv_max_seqlen``."""

    index: torch.Tensor  # int64 [n], `host_index`'s values
    seqlen_bound: int
    inv_max_seqlen: torch.Tensor  # float32 [1]


@dataclass
class _IndexLayout:
    """The index tensors of a batch's layout on the device (views of one buffer copied from the
    host) and the attention inputs (their offsets, contexts and targets from the same buffer,
    with CPU int64 twins)."""

    item_offsets: torch.Tensor  # [B+1] sample starts in the item list
    history_lengths: torch.Tensor  # [B]
    sample: torch.Tensor  # [N_items]
    pos: torch.Tensor  # [N_items] position inside the sample's items
    is_history: torch.Tensor  # [N_items] bool
    dest: torch.Tensor  # [N_items] row in x
    position_ids: torch.Tensor  # [N_items] min(pos, h), at most max_positions - 1
    history_index: torch.Tensor  # [N_hist] item indices of the history tokens
    candidate_index: torch.Tensor  # [N_cand] item indices of the candidates
    ctx_rows: torch.Tensor | None  # [B*F] row of contextual token i of sample s at s*F + i
    # the token-assembly kernels' arrays (`token_assembly.host_token_index`), or None
    row_src: torch.Tensor | None  # [rows] item t, -1 padding, -2 - k contextual token k
    pos_order: torch.Tensor | None  # [N_items] items by position id (stable)
    pos_offsets: torch.Tensor | None  # [max_positions + 1] each position's start in pos_order
    action_index: torch.Tensor | None  # [N_items] index into the action words, -1 candidates
    attn: AttentionInputs  # the sequences plus the padding ones, with their host twins

    def token_index(self) -> token_assembly.TokenIndex:
        """The index tensors the token-assembly kernels read (a layout made with their arrays)."""
        if self.row_src is None:
            raise RuntimeError("this layout was made without the token-assembly arrays")
        return token_assembly.TokenIndex(
            row_src=self.row_src,
            pos_ids=self.position_ids,
            action_index=self.action_index,
            dest=self.dest,
            pos_order=self.pos_order,
            pos_offsets=self.pos_offsets,
            ctx_rows=self.ctx_rows if self.ctx_rows is not None else self.dest[:0],
        )


@dataclass
class HostLayout:
    """The host half of `_index_layout` for one batch: `SequencePreprocessor._sizes`' result, the
    layout's index arrays in one int64 buffer (page-locked when made for a GPU), and the
    attention's host arrays (`SequencePreprocessor._compute_host_layout`;
    `SequencePreprocessor.prepare_host` builds it ahead of the step on the batch-prefetch
    thread)."""

    sizes: tuple  # (host lengths, tokens, longest sequence, any targets, rows of x)
    buffer: torch.Tensor  # int64 [n]: the present parts of `_host_index`, concatenated
    parts: dict[str, int]  # name -> length of each present part, in buffer order
    host_attn: tuple  # (seq_offsets, contexts, targets, padding sequences)


def _host_layout(
    sizes: tuple, f: int, max_positions: int, pin: bool, tokens: bool = False
) -> HostLayout:
    """The `HostLayout` of a batch of ``sizes`` (`SequencePreprocessor._sizes`) with ``f``
    contextual tokens per sample; ``pin``: a page-locked buffer (for a copy to a GPU);
    ``tokens``: with the token-assembly kernels' arrays."""
    host, _, max_seqlen, has_targets, rows = sizes
    parts, host_attn = _host_index(host, f, rows, max_seqlen, max_positions, has_targets, tokens)
    present = {k: v for k, v in parts.items() if v is not None}
    lengths = {k: v.shape[0] for k, v in present.items()}
    buf = torch.empty(sum(lengths.values()), dtype=torch.int64, pin_memory=pin)
    np.concatenate(list(present.values()), out=buf.numpy())
    return HostLayout(sizes, buf, lengths, host_attn)


def _index_layout(
    prep: HostLayout,
    device: torch.device,
    static: StaticLayout | None = None,
) -> _IndexLayout:
    """Every index tensor of the layout, computed with NumPy from the host lengths (``prep``)
    and sent to ``device`` as one int64 buffer (pinned, non-blocking on CUDA):
    one copy instead of ~40 small device ops and their launches, and still no read back from the
    GPU. With ``static`` the tensors are views of ``static.index`` instead (filled by the caller:
    nothing is copied).

    The attention layout: the batch's sequences plus, when the rows of x exceed their token
    count, trailing padding sequences of at most min(max_seqlen, `PAD_SEQUENCE_TOKENS`) tokens
    covering the extra rows (no contextual tokens, no targets; the attention scaling unchanged).
    Short ones: the attention's work grows with the square of a sequence's length; 2048 padding
    rows in one sequence would add ~6% to the attention work of the benchmark model's batches
    (estimated from the squares of their lengths, not timed)."""
    seq_offsets, contexts, targets, n_pad = prep.host_attn
    max_seqlen = prep.sizes[2]
    sizes = list(prep.parts.values())
    if static is not None:
        if static.index.numel() != sum(sizes) or static.index.device != device:
            raise RuntimeError(
                f"the static layout buffer holds {static.index.numel()} values on "
                f"{static.index.device}; this batch's layout needs {sum(sizes)} on {device}"
            )
        on_dev = static.index
    else:
        buf = prep.buffer
        cuda = device.type == "cuda"
        on_dev = buf.to(device, non_blocking=cuda) if buf.device != device else buf
    dev = dict(zip(prep.parts, torch.split(on_dev, sizes)))
    dev["is_history"] = dev["is_history"].bool()

    attn = AttentionInputs(
        seq_offsets=dev["seq_offsets"],
        max_seqlen=max_seqlen if static is None else static.seqlen_bound,
        num_contexts=dev.get("num_contexts"),
        num_targets=dev.get("num_targets"),
        host_seq_offsets=torch.from_numpy(seq_offsets),
        host_num_contexts=None if contexts is None else torch.from_numpy(contexts),
        host_num_targets=None if targets is None else torch.from_numpy(targets),
        padding_sequences=n_pad,
        inv_max_seqlen=None if static is None else static.inv_max_seqlen,
    )
    names = [f.name for f in fields(_IndexLayout) if f.name != "attn"]
    return _IndexLayout(**{k: dev.get(k) for k in names}, attn=attn)


def _host_index(
    host: HostLengths,
    f: int,
    rows: int,
    max_seqlen: int,
    max_positions: int,
    has_targets: bool,
    tokens: bool = False,
) -> tuple[dict[str, np.ndarray | None], tuple]:
    """The layout's index arrays (name -> int64 array, None where absent, in the order of the
    device buffer) and the attention's host arrays (seq_offsets, contexts, targets, padding
    sequences) for `_index_layout`; ``tokens``: with the token-assembly kernels' arrays."""
    items = host.items.numpy().astype(np.int64, copy=False)
    hist = host.history.numpy().astype(np.int64, copy=False)
    cand = host.candidates.numpy().astype(np.int64, copy=False)
    b = items.shape[0]
    offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(items + f, out=offsets[1:])
    item_offsets = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(items, out=item_offsets[1:])
    sample = np.repeat(np.arange(b, dtype=np.int64), items)
    pos = np.arange(sample.shape[0], dtype=np.int64) - item_offsets[:-1][sample]
    hist_of = hist[sample]
    is_hist = pos < hist_of
    # the history items of a sample come first (host_lengths checks items = history +
    # candidates), so these are its first h item indices and the rest
    history_index = np.flatnonzero(is_hist).astype(np.int64, copy=False)
    candidate_index = np.flatnonzero(~is_hist).astype(np.int64, copy=False)
    dest = offsets[:-1][sample] + f + pos
    position_ids = np.minimum(np.minimum(pos, hist_of), max_positions - 1)
    ctx_rows = (offsets[:-1, None] + np.arange(f, dtype=np.int64)).reshape(-1) if f else None
    pad = rows - int(offsets[-1])
    chunk = max(1, min(max_seqlen, PAD_SEQUENCE_TOKENS))
    n_pad = -(-pad // chunk) if pad > 0 else 0
    steps = np.minimum(np.arange(1, n_pad + 1, dtype=np.int64) * chunk, pad)
    seq_offsets = np.concatenate([offsets, offsets[-1] + steps])
    zeros = np.zeros(n_pad, dtype=np.int64)
    contexts = np.concatenate([np.full(b, f, dtype=np.int64), zeros]) if f > 0 else None
    targets = np.concatenate([cand, zeros]) if has_targets else None
    parts = {
        "item_offsets": item_offsets,
        "history_lengths": hist,
        "sample": sample,
        "pos": pos,
        "is_history": is_hist.astype(np.int64),
        "dest": dest,
        "position_ids": position_ids,
        "history_index": history_index,
        "candidate_index": candidate_index,
        "ctx_rows": ctx_rows,
        "seq_offsets": seq_offsets,
        "num_contexts": contexts,
        "num_targets": targets,
    }
    if tokens:
        parts.update(
            token_assembly.host_token_index(
                rows, dest, position_ids, is_hist, ctx_rows, max_positions
            )
        )
    return parts, (seq_offsets, contexts, targets, n_pad)


def item_values(batch: Batch) -> torch.Tensor:
    """Raw item ids (history then candidates, per sample) of the batch."""
    return batch.features[ITEM_FEATURE].values()
