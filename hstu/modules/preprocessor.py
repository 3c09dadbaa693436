"""Turns looked-up embeddings of a `Batch` into the jagged HSTU token sequence.

Per sample the sequence is ``[ctx_1 .. ctx_F, hist_1 .. hist_h, cand_1 .. cand_k]``:
contextual tokens (one per contextual feature), history tokens (item + action + position
embeddings) and candidate tokens (item + position embeddings; every candidate gets position h, so
candidates are interchangeable and never see each other's actions). The attention treats the
first F tokens as contextual and the last k as targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.modules.hstu_layer import AttentionInputs

__all__ = ["SequenceLayout", "SequencePreprocessor"]


@dataclass
class SequenceLayout:
    """Where each item token of the batch landed in the jagged [T, D] sequence."""

    attn: AttentionInputs
    item_dest: torch.Tensor  # [N_items] row in x of each item token (history then candidates)
    item_sample: torch.Tensor  # [N_items] sample index of each item token
    item_pos: torch.Tensor  # [N_items] position of the item inside its sample's item list
    is_history: torch.Tensor  # [N_items] bool
    history_lengths: torch.Tensor  # [B]
    num_tokens: int


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
    ) -> None:
        super().__init__()
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

    def forward(
        self,
        batch: Batch,
        contextual: list[torch.Tensor],
        items: JaggedTensor,
    ) -> tuple[torch.Tensor, SequenceLayout]:
        """contextual: F tensors [B, D]; items: jagged item embeddings (history + candidates)."""
        device = items.values().device
        b = batch.batch_size
        f = self.num_contextual
        item_lengths = items.lengths().long()
        hist_lengths = batch.features[ACTION_FEATURE].lengths().long().to(device)
        num_cand = batch.num_candidates.long().to(device)
        seq_lengths = item_lengths + f
        offsets = torch.zeros(b + 1, dtype=torch.long, device=device)
        offsets[1:] = torch.cumsum(seq_lengths, 0)
        num_tokens = int(offsets[-1])
        max_seqlen = int(seq_lengths.max()) if b > 0 else 0
        needed = int((hist_lengths + (num_cand > 0).long()).max()) if b > 0 else 0
        if needed > self.max_positions:
            raise ValueError(
                f"a sample needs {needed} positions (history + 1 for its candidates) but the model "
                f"has {self.max_positions} (NetworkArgs.num_position_embeddings, default "
                f"DatasetArgs.max_history_seqlen + 1)"
            )

        item_offsets = torch.zeros(b + 1, dtype=torch.long, device=device)
        item_offsets[1:] = torch.cumsum(item_lengths, 0)
        n_items = int(item_offsets[-1])
        sample = torch.repeat_interleave(torch.arange(b, device=device), item_lengths)
        pos = torch.arange(n_items, device=device) - item_offsets[:-1][sample]
        is_hist = pos < hist_lengths[sample]
        dest = offsets[:-1][sample] + f + pos

        values = items.values()
        pos_ids = torch.minimum(pos, hist_lengths[sample]).clamp(max=self.max_positions - 1)
        scaled = values * self.item_scale if self.item_scale != 1.0 else values
        tok = scaled + self.position_embedding(pos_ids)
        actions = batch.features[ACTION_FEATURE].values().to(device)
        bits = (actions.view(-1, 1) >> torch.arange(self.num_action_bits, device=device)) & 1
        action_tok = bits.to(values.dtype) @ self.action_embedding + self.history_embedding
        tok = tok.index_put((is_hist.nonzero().squeeze(1),), action_tok, accumulate=True)

        x = values.new_zeros((num_tokens, self.hidden_size))
        x = x.index_copy(0, dest, tok)
        for i, ctx in enumerate(contextual):
            x = x.index_copy(0, offsets[:-1] + i, ctx)
        x = self.dropout(x)
        attn = AttentionInputs(
            seq_offsets=offsets,
            max_seqlen=max_seqlen,
            num_contexts=torch.full((b,), f, dtype=torch.long, device=device) if f > 0 else None,
            num_targets=num_cand if bool((num_cand > 0).any()) else None,
        )
        layout = SequenceLayout(
            attn=attn,
            item_dest=dest,
            item_sample=sample,
            item_pos=pos,
            is_history=is_hist,
            history_lengths=hist_lengths,
            num_tokens=num_tokens,
        )
        return x, layout


def item_values(batch: Batch) -> torch.Tensor:
    """Raw item ids (history then candidates, per sample) of the batch."""
    return batch.features[ITEM_FEATURE].values()
