"""`Batch`: what the data pipeline hands the models (jagged, no padding)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch", "ITEM_FEATURE", "ACTION_FEATURE"]

ITEM_FEATURE = "item_id"
ACTION_FEATURE = "action"


@dataclass
class Batch:
    """One batch of B samples.

    features: KeyedJaggedTensor with
      - one key per contextual feature (``contextual_feature_names``), exactly one value per sample;
      - ``item_id``: per sample, the history items followed by ``num_candidates`` candidate items;
      - ``action``: per sample, the action bitmask of each *history* item only (candidates'
        actions are the labels and never enter the model's input).
    num_candidates: [B] int64; zeros for retrieval.
    labels: ranking only, [sum(num_candidates)] int64 action bitmask of each candidate, in order.
    target_item_ids: retrieval evaluation only, [B] int64 held-out next item of each sample.
    user_ids: [B] int64 raw user ids (for bookkeeping, history exclusion, debugging).
    timestamps: [sum(item lengths)] int64, jagged exactly like ``item_id`` (same lengths, same
      order): the time of each history item, then each candidate's own time (its interaction's
      time in the dataset). None when the dataset has no real timestamps
      (`SequenceData.has_timestamps`, e.g. SASRec-style files).
    target_timestamps: retrieval evaluation only, [B] int64 time of each held-out next item (the
      time of the request the query answers); None otherwise and without real timestamps.
    sample_weights: [B] float32 weight of each sample's loss terms, or None (all 1). Padding
      samples (`hstu.training.step_graphs.pad_batch`, which gives a batch the fixed shapes of a
      CUDA graph of the training step) carry 0: they add nothing to the loss or its gradients
      (retrieval: their loss rows and in-batch negatives; ranking: their candidates' terms).
    global_counts: training batches from a `BatchIterator` given per-sample loss counts: (loss
      terms, samples) of the whole global batch, all ranks together, known without communication
      (the trainer then skips its per-step host all-reduce of the local counts).
    host: for a batch moved off the CPU by `to()`, the CPU batch it was copied from. The models
      read lengths, offsets and counts from it instead of from the device tensors, so the forward
      needs no device->host copies (each one a host<->GPU sync). Never modify either side after
      the copy: both must keep describing the same batch.
    host_memo: host-side work on this batch done ahead of its step (e.g. the preprocessor's index
      layout, `SequencePreprocessor.prepare_host`, run on the batch-prefetch thread), keyed by
      what it depends on; the consumer recomputes whatever it does not find. Shared by the
      batch's copies (`to`, `pin_memory`).
    """

    features: KeyedJaggedTensor
    contextual_feature_names: list[str]
    num_candidates: torch.Tensor
    user_ids: torch.Tensor
    labels: torch.Tensor | None = None
    target_item_ids: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    target_timestamps: torch.Tensor | None = None
    sample_weights: torch.Tensor | None = None
    global_counts: tuple[float, float] | None = field(default=None, compare=False)
    host: Batch | None = field(default=None, repr=False, compare=False)
    host_memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return int(self.user_ids.numel())

    def item_lengths(self) -> torch.Tensor:
        return self.features[ITEM_FEATURE].lengths()

    def history_lengths(self) -> torch.Tensor:
        return self.features[ACTION_FEATURE].lengths()

    @property
    def is_on_cpu(self) -> bool:
        return self.user_ids.device.type == "cpu"

    def host_batch(self) -> Batch | None:
        """The CPU twin of this batch: itself when on the CPU, else the batch `to()` copied it
        from (None for a batch built directly on a device)."""
        if self.host is not None:
            return self.host
        return self if self.is_on_cpu else None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy on ``device`` that keeps this batch's CPU twin reachable as ``host``.

        ``non_blocking=True`` from pinned memory (`pin_memory()`) does not wait for the GPU."""
        out = {}
        for f in fields(self):
            if f.name == "host":
                continue
            val = getattr(self, f.name)
            if isinstance(val, (torch.Tensor, KeyedJaggedTensor)):
                val = val.to(device, non_blocking=non_blocking)
            out[f.name] = val
        return Batch(**out, host=self.host_batch())

    def pin_memory(self) -> Batch:
        """A copy in page-locked CPU memory (so `to(cuda, non_blocking=True)` is asynchronous)."""
        out = {}
        for f in fields(self):
            if f.name == "host":
                continue
            val = getattr(self, f.name)
            if isinstance(val, (torch.Tensor, KeyedJaggedTensor)):
                val = val.pin_memory()
            out[f.name] = val
        return Batch(**out)
