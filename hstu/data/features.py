"""What the models and the embedding tables need to know about a dataset's features."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FeatureInfo", "TIMESTAMPED_DATASETS", "require_timestamps"]

# for messages: which datasets carry real per-interaction times (docs/datasets.md)
TIMESTAMPED_DATASETS = (
    "synthetic, ml-100k, ml-1m, ml-20m, kuairand-pure, kuairand-1k and kuairand-27k have "
    "real timestamps; the SASRec-style files (--dataset sequences, amazon-beauty) have only "
    "the order of the file"
)


@dataclass
class FeatureInfo:
    """Sizes the model needs from the data.

    ``has_timestamps``: the dataset's interactions carry real times, so its batches have
    `Batch.timestamps` (`SequenceData.has_timestamps`); False for SASRec-style files.
    """

    contextual_feature_names: list[str]
    contextual_cardinalities: list[int]
    item_vocab_size: int
    num_action_bits: int
    max_history_seqlen: int
    max_num_candidates: int = 0
    action_names: list[str] = field(default_factory=list)
    has_timestamps: bool = False


def require_timestamps(info: FeatureInfo, setting: str) -> None:
    """ValueError naming ``setting`` when the dataset described by ``info`` has no real
    timestamps. ``setting`` is the binding that needs them, e.g.
    ``"NetworkArgs.relative_attention_bias='time'"``; a bare value (``"time"``) is taken as the
    value of ``NetworkArgs.relative_attention_bias``."""
    if info.has_timestamps:
        return
    if "." not in setting:
        setting = f"NetworkArgs.relative_attention_bias={setting!r}"
    raise ValueError(
        f"{setting} uses the time between interactions, but this dataset has no timestamps "
        f"(its batches carry none). {TIMESTAMPED_DATASETS}. Use a dataset with timestamps or "
        "NetworkArgs.relative_attention_bias='position' (or 'none')"
    )
