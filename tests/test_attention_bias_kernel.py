"""The compiled kernel's in-kernel relative attention bias against the PyTorch reference.

The reference side builds the dense [B, Hw, N, N] bias from the weights with plain indexing
(written here, independently of the model code) and runs `reference.hstu_attention(bias=...)`
in fp32; the kernel side calls `torch.ops.hstu_attention.fwd/bwd` with the timestamps and the
weight vectors. Compared: the output, dq/dk/dv and both weight gradients, relative to the
largest reference magnitude (as tests/test_attention_kernel.py does). The kernel sums the
weight gradients from Element-precision dS, hence the looser weight tolerance.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from attention_helpers import mask_kwargs

from hstu.ops import reference

pytestmark = pytest.mark.gpu

cuda_attention = pytest.importorskip("hstu.ops.cuda_attention")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if not cuda_attention.is_available():
    pytest.skip("hstu._hstu_attention_C is not built", allow_module_level=True)

FWD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
BWD_TOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}
WEIGHT_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
DTYPES = [torch.bfloat16, torch.float16]
LENGTHS = [0, 1, 17, 130, 0, 257, 300, 64]
MAX_SEQLEN = 300


def edges_for(num_buckets: int) -> torch.Tensor:
    """edges[0] = 1, edges[k] = ceil(exp(0.301 k)), saturated at int64 max."""
    out = [1]
    for k in range(1, num_buckets + 1):
        e = math.exp(0.301 * k)
        out.append(min(math.ceil(e), 2**63 - 1) if e < 2**63 else 2**63 - 1)
    return torch.tensor(out, dtype=torch.int64)


def buckets_of(gaps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """floor(ln(max(|g|, 1)) / 0.301) clamped to [0, NB], exactly: count of edges[1:] <= x."""
    x = gaps.abs().clamp(min=1)
    e = edges_for(num_buckets).to(gaps.device)
    return (x.unsqueeze(-1) >= e[1:]).sum(-1)


def dense_bias(lengths, max_seqlen, heads, ts, pos_w, time_w, max_pos, last_query=None):
    """[B, H, N, N] bias over padded positions (0 off-sequence; masked there anyway); the last
    token of sequence s queries at last_query[s] when given, else at its own time."""
    b = len(lengths)
    n = max_seqlen
    dev = (pos_w if pos_w is not None else time_w).device
    out = torch.zeros(b, heads, n, n, device=dev)
    pos = torch.arange(n, device=dev)
    offs = [0] + list(itertools.accumulate(lengths))
    for s, L in enumerate(lengths):
        if L == 0:
            continue
        terms = torch.zeros(heads, L, L, device=dev)
        i = pos[:L].view(L, 1)
        j = pos[:L].view(1, L)
        if pos_w is not None:
            idx = (j - i).clamp(-max_pos, max_pos) + max_pos  # [L, L]
            terms = terms + pos_w[:, idx].expand(heads, L, L)
        if time_w is not None:
            t = ts[offs[s] : offs[s] + L]
            nxt = t[torch.clamp(pos[:L] + 1, max=L - 1)].clone()
            if last_query is not None:
                nxt[L - 1] = last_query[s]
            k = buckets_of(nxt.view(L, 1) - t.view(1, L), time_w.shape[1] - 1)
            terms = terms + time_w[:, k].expand(heads, L, L)
        out[s, :, :L, :L] = terms
    return out


def _timestamps(lengths, gen, huge=False, pattern="log"):
    """Per sequence, non-decreasing with gaps spread over 0 .. 10^7 on a log scale (many buckets,
    10% ties); ``huge``: gaps up to 2^54 (differences up to ~2^62: buckets up to ~143 of 256) and
    the tokens in any order. ``pattern="steady"``: gaps of 1000 (the rows of a key tile some
    hundred tokens away span 2 or 3 buckets, with the boundaries anywhere in the tile);
    ``"one_swap"``: the log-scale gaps with two adjacent tokens swapped (one key tile out of
    time order, the others ascending)."""
    parts = []
    for L in lengths:
        if pattern == "steady":
            parts.append(1_600_000_000 + 1000 * torch.arange(L, dtype=torch.long))
            continue
        if huge:
            gaps = torch.floor(2 ** (torch.rand(L, generator=gen) * 54.0)).long()
        else:
            gaps = torch.floor(10 ** (torch.rand(L, generator=gen) * 7.0)).long()
            gaps[torch.rand(L, generator=gen) < 0.1] = 0  # ties
        t = 1_600_000_000 + torch.cumsum(gaps, 0)
        if pattern == "one_swap" and L > 1:
            i = int(torch.randint(0, L - 1, (1,), generator=gen))
            t[[i, i + 1]] = t[[i + 1, i]].clone()
        parts.append(t[torch.randperm(L, generator=gen)] if huge else t)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _run(
    lengths,
    d,
    dtype,
    *,
    heads=2,
    per_head=True,
    use_pos=True,
    use_time=True,
    max_pos=None,
    num_buckets=128,
    alpha=None,
    deterministic=False,
    last_query=False,
    seed=0,
    huge_gaps=False,
    ts_pattern="log",
    **kw,
):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    total = int(offsets[-1])
    q, k, v, do = (torch.randn(total, heads, d, generator=gen).to("cuda", dtype) for _ in range(4))
    max_pos = MAX_SEQLEN - 1 if max_pos is None else max_pos
    hw = heads if per_head else 1
    pos_w = (torch.randn(hw, 2 * max_pos + 1, generator=gen) * 0.5).cuda() if use_pos else None
    time_w = (torch.randn(hw, num_buckets + 1, generator=gen) * 0.5).cuda() if use_time else None
    ts = _timestamps(lengths, gen, huge=huge_gaps, pattern=ts_pattern).cuda()
    last_q = None
    if last_query and use_time:  # a request time after each sequence's last interaction
        ends = torch.tensor(
            [int(ts[e - 1]) if e > s else 0 for s, e in zip(offsets[:-1], offsets[1:])]
        )
        last_q = (ends + torch.randint(0, 10**6, (len(lengths),), generator=gen)).cuda()
    alpha = 1.0 / math.sqrt(d) if alpha is None else alpha
    inv_scale = 1.0 / MAX_SEQLEN
    mask_kw = dict(
        num_contexts=kw.get("num_contexts"),
        num_targets=kw.get("num_targets"),
        target_group_size=kw.get("target_group_size", 1),
        window_size=kw.get("window_size", 0),
        causal=kw.get("causal", True),
    )
    # reference
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    pr = pos_w.clone().requires_grad_() if use_pos else None
    tr = time_w.clone().requires_grad_() if use_time else None
    bias = dense_bias(lengths, MAX_SEQLEN, heads, ts, pr, tr, max_pos, last_q)
    ref = reference.hstu_attention(
        qr,
        kr,
        vr,
        offsets.cuda(),
        MAX_SEQLEN,
        alpha=alpha,
        scaling_seqlen=MAX_SEQLEN,
        bias=bias,
        **mask_kw,
    )
    ref.backward(do.float())
    # kernel
    extra = dict(
        timestamps=ts if use_time else None,
        pos_weight=pos_w,
        time_weight=time_w,
        time_edges=edges_for(num_buckets).cuda() if use_time else None,
        max_pos=max_pos if use_pos else 0,
    )
    if last_q is not None:
        extra["last_query_time"] = last_q
    args = (
        offsets,
        MAX_SEQLEN,
        mask_kw["num_contexts"],
        mask_kw["num_targets"],
        mask_kw["target_group_size"],
        mask_kw["window_size"],
        alpha,
        inv_scale,
        mask_kw["causal"],
    )
    out = torch.ops.hstu_attention.fwd(q, k, v, *args, **extra)
    grads = torch.ops.hstu_attention.bwd(do, q, k, v, *args, deterministic, **extra)
    return out, grads, ref, (qr.grad, kr.grad, vr.grad, pr, tr), (q, k, v, do, args, extra)


def _rel(x, ref):
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)


def _check(lengths, d, dtype, **kw):
    out, grads, ref, ref_grads, _ = _run(lengths, d, dtype, **kw)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) <= FWD_TOL[dtype], f"forward {_rel(out, ref):.3e}"
    dq, dk, dv, dpos, dtime = grads
    qg, kg, vg, pr, tr = ref_grads
    for name, g, gr in (("dq", dq, qg), ("dk", dk, kg), ("dv", dv, vg)):
        assert torch.isfinite(g).all(), name
        assert _rel(g, gr) <= BWD_TOL[dtype], f"{name} {_rel(g, gr):.3e}"
    if pr is not None:
        assert dpos.shape == pr.shape
        assert _rel(dpos, pr.grad) <= WEIGHT_TOL[dtype], f"d pos_weight {_rel(dpos, pr.grad):.3e}"
    else:
        assert dpos.numel() == 0
    if tr is not None:
        assert dtime.shape == tr.shape
        assert _rel(dtime, tr.grad) <= WEIGHT_TOL[dtype], (
            f"d time_weight {_rel(dtime, tr.grad):.3e}"
        )
    else:
        assert dtime.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_position_time_every_dim(d, dtype):
    _check(LENGTHS, d, dtype)


@pytest.mark.parametrize(
    "terms", [dict(use_time=False), dict(use_pos=False)], ids=["position", "time"]
)
@pytest.mark.parametrize("d", [64, 128])
def test_single_term(terms, d):
    _check(LENGTHS, d, torch.bfloat16, **terms)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "all"])
def test_position_only_every_dim(mask, d, dtype):
    """The position term alone: the backward runs the kernel built without the time term
    (bwd_biaspos_*)."""
    kw = _mask_kwargs(MASKS[mask], LENGTHS) if mask != "none" else {}
    _check(LENGTHS, d, dtype, use_time=False, **kw)


def _bwd_profiled(*args, **kw):
    """torch.ops.hstu_attention.bwd(*args, **kw) and the tiles (`BwdTraits<...>`, from the
    profiler's kernel names) of the backward kernels it ran."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = torch.ops.hstu_attention.bwd(*args, **kw)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "hstu_bwd_kernel" in e.name]
    tiles = {m.group(0) for n in names for m in [re.search(r"BwdTraits<[^>]*>", n)] if m}
    assert tiles, names
    return out, tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_position_only_backward_matches_the_general_kernel(d, dtype):
    """The position-only backward (no time weight) against the general biased backward given
    a time weight of zeros: the same scores (adding 0 is exact), so on the same tiles dq/dk/dv
    are bitwise equal in deterministic mode; d pos_weight sums the same dS in another atomic
    order. Without the time term's tables the position-only kernel may fit larger tiles (d64
    on the A100's 163 KB); then its gradients are compared within the kernel's tolerance."""
    kw = _mask_kwargs(MASKS["all"], LENGTHS)
    _, _, _, _, (q, k, v, do, args, extra) = _run(LENGTHS, d, dtype, **kw)
    general = dict(extra, time_weight=torch.zeros_like(extra["time_weight"]))
    position = dict(extra, timestamps=None, time_weight=None, time_edges=None)
    a, tiles_a = _bwd_profiled(do, q, k, v, *args, True, **general)
    b, tiles_b = _bwd_profiled(do, q, k, v, *args, True, **position)
    for name, x, y in zip(("dq", "dk", "dv"), a[:3], b[:3]):
        if tiles_a == tiles_b:
            assert torch.equal(x, y), name
        else:
            err = float((x.float() - y.float()).abs().max() / x.float().abs().max())
            assert err <= BWD_TOL[dtype] / 3, f"{name}: {err:.3e} ({tiles_a} vs {tiles_b})"
    assert b[4].numel() == 0
    assert float(a[3].abs().max()) > 0
    torch.testing.assert_close(b[3], a[3], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d", [64, 256])
def test_last_query_time(d):
    kw = _mask_kwargs(MASKS["all"], LENGTHS)
    _check(LENGTHS, d, torch.bfloat16, last_query=True, **kw)


def test_shared_weights_clamped_positions_few_buckets():
    _check(LENGTHS, 128, torch.bfloat16, per_head=False, max_pos=20, num_buckets=8, heads=3)


@pytest.mark.parametrize("d", [64, 128])
def test_huge_gaps_many_buckets_any_order(d):
    """The backward keeps one byte per element's bucket: buckets past 127, gaps of both signs
    (keys out of order, no causal mask) and rows whose buckets change at every key."""
    _check(LENGTHS, d, torch.bfloat16, num_buckets=256, huge_gaps=True, causal=False)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("pattern", ["steady", "one_swap"])
@pytest.mark.parametrize("d", [64, 128])
def test_time_buckets_by_column_segments(d, pattern, causal):
    """The forward's rows of an ascending key tile take their buckets from column segments (the
    boundaries found by binary search, gaps of both signs without the causal mask); a tile out of
    time order takes the per-key bucket."""
    _check(LENGTHS, d, torch.bfloat16, ts_pattern=pattern, causal=causal)


@pytest.mark.parametrize("terms", ["position_time", "position"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_a100_shared_memory_budget(d, terms, monkeypatch):
    """HSTU_ATTN_MAX_SMEM=166912 plans the A100's tiles (163 KB per block) here, and a kernel
    whose tiles and bias tables exceed the budget is refused, not launched: d64's biased
    backward falls back to single-buffered tiles there, its position-only backward (no time
    tables) keeps the double-buffered ones."""
    monkeypatch.setenv("HSTU_ATTN_MAX_SMEM", "166912")
    kw = _mask_kwargs(MASKS["all"], LENGTHS)
    _check(LENGTHS, d, torch.bfloat16, use_time=terms == "position_time", **kw)


def test_kernel_past_the_shared_memory_cap_is_refused_with_its_reason(monkeypatch):
    """A cap below every configuration: the launch is refused with an error that names the
    shared memory and HSTU_ATTN_MAX_SMEM, never attempted."""
    monkeypatch.setenv("HSTU_ATTN_MAX_SMEM", "4096")
    with pytest.raises(RuntimeError, match="shared memory exceeds .* HSTU_ATTN_MAX_SMEM=4096"):
        _check(LENGTHS, 64, torch.bfloat16)


def test_alpha_one_paper_setting():
    _check(LENGTHS, 64, torch.float16, alpha=1.0, per_head=False)


MASKS = {
    "noncausal": dict(causal=False),
    "context": dict(ctx=[0, 1, 6, 3, 0, 70, 6, 64]),
    "targets_group3": dict(tgt=[0, 1, 5, 100, 0, 20, 7, 64], g=3),
    "window": dict(w=37),
    "all": dict(ctx=[0, 0, 4, 6, 0, 6, 90, 1], tgt=[0, 1, 5, 100, 0, 20, 7, 60], g=2, w=70),
}


_mask_kwargs = mask_kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("mask", list(MASKS))
def test_bias_with_masks(mask, d, dtype):
    _check(LENGTHS, d, dtype, **_mask_kwargs(MASKS[mask], LENGTHS))


def test_deterministic_mode_keeps_dq_dk_dv_bitwise():
    kw = _mask_kwargs(MASKS["all"], LENGTHS)
    _, _, _, _, (q, k, v, do, args, extra) = _run(LENGTHS, 128, torch.bfloat16, **kw)
    first = torch.ops.hstu_attention.bwd(do, q, k, v, *args, True, **extra)
    for _ in range(3):
        again = torch.ops.hstu_attention.bwd(do, q, k, v, *args, True, **extra)
        for a, b in zip(first[:3], again[:3]):
            assert torch.equal(a, b)
        for a, b in zip(first[3:], again[3:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bias_without_bias_path_unchanged():
    """Zero weights give exactly the unbiased kernel's output (same tiles, bias adds 0)."""
    lengths = [5, 130, 64]
    _, _, _, _, (q, k, v, do, args, extra) = _run(lengths, 64, torch.bfloat16)
    zero = dict(
        extra,
        pos_weight=torch.zeros_like(extra["pos_weight"]),
        time_weight=torch.zeros_like(extra["time_weight"]),
    )
    plain = torch.ops.hstu_attention.fwd(q, k, v, *args)
    biased = torch.ops.hstu_attention.fwd(q, k, v, *args, **zero)
    torch.testing.assert_close(biased, plain, rtol=0, atol=0)


def test_bad_bias_inputs_raise():
    lengths = [5, 9]
    _, _, _, _, (q, k, v, do, args, extra) = _run(lengths, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="time_weight needs timestamps"):
        torch.ops.hstu_attention.fwd(q, k, v, *args, **dict(extra, timestamps=None))
    with pytest.raises(ValueError, match="pos_weight must be"):
        torch.ops.hstu_attention.fwd(q, k, v, *args, **dict(extra, max_pos=3))
    with pytest.raises(ValueError, match="timestamps must be"):
        torch.ops.hstu_attention.fwd(
            q, k, v, *args, **dict(extra, timestamps=extra["timestamps"][:3])
        )
    bad = list(args)
    bad[6] = 0.0  # alpha
    with pytest.raises(ValueError, match="alpha must be != 0"):
        torch.ops.hstu_attention.fwd(q, k, v, *bad, **extra)
    with pytest.raises(ValueError, match="num_buckets"):
        torch.ops.hstu_attention.fwd(
            q,
            k,
            v,
            *args,
            **dict(
                extra,
                time_weight=torch.zeros(1, 300, device="cuda"),
                time_edges=torch.ones(300, dtype=torch.int64, device="cuda"),
            ),
        )
