"""What RankingGR and RetrievalGR share: embedding lookups, token sequence, HSTU encoder."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.data.batch import ITEM_FEATURE, Batch
from hstu.embeddings import TableSpec, build_embedding_collection
from hstu.modules.hstu_layer import HSTUEncoder
from hstu.modules.preprocessor import SequenceLayout, SequencePreprocessor

__all__ = ["FeatureInfo", "GenerativeRecommender", "EXTRA_ITEM_FEATURE"]

# A second feature on the item table: negatives and corpus lookups ride along with the batch so
# every call of the (possibly sharded) collection sees the same feature keys.
EXTRA_ITEM_FEATURE = "extra_item_id"


@dataclass
class FeatureInfo:
    """Sizes the model needs from the data."""

    contextual_feature_names: list[str]
    contextual_cardinalities: list[int]
    item_vocab_size: int
    num_action_bits: int
    max_history_seqlen: int
    max_num_candidates: int = 0
    action_names: list[str] = field(default_factory=list)


class GenerativeRecommender(nn.Module):
    """Embeddings -> jagged token sequence -> N HSTU layers."""

    uses_extra_items: bool = False

    def __init__(
        self,
        info: FeatureInfo,
        *,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dropout: float,
        target_group_size: int = 1,
        window_size: int = 0,
        alpha: float | None = None,
        scaling_seqlen: int | None = None,
        num_positions: int = 0,
        init_std: float = 0.02,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.info = info
        self.hidden_size = hidden_size
        gen = torch.Generator().manual_seed(seed)
        # fbgemm's TBE kernels need a row width that is a multiple of 4: wider rows, the first
        # hidden_size columns used (the spare columns never receive gradient)
        self.table_dim = (hidden_size + 3) // 4 * 4
        item_features = [ITEM_FEATURE] + ([EXTRA_ITEM_FEATURE] if self.uses_extra_items else [])
        specs = [
            TableSpec(f"ctx_{name}", max(1, card), self.table_dim, [name])
            for name, card in zip(info.contextual_feature_names, info.contextual_cardinalities)
        ]
        specs.append(
            TableSpec("item_table", max(1, info.item_vocab_size), self.table_dim, item_features)
        )
        self.table_specs = specs
        self.embedding_features = list(info.contextual_feature_names) + item_features
        self.embedding_collection = build_embedding_collection(
            specs, init_std=init_std, generator=gen
        )
        positions = num_positions or (info.max_history_seqlen + 1)
        self.preprocessor = SequencePreprocessor(
            hidden_size,
            info.num_action_bits,
            positions,
            len(info.contextual_feature_names),
            dropout=dropout,
        )
        self.encoder = HSTUEncoder(
            num_layers,
            hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            dropout=dropout,
            target_group_size=target_group_size,
            window_size=window_size,
            alpha=alpha,
            scaling_seqlen=scaling_seqlen,
        )

    # ---- embeddings --------------------------------------------------------------------------
    def _lookup_kjt(self, batch: Batch | None, extra_ids: torch.Tensor | None, device) -> KeyedJaggedTensor:
        """One KJT with exactly ``self.embedding_features`` as keys (batch features + extra ids)."""
        names = self.embedding_features
        n_ctx = len(self.info.contextual_feature_names)
        if batch is not None:
            kjt = batch.features
            b = batch.batch_size
            lengths = kjt.lengths()[: (n_ctx + 1) * b]
            values = kjt.values()[: int(lengths.sum())]
        else:
            b = 1
            lengths = torch.zeros((n_ctx + 1) * b, dtype=torch.long, device=device)
            values = torch.zeros(0, dtype=torch.long, device=device)
        if self.uses_extra_items:
            extra = (
                extra_ids.long() if extra_ids is not None
                else torch.zeros(0, dtype=torch.long, device=device)
            )
            extra_lengths = torch.zeros(b, dtype=lengths.dtype, device=lengths.device)
            extra_lengths[0] = extra.numel()
            lengths = torch.cat([lengths, extra_lengths])
            values = torch.cat([values.long(), extra.to(values.device)])
        return KeyedJaggedTensor.from_lengths_sync(keys=names, values=values.long(), lengths=lengths)

    def lookup(
        self, batch: Batch | None, extra_ids: torch.Tensor | None = None
    ) -> dict[str, JaggedTensor]:
        """feature -> JaggedTensor of [n, hidden_size] rows (table padding columns dropped)."""
        device = batch.user_ids.device if batch is not None else extra_ids.device
        out = self.embedding_collection(self._lookup_kjt(batch, extra_ids, device))
        if self.table_dim == self.hidden_size:
            return out
        return {
            k: JaggedTensor(values=jt.values()[:, : self.hidden_size], lengths=jt.lengths())
            for k, jt in out.items()
        }

    # ---- encoder -----------------------------------------------------------------------------
    def encode(self, batch: Batch, extra_ids: torch.Tensor | None = None):
        """Returns (encoder output [T, D], layout, item embeddings [N_items, D], extra emb or None)."""
        emb = self.lookup(batch, extra_ids)
        contextual = [emb[name].values() for name in self.info.contextual_feature_names]
        items = emb[ITEM_FEATURE]
        x, layout = self.preprocessor(batch, contextual, items)
        y = self.encoder(x, layout.attn)
        extra = emb[EXTRA_ITEM_FEATURE].values() if self.uses_extra_items else None
        return y, layout, items.values(), extra


def gather_outputs(y: torch.Tensor, layout: SequenceLayout, mask: torch.Tensor) -> torch.Tensor:
    """Encoder outputs at the item tokens selected by ``mask`` (in batch order)."""
    return y.index_select(0, layout.item_dest[mask])
