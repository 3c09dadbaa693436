"""Token padding (NetworkArgs.pad_tokens): the jagged token count is rounded up so matmul shapes
repeat across batches; the padding rows must change nothing the model computes (CPU, reference
ops, padding forced on)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import small_model

from hstu.config.args import NetworkArgs
from hstu.modules.graphed_encoder import GRAPH_PAD_SIZES_PER_OCTAVE, EncoderGraphs
from hstu.modules.preprocessor import PAD_SEQUENCE_TOKENS, _attention_inputs, padded_token_count


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
    offs = torch.tensor([0, 3000, 4000])
    attn = _attention_inputs(
        offs.clone(), offs.clone(), 4096, 0, torch.tensor([0, 0]), torch.tensor([0, 0]), False, 6000
    )
    lengths = attn.host_seq_offsets.diff().tolist()
    assert lengths == [3000, 1000] + [PAD_SEQUENCE_TOKENS] * 7 + [2000 - 7 * PAD_SEQUENCE_TOKENS]
    assert attn.padding_sequences == 8 and torch.equal(attn.seq_offsets, attn.host_seq_offsets)
    # a short max_seqlen bounds them further
    offs = torch.tensor([0, 80, 100])
    attn = _attention_inputs(
        offs.clone(), offs.clone(), 100, 0, torch.tensor([0, 0]), torch.tensor([0, 0]), False, 350
    )
    assert attn.host_seq_offsets.diff().tolist() == [80, 20, 100, 100, 50]


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
    graphs on: `HSTUEncoder.graphed`); otherwise (evaluation, CPU, several processes) to 32."""
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
