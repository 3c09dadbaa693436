"""Ranking inference from a training checkpoint: encode users' histories once
(`hstu.inference.kv_cache`), then score any number of candidate sets against the cache.

    from hstu.inference.ranker import Ranker

    ranker = Ranker.from_checkpoint("runs/my-ranking-run")
    cache = ranker.encode([{"user_id": 7, "items": [...], "timestamps": [...]}], num_candidates=3)
    probs = ranker.predict(cache, [[11, 12, 13]])          # [3, num_tasks] probabilities
    again = ranker.predict(cache, [[21, 22, 23]])          # the history is not run again

Loading is `CheckpointModel.from_checkpoint` (any number of rank files, the run's config.gin,
its dataset). `score_full` recomputes history + candidates with the model's own forward: the
cached scores equal it (docs/inference.md states the conditions and tolerance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hstu.inference.kv_cache import HistoryCache, encode_history, score_candidates, with_candidates
from hstu.inference.requests import UserHistory, as_user_history
from hstu.inference.retriever import CheckpointModel
from hstu.models.ranking import RankingGR

__all__ = ["Ranker"]


class Ranker(CheckpointModel):
    """A trained `RankingGR` in eval mode: history caches and candidate scores."""

    task = "ranking"
    model_type = RankingGR

    def _history_batch(self, users: Sequence[UserHistory | Mapping[str, Any]]):
        """(the histories as a batch without candidates, the requests' query times or None)."""
        reqs = [as_user_history(u, f"request {i + 1}") for i, u in enumerate(users)]
        self.check_users(reqs)
        batch = self.make_batch(reqs)
        query_time, batch.target_timestamps = batch.target_timestamps, None
        return batch, query_time

    def check_candidates(self, candidates: Sequence[Sequence[int]]) -> None:
        """ValueError for candidate ids outside the item corpus or an empty set."""
        unknown = self.unknown_items([int(i) for c in candidates for i in c])
        if unknown:
            raise ValueError(
                f"unknown candidate item ids {unknown[:10]}: not in the model's item corpus"
            )
        if any(len(c) == 0 for c in candidates):
            raise ValueError("every user needs at least one candidate")

    @torch.no_grad()
    def encode(
        self, users: Sequence[UserHistory | Mapping[str, Any]], num_candidates: int
    ) -> HistoryCache:
        """The history cache of ``users`` (the last max_history_seqlen items of each) for
        candidate sets of ``num_candidates`` items; a request's ``query_time`` (default: its last
        item's time) is the time its candidates are scored at."""
        batch, query_time = self._history_batch(users)
        with self._autocast():
            return encode_history(
                self.model, batch.to(self.device), num_candidates, query_time=query_time
            )

    @torch.no_grad()
    def score(
        self,
        cache: HistoryCache,
        candidates: Sequence[Sequence[int]],
        timestamps: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [sum of candidates, num_tasks] (float32, CPU) of each user's candidates, in
        the cache's user order; times default to each user's query time."""
        self.check_candidates(candidates)
        with self._autocast():
            out = score_candidates(
                self.model, cache, [list(map(int, c)) for c in candidates], timestamps
            )
        return out.float().cpu()

    def score_sets(
        self,
        users: Sequence[UserHistory | Mapping[str, Any]],
        candidate_sets: Sequence[Sequence[Sequence[int]]],
        batch_size: int = 64,
    ) -> list[list[torch.Tensor]]:
        """Logits of any number of candidate sets per user: ``out[u][k]`` is [len(set k),
        num_tasks] for user u's k-th set (candidates at the request's query time). Users are
        encoded once per set size, ``batch_size`` at a time; each of their sets of that size is
        then scored from the cache."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if len(candidate_sets) != len(users):
            raise ValueError(
                f"{len(candidate_sets)} lists of candidate sets for {len(users)} users"
            )
        out: list[list[torch.Tensor | None]] = [[None] * len(sets) for sets in candidate_sets]
        by_size: dict[int, dict[int, list[int]]] = {}
        for u, sets in enumerate(candidate_sets):
            if len(sets) == 0:
                raise ValueError(f"request {u + 1}: no candidate sets")
            for k, cand in enumerate(sets):
                by_size.setdefault(len(cand), {}).setdefault(u, []).append(k)
        for n, per_user in sorted(by_size.items()):
            order = list(per_user)
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                cache = self.encode([users[u] for u in chunk], num_candidates=max(n, 1))
                for r in range(max(len(per_user[u]) for u in chunk)):
                    # users with fewer sets of this size repeat their first one (dropped)
                    ks = [per_user[u][min(r, len(per_user[u]) - 1)] for u in chunk]
                    logits = self.score(cache, [candidate_sets[u][k] for u, k in zip(chunk, ks)])
                    for u, k, part in zip(chunk, ks, torch.split(logits, n)):
                        if r < len(per_user[u]):
                            out[u][k] = part
        return out  # type: ignore[return-value]

    def predict(self, cache: HistoryCache, candidates, timestamps=None) -> torch.Tensor:
        """Per-task probabilities (sigmoid of `score`)."""
        return torch.sigmoid(self.score(cache, candidates, timestamps))

    @torch.no_grad()
    def score_full(
        self,
        users: Sequence[UserHistory | Mapping[str, Any]],
        candidates: Sequence[Sequence[int]],
        timestamps: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """The same logits by the model's forward on history + candidates (no cache)."""
        self.check_candidates(candidates)
        batch, query_time = self._history_batch(users)
        full = with_candidates(
            batch, [list(map(int, c)) for c in candidates], timestamps, query_time
        )
        with self._autocast():
            return self.model(full.to(self.device))["logits"].float().cpu()
