"""Host-side collectives every layer may use: sums and exchanges of CPU numbers over a gloo
group spanning the same ranks as the default group, so that they never enqueue work on a GPU
stream nor wait for it."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["host_group", "all_reduce_sum_host"]

# (default group it was made for, gloo group over the same ranks)
_HOST_GROUP: tuple[object, object] | None = None


def _host_group():
    """A gloo group over the same ranks for host-side sums (created once per default group,
    collectively).

    Sums of host numbers (loss-term counts, FLOPs) go through it, so they never enqueue work
    on the GPU stream nor wait for it: the training step stays free of host<->device syncs.
    """
    global _HOST_GROUP
    if dist.get_backend() == "gloo":
        return None  # the default group is already host-side
    world = dist.group.WORLD
    if _HOST_GROUP is None or _HOST_GROUP[0] is not world:
        _HOST_GROUP = (world, dist.new_group(backend="gloo"))
    return _HOST_GROUP[1]


def host_group(group: dist.ProcessGroup | None = None) -> tuple[bool, dist.ProcessGroup | None]:
    """(available, gloo group) for host-side collectives over the ranks of ``group`` (None: the
    default group). Returns ``(True, None)`` when ``group`` is the default group and already
    gloo, ``(False, None)`` for a device subgroup (no gloo twin is kept for subgroups)."""
    if dist.get_backend(group) == "gloo":
        return True, group
    if group is None or group is dist.group.WORLD:
        return True, _host_group()
    return False, None


def all_reduce_sum_host(values: list[float]) -> list[float]:
    """Sums a few host floats over all ranks without touching the GPU (gloo group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=_host_group())
    return t.tolist()
