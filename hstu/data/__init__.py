"""Data: sequences, synthetic generator, samples for ranking/retrieval, batches and loaders."""

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.data.datasets import (
    RankingSamples,
    RetrievalSamples,
    Samples,
    SampleSplits,
    build_ranking_samples,
    build_retrieval_samples,
)
from hstu.data.loader import BatchIterator
from hstu.data.registry import (
    SYNTHETIC_DATASET,
    build_samples,
    load_sequence_data,
    resolve_dataset_dir,
)
from hstu.data.sequences import DATA_FILE, MANIFEST_FILE, SequenceData
from hstu.data.synthetic import (
    SYNTHETIC_ACTION_NAMES,
    SYNTHETIC_FEATURE_NAMES,
    SyntheticLatents,
    generate_synthetic,
    generate_synthetic_with_latents,
)

__all__ = [
    "ACTION_FEATURE",
    "ITEM_FEATURE",
    "Batch",
    "BatchIterator",
    "DATA_FILE",
    "MANIFEST_FILE",
    "RankingSamples",
    "RetrievalSamples",
    "SYNTHETIC_ACTION_NAMES",
    "SYNTHETIC_DATASET",
    "SYNTHETIC_FEATURE_NAMES",
    "SampleSplits",
    "Samples",
    "SequenceData",
    "SyntheticLatents",
    "build_ranking_samples",
    "build_retrieval_samples",
    "build_samples",
    "generate_synthetic",
    "generate_synthetic_with_latents",
    "load_sequence_data",
    "resolve_dataset_dir",
]
