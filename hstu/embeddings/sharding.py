"""Row-wise sharding of dynamic embedding tables across ranks (ids routed by hash).

Each rank holds the rows of the ids with `owner_of(id, world_size) == rank` (a hash independent
of the bucket hash). A lookup sends every id to its owner (all_to_all of ids), the owner looks
it up (inserting, in training) in its local shard, and sends the rows back (all_to_all of
embeddings); backward sends the gradients to the owners, where the fused optimizer updates the
rows. The result equals one unsharded table fed the ids of all ranks (same ids -> same rows,
gradients of an id summed over all ranks before its single update).

Two ways in, both next to ordinary torchrec tables in one DistributedModelParallel:
- `DynamicEmbeddingSharder()` in DMP's `sharders`: the planner sees each table as a [capacity,
  dim] stand-in, places it row_wise, and DMP swaps in the sharded collection;
- `shard_dynamic_embeddings(model)` before DMP: the collection becomes a (pre-sharded)
  torchrec ShardedModule, which DMP keeps as it is.
The sharded collection does its own input/output dist with torch.distributed (synchronous
all_to_alls) and holds no Parameter or buffer, so DDP and the dense optimizer never see the rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    ModuleSharder,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    concat_dumps,
    table_host_ids,
)
from hstu.embeddings.reference_table import owner_of
from hstu.training.distributed import host_group

__all__ = [
    "DynamicEmbeddingSharder",
    "HostIdRouter",
    "ShardedDynamicEmbeddingCollection",
    "shard_dynamic_embeddings",
    "merge_collection_dumps",
]


class _AllToAllRows(torch.autograd.Function):
    """Rows [sum(in_splits), D] -> [sum(out_splits), D]; backward routes gradients back
    (multiplied by ``grad_scale``: 1/world_size under gradient division)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, grad_scale=1.0):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.grad_scale = (out_splits, in_splits), group, grad_scale
        out = x.new_empty((sum(out_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), grad.shape[1]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        if ctx.grad_scale != 1.0:
            g = g * ctx.grad_scale
        return g, None, None, None, None


@dataclass
class _TableRoute:
    """One table's share of a gloo exchange of CPU ids: ``count`` local ids, sent to their
    owners in ``order`` (stable by owner) with ``send[r]`` ids for rank r, ``recv[s]`` ids
    received from rank s (``recv_ids``, source-major); ``inverse`` puts rows in ``order`` back in
    the local id order."""

    count: int
    send: list[int]
    recv: list[int]
    recv_ids: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor

    def pinned(self) -> _TableRoute:
        """The same route with its tensors in page-locked memory (asynchronous copies to a GPU)."""
        return _TableRoute(
            self.count,
            self.send,
            self.recv,
            self.recv_ids.pin_memory(),
            self.order.pin_memory(),
            self.inverse.pin_memory(),
        )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``; from pinned memory the copy does not wait for the GPU."""
    if device.type != "cuda":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


class HostIdRouter:
    """Makes the gloo exchange of a sharded collection's CPU ids for the *next* training batch
    while the current step runs, on one background thread with a gloo group of its own.

    Without it, `ShardedDynamicEmbeddingCollection.forward` exchanges the ids at the start of
    every lookup: a host-to-host barrier where each rank's main thread waits for the slowest
    rank's host, plus the hashing and sorting of the ids on the CPU. With it the main thread only
    collects the finished exchange (`Future.result()`), and the ranks' hosts may drift apart by
    up to a step without waiting for each other.

    Every rank must `submit` the same sequence of batches (the trainer submits one per training
    step, through `PrefetchIterator`'s lookahead), because each submission is one pair of
    collectives on the router's group. ``group``: the ranks of the collection's group; the
    router's gloo group is created here, so every rank must construct its router at the same
    point (it is a collective call of the default group)."""

    def __init__(
        self,
        collection: ShardedDynamicEmbeddingCollection,
        device: torch.device,
        batch_host_ids: Callable[[Any], tuple[list[str], dict[str, torch.Tensor]] | None],
        ranks: list[int] | None = None,
    ) -> None:
        self.collection = collection
        self.device = torch.device(device)
        self._batch_host_ids = batch_host_ids
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstu-id-router")
        self._cuda_ready = threading.Event()

    @classmethod
    def for_model(cls, model: nn.Module, device: torch.device) -> HostIdRouter | None:
        """A router for ``model``'s sharded dynamic tables, or None where ahead-of-step routing
        does not apply: one process, no sharded dynamic collection, a collection over a subgroup,
        or a model whose lookup adds ids that are not in the batch (retrieval's sampled
        negatives). The same answer on every rank (it depends on the configuration only)."""
        coll = getattr(model, "dynamic_collection", None)
        if not isinstance(coll, ShardedDynamicEmbeddingCollection) or coll.world_size == 1:
            return None
        if getattr(model, "uses_extra_items", False) or not hasattr(model, "dynamic_host_ids"):
            return None
        if coll._group is not None and coll._group is not dist.group.WORLD:
            return None
        return cls(coll, device, model.dynamic_host_ids)

    def submit(self, features: list[str], host_ids: dict[str, torch.Tensor]) -> Future:
        """Starts the exchange for a lookup of ``features`` with these CPU ids; the future's
        result goes to `forward(..., route=)` (None when some ids are not on the host)."""
        return self._pool.submit(self._run, list(features), dict(host_ids))

    def _run(self, features: list[str], host_ids: dict[str, torch.Tensor]):
        pin = self.device.type == "cuda"
        if pin and not self._cuda_ready.is_set():
            torch.cuda.set_device(self.device)  # page-locked buffers for this GPU's context
            self._cuda_ready.set()
        return self.collection.route_on_host(features, host_ids, self.group, pin=pin)

    def attach(self, batch) -> None:
        """`PrefetchIterator` lookahead hook: starts the exchange of ``batch``'s ids (a CPU batch,
        one step before the trainer takes it) and stores the future as ``batch.dynamic_route``."""
        spec = self._batch_host_ids(batch)
        batch.dynamic_route = None if spec is None else self.submit(*spec)

    def close(self) -> None:
        """Waits for the submitted exchanges (the other ranks made the same submissions, so
        they complete) and stops the thread."""
        self._pool.shutdown(wait=True)


class ShardedDynamicEmbeddingCollection(DynamicEmbeddingCollection, ShardedModule):
    """DynamicEmbeddingCollection whose tables are split row-wise over the ranks of `group`
    (capacity / world_size slots each). Same forward, stats, dump/load; `dump()` returns this
    rank's rows, `load()` takes the merged dumps of any number of ranks (`merge_collection_dumps`)
    and keeps the ids this rank owns. Every rank must call forward and backward together.

    ``gradient_division=True`` divides the row gradients (summed over the ranks that looked an id
    up) by the world size, as torchrec does for its own sharded tables
    (``torchrec.distributed.comm_ops.GRADIENT_DIVISION``): with per-rank losses scaled for DDP's
    gradient averaging, the rows then see the gradient of the global-batch loss, whatever the
    world size. False keeps the plain sum (the gradient of the sum of the ranks' losses)."""

    def __init__(
        self,
        tables: list[DynamicEmbeddingConfig],
        device: torch.device | str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        backend: str = "auto",
        gradient_division: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedDynamicEmbeddingCollection needs torch.distributed")
        self._group = group
        self.gradient_division = bool(gradient_division)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        super().__init__(tables, device, backend=backend)

    def _make_table(self, config: DynamicEmbeddingConfig) -> DynamicEmbeddingTable:
        return DynamicEmbeddingTable(
            config,
            self.device,
            backend=self._backend,
            world_size=self.world_size,
            rank=self.rank,
        )

    # torchrec's ShardedModule interface: forward() does input dist, lookup and output dist in
    # one go (the all_to_alls are synchronous), so the split stages are not offered.
    def create_context(self) -> None:
        return None

    @property
    def unsharded_module_type(self) -> type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    def input_dist(self, ctx, *input, **kwargs):  # noqa: A002
        raise NotImplementedError("ShardedDynamicEmbeddingCollection runs through forward()")

    def compute(self, ctx, dist_input):
        raise NotImplementedError("ShardedDynamicEmbeddingCollection runs through forward()")

    def output_dist(self, ctx, output):
        raise NotImplementedError("ShardedDynamicEmbeddingCollection runs through forward()")

    def _route(
        self,
        table: DynamicEmbeddingTable,
        ids: torch.Tensor,
        scores,
        host_ids: torch.Tensor | None = None,
        routed: _TableRoute | None = None,
    ):
        """Looks ``ids`` up in their owners' shards. ``routed``: this table's share of an
        exchange of the CPU ids over gloo (`forward` exchanges every table's ids at once, or a
        `HostIdRouter` did it ahead of the step); None routes the ids over the device group."""
        w = self.world_size
        ids = ids.to(self.device)
        if w == 1:  # every id is local: no collective to line up
            return table(ids, scores, host_ids=host_ids)
        if routed is not None:
            # ids, counts and the permutations come from the CPU ids: no device->host read, and
            # no hashing or sorting of the ids on the device
            send, recv, recv_host = routed.send, routed.recv, routed.recv_ids
            recv_ids = _to_device(recv_host, self.device)
            inv = _to_device(routed.inverse, self.device)
            order = _to_device(routed.order, self.device) if scores is not None else None
        else:
            owner = owner_of(ids, w)
            order = torch.argsort(owner, stable=True)
            inv = None
            send_counts = torch.bincount(owner, minlength=w)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self._group)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            recv_ids = ids.new_empty(sum(recv))
            dist.all_to_all_single(recv_ids, ids[order], recv, send, group=self._group)
            recv_host = None
        recv_scores = None
        if scores is not None:
            s = scores.to(self.device, torch.float64)[order]
            recv_scores = s.new_empty(sum(recv))
            dist.all_to_all_single(recv_scores, s, recv, send, group=self._group)
        local = table(recv_ids, recv_scores, host_ids=recv_host)
        grad_scale = 1.0 / w if self.gradient_division else 1.0
        rows = _AllToAllRows.apply(local, send, recv, self._group, grad_scale)
        if inv is None:
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
        return rows.index_select(0, inv)

    def _route_ids_on_host(
        self,
        host_ids: list[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        pin: bool = False,
    ) -> list[_TableRoute] | None:
        """Sends each table's CPU ids to their owners over a gloo group (``group``, default the
        host twin of this collection's group), all tables in one exchange of counts and one of
        ids (each collective waits for every rank's host): per table, in the order of the device
        route (by owner, stable), a `_TableRoute`; None when no gloo group spans this
        collection's ranks. ``pin``: the received ids and permutations in page-locked memory."""
        if group is None:
            ok, group = host_group(self._group)
            if not ok:
                return None
        if any(h.device.type != "cpu" for h in host_ids):
            # (the "host" ids were moved to the GPU, e.g. by DDP's input scattering when passed
            # as a plain argument: the device route is exact)
            return None
        w, nt = self.world_size, len(host_ids)
        host_ids = [h.to(torch.int64) for h in host_ids]
        owners = [owner_of(h, w) for h in host_ids]
        # send_counts[r, t]: ids of table t for rank r; recv_counts[s, t]: ids of t from rank s
        send_counts = torch.stack([torch.bincount(o, minlength=w) for o in owners], 1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        # the payload for rank r: table 0's ids for r, then table 1's, ...
        by_dest: list[list[torch.Tensor]] = [[] for _ in range(w)]
        orders = []
        for t, (h, o) in enumerate(zip(host_ids, owners)):
            order = torch.argsort(o, stable=True)
            orders.append(order)
            for r, part in enumerate(torch.split(h[order], send_counts[:, t].tolist())):
                by_dest[r].append(part)
        send_buf = torch.cat([part for parts in by_dest for part in parts])
        send_split, recv_split = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        recv_buf = send_buf.new_empty(sum(recv_split))
        dist.all_to_all_single(recv_buf, send_buf, recv_split, send_split, group=group)
        parts = torch.split(recv_buf, recv_counts.flatten().tolist())  # source-major
        out = []
        for t in range(nt):
            order = orders[t]
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel())
            route = _TableRoute(
                count=order.numel(),
                send=send_counts[:, t].tolist(),
                recv=recv_counts[:, t].tolist(),
                recv_ids=torch.cat([parts[src * nt + t] for src in range(w)]),
                order=order,
                inverse=inverse,
            )
            out.append(route.pinned() if pin else route)
        return out

    def _table_host_ids(
        self, features: list[str], host_ids: dict[str, torch.Tensor] | None
    ) -> list[torch.Tensor | None]:
        """Per table (collection order), the CPU ids of its features among ``features`` (the
        lookup's keys) in the order of the device ids: None where some are not known; an empty
        tensor for a table with no feature here (its route must still match the other ranks')."""
        out = []
        for table in self.tables.values():
            feats = [f for f in table.config.feature_names if f in features]
            if feats:
                out.append(table_host_ids(host_ids, feats))
            else:
                out.append(None if host_ids is None else torch.empty(0, dtype=torch.int64))
        return out

    def route_on_host(
        self,
        features: list[str],
        host_ids: dict[str, torch.Tensor],
        group: dist.ProcessGroup,
        pin: bool = False,
    ) -> list[_TableRoute] | None:
        """The gloo exchange `forward` makes for a lookup of ``features`` with these CPU ids,
        made now (by `HostIdRouter`, ahead of the step): pass the result to `forward(...,
        route=)`. None when some table's ids are not all known on the host (then the forward
        routes over the device group, on every rank alike)."""
        hids = self._table_host_ids(features, host_ids)
        if self.world_size == 1 or not hids or any(h is None for h in hids):
            return None
        return self._route_ids_on_host(hids, group=group, pin=pin)

    def forward(
        self,
        features: KeyedJaggedTensor,
        host_ids: dict[str, torch.Tensor] | None = None,
        route: Future | list[_TableRoute] | None = None,
    ) -> dict[str, JaggedTensor]:
        """``host_ids``: feature -> the same ids on the CPU. Every rank must pass them for the
        same tables (or none): they decide whether the ids route over gloo or the device group.
        ``route``: the exchange `route_on_host` (or a `HostIdRouter` future) already made for
        exactly these features and ids; every rank must pass one or none.
        """
        jts = features.to_dict()
        unknown = [f for f in jts if f not in self._feature_to_table]
        if unknown:
            raise ValueError(
                f"features {unknown} have no dynamic table; configured: {self.feature_names()}"
            )
        plans = []
        for table in self.tables.values():
            # Every rank routes every table (an absent feature sends zero ids): the collectives
            # must line up across ranks.
            feats = [f for f in table.config.feature_names if f in jts]
            for f in feats:
                if jts[f].values().dtype not in (torch.int32, torch.int64):
                    raise TypeError(
                        f"feature {f!r}: ids must be int32/int64, got {jts[f].values().dtype}"
                    )
            vals = [jts[f].values().to(torch.int64) for f in feats]
            ids = torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
            scores = None
            if table.config.eviction_policy == "custom" and feats:
                ws = [jts[f].weights_or_none() for f in feats]
                if all(w is not None for w in ws):
                    scores = torch.cat(ws)
            plans.append([table, feats, vals, ids, scores, None])
        for plan, hid in zip(plans, self._table_host_ids(list(jts), host_ids)):
            plan[5] = hid
        # exchanged ahead of the step (None when the ids were not all on the host: the same on
        # every rank, which then all route here)
        routed = route.result() if isinstance(route, Future) else route
        if routed is not None:
            got = [int(p[3].numel()) for p in plans]
            if [r.count for r in routed] != got:
                raise RuntimeError(
                    f"the id route made ahead of this step was made for {[r.count for r in routed]}"
                    f" ids per table, but the lookup has {got}: it belongs to another batch"
                )
        elif self.world_size > 1 and plans and all(p[5] is not None for p in plans):
            # with CPU ids for every table, one gloo exchange routes them all (else every table
            # goes over the device group: the same choice on every rank, so collectives line up)
            routed = self._route_ids_on_host([p[5] for p in plans])
        out: dict[str, JaggedTensor] = {}
        for i, (table, feats, vals, ids, scores, hid) in enumerate(plans):
            emb = self._route(table, ids, scores, hid, None if routed is None else routed[i])
            for f, e in zip(feats, torch.split(emb, [v.numel() for v in vals])):
                out[f] = JaggedTensor(values=e, lengths=jts[f].lengths(), offsets=jts[f].offsets())
        return out

    def global_stats(self) -> dict[str, float]:
        """Stats summed over ranks (rows, inserts, ...; rates recomputed)."""
        local = self.stats()
        keys = sorted(local)
        t = torch.tensor([local[k] for k in keys], dtype=torch.float64)
        if dist.get_backend(self._group) == "nccl":
            t = t.to(self.device)
        dist.all_reduce(t, group=self._group)
        total = dict(zip(keys, t.cpu().tolist()))
        for name in self.tables:
            cap, rows = total[f"{name}/capacity"], total[f"{name}/rows"]
            lookups = total[f"{name}/lookups"]
            total[f"{name}/occupancy"] = rows / cap if cap else 0.0
            total[f"{name}/hit_rate"] = total[f"{name}/hits"] / lookups if lookups else 0.0
        return total


def merge_collection_dumps(dumps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Merge the `dump()` of every rank into one collection dump loadable by any rank count."""
    tables = sorted({k.split("/", 1)[0] for k in dumps[0]})
    out: dict[str, torch.Tensor] = {}
    for t in tables:
        per_rank = [
            {k.split("/", 1)[1]: v for k, v in d.items() if k.startswith(t + "/")} for d in dumps
        ]
        for k, v in concat_dumps(per_rank).items():
            out[f"{t}/{k}"] = v
    return out


class DynamicEmbeddingSharder(ModuleSharder[DynamicEmbeddingCollection]):
    """torchrec sharder: pass it to DistributedModelParallel (`sharders=[...,
    DynamicEmbeddingSharder()]`) and the planner places each dynamic table row-wise (its storage
    estimated from capacity x dim), then DMP swaps the collection for its
    `ShardedDynamicEmbeddingCollection`. The shard layout is by id hash, not by the planner's
    row ranges: only the sharding type (row_wise over all ranks of the env) is taken from the
    plan."""

    def __init__(self, backend: str = "auto", gradient_division: bool = False) -> None:
        super().__init__()
        self._backend = backend
        self._gradient_division = gradient_division

    @property
    def module_type(self) -> type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    @property
    def fused_params(self) -> dict:
        """No TBE cache/prefetch settings (the planner's estimators read this)."""
        return {}

    def shardable_parameters(self, module: DynamicEmbeddingCollection) -> dict[str, nn.Parameter]:
        # Stand-ins of the table shapes for the planner only; never registered on the module.
        return {
            c.name: nn.Parameter(
                torch.empty(c.num_slots, c.embedding_dim, device="meta"), requires_grad=False
            )
            for c in module.embedding_configs()
        }

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(
        self,
        module: DynamicEmbeddingCollection,
        params,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingCollection:
        for name, p in params.items():
            if p.sharding_type != ShardingType.ROW_WISE.value:
                raise ValueError(
                    f"dynamic table {name!r}: sharding type {p.sharding_type!r} is not "
                    "supported, only row_wise"
                )
        return _shard_one(module, env.process_group, device, self._backend, self._gradient_division)


def shard_dynamic_embeddings(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every DynamicEmbeddingCollection inside model by its row-wise sharded twin (rows
    it already holds move to their owners). Call before DistributedModelParallel."""
    if isinstance(model, DynamicEmbeddingCollection) and not isinstance(
        model, ShardedDynamicEmbeddingCollection
    ):
        return _shard_one(model, group)
    for name, child in list(model.named_children()):
        new = shard_dynamic_embeddings(child, group)
        if new is not child:
            setattr(model, name, new)
    return model


def _shard_one(
    m: DynamicEmbeddingCollection,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    backend: str | None = None,
    gradient_division: bool = False,
) -> ShardedDynamicEmbeddingCollection:
    if device is None or m.device.type != "meta":
        device = m.device
    sharded = ShardedDynamicEmbeddingCollection(
        m.embedding_configs(),
        device,
        group=group,
        backend=backend or m._backend,
        gradient_division=gradient_division,
    )
    # The unsharded modules are replicas (as DistributedModelParallel assumes): rank 0's rows
    # are distributed to their owners. A module built on the meta device holds none.
    if m.device.type != "meta":
        obj = [m.dump() if dist.get_rank(group) == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(obj, src=src, group=group)
        sharded.load(obj[0])
    sharded.train(m.training)
    return sharded
