"""Evaluation metrics: per-task ranking AUC and full-corpus retrieval HR@K / NDCG@K / MRR.

Both accumulators are distributed-aware: when ``torch.distributed`` is initialised with more than
one rank, ``compute()`` aggregates over the *global* evaluation set (AUC is computed on all-gathered
predictions, retrieval metrics on all-reduced sums), never as an average of per-rank values.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "RankingMetrics",
    "RetrievalEvaluator",
    "binary_auc",
    "held_out_histories",
    "ks_from_metric_names",
    "popularity_scores",
    "retrieval_metrics",
]

logger = logging.getLogger(__name__)


def held_out_histories(data, user_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``history_ids`` of `RetrievalEvaluator.update` for leave-one-out evaluation users:
    every item each user of ``data`` (a `SequenceData`) consumed before the held-out last one
    (not only the batch's window), as (values, offsets [B+1]) int64 on the CPU."""
    uids = user_ids.cpu().numpy()
    rows = data.user_rows(uids)
    if (rows < 0).any():
        missing = uids[rows < 0][:5].tolist()
        raise ValueError(f"evaluation users {missing} are not in the dataset")
    values, offsets = data.histories_before_last(rows)
    return torch.from_numpy(values), torch.from_numpy(offsets)


# Default bound on the [chunk, C] score block materialised by RetrievalEvaluator (elements).
_DEFAULT_CHUNK_ELEMENTS = 1 << 25


# ---- distributed helpers -------------------------------------------------------------------


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _collective_device() -> torch.device:
    """Device that the default process group can communicate from (CUDA for NCCL, else CPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_variable(t: torch.Tensor) -> torch.Tensor:
    """Concatenate along dim 0 the tensors of every rank; their lengths may differ."""
    world = _world_size()
    if world == 1:
        return t
    device = _collective_device()
    local = t.to(device)
    n = torch.tensor([local.shape[0]], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    lengths = [int(s.item()) for s in sizes]
    max_len = max(max(lengths), 1)  # never communicate empty buffers
    padded = local.new_zeros((max_len, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:length] for g, length in zip(gathered, lengths)]).to(t.device)


# ---- ranking: AUC ---------------------------------------------------------------------------


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of 1-D ``scores`` against 0/1 ``labels``, by torchmetrics' ``binary_auroc``.

    Exact (every distinct score is a threshold): a positive tied with a negative counts one half,
    the trapezoidal ROC area. Returns nan when all labels are of one class or there are none: AUC
    is undefined there (torchmetrics would return 0 with a warning, and fail on empty input).

    torchmetrics applies a sigmoid to scores outside [0, 1], and in floating point that merges
    distinct large logits into ties; the scores are therefore handed over as their dense ranks
    scaled into [0, 1], which keeps every order and every tie of the scores exactly. The ROC
    counts are float32 in torchmetrics, so the result is exact up to float32 rounding.
    """
    scores = scores.detach().reshape(-1)
    labels = labels.detach().reshape(-1).to(torch.bool)
    if scores.numel() != labels.numel():
        raise ValueError(
            f"binary_auc: {scores.numel()} scores but {labels.numel()} labels; they must match"
        )
    n_pos = int(labels.sum().item())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    # imported on first use: importing hstu.modules.metrics (every trainer does) stays cheap
    from torchmetrics.functional.classification import binary_auroc

    _, dense_rank = torch.unique(scores.to(torch.float64), sorted=True, return_inverse=True)
    preds = dense_rank.to(torch.float64) / max(int(dense_rank.max().item()), 1)
    return float(binary_auroc(preds, labels.to(torch.int64)).item())


class RankingMetrics:
    """Per-task AUC over multi-task logits with bitmask labels (bit t = positive for task t).

    ``compute()`` returns ``{"auc/<task_name>": float, ..., "auc/mean": float}``; a task whose
    labels are all of one class reports nan, and ``auc/mean`` averages the defined ones only.
    """

    def __init__(self, num_tasks: int, task_names: Sequence[str] | None = None) -> None:
        if num_tasks <= 0:
            raise ValueError(f"RankingMetrics: num_tasks={num_tasks} must be >= 1")
        if num_tasks > 63:
            raise ValueError(
                f"RankingMetrics: num_tasks={num_tasks} does not fit an int64 label bitmask (max 63)"
            )
        names = (
            list(task_names) if task_names is not None else [f"task{t}" for t in range(num_tasks)]
        )
        if len(names) != num_tasks:
            raise ValueError(
                f"RankingMetrics: {len(names)} task_names {names} for num_tasks={num_tasks}; "
                "give one name per task"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"RankingMetrics: task_names {names} contain duplicates")
        self.num_tasks = num_tasks
        self.task_names = names
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def reset(self) -> None:
        self._logits.clear()
        self._labels.clear()

    @property
    def num_samples(self) -> int:
        """Samples accumulated on this rank since the last reset."""
        return sum(x.shape[0] for x in self._logits)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Accumulate ``logits`` [N, T] (any monotone score works) and ``labels`` [N] int bitmask."""
        if logits.dim() != 2 or logits.shape[1] != self.num_tasks:
            raise ValueError(
                f"RankingMetrics.update: logits must be [N, {self.num_tasks}], got {tuple(logits.shape)}"
            )
        if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
            raise ValueError(
                f"RankingMetrics.update: labels must be [N={logits.shape[0]}], got {tuple(labels.shape)}"
            )
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise TypeError(
                f"RankingMetrics.update: labels must be an integer bitmask tensor, got {labels.dtype}"
            )
        self._logits.append(logits.detach().to("cpu", torch.float32))
        self._labels.append(labels.detach().to("cpu", torch.int64))

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.cat(self._logits) if self._logits else torch.zeros((0, self.num_tasks))
        labels = torch.cat(self._labels) if self._labels else torch.zeros((0,), dtype=torch.int64)
        return _all_gather_variable(logits), _all_gather_variable(labels)

    @staticmethod
    def metric_names(task_names: Sequence[str]) -> list[str]:
        """The names `compute` reports for ``task_names``: ``auc/<task>`` each, then ``auc/mean``."""
        return [f"auc/{name}" for name in task_names] + ["auc/mean"]

    def compute(self) -> dict[str, float]:
        """AUC per task over the global evaluation set. Collective: call it on every rank."""
        logits, labels = self._gathered()
        out: dict[str, float] = {}
        defined = []
        *per_task, mean = self.metric_names(self.task_names)
        for t, name in enumerate(per_task):
            auc = binary_auc(logits[:, t], (labels >> t) & 1)
            out[name] = auc
            if not math.isnan(auc):
                defined.append(auc)
        out[mean] = sum(defined) / len(defined) if defined else math.nan
        return out


# ---- retrieval: HR@K, NDCG@K, MRR ------------------------------------------------------------


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or any(k <= 0 for k in ks):
        raise ValueError(f"retrieval metrics: ks={ks} must be a non-empty list of positive ints")
    return ks


def retrieval_metrics(
    scores: torch.Tensor, target_index: torch.Tensor, ks: Sequence[int] = (10, 50, 200)
) -> dict[str, torch.Tensor]:
    """Per-sample ``hr@k``, ``ndcg@k`` (for each k) and ``mrr`` of the target among C candidates.

    scores [B, C]; target_index [B] (column of each row's target). The target's rank is
    ``1 + #{other candidates with score >= target score}``: ties count *against* the target, so a
    constant model ranks every target last instead of first. Scores of -inf mark excluded
    candidates and never count above the target (a target scored -inf is placed after every
    non-excluded candidate). HR@K = [rank <= K]; NDCG@K = 1/log2(rank+1) if rank <= K else 0;
    MRR = 1/rank.
    """
    ks = _check_ks(ks)
    if scores.dim() != 2:
        raise ValueError(f"retrieval_metrics: scores must be [B, C], got {tuple(scores.shape)}")
    b, c = scores.shape
    if target_index.shape != (b,):
        raise ValueError(
            f"retrieval_metrics: target_index must be [B={b}], got {tuple(target_index.shape)}"
        )
    target_index = target_index.to(scores.device, torch.int64)
    if b and (int(target_index.min()) < 0 or int(target_index.max()) >= c):
        raise ValueError(
            f"retrieval_metrics: target_index values must be in [0, {c}), got range "
            f"[{int(target_index.min())}, {int(target_index.max())}]"
        )
    if torch.isnan(scores).any():
        raise ValueError("retrieval_metrics: scores contain NaN; ranks would be meaningless")
    target_score = scores.gather(1, target_index[:, None])
    ahead = (scores >= target_score) & (scores != float("-inf"))
    # The target compares >= itself; drop that self-count (only present when it is not -inf).
    self_counted = (target_score.squeeze(1) != float("-inf")).to(torch.int64)
    rank = 1 + ahead.sum(dim=1) - self_counted
    rank_f = rank.to(torch.float64)
    out: dict[str, torch.Tensor] = {}
    gain = 1.0 / torch.log2(rank_f + 1.0)
    for k in ks:
        hit = rank <= k
        out[f"hr@{k}"] = hit.to(torch.float64)
        out[f"ndcg@{k}"] = torch.where(hit, gain, torch.zeros_like(gain))
    out["mrr"] = 1.0 / rank_f
    return out


_METRIC_NAME = re.compile(r"^(HR|NDCG)@(\d+)$")


def ks_from_metric_names(names: Sequence[str]) -> tuple[int, ...]:
    """The cut-offs K named by RetrievalArgs.eval_metrics (``"HR@10"``, ``"NDCG@50"``, ``"MRR"``)."""
    ks: list[int] = []
    for name in names:
        up = str(name).strip().upper()
        if up == "MRR":
            continue
        m = _METRIC_NAME.match(up)
        if m is None or int(m.group(2)) <= 0:
            raise ValueError(
                f"RetrievalArgs.eval_metrics: unknown metric {name!r}; use 'HR@K', 'NDCG@K' "
                "(K a positive int) or 'MRR'"
            )
        k = int(m.group(2))
        if k not in ks:
            ks.append(k)
    return tuple(sorted(ks)) if ks else (10,)


def _as_jagged(
    history_ids: Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise history to (values [N] int64, offsets [B+1] int64) on CPU."""
    if hasattr(history_ids, "offsets") and hasattr(history_ids, "values"):
        history_ids = (history_ids.values(), history_ids.offsets())  # torchrec JaggedTensor
    if (
        isinstance(history_ids, tuple)
        and len(history_ids) == 2
        and history_ids[1].dim() == 1
        and history_ids[1].numel() == batch_size + 1
    ):
        values, offsets = history_ids
        values = values.reshape(-1).to("cpu", torch.int64)
        offsets = offsets.to("cpu", torch.int64)
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or (offsets.diff() < 0).any():
            raise ValueError(
                f"RetrievalEvaluator.update: history offsets must start at 0, be non-decreasing and "
                f"end at len(values)={values.numel()}; got {offsets.tolist()[:8]}..."
            )
        return values, offsets
    seqs = list(history_ids)
    if len(seqs) != batch_size:
        raise ValueError(
            f"RetrievalEvaluator.update: got {len(seqs)} history sequences for a batch of "
            f"{batch_size}; pass one 1-D tensor per query or a (values, offsets) pair"
        )
    lengths = torch.tensor([int(s.numel()) for s in seqs], dtype=torch.int64)
    offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    values = (
        torch.cat([torch.as_tensor(s).reshape(-1).to("cpu", torch.int64) for s in seqs])
        if seqs
        else torch.zeros(0, dtype=torch.int64)
    )
    return values, offsets


class RetrievalEvaluator:
    """Accumulates HR@K, NDCG@K and MRR of next-item targets ranked against the full corpus.

    ``item_ids`` [C] are the raw ids of the corpus, in the row order of the item embeddings passed
    to ``update``. With ``exclude_history`` each query's own history items are scored -inf (the
    usual "do not recommend what was already consumed" protocol) *except the target itself*: a
    re-consumed target stays rankable, otherwise it could never be hit and repeat-heavy datasets
    would be scored as if the model were wrong on every repeat.
    """

    def __init__(
        self,
        item_ids: torch.Tensor,
        ks: Sequence[int] = (10, 50, 200),
        exclude_history: bool = True,
        chunk_size: int | None = None,
    ) -> None:
        item_ids = torch.as_tensor(item_ids).reshape(-1).to("cpu", torch.int64)
        if item_ids.numel() == 0:
            raise ValueError("RetrievalEvaluator: the item corpus (item_ids) is empty")
        sorted_ids, order = torch.sort(item_ids)
        dup = sorted_ids[1:] == sorted_ids[:-1]
        if dup.any():
            raise ValueError(
                f"RetrievalEvaluator: item_ids must be unique; {sorted_ids[1:][dup][:5].tolist()} repeat"
            )
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"RetrievalEvaluator: chunk_size={chunk_size} must be positive")
        self.item_ids = item_ids
        self.ks = _check_ks(ks)
        self.exclude_history = exclude_history
        self.chunk_size = chunk_size or max(1, _DEFAULT_CHUNK_ELEMENTS // item_ids.numel())
        self._sorted_ids = sorted_ids
        self._sorted_pos = order
        # the per-sample keys of `retrieval_metrics`, in the order of `metric_names`
        self._keys = [name.lower() for name in self.metric_names(self.ks)]
        self.reset()

    @property
    def num_items(self) -> int:
        return int(self.item_ids.numel())

    def reset(self) -> None:
        self._sums = torch.zeros(len(self._keys), dtype=torch.float64)
        self._count = 0

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Corpus column of each raw id and whether it is in the corpus at all."""
        ids = ids.to("cpu", torch.int64)
        pos = torch.searchsorted(self._sorted_ids, ids).clamp_(max=self.num_items - 1)
        found = self._sorted_ids[pos] == ids
        return self._sorted_pos[pos], found

    def update(
        self,
        query: torch.Tensor,
        item_embeddings: torch.Tensor,
        target_ids: torch.Tensor,
        history_ids: Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Score ``query`` [B, D] against ``item_embeddings`` [C, D] (dot product) and accumulate.

        ``target_ids`` [B] are raw item ids. ``history_ids`` (needed with ``exclude_history``): one
        1-D tensor of raw ids per query, a ``(values, offsets)`` pair, or a torchrec JaggedTensor;
        ids absent from the corpus are ignored. Scoring is chunked over queries (``chunk_size``)
        so at most ``chunk_size x C`` scores exist at once.
        """
        if (
            query.dim() != 2
            or item_embeddings.dim() != 2
            or query.shape[1] != item_embeddings.shape[1]
        ):
            raise ValueError(
                f"RetrievalEvaluator.update: query [B, D] and item_embeddings [C, D] must share D; "
                f"got {tuple(query.shape)} and {tuple(item_embeddings.shape)}"
            )
        if item_embeddings.shape[0] != self.num_items:
            raise ValueError(
                f"RetrievalEvaluator.update: item_embeddings has {item_embeddings.shape[0]} rows but "
                f"the corpus has {self.num_items} item_ids; pass one row per corpus item, in order"
            )
        emb_t = item_embeddings.detach().float().t()
        query = query.detach().float()
        self._update(lambda s, e: query[s:e] @ emb_t, query.shape[0], target_ids, history_ids)

    def update_scores(
        self,
        scores: torch.Tensor,
        target_ids: torch.Tensor,
        history_ids: Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Accumulate precomputed scores: [B, C], or [C] for a query-independent model (e.g. popularity)."""
        b = int(target_ids.numel())
        if scores.dim() == 1:
            scores = scores.reshape(1, -1).expand(b, -1)
        if scores.dim() != 2 or scores.shape[1] != self.num_items or scores.shape[0] != b:
            raise ValueError(
                f"RetrievalEvaluator.update_scores: scores must be [B={b}, C={self.num_items}] or "
                f"[C], got {tuple(scores.shape)}"
            )
        scores = scores.detach()
        # copy: history exclusion writes -inf into the block, which must not reach the caller
        self._update(
            lambda s, e: scores[s:e].to(torch.float32, copy=True), b, target_ids, history_ids
        )

    def _update(self, score_fn, batch_size: int, target_ids, history_ids) -> None:
        """Shared body: ``score_fn(start, end)`` returns a fresh [end - start, C] float block."""
        target_ids = torch.as_tensor(target_ids).reshape(-1)
        if target_ids.numel() != batch_size:
            raise ValueError(
                f"RetrievalEvaluator.update: {target_ids.numel()} target_ids for {batch_size} queries"
            )
        if batch_size == 0:
            return
        target_col, found = self._lookup(target_ids)
        if not found.all():
            missing = target_ids.cpu()[~found][:5].tolist()
            raise ValueError(
                f"RetrievalEvaluator.update: target ids {missing} are not in the item corpus "
                f"({self.num_items} items); the corpus must contain every evaluation target"
            )
        if self.exclude_history:
            if history_ids is None:
                raise ValueError(
                    "RetrievalEvaluator.update: exclude_history=True needs history_ids "
                    "(RetrievalArgs.eval_exclude_history); pass them or disable exclusion"
                )
            hist_values, hist_offsets = _as_jagged(history_ids, batch_size)
            hist_col, hist_found = self._lookup(hist_values)
            hist_lengths = hist_offsets.diff()
        for start in range(0, batch_size, self.chunk_size):
            end = min(start + self.chunk_size, batch_size)
            scores = score_fn(start, end)
            tgt = target_col[start:end].to(scores.device)
            if self.exclude_history:
                lo, hi = int(hist_offsets[start]), int(hist_offsets[end])
                if hi > lo:
                    rows = torch.repeat_interleave(
                        torch.arange(end - start), hist_lengths[start:end]
                    )
                    cols = hist_col[lo:hi]
                    keep = hist_found[lo:hi] & (cols != target_col[start:end][rows])
                    if keep.any():
                        scores[rows[keep].to(scores.device), cols[keep].to(scores.device)] = float(
                            "-inf"
                        )
            per_sample = retrieval_metrics(scores, tgt, self.ks)
            self._sums += torch.stack([per_sample[k].sum().cpu() for k in self._keys])
        self._count += batch_size

    def compute(self) -> dict[str, float]:
        """Mean metrics over every rank's samples: ``{"HR@10": .., "NDCG@10": .., "MRR": ..}``.

        Collective when distributed: call it on every rank.
        """
        totals = torch.cat([self._sums, torch.tensor([float(self._count)], dtype=torch.float64)])
        if _world_size() > 1:
            buf = totals.to(_collective_device())
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            totals = buf.cpu()
        count = totals[-1].item()
        out: dict[str, float] = {}
        for i, name in enumerate(self.metric_names(self.ks)):
            out[name] = totals[i].item() / count if count > 0 else math.nan
        return out

    @staticmethod
    def metric_names(ks: Sequence[int]) -> list[str]:
        """The names `compute` reports for the cut-offs ``ks``: ``HR@K`` each, ``NDCG@K`` each,
        ``MRR`` (the order of its sums)."""
        return [f"HR@{k}" for k in ks] + [f"NDCG@{k}" for k in ks] + ["MRR"]

    @property
    def num_samples(self) -> int:
        """Queries accumulated on this rank since the last reset."""
        return self._count


def popularity_scores(
    train_item_ids: torch.Tensor, corpus: torch.Tensor, tie_break: bool = True
) -> torch.Tensor:
    """Query-independent popularity scores [C] for a baseline evaluated through RetrievalEvaluator.

    Counts how often each corpus item occurs in ``train_item_ids``. With ``tie_break`` (default)
    the score is the item's popularity rank instead (C for the most frequent down to 1), equal
    counts ordered by corpus position; since ties count against the target, an un-broken tie
    among rare items would otherwise make the baseline look worse than a real popularity ranking.
    Use as ``evaluator.update_scores(popularity_scores(...), target_ids, history)``.
    """
    corpus = torch.as_tensor(corpus).reshape(-1).to("cpu", torch.int64)
    train = torch.as_tensor(train_item_ids).reshape(-1).to("cpu", torch.int64)
    sorted_ids, order = torch.sort(corpus)
    pos = torch.searchsorted(sorted_ids, train).clamp_(max=max(corpus.numel() - 1, 0))
    found = (
        sorted_ids[pos] == train if corpus.numel() else torch.zeros_like(train, dtype=torch.bool)
    )
    counts = torch.zeros(corpus.numel(), dtype=torch.int64)
    counts.index_add_(0, order[pos[found]], torch.ones(int(found.sum()), dtype=torch.int64))
    if not tie_break:
        return counts.to(torch.float32)
    # Stable descending sort by count: earlier corpus positions win ties.
    ranking = torch.sort(counts, descending=True, stable=True).indices
    scores = torch.empty(corpus.numel(), dtype=torch.float32)
    scores[ranking] = torch.arange(corpus.numel(), 0, -1, dtype=torch.float32)
    return scores
