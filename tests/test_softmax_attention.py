"""The SASRec-style softmax attention baseline (NetworkArgs.attention_type="softmax").

Checked against a brute-force per-sequence softmax that spells out the mask rules pair by pair,
forward and backward, and wired through the layer, the builder and the config.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hstu.config.args import NetworkArgs
from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples, load_sequence_data
from hstu.models.builder import build_model
from hstu.modules.hstu_layer import AttentionInputs, HSTULayer
from hstu.modules.softmax_attention import softmax_attention
from hstu.ops.reference import hstu_attention, hstu_attention_mask


def _pair_ok(i: int, j: int, n: int, c: int, t: int, g: int, w: int) -> bool:
    """docs/design.md's mask for one pair, written out literally (independent of the reference)."""
    h = n - t
    pid = (lambda p: max(p - c + 1, 0)) if c > 0 else (lambda p: p)
    ok = i == j or pid(i) > pid(j)
    if i >= h and j >= h and (i - h) // g != (j - h) // g:
        ok = False
    if w > 0 and pid(i) - pid(j) > w:
        ok = False
    return ok or (c > 0 and pid(i) == 0 and j < h)


def _brute_force(q, k, v, offsets, ctx, tgt, g, w, scale):
    """Per sequence, per query: softmax over the valid keys only (float64, differentiable)."""
    rows = []
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        c = int(ctx[b]) if ctx is not None else 0
        t = int(tgt[b]) if tgt is not None else 0
        for i in range(e - s):
            keys = [j for j in range(e - s) if _pair_ok(i, j, e - s, c, t, g, w)]
            idx = torch.tensor(keys) + s
            logits = scale * (q[s + i].unsqueeze(1) * k[idx].transpose(0, 1)).sum(-1)  # [H, n]
            p = torch.softmax(logits, dim=-1)
            rows.append((p.unsqueeze(-1) * v[idx].transpose(0, 1)).sum(1))  # [H, Dv]
    if not rows:
        return q.new_zeros((0, q.shape[1], v.shape[2]))
    return torch.stack(rows)


def _inputs(lengths, h=2, d=4, dv=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    total = int(offsets[-1])
    q, k = (torch.randn(total, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(total, h, dv, generator=gen, dtype=torch.float64)
    return q, k, v, offsets


CASES = [
    # lengths, contexts, targets, target_group_size, window
    ([5, 0, 1, 7], None, None, 1, 0),
    ([6, 3, 9], [2, 0, 1], None, 1, 0),
    ([8, 4, 1], [1, 1, 0], [3, 1, 0], 1, 0),
    ([9, 7], [2, 0], [4, 3], 2, 0),
    ([10, 6, 2], [1, 0, 0], [2, 0, 1], 1, 3),
]


@pytest.mark.parametrize("lengths,ctx,tgt,g,w", CASES)
def test_matches_brute_force_forward_and_backward(lengths, ctx, tgt, g, w):
    q, k, v, offsets = _inputs(lengths)
    ctx_t = None if ctx is None else torch.tensor(ctx)
    tgt_t = None if tgt is None else torch.tensor(tgt)
    n = max(lengths)
    scale = 0.7
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = softmax_attention(
        *leaves,
        offsets,
        n,
        num_contexts=ctx_t,
        num_targets=tgt_t,
        target_group_size=g,
        window_size=w,
        alpha=scale,
    )
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = _brute_force(*ref_leaves, offsets, ctx_t, tgt_t, g, w, scale)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    (out * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    for name, a, b in zip("qkv", leaves, ref_leaves):
        assert torch.isfinite(a.grad).all(), name  # padding rows must not leak NaN
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=f"d{name}")


def test_brute_force_mask_equals_the_reference_mask():
    """The literal pair rules above are the reference's mask (so both attentions see one mask)."""
    lengths = torch.tensor([9, 7, 3])
    ctx, tgt = torch.tensor([2, 0, 1]), torch.tensor([4, 3, 0])
    for g, w in [(1, 0), (2, 0), (1, 2)]:
        mask = hstu_attention_mask(lengths, 9, ctx, tgt, g, w)
        for b, n in enumerate(lengths.tolist()):
            want = torch.tensor(
                [
                    [_pair_ok(i, j, n, int(ctx[b]), int(tgt[b]), g, w) for j in range(n)]
                    for i in range(n)
                ]
            )
            assert torch.equal(mask[b, :n, :n], want), (b, g, w)


def test_defaults_scale_and_rows_sum_to_one():
    q, k, v, offsets = _inputs([6, 4], d=16, dv=1)
    ones = torch.ones_like(v)
    out = softmax_attention(q, k, ones, offsets, 6)
    torch.testing.assert_close(out, ones)  # convex combination of ones
    want = _brute_force(q, k, v, offsets, None, None, 1, 0, 1.0 / math.sqrt(16))
    torch.testing.assert_close(softmax_attention(q, k, v, offsets, 6), want)
    # scaling_seqlen is HSTU-only and has no effect here
    torch.testing.assert_close(softmax_attention(q, k, v, offsets, 6, scaling_seqlen=3), want)
    # first token sees only itself
    torch.testing.assert_close(out[0], ones[0])
    torch.testing.assert_close(softmax_attention(q, k, v, offsets, 6)[0], v[0])


def test_float32_and_input_checks():
    q, k, v, offsets = _inputs([5, 2])
    out = softmax_attention(q.float(), k.float(), v.float(), offsets, 5)
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="max_seqlen"):
        softmax_attention(q, k, v, offsets, 4)
    with pytest.raises(ValueError, match="seq_offsets"):
        softmax_attention(q, k, v, torch.tensor([0, 5, 6]), 5)


def _layer_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, 5, 8])
    x = torch.randn(8, 16, generator=gen)
    return x, AttentionInputs(seq_offsets=offsets, max_seqlen=5)


def test_layer_switch_changes_only_the_attention():
    x, attn = _layer_inputs()
    torch.manual_seed(0)
    hstu_layer = HSTULayer(16, num_heads=2, head_dim=8, attention_type="hstu")
    torch.manual_seed(0)
    soft_layer = HSTULayer(16, num_heads=2, head_dim=8, attention_type="softmax")
    for a, b in zip(hstu_layer.state_dict().values(), soft_layer.state_dict().values()):
        assert torch.equal(a, b)  # no parameters of its own: same seeded weights
    y_soft = soft_layer(x, attn)
    assert not torch.allclose(y_soft, hstu_layer(x, attn))
    # recompute the layer by hand with the softmax attention: the only swapped piece
    t, h, d = 8, 2, 8
    u, v, q, k = torch.split(
        torch.nn.functional.silu(soft_layer.uvqk(soft_layer.input_norm(x))), h * d, dim=-1
    )
    a = softmax_attention(
        q.reshape(t, h, d), k.reshape(t, h, d), v.reshape(t, h, d), attn.seq_offsets, 5
    ).reshape(t, h * d)
    want = x + soft_layer.out_proj(soft_layer.attn_norm(a) * u)
    torch.testing.assert_close(y_soft, want)
    # and the HSTU path still calls the HSTU reference
    a_h = hstu_attention(
        q.reshape(t, h, d), k.reshape(t, h, d), v.reshape(t, h, d), attn.seq_offsets, 5
    ).reshape(t, h * d)
    torch.testing.assert_close(
        hstu_layer(x, attn), x + hstu_layer.out_proj(hstu_layer.attn_norm(a_h) * u)
    )


def test_causal_future_tokens_do_not_leak():
    x, attn = _layer_inputs()
    layer = HSTULayer(16, num_heads=2, head_dim=8, attention_type="softmax")
    y = layer(x, attn)
    x2 = x.clone()
    x2[3] += 5.0  # token 3 of sequence 0
    y2 = layer(x2, attn)
    torch.testing.assert_close(y2[:3], y[:3])
    torch.testing.assert_close(y2[5:], y[5:])  # other sequence untouched
    assert not torch.allclose(y2[3:5], y[3:5])


def test_bad_attention_type_names_the_binding():
    with pytest.raises(ValueError, match=r"NetworkArgs\.attention_type='flash'.*'hstu', 'softmax'"):
        NetworkArgs(attention_type="flash")
    with pytest.raises(ValueError, match=r"NetworkArgs\.attention_type='flash'"):
        HSTULayer(16, num_heads=2, head_dim=8, attention_type="flash")


def test_builder_passes_attention_type_and_the_baseline_learns():
    bindings = [
        "DatasetArgs.synthetic_num_users=120",
        "DatasetArgs.synthetic_num_items=60",
        "DatasetArgs.max_history_seqlen=16",
        "NetworkArgs.hidden_dropout=0.0",
        "RetrievalArgs.num_negatives=16",
    ]
    models = {}
    for att in ("hstu", "softmax"):
        cfg = load_config("retrieval", [], [*bindings, f"NetworkArgs.attention_type='{att}'"])
        data = load_sequence_data(cfg.dataset, num_tasks=8)
        splits = build_samples(data, cfg.dataset, "retrieval")
        models[att] = build_model(cfg, data)
    assert [layer.attention_type for layer in models["softmax"].encoder.layers] == ["softmax"] * 2
    assert [layer.attention_type for layer in models["hstu"].encoder.layers] == ["hstu"] * 2
    hs, ss = models["hstu"].state_dict(), models["softmax"].state_dict()
    for name, value in hs.items():
        if isinstance(value, torch.Tensor) and "embedding_collection" not in name:
            assert torch.equal(value, ss[name]), name  # identical dense init
    model = models["softmax"]
    batch = splits.train.collate(list(range(16)))
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "embedding" not in n], 5e-3)
    losses = []
    for _ in range(30):
        torch.manual_seed(0)  # same negatives every step: a fixed problem
        out = model(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_fused_layer_runs_the_softmax_baseline_like_the_unfused_layer():
    fused_mod = pytest.importorskip("hstu.modules.fused_hstu_layer")
    x, attn = _layer_inputs()
    torch.manual_seed(0)
    plain = HSTULayer(16, num_heads=2, head_dim=8, attention_type="softmax").eval()
    fused = fused_mod.FusedHSTULayer(16, num_heads=2, head_dim=8, attention_type="softmax").eval()
    fused.load_state_dict(plain.state_dict())
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [plain(xs[0], attn), fused(xs[1], attn)]
    torch.testing.assert_close(ys[1], ys[0])
    for y in ys:
        y.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
