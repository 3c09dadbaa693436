"""The fused HSTU layer: one autograd Function with a hand-written backward (DESIGN.md).

    n = LayerNorm(x); z = n @ W_uvqk^T + b; u, v, q, k = split(SiLU(z)); a = attention(q, k, v)
    y = dropout(LayerNorm(a) * u); x_out = x + y @ W_o^T + b_o

`FusedHSTULayer` is a drop-in for `HSTULayer` (same constructor, forward and parameter names, so
state dicts load into either); `HSTULayer` stays the unfused reference twin the tests compare to.

Precision: under autocast (bf16/fp16 on GPU) the three matmuls and the attention run in the
autocast dtype, both LayerNorms and the gating in fp32, the residual stream keeps x's dtype;
without autocast everything runs in x's dtype.

Memory: by default the Function keeps x, the input LayerNorm output n (matmul dtype), the uvqk
pre-activation z, its SiLU (u, v, q, k), the attention output a and the dropout mask.
`recompute_input_layernorm=True` keeps only x and its row statistics and recomputes n in backward;
`recompute_uvqk_silu=True` keeps only z and recomputes SiLU(z) in backward. (The projection input
y is always recomputed from a, u and the mask: it is a cheap elementwise product.)

Attention backward: on CUDA with the compiled kernel the op's own backward
(`torch.ops.hstu_attention.bwd`) runs; otherwise (CPU reference, softmax baseline,
`HSTU_FORCE_REFERENCE_ATTENTION=1`) the attention forward is replayed under autograd on detached
leaves and differentiated with `torch.autograd.grad`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hstu.modules.hstu_layer import AttentionInputs, HSTULayer
from hstu.ops import attention as attention_ops

__all__ = ["FusedHSTULayer", "apply_dropout", "dropout_keep_mask", "fused_hstu_layer"]


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
    use_compiled_ops: bool


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


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d SiLU(z) / dz = s * (1 + z * (1 - s)), s = sigmoid(z); fp32."""
    zf = z.float()
    s = torch.sigmoid(zf)
    return s * (1.0 + zf * (1.0 - s))


def _attention_forward(
    spec: _LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    a = spec.attn
    if spec.use_compiled_ops:
        kw = spec.attn_kwargs
        return torch.ops.hstu_attention.fwd(
            q,
            k,
            v,
            a.seq_offsets,
            a.max_seqlen,
            a.num_contexts,
            a.num_targets,
            kw["target_group_size"],
            kw["window_size"],
            kw["alpha"],
            kw["inv_scale"],
            True,
        )
    return spec.attention_fn(
        q,
        k,
        v,
        a.seq_offsets,
        a.max_seqlen,
        num_contexts=a.num_contexts,
        num_targets=a.num_targets,
        target_group_size=spec.attn_kwargs["target_group_size"],
        window_size=spec.attn_kwargs["window_size"],
        alpha=spec.attn_kwargs["alpha_arg"],
        scaling_seqlen=spec.attn_kwargs["scaling_arg"],
    )


def _attention_backward(
    spec: _LayerSpec, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = spec.attn
    if spec.use_compiled_ops:
        kw = spec.attn_kwargs
        dq, dk, dv = torch.ops.hstu_attention.bwd(
            dout.contiguous(),
            q,
            k,
            v,
            a.seq_offsets,
            a.max_seqlen,
            a.num_contexts,
            a.num_targets,
            kw["target_group_size"],
            kw["window_size"],
            kw["alpha"],
            kw["inv_scale"],
            True,
            False,
        )
        return dq, dk, dv
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = _attention_forward(spec, *leaves)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip((dq, dk, dv), leaves))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _FusedHSTUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_in, b_in, w_uvqk, b_uvqk, w_attn, b_attn, w_out, b_out, spec):  # type: ignore[override]
        cdtype = _compute_dtype(x)
        dev = x.device.type
        with torch.autocast(dev, enabled=False):
            t = x.shape[0]
            hd = spec.num_heads * spec.head_dim
            n, mean1, rstd1 = _layer_norm_fwd(x, w_in, b_in, spec.eps)
            n_c = n.to(cdtype)
            z = F.linear(n_c, w_uvqk.to(cdtype), b_uvqk.to(cdtype))
            act = F.silu(z)
            u, v, q, k = torch.split(act, hd, dim=-1)
            shape = (t, spec.num_heads, spec.head_dim)
            q3, k3, v3 = (s.reshape(shape).contiguous() for s in (q, k, v))
            if t > 0:
                attn = _attention_forward(spec, q3, k3, v3).reshape(t, hd).to(cdtype)
            else:
                attn = act.new_zeros((0, hd))
            ln2, mean2, rstd2 = _layer_norm_fwd(attn, w_attn, b_attn, spec.eps)
            g = ln2 * u.float()
            mask = None
            if spec.training and spec.dropout > 0.0 and g.numel() > 0:
                g, mask = apply_dropout(g, spec.dropout)
            y_c = g.to(cdtype)
            proj = F.linear(y_c, w_out.to(cdtype), b_out.to(cdtype))
            out = x + proj.to(x.dtype)

        ctx.spec, ctx.cdtype = spec, cdtype
        ctx.has_mask = mask is not None
        saved_n = None if spec.recompute_input_layernorm else n_c
        saved_act = None if spec.recompute_uvqk_silu else act
        ctx.save_for_backward(
            x, mean1, rstd1, saved_n, z, saved_act, attn, mean2, rstd2, mask,
            w_in, b_in, w_uvqk, w_attn, b_attn, w_out,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        (x, mean1, rstd1, n_c, z, act, attn, mean2, rstd2, mask,
         w_in, b_in, w_uvqk, w_attn, b_attn, w_out) = ctx.saved_tensors  # fmt: skip
        spec, cdtype = ctx.spec, ctx.cdtype
        dev = x.device.type
        with torch.autocast(dev, enabled=False):
            t = x.shape[0]
            hd = spec.num_heads * spec.head_dim
            keep_scale = 1.0 / (1.0 - spec.dropout) if ctx.has_mask else 1.0
            if act is None:  # recompute_uvqk_silu
                act = F.silu(z)
            u, v, q, k = torch.split(act, hd, dim=-1)

            # output projection: proj = y_c @ W_o^T + b_o, y_c recomputed from attn, u and mask
            ahat = (attn.float() - mean2) * rstd2
            ln2 = ahat * w_attn.float() + b_attn.float()
            g = ln2 * u.float()
            if ctx.has_mask:
                g = g * mask * keep_scale
            y_c = g.to(cdtype)
            dproj = dout.to(cdtype)
            d_w_out = (dproj.t() @ y_c).to(w_out.dtype)
            d_b_out = dproj.float().sum(0).to(w_out.dtype)
            dy = (dproj @ w_out.to(cdtype)).float()

            # dropout (same mask) and gating
            if ctx.has_mask:
                dy = dy * mask * keep_scale
            du = dy * ln2
            dln2 = dy * u.float()
            d_attn, d_w_attn, d_b_attn = _layer_norm_bwd(dln2, attn, mean2, rstd2, w_attn)

            # attention
            shape = (t, spec.num_heads, spec.head_dim)
            if t > 0:
                q3, k3, v3 = (s.reshape(shape).contiguous() for s in (q, k, v))
                dq, dk, dv = _attention_backward(spec, d_attn.to(cdtype).reshape(shape), q3, k3, v3)
                dq, dk, dv = (d.reshape(t, hd).float() for d in (dq, dk, dv))
            else:
                dq = dk = dv = du.new_zeros((0, hd))

            # SiLU and the uvqk projection
            dz = (torch.cat([du, dv, dq, dk], dim=-1) * _silu_grad(z)).to(cdtype)
            if n_c is None:  # recompute_input_layernorm
                xhat = (x.float() - mean1) * rstd1
                n_c = (xhat * w_in.float() + b_in.float()).to(cdtype)
            d_w_uvqk = (dz.t() @ n_c).to(w_uvqk.dtype)
            d_b_uvqk = dz.float().sum(0).to(w_uvqk.dtype)
            dn = (dz @ w_uvqk.to(cdtype)).float()

            # input LayerNorm and the residual
            dx_ln, d_w_in, d_b_in = _layer_norm_bwd(dn, x, mean1, rstd1, w_in)
            dx = dout + dx_ln.to(dout.dtype)
        return (
            dx.to(x.dtype),
            d_w_in.to(w_in.dtype),
            d_b_in.to(b_in.dtype),
            d_w_uvqk,
            d_b_uvqk,
            d_w_attn.to(w_attn.dtype),
            d_b_attn.to(b_attn.dtype),
            d_w_out,
            d_b_out,
            None,
        )


def _use_compiled_ops(q_device: torch.device, attention_type: str, head_dim: int) -> bool:
    """The compiled kernel's fwd/bwd ops are called directly on CUDA (unless benchmarking the
    reference with HSTU_FORCE_REFERENCE_ATTENTION=1, running the softmax baseline, or a head dim
    the kernel lacks: `hstu_attention` then zero-pads it and the generic backward replays it)."""
    if q_device.type != "cuda" or attention_type != "hstu":
        return False
    if head_dim not in getattr(attention_ops, "KERNEL_HEAD_DIMS", (32, 64, 128, 256)):
        return False
    if attention_ops.reference_attention_forced():
        return False
    if not attention_ops.compiled_attention_available():
        raise RuntimeError(attention_ops._BUILD_HINT)
    ops = getattr(torch.ops, "hstu_attention", None)
    return ops is not None and hasattr(ops, "fwd") and hasattr(ops, "bwd")


def fused_hstu_layer(layer: FusedHSTULayer, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
    """Runs ``layer``'s parameters through the fused Function."""
    if attn.max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0; got {attn.max_seqlen}")
    alpha = 1.0 / math.sqrt(layer.head_dim) if layer.alpha is None else float(layer.alpha)
    scaling = attn.max_seqlen if layer.scaling_seqlen is None else layer.scaling_seqlen
    if layer.attention_type == "softmax":
        from hstu.modules.softmax_attention import softmax_attention

        attention_fn = softmax_attention
    else:
        attention_fn = attention_ops.hstu_attention
    spec = _LayerSpec(
        num_heads=layer.num_heads,
        head_dim=layer.head_dim,
        eps=layer.input_norm.eps,
        dropout=float(layer.dropout.p),
        training=layer.training,
        recompute_input_layernorm=layer.recompute_input_layernorm,
        recompute_uvqk_silu=layer.recompute_uvqk_silu,
        attn=attn,
        attention_fn=attention_fn,
        attn_kwargs={
            "target_group_size": int(layer.target_group_size),
            "window_size": int(layer.window_size),
            "alpha": alpha,
            "inv_scale": 1.0 / float(scaling) if scaling else 0.0,
            "alpha_arg": layer.alpha,
            "scaling_arg": layer.scaling_seqlen,
        },
        use_compiled_ops=_use_compiled_ops(x.device, layer.attention_type, layer.head_dim),
    )
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
        spec,
    )


class FusedHSTULayer(HSTULayer):
    """`HSTULayer` computed by one autograd Function with a hand-written backward.

    Same constructor, parameters and forward as `HSTULayer`, plus two memory options:
    ``recompute_input_layernorm`` (recompute the input LayerNorm in backward instead of storing
    it) and ``recompute_uvqk_silu`` (store only the uvqk pre-activation, recompute the SiLU).
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
        **kwargs,
    ) -> None:
        super().__init__(hidden_size, num_heads, head_dim, dropout, **kwargs)
        self.recompute_input_layernorm = bool(recompute_input_layernorm)
        self.recompute_uvqk_silu = bool(recompute_uvqk_silu)

    def forward(self, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(
                f"FusedHSTULayer expects jagged x of shape [T, {self.hidden_size}]; "
                f"got {tuple(x.shape)}"
            )
        return fused_hstu_layer(self, x, attn)

    def extra_repr(self) -> str:
        return (
            f"recompute_input_layernorm={self.recompute_input_layernorm}, "
            f"recompute_uvqk_silu={self.recompute_uvqk_silu}"
        )
