"""Inference from training checkpoints: top-K retrieval (`Retriever`)."""

from hstu.inference.retriever import Retriever, UserHistory, as_user_history, find_run_config

__all__ = ["Retriever", "UserHistory", "as_user_history", "find_run_config"]
