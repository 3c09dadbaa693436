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
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.config.args import SPARSE_OPTIMIZERS

__all__ = [
    "TableSpec",
    "DenseEmbeddingCollection",
    "build_embedding_collection",
    "apply_sparse_optimizer",
]

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


def init_rows_(
    weight: torch.Tensor,
    initializer: str,
    init_std: float,
    generator: torch.Generator | None = None,
) -> None:
    """Fills ``weight`` in place: N(0, s), N(0, s) truncated at 2s, U(-s, s) or the constant s."""
    with torch.no_grad():
        if initializer == "normal":
            weight.copy_(torch.randn(weight.shape, generator=generator) * init_std)
        elif initializer == "truncated_normal":
            rows = torch.empty(weight.shape)
            torch.nn.init.trunc_normal_(
                rows, std=init_std, a=-2 * init_std, b=2 * init_std, generator=generator
            )
            weight.copy_(rows)
        elif initializer == "uniform":
            weight.copy_((torch.rand(weight.shape, generator=generator) * 2 - 1) * init_std)
        elif initializer == "constant":
            weight.fill_(init_std)
        else:
            raise ValueError(
                f"EmbeddingArgs.initializer={initializer!r} is not supported: one of "
                "'normal', 'truncated_normal', 'uniform', 'constant'"
            )


class DenseEmbeddingCollection(nn.Module):
    """Plain ``nn.Embedding`` tables with torchrec's ``EmbeddingCollection`` contract
    (``collection(kjt) -> dict[feature, JaggedTensor]``).

    EmbeddingArgs.embedding_backend='dense': the tables are ordinary dense parameters, so the
    dense optimizer updates every row at every step (Adam moments included) and DDP replicates
    them, exactly as Meta's reference HSTU trains its item table. Meant for small catalogues
    (every rank holds every row; the gradient is a dense [rows, dim] tensor).
    """

    def __init__(
        self,
        specs: list[TableSpec],
        *,
        initializer: str = "normal",
        init_std: float = 0.02,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.tables = nn.ModuleDict()
        self.feature_to_table: dict[str, str] = {}
        for s in specs:
            if s.dynamic:
                raise ValueError(f"table {s.name!r} is dynamic; a dense collection holds none")
            table = nn.Embedding(s.num_embeddings, s.embedding_dim)
            init_rows_(table.weight, initializer, init_std, generator)
            self.tables[s.name] = table
            for f in s.feature_names:
                if f in self.feature_to_table:
                    raise ValueError(f"feature {f!r} is listed by two tables")
                self.feature_to_table[f] = s.name

    def table_of(self, feature: str) -> nn.Embedding:
        """The table that serves ``feature``."""
        if feature not in self.feature_to_table:
            raise KeyError(
                f"feature {feature!r} has no table (tables serve {sorted(self.feature_to_table)})"
            )
        return self.tables[self.feature_to_table[feature]]

    def check_ids(self, feature: str, ids: torch.Tensor) -> None:
        """ValueError when ``ids`` (best on the CPU: on a GPU the min/max are read back) fall
        outside ``feature``'s table."""
        n = self.table_of(feature).num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ValueError(
                f"feature {feature!r}: ids must lie in [0, {n}); got "
                f"{int(ids.min())}..{int(ids.max())}"
            )

    def forward(
        self, features: KeyedJaggedTensor, host_ids: dict[str, torch.Tensor] | None = None
    ) -> dict[str, JaggedTensor]:
        """``host_ids``: feature -> the same ids on the CPU, where the id range is checked
        (without them a GPU lookup reads the ids' min/max back: a host<->device sync)."""
        out: dict[str, JaggedTensor] = {}
        host_ids = host_ids or {}
        for key, jt in features.to_dict().items():
            table = self.table_of(key)
            ids = jt.values().long()
            self.check_ids(key, host_ids.get(key, ids))
            out[key] = JaggedTensor(values=table(ids), lengths=jt.lengths())
        return out


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
