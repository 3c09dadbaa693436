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
The sharded collection implements torchrec's stages (input dist of the ids, local lookup,
output dist of the rows) with torch.distributed and holds no Parameter or buffer, so DDP and the
dense optimizer never see the rows.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    Awaitable,
    ModuleSharder,
    NoWait,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.comm import host_group
from hstu.config.limits import table_memory
from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    concat_dumps,
    make_dynamic_table,
    table_host_ids,
)
from hstu.embeddings.reference_table import owner_of

__all__ = [
    "DynamicEmbeddingSharder",
    "DynamicLookupContext",
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
    """``t`` on ``device``; a CPU tensor goes through pinned memory to a GPU, so that the copy
    does not wait for the GPU (a tensor already on a GPU, e.g. routed there, is moved as is)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


@dataclass
class _TablePlan:
    """One table's part of a lookup: its features among the lookup's keys, their ids (as given)
    and value counts, the eviction scores if any, and the same ids on the CPU where known."""

    table: DynamicEmbeddingTable
    features: list[str]
    sizes: list[int]
    ids: torch.Tensor
    scores: torch.Tensor | None
    host_ids: torch.Tensor | None


@dataclass
class DynamicLookupContext:
    """torchrec's per-call context of `ShardedDynamicEmbeddingCollection`: the lookup's plan
    (set by `input_dist`, or by `plan` when the input dist was made ahead of the step) and the
    KJT's per-feature lengths and offsets for the output."""

    plans: list[_TablePlan] = field(default_factory=list)
    jagged: dict[str, JaggedTensor] = field(default_factory=dict)
    routes: list[_TableRoute] = field(default_factory=list)


class _FutureAwaitable(Awaitable):
    """torchrec Awaitable of a `concurrent.futures.Future` (an id exchange on the exchange
    thread)."""

    def __init__(self, future: Future) -> None:
        super().__init__()
        self._future = future

    def _wait_impl(self):
        return self._future.result()


class _IdExchange:
    """One background thread and a gloo group of its own on which a collection exchanges the CPU
    ids of a *future* lookup between ranks (`input_dist(..., asynchronous=True)`), so that the
    next batch's input distribution overlaps the current step. Creating it is a collective call
    of the default group (every rank at the same point); every rank must then submit the same
    sequence of lookups (each one is a pair of collectives on this group)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group = dist.new_group(backend="gloo")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstu-input-dist")
        self._cuda_ready = threading.Event()

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(self._run, fn, args)

    def _run(self, fn, args):
        if self.device.type == "cuda" and not self._cuda_ready.is_set():
            torch.cuda.set_device(self.device)  # page-locked buffers for this GPU's context
            self._cuda_ready.set()
        return fn(*args, group=self.group, pin=self.device.type == "cuda")

    def close(self) -> None:
        """Waits for the submitted exchanges (the other ranks made the same submissions, so they
        complete) and stops the thread."""
        self._pool.shutdown(wait=True)


class ShardedDynamicEmbeddingCollection(DynamicEmbeddingCollection, ShardedModule):
    """DynamicEmbeddingCollection whose tables are split row-wise over the ranks of `group`
    (capacity / world_size slots each). Same forward, stats, dump/load; `dump()` returns this
    rank's rows, `load()` takes the merged dumps of any number of ranks (`merge_collection_dumps`)
    and keeps the ids this rank owns. Every rank must call forward and backward together.

    torchrec's three stages: `input_dist` sends every id to its owner (over gloo from the CPU
    ids when every table's ids are known on the host, else over the device group), `compute`
    looks the received ids up in the local shards, `output_dist` sends the rows back (autograd
    sends the gradients to the owners, where the fused optimizer updates the rows). `forward`
    runs the three; `forward(..., dist_input=)` takes an input dist made ahead of the step
    (`input_dist(..., asynchronous=True)` on the exchange thread, see `SparseDistPipeline`).

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
        self._exchange: _IdExchange | None = None
        # several ranks: this rank's own looked-up rows per table while staged (`stage`)
        self._staged_tables: dict[str, torch.Tensor] | None = None

    def _make_table(self, config: DynamicEmbeddingConfig) -> DynamicEmbeddingTable:
        return make_dynamic_table(
            config,
            self.device,
            backend=self._backend,
            world_size=self.world_size,
            rank=self.rank,
        )

    @property
    def unsharded_module_type(self) -> type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    # ---- input dist made ahead of the step -----------------------------------------------
    def supports_async_input_dist(self) -> bool:
        """Whether `enable_async_input_dist` applies: several ranks, all of the default group
        (the exchange group is created over the default group). The same answer on every rank."""
        return self.world_size > 1 and (self._group is None or self._group is dist.group.WORLD)

    def enable_async_input_dist(self) -> bool:
        """Creates the exchange thread and its gloo group (a collective call: every rank at the
        same point). Returns whether it applies (`supports_async_input_dist`)."""
        if not self.supports_async_input_dist():
            return False
        if self._exchange is None:
            self._exchange = _IdExchange(self.device)
        return True

    def close(self) -> None:
        """Stops the exchange thread, if any (after its pending exchanges)."""
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None

    # ---- torchrec's stages -----------------------------------------------------------------
    def create_context(self) -> DynamicLookupContext:
        return DynamicLookupContext()

    def plan(
        self, ctx: DynamicLookupContext, features: KeyedJaggedTensor, host_ids=None
    ) -> DynamicLookupContext:
        """Fills ``ctx`` with the lookup of ``features`` (each table's ids, counts and scores;
        ``host_ids``: feature -> the same ids on the CPU, where known)."""
        jts = features.to_dict()
        ctx.jagged = jts
        values = {f: jt.values() for f, jt in jts.items()}
        weights = {f: jt.weights_or_none() for f, jt in jts.items()}
        ctx.plans = self._plans(values, host_ids, weights)
        return ctx

    def _plans(self, values, host_ids, weights=None) -> list[_TablePlan]:
        """One `_TablePlan` per table for the ids ``values`` (feature -> ids). Every rank routes
        every table (an absent feature sends zero ids): the collectives must line up across
        ranks."""
        inputs = self._table_inputs(values, host_ids, weights, every=True)
        hids = self._table_host_ids(list(values), host_ids)
        return [
            _TablePlan(table, feats, [values[f].numel() for f in feats], ids, scores, hid)
            for (table, feats, ids, scores, _), hid in zip(inputs, hids, strict=True)
        ]

    def input_dist(  # type: ignore[override]
        self,
        ctx: DynamicLookupContext,
        features: KeyedJaggedTensor,
        host_ids: dict[str, torch.Tensor] | None = None,
        *,
        asynchronous: bool = False,
    ) -> Awaitable[Awaitable[list[_TableRoute]]]:
        """Sends each id to its owner rank: one `_TableRoute` per table. With every table's
        ids on the CPU (``host_ids``, every rank alike) the ids, counts and permutations come
        from the CPU over gloo, all tables in one exchange (no device->host read); else each
        table goes over the device group. ``asynchronous``: the gloo exchange runs on the
        exchange thread (`enable_async_input_dist`) and the awaitable waits for it."""
        self.plan(ctx, features, host_ids)
        return self._route(ctx.plans, asynchronous)

    def _route(
        self, plans: list[_TablePlan], asynchronous: bool = False
    ) -> Awaitable[Awaitable[list[_TableRoute]]]:
        """The input dist of ``plans`` (`input_dist`)."""
        hids = [p.host_ids for p in plans]
        if self.world_size > 1 and hids and all(h is not None for h in hids):
            if asynchronous and self._exchange is not None:
                return NoWait(_FutureAwaitable(self._exchange.submit(self._route_on_host, hids)))
            ok, group = host_group(self._group)
            if ok:
                return NoWait(NoWait(self._route_on_host(hids, group=group)))
        return NoWait(NoWait([self._route_on_device(p) for p in plans]))

    def compute(
        self, ctx: DynamicLookupContext, dist_input: list[_TableRoute]
    ) -> list[torch.Tensor]:
        """Looks the received ids up in this rank's shards: per table, [received, dim] rows."""
        got = [int(p.ids.numel()) for p in ctx.plans]
        if [r.count for r in dist_input] != got:
            raise RuntimeError(
                f"the input dist was made for {[r.count for r in dist_input]} ids per table, but "
                f"the lookup has {got}: it belongs to another batch"
            )
        out = []
        for p, r in zip(ctx.plans, dist_input):
            if self.world_size == 1:  # every id is local
                out.append(p.table(p.ids.to(self.device), p.scores, host_ids=p.host_ids))
                continue
            recv_scores = None
            if p.scores is not None:
                order = _to_device(r.order, self.device)
                s = p.scores.to(self.device, torch.float64)[order]
                recv_scores = s.new_empty(sum(r.recv))
                dist.all_to_all_single(recv_scores, s, r.recv, r.send, group=self._group)
            recv_ids = _to_device(r.recv_ids, self.device)
            recv_host = r.recv_ids if r.recv_ids.device.type == "cpu" else None
            out.append(p.table(recv_ids, recv_scores, host_ids=recv_host))
        return out

    def output_dist(
        self, ctx: DynamicLookupContext, output: list[torch.Tensor]
    ) -> Awaitable[dict[str, JaggedTensor]]:
        """Sends the rows back to the ranks that asked (gradients go the other way in backward)
        and puts them in the lookup's order, split per feature."""
        out: dict[str, JaggedTensor] = {}
        for p, rows, r in zip(ctx.plans, output, ctx.routes):
            rows = self._rows_back(rows, r)
            jts = ctx.jagged
            for f, e in zip(p.features, torch.split(rows, p.sizes)):
                out[f] = JaggedTensor(values=e, lengths=jts[f].lengths(), offsets=jts[f].offsets())
        return NoWait(out)

    def _rows_back(self, rows: torch.Tensor, route: _TableRoute) -> torch.Tensor:
        """One table's ``rows`` of the ids this rank received (`compute`) sent back to the ranks
        that asked, in the order of this rank's own ids (autograd sends the gradients to the
        owners)."""
        if self.world_size == 1:
            return rows
        grad_scale = 1.0 / self.world_size if self.gradient_division else 1.0
        rows = _AllToAllRows.apply(rows, route.send, route.recv, self._group, grad_scale)
        return rows.index_select(0, _to_device(route.inverse, self.device))

    def compute_and_output_dist(self, ctx: DynamicLookupContext, input: list[_TableRoute]):  # noqa: A002
        ctx.routes = input
        return self.output_dist(ctx, self.compute(ctx, input))

    def forward(  # type: ignore[override]
        self,
        features: KeyedJaggedTensor,
        host_ids: dict[str, torch.Tensor] | None = None,
        dist_input: Awaitable | None = None,
    ) -> dict[str, JaggedTensor]:
        """The three stages. ``host_ids``: feature -> the same ids on the CPU; every rank must
        pass them for the same tables (or none): they decide whether the ids route over gloo or
        the device group. ``dist_input``: the `input_dist` already made for exactly these
        features and ids (ahead of the step); every rank must pass one or none. While rows are
        staged (`stage`, several ranks) it returns those, with no collective."""
        if self._staged_tables is not None:
            if dist_input is not None:
                raise RuntimeError("a lookup of staged rows takes no input dist made ahead")
            return self._staged_lookup(features)
        ctx = self.create_context()
        if dist_input is None:
            dist_input = self.input_dist(ctx, features, host_ids)
        else:
            self.plan(ctx, features, host_ids)
        routes = dist_input.wait().wait()
        return self.compute_and_output_dist(ctx, routes).wait()

    def lookup_tables(
        self,
        values: dict[str, torch.Tensor],
        host_ids: dict[str, torch.Tensor] | None = None,
        dist_input: Awaitable | None = None,
    ) -> dict[str, torch.Tensor]:
        """`DynamicEmbeddingCollection.lookup_tables`: table name -> the rows `forward` gives
        the features' ids ``values`` (a table's features concatenated in its feature order),
        every table's (an absent feature's table looks up no ids). On several ranks the ids
        travel to their owners and the rows back as in `forward` (every rank must call it
        together), and the rows' backward sends the gradients to the owners' fused updates.
        ``dist_input``: the `input_dist` of these ids made ahead, as for `forward`. Not for the
        'custom' policy (its scores come with the ids of a KeyedJaggedTensor)."""
        if self.world_size == 1:
            if dist_input is not None:
                raise ValueError("lookup_tables: one rank has no input dist")
            return self._lookup_tables(values, host_ids, every=True)
        for table in self.tables.values():
            if table.config.eviction_policy == "custom":
                raise ValueError(
                    f"lookup_tables: table {table.config.name!r} has eviction_policy='custom', "
                    "whose scores come with the ids (look it up through forward)"
                )
        ctx = self.create_context()
        ctx.plans = self._plans(values, host_ids)
        if dist_input is None:
            dist_input = self._route(ctx.plans)
        ctx.routes = dist_input.wait().wait()
        rows = self.compute(ctx, ctx.routes)
        return {
            p.table.config.name: self._rows_back(r, route)
            for p, r, route in zip(ctx.plans, rows, ctx.routes)
        }

    def stage(self, rows: dict[str, torch.Tensor] | None) -> None:
        """`DynamicEmbeddingCollection.stage`. On several ranks the staged rows are this rank's
        own lookups (`lookup_tables`), not its shards': `forward` then returns them, split per
        feature, without any collective (the whole training step's CUDA graphs,
        `hstu.training.step_graphs`). An empty ``rows`` stages nothing, as None."""
        if self.world_size == 1:
            super().stage(rows)
            return
        rows = rows or {}
        unknown = [n for n in rows if n not in self.tables]
        if unknown:
            raise KeyError(f"stage: no dynamic tables {unknown}; tables: {list(self.tables)}")
        for name, r in rows.items():
            self.tables[name].check_staged(r)
        self._staged_tables = dict(rows) or None

    def _staged_lookup(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """`forward`'s output from the staged rows (`stage`)."""
        jts = features.to_dict()
        unknown = [f for f in jts if f not in self._feature_to_table]
        if unknown:
            raise ValueError(
                f"features {unknown} have no dynamic table; configured: {self.feature_names()}"
            )
        out: dict[str, JaggedTensor] = {}
        for name, table in self.tables.items():
            feats = [f for f in table.config.feature_names if f in jts]
            if not feats:
                continue
            rows = self._staged_tables.get(name)
            sizes = [jts[f].values().numel() for f in feats]
            if rows is None or rows.shape[0] != sum(sizes):
                got = "none" if rows is None else rows.shape[0]
                raise RuntimeError(
                    f"dynamic table {name!r}: a lookup of {sum(sizes)} ids met {got} staged rows "
                    "(they were staged for another batch)"
                )
            for f, e in zip(feats, torch.split(rows, sizes)):
                out[f] = JaggedTensor(values=e, lengths=jts[f].lengths(), offsets=jts[f].offsets())
        return out

    # ---- routing -------------------------------------------------------------------------
    def _route_on_device(self, p: _TablePlan) -> _TableRoute:
        """One table's ids to their owners over the device group (counts read back)."""
        ids = p.ids.to(self.device)
        if self.world_size == 1:
            empty = torch.empty(0, dtype=torch.int64)
            return _TableRoute(ids.numel(), [ids.numel()], [ids.numel()], ids, empty, empty)
        w = self.world_size
        owner = owner_of(ids, w)
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=w)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self._group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        recv_ids = ids.new_empty(sum(recv))
        dist.all_to_all_single(recv_ids, ids[order], recv, send, group=self._group)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return _TableRoute(ids.numel(), send, recv, recv_ids, order, inverse)

    def _route_on_host(
        self,
        host_ids: list[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        pin: bool = False,
    ) -> list[_TableRoute]:
        """Sends each table's CPU ids to their owners over the gloo ``group``, all tables in one
        exchange of counts and one of ids (each collective waits for every rank's host): per
        table, in the order of the device route (by owner, stable), a `_TableRoute`. ``pin``:
        the received ids and permutations in page-locked memory."""
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
        lookup's keys) in the order of the device ids: None where some are not known (or the
        "host" ids are not on the CPU); an empty tensor for a table with no feature here (its
        route must still match the other ranks')."""
        out = []
        for table in self.tables.values():
            feats = [f for f in table.config.feature_names if f in features]
            if feats:
                hid = table_host_ids(host_ids, feats)
                out.append(hid if hid is None or hid.device.type == "cpu" else None)
            else:
                out.append(None if host_ids is None else torch.empty(0, dtype=torch.int64))
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
                torch.empty(_planner_rows(c), c.embedding_dim, device="meta"), requires_grad=False
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


def _planner_rows(c: DynamicEmbeddingConfig) -> int:
    """Rows of the planner's stand-in for a table: its slots, or for a hybrid table as many
    rows as its HBM part (slot directory + cache, all ranks) takes: the planner places HBM, and
    the rows of a hybrid table live in host memory."""
    if c.storage != "hybrid":
        return c.num_slots
    ws = dist.get_world_size() if dist.is_initialized() else 1
    mem = table_memory(
        "dynamic",
        c.capacity,
        c.embedding_dim,
        sparse_optimizer=c.optimizer,
        dense_states=0,
        world_size=ws,
        storage="hybrid",
        hbm_cache=c.hbm_cache,
    )
    return max(1, -(-mem.device * ws // (c.embedding_dim * 4)))


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
