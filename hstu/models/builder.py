"""Builds RankingGR / RetrievalGR from a RunConfig and the dataset's sizes."""

from __future__ import annotations

import torch

from hstu.config.gin_utils import RunConfig
from hstu.data.sequences import SequenceData
from hstu.models.base import (
    DenseTableOptions,
    DynamicTableOptions,
    FeatureInfo,
    GenerativeRecommender,
)
from hstu.models.ranking import RankingGR
from hstu.models.retrieval import RetrievalGR

__all__ = ["feature_info", "build_model", "dynamic_table_options", "dense_table_options"]


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


def build_model(
    cfg: RunConfig, data: SequenceData, *, dynamic_device: str = "cpu"
) -> GenerativeRecommender:
    """The unsharded model, initialised deterministically from TrainerArgs.seed.

    ``dynamic_device``: where dynamic tables (EmbeddingArgs.embedding_backend='dynamic') are
    built; "meta" on GPU, where DistributedModelParallel's DynamicEmbeddingSharder creates them.
    """
    return _build_model(cfg, data, dynamic_device)


def dynamic_table_options(cfg: RunConfig, device: str = "cpu") -> DynamicTableOptions | None:
    """EmbeddingArgs -> the dynamic tables' settings (None for the torchrec backend)."""
    emb = cfg.embedding
    if emb.embedding_backend != "dynamic":
        return None
    return DynamicTableOptions(
        item_capacity=emb.item_capacity,
        user_capacity=emb.user_capacity,
        optimizer=emb.sparse_optimizer_str,
        learning_rate=emb.sparse_learning_rate or cfg.optimizer.learning_rate,
        initializer=emb.initializer,
        init_std=emb.init_std,
        eviction_policy=emb.eviction_policy,
        seed=cfg.trainer.seed,
        device=device,
    )


def dense_table_options(cfg: RunConfig) -> DenseTableOptions | None:
    """EmbeddingArgs -> the dense tables' settings: every table with embedding_backend='dense',
    the contextual tables with embedding_backend='dynamic' and contextual_tables='dense' (None
    otherwise: torchrec tables)."""
    emb = cfg.embedding
    dense_contextual = emb.embedding_backend == "dynamic" and emb.contextual_tables == "dense"
    if emb.embedding_backend != "dense" and not dense_contextual:
        return None
    return DenseTableOptions(initializer=emb.initializer, init_std=emb.init_std)


def _build_model(
    cfg: RunConfig, data: SequenceData, dynamic_device: str = "cpu"
) -> GenerativeRecommender:
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
        fused_layer=net.fused_layer,
        recompute_input_layernorm=net.recompute_input_layernorm,
        recompute_uvqk_silu=net.recompute_uvqk_silu,
        # 'auto' leaves the layer default (HSTU_FUSED_GATE_KERNEL may override it)
        fused_gate_kernel=None if net.fused_gate_kernel == "auto" else net.fused_gate_kernel,
        attention_type=net.attention_type,
        dynamic_tables=dynamic_table_options(cfg, dynamic_device),
        dense_tables=dense_table_options(cfg),
        use_contextual_features=net.use_contextual_features,
        relative_attention_bias=net.relative_attention_bias,
        scale_item_embeddings=net.scale_item_embeddings,
        position_init_std=net.position_init_std,
        uvqk_init_std=net.uvqk_init_std,
        final_layernorm=net.final_layernorm,
        pad_tokens=net.pad_tokens,
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
