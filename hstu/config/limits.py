"""Upper bounds of the size-bearing settings and the memory estimate checked before allocating.

Two kinds of checks keep a size that cannot work from reaching the allocator:

- **Bounds** (``hstu.config.args``, at config time): anything that becomes a jagged length, a
  kernel offset, a matrix dimension or an id is at most ``INT32_MAX``; loop counts and seeds fit
  an int64; ``RankingArgs.num_tasks`` fits the int64 action bitmask.
- **Memory** (:func:`estimate_memory`, at model build when the dataset's sizes are known, and for
  the synthetic generator before it runs): a simple, deliberately low estimate of what one
  process holds, compared with the memory that will hold it (:func:`available_memory`: free GPU
  memory on CUDA, ``MemAvailable`` of the host otherwise). Only a run whose low estimate exceeds
  everything available is refused, so a refusal is never a guess; ``HSTU_SKIP_MEMORY_CHECK=1``
  turns the check off (a warning) for the case where the estimate is wrong.

The estimate, per process (``world_size`` processes, ``local_world_size`` of them on this host):

- embedding tables: rows x width x 4 B x (1 + optimizer states), split over the ranks
  (torchrec and dynamic tables) or replicated with gradients (the ``dense`` backend);
  dynamic tables hold ``capacity`` rows up front;
- dense parameters: count x 4 B x (weights + gradients + dense optimizer states);
- activations: tokens x (2 hidden + 8 heads x kv_channels) x bytes per element x layers, plus
  the dense [B, heads, L, L] scores where the PyTorch reference attention runs (CPU, softmax
  attention, relative position bias);
- retrieval negatives: rows x num_negatives x 36 B (ids, indices, logits), plus their gathered
  rows when the corpus is looked up per negative, plus [rows, rows] logits for in-batch negatives;
- the dataset arrays, once per process on this host.

This module imports nothing from hstu (the data layer provides the dataset's sizes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "MAX_ITEM_ID",
    "MAX_NUM_TASKS",
    "SKIP_MEMORY_CHECK_ENV",
    "DataSizes",
    "Driver",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryTerm",
    "STORAGES",
    "TableMemory",
    "plain_table_states",
    "TableUse",
    "available_memory",
    "check_table_allocation",
    "hbm_cache_rows",
    "parse_hbm_cache",
    "table_memory",
    "dense_optimizer_states",
    "check_memory",
    "check_run_memory",
    "estimate_memory",
    "format_bytes",
    "process_counts",
    "skip_memory_check",
]

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Item ids index the item table (max id + 1 rows with the static backends): the int32 range keeps
# every id a valid row index and every size derived from it (id + 1, rows x width) far from
# overflowing int64. Prepared datasets are checked against it.
MAX_ITEM_ID = INT32_MAX
# Actions are an int64 bitmask, one bit per task (the synthetic generator's limit too).
MAX_NUM_TASKS = 62
SKIP_MEMORY_CHECK_ENV = "HSTU_SKIP_MEMORY_CHECK"

# bytes of fp32 optimizer state per table element (besides the row itself)
_SPARSE_STATES = {"sgd": 0.0, "rowwise_adagrad": 0.0, "adagrad": 1.0, "adam": 2.0}
# columns of dynamic-table optimizer state per row (hstu.embeddings.dynamic_config)
_DYNAMIC_STATE_COLS = {"sgd": 0, "rowwise_adagrad": 1}
_DYNAMIC_SLOT_BYTES = 24  # key, score, touched: int64 each
_DYNAMIC_BUCKET = 32
# where a dynamic table's rows live (EmbeddingArgs.storage): all in HBM, or all in host memory
# with the hot ones cached in HBM (hstu.embeddings.hybrid_table)
STORAGES: tuple[str, ...] = ("hbm", "hybrid")
# hybrid tables: each slot of the directory (in HBM) holds key, score, last-use step (int64) and
# the row of the HBM cache holding it (int32); each cache row records its key and slot and has a
# free-list entry (int64); the cache's index tensors have one spare entry each, and the free-row
# count is one int64 (hstu.embeddings.hybrid_table)
_HYBRID_SLOT_BYTES = _DYNAMIC_SLOT_BYTES + 4
_CACHE_ROW_META_BYTES = 24
_HYBRID_FIXED_BYTES = 4 + 3 * 8 + 8
# saved activations per token and layer, in elements: x and LayerNorm(x) (2 hidden), u, v, q, k
# and their SiLU (8 x heads x kv_channels); the gate's tensors are left out (a low estimate)
_ACT_HIDDEN, _ACT_INNER = 2, 8
# retrieval: per (row, negative): int64 offset + id + index and three fp32 logits copies
_NEGATIVE_BYTES = 36


class MemoryBudgetError(ValueError):
    """A configuration whose estimated memory exceeds what the device or host has; the message
    is one line naming the setting, the estimate, the limit and the fix."""


@dataclass(frozen=True)
class DataSizes:
    """What the estimate needs of a dataset (`SequenceData` or the synthetic generator's plan).

    ``item_rows``: rows of the item table (max item id + 1); ``num_items``: distinct items (the
    retrieval corpus); ``longest_sequence``: the longest user sequence; ``array_bytes``: the
    dataset's arrays in memory; ``source``: what the sizes come from, for messages;
    ``synthetic``: generated from ``DatasetArgs.synthetic_*`` (messages name those fields).
    """

    num_users: int
    num_interactions: int
    item_rows: int
    num_items: int
    contextual_cardinalities: tuple[int, ...]
    num_action_bits: int
    longest_sequence: int
    array_bytes: int = 0
    source: str = "the dataset"
    synthetic: bool = False
    contextual_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, data: Any, source: str = "") -> DataSizes:
        """The sizes of a loaded `SequenceData`."""
        lengths = data.lengths()
        arrays = (
            data.user_ids,
            data.offsets,
            data.item_ids,
            data.actions,
            data.timestamps,
            data.user_features,
        )
        return cls(
            num_users=int(data.num_users),
            num_interactions=int(data.num_interactions),
            item_rows=int(data.item_vocab_size),
            num_items=int(data.item_corpus().size),
            contextual_cardinalities=tuple(int(c) for c in data.user_feature_cardinalities),
            contextual_names=tuple(data.user_feature_names),
            num_action_bits=max(1, int(data.num_tasks)),
            longest_sequence=int(lengths.max()) if lengths.size else 0,
            array_bytes=int(sum(a.nbytes for a in arrays)),
            source=source or f"dataset {data.name!r}",
        )


@dataclass(frozen=True)
class Driver:
    """A setting (or dataset size) a term grows with: ``label=value``; ``default`` makes
    ``value / default`` its growth (the driver that grew most is named as the cause)."""

    label: str
    value: Any
    default: float | None = None
    fix: str = ""

    def growth(self) -> float:
        value = self.value
        if isinstance(value, (list, tuple)):  # e.g. MLP widths: the widest against 256
            value = max(value, default=0) / 256
        try:
            v = float(value)
        except (TypeError, ValueError):
            return 1.0
        return v / max(float(self.default or 1.0), 1.0)

    def text(self) -> str:
        return f"{self.label}={self.value}"


@dataclass(frozen=True)
class MemoryTerm:
    """One part of the estimate: ``bytes`` for ``what`` (``formula`` says how it is counted)."""

    what: str
    bytes: int
    formula: str
    drivers: tuple[Driver, ...] = ()

    def cause(self) -> Driver | None:
        """The driver that grew most over its default (the first one on a tie)."""
        best: Driver | None = None
        for d in self.drivers:
            if best is None or d.growth() > best.growth():
                best = d
        return best


@dataclass(frozen=True)
class TableUse:
    """One embedding table's share of a `MemoryEstimate`, for the refusal message: ``bytes`` in
    that memory (per process, times the processes of this host for host memory), the setting
    that sets its rows (``binding``), and, for a dynamic table held in HBM, ``host_bytes``: what
    its rows would take in this host's memory with ``EmbeddingArgs.storage='hybrid'``."""

    name: str
    kind: str
    rows: int
    width: int
    storage: str
    bytes: int
    world_size: int = 1
    binding: str = ""
    host_bytes: int = 0

    def describe(self) -> str:
        where = f", {self.storage}" if self.kind == "dynamic" else ""
        return f"{self.kind} table {self.name!r} ({self.rows:,} rows x {self.width}{where})"


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of one memory (``where``: "host" or "cuda"), as a sum of terms; ``tables``:
    the embedding tables' shares of it (named in a refusal)."""

    where: str
    terms: tuple[MemoryTerm, ...] = field(default_factory=tuple)
    tables: tuple[TableUse, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return int(sum(t.bytes for t in self.terms))

    def largest(self) -> MemoryTerm | None:
        return max(self.terms, key=lambda t: t.bytes) if self.terms else None

    def times(self, n: int) -> MemoryEstimate:
        """The same estimate for ``n`` processes (each holding all of it)."""
        terms = tuple(
            MemoryTerm(t.what, t.bytes * int(n), t.formula, t.drivers) for t in self.terms
        )
        tables = tuple(
            dataclasses.replace(t, bytes=t.bytes * int(n), host_bytes=t.host_bytes * int(n))
            for t in self.tables
        )
        return MemoryEstimate(self.where, terms, tables)

    def summary(self) -> str:
        parts = [f"{t.what} {format_bytes(t.bytes)}" for t in self.terms if t.bytes > 0]
        return ", ".join(parts)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, 3 significant digits)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"  # pragma: no cover


def _ceil4(x: int) -> int:
    return (x + 3) // 4 * 4


def _defaults(obj: Any) -> Mapping[str, Any]:
    """Field defaults of a dataclass instance's class (for a driver's growth)."""
    out = {}
    for f in getattr(type(obj), "__dataclass_fields__", {}).values():
        out[f.name] = f.default
    return out


def _driver(obj: Any, name: str, fix: str = "") -> Driver:
    default = _defaults(obj).get(name)
    value = getattr(obj, name)
    num = default if isinstance(default, (int, float)) and not isinstance(default, bool) else None
    return Driver(f"{type(obj).__name__}.{name}", value, num, fix)


def dense_optimizer_states(opt: Any) -> int:
    """fp32 states per parameter of the dense optimizer (`OptimizerArgs`): Adam's two moments,
    SGD's momentum buffer."""
    if opt.optimizer_str in ("adam", "adamw"):
        return 2
    return 1 if float(getattr(opt, "momentum", 0.0)) > 0 else 0


def parse_hbm_cache(value: Any, binding: str) -> float | int:
    """A validated ``hbm_cache`` setting (``binding`` names it in errors): a fraction of a
    table's rows in (0, 1] (a float), or a byte count > 1 (an int; an integral float above 1,
    such as ``8e9`` in a gin file, counts as bytes)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{binding}={value!r} must be a number: a fraction of the table's rows in (0, 1] "
            f"or a byte count > 1, got {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{binding}={value!r} must be a finite number")
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, float) and value > 1.0 and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value > 1:
        if value > INT64_MAX:
            raise ValueError(f"{binding}={value!r} is too large: use at most {INT64_MAX} bytes")
        return value
    raise ValueError(
        f"{binding}={value!r} is not a cache size: give a fraction of the table's rows in "
        "(0, 1] (e.g. 0.1; 1.0 = every row) or a byte count > 1 (e.g. 8589934592 for 8 GiB)"
    )


def _dynamic_width(width: int, sparse_optimizer: str) -> int:
    """fp32 columns of a dynamic table's row: the embedding and its optimizer state, padded to 4
    (hstu.embeddings.dynamic_config.OPTIMIZER_STATE_DIM)."""
    cols = _DYNAMIC_STATE_COLS.get(sparse_optimizer)
    if cols is None:  # adagrad: one per element, adam: two per element + the step
        cols = width if sparse_optimizer == "adagrad" else 2 * width + 1
    return _ceil4(width + cols)


def hbm_cache_rows(hbm_cache: float | int, slots: int, row_floats: int) -> int:
    """Rows of a hybrid table's HBM cache (one rank's shard of ``slots`` slots, rows of
    ``row_floats`` fp32): a fraction of the slots, or as many rows (with their 24 B of
    metadata) as the byte count holds; a multiple of 32, at least 32, at most ``slots``."""
    slots = max(_DYNAMIC_BUCKET, int(slots))
    if isinstance(hbm_cache, float):
        rows = math.ceil(hbm_cache * slots / _DYNAMIC_BUCKET) * _DYNAMIC_BUCKET
    else:
        rows = int(hbm_cache) // (row_floats * 4 + _CACHE_ROW_META_BYTES)
        rows = rows // _DYNAMIC_BUCKET * _DYNAMIC_BUCKET
    return min(max(rows, _DYNAMIC_BUCKET), math.ceil(slots / _DYNAMIC_BUCKET) * _DYNAMIC_BUCKET)


def hybrid_device_bytes(slots: int, cache_rows: int, row_floats: int) -> int:
    """Device bytes of a hybrid dynamic table's shard: the slot directory and the cache."""
    return (
        slots * _HYBRID_SLOT_BYTES
        + cache_rows * (row_floats * 4 + _CACHE_ROW_META_BYTES)
        + _HYBRID_FIXED_BYTES
    )


@dataclass(frozen=True)
class TableMemory:
    """One table's bytes per rank in device memory (HBM on a GPU) and in host memory; on a CPU
    run both are host memory. ``cache_rows``: the HBM cache of a hybrid dynamic table."""

    device: int
    host: int
    world_size: int = 1
    cache_rows: int = 0
    # bytes on all ranks when they are not per_rank x world_size (a torchrec table's rows are
    # split over the ranks, its per-rank share rounded up); 0: per_rank x world_size
    all_ranks: int = 0

    @property
    def per_rank(self) -> int:
        return self.device + self.host

    @property
    def total(self) -> int:
        return self.all_ranks or self.per_rank * self.world_size


def plain_table_states(optimizer: str, width: int) -> float:
    """State floats per element of a plain table that `EmbeddingArgs.sparse_optimizer_str`
    trains (``plain_table_optimizer='sparse'``): Adagrad one, row-wise Adagrad one per row,
    Adam two plus a per-row step, SGD none."""
    per_row = {"sgd": 0.0, "adagrad": float(width), "rowwise_adagrad": 1.0}
    return per_row.get(optimizer, 2.0 * width + 1.0) / max(1, int(width))


def table_memory(
    kind: str,
    rows: int,
    width: int,
    *,
    sparse_optimizer: str,
    dense_states: float,
    world_size: int,
    storage: str = "hbm",
    hbm_cache: float | int = 0.1,
) -> TableMemory:
    """Where one embedding table's bytes are, per rank: the one formula of the start-up
    estimate and of the tables' memory plan (`EmbeddingStack.memory_plan`).

    ``kind``: "torchrec" (rows x width fp32 + the sparse optimizer's per-element state,
    row-wise over the ranks), "dynamic" (``rows`` = capacity; every slot of a rank's shard,
    rounded up to whole buckets) or "plain" (replicated on every rank with its gradient and
    ``dense_states`` dense optimizer states). A dynamic table with ``storage='hbm'`` holds per
    slot its row (padded to 4 floats with its optimizer columns) and key, score and last-use
    step in device memory; with ``storage='hybrid'`` the rows are in host memory and the device
    holds the slot directory (28 B per slot) and the cache (``hbm_cache``, see
    `hbm_cache_rows`)."""
    ws = max(1, int(world_size))
    if kind == "dynamic":
        slots = math.ceil(math.ceil(rows / ws) / _DYNAMIC_BUCKET) * _DYNAMIC_BUCKET
        row_floats = _dynamic_width(width, sparse_optimizer)
        if storage == "hybrid":
            cache = hbm_cache_rows(hbm_cache, slots, row_floats)
            device = hybrid_device_bytes(slots, cache, row_floats)
            return TableMemory(device, slots * row_floats * 4, ws, cache)
        return TableMemory(slots * (row_floats * 4 + _DYNAMIC_SLOT_BYTES), 0, ws)
    if kind == "plain":
        return TableMemory(int(rows * width * 4 * (2 + dense_states)), 0, ws)
    if kind == "torchrec":
        # (row-wise Adagrad's one float per row is left out: a low estimate)
        total = int(rows * width * 4 * (1 + _SPARSE_STATES.get(sparse_optimizer, 0.0)))
        return TableMemory(math.ceil(total / ws), 0, ws, all_ranks=total)
    raise ValueError(f"table_memory: kind={kind!r} is not one of 'torchrec', 'dynamic', 'plain'")


def _dense_parameter_count(cfg: Any, sizes: DataSizes, n_ctx: int) -> int:
    """Parameters trained by the dense optimizer outside the embedding tables (exact for the
    models of hstu.models; tests compare it with a built model)."""
    net, ds = cfg.network, cfg.dataset
    h = int(net.hidden_size)
    inner = int(net.num_attention_heads) * int(net.kv_channels)
    positions = int(net.num_position_embeddings) or (int(ds.max_history_seqlen) + 1)
    candidates = int(ds.max_num_candidates) if cfg.task == "ranking" else 0
    per_layer = (2 * h) + (h * 4 * inner + 4 * inner) + (2 * inner) + (inner * h + h)
    bias = str(net.relative_attention_bias)
    rows = int(net.num_attention_heads) if net.relative_attention_bias_per_head else 1
    if bias in ("position", "position_time"):
        per_layer += rows * (2 * (n_ctx + positions + candidates) - 1)
    if bias in ("time", "position_time"):
        per_layer += rows * (int(net.num_time_buckets) + 1)
    count = int(net.num_layers) * per_layer
    count += (2 * h) if net.final_layernorm else 0
    count += sizes.num_action_bits * h + h + positions * h  # action, history, position rows
    if cfg.task == "ranking":
        head = list(cfg.ranking.head_hidden_sizes())
        prev = h
        count += 2 * h
        for width in [*head, int(cfg.ranking.num_tasks)]:
            count += prev * int(width) + int(width)
            prev = int(width)
    return count


def _reference_attention(cfg: Any, device_type: str, forced: bool) -> bool:
    net = cfg.network
    # the relative bias runs inside the compiled kernel: no [B, H, L, L] scores on CUDA
    return device_type != "cuda" or forced or net.attention_type == "softmax"


def estimate_memory(
    cfg: Any,
    sizes: DataSizes,
    *,
    device_type: str = "cpu",
    world_size: int = 1,
    local_world_size: int | None = None,
    reference_attention: bool = False,
    data_loaded: bool = False,
) -> dict[str, MemoryEstimate]:
    """The memory one run needs, per process: ``{"host": ..., "cuda": ...}`` ("cuda" only when
    ``device_type == "cuda"``; on the CPU everything is host memory).

    ``cfg``: a `RunConfig`; ``sizes``: the dataset's; ``world_size``: processes of the job;
    ``local_world_size``: processes on this host (default ``world_size``); the host estimate
    covers all of them. ``reference_attention``: the PyTorch attention is forced on CUDA.
    ``data_loaded``: the dataset's arrays are in memory already (they are then not counted:
    the available memory has shrunk by them). A deliberately low estimate (see the module
    docstring): what it refuses cannot fit.
    """
    ws = max(1, int(world_size))
    lws = ws if local_world_size is None else max(1, int(local_world_size))
    t, ds, net, emb = cfg.trainer, cfg.dataset, cfg.network, cfg.embedding
    cuda = device_type == "cuda"
    h = int(net.hidden_size)
    inner = int(net.num_attention_heads) * int(net.kv_channels)
    n_ctx = len(sizes.contextual_cardinalities) if net.use_contextual_features else 0
    dense_states = dense_optimizer_states(cfg.optimizer)
    size_drivers = (_driver(net, "hidden_size"),)

    # ---- embedding tables ----------------------------------------------------------------
    backend = emb.embedding_backend
    table_dim = h if backend == "dense" else _ceil4(h)
    names = list(sizes.contextual_names) or [f"ctx{i}" for i in range(n_ctx)]
    ctx_rows = {
        name: max(1, int(c))
        for name, c in zip(names, sizes.contextual_cardinalities)
        if net.use_contextual_features
    }
    item_rows = max(1, int(sizes.item_rows))
    if sizes.synthetic:
        item_driver = _driver(ds, "synthetic_num_items")
        user_driver = _driver(ds, "synthetic_num_users")
    else:
        # sizes given by the data grow by 1: a setting that grew wins the blame
        item_driver = Driver(
            f"the item table of {sizes.source} (max item id + 1 rows)",
            item_rows,
            item_rows,
            "use EmbeddingArgs.embedding_backend='dynamic' with an EmbeddingArgs.item_capacity "
            "that fits, or re-prepare the dataset with smaller item ids",
        )
        user_driver = Driver(
            f"the user_id table of {sizes.source}",
            ctx_rows.get("user_id", 1),
            ctx_rows.get("user_id", 1),
        )
    kinds = {
        "sparse_optimizer": emb.sparse_optimizer_str,
        "dense_states": dense_states,
        "world_size": ws,
    }
    sharded = 0.0  # split over the ranks (torchrec, dynamic)
    replicated = 0.0  # on every rank, with gradients and dense optimizer states (dense tables)
    host_copy = 0.0  # static tables are initialised on the CPU by every process
    host_rows = 0  # per process: the rows of hybrid dynamic tables (host memory)
    uses: list[TableUse] = []  # per table: its device-side bytes per process
    host_uses: list[TableUse] = []  # per table: its host-tier bytes per process (hybrid)
    drivers: list[Driver] = []
    dynamic = backend == "dynamic"
    storage = getattr(emb, "storage", "hbm")
    hbm_cache = getattr(emb, "hbm_cache", 0.1)
    for name, rows in [*ctx_rows.items(), ("item_table", item_rows)]:
        is_dynamic = dynamic and name in ("item_table", "user_id")
        table_name = name if name == "item_table" else f"ctx_{name}"
        if is_dynamic:
            is_item = name == "item_table"
            requested = int(emb.item_capacity if is_item else emb.user_capacity)
            capacity = requested or 2 * rows
            mem = table_memory(
                "dynamic", capacity, h, storage=storage, hbm_cache=hbm_cache, **kinds
            )
            sharded += mem.device * ws
            host_rows += mem.host
            field_name = "item_capacity" if is_item else "user_capacity"
            binding = f"EmbeddingArgs.{field_name}"
            # what the rows alone would take in host memory as a hybrid table
            as_hybrid = table_memory("dynamic", capacity, h, storage="hybrid", **kinds).host
            use = TableUse(table_name, "dynamic", capacity, h, storage, mem.device, ws, binding,
                           0 if storage == "hybrid" else as_hybrid)  # fmt: skip
            uses.append(use)
            if mem.host:
                host_uses.append(dataclasses.replace(use, bytes=mem.host, host_bytes=0))
            if requested or not sizes.synthetic:
                drivers.append(
                    Driver(
                        binding,
                        requested if requested else f"0 (2 x {rows} rows of the data)",
                        None if requested else 1.0,
                        f"set {binding} to a capacity that fits",
                    )
                )
            continue
        host_copy += rows * table_dim * 4
        dense_table = backend == "dense" or (dynamic and emb.contextual_tables == "dense")
        kind = "plain" if dense_table else "torchrec"
        plain_kinds = dict(kinds)
        if dense_table and getattr(emb, "plain_table_optimizer", "dense") == "sparse":
            plain_kinds["dense_states"] = plain_table_states(emb.sparse_optimizer_str, table_dim)
        mem = table_memory(kind, rows, table_dim, **plain_kinds)
        if dense_table:
            replicated += mem.device
        else:
            sharded += mem.total
        uses.append(TableUse(table_name, kind, rows, table_dim, "", mem.device, ws))
    if not dynamic or sizes.synthetic:
        drivers = [item_driver, *([user_driver] if sizes.synthetic else []), *drivers]
    tables_total = int(sharded / ws + replicated)
    formula = "rows x width x 4 B x (1 + optimizer states), dynamic tables: capacity rows"
    if host_rows:
        formula += "; hybrid tables: 28 B per slot + the HBM cache's rows"
    tables = MemoryTerm(
        "embedding tables", tables_total, formula, (*dict.fromkeys(drivers), *size_drivers)
    )
    hybrid_rows = MemoryTerm(
        "hybrid table rows",
        int(host_rows),
        "capacity x row width x 4 B (row + optimizer state, padded to 4 floats), in host memory",
        tables.drivers,
    )

    # ---- dense parameters ----------------------------------------------------------------
    params = _dense_parameter_count(cfg, sizes, n_ctx)
    dense = MemoryTerm(
        "dense parameters",
        params * 4 * (2 + dense_states),
        "parameters x 4 B x (weights + gradients + optimizer states)",
        (
            _driver(net, "num_layers"),
            _driver(net, "hidden_size"),
            _driver(net, "num_attention_heads"),
            _driver(net, "kv_channels"),
            _driver(net, "num_position_embeddings")
            if net.num_position_embeddings
            else _driver(ds, "max_history_seqlen"),
            *(
                [
                    Driver(
                        "RankingArgs.prediction_head_arch",
                        tuple(cfg.ranking.prediction_head_arch),
                        None,
                    )
                ]
                if cfg.task == "ranking" and cfg.ranking.prediction_head_arch
                else []
            ),
        ),
    )

    # ---- activations ---------------------------------------------------------------------
    longest = max(1, int(sizes.longest_sequence))
    h_len = int(ds.max_history_seqlen)
    if cfg.task == "ranking":
        items_per_sample = min(h_len + int(ds.max_num_candidates), longest)
    else:
        items_per_sample = min(h_len + 1, longest)
    seq = n_ctx + items_per_sample  # tokens of the longest sample
    elem = 2 if cuda and net.dtype_str != "float32" else 4
    ref = _reference_attention(cfg, device_type, reference_attention)
    heads = int(net.num_attention_heads)
    layers = int(net.num_layers)

    def act_bytes(batch: int, backward: bool) -> int:
        per_rank = math.ceil(batch / ws)
        tokens = per_rank * seq
        per_layer = tokens * (_ACT_HIDDEN * h + _ACT_INNER * inner) * elem
        scores = per_rank * heads * seq * seq * 4 * 2 if ref else 0
        if backward:
            return layers * (per_layer + scores)
        return per_layer + scores  # inference frees each layer's tensors

    train_batch = int(t.train_batch_size)
    eval_batch = min(int(t.eval_batch_size), max(1, sizes.num_users))
    train_act, eval_act = act_bytes(train_batch, True), act_bytes(eval_batch, False)
    batch_driver = _driver(t, "train_batch_size" if train_act >= eval_act else "eval_batch_size")
    act_drivers: list[Driver] = [
        batch_driver,
        _driver(ds, "max_history_seqlen"),
        _driver(net, "num_layers"),
        _driver(net, "hidden_size"),
        _driver(net, "num_attention_heads"),
        _driver(net, "kv_channels"),
    ]
    if cfg.task == "ranking":
        act_drivers.insert(2, _driver(ds, "max_num_candidates"))
    formula = "tokens x (2 hidden + 8 heads x kv_channels) x bytes x layers"
    if ref:
        formula += " + [B, heads, L, L] fp32 scores (PyTorch attention)"
    activations = MemoryTerm("activations", max(train_act, eval_act), formula, tuple(act_drivers))

    terms = [tables, dense, activations]

    # ---- retrieval negatives ---------------------------------------------------------------
    if cfg.task == "retrieval":
        rows = math.ceil(train_batch / ws) * items_per_sample
        rt = cfg.retrieval
        neg = 0
        if rt.negative_sampling in ("random", "mixed"):
            k = int(rt.num_negatives)
            neg += rows * k * _NEGATIVE_BYTES
            if sizes.num_items > k * h:  # looked up per negative: [rows, K, hidden] and its grad
                neg += rows * k * h * 4 * 2
        if rt.negative_sampling in ("in_batch", "mixed"):
            neg += rows * rows * 4 * 3
        terms.append(
            MemoryTerm(
                "retrieval negatives",
                neg,
                "rows x num_negatives x 36 B (+ their rows when looked up one by one) "
                "+ rows x rows x 12 B in-batch",
                (
                    _driver(rt, "num_negatives"),
                    _driver(t, "train_batch_size"),
                    _driver(ds, "max_history_seqlen"),
                ),
            )
        )

    data_term = MemoryTerm(
        "dataset arrays",
        0 if data_loaded else int(sizes.array_bytes) * lws,
        "the dataset's arrays, once per process on this host",
        (_driver(ds, "synthetic_num_users"), _driver(ds, "synthetic_num_items"))
        if sizes.synthetic
        else (Driver(f"the size of {sizes.source}", sizes.array_bytes, sizes.array_bytes),),
    )
    if not cuda:
        # every process of this host holds its part of everything (a hybrid table's "device"
        # tier is host memory too in the CPU development mode)
        if host_rows:
            terms[0] = dataclasses.replace(tables, bytes=tables.bytes + int(host_rows))
            tier = {h.name: h.bytes for h in host_uses}
            uses = [dataclasses.replace(u, bytes=u.bytes + tier.get(u.name, 0)) for u in uses]
        host_terms = [MemoryTerm(x.what, x.bytes * lws, x.formula, x.drivers) for x in terms]
        est = MemoryEstimate("host", (*host_terms, data_term), tuple(uses))
        return {"host": _times_tables(est, lws)}
    host_tables = MemoryTerm(
        "embedding tables (initialised on the CPU)",
        int(host_copy) * lws,
        "static table rows x width x 4 B, once per process on this host",
        tables.drivers,
    )
    host_terms = [host_tables, data_term]
    if host_rows:
        host_terms.insert(1, dataclasses.replace(hybrid_rows, bytes=int(host_rows) * lws))
    host_est = _times_tables(MemoryEstimate("host", tuple(host_terms), tuple(host_uses)), lws)
    return {
        "cuda": MemoryEstimate("cuda", tuple(terms), tuple(uses)),
        "host": host_est,
    }


def _times_tables(est: MemoryEstimate, n: int) -> MemoryEstimate:
    """``est`` with its tables' shares multiplied by ``n`` (the processes of this host; the
    terms already are)."""
    tables = tuple(
        dataclasses.replace(t, bytes=t.bytes * n, host_bytes=t.host_bytes * n) for t in est.tables
    )
    return MemoryEstimate(est.where, est.terms, tables)


# ---- what is available --------------------------------------------------------------------------


def _mem_available_bytes() -> tuple[int, str]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(total), "host memory"
    except (ValueError, OSError, AttributeError):
        return 0, "host memory (unknown)"


def available_memory(where: str) -> tuple[int, str]:
    """(bytes, description) of the memory that will hold ``where`` ("host" or "cuda"): the
    current CUDA device's free memory, or the host's MemAvailable (its physical memory where
    /proc/meminfo is absent). 0 bytes: unknown (the check is then skipped)."""
    if where == "cuda":
        import torch

        if not torch.cuda.is_available():
            return 0, "GPU memory (no CUDA device)"
        dev = torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free), f"free memory of GPU {dev} ({torch.cuda.get_device_name(dev)})"
    return _mem_available_bytes()


def skip_memory_check(environ: Mapping[str, str] | None = None) -> bool:
    """``HSTU_SKIP_MEMORY_CHECK=1`` (also true/yes/on): skip the memory check."""
    env = os.environ if environ is None else environ
    return env.get(SKIP_MEMORY_CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_memory(
    estimates: Mapping[str, MemoryEstimate],
    available: Mapping[str, tuple[int, str]] | None = None,
    *,
    what: str = "this run",
) -> None:
    """Raise `MemoryBudgetError` (one line) when an estimate exceeds its memory.

    ``available``: ``{where: (bytes, description)}``; default `available_memory` of each.
    A limit of 0 bytes (unknown) passes. The message names the setting that grew most in the
    largest term, the estimate (with its parts), the limit and the fix; when the embedding
    tables are what does not fit, it names the largest table, its bytes and the fixes for it
    (fewer rows, more GPUs, ``EmbeddingArgs.storage='hybrid'`` when its rows fit in host memory,
    or several hosts when even the host memory cannot hold them).
    """
    if skip_memory_check():
        return

    def limit_of(where: str) -> tuple[int, str]:
        return (available or {}).get(where) or available_memory(where)

    for where, est in estimates.items():
        limit, desc = limit_of(where)
        if limit <= 0 or est.total <= limit:
            continue
        term = est.largest()
        cause = term.cause() if term is not None else None
        memory = "GPU memory" if where == "cuda" else "host memory"
        head = f"{cause.text()}: " if cause is not None else ""
        fix = (cause.fix if cause is not None and cause.fix else "") or (
            f"lower {cause.label}" if cause is not None else "use smaller sizes"
        )
        others = [
            d.text()
            for d in (term.drivers if term is not None else ())
            if cause is None or d.label != cause.label
        ]
        also = f" (the {term.what} also grow with {', '.join(others[:4])})" if others else ""
        # a dynamic table is what does not fit, by its rows (not a width that grew): its fixes
        rows_grew = cause is None or not cause.label.startswith("NetworkArgs.")
        largest = max(est.tables, key=lambda x: x.bytes) if est.tables else None
        if (
            largest is not None
            and largest.kind == "dynamic"
            and term.what in _TABLE_TERMS
            and rows_grew
        ):
            fix = _table_fix(where, est.tables, limit, limit_of)
            also = ""
        raise MemoryBudgetError(
            f"{head}{what} needs an estimated {format_bytes(est.total)} of {memory} "
            f"({est.summary()}; {term.what}: {term.formula}) but {desc} is "
            f"{format_bytes(limit)}; {fix}{also}, or set {SKIP_MEMORY_CHECK_ENV}=1 if the "
            "estimate is wrong"
        )


_TABLE_TERMS = ("embedding tables", "hybrid table rows")


def _table_fix(where: str, tables: tuple[TableUse, ...], limit: int, limit_of) -> str:
    """The fixes for the largest table (a dynamic one) of a memory (``where``) that the tables
    overflow: fewer rows, more GPUs, hybrid storage when its rows fit in host memory, a smaller
    HBM cache, or several hosts."""
    t = max(tables, key=lambda x: x.bytes)
    rows = f"fewer rows (lower {t.binding})" if t.binding else "fewer rows"
    # the GPUs (or processes) over which the table's bytes here would fit, rows split row-wise
    gpus = max(2, math.ceil(t.bytes * t.world_size / max(1, limit)))
    head = f"the largest is {t.describe()}, {format_bytes(t.bytes)} of it per process"
    if where == "cuda" and t.storage == "hybrid":  # the directory and the cache
        return (
            f"{head} (its slot directory, 28 B per row, and its HBM cache): lower "
            f"EmbeddingArgs.hbm_cache, use {rows}, or more GPUs (at least {gpus} of this size)"
        )
    if where == "cuda":
        host_limit, host_desc = limit_of("host")
        if host_limit <= 0 or t.host_bytes <= host_limit:
            return (
                f"{head}: use {rows}, more GPUs (at least {gpus} of this size), or "
                f"EmbeddingArgs.storage='hybrid' (its rows, {format_bytes(t.host_bytes)}, fit "
                f"in host memory ({host_desc} {format_bytes(host_limit)}): HBM then holds the "
                "cache of EmbeddingArgs.hbm_cache and 28 B per row)"
            )
        return (
            f"{head}: use {rows} or more GPUs (at least {gpus} of this size); "
            f"EmbeddingArgs.storage='hybrid' does not help: its rows take "
            f"{format_bytes(t.host_bytes)} of host memory and {host_desc} is "
            f"{format_bytes(host_limit)}, so it needs several hosts' memory (more GPUs on more "
            "hosts)"
        )
    if t.storage == "hybrid":
        return (
            f"{head} (the rows of a hybrid table live in host memory): it needs several hosts' "
            f"memory: spread it over more GPUs on more hosts (each holds 1/N of the rows; at "
            f"least {gpus} processes' worth), or use {rows}"
        )
    return f"{head}: use {rows}, or spread it over more hosts (at least {gpus} processes' worth)"


# allocations below this are not checked (no memory query for small tables)
_CHECK_ALLOCATION_FROM = 64 * 2**20


def check_table_allocation(
    what: str,
    device_type: str,
    device_bytes: int,
    host_bytes: int = 0,
    *,
    storage: str = "hbm",
    hybrid_host_bytes: int = 0,
    available: Mapping[str, tuple[int, str]] | None = None,
) -> None:
    """Refuses (`MemoryBudgetError`, one line) to allocate a dynamic table (or one rank's
    shard of it), ``what``, that cannot fit: ``device_bytes`` on its device (HBM on a GPU;
    host memory on the CPU) and ``host_bytes`` of host memory (a hybrid table's rows).
    ``hybrid_host_bytes``: the host memory its rows would take with ``storage='hybrid'`` (for
    the fix). Called right before the table allocates; the start-up estimate
    (`estimate_memory`) refuses a whole run earlier with the same fixes."""
    if skip_memory_check() or device_bytes + host_bytes < _CHECK_ALLOCATION_FROM:
        return

    def limit_of(where: str) -> tuple[int, str]:
        return (available or {}).get(where) or available_memory(where)

    cuda = device_type == "cuda"
    needs = (
        {"cuda": device_bytes, "host": host_bytes} if cuda else {"host": device_bytes + host_bytes}
    )
    for where, need in needs.items():
        limit, desc = limit_of(where)
        if limit <= 0 or need <= limit:
            continue
        memory = "GPU memory" if where == "cuda" else "host memory"
        if where == "cuda" and storage == "hbm":
            host_limit, host_desc = limit_of("host")
            if host_limit <= 0 or hybrid_host_bytes <= host_limit:
                fix = (
                    "use a smaller capacity, more GPUs (the rows are split row-wise), or "
                    f"EmbeddingArgs.storage='hybrid' (its rows, {format_bytes(hybrid_host_bytes)}, "
                    f"fit in host memory: {host_desc} {format_bytes(host_limit)})"
                )
            else:
                fix = (
                    "use a smaller capacity or more GPUs; EmbeddingArgs.storage='hybrid' does "
                    f"not help (its rows take {format_bytes(hybrid_host_bytes)}, {host_desc} is "
                    f"{format_bytes(host_limit)}): it needs several hosts' memory"
                )
        elif where == "cuda":
            fix = "lower EmbeddingArgs.hbm_cache, use a smaller capacity, or more GPUs"
        elif storage == "hybrid" and cuda:
            fix = (
                "it needs several hosts' memory: spread its rows over more GPUs on more hosts, "
                "or use a smaller capacity"
            )
        else:
            fix = "use a smaller capacity, or spread the rows over more processes or hosts"
        raise MemoryBudgetError(
            f"{what} needs {format_bytes(need)} of {memory} but {desc} is "
            f"{format_bytes(limit)}; {fix}, or set {SKIP_MEMORY_CHECK_ENV}=1 if the estimate is "
            "wrong"
        )


def process_counts() -> tuple[int, int]:
    """(world size, processes on this host): torch.distributed's world when it is initialised,
    else ``WORLD_SIZE``; ``LOCAL_WORLD_SIZE`` (torchrun) or the world size."""
    world = 0
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
    except (ImportError, RuntimeError):
        world = 0
    if world <= 0:
        world = _env_int("WORLD_SIZE", 1)
    local = _env_int("LOCAL_WORLD_SIZE", world)
    return max(1, world), max(1, min(local, world))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def check_run_memory(
    cfg: Any,
    sizes: DataSizes,
    *,
    device_type: str,
    reference_attention: bool = False,
    data_loaded: bool = True,
) -> dict[str, MemoryEstimate]:
    """`estimate_memory` for this process's job (`process_counts`), checked against
    `available_memory` by `check_memory`; returns the estimates (for a log line)."""
    world, local = process_counts()
    estimates = estimate_memory(
        cfg,
        sizes,
        device_type=device_type,
        world_size=world,
        local_world_size=local,
        reference_attention=reference_attention,
        data_loaded=data_loaded,
    )
    if skip_memory_check():
        logger.warning(
            "%s=1: the memory check is off (estimate: %s)",
            SKIP_MEMORY_CHECK_ENV,
            "; ".join(f"{k} {format_bytes(v.total)}" for k, v in estimates.items()),
        )
        return estimates
    check_memory(estimates, what=f"this {cfg.task} run")
    return estimates
