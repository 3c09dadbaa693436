"""Builds RankingGR / RetrievalGR from a RunConfig and the dataset's sizes."""

from __future__ import annotations

import torch

from hstu.config.gin_utils import RunConfig
from hstu.data.sequences import SequenceData
from hstu.models.base import FeatureInfo, GenerativeRecommender
from hstu.models.ranking import RankingGR
from hstu.models.retrieval import RetrievalGR

__all__ = ["feature_info", "build_model", "set_attention_type"]


def feature_info(data: SequenceData, cfg: RunConfig) -> FeatureInfo:
    return FeatureInfo(
        contextual_feature_names=list(data.user_feature_names),
        contextual_cardinalities=list(data.user_feature_cardinalities),
        item_vocab_size=data.item_vocab_size,
        num_action_bits=max(1, data.num_tasks),
        max_history_seqlen=cfg.dataset.max_history_seqlen,
        max_num_candidates=cfg.dataset.max_num_candidates if cfg.task == "ranking" else 0,
        action_names=list(data.action_names),
    )


def build_model(cfg: RunConfig, data: SequenceData) -> GenerativeRecommender:
    """The unsharded model, initialised deterministically from TrainerArgs.seed."""
    model = _build_model(cfg, data)
    set_attention_type(model, cfg.network.attention_type)
    return model


def set_attention_type(model: GenerativeRecommender, attention_type: str) -> None:
    """NetworkArgs.attention_type onto every encoder layer ("softmax": the SASRec-style baseline).

    Set after construction so the models' constructors stay untouched; the attention has no
    parameters of its own, so both types start from the same seeded weights.
    """
    for layer in model.encoder.layers:
        if not hasattr(layer, "attention_type"):
            raise ValueError(
                f"NetworkArgs.attention_type={attention_type!r}: encoder layer "
                f"{type(layer).__name__} has no attention_type switch"
            )
        layer.attention_type = attention_type


def _build_model(cfg: RunConfig, data: SequenceData) -> GenerativeRecommender:
    net = cfg.network
    common = dict(
        hidden_size=net.hidden_size,
        num_layers=net.num_layers,
        num_heads=net.num_attention_heads,
        head_dim=net.kv_channels,
        dropout=net.hidden_dropout,
        target_group_size=net.target_group_size,
        window_size=net.max_attn_len,
        alpha=net.attn_alpha or None,
        scaling_seqlen=net.scaling_seqlen or None,
        num_positions=net.num_position_embeddings,
        init_std=cfg.embedding.init_std,
        seed=cfg.trainer.seed,
    )
    info = feature_info(data, cfg)
    torch.manual_seed(cfg.trainer.seed)
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
            num_tasks=r.num_tasks,
            head_hidden=head,
            head_dropout=r.prediction_head_dropout,
            task_weights=list(r.task_weights) or None,
            **common,
        )
    rt = cfg.retrieval
    return RetrievalGR(
        info,
        item_corpus=torch.from_numpy(data.item_corpus()),
        num_negatives=rt.num_negatives,
        temperature=rt.temperature,
        negative_sampling=rt.negative_sampling,
        **common,
    )
