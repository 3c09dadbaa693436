"""Embedding tables: ordinary torchrec tables and dynamic (hash) tables, one interface.

Both kinds take a KeyedJaggedTensor and return ``dict[feature, JaggedTensor]``; both are sharded
by torchrec's DistributedModelParallel (``EmbeddingCollectionSharder`` and
``DynamicEmbeddingSharder``).
"""

from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
from hstu.embeddings.dynamic_table import DynamicEmbeddingCollection, DynamicEmbeddingTable
from hstu.embeddings.sharding import DynamicEmbeddingSharder, merge_collection_dumps
from hstu.embeddings.static import TableSpec, apply_sparse_optimizer, build_embedding_collection

__all__ = [
    "TableSpec",
    "build_embedding_collection",
    "apply_sparse_optimizer",
    "DynamicEmbeddingConfig",
    "DynamicEmbeddingCollection",
    "DynamicEmbeddingTable",
    "DynamicEmbeddingSharder",
    "merge_collection_dumps",
]
