"""The compiled HSTU attention kernel against the PyTorch reference, forward and backward.

Inputs are bf16/fp16; the reference runs in fp32 on the same (rounded) inputs. The kernel feeds
the tensor cores Element-precision P and dS (as FlashAttention does), so errors are measured
relative to the largest reference magnitude:
  forward   max|out - ref| <= FWD_TOL[dtype] * max|ref|
  gradients max|g - ref|   <= BWD_TOL[dtype] * max|ref|
"""

from __future__ import annotations

import itertools

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
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [32, 64, 128, 256]
# Empty sequences, length 1, lengths that are no multiple of any tile, and the max length.
LENGTHS = [0, 1, 17, 130, 0, 257, 300, 64]
MAX_SEQLEN = 300


def _batch(lengths, heads, d, dtype, seed=0, offsets_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=offsets_dtype)
    total = int(offsets[-1])
    q, k, v, do = (torch.randn(total, heads, d, generator=gen) for _ in range(4))
    q, k, v, do = (x.to("cuda", dtype) for x in (q, k, v, do))
    return q, k, v, do, offsets.cuda()


def _counts(values, lengths):
    return torch.tensor([min(c, L) for c, L in zip(values, lengths)], dtype=torch.int64).cuda()


def _max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)


def _check(lengths, d, dtype, max_seqlen=MAX_SEQLEN, heads=2, backward=True, seed=0, **kw):
    q, k, v, do, offsets = _batch(lengths, heads, d, dtype, seed=seed)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference.hstu_attention(qr, kr, vr, offsets, max_seqlen, **kw)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out = cuda_attention.hstu_attention_cuda(q, k, v, offsets, max_seqlen, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = _max_rel_err(out, ref)
    assert err <= FWD_TOL[dtype], f"forward rel err {err:.3e} > {FWD_TOL[dtype]}"
    if not backward:
        return
    ref.backward(do.float())
    out.backward(do)
    for name, g, gr in (("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        assert torch.isfinite(g).all(), name
        err = _max_rel_err(g, gr)
        assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e} > {BWD_TOL[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_causal_every_dim_dtype(d: int, dtype: torch.dtype) -> None:
    _check(LENGTHS, d, dtype)


MASKS = {
    "causal": dict(),
    "noncausal": dict(causal=False),
    "context": dict(ctx=[0, 1, 6, 3, 0, 70, 6, 64]),
    "targets": dict(tgt=[0, 1, 5, 100, 0, 20, 7, 64]),
    "targets_group3": dict(tgt=[0, 1, 5, 100, 0, 20, 7, 64], g=3),
    "targets_group64": dict(tgt=[0, 1, 5, 100, 0, 200, 130, 64], g=64),
    "window": dict(w=37),
    "context_targets": dict(ctx=[0, 0, 4, 6, 0, 6, 90, 1], tgt=[0, 1, 5, 100, 0, 20, 7, 60]),
    "context_window": dict(ctx=[0, 1, 4, 6, 0, 6, 90, 1], w=50),
    "all": dict(ctx=[0, 0, 4, 6, 0, 6, 90, 1], tgt=[0, 1, 5, 100, 0, 20, 7, 60], g=2, w=70),
}


_mask_kwargs = mask_kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", list(MASKS))
def test_masks(mask: str, d: int, dtype: torch.dtype) -> None:
    _check(LENGTHS, d, dtype, **_mask_kwargs(MASKS[mask], LENGTHS))


@pytest.mark.parametrize("d", [32, 256])
def test_all_masks_small_and_large_dims(d: int) -> None:
    _check(LENGTHS, d, torch.bfloat16, **_mask_kwargs(MASKS["all"], LENGTHS))


def test_long_sequences_with_targets() -> None:
    lengths = [1000, 1500, 0, 2048, 33]
    cfg = dict(ctx=[6, 6, 0, 6, 6], tgt=[100, 100, 0, 100, 10])
    _check(lengths, 128, torch.bfloat16, max_seqlen=2048, heads=2, **_mask_kwargs(cfg, lengths))


def test_alpha_scaling_and_int64_offsets() -> None:
    q, k, v, _, offsets = _batch(LENGTHS, 2, 64, torch.bfloat16, offsets_dtype=torch.int64)
    kw = dict(alpha=0.3, scaling_seqlen=97)
    ref = reference.hstu_attention(q.float(), k.float(), v.float(), offsets, MAX_SEQLEN, **kw)
    out = cuda_attention.hstu_attention_cuda(q, k, v, offsets, MAX_SEQLEN, **kw)
    assert _max_rel_err(out, ref) <= FWD_TOL[torch.bfloat16]


def test_max_seqlen_larger_than_longest() -> None:
    _check([5, 40], 64, torch.float16, max_seqlen=4096)


def test_all_sequences_empty_or_no_tokens() -> None:
    q, k, v, _, offsets = _batch([0, 0, 0], 2, 64, torch.bfloat16)
    out = cuda_attention.hstu_attention_cuda(q, k, v, offsets, 8)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "smem",
    ["device", "229375", "200000", "166912"],
    ids=["device_smem", "208k_smem", "195k_smem", "a100_smem"],
)
def test_d256_backward_every_tile_config(smem: str, dtype: torch.dtype, monkeypatch) -> None:
    """d256 picks 128x64 tiles with the dP-first schedule when the device lets a block use 224 KB
    of shared memory (H100/H200), 64x64 with double-buffered Q/dO at 208 KB, single-buffered ones
    otherwise (A100: 163 KB); HSTU_ATTN_MAX_SMEM caps the budget, so all three run here. The
    forward runs 64-row CTAs (two per SM) with a 2 x 2 warp grid and P through shared memory from
    208 KB, with 16-row warps from 192 KB, and 128-row CTAs below: all three run here."""
    if smem == "device":
        monkeypatch.delenv("HSTU_ATTN_MAX_SMEM", raising=False)
    else:
        monkeypatch.setenv("HSTU_ATTN_MAX_SMEM", smem)
    _check(LENGTHS, 256, dtype, **_mask_kwargs(MASKS["all"], LENGTHS))


def _run_profiled(lengths, d, dtype, max_seqlen, seed=0, **kw):
    """Output and dq, dk, dv of the compiled kernel, and the names of the CUDA kernels that the
    forward and the backward ran."""
    q, k, v, do, offsets = _batch(lengths, 2, d, dtype, seed=seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = cuda_attention.hstu_attention_cuda(q, k, v, offsets, max_seqlen, **kw)
        out.backward(do)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return (out.detach(), q.grad, k.grad, v.grad), names


# d -> (forward, backward) that have an SM90 (wgmma) kernel
SM90_KERNELS = {128: (False, False), 256: (True, True)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["causal", "all", "window"])
@pytest.mark.parametrize("d", [128, 256])
def test_sm90_kernels(d: int, mask: str, dtype: torch.dtype, monkeypatch) -> None:
    """The wgmma kernels (on a 9.0 device, when the build has sm_90a code: the d256 forward and
    backward) run by default there and match the reference and the SM80 kernels
    (HSTU_ATTN_SM90=0) on the same inputs; elsewhere both settings run the SM80 kernels. The
    profiler names the kernels that ran."""
    lengths = [700, 0, 1, 513, 129, 1030, 64, 300]
    kw = _mask_kwargs(MASKS[mask], lengths)
    sm90 = cuda_attention.has_sm90_kernels() and torch.cuda.get_device_capability() == (9, 0)
    expect_fwd, expect_bwd = (sm90 and e for e in SM90_KERNELS[d])
    monkeypatch.delenv("HSTU_ATTN_MAX_SMEM", raising=False)
    monkeypatch.delenv("HSTU_ATTN_SM90", raising=False)
    r90, names90 = _run_profiled(lengths, d, dtype, 1030, seed=7, **kw)
    assert any("hstu_fwd_kernel_sm90" in n for n in names90) == expect_fwd, sorted(names90)
    assert any("hstu_bwd_kernel_sm90" in n for n in names90) == expect_bwd, sorted(names90)
    monkeypatch.setenv("HSTU_ATTN_SM90", "0")
    r80, names80 = _run_profiled(lengths, d, dtype, 1030, seed=7, **kw)
    assert not any("_sm90" in n for n in names80), sorted(names80)
    assert any("hstu_fwd_kernel" in n for n in names80)
    assert any("hstu_bwd_kernel" in n for n in names80)
    for name, a, b, tol in zip(
        ("out", "dq", "dk", "dv"), r90, r80, (FWD_TOL[dtype],) + (BWD_TOL[dtype],) * 3
    ):
        assert torch.isfinite(a).all(), name
        err = _max_rel_err(a, b)
        assert err <= tol / 3, f"{name}: wgmma vs SM80 kernel rel err {err:.3e}"
    monkeypatch.delenv("HSTU_ATTN_SM90")
    _check(lengths, d, dtype, max_seqlen=1030, seed=7, **kw)


@pytest.mark.parametrize("convert", ["in_bwd", "kernel"])
@pytest.mark.parametrize("mask", ["causal", "all", "window"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dq_conversion_paths(d: int, mask: str, convert: str, monkeypatch) -> None:
    """dQ converted by the last key block of each query block inside the backward kernel (when
    the op passes the arrival counters) and by the separate convert kernel
    (HSTU_ATTN_DQ_CONVERT=kernel) both match the reference, on sequences with many blocks."""
    # the convert kernel is the default (unset); HSTU_ATTN_DQ_CONVERT=bwd opts into the other path
    monkeypatch.setenv("HSTU_ATTN_DQ_CONVERT", "kernel" if convert == "kernel" else "bwd")
    lengths = [700, 0, 1, 513, 129, 1030, 64, 300]
    _check(lengths, d, torch.bfloat16, max_seqlen=1030, **_mask_kwargs(MASKS[mask], lengths))


@pytest.mark.parametrize(
    "d, smem", [(64, None), (128, None), (256, None), (256, "229375"), (256, "166912")]
)
def test_deterministic_backward_is_bitwise_reproducible(
    d: int, smem: str | None, monkeypatch
) -> None:
    if smem is None:
        monkeypatch.delenv("HSTU_ATTN_MAX_SMEM", raising=False)
    else:
        monkeypatch.setenv("HSTU_ATTN_MAX_SMEM", smem)
    lengths = [700, 0, 1, 513, 129]
    kw = _mask_kwargs(dict(ctx=[3, 0, 0, 6, 1], tgt=[50, 0, 1, 40, 10]), lengths)
    q, k, v, do, offsets = _batch(lengths, 2, d, torch.bfloat16, seed=3)
    grads = []
    for _ in range(3):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = cuda_attention.hstu_attention_cuda(qq, kk, vv, offsets, 700, deterministic=True, **kw)
        out.backward(do)
        grads.append((qq.grad, kk.grad, vv.grad))
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    reference.hstu_attention(qr, kr, vr, offsets, 700, **kw).backward(do.float())
    assert _max_rel_err(grads[0][0], qr.grad) <= BWD_TOL[torch.bfloat16]


@pytest.mark.parametrize("d", [64, 256])
def test_grid_orders_give_identical_results(d: int, monkeypatch) -> None:
    """The CTA order of both kernels (pairs per dispatch group, HSTU_ATTN_PAIR_GROUP, and the
    last group's size, HSTU_ATTN_LAST_GROUP; by default sized from the L2 and the GPU's CTA slots)
    covers every (block, sequence, head) tile once whatever the sizes, including a last group that
    takes a remainder: outputs and deterministic gradients are bitwise equal across group sizes,
    and match the reference."""
    lengths = [700, 0, 1, 513, 129]  # 5 sequences x 3 heads = 15 pairs
    kw = _mask_kwargs(dict(ctx=[3, 0, 0, 6, 1], tgt=[50, 0, 1, 40, 10]), lengths)
    q, k, v, do, offsets = _batch(lengths, 3, d, torch.bfloat16, seed=5)
    grads = {}
    settings = [(None, None), ("1", None), ("2", "1"), ("4", "6"), ("7", None), ("15", None)]
    settings += [("1000", None), ("1", "15"), ("3", "100")]
    for group, last in settings:
        for name, val in (("HSTU_ATTN_PAIR_GROUP", group), ("HSTU_ATTN_LAST_GROUP", last)):
            if val is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, val)
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = cuda_attention.hstu_attention_cuda(qq, kk, vv, offsets, 700, deterministic=True, **kw)
        out.backward(do)
        grads[(group, last)] = (out.detach(), qq.grad, kk.grad, vv.grad)
    for setting, g in grads.items():
        for name, a, b in zip(("out", "dq", "dk", "dv"), grads[(None, None)], g):
            assert torch.equal(a, b), f"{name} differs with (group, last group) = {setting}"
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    reference.hstu_attention(qr, kr, vr, offsets, 700, **kw).backward(do.float())
    for name, g, gr in zip(
        ("dq", "dk", "dv"), grads[(None, None)][1:], (qr.grad, kr.grad, vr.grad)
    ):
        err = _max_rel_err(g, gr)
        assert err <= BWD_TOL[torch.bfloat16], f"{name} rel err {err:.3e}"


def _grads_with(env: str | None, monkeypatch, lengths, heads, d, max_seqlen, seed, det=True, **kw):
    if env is None:
        monkeypatch.delenv("HSTU_ATTN_COMPACT_GRID", raising=False)
    else:
        monkeypatch.setenv("HSTU_ATTN_COMPACT_GRID", env)
    q, k, v, do, offsets = _batch(lengths, heads, d, torch.bfloat16, seed=seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = {}
    if kw.pop("bias", False):
        gen = torch.Generator().manual_seed(seed)
        extra["pos_weight"] = (torch.randn(1, 2 * 64 + 1, generator=gen) * 0.1).cuda()
        extra["max_pos"] = 64
        gaps = torch.randint(0, 10**5, (q.shape[0],), generator=gen)
        extra["timestamps"] = torch.cumsum(gaps, 0).cuda()
        extra["time_weight"] = (torch.randn(1, 129, generator=gen) * 0.1).cuda()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = cuda_attention.hstu_attention_cuda(
            q, k, v, offsets, max_seqlen, deterministic=det, **extra, **kw
        )
        out.backward(do)
        torch.cuda.synchronize()
    compacted = sum("hstu_compact_grid_kernel" in e.name for e in prof.events())
    return (out.detach(), q.grad, k.grad, v.grad), compacted


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_compacted_grid_gives_identical_results(d: int, bias: bool, monkeypatch) -> None:
    """Heavy-tailed lengths under a loose max_seqlen bound (a CUDA graph's power of two): most
    CTAs of the full grid start past their sequence's end, so the launchers run the compacted
    grid (the compaction kernel runs in the forward and the backward); output and deterministic
    gradients are bitwise those of the full grid (HSTU_ATTN_COMPACT_GRID=0), which does not
    run it. Masks, several dispatch groups and a last group with a remainder included."""
    lengths = [1000, 3, 0, 130, 64, 1, 77, 500, 65, 129, 2]
    kw = _mask_kwargs(
        dict(ctx=[3, 0, 0, 6, 1, 0, 2, 0, 0, 4, 0], tgt=[50, 1, 0, 40, 10, 0, 5, 9, 1, 3, 1]),
        lengths,
    )
    monkeypatch.setenv("HSTU_ATTN_PAIR_GROUP", "4")
    for det in (True, False):  # deterministic: the SM80 backward; else the SM90 one at d256
        runs = {}
        for env in (None, "0"):
            runs[env] = _grads_with(
                env, monkeypatch, lengths, 3, d, 2048, 7, det=det, bias=bias, **kw
            )
        assert runs[None][1] >= 2 and runs["0"][1] == 0
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[None][0], runs["0"][0]):
            if name == "dq" and not det:  # fp32 atomics in CTA order: equal up to rounding
                err = float((a.float() - b.float()).norm() / b.float().norm())
                assert err < 1e-3, f"dq differs by {err:.2e} between the grids"
            else:
                assert torch.equal(a, b), f"{name} differs between the compacted and full grid"


def test_grid_not_compacted_when_lengths_fill_it(monkeypatch) -> None:
    """Lengths close to max_seqlen leave few CTAs past a sequence's end: no compaction kernel."""
    lengths = [300, 290, 257, 300]
    _, compacted = _grads_with(None, monkeypatch, lengths, 2, 64, 300, 3)
    assert compacted == 0


def test_meta_shapes() -> None:
    q = torch.empty(10, 2, 64, device="meta", dtype=torch.bfloat16)
    offs = torch.empty(3, device="meta", dtype=torch.int32)
    out = torch.ops.hstu_attention.fwd(q, q, q, offs, 8, None, None, 1, 0, 0.1, 0.1, True)
    assert out.shape == (10, 2, 64) and out.device.type == "meta"
    dq, dk, dv, dpos, dtime = torch.ops.hstu_attention.bwd(
        q, q, q, q, offs, 8, None, None, 1, 0, 0.1, 0.1, True, False
    )
    assert dq.shape == dk.shape == dv.shape == (10, 2, 64)
    assert dpos.numel() == 0 and dtime.numel() == 0  # no bias weights given
    pos_w = torch.empty(1, 17, device="meta")
    time_w = torch.empty(2, 129, device="meta")
    ts = torch.empty(10, device="meta", dtype=torch.int64)
    edges = torch.empty(129, device="meta", dtype=torch.int64)
    grads = torch.ops.hstu_attention.bwd(
        q,
        q,
        q,
        q,
        offs,
        8,
        None,
        None,
        1,
        0,
        0.1,
        0.1,
        True,
        False,
        timestamps=ts,
        pos_weight=pos_w,
        time_weight=time_w,
        time_edges=edges,
        max_pos=8,
    )
    assert grads[3].shape == (1, 17) and grads[4].shape == (2, 129)
    dq32 = torch.ops.hstu_attention.bwd(
        q, q, q, q, offs, 8, None, None, 1, 0, 0.1, 0.1, True, False, dq_fp32=True
    )[0]
    assert dq32.shape == (2, 10, 64) and dq32.dtype == torch.float32


@pytest.mark.parametrize("d", [64, 256])
def test_dq_fp32_is_the_unconverted_accumulator(d) -> None:
    """bwd(..., dq_fp32=True) returns dQ as the fp32 head-major [H, T, D] accumulator: in
    deterministic mode (a fixed reduction order) it rounds to exactly the dq of the default call;
    dk, dv are unchanged; outside deterministic mode it matches within the fp32 sum order."""
    lengths = [300, 1, 129, 700]
    q, k, v, do, offsets = _batch(lengths, 2, d, torch.bfloat16, seed=d)
    args = (offsets, max(lengths), None, None, 1, 0, 0.2, 1 / 700, True)
    ref = torch.ops.hstu_attention.bwd(do, q, k, v, *args, True)
    got = torch.ops.hstu_attention.bwd(do, q, k, v, *args, True, dq_fp32=True)
    assert got[0].shape == (2, q.shape[0], d) and got[0].dtype == torch.float32
    assert torch.equal(got[0].transpose(0, 1).to(q.dtype), ref[0])
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    fast = torch.ops.hstu_attention.bwd(do, q, k, v, *args, False, dq_fp32=True)[0]
    assert _max_rel_err(fast.transpose(0, 1), ref[0].float()) < 1e-2


# --- error paths: bad input raises before any launch -------------------------------------------


def _good():
    q, k, v, _, offsets = _batch([3, 5], 2, 64, torch.bfloat16)
    return q, k, v, offsets


def _call(q, k, v, offsets, max_seqlen=8, **kw):
    return cuda_attention.hstu_attention_cuda(q, k, v, offsets, max_seqlen, **kw)


def test_error_dtype() -> None:
    q, k, v, offs = _good()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        _call(q.float(), k.float(), v.float(), offs)
    with pytest.raises(TypeError, match="dtype"):
        _call(q, k.half(), v, offs)
    with pytest.raises(TypeError, match="int32 or int64"):
        _call(q, k, v, offs.float())


def test_error_head_dims() -> None:
    q, k, v, offs = _good()
    with pytest.raises(ValueError, match="Dqk == Dv"):
        _call(q, k, v[..., :32].contiguous(), offs)
    with pytest.raises(ValueError, match="head dim 48 is not supported"):
        _call(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), offs)
    with pytest.raises(ValueError, match="head dims differ"):
        _call(q, k[..., :32].contiguous(), v, offs)


def test_error_device_and_contiguity() -> None:
    q, k, v, offs = _good()
    with pytest.raises(ValueError, match="CUDA tensor"):
        _call(q, k.cpu(), v, offs)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.hstu_attention.fwd(q, kt, v, offs, 8, None, None, 1, 0, 0.1, 0.1, True)


def test_error_offsets() -> None:
    q, k, v, offs = _good()
    with pytest.raises(ValueError, match="non-decreasing"):
        _call(q, k, v, torch.tensor([0, 6, 3, 8], dtype=torch.int32).cuda())
    with pytest.raises(ValueError, match="number of tokens"):
        _call(q, k, v, torch.tensor([0, 3, 7], dtype=torch.int32).cuda())
    with pytest.raises(ValueError, match=r"seq_offsets\[0\] must be 0"):
        _call(q, k, v, torch.tensor([1, 3, 8], dtype=torch.int32).cuda())
    with pytest.raises(ValueError, match="max_seqlen"):
        _call(q, k, v, offs, max_seqlen=4)
    with pytest.raises(ValueError, match="1-D"):
        _call(q, k, v, offs.view(1, 3))
    with pytest.raises(ValueError, match="int32 range"):
        big = torch.tensor([0, 2**31 + 5, 2**31 + 5], dtype=torch.int64).cuda()
        _call(q, k, v, big, max_seqlen=2**31 - 1)


def test_error_sequence_longer_than_grid() -> None:
    n = 65535 * 64 + 1
    q = torch.zeros(n, 1, 32, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="at most 4194240 tokens"):
        _call(q, q, q, offs, max_seqlen=n)


def test_error_counts() -> None:
    q, k, v, offs = _good()
    with pytest.raises(ValueError, match=r"num_targets must have shape \[B\]"):
        _call(q, k, v, offs, num_targets=torch.tensor([1, 1, 1]).cuda())
    with pytest.raises(ValueError, match=r"num_targets\[0\]=4"):
        _call(q, k, v, offs, num_targets=torch.tensor([4, 1]).cuda())
    with pytest.raises(ValueError, match=r"num_contexts\[1\]=-1"):
        _call(q, k, v, offs, num_contexts=torch.tensor([0, -1]).cuda())
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        _call(
            q,
            k,
            v,
            offs,
            num_contexts=torch.tensor([2, 0]).cuda(),
            num_targets=torch.tensor([2, 0]).cuda(),
        )
    with pytest.raises(TypeError, match="int32 or int64"):
        _call(q, k, v, offs, num_targets=torch.tensor([1.0, 1.0]).cuda())
    with pytest.raises(ValueError, match="target_group_size"):
        _call(q, k, v, offs, target_group_size=0)
    with pytest.raises(ValueError, match="window_size"):
        _call(q, k, v, offs, window_size=-1)
    with pytest.raises(ValueError, match="causal=False"):
        _call(q, k, v, offs, causal=False, window_size=2)
    with pytest.raises(ValueError, match="scaling_seqlen"):
        _call(q, k, v, offs, scaling_seqlen=0)
