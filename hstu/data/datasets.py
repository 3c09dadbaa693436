"""Training and evaluation samples for ranking and retrieval, cut from `SequenceData` by time.

A sample is a contiguous slice of one user's time-ordered sequence, so it is stored as four
integers (user row and three positions into the CSR item arrays) and only materialised when a
batch is collated. Both protocols are leakage-free: every training target/candidate of a user
lies strictly before that user's evaluation target/candidates.

Ranking (``k = max_num_candidates``, ``H = max_history_seqlen``):
  eval  per user: candidates = the last ``min(k, L - 1)`` interactions, history = up to H right
        before them;
  train per user: the interactions before the eval candidates, cut from the end into chunks of
        k candidates (the earliest chunk may be shorter), each with up to H preceding items as
        history (at least one).
Retrieval (leave-one-out):
  eval  per user: history = the last H of ``items[:-1]``, target = ``items[-1]``;
  train per user: ``items[:-1]`` cut from the end into non-overlapping windows of up to H + 1
        items; the model predicts item p + 1 from the prefix ending at p inside each window.
        Windows of fewer than 2 items are dropped.
Users with fewer than 2 interactions have no usable sample and are skipped (and counted).

Timestamps: when the data has real ones (`SequenceData.has_timestamps`), every batch carries the
time of each of its items (history and candidates, jagged like ``item_id``) and retrieval eval
batches the time of each held-out target; otherwise none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.data.sequences import SequenceData

__all__ = [
    "RankingSamples",
    "RetrievalSamples",
    "SampleSplits",
    "Samples",
    "build_ranking_samples",
    "build_retrieval_samples",
]

logger = logging.getLogger(__name__)


class Samples(Protocol):
    """What `BatchIterator` needs: a length and a collate from sample indices to a `Batch`."""

    def __len__(self) -> int: ...

    def collate(self, indices: np.ndarray | list[int]) -> Batch: ...


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, without a Python loop."""
    lengths = (ends - starts).astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_start = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=seg_start[1:])
    return np.arange(total, dtype=np.int64) + np.repeat(starts - seg_start, lengths)


def _within_group_index(counts: np.ndarray) -> np.ndarray:
    """For groups of the given sizes laid end to end, each element's index inside its group."""
    total = int(counts.sum())
    starts = np.zeros(counts.shape[0], dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _as_index_array(indices: np.ndarray | list[int], n: int, what: str) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"{what}: sample index out of range [0, {n}): {idx.min()}..{idx.max()}")
    return idx


def _check_positive_arg(binding: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{binding} must be an integer >= 1; got {value!r}")


def _make_batch(
    data: SequenceData,
    user_rows: np.ndarray,
    item_starts: np.ndarray,
    history_ends: np.ndarray,
    item_ends: np.ndarray,
    labels: np.ndarray | None,
    target_positions: np.ndarray | None,
) -> Batch:
    """Assemble a `Batch` whose sample b has items [item_starts, item_ends) of the CSR arrays,
    the first ``history_ends - item_starts`` of them history (with actions). Timestamps follow
    the items (each item's own time) when the data has real ones. ``target_positions``
    (retrieval evaluation): the held-out item of each sample, whose id and time the batch
    carries as targets."""
    b = int(user_rows.shape[0])
    names = list(data.user_feature_names)
    ctx = data.user_features[user_rows]  # [B, F]
    item_positions = _ranges(item_starts, item_ends)
    item_values = data.item_ids[item_positions]
    action_values = data.actions[_ranges(item_starts, history_ends)]
    values = np.concatenate([ctx.T.reshape(-1), item_values, action_values]).astype(np.int64)
    lengths = np.concatenate(
        [
            np.ones(b * len(names), dtype=np.int64),
            (item_ends - item_starts).astype(np.int64),
            (history_ends - item_starts).astype(np.int64),
        ]
    )
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[*names, ITEM_FEATURE, ACTION_FEATURE],
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths),
    )
    timed = data.has_timestamps
    return Batch(
        features=features,
        contextual_feature_names=names,
        num_candidates=torch.from_numpy((item_ends - history_ends).astype(np.int64)),
        user_ids=torch.from_numpy(data.user_ids[user_rows].astype(np.int64)),
        labels=None if labels is None else torch.from_numpy(labels.astype(np.int64)),
        target_item_ids=None
        if target_positions is None
        else torch.from_numpy(data.item_ids[target_positions].astype(np.int64)),
        timestamps=torch.from_numpy(data.timestamps[item_positions].astype(np.int64))
        if timed
        else None,
        target_timestamps=torch.from_numpy(data.timestamps[target_positions].astype(np.int64))
        if timed and target_positions is not None
        else None,
    )


@dataclass
class RankingSamples:
    """Ranking samples of one split: sample s has history ``[history_starts[s],
    candidate_starts[s])`` and candidates ``[candidate_starts[s], candidate_ends[s])`` (global
    positions into ``data``'s item arrays); the labels are the candidates' action bitmasks."""

    data: SequenceData
    split: str
    user_rows: np.ndarray
    history_starts: np.ndarray
    candidate_starts: np.ndarray
    candidate_ends: np.ndarray
    max_history_seqlen: int
    max_num_candidates: int
    num_skipped_users: int = 0

    def __len__(self) -> int:
        return int(self.user_rows.shape[0])

    @property
    def contextual_feature_names(self) -> list[str]:
        return list(self.data.user_feature_names)

    @property
    def max_seqlen(self) -> int:
        """Longest item sequence (history + candidates) a batch can hold."""
        return self.max_history_seqlen + self.max_num_candidates

    def num_candidates(self) -> np.ndarray:
        return self.candidate_ends - self.candidate_starts

    def history_lengths(self) -> np.ndarray:
        return self.candidate_starts - self.history_starts

    def loss_counts(self) -> np.ndarray:
        """Loss terms of each sample: its candidates (as the trainer counts a batch's)."""
        return self.num_candidates()

    def collate(self, indices: np.ndarray | list[int]) -> Batch:
        """`Batch` of the given samples: item_id = history + candidates, action = history only,
        labels = candidates' bitmasks (concatenated in sample order), num_candidates per sample."""
        idx = _as_index_array(indices, len(self), f"RankingSamples[{self.split}]")
        cs, ce = self.candidate_starts[idx], self.candidate_ends[idx]
        return _make_batch(
            self.data,
            self.user_rows[idx],
            self.history_starts[idx],
            cs,
            ce,
            labels=self.data.actions[_ranges(cs, ce)],
            target_positions=None,
        )


@dataclass
class RetrievalSamples:
    """Retrieval samples of one split: sample s is the item window ``[starts[s], ends[s])``
    (global positions into ``data``). For ``split == "eval"`` the window is the history and the
    item at ``ends[s]`` is the held-out target; for ``"train"`` the window itself is the sequence
    whose every next item is a target."""

    data: SequenceData
    split: str
    user_rows: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    max_history_seqlen: int
    num_skipped_users: int = 0

    def __len__(self) -> int:
        return int(self.user_rows.shape[0])

    @property
    def contextual_feature_names(self) -> list[str]:
        return list(self.data.user_feature_names)

    @property
    def is_eval(self) -> bool:
        return self.split == "eval"

    @property
    def max_seqlen(self) -> int:
        """Longest item sequence a batch can hold (train windows carry one extra item)."""
        return self.max_history_seqlen + (0 if self.is_eval else 1)

    def loss_counts(self) -> np.ndarray:
        """Loss terms of each sample as the trainer counts a batch's: next-item pairs, one per
        window item after the first."""
        return np.maximum(self.ends - self.starts - 1, 0)

    def target_positions(self) -> np.ndarray:
        """Eval: global position of each sample's target; train: positions ``starts+1..ends-1``
        are the targets, returned concatenated."""
        if self.is_eval:
            return self.ends.copy()
        return _ranges(self.starts + 1, self.ends)

    def collate(self, indices: np.ndarray | list[int]) -> Batch:
        """`Batch` of the given samples: item_id and action = the window (num_candidates = 0);
        eval batches also carry ``target_item_ids`` (and ``target_timestamps``)."""
        idx = _as_index_array(indices, len(self), f"RetrievalSamples[{self.split}]")
        s, e = self.starts[idx], self.ends[idx]
        return _make_batch(
            self.data,
            self.user_rows[idx],
            s,
            e,
            e,
            labels=None,
            target_positions=e if self.is_eval else None,
        )


class SampleSplits(NamedTuple):
    """Train and eval samples of one task."""

    train: RankingSamples | RetrievalSamples
    eval: RankingSamples | RetrievalSamples


def _usable_users(data: SequenceData, task: str) -> tuple[np.ndarray, np.ndarray, int]:
    lengths = data.lengths()
    ok = lengths >= 2
    skipped = int((~ok).sum())
    if not ok.any():
        raise ValueError(
            f"{data.name}: no user has >= 2 interactions, so no {task} sample can be built "
            f"({data.num_users} users, {data.num_interactions} interactions)"
        )
    if skipped:
        logger.info(
            "%s: skipped %d of %d users with fewer than 2 interactions for %s",
            data.name,
            skipped,
            data.num_users,
            task,
        )
    return np.flatnonzero(ok).astype(np.int64), lengths[ok].astype(np.int64), skipped


def build_ranking_samples(
    data: SequenceData, max_history_seqlen: int, max_num_candidates: int
) -> SampleSplits:
    """Time-based ranking samples (see module docstring); train samples in time order per user."""
    _check_positive_arg("DatasetArgs.max_history_seqlen", max_history_seqlen)
    _check_positive_arg("DatasetArgs.max_num_candidates", max_num_candidates)
    h, k = int(max_history_seqlen), int(max_num_candidates)
    users, lengths, skipped = _usable_users(data, "ranking")
    base = data.offsets[users]

    n_eval = np.minimum(k, lengths - 1)
    eval_cs = lengths - n_eval
    eval_split = RankingSamples(
        data=data,
        split="eval",
        user_rows=users,
        history_starts=base + np.maximum(eval_cs - h, 0),
        candidate_starts=base + eval_cs,
        candidate_ends=base + lengths,
        max_history_seqlen=h,
        max_num_candidates=k,
        num_skipped_users=skipped,
    )

    # Train region [0, P) per user; chunk j (from the end) ends at P - j*k and needs >= 1 history.
    p = eval_cs
    counts = np.where(p > 1, (p - 1 + k - 1) // k, 0)
    rows = np.repeat(np.arange(users.shape[0]), counts)
    j = np.repeat(counts, counts) - 1 - _within_group_index(counts)  # chronological order
    ce = p[rows] - j * k
    cs = np.maximum(ce - k, 1)
    train_split = RankingSamples(
        data=data,
        split="train",
        user_rows=users[rows],
        history_starts=base[rows] + np.maximum(cs - h, 0),
        candidate_starts=base[rows] + cs,
        candidate_ends=base[rows] + ce,
        max_history_seqlen=h,
        max_num_candidates=k,
        num_skipped_users=skipped,
    )
    logger.info(
        "%s ranking samples: %d train, %d eval (history <= %d, candidates <= %d)",
        data.name,
        len(train_split),
        len(eval_split),
        h,
        k,
    )
    return SampleSplits(train_split, eval_split)


def build_retrieval_samples(data: SequenceData, max_history_seqlen: int) -> SampleSplits:
    """Leave-one-out retrieval samples (see module docstring)."""
    _check_positive_arg("DatasetArgs.max_history_seqlen", max_history_seqlen)
    h = int(max_history_seqlen)
    users, lengths, skipped = _usable_users(data, "retrieval")
    base = data.offsets[users]

    eval_end = lengths - 1
    eval_split = RetrievalSamples(
        data=data,
        split="eval",
        user_rows=users,
        starts=base + np.maximum(eval_end - h, 0),
        ends=base + eval_end,
        max_history_seqlen=h,
        num_skipped_users=skipped,
    )

    # Train region items[:-1] = [0, P); windows of w = h + 1 items from the end, >= 2 items each.
    w = h + 1
    p = lengths - 1
    counts = p // w + (p % w >= 2)
    rows = np.repeat(np.arange(users.shape[0]), counts)
    j = np.repeat(counts, counts) - 1 - _within_group_index(counts)
    e = p[rows] - j * w
    s = np.maximum(e - w, 0)
    train_split = RetrievalSamples(
        data=data,
        split="train",
        user_rows=users[rows],
        starts=base[rows] + s,
        ends=base[rows] + e,
        max_history_seqlen=h,
        num_skipped_users=skipped,
    )
    logger.info(
        "%s retrieval samples: %d train windows, %d eval users (history <= %d)",
        data.name,
        len(train_split),
        len(eval_split),
        h,
    )
    return SampleSplits(train_split, eval_split)
