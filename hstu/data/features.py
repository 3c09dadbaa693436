"""What the models and the embedding tables need to know about a dataset's features."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FeatureInfo"]


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
