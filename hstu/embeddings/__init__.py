"""Embedding tables: ordinary torchrec tables and dynamic (hash) tables, one interface."""

from hstu.embeddings.static import TableSpec, apply_sparse_optimizer, build_embedding_collection

__all__ = ["TableSpec", "build_embedding_collection", "apply_sparse_optimizer"]
