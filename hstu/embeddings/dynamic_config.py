"""`DynamicEmbeddingConfig`: one dynamic (hash-keyed, growing, evicting) embedding table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import gin

from hstu.config.args import SPARSE_OPTIMIZERS
from hstu.config.limits import STORAGES, hbm_cache_rows, parse_hbm_cache

__all__ = [
    "DynamicEmbeddingConfig",
    "INITIALIZERS",
    "EVICTION_POLICIES",
    "OPTIMIZER_STATE_DIM",
    "BUCKET_SIZE",
]

# Slots per hash bucket. The GPU kernels give one warp lane to each slot of a bucket.
BUCKET_SIZE = 32

# Accepted initializer names and their parameters (with defaults; None means "depends on dim").
INITIALIZERS: dict[str, dict[str, float | None]] = {
    "uniform": {"low": None, "high": None},  # default +-1/sqrt(dim)
    "normal": {"mean": 0.0, "std": None},  # default 1/sqrt(dim)
    "truncated_normal": {"mean": 0.0, "std": None, "a": -2.0, "b": 2.0},  # a, b in std units
    "constant": {"value": 0.0},
}
EVICTION_POLICIES = ("lru", "lfu", "custom")


def OPTIMIZER_STATE_DIM(optimizer: str, dim: int) -> int:  # noqa: N802 (reads like a table)
    """fp32 columns of optimizer state stored beside each row (Adam: m, v, per-row step)."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim + 1}[optimizer]


@gin.configurable
@dataclass
class DynamicEmbeddingConfig:
    """A dynamic embedding table: any int64 id maps to a row created on first sight.

    capacity is the number of rows kept (rounded up to a multiple of 32 slots, the bucket size);
    when a bucket is full the row with the lowest eviction score that is not used by the current
    batch is replaced. The optimizer runs fused into backward: the dense optimizer never sees
    these rows.

    storage: "hbm" keeps every row on the table's device; "hybrid" keeps the rows in host
    memory and the hot ones in a device cache of ``hbm_cache`` (a fraction of the rows in
    (0, 1], or bytes per device), with the same results (`hstu.embeddings.hybrid_table`).

    lookup_graphs: a training lookup on the GPU (storage "hbm", the compiled kernels) replays
    its ops from CUDA graphs, one per padded id count (`hstu.embeddings.lookup_graphs`); False
    issues them one by one. The results are the same.
    """

    name: str
    embedding_dim: int
    capacity: int
    feature_names: list[str] = field(default_factory=list)
    initializer: str = "uniform"
    init_params: dict[str, float] = field(default_factory=dict)
    eviction_policy: str = "lru"
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    seed: int = 0
    output_dtype: str = "float32"
    storage: str = "hbm"
    hbm_cache: float | int = 0.1
    lookup_graphs: bool = True

    def __post_init__(self) -> None:
        where = f"DynamicEmbeddingConfig(name={self.name!r})"
        if not isinstance(self.name, str) or not self.name or "." in self.name or "/" in self.name:
            raise ValueError(
                f"DynamicEmbeddingConfig.name={self.name!r}: must be a non-empty str without '.' "
                "or '/'"
            )
        for attr in ("embedding_dim", "capacity"):
            val = getattr(self, attr)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{where}.{attr}={val!r} must be a positive int")
        if self.embedding_dim > 4096:
            raise ValueError(f"{where}.embedding_dim={self.embedding_dim} exceeds 4096")
        if not self.feature_names:
            self.feature_names = [self.name]
        self.feature_names = list(self.feature_names)
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"{where}.feature_names={self.feature_names} has duplicates")
        if self.initializer not in INITIALIZERS:
            raise ValueError(
                f"{where}.initializer={self.initializer!r} is not supported: one of "
                f"{sorted(INITIALIZERS)}"
            )
        allowed = INITIALIZERS[self.initializer]
        unknown = sorted(set(self.init_params) - set(allowed))
        if unknown:
            raise ValueError(
                f"{where}.init_params has unknown keys {unknown} for initializer "
                f"{self.initializer!r}: allowed {sorted(allowed)}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"{where}.eviction_policy={self.eviction_policy!r} is not supported: one of "
                f"{list(EVICTION_POLICIES)}"
            )
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(
                f"{where}.optimizer={self.optimizer!r} is not supported: one of {list(SPARSE_OPTIMIZERS)}"
            )
        if not self.learning_rate >= 0:
            raise ValueError(f"{where}.learning_rate={self.learning_rate} must be >= 0")
        for attr in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, attr) < 1.0:
                raise ValueError(f"{where}.{attr}={getattr(self, attr)} must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"{where}.eps={self.eps} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"{where}.weight_decay={self.weight_decay} must be >= 0")
        if self.output_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(
                f"{where}.output_dtype={self.output_dtype!r}: one of float32, float16, bfloat16"
            )
        if self.storage not in STORAGES:
            raise ValueError(
                f"{where}.storage={self.storage!r} is not supported: one of {list(STORAGES)}"
            )
        self.hbm_cache = parse_hbm_cache(self.hbm_cache, f"{where}.hbm_cache")
        self.init_args()  # validates the resolved initializer parameters

    @property
    def num_slots(self) -> int:
        return -(-self.capacity // BUCKET_SIZE) * BUCKET_SIZE

    @property
    def state_dim(self) -> int:
        return OPTIMIZER_STATE_DIM(self.optimizer, self.embedding_dim)

    @property
    def row_width(self) -> int:
        """fp32 columns of a stored row: the embedding, its optimizer state, padding to 4."""
        return -(-(self.embedding_dim + self.state_dim) // 4) * 4

    def cache_rows(self, num_slots: int) -> int:
        """Rows of a hybrid table's device cache for a shard of ``num_slots`` slots."""
        return hbm_cache_rows(self.hbm_cache, num_slots, self.row_width)

    def init_args(self) -> tuple[int, float, float, float, float]:
        """(kind, p0, p1, p2, p3) as the kernels take them; see reference_table.init_rows."""
        p = dict(INITIALIZERS[self.initializer])
        p.update(self.init_params)
        scale = 1.0 / math.sqrt(self.embedding_dim)
        where = f"DynamicEmbeddingConfig(name={self.name!r}).init_params"
        if self.initializer == "uniform":
            low = -scale if p["low"] is None else float(p["low"])
            high = scale if p["high"] is None else float(p["high"])
            if not low <= high:
                raise ValueError(f"{where}: uniform needs low <= high, got {low} > {high}")
            return 0, low, high, 0.0, 0.0
        if self.initializer == "normal":
            std = scale if p["std"] is None else float(p["std"])
            if std < 0:
                raise ValueError(f"{where}: std={std} must be >= 0")
            return 1, float(p["mean"]), std, 0.0, 0.0
        if self.initializer == "truncated_normal":
            std = scale if p["std"] is None else float(p["std"])
            a, b = float(p["a"]), float(p["b"])
            if std < 0 or not a < b:
                raise ValueError(f"{where}: truncated_normal needs std >= 0 and a < b")
            return 2, float(p["mean"]), std, a, b
        return 3, float(p["value"]), 0.0, 0.0, 0.0
