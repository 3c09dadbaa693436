"""Ordinary torchrec embedding tables behind the small interface the models use.

A model owns one embedding collection: ``collection(kjt) -> dict[feature, JaggedTensor]``
(torchrec's ``EmbeddingCollection`` contract). Dynamic tables (``hstu.embeddings.dynamic_table``)
honour the same contract, so the models never know which kind they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig

__all__ = ["TableSpec", "build_embedding_collection", "apply_sparse_optimizer", "SPARSE_OPTIMIZERS"]

SPARSE_OPTIMIZERS = ("sgd", "adam", "adagrad", "rowwise_adagrad")
# fbgemm's CPU TBE kernels implement only these (torchrec fuses the optimizer into backward).
CPU_SPARSE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


@dataclass
class TableSpec:
    """One embedding table: ``feature_names`` all look up rows of this table."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)
    dynamic: bool = False
    capacity: int = 0

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0:
            raise ValueError(f"table {self.name!r}: num_embeddings must be > 0")
        if self.embedding_dim <= 0:
            raise ValueError(f"table {self.name!r}: embedding_dim must be > 0")
        if not self.feature_names:
            raise ValueError(f"table {self.name!r}: needs at least one feature name")


def build_embedding_collection(
    specs: list[TableSpec], *, init_std: float = 0.02, generator: torch.Generator | None = None
) -> nn.Module:
    """Builds a torchrec EmbeddingCollection on CPU with seeded N(0, init_std) rows.

    Built on a real device (not meta) on purpose: DistributedModelParallel copies these rows into
    its shards, so every world size starts from identical tables.
    """
    configs = [
        EmbeddingConfig(
            name=s.name,
            embedding_dim=s.embedding_dim,
            num_embeddings=s.num_embeddings,
            feature_names=list(s.feature_names),
        )
        for s in specs
    ]
    ec = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for s in specs:
            w = ec.embeddings[s.name].weight
            w.copy_(torch.randn(w.shape, generator=generator) * init_std)
    return ec


def apply_sparse_optimizer(
    module: nn.Module, optimizer: str, lr: float, *, device_type: str, eps: float = 1e-8
) -> None:
    """Fuses the sparse optimizer into the backward of ``module``'s tables (torchrec style)."""
    import torchrec.optim as trec_optim
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if optimizer not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"EmbeddingArgs.sparse_optimizer_str={optimizer!r} is not supported: "
            f"one of {list(SPARSE_OPTIMIZERS)}"
        )
    if device_type == "cpu" and optimizer not in CPU_SPARSE_OPTIMIZERS:
        raise ValueError(
            f"EmbeddingArgs.sparse_optimizer_str={optimizer!r} has no CPU kernel in torchrec/fbgemm "
            f"(CPU development mode supports {list(CPU_SPARSE_OPTIMIZERS)}); use "
            f"--gin-bindings \"EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'\" on CPU"
        )
    classes = {
        "sgd": (torch.optim.SGD, {"lr": lr}),
        "adam": (torch.optim.Adam, {"lr": lr, "eps": eps}),
        "adagrad": (torch.optim.Adagrad, {"lr": lr, "eps": eps}),
        "rowwise_adagrad": (trec_optim.RowWiseAdagrad, {"lr": lr, "eps": eps}),
    }
    cls, kwargs = classes[optimizer]
    apply_optimizer_in_backward(cls, module.parameters(), kwargs)
