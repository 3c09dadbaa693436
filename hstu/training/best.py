"""The best evaluation of a run and early stopping (`TrainerArgs.best_metric`,
`best_metric_mode`, `early_stop_patience`).

`BestMetric` follows one evaluation metric over a run's evaluations: which evaluation scored best
(the trainer then saves that step's checkpoint and marks it best, `Checkpointer.mark_best`, which
pruning spares) and how many evaluations in a row have not improved on it (early stopping). Its
state travels in the checkpoints, so a resumed run keeps its best and its count. Every rank sees
the same (all-reduced) metrics, so every rank takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BestMetric", "eval_metric_names", "headline_metric", "resolve_best_metric"]


def headline_metric(
    task: str, retrieval_metrics: Sequence[str], names: Sequence[str]
) -> str | None:
    """The task's headline metric among ``names``: the mean AUC over tasks (ranking), the first
    of ``retrieval_metrics`` (RetrievalArgs.eval_metrics) that ``names`` holds (retrieval); else
    the first AUC / the first name that is not the loss."""
    names = list(names)
    if task == "ranking":
        preferred = ["auc/mean"] + [n for n in names if n.startswith("auc")]
    else:
        preferred = [str(m).strip().upper() for m in retrieval_metrics]
    for name in preferred + [n for n in names if n != "loss"]:
        if name in names:
            return name
    return None


def eval_metric_names(task: str, task_names: Sequence[str], retrieval_ks: Sequence[int]) -> list:
    """The names an evaluation of ``task`` reports: `RankingMetrics`' and the trainer's ``loss``
    (ranking), `RetrievalEvaluator`'s (retrieval)."""
    from hstu.modules.metrics import RankingMetrics, RetrievalEvaluator

    if task == "ranking":
        return RankingMetrics.metric_names(task_names) + ["loss"]
    return RetrievalEvaluator.metric_names(retrieval_ks)


def resolve_best_metric(
    name: str, mode: str, names: Sequence[str], headline: str | None
) -> tuple[str, str]:
    """(metric, "max" | "min") for ``TrainerArgs.best_metric=name`` and ``best_metric_mode=mode``
    among the evaluation's ``names``; "auto" names ``headline`` (the task's headline metric); an
    "auto" mode minimises a loss and maximises the rest. Raises naming the setting."""
    name = name.strip()
    metric = headline if name.lower() == "auto" else name
    if metric not in names:
        # retrieval names are upper case as logged; accept the config's spelling (ndcg@10)
        matches = [n for n in names if n.lower() == str(metric).lower()]
        if len(matches) != 1:
            raise ValueError(
                f"TrainerArgs.best_metric={name!r} is not one of this run's evaluation metrics "
                f"{list(names)}; set one of them, or 'auto' (the task's headline metric)"
            )
        metric = matches[0]
    if mode == "auto":  # (the mode itself is checked with the config: BEST_METRIC_MODES)
        mode = "min" if "loss" in metric.lower() else "max"
    return metric, mode


@dataclass
class BestMetric:
    """The best value of ``metric`` over a run's evaluations (``mode`` "max" or "min") and the
    evaluations since it improved; ``patience`` > 0: `should_stop` after that many."""

    metric: str
    mode: str
    patience: int = 0
    value: float | None = None
    step: int | None = None
    path: str | None = None  # the best evaluation's checkpoint, once saved
    stale: int = 0  # evaluations in a row without improvement

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Takes the evaluation of ``step``; True when it is the best so far (strictly better; a
        NaN value never is)."""
        if self.metric not in metrics:
            raise ValueError(
                f"TrainerArgs.best_metric: the evaluation at step {step} reported no "
                f"{self.metric!r} (it reported {sorted(metrics)})"
            )
        value = float(metrics[self.metric])
        better = not math.isnan(value) and (
            self.value is None or (value > self.value if self.mode == "max" else value < self.value)
        )
        if better:
            self.value, self.step, self.path, self.stale = value, int(step), None, 0
        else:
            self.stale += 1
        return better

    def summary(self) -> dict:
        """What a run reports of it (`TrainResult.best`, run.json): metric, mode, the best value,
        its step and checkpoint."""
        keys = ("metric", "mode", "value", "step")
        return {**{k: getattr(self, k) for k in keys}, "checkpoint": self.path}

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def state_dict(self) -> dict:
        """Everything but ``patience`` (a setting of the run that loads it)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "patience"}

    def load_state_dict(self, state: dict) -> bool:
        """Restores a checkpoint's state when it followed the same metric the same way; False
        (nothing restored) otherwise."""
        if state.get("metric") != self.metric or state.get("mode") != self.mode:
            return False
        self.value = None if state.get("value") is None else float(state["value"])
        self.step = None if state.get("step") is None else int(state["step"])
        self.path = state.get("path")
        self.stale = int(state.get("stale", 0))
        return True
