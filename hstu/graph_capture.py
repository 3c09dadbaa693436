"""Helpers shared by the CUDA graph runners (the encoder's `hstu.modules.graphed_encoder`, the
whole step's `hstu.training.step_graphs`, the dynamic tables' `hstu.embeddings.lookup_graphs`)."""

from __future__ import annotations

import torch

__all__ = ["release_generator"]


def release_generator(device: torch.device) -> None:
    """After a failed capture: the device's default CUDA generator gets a fresh copy of its
    state. A capture that ends in an error leaves the state marked as capturing, and every
    later random op (dropout, negatives) of the eager steps would then raise ("Offset increment
    outside graph capture"); the copy keeps the seed and offset without that mark."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    gen.graphsafe_set_state(gen.clone_state())
