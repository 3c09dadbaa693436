"""What RankingGR and RetrievalGR share: embedding lookups, token sequence, HSTU encoder."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.data.batch import ITEM_FEATURE, Batch
from hstu.embeddings import TableSpec, build_embedding_collection
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import DynamicEmbeddingCollection
from hstu.embeddings.static import DenseEmbeddingCollection
from hstu.modules.hstu_layer import AttentionInputs, HSTUEncoder
from hstu.modules.preprocessor import SequenceLayout, SequencePreprocessor

__all__ = [
    "FeatureInfo",
    "GenerativeRecommender",
    "EXTRA_ITEM_FEATURE",
    "USER_ID_FEATURE",
    "DynamicTableOptions",
    "DenseTableOptions",
    "RELATIVE_ATTENTION_BIAS",
]

# NetworkArgs.relative_attention_bias: "position" = a learned bias per relative position added to
# the attention scores (the position part of Meta HSTU's relative bias; its time part needs
# timestamps, which batches do not carry)
RELATIVE_ATTENTION_BIAS = ("none", "position")

# A second feature on the item table: negatives and corpus lookups ride along with the batch so
# every call of the (possibly sharded) collection sees the same feature keys.
EXTRA_ITEM_FEATURE = "extra_item_id"
# The contextual feature whose table becomes dynamic under EmbeddingArgs.embedding_backend='dynamic'
USER_ID_FEATURE = "user_id"


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


@dataclass
class DynamicTableOptions:
    """EmbeddingArgs.embedding_backend='dynamic': the item table and the user_id table become
    `DynamicEmbeddingCollection` tables (hash-keyed, fixed capacity, optimizer fused into
    backward); the other contextual tables stay ordinary torchrec tables.

    A capacity of 0 means twice the dataset's vocabulary. ``device`` is where the unsharded
    collection is built: "cpu" (CPU development mode, the reference table) or "meta" on GPU
    (DistributedModelParallel's DynamicEmbeddingSharder builds the real shards on the GPU).
    """

    item_capacity: int = 0
    user_capacity: int = 0
    optimizer: str = "rowwise_adagrad"
    learning_rate: float = 1e-3
    initializer: str = "normal"
    init_std: float = 0.02
    eviction_policy: str = "lru"
    seed: int = 0
    device: str = "cpu"

    def init_params(self) -> dict[str, float]:
        """EmbeddingArgs.init_std as the initializer's parameter (std, half-width or value)."""
        s = float(self.init_std)
        return {
            "normal": {"std": s},
            "truncated_normal": {"std": s},
            "uniform": {"low": -s, "high": s},
            "constant": {"value": s},
        }[self.initializer]

    def config(
        self, name: str, dim: int, capacity: int, features: list[str]
    ) -> DynamicEmbeddingConfig:
        return DynamicEmbeddingConfig(
            name=name,
            embedding_dim=dim,
            capacity=capacity,
            feature_names=list(features),
            initializer=self.initializer,
            init_params=self.init_params(),
            eviction_policy=self.eviction_policy,
            optimizer=self.optimizer,
            learning_rate=self.learning_rate,
            seed=self.seed,
        )


@dataclass
class DenseTableOptions:
    """EmbeddingArgs.embedding_backend='dense': every table is a plain ``nn.Embedding`` inside the
    dense model, trained by the dense optimizer (every row, every step, as in Meta's reference
    HSTU training) and replicated by DDP instead of sharded. For small catalogues only."""

    initializer: str = "normal"
    init_std: float = 0.02


class GenerativeRecommender(nn.Module):
    """Embeddings -> jagged token sequence -> N HSTU layers."""

    uses_extra_items: bool = False

    def __init__(
        self,
        info: FeatureInfo,
        *,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dropout: float,
        target_group_size: int = 1,
        window_size: int = 0,
        alpha: float | None = None,
        scaling_seqlen: int | None = None,
        num_positions: int = 0,
        init_std: float = 0.02,
        seed: int = 0,
        fused_layer: bool = False,
        recompute_input_layernorm: bool = False,
        recompute_uvqk_silu: bool = False,
        fused_gate_kernel: str | None = None,
        attention_type: str = "hstu",
        dynamic_tables: DynamicTableOptions | None = None,
        dense_tables: DenseTableOptions | None = None,
        use_contextual_features: bool = True,
        relative_attention_bias: str = "none",
        scale_item_embeddings: bool = False,
        position_init_std: float = 0.02,
        uvqk_init_std: float = 0.0,
        final_layernorm: bool = True,
        pad_tokens: str = "auto",
    ) -> None:
        super().__init__()
        if relative_attention_bias not in RELATIVE_ATTENTION_BIAS:
            raise ValueError(
                f"NetworkArgs.relative_attention_bias={relative_attention_bias!r} is not "
                f"supported: one of {list(RELATIVE_ATTENTION_BIAS)}"
            )
        self.info = info
        self.hidden_size = hidden_size
        # contextual features the model embeds as leading tokens (all of the data's, or none)
        self.contextual_names = (
            list(info.contextual_feature_names) if use_contextual_features else []
        )
        gen = torch.Generator().manual_seed(seed)
        # fbgemm's TBE kernels need a row width that is a multiple of 4: wider rows, the first
        # hidden_size columns used (the spare columns never receive gradient). Plain nn.Embedding
        # tables (the dense backend) have no such constraint.
        # (dynamic and dense tables together: the dense ones are the contextual tables, same width)
        plain = dense_tables is not None and dynamic_tables is None
        self.table_dim = hidden_size if plain else (hidden_size + 3) // 4 * 4
        item_features = [ITEM_FEATURE] + ([EXTRA_ITEM_FEATURE] if self.uses_extra_items else [])
        cards = dict(zip(info.contextual_feature_names, info.contextual_cardinalities))
        specs = [
            TableSpec(f"ctx_{name}", max(1, cards[name]), self.table_dim, [name])
            for name in self.contextual_names
        ]
        specs.append(
            TableSpec("item_table", max(1, info.item_vocab_size), self.table_dim, item_features)
        )
        self.embedding_features = list(self.contextual_names) + item_features
        self.dynamic_features: list[str] = []
        self.dynamic_collection: DynamicEmbeddingCollection | None = None
        if dynamic_tables is not None:
            specs = self._make_dynamic(specs, dynamic_tables)
        self.table_specs = specs
        static = [s for s in specs if not s.dynamic]
        # torchrec tables (sharded by DistributedModelParallel, fused sparse optimizer) or, with
        # the dense backend, plain nn.Embedding tables that are ordinary dense parameters
        self.embedding_collection: nn.Module | None = None
        self.dense_tables: DenseEmbeddingCollection | None = None
        if dense_tables is not None:
            self.dense_tables = DenseEmbeddingCollection(
                static,
                initializer=dense_tables.initializer,
                init_std=dense_tables.init_std,
                generator=gen,
            )
        elif static:
            self.embedding_collection = build_embedding_collection(
                static, init_std=init_std, generator=gen
            )
        positions = num_positions or (info.max_history_seqlen + 1)
        self.preprocessor = SequencePreprocessor(
            hidden_size,
            info.num_action_bits,
            positions,
            len(self.contextual_names),
            dropout=dropout,
            scale_item_embeddings=scale_item_embeddings,
            position_init_std=position_init_std,
            pad_tokens=pad_tokens,
        )
        # longest token sequence: contextual tokens + history/candidate positions + candidates
        max_tokens = len(self.contextual_names) + positions + info.max_num_candidates
        self.encoder = HSTUEncoder(
            num_layers,
            hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            dropout=dropout,
            target_group_size=target_group_size,
            window_size=window_size,
            alpha=alpha,
            scaling_seqlen=scaling_seqlen,
            fused=fused_layer,
            recompute_input_layernorm=recompute_input_layernorm,
            recompute_uvqk_silu=recompute_uvqk_silu,
            gate_kernel=fused_gate_kernel,
            attention_type=attention_type,
            relative_bias_len=max_tokens if relative_attention_bias == "position" else 0,
            uvqk_init_std=uvqk_init_std,
            final_layernorm=final_layernorm,
        )
        # jagged layout of the last forward (FLOP accounting reads its sequence lengths)
        self.last_attention_inputs: AttentionInputs | None = None

    def _make_dynamic(self, specs: list[TableSpec], opts: DynamicTableOptions) -> list[TableSpec]:
        """Marks the item and user_id tables dynamic and builds their DynamicEmbeddingCollection."""
        configs, out = [], []
        for spec in specs:
            is_item = spec.name == "item_table"
            if not is_item and spec.feature_names != [USER_ID_FEATURE]:
                out.append(spec)
                continue
            requested = opts.item_capacity if is_item else opts.user_capacity
            capacity = requested or 2 * spec.num_embeddings
            out.append(
                TableSpec(
                    spec.name,
                    spec.num_embeddings,
                    self.hidden_size,
                    list(spec.feature_names),
                    dynamic=True,
                    capacity=capacity,
                )
            )
            configs.append(opts.config(spec.name, self.hidden_size, capacity, spec.feature_names))
            self.dynamic_features += list(spec.feature_names)
        self.dynamic_collection = DynamicEmbeddingCollection(configs, torch.device(opts.device))
        return out

    # ---- embeddings --------------------------------------------------------------------------
    def _lookup_features(
        self, batch: Batch | None, extra_ids: torch.Tensor | None, device
    ) -> tuple[int, dict[str, _FeatureIds]]:
        """The ids of every feature in ``self.embedding_features`` (batch features + extra ids)
        with their per-key counts taken from the host (no device->host read)."""
        n_ctx = len(self.contextual_names)
        parts: dict[str, _FeatureIds] = {}
        if batch is not None:
            kjt = batch.features
            b = batch.batch_size
            host = batch.host_batch()
            src = host.features if host is not None else kjt
            # the batch's keys: [*data contextual features, item, action]; the model keeps all
            # contextual features or none (NetworkArgs.use_contextual_features). The per-key
            # counts come from the CPU twin (or from the device KJT's cached per-key lists)
            first = len(self.info.contextual_feature_names) - n_ctx
            offset_per_key = src.offset_per_key()
            length_per_key = src.length_per_key()
            values, lengths = kjt.values(), kjt.lengths()
            host_values = host.features.values() if host is not None else None
            for i, name in enumerate(self.embedding_features[: n_ctx + 1]):
                k = first + i
                lo, n = offset_per_key[k], length_per_key[k]
                parts[name] = _FeatureIds(
                    values=values[lo : lo + n],
                    lengths=lengths[k * b : (k + 1) * b],
                    count=n,
                    host_values=None if host_values is None else host_values[lo : lo + n],
                )
        else:
            b = 1
            for name in self.embedding_features[: n_ctx + 1]:
                parts[name] = _FeatureIds(
                    values=torch.zeros(0, dtype=torch.long, device=device),
                    lengths=torch.zeros(b, dtype=torch.long, device=device),
                    count=0,
                    host_values=torch.zeros(0, dtype=torch.long),
                )
        if self.uses_extra_items:
            dtype = parts[ITEM_FEATURE].lengths.dtype
            dev = parts[ITEM_FEATURE].values.device
            extra = (
                extra_ids.long()
                if extra_ids is not None
                else torch.zeros(0, dtype=torch.long, device=dev)
            )
            extra_lengths = torch.zeros(b, dtype=dtype, device=dev)
            extra_lengths[0] = extra.numel()
            parts[EXTRA_ITEM_FEATURE] = _FeatureIds(
                values=extra.to(dev),
                lengths=extra_lengths,
                count=extra.numel(),
                host_values=extra if extra.device.type == "cpu" else None,
            )
        return b, parts

    def _lookup_kjt(
        self, batch: Batch | None, extra_ids: torch.Tensor | None, device
    ) -> KeyedJaggedTensor:
        """One KJT with exactly ``self.embedding_features`` as keys (batch features + extra ids)."""
        b, parts = self._lookup_features(batch, extra_ids, device)
        return _make_kjt(self.embedding_features, parts, b)

    def dynamic_host_ids(self, batch: Batch) -> tuple[list[str], dict[str, torch.Tensor]] | None:
        """(the dynamic tables' feature keys, their CPU ids) exactly as `lookup(batch)` hands
        them to the dynamic collection, for a CPU batch; None without dynamic tables or when the
        lookup adds ids that are not in the batch (``uses_extra_items``). `HostIdRouter` uses
        it to exchange the ids between ranks before the step."""
        if self.dynamic_collection is None or self.uses_extra_items:
            return None
        if not batch.is_on_cpu:
            raise ValueError("dynamic_host_ids takes the CPU batch (before it is moved)")
        _, parts = self._lookup_features(batch, None, batch.user_ids.device)
        dyn = [k for k in self.embedding_features if k in self.dynamic_features]
        return dyn, {k: parts[k].host_values for k in dyn if parts[k].host_values is not None}

    def lookup(
        self, batch: Batch | None, extra_ids: torch.Tensor | None = None
    ) -> dict[str, JaggedTensor]:
        """feature -> JaggedTensor of [n, hidden_size] rows (table padding columns dropped).

        The KJTs handed to the collections carry their per-key lengths and offsets (from the
        host), and the dynamic tables get the CPU ids, so no lookup step reads sizes back from
        the GPU (torchrec's own sharded input dist still may, see docs/architecture.md)."""
        device = batch.user_ids.device if batch is not None else extra_ids.device
        b, parts = self._lookup_features(batch, extra_ids, device)
        static_collection = (
            self.dense_tables if self.dense_tables is not None else self.embedding_collection
        )
        keys = self.embedding_features
        known = {k: parts[k].host_values for k in keys if parts[k].host_values is not None}

        def static_lookup(names: list[str]) -> dict[str, JaggedTensor]:
            kjt = _make_kjt(names, parts, b)
            if self.dense_tables is None:
                return static_collection(kjt)
            # plain tables check their id range on the CPU ids (no device read)
            return self.dense_tables(kjt, host_ids={k: known[k] for k in names if k in known})

        if self.dynamic_collection is None:
            out = static_lookup(keys)
        else:
            dyn = [k for k in keys if k in self.dynamic_features]
            static = [k for k in keys if k not in self.dynamic_features]
            out = {}
            if static:
                out.update(static_lookup(static))
            host_ids = {k: known[k] for k in dyn if k in known}
            kwargs = {}
            route = getattr(batch, "dynamic_route", None) if extra_ids is None else None
            if route is not None:  # the ids' exchange between ranks, made ahead of the step
                kwargs["route"] = route
            out.update(
                self.dynamic_collection(_make_kjt(dyn, parts, b), host_ids=host_ids, **kwargs)
            )
        if self.table_dim == self.hidden_size:
            return out
        return {
            k: JaggedTensor(values=jt.values()[:, : self.hidden_size], lengths=jt.lengths())
            for k, jt in out.items()
        }

    # ---- encoder -----------------------------------------------------------------------------
    def encode(self, batch: Batch, extra_ids: torch.Tensor | None = None):
        """Returns (encoder output [T, D], layout, item embeddings [N_items, D], extra emb or None)."""
        with record_function("hstu/lookup"):
            emb = self.lookup(batch, extra_ids)
        contextual = [emb[name].values() for name in self.contextual_names]
        items = emb[ITEM_FEATURE]
        with record_function("hstu/preprocess"):
            x, layout = self.preprocessor(batch, contextual, items)
        self.last_attention_inputs = layout.attn
        with record_function("hstu/encoder"):
            y = self.encoder(x, layout.attn)
        extra = emb[EXTRA_ITEM_FEATURE].values() if self.uses_extra_items else None
        return y, layout, items.values(), extra


def gather_outputs(y: torch.Tensor, layout: SequenceLayout, index: torch.Tensor) -> torch.Tensor:
    """Encoder outputs at the item tokens ``index`` (positions in the batch's item list, e.g.
    `SequenceLayout.candidate_index`). Indices, not a boolean mask: selecting by mask needs the
    number of selected rows on the host, a host<->GPU sync."""
    if index.dtype == torch.bool:
        raise TypeError(
            "gather_outputs takes item indices (e.g. layout.candidate_index), not a boolean mask"
        )
    return y.index_select(0, layout.item_dest.index_select(0, index))


@dataclass
class _FeatureIds:
    """One feature's ids for a lookup: device values and [B] lengths, the value count (a host
    int) and, when known, the same values on the CPU."""

    values: torch.Tensor
    lengths: torch.Tensor
    count: int
    host_values: torch.Tensor | None


def _make_kjt(keys: list[str], parts: dict[str, _FeatureIds], stride: int) -> KeyedJaggedTensor:
    """KJT of ``keys`` (in that order) built with its per-key lengths and offsets given, so that
    torchrec never computes them from the device lengths (a ``.tolist()`` sync)."""
    sel = [parts[k] for k in keys]
    counts = [p.count for p in sel]
    offset_per_key = [0]
    for c in counts:
        offset_per_key.append(offset_per_key[-1] + c)
    values = sel[0].values.long() if len(sel) == 1 else torch.cat([p.values.long() for p in sel])
    lengths = sel[0].lengths if len(sel) == 1 else torch.cat([p.lengths for p in sel])
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=lengths,
        stride=stride,
        length_per_key=counts,
        offset_per_key=offset_per_key,
    )
