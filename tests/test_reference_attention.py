"""The PyTorch reference HSTU attention against a brute-force per-pair loop of docs/design.md's rules.

The loop spells out every mask rule literally (ids, causal, target groups, window, contextual
rows) so that the reference, the oracle of the CUDA kernel tests, is itself checked on CPU.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hstu.ops.reference import hstu_attention, hstu_attention_mask


def _valid(i: int, j: int, L: int, c: int, t: int, g: int, w: int, causal: bool) -> bool:
    if not causal:
        return True
    h = L - t

    def pid(p: int) -> int:
        return max(p - c + 1, 0) if c > 0 else p

    ok = i == j or pid(i) > pid(j)
    if i >= h and j >= h:
        ok = ok and (i - h) // g == (j - h) // g
    if w > 0:
        ok = ok and pid(i) - pid(j) <= w
    if c > 0 and pid(i) == 0 and j < h:
        ok = True
    return ok


def _brute_force(q, k, v, offsets, max_seqlen, ctx, tgt, g, w, alpha, scaling, causal):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    qd, kd, vd = q.double(), k.double(), v.double()
    for b in range(len(offsets) - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        L = e - s
        c = int(ctx[b]) if ctx is not None else 0
        t = int(tgt[b]) if tgt is not None else 0
        for i in range(L):
            for j in range(L):
                if not _valid(i, j, L, c, t, g, w, causal):
                    continue
                score = alpha * (qd[s + i] * kd[s + j]).sum(-1)  # [H]
                out[s + i] += (torch.nn.functional.silu(score) / scaling)[:, None] * vd[s + j]
    return out


def _case(lengths, h=2, d=4, dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)
    total = int(offsets[-1])
    q = torch.randn(total, h, d, generator=gen)
    k = torch.randn(total, h, d, generator=gen)
    v = torch.randn(total, h, dv or d, generator=gen)
    return q, k, v, offsets


LENGTHS = [0, 1, 5, 9, 0, 12]
CASES = {
    "causal": dict(),
    "noncausal": dict(causal=False),
    "context": dict(ctx=[0, 1, 2, 3, 0, 4]),
    "targets": dict(tgt=[0, 1, 2, 4, 0, 5]),
    "targets_group2": dict(tgt=[0, 1, 2, 4, 0, 5], g=2),
    "window": dict(w=3),
    "context_targets": dict(ctx=[0, 0, 1, 2, 0, 3], tgt=[0, 1, 2, 3, 0, 4]),
    "all": dict(ctx=[0, 0, 1, 2, 0, 3], tgt=[0, 1, 2, 3, 0, 4], g=2, w=2),
    "all_window1": dict(ctx=[0, 1, 2, 2, 0, 5], tgt=[0, 0, 3, 4, 0, 4], g=3, w=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_brute_force(name: str) -> None:
    cfg = CASES[name]
    q, k, v, offsets = _case(LENGTHS, dv=3)
    ctx = torch.tensor(cfg["ctx"]) if "ctx" in cfg else None
    tgt = torch.tensor(cfg["tgt"]) if "tgt" in cfg else None
    g, w, causal = cfg.get("g", 1), cfg.get("w", 0), cfg.get("causal", True)
    max_seqlen = 14
    alpha = 0.7
    out = hstu_attention(
        q,
        k,
        v,
        offsets,
        max_seqlen,
        num_contexts=ctx,
        num_targets=tgt,
        target_group_size=g,
        window_size=w,
        alpha=alpha,
        scaling_seqlen=10,
        causal=causal,
    )
    expect = _brute_force(q, k, v, offsets, max_seqlen, ctx, tgt, g, w, alpha, 10.0, causal)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in CASES if n != "noncausal"])
def test_mask_matches_rules(name: str) -> None:
    cfg = CASES[name]
    lengths = torch.tensor(LENGTHS)
    ctx = torch.tensor(cfg["ctx"]) if "ctx" in cfg else None
    tgt = torch.tensor(cfg["tgt"]) if "tgt" in cfg else None
    g, w = cfg.get("g", 1), cfg.get("w", 0)
    n = 13
    mask = hstu_attention_mask(lengths, n, ctx, tgt, g, w, True)
    for b, L in enumerate(LENGTHS):
        c = int(ctx[b]) if ctx is not None else 0
        t = int(tgt[b]) if tgt is not None else 0
        for i in range(n):
            for j in range(n):
                expect = i < L and j < L and _valid(i, j, L, c, t, g, w, True)
                assert bool(mask[b, i, j]) == expect, (b, i, j)


def test_empty_and_length_one() -> None:
    q, k, v, offsets = _case([0, 0])
    out = hstu_attention(q, k, v, offsets, 4)
    assert out.shape == (0, 2, 4)
    q, k, v, offsets = _case([1])
    out = hstu_attention(q, k, v, offsets, 1, alpha=1.0)
    s = (q[0] * k[0]).sum(-1)
    torch.testing.assert_close(out[0], torch.nn.functional.silu(s)[:, None] * v[0])


def test_defaults_alpha_and_scaling() -> None:
    q, k, v, offsets = _case([3, 4], d=16)
    out = hstu_attention(q, k, v, offsets, 6)
    expect = _brute_force(q, k, v, offsets, 6, None, None, 1, 0, 1 / math.sqrt(16), 6.0, True)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)
