"""`EmbeddingStack`: every embedding table of a model behind one module.

The models ask it for embeddings (``stack(batch) -> {feature: JaggedTensor}``) and the trainer
asks it for what a run needs of the tables (sharders, sparse optimizer, checkpoint state,
statistics, the next batch's input dist); neither ever names a backend. It owns:

- the tables, by `EmbeddingArgs.embedding_backend`:
  ``torchrec``: one torchrec `EmbeddingCollection` (sharded by DistributedModelParallel, sparse
  optimizer fused into its backward); ``dynamic``: the item and ``user_id`` tables as a
  `DynamicEmbeddingCollection` (hash keyed, row-wise sharded by id), the other contextual tables
  as torchrec tables or, with ``contextual_tables='dense'``, plain tables; ``dense``: plain
  ``nn.Embedding`` tables trained by the dense optimizer and replicated by DDP;
- the lookup's KJTs, built with their per-key lengths and offsets from the host-side batch (no
  device->host read), and the padding of table rows to fbgemm's width multiple of 4;
- the checkpoint state that lives outside ``state_dict()`` (dynamic rows and their optimizer
  state) and the checks that a checkpoint was written with the same table layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.config.args import EmbeddingArgs
from hstu.config.limits import format_bytes, plain_table_states, table_memory
from hstu.data.batch import ITEM_FEATURE, Batch
from hstu.data.features import FeatureInfo
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import DynamicEmbeddingCollection
from hstu.embeddings.plain_optimizer import PlainTableOptimizer
from hstu.embeddings.sharding import (
    DynamicEmbeddingSharder,
    ShardedDynamicEmbeddingCollection,
    merge_collection_dumps,
)
from hstu.embeddings.static import (
    DenseEmbeddingCollection,
    TableSpec,
    apply_sparse_optimizer,
    build_embedding_collection,
)
from hstu.embeddings.torchrec_direct import DirectLookup

__all__ = [
    "EmbeddingStack",
    "EXTRA_ITEM_FEATURE",
    "ItemLookup",
    "USER_ID_FEATURE",
    "SparseInput",
    "format_memory_plan",
]

# A second feature on the item table: negatives and corpus lookups ride along with the batch so
# every call of the (possibly sharded) collection sees the same feature keys.
EXTRA_ITEM_FEATURE = "extra_item_id"
# The contextual feature whose table becomes dynamic under EmbeddingArgs.embedding_backend='dynamic'
USER_ID_FEATURE = "user_id"
# the checkpoint entry of the rows that live outside state_dict()
_DYNAMIC_STATE = "dynamic_embeddings"
# the prefix of the torchrec tables' rows in `EmbeddingStack.lookup_sparse` (per feature)
_TORCHREC_ROWS = "torchrec:"
# submodules whose parameters are trained by a fused sparse optimizer, not the dense one
_SPARSE_MODULES = ("embedding_collection",)
# EmbeddingArgs fields that decide how tables are stored (a checkpoint records them)
_LAYOUT_FIELDS = ("embedding_backend", "contextual_tables", "plain_table_optimizer")


@dataclass
class SparseInput:
    """The input dist of a batch's dynamic-table ids, started before its step
    (`EmbeddingStack.start_input_dist`); hand it to the model's forward with that batch."""

    features: list[str]
    counts: list[int]
    dist_input: Awaitable


@dataclass
class ItemLookup:
    """`EmbeddingStack.serving_item_lookup`: ``rows(device ids) -> [n, hidden_size]`` without
    host reads, and ``check(cpu ids)`` that raises on ids ``rows`` must not see."""

    rows: Callable[[torch.Tensor], torch.Tensor]
    check: Callable[[torch.Tensor], None]


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


def _started_dist(
    sparse_input: SparseInput, features: list[str], parts: dict[str, _FeatureIds]
) -> Awaitable:
    """The input dist of ``sparse_input`` for a lookup of ``features`` (``parts``); raises when
    it was started for other ids."""
    counts = [parts[k].count for k in features]
    if sparse_input.features != features or sparse_input.counts != counts:
        raise RuntimeError(
            f"the input dist started ahead was made for {sparse_input.features} with "
            f"{sparse_input.counts} ids, but this lookup has {features} with {counts}: "
            "it belongs to another batch"
        )
    return sparse_input.dist_input


def _init_params(initializer: str, init_std: float) -> dict[str, float]:
    """EmbeddingArgs.init_std as the initializer's parameter (std, half-width or value)."""
    s = float(init_std)
    return {
        "normal": {"std": s},
        "truncated_normal": {"std": s},
        "uniform": {"low": -s, "high": s},
        "constant": {"value": s},
    }[initializer]


class EmbeddingStack(nn.Module):
    """The tables of one model and their lookup: ``forward(batch, extra_ids) -> {feature:
    JaggedTensor of [n, hidden_size] rows}`` for the contextual features, ``item_id`` and, with
    ``extra_item_feature``, the extra item ids (negatives, corpus) under `EXTRA_ITEM_FEATURE`.

    Built on the CPU from ``seed`` (DistributedModelParallel copies the rows into its shards, so
    every world size starts from identical tables). ``device_type``: the device the run trains
    on; on "cuda" dynamic tables are built on "meta" (their sharder creates the shards on the
    GPU).
    """

    def __init__(
        self,
        info: FeatureInfo,
        args: EmbeddingArgs,
        *,
        hidden_size: int,
        sparse_learning_rate: float,
        use_contextual_features: bool = True,
        extra_item_feature: bool = False,
        seed: int = 0,
        device_type: str = "cpu",
    ) -> None:
        super().__init__()
        self.args = args
        self.info = info
        self.hidden_size = int(hidden_size)
        self.sparse_learning_rate = float(sparse_learning_rate)
        # contextual features embedded as leading tokens (all of the data's, or none)
        self.contextual_names = (
            list(info.contextual_feature_names) if use_contextual_features else []
        )
        self.extra_item_feature = bool(extra_item_feature)
        self._input_dist_ahead = False  # set by enable_input_dist_ahead
        # torchrec feature -> rows its lookups return instead (`stage_sparse`)
        self._staged_torchrec: dict[str, torch.Tensor] | None = None
        # (collection, its DirectLookup or None), decided at the first lookup
        self._direct: tuple[nn.Module, DirectLookup | None] | None = None
        backend = args.embedding_backend
        dense_static = backend == "dense" or (
            backend == "dynamic" and args.contextual_tables == "dense"
        )
        # fbgemm's TBE kernels need a row width that is a multiple of 4: wider rows, the first
        # hidden_size columns used (the spare columns never receive gradient). Plain nn.Embedding
        # tables have no such constraint (with dynamic tables beside them, the plain ones are the
        # contextual tables and keep the common width).
        self.table_dim = self.hidden_size if backend == "dense" else (hidden_size + 3) // 4 * 4
        item_features = [ITEM_FEATURE] + ([EXTRA_ITEM_FEATURE] if extra_item_feature else [])
        cards = dict(zip(info.contextual_feature_names, info.contextual_cardinalities))
        specs = [
            TableSpec(f"ctx_{name}", max(1, cards[name]), self.table_dim, [name])
            for name in self.contextual_names
        ]
        specs.append(
            TableSpec("item_table", max(1, info.item_vocab_size), self.table_dim, item_features)
        )
        self.features = list(self.contextual_names) + item_features
        self.dynamic_features: list[str] = []
        self.dynamic_collection: DynamicEmbeddingCollection | None = None
        if backend == "dynamic":
            dynamic_device = "meta" if device_type == "cuda" else "cpu"
            specs = self._make_dynamic(specs, args, seed, dynamic_device)
        self.table_specs = specs
        static = [s for s in specs if not s.dynamic]
        gen = torch.Generator().manual_seed(seed)
        self.embedding_collection: nn.Module | None = None
        self.dense_tables: DenseEmbeddingCollection | None = None
        if dense_static:
            self.dense_tables = DenseEmbeddingCollection(
                static, initializer=args.initializer, init_std=args.init_std, generator=gen
            )
        elif static:
            self.embedding_collection = build_embedding_collection(
                static, init_std=args.init_std, generator=gen
            )
        # the features of the dynamic tables and of the others (plain or torchrec), in lookup order
        self._dynamic_keys = [k for k in self.features if k in self.dynamic_features]
        self._static_keys = [k for k in self.features if k not in self.dynamic_features]

    def _make_dynamic(
        self, specs: list[TableSpec], args: EmbeddingArgs, seed: int, device: str
    ) -> list[TableSpec]:
        """Marks the item and user_id tables dynamic and builds their collection. A capacity of
        0 means twice the dataset's vocabulary."""
        configs, out = [], []
        for spec in specs:
            is_item = spec.name == "item_table"
            if not is_item and spec.feature_names != [USER_ID_FEATURE]:
                out.append(spec)
                continue
            requested = args.item_capacity if is_item else args.user_capacity
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
            configs.append(
                DynamicEmbeddingConfig(
                    name=spec.name,
                    embedding_dim=self.hidden_size,
                    capacity=capacity,
                    feature_names=list(spec.feature_names),
                    initializer=args.initializer,
                    init_params=_init_params(args.initializer, args.init_std),
                    eviction_policy=args.eviction_policy,
                    optimizer=args.sparse_optimizer_str,
                    learning_rate=self.sparse_learning_rate,
                    seed=seed,
                    storage=args.storage,
                    hbm_cache=args.hbm_cache,
                    lookup_graphs=args.dynamic_lookup_graphs,
                )
            )
            self.dynamic_features += list(spec.feature_names)
        self.dynamic_collection = DynamicEmbeddingCollection(configs, torch.device(device))
        return out

    # ---- what a run needs of the tables ----------------------------------------------------
    def sharders(self, gradient_division: bool) -> list:
        """torchrec sharders for DistributedModelParallel: ordinary tables and dynamic tables
        side by side. ``gradient_division``: torchrec's setting (the dynamic tables divide their
        summed row gradients by the world size alike)."""
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        return [
            EmbeddingCollectionSharder(),
            DynamicEmbeddingSharder(gradient_division=gradient_division),
        ]

    def configure_sparse_optimizer(self, device_type: str) -> None:
        """Fuses `EmbeddingArgs.sparse_optimizer_str` into the torchrec tables' backward (the
        dynamic tables carry theirs in their config; plain tables use the dense optimizer)."""
        if self.embedding_collection is not None:
            apply_sparse_optimizer(
                self.embedding_collection,
                self.args.sparse_optimizer_str,
                self.sparse_learning_rate,
                device_type=device_type,
            )

    def plain_table_groups(self) -> list[dict]:
        """With ``EmbeddingArgs.plain_table_optimizer='sparse'``: one param group per plain
        table for `PlainTableOptimizer` (its weight and the row width its row-wise statistics
        average over); otherwise [] (the dense optimizer trains plain tables)."""
        if self.dense_tables is None or self.args.plain_table_optimizer != "sparse":
            return []
        return [
            {"params": [table.weight], "dim": min(self.hidden_size, table.embedding_dim)}
            for table in self.dense_tables.tables.values()
        ]

    def build_plain_table_optimizer(self) -> PlainTableOptimizer | None:
        """`PlainTableOptimizer` over `plain_table_groups` (None without them): the sparse
        optimizer and learning rate of the dynamic and torchrec tables."""
        groups = self.plain_table_groups()
        if not groups:
            return None
        return PlainTableOptimizer(
            groups, self.args.sparse_optimizer_str, self.sparse_learning_rate
        )

    @property
    def has_sparse_tables(self) -> bool:
        """Whether some table is dynamic or torchrec (trained by a fused sparse optimizer in
        the backward of its rows; `lookup_sparse` looks them up)."""
        return bool(self.dynamic_features) or self.embedding_collection is not None

    @staticmethod
    def is_sparse_parameter(name: str) -> bool:
        """Whether the parameter ``name`` (a qualified name anywhere in the model) is trained by
        a fused sparse optimizer, i.e. is not for the dense optimizer."""
        parts = name.split(".")
        return any(m in parts for m in _SPARSE_MODULES)

    def checkpoint_meta(self) -> dict[str, str]:
        """The table layout a checkpoint records (resuming with another one is refused)."""
        return {k: getattr(self.args, k) for k in _LAYOUT_FIELDS}

    def check_checkpoint(self, meta: dict, state: dict, where: str) -> None:
        """Refuses a checkpoint written with another table layout, with the binding to use."""
        for name in _LAYOUT_FIELDS:
            saved, current = meta.get(name), getattr(self.args, name)
            if saved is not None and saved != current:
                raise ValueError(
                    f"{where} was written with EmbeddingArgs.{name}='{saved}' but this run uses "
                    f"'{current}'; the tables or their optimizer state are stored differently, "
                    "so resume with "
                    f"--gin-bindings \"EmbeddingArgs.{name}='{saved}'\""
                )
        saved_dynamic = _DYNAMIC_STATE in state
        if saved_dynamic != (self.dynamic_collection is not None):
            saved = "dynamic" if saved_dynamic else "torchrec"
            raise ValueError(
                f"{where} was written with EmbeddingArgs.embedding_backend='{saved}' but this run "
                f"uses '{self.args.embedding_backend}'; resume with --gin-bindings "
                f"\"EmbeddingArgs.embedding_backend='{saved}'\""
            )

    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Table state outside ``state_dict()``: this rank's dynamic rows and their optimizer
        state (empty without dynamic tables). Goes into the rank's checkpoint file as is."""
        if self.dynamic_collection is None:
            return {}
        return {_DYNAMIC_STATE: self.dynamic_collection.dump()}

    def load_checkpoint_state(self, states: list[dict]) -> None:
        """Restores `checkpoint_state` from the rank files ``states`` (one: this rank's own; all
        of them when the world size changed: each rank keeps the ids it owns)."""
        if self.dynamic_collection is None:
            return
        dumps = [s[_DYNAMIC_STATE] for s in states]
        self.dynamic_collection.load(merge_collection_dumps(dumps) if len(dumps) > 1 else dumps[0])

    def stats(self) -> dict[str, float]:
        """`<table>/<stat>` of the dynamic tables, summed over ranks when sharded (a collective
        then: every rank calls it)."""
        coll = self.dynamic_collection
        if coll is None:
            return {}
        if isinstance(coll, ShardedDynamicEmbeddingCollection):
            return coll.global_stats()
        return coll.stats()

    def lookup_graph_stats(self) -> dict[str, float]:
        """The dynamic tables' lookup graphs (`hstu.embeddings.lookup_graphs`), this rank's
        tables summed: captures, the seconds they took, replays; empty without such tables."""
        tables = getattr(self.dynamic_collection, "tables", None) or {}
        stats = [t._graphs.stats for t in tables.values() if t._graphs is not None]
        if not stats:
            return {}
        return {
            "captures": sum(g.captures for g in stats),
            "capture_seconds": sum(g.capture_seconds for g in stats),
            "replays": sum(g.replays for g in stats),
        }

    def memory_plan(
        self, world_size: int, device_type: str, dense_states: int = 2
    ) -> list[dict[str, object]]:
        """Where each table lives and what it holds: name, kind, rows (a dynamic table's
        capacity), width, bytes per rank and on all ranks, split into device memory (HBM on a
        GPU) and host memory (`hstu.config.limits.table_memory`, the formula of the start-up
        memory check), and placement. A hybrid dynamic table counts its slot directory and HBM
        cache in HBM and every row in host memory. ``dense_states``: the dense optimizer's
        states per parameter (plain tables). Logged at start (`format_memory_plan`)."""
        memory = "HBM" if device_type == "cuda" else "host memory"
        plan = []
        for spec in self.table_specs:
            storage = "hbm"
            if spec.dynamic:
                kind, rows, storage = "dynamic", spec.capacity, self.args.storage
            else:
                kind = "plain" if self.dense_tables is not None else "torchrec"
                rows = spec.num_embeddings
            states: float = dense_states
            if kind == "plain" and self.args.plain_table_optimizer == "sparse":
                states = plain_table_states(self.args.sparse_optimizer_str, spec.embedding_dim)
            mem = table_memory(
                kind,
                rows,
                spec.embedding_dim,
                sparse_optimizer=self.args.sparse_optimizer_str,
                dense_states=states,
                world_size=world_size,
                storage=storage,
                hbm_cache=self.args.hbm_cache,
            )
            per_rank, total = mem.per_rank, mem.total
            placement = "replicated on" if kind == "plain" else "row-wise over"
            where = f"{memory}, {placement} {world_size} rank(s)"
            if storage == "hybrid":
                cache = f"{mem.cache_rows:,}-row cache" if device_type == "cuda" else "cache"
                where = f"host memory + {cache} in {memory}, {placement} {world_size} rank(s)"
            plan.append(
                {
                    "table": spec.name,
                    "kind": kind,
                    "rows": rows,
                    "width": spec.embedding_dim,
                    "storage": storage,
                    "bytes": total,
                    "bytes_per_rank": per_rank,
                    "device_bytes_per_rank": mem.device if device_type == "cuda" else 0,
                    "host_bytes_per_rank": mem.host if device_type == "cuda" else per_rank,
                    "where": where,
                }
            )
        return plan

    # ---- input dist ahead of the step ------------------------------------------------------
    def enable_input_dist_ahead(self, fixed_extra_ids: bool = False) -> bool:
        """Prepares `start_input_dist` (a collective call: every rank at the same point);
        returns whether it applies: sharded dynamic tables over several ranks, and lookups
        that take their ids from the batch alone (not retrieval's sampled negatives) or, with
        ``fixed_extra_ids``, extra ids known before the step (the whole training step's CUDA
        graphs look the corpus up whole)."""
        coll = self.dynamic_collection
        if not isinstance(coll, ShardedDynamicEmbeddingCollection):
            return False
        if self.extra_item_feature and not fixed_extra_ids:
            return False
        self._input_dist_ahead = coll.enable_async_input_dist()
        return self._input_dist_ahead

    def start_input_dist(
        self, batch: Batch, extra_host_ids: torch.Tensor | None = None
    ) -> SparseInput | None:
        """Starts sending the dynamic-table ids of the CPU ``batch`` (+ the extra item ids
        ``extra_host_ids``, on the CPU) to their owner ranks (on the collection's exchange
        thread); None where `enable_input_dist_ahead` did not apply. Every rank must start the
        same sequence of batches."""
        coll = self.dynamic_collection
        if not self._input_dist_ahead:
            return None
        if not batch.is_on_cpu:
            raise ValueError("start_input_dist takes the CPU batch (before it is moved)")
        if extra_host_ids is not None and extra_host_ids.device.type != "cpu":
            raise ValueError("start_input_dist takes the extra ids on the CPU")
        b, parts = self._feature_ids(batch, extra_host_ids, batch.user_ids.device)
        dyn = self._dynamic_keys
        kjt = _make_kjt(dyn, parts, b)
        host = {k: parts[k].host_values for k in dyn}
        dist_input = coll.input_dist(coll.create_context(), kjt, host, asynchronous=True)
        return SparseInput(dyn, [parts[k].count for k in dyn], dist_input)

    def close(self) -> None:
        """Stops background work (the exchange thread of sharded dynamic tables)."""
        if isinstance(self.dynamic_collection, ShardedDynamicEmbeddingCollection):
            self.dynamic_collection.close()

    # ---- lookup ----------------------------------------------------------------------------
    def _feature_ids(
        self,
        batch: Batch | None,
        extra_ids: torch.Tensor | None,
        device,
        extra_host_ids: torch.Tensor | None = None,
    ) -> tuple[int, dict[str, _FeatureIds]]:
        """The ids of every feature in ``self.features`` (batch features + extra ids) with their
        per-key counts taken from the host (no device->host read)."""
        n_ctx = len(self.contextual_names)
        parts: dict[str, _FeatureIds] = {}
        if batch is not None:
            kjt = batch.features
            b = batch.batch_size
            host = batch.host_batch()
            src = host.features if host is not None else kjt
            # the batch's keys: [*data contextual features, item, action]; the per-key counts
            # come from the CPU twin (or from the device KJT's cached per-key lists)
            first = len(self.info.contextual_feature_names) - n_ctx
            offset_per_key = src.offset_per_key()
            length_per_key = src.length_per_key()
            values, lengths = kjt.values(), kjt.lengths()
            host_values = host.features.values() if host is not None else None
            for i, name in enumerate(self.features[: n_ctx + 1]):
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
            for name in self.features[: n_ctx + 1]:
                parts[name] = _FeatureIds(
                    values=torch.zeros(0, dtype=torch.long, device=device),
                    lengths=torch.zeros(b, dtype=torch.long, device=device),
                    count=0,
                    host_values=torch.zeros(0, dtype=torch.long),
                )
        if self.extra_item_feature:
            dtype = parts[ITEM_FEATURE].lengths.dtype
            dev = parts[ITEM_FEATURE].values.device
            extra = (
                extra_ids.long()
                if extra_ids is not None
                else torch.zeros(0, dtype=torch.long, device=dev)
            )
            # the extra ids spread evenly over the B samples: a sequence lookup's rows do not
            # depend on how its ids are split into samples, but fbgemm's forward gives each
            # sample's ids to one warp, which took 3.5 ms for Amazon Beauty's 12,101-item corpus
            # all on one sample. Fills, not `[0] = n`: that copies a CPU scalar to the device
            # (a step's CUDA graph cannot capture it)
            n = extra.numel()
            extra_lengths = torch.full((b,), n // b, dtype=dtype, device=dev)
            extra_lengths[: n % b].add_(1)
            parts[EXTRA_ITEM_FEATURE] = _FeatureIds(
                values=extra.to(dev),
                lengths=extra_lengths,
                count=n,
                host_values=extra if extra.device.type == "cpu" else extra_host_ids,
            )
        return b, parts

    def serving_item_lookup(self) -> ItemLookup | None:
        """The item rows for serving (eval): ``rows(ids)`` maps int64 item ids on the tables'
        device to their [n, hidden_size] rows, as `forward` returns them, reading nothing back
        to the host (a CUDA graph can capture it); ``check(host_ids)`` validates the same ids on
        the CPU first. None where the item table cannot (torchrec tables, hybrid storage)."""
        if ITEM_FEATURE in self.dynamic_features:
            table_of = getattr(self.dynamic_collection, "table_of", None)  # None once sharded
            table = None if table_of is None else table_of(ITEM_FEATURE)
            if table is None or not table.serves_without_sync:
                return None
            return ItemLookup(rows=table.serving_rows, check=table.check_serving_ids)
        if self.dense_tables is None:
            return None
        dense, width = self.dense_tables, self.hidden_size
        weight = dense.table_of(ITEM_FEATURE).weight
        return ItemLookup(
            rows=lambda ids: F.embedding(ids, weight)[:, :width],
            check=lambda host_ids: dense.check_ids(ITEM_FEATURE, host_ids),
        )

    def lookup_kjt(
        self, batch: Batch | None, extra_ids: torch.Tensor | None = None
    ) -> KeyedJaggedTensor:
        """One KJT with exactly ``self.features`` as keys (batch features + extra ids)."""
        device = batch.user_ids.device if batch is not None else extra_ids.device
        b, parts = self._feature_ids(batch, extra_ids, device)
        return _make_kjt(self.features, parts, b)

    def lookup_sparse(
        self,
        batch: Batch,
        extra_ids: torch.Tensor | None = None,
        extra_host_ids: torch.Tensor | None = None,
        sparse_input: SparseInput | None = None,
    ) -> dict[str, torch.Tensor]:
        """The rows that the tables trained by fused sparse optimizers give ``batch`` (+ extra
        ids) in a training lookup, exactly the ids `forward` would look them up with: dynamic
        tables under their table names, torchrec tables per feature under
        ``"torchrec:<feature>"`` ([n, table_dim]). Their backward runs the fused updates. With
        `stage_sparse` of these rows' values, `forward` then reads none of these tables (the
        whole training step's CUDA graphs: `hstu.training.step_graphs`). ``sparse_input``: the
        input dist of these ids started ahead (`start_input_dist`)."""
        b, parts = self._feature_ids(batch, extra_ids, batch.user_ids.device, extra_host_ids)
        rows: dict[str, torch.Tensor] = {}
        static = self._static_keys
        if static and self.embedding_collection is not None:
            out = self._lookup_torchrec(static, parts, b)
            rows.update({_TORCHREC_ROWS + k: out[k].values() for k in static})
        if self.dynamic_collection is not None:
            dyn = self._dynamic_keys
            host = {k: parts[k].host_values for k in dyn if parts[k].host_values is not None}
            values = {k: parts[k].values for k in dyn}
            kwargs = {}
            if sparse_input is not None:
                kwargs["dist_input"] = _started_dist(sparse_input, dyn, parts)
            rows.update(self.dynamic_collection.lookup_tables(values, host_ids=host, **kwargs))
        return rows

    def _lookup_torchrec(
        self, static: list[str], parts: dict[str, _FeatureIds], b: int
    ) -> dict[str, JaggedTensor]:
        """The torchrec tables' lookup of the features ``static``: their fbgemm modules called
        directly where `DirectLookup` applies (one rank, table-wise), else the collection."""
        direct = self._direct_lookup()
        if direct is None:
            # (a sharded collection returns an awaitable of the dict: dict() waits for it)
            return dict(self.embedding_collection(_make_kjt(static, parts, b)))
        rows = direct(lambda names: _make_kjt(names, parts, b), {k: parts[k].count for k in static})
        return {k: JaggedTensor(values=rows[k], lengths=parts[k].lengths) for k in static}

    def torchrec_lookup(self) -> str:
        """How the torchrec tables are looked up, for the run's log: "direct" (`DirectLookup`),
        "torchrec (<why not direct>)", or "" without torchrec tables."""
        ec = self.embedding_collection
        if ec is None or not self._static_keys:
            return ""
        if self._direct_lookup() is not None:
            return "direct"
        return f"torchrec ({DirectLookup.why_not(ec, self._static_keys)})"

    def _direct_lookup(self) -> DirectLookup | None:
        """`DirectLookup` of the torchrec collection as it is now (sharded by the trainer after
        this stack was built), or None where it does not apply; decided once per collection."""
        ec = self.embedding_collection
        if self._direct is None or self._direct[0] is not ec:
            self._direct = (ec, DirectLookup.of(ec, self._static_keys))
        return self._direct[1]

    def stage_sparse(self, rows: dict[str, torch.Tensor] | None) -> None:
        """Training lookups return ``rows`` (named as `lookup_sparse` names them) instead of
        reading the tables, until ``stage_sparse(None)`` (`DynamicEmbeddingTable.stage` for the
        dynamic tables; the torchrec tables are then not called at all)."""
        if rows is None:
            self._staged_torchrec = None
            if self.dynamic_collection is not None:
                self.dynamic_collection.stage(None)
            return
        torchrec_rows = {
            k[len(_TORCHREC_ROWS) :]: v for k, v in rows.items() if k.startswith(_TORCHREC_ROWS)
        }
        dynamic = {k: v for k, v in rows.items() if not k.startswith(_TORCHREC_ROWS)}
        static = self._static_keys
        if torchrec_rows and self.embedding_collection is None:
            raise KeyError(
                f"stage_sparse: rows {sorted(torchrec_rows)} for torchrec tables; there are none"
            )
        if torchrec_rows and sorted(torchrec_rows) != sorted(static):
            raise KeyError(
                f"stage_sparse: the torchrec tables' rows must name the features {static}, got "
                f"{sorted(torchrec_rows)}"
            )
        for name, r in torchrec_rows.items():
            if r.dim() != 2 or r.shape[1] != self.table_dim:
                raise ValueError(
                    f"stage_sparse: staged rows of feature {name!r} must be [n, {self.table_dim}], "
                    f"got {tuple(r.shape)}"
                )
        if dynamic and self.dynamic_collection is None:
            raise KeyError(f"stage_sparse: no dynamic tables {sorted(dynamic)}; there are none")
        if self.dynamic_collection is not None:
            self.dynamic_collection.stage(dynamic)
        self._staged_torchrec = torchrec_rows or None

    def _staged_static(
        self, static: list[str], parts: dict[str, _FeatureIds]
    ) -> dict[str, JaggedTensor]:
        """The torchrec tables' staged rows (`stage_sparse`) as `forward` returns their lookup."""
        out = {}
        for k in static:
            r = self._staged_torchrec[k]
            if r.shape[0] != parts[k].count:
                raise RuntimeError(
                    f"torchrec feature {k!r}: a lookup of {parts[k].count} ids met {r.shape[0]} "
                    "staged rows (they were staged for another batch)"
                )
            out[k] = JaggedTensor(values=r, lengths=parts[k].lengths)
        return out

    def check_host_ids(self, batch: Batch) -> None:
        """The id range checks that `forward` makes for the plain tables, on a CPU ``batch``
        alone (a CUDA graph replaying the lookup runs none of its Python)."""
        if self.dense_tables is None:
            return
        _, parts = self._feature_ids(batch, None, torch.device("cpu"))
        for name, part in parts.items():
            if part.count and name not in self.dynamic_features:
                self.dense_tables.check_ids(name, part.host_values)

    def forward(
        self,
        batch: Batch | None,
        extra_ids: torch.Tensor | None = None,
        sparse_input: SparseInput | None = None,
        extra_host_ids: torch.Tensor | None = None,
    ) -> dict[str, JaggedTensor]:
        """feature -> JaggedTensor of [n, hidden_size] rows (table padding columns dropped).
        ``extra_host_ids``: ``extra_ids`` on the CPU, where known (their range is checked there).

        The KJTs handed to the tables carry their per-key lengths and offsets (from the host),
        and the dynamic tables get the CPU ids, so no lookup step reads sizes back from the GPU
        (torchrec's own sharded input dist still may, see docs/architecture.md).
        ``sparse_input``: this batch's input dist started ahead (`start_input_dist`)."""
        device = batch.user_ids.device if batch is not None else extra_ids.device
        b, parts = self._feature_ids(batch, extra_ids, device, extra_host_ids)
        keys = self.features
        known = {k: parts[k].host_values for k in keys if parts[k].host_values is not None}
        dyn, static = self._dynamic_keys, self._static_keys
        out: dict[str, JaggedTensor] = {}
        if static and self.dense_tables is not None:
            # plain tables check their id range on the CPU ids (no device read)
            host = {k: known[k] for k in static if k in known}
            out.update(self.dense_tables(_make_kjt(static, parts, b), host_ids=host))
        elif static and self._staged_torchrec is not None:
            out.update(self._staged_static(static, parts))
        elif static:
            out.update(self._lookup_torchrec(static, parts, b))
        if dyn:
            kwargs = {}
            if sparse_input is not None:
                kwargs["dist_input"] = _started_dist(sparse_input, dyn, parts)
            host_ids = {k: known[k] for k in dyn if k in known}
            out.update(
                self.dynamic_collection(_make_kjt(dyn, parts, b), host_ids=host_ids, **kwargs)
            )
        if self.table_dim == self.hidden_size:
            return out
        return {
            k: JaggedTensor(values=jt.values()[:, : self.hidden_size], lengths=jt.lengths())
            for k, jt in out.items()
        }


def format_memory_plan(plan: list[dict[str, object]]) -> str:
    """The plan of `EmbeddingStack.memory_plan` as a small text table."""
    header = ("table", "kind", "rows", "width", "bytes", "per rank", "HBM/rank", "host/rank")
    header += ("where",)
    lines = [
        (str(r["table"]), str(r["kind"]), f"{r['rows']:,}", str(r["width"]))
        + (format_bytes(r["bytes"]), format_bytes(r["bytes_per_rank"]))
        + (format_bytes(r["device_bytes_per_rank"]), format_bytes(r["host_bytes_per_rank"]))
        + (str(r["where"]),)
        for r in plan
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)
