"""Inference: top-K retrieval from a training checkpoint (`Retriever`), ranking with a KV cache
of the history (`Ranker`), or serving an exported artifact (`RetrievalArtifact`,
`RankingArtifact`, `load_artifact`: torch only, no torchrec, no gin).

Names load on first use, so that ``import hstu.inference.artifact`` stays free of the training
stack."""

from __future__ import annotations

import importlib

__all__ = [
    "RankingArtifact",
    "Ranker",
    "RetrievalArtifact",
    "Retriever",
    "UserHistory",
    "as_user_history",
    "find_run_config",
    "load_artifact",
]

_WHERE = {
    "Retriever": "hstu.inference.retriever",
    "find_run_config": "hstu.inference.retriever",
    "RetrievalArtifact": "hstu.inference.artifact",
    "RankingArtifact": "hstu.inference.artifact",
    "load_artifact": "hstu.inference.artifact",
    "Ranker": "hstu.inference.ranker",
    "UserHistory": "hstu.inference.requests",
    "as_user_history": "hstu.inference.requests",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hstu.inference' has no attribute {name!r}")
