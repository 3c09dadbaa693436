"""Loading and serving an exported artifact (retrieval or ranking) with torch alone.

An artifact (written by ``python -m hstu.export``, `hstu.inference.export`) is a directory:

    manifest.json   format, versions, task, source checkpoint, the model's fixed sizes, and the
                    sha256 and size of every other file
    model.pt2       torch.export program: retrieval, dense user batch -> L2-normalised queries
                    [B, D]; ranking, dense user batch + candidates -> logits [B, C, tasks]
    tables.pt       corpus ids (sorted) (+ retrieval: normalised corpus embeddings), dataset
                    users (sorted) with their contextual feature ids (tensors only, loaded with
                    weights_only)
    config.gin      the training configuration, for people (not read here)

`load_artifact` (or `RetrievalArtifact.load` / `RankingArtifact.load`) checks the manifest and
every checksum before it loads anything, so a truncated, edited or swapped file is a clear
error, never garbage scores. This module imports torch, NumPy and `hstu.inference.requests`
only: serving needs neither torchrec nor gin.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hstu.inference.requests import UserHistory, as_user_history

__all__ = [
    "ARTIFACT_FORMAT",
    "ARTIFACT_VERSION",
    "FILES",
    "ArtifactError",
    "RankingArtifact",
    "RetrievalArtifact",
    "load_artifact",
    "read_manifest",
]

ARTIFACT_FORMAT = "hstu-inference-artifact"
ARTIFACT_VERSION = 1
TASKS = ("retrieval", "ranking")
FILES = {
    "manifest": "manifest.json",
    "model": "model.pt2",
    "tables": "tables.pt",
    "config": "config.gin",
}
_EXPORT_HINT = "export it again: python -m hstu.export --checkpoint RUN_DIR --out DIR"


class ArtifactError(ValueError):
    """A missing, partial, corrupted or incompatible artifact."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of the artifact directory ``path`` (every listed file present with
    its size and sha256)."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"artifact {root} is not a directory; {_EXPORT_HINT}")
    mpath = root / FILES["manifest"]
    if not mpath.is_file():
        raise ArtifactError(
            f"artifact {root} has no {FILES['manifest']} (partial?); {_EXPORT_HINT}"
        )
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{mpath} is not readable JSON ({exc}); {_EXPORT_HINT}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{mpath} is not an HSTU artifact manifest; {_EXPORT_HINT}")
    if manifest.get("task") not in TASKS:
        raise ArtifactError(
            f"{mpath}: task {manifest.get('task')!r} is not one of {list(TASKS)}; {_EXPORT_HINT}"
        )
    if manifest.get("version") != ARTIFACT_VERSION:
        raise ArtifactError(
            f"{mpath}: artifact format version {manifest.get('version')!r}, this library reads "
            f"version {ARTIFACT_VERSION}; {_EXPORT_HINT}"
        )
    files = manifest.get("files") or {}
    for name in (FILES["model"], FILES["tables"]):
        if name not in files:
            raise ArtifactError(f"{mpath} lists no {name}; {_EXPORT_HINT}")
    for name, info in files.items():
        f = root / name
        if not f.is_file():
            raise ArtifactError(f"artifact {root} lacks {name} (partial copy?); {_EXPORT_HINT}")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise ArtifactError(
                f"{f} has {size} bytes, the manifest says {info.get('bytes')} (truncated or "
                f"replaced); {_EXPORT_HINT}"
            )
        if _sha256(f) != info.get("sha256"):
            raise ArtifactError(f"{f} does not match its sha256 in the manifest; {_EXPORT_HINT}")
    return manifest


class _Artifact:
    """What both tasks' artifacts share: the checked files, the program, the request inputs.

    ``device``: where the corpus scoring runs (retrieval); the program runs on the CPU, where it
    was traced (its constants live there)."""

    task = ""

    def __init__(self, path: str | os.PathLike, device: str | torch.device = "cpu") -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if self.manifest["task"] != self.task:
            raise ArtifactError(
                f"{self.path} holds a {self.manifest['task']} model, not a {self.task} model "
                "(hstu.inference.artifact.load_artifact picks the class)"
            )
        model = self.manifest.get("model") or {}
        try:
            self.max_history = int(model["max_history"])
            self.feature_names = list(model["contextual_features"])
            self.cardinalities = [int(c) for c in model["contextual_cardinalities"]]
            self.time_bias = bool(model["time_bias"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(
                f"{self.path}: manifest 'model' section incomplete ({exc})"
            ) from exc
        self.device = torch.device(device)
        try:
            self.tables = torch.load(
                self.path / FILES["tables"], map_location="cpu", weights_only=True
            )
            self.program = torch.export.load(str(self.path / FILES["model"]))
        except Exception as exc:  # noqa: BLE001 - any load failure is an artifact problem
            raise ArtifactError(f"{self.path}: cannot load ({exc}); {_EXPORT_HINT}") from exc
        self.module = self.program.module()
        self.corpus = self.tables["corpus"].long()
        self.user_ids = self.tables["user_ids"].long()
        self.user_features = self.tables["user_features"].long()

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu"):
        return cls(path, device)

    # ---- requests ------------------------------------------------------------------------------
    def _rows_of(self, items: Sequence[int], where: str) -> torch.Tensor:
        ids = torch.as_tensor(list(items), dtype=torch.int64)
        pos = torch.searchsorted(self.corpus, ids).clamp_(max=self.corpus.numel() - 1)
        found = self.corpus[pos] == ids
        if not bool(found.all()):
            bad = ids[~found].unique()[:10].tolist()
            raise ValueError(f"{where}: unknown item ids {bad}: not in the artifact's corpus")
        return pos

    def _features_of(self, u: UserHistory, where: str) -> list[int]:
        if not self.feature_names:
            return []
        if u.features is not None:
            missing = [n for n in self.feature_names if n not in u.features]
            if missing:
                raise ValueError(f"{where}: features lack {missing}")
            values = [int(u.features[n]) for n in self.feature_names]
        else:
            pos = int(torch.searchsorted(self.user_ids, torch.tensor(u.user_id)))
            if pos >= self.user_ids.numel() or int(self.user_ids[pos]) != u.user_id:
                raise ValueError(
                    f"{where}: user {u.user_id} is not among the exported users: give its "
                    f"contextual features {self.feature_names} in 'features'"
                )
            values = self.user_features[pos].tolist()
        for name, value, card in zip(self.feature_names, values, self.cardinalities):
            if not 0 <= value < card:
                raise ValueError(f"{where}: feature {name}={value} is outside [0, {card})")
        return values

    def inputs(self, users: Sequence[UserHistory | Mapping[str, Any]]) -> tuple[torch.Tensor, ...]:
        """The program's dense history inputs for ``users`` (the last max_history items each):
        (item rows, lengths, actions, contextual ids, timestamps, query times)."""
        reqs = [as_user_history(u, f"request {i + 1}") for i, u in enumerate(users)]
        b, lmax, f = len(reqs), self.max_history, len(self.feature_names)
        rows = torch.zeros(b, lmax, dtype=torch.int64)
        actions = torch.zeros(b, lmax, dtype=torch.int64)
        times = torch.zeros(b, lmax, dtype=torch.int64)
        ctx = torch.zeros(b, f, dtype=torch.int64)
        lengths = torch.zeros(b, dtype=torch.int64)
        query_time = torch.zeros(b, dtype=torch.int64)
        for r, u in enumerate(reqs):
            where = f"user {u.user_id} (request {r + 1})"
            if not u.items:
                raise ValueError(f"{where} has no items: a query needs at least one history item")
            for name, vals in (("timestamps", u.timestamps), ("actions", u.actions)):
                if vals is not None and len(vals) != len(u.items):
                    raise ValueError(f"{where}: {len(vals)} {name} for {len(u.items)} items")
            if self.time_bias and u.timestamps is None:
                raise ValueError(
                    f"{where} has no timestamps, but the model has a relative time bias: give "
                    "one per item"
                )
            lo = max(len(u.items) - lmax, 0)
            n = len(u.items) - lo
            lengths[r] = n
            rows[r, :n] = self._rows_of(u.items[lo:], where)
            if u.actions is not None:
                actions[r, :n] = torch.as_tensor(u.actions[lo:], dtype=torch.int64)
            if u.timestamps is not None:
                times[r, :n] = torch.as_tensor(u.timestamps[lo:], dtype=torch.int64)
                query_time[r] = u.timestamps[-1] if u.query_time is None else u.query_time
            ctx[r] = torch.as_tensor(self._features_of(u, where), dtype=torch.int64)
        return rows, lengths, actions, ctx, times, query_time


class RankingArtifact(_Artifact):
    """A loaded ranking artifact: logits of each request's candidates, the model's forward on
    history + candidates (the exported program; equal to `Ranker.score_full`)."""

    task = "ranking"

    @torch.no_grad()
    def score(
        self,
        users: Sequence[UserHistory | Mapping[str, Any]],
        candidates: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [sum of candidates, num_tasks] (float32, CPU), users in order; candidates are
        scored at each request's query time (default its last item's time)."""
        if len(candidates) != len(users):
            raise ValueError(f"{len(candidates)} candidate sets for {len(users)} users")
        rows, lengths, actions, ctx, times, query_time = self.inputs(users)
        b = len(candidates)
        c = max((len(x) for x in candidates), default=0)
        cand_rows = torch.zeros(b, max(c, 1), dtype=torch.int64)
        counts = torch.zeros(b, dtype=torch.int64)
        for r, cand in enumerate(candidates):
            if len(cand) == 0:
                raise ValueError(f"request {r + 1}: every user needs at least one candidate")
            cand_rows[r, : len(cand)] = self._rows_of(cand, f"request {r + 1}: candidates")
            counts[r] = len(cand)
        cand_times = query_time.view(-1, 1).expand(b, cand_rows.shape[1]).contiguous()
        logits = self.module(rows, lengths, actions, ctx, times, cand_rows, counts, cand_times)
        keep = torch.arange(cand_rows.shape[1]).view(1, -1) < counts.view(-1, 1)
        return logits[keep]

    def predict(self, users, candidates) -> torch.Tensor:
        """Per-task probabilities (sigmoid of `score`)."""
        return torch.sigmoid(self.score(users, candidates))


def load_artifact(path: str | os.PathLike, device: str | torch.device = "cpu") -> _Artifact:
    """The artifact at ``path`` as a `RetrievalArtifact` or `RankingArtifact` (by its task)."""
    task = read_manifest(path)["task"]
    cls = RankingArtifact if task == "ranking" else RetrievalArtifact
    return cls(path, device)


class RetrievalArtifact(_Artifact):
    """A loaded retrieval artifact: queries and top-K over the exported corpus."""

    task = "retrieval"

    def __init__(self, path: str | os.PathLike, device: str | torch.device = "cpu") -> None:
        super().__init__(path, device)
        self.corpus_emb = self.tables.pop("corpus_embeddings").float().to(self.device)

    # ---- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def queries(self, users: Sequence[UserHistory | Mapping[str, Any]]) -> torch.Tensor:
        """[U, D] L2-normalised query of each user (float32, CPU)."""
        if not len(users):
            return torch.empty(0, self.corpus_emb.shape[1])
        return self.module(*self.inputs(users))

    @torch.no_grad()
    def retrieve(
        self,
        users: Sequence[UserHistory | Mapping[str, Any]],
        top_k: int = 100,
        exclude_history: bool = True,
        batch_size: int = 256,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top ``top_k`` items per user: (ids [U, K] int64, scores [U, K] float32), best first,
        on the CPU; as `hstu.inference.Retriever.retrieve` (history items excluded, -1 / -inf
        where fewer than K remain)."""
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k={top_k!r} must be a positive integer")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        k = min(top_k, self.corpus.numel())
        reqs = [as_user_history(u, f"request {i + 1}") for i, u in enumerate(users)]
        ids_out, scores_out = [], []
        for s in range(0, len(reqs), batch_size):
            chunk = reqs[s : s + batch_size]
            q = self.queries(chunk).to(self.device)
            scores = q @ self.corpus_emb.t()
            if exclude_history:
                r_idx = np.concatenate([np.full(len(u.items), r) for r, u in enumerate(chunk)])
                cols = self._rows_of([i for u in chunk for i in u.items], "history")
                scores[torch.from_numpy(r_idx).to(scores.device), cols.to(scores.device)] = float(
                    "-inf"
                )
            top, pos = torch.topk(scores, k, dim=1)
            ids = self.corpus.to(pos.device)[pos]
            ids = torch.where(torch.isneginf(top), torch.full_like(ids, -1), ids)
            ids_out.append(ids.cpu())
            scores_out.append(top.cpu())
        if not ids_out:
            return torch.empty(0, k, dtype=torch.int64), torch.empty(0, k)
        return torch.cat(ids_out), torch.cat(scores_out)
