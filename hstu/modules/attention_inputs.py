"""`AttentionInputs`: the jagged layout every HSTU layer of one forward pass shares.

A leaf module (no imports from the layers), so the preprocessor, both layers and the encoder can
import it without import cycles; `hstu.modules.hstu_layer` re-exports it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["AttentionInputs"]


@functools.cache
def _cuda_available() -> bool:
    """torch.cuda.is_available(), asked once (it costs microseconds per call, and the layers ask
    for their metadata at every call)."""
    return torch.cuda.is_available()


@dataclass
class AttentionInputs:
    """Jagged layout shared by every layer of one forward pass.

    ``host_*``: optional CPU int64 copies of the metadata (the preprocessor makes them from the
    batch's CPU twin). The compiled attention op validates CPU metadata on the host and copies it
    to the GPU asynchronously; given the device tensors instead it must read them back first, a
    host<->GPU sync. `kernel_metadata()` picks what to hand the op."""

    seq_offsets: torch.Tensor  # [B+1] int64
    max_seqlen: int
    num_contexts: torch.Tensor | None = None  # [B]
    num_targets: torch.Tensor | None = None  # [B]
    host_seq_offsets: torch.Tensor | None = None  # [B+1] CPU int64, same values as seq_offsets
    host_num_contexts: torch.Tensor | None = None  # [B] CPU int64 (None iff num_contexts is None)
    host_num_targets: torch.Tensor | None = None  # [B] CPU int64 (None iff num_targets is None)
    # trailing sequences that only hold padding rows (`SequencePreprocessor` pads the token count
    # so matmul shapes repeat across batches); not part of the batch: no FLOPs, no outputs read
    padding_sequences: int = 0
    # [T] int64 on the device, one per token (padding rows included): the time of each token for
    # the relative time bias (contextual tokens take their sequence's first item time, padding
    # rows 0); None when the model has no time bias or the batch no timestamps
    timestamps: torch.Tensor | None = None
    # [B] int64 on the device (padding sequences included) or None: the time each sequence's
    # last token queries at in the relative time bias (retrieval evaluation: the held-out item's
    # time, the request time); None: the last token's own time
    last_query_time: torch.Tensor | None = None
    # [1] float32 on the device: 1 / the batch's longest sequence, set when ``max_seqlen`` is only
    # an upper bound (a captured CUDA graph's, `hstu.modules.graphed_encoder`): the compiled
    # attention then reads its default scaling from here instead of 1 / max_seqlen
    inv_max_seqlen: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.last_query_time is not None and (
            self.last_query_time.dtype != torch.int64
            or self.last_query_time.shape != (self.seq_offsets.numel() - 1,)
        ):
            raise TypeError(
                f"AttentionInputs: last_query_time must be int64 [B] = "
                f"[{self.seq_offsets.numel() - 1}]; got {self.last_query_time.dtype} of shape "
                f"{tuple(self.last_query_time.shape)}"
            )
        if self.timestamps is not None and (
            self.timestamps.dtype != torch.int64 or self.timestamps.dim() != 1
        ):
            raise TypeError(
                f"AttentionInputs: timestamps must be a 1-D int64 tensor [T]; got "
                f"{self.timestamps.dtype} of shape {tuple(self.timestamps.shape)}"
            )
        if self.padding_sequences < 0 or self.padding_sequences > self.seq_offsets.numel() - 1:
            raise ValueError(
                f"AttentionInputs: padding_sequences={self.padding_sequences} is not within the "
                f"{self.seq_offsets.numel() - 1} sequences"
            )
        pairs = (
            ("seq_offsets", self.seq_offsets, self.host_seq_offsets),
            ("num_contexts", self.num_contexts, self.host_num_contexts),
            ("num_targets", self.num_targets, self.host_num_targets),
        )
        if self.host_seq_offsets is None:
            if self.host_num_contexts is not None or self.host_num_targets is not None:
                raise ValueError(
                    "AttentionInputs: host_num_contexts/host_num_targets need host_seq_offsets"
                )
            return
        for name, dev, host in pairs:
            if (dev is None) != (host is None):
                raise ValueError(
                    f"AttentionInputs: {name} and host_{name} must both be given or both None"
                )
            if host is None:
                continue
            if host.device.type != "cpu" or host.dtype != torch.int64:
                raise TypeError(
                    f"AttentionInputs: host_{name} must be a CPU int64 tensor; got "
                    f"{host.dtype} on {host.device}"
                )
            if host.shape != dev.shape:
                raise ValueError(
                    f"AttentionInputs: host_{name} has shape {tuple(host.shape)} but {name} has "
                    f"{tuple(dev.shape)}"
                )

    def kernel_metadata(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(seq_offsets, num_contexts, num_targets) for the compiled op on ``device``: the CPU
        copies when the model runs on CUDA and they exist (no sync), else the device tensors,
        always the device tensors under CUDA graph capture (a captured host->device copy would
        replay stale bytes)."""
        capturing = (
            device.type == "cuda" and _cuda_available() and torch.cuda.is_current_stream_capturing()
        )
        if device.type == "cuda" and self.host_seq_offsets is not None and not capturing:
            return self.host_seq_offsets, self.host_num_contexts, self.host_num_targets
        return self.seq_offsets, self.num_contexts, self.num_targets

    def real_lengths(self) -> torch.Tensor:
        """Token lengths of the batch's own sequences (padding sequences left out), from the CPU
        copy of the offsets when there is one."""
        offs = self.host_seq_offsets if self.host_seq_offsets is not None else self.seq_offsets
        lengths = offs[1:] - offs[:-1]
        return lengths[: lengths.numel() - self.padding_sequences]
