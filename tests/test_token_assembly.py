"""The preprocessor's token assembly: the host index arrays and the PyTorch twin against the
preprocessor's own ops (CPU), the compiled kernels against the twin (`-m gpu`): x bit for bit
(dropout masks included: both draw them from the same Philox seed), every gradient, determinism,
the preprocessor with and without the kernels, and the ops' input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.modules import layer_norm_mul_dropout as lnmd
from hstu.modules import token_assembly as ta
from hstu.modules.preprocessor import (
    HostLengths,
    SequencePreprocessor,
    _host_layout,
    _index_layout,
    padded_token_count,
)


def _case(seed=0, b=6, f=2, d=64, bits=3, max_hist=40, max_cand=4, pad=True, device="cpu"):
    """(preprocessor, layout, tensors) of a random jagged batch: histories of 0..max_hist items,
    0..max_cand candidates, ``f`` contextual tokens per sample, the token layout with the
    kernels' arrays; values, contextual tokens and action words random."""
    gen = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, max_hist + 1, (b,), generator=gen)
    cand = torch.randint(0, max_cand + 1, (b,), generator=gen)
    items = hist + cand
    host = HostLengths(items=items, history=hist, candidates=cand)
    max_pos = max_hist + 1
    num_tokens = int((items + f).sum())
    rows = padded_token_count(num_tokens) if pad else num_tokens
    max_seqlen = int((items + f).max())
    sizes = (host, num_tokens, max_seqlen, bool((cand > 0).any()), rows)
    dev = torch.device(device)
    prep = _host_layout(sizes, f, max_pos, False, True)
    lay = _index_layout(prep, dev)
    pre = SequencePreprocessor(d, bits, max_pos, f, dropout=0.0).to(dev)
    with torch.no_grad():
        pre.history_embedding.normal_(generator=None)
    n = int(items.sum())
    values = torch.randn(n, d, generator=gen).to(dev)
    actions = torch.randint(-5, 1 << (bits + 2), (int(hist.sum()),), generator=gen).to(dev)
    contextual = [torch.randn(b, d, generator=gen).to(dev) for _ in range(f)]
    return pre, lay, rows, num_tokens, values, actions, contextual


def _reference(pre, lay, rows, values, actions, contextual, p=0.0, seed=0, offset=0, scale=1.0):
    return ta.reference_assemble(
        rows, values, scale, pre.position_embedding.weight, lay.position_ids,
        pre.action_embedding, pre.history_embedding, actions, lay.action_index, lay.dest,
        lay.ctx_rows, contextual, p, seed, offset,
    )  # fmt: skip


def test_host_token_index_arrays():
    _, lay, rows, num_tokens, values, _, _ = _case(seed=3)
    row_src = lay.row_src.numpy()
    dest = lay.dest.numpy()
    n = dest.shape[0]
    assert row_src.shape == (rows,)
    assert np.array_equal(row_src[dest], np.arange(n))  # each item's row names it
    ctx = lay.ctx_rows.numpy()
    assert np.array_equal(row_src[ctx], -2 - np.arange(ctx.shape[0]))
    assert (row_src[num_tokens:] == -1).all() and (row_src[:num_tokens] != -1).all()
    # items grouped by position id, in item order within a position
    pos_ids = lay.position_ids.numpy()
    order, offs = lay.pos_order.numpy(), lay.pos_offsets.numpy()
    assert sorted(order.tolist()) == list(range(n))
    for p in range(offs.shape[0] - 1):
        seg = order[offs[p] : offs[p + 1]]
        assert (pos_ids[seg] == p).all() and (np.diff(seg) > 0).all()
    assert offs[-1] == n
    # action_index numbers the history items in order, -1 for candidates
    is_hist = lay.is_history.numpy()
    act = lay.action_index.numpy()
    assert np.array_equal(act[is_hist], np.arange(int(is_hist.sum())))
    assert (act[~is_hist] == -1).all()
    idx = lay.token_index()
    assert idx.row_src is lay.row_src and idx.pos_ids is lay.position_ids
    assert idx.ctx_rows is lay.ctx_rows
    # without contextual tokens: an empty index tensor; without the arrays: a clear error
    assert _case(seed=3, f=0)[1].token_index().ctx_rows.shape == (0,)
    one = torch.tensor([2])
    host = HostLengths(items=one, history=one, candidates=torch.tensor([0]))
    bare = _index_layout(_host_layout((host, 2, 2, False, 2), 0, 3, False), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without the token-assembly arrays"):
        bare.token_index()


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_twin_equals_the_preprocessor_ops(scale):
    """Without dropout the twin's x is the PyTorch path's bit for bit; gradients agree."""
    pre, lay, rows, num_tokens, values, actions, contextual = _case(seed=1)
    pre.item_scale = scale
    leaves = [values, *contextual]
    outs = []
    for fn in ("ops", "twin"):
        ins = [t.clone().requires_grad_(True) for t in leaves]
        pre.zero_grad(set_to_none=True)
        if fn == "ops":
            x = pre._assemble(lay, ins[0], actions, ins[1:], rows, num_tokens)
        else:
            x = _reference(pre, lay, rows, ins[0], actions, ins[1:], scale=scale)
        dx = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
        x.backward(dx)
        grads = [t.grad for t in ins] + [
            p.grad for p in (pre.position_embedding.weight, pre.action_embedding,
                             pre.history_embedding)
        ]  # fmt: skip
        outs.append((x.detach(), grads))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_twin_dropout_uses_the_kernel_mask():
    pre, lay, rows, _, values, actions, contextual = _case(seed=2)
    plain = _reference(pre, lay, rows, values, actions, contextual)
    dropped = _reference(pre, lay, rows, values, actions, contextual, 0.25, 7, 12)
    keep = lnmd.keep_mask(7, 12, rows, values.shape[1], 0.25)
    _, scale = lnmd.dropout_threshold(0.25)
    assert torch.equal(dropped, plain * keep * scale)
    assert 0.2 < 1 - keep.float().mean() < 0.3


def test_cpu_layout_has_no_kernel_arrays_and_limits():
    pre = SequencePreprocessor(64, 3, 41, 2)
    assert not pre._kernel_tokens(torch.device("cpu"))
    assert ta.max_action_bits(1024) == 23 and ta.max_action_bits(64) == 383
    assert ta.supported(1024, 12) and not ta.supported(1024, 24) and not ta.supported(50, 3)
    assert not SequencePreprocessor(64, 3, 41, 2, fused_tokens=False)._kernel_tokens(
        torch.device("cuda")
    )


# ---- the compiled kernels (GPU) --------------------------------------------------------------


def _needs_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not ta.kernel_available():
        pytest.skip("needs the hstu_lnmd extension built with the token-assembly ops")


def _kernel(pre, lay, rows, values, actions, contextual, p=0.0, seed=0, offset=0, scale=1.0):
    return ta._Tokens.apply(
        lay.token_index(), (p, seed, offset, None), scale, values, pre.position_embedding.weight,
        pre.action_embedding, pre.history_embedding, actions, *contextual,
    )  # fmt: skip


def _grads(pre, fn, leaves, dx):
    ins = [t.detach().clone().requires_grad_(True) for t in leaves]
    pre.zero_grad(set_to_none=True)
    x = fn(ins)
    x.backward(dx)
    params = (pre.position_embedding.weight, pre.action_embedding, pre.history_embedding)
    return x.detach(), [t.grad for t in ins] + [p.grad for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "f", "bits", "p", "scale"),
    [
        (64, 2, 3, 0.0, 1.0),
        (64, 0, 1, 0.1, 8.0),
        (40, 3, 8, 0.3, 1.0),
        (1024, 2, 8, 0.1, 32.0),
        (2048, 1, 11, 0.0, 1.0),
    ],
)
def test_kernel_matches_twin(d, f, bits, p, scale):
    _needs_kernel()
    pre, lay, rows, _, values, actions, contextual = _case(
        seed=d + bits, d=d, f=f, bits=bits, max_hist=300, device="cuda"
    )
    dx = torch.randn(rows, d, device="cuda")
    leaves = [values, *contextual]
    got_x, got = _grads(
        pre, lambda t: _kernel(pre, lay, rows, t[0], actions, t[1:], p, 11, 4, scale), leaves, dx
    )
    ref_x, ref = _grads(
        pre, lambda t: _reference(pre, lay, rows, t[0], actions, t[1:], p, 11, 4, scale),
        leaves, dx,
    )  # fmt: skip
    assert torch.equal(got_x, ref_x)
    names = ["values"] + [f"ctx{i}" for i in range(f)] + ["pos", "action", "history"]
    for name, a, b in zip(names, got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * max(1.0, b.abs().max().item()),
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


@pytest.mark.gpu
def test_kernel_backward_is_deterministic_and_padding_rows_get_nothing():
    _needs_kernel()
    pre, lay, rows, num_tokens, values, actions, contextual = _case(
        seed=9, d=256, bits=8, max_hist=500, device="cuda"
    )
    dx = torch.randn(rows, 256, device="cuda")
    leaves = [values, *contextual]
    fn = lambda t: _kernel(pre, lay, rows, t[0], actions, t[1:], 0.1, 3, 8)  # noqa: E731
    x1, g1 = _grads(pre, fn, leaves, dx)
    x2, g2 = _grads(pre, fn, leaves, dx)
    assert torch.equal(x1, x2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert rows > num_tokens and not x1[num_tokens:].any()
    # a gradient on the padding rows only changes nothing
    dpad = torch.zeros_like(dx)
    dpad[num_tokens:] = 1.0
    _, gp = _grads(pre, fn, leaves, dpad)
    assert all(not g.any() for g in gp)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_preprocessor_with_and_without_the_kernel(autocast):
    """The preprocessor's forward on CUDA (no dropout): x bitwise the PyTorch path's, under
    bf16 autocast too (the action table's matmul runs in bf16 on both sides), gradients close."""
    _needs_kernel()
    pre, lay, rows, num_tokens, values, actions, contextual = _case(
        seed=4, d=128, bits=8, max_hist=200, device="cuda"
    )
    assert pre._kernel_tokens(torch.device("cuda"))
    dx = torch.randn(rows, 128, device="cuda")
    leaves = [values, *contextual]
    results = []
    for kernel in (True, False):

        def fn(t, kernel=kernel):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                if kernel:
                    return pre._assemble_kernel(lay, t[0], actions, t[1:], actions.shape[0])
                return pre._assemble(lay, t[0], actions, t[1:], rows, num_tokens)

        results.append(_grads(pre, fn, leaves, dx))
    assert torch.equal(results[0][0], results[1][0])
    # under autocast the PyTorch path rounds the action table's gradient to bf16 first
    tol = 2e-2 if autocast else 1e-5
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


@pytest.mark.gpu
def test_kernel_ops_reject_bad_input():
    _needs_kernel()
    pre, lay, rows, _, values, actions, contextual = _case(seed=5, d=64, device="cuda")
    table = torch.zeros(8, 64, device="cuda")
    with pytest.raises(TypeError, match="values must be float32"):
        torch.ops.hstu_lnmd.tokens_fwd(
            values.double(), 1.0, pre.position_embedding.weight, lay.position_ids, table,
            actions, lay.action_index, 3, values[:0], lay.row_src, 0.0, 0, 0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="action_bits"):
        torch.ops.hstu_lnmd.tokens_fwd(
            values, 1.0, pre.position_embedding.weight, lay.position_ids,
            torch.zeros(1 << 24, 64, device="cuda")[:0], actions, lay.action_index, 400,
            values[:0], lay.row_src, 0.0, 0, 0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="pos_ids must be a contiguous 1-D tensor of"):
        torch.ops.hstu_lnmd.tokens_fwd(
            values, 1.0, pre.position_embedding.weight, lay.position_ids[:-1],
            table, actions, lay.action_index, 3, values[:0], lay.row_src, 0.0, 0, 0,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"dropout p must be in \[0, 1\)"):
        _kernel(pre, lay, rows, values, actions, contextual, p=1.0)
    with pytest.raises(ValueError, match="action words"):
        pre._assemble_kernel(lay, values, actions[:-1], contextual, actions.shape[0])
