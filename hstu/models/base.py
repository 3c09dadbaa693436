"""What RankingGR and RetrievalGR share: embeddings -> token sequence -> HSTU encoder."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.profiler import record_function

from hstu.config.args import NetworkArgs
from hstu.data.batch import ITEM_FEATURE, Batch
from hstu.data.features import FeatureInfo, require_timestamps
from hstu.embeddings.stack import EXTRA_ITEM_FEATURE, EmbeddingStack, SparseInput
from hstu.modules.hstu_layer import AttentionInputs, HSTUEncoder
from hstu.modules.preprocessor import (
    PAD_SIZES_PER_OCTAVE,
    SequenceLayout,
    SequencePreprocessor,
)

__all__ = ["FeatureInfo", "GenerativeRecommender", "gather_outputs"]

logger = logging.getLogger(__name__)


class GenerativeRecommender(nn.Module):
    """Embeddings (an `EmbeddingStack`) -> jagged token sequence -> N HSTU layers.

    ``net``: the `NetworkArgs` as configured (their names are used as they are); the stack is
    built by the caller (`hstu.models.builder`) with ``extra_item_feature`` set to the class's
    ``uses_extra_items``. ``reference_attention``: the PyTorch reference attention on CUDA too
    (benchmarks and checks only; see `hstu.ops.attention.force_reference_from_env`)."""

    uses_extra_items: bool = False

    def __init__(
        self,
        info: FeatureInfo,
        net: NetworkArgs,
        embeddings: EmbeddingStack,
        *,
        reference_attention: bool = False,
    ) -> None:
        super().__init__()
        if embeddings.extra_item_feature != self.uses_extra_items:
            raise ValueError(
                f"{type(self).__name__} needs an EmbeddingStack built with "
                f"extra_item_feature={self.uses_extra_items}"
            )
        self.info = info
        self.net = net
        self.hidden_size = net.hidden_size
        self.embeddings = embeddings
        self.contextual_names = list(embeddings.contextual_names)
        positions = net.num_position_embeddings or (info.max_history_seqlen + 1)
        uses_time = net.relative_attention_bias in ("time", "position_time")
        if uses_time:
            require_timestamps(
                info, f"NetworkArgs.relative_attention_bias={net.relative_attention_bias!r}"
            )
        self.preprocessor = SequencePreprocessor(
            net.hidden_size,
            info.num_action_bits,
            positions,
            len(self.contextual_names),
            dropout=net.hidden_dropout,
            scale_item_embeddings=net.scale_item_embeddings,
            position_init_std=net.position_init_std,
            pad_tokens=net.pad_tokens,
            timestamps=uses_time,
            fused_tokens=net.fused_token_assembly,
        )
        # longest token sequence: contextual tokens + history/candidate positions + candidates
        max_tokens = len(self.contextual_names) + positions + info.max_num_candidates
        self.encoder = _build_encoder(net, max_tokens, reference_attention)
        # jagged layout of the last forward (FLOP accounting reads its sequence lengths)
        self.last_attention_inputs: AttentionInputs | None = None

    @property
    def table_specs(self):
        return self.embeddings.table_specs

    def lookup(self, batch: Batch | None, extra_ids: torch.Tensor | None = None):
        """feature -> JaggedTensor of [n, hidden_size] rows (`EmbeddingStack.forward`)."""
        return self.embeddings(batch, extra_ids)

    def fixed_extra_ids(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The extra item ids (device, CPU) that every training forward passes to the lookup,
        known before it runs (none here; retrieval: its negatives' corpus)."""
        return None, None

    # ---- encoder -----------------------------------------------------------------------------
    def prepare_host(self, batch: Batch, device: torch.device | str) -> None:
        """The host work of a training forward of CPU ``batch`` on ``device`` that needs only
        the batch, done ahead of its step and kept in ``batch.host_memo`` (the trainer calls it
        on the batch-prefetch thread, so it overlaps the GPU's work instead of delaying the
        step's first kernels): the preprocessor's index layout (`encode` recomputes what it
        does not find)."""
        self.preprocessor.prepare_host(batch, device)

    def encode(
        self,
        batch: Batch,
        extra_ids: torch.Tensor | None = None,
        sparse_input: SparseInput | None = None,
        extra_host_ids: torch.Tensor | None = None,
        final_norm: bool = True,
    ):
        """Returns (encoder output [T, D], layout, item embeddings [N_items, D], extra emb or
        None). ``sparse_input``: the batch's embedding input dist started ahead of the step;
        ``extra_host_ids``: ``extra_ids`` on the CPU where known (their range is checked there);
        ``final_norm=False``: the output before the encoder's final norm (the caller applies
        ``self.encoder.final`` to the rows it reads)."""
        with record_function("hstu/lookup"):
            emb = self.embeddings(batch, extra_ids, sparse_input, extra_host_ids=extra_host_ids)
        contextual = [emb[name].values() for name in self.contextual_names]
        items = emb[ITEM_FEATURE]
        # a call the encoder may replay from CUDA graphs (one pair per token count) rounds the
        # token count more coarsely, so that fewer counts occur
        graphed = self.encoder.graphed(items.values().device)
        sizes = self.encoder.graphs.pad_sizes_per_octave if graphed else PAD_SIZES_PER_OCTAVE
        with record_function("hstu/preprocess"):
            x, layout = self.preprocessor(batch, contextual, items, pad_sizes_per_octave=sizes)
        self.last_attention_inputs = layout.attn
        with record_function("hstu/encoder"):
            y = self.encoder(x, layout.attn, final_norm=final_norm)
        extra = emb[EXTRA_ITEM_FEATURE].values() if self.uses_extra_items else None
        return y, layout, items.values(), extra


def normalize_loss(total: torch.Tensor, normalizer, count: int) -> torch.Tensor:
    """``total`` divided by the loss normalizer: a float (0 or None: ``count``), or a device
    tensor (a graphed step's, in device memory: never truth-tested, that would read it back)."""
    if isinstance(normalizer, torch.Tensor):
        return total / normalizer
    return total / (normalizer if normalizer else count)


def gather_outputs(y: torch.Tensor, layout: SequenceLayout, index: torch.Tensor) -> torch.Tensor:
    """Encoder outputs at the item tokens ``index`` (positions in the batch's item list, e.g.
    `SequenceLayout.candidate_index`). Indices, not a boolean mask: selecting by mask needs the
    number of selected rows on the host, a host<->GPU sync."""
    if index.dtype == torch.bool:
        raise TypeError(
            "gather_outputs takes item indices (e.g. layout.candidate_index), not a boolean mask"
        )
    return y.index_select(0, layout.item_dest.index_select(0, index))


def _build_encoder(net: NetworkArgs, max_tokens: int, reference_attention: bool) -> HSTUEncoder:
    """The HSTU layers from `NetworkArgs` (the one place where config names meet the layers'
    argument names)."""
    return HSTUEncoder(
        net.num_layers,
        net.hidden_size,
        num_heads=net.num_attention_heads,
        head_dim=net.kv_channels,
        dropout=net.hidden_dropout,
        target_group_size=net.target_group_size,
        window_size=net.max_attn_len,
        alpha=net.attn_alpha or None,  # 0 = 1/sqrt(kv_channels)
        scaling_seqlen=net.scaling_seqlen or None,  # 0 = the batch's longest sequence
        fused=net.fused_layer,
        recompute_input_layernorm=net.recompute_input_layernorm,
        recompute_uvqk_silu=net.recompute_uvqk_silu,
        gate_kernel=net.fused_gate_kernel,
        elementwise_kernels=net.fused_elementwise_kernels,
        layernorm_kernel=net.fused_layernorm_kernel,
        stage_compile=net.fused_stage_compile,
        residual_gemm=net.fused_residual_gemm,
        kernel_backend=net.kernel_backend,
        reference_attention=reference_attention,
        cuda_graphs=net.cuda_graphs,
        cuda_graph_pad_sizes=net.cuda_graph_pad_sizes,
        attention_type=net.attention_type,
        relative_attention_bias=net.relative_attention_bias,
        # P = the longest token sequence - 1: every relative distance has its own weight
        max_relative_position=max_tokens - 1,
        num_time_buckets=net.num_time_buckets,
        relative_bias_per_head=net.relative_attention_bias_per_head,
        uvqk_init_std=net.uvqk_init_std,
        final_layernorm=net.final_layernorm,
    )
