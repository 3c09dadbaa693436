"""Builds RankingGR / RetrievalGR from a RunConfig and the dataset's sizes."""

from __future__ import annotations

import dataclasses
import os

import torch

from hstu.config.gin_utils import RunConfig
from hstu.config.limits import DataSizes, check_run_memory
from hstu.data.features import FeatureInfo
from hstu.data.registry import SYNTHETIC_DATASET
from hstu.data.sequences import SequenceData
from hstu.embeddings.stack import EmbeddingStack
from hstu.models.base import GenerativeRecommender
from hstu.models.ranking import RankingGR
from hstu.models.retrieval import RetrievalGR
from hstu.ops.attention import force_reference_from_env

__all__ = ["feature_info", "build_model", "build_embedding_stack"]


def feature_info(data: SequenceData, cfg: RunConfig) -> FeatureInfo:
    return FeatureInfo(
        contextual_feature_names=list(data.user_feature_names),
        contextual_cardinalities=list(data.user_feature_cardinalities),
        item_vocab_size=data.item_vocab_size,
        num_action_bits=max(1, data.num_tasks),
        max_history_seqlen=cfg.dataset.max_history_seqlen,
        max_num_candidates=cfg.dataset.max_num_candidates if cfg.task == "ranking" else 0,
        action_names=list(data.action_names),
        has_timestamps=bool(data.has_timestamps),
    )


def build_embedding_stack(
    cfg: RunConfig, info: FeatureInfo, *, extra_item_feature: bool, device_type: str = "cpu"
) -> EmbeddingStack:
    """The model's tables from `EmbeddingArgs` and the dataset's features."""
    return EmbeddingStack(
        info,
        cfg.embedding,
        hidden_size=cfg.network.hidden_size,
        sparse_learning_rate=cfg.embedding.sparse_learning_rate or cfg.optimizer.learning_rate,
        use_contextual_features=cfg.network.use_contextual_features,
        extra_item_feature=extra_item_feature,
        seed=cfg.trainer.seed,
        device_type=device_type,
    )


def build_model(
    cfg: RunConfig, data: SequenceData, *, device_type: str = "cpu"
) -> GenerativeRecommender:
    """The unsharded model, initialised deterministically from TrainerArgs.seed.

    ``device_type``: the device the run trains on (the tables are built for it, see
    `EmbeddingStack`).
    """

    info = feature_info(data, cfg)
    # the one comparison switch of the attention path (benchmarks and checks only)
    reference = force_reference_from_env(os.environ)
    # sizes that cannot fit are refused here, before any table or layer is allocated
    sizes = DataSizes.of(data, source=f"dataset {cfg.dataset.dataset_name!r}")
    if cfg.dataset.dataset_name == SYNTHETIC_DATASET:
        sizes = dataclasses.replace(sizes, synthetic=True)
    check_run_memory(cfg, sizes, device_type=device_type, reference_attention=reference)
    torch.manual_seed(cfg.trainer.seed)
    cls = RankingGR if cfg.task == "ranking" else RetrievalGR
    stack = build_embedding_stack(
        cfg, info, extra_item_feature=cls.uses_extra_items, device_type=device_type
    )
    if cfg.task == "ranking":
        r = cfg.ranking
        if data.num_tasks < r.num_tasks:
            raise ValueError(
                f"RankingArgs.num_tasks={r.num_tasks} but dataset {data.name!r} has only "
                f"{data.num_tasks} action signals ({data.action_names}); set "
                f"RankingArgs.num_tasks={data.num_tasks} or fewer"
            )
        head = list(r.prediction_head_arch)
        if head and head[-1] == r.num_tasks:
            head = head[:-1]  # recsys-examples style: the last entry is the output layer
        return RankingGR(
            info,
            cfg.network,
            stack,
            num_tasks=r.num_tasks,
            head_hidden=head,
            head_dropout=r.prediction_head_dropout,
            task_weights=list(r.task_weights) or None,
            reference_attention=reference,
        )
    rt = cfg.retrieval
    return RetrievalGR(
        info,
        cfg.network,
        stack,
        item_corpus=torch.from_numpy(data.item_corpus()),
        num_negatives=rt.num_negatives,
        temperature=rt.temperature,
        negative_sampling=rt.negative_sampling,
        reference_attention=reference,
    )
