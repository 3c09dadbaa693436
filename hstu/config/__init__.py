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
from hstu.config.gin_utils import (
    CONFIG_FILENAME,
    TASKS,
    ConfigError,
    RunConfig,
    default_config_file,
    load_config,
    split_bindings,
)

__all__ = [
    "ARG_CLASSES",
    "CONFIG_FILENAME",
    "TASKS",
    "ConfigError",
    "RunConfig",
    "default_config_file",
    "load_config",
    "split_bindings",
    "SUPPORTED_DATASETS",
    "DatasetArgs",
    "EmbeddingArgs",
    "NetworkArgs",
    "OptimizerArgs",
    "RankingArgs",
    "RetrievalArgs",
    "TrainerArgs",
]
