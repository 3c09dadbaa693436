"""HSTU models: RankingGR and RetrievalGR."""

from hstu.models.builder import build_model
from hstu.models.ranking import RankingGR
from hstu.models.retrieval import RetrievalGR

__all__ = ["RankingGR", "RetrievalGR", "build_model"]
