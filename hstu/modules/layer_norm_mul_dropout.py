"""y = dropout(LayerNorm(x) * u): the HSTU gating step, compiled CUDA kernel + PyTorch twin.

The compiled ops live in `hstu._layer_norm_mul_dropout_C` (kernels/layer_norm_mul_dropout/):

    torch.ops.hstu_lnmd.fwd(x, u, weight, bias, eps, p, seed, offset, seed_offset=None,
                            u_silu=False, y_out=None) -> (y, mean, rstd)
    torch.ops.hstu_lnmd.bwd(dy, x, u, weight, bias, mean, rstd, p, seed, offset, recompute_y,
                            seed_offset=None, u_silu=False, du_out=None)
        -> (dx, du, dweight, dbias, y or empty)

``u_silu``: u is the pre-activation z_u and the kernels use SiLU(z_u) rounded to u's dtype; the
backward then returns du * SiLU'(z_u) (du rounded first), i.e. the u block of the SiLU
backward's dz. ``du_out``: du is written into that tensor (e.g. a column block of dz) and comes
back empty; likewise the forward's ``y_out`` for y (e.g. the first D columns of the output
projection's input with its bias column, docs/kernels.md "Fused HSTU layer").

x, u, dy: [T, D] bf16/fp16 on CUDA (last dim contiguous, row stride a multiple of 8: u may be a
column slice of a wider tensor); weight, bias: fp32 [D]; D a multiple of 8 up to 8192. Math in
fp32; outputs in x's dtype, mean/rstd/dweight/dbias fp32.

Dropout: the keep mask is not stored. It is a pure function of (seed, offset, row, col)
(Philox4x32-10, one call per 8-element chunk, 16 bits per element;
kernels/layer_norm_mul_dropout/philox.h) and the backward regenerates it from the forward's seed
and offset. p is quantised to t / 65536 with t = round(65536 p); kept elements are scaled by
65536 / (65536 - t) (unbiased). `draw_seed` takes the seed of the device's default CUDA generator
and its Philox offset, then advances that offset (no device sync), the way torch's own dropout
consumes the generator: `torch.manual_seed` fixes the masks and every call gets fresh ones.
``seed_offset`` (int64 [2] on the device, `draw_seed_tensor`) replaces seed and offset with values
the kernels read from device memory: inside a captured CUDA graph the pair is drawn by a kernel
of the graph, so each replay gets a fresh mask.

`reference_fwd` / `reference_bwd` are the PyTorch twins with the same signatures and the same
mask (`keep_mask` computes it with NumPy): the test oracle.

The same extension holds the fused layer's uvqk SiLU, written chunk-major (vectorised, fp32
math; aten's SiLU runs its slow strided path on the transposed write):

    torch.ops.hstu_lnmd.silu_chunk_major(z, first_block=0) -> act
    torch.ops.hstu_lnmd.silu_chunk_major_backward(du, dv, dq, dk, z, bias_grad) -> (dz, dbias)
    torch.ops.hstu_lnmd.silu_chunk_major_backward_into(dv, dq, dk, z, dz, bias_grad) -> dbias

z: [T, 4*hd] bf16/fp16 on CUDA, hd a multiple of 8; act: [4, T, hd] (u, v, q, k blocks), or
[3, T, hd] (v, q, k) with first_block=1. `_into` takes dz with its u block already written (the
gating backward with u_silu and du_out), writes the other three and sums all four. The
backward takes the four [T, hd] gradients as separate tensors (any row stride that is a multiple
of 8) and returns dz [T, 4*hd] plus, when bias_grad, the fp32 column sums of dz (the uvqk bias
gradient, from the same pass); dq may also be the attention backward's fp32 accumulator
[H, T, D]. Twins: `reference_silu_chunk_major`, `reference_silu_chunk_major_backward`,
`reference_silu_chunk_major_backward_into`.

    torch.ops.hstu_lnmd.cast_colsum(x, dtype) -> (y, colsum)

x: fp32 [T, D] on CUDA, D a multiple of 8; y = x.to(dtype) (bf16/fp16), colsum = x.sum(0) in
fp32, one pass (the fused layer's incoming gradient and its output bias gradient). Twin:
`reference_cast_colsum`.

The extension also holds the sequence preprocessor's token assembly (`tokens_fwd`,
`tokens_bwd`; kernels/layer_norm_mul_dropout/tokens_api.cpp), whose Python face and twin are in
`hstu/modules/token_assembly.py`; its dropout uses the same mask as these ops.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "MAX_DIM",
    "draw_seed",
    "draw_seed_tensor",
    "dropout_threshold",
    "is_available",
    "keep_mask",
    "layer_norm_mul_dropout",
    "load_extension",
    "reference_bwd",
    "reference_cast_colsum",
    "reference_fwd",
    "reference_ln_bwd",
    "reference_ln_fwd",
    "reference_residual_gemm",
    "reference_silu_chunk_major",
    "reference_silu_chunk_major_backward",
    "reference_silu_chunk_major_backward_into",
    "supports",
]

MAX_DIM = 8192
BUILD_HINT = (
    "the LayerNorm*u*dropout kernel (hstu._layer_norm_mul_dropout_C) is not built: build it with "
    '`HSTU_KERNELS=layer_norm_mul_dropout HSTU_CUDA_ARCH_LIST="8.0" pip install '
    '--no-build-isolation -e .` (H100/H200: HSTU_CUDA_ARCH_LIST="8.0;9.0"), or use '
    "FusedHSTULayer(gate_kernel='compiled')"
)

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_MASK32 = np.uint64(0xFFFFFFFF)
_loaded: dict[str, bool] = {}


def load_extension() -> bool:
    """Import the extension (registers torch.ops.hstu_lnmd); False when it is not built."""
    if "ok" not in _loaded:
        try:
            import hstu._layer_norm_mul_dropout_C  # noqa: F401

            _loaded["ok"] = True
        except ImportError:
            _loaded["ok"] = False
    return _loaded["ok"]


def is_available() -> bool:
    """True when the extension imports and CUDA is present."""
    return torch.cuda.is_available() and load_extension()


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel handles activations like ``x`` ([T, D], bf16/fp16, CUDA, D % 8 == 0)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[1] % 8 == 0
        and 8 <= x.shape[1] <= MAX_DIM
    )


def _as_int64(v: int) -> int:
    return v - 2**64 if v >= 2**63 else v  # same 64 bits, in the ops' int range


def draw_seed(device: torch.device | str | None = None) -> tuple[int, int]:
    """(seed, offset) of one dropout call: on CUDA the default generator's seed and Philox
    offset, which it advances by 4 (no sync); elsewhere a seed drawn from the CPU generator."""
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64)), 0
    if not torch.cuda.default_generators:  # filled by CUDA's lazy init
        torch.cuda.init()
    index = torch.cuda.current_device() if device.index is None else device.index
    gen = torch.cuda.default_generators[index]
    offset = gen.get_offset()
    gen.set_offset(offset + 4)
    return _as_int64(gen.initial_seed()), _as_int64(offset)


def draw_seed_tensor(device: torch.device | str) -> torch.Tensor:
    """int64 [2] on a CUDA ``device``: a (seed, offset) pair drawn by a kernel from the default
    generator, for the ops' ``seed_offset`` argument. Inside a captured CUDA graph the draw is part
    of the graph, so each replay hands the kernels a fresh pair (`draw_seed`'s host values would
    be baked into the capture and repeat one mask)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def dropout_threshold(p: float) -> tuple[int, float]:
    """(threshold t, scale) of dropout probability ``p``: keep iff the 16-bit draw >= t."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1); got {p}")
    t = min(int(np.rint(p * 65536.0)), 65535)
    return t, (1.0 if t == 0 else 65536.0 / (65536 - t))


def _philox4x32_10(counter: np.ndarray, offset: int, seed: int) -> list[np.ndarray]:
    """Philox4x32-10 of the counters (counter lo, counter hi, offset lo, offset hi) (counter: a
    uint64 array) under key ``seed``."""
    hi = np.full_like(counter, np.uint64(offset & 0xFFFFFFFFFFFFFFFF))
    c = [counter & _MASK32, counter >> np.uint64(32), hi & _MASK32, hi >> np.uint64(32)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0 = _PHILOX_M[0] * c[0]  # < 2**64: exact in uint64
        p1 = _PHILOX_M[1] * c[2]
        c = [
            (p1 >> np.uint64(32)) ^ c[1] ^ k0,
            p1 & _MASK32,
            (p0 >> np.uint64(32)) ^ c[3] ^ k1,
            p0 & _MASK32,
        ]
    return c


def keep_mask(seed: int, offset: int, rows: int, cols: int, p: float, device=None) -> torch.Tensor:
    """The kernel's dropout keep mask (bool [rows, cols], True = kept) for (seed, offset), p."""
    if cols % 8:
        raise ValueError(f"the dropout mask is drawn per 8 columns; cols={cols} is not a multiple")
    t, _ = dropout_threshold(p)
    if t == 0:
        return torch.ones((rows, cols), dtype=torch.bool, device=device)
    with np.errstate(over="ignore"):
        words = _philox4x32_10(np.arange(rows * cols // 8, dtype=np.uint64), offset, seed)
    r16 = np.stack(
        [(words[j // 2] >> np.uint64(16 * (j % 2))) & np.uint64(0xFFFF) for j in range(8)], axis=1
    )
    return torch.from_numpy(r16 >= t).reshape(rows, cols).to(device)


def _silu_rounded(z: torch.Tensor) -> torch.Tensor:
    """SiLU(z) in fp32, rounded to z's dtype (what silu_chunk_major stores), as fp32."""
    return torch.nn.functional.silu(z.float()).to(z.dtype).float()


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    """SiLU'(z) = s (1 + z (1 - s)), s = sigmoid(z), in fp32."""
    zf = z.float()
    s = torch.sigmoid(zf)
    return s * (1.0 + zf * (1.0 - s))


def reference_fwd(
    x,
    u,
    weight,
    bias,
    eps: float,
    p: float,
    seed: int,
    offset: int,
    u_silu: bool = False,
    y_out: torch.Tensor | None = None,
):
    """PyTorch twin of torch.ops.hstu_lnmd.fwd: (y in x's dtype, mean fp32 [T], rstd fp32 [T]).
    ``u_silu``: u is the pre-activation; SiLU(u) rounded to u's dtype is used. ``y_out``: y is
    written there and returned empty."""
    if u_silu:
        u = _silu_rounded(u)
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean[:, None]).square().mean(-1) + eps)
    ln = (xf - mean[:, None]) * rstd[:, None] * weight.float() + bias.float()
    g = ln * u.float()
    t, scale = dropout_threshold(p)
    if t:
        g = torch.where(keep_mask(seed, offset, *x.shape, p, x.device), g * scale, 0.0)
    if y_out is not None:
        y_out.copy_(g)
        return x.new_empty(0), mean, rstd
    return g.to(x.dtype), mean, rstd


def reference_bwd(
    dy,
    x,
    u,
    weight,
    bias,
    mean,
    rstd,
    p: float,
    seed: int,
    offset: int,
    recompute_y: bool,
    u_silu: bool = False,
    du_out: torch.Tensor | None = None,
):
    """PyTorch twin of torch.ops.hstu_lnmd.bwd: (dx, du, dweight, dbias, y or empty).
    ``u_silu``: u is the pre-activation z_u; SiLU(z_u) rounded is used and du comes back as
    du (rounded) * SiLU'(z_u). ``du_out``: du is written there and returned empty."""
    z_u = u
    if u_silu:
        u = _silu_rounded(z_u)
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    ln = xhat * weight.float() + bias.float()
    t, scale = dropout_threshold(p)
    keep = keep_mask(seed, offset, *x.shape, p, x.device) if t else None
    dg = dy.float() if keep is None else torch.where(keep, dy.float() * scale, 0.0)
    du = dg * ln
    dln = dg * u.float()
    dweight = (dln * xhat).sum(0)
    dbias = dln.sum(0)
    dxh = dln * weight.float()
    dx = rstd[:, None] * (
        dxh - dxh.mean(-1, keepdim=True) - xhat * (dxh * xhat).mean(-1, keepdim=True)
    )
    if recompute_y:
        g = ln * u.float()
        y = (g if keep is None else torch.where(keep, g * scale, 0.0)).to(x.dtype)
    else:
        y = x.new_empty((0,))
    du = du.to(x.dtype)
    if u_silu:
        du = (du.float() * _silu_grad(z_u)).to(x.dtype)
    if du_out is not None:
        du_out.copy_(du)
        du = x.new_empty((0,))
    return dx.to(x.dtype), du, dweight, dbias, y


def _check_chunk_major(z: torch.Tensor) -> int:
    if z.dim() != 2 or z.shape[1] % 4:
        raise ValueError(
            f"z must be [T, 4 * hd] (u | v | q | k column blocks); got shape {tuple(z.shape)}"
        )
    return z.shape[1] // 4


def reference_silu_chunk_major(z: torch.Tensor, first_block: int = 0) -> torch.Tensor:
    """PyTorch twin of torch.ops.hstu_lnmd.silu_chunk_major: SiLU(z) in fp32, rounded to z's
    dtype, as [4 - first_block, T, hd] (blocks first_block..3, block b = columns
    b*hd:(b+1)*hd of z; first_block=1: v, q, k only)."""
    hd = _check_chunk_major(z)
    if first_block not in (0, 1):
        raise ValueError(f"first_block must be 0 (u, v, q, k) or 1 (v, q, k); got {first_block}")
    act = torch.nn.functional.silu(z[:, first_block * hd :].float()).to(z.dtype)
    return act.view(z.shape[0], 4 - first_block, hd).transpose(0, 1).contiguous()


def reference_silu_chunk_major_backward_into(
    dv: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    z: torch.Tensor,
    dz: torch.Tensor,
    bias_grad: bool,
) -> torch.Tensor:
    """PyTorch twin of torch.ops.hstu_lnmd.silu_chunk_major_backward_into: dz's u block is
    given (the gating backward with u_silu wrote it); the v, q, k blocks are written as
    `reference_silu_chunk_major_backward` writes them; returns the column sums of all of dz
    (bias_grad), else an empty tensor."""
    hd = _check_chunk_major(z)
    if tuple(dz.shape) != tuple(z.shape):
        raise ValueError(f"dz must have z's shape {tuple(z.shape)}; got {tuple(dz.shape)}")
    rest, _ = reference_silu_chunk_major_backward(dz[:, :hd], dv, dq, dk, z, False)
    dz[:, hd:] = rest[:, hd:]
    return dz.float().sum(0) if bias_grad else z.new_empty((0,), dtype=torch.float32)


def reference_silu_chunk_major_backward(
    du: torch.Tensor,
    dv: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    z: torch.Tensor,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of torch.ops.hstu_lnmd.silu_chunk_major_backward: dz = [du | dv | dq | dk] *
    SiLU'(z) in fp32, rounded to z's dtype, and (bias_grad) its fp32 column sums, else empty.
    dq may also be the attention backward's fp32 accumulator, head-major [H, T, D] with H * D =
    hd (`torch.ops.hstu_attention.bwd(..., dq_fp32=True)`), used unrounded."""
    hd = _check_chunk_major(z)
    t = z.shape[0]
    if dq.dtype == torch.float32 and dq.dim() == 3:
        if dq.shape[1] != t or dq.shape[0] * dq.shape[2] != hd:
            raise ValueError(
                f"an fp32 dq must be the attention's head-major [H, T, D] accumulator with "
                f"H * D = hd = {hd}, T = {t}; got shape {tuple(dq.shape)}"
            )
        dq = dq.transpose(0, 1).reshape(t, hd)
    for name, g in (("du", du), ("dv", dv), ("dq", dq), ("dk", dk)):
        if tuple(g.shape) != (t, hd):
            raise ValueError(
                f"{name} must be [T, hd] = [{t}, {hd}] for z of shape {tuple(z.shape)}; "
                f"got {tuple(g.shape)}"
            )
    g = torch.cat([du.float(), dv.float(), dq.float(), dk.float()], dim=1)
    dz = (g * _silu_grad(z)).to(z.dtype)
    dbias = dz.float().sum(0) if bias_grad else z.new_empty((0,), dtype=torch.float32)
    return dz, dbias


def reference_cast_colsum(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of torch.ops.hstu_lnmd.cast_colsum: (x.to(dtype), x's fp32 column sums)."""
    if x.dim() != 2:
        raise ValueError(f"cast_colsum: x must be 2-D [T, D]; got shape {tuple(x.shape)}")
    return x.to(dtype), x.float().sum(0)


def reference_residual_gemm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of torch.ops.hstu_lnmd.residual_gemm: x + y w^T in fp32 (x fp32 [T, N], y
    [T, K], w [N, K]; 16-bit products are exact in fp32, so the op differs only by the order of
    its fp32 additions)."""
    if x.dim() != 2 or y.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"residual_gemm: x, y, w must be 2-D; got shapes {tuple(x.shape)}, "
            f"{tuple(y.shape)}, {tuple(w.shape)}"
        )
    return torch.addmm(x.float(), y.float(), w.float().t())


def reference_ln_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch twin of torch.ops.hstu_lnmd.ln_fwd: (LayerNorm(x) in fp32 cast to ``dtype``,
    mean [T], rstd [T])."""
    if x.dim() != 2:
        raise ValueError(f"ln_fwd: x must be 2-D [T, D]; got shape {tuple(x.shape)}")
    out, mean, rstd = torch.native_layer_norm(
        x.float(), (x.shape[1],), weight.float(), bias.float(), eps
    )
    return out.to(dtype), mean.reshape(-1), rstd.reshape(-1)


def reference_ln_bwd(
    dn: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    dres: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch twin of torch.ops.hstu_lnmd.ln_bwd, in fp32: (dres + the LayerNorm backward of
    dn, d weight, d bias)."""
    mean, rstd = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    xhat = (x.float() - mean) * rstd
    g = dn.float()
    gx = g * weight.float()
    dx = rstd * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
    return dres.float() + dx, (g * xhat).sum(0), g.sum(0)


class _LayerNormMulDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, u, weight, bias, eps, p, use_kernel):  # type: ignore[override]
        seed, offset = draw_seed(x.device) if p > 0.0 else (0, 0)
        w, b = weight.float(), bias.float()
        fwd = torch.ops.hstu_lnmd.fwd if use_kernel else reference_fwd
        y, mean, rstd = fwd(x, u, w, b, eps, p, seed, offset)
        ctx.save_for_backward(x, u, w, b, mean, rstd)
        ctx.p, ctx.seed, ctx.offset, ctx.use_kernel = p, seed, offset, use_kernel
        ctx.dtypes = (weight.dtype, bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, u, w, b, mean, rstd = ctx.saved_tensors
        bwd = torch.ops.hstu_lnmd.bwd if ctx.use_kernel else reference_bwd
        dx, du, dw, db, _ = bwd(dy, x, u, w, b, mean, rstd, ctx.p, ctx.seed, ctx.offset, False)
        return dx, du, dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None, None, None


def layer_norm_mul_dropout(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    p: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """dropout(LayerNorm(x) * u) with autograd: the CUDA kernel where it applies (bf16/fp16
    CUDA tensors, built extension), else the PyTorch twin (same mask for the same seed)."""
    p = float(p) if training else 0.0
    use_kernel = supports(x) and load_extension()
    return _LayerNormMulDropout.apply(x, u, weight, bias, float(eps), p, use_kernel)
