"""Run configuration: gin-configurable, validated dataclasses and the gin loading helpers."""

from hstu.config.args import (
    ARG_CLASSES,
    SUPPORTED_DATASETS,
    DatasetArgs,
    EmbeddingArgs,
    NetworkArgs,
    OptimizerArgs,
    RankingArgs,
    RetrievalArgs,
    TrainerArgs,
)

__all__ = [
    "ARG_CLASSES",
    "SUPPORTED_DATASETS",
    "DatasetArgs",
    "EmbeddingArgs",
    "NetworkArgs",
    "OptimizerArgs",
    "RankingArgs",
    "RetrievalArgs",
    "TrainerArgs",
]
