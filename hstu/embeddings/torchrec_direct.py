"""The training lookup of torchrec tables on one rank, without torchrec's distribution.

On one rank with every torchrec table placed table-wise (`hstu.training.distributed.
planner_constraints`), a sharded `EmbeddingCollection`'s input and output "distributions" move
nothing: the ids stay on the rank and so do the rows. What they cost is host time: torchrec's
Python around each lookup (the KJT's permutation to the sharding's feature order, the all-to-all
of one rank, the awaitables, the output split into per-feature `JaggedTensor`s), several
milliseconds a step for the small configs, whose GPU work for the same step is ~2 ms.

`DirectLookup` calls the collection's own fbgemm modules (torchrec's `BatchedFusedEmbedding`, the
table-batched embedding with the optimizer fused into its backward) with each group's features
and splits the rows per feature: the same kernels on the same ids, so the same rows and the same
fused updates (CPU test: rows and tables after the updates equal those of the collection's
forward; `EmbeddingStack.lookup_sparse` and `EmbeddingStack.forward` use it). `DirectLookup.of`
takes only a collection whose structure it knows (one rank, only
table-wise shards, one lookup of table-batched modules, no index deduplication); for any other it
returns None and the caller keeps the collection's forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

__all__ = ["DirectLookup"]


class DirectLookup:
    """The fbgemm modules of a one-rank, table-wise sharded `EmbeddingCollection`, each with the
    features it looks up (in the order its tables expect them)."""

    def __init__(self, groups: list[tuple[nn.Module, list[str]]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, collection: nn.Module, features: list[str]) -> DirectLookup | None:
        """The direct lookup of ``collection`` for ``features`` (each looked up by exactly one
        of its modules), or None when ``collection`` is not a sharded collection this knows how
        to call directly (`why_not` says why; logged at debug level)."""
        why = cls.why_not(collection, features)
        if why:
            logger.debug("torchrec tables: the lookup goes through torchrec (%s)", why)
            return None
        return cls(_groups(collection))

    @staticmethod
    def why_not(collection: nn.Module, features: list[str]) -> str:
        """Why ``collection`` is not looked up directly for ``features`` ("" when it is)."""
        why = _unsupported(collection)
        if not why:
            found = [f for _, names in _groups(collection) for f in names]
            if sorted(found) != sorted(features) or len(set(found)) != len(found):
                why = f"its modules look up {found}, the stack asks for {features}"
        return why

    def __call__(
        self, kjt_of: Callable[[list[str]], KeyedJaggedTensor], counts: dict[str, int]
    ) -> dict[str, torch.Tensor]:
        """feature -> its [count, table width] rows. ``kjt_of(names)``: the batch's ids of
        ``names`` as one KJT in that order; ``counts``: each feature's id count (host ints)."""
        out: dict[str, torch.Tensor] = {}
        for module, names in self.groups:
            rows = module(kjt_of(names))
            out.update(zip(names, rows.split([counts[n] for n in names])))
        return out


def _unsupported(collection: nn.Module) -> str:
    """Why ``collection`` is not one `DirectLookup` calls directly ("" when it is)."""
    try:
        from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding
        from torchrec.distributed.embedding import ShardedEmbeddingCollection
        from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
    except ImportError as e:  # a torchrec without these modules
        return f"torchrec lacks {e.name}"
    if not isinstance(collection, ShardedEmbeddingCollection):
        return f"not sharded ({type(collection).__name__})"
    env = getattr(collection, "_env", None)
    if env is None or getattr(env, "world_size", None) != 1:
        return "not one rank"
    kinds = list(getattr(collection, "_sharding_type_to_sharding", {}) or [])
    if kinds != ["table_wise"]:
        return f"sharding types {kinds} (only table-wise is called directly)"
    if getattr(collection, "_use_index_dedup", True) or getattr(collection, "_need_indices", True):
        return "index deduplication or indices kept"
    lookups = getattr(collection, "_lookups", None)
    if lookups is None or len(lookups) != 1 or not isinstance(lookups[0], GroupedEmbeddingsLookup):
        return "not one grouped lookup"
    for op in lookups[0]._emb_modules:
        if not isinstance(op, BaseBatchedEmbedding) or not hasattr(op, "_config"):
            return f"a lookup module of type {type(op).__name__}"
    return ""


def _groups(collection: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """The table-batched modules of a supported collection, each with its features."""
    return [(op, list(op._config.feature_names())) for op in collection._lookups[0]._emb_modules]
