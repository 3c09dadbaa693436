"""Token padding (NetworkArgs.pad_tokens): the jagged token count is rounded up so matmul shapes
repeat across batches; the padding rows must change nothing the model computes (CPU, reference
ops, padding forced on)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import small_model

from hstu.config.args import NetworkArgs
from hstu.modules.graphed_encoder import GRAPH_PAD_SIZES_PER_OCTAVE, EncoderGraphs
from hstu.modules.preprocessor import (
    PAD_SEQUENCE_TOKENS,
    HostLengths,
    _host_layout,
    _index_layout,
    padded_token_count,
)


def test_padded_token_count_bounds():
    assert padded_token_count(0) == 0
    seen = set()
    for t in list(range(1, 5000, 7)) + list(range(30000, 70000, 13)):
        p = padded_token_count(t)
        assert p >= t and p % 128 == 0
        assert p - t < max(128, t / 32 + 1)  # at most ~1/32 extra rows
        if 32768 <= t < 65536:
            seen.add(p)
    assert len(seen) <= 33  # few distinct shapes per power of two


@pytest.mark.parametrize("per_octave", [8, 16])
def test_coarser_padding_for_graphs(per_octave):
    seen = set()
    for t in range(30000, 70000, 13):
        p = padded_token_count(t, per_octave)
        assert p >= t and p % 128 == 0 and p - t < t / per_octave + 1
        assert p >= padded_token_count(t)
        if 32768 <= t < 65536:
            seen.add(p)
    assert len(seen) <= per_octave + 1
    with pytest.raises(ValueError, match="power of two"):
        padded_token_count(100, 12)


def test_padding_rows_go_into_short_sequences():
    """2000 padding rows after two sequences: 8 padding sequences of at most 256 tokens (not one
    of 2000: the attention's cost grows with the square of the length), the same on both sides."""
    attn = _layout([3000, 1000], 4096, 6000)
    lengths = attn.host_seq_offsets.diff().tolist()
    assert lengths == [3000, 1000] + [PAD_SEQUENCE_TOKENS] * 7 + [2000 - 7 * PAD_SEQUENCE_TOKENS]
    assert attn.padding_sequences == 8 and torch.equal(attn.seq_offsets, attn.host_seq_offsets)
    # a short max_seqlen bounds them further
    attn = _layout([80, 20], 100, 350)
    assert attn.host_seq_offsets.diff().tolist() == [80, 20, 100, 100, 50]


def _layout(lengths: list[int], max_seqlen: int, rows: int):
    """The attention layout of history-only samples of ``lengths`` padded to ``rows``."""
    items = torch.tensor(lengths, dtype=torch.int64)
    host = HostLengths(items=items, history=items.clone(), candidates=torch.zeros_like(items))
    sizes = (host, int(items.sum()), max_seqlen, False, rows)
    lay = _index_layout(_host_layout(sizes, 0, 1 << 20, False), torch.device("cpu"))
    return lay.attn


def _model(task: str, pad: str, *extra: str):
    _, _, splits, model = small_model(task, f"NetworkArgs.pad_tokens='{pad}'", *extra)
    return splits, model


@pytest.mark.parametrize(
    ("task", "extra"),
    [
        ("ranking", ()),
        ("retrieval", ()),
        ("ranking", ("NetworkArgs.fused_layer=True",)),
        # the time bias reads Batch.timestamps: the padding rows must not disturb them either
        ("ranking", ("NetworkArgs.relative_attention_bias='position_time'",)),
        ("retrieval", ("NetworkArgs.relative_attention_bias='position_time'",)),
    ],
)
def test_padding_changes_no_output_or_gradient(task, extra):
    splits, plain = _model(task, "off", *extra)
    _, padded = _model(task, "on", *extra)
    padded.load_state_dict(plain.state_dict())
    batch = splits.train.collate(list(range(7)))
    outs, grads = [], []
    for model in (plain, padded):
        model.train()
        torch.manual_seed(1)  # same negatives for retrieval
        out = model(batch)
        out["loss"].backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    attn = padded.last_attention_inputs
    t = int(outs[0]["num_tokens"])
    assert int(outs[1]["num_tokens"]) == t  # the real token count, not the padded one
    assert attn.padding_sequences > 0 and int(attn.seq_offsets[-1]) == padded_token_count(t)
    lengths = attn.seq_offsets.diff()
    assert int(lengths[-attn.padding_sequences :].max()) <= min(
        attn.max_seqlen, PAD_SEQUENCE_TOKENS
    )
    assert int(attn.real_lengths().sum()) == t
    torch.testing.assert_close(outs[1]["loss"], outs[0]["loss"], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("sizes", [None, 4])
def test_only_a_call_that_may_replay_graphs_pads_coarsely(monkeypatch, sizes):
    """The model rounds the token count to `NetworkArgs.cuda_graph_pad_sizes` sizes per power of
    two (default 8) only for a call its encoder may replay from CUDA graphs (training on CUDA,
    graphs on: `HSTUEncoder.graphed`); otherwise (evaluation, CPU) to 32."""
    bindings = ["NetworkArgs.cuda_graphs=True"]
    if sizes is not None:
        bindings.append(f"NetworkArgs.cuda_graph_pad_sizes={sizes}")
    splits, model = _model("ranking", "on", *bindings)
    assert model.encoder.graphs.pad_sizes_per_octave == (sizes or GRAPH_PAD_SIZES_PER_OCTAVE)
    batch = splits.train.collate(list(range(200)))  # ~6k tokens: the two roundings differ
    assert not model.encoder.graphed(torch.device("cpu"))
    rows = {}
    for graphed in (False, True):
        # the encoder runs eagerly here; only the padding choice follows `graphed`
        monkeypatch.setattr(model.encoder, "graphed", lambda device, g=graphed: g)
        model(batch)
        attn = model.last_attention_inputs
        t = int(attn.real_lengths().sum())
        rows[graphed] = (int(attn.seq_offsets[-1]), t)
    assert rows[False][0] == padded_token_count(rows[False][1])
    expected = padded_token_count(rows[True][1], sizes or GRAPH_PAD_SIZES_PER_OCTAVE)
    assert rows[True][0] == expected
    assert rows[True][0] > rows[False][0]


@pytest.mark.parametrize("bad", [0, 3, 12, 2048])
def test_bad_cuda_graph_pad_sizes_names_the_setting(bad):
    with pytest.raises(ValueError, match="cuda_graph_pad_sizes"):
        NetworkArgs(cuda_graph_pad_sizes=bad)
    if bad != 2048:  # built directly, the graphs refuse a non-power of two (only the config caps)
        with pytest.raises(ValueError, match="cuda_graph_pad_sizes must be a power of two"):
            EncoderGraphs(pad_sizes_per_octave=bad)


def test_bad_pad_tokens_value_names_the_binding():
    with pytest.raises(ValueError, match="pad_tokens"):
        _model("ranking", "sometimes")


def _device_layout_twin(items, hist, cand, f, rows, max_seqlen, max_positions):
    """The layout's index tensors as the preprocessor derived them with torch ops from the
    lengths before they moved to the host (`_index_layout` must give the same values)."""
    from hstu.modules.preprocessor import segment_ranges

    b = items.numel()
    n_items, n_hist = int(items.sum()), int(hist.sum())
    offsets = torch.zeros(b + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(items + f, 0)
    item_offsets = torch.zeros(b + 1, dtype=torch.long)
    item_offsets[1:] = torch.cumsum(items, 0)
    sample = torch.repeat_interleave(torch.arange(b), items, output_size=n_items)
    pos = torch.arange(n_items) - item_offsets[:-1][sample]
    out = {
        "item_offsets": item_offsets,
        "history_lengths": hist,
        "sample": sample,
        "pos": pos,
        "is_history": pos < hist[sample],
        "dest": offsets[:-1][sample] + f + pos,
        "position_ids": torch.minimum(pos, hist[sample]).clamp(max=max_positions - 1),
        "history_index": segment_ranges(item_offsets[:-1], hist, n_hist),
        "candidate_index": segment_ranges(item_offsets[:-1] + hist, cand, n_items - n_hist),
        "ctx_rows": (offsets[:-1].view(b, 1) + torch.arange(f)).view(-1) if f else None,
    }
    pad = rows - int(offsets[-1])
    chunk = max(1, min(max_seqlen, PAD_SEQUENCE_TOKENS))
    n_pad = -(-pad // chunk) if pad > 0 else 0
    steps = torch.clamp(torch.arange(1, n_pad + 1) * chunk, max=pad)
    out["seq_offsets"] = torch.cat([offsets, offsets[-1] + steps])
    zeros = torch.zeros(n_pad, dtype=torch.long)
    out["num_contexts"] = torch.cat([torch.full((b,), f), zeros]) if f else None
    out["num_targets"] = torch.cat([cand, zeros]) if bool((cand > 0).any()) else None
    return out, n_pad


@pytest.mark.parametrize("f", [0, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_layout_equals_the_device_formulas(f, seed):
    """Random batches (empty samples, candidate-free ones, positions clamped): every tensor of
    the host-built layout equals the torch formulas it replaced, the host twins equal the device
    tensors, and the attention inputs carry them."""
    g = torch.Generator().manual_seed(seed)
    b = 7
    hist = torch.randint(0, 40, (b,), generator=g)
    cand = torch.randint(0, 4, (b,), generator=g) * (torch.arange(b) % 3 != 0)
    hist[0] = 0
    items = hist + cand
    max_positions = 30  # below some histories: the positions clamp
    tokens = int((items + f).sum())
    max_seqlen = int((items + f).max())
    rows = padded_token_count(tokens) + 300
    host = HostLengths(items=items, history=hist, candidates=cand)
    has_targets = bool((cand > 0).any())
    prep = _host_layout((host, tokens, max_seqlen, has_targets, rows), f, max_positions, False)
    lay = _index_layout(prep, torch.device("cpu"))
    want, n_pad = _device_layout_twin(items, hist, cand, f, rows, max_seqlen, max_positions)
    for name, ref in want.items():
        got = getattr(
            lay.attn if name in ("seq_offsets", "num_contexts", "num_targets") else lay, name
        )
        if ref is None:
            assert got is None, name
            continue
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    attn = lay.attn
    assert attn.padding_sequences == n_pad > 0
    assert torch.equal(attn.host_seq_offsets, attn.seq_offsets)
    assert int(attn.seq_offsets[-1]) == rows
    if f:
        assert torch.equal(attn.host_num_contexts, attn.num_contexts)
    if has_targets:
        assert torch.equal(attn.host_num_targets, attn.num_targets)


@pytest.mark.parametrize("pad", ["off", "on"])
def test_layout_prepared_ahead_is_used_and_changes_nothing(monkeypatch, pad):
    """`BaseGR.prepare_host` (the trainer runs it on the batch-prefetch thread) leaves the batch's
    host layout in ``batch.host_memo``; the forward takes it from there instead of computing it,
    with loss and gradients bitwise those of a forward that computes it itself."""
    import hstu.modules.preprocessor as pre

    splits, model = _model("ranking", pad)
    model.train()
    prepared = splits.train.collate(list(range(7)))
    plain = splits.train.collate(list(range(7)))
    model.prepare_host(prepared, "cpu")
    assert len(prepared.host_memo) == 1 and not plain.host_memo
    calls = []
    real = pre._host_layout
    monkeypatch.setattr(pre, "_host_layout", lambda *a: calls.append(1) or real(*a))
    results = []
    for batch in (prepared, plain):
        model.zero_grad(set_to_none=True)
        out = model(batch)
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out["loss"].detach(), grads))
    assert len(calls) == 1  # only the plain batch computed its layout in the forward
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys() and results[0][1]
    for name, g in results[0][1].items():
        assert torch.equal(g, results[1][1][name]), name


def test_a_batch_the_layout_rejects_is_left_to_the_forward():
    """A batch the preprocessor refuses (more positions than the model has) gets no prepared
    layout; its forward raises the error, naming the setting."""
    splits, model = _model("ranking", "off", "NetworkArgs.num_position_embeddings=5")
    batch = splits.train.collate(list(range(7)))
    model.prepare_host(batch, "cpu")
    assert not batch.host_memo
    with pytest.raises(ValueError, match="num_position_embeddings"):
        model(batch)


def test_layout_is_prepared_at_the_last_training_forwards_padding(monkeypatch):
    """A call whose encoder may replay CUDA graphs pads more coarsely; the layout prepared ahead
    follows the rounding of the last training forward, so the next graphed forward finds it
    (and an evaluation forward, at the default rounding, does not change it)."""
    import hstu.modules.preprocessor as pre

    splits, model = _model("ranking", "on", "NetworkArgs.cuda_graphs=True")
    monkeypatch.setattr(model.encoder, "graphed", lambda device: model.training)
    model.train()
    model(splits.train.collate(list(range(200))))
    coarse = model.encoder.graphs.pad_sizes_per_octave
    assert model.preprocessor.train_pad_sizes == coarse
    model.eval()
    with torch.no_grad():
        model(splits.train.collate(list(range(7))))
    assert model.preprocessor.train_pad_sizes == coarse
    model.train()
    batch = splits.train.collate(list(range(200, 400)))
    model.prepare_host(batch, "cpu")
    assert [key[2] for key in batch.host_memo] == [coarse]
    calls = []
    real = pre._host_layout
    monkeypatch.setattr(pre, "_host_layout", lambda *a: calls.append(1) or real(*a))
    model(batch)
    assert not calls  # the graphed forward took the prepared layout
