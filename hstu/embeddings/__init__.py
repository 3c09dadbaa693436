"""Embedding tables behind one interface: `EmbeddingStack` owns every backend (torchrec tables,
dynamic hash tables, plain tables), the lookup, the sparse optimizer, the tables' checkpoint
state and their statistics.

The collections take a KeyedJaggedTensor and return ``dict[feature, JaggedTensor]``; torchrec's
DistributedModelParallel shards them (``EmbeddingCollectionSharder`` and
``DynamicEmbeddingSharder``).
"""

from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import (
    DynamicEmbeddingCollection,
    DynamicEmbeddingTable,
    make_dynamic_table,
)
from hstu.embeddings.hybrid_table import HybridDynamicEmbeddingTable
from hstu.embeddings.sharding import DynamicEmbeddingSharder, merge_collection_dumps
from hstu.embeddings.stack import EmbeddingStack, SparseInput
from hstu.embeddings.static import TableSpec, apply_sparse_optimizer, build_embedding_collection

__all__ = [
    "EmbeddingStack",
    "SparseInput",
    "TableSpec",
    "build_embedding_collection",
    "apply_sparse_optimizer",
    "DynamicEmbeddingConfig",
    "DynamicEmbeddingCollection",
    "DynamicEmbeddingTable",
    "HybridDynamicEmbeddingTable",
    "make_dynamic_table",
    "DynamicEmbeddingSharder",
    "merge_collection_dumps",
]
