"""Process group setup and torchrec DistributedModelParallel wrapping.

Every run has a process group, also a single process (torchrec's sharded tables need one): under
torchrun the env:// rendezvous, otherwise a private one-rank group on a free loopback port.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hstu.comm import all_reduce_sum_host, host_group
from hstu.embeddings.stack import EmbeddingStack

__all__ = [
    "DistInfo",
    "init_distributed",
    "wrap_model",
    "all_reduce_sum",
    "all_reduce_sum_host",
    "barrier",
    "host_group",
    "cleanup",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device_type: str) -> DistInfo:
    """Joins (or creates) the default process group: NCCL on CUDA, gloo on CPU."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
        else:
            store = dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=timedelta(minutes=5))
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        owns = True
    info = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        owns_group=owns,
    )
    logger.info(
        "process group: rank %d/%d, backend %s, device %s",
        info.rank,
        info.world_size,
        backend,
        device,
    )
    return info


def cleanup(info: DistInfo) -> None:
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums a few floats over all ranks (one collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


_RECAT_CACHE_SIZE = 64


def install_torchrec_recat_cache() -> bool:
    """Makes torchrec's KJT all-to-all stop syncing the host with the GPU on every forward.

    torchrec builds its feature "recat" permutation (`dist_data._get_recat`) from a Python list
    with ``torch.tensor(..., device=cuda)`` each time a sharded embedding collection's input
    distribution runs: a blocking copy from pageable memory, i.e. a full host<->GPU sync per step
    (the only one left in our training forward; measured on the H100: the host then waits for
    the previous step's backward, ~16 ms per step of the e2e benchmark). The permutation depends
    only on the arguments (feature counts, world size, stagger, per-rank batch sizes), so it is
    built once per argument set and the device tensor is reused (torchrec only reads it). Returns
    whether the wrapper is installed (False when this torchrec has no `_get_recat`). Idempotent.
    """
    import functools
    import inspect

    try:
        from torchrec.distributed import dist_data
    except ImportError:
        return False
    original = getattr(dist_data, "_get_recat", None)
    if original is None:
        return False
    if getattr(original, "_hstu_cached", False):
        return True
    signature = inspect.signature(original)
    cache: dict[tuple, torch.Tensor | None] = {}

    @functools.wraps(original)
    def cached_recat(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = dict(bound.arguments)
        device = params.get("device")
        if device is None or torch.device(device).type != "cuda":
            return original(*args, **kwargs)
        sizes = params.get("batch_size_per_rank")
        key = tuple(
            (name, tuple(value) if isinstance(value, list) else value)
            for name, value in params.items()
            if name != "batch_size_per_rank"
        ) + (("batch_size_per_rank", None if sizes is None else tuple(sizes)),)
        if key not in cache:
            params["device"] = None  # built on the host, then one copy to the device
            host = original(**params)
            cache[key] = None if host is None else host.to(torch.device(device))
            if len(cache) > _RECAT_CACHE_SIZE:
                cache.pop(next(iter(cache)))
        return cache[key]

    cached_recat._hstu_cached = True  # type: ignore[attr-defined]
    dist_data._get_recat = cached_recat
    return True


def use_ddp(world_size: int) -> bool:
    """Whether the dense parameters go under DDP: with more than one rank; with one only when
    HSTU_SINGLE_PROCESS_DDP=1 (for comparisons). A single process has nothing to average, and DDP
    still costs host time every step: a gradient copy (scaled by 1 / world size) into its bucket
    per parameter, and the bucket all-reduces."""
    value = os.environ.get("HSTU_SINGLE_PROCESS_DDP", "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"HSTU_SINGLE_PROCESS_DDP={value!r} is not supported: 1 (a single process trains "
            "under DDP too), 0 or unset (it does not)"
        )
    return world_size > 1 or value == "1"


def _no_data_parallel():
    """A torchrec DataParallelWrapper that leaves the unsharded modules unwrapped and only moves
    them to the device, as DDP's wrapping would (state-dict keys are the same either way:
    DistributedModelParallel strips DDP's "module." prefix)."""
    from torchrec.distributed.model_parallel import DataParallelWrapper

    class NoDataParallel(DataParallelWrapper):
        def wrap(self, dmp, env, device: torch.device) -> None:
            dmp.module.to(device)

    return NoDataParallel()


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of a CUDA device in bytes (what torchrec's planner may place tables in)."""
    return int(torch.cuda.mem_get_info(device)[1])


def planner_constraints(embeddings: EmbeddingStack, world_size: int) -> dict | None:
    """torchrec planner constraints: on one rank, each torchrec table whole and table-wise
    (None elsewhere: the planner chooses). On one GPU the planner may place a table row-wise,
    one shard of all its rows, the same kernels; but a row-wise lookup first bucketizes the ids,
    which drops their per-key lengths, and torchrec's all-to-all then reads those back from the
    GPU: a host-device sync in every step (docs/architecture.md, "Host/device synchronisation").
    Checkpoints do not depend on the placement (`hstu.training.reshard`)."""
    if world_size != 1 or embeddings.embedding_collection is None:
        return None
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    table_wise = [ShardingType.TABLE_WISE.value]
    return {
        spec.name: ParameterConstraints(sharding_types=table_wise)
        for spec in embeddings.table_specs
        if not spec.dynamic
    }


def wrap_model(
    model: nn.Module,
    info: DistInfo,
    embeddings: EmbeddingStack,
    data_parallel: bool | None = None,
) -> nn.Module:
    """Shards the model's tables with DistributedModelParallel (dense parts under DDP when there
    are several ranks, see `use_ddp`; ``data_parallel=False``: never, the caller averages the
    gradients itself, `FlatGradients`).

    The planner places tables for this world size; on CPU it plans for host memory. The sharders
    come from the model's `EmbeddingStack` (torchrec tables and dynamic tables side by side).
    """
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.comm_ops import get_gradient_division
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    install_torchrec_recat_cache()

    # ordinary torchrec tables and dynamic (hash) tables side by side in one DMP. The trainer
    # scales each rank's loss for DDP's gradient averaging; torchrec divides its tables' summed
    # gradients by the world size to match (comm_ops.GRADIENT_DIVISION), and so do dynamic tables:
    # every table sees the global-batch gradient at any world size.
    sharders = embeddings.sharders(gradient_division=get_gradient_division())
    # the planner's memory is the device's real memory (torchrec assumes 32 GB of HBM otherwise)
    topology = Topology(
        world_size=info.world_size,
        compute_device=info.device.type,
        hbm_cap=device_memory_bytes(info.device) if info.device.type == "cuda" else None,
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, constraints=planner_constraints(embeddings, info.world_size)
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if data_parallel is None:
        data_parallel = use_ddp(info.world_size)
    wrapper = None if data_parallel else _no_data_parallel()
    return DistributedModelParallel(
        model, device=info.device, plan=plan, sharders=sharders, data_parallel_wrapper=wrapper
    )


class FlatGradients:
    """The gradients of ``params`` as views of one flat buffer per dtype, averaged over the ranks
    by one all-reduce per buffer: the data parallelism of a training step replayed whole from
    CUDA graphs on several processes (hstu.training.step_graphs), where DDP's gradient hooks,
    which start their all-reduces from the host during the backward, cannot run. The collective
    sits inside the captured step and runs at every replay; an eager step calls it alike, so
    every rank issues the same collectives whichever of its steps replay.

    The parameters are broadcast from rank 0 first (as DDP's construction does). The gradients
    must then be zeroed in place, never set to None (the step graphs already require that)."""

    def __init__(self, params: list[nn.Parameter], world_size: int) -> None:
        self.world_size = int(world_size)
        self.params = list(params)
        self.buffers: list[torch.Tensor] = []
        by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)
            for (dtype, device), group in by_dtype.items():
                flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
                offset = 0
                for p in group:
                    p.grad = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.buffers.append(flat)

    def views_intact(self) -> bool:
        """Whether every parameter's gradient is still a view of the buffers."""
        ptrs = {b.untyped_storage().data_ptr() for b in self.buffers}
        return all(
            p.grad is not None and p.grad.untyped_storage().data_ptr() in ptrs for p in self.params
        )

    def all_reduce(self) -> None:
        """Averages the gradients over the ranks (sum, then / world size). Raises when a
        gradient was replaced (set to None or to a new tensor): its values would not be
        averaged."""
        if not self.views_intact():
            raise RuntimeError(
                "FlatGradients: a parameter's gradient is no longer a view of the flat buffers "
                "(set to None or replaced); zero the gradients in place "
                "(optimizer.zero_grad(set_to_none=False))"
            )
        for flat in self.buffers:
            dist.all_reduce(flat)
            flat.mul_(1.0 / self.world_size)
