"""dropout(LayerNorm(x) * u): the PyTorch twin (CPU) and the compiled CUDA kernel vs the twin (GPU).

The twin is checked against autograd of the plain formula; the kernel (`-m gpu`) against the twin:
forward and every gradient, bf16 and fp16, widths from 8 to 8192, strided u, dropout masks equal
bit for bit (both derive them from the same Philox seed), eval mode, and the input checks.
"""

from __future__ import annotations

import pytest
import torch

from hstu.modules import layer_norm_mul_dropout as lnmd


def _inputs(t, d, dtype=torch.float32, device="cpu", seed=0, u_stride_cols=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=gen) * 2 + 0.5).to(device, dtype)
    wide = u_stride_cols or d
    u_full = torch.randn(t, wide, generator=gen).to(device, dtype)
    u = u_full[:, :d]  # a column block of a wider tensor when u_stride_cols > d
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    b = (0.1 * torch.randn(d, generator=gen)).to(device)
    dy = torch.randn(t, d, generator=gen).to(device, dtype)
    return x, u, w, b, dy


def _autograd_formula(x, u, w, b, dy, eps, keep, scale):
    """The plain PyTorch formula, differentiated by autograd (fp32)."""
    leaves = [t.detach().float().requires_grad_(True) for t in (x, u, w, b)]
    xf, uf, wf, bf = leaves
    g = torch.nn.functional.layer_norm(xf, (xf.shape[1],), wf, bf, eps) * uf
    y = g if keep is None else g * keep * scale
    y.backward(dy.float())
    return y.detach(), [t.grad for t in leaves]


def test_dropout_threshold_quantises_p_and_rejects_bad_values():
    assert lnmd.dropout_threshold(0.0) == (0, 1.0)
    assert lnmd.dropout_threshold(0.25) == (16384, 65536 / 49152)
    t, scale = lnmd.dropout_threshold(0.1)
    assert t == 6554 and scale == pytest.approx(1 / (1 - 6554 / 65536))
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            lnmd.dropout_threshold(bad)


def test_keep_mask_statistics_and_determinism():
    m = lnmd.keep_mask(1234, 8, 512, 1024, 0.3)
    assert m.shape == (512, 1024) and m.dtype == torch.bool
    assert abs(float((~m).float().mean()) - 0.3) < 0.005
    # per-column and per-row drop rates are flat (no stripes from the 8-wide chunking)
    cols = (~m).float().mean(0).view(-1, 8).mean(0)
    assert float((cols - 0.3).abs().max()) < 0.01
    assert torch.equal(m, lnmd.keep_mask(1234, 8, 512, 1024, 0.3))
    for other in (
        lnmd.keep_mask(1235, 8, 512, 1024, 0.3),
        lnmd.keep_mask(1234, 12, 512, 1024, 0.3),
    ):
        # another seed or another offset: an independent mask (disagrees on 2 p (1 - p) = 42%)
        assert abs(float((m != other).float().mean()) - 0.42) < 0.01
    assert bool(lnmd.keep_mask(7, 0, 3, 16, 0.0).all())
    with pytest.raises(ValueError, match="multiple"):
        lnmd.keep_mask(7, 0, 3, 12, 0.5)


def test_draw_seed_follows_torch_manual_seed():
    torch.manual_seed(5)
    a = lnmd.draw_seed()
    torch.manual_seed(5)
    assert lnmd.draw_seed() == a
    assert lnmd.draw_seed() != a
    assert 0 <= a[0] < 2**63 and a[1] == 0


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_twin_matches_autograd(p, dtype):
    t, d, eps, seed = 37, 48, 1e-6, 99
    x, u, w, b, dy = _inputs(t, d, dtype, u_stride_cols=4 * d)
    thr, scale = lnmd.dropout_threshold(p)
    keep = lnmd.keep_mask(seed, 4, t, d, p) if thr else None
    y_ref, (dx_ref, du_ref, dw_ref, db_ref) = _autograd_formula(x, u, w, b, dy, eps, keep, scale)
    y, mean, rstd = lnmd.reference_fwd(x, u, w, b, eps, p, seed, 4)
    dx, du, dw, db, y2 = lnmd.reference_bwd(dy, x, u, w, b, mean, rstd, p, seed, 4, True)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert y.dtype == dx.dtype == du.dtype == dtype and dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref, **tol)
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    torch.testing.assert_close(dx.float(), dx_ref, **tol)
    torch.testing.assert_close(du.float(), du_ref, **tol)
    torch.testing.assert_close(dw, dw_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(db, db_ref, atol=1e-4, rtol=1e-4)
    if keep is not None:
        assert torch.equal(y == 0, ~keep)  # dropped exactly where the mask says
    _, _, _, _, empty = lnmd.reference_bwd(dy, x, u, w, b, mean, rstd, p, seed, 4, False)
    assert empty.numel() == 0


def test_autograd_function_eval_mode_has_no_dropout_cpu():
    x, u, w, b, _ = _inputs(20, 32)
    a = lnmd.layer_norm_mul_dropout(x, u, w, b, 1e-6, p=0.5, training=False)
    ref, _, _ = lnmd.reference_fwd(x, u, w, b, 1e-6, 0.0, 0, 0)
    torch.testing.assert_close(a, ref, atol=0, rtol=0)
    torch.manual_seed(3)
    dropped = lnmd.layer_norm_mul_dropout(x, u, w, b, 1e-6, p=0.5, training=True)
    assert 0.4 < float((dropped == 0).float().mean()) < 0.6


# ---- GPU: the compiled kernel vs the twin ---------------------------------------------------


def _kernel_ready() -> bool:
    return torch.cuda.is_available() and lnmd.load_extension()


needs_kernel = pytest.mark.skipif(
    not _kernel_ready(),
    reason="needs CUDA and hstu._layer_norm_mul_dropout_C (HSTU_KERNELS=layer_norm_mul_dropout)",
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 777, 4099])
def test_fwd_y_out_writes_the_same_y_into_a_strided_view_cuda(dtype, t):
    """fwd(y_out=buf[:, :D]) writes exactly the y the op returns without it (the same kernel,
    another row stride), leaves buf's other columns alone, returns y empty and the same
    mean/rstd; a y_out of the wrong dtype, shape or row stride is refused before launching."""
    d = 1024
    x, u, w, b, _ = _inputs(t, d, dtype, "cuda", seed=t)
    ref = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.1, 11, 4)
    buf = torch.full((t, d + 8), 3.0, device="cuda", dtype=dtype)
    got = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.1, 11, 4, y_out=buf[:, :d])
    assert got[0].numel() == 0
    assert torch.equal(buf[:, :d], ref[0])
    assert bool((buf[:, d:] == 3.0).all())
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    with pytest.raises(TypeError, match="y_out"):
        torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.0, 0, 0, y_out=buf[:, :d].float())
    with pytest.raises(ValueError, match="y_out"):
        torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.0, 0, 0, y_out=buf[:, : d - 8])
    if t > 1:
        odd = torch.empty((t, d + 4), device="cuda", dtype=dtype)[:, :d]
        with pytest.raises(ValueError, match="y_out row stride"):
            torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.0, 0, 0, y_out=odd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,d,u_cols",
    [(1, 8, 8), (37, 24, 96), (1000, 256, 256), (777, 1024, 4096), (129, 1032, 1032),
     (300, 2048, 2048), (65, 4096, 4096), (9, 8192, 8192)],
)  # fmt: skip
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.gpu
@needs_kernel
def test_kernel_matches_twin_cuda(dtype, t, d, u_cols, p):
    """Forward: y within 1 ulp-ish of the twin (atol 1e-2, rtol 1.6e-2 in bf16; 2e-3/2e-3 fp16),
    mean/rstd 1e-5; backward: du and the recomputed y likewise, dx within 1% relative L2,
    dweight, dbias (fp32 sums in another order) within 1e-4 relative L2. Masks equal exactly."""
    x, u, w, b, dy = _inputs(t, d, dtype, "cuda", seed=t + d, u_stride_cols=u_cols)
    seed, off, eps = -(2**62) + 12345, 2**40 + 8, 1e-6  # 64-bit seed and offset, high bits set
    y, mean, rstd = torch.ops.hstu_lnmd.fwd(x, u, w, b, eps, p, seed, off)
    y_r, mean_r, rstd_r = lnmd.reference_fwd(x, u, w, b, eps, p, seed, off)
    tol = (
        {"atol": 1e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}
    )
    torch.testing.assert_close(mean, mean_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, rstd_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.float(), y_r.float(), **tol)
    if p > 0:  # dropped exactly where the twin's mask says (where the undropped y is nonzero)
        keep = lnmd.keep_mask(seed, off, t, d, p, "cuda")
        live = torch.ops.hstu_lnmd.fwd(x, u, w, b, eps, 0.0, seed, off)[0] != 0
        assert torch.equal((y == 0) & live, ~keep & live)
    dx, du, dw, db, y2 = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, p, seed, off, True)
    dx_r, du_r, dw_r, db_r, _ = lnmd.reference_bwd(dy, x, u, w, b, mean, rstd, p, seed, off, True)
    torch.testing.assert_close(y2.float(), y.float(), **tol)  # the recompute is the forward's y
    assert torch.equal(y2 == 0, y == 0)  # with the forward's mask
    torch.testing.assert_close(du.float(), du_r.float(), **tol)
    assert _rel(dx, dx_r) < 1e-2, _rel(dx, dx_r)
    assert _rel(dw, dw_r) < 1e-4 and _rel(db, db_r) < 1e-4, (_rel(dw, dw_r), _rel(db, db_r))
    _, _, _, _, none = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, p, seed, off, False)
    assert none.numel() == 0


@pytest.mark.gpu
@needs_kernel
def test_kernel_dropout_statistics_and_eval_cuda():
    """p = 0.1 over 4M elements: drop rate within 0.002 of p, mean of y / (LN*u) ~ 1 (unbiased
    scale); a fresh seed per call; eval mode (training=False) equals p = 0."""
    x, u, w, b, _ = _inputs(4096, 1024, torch.bfloat16, "cuda")
    y0, _, _ = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.0, 0, 0)
    torch.manual_seed(0)
    y1 = lnmd.layer_norm_mul_dropout(x, u, w, b, 1e-6, p=0.1, training=True)
    y2 = lnmd.layer_norm_mul_dropout(x, u, w, b, 1e-6, p=0.1, training=True)
    drop = float(((y1 == 0) & (y0 != 0)).float().sum() / (y0 != 0).float().sum())
    assert abs(drop - 0.1) < 0.002, drop
    assert not torch.equal(y1 == 0, y2 == 0)
    kept = y1 != 0
    ratio = float((y1[kept].float() / y0[kept].float()).median())
    assert abs(ratio - 1 / 0.9) < 1e-2, ratio
    ev = lnmd.layer_norm_mul_dropout(x, u, w, b, 1e-6, p=0.1, training=False)
    torch.testing.assert_close(ev, y0, atol=0, rtol=0)


@pytest.mark.gpu
@needs_kernel
def test_kernel_autograd_function_gradients_cuda():
    """The autograd wrapper: gradients equal the op's backward with the forward's seed."""
    x, u, w, b, dy = _inputs(200, 512, torch.bfloat16, "cuda")
    leaves = [t.clone().requires_grad_(True) for t in (x, u, w, b)]
    torch.manual_seed(1)
    seed, off = lnmd.draw_seed("cuda")
    torch.manual_seed(1)
    out = lnmd.layer_norm_mul_dropout(*leaves, 1e-6, p=0.2, training=True)
    out.backward(dy)
    _, mean, rstd = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.2, seed, off)
    dx, du, dw, db, _ = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, 0.2, seed, off, False)
    for got, want in zip([t.grad for t in leaves], (dx, du, dw, db)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.gpu
@needs_kernel
def test_kernel_input_errors_cuda():
    x, u, w, b, _ = _inputs(4, 64, torch.bfloat16, "cuda")
    fwd = torch.ops.hstu_lnmd.fwd
    with pytest.raises(ValueError, match="multiple of 8"):
        fwd(x[:, :60].contiguous(), u[:, :60].contiguous(), w[:60], b[:60], 1e-6, 0.0, 0, 0)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        fwd(x.float(), u.float(), w, b, 1e-6, 0.0, 0, 0)
    with pytest.raises(TypeError, match="float32"):
        fwd(x, u, w.bfloat16(), b, 1e-6, 0.0, 0, 0)
    with pytest.raises(TypeError, match="has dtype"):
        fwd(x, u.half(), w, b, 1e-6, 0.0, 0, 0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fwd(x, u.t().contiguous().t(), w, b, 1e-6, 0.0, 0, 0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        fwd(x, u, w, b, 1e-6, 1.0, 0, 0)
    with pytest.raises(ValueError, match="shape"):
        fwd(x, u[:3], w, b, 1e-6, 0.0, 0, 0)
    wide = torch.zeros(2, 8200, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="8192"):
        fwd(wide, wide, w.new_zeros(8200), b.new_zeros(8200), 1e-6, 0.0, 0, 0)
    # T = 0: empty outputs, zero parameter gradients
    e = x[:0]
    y, mean, rstd = fwd(e, e, w, b, 1e-6, 0.1, 3, 0)
    assert y.shape == (0, 64) and mean.shape == (0,)
    dx, du, dw, db, _ = torch.ops.hstu_lnmd.bwd(e, e, e, w, b, mean, rstd, 0.1, 3, 0, False)
    assert dx.shape == (0, 64) and float(dw.abs().sum()) == 0.0 and float(db.abs().sum()) == 0.0


# ---- chunk-major SiLU of the uvqk projection: twins (CPU), kernels vs twins (GPU) ------------


def _silu_inputs(t, hd, dtype=torch.float32, device="cpu", seed=0, z_cols=None, strided=False):
    """z [T, 4*hd] (a column block of a wider [T, z_cols] tensor when z_cols is given) with
    values over SiLU's whole range, and du, dv, dq, dk as the fused layer has them: separate
    buffers, du a column block of a wider tensor, dq/dk/dv [T, H, d]-shaped rows when strided."""
    gen = torch.Generator().manual_seed(seed)
    wide = z_cols or 4 * hd
    z = (torch.randn(t, wide, generator=gen) * 4).to(device, dtype)[:, : 4 * hd]
    if strided:
        du = torch.randn(t, 2 * hd, generator=gen).to(device, dtype)[:, hd:]
    else:
        du = torch.randn(t, hd, generator=gen).to(device, dtype)
    dv, dq, dk = (torch.randn(t, hd, generator=gen).to(device, dtype) for _ in range(3))
    return z, (du, dv, dq, dk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_twins_match_autograd_and_the_aten_path(dtype):
    """Forward: the twin equals SiLU(z) per column block, laid out [4, T, hd], and the fused
    layer's aten fallback bit for bit; backward: dz equals autograd's SiLU gradient (fp32) and
    the aten fallback (rounded alike), dbias the column sums of dz."""
    import hstu.modules.fused_hstu_layer as fused_mod

    t, hd = 37, 24
    z, grads = _silu_inputs(t, hd, dtype, strided=True)
    act = lnmd.reference_silu_chunk_major(z)
    assert act.shape == (4, t, hd) and act.dtype == dtype and act.is_contiguous()
    # fp32: CPU aten's vectorised and strided SiLU loops may differ in the last bit
    exact = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    for b in range(4):
        want = torch.nn.functional.silu(z[:, b * hd : (b + 1) * hd].float()).to(dtype)
        torch.testing.assert_close(act[b], want, **exact)
    torch.testing.assert_close(act, fused_mod._silu_chunk_major(z, hd), **exact)

    dz, dbias = lnmd.reference_silu_chunk_major_backward(*grads, z, True)
    assert dz.shape == (t, 4 * hd) and dz.dtype == dtype and dbias.dtype == torch.float32
    zl = z.detach().float().requires_grad_(True)
    torch.nn.functional.silu(zl).backward(torch.cat([g.float() for g in grads], 1))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(dz.float(), zl.grad, **tol)
    aten_dz = torch.empty_like(z)
    fused_mod._silu_backward_into(aten_dz, grads, z, hd)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    if dtype == torch.float16:  # aten's CPU half opmath may differ by one rounding step
        tol = {"atol": 1e-3, "rtol": 1e-3}
    torch.testing.assert_close(dz, aten_dz, **tol)
    torch.testing.assert_close(dbias, dz.float().sum(0), atol=0, rtol=0)
    _, none = lnmd.reference_silu_chunk_major_backward(*grads, z, False)
    assert none.numel() == 0


def test_silu_twins_empty_and_shape_errors():
    z, grads = _silu_inputs(0, 16)
    assert lnmd.reference_silu_chunk_major(z).shape == (4, 0, 16)
    dz, dbias = lnmd.reference_silu_chunk_major_backward(*grads, z, True)
    assert dz.shape == (0, 64) and torch.equal(dbias, torch.zeros(64))
    with pytest.raises(ValueError, match=r"\[T, 4 \* hd\]"):
        lnmd.reference_silu_chunk_major(torch.zeros(3, 10))
    z, (du, dv, dq, dk) = _silu_inputs(5, 8)
    with pytest.raises(ValueError, match=r"dq must be \[T, hd\] = \[5, 8\]"):
        lnmd.reference_silu_chunk_major_backward(du, dv, dq[:4], dk, z, True)


_SILU_SHAPES = [
    # (T, hd, z_cols, strided grads)
    (1, 8, None, False),
    (37, 24, 128, True),
    (1000, 64, None, True),
    (777, 256, 1032, False),
    (129, 1024, None, True),
    (65, 1032, None, False),
    (4099, 128, None, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,hd,z_cols,strided", _SILU_SHAPES)
@pytest.mark.gpu
@needs_kernel
def test_silu_kernels_match_twins_cuda(dtype, t, hd, z_cols, strided):
    """act and dz within one rounding step of the twins (fp32 math on both sides, the kernel's
    exp is the fast one), dbias within 1e-3 relative L2 of the twin's and within 1e-5 of the
    kernel's own dz summed by torch (same values, another order); odd T, strided z and grads."""
    z, grads = _silu_inputs(t, hd, dtype, "cuda", seed=t + hd, z_cols=z_cols, strided=strided)
    tol = (
        {"atol": 1e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}
    )
    act = torch.ops.hstu_lnmd.silu_chunk_major(z)
    act_r = lnmd.reference_silu_chunk_major(z)
    assert act.shape == (4, t, hd) and act.dtype == dtype and act.is_contiguous()
    torch.testing.assert_close(act.float(), act_r.float(), **tol)
    dz, dbias = torch.ops.hstu_lnmd.silu_chunk_major_backward(*grads, z, True)
    dz_r, dbias_r = lnmd.reference_silu_chunk_major_backward(*grads, z, True)
    assert dz.shape == (t, 4 * hd) and dz.dtype == dtype and dbias.dtype == torch.float32
    torch.testing.assert_close(dz.float(), dz_r.float(), **tol)
    assert _rel(dbias, dbias_r) < 1e-3, _rel(dbias, dbias_r)
    assert _rel(dbias, dz.float().sum(0)) < 1e-5, _rel(dbias, dz.float().sum(0))
    dz2, none = torch.ops.hstu_lnmd.silu_chunk_major_backward(*grads, z, False)
    assert none.numel() == 0 and torch.equal(dz2, dz)


def test_silu_twin_takes_the_attention_fp32_dq_accumulator():
    """The twin with dq as the attention's fp32 head-major [H, T, D] accumulator equals the twin
    given the same values as [T, hd] fp32 rows (so no rounding of dq before SiLU'), and names a
    malformed accumulator."""
    t, heads, d = 29, 3, 8
    z, (du, dv, _, dk) = _silu_inputs(t, heads * d, torch.bfloat16, seed=3)
    acc = torch.randn(heads, t, d)
    dz, dbias = lnmd.reference_silu_chunk_major_backward(du, dv, acc, dk, z, True)
    rows = acc.transpose(0, 1).reshape(t, heads * d)
    dz_r, dbias_r = lnmd.reference_silu_chunk_major_backward(du, dv, rows, dk, z, True)
    assert torch.equal(dz, dz_r) and torch.equal(dbias, dbias_r)
    with pytest.raises(ValueError, match="head-major"):
        lnmd.reference_silu_chunk_major_backward(du, dv, acc[:, :5], dk, z, True)


@pytest.mark.parametrize("t,heads,d", [(1, 1, 8), (1000, 4, 256), (4099, 2, 64), (777, 3, 32)])
@pytest.mark.gpu
@needs_kernel
def test_silu_backward_with_fp32_dq_accumulator_cuda(t, heads, d):
    """The kernel reading dq from the attention's fp32 head-major accumulator: dz within one
    rounding step of the twin (which uses the same unrounded dq), dbias within 1e-3 relative L2;
    u, v, k blocks bit-equal to the call with a 16-bit dq; a malformed accumulator is refused."""
    hd = heads * d
    z, (du, dv, dq16, dk) = _silu_inputs(t, hd, torch.bfloat16, "cuda", seed=t + d, strided=True)
    acc = torch.randn(heads, t, d, device="cuda")
    dz, dbias = torch.ops.hstu_lnmd.silu_chunk_major_backward(du, dv, acc, dk, z, True)
    dz_r, dbias_r = lnmd.reference_silu_chunk_major_backward(du, dv, acc, dk, z, True)
    torch.testing.assert_close(dz.float(), dz_r.float(), atol=1e-2, rtol=1.6e-2)
    assert _rel(dbias, dbias_r) < 1e-3, _rel(dbias, dbias_r)
    dz16, _ = torch.ops.hstu_lnmd.silu_chunk_major_backward(du, dv, dq16, dk, z, True)
    for blk in (0, 1, 3):
        cols = slice(blk * hd, (blk + 1) * hd)
        assert torch.equal(dz[:, cols], dz16[:, cols]), blk
    with pytest.raises(ValueError, match="head-major"):
        torch.ops.hstu_lnmd.silu_chunk_major_backward(du, dv, acc[:, :, : d // 2], dk, z, True)
    if t * heads > 1:  # [H, T, D] rows 2D apart
        strided = torch.randn(heads, t, 2 * d, device="cuda")[:, :, :d]
        with pytest.raises(ValueError, match="contiguous"):
            torch.ops.hstu_lnmd.silu_chunk_major_backward(du, dv, strided, dk, z, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,heads,d,p", [(1, 1, 8, 0.0), (777, 4, 256, 0.1), (4099, 2, 64, 0.0)])
@pytest.mark.gpu
@needs_kernel
def test_u_silu_in_the_gate_kernels_equals_the_unfused_kernels_cuda(dtype, t, heads, d, p):
    """The fused layer's path with u's SiLU inside the gating kernels against the kernels
    without it (same math and roundings, so equal up to the compiler's instruction choices:
    checked within one rounding step, fp32 sums within 1e-5): silu_chunk_major(z, 1) = the v,
    q, k blocks of silu_chunk_major(z) (bit for bit: the same kernel); fwd(u_silu) on z's u
    block = fwd on SiLU(z)'s u block; bwd(u_silu, du_out=dz[:, :hd]) gives the same dx,
    dweight, dbias, y and writes the u block silu_chunk_major_backward writes;
    silu_chunk_major_backward_into then writes the other blocks and the same bias sums (dq as a
    16-bit tensor and as the attention's fp32 accumulator)."""
    hd = heads * d
    z, (_, dv, dq, dk) = _silu_inputs(t, hd, dtype, "cuda", seed=t + d, z_cols=4 * hd + 8)
    x, _, w, b, dy = _inputs(t, hd, dtype, "cuda", seed=t)
    seed, off, eps = 77, 4, 1e-6
    step = 8e-3 if dtype == torch.bfloat16 else 1e-3

    def same(a, b):
        if a.dtype == torch.float32:
            assert _rel(a, b) < 1e-5, _rel(a, b)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=step, atol=1e-4)

    act = torch.ops.hstu_lnmd.silu_chunk_major(z)
    act3 = torch.ops.hstu_lnmd.silu_chunk_major(z, 1)
    assert act3.shape == (3, t, hd) and torch.equal(act3, act[1:])
    zu = z[:, :hd]
    ref_f = torch.ops.hstu_lnmd.fwd(x, act[0], w, b, eps, p, seed, off)
    got_f = torch.ops.hstu_lnmd.fwd(x, zu, w, b, eps, p, seed, off, u_silu=True)
    for a, g in zip(ref_f, got_f):
        same(g, a)
    mean, rstd = ref_f[1], ref_f[2]
    ref_b = torch.ops.hstu_lnmd.bwd(dy, x, act[0], w, b, mean, rstd, p, seed, off, True)
    for dq_in in (dq, torch.randn(heads, t, d, device="cuda")):
        dz = torch.full((t, 4 * hd), float("nan"), device="cuda", dtype=dtype)
        got_b = torch.ops.hstu_lnmd.bwd(
            dy, x, zu, w, b, mean, rstd, p, seed, off, True, u_silu=True, du_out=dz[:, :hd]
        )
        assert got_b[1].numel() == 0
        for i in (0, 2, 3, 4):
            same(got_b[i], ref_b[i])
        dz_r, dbias_r = torch.ops.hstu_lnmd.silu_chunk_major_backward(
            ref_b[1], dv, dq_in, dk, z, True
        )
        dbias = torch.ops.hstu_lnmd.silu_chunk_major_backward_into(dv, dq_in, dk, z, dz, True)
        assert not dz.isnan().any()
        same(dz, dz_r)
        same(dbias, dbias_r)
        # the v, q, k blocks come from the same kernel code: bit for bit
        assert torch.equal(dz[:, hd:], dz_r[:, hd:])
        none = torch.ops.hstu_lnmd.silu_chunk_major_backward_into(dv, dq_in, dk, z, dz, False)
        assert none.numel() == 0
    with pytest.raises(ValueError, match="first_block"):
        torch.ops.hstu_lnmd.silu_chunk_major(z, 2)
    with pytest.raises(ValueError, match="dz"):
        torch.ops.hstu_lnmd.silu_chunk_major_backward_into(dv, dq, dk, z, dz[:, :-8], True)


@pytest.mark.gpu
@needs_kernel
def test_silu_kernels_extreme_values_and_aten_agreement_cuda():
    """Large |z| (exp overflow/underflow) gives SiLU's limits, no NaN; on ordinary values the
    kernels agree with the fused layer's aten fallback within one rounding step."""
    import hstu.modules.fused_hstu_layer as fused_mod

    vals = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 5.0, -5.0, 30.0, -30.0, 88.0, -88.0, 100.0,
                         -100.0, 1e4, -1e4, 3.0, -3.0], device="cuda")  # fmt: skip
    z = vals.repeat(3, 4).to(torch.bfloat16)  # [3, 64]: hd = 16
    act = torch.ops.hstu_lnmd.silu_chunk_major(z)
    assert torch.isfinite(act.float()).all()
    torch.testing.assert_close(act, lnmd.reference_silu_chunk_major(z), atol=1e-2, rtol=1.6e-2)
    ones = torch.ones(3, 16, device="cuda", dtype=torch.bfloat16)
    dz, _ = torch.ops.hstu_lnmd.silu_chunk_major_backward(ones, ones, ones, ones, z, True)
    assert torch.isfinite(dz.float()).all()
    dz_r, _ = lnmd.reference_silu_chunk_major_backward(ones, ones, ones, ones, z, True)
    torch.testing.assert_close(dz, dz_r, atol=1e-2, rtol=1.6e-2)

    z, grads = _silu_inputs(513, 256, torch.bfloat16, "cuda", seed=5)
    tol = {"atol": 1e-2, "rtol": 1.6e-2}
    act = torch.ops.hstu_lnmd.silu_chunk_major(z)
    torch.testing.assert_close(act, fused_mod._silu_chunk_major(z, 256), **tol)
    dz, _ = torch.ops.hstu_lnmd.silu_chunk_major_backward(*grads, z, True)
    dz_a = torch.empty_like(z)
    fused_mod._silu_backward_into(dz_a, grads, z, 256)
    torch.testing.assert_close(dz, dz_a, **tol)
    # one-ulp differences at most, and rare
    assert float((act != fused_mod._silu_chunk_major(z, 256)).float().mean()) < 0.05


@pytest.mark.gpu
@needs_kernel
def test_silu_kernels_empty_meta_and_input_errors_cuda():
    ops = torch.ops.hstu_lnmd
    z, grads = _silu_inputs(0, 16, torch.bfloat16, "cuda")
    assert ops.silu_chunk_major(z).shape == (4, 0, 16)
    dz, dbias = ops.silu_chunk_major_backward(*grads, z, True)
    assert dz.shape == (0, 64) and dbias.shape == (64,) and float(dbias.abs().sum()) == 0.0
    mz = torch.empty(10, 64, dtype=torch.bfloat16, device="meta")
    mg = torch.empty(10, 16, dtype=torch.bfloat16, device="meta")
    assert ops.silu_chunk_major(mz).shape == (4, 10, 16)
    mdz, mdb = ops.silu_chunk_major_backward(mg, mg, mg, mg, mz, True)
    assert mdz.shape == (10, 64) and mdb.shape == (64,) and mdb.dtype == torch.float32

    z, (du, dv, dq, dk) = _silu_inputs(6, 16, torch.bfloat16, "cuda")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ops.silu_chunk_major(z.float())
    with pytest.raises(ValueError, match="hd a multiple of 8"):
        ops.silu_chunk_major(z[:, :48].contiguous())
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.silu_chunk_major(z.t().contiguous().t())
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.silu_chunk_major(torch.zeros(6, 68, dtype=torch.bfloat16, device="cuda")[:, :64])
    with pytest.raises(ValueError, match=r"dv must be \[T, hd\] = \[6, 16\]"):
        ops.silu_chunk_major_backward(du, dv[:5], dq, dk, z, True)
    with pytest.raises(TypeError, match="dk has dtype"):
        ops.silu_chunk_major_backward(du, dv, dq, dk.half(), z, True)
    with pytest.raises(ValueError, match="16-byte aligned"):
        wide = torch.zeros(6 * 16 + 1, dtype=torch.bfloat16, device="cuda")
        ops.silu_chunk_major_backward(wide[1:].view(6, 16), dv, dq, dk, z, True)


# ---- cast + column sum of the incoming fp32 gradient ----------------------------------------


def test_cast_colsum_twin_cpu():
    x = torch.randn(33, 40, generator=torch.Generator().manual_seed(0))
    y, colsum = lnmd.reference_cast_colsum(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.to(torch.bfloat16))
    assert colsum.dtype == torch.float32
    torch.testing.assert_close(colsum, x.sum(0), atol=0, rtol=0)  # the fp32 values, not y's
    with pytest.raises(ValueError, match=r"2-D \[T, D\]"):
        lnmd.reference_cast_colsum(x[0], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,d,stride", [(1, 8, 8), (37, 24, 32), (1000, 1024, 1024),
                                        (4099, 1032, 1040), (0, 64, 64)])  # fmt: skip
@pytest.mark.gpu
@needs_kernel
def test_cast_colsum_matches_twin_cuda(dtype, t, d, stride):
    """y bit-equal to x.to(dtype) (both round to nearest even); column sums within 1e-5 of the
    fp64 sums relative to sum |x| (fp32 additions in another order); strided x; T = 0."""
    x = (torch.randn(t, stride, generator=torch.Generator().manual_seed(t + d)) * 3).cuda()[:, :d]
    assert t < 2 or x.stride(0) == stride
    y, colsum = torch.ops.hstu_lnmd.cast_colsum(x, dtype)
    y_r, _ = lnmd.reference_cast_colsum(x, dtype)
    assert y.shape == (t, d) and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, y_r)
    assert colsum.shape == (d,) and colsum.dtype == torch.float32
    exact = x.double().sum(0)
    bound = 1e-5 * x.double().abs().sum(0) + 1e-6
    assert bool(((colsum.double() - exact).abs() <= bound).all())


@pytest.mark.gpu
@needs_kernel
def test_cast_colsum_meta_and_input_errors_cuda():
    op = torch.ops.hstu_lnmd.cast_colsum
    m, ms = op(torch.empty(7, 64, device="meta"), torch.bfloat16)
    assert m.shape == (7, 64) and m.dtype == torch.bfloat16 and ms.shape == (64,)
    x = torch.randn(6, 64, device="cuda")
    with pytest.raises(TypeError, match="must be float32"):
        op(x.half(), torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        op(x, torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        op(x[:, :60].contiguous(), torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        op(torch.randn(64, 6, device="cuda").t(), torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        op(torch.randn(6 * 64 + 1, device="cuda")[1:].view(6, 64), torch.bfloat16)


# ---- output projection + residual as one GEMM ------------------------------------------------


def test_residual_gemm_twin_is_the_formula_cpu():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 24, generator=gen)
    y = torch.randn(9, 16, generator=gen).bfloat16()
    w = torch.randn(24, 16, generator=gen).bfloat16()
    out = lnmd.reference_residual_gemm(x, y, w)
    exact = x.double() + y.double() @ w.double().t()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must be 2-D"):
        lnmd.reference_residual_gemm(x, y[0], w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,n,k,x_stride,y_stride",
    [
        (1, 8, 8, 8, 8),
        (777, 256, 264, 256, 264),
        (4099, 1024, 1032, 1032, 1040),
        (0, 64, 72, 64, 72),
    ],
)
@pytest.mark.gpu
@needs_kernel
def test_residual_gemm_matches_twin_cuda(dtype, t, n, k, x_stride, y_stride):
    """x + y w^T against the twin (fp64 of the same products) within fp32 accumulation error,
    and against torch.addmm with an fp32 output; strided x and y (column blocks of wider
    tensors, as the fused layer's [y | 1 | 0] buffer is); x untouched; T = 0."""
    gen = torch.Generator().manual_seed(t + n + k)
    x_full = torch.randn(t, x_stride, generator=gen).cuda()
    x = x_full[:, :n]
    y = (torch.randn(t, y_stride, generator=gen) * 0.5).to("cuda", dtype)[:, :k]
    w = (torch.randn(n, k, generator=gen) * 0.05).to("cuda", dtype)
    x_before = x_full.clone()
    out = torch.ops.hstu_lnmd.residual_gemm(x, y, w)
    assert out.shape == (t, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(x_full, x_before)
    if t == 0:
        return
    exact = x.double() + y.double() @ w.double().t()
    bound = 3e-5 * (x.double().abs() + y.double().abs() @ w.double().abs().t()) + 1e-6
    assert bool(((out.double() - exact).abs() <= bound).all())
    ref = lnmd.reference_residual_gemm(x, y, w)
    assert float((out - ref).abs().max()) <= float(bound.max())
    addmm = torch.addmm(x, y, w.t(), out_dtype=torch.float32)
    assert float((out - addmm).abs().max()) <= float(bound.max())


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("deterministic", [False, True])
def test_residual_gemm_algorithm_choice_keeps_the_result_cuda(deterministic):
    """The algorithm is timed on a shape's first eager call (or kept as the heuristic's first
    choice under deterministic algorithms): that call, the cached plan's next call, a call
    captured in a CUDA graph before any eager call of its shape (its replay) and the eager call
    after the capture all give x + y w^T within fp32 accumulation error."""
    op = torch.ops.hstu_lnmd.residual_gemm
    gen = torch.Generator().manual_seed(11)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        for t in (3000 + 128 * deterministic, 5000 + 128 * deterministic):
            x = torch.randn(t, 512, generator=gen).cuda()
            y = (torch.randn(t, 520, generator=gen) * 0.5).to("cuda", torch.bfloat16)
            w = (torch.randn(512, 520, generator=gen) * 0.05).to("cuda", torch.bfloat16)
            exact = x.double() + y.double() @ w.double().t()
            bound = 3e-5 * (x.double().abs() + y.double().abs() @ w.double().abs().t()) + 1e-6
            outs = []
            if t >= 5000:  # the shape's first call inside a capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = op(x, y, w)
                graph.replay()
                outs.append(captured.clone())
            outs += [op(x, y, w), op(x, y, w)]
            for out in outs:
                assert bool(((out.double() - exact).abs() <= bound).all()), t
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
@needs_kernel
def test_residual_gemm_meta_and_input_errors_cuda():
    op = torch.ops.hstu_lnmd.residual_gemm
    m = op(torch.empty(7, 64, device="meta"), torch.empty(7, 72, device="meta", dtype=torch.bfloat16),
           torch.empty(64, 72, device="meta", dtype=torch.bfloat16))  # fmt: skip
    assert m.shape == (7, 64) and m.dtype == torch.float32
    x = torch.randn(6, 64, device="cuda")
    y = torch.randn(6, 72, device="cuda").bfloat16()
    w = torch.randn(64, 72, device="cuda").bfloat16()
    with pytest.raises(TypeError, match="must be float32"):
        op(x.bfloat16(), y, w)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        op(x, y.float(), w.float())
    with pytest.raises(TypeError, match="cast w to y's dtype"):
        op(x, y, w.half())
    with pytest.raises(ValueError, match="rows but x has"):
        op(x, y[:5], w)
    with pytest.raises(ValueError, match=r"w must be \[N, K\]"):
        op(x, y, w[:, :64])
    with pytest.raises(ValueError, match="contiguous last dim"):
        op(x, y, torch.randn(72, 64, device="cuda").bfloat16().t())
    with pytest.raises(ValueError, match="CUDA tensor"):
        op(x, y.cpu(), w)


# ---- input LayerNorm of the fp32 residual stream ---------------------------------------------


def test_ln_twins_match_autograd_cpu():
    """reference_ln_bwd (with the residual gradient added) equals autograd through LayerNorm; the
    forward twin's statistics are LayerNorm's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(29, 48, generator=gen, dtype=torch.float64).float().requires_grad_(True)
    w, b = torch.randn(48, generator=gen), torch.randn(48, generator=gen)
    dn, dres = torch.randn(29, 48, generator=gen), torch.randn(29, 48, generator=gen)
    n, mean, rstd = lnmd.reference_ln_fwd(x, w, b, 1e-6, torch.float32)
    assert mean.shape == (29,) and rstd.shape == (29,)
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    n_auto = torch.nn.functional.layer_norm(x, (48,), wr, br, 1e-6)
    torch.testing.assert_close(n, n_auto.detach(), atol=1e-5, rtol=1e-5)
    ((n_auto * dn).sum() + (x * dres).sum()).backward()
    dx, dw, db = lnmd.reference_ln_bwd(dn, x.detach(), mean, rstd, w, dres)
    torch.testing.assert_close(dx, x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw, wr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(db, br.grad, atol=1e-4, rtol=1e-4)
    n16, _, _ = lnmd.reference_ln_fwd(x, w, b, 1e-6, torch.bfloat16)
    assert n16.dtype == torch.bfloat16 and torch.equal(n16, n.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"2-D \[T, D\]"):
        lnmd.reference_ln_fwd(x[0], w, b, 1e-6, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,d,stride", [(1, 8, 8), (37, 24, 32), (1000, 1024, 1024),
                                        (4099, 1032, 1040), (3, 8192, 8192), (0, 64, 64)])  # fmt: skip
@pytest.mark.gpu
@needs_kernel
def test_ln_kernels_match_twins_cuda(dtype, t, d, stride):
    """Forward: n within one rounding step of the twin's (fp32 statistics summed in another
    order), mean/rstd within 1e-5; backward (strided x, dn and dres; T = 0; the widest row):
    dx within 1e-4 of the twin relative to its scale, d weight / d bias within 1e-4 relative
    to sum |terms| (fp32 additions in another order)."""
    gen = torch.Generator().manual_seed(t + d)
    x = (torch.randn(t, stride, generator=gen) * 2 + 0.5).cuda()[:, :d]
    w = (torch.randn(d, generator=gen) * 0.5 + 1).cuda()
    b = (torch.randn(d, generator=gen) * 0.1).cuda()
    dn = torch.randn(t, stride, generator=gen).to(dtype).cuda()[:, :d]
    dres = torch.randn(t, stride, generator=gen).cuda()[:, :d]
    n, mean, rstd = torch.ops.hstu_lnmd.ln_fwd(x, w, b, 1e-6, dtype)
    n_r, mean_r, rstd_r = lnmd.reference_ln_fwd(x, w, b, 1e-6, dtype)
    assert n.shape == (t, d) and n.dtype == dtype and n.is_contiguous()
    assert mean.shape == (t,) and rstd.dtype == torch.float32
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10  # one rounding step, relative
    torch.testing.assert_close(n.float(), n_r.float(), atol=step, rtol=step)
    torch.testing.assert_close(mean, mean_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, rstd_r, atol=1e-5, rtol=1e-5)
    dx, dw, db = torch.ops.hstu_lnmd.ln_bwd(dn, x, mean_r, rstd_r, w, dres)
    dx_r, dw_r, db_r = lnmd.reference_ln_bwd(dn, x, mean_r, rstd_r, w, dres)
    assert dx.shape == (t, d) and dx.dtype == torch.float32 and dx.is_contiguous()
    scale = float(dx_r.abs().max()) if t else 1.0
    torch.testing.assert_close(dx, dx_r, atol=1e-4 * scale, rtol=1e-4)
    xhat = ((x.double() - mean_r.double()[:, None]) * rstd_r.double()[:, None]).abs()
    g = dn.double().abs()
    assert bool(((dw.double() - dw_r.double()).abs() <= 1e-4 * (g * xhat).sum(0) + 1e-5).all())
    assert bool(((db.double() - db_r.double()).abs() <= 1e-4 * g.sum(0) + 1e-5).all())


@pytest.mark.gpu
@needs_kernel
def test_ln_kernels_meta_and_input_errors_cuda():
    ops = torch.ops.hstu_lnmd
    n, m, r = ops.ln_fwd(
        torch.empty(7, 64, device="meta"), torch.empty(64, device="meta"),
        torch.empty(64, device="meta"), 1e-6, torch.bfloat16,
    )  # fmt: skip
    assert n.shape == (7, 64) and n.dtype == torch.bfloat16 and m.shape == (7,) == r.shape
    dx, dw, db = ops.ln_bwd(
        torch.empty(7, 64, device="meta", dtype=torch.bfloat16), torch.empty(7, 64, device="meta"),
        torch.empty(7, device="meta"), torch.empty(7, device="meta"),
        torch.empty(64, device="meta"), torch.empty(7, 64, device="meta"),
    )  # fmt: skip
    assert dx.shape == (7, 64) and dx.dtype == torch.float32 and dw.shape == (64,) == db.shape
    x = torch.randn(6, 64, device="cuda")
    w, b = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")
    with pytest.raises(TypeError, match="must be float32"):
        ops.ln_fwd(x.half(), w, b, 1e-6, torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ops.ln_fwd(x, w, b, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.ln_fwd(x[:, :60].contiguous(), w[:60], b[:60], 1e-6, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops.ln_fwd(torch.randn(64, 6, device="cuda").t(), w, b, 1e-6, torch.bfloat16)
    with pytest.raises(ValueError, match="eps"):
        ops.ln_fwd(x, w, b, 0.0, torch.bfloat16)
    _, mean, rstd = ops.ln_fwd(x, w, b, 1e-6, torch.bfloat16)
    dn = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dres has shape"):
        ops.ln_bwd(dn, x, mean, rstd, w, x[:5])
    with pytest.raises(TypeError, match="dn must be bfloat16 or float16"):
        ops.ln_bwd(dn.float(), x, mean, rstd, w, x)
    with pytest.raises(TypeError, match="dres must be float32"):
        ops.ln_bwd(dn, x, mean, rstd, w, x.half())
    with pytest.raises(ValueError, match="mean must be a contiguous 1-D"):
        ops.ln_bwd(dn, x, mean[:5], rstd, w, x)


# ---- the partial-row sums behind every weight / bias gradient -------------------------------


@pytest.mark.parametrize("d", [24, 1032])  # 24, 1032: the sum kernel's last block part-filled
@pytest.mark.gpu
@needs_kernel
def test_gradient_sums_reproducible_separate_and_exact_cuda(d):
    """Every op that sums fp32 partial rows (gating bwd: d weight, d bias; ln_bwd: the same;
    silu_chunk_major_backward: d bias; cast_colsum: the column sums) returns the same bits on a
    second call (a fixed order of additions), each sum in its own storage (op outputs must not
    alias), and within fp32 rounding (3e-5 of the sum of magnitudes) of a float64 sum of the same
    values."""
    t, dtype, gen = 4099, torch.bfloat16, torch.Generator().manual_seed(d)
    x, u, w, b, dy = _inputs(t, d, dtype, "cuda", seed=d)
    _, mean, rstd = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.0, 1, 2)
    xf = (torch.randn(t, d, generator=gen) * 2).cuda()
    dn = torch.randn(t, d, generator=gen).to(dtype).cuda()
    dres = torch.randn(t, d, generator=gen).cuda()
    _, lmean, lrstd = torch.ops.hstu_lnmd.ln_fwd(xf, w, b, 1e-6, dtype)
    z, grads = _silu_inputs(t, d, dtype, "cuda", seed=d)

    def sums():
        _, _, dw, db, _ = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, 0.0, 1, 2, False)
        _, ldw, ldb = torch.ops.hstu_lnmd.ln_bwd(dn, xf, lmean, lrstd, w, dres)
        dz, dbias = torch.ops.hstu_lnmd.silu_chunk_major_backward(*grads, z, True)
        _, colsum = torch.ops.hstu_lnmd.cast_colsum(dres, dtype)
        return [dw, db, ldw, ldb, dbias, colsum], dz

    first, dz = sums()
    second, _ = sums()
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)
    ptrs = [s.untyped_storage().data_ptr() for s in first]
    assert len(set(ptrs)) == len(ptrs)
    # bias-type sums are plain column sums of known tensors: compare with float64
    for got, rows in ((first[4], dz), (first[5], dres)):
        want = rows.double().sum(0)
        scale = rows.double().abs().sum(0)
        assert bool(((got.double() - want).abs() <= 3e-5 * scale + 1e-6).all())
