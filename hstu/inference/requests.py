"""Inference requests: one user's history as `UserHistory`, parsed from JSON-like dicts.

Imports torch and NumPy only, so that the artifact loader (`hstu.inference.artifact`) and the
checkpoint `Retriever` share it without the training stack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["UserHistory", "as_user_history"]


@dataclass
class UserHistory:
    """One retrieval request: a user's interactions, oldest first.

    ``timestamps`` (one per item) are needed only by a model with a relative time bias;
    ``query_time`` is then the time of the request (the last history token queries at it, as the
    evaluation's does at the held-out item's time; default: the last item's own time).
    ``actions`` (action bitmask per item) default to 0. ``features`` (contextual feature name ->
    id) default to the user's row of the dataset.
    """

    user_id: int
    items: list[int]
    timestamps: list[int] | None = None
    actions: list[int] | None = None
    features: dict[str, int] | None = None
    query_time: int | None = None


def as_user_history(user: UserHistory | Mapping[str, Any], where: str = "request") -> UserHistory:
    """A `UserHistory` from a request dict (keys ``user_id``, ``items``, optional
    ``timestamps``, ``actions``, ``features``); errors start with ``where``."""
    if isinstance(user, UserHistory):
        return user
    if not isinstance(user, Mapping):
        raise TypeError(f"{where} is a {type(user).__name__}, not a UserHistory or dict")
    keys = {"user_id", "items", "timestamps", "actions", "features", "query_time"}
    unknown = sorted(set(user) - keys)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    if "user_id" not in user or "items" not in user:
        raise ValueError(f"{where} needs 'user_id' and 'items'")
    (user_id,) = _ints([user["user_id"]], f"{where}: user_id")
    features = user.get("features")
    if features is not None and not isinstance(features, Mapping):
        raise TypeError(f"{where}: features must be an object of name -> id")
    return UserHistory(
        user_id=user_id,
        items=_ints(user["items"], f"{where}: items"),
        timestamps=_ints(user["timestamps"], f"{where}: timestamps")
        if user.get("timestamps") is not None
        else None,
        actions=_ints(user["actions"], f"{where}: actions")
        if user.get("actions") is not None
        else None,
        features=None
        if features is None
        else dict(zip(features, _ints(list(features.values()), f"{where}: features"))),
        query_time=None
        if user.get("query_time") is None
        else _ints([user["query_time"]], f"{where}: query_time")[0],
    )


def _ints(values: Any, where: str) -> list[int]:
    """``values`` as a list of Python ints; TypeError naming the first value that is not one."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        if not isinstance(values, (np.ndarray, torch.Tensor)):
            raise TypeError(f"{where} must be a list of integers, got {type(values).__name__}")
    out = []
    for v in list(values):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{where}: {v!r} is not an integer")
        out.append(int(v))
    return out
