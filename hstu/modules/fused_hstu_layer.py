"""The fused HSTU layer: one autograd Function with a hand-written backward (docs/design.md).

    n = LayerNorm(x); z = n @ W_uvqk^T + b; u, v, q, k = split(SiLU(z)); a = attention(q, k, v)
    y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o^T + b_o

`FusedHSTULayer` is a drop-in for `HSTULayer` (same constructor, forward and parameter names, so
state dicts load into either); `HSTULayer` stays the unfused reference twin the tests compare to.

Precision: under autocast (bf16/fp16 on GPU) the three matmuls and the attention run in the
autocast dtype, both LayerNorms and the gating in fp32, the residual stream keeps x's dtype;
without autocast everything runs in x's dtype.

Layout: SiLU(z) is written chunk-major, [4, T, H*d] = (u, v, q, k), so q, k and v are contiguous
[T, H, d] views for the attention op (no copies); the SiLU backward writes each of the four
gradients straight into its column block of dz [T, 4*H*d] (no concat). On CUDA with bf16/fp16
activations, H*d % 8 == 0 and the lnmd extension built, both run as vectorised kernels
(`torch.ops.hstu_lnmd.silu_chunk_major[_backward]`; the backward also returns the uvqk bias
gradient from the same pass); otherwise (CPU, fp32, ``elementwise_kernels=False``, i.e.
`NetworkArgs.fused_elementwise_kernels=False`) `aten.silu.out` / `aten.silu_backward` and
`dz.sum(0)`. The same switch covers the backward's first step: with an fp32 residual stream the
incoming gradient is cast to the matmul dtype and summed for the output bias in one pass
(`torch.ops.hstu_lnmd.cast_colsum`) instead of a copy and a reduction over the copy.

Gating step `dropout(LayerNorm(a) * u)` (``gate_kernel``): "cuda" runs the compiled kernel
(`hstu.modules.layer_norm_mul_dropout`, kernels/layer_norm_mul_dropout/: one pass forward, one
pass backward that also re-emits y for W_o's gradient; dropout mask regenerated from a Philox
seed), "compiled" the torch.compiled PyTorch stages, "auto" the kernel when it is built and
applies (CUDA, bf16/fp16, H*d a multiple of 8 up to 8192), else the compiled stages
(`NetworkArgs.fused_gate_kernel`). On CPU the stages run eagerly whatever the setting
(development mode). With the gating kernel and an fp32 residual stream, the kernel writes y into
a [T, H*d + 8] buffer with a column of ones, and ``x + y W_o^T + b_o`` is one GEMM accumulating
onto x with an fp32 output (``residual_gemm``, `NetworkArgs.fused_residual_gemm`): cuBLASLt reading
x as its C matrix (`torch.ops.hstu_lnmd.residual_gemm`), so x is not first copied into the result
as torch.addmm copies it.

Memory: by default the Function keeps x, the input LayerNorm output n (matmul dtype), the uvqk
pre-activation z, its SiLU (u, v, q, k), the attention output a and (compiled gate with dropout)
the bool dropout mask; the CUDA gate keeps only a seed. `recompute_input_layernorm=True` keeps
only x and its row statistics and recomputes n in backward; `recompute_uvqk_silu=True` keeps only
z and recomputes SiLU(z) in backward. The projection input y is always recomputed.

Attention: `hstu.ops.attention` chooses (`compiled_attention_ops` / `hstu_attention`). On CUDA
with the compiled kernel at a head dim it is built for, its own backward
(`torch.ops.hstu_attention.bwd`) runs; otherwise (CPU reference, softmax baseline, another head
dim, ``reference_attention=True``) the attention forward is replayed under autograd on detached
leaves and differentiated with `torch.autograd.grad`. A relative attention bias
(`RelativeAttentionBias`) enters the Function as its two weight tensors: the kernel computes the
bias in-kernel from them and the token timestamps and its backward returns their gradients; the
replayed reference differentiates them like q, k and v.

Input LayerNorm: with an fp32 residual stream (contiguous, hidden a multiple of 8), the same
switch and ``layernorm_kernel`` (`NetworkArgs.fused_layernorm_kernel`) on, its forward
(LayerNorm + cast to the matmul dtype + row statistics) and its backward (+ the residual
gradient, + d weight / d bias) are one kernel each
(`torch.ops.hstu_lnmd.ln_fwd` / `ln_bwd`). Each call costs ~0.03 ms of host time against
~0.3 ms for a torch.compiled region (guards + generated wrapper), which matters when the host
bounds the step (docs/multi_gpu.md).

The input LayerNorm (+ cast) where its kernels do not run, its backward (+ residual gradient)
and, with the compiled gate, the gating stages are pure functions (`_stage_*`), torch.compiled on
CUDA (``stage_compile=False``, i.e. `NetworkArgs.fused_stage_compile=False`: eager) and eager on
CPU.

Every choice is a `FusedHSTULayer` constructor argument (from `NetworkArgs` through
`HSTUEncoder`); nothing here reads the environment. Process-wide state is limited to caches and
one fallback: a stage that fails to compile switches every layer to the eager stages.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hstu.config.args import FUSED_GATE_KERNELS
from hstu.modules import layer_norm_mul_dropout as lnmd
from hstu.modules.attention_inputs import AttentionInputs
from hstu.modules.relative_bias import RelativeAttentionBias
from hstu.modules.softmax_attention import softmax_attention
from hstu.modules.unfused_layer import HSTULayer
from hstu.ops import attention as attention_ops
from hstu.ops import reference

__all__ = [
    "GATE_KERNELS",
    "FusedHSTULayer",
    "apply_dropout",
    "dropout_keep_mask",
    "fused_hstu_layer",
    "stage_compile_fell_back",
]

logger = logging.getLogger(__name__)

# FusedHSTULayer(gate_kernel=...) values (NetworkArgs.fused_gate_kernel; defined in hstu.config)
GATE_KERNELS = FUSED_GATE_KERNELS


def apply_dropout(g: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout of ``g`` with the very RNG draw `nn.Dropout` makes on the same tensor (so a fused
    and an unfused layer seeded alike drop the same elements); returns (output, keep mask)."""
    if g.is_cuda:  # nn.Dropout on CUDA is native_dropout (Philox, fused)
        out, mask = torch.native_dropout(g, p, True)
        return out, mask
    noise = torch.empty_like(g).bernoulli_(1.0 - p)  # as ATen's CPU dropout draws it
    mask = noise.bool()
    return g * noise.div_(1.0 - p), mask


def dropout_keep_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """The keep mask (True = kept) `FusedHSTULayer` draws for a gating output like ``like``."""
    return apply_dropout(like, p)[1]


@dataclass
class _LayerSpec:
    """Non-tensor settings of one fused call (plus the jagged layout, which needs no grad)."""

    num_heads: int
    head_dim: int
    eps: float
    dropout: float
    training: bool
    recompute_input_layernorm: bool
    recompute_uvqk_silu: bool
    attn: AttentionInputs
    attention_fn: Callable[..., torch.Tensor]
    attn_kwargs: dict
    # (fwd, bwd) ops of the compiled attention kernel when they run this call, else None
    attn_ops: tuple[Callable, Callable] | None
    # torch.compile the PyTorch stages on CUDA (FusedHSTULayer(stage_compile))
    stage_compile: bool
    # (fwd, bwd) ops of the compiled LayerNorm*u*dropout kernel when it runs the gating step
    gate_ops: tuple[Callable, Callable] | None
    # (silu_chunk_major, silu_chunk_major_backward) ops when the SiLU kernels run, else None
    silu_ops: tuple[Callable, Callable] | None = None
    # silu_chunk_major_backward_into when u's SiLU runs inside the gating kernels, else None:
    # act is then [3, T, hd] (v, q, k) and u is z's first column block (`_silu_into_op`)
    silu_into: Callable | None = None
    # cast_colsum op for the incoming fp32 gradient (cast + output bias gradient), else None
    cast_op: Callable | None = None
    # (ln_fwd, ln_bwd) ops of the input LayerNorm kernels (fp32 residual stream), else None
    ln_ops: tuple[Callable, Callable] | None = None
    # the layer's relative attention bias (its weights enter the Function as tensors), or None
    rel_bias: RelativeAttentionBias | None = None
    # the softmax baseline takes the relative bias as a dense tensor
    dense_bias: bool = False
    # x + y W_o^T + b_o as one GEMM that reads x (FusedHSTULayer(residual_gemm); applies with the
    # gating ops and an fp32 residual stream: `_residual_gemm`)
    residual_gemm: bool = False


def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 LayerNorm over the last dim; returns (out, mean [T, 1], rstd [T, 1])."""
    xf = x.float()
    out, mean, rstd = torch.native_layer_norm(
        xf, (xf.shape[-1],), weight.float(), bias.float(), eps
    )
    return out, mean.reshape(-1, 1), rstd.reshape(-1, 1)


def _layer_norm_bwd(
    grad: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hand-written LayerNorm backward in fp32: (dx, dweight, dbias)."""
    xhat = (x.float() - mean) * rstd
    g = grad.float()
    dweight = (g * xhat).sum(0)
    dbias = g.sum(0)
    gx = g * weight.float()
    # dx = rstd * (gx - mean(gx) - xhat * mean(gx * xhat))
    dx = rstd * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
    return dx, dweight, dbias


# ---- elementwise stages between the matmuls and the attention ---------------------------------
# Pure functions of tensors and Python scalars. On CUDA each is compiled by torch.compile into a
# few fused kernels (stage_compile=False keeps them eager): at benchmark shapes these
# memory-bound steps, not the matmuls, would otherwise dominate the layer's time.


def _stage_pre_norm(x, w, b, eps: float, cdtype: torch.dtype):
    """Input LayerNorm -> (n in the matmul dtype, mean, rstd)."""
    n, mean, rstd = _layer_norm_fwd(x, w, b, eps)
    return n.to(cdtype), mean, rstd


def _stage_recompute_norm(x, mean, rstd, w, b, cdtype: torch.dtype):
    """recompute_input_layernorm: n from x and the saved row statistics."""
    return ((x.float() - mean) * rstd * w.float() + b.float()).to(cdtype)


def _stage_gate_fwd(attn, w, b, u, keep, scale: float, eps: float, cdtype: torch.dtype):
    """y = dropout(LayerNorm(attn) * u) in the matmul dtype, plus LayerNorm(attn)'s statistics."""
    ln, mean, rstd = _layer_norm_fwd(attn, w, b, eps)
    g = ln * u.float()
    if keep is not None:
        g = g * keep * scale
    return g.to(cdtype), mean, rstd


def _stage_gate_recompute(attn, mean, rstd, w, b, u, keep, scale: float, cdtype: torch.dtype):
    """The output projection's input y, recomputed in backward (weight gradient of W_o)."""
    g = ((attn.float() - mean) * rstd * w.float() + b.float()) * u.float()
    if keep is not None:
        g = g * keep * scale
    return g.to(cdtype)


def _stage_gate_bwd(dy, attn, mean, rstd, w, b, u, keep, scale: float, cdtype: torch.dtype):
    """Backward of dropout (same mask), gating and LayerNorm(attn):
    (d attn and du in the matmul dtype, d weight, d bias)."""
    dy = dy.float()
    if keep is not None:
        dy = dy * keep * scale
    ln = (attn.float() - mean) * rstd * w.float() + b.float()
    du = dy * ln
    d_attn, dw, db = _layer_norm_bwd(dy * u.float(), attn, mean, rstd, w)
    return d_attn.to(cdtype), du.to(cdtype), dw, db


def _stage_in_norm_bwd(dn, x, mean, rstd, w, dout):
    """Input LayerNorm backward plus the residual: (dx, d weight, d bias)."""
    dx_ln, dw, db = _layer_norm_bwd(dn, x, mean, rstd, w)
    return (dout.float() + dx_ln).to(x.dtype), dw, db


def _silu_chunk_major(z: torch.Tensor, hd: int) -> torch.Tensor:
    """SiLU(z) for z [T, 4*hd] (u | v | q | k per row), written as [4, T, hd]: each of u, v, q, k
    is then a contiguous [T, hd] block (q, k, v feed the attention op without copies)."""
    t = z.shape[0]
    act = z.new_empty((4, t, hd))
    torch.ops.aten.silu.out(z.view(t, 4, hd).transpose(0, 1), out=act)
    return act


def _silu_backward_into(dz: torch.Tensor, grads, z: torch.Tensor, hd: int) -> None:
    """dz[:, i*hd:(i+1)*hd] = grads[i] * SiLU'(z[:, i*hd:(i+1)*hd]) for the four blocks: each
    gradient goes straight into its column block (no concatenation), math in fp32 (opmath)."""
    t = z.shape[0]
    for i, g in enumerate(grads):
        cols = slice(i * hd, (i + 1) * hd)
        torch.ops.aten.silu_backward.grad_input(
            g.reshape(t, hd), z[:, cols], grad_input=dz[:, cols]
        )


def _kernel_layout(g: torch.Tensor) -> torch.Tensor:
    """``g`` [T, W] as the rows the lnmd elementwise kernels read (unit last stride, row stride a
    multiple of 8 and >= W, 16-byte aligned): itself when it already is, else a contiguous copy
    (e.g. an expanded gradient with stride 0)."""
    t, w = g.shape
    if t > 0 and (g.stride(1) != 1 or (t > 1 and (g.stride(0) % 8 or g.stride(0) < w))):
        g = g.contiguous()
    if t > 0 and g.data_ptr() % 16:
        g = g.clone(memory_format=torch.contiguous_format)
    return g


def _kernel_rows(g: torch.Tensor, t: int, hd: int, dtype: torch.dtype) -> torch.Tensor:
    """``g`` as the [T, hd] rows the SiLU backward kernel reads, in ``dtype``."""
    return _kernel_layout(_cast(g.reshape(t, hd), dtype))


def _silu_backward(spec: _LayerSpec, grads, z: torch.Tensor, hd: int, dt_bias: torch.dtype):
    """(dz [T, 4*hd], the uvqk bias gradient in dt_bias) from du, dv, dq, dk and z: one kernel
    pass when the SiLU kernels run, else aten.silu_backward per block and dz.sum(0)."""
    if spec.silu_ops is not None:
        dz, d_bias = spec.silu_ops[1](*_silu_grad_rows(spec, grads, z, hd), z, True)
        return dz, _cast(d_bias, dt_bias)
    dz = torch.empty_like(z)
    _silu_backward_into(dz, grads, z, hd)
    return dz, dz.sum(0, dtype=torch.float32).to(dt_bias)


def _activations(spec: _LayerSpec, z: torch.Tensor, hd: int):
    """(act as saved, u for the gating step, (v, q, k)) from z [T, 4*hd]: the SiLU kernel's
    [4, T, hd] blocks, or with `silu_into` its [3, T, hd] v, q, k and z's u block itself (the
    gating kernels apply SiLU to it)."""
    if spec.silu_into is not None:
        act = spec.silu_ops[0](z, 1)
    elif spec.silu_ops is not None:
        act = spec.silu_ops[0](z)
    else:
        act = _silu_chunk_major(z, hd)
    return (act, *_split_activations(spec, act, z, hd))


def _split_activations(spec: _LayerSpec, act: torch.Tensor, z: torch.Tensor, hd: int):
    """(u, (v, q, k)) of a saved ``act`` (see `_activations`); one unbind, not an indexing call
    per block."""
    blocks = act.unbind(0)
    if spec.silu_into is not None:
        return z[:, :hd], blocks
    return blocks[0], blocks[1:]


def _u_silu_kwarg(spec: _LayerSpec) -> dict:
    """The gating ops' ``u_silu`` keyword when they take u before its SiLU."""
    return {"u_silu": True} if spec.silu_into is not None else {}


def _silu_backward_vqk(spec: _LayerSpec, dz, grads, z: torch.Tensor, hd: int, dt_bias):
    """dz's v, q, k blocks from dv, dq, dk (its u block is written already) and the uvqk bias
    gradient in dt_bias: one `silu_chunk_major_backward_into` pass."""
    return _cast(spec.silu_into(*_silu_grad_rows(spec, grads, z, hd), z, dz, True), dt_bias)


def _dq_accum(spec: _LayerSpec) -> bool:
    """Whether the attention backward hands dq over as its fp32 head-major accumulator
    (`dq_fp32=True`): the kernel ops run, the SiLU kernels read dq, and the attention op takes
    the argument (an extension built from older sources returns dq converted, as before)."""
    return (
        spec.attn_ops is not None
        and spec.silu_ops is not None
        and _takes(spec.attn_ops[1], "dq_fp32")
    )


def _silu_grad_rows(spec: _LayerSpec, grads, z: torch.Tensor, hd: int) -> list[torch.Tensor]:
    """``grads`` (ending with dq, dk) as the SiLU backward kernels read them: [T, hd] rows in
    z's dtype, except dq when it is the attention's fp32 accumulator (`_dq_accum`), passed as
    it is."""
    t = z.shape[0]
    keep = len(grads) - 2 if _dq_accum(spec) else -1
    return [g if i == keep else _kernel_rows(g, t, hd, z.dtype) for i, g in enumerate(grads)]


def _output_grad(spec: _LayerSpec, dout: torch.Tensor, cdtype: torch.dtype, dt_bias: torch.dtype):
    """(dout in the matmul dtype, the output projection's bias gradient in dt_bias): one pass
    over an fp32 dout when the cast kernel runs, else a cast and a sum of the cast."""
    if spec.cast_op is not None and dout.dtype == torch.float32 and cdtype != torch.float32:
        dproj, d_bias = spec.cast_op(_kernel_layout(dout), cdtype)
        return dproj, _cast(d_bias, dt_bias)
    dproj = dout.to(cdtype)
    return dproj, dproj.sum(0, dtype=torch.float32).to(dt_bias)


# Destinations of weight gradients, by id of the parameter: set by `weight_grads_into` while
# the encoder's CUDA graphs capture a backward (hstu/modules/graphed_encoder.py).
_grad_destinations: dict[int, torch.Tensor] = {}


@contextlib.contextmanager
def weight_grads_into(buffers: dict[int, torch.Tensor]):
    """Within the block, a fused layer's backward writes the fp32 gradient of a projection
    weight whose ``id`` is in ``buffers`` straight into that buffer (`_weight_grad`; the first
    gradient of that weight only) and returns the buffer itself. The encoder's graphs hand the
    replay's gradient buffers over this way instead of copying each gradient into them after
    the capture."""
    _grad_destinations.update(buffers)
    try:
        yield
    finally:
        _grad_destinations.clear()


@functools.cache
def _has_mm_out_dtype() -> bool:
    """Whether this torch has `aten::mm.dtype` (16-bit operands, fp32 output; CUDA only)."""
    return "dtype" in torch.ops.aten.mm.overloads()


def _weight_grad(a: torch.Tensor, b: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``a @ b``, a projection weight's gradient, in ``param``'s dtype. On CUDA with 16-bit
    operands and an fp32 parameter, one GEMM with an fp32 output (`torch.mm(..., out_dtype=)`):
    no 16-bit product written, read back and cast (one rounding instead of two); into the
    buffer `weight_grads_into` names for ``param``, when there is one. Otherwise the product in
    the operands' dtype, cast."""
    if (
        param.dtype == torch.float32
        and a.dtype in (torch.bfloat16, torch.float16)
        and a.device.type == "cuda"
        and _has_mm_out_dtype()
    ):
        # taken once: a weight that two layers share gets its buffer from the first backward
        # only (autograd then sums the second's fresh gradient onto it, not onto itself)
        out = _grad_destinations.pop(id(param), None)
        if out is not None and out.shape == param.shape and out.dtype == torch.float32:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32)
    return _cast(a @ b, param.dtype)


def _residual(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    out = x + proj  # one kernel; promotes bf16 proj into an fp32 residual stream
    return out if out.dtype == x.dtype else out.to(x.dtype)


# Columns the output projection's input gains for its bias (one column of ones, then zeros: a
# multiple of 8 keeps the gating kernel's rows and the GEMM's operands 16-byte aligned).
_BIAS_COLUMNS = 8


def _bias_augmented(t: int, hd: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[t, hd + _BIAS_COLUMNS] buffer: column hd is 1, the rest past hd 0 (device fills, no
    host copy: safe inside a graph capture); the gating kernel writes y into its first hd
    columns."""
    buf = torch.empty((t, hd + _BIAS_COLUMNS), dtype=dtype, device=device)
    buf[:, hd].fill_(1)
    buf[:, hd + 1 :].zero_()
    return buf


def _residual_gemm(
    x: torch.Tensor, y_aug: torch.Tensor, w_c: torch.Tensor, b_c: torch.Tensor
) -> torch.Tensor:
    """x + y W^T + b in fp32 from one GEMM (W and b in y's dtype): [y | 1 | 0] [W | b | 0]^T
    accumulated onto x, with no 16-bit projection written and read back. On CUDA
    `torch.ops.hstu_lnmd.residual_gemm` (cuBLASLt reading x as C and writing a new output:
    torch.addmm would first copy x into its result, a read and write of the whole fp32 stream);
    with an extension built before that op, addmm (fp32 output from 16-bit operands). On CPU
    (tests of the code path with the kernels' twins) the op's twin, the same GEMM in fp32."""
    w_aug = torch.cat((w_c, F.pad(b_c.unsqueeze(1), (0, _BIAS_COLUMNS - 1))), 1)
    if x.device.type != "cuda":
        return lnmd.reference_residual_gemm(x, y_aug, w_aug)
    op = _elementwise_ops(y_aug, "residual_gemm")  # y's dtype: x is the fp32 stream
    if op is not None:
        return op(x, y_aug, w_aug)
    return torch.addmm(x, y_aug, w_aug.t(), torch.float32)


_STAGES: dict[str, Callable] = {
    name[len("_stage_") :]: fn for name, fn in globals().items() if name.startswith("_stage_")
}
_compiled: dict[str, Callable] = {}
# set when a stage failed to compile: every layer runs the eager stages from then on
_compile_fallback = {"eager": False}
_elementwise_state = {
    "warned": False,
    "ops": {},  # op name -> torch.ops.hstu_lnmd.<name> or None (built without it)
}


def _elementwise_ops(x: torch.Tensor, name: str):
    """torch.ops.hstu_lnmd.<name> when the extension's elementwise kernels may run for this call
    (CUDA, bf16/fp16 matmul dtype, extension built with the op), else None. Whether the layer
    wants them at all (``elementwise_kernels``) is checked by the caller."""
    if x.device.type != "cuda":
        return None
    if _compute_dtype(x) not in (torch.float16, torch.bfloat16) or not lnmd.load_extension():
        return None
    cached = _elementwise_state["ops"]
    if name in cached:
        return cached[name]
    ops = torch.ops.hstu_lnmd
    cached[name] = getattr(ops, name) if hasattr(ops, name) else None
    if cached[name] is None:  # an extension built before the op existed
        if not _elementwise_state["warned"]:
            logger.warning(
                "FusedHSTULayer: hstu._layer_norm_mul_dropout_C has no %s op (built from older "
                "sources); using the aten path. Rebuild it: %s",
                name,
                lnmd.BUILD_HINT,
            )
            _elementwise_state["warned"] = True
    return cached[name]


def _silu_ops(x: torch.Tensor, inner: int):
    """(silu_chunk_major, silu_chunk_major_backward) ops when they run this call's uvqk SiLU
    (`_elementwise_ops` conditions and H*d % 8 == 0), else None."""
    fwd = None if inner % 8 else _elementwise_ops(x, "silu_chunk_major")
    bwd = None if fwd is None else _elementwise_ops(x, "silu_chunk_major_backward")
    return None if bwd is None else (fwd, bwd)


@functools.cache
def _takes(op: Callable, arg: str) -> bool:
    """Whether the torch op's schema has the argument ``arg`` (an extension built from older
    sources may not). Cached: asked at every layer call."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    return schema is not None and any(a.name == arg for a in schema.arguments)


def _silu_into_op(x: torch.Tensor, silu_ops, gate_ops):
    """silu_chunk_major_backward_into when the SiLU of u moves into the gating kernels (both
    the SiLU and the gate kernels run this call, and the extension has the op: a build that
    has it also has the gate's u_silu / du_out and the SiLU's first_block), else None. Then the
    SiLU kernel computes v, q, k only, the gating kernels read z's u block and apply SiLU
    themselves, and the gating backward writes dz's u block."""
    if silu_ops is None or gate_ops is None:
        return None
    return _elementwise_ops(x, "silu_chunk_major_backward_into")


def _cast_op(x: torch.Tensor, hidden: int):
    """cast_colsum when it runs the backward's first step (`_elementwise_ops` conditions, an fp32
    residual stream and hidden % 8 == 0), else None."""
    if x.dtype != torch.float32 or hidden % 8:
        return None
    return _elementwise_ops(x, "cast_colsum")


def _ln_ops(x: torch.Tensor, hidden: int):
    """(ln_fwd, ln_bwd) when the input LayerNorm kernels run this call (`_elementwise_ops`
    conditions, a contiguous fp32 residual stream, hidden a multiple of 8 up to lnmd.MAX_DIM),
    else None (the torch.compiled stages run). The layer's ``elementwise_kernels`` and
    ``layernorm_kernel`` are checked by the caller."""
    if x.dtype != torch.float32 or hidden % 8 or hidden > lnmd.MAX_DIM:
        return None
    if not x.is_contiguous():
        return None
    fwd = _elementwise_ops(x, "ln_fwd")
    bwd = None if fwd is None else _elementwise_ops(x, "ln_bwd")
    return None if bwd is None else (fwd, bwd)


def stage_compile_fell_back() -> bool:
    """True once a stage failed to compile: from then on every layer runs the eager stages."""
    return _compile_fallback["eager"]


def _stage(name: str, device: torch.device, *args, compile_stages: bool = True):
    """Runs stage ``name``: compiled on CUDA (``compile_stages``), eager otherwise or after a
    compile failure."""
    fn = _STAGES[name]
    if not _stages_compiled(device, compile_stages):
        return fn(*args)
    compiled = _compiled.get(name)
    if compiled is None:
        compiled = _compiled[name] = torch.compile(fn, dynamic=True)
    try:
        return compiled(*args)
    except Exception as exc:  # a compile failure must not stop training: eager is correct
        logger.warning(
            "FusedHSTULayer: torch.compile of stage %r failed (%s: %s); running the elementwise "
            "stages eagerly from now on",
            name,
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )
        _compile_fallback["eager"] = True
        return fn(*args)


def _kernel_bias_args(
    spec: _LayerSpec,
    q: torch.Tensor,
    pos_weight: torch.Tensor | None,
    time_weight: torch.Tensor | None,
) -> dict:
    """The relative-bias keyword arguments of the compiled ops (all None / 0 without a bias):
    fp32 contiguous weights, the timestamps and the time bucket edges on q's device."""
    if spec.rel_bias is None:
        return {}
    kw = spec.rel_bias.attention_kwargs(spec.attn, pos_weight, time_weight)
    ts, pw, tw = kw["timestamps"], kw["pos_weight"], kw["time_weight"]
    last = kw["last_query_time"]
    reference.check_relative_bias(
        q.shape[0],
        q.shape[1],
        ts,
        pw,
        tw,
        kw["max_pos"],
        spec.attn_kwargs["alpha"],
        last,
        spec.attn.seq_offsets.numel() - 1,
    )
    edges = None
    if tw is not None:
        for name, t in (("timestamps", ts), ("last_query_time", last)):
            if t is not None and t.device != q.device:
                raise ValueError(f"AttentionInputs.{name} must be on {q.device}; got {t.device}")
        ts, tw = ts.contiguous(), tw.float().contiguous()
        last = None if last is None else last.contiguous()
        edges = reference.time_bucket_edges(tw.shape[1] - 1, q.device)
    if pw is not None:
        pw = pw.float().contiguous()
    return dict(
        timestamps=ts,
        pos_weight=pw,
        time_weight=tw,
        time_edges=edges,
        max_pos=kw["max_pos"],
        last_query_time=last,
    )


def _attention_forward(
    spec: _LayerSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    a = spec.attn
    if spec.attn_ops is not None:
        kw = spec.attn_kwargs
        # CPU copies of the metadata when present: validated on the host, no device sync
        offsets, contexts, targets = a.kernel_metadata(q.device)
        return spec.attn_ops[0](
            q,
            k,
            v,
            offsets,
            a.max_seqlen,
            contexts,
            targets,
            kw["target_group_size"],
            kw["window_size"],
            kw["alpha"],
            kw["inv_scale"],
            True,
            **_kernel_bias_args(spec, q, pos_weight, time_weight),
            inv_scale_tensor=kw["inv_scale_tensor"],
        )
    extra = {}
    if spec.rel_bias is not None:
        extra = spec.rel_bias.attention_kwargs(a, pos_weight, time_weight, dense=spec.dense_bias)
    offsets, contexts, targets = a.seq_offsets, a.num_contexts, a.num_targets
    if not spec.dense_bias:  # hstu.ops.attention (e.g. a head dim the kernel runs padded)
        # host metadata on CUDA: the compiled op validates it without a device sync
        offsets, contexts, targets = a.kernel_metadata(q.device)
        if spec.attn_kwargs["inv_scale_tensor"] is not None:
            extra["inv_scale_tensor"] = spec.attn_kwargs["inv_scale_tensor"]
    return spec.attention_fn(
        q,
        k,
        v,
        offsets,
        a.max_seqlen,
        num_contexts=contexts,
        num_targets=targets,
        target_group_size=spec.attn_kwargs["target_group_size"],
        window_size=spec.attn_kwargs["window_size"],
        alpha=spec.attn_kwargs["alpha_arg"],
        scaling_seqlen=spec.attn_kwargs["scaling_arg"],
        **extra,
    )


def _attention_backward(
    spec: _LayerSpec,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, d pos_weight, d time_weight); a weight's gradient is None when it is."""
    a = spec.attn
    weights = (pos_weight, time_weight)
    if spec.attn_ops is not None:
        kw = spec.attn_kwargs
        offsets, contexts, targets = a.kernel_metadata(q.device)
        # with the SiLU kernels, dq stays the kernel's fp32 accumulator: the SiLU backward
        # reads it directly, so no convert kernel runs
        extra = {"dq_fp32": True} if _dq_accum(spec) else {}
        dq, dk, dv, d_pos, d_time = spec.attn_ops[1](
            dout.contiguous(),
            q,
            k,
            v,
            offsets,
            a.max_seqlen,
            contexts,
            targets,
            kw["target_group_size"],
            kw["window_size"],
            kw["alpha"],
            kw["inv_scale"],
            True,
            False,
            **_kernel_bias_args(spec, q, pos_weight, time_weight),
            inv_scale_tensor=kw["inv_scale_tensor"],
            **extra,
        )
        # fp32 from the kernel (empty for an absent weight); back to the parameters' dtype
        d_w = [None if w is None else _cast(g, w.dtype) for w, g in zip(weights, (d_pos, d_time))]
        return dq, dk, dv, *d_w
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    w_leaves = [None if w is None else w.detach().requires_grad_(True) for w in weights]
    inputs = leaves + [w for w in w_leaves if w is not None]
    with torch.enable_grad():
        out = _attention_forward(spec, *leaves, *w_leaves)
        grads = list(torch.autograd.grad(out, inputs, dout, allow_unused=True))
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, inputs)]
    dq, dk, dv = grads[:3]
    rest = iter(grads[3:])
    return dq, dk, dv, *(None if w is None else next(rest) for w in w_leaves)


def _seed_offset_kwarg(seed_offset: torch.Tensor | None) -> dict:
    """The gating ops' ``seed_offset`` keyword where a device-side seed is used (captures)."""
    return {} if seed_offset is None else {"seed_offset": seed_offset}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: itself when it already is (``Tensor.to`` returns it too, but a call
    through the binding costs host time: the layer makes ~20 such casts per step and layer)."""
    return t if t.dtype == dtype else t.to(dtype)


class _FusedHSTUFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, w_in, b_in, w_uvqk, b_uvqk, w_attn, b_attn, w_out, b_out, w_pos, w_time, spec
    ):  # type: ignore[override]
        cdtype = _compute_dtype(x)
        dev = x.device
        with torch.autocast(dev.type, enabled=False):
            t = x.shape[0]
            hd = spec.num_heads * spec.head_dim
            shape = (t, spec.num_heads, spec.head_dim)
            if spec.ln_ops is not None:
                n_c, mean1, rstd1 = spec.ln_ops[0](
                    x, _cast(w_in, torch.float32), _cast(b_in, torch.float32), spec.eps, cdtype
                )
                mean1, rstd1 = mean1.view(-1, 1), rstd1.view(-1, 1)
            else:
                n_c, mean1, rstd1 = _stage(
                    "pre_norm", dev, x, w_in, b_in, spec.eps, cdtype,
                    compile_stages=spec.stage_compile,
                )  # fmt: skip
            # cast once; backward reuses the casts (no-ops when the weights are already cdtype)
            w_uvqk_c, w_out_c = _cast(w_uvqk, cdtype), _cast(w_out, cdtype)
            z = F.linear(n_c, w_uvqk_c, _cast(b_uvqk, cdtype))
            act, u, (v_, q_, k_) = _activations(spec, z, hd)
            if t > 0:
                attn = _attention_forward(
                    spec, q_.view(shape), k_.view(shape), v_.view(shape), w_pos, w_time
                )
                attn = _cast(attn.reshape(t, hd), cdtype)
            else:
                attn = act.new_zeros((0, hd))
            p = spec.dropout if (spec.training and t > 0) else 0.0
            mask, scale, seed = None, 1.0, (0, 0)
            seed_offset = None
            if spec.gate_ops is not None:
                seed = (0, 0)
                if p > 0.0 and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    # drawn by a kernel inside the graph: every replay gets a fresh mask
                    seed_offset = lnmd.draw_seed_tensor(dev)
                elif p > 0.0:
                    seed = lnmd.draw_seed(dev)
                # x + y W_o^T + b_o as one GEMM reading x (fp32 residual stream only)
                rgemm = spec.residual_gemm and x.dtype == torch.float32 and t > 0
                y_aug = _bias_augmented(t, hd, cdtype, dev) if rgemm else None
                y_c, mean2, rstd2 = spec.gate_ops[0](
                    attn, u, _cast(w_attn, torch.float32), _cast(b_attn, torch.float32), spec.eps, p, *seed,
                    **_seed_offset_kwarg(seed_offset), **_u_silu_kwarg(spec),
                    **({} if y_aug is None else {"y_out": y_aug[:, :hd]}),
                )  # fmt: skip
            else:
                y_aug = None
                if p > 0.0:
                    scale = 1.0 / (1.0 - p)
                    if _stages_compiled(dev, spec.stage_compile):
                        mask = torch.rand((t, hd), device=dev) >= p
                    else:  # eager: the very draw nn.Dropout makes (same seed, same mask)
                        ln2, _, _ = _layer_norm_fwd(attn, w_attn, b_attn, spec.eps)
                        mask = apply_dropout(ln2 * u.float(), p)[1]
                y_c, mean2, rstd2 = _stage(
                    "gate_fwd", dev, attn, w_attn, b_attn, u, mask, scale, spec.eps, cdtype,
                    compile_stages=spec.stage_compile,
                )  # fmt: skip
            if y_aug is not None:
                out = _residual_gemm(x, y_aug, w_out_c, _cast(b_out, cdtype))
            else:
                out = _residual(x, F.linear(y_c, w_out_c, _cast(b_out, cdtype)))

        ctx.spec, ctx.cdtype, ctx.scale, ctx.p, ctx.seed = spec, cdtype, scale, p, seed
        ctx.seed_offset = seed_offset
        ctx.param_dtypes = (b_uvqk.dtype, b_out.dtype)
        ctx.weights = (w_uvqk, w_out)  # the parameters themselves (`_weight_grad`)
        saved_n = None if spec.recompute_input_layernorm else n_c
        saved_act = None if spec.recompute_uvqk_silu else act
        ctx.save_for_backward(
            x, mean1, rstd1, saved_n, z, saved_act, attn, mean2, rstd2, mask,
            w_in, b_in, w_uvqk_c, w_attn, b_attn, w_out_c, w_pos, w_time,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        (x, mean1, rstd1, n_c, z, act, attn, mean2, rstd2, mask,
         w_in, b_in, w_uvqk_c, w_attn, b_attn, w_out_c, w_pos, w_time) = ctx.saved_tensors  # fmt: skip
        spec, cdtype, scale = ctx.spec, ctx.cdtype, ctx.scale
        dt_b_uvqk, dt_b_out = ctx.param_dtypes
        w_uvqk, w_out = ctx.weights
        dev = x.device
        # autograd runs the backward with autocast off unless the caller's backward() sits in
        # an autocast region: only then is a region that disables it needed
        no_autocast = (
            torch.autocast(dev.type, enabled=False)
            if torch.is_autocast_enabled(dev.type)
            else contextlib.nullcontext()
        )
        with no_autocast:
            t = x.shape[0]
            hd = spec.num_heads * spec.head_dim
            shape = (t, spec.num_heads, spec.head_dim)
            if act is None:  # recompute_uvqk_silu
                act, u, vqk = _activations(spec, z, hd)
            else:
                u, vqk = _split_activations(spec, act, z, hd)
            # with u's SiLU in the gating kernels, the gating backward writes dz's u block
            dz = torch.empty_like(z) if spec.silu_into is not None else None

            # output projection: proj = y @ W_o^T + b_o
            dproj, d_b_out = _output_grad(spec, dout, cdtype, dt_b_out)
            dy = dproj @ w_out_c

            # dropout (the forward's mask), gating, LayerNorm(attn); y recomputed for dW_o
            if spec.gate_ops is not None:
                into = {} if dz is None else {"du_out": dz[:, :hd], **_u_silu_kwarg(spec)}
                d_attn, du, d_w_attn, d_b_attn, y_c = spec.gate_ops[1](
                    dy, attn, u, _cast(w_attn, torch.float32), _cast(b_attn, torch.float32), mean2, rstd2, ctx.p,
                    *ctx.seed,
                    True, **_seed_offset_kwarg(ctx.seed_offset), **into,
                )  # fmt: skip
            else:
                y_c = _stage(
                    "gate_recompute", dev, attn, mean2, rstd2, w_attn, b_attn, u, mask, scale,
                    cdtype, compile_stages=spec.stage_compile,
                )  # fmt: skip
                d_attn, du, d_w_attn, d_b_attn = _stage(
                    "gate_bwd", dev, dy, attn, mean2, rstd2, w_attn, b_attn, u, mask, scale,
                    cdtype, compile_stages=spec.stage_compile,
                )  # fmt: skip
            del dy
            d_w_out = _weight_grad(dproj.t(), y_c, w_out)
            del y_c

            # attention (q, k, v: contiguous views of the chunk-major SiLU output)
            if t > 0:
                q3, k3, v3 = vqk[1].view(shape), vqk[2].view(shape), vqk[0].view(shape)
                dq, dk, dv, d_pos, d_time = _attention_backward(
                    spec, d_attn.view(shape), q3, k3, v3, w_pos, w_time
                )
            else:
                dq = dk = dv = act.new_zeros(shape)
                d_pos, d_time = (
                    None if w is None else torch.zeros_like(w) for w in (w_pos, w_time)
                )
            del d_attn

            # SiLU, straight into the column blocks of dz (+ the uvqk bias gradient), then the
            # uvqk projection
            if dz is not None:
                d_b_uvqk = _silu_backward_vqk(spec, dz, (dv, dq, dk), z, hd, dt_b_uvqk)
            else:
                dz, d_b_uvqk = _silu_backward(spec, (du, dv, dq, dk), z, hd, dt_b_uvqk)
            del du, dv, dq, dk
            if n_c is None:  # recompute_input_layernorm
                n_c = _stage(
                    "recompute_norm", dev, x, mean1, rstd1, w_in, b_in, cdtype,
                    compile_stages=spec.stage_compile,
                )  # fmt: skip
            d_w_uvqk = _weight_grad(dz.t(), n_c, w_uvqk)
            dn = dz @ w_uvqk_c
            del dz

            # input LayerNorm and the residual
            if spec.ln_ops is not None:
                dres = dout
                if dres.dtype != torch.float32 or not dres.is_contiguous():
                    dres = dres.float().contiguous()  # e.g. the expanded gradient of a sum()
                dx, d_w_in, d_b_in = spec.ln_ops[1](
                    dn, x, mean1.view(-1), rstd1.view(-1), _cast(w_in, torch.float32), dres
                )
            else:
                dx, d_w_in, d_b_in = _stage(
                    "in_norm_bwd", dev, dn, x, mean1, rstd1, w_in, dout,
                    compile_stages=spec.stage_compile,
                )  # fmt: skip
        return (
            dx,
            _cast(d_w_in, w_in.dtype),
            _cast(d_b_in, b_in.dtype),
            d_w_uvqk,
            d_b_uvqk,
            _cast(d_w_attn, w_attn.dtype),
            _cast(d_b_attn, b_attn.dtype),
            d_w_out,
            d_b_out,
            d_pos,
            d_time,
            None,
        )


def _stages_compiled(device: torch.device, compile_stages: bool) -> bool:
    return device.type == "cuda" and compile_stages and not _compile_fallback["eager"]


def _check_gate_kernel(value: str | None) -> str:
    value = "auto" if value is None else value
    if value not in GATE_KERNELS:
        raise ValueError(
            f"FusedHSTULayer(gate_kernel={value!r}) is not supported: one of "
            f"{list(GATE_KERNELS)} (NetworkArgs.fused_gate_kernel)"
        )
    return value


def _gate_ops(mode: str, x: torch.Tensor, inner: int):
    """(fwd, bwd) of the compiled LayerNorm*u*dropout kernel when it runs this call's gating
    step (``mode``: the layer's gate_kernel), else None (the PyTorch stages run)."""
    if x.device.type != "cuda":
        return None  # CPU development mode: eager PyTorch stages
    if mode == "compiled":
        return None
    cdtype = _compute_dtype(x)
    fits = cdtype in (torch.float16, torch.bfloat16) and inner % 8 == 0 and inner <= lnmd.MAX_DIM
    ops = (torch.ops.hstu_lnmd.fwd, torch.ops.hstu_lnmd.bwd) if lnmd.load_extension() else None
    if mode == "auto":
        return ops if fits else None
    if ops is None:
        raise RuntimeError(f"FusedHSTULayer(gate_kernel='cuda'): {lnmd.BUILD_HINT}")
    if not fits:
        raise ValueError(
            f"FusedHSTULayer(gate_kernel='cuda') needs bf16/fp16 activations (autocast) and "
            f"num_heads * head_dim a multiple of 8 up to {lnmd.MAX_DIM}; got {cdtype} and "
            f"{inner}: use gate_kernel='compiled' (or 'auto')"
        )
    return ops


# per layer: the ops `_layer_ops` chose, by key (beside the layer, not in its __dict__: a copy
# or a pickle of the layer carries no op handles)
_LAYER_OPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_ops(layer: FusedHSTULayer, x: torch.Tensor) -> dict:
    """The ops one call of ``layer`` runs (attention kernel or reference, elementwise kernels or
    PyTorch stages), chosen for x's device, dtype, compute dtype and layout and the layer's
    settings; chosen once per such key and kept beside the layer in `_LAYER_OPS` (the choice is
    the same at every step, and making it costs host time at every layer call)."""
    key = (
        x.device,
        x.dtype,
        _compute_dtype(x),
        x.is_contiguous(),
        layer.attention_type,
        layer.reference_attention,
        layer.elementwise_kernels,
        layer.layernorm_kernel,
        layer.gate_kernel,
        layer.num_heads,
        layer.head_dim,
        layer.hidden_size,
    )
    cache = _LAYER_OPS.get(layer)
    if cache is None:
        cache = _LAYER_OPS[layer] = {}
    hit = cache.get(key)
    if hit is not None:
        return hit
    inner = layer.num_heads * layer.head_dim
    if layer.attention_type == "softmax":
        attention_fn, attn_ops = softmax_attention, None
    else:  # hstu.ops.attention chooses kernel or reference
        force = layer.reference_attention
        attention_fn = functools.partial(attention_ops.hstu_attention, force_reference=force)
        attn_ops = attention_ops.compiled_attention_ops(
            x.device, layer.head_dim, force_reference=force
        )
    elementwise = layer.elementwise_kernels
    use_ln_kernel = elementwise and layer.layernorm_kernel
    gate_ops = _gate_ops(layer.gate_kernel, x, inner)
    silu_ops = _silu_ops(x, inner) if elementwise else None
    hit = cache[key] = {
        "attention_fn": attention_fn,
        "attn_ops": attn_ops,
        "gate_ops": gate_ops,
        "silu_ops": silu_ops,
        "silu_into": _silu_into_op(x, silu_ops, gate_ops),
        "cast_op": _cast_op(x, layer.hidden_size) if elementwise else None,
        "ln_ops": _ln_ops(x, layer.hidden_size) if use_ln_kernel else None,
    }
    return hit


def fused_hstu_layer(layer: FusedHSTULayer, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
    """Runs ``layer``'s parameters through the fused Function."""
    if attn.max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0; got {attn.max_seqlen}")
    alpha = 1.0 / math.sqrt(layer.head_dim) if layer.alpha is None else float(layer.alpha)
    scaling = attn.max_seqlen if layer.scaling_seqlen is None else layer.scaling_seqlen
    ops = _layer_ops(layer, x)
    spec = _LayerSpec(
        num_heads=layer.num_heads,
        head_dim=layer.head_dim,
        eps=layer.input_norm.eps,
        dropout=float(layer.dropout.p),
        training=layer.training,
        recompute_input_layernorm=layer.recompute_input_layernorm,
        recompute_uvqk_silu=layer.recompute_uvqk_silu,
        attn=attn,
        attention_fn=ops["attention_fn"],
        attn_kwargs={
            "target_group_size": int(layer.target_group_size),
            "window_size": int(layer.window_size),
            "alpha": alpha,
            "inv_scale": 1.0 / float(scaling) if scaling else 0.0,
            # the batch's scaling from device memory when max_seqlen is an upper bound (graphs)
            "inv_scale_tensor": attn.inv_max_seqlen if layer.scaling_seqlen is None else None,
            "alpha_arg": layer.alpha,
            "scaling_arg": layer.scaling_seqlen,
        },
        attn_ops=ops["attn_ops"],
        stage_compile=layer.stage_compile,
        gate_ops=ops["gate_ops"],
        silu_ops=ops["silu_ops"],
        silu_into=ops["silu_into"],
        cast_op=ops["cast_op"],
        ln_ops=ops["ln_ops"],
        rel_bias=layer.relative_bias,
        dense_bias=layer.attention_type == "softmax",
        residual_gemm=layer.residual_gemm,
    )
    if spec.attn_kwargs["inv_scale_tensor"] is not None and layer.attention_type == "softmax":
        raise ValueError(
            "AttentionInputs.inv_max_seqlen (a CUDA graph's device-side scaling) is read by the "
            "compiled HSTU attention only; this layer runs the softmax baseline"
        )
    rel = layer.relative_bias
    return _FusedHSTUFunction.apply(
        x,
        layer.input_norm.weight,
        layer.input_norm.bias,
        layer.uvqk.weight,
        layer.uvqk.bias,
        layer.attn_norm.weight,
        layer.attn_norm.bias,
        layer.out_proj.weight,
        layer.out_proj.bias,
        None if rel is None else rel.pos_weight,
        None if rel is None else rel.time_weight,
        spec,
    )


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


class FusedHSTULayer(HSTULayer):
    """`HSTULayer` computed by one autograd Function with a hand-written backward.

    Same constructor, parameters and forward as `HSTULayer`, plus two memory options:
    ``recompute_input_layernorm`` (recompute the input LayerNorm in backward instead of storing
    it) and ``recompute_uvqk_silu`` (store only the uvqk pre-activation, recompute the SiLU),
    and the code-path choices on CUDA (module docstring; `NetworkArgs` field in brackets):
    ``gate_kernel`` ("auto" | "cuda" | "compiled"; None: "auto") [fused_gate_kernel], the
    implementation of dropout(LayerNorm(attn) * u); ``elementwise_kernels``
    [fused_elementwise_kernels], the hstu_lnmd SiLU and gradient-cast kernels;
    ``layernorm_kernel`` [fused_layernorm_kernel], its input LayerNorm kernels (also needs
    ``elementwise_kernels``); ``stage_compile`` [fused_stage_compile], torch.compile of the
    PyTorch stages; ``residual_gemm`` [fused_residual_gemm], x + y W_o^T + b_o as one GEMM
    that reads x (with the gating kernel and an fp32 residual stream). They are plain
    attributes, read at every forward.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        dropout: float = 0.0,
        *,
        recompute_input_layernorm: bool = False,
        recompute_uvqk_silu: bool = False,
        gate_kernel: str | None = "auto",
        elementwise_kernels: bool = True,
        layernorm_kernel: bool = True,
        stage_compile: bool = True,
        residual_gemm: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(hidden_size, num_heads, head_dim, dropout, **kwargs)
        self.recompute_input_layernorm = bool(recompute_input_layernorm)
        self.recompute_uvqk_silu = bool(recompute_uvqk_silu)
        self.gate_kernel = _check_gate_kernel(gate_kernel)
        self.elementwise_kernels = bool(elementwise_kernels)
        self.layernorm_kernel = bool(layernorm_kernel)
        self.stage_compile = bool(stage_compile)
        self.residual_gemm = bool(residual_gemm)

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(
                f"FusedHSTULayer expects jagged x of shape [T, {self.hidden_size}]; "
                f"got {tuple(x.shape)}"
            )
        return fused_hstu_layer(self, x, attn)

    # ---- serving: the layer around an attention computed elsewhere (hstu.inference.kv_cache) --
    def _serving(self) -> bool:
        """True where `project` / `finish` run the fused forward's own steps: eval mode, no
        autograd (the kernels here have no backward; otherwise `HSTULayer`'s autograd ops)."""
        return not self.training and not torch.is_grad_enabled()

    def _serving_weights(self, name: str, cdtype: torch.dtype):
        """(weight, bias) of the Linear ``name`` ("uvqk" or "out_proj") in the matmul dtype,
        cast once and kept while the parameters are unchanged (same memory, same version
        counters): a served layer runs its matmuls without a cast per call, and a CUDA graph of
        it reads the kept casts."""
        linear = getattr(self, name)
        w, b = linear.weight, linear.bias
        stamp = (w.data_ptr(), w._version, b.data_ptr(), b._version, cdtype)
        casts = self.__dict__.setdefault("_serving_casts", {})
        hit = casts.get(name)
        if hit is None or hit[0] != stamp:
            hit = casts[name] = (stamp, w.detach().to(cdtype), b.detach().to(cdtype))
        return hit[1], hit[2]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(u, v, q, k), each [T, H * D]. Serving (eval, no grad): the fused forward's input
        LayerNorm, matmul and chunk-major SiLU (the same kernels and precision as `forward`;
        q, k and v are contiguous); otherwise `HSTULayer.project`."""
        if not self._serving():
            return super().project(x)
        cdtype = _compute_dtype(x)
        inner = self.num_heads * self.head_dim
        norm = self.input_norm
        ln = (
            _ln_ops(x, self.hidden_size)
            if self.elementwise_kernels and self.layernorm_kernel
            else None
        )
        silu = _silu_ops(x, inner) if self.elementwise_kernels else None
        with torch.autocast(x.device.type, enabled=False):
            if ln is not None:
                n_c = ln[0](x, norm.weight.float(), norm.bias.float(), norm.eps, cdtype)[0]
            else:
                n_c = _stage(
                    "pre_norm", x.device, x, norm.weight, norm.bias, norm.eps, cdtype,
                    compile_stages=self.stage_compile,
                )[0]  # fmt: skip
            w, b = self._serving_weights("uvqk", cdtype)
            z = F.linear(n_c, w, b)
            act = silu[0](z) if silu is not None else _silu_chunk_major(z, inner)
        return act[0], act[1], act[2], act[3]

    def finish(self, x: torch.Tensor, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """x + W_o(LayerNorm(a) * u). Serving (eval, no grad): the fused forward's gating step
        and output matmul; otherwise `HSTULayer.finish`."""
        if not self._serving():
            return super().finish(x, a, u)
        cdtype = _compute_dtype(x)
        inner = self.num_heads * self.head_dim
        norm = self.attn_norm
        gate = _gate_ops(self.gate_kernel, x, inner)
        with torch.autocast(x.device.type, enabled=False):
            a = _kernel_layout(a.reshape(-1, inner).to(cdtype))
            if gate is not None:
                y_c = gate[0](
                    a, _kernel_layout(u.to(cdtype)), norm.weight.float(), norm.bias.float(),
                    norm.eps, 0.0, 0, 0,
                )[0]  # fmt: skip
            else:
                y_c = _stage(
                    "gate_fwd", x.device, a, norm.weight, norm.bias, u, None, 1.0, norm.eps,
                    cdtype, compile_stages=self.stage_compile,
                )[0]  # fmt: skip
            w, b = self._serving_weights("out_proj", cdtype)
            return _residual(x, F.linear(y_c, w, b))

    def kernel_choices(self, device: torch.device) -> dict[str, str]:
        """`HSTUEncoder.kernel_choices` of a stack of fused layers: each value is the setting,
        then in brackets what runs on ``device`` (never raises; the per-call conditions such as
        the autocast dtype are named, not evaluated)."""
        cuda = torch.device(device).type == "cuda"
        built = cuda and lnmd.load_extension()
        if not cuda:
            stages = "CPU: eager stages"
        elif not self.stage_compile or _compile_fallback["eager"]:
            stages = "eager stages"
        else:
            stages = "torch.compiled stages"
        gate = self.gate_kernel
        if not cuda:
            gate += f" ({stages})"
        elif gate == "cuda":
            gate += " (hstu_lnmd kernel)" if built else " (hstu_lnmd not built: forward raises)"
        elif gate == "compiled":
            gate += f" ({stages})"
        elif built:
            gate += f" (hstu_lnmd kernel for bf16/fp16 and H*d % 8 == 0, else {stages})"
        else:
            gate += f" ({stages}: hstu_lnmd not built)"

        def kernel_switch(flag: bool, what: str, needs: str = "") -> str:
            if not flag:
                return "off"
            if needs:
                return f"on (off: needs {needs})"
            if not cuda:
                return "on (CPU: PyTorch ops)"
            if not built:
                return "on (hstu_lnmd not built: PyTorch ops)"
            return f"on ({what})"

        if not cuda:
            compile_state = "(CPU: eager)"
        elif _compile_fallback["eager"]:
            compile_state = "(a stage failed to compile: eager)"
        else:
            compile_state = "(torch.compile on CUDA)" if self.stage_compile else "(eager)"
        recompute = [
            name
            for name, flag in (
                ("input_layernorm", self.recompute_input_layernorm),
                ("uvqk_silu", self.recompute_uvqk_silu),
            )
            if flag
        ]
        return {
            "layer": "fused (FusedHSTULayer, hand-written backward)",
            "attention": self.attention_choice(device),
            "gate_kernel": gate,
            "elementwise_kernels": kernel_switch(
                self.elementwise_kernels, "SiLU and gradient cast with bf16/fp16 matmuls"
            ),
            "layernorm_kernel": kernel_switch(
                self.layernorm_kernel,
                "input LayerNorm with an fp32 residual stream",
                "" if self.elementwise_kernels else "elementwise_kernels",
            ),
            "stage_compile": f"{_on_off(self.stage_compile)} {compile_state}",
            "residual_gemm": (
                "off"
                if not self.residual_gemm
                else "on (with the gating kernel and an fp32 residual stream: one GEMM "
                "accumulates onto x)"
            ),
            "recompute": "+".join(recompute) if recompute else "none",
        }

    def extra_repr(self) -> str:
        return (
            f"recompute_input_layernorm={self.recompute_input_layernorm}, "
            f"recompute_uvqk_silu={self.recompute_uvqk_silu}, gate_kernel={self.gate_kernel}, "
            f"elementwise_kernels={self.elementwise_kernels}, "
            f"layernorm_kernel={self.layernorm_kernel}, stage_compile={self.stage_compile}, "
            f"residual_gemm={self.residual_gemm}"
        )
