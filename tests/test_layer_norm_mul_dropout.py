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
