"""Attention of a sequence's last queries against its cached keys/values (inference with a KV
cache): `hstu.ops.reference.hstu_attention_cached` and its compiled twin
`torch.ops.hstu_attention.fwd_cached`.

CPU: the reference equals the query rows of the whole-sequence attention (`hstu_attention` on
the full q), with the keys/values in per-sequence slots whose unused tails hold garbage, for every
mask and the relative bias. GPU: the kernel against the reference (every mask, both dtypes, head
dims 32-256, position + time bias, slot gaps, sequences without queries, queries covering the
whole sequence) and its input checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hstu.ops import reference
from hstu.ops.attention import hstu_attention_cached

# (sequence length, queries at its end, spare slot rows)
SEQS = [(1, 1, 0), (17, 3, 2), (130, 100, 5), (0, 0, 3), (257, 1, 0), (300, 300, 7), (64, 0, 1)]
MASKS = {
    "causal": {},
    "targets": {"tgt": [1, 3, 100, 0, 1, 200, 0]},
    "contexts_targets_groups": {
        "ctx": [0, 2, 6, 0, 3, 5, 2],
        "tgt": [1, 3, 90, 0, 1, 150, 0],
        "g": 3,
    },
    "window": {"ctx": [0, 1, 4, 0, 2, 2, 0], "tgt": [1, 2, 60, 0, 1, 100, 0], "w": 40},
}


def _mask(cfg, lengths, device):
    kw = {}
    ctx = [min(c, n) for c, n in zip(cfg.get("ctx", [0] * len(lengths)), lengths)]
    if "ctx" in cfg:
        kw["num_contexts"] = torch.tensor(ctx, dtype=torch.int64, device=device)
    if "tgt" in cfg:
        tgt = [min(t, n - c) for t, n, c in zip(cfg["tgt"], lengths, ctx)]
        kw["num_targets"] = torch.tensor(tgt, dtype=torch.int64, device=device)
    if "g" in cfg:
        kw["target_group_size"] = cfg["g"]
    if "w" in cfg:
        kw["window_size"] = cfg["w"]
    return kw


def _case(seqs, heads, d, dtype, device, *, bias=False, seed=0):
    """Whole sequences (q, k, v, times) and their cached form: the last queries of each, k/v/times
    in slots with garbage in the spare rows."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [n for n, _, _ in seqs]
    offs = [0, *itertools.accumulate(lengths)]
    total = offs[-1]
    q, k, v = (torch.randn(total, heads, d, generator=gen) for _ in range(3))
    gaps = torch.floor(10 ** (torch.rand(total, generator=gen) * 6)).long()
    ts = torch.cat([1_700_000_000 + torch.cumsum(gaps[a:b], 0) for a, b in zip(offs, offs[1:])])
    slot = [n + spare for n, _, spare in seqs]
    slot_offs = [0, *itertools.accumulate(slot)]
    kc = torch.full((slot_offs[-1], heads, d), 1e4)  # garbage past each sequence's rows
    vc = torch.full((slot_offs[-1], heads, d), -1e4)
    tc = torch.full((slot_offs[-1],), -(2**40), dtype=torch.int64)
    q_rows = []
    for (n, nq, _), a, s in zip(seqs, offs, slot_offs):
        kc[s : s + n], vc[s : s + n], tc[s : s + n] = k[a : a + n], v[a : a + n], ts[a : a + n]
        q_rows += list(range(a + n - nq, a + n))
    q_rows = torch.tensor(q_rows, dtype=torch.int64)
    q_offs = [0, *itertools.accumulate(nq for _, nq, _ in seqs)]
    extra = {}
    if bias:
        max_pos = 64
        extra = dict(
            pos_weight=torch.randn(heads, 2 * max_pos + 1, generator=gen).to(device) * 0.5,
            time_weight=torch.randn(1, 129, generator=gen).to(device) * 0.5,
            max_pos=max_pos,
            last_query_time=(ts[[max(o - 1, 0) for o in offs[1:]]] + 777).to(device),
        )
    to = dict(device=device, dtype=dtype)
    whole = dict(
        q=q.to(**to), k=k.to(**to), v=v.to(**to), ts=ts.to(device),
        offsets=torch.tensor(offs, device=device),
    )  # fmt: skip
    cached = dict(
        q=q[q_rows].to(**to),
        k=kc.to(**to),
        v=vc.to(**to),
        ts=tc.to(device),
        q_offsets=torch.tensor(q_offs),
        kv_offsets=torch.tensor(slot_offs),
        kv_lengths=torch.tensor(lengths),
    )
    return whole, cached, q_rows.to(device), lengths, extra


def _whole_rows(whole, q_rows, lengths, mask_kw, extra, scaling):
    out = reference.hstu_attention(
        whole["q"].float(), whole["k"].float(), whole["v"].float(), whole["offsets"],
        max(lengths), scaling_seqlen=scaling,
        timestamps=whole["ts"] if "time_weight" in extra else None, **mask_kw, **extra,
    )  # fmt: skip
    return out[q_rows]


def _cached(fn, cached, mask_kw, extra, scaling, **kernel_kw):
    return fn(
        cached["q"], cached["k"], cached["v"], cached["q_offsets"], cached["kv_offsets"],
        kv_lengths=cached["kv_lengths"], scaling_seqlen=scaling,
        timestamps=cached["ts"] if "time_weight" in extra else None, **mask_kw, **extra,
        **kernel_kw,
    )  # fmt: skip


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "position_time"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_reference_equals_the_whole_sequence_rows(mask, bias):
    whole, cached, q_rows, lengths, extra = _case(SEQS, 2, 16, torch.float32, "cpu", bias=bias)
    mask_kw = _mask(MASKS[mask], lengths, "cpu")
    want = _whole_rows(whole, q_rows, lengths, mask_kw, extra, 320)
    got = _cached(reference.hstu_attention_cached, cached, mask_kw, extra, 320)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(want.abs().max()) > 0


@pytest.mark.parametrize("bad", [-1, 65, 2.0])
def test_bad_num_splits_is_a_clear_error_on_every_path(bad):
    _, cached, _, _, _ = _case(SEQS, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"num_splits=.* must be an int in \[0, 64\]"):
        _cached(hstu_attention_cached, cached, {}, {}, 320, num_splits=bad)


def test_reference_bad_layouts_are_clear_errors():
    _, cached, _, _, _ = _case(SEQS, 2, 16, torch.float32, "cpu")
    args = (cached["q"], cached["k"], cached["v"])
    too_many = cached["q_offsets"].clone()
    too_many[1:] += 1000
    with pytest.raises(ValueError, match="q_offsets"):
        reference.hstu_attention_cached(*args, too_many, cached["kv_offsets"])
    lengths = cached["kv_lengths"].clone()
    lengths[2] = 10_000
    with pytest.raises(ValueError, match="kv_lengths"):
        reference.hstu_attention_cached(
            *args, cached["q_offsets"], cached["kv_offsets"], kv_lengths=lengths
        )
    lengths = cached["kv_lengths"].clone()
    lengths[2] = 50  # 100 queries
    with pytest.raises(ValueError, match="100 queries but only 50 keys"):
        reference.hstu_attention_cached(
            *args, cached["q_offsets"], cached["kv_offsets"], kv_lengths=lengths
        )


# ---- the compiled kernel ------------------------------------------------------------------------

FWD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _kernel_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hstu.ops import cuda_attention

    return cuda_attention.is_available()


needs_kernel = pytest.mark.skipif(
    not _kernel_ready(), reason="needs a CUDA GPU and hstu._hstu_attention_C"
)


def _rel(x, ref):
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)


def _kernel_vs_reference(seqs, d, dtype, mask, bias, heads=2, seed=0, num_splits=1):
    whole, cached, q_rows, lengths, extra = _case(
        seqs, heads, d, dtype, "cuda", bias=bias, seed=seed
    )
    mask_kw = _mask(MASKS[mask], lengths, "cuda")
    scaling = max(lengths) + 3
    want = _whole_rows(whole, q_rows, lengths, mask_kw, extra, scaling)
    got = _cached(hstu_attention_cached, cached, mask_kw, extra, scaling, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    assert _rel(got, want) <= FWD_TOL[dtype], f"{_rel(got, want):.3e}"


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "position_time"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.gpu
@needs_kernel
def test_kernel_matches_reference(d, dtype, mask, bias):
    _kernel_vs_reference(SEQS, d, dtype, mask, bias)


@pytest.mark.gpu
@needs_kernel
def test_kernel_long_history_few_candidates():
    """The ranking-inference shape: 2,000 history tokens, 100 candidates in groups of 1."""
    seqs = [(2100, 100, 0), (1500, 100, 0), (2100, 100, 0)]
    whole, cached, q_rows, lengths, _ = _case(seqs, 4, 128, torch.bfloat16, "cuda")
    mask_kw = {
        "num_targets": torch.tensor([100, 100, 100], device="cuda"),
        "num_contexts": torch.tensor([6, 6, 6], device="cuda"),
    }
    want = _whole_rows(whole, q_rows, lengths, mask_kw, {}, 2100)
    got = _cached(hstu_attention_cached, cached, mask_kw, {}, 2100)
    assert _rel(got, want) <= FWD_TOL[torch.bfloat16]


@pytest.mark.parametrize("splits", [2, 7, 0])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "position_time"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.gpu
@needs_kernel
def test_kernel_key_splits_match_reference(d, mask, bias, splits):
    """Each query block's keys split over several CTAs (partial outputs added in fp32): the
    same rows as the reference, for every mask, with and without the bias; more splits than
    key blocks leave some CTAs without keys."""
    _kernel_vs_reference(SEQS, d, torch.bfloat16, mask, bias, num_splits=splits)


@pytest.mark.parametrize("splits", [1, 4, 0])
@pytest.mark.gpu
@needs_kernel
def test_kernel_key_splits_long_history_one_user(splits):
    """One user, 2,000 history tokens + 100 candidates, 4 heads (8 CTAs without splits)."""
    whole, cached, q_rows, lengths, extra = _case(
        [(2106, 100, 0)], 4, 256, torch.bfloat16, "cuda", bias=True
    )
    mask_kw = {
        "num_targets": torch.tensor([100], device="cuda"),
        "num_contexts": torch.tensor([6], device="cuda"),
    }
    want = _whole_rows(whole, q_rows, lengths, mask_kw, extra, 2106)
    got = _cached(hstu_attention_cached, cached, mask_kw, extra, 2106, num_splits=splits)
    assert _rel(got, want) <= FWD_TOL[torch.bfloat16]


@pytest.mark.gpu
@needs_kernel
def test_kernel_bad_inputs_raise_before_launch():
    _, cached, _, _, _ = _case(SEQS, 2, 64, torch.bfloat16, "cuda")
    op = torch.ops.hstu_attention.fwd_cached
    q, k, v = cached["q"], cached["k"], cached["v"]
    qo, ko, lens = cached["q_offsets"], cached["kv_offsets"], cached["kv_lengths"]

    def call(**kw):
        a = dict(q=q, k=k, v=v, q_offsets=qo, kv_offsets=ko, kv_lengths=lens)
        a.update(kw)
        return op(a["q"], a["k"], a["v"], a["q_offsets"], a["kv_offsets"], a["kv_lengths"],
                  None, None, 1, 0, 0.125, 0.01)  # fmt: skip

    short = lens.clone()
    short[2] = 50
    with pytest.raises(ValueError, match="queries but only"):
        call(kv_lengths=short)
    big = lens.clone()
    big[0] = 10_000
    with pytest.raises(ValueError, match="kv_lengths"):
        call(kv_lengths=big)
    with pytest.raises(ValueError, match="q_offsets"):
        call(q_offsets=qo[:-1])
    with pytest.raises(ValueError, match="kv_offsets"):
        call(kv_offsets=ko + 1)
    with pytest.raises(TypeError, match="dtype"):
        call(k=k.half())
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="num_splits"):
            op(q, k, v, qo, ko, lens, None, None, 1, 0, 0.125, 0.01, num_splits=bad)
    torch.cuda.synchronize()
