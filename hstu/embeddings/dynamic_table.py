"""Dynamic embedding table and collection: int64 ids -> rows created on first sight, evicted when
full, trained by an optimizer fused into backward.

`DynamicEmbeddingCollection` takes a torchrec KeyedJaggedTensor and returns dict[str,
JaggedTensor] like torchrec's EmbeddingCollection. Its rows are plain tensors, not Parameters or
buffers: the dense optimizer, DDP and state_dict never see them; checkpoints go through
`dump()`/`load()`. On CUDA the compiled kernels (`cuda_table.py`) run; on CPU the pure-PyTorch
reference (`reference_table.py`) with the same semantics.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.embeddings import reference_table
from hstu.embeddings.dynamic_config import BUCKET_SIZE, DynamicEmbeddingConfig
from hstu.embeddings.reference_table import EMPTY_KEY, OPT_CODES, TableState

__all__ = ["DynamicEmbeddingTable", "DynamicEmbeddingCollection", "UniqueIds", "unique_ids"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _backend(device: torch.device, backend: str) -> ModuleType:
    if backend not in ("auto", "reference", "cuda"):
        raise ValueError(f"backend={backend!r}: one of 'auto', 'cuda', 'reference'")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference_table
    if device.type != "cuda":
        raise ValueError(f"backend='cuda' needs a CUDA device, got {device}")
    from hstu.embeddings import cuda_table

    cuda_table.require_kernels()
    return cuda_table


class UniqueIds:
    """Deduplicated ids of one lookup: uniq (sorted), counts, inverse (ids == uniq[inverse]),
    perm (argsort of ids) and offsets (segments of perm per unique id)."""

    def __init__(self, ids: torch.Tensor) -> None:
        sorted_ids, self.perm = torch.sort(ids)
        self.uniq, self.counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        n, u = ids.numel(), self.uniq.numel()
        self.offsets = torch.zeros(u + 1, dtype=torch.int64, device=ids.device)
        torch.cumsum(self.counts, 0, out=self.offsets[1:])
        self.inverse = torch.empty(n, dtype=torch.int64, device=ids.device)
        self.inverse[self.perm] = torch.repeat_interleave(
            torch.arange(u, device=ids.device), self.counts, output_size=n
        )


def unique_ids(ids: torch.Tensor) -> UniqueIds:
    return UniqueIds(ids)


class _FusedLookup(torch.autograd.Function):
    """Forward gathers rows; backward reduces the gradient per unique id and updates the rows and
    their optimizer state in place. `dummy` (an empty tensor requiring grad) makes autograd call
    backward although the table holds no Parameter."""

    @staticmethod
    def forward(ctx, dummy, table, u, slots):  # type: ignore[override]
        ctx.table, ctx.u, ctx.slots = table, u, slots
        return table.ops.gather(table.state, table.dim, slots, u.inverse)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        t, u = ctx.table, ctx.u
        t.ops.update(
            t.state,
            t.dim,
            u.uniq,
            ctx.slots,
            u.inverse,
            u.perm,
            u.offsets,
            grad.contiguous(),
            t.optimizer_args(),
        )
        return None, None, None, None


class DynamicEmbeddingTable(nn.Module):
    """One dynamic table (or one rank's shard of it: `world_size`/`rank` keep only the ids whose
    `owner_of(id, world_size) == rank` on load, and split the capacity)."""

    def __init__(
        self,
        config: DynamicEmbeddingConfig,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.device = torch.device(device if device is not None else "cpu")
        self.ops = _backend(self.device, backend)
        self.world_size, self.rank = world_size, rank
        self.dim = config.embedding_dim
        per_rank = -(-config.capacity // world_size)
        num_slots = -(-per_rank // BUCKET_SIZE) * BUCKET_SIZE
        # Rows padded to 4 floats so the kernels move them as float4.
        self.width = -(-(self.dim + config.state_dim) // 4) * 4
        self.state = TableState.empty(num_slots, self.width, self.device)
        self.step = 0
        self.lr = config.learning_rate
        self._counters = torch.zeros(5, dtype=torch.int64, device=self.device)

    # -- lookup ---------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings [len(ids), dim] of int ids. Training inserts unseen ids (and trains them when
        grad is enabled); eval never inserts and returns zeros for unknown ids. `scores` (same
        length as ids) sets the eviction score of each id under the 'custom' policy."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"table {self.config.name!r}: ids must be int32/int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"table {self.config.name!r}: ids must be 1-D, got {tuple(ids.shape)}")
        ids = ids.to(device=self.device, dtype=torch.int64)
        dtype = _DTYPES[self.config.output_dtype]
        u = UniqueIds(ids)
        n_unique = u.uniq.numel()
        if not self.training:
            slots = self.ops.find(self.state, u.uniq)
            hits = (slots >= 0).sum()
            self._counters[0] += n_unique
            self._counters[1] += hits
            self._check_reserved(u)
            out = self.ops.gather(self.state, self.dim, slots, u.inverse)
            return out.to(dtype)
        self.step += 1
        score_vals, accumulate = self._score_values(u, scores)
        slots = self.ops.find(self.state, u.uniq, True, self.step, score_vals, accumulate)
        missing = torch.nonzero(slots < 0).flatten()
        self._check_reserved(u)
        n_new = missing.numel()
        self._counters[0] += n_unique
        self._counters[1] += n_unique - n_new
        if n_new:
            new_keys = u.uniq[missing]
            if score_vals is None:
                new_scores = torch.full_like(new_keys, self.step)
            else:
                new_scores = score_vals[missing]
            new_slots, n_evicted = self._insert_grouped(new_keys, new_scores, self.step)
            slots[missing] = new_slots
            inserted = (new_slots >= 0).sum()
            self._counters[2] += inserted
            self._counters[3] += n_evicted
            self._counters[4] += n_new - inserted
        if torch.is_grad_enabled():
            dummy = torch.empty(0, device=self.device, requires_grad=True)
            out = _FusedLookup.apply(dummy, self, u, slots)
        else:
            out = self.ops.gather(self.state, self.dim, slots, u.inverse)
        return out.to(dtype)

    def _check_reserved(self, u: UniqueIds) -> None:
        if u.uniq.numel() and int(u.uniq[0]) == EMPTY_KEY:
            raise ValueError(
                f"table {self.config.name!r}: id {EMPTY_KEY} (int64 min) is reserved for empty slots"
            )

    def _score_values(
        self, u: UniqueIds, scores: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, bool]:
        policy = self.config.eviction_policy
        if policy == "lfu":
            return u.counts, True
        if policy == "custom" and scores is not None:
            if scores.numel() != u.inverse.numel():
                raise ValueError(
                    f"table {self.config.name!r}: {scores.numel()} scores for "
                    f"{u.inverse.numel()} ids"
                )
            vals = torch.full_like(u.uniq, torch.iinfo(torch.int64).min)
            vals.scatter_reduce_(0, u.inverse, scores.to(self.device, torch.int64), "amax")
            return vals, False
        return None, False

    def _insert_grouped(
        self, keys: torch.Tensor, scores: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Insert absent unique keys, given in priority order; returns their slots (-1 overflow)."""
        b = self.ops.bucket_of(keys, self.state.num_buckets)
        order = torch.argsort(b, stable=True)
        seg_buckets, seg_counts = torch.unique_consecutive(b[order], return_counts=True)
        seg_offsets = torch.zeros(seg_buckets.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(seg_counts, 0, out=seg_offsets[1:])
        init = self.config.init_args()
        slots_sorted, n_evicted = self.ops.insert(
            self.state,
            keys[order],
            seg_offsets,
            seg_buckets,
            scores[order],
            step,
            self.dim,
            self.config.seed,
            init,
        )
        slots = torch.empty_like(slots_sorted)
        slots[order] = slots_sorted
        return slots, n_evicted

    # -- optimizer --------------------------------------------------------------------------------
    def optimizer_args(self) -> tuple[int, float, float, float, float, float]:
        c = self.config
        return (OPT_CODES[c.optimizer], self.lr, c.beta1, c.beta2, c.eps, c.weight_decay)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = float(lr)

    # -- maintenance ------------------------------------------------------------------------------
    def erase(self, ids: torch.Tensor) -> int:
        """Remove ids from the table; returns how many were present."""
        ids = ids.to(device=self.device, dtype=torch.int64)
        return int(self.ops.erase(self.state, torch.unique(ids)))

    def set_scores(self, ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrite the eviction score of ids already in the table (absent ones are ignored)."""
        ids = ids.to(device=self.device, dtype=torch.int64)
        slots = self.ops.find(self.state, ids)
        ok = slots >= 0
        self.state.scores[slots[ok]] = scores.to(self.device, torch.int64)[ok]

    def size(self) -> int:
        return int(self.ops.size(self.state))

    def stats(self) -> dict[str, float]:
        lookups, hits, inserts, evictions, overflows = self._counters.tolist()
        rows = self.size()
        return {
            "rows": float(rows),
            "capacity": float(self.state.keys.numel()),
            "occupancy": rows / self.state.keys.numel(),
            "lookups": float(lookups),
            "hits": float(hits),
            "hit_rate": hits / lookups if lookups else 0.0,
            "inserts": float(inserts),
            "evictions": float(evictions),
            "overflows": float(overflows),
        }

    # -- checkpoint ---------------------------------------------------------------------------------
    def dump(self) -> dict[str, torch.Tensor]:
        """Live rows ordered by key, on CPU: keys, values [n, dim], optimizer_state [n, S], scores,
        plus metadata (step, embedding_dim, optimizer code). Dumps of all ranks concatenated
        (`concat_dumps`) load into any number of ranks."""
        slots = self.ops.export(self.state)
        d = self.dim
        return {
            "keys": self.state.keys[slots].cpu(),
            "values": self.state.values[slots, :d].cpu(),
            "optimizer_state": self.state.values[slots, d : d + self.config.state_dim].cpu(),
            "scores": self.state.scores[slots].cpu(),
            "step": torch.tensor(self.step, dtype=torch.int64),
            "embedding_dim": torch.tensor(d, dtype=torch.int64),
            "optimizer": torch.tensor(OPT_CODES[self.config.optimizer], dtype=torch.int64),
        }

    def load(self, dump: dict[str, torch.Tensor]) -> None:
        """Replace the contents with a dump (this rank keeps the ids it owns). Rows that do not fit
        (a smaller capacity) keep the highest scores; the others are dropped with a warning."""
        name = self.config.name
        missing = {"keys", "values", "optimizer_state", "scores", "step"} - set(dump)
        if missing:
            raise ValueError(f"table {name!r}: dump lacks {sorted(missing)}")
        dim = int(dump.get("embedding_dim", dump["values"].shape[1]))
        if dim != self.dim or dump["values"].shape[1] != self.dim:
            raise ValueError(f"table {name!r}: dump has embedding_dim={dim}, table has {self.dim}")
        opt = {v: k for k, v in OPT_CODES.items()}.get(int(dump.get("optimizer", -1)), "unknown")
        if "optimizer" in dump and opt != self.config.optimizer:
            raise ValueError(
                f"table {name!r}: dump was trained with optimizer={opt!r}, table uses "
                f"{self.config.optimizer!r}"
            )
        if dump["optimizer_state"].shape[1] != self.config.state_dim:
            raise ValueError(
                f"table {name!r}: dump has {dump['optimizer_state'].shape[1]} optimizer state "
                f"columns, {self.config.optimizer!r} needs {self.config.state_dim}"
            )
        keys = dump["keys"].to(self.device, torch.int64)
        values = dump["values"].to(self.device, torch.float32)
        opt_state = dump["optimizer_state"].to(self.device, torch.float32)
        scores = dump["scores"].to(self.device, torch.int64)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table {name!r}: dump has duplicate keys")
        if self.world_size > 1:
            mine = reference_table.owner_of(keys, self.world_size) == self.rank
            keys, values, opt_state, scores = (
                keys[mine],
                values[mine],
                opt_state[mine],
                scores[mine],
            )
        self.state = TableState.empty(
            self.state.keys.numel(), self.state.values.shape[1], self.device
        )
        self.step = int(dump["step"])
        # Priority inside a bucket: higher score first, then smaller key.
        order = torch.argsort(keys, stable=True)
        order = order[torch.argsort(scores[order], descending=True, stable=True)]
        slots, _ = self._insert_grouped(keys[order], scores[order], step=-1)
        ok = slots >= 0
        s = slots[ok]
        self.state.values[s, : self.dim] = values[order][ok]
        self.state.values[s, self.dim : self.dim + self.config.state_dim] = opt_state[order][ok]
        self.state.touched.zero_()
        dropped = int((~ok).sum())
        if dropped:
            logger.warning(
                "table %r: %d rows of the dump did not fit and were dropped", name, dropped
            )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={c.name}, dim={c.embedding_dim}, slots={self.state.keys.numel()}, "
            f"optimizer={c.optimizer}, eviction={c.eviction_policy}, backend="
            f"{self.ops.__name__.rsplit('.', 1)[-1]}, rank={self.rank}/{self.world_size}"
        )


def concat_dumps(dumps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Merge the per-rank dumps of one table into one (any rank count can load the result)."""
    out = {
        k: torch.cat([d[k] for d in dumps]) for k in ("keys", "values", "optimizer_state", "scores")
    }
    order = torch.argsort(out["keys"])  # ordered by key, like a single table's dump
    out = {k: v[order] for k, v in out.items()}
    out["step"] = torch.stack([d["step"] for d in dumps]).max()
    for k in ("embedding_dim", "optimizer"):
        out[k] = dumps[0][k]
    return out


class DynamicEmbeddingCollection(nn.Module):
    """Dynamic tables looked up with a KeyedJaggedTensor, like torchrec's EmbeddingCollection:
    forward(features) -> {feature name: JaggedTensor of [n, dim] embeddings}. Features sharing a
    table are looked up together (one dedup, one kernel chain). Under the 'custom' eviction policy
    the KJT weights are the eviction scores."""

    def __init__(
        self,
        tables: list[DynamicEmbeddingConfig],
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self._configs = list(tables)
        self.device = torch.device(device if device is not None else "cpu")
        self._backend = backend
        self._feature_to_table: dict[str, str] = {}
        names = [c.name for c in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"DynamicEmbeddingCollection: duplicate table names in {names}")
        for c in tables:
            if not isinstance(c, DynamicEmbeddingConfig):
                raise TypeError(f"tables must be DynamicEmbeddingConfig, got {type(c).__name__}")
            for f in c.feature_names:
                if f in self._feature_to_table:
                    raise ValueError(
                        f"feature {f!r} is mapped to tables {self._feature_to_table[f]!r} and "
                        f"{c.name!r}"
                    )
                self._feature_to_table[f] = c.name
        # A plain dict (a ModuleDict would reject names such as "items" or "keys"); the tables
        # are registered as children "table_<name>" so train()/eval() reach them.
        self.tables: dict[str, DynamicEmbeddingTable] = {}
        for c in tables:
            self.tables[c.name] = self._make_table(c)
            self.add_module(f"table_{c.name}", self.tables[c.name])

    def _make_table(self, config: DynamicEmbeddingConfig) -> DynamicEmbeddingTable:
        return DynamicEmbeddingTable(config, self.device, backend=self._backend)

    def embedding_configs(self) -> list[DynamicEmbeddingConfig]:
        return list(self._configs)

    def feature_names(self) -> list[str]:
        return list(self._feature_to_table)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        jts = features.to_dict()
        unknown = [f for f in jts if f not in self._feature_to_table]
        if unknown:
            raise ValueError(
                f"features {unknown} have no dynamic table; configured: {self.feature_names()}"
            )
        out: dict[str, JaggedTensor] = {}
        for table in self.tables.values():
            feats = [f for f in table.config.feature_names if f in jts]
            if not feats:
                continue
            for f in feats:
                if jts[f].values().dtype not in (torch.int32, torch.int64):
                    raise TypeError(
                        f"feature {f!r}: ids must be int32/int64, got {jts[f].values().dtype}"
                    )
            ids = torch.cat([jts[f].values().to(torch.int64) for f in feats])
            scores = None
            if table.config.eviction_policy == "custom":
                ws = [jts[f].weights_or_none() for f in feats]
                if all(w is not None for w in ws):
                    scores = torch.cat(ws)
            emb = table(ids, scores)
            sizes = [jts[f].values().numel() for f in feats]
            for f, e in zip(feats, torch.split(emb, sizes)):
                out[f] = JaggedTensor(values=e, lengths=jts[f].lengths(), offsets=jts[f].offsets())
        return out

    # -- fused optimizer, stats, checkpoint ----------------------------------------------------------
    @property
    def fused_optimizer(self) -> dict[str, dict[str, float | str]]:
        """Per-table optimizer settings; updates happen inside backward (no dense optimizer)."""
        return {
            n: {
                "optimizer": t.config.optimizer,
                "lr": t.lr,
                "beta1": t.config.beta1,
                "beta2": t.config.beta2,
                "eps": t.config.eps,
                "weight_decay": t.config.weight_decay,
            }
            for n, t in self.tables.items()
        }

    def set_learning_rate(self, lr: float, table: str | None = None) -> None:
        for n, t in self.tables.items():
            if table is None or n == table:
                t.set_learning_rate(lr)

    def stats(self) -> dict[str, float]:
        """Flat `{table}/{stat}` numbers for TensorBoard."""
        return {f"{n}/{k}": v for n, t in self.tables.items() for k, v in t.stats().items()}

    def dump(self) -> dict[str, torch.Tensor]:
        """`{table}/{field}` tensors of every table (this rank's rows when sharded)."""
        return {f"{n}/{k}": v for n, t in self.tables.items() for k, v in t.dump().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in self.tables.items():
            sub = {k.split("/", 1)[1]: v for k, v in state.items() if k.split("/", 1)[0] == n}
            if not sub:
                raise ValueError(f"load: no entries for table {n!r}")
            t.load(sub)
