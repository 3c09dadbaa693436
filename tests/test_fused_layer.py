"""FusedHSTULayer (one autograd Function, hand-written backward) vs the unfused HSTULayer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hstu.modules.fused_hstu_layer as fused_mod
from hstu.modules.fused_hstu_layer import FusedHSTULayer, dropout_keep_mask
from hstu.modules.hstu_layer import AttentionInputs, HSTUEncoder, HSTULayer

HIDDEN, HEADS, DIM = 24, 2, 8
RECOMPUTE = [(False, False), (True, False), (False, True), (True, True)]


class _FixedMaskDropout(nn.Module):
    """Drives the unfused layer with the fused layer's dropout mask."""

    def __init__(self, mask: torch.Tensor, p: float) -> None:
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask / (1.0 - self.p)


def _layout(lengths, contexts=None, targets=None, device="cpu") -> AttentionInputs:
    lens = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)

    def as_t(v):
        return None if v is None else torch.tensor(v, dtype=torch.int64, device=device)

    return AttentionInputs(
        seq_offsets=offsets.to(device),
        max_seqlen=max(lengths, default=0),
        num_contexts=as_t(contexts),
        num_targets=as_t(targets),
    )


def _pair(dropout=0.0, recompute=(False, False), seed=0, **kw):
    torch.manual_seed(seed)
    ref = HSTULayer(HIDDEN, HEADS, DIM, dropout, **kw)
    fused = FusedHSTULayer(
        HIDDEN,
        HEADS,
        DIM,
        dropout,
        recompute_input_layernorm=recompute[0],
        recompute_uvqk_silu=recompute[1],
        **kw,
    )
    fused.load_state_dict(ref.state_dict())
    # non-trivial norm affine parameters so their gradients are exercised
    with torch.no_grad():
        for layer in (ref, fused):
            for p in (layer.input_norm.weight, layer.attn_norm.weight):
                p.copy_(1.0 + 0.1 * torch.arange(p.numel()) / p.numel())
            for p in (layer.input_norm.bias, layer.attn_norm.bias, layer.uvqk.bias):
                p.copy_(0.05 * torch.cos(torch.arange(p.numel(), dtype=torch.float32)))
    return ref, fused


def _run(layer: nn.Module, x: torch.Tensor, attn: AttentionInputs, grad_out: torch.Tensor):
    xi = x.clone().requires_grad_(True)
    out = layer(xi, attn)
    out.backward(grad_out)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["x"] = xi.grad.clone()
    return out.detach(), grads


def _assert_match(ref_res, fused_res, atol=2e-5, rtol=1e-4):
    (out_r, g_r), (out_f, g_f) = ref_res, fused_res
    torch.testing.assert_close(out_f, out_r, atol=atol, rtol=rtol)
    assert g_r.keys() == g_f.keys()
    for name in g_r:
        torch.testing.assert_close(g_f[name], g_r[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("with_ctx_targets", [False, True])
def test_fused_matches_unfused_fp32(recompute, with_ctx_targets):
    lengths = [5, 1, 9, 0, 7]
    ctx = [2, 0, 3, 0, 1] if with_ctx_targets else None
    tgt = [2, 1, 3, 0, 2] if with_ctx_targets else None
    attn = _layout(lengths, ctx, tgt)
    ref, fused = _pair(recompute=recompute, target_group_size=2 if with_ctx_targets else 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(lengths), HIDDEN, generator=gen)
    grad_out = torch.randn(sum(lengths), HIDDEN, generator=gen)
    _assert_match(_run(ref, x, attn, grad_out), _run(fused, x, attn, grad_out))


def test_fused_matches_with_window_alpha_and_scaling():
    attn = _layout([6, 11, 3])
    ref, fused = _pair(window_size=3, alpha=0.3, scaling_seqlen=16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20, HIDDEN, generator=gen)
    g = torch.randn(20, HIDDEN, generator=gen)
    _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))


@pytest.mark.parametrize("recompute", [(False, False), (True, True)])
def test_fused_dropout_same_seed_same_mask_as_unfused(recompute):
    """The fused layer draws its mask exactly as nn.Dropout does: seeded alike, the fused and
    the unfused layer drop the same elements (forward and backward match)."""
    p = 0.3
    lengths = [7, 4, 10]
    attn = _layout(lengths, targets=[2, 1, 3])
    ref, fused = _pair(dropout=p, recompute=recompute)
    ref.train()
    fused.train()
    gen = torch.Generator().manual_seed(3)
    t = sum(lengths)
    x = torch.randn(t, HIDDEN, generator=gen)
    g = torch.randn(t, HIDDEN, generator=gen)
    torch.manual_seed(42)
    res_f = _run(fused, x, attn, g)
    torch.manual_seed(42)
    res_r = _run(ref, x, attn, g)
    _assert_match(res_r, res_f)
    # dropout did act: the no-dropout output differs
    fused.eval()
    assert not torch.allclose(fused(x, attn).detach(), res_f[0])
    fused.train()
    # same seed -> same mask -> identical output; another seed -> another mask
    torch.manual_seed(42)
    torch.testing.assert_close(fused(x, attn).detach(), res_f[0], atol=0, rtol=0)
    torch.manual_seed(43)
    assert not torch.allclose(fused(x, attn).detach(), res_f[0])


def test_fused_dropout_backward_reuses_forward_mask():
    """Backward uses the forward's mask: it matches the unfused layer driven with that mask
    under a different RNG state (a redrawn mask could not match)."""
    p = 0.5
    attn = _layout([9, 5])
    ref, fused = _pair(dropout=p)
    x = torch.randn(14, HIDDEN)
    g = torch.randn(14, HIDDEN)
    seen = {}
    orig = fused_mod.apply_dropout

    def spy(t, q):
        out, mask = orig(t, q)
        seen["mask"] = mask
        return out, mask

    fused_mod.apply_dropout = spy
    try:
        torch.manual_seed(7)
        res_f = _run(fused, x, attn, g)
    finally:
        fused_mod.apply_dropout = orig
    torch.manual_seed(999)
    ref.dropout = _FixedMaskDropout(seen["mask"], p)
    _assert_match(_run(ref, x, attn, g), res_f)


def test_fused_dropout_statistics_and_eval_mode():
    p = 0.25
    torch.manual_seed(0)
    mask = dropout_keep_mask(torch.ones(4000, 16), p)
    assert abs(float((~mask).float().mean()) - p) < 0.01
    attn = _layout([12, 9])
    ref, fused = _pair(dropout=p)
    ref.eval()
    fused.eval()  # eval: no dropout, deterministic, equal to the unfused layer
    x = torch.randn(21, HIDDEN)
    g = torch.randn(21, HIDDEN)
    _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))


@pytest.mark.parametrize("lengths", [[], [0, 0, 0]])
@pytest.mark.parametrize("recompute", [(False, False), (True, True)])
def test_fused_empty_batch(lengths, recompute):
    attn = _layout(lengths)
    ref, fused = _pair(recompute=recompute, dropout=0.1)
    x = torch.zeros(0, HIDDEN)
    g = torch.zeros(0, HIDDEN)
    # (the unfused layer's reference attention rejects max_seqlen=0; the fused one skips it)
    out_f, g_f = _run(fused, x, attn, g)
    assert out_f.shape == (0, HIDDEN)
    params = dict(ref.named_parameters())
    for name, grad in g_f.items():
        assert grad.shape == (params[name].shape if name != "x" else (0, HIDDEN))
        assert torch.count_nonzero(grad) == 0, name


def test_fused_rejects_bad_shape():
    _, fused = _pair()
    with pytest.raises(ValueError, match=r"\[T, 24\]"):
        fused(torch.zeros(3, HIDDEN + 1), _layout([3]))


def test_encoder_fused_switch_and_state_dict_compat():
    kw = dict(num_heads=HEADS, head_dim=DIM, dropout=0.0)
    torch.manual_seed(0)
    ref = HSTUEncoder(2, HIDDEN, fused=False, **kw)
    fused = HSTUEncoder(2, HIDDEN, fused=True, recompute_uvqk_silu=True, **kw)
    assert all(type(layer) is FusedHSTULayer for layer in fused.layers)
    assert all(type(layer) is HSTULayer for layer in ref.layers)
    fused.load_state_dict(ref.state_dict())
    attn = _layout([4, 6], contexts=[1, 2], targets=[1, 2])
    x = torch.randn(10, HIDDEN)
    g = torch.randn(10, HIDDEN)
    _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))


def _jagged_batch(dev: torch.device, hidden: int):
    """(layout, x, output gradient) of six sequences (one empty, one of one token) with targets:
    the GPU tests' batch."""
    lengths = [300, 1, 77, 512, 0, 129]
    attn = _layout(lengths, targets=[10, 0, 5, 20, 0, 7], device=dev)
    t = sum(lengths)
    return attn, torch.randn(t, hidden, device=dev), torch.randn(t, hidden, device=dev)


def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from hstu.ops import compiled_attention_available

    return compiled_attention_available()


def _cuda_layers_and_batch(
    heads: int, dim: int, recompute, gate: str = "auto", stage_compile: bool = True
):
    """(unfused layer, fused layer with the same weights, jagged layout with contexts and
    targets, input x, output gradient g) on CUDA, hidden 256, seeded."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden = 256
    ref = HSTULayer(hidden, heads, dim, 0.0).to(dev)
    fused = FusedHSTULayer(
        hidden,
        heads,
        dim,
        0.0,
        recompute_input_layernorm=recompute[0],
        recompute_uvqk_silu=recompute[1],
        gate_kernel=gate,
        stage_compile=stage_compile,
    ).to(dev)
    fused.load_state_dict(ref.state_dict())
    lengths = [300, 1, 77, 512, 0, 129]
    attn = _layout(lengths, contexts=[3, 0, 2, 4, 0, 1], targets=[10, 0, 5, 20, 0, 7], device=dev)
    t = sum(lengths)
    x = torch.randn(t, hidden, device=dev)
    g = torch.randn(t, hidden, device=dev)
    return ref, fused, attn, x, g


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and the compiled HSTU attention kernel")
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize(
    "compile_stages,gate",
    [(True, "compiled"), (False, "compiled"), (True, "cuda"), (False, "cuda")],
)
def test_fused_matches_unfused_bf16_cuda(recompute, compile_stages, gate):
    """bf16 autocast on CUDA, compiled attention in both, the fused layer's elementwise stages
    torch.compiled or eager and its gating step by the stages or the CUDA LayerNorm*u*dropout
    kernel: output within 2e-2 (abs) + 2e-2 (rel) and every gradient within 3% relative L2
    error of the unfused layer's."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    if gate == "cuda" and not lnmd.load_extension():
        pytest.skip("the LayerNorm*u*dropout extension is not built")
    ref, fused, attn, x, g = _cuda_layers_and_batch(4, 64, recompute, gate, compile_stages)
    results = []
    for layer in (ref, fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(_run(layer, x, attn, g))
    compiled_ok = not fused_mod.stage_compile_fell_back()
    (out_r, g_r), (out_f, g_f) = results
    if compile_stages:
        assert compiled_ok, "a stage failed to compile and fell back to eager (see the warning)"
    assert out_f.dtype == out_r.dtype
    torch.testing.assert_close(out_f, out_r, atol=2e-2, rtol=2e-2)
    for name in g_r:
        err = (g_f[name].float() - g_r[name].float()).norm() / g_r[name].float().norm().clamp_min(
            1e-6
        )
        assert err < 3e-2, (name, float(err))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and the compiled HSTU attention kernel")
def test_fused_head_dim_without_kernel_instance_cuda():
    """head_dim 50 (paper ML-1M): hstu_attention zero-pads to 64; the fused layer's backward
    replays it under autograd. Same tolerances as the bf16 test."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = HSTULayer(100, 2, 50, 0.0).to(dev)
    fused = FusedHSTULayer(100, 2, 50, 0.0).to(dev)
    fused.load_state_dict(ref.state_dict())
    attn = _layout([40, 1, 77], targets=[5, 0, 9], device=dev)
    x = torch.randn(118, 100, device=dev)
    g = torch.randn(118, 100, device=dev)
    results = []
    for layer in (ref, fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(_run(layer, x, attn, g))
    (out_r, g_r), (out_f, g_f) = results
    torch.testing.assert_close(out_f, out_r, atol=2e-2, rtol=2e-2)
    for name in g_r:
        err = (g_f[name] - g_r[name]).norm() / g_r[name].norm().clamp_min(1e-6)
        assert err < 3e-2, (name, float(err))


def _match_every_recompute_option(seed: int):
    """Fused vs unfused on a batch with contextual and target tokens, for every recompute
    option (CPU, fp32); returns the batch (T, layout, x, output gradient) for further checks."""
    attn = _layout([7, 1, 12], contexts=[1, 0, 2], targets=[2, 0, 3])
    t = 20
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=gen)
    g = torch.randn(t, HIDDEN, generator=gen)
    for recompute in RECOMPUTE:
        ref, fused = _pair(recompute=recompute, target_group_size=2)
        _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))
    return t, attn, x, g


def test_fused_gate_kernel_path_matches_unfused_cpu(monkeypatch):
    """The gate_kernel='cuda' code path of the Function, run on CPU with the kernel's PyTorch twin
    in place of the CUDA ops: matches the unfused layer without dropout, and with dropout when
    the unfused layer is driven by the twin's Philox mask of the seed the forward drew (so the
    backward regenerated that very mask). p = 0.25 is exact in the kernel's 1/65536 steps."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    calls = []

    def fake_gate_ops(mode, x, inner):
        calls.append(mode)
        return lnmd.reference_fwd, lnmd.reference_bwd

    monkeypatch.setattr(fused_mod, "_gate_ops", fake_gate_ops)
    t, attn, x, g = _match_every_recompute_option(seed=4)
    p = 0.25
    ref, fused = _pair(dropout=p, recompute=(True, True))
    seeds = []
    real_draw = lnmd.draw_seed
    monkeypatch.setattr(lnmd, "draw_seed", lambda dev: seeds.append(real_draw(dev)) or seeds[-1])
    res_f = _run(fused, x, attn, g)
    keep = lnmd.keep_mask(*seeds[-1], t, HEADS * DIM, p)
    ref.dropout = _FixedMaskDropout(keep, p)
    _assert_match(_run(ref, x, attn, g), res_f)
    assert len(seeds) == 1 and calls


@pytest.mark.parametrize("residual_gemm", [True, False], ids=["residual_gemm", "two_ops"])
def test_residual_gemm_path_matches_unfused_cpu(monkeypatch, residual_gemm):
    """With the gating ops (their twin on CPU) and an fp32 residual stream, x + y W_o^T + b_o is
    one GEMM over [y | 1 | 0] (the twin writes y into the buffer's first columns through
    y_out): same output and gradients as the unfused layer, and as with the switch off."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    y_outs = []

    def fwd_twin(*args, **kwargs):
        y_outs.append(kwargs.get("y_out"))
        return lnmd.reference_fwd(*args, **kwargs)

    monkeypatch.setattr(
        fused_mod, "_gate_ops", lambda mode, x, inner: (fwd_twin, lnmd.reference_bwd)
    )
    attn = _layout([7, 1, 12], contexts=[1, 0, 2], targets=[2, 0, 3])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, HIDDEN, generator=gen)
    g = torch.randn(20, HIDDEN, generator=gen)
    ref, fused = _pair()
    fused.residual_gemm = residual_gemm
    with torch.no_grad():
        for layer in (ref, fused):
            layer.out_proj.bias.copy_(0.3 * torch.sin(torch.arange(HIDDEN, dtype=torch.float32)))
    _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))
    assert len(y_outs) == 1
    if residual_gemm:  # a [T, H*d] view of the [T, H*d + 8] operand
        y = y_outs[0]
        assert y.shape == (20, HEADS * DIM) and y.stride(0) == HEADS * DIM + 8
    else:
        assert y_outs[0] is None
    assert "residual_gemm" in fused.extra_repr()
    assert fused.kernel_choices(torch.device("cpu"))["residual_gemm"].startswith(
        "on" if residual_gemm else "off"
    )


def test_gate_fwd_twin_writes_y_out():
    """reference_fwd(y_out=...) writes y into the given (strided) view and returns y empty."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen).bfloat16()
    u = torch.randn(6, 16, generator=gen).bfloat16()
    w, b = torch.rand(16, generator=gen) + 0.5, torch.randn(16, generator=gen)
    y, mean, rstd = lnmd.reference_fwd(x, u, w, b, 1e-6, 0.25, 3, 4)
    buf = torch.full((6, 24), 7.0, dtype=torch.bfloat16)
    y2, mean2, rstd2 = lnmd.reference_fwd(x, u, w, b, 1e-6, 0.25, 3, 4, y_out=buf[:, :16])
    assert y2.numel() == 0
    assert torch.equal(buf[:, :16], y) and torch.equal(
        buf[:, 16:], torch.full((6, 8), 7.0).bfloat16()
    )
    assert torch.equal(mean, mean2) and torch.equal(rstd, rstd2)


def test_gate_kernel_option_is_validated():
    with pytest.raises(ValueError, match="gate_kernel"):
        FusedHSTULayer(HIDDEN, HEADS, DIM, gate_kernel="triton")
    assert FusedHSTULayer(HIDDEN, HEADS, DIM).gate_kernel == "auto"
    assert FusedHSTULayer(HIDDEN, HEADS, DIM, gate_kernel=None).gate_kernel == "auto"
    # CPU tensors run the eager stages whatever the setting
    assert fused_mod._gate_ops("cuda", torch.zeros(2, HIDDEN), HEADS * DIM) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and the compiled HSTU attention kernel")
def test_fused_gate_cuda_dropout_matches_unfused_with_its_mask_cuda(monkeypatch):
    """gate_kernel='cuda' with dropout p = 0.25 (exact in the kernel's 1/65536 steps), bf16: the
    unfused layer driven by the kernel's Philox mask (the seed/offset the forward drew) matches
    within the bf16 tolerances above, so the backward regenerated the forward's mask."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    if not lnmd.load_extension():
        pytest.skip("the LayerNorm*u*dropout extension is not built")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden, heads, dim, p = 256, 4, 64, 0.25
    ref = HSTULayer(hidden, heads, dim, p).to(dev)
    fused = FusedHSTULayer(hidden, heads, dim, p, gate_kernel="cuda").to(dev)
    fused.load_state_dict(ref.state_dict())
    attn, x, g = _jagged_batch(dev, hidden)
    t = x.shape[0]
    seeds = []
    real_draw = lnmd.draw_seed
    monkeypatch.setattr(lnmd, "draw_seed", lambda d: seeds.append(real_draw(d)) or seeds[-1])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_f, g_f = _run(fused, x, attn, g)
    assert len(seeds) == 1
    ref.dropout = _FixedMaskDropout(lnmd.keep_mask(*seeds[0], t, heads * dim, p, dev), p)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_r, g_r = _run(ref, x, attn, g)
    torch.testing.assert_close(out_f, out_r, atol=2e-2, rtol=2e-2)
    for name in g_r:
        err = (g_f[name].float() - g_r[name].float()).norm() / g_r[name].float().norm().clamp_min(
            1e-6
        )
        assert err < 3e-2, (name, float(err))


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and the compiled HSTU attention kernel")
def test_residual_gemm_matches_two_ops_cuda(monkeypatch):
    """bf16 autocast, fp32 residual stream, CUDA gate kernel: the output projection + residual
    as one GEMM (the cuBLASLt op reading x as C, fp32 output) against the two-op path: outputs
    within the bf16 rounding of the projection the two-op path adds, gradients bit for bit (the
    backward does not read the output), and the GEMM path ran through the op."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    if not lnmd.load_extension():
        pytest.skip("the LayerNorm*u*dropout extension is not built")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hidden, heads, dim = 256, 4, 64
    layer = FusedHSTULayer(hidden, heads, dim, 0.0, gate_kernel="cuda").to(dev)
    with torch.no_grad():
        layer.out_proj.bias.uniform_(-1.0, 1.0)
    attn, x, g = _jagged_batch(dev, hidden)
    gemms = []
    real_gemm = fused_mod._residual_gemm
    monkeypatch.setattr(
        fused_mod, "_residual_gemm", lambda *a: gemms.append(a[0].device.type) or real_gemm(*a)
    )
    ops = []
    real_op = torch.ops.hstu_lnmd.residual_gemm
    monkeypatch.setitem(
        fused_mod._elementwise_state["ops"],
        "residual_gemm",
        lambda *a: ops.append(tuple(a[1].shape)) or real_op(*a),
    )
    results = []
    for on in (True, False):
        layer.residual_gemm = on
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results.append(_run(layer, x, attn, g))
    assert gemms == ["cuda"]  # the GEMM path ran with the switch on, and only then
    assert ops == [(x.shape[0], heads * dim + 8)]  # through the op, on [y | 1 | 0]
    (out_on, g_on), (out_off, g_off) = results
    assert out_on.dtype == torch.float32
    proj = out_off - x
    assert float((out_on - out_off).abs().max()) <= float(proj.abs().max()) * 2**-7 + 1e-6
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), name


def test_u_silu_in_the_gate_kernels_matches_unfused_cpu(monkeypatch):
    """With both the SiLU and the gate kernels (their PyTorch twins on CPU) and an
    extension that has silu_chunk_major_backward_into, u's SiLU moves into the gating ops: the
    SiLU op computes v, q, k only (first_block=1), the gating ops get z's u block with
    u_silu=True, the gating backward writes dz's u block (du_out) and the SiLU backward fills
    the rest. Matches the unfused layer for every recompute option, and an empty batch."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    calls = {"first_block": [], "u_silu": [], "into": 0}

    def silu_fwd(z, first_block=0):
        calls["first_block"].append(first_block)
        return lnmd.reference_silu_chunk_major(z, first_block)

    def gate_fwd(*args, u_silu=False, **kw):
        calls["u_silu"].append(u_silu)
        return lnmd.reference_fwd(*args, u_silu=u_silu, **kw)

    def into(dv, dq, dk, z, dz, bias_grad):
        calls["into"] += 1
        return lnmd.reference_silu_chunk_major_backward_into(dv, dq, dk, z, dz, bias_grad)

    monkeypatch.setattr(
        fused_mod,
        "_silu_ops",
        lambda x, inner: (silu_fwd, lnmd.reference_silu_chunk_major_backward),
    )
    monkeypatch.setattr(
        fused_mod, "_gate_ops", lambda mode, x, inner: (gate_fwd, lnmd.reference_bwd)
    )
    monkeypatch.setattr(
        fused_mod,
        "_elementwise_ops",
        lambda x, name: into if name == "silu_chunk_major_backward_into" else None,
    )
    _match_every_recompute_option(seed=6)
    assert calls["into"] == len(RECOMPUTE)
    assert set(calls["first_block"]) == {1} and set(calls["u_silu"]) == {True}
    _, fused = _pair(recompute=(True, True))
    empty = torch.zeros(0, HIDDEN)
    out_f, g_f = _run(fused, empty, _layout([0, 0]), empty)
    assert out_f.shape == (0, HIDDEN) and torch.count_nonzero(g_f["uvqk.bias"]) == 0


def test_u_silu_twins_equal_the_unfused_kernels_path():
    """The twins with u before its SiLU (u_silu) give the same y, dx, dweight, dbias as with u =
    SiLU(z_u) rounded, and write exactly the u block the SiLU backward twin writes from du; the
    _into twin fills the other blocks and sums all four."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    torch.manual_seed(0)
    t, hd = 13, 16
    z = (torch.randn(t, 4 * hd) * 3).to(torch.bfloat16)
    x = torch.randn(t, hd).to(torch.bfloat16)
    dy = torch.randn(t, hd).to(torch.bfloat16)
    w, b = torch.randn(hd), torch.randn(hd)
    act = lnmd.reference_silu_chunk_major(z)
    assert torch.equal(lnmd.reference_silu_chunk_major(z, 1), act[1:])
    y, mean, rstd = lnmd.reference_fwd(x, act[0], w, b, 1e-5, 0.25, 3, 4)
    y2, mean2, rstd2 = lnmd.reference_fwd(x, z[:, :hd], w, b, 1e-5, 0.25, 3, 4, u_silu=True)
    assert torch.equal(y, y2) and torch.equal(mean, mean2) and torch.equal(rstd, rstd2)
    ref = lnmd.reference_bwd(dy, x, act[0], w, b, mean, rstd, 0.25, 3, 4, True)
    dz = torch.full_like(z, float("nan"))
    got = lnmd.reference_bwd(
        dy, x, z[:, :hd], w, b, mean, rstd, 0.25, 3, 4, True, u_silu=True, du_out=dz[:, :hd]
    )
    for i in (0, 2, 3, 4):
        assert torch.equal(got[i], ref[i]), i
    assert got[1].numel() == 0
    grads = [torch.randn(t, hd).to(torch.bfloat16) for _ in range(3)]
    dz_ref, dbias_ref = lnmd.reference_silu_chunk_major_backward(ref[1], *grads, z, True)
    dbias = lnmd.reference_silu_chunk_major_backward_into(*grads, z, dz, True)
    assert torch.equal(dz, dz_ref) and torch.equal(dbias, dbias_ref)


def test_fused_silu_kernel_path_matches_unfused_cpu(monkeypatch):
    """The SiLU-kernel code path of the Function (chunk-major forward, one backward pass that
    also returns the uvqk bias gradient), run on CPU with the kernels' PyTorch twins in place of
    the CUDA ops: matches the unfused layer for every recompute option, alone and together with
    the gate-kernel path, and the twins receive [T, H*d] gradient rows."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    seen = []

    def bwd_twin(du, dv, dq, dk, z, bias_grad):
        seen.append([tuple(g.shape) for g in (du, dv, dq, dk)] + [bias_grad])
        return lnmd.reference_silu_chunk_major_backward(du, dv, dq, dk, z, bias_grad)

    monkeypatch.setattr(
        fused_mod, "_silu_ops", lambda x, inner: (lnmd.reference_silu_chunk_major, bwd_twin)
    )
    t, attn, x, g = _match_every_recompute_option(seed=5)
    assert len(seen) == len(RECOMPUTE)
    assert seen[0] == [(t, HEADS * DIM)] * 4 + [True]
    monkeypatch.setattr(
        fused_mod, "_gate_ops", lambda mode, x, inner: (lnmd.reference_fwd, lnmd.reference_bwd)
    )
    ref, fused = _pair(recompute=(False, True))
    _assert_match(_run(ref, x, attn, g), _run(fused, x, attn, g))
    # an empty batch through the kernel path: zero gradients of the right shapes
    _, fused = _pair(recompute=(True, True))
    out_f, g_f = _run(fused, x[:0], _layout([0, 0]), g[:0])
    assert out_f.shape == (0, HIDDEN) and torch.count_nonzero(g_f["uvqk.bias"]) == 0


def test_silu_kernel_selection_and_gradient_rows(monkeypatch):
    """_silu_ops: None on CPU and for fp32 activations; a layer built with
    elementwise_kernels=False does not ask for them; _kernel_rows hands the kernel views where
    the layout allows and aligned contiguous copies where it does not."""
    x = torch.zeros(3, HIDDEN)
    assert fused_mod._silu_ops(x, HEADS * DIM) is None
    assert fused_mod._cast_op(x, HIDDEN) is None
    asked = []
    for name in ("_silu_ops", "_cast_op", "_ln_ops"):
        monkeypatch.setattr(fused_mod, name, lambda *a, name=name: asked.append(name))
    attn = _layout([3])
    FusedHSTULayer(HIDDEN, HEADS, DIM, elementwise_kernels=False)(x, attn)
    assert asked == []
    FusedHSTULayer(HIDDEN, HEADS, DIM, layernorm_kernel=False)(x, attn)
    assert asked == ["_silu_ops", "_cast_op"]
    FusedHSTULayer(HIDDEN, HEADS, DIM)(x, attn)
    assert asked[2:] == ["_silu_ops", "_cast_op", "_ln_ops"]
    base = torch.randn(5, 2, 16)
    rows = fused_mod._kernel_rows(base, 5, 32, torch.float32)
    assert rows.shape == (5, 32) and rows.data_ptr() == base.data_ptr()  # a view
    block = torch.randn(5, 64)[:, 16:48]  # row stride 64, 16 elements in: a view too
    assert fused_mod._kernel_rows(block, 5, 32, torch.float32).data_ptr() == block.data_ptr()
    odd = torch.randn(5, 37)[:, 1:33]  # row stride 37 (not a multiple of 8): copied
    copied = fused_mod._kernel_rows(odd, 5, 32, torch.bfloat16)
    assert copied.is_contiguous() and copied.dtype == torch.bfloat16
    assert torch.equal(copied, odd.to(torch.bfloat16))
    one_row = torch.randn(32, 2)[:, :1].t()  # T = 1 with a column stride of 2: copied
    assert fused_mod._kernel_rows(one_row, 1, 32, torch.float32).stride(1) == 1
    shifted = torch.randn(161)[1:].view(5, 32)  # 4 bytes past an aligned start: copied aligned
    fixed = fused_mod._kernel_rows(shifted, 5, 32, torch.float32)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and the compiled HSTU attention kernel")
@pytest.mark.parametrize("recompute", [(False, False), (True, True)])
def test_fused_silu_kernel_vs_aten_path_cuda(recompute):
    """bf16 autocast: the layer with the chunk-major SiLU and input LayerNorm kernels (selected:
    `_silu_ops` / `_ln_ops` are not None) vs the same layer on the aten SiLU path and compiled
    LayerNorm stages: output within 2e-2 abs + rel, every gradient
    within 1% relative L2 (the kernels differ from aten by at most a rounding step per element),
    and both within the unfused tolerances of the reference layer."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    if not lnmd.load_extension() or not hasattr(torch.ops.hstu_lnmd, "silu_chunk_major"):
        pytest.skip("the lnmd extension with the SiLU ops is not built")
    heads, dim = 4, 64
    ref, fused, attn, x, g = _cuda_layers_and_batch(heads, dim, recompute)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fused_mod._silu_ops(x, heads * dim) is not None
        assert fused_mod._ln_ops(x, x.shape[1]) is not None  # the input LayerNorm kernels too
        res_k = _run(fused, x, attn, g)
        fused.zero_grad()
        fused.elementwise_kernels = False  # NetworkArgs.fused_elementwise_kernels=False
        res_a = _run(fused, x, attn, g)
        res_r = _run(ref, x, attn, g)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))

    torch.testing.assert_close(res_k[0], res_a[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(res_k[0], res_r[0], atol=2e-2, rtol=2e-2)
    for name in res_a[1]:
        assert rel(res_k[1][name], res_a[1][name]) < 1e-2, (
            name,
            rel(res_k[1][name], res_a[1][name]),
        )
        assert rel(res_k[1][name], res_r[1][name]) < 3e-2, (
            name,
            rel(res_k[1][name], res_r[1][name]),
        )


def test_fused_cast_kernel_path_cpu_autocast(monkeypatch):
    """The cast_colsum code path of the backward (fp32 residual stream, bf16 matmuls), run on
    CPU under bf16 autocast with the op's twin: the twin receives the fp32 gradient as aligned
    [T, D] rows (a contiguous copy of a column-major one), every gradient equals the aten path's
    (a cast, then a sum of the cast) except the output bias, which now sums the fp32 values."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    seen = []

    def cast_twin(dout, dtype):
        seen.append((dout.dtype, dtype, dout.is_contiguous()))
        return lnmd.reference_cast_colsum(dout, dtype)

    attn = _layout([7, 1, 12], targets=[2, 0, 3])
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(20, HIDDEN, generator=gen)
    g = torch.randn(HIDDEN, 20, generator=gen).t()  # column-major
    results = []
    for use_op in (False, True):
        if use_op:
            monkeypatch.setattr(fused_mod, "_cast_op", lambda x, hidden: cast_twin)
        _, fused = _pair(recompute=(True, True))
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused(xi, attn)
        assert out.dtype == torch.float32
        out.backward(g)
        grads = {n: p.grad.clone() for n, p in fused.named_parameters()}
        results.append((out.detach(), grads, xi.grad.clone()))
    assert seen == [(torch.float32, torch.bfloat16, True)]
    (out_a, g_a, dx_a), (out_k, g_k, dx_k) = results
    torch.testing.assert_close(out_k, out_a, atol=0, rtol=0)
    torch.testing.assert_close(dx_k, dx_a, atol=0, rtol=0)
    for name in g_a:
        if name == "out_proj.bias":
            torch.testing.assert_close(g_k[name], g.sum(0), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(g_k[name], g_a[name], atol=5e-2, rtol=1e-2)
        else:
            torch.testing.assert_close(g_k[name], g_a[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("recompute", [(False, False), (True, False)])
def test_fused_input_layernorm_kernel_path_cpu_autocast(monkeypatch, recompute):
    """The ln_fwd / ln_bwd code path of the fused layer (fp32 residual stream, bf16 matmuls), run
    on CPU under bf16 autocast with the ops' twins: the backward hands them the fp32 output
    gradient as aligned [T, D] rows (a contiguous copy of a column-major one) and the [T] row
    statistics; output and every gradient match the stage path's (the same fp32 math in another
    op order: within 1e-5)."""
    from hstu.modules import layer_norm_mul_dropout as lnmd

    seen = []

    def bwd_twin(dn, x, mean, rstd, w, dres):
        seen.append((dn.dtype, mean.shape, dres.dtype, dres.is_contiguous()))
        return lnmd.reference_ln_bwd(dn, x, mean, rstd, w, dres)

    attn = _layout([7, 1, 12], targets=[2, 0, 3])
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(20, HIDDEN, generator=gen)
    g = torch.randn(HIDDEN, 20, generator=gen).t()  # column-major
    results = []
    for use_op in (False, True):
        if use_op:
            monkeypatch.setattr(
                fused_mod, "_ln_ops", lambda x, hidden: (lnmd.reference_ln_fwd, bwd_twin)
            )
        _, fused = _pair(recompute=recompute)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused(xi, attn)
        out.backward(g)
        grads = {n: p.grad.clone() for n, p in fused.named_parameters()}
        results.append((out.detach(), grads, xi.grad.clone()))
    assert seen == [(torch.bfloat16, (20,), torch.float32, True)]
    (out_a, g_a, dx_a), (out_k, g_k, dx_k) = results
    torch.testing.assert_close(out_k, out_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_k, dx_a, atol=1e-5, rtol=1e-5)
    for name in g_a:
        torch.testing.assert_close(g_k[name], g_a[name], atol=1e-4, rtol=1e-4, msg=name)


def test_serving_project_and_finish_equal_the_fused_forward():
    """Eval without grad (hstu.inference.kv_cache's path): project -> attend -> finish runs the
    fused forward's own steps and gives its output; with grad enabled they are `HSTULayer`'s
    autograd ops and gradients flow."""
    lengths = [5, 3, 8]
    attn = _layout(lengths, [1, 0, 2], [2, 1, 3])
    _, fused = _pair()
    fused.eval()
    x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = fused(x, attn)
        u, v, q, k = fused.project(x)
        got = fused.finish(x, fused.attend(q, k, v, attn), u)
    assert all(t.is_contiguous() for t in (u, v, q, k))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    xi = x.clone().requires_grad_(True)
    u, v, q, k = fused.project(xi)
    fused.finish(xi, fused.attend(q, k, v, attn), u).sum().backward()
    assert xi.grad is not None and fused.uvqk.weight.grad is not None


def test_serving_weight_casts_are_kept_until_the_weights_change():
    _, fused = _pair()
    fused.eval()
    x = torch.randn(4, HIDDEN)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused.project(x)
        w, b = fused._serving_weights("uvqk", torch.bfloat16)
        assert w.dtype == torch.bfloat16
        assert fused._serving_weights("uvqk", torch.bfloat16)[0] is w  # kept
        fused.uvqk.weight.add_(1.0)  # e.g. an optimizer step or a checkpoint load
        w2, _ = fused._serving_weights("uvqk", torch.bfloat16)
    assert w2 is not w
    torch.testing.assert_close(w2, fused.uvqk.weight.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_layer_ops_are_chosen_once_per_layer_and_input_kind(monkeypatch):
    """The ops a fused layer runs are chosen at its first call for an input kind (device,
    dtypes, layout, the layer's settings) and kept: later calls do not choose again; a changed
    setting or another input dtype chooses anew; the kept choice stays beside the layer, not in
    it (a deep copy works and chooses for itself)."""
    import copy

    calls = []
    real = fused_mod._gate_ops
    monkeypatch.setattr(
        fused_mod, "_gate_ops", lambda mode, x, inner: calls.append(mode) or real(mode, x, inner)
    )
    _, fused = _pair()
    attn = _layout([5, 3])
    x = torch.randn(8, HIDDEN)
    out1 = fused(x, attn)
    out2 = fused(x, attn)
    assert len(calls) == 1 and torch.equal(out1, out2)
    fused(x.double().float(), attn)  # same kind of input
    assert len(calls) == 1
    fused.gate_kernel = "compiled"
    fused(x, attn)
    assert calls == ["auto", "compiled"]
    twin = copy.deepcopy(fused)
    assert "_ops_cache" not in twin.__dict__
    torch.testing.assert_close(twin(x, attn), fused(x, attn))
    assert len(calls) == 3  # the copy chose for itself


def test_weight_grad_off_cuda_is_the_cast_product_and_ignores_destinations():
    """Off CUDA (no fp32-output GEMM there) a weight gradient is the product in the operands'
    dtype cast to the parameter's; a destination named for the parameter is not written, and
    the destinations are gone after the block, also when it raises."""
    torch.manual_seed(0)
    a = torch.randn(8, 16).bfloat16()
    b = torch.randn(16, 4).bfloat16()
    w = nn.Parameter(torch.zeros(8, 4))
    buf = torch.full((8, 4), 7.0)
    with fused_mod.weight_grads_into({id(w): buf}):
        g = fused_mod._weight_grad(a, b, w)
    assert g.dtype == torch.float32 and g.data_ptr() != buf.data_ptr()
    torch.testing.assert_close(g, (a @ b).float(), atol=0, rtol=0)
    assert bool((buf == 7.0).all())
    with pytest.raises(RuntimeError, match="inside"):
        with fused_mod.weight_grads_into({id(w): buf}):
            raise RuntimeError("inside")
    assert not fused_mod._grad_destinations


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_grad_cuda_is_one_fp32_gemm_into_its_destination(dtype):
    """On CUDA the gradient of an fp32 weight from 16-bit operands comes out of the GEMM in fp32:
    the fp32 product of the (transposed) operands within fp32 accumulation error, closer to it
    than the 16-bit product cast; with a destination it is written there and returned as is."""
    if not fused_mod._has_mm_out_dtype():
        pytest.skip("this torch has no aten::mm.dtype")
    torch.manual_seed(0)
    dz = torch.randn(3000, 512, device="cuda", dtype=dtype)
    n = torch.randn(3000, 256, device="cuda", dtype=dtype)
    w = nn.Parameter(torch.zeros(512, 256, device="cuda"))
    exact = dz.double().t() @ n.double()
    g = fused_mod._weight_grad(dz.t(), n, w)
    assert g.dtype == torch.float32 and g.shape == w.shape
    err = (g.double() - exact).norm() / exact.norm()
    err_cast = ((dz.t() @ n).double() - exact).norm() / exact.norm()
    assert err < 1e-5 and err < err_cast, (float(err), float(err_cast))
    buf = torch.full_like(w, float("nan"))
    with fused_mod.weight_grads_into({id(w): buf}):
        g2 = fused_mod._weight_grad(dz.t(), n, w)
    assert g2.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, g, atol=0, rtol=0)
