"""World-size-independent checkpoint state: sharded tensors saved as (offset, piece) records.

torchrec stores a sharded table (and its fused optimizer state, e.g. row-wise Adagrad's
``momentum1``) in ``state_dict()`` as a ``ShardedTensor`` (or a ``DTensor``) whose pickled form is
bound to the rank and world size that wrote it. :func:`to_portable` replaces each one by a plain
record ``{"__hstu_shards__": 1, "global_shape": [...], "pieces": [{"offsets": [...], "tensor":
t}]}`` holding this rank's pieces and where they sit in the global tensor. :func:`restore_into`
fills the current run's state (any world size, any planner placement) from the records of every
saved rank: each local piece of the target copies the overlapping parts of the saved pieces, and
the copied volume must cover it exactly.

Plain (replicated) tensors and non-tensor leaves are taken from the first source, so callers
pass the sources with the authoritative one first (this rank's own file, or rank 0's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "SHARDS_KEY",
    "fit_optimizer_state_shapes",
    "is_sharded",
    "to_portable",
    "restore_into",
    "has_live_shards",
    "unexpected_keys",
]

SHARDS_KEY = "__hstu_shards__"

_Piece = tuple[tuple[int, ...], torch.Tensor]


def _sharded_tensor_type() -> type | None:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return ShardedTensor


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return None
    return DTensor


def is_sharded(value: Any) -> bool:
    """True for a live ShardedTensor or DTensor (a tensor split over ranks)."""
    st, dt = _sharded_tensor_type(), _dtensor_type()
    return (st is not None and isinstance(value, st)) or (dt is not None and isinstance(value, dt))


def _is_record(value: Any) -> bool:
    return isinstance(value, Mapping) and SHARDS_KEY in value


def _pieces(value: Any, where: str) -> tuple[tuple[int, ...], list[_Piece]]:
    """(global shape, [(offsets, local tensor)]) of a live sharded tensor or a saved record."""
    if _is_record(value):
        pieces = [(tuple(int(o) for o in p["offsets"]), p["tensor"]) for p in value["pieces"]]
        return tuple(int(s) for s in value["global_shape"]), pieces
    st, dt = _sharded_tensor_type(), _dtensor_type()
    if st is not None and isinstance(value, st):
        pieces = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
        return tuple(value.size()), pieces
    if dt is not None and isinstance(value, dt):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(p.is_partial() for p in value.placements):
            raise ValueError(
                f"{where}: a DTensor with a Partial placement holds unreduced values and cannot "
                "be checkpointed shard by shard"
            )
        local = value.to_local()
        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return tuple(value.shape), [(tuple(int(o) for o in offsets), local)]
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), [((0,) * value.dim(), value)]
    raise TypeError(f"{where}: expected a tensor, got {type(value).__name__}")


def to_portable(obj: Any) -> Any:
    """Copy of a (nested) state dict with every ShardedTensor/DTensor turned into a record.

    The pieces are the live local tensors (no copy); ``torch.save`` writes them as they are.
    Records hold only tensors, ints and lists, so they load with ``weights_only=True``.
    """
    if is_sharded(obj):
        shape, pieces = _pieces(obj, "state")
        return {
            SHARDS_KEY: 1,
            "global_shape": list(shape),
            "pieces": [{"offsets": list(o), "tensor": t.detach()} for o, t in pieces],
        }
    if isinstance(obj, Mapping):
        return type(obj)((k, to_portable(v)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, list):
        return [to_portable(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_portable(v) for v in obj)
    return obj


def has_live_shards(obj: Any) -> bool:
    """True when ``obj`` still holds ShardedTensors/DTensors (a checkpoint of format 1)."""
    if is_sharded(obj):
        return True
    if isinstance(obj, Mapping):
        return any(has_live_shards(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_live_shards(v) for v in obj)
    return False


def _copy_overlaps(
    dst: torch.Tensor, dst_off: Sequence[int], sources: list[_Piece], where: str
) -> None:
    """Fill ``dst`` (placed at ``dst_off`` in the global tensor) from overlapping source pieces."""
    covered = 0
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for src_off, src in sources:
        key = (tuple(src_off), tuple(src.shape))
        if key in seen:  # the same piece held by several ranks (replicated placement)
            continue
        seen.add(key)
        dst_sl, src_sl, volume = [], [], 1
        for d in range(dst.dim()):
            lo = max(dst_off[d], src_off[d])
            hi = min(dst_off[d] + dst.shape[d], src_off[d] + src.shape[d])
            if hi <= lo:
                volume = 0
                break
            dst_sl.append(slice(lo - dst_off[d], hi - dst_off[d]))
            src_sl.append(slice(lo - src_off[d], hi - src_off[d]))
            volume *= hi - lo
        if volume == 0 and dst.dim() > 0:
            continue
        with torch.no_grad():
            dst[tuple(dst_sl)].copy_(src[tuple(src_sl)])
        covered += volume
    if covered != dst.numel():
        raise ValueError(
            f"{where}: the checkpoint's shards cover {covered} of the {dst.numel()} values of "
            f"this rank's piece at offsets {list(dst_off)} (shape {list(dst.shape)}); the saved "
            "rank files are incomplete or overlap"
        )


def _restore_tensor(target: Any, values: list[Any], where: str) -> Any:
    t_shape, t_pieces = _pieces(target, where)
    src_pieces: list[_Piece] = []
    for v in values:
        shape, pieces = _pieces(v, where)
        if shape != t_shape:
            raise ValueError(
                f"{where}: shape {list(shape)} in the checkpoint but {list(t_shape)} in this "
                "run; the model or table sizes changed since the checkpoint was written"
            )
        src_pieces.extend(pieces)
        if not (_is_record(v) or is_sharded(v)):
            break  # a replicated plain tensor: the first copy is the whole tensor
    for off, piece in t_pieces:
        _copy_overlaps(piece, off, src_pieces, where)
    return target


def restore_into(target: Any, sources: Sequence[Any], where: str = "state") -> Any:
    """``target`` (this run's state dict) with every tensor filled from ``sources``.

    ``sources`` are the same entry of the saved rank files, the authoritative copy first.
    Tensors are filled in place (sharded ones piece by piece from every source); other leaves
    are replaced by the first source's value. Returns the filled structure, ready for
    ``load_state_dict``.
    """
    if not sources:
        raise ValueError(f"{where}: missing from the checkpoint")
    if is_sharded(target) or isinstance(target, torch.Tensor) or _is_record(target):
        return _restore_tensor(target, list(sources), where)
    if isinstance(target, Mapping):
        out = {}
        for k, v in target.items():
            present = [s[k] for s in sources if isinstance(s, Mapping) and k in s]
            if not present:
                raise ValueError(
                    f"{where}[{k!r}] is in this run's state but not in the checkpoint; was it "
                    "written by a different model configuration?"
                )
            out[k] = restore_into(v, present, f"{where}[{k!r}]")
        if isinstance(target, OrderedDict):
            ordered = OrderedDict(out)
            meta = getattr(target, "_metadata", None)  # module state-dict versions
            if meta is not None:
                ordered._metadata = meta  # type: ignore[attr-defined]
            return ordered
        return out
    return sources[0]


def unexpected_keys(target: Mapping[str, Any], source: Mapping[str, Any]) -> list[str]:
    """Top-level keys the checkpoint has and this run's state lacks."""
    return sorted(set(source) - set(target))


# model entries renamed since checkpoint files were first written (old prefix -> new prefix):
# the tables moved from the model into its EmbeddingStack (``model.embeddings``)
_RENAMED_PREFIXES = {
    "embedding_collection.": "embeddings.embedding_collection.",
    "dense_tables.": "embeddings.dense_tables.",
}


def _renamed(name: str) -> str:
    for old, new in _RENAMED_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


# model entries whose tensor changed shape, not size: the position-only relative attention bias
# of each layer, one shared vector [2P + 1], is now RelativeAttentionBias.pos_weight [1, 2P + 1]
_OLD_RELATIVE_BIAS = ".relative_bias.weight"
_NEW_RELATIVE_BIAS = ".relative_bias.pos_weight"


def _upgrade_relative_bias(model: Any) -> Any:
    if not isinstance(model, dict) or not any(
        isinstance(k, str) and k.endswith(_OLD_RELATIVE_BIAS) for k in model
    ):
        return model
    pairs = []
    for k, v in model.items():
        if isinstance(k, str) and k.endswith(_OLD_RELATIVE_BIAS):
            k = k[: -len(_OLD_RELATIVE_BIAS)] + _NEW_RELATIVE_BIAS
            v = v.reshape(1, -1) if isinstance(v, torch.Tensor) else v
        pairs.append((k, v))
    out = type(model)(pairs)
    meta = getattr(model, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def fit_optimizer_state_shapes(optimizer: torch.optim.Optimizer) -> int:
    """Reshape loaded optimizer state tensors written for a parameter that has since gained a
    leading dimension of 1 (the relative bias of older files, [2P + 1], is now [1, 2P + 1]; see
    `upgrade_state_keys`); call after ``optimizer.load_state_dict``. Only that upgrade is
    applied: any other shape mismatch is left for the optimizer to report, never reshaped
    silently. Returns how many tensors were reshaped."""
    fixed = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or p.dim() < 1 or p.shape[0] != 1:
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.shape == p.shape[1:]:
                    state[key] = value.reshape(p.shape)
                    fixed += 1
    return fixed


def upgrade_state_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """A rank file's state with the model and fused-optimizer entries of older files under their
    current names (state keys, and the parameter names in optimizer param groups), and the
    position-only relative bias of older files (``<layer>.relative_bias.weight`` [2P + 1]) as
    ``<layer>.relative_bias.pos_weight`` [1, 2P + 1] (its dense optimizer state, keyed by
    parameter index, is reshaped by `fit_optimizer_state_shapes` after loading). Other entries
    are returned as they are; current files come back unchanged."""

    def rename(obj: Any) -> Any:
        if isinstance(obj, dict):  # (OrderedDict included: state dicts keep their type)
            pairs = [(_renamed(k) if isinstance(k, str) else k, rename(v)) for k, v in obj.items()]
            return type(obj)(pairs)
        if isinstance(obj, list):
            return [_renamed(v) if isinstance(v, str) else rename(v) for v in obj]
        return obj

    out = dict(state)
    for key in ("model", "fused_optimizer"):
        if key in out:
            out[key] = rename(out[key])
    if "model" in out:
        out["model"] = _upgrade_relative_bias(out["model"])
    return out
