"""`Batch`: what the data pipeline hands the models (jagged, no padding)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch", "ITEM_FEATURE", "ACTION_FEATURE"]

ITEM_FEATURE = "item_id"
ACTION_FEATURE = "action"


@dataclass
class Batch:
    """One batch of B samples.

    features: KeyedJaggedTensor with
      - one key per contextual feature (``contextual_feature_names``), exactly one value per sample;
      - ``item_id``: per sample, the history items followed by ``num_candidates`` candidate items;
      - ``action``: per sample, the action bitmask of each *history* item only (candidates'
        actions are the labels and never enter the model's input).
    num_candidates: [B] int64; zeros for retrieval.
    labels: ranking only, [sum(num_candidates)] int64 action bitmask of each candidate, in order.
    target_item_ids: retrieval evaluation only, [B] int64 held-out next item of each sample.
    user_ids: [B] int64 raw user ids (for bookkeeping, history exclusion, debugging).
    """

    features: KeyedJaggedTensor
    contextual_feature_names: list[str]
    num_candidates: torch.Tensor
    user_ids: torch.Tensor
    labels: torch.Tensor | None = None
    target_item_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.user_ids.numel())

    def item_lengths(self) -> torch.Tensor:
        return self.features[ITEM_FEATURE].lengths()

    def history_lengths(self) -> torch.Tensor:
        return self.features[ACTION_FEATURE].lengths()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        out = {}
        for f in fields(self):
            val = getattr(self, f.name)
            if isinstance(val, (torch.Tensor, KeyedJaggedTensor)):
                val = val.to(device, non_blocking=non_blocking)
            out[f.name] = val
        return Batch(**out)

    def pin_memory(self) -> Batch:
        out = {}
        for f in fields(self):
            val = getattr(self, f.name)
            if isinstance(val, (torch.Tensor, KeyedJaggedTensor)):
                val = val.pin_memory()
            out[f.name] = val
        return Batch(**out)
