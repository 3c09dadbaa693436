"""CUDA graphs of the encoder (hstu.modules.graphed_encoder) and what they rest on.

CPU: keys, bounds, the metadata check and the switch. GPU (-m gpu): the device-side scaling and
dropout seed of the compiled ops equal their by-value twins bitwise; the attention op captured
with GPU metadata and a length bound replays other batches exactly as eager calls; a graphed
encoder (fused and unfused layers, relative bias, contexts and targets) gives the eager
encoder's outputs and gradients on batches of one key; dropout draws fresh masks per replay;
a graphed training run follows the eager run's losses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import needs_compiled_kernels

from hstu.config.gin_utils import ConfigError, load_config
from hstu.modules.attention_inputs import AttentionInputs
from hstu.modules.graphed_encoder import (
    SEQ_GRAIN,
    EncoderGraphs,
    GraphKey,
    fresh_parameter_leaves,
    seqlen_bound,
)
from hstu.modules.hstu_layer import HSTUEncoder


def _attn(lengths: list[int], *, rows: int | None = None, contexts: int = 0, targets=None,
          device: str = "cpu", timestamps: bool = False) -> AttentionInputs:  # fmt: skip
    lengths = list(lengths)
    total = sum(lengths)
    if rows is not None and rows > total:
        lengths.append(rows - total)  # one padding sequence
    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths), 0)
    n = len(lengths)
    ctx = None if not contexts else torch.tensor([contexts] * n, dtype=torch.int64)
    if ctx is not None and rows is not None and rows > total:
        ctx[-1] = 0
    tgt = None if targets is None else torch.tensor(list(targets) + [0] * (n - len(targets)))
    ts = None
    if timestamps:
        ts = torch.cat([torch.sort(torch.randint(0, 10**6, (n_,))).values for n_ in lengths])
    dev = torch.device(device)
    return AttentionInputs(
        seq_offsets=offs.to(dev),
        max_seqlen=max(lengths),
        num_contexts=None if ctx is None else ctx.to(dev),
        num_targets=None if tgt is None else tgt.to(dev),
        host_seq_offsets=offs,
        host_num_contexts=ctx,
        host_num_targets=tgt,
        timestamps=None if ts is None else ts.to(dev),
    )


# ---- CPU -----------------------------------------------------------------------------------------


def test_seqlen_bound_is_the_next_power_of_two_from_64():
    assert [seqlen_bound(n) for n in (0, 1, 63, 64, 65, 200, 256, 257, 4110)] == [
        64, 64, 64, 64, 128, 256, 256, 512, 8192,
    ]  # fmt: skip


def test_cuda_graphs_switch_is_a_checked_bool():
    cfg = load_config("retrieval", [], [])
    assert cfg.network.cuda_graphs is False  # opt-in
    assert (
        load_config("retrieval", [], ["NetworkArgs.cuda_graphs=True"]).network.cuda_graphs is True
    )
    with pytest.raises(ConfigError, match="cuda_graphs"):
        load_config("retrieval", [], ["NetworkArgs.cuda_graphs='yes'"])


def test_encoder_has_graphs_only_where_the_compiled_attention_runs():
    kw = dict(num_heads=2, head_dim=8)
    assert HSTUEncoder(1, 16, cuda_graphs=True, **kw).graphs is not None
    assert HSTUEncoder(1, 16, cuda_graphs=False, **kw).graphs is None
    assert HSTUEncoder(1, 16, cuda_graphs=True, reference_attention=True, **kw).graphs is None
    assert HSTUEncoder(1, 16, cuda_graphs=True, attention_type="softmax", **kw).graphs is None


def test_cpu_forward_never_uses_graphs():
    torch.manual_seed(0)
    enc = HSTUEncoder(2, 16, num_heads=2, head_dim=8, cuda_graphs=True, fused=True)
    ref = copy.deepcopy(enc)
    assert ref.graphs is not None and ref.graphs is not enc.graphs  # a fresh, empty runner
    attn = _attn([5, 9, 3], contexts=1)
    x = torch.randn(17, 16, requires_grad=True)
    torch.testing.assert_close(enc(x, attn), ref.final(ref.forward_eager(x, attn)), rtol=0, atol=0)
    assert enc.graphs.stats.replays == 0 and enc.graphs.stats.captures == 0


def test_run_off_cuda_is_eager_even_at_first_sight():
    """Keys are captured the first time they are seen; a caller that hands `run` a CPU batch
    (skipping `applies`) still gets the eager forward, counted as an eager step, no capture."""
    torch.manual_seed(0)
    enc = HSTUEncoder(2, 16, num_heads=2, head_dim=8, cuda_graphs=True, fused=True)
    assert enc.graphs.min_uses == 1
    attn = _attn([5, 9, 3], contexts=1)
    x = torch.randn(17, 16)
    out = enc.graphs.run(enc, x, attn)
    torch.testing.assert_close(out, enc.forward_eager(x, attn), rtol=0, atol=0)
    stats = enc.graphs.stats
    assert (stats.eager, stats.captures, stats.replays) == (1, 0, 0)


def test_a_replay_is_pending_while_its_autograd_node_lives():
    """`_replay_pending` (a call then runs eagerly): true while the last forward replay's node is
    alive and its backward has not run; a node dropped without a backward releases it."""
    import weakref

    class Node:  # stands for the replay's autograd node (weak-referenceable, like ctx)
        pass

    runner = EncoderGraphs()
    assert not runner._replay_pending()
    node = Node()
    runner._pending = weakref.ref(node)
    assert runner._replay_pending()
    del node  # the step's graph dropped without a backward
    assert not runner._replay_pending() and runner._pending is None


def test_several_processes_keep_the_graphs(monkeypatch):
    """A run on several processes (DDP) replays the encoder's graphs too: each rank captures its
    own, and the backward replay hands the gradients to autograd, where DDP's hooks reduce them
    (the two-GPU run: test_multi_gpu_graphs.py)."""
    enc = HSTUEncoder(1, 16, num_heads=2, head_dim=8, cuda_graphs=True, fused=True)
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert enc.graphs.applies(enc, torch.device("cuda"))
    assert not enc.graphs.stats.disabled
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not enc.graphs.applies(enc, torch.device("cuda"))  # inside another capture: eager


def _key(attn: AttentionInputs, rows: int) -> GraphKey:
    return EncoderGraphs()._key(torch.zeros(rows, 8), attn)


def test_keys_round_sequences_and_bound_lengths():
    a = _attn([5, 9, 3], contexts=1)
    k = _key(a, 17)
    assert (k.rows, k.num_seqs, k.seqlen_bound, k.contexts, k.targets) == (
        17, SEQ_GRAIN, 64, True, False,
    )  # fmt: skip
    # other lengths with the same rows, sequence count and bound: the same graph
    assert _key(_attn([8, 8, 1], contexts=1), 17) == k
    assert _key(_attn([70, 9, 3], contexts=1), 82).seqlen_bound == 128
    no_host = AttentionInputs(seq_offsets=a.seq_offsets, max_seqlen=9)
    assert EncoderGraphs()._key(torch.zeros(17, 8), no_host) is None  # eager: the op checks


def test_a_key_without_a_graph_takes_the_smallest_covering_one():
    """`_covering` picks, among graphs of the same rows, inputs and autocast, the one with the
    smallest length bound, then the fewest sequence slots, that hold the key; none of another
    token count or other inputs; the choice is remembered until the graphs change."""
    from dataclasses import replace

    from hstu.modules.graphed_encoder import _Entry

    graphs = EncoderGraphs()
    base = _key(_attn([5, 9, 3], contexts=1), 17)

    def add(**changes) -> GraphKey:
        k = replace(base, **changes)
        z = torch.zeros(1)
        graphs._entries[k] = _Entry(k, z, None, None, None, None, z, z, z, z, z)
        return k

    add(num_seqs=16, seqlen_bound=256)
    add(num_seqs=8, seqlen_bound=512)
    smallest = add(num_seqs=24, seqlen_bound=128)
    add(num_seqs=16, seqlen_bound=128)  # fewer slots at the same bound: preferred
    add(num_seqs=64, seqlen_bound=64)  # too short a bound
    add(rows=18, num_seqs=64, seqlen_bound=4096)  # another token count
    add(targets=True, num_seqs=64, seqlen_bound=4096)  # other inputs
    want = replace(base, num_seqs=16, seqlen_bound=128)
    query = replace(base, num_seqs=8, seqlen_bound=128)
    assert graphs._covering(query).key == want
    assert graphs._cover == {query: want}
    del graphs._entries[want]
    graphs._cover.clear()
    assert graphs._covering(query).key == smallest
    assert graphs._covering(replace(base, num_seqs=8, seqlen_bound=1024)) is None
    assert graphs._covering(replace(base, num_seqs=32, seqlen_bound=128)) is None
    assert graphs._covering(replace(base, rows=19)) is None
    graphs.reset()
    assert graphs._cover == {} and graphs._covering(query) is None


@pytest.mark.parametrize(
    "change",
    ["offsets_start", "total", "too_long", "negative_length", "contexts_exceed", "bad_targets"],
)
def test_metadata_that_the_kernel_would_refuse_runs_eagerly(change):
    a = _attn([5, 9, 3], contexts=1, targets=[1, 2, 1])
    key = _key(a, 17)
    x = torch.zeros(17, 8)
    assert EncoderGraphs._fits(key, x, a)
    offs = a.host_seq_offsets.clone()
    if change == "offsets_start":
        offs += 1
    elif change == "total":
        offs[-1] += 1
    elif change == "too_long":
        a.max_seqlen = 8
    elif change == "negative_length":
        offs[1] = 15
    elif change == "contexts_exceed":
        a.host_num_contexts = torch.tensor([5, 1, 1])
    elif change == "bad_targets":
        a.host_num_targets = torch.tensor([1, -1, 1])
    a.host_seq_offsets = offs
    assert not EncoderGraphs._fits(key, x, a)


# ---- GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


_needs_kernels = needs_compiled_kernels


@gpu
def test_device_seed_equals_host_seed_bitwise():
    _needs_kernels()
    torch.manual_seed(0)
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    dy = torch.randn_like(x)
    seed, offset = 1234567, 40
    so = torch.tensor([seed, offset], dtype=torch.int64, device="cuda")
    host = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.3, seed, offset)
    dev = torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.3, 0, 0, seed_offset=so)
    for a, c in zip(host, dev):
        assert torch.equal(a, c)
    mean, rstd = host[1], host[2]
    hb = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, 0.3, seed, offset, True)
    db = torch.ops.hstu_lnmd.bwd(dy, x, u, w, b, mean, rstd, 0.3, 0, 0, True, seed_offset=so)
    for a, c in zip(hb, db):
        assert torch.equal(a, c)
    with pytest.raises((ValueError, RuntimeError), match="seed_offset"):
        torch.ops.hstu_lnmd.fwd(x, u, w, b, 1e-6, 0.3, 0, 0, seed_offset=so[:1])


def _qkv(t: int, h: int = 2, d: int = 64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(t)
    return [torch.randn(t, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


@gpu
def test_device_scaling_equals_the_by_value_scaling_bitwise():
    _needs_kernels()
    a = _attn([100, 37, 250], contexts=2, targets=[3, 0, 5])
    q, k, v = _qkv(387)
    dout = torch.randn_like(q)
    meta = (a.host_seq_offsets, 250, a.host_num_contexts, a.host_num_targets, 1, 0, 0.125)
    inv = torch.tensor([1 / 250], device="cuda")
    ref = torch.ops.hstu_attention.fwd(q, k, v, *meta, 1 / 250, True)
    out = torch.ops.hstu_attention.fwd(q, k, v, *meta, 1.0, True, inv_scale_tensor=inv)
    assert torch.equal(ref, out)
    rb = torch.ops.hstu_attention.bwd(dout, q, k, v, *meta, 1 / 250, True, True)
    ob = torch.ops.hstu_attention.bwd(dout, q, k, v, *meta, 1.0, True, True, inv_scale_tensor=inv)
    for x, y in zip(rb[:3], ob[:3]):
        assert torch.equal(x, y)


@gpu
def test_captured_attention_replays_other_batches_like_eager_calls():
    """Captured once with GPU metadata and a length bound, replayed with other lengths (same
    token count): equal to eager calls with each batch's exact metadata."""
    _needs_kernels()
    t, bound = 400, 256
    q, k, v = _qkv(t)
    offs = torch.zeros(5, dtype=torch.int64, device="cuda")
    ctx = torch.zeros(4, dtype=torch.int64, device="cuda")
    tgt = torch.zeros(4, dtype=torch.int64, device="cuda")
    inv = torch.ones(1, device="cuda")
    batches = [
        ([100, 200, 50, 50], [1, 1, 1, 0], [2, 0, 3, 0]),
        ([250, 10, 140, 0], [2, 0, 1, 0], [1, 1, 0, 0]),
    ]

    def load(lengths, c, g):
        o = torch.zeros(5, dtype=torch.int64)
        o[1:] = torch.cumsum(torch.tensor(lengths), 0)
        offs.copy_(o)
        ctx.copy_(torch.tensor(c))
        tgt.copy_(torch.tensor(g))
        inv.fill_(1.0 / max(lengths))

    load(*batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.hstu_attention.fwd(q, k, v, offs, bound, ctx, tgt, 1, 0, 0.125, 1.0, True,
                                     inv_scale_tensor=inv)  # fmt: skip
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        out = torch.ops.hstu_attention.fwd(q, k, v, offs, bound, ctx, tgt, 1, 0, 0.125, 1.0, True,
                                           inv_scale_tensor=inv)  # fmt: skip
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    for lengths, c, g in batches:
        load(lengths, c, g)
        graph.replay()
        o = torch.zeros(5, dtype=torch.int64)
        o[1:] = torch.cumsum(torch.tensor(lengths), 0)
        ref = torch.ops.hstu_attention.fwd(
            q, k, v, o, max(lengths), torch.tensor(c), torch.tensor(g), 1, 0, 0.125,
            1.0 / max(lengths), True,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def _encoders(fused: bool, bias: str, dropout: float = 0.0):
    torch.manual_seed(0)
    kw = dict(num_heads=2, head_dim=32, dropout=dropout, fused=fused, relative_attention_bias=bias)
    if bias != "none":
        kw.update(max_relative_position=300, num_time_buckets=64)
    graphed = HSTUEncoder(2, 64, cuda_graphs=True, **kw).cuda()
    eager = HSTUEncoder(2, 64, cuda_graphs=False, **kw).cuda()
    eager.load_state_dict(graphed.state_dict())
    graphed.graphs.min_uses = 1
    return graphed, eager


def _batch(lengths, rows, targets, seed):
    torch.manual_seed(seed)
    a = _attn(lengths, rows=rows, contexts=2, targets=targets, device="cuda", timestamps=True)
    x = torch.randn(rows, 64, device="cuda", requires_grad=True)
    return a, x


@gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bias", ["none", "position_time"])
def test_graphed_encoder_equals_eager(fused, bias):
    _needs_kernels()
    graphed, eager = _encoders(fused, bias)
    batches = [([120, 60, 30], [3, 0, 5]), ([110, 50, 50], [1, 1, 1]), ([90, 90, 30], [0, 2, 0])]
    for step, (lengths, targets) in enumerate(batches):
        _assert_same_step(graphed, eager, *_batch(lengths, 256, targets, step))
    stats = graphed.graphs.stats
    assert stats.captures == 1 and stats.replays == 3 and stats.disabled == "", stats


def _assert_same_step(graphed, eager, attn, x):
    """One forward + backward of both encoders on (x, attn): outputs and every gradient agree."""
    g = torch.randn(x.shape, device="cuda")
    outs = []
    for enc in (graphed, eager):
        enc.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = enc(xx, attn)
        (y.float() * g).sum().backward()
        outs.append((y.detach().float(), xx.grad, {n: p.grad for n, p in enc.named_parameters()}))
    (yg, dxg, pg), (ye, dxe, pe) = outs
    torch.testing.assert_close(yg, ye, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dxg, dxe, rtol=2e-2, atol=2e-2)
    _assert_grads_close(pg, pe)


def _assert_grads_close(got: dict, want: dict) -> None:
    """Parameter gradients by name agree within 3% of each one's largest magnitude (None where
    the eager encoder has None)."""
    for name, grad in want.items():
        if grad is None:
            assert got[name] is None, name
            continue
        scale = grad.abs().max().clamp(min=1e-6)
        assert ((got[name] - grad).abs().max() / scale) < 3e-2, name


@gpu
def test_a_graph_with_more_sequences_and_a_longer_bound_replays_smaller_keys():
    """A batch of a captured token count whose key has no graph replays one with more sequence
    slots and a longer length bound (same values as eager); only a longer bound than every graph
    of that count holds is captured anew."""
    _needs_kernels()
    graphed, eager = _encoders(True, "position_time")
    batches = [
        ([200] + [10] * 8, [1] * 9),  # bound 256, 10 sequences (+1 padding): 16 slots
        ([100, 60, 30, 70, 60], [3, 0, 5, 0, 1]),  # bound 128, 8 slots: the first graph
        ([120] + [10] * 12, [0] * 13),  # 13 sequences (+ padding) in 16 slots: the first graph
        ([300, 20], [2, 2]),  # bound 512: a capture
    ]
    for step, (lengths, targets) in enumerate(batches):
        _assert_same_step(graphed, eager, *_batch(lengths, 320, targets, step))
        if step == 2:
            assert graphed.graphs.stats.captures == 1, graphed.graphs.stats
    stats = graphed.graphs.stats
    assert stats.captures == 2 and stats.replays == 4 and stats.graphs == 2, stats


def _pool_encoder(layers: int, rows: int):
    """A graphed fused encoder (hidden 256, 2 heads x 128) that captures at first sight, and an
    input of ``rows`` tokens."""
    _needs_kernels()
    torch.manual_seed(0)
    enc = HSTUEncoder(layers, 256, num_heads=2, head_dim=128, fused=True, cuda_graphs=True)
    enc = enc.cuda()
    enc.graphs.min_uses = 1
    return enc, torch.randn(rows, 256, device="cuda", requires_grad=True)


@gpu
def test_captures_of_several_keys_share_one_pool():
    """Every key's capture reuses the memory that the captures before it freed: four keys of the
    same token rows (different length bounds) reserve about what the first one alone did, not
    four steps' activations (captures on streams of their own could not share freed blocks)."""
    rows = 8192
    enc, x = _pool_encoder(2, rows)
    reserved = []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    for longest in (64, 100, 200, 400):  # length bounds 64, 128, 256, 512: four keys
        n = rows // longest
        lengths = [longest] * n + ([rows - n * longest] if rows > n * longest else [])
        attn = _attn(lengths, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = enc(x, attn)
        y.float().sum().backward()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved() - base)
    stats = enc.graphs.stats
    assert stats.captures == 4 and stats.graphs == 4 and stats.disabled == "", stats
    first, later = reserved[0], reserved[-1] - reserved[0]
    assert first > 0
    assert later < 0.25 * first, f"reserved after each capture: {reserved}"


@gpu
def test_a_second_call_before_the_backward_runs_eagerly():
    """Two calls of the graphed encoder before one backward: the first replays, the second runs
    eagerly (a replay would overwrite the first one's activations and input), and outputs and
    gradients equal the eager encoder's. A forward whose graph is dropped without a backward does
    not hold the graphs back."""
    _needs_kernels()
    graphed, eager = _encoders(True, "position_time")
    (a1, x1), (a2, x2) = (
        _batch([120, 60, 30], 256, [3, 0, 5], 0),
        _batch([90, 90, 30], 256, [0, 2, 0], 1),
    )
    g1, g2 = torch.randn(x1.shape, device="cuda"), torch.randn(x2.shape, device="cuda")
    results = []
    for enc in (graphed, eager):
        enc.zero_grad(set_to_none=True)
        xx1, xx2 = (x.detach().clone().requires_grad_(True) for x in (x1, x2))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y1, y2 = enc(xx1, a1), enc(xx2, a2)
        ((y1.float() * g1).sum() + (y2.float() * g2).sum()).backward()
        grads = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
        results.append((y1.detach().float(), y2.detach().float(), xx1.grad, xx2.grad, grads))
    stats = graphed.graphs.stats
    assert stats.captures == 1 and stats.replays == 1 and stats.eager == 1, stats
    for got, want in zip(results[0][:4], results[1][:4]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    _assert_grads_close(results[0][4], results[1][4])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed(x1.detach(), a1)  # dropped without a backward
        y = graphed(x1.detach(), a1)
    y.float().sum().backward()
    assert stats.replays == 3 and stats.eager == 1, stats


@gpu
def test_a_pending_backward_replays_after_its_encoder_is_dropped():
    """Dropping the encoder while a replay's backward is pending, and a garbage collection of a
    reference cycle through the graphs: the backward still replays (its node holds the captured
    pair and the buffers) and the process lives on."""
    import gc

    _needs_kernels()
    graphed, eager = _encoders(True, "none")
    attn, x = _batch([120, 60, 30], 256, [3, 0, 5], 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = graphed(x.detach(), attn)
        want = eager(x.detach(), attn).float()
    assert graphed.graphs.stats.replays == 1
    runner = graphed.graphs
    runner.cycle = runner  # a reference cycle: only the collector frees it
    del graphed, runner
    gc.collect()
    y.float().sum().backward()  # the pending backward replays after its encoder is gone
    torch.testing.assert_close(y.detach().float(), want, rtol=2e-2, atol=2e-2)
    del y
    gc.collect()
    torch.cuda.synchronize()


@gpu
def test_the_layers_output_keeps_its_values_through_the_backward():
    """The output buffer is not shared with the gradients: code after the encoder may read the
    layers' output after the backward (the gradients share the other buffer)."""
    _needs_kernels()
    graphed, eager = _encoders(True, "none")
    attn, x = _batch([120, 60, 30], 256, [3, 0, 5], 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = graphed(x, attn, final_norm=False)
        want = eager(x.detach(), attn, final_norm=False).detach().float()
    before = y.detach().float().clone()
    (y.float() * 3.0).sum().backward()
    assert graphed.graphs.stats.replays == 1
    assert torch.equal(y.detach().float(), before)
    torch.testing.assert_close(before, want, rtol=2e-2, atol=2e-2)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@gpu
def test_later_captures_warm_up_in_the_graph_pool():
    """A capture's eager warm-up allocates in the graphs' pool once graphs hold it: capturing a
    second key of the same rows barely raises the reserved peak (its warm-up and capture reuse
    the first capture's freed blocks), where a warm-up in the ordinary pool would reserve a
    step's activations beside the pool."""
    rows = 16384
    enc, x = _pool_encoder(4, rows)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    grown = []
    for longest in (400, 100):  # length bounds 512 and 128: two keys of one row count
        n = rows // longest
        attn = _attn([longest] * n + ([rows - n * longest] if rows > n * longest else []),
                     device="cuda")  # fmt: skip
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = enc(x, attn)
        y.float().sum().backward()
        torch.cuda.synchronize()
        grown.append(torch.cuda.max_memory_reserved() - before)
        del y
    stats = enc.graphs.stats
    assert stats.captures == 2 and stats.disabled == "", stats
    first = grown[0]
    assert first > 0 and grown[1] < 0.25 * first, f"reserved peak growth per capture: {grown}"
    assert torch.cuda.memory_reserved() - base < 1.5 * first


def _regrowth_footprint(keep_small_output: bool) -> tuple[int, bool]:
    """The reserved memory a graphed encoder holds after capturing a small key and then a key
    beyond its shared buffers (the graphs are dropped and captured anew), with the small step's
    output kept or not, and whether the small key's graph is gone."""
    import weakref

    small, big = 4096, 8192  # big > BUFFER_HEADROOM x small
    enc, x_big = _pool_encoder(4, big)
    x_small = torch.randn(small, 256, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()

    def step(x):
        attn = _attn([256] * (x.shape[0] // 256), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = enc(x, attn)
        y.float().sum().backward()
        return y

    kept = step(x_small)  # a trainer keeps its last loss (and so the replay's node) alive
    old = weakref.ref(next(iter(enc.graphs._entries.values())).fwd)
    if not keep_small_output:
        del kept
    y = step(x_big)
    torch.cuda.synchronize()
    stats = enc.graphs.stats
    assert stats.captures == 2 and stats.graphs == 1 and stats.disabled == "", stats
    del y
    return torch.cuda.memory_reserved() - base, old() is None


@gpu
def test_growing_buffers_give_the_old_graphs_memory_back():
    """A key beyond the shared buffers drops every graph; their pool goes back to the device
    even while the previous step's output is still referenced (its replay node no longer holds
    the graphs after its backward), so the process holds about what it holds when nothing keeps
    the old step alive, not both pools."""
    kept, gone = _regrowth_footprint(True)
    assert gone, "the previous step's replay node keeps the dropped graph alive"
    dropped, _ = _regrowth_footprint(False)
    assert kept < 1.15 * dropped, f"reserved {kept} with the old step kept, {dropped} without"


@gpu
@pytest.mark.parametrize("failures", [1, 2])
def test_capture_out_of_memory_is_retried_once_then_runs_eagerly(monkeypatch, failures):
    """A capture that runs out of memory is tried once more after the cached blocks are released;
    a second failure turns graphs off with the reason, and every step still returns the eager
    result."""
    _needs_kernels()
    graphed, eager = _encoders(True, "none")
    runner = graphed.graphs
    real = runner._capture_once
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= failures:
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_capture_once", flaky)
    attn, x = _batch([120, 60, 30], 256, [3, 0, 5], 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yg = graphed(x.detach(), attn).float()
        ye = eager(x.detach(), attn).float()
    torch.testing.assert_close(yg, ye, rtol=2e-2, atol=2e-2)
    assert len(calls) == 2
    if failures == 1:
        assert runner.stats.captures == 1 and runner.stats.disabled == ""
    else:
        assert runner.stats.captures == 0
        assert "OutOfMemoryError" in runner.stats.disabled and "planted" in runner.stats.disabled


@gpu
def test_a_capture_that_fails_midway_leaves_random_draws_working(monkeypatch):
    """A capture invalidated in the middle (here: a synchronisation inside it) turns graphs off
    with the reason, the step runs eagerly, and the CUDA generator leaves capture mode: random
    draws and dropout keep working afterwards."""
    _needs_kernels()
    graphed, _ = _encoders(True, "none", dropout=0.3)
    runner = graphed.graphs
    real = runner._static_forward

    def breaks_the_capture(*args, **kwargs):
        y = real(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture is invalidated
        return y

    monkeypatch.setattr(runner, "_static_forward", breaks_the_capture)
    attn, x = _batch([120, 60, 30], 256, [3, 0, 5], 0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = graphed(x, attn)
    y.float().sum().backward()
    assert runner.stats.captures == 0 and "capturing failed" in runner.stats.disabled
    assert torch.isfinite(y).all()
    draws = torch.rand(1024, device="cuda")  # refused while the generator counts a capture
    assert torch.isfinite(draws).all() and draws.std() > 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = graphed(x, attn), graphed(x, attn)  # eager now: fresh dropout masks each call
    assert not torch.equal(a, b)


@gpu
def test_graphed_dropout_draws_a_fresh_mask_per_replay():
    _needs_kernels()
    graphed, _ = _encoders(True, "none", dropout=0.3)
    attn, x = _batch([120, 60, 30], 256, [3, 0, 5], 0)
    outs = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = graphed(x, attn)
        y.float().sum().backward()
        outs.append(y.detach().clone())
    assert graphed.graphs.stats.replays == 3
    assert not torch.equal(outs[1], outs[2]) and torch.isfinite(outs[2]).all()


@gpu
def test_graphed_training_follows_the_eager_losses(tmp_path, run_dir_bindings):
    _needs_kernels()
    from hstu.training.trainer import run_training

    losses = {}
    for graphs in (True, False):
        cfg = load_config(
            "ranking",
            [],
            run_dir_bindings(tmp_path, f"g{graphs}")
            + [
                "DatasetArgs.synthetic_num_users=300",
                "DatasetArgs.synthetic_num_items=200",
                "DatasetArgs.max_history_seqlen=40",
                "NetworkArgs.num_layers=2",
                "NetworkArgs.hidden_size=64",
                "NetworkArgs.num_attention_heads=2",
                "NetworkArgs.kv_channels=32",
                "NetworkArgs.hidden_dropout=0.0",
                "NetworkArgs.fused_layer=True",
                f"NetworkArgs.cuda_graphs={graphs}",
                "TrainerArgs.train_batch_size=16",
                "TrainerArgs.max_train_iters=60",
                "TrainerArgs.eval_interval=0",
                "TrainerArgs.max_eval_iters=1",
                "TrainerArgs.log_interval=10",
                "TrainerArgs.ckpt_save_interval=-1",
                "TrainerArgs.progress_bar=False",
                "EmbeddingArgs.embedding_backend='dense'",
            ],
        )
        result = run_training(cfg, device_type="cuda")
        losses[graphs] = [loss for _, loss in result.losses]
    a, b = torch.tensor(losses[True]), torch.tensor(losses[False])
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def _accumulators(root) -> set[int]:
    """ids of the leaf tensors whose gradient accumulators ``root``'s autograd graph reaches."""
    seen, stack, leaves = set(), [root], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)
    return leaves


@pytest.mark.parametrize("fused", [False, True])
def test_fresh_parameter_leaves_differentiate_like_the_parameters(fused):
    """A capture's parameters are fresh leaves over the same storage: the same outputs and
    gradients as the module's own parameters, none of the accumulators an earlier graph kept
    alive, and the module's parameters back in place after the block (a tied one gets one leaf)."""
    torch.manual_seed(0)
    enc = HSTUEncoder(2, 32, num_heads=2, head_dim=8, fused=fused)
    enc.layers[1].register_parameter("tied", enc.layers[0].uvqk.weight)  # one tensor, two modules
    params = [p for p in enc.layers.parameters() if p.requires_grad]
    attn = _attn([5, 3])
    x = torch.randn(8, 32)
    y0 = enc.forward_eager(x, attn)  # an earlier graph, kept alive
    want = torch.autograd.grad(y0.square().sum(), params, retain_graph=True)
    before = [id(p) for p in params]
    with fresh_parameter_leaves(enc, params) as leaves:
        assert len(leaves) == len(params)
        assert all(a is not p and a.data_ptr() == p.data_ptr() for a, p in zip(leaves, params))
        assert enc.layers[1].tied is enc.layers[0].uvqk.weight  # still one tensor
        y = enc.forward_eager(x, attn)
        reached = _accumulators(y.grad_fn)
        assert not reached & {id(p) for p in params}
        assert reached <= {id(a) for a in leaves}
        got = torch.autograd.grad(y.square().sum(), leaves)
    torch.testing.assert_close(y, y0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [id(p) for p in enc.layers.parameters() if p.requires_grad] == before
    assert isinstance(enc.layers[0].uvqk.weight, torch.nn.Parameter)


def test_warmup_routing_without_the_allocator_api_warns_once_and_runs_in_the_ordinary_pool(
    monkeypatch, caplog
):
    """A torch without the allocator's pool routing: the warm-up runs unrouted (no error), and
    the log says so once, naming what is missing."""
    graphs = EncoderGraphs()
    monkeypatch.delattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", raising=False)
    with graphs._warmup_allocations(torch.device("cpu")):  # no graph yet: nothing to route
        pass
    assert "lacks" not in caplog.text
    graphs._entries = {"held": object()}  # graphs hold the pool: routing would apply
    with caplog.at_level("WARNING", logger="hstu.modules.graphed_encoder"):
        for _ in range(2):
            with graphs._warmup_allocations(torch.device("cpu")):
                ran = True
    assert ran
    warnings = [r for r in caplog.records if "lacks" in r.getMessage()]
    assert len(warnings) == 1
    assert "_cuda_beginAllocateCurrentThreadToPool" in warnings[0].getMessage()
