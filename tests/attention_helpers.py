"""Shared helpers of the attention kernel tests (imported by the test modules, not collected)."""

from __future__ import annotations

import torch


def mask_kwargs(cfg: dict, lengths: list[int], device: str = "cuda") -> dict:
    """Attention mask keyword arguments from a compact case: ``ctx`` / ``tgt`` per-sequence counts
    (clipped to each length; targets to what the contexts leave), ``g`` target group size, ``w``
    window, ``causal``."""
    kw = {}
    ctx = cfg.get("ctx")
    tgt = cfg.get("tgt")
    if ctx is not None:
        ctx = [min(c, n) for c, n in zip(ctx, lengths)]
        kw["num_contexts"] = torch.tensor(ctx, dtype=torch.int64, device=device)
    if tgt is not None:
        ctx_used = ctx or [0] * len(lengths)
        tgt = [min(t, n - c) for t, n, c in zip(tgt, lengths, ctx_used)]
        kw["num_targets"] = torch.tensor(tgt, dtype=torch.int32, device=device)
    if "g" in cfg:
        kw["target_group_size"] = cfg["g"]
    if "w" in cfg:
        kw["window_size"] = cfg["w"]
    if "causal" in cfg:
        kw["causal"] = cfg["causal"]
    return kw
