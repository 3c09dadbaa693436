"""Top-K retrieval from a training checkpoint.

`Retriever.from_checkpoint` rebuilds the retrieval model the way the trainer does (the run's
``config.gin``, the dataset it names, `hstu.models.builder.build_model`), restores the weights of
every saved rank file (`hstu.training.reshard.restore_into`, so a checkpoint written by any
number of ranks loads into the one unsharded model) and switches to eval mode. Queries are the
model's own evaluation queries (the L2-normalised output at the last history position) and an
item's score is its cosine with the query: the scoring `RetrievalEvaluator` ranks by.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.config.gin_utils import CONFIG_FILENAME, RunConfig, load_config
from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.data.loader import BatchIterator
from hstu.data.registry import build_samples, load_sequence_data
from hstu.data.sequences import SequenceData
from hstu.inference.requests import UserHistory, as_user_history
from hstu.models.builder import build_model
from hstu.models.retrieval import RetrievalGR
from hstu.modules.metrics import RetrievalEvaluator, held_out_histories, ks_from_metric_names
from hstu.training.checkpoint import Checkpointer
from hstu.training.reshard import restore_into, unexpected_keys, upgrade_state_keys
from hstu.training.rundir import config_identity

__all__ = [
    "CheckpointModel",
    "Retriever",
    "UserHistory",
    "as_user_history",
    "find_run_config",
    "locate_checkpoint",
]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_GIN_TASK = re.compile(r"^# Resolved HSTU configuration \(task: (\w+)\)", re.MULTILINE)


def find_run_config(step_dir: Path) -> Path | None:
    """The ``config.gin`` of the run that wrote ``step_dir``: beside its checkpoint root (an
    explicit ``TrainerArgs.ckpt_save_dir``) or in the run directory above it."""
    for parent in (step_dir.parent, step_dir.parent.parent):
        path = parent / CONFIG_FILENAME
        if path.is_file():
            return path
    return None


def locate_checkpoint(
    checkpoint_dir: str | os.PathLike, config_file: str | os.PathLike | None = None
) -> tuple[Path, dict, Path, str]:
    """(step directory, its meta.json, the run's config.gin, the task) of ``checkpoint_dir``: a
    run directory, a checkpoint root (its ``latest``), one ``step_XXXXXXXX`` directory or a
    root's ``best.json`` (the best evaluation's checkpoint, TrainerArgs.best_metric)."""
    path = Path(checkpoint_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist: give a run directory, its checkpoints/ "
            "directory, one of its step_XXXXXXXX directories or its best.json"
        )
    if (path / CONFIG_FILENAME).is_file() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"  # a run directory
    step_dir = Checkpointer.resolve(path)
    meta = Checkpointer.read_meta(step_dir)
    if config_file is None:
        found = find_run_config(step_dir)
        if found is None:
            raise FileNotFoundError(
                f"no {CONFIG_FILENAME} found for checkpoint {step_dir} (looked in "
                f"{step_dir.parent} and {step_dir.parent.parent}); pass the run's resolved "
                "config with --config (Retriever.from_checkpoint(config_file=...))"
            )
        config_file = found
    config_file = Path(config_file)
    if not config_file.is_file():
        raise FileNotFoundError(f"config file {config_file} does not exist")
    return step_dir, meta, config_file, _task_of(config_file, meta)


def _task_of(config_file: Path, meta: Mapping[str, Any]) -> str:
    task = (meta.get("extra_meta") or {}).get("task")
    if task:
        return str(task)
    m = _GIN_TASK.search(config_file.read_text(encoding="utf-8"))
    return m.group(1) if m else "retrieval"


class CheckpointModel:
    """A trained model of one task in eval mode with its dataset: loading from a checkpoint
    (any number of rank files) and building request batches. `Retriever` and
    `hstu.inference.ranker.Ranker` are its tasks."""

    task: ClassVar[str] = ""
    model_type: ClassVar[type] = nn.Module

    def __init__(
        self,
        model: nn.Module,
        cfg: RunConfig,
        data: SequenceData,
        *,
        device: torch.device,
        step: int = 0,
        checkpoint: Path | None = None,
    ) -> None:
        self.model = model.eval()
        self.cfg = cfg
        self.data = data
        self.device = device
        self.step = step
        self.checkpoint = checkpoint
        self.corpus = torch.from_numpy(data.item_corpus()).long()
        self.max_history = int(cfg.dataset.max_history_seqlen)
        self._autocast_dtype = _DTYPES[cfg.network.dtype_str] if device.type == "cuda" else None
        self._corpus_emb: torch.Tensor | None = None
        self._corpus_dev: torch.Tensor | None = None

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | os.PathLike,
        device: str | torch.device = "cpu",
        *,
        config_file: str | os.PathLike | None = None,
        bindings: Sequence[str] = (),
    ) -> CheckpointModel:
        """Load the model of ``checkpoint_dir``: a run directory, a checkpoint root (its
        ``latest``) or one ``step_XXXXXXXX`` directory.

        ``config_file``: the run's resolved ``config.gin`` when it is not beside the checkpoints;
        ``bindings``: gin bindings applied after it (e.g. ``DatasetArgs.dataset_path`` when the
        data moved).
        """
        step_dir, meta, config_file, task = locate_checkpoint(checkpoint_dir, config_file)
        if task != cls.task:
            raise ValueError(
                f"checkpoint {step_dir} holds a {task} model; {cls.__name__} needs a "
                f"{cls.task} checkpoint (retrieval: hstu.inference.Retriever, ranking: "
                "hstu.inference.ranker.Ranker)"
            )
        cfg = load_config(cls.task, [config_file], list(bindings))
        _check_identity(cfg, meta, step_dir, config_file)
        dev = torch.device(device)
        num_tasks = 8 if cfg.dataset.dataset_name == "synthetic" else 0  # as the trainer does
        data = load_sequence_data(cfg.dataset, num_tasks=num_tasks)
        model = build_model(cfg, data, device_type=dev.type)
        if not isinstance(model, cls.model_type):  # pragma: no cover - the task decides
            raise TypeError(f"{type(model).__name__} is not a {cls.task} model")
        _load_weights(model, step_dir, meta)
        model.to(dev)
        logger.info(
            "loaded %s (step %d, written by %d rank(s)) on %s",
            step_dir,
            int(meta["step"]),
            int(meta["world_size"]),
            dev,
        )
        return cls(model, cfg, data, device=dev, step=int(meta["step"]), checkpoint=step_dir)

    def _autocast(self):
        if self._autocast_dtype is None or self._autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self._autocast_dtype)

    def _columns(
        self, items: torch.Tensor, corpus: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Corpus position of each id (the corpus is sorted) and whether it is in the corpus, on
        ``corpus``'s device (default: the CPU copy)."""
        corpus = self.corpus if corpus is None else corpus
        items = items.to(corpus.device, torch.int64)
        pos = torch.searchsorted(corpus, items).clamp_(max=corpus.numel() - 1)
        return pos, corpus[pos] == items

    # ---- requests ------------------------------------------------------------------------------

    def check_users(self, users: Sequence[UserHistory], where: str | None = None) -> None:
        """ValueError naming the first problem of ``users``: item ids outside the corpus, an
        empty history, timestamps or actions that do not match the items, a missing time."""
        for n, u in enumerate(users):
            where_u = where or f"user {u.user_id} (request {n + 1})"
            if not u.items:
                raise ValueError(f"{where_u} has no items: a query needs at least one history item")
            if u.timestamps is not None and len(u.timestamps) != len(u.items):
                raise ValueError(
                    f"{where_u}: {len(u.timestamps)} timestamps for {len(u.items)} items"
                )
            if u.actions is not None and len(u.actions) != len(u.items):
                raise ValueError(f"{where_u}: {len(u.actions)} actions for {len(u.items)} items")
            if self.needs_timestamps and u.timestamps is None:
                raise ValueError(
                    f"{where_u} has no timestamps, but the model has a relative time bias "
                    f"(NetworkArgs.relative_attention_bias="
                    f"{self.cfg.network.relative_attention_bias!r}): give one per item"
                )
        unknown = self.unknown_items([i for u in users for i in u.items])
        if unknown:
            shown = ", ".join(str(i) for i in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise ValueError(
                (f"{where}: " if where else "")
                + f"unknown item ids {shown}{more}: not in the model's item corpus "
                f"({self.corpus.numel()} items of dataset {self.data.name!r})"
            )

    @property
    def needs_timestamps(self) -> bool:
        return bool(self.model.preprocessor.timestamps)

    def unknown_items(self, items: Sequence[int]) -> list[int]:
        """The distinct ids of ``items`` that are not in the corpus, sorted."""
        if not len(items):
            return []
        ids = torch.unique(torch.as_tensor(list(items), dtype=torch.int64))
        _, found = self._columns(ids)
        return ids[~found].tolist()

    def _user_row(self, user_id: int) -> int | None:
        row = int(self.data.user_rows([user_id])[0])
        return row if row >= 0 else None

    def make_batch(self, users: Sequence[UserHistory]) -> Batch:
        """A `Batch` of the requests: the last ``max_history_seqlen`` items of each as history."""
        names = list(self.data.user_feature_names)
        cards = list(self.data.user_feature_cardinalities)
        ctx = np.zeros((len(users), len(names)), dtype=np.int64)
        items, actions, times, lengths, query_times = [], [], [], [], []
        for b, u in enumerate(users):
            if u.features is not None:
                missing = [n for n in names if n not in u.features]
                if missing:
                    raise ValueError(f"user {u.user_id}: features lack {missing}")
                ctx[b] = [int(u.features[n]) for n in names]
            else:
                row = self._user_row(int(u.user_id))
                if row is not None:
                    ctx[b] = self.data.user_features[row]
                elif names and self.cfg.network.use_contextual_features:
                    raise ValueError(
                        f"user {u.user_id} is not in dataset {self.data.name!r}: give its "
                        f"contextual features {names} in 'features'"
                    )
            for n, (value, card) in enumerate(zip(ctx[b], cards)):
                if not 0 <= value < card and self.cfg.network.use_contextual_features:
                    raise ValueError(
                        f"user {u.user_id}: feature {names[n]}={int(value)} is outside the "
                        f"model's table [0, {card})"
                    )
            lo = max(len(u.items) - self.max_history, 0)
            items.append(np.asarray(u.items[lo:], dtype=np.int64))
            actions.append(np.asarray((u.actions or [0] * len(u.items))[lo:], dtype=np.int64))
            if u.timestamps is not None:
                times.append(np.asarray(u.timestamps[lo:], dtype=np.int64))
                last = u.timestamps[-1]
                query_times.append(last if u.query_time is None else int(u.query_time))
            lengths.append(len(u.items) - lo)
        b = len(users)
        lens = np.asarray(lengths, dtype=np.int64)
        values = np.concatenate([ctx.T.reshape(-1), *items, *actions]).astype(np.int64)
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=[*names, ITEM_FEATURE, ACTION_FEATURE],
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(
                np.concatenate([np.ones(b * len(names), np.int64), lens, lens])
            ),
        )
        timed = b > 0 and len(times) == b
        return Batch(
            features=features,
            contextual_feature_names=names,
            num_candidates=torch.zeros(b, dtype=torch.int64),
            user_ids=torch.as_tensor([int(u.user_id) for u in users], dtype=torch.int64),
            timestamps=torch.from_numpy(np.concatenate(times)) if timed else None,
            target_timestamps=torch.as_tensor(query_times, dtype=torch.int64) if timed else None,
        )

    def dataset_user(self, user_id: int) -> UserHistory:
        """The whole stored history of a dataset user as a request (KeyError when unknown)."""
        row = self._user_row(int(user_id))
        if row is None:
            raise KeyError(f"user {user_id} is not in dataset {self.data.name!r}")
        lo, hi = int(self.data.offsets[row]), int(self.data.offsets[row + 1])
        return UserHistory(
            user_id=int(user_id),
            items=self.data.item_ids[lo:hi].astype(np.int64).tolist(),
            timestamps=self.data.timestamps[lo:hi].astype(np.int64).tolist()
            if self.data.has_timestamps
            else None,
            actions=self.data.actions[lo:hi].astype(np.int64).tolist(),
        )


class Retriever(CheckpointModel):
    """A trained `RetrievalGR` in eval mode with its dataset and the corpus embeddings."""

    task = "retrieval"
    model_type = RetrievalGR

    # ---- scoring -------------------------------------------------------------------------------

    @torch.no_grad()
    def corpus_embeddings(self, chunk: int = 65536) -> torch.Tensor:
        """[C, D] L2-normalised float embeddings of the corpus (``self.corpus`` order), cached."""
        if self._corpus_emb is None:
            parts = []
            for s in range(0, self.corpus.numel(), chunk):
                ids = self.corpus[s : s + chunk].to(self.device)
                with self._autocast():
                    parts.append(self.model.item_embeddings(ids).float())
            self._corpus_emb = torch.cat(parts)
        return self._corpus_emb

    @torch.no_grad()
    def queries(self, batch: Batch) -> torch.Tensor:
        """[B, D] query of each sample: the model's output at its last history item."""
        if batch.target_item_ids is None:
            # the model returns its evaluation query when the batch has targets; any id does
            batch = _with_placeholder_targets(batch)
        device_batch = batch.to(self.device)
        with self._autocast():
            out = self.model(device_batch)
        return out["query"].float()

    @torch.no_grad()
    def retrieve(
        self,
        batch_or_users: Batch | Sequence[UserHistory | Mapping[str, Any]],
        top_k: int = 100,
        exclude_history: bool = True,
        batch_size: int = 256,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top ``top_k`` items of each user: ``(item_ids [U, K] int64, scores [U, K] float32)``,
        best first, on the CPU.

        ``batch_or_users``: a `Batch` (its history window is the query and the excluded items)
        or `UserHistory` requests (dicts with the same keys work too; every given item is
        excluded, the last ``DatasetArgs.max_history_seqlen`` ones form the query). When fewer
        than ``top_k`` items are left after the exclusion, the rest of the row is id -1 with
        score -inf. ``K = min(top_k, corpus size)``.
        """
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k={top_k!r} must be a positive integer")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        k = min(top_k, self.corpus.numel())
        if isinstance(batch_or_users, Batch):
            batch = batch_or_users.to(self.device)
            chunks = [(batch, _history_of(batch))]
        else:
            users = [as_user_history(u, f"request {i + 1}") for i, u in enumerate(batch_or_users)]
            self.check_users(users)
            chunks = (
                (self.make_batch(part), _jagged_items([u.items for u in part]))
                for part in (users[s : s + batch_size] for s in range(0, len(users), batch_size))
            )
        ids_out, scores_out = [], []
        for batch, history in chunks:
            ids, scores = self._top_k(self.queries(batch), history if exclude_history else None, k)
            ids_out.append(ids)
            scores_out.append(scores)
        if not ids_out:
            return torch.empty(0, k, dtype=torch.int64), torch.empty(0, k)
        return torch.cat(ids_out), torch.cat(scores_out)

    def _top_k(
        self, query: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor] | None, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top ``k`` corpus items of each query row, the items of ``history`` (jagged: ids [n] and
        counts per row [B]) excluded. On the device without a host sync until the result is
        copied back: every (row, history item) pair at once, ids found by a sorted search over the
        corpus; an id outside the corpus writes into an extra score column that is never ranked."""
        emb = self.corpus_embeddings()
        c = emb.shape[0]
        dev = query.device
        scores = query.new_zeros(query.shape[0], c + 1)
        torch.matmul(query, emb.t(), out=scores[:, :c])  # [B, C] cosine, as the evaluator scores
        corpus = self._device_corpus()
        if history is not None and history[0].numel():
            items, counts = history[0].to(dev, torch.int64), history[1].to(dev, torch.int64)
            rows = torch.repeat_interleave(
                torch.arange(counts.numel(), device=dev), counts, output_size=items.numel()
            )
            col, found = self._columns(items, corpus)
            col = torch.where(found, col, c)
            scores.index_put_((rows, col), scores.new_full((), float("-inf")))
        top, pos = torch.topk(scores[:, :c], k, dim=1)
        ids = torch.where(torch.isneginf(top), -1, corpus[pos])
        return ids.cpu(), top.cpu()

    def _device_corpus(self) -> torch.Tensor:
        """The sorted corpus ids on the model's device (cached)."""
        if self._corpus_dev is None:
            self._corpus_dev = self.corpus.to(self.device)
        return self._corpus_dev

    # ---- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self,
        max_batches: int | None = None,
        batch_size: int | None = None,
    ) -> dict[str, float]:
        """The training-time evaluation on the dataset's eval split (leave-one-out targets,
        `RetrievalArgs.eval_metrics` and `eval_exclude_history`, `TrainerArgs.eval_batch_size`
        and `max_eval_iters` unless given): the same metrics dict the trainer logs."""
        rt, t = self.cfg.retrieval, self.cfg.trainer
        samples = build_samples(self.data, self.cfg.dataset, "retrieval").eval
        it = BatchIterator(
            samples,
            batch_size or t.eval_batch_size,
            shuffle=False,
            seed=t.seed,
            drop_last=False,
            batch_size_binding="TrainerArgs.eval_batch_size",
        )
        evaluator = RetrievalEvaluator(
            self.corpus,
            ks=ks_from_metric_names(rt.eval_metrics),
            exclude_history=rt.eval_exclude_history,
        )
        emb = self.corpus_embeddings()
        batches = it.eval_index_batches()
        limit = t.max_eval_iters if max_batches is None else max_batches
        if limit:
            batches = batches[:limit]
        for idx in batches:
            if len(idx) == 0:
                continue
            batch = samples.collate(idx)
            evaluator.update(
                self.queries(batch),
                emb,
                batch.target_item_ids,
                held_out_histories(self.data, batch.user_ids) if rt.eval_exclude_history else None,
            )
        return evaluator.compute()


# ---- helpers -----------------------------------------------------------------------------------


def _check_identity(cfg: RunConfig, meta: Mapping[str, Any], step_dir: Path, config: Path) -> None:
    """Refuse a config.gin that does not describe the checkpoint (the fields that define what
    was trained, as recorded in meta.json when it was saved)."""
    saved = (meta.get("extra_meta") or {}).get("config_identity")
    if not isinstance(saved, dict):
        return
    current = json.loads(json.dumps(config_identity(cfg)))
    diffs = [
        f"{k}: {saved[k]!r} -> {v!r}" for k, v in current.items() if k in saved and saved[k] != v
    ]
    if diffs:
        shown = ", ".join(diffs[:3]) + (f" and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        raise ValueError(
            f"{config} does not describe checkpoint {step_dir} ({shown}): pass the config of "
            "the run that wrote it"
        )


def _load_weights(model: nn.Module, step_dir: Path, meta: Mapping[str, Any]) -> None:
    """Fill ``model`` from every rank file of ``step_dir`` (one unsharded copy)."""
    fmt = int(meta.get("format_version", 1))
    if fmt < 2 and int(meta["world_size"]) > 1:
        raise ValueError(
            f"checkpoint {step_dir} was written by {meta['world_size']} processes in checkpoint "
            f"format {fmt}, whose torchrec shards cannot be regrouped: resume it with "
            f"--nproc_per_node={meta['world_size']} and save again"
        )
    extra = meta.get("extra_meta") or {}
    sources = [upgrade_state_keys(s) for s in Checkpointer.load_all_ranks(step_dir, mmap=True)]
    model.embeddings.check_checkpoint(extra, sources[0], f"checkpoint {step_dir}")
    current = model.state_dict()
    surplus = unexpected_keys(current, sources[0]["model"])
    if surplus:
        raise ValueError(
            f"checkpoint {step_dir} holds model entries this model lacks: {surplus[:8]}; does "
            "the config describe this checkpoint?"
        )
    state = restore_into(current, [s["model"] for s in sources], f"checkpoint {step_dir} model")
    model.load_state_dict(state)
    model.embeddings.load_checkpoint_state(sources)


def _with_placeholder_targets(batch: Batch) -> Batch:
    """``batch`` with ``target_item_ids`` set to each sample's last item (only its presence
    matters: the model then returns the query of the last history position)."""
    lengths = batch.item_lengths()
    ends = torch.cumsum(lengths, 0) - 1
    values = batch.features[ITEM_FEATURE].values()
    targets = values[ends.clamp(min=0)] if values.numel() else torch.zeros_like(lengths)
    fields = {k: getattr(batch, k) for k in batch.__dataclass_fields__ if k != "host"}
    fields["target_item_ids"] = targets
    # the CPU twin stays reachable (the model reads the lengths from it without a device sync)
    return Batch(**fields, host=batch.host)


def _history_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's history items (the window the batch holds), jagged: (the item ids of the
    batch with a sample's non-history items (candidates) replaced by -1 (never a corpus id),
    item counts per sample), on the batch's device without a host sync."""
    values = batch.features[ITEM_FEATURE].values()
    lengths = batch.item_lengths().to(values.device)
    hist = batch.history_lengths().to(values.device)
    starts = torch.cumsum(lengths, 0) - lengths
    n = values.numel()
    pos = torch.arange(n, device=values.device) - torch.repeat_interleave(
        starts, lengths, output_size=n
    )
    keep = pos < torch.repeat_interleave(hist, lengths, output_size=n)
    return torch.where(keep, values.long(), -1), lengths


def _jagged_items(histories: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every item id of ``histories`` concatenated, count per history) on the host."""
    counts = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    items = torch.as_tensor(np.concatenate([np.asarray(h, dtype=np.int64) for h in histories]))
    return items, counts
