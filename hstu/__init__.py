"""HSTU: a training framework for generative recommenders (ranking and retrieval)."""

__version__ = "0.1.0"
