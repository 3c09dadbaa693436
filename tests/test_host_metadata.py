"""Host-side metadata in the forward (no host<->GPU syncs): the preprocessor, the embedding lookup,
the output gathers and the attention entry point must give exactly what a
device-reading implementation gives; that implementation is kept here as the reference."""

from __future__ import annotations

import pytest
import torch
from test_models import _setup as models_setup
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.embeddings.stack import EXTRA_ITEM_FEATURE
from hstu.models.base import gather_outputs
from hstu.models.builder import build_model
from hstu.models.ranking import label_bits
from hstu.modules.hstu_layer import AttentionInputs
from hstu.modules.preprocessor import (
    SequenceLayout,
    SequencePreprocessor,
    host_lengths,
    segment_ranges,
)
from hstu.ops import reference
from hstu.ops.attention import hstu_attention

# ---- the reference implementation (reads sizes from the device tensors) -----------------------


def _old_preprocess(pre: SequencePreprocessor, batch: Batch, contextual, items: JaggedTensor):
    device = items.values().device
    b = batch.batch_size
    f = pre.num_contextual
    item_lengths = items.lengths().long()
    hist_lengths = batch.features[ACTION_FEATURE].lengths().long().to(device)
    num_cand = batch.num_candidates.long().to(device)
    seq_lengths = item_lengths + f
    offsets = torch.zeros(b + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(seq_lengths, 0)
    num_tokens = int(offsets[-1])
    max_seqlen = int(seq_lengths.max()) if b > 0 else 0
    item_offsets = torch.zeros(b + 1, dtype=torch.long, device=device)
    item_offsets[1:] = torch.cumsum(item_lengths, 0)
    n_items = int(item_offsets[-1])
    sample = torch.repeat_interleave(torch.arange(b, device=device), item_lengths)
    pos = torch.arange(n_items, device=device) - item_offsets[:-1][sample]
    is_hist = pos < hist_lengths[sample]
    dest = offsets[:-1][sample] + f + pos
    values = items.values()
    pos_ids = torch.minimum(pos, hist_lengths[sample]).clamp(max=pre.max_positions - 1)
    scaled = values * pre.item_scale if pre.item_scale != 1.0 else values
    tok = scaled + pre.position_embedding(pos_ids)
    actions = batch.features[ACTION_FEATURE].values().to(device)
    # the action tokens as the module computes them (checked against the per-token product in
    # test_action_tokens_match_per_token_product): this file checks the host metadata
    action_tok = pre.action_tokens(actions, values.dtype) + pre.history_embedding
    tok = tok.index_put((is_hist.nonzero().squeeze(1),), action_tok, accumulate=True)
    x = values.new_zeros((num_tokens, pre.hidden_size))
    x = x.index_copy(0, dest, tok)
    for i, ctx in enumerate(contextual):
        x = x.index_copy(0, offsets[:-1] + i, ctx)
    x = pre.dropout(x)
    attn = AttentionInputs(
        seq_offsets=offsets,
        max_seqlen=max_seqlen,
        num_contexts=torch.full((b,), f, dtype=torch.long, device=device) if f > 0 else None,
        num_targets=num_cand if bool((num_cand > 0).any()) else None,
    )
    layout = SequenceLayout(attn, dest, sample, pos, is_hist, hist_lengths, num_tokens)
    return x, layout


def _old_lookup(model, batch: Batch | None, extra_ids=None) -> dict[str, JaggedTensor]:
    stack = model.embeddings
    names = stack.features
    n_ctx = len(model.contextual_names)
    device = batch.user_ids.device if batch is not None else extra_ids.device
    if batch is not None:
        kjt = batch.features
        b = batch.batch_size
        skip = (len(model.info.contextual_feature_names) - n_ctx) * b
        all_lengths = kjt.lengths()
        start = int(all_lengths[:skip].sum()) if skip else 0
        lengths = all_lengths[skip : skip + (n_ctx + 1) * b]
        values = kjt.values()[start : start + int(lengths.sum())]
    else:
        b = 1
        lengths = torch.zeros((n_ctx + 1) * b, dtype=torch.long, device=device)
        values = torch.zeros(0, dtype=torch.long, device=device)
    if model.uses_extra_items:
        extra = extra_ids.long() if extra_ids is not None else torch.zeros(0, dtype=torch.long)
        # spread evenly over the samples (the first n % b get one more)
        n = extra.numel()
        extra_lengths = torch.tensor([n // b + (i < n % b) for i in range(b)], dtype=lengths.dtype)
        lengths = torch.cat([lengths, extra_lengths])
        values = torch.cat([values.long(), extra])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=values.long(), lengths=lengths)
    static_collection = (
        stack.dense_tables if stack.dense_tables is not None else stack.embedding_collection
    )
    if stack.dynamic_collection is None:
        out = static_collection(kjt)
    else:
        keys = kjt.keys()
        dyn = [i for i, k in enumerate(keys) if k in stack.dynamic_features]
        static = [i for i, k in enumerate(keys) if k not in stack.dynamic_features]
        out = {}
        if static:
            kjt_static, kjt_dyn = kjt.permute(static + dyn).split([len(static), len(dyn)])
            out.update(static_collection(kjt_static))
        else:
            kjt_dyn = kjt
        out.update(stack.dynamic_collection(kjt_dyn))
    if stack.table_dim == model.hidden_size:
        return out
    return {
        k: JaggedTensor(values=jt.values()[:, : model.hidden_size], lengths=jt.lengths())
        for k, jt in out.items()
    }


# ---- batches -----------------------------------------------------------------------------------


def _random_batch(
    seed: int,
    b: int,
    ctx_names: list[str],
    *,
    max_hist: int = 9,
    max_cand: int = 4,
    zero_history: bool = True,
) -> Batch:
    """Ranking-style batch: contextual features, history items + actions, candidates + labels."""
    g = torch.Generator().manual_seed(seed)
    lo = 0 if zero_history else 1
    hist = torch.randint(lo, max_hist + 1, (b,), generator=g)
    cand = torch.randint(0, max_cand + 1, (b,), generator=g) if max_cand else torch.zeros(b)
    cand = cand.long()
    items = hist + cand
    ctx_values = torch.randint(0, 5, (len(ctx_names) * b,), generator=g)
    item_values = torch.randint(0, 50, (int(items.sum()),), generator=g)
    action_values = torch.randint(0, 256, (int(hist.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[*ctx_names, ITEM_FEATURE, ACTION_FEATURE],
        values=torch.cat([ctx_values, item_values, action_values]),
        lengths=torch.cat([torch.ones(len(ctx_names) * b, dtype=torch.long), items, hist]),
    )
    return Batch(
        features=kjt,
        contextual_feature_names=list(ctx_names),
        num_candidates=cand,
        user_ids=torch.arange(b, dtype=torch.long),
        labels=torch.randint(0, 256, (int(cand.sum()),), generator=g),
    )


def _item_embeddings(batch: Batch, dim: int, seed: int) -> JaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = batch.features[ITEM_FEATURE].lengths()
    return JaggedTensor(values=torch.randn(int(lengths.sum()), dim, generator=g), lengths=lengths)


def _assert_same_layout(new: SequenceLayout, old: SequenceLayout) -> None:
    for name in ("item_dest", "item_sample", "item_pos", "is_history", "history_lengths"):
        assert torch.equal(getattr(new, name), getattr(old, name)), name
    assert new.num_tokens == old.num_tokens
    a, o = new.attn, old.attn
    assert torch.equal(a.seq_offsets, o.seq_offsets) and a.max_seqlen == o.max_seqlen
    for name in ("num_contexts", "num_targets"):
        x, y = getattr(a, name), getattr(o, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    # the host copies describe the same layout
    assert torch.equal(a.host_seq_offsets, a.seq_offsets.cpu())
    for name in ("num_contexts", "num_targets"):
        dev, host = getattr(a, name), getattr(a, f"host_{name}")
        assert (dev is None) == (host is None)
        if dev is not None:
            assert host.device.type == "cpu" and torch.equal(host, dev.cpu())
    # index sets that replace boolean masks
    assert torch.equal(new.candidate_index, (~old.is_history).nonzero().squeeze(1))


# ---- preprocessor ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_ctx,max_cand,zero_history",
    [(0, 0, False), (0, 4, True), (3, 0, True), (3, 4, False), (2, 3, True)],
)
def test_preprocessor_bitwise_equal_to_device_reading(num_ctx, max_cand, zero_history):
    torch.manual_seed(0)
    names = [f"f{i}" for i in range(num_ctx)]
    pre = SequencePreprocessor(16, 8, 12, num_ctx, scale_item_embeddings=num_ctx == 2)
    for seed in range(4):
        batch = _random_batch(seed, 7, names, max_cand=max_cand, zero_history=zero_history)
        contextual = [torch.randn(7, 16) for _ in names]
        items = _item_embeddings(batch, 16, seed)
        x_old, old = _old_preprocess(pre, batch, contextual, items)
        # the batch as the trainer hands it over: a copy whose CPU twin is the original
        moved = batch.to("cpu")
        assert moved.host is batch
        x_new, new = pre(moved, contextual, items)
        assert torch.equal(x_new, x_old)
        _assert_same_layout(new, old)
        # and the CPU batch itself (its own twin)
        x_self, _ = pre(batch, contextual, items)
        assert torch.equal(x_self, x_old)


@pytest.mark.parametrize("num_ctx,pad", [(2, "off"), (0, "off"), (3, "on")])
def test_preprocessor_gradients_equal_to_device_reading(num_ctx, pad):
    """Parameter, item-embedding and contextual gradients bitwise equal to the reference's (zeros
    + one out-of-place index_copy per source); padding rows (pad_tokens="on") get no gradient."""
    torch.manual_seed(1)
    names = [f"f{i}" for i in range(num_ctx)]
    pre = SequencePreprocessor(8, 4, 12, num_ctx, pad_tokens=pad)
    batch = _random_batch(3, 6, names)
    ctx0 = [torch.randn(6, 8) for _ in names]
    items0 = _item_embeddings(batch, 8, 3)
    grads = []
    for fn in (_old_preprocess, lambda p, *a: p(*a)):
        pre.zero_grad()
        ctx = [c.clone().requires_grad_() for c in ctx0]
        values = items0.values().clone().requires_grad_()
        items = JaggedTensor(values=values, lengths=items0.lengths())
        x, layout = fn(pre, batch, ctx, items)
        if pad == "on":
            assert x.shape[0] >= layout.num_tokens and not x[layout.num_tokens :].any()
        x = x[: layout.num_tokens]
        (x * torch.arange(x.numel()).view_as(x).sin()).sum().backward()
        grads.append(
            [p.grad.clone() for p in pre.parameters()] + [values.grad] + [c.grad for c in ctx]
        )
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_preprocessor_history_tokens_same_in_deterministic_mode():
    """The action tokens join the history rows by index_add_ (one addition per row), or by the
    sorted index_put_ under torch.use_deterministic_algorithms: same tokens and gradients."""
    torch.manual_seed(2)
    pre = SequencePreprocessor(8, 4, 12, 1)
    batch = _random_batch(5, 6, ["f0"], max_cand=3)
    ctx0 = [torch.randn(6, 8)]
    items0 = _item_embeddings(batch, 8, 5)
    results = []
    before = torch.are_deterministic_algorithms_enabled()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            pre.zero_grad()
            values = items0.values().clone().requires_grad_()
            items = JaggedTensor(values=values, lengths=items0.lengths())
            x, layout = pre(batch, ctx0, items)
            (x[: layout.num_tokens].cos()).sum().backward()
        finally:
            torch.use_deterministic_algorithms(before)
        results.append([x.detach(), values.grad] + [p.grad.clone() for p in pre.parameters()])
    assert results[0][0].abs().sum() > 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n_bits", [1, 3, 8, 13])
def test_action_tokens_match_per_token_product(n_bits):
    """The action tokens from the table of bit combinations (or, above MAX_COMBO_BITS, the
    direct product) equal bits(actions) @ action_embedding, forward and weight gradient; bits
    above num_action_bits are ignored."""
    from hstu.modules.preprocessor import MAX_COMBO_BITS

    torch.manual_seed(n_bits)
    pre = SequencePreprocessor(16, n_bits, 12, 0)
    actions = torch.randint(0, 1 << 20, (300,))
    weight = torch.randn(300, 16)
    got = pre.action_tokens(actions, torch.float32)
    (got * weight).sum().backward()
    grad_got = pre.action_embedding.grad.clone()
    pre.action_embedding.grad = None
    bits = (actions.view(-1, 1) >> torch.arange(n_bits)) & 1
    want = bits.float() @ pre.action_embedding
    (want * weight).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_got, pre.action_embedding.grad, rtol=1e-5, atol=1e-5)
    assert (n_bits > MAX_COMBO_BITS) == (n_bits == 13)


def test_host_lengths_rejects_inconsistent_batch():
    batch = _random_batch(0, 4, ["a"])
    batch.num_candidates = batch.num_candidates + 1
    with pytest.raises(ValueError, match="history items .* followed by its candidates"):
        host_lengths(batch)


def test_segment_ranges():
    starts = torch.tensor([0, 5, 9, 9])
    counts = torch.tensor([2, 0, 3, 1])
    assert segment_ranges(starts, counts, 6).tolist() == [0, 1, 9, 10, 11, 9]
    assert segment_ranges(starts[:0], counts[:0], 0).tolist() == []


def test_batch_host_twin():
    batch = _random_batch(0, 3, ["a"])
    assert batch.host_batch() is batch
    moved = batch.to("cpu")
    assert moved.host is batch and moved.host_batch() is batch
    again = moved.to("cpu")  # the twin is the original CPU batch, not an intermediate copy
    assert again.host is batch
    assert "host" not in repr(moved).split("features=")[0]


# ---- models: lookup, gathers, whole forward ------------------------------------------------------


def _setup(task: str, *bindings: str):
    """test_models' small synthetic setup: (cfg, splits, model, data)."""
    cfg, data, splits, model = models_setup(task, *bindings)
    return cfg, splits, model, data


@pytest.mark.parametrize(
    "bindings",
    [
        (),
        ("EmbeddingArgs.embedding_backend='dynamic'",),
        ("EmbeddingArgs.embedding_backend='dynamic'", "NetworkArgs.use_contextual_features=False"),
        ("NetworkArgs.use_contextual_features=False",),
    ],
)
def test_ranking_forward_backward_bitwise_equal_to_device_reading(bindings):
    """Whole ranking step (lookup incl. dynamic-table inserts, preprocessor, encoder, candidate
    gather, head, backward + fused table update) vs the device-reading lookup/preprocess/mask code."""
    cfg, splits, model, data = _setup("ranking", *bindings)
    ref = build_model(cfg, data)  # built from the same seed: the same weights
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    model.train()
    ref.train()
    for step in range(2):
        batch = splits.train.collate(list(range(8 * step, 8 * step + 8))).to("cpu")
        out = model(batch)
        emb = _old_lookup(ref, batch)
        ctx = [emb[n].values() for n in ref.contextual_names]
        x, layout = _old_preprocess(ref.preprocessor, batch, ctx, emb[ITEM_FEATURE])
        y = ref.encoder(x, layout.attn, final_norm=False)  # normed on the candidates' rows
        cand = y.index_select(0, layout.item_dest[~layout.is_history])
        logits = ref.head(ref.encoder.final(cand)).float()
        assert torch.equal(out["logits"], logits)
        targets = label_bits(batch.labels, ref.num_tasks)
        per = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, targets, reduction="none"
        )
        ref_loss = (per * ref.task_weights).sum() / per.shape[0]
        assert torch.equal(out["loss"], ref_loss)
        out["loss"].backward()
        ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    if model.embeddings.dynamic_collection is not None:
        a, b = model.embeddings.dynamic_collection.dump(), ref.embeddings.dynamic_collection.dump()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_retrieval_indices_equal_device_reading_masks():
    """The next-item rows and the eval query rows are the rows boolean masks choose,
    and the training loss equals the masked path's."""
    cfg, splits, model, _ = _setup(
        "retrieval", "RetrievalArgs.negative_sampling='in_batch'", "NetworkArgs.num_layers=1"
    )
    model.train()
    batch = splits.train.collate(list(range(6))).to("cpu")
    emb = model.lookup(batch)
    ctx = [emb[n].values() for n in model.contextual_names]
    x, layout = model.preprocessor(batch, ctx, emb[ITEM_FEATURE])
    _, old = _old_preprocess(model.preprocessor, batch, ctx, emb[ITEM_FEATURE])
    _assert_same_layout(layout, old)
    has_next = old.is_history & (old.item_pos + 1 < old.history_lengths[old.item_sample])
    hist = layout.history_lengths
    rows = int(torch.clamp(hist - 1, min=0).sum())
    src = segment_ranges(layout.item_offsets[:-1], torch.clamp(hist - 1, min=0), rows)
    assert torch.equal(src, has_next.nonzero().squeeze(1))
    last_mask = old.is_history & (old.item_pos + 1 == old.history_lengths[old.item_sample])
    last = segment_ranges(layout.item_offsets[:-1] + hist - 1, (hist > 0).long(), 6)
    assert torch.equal(last, last_mask.nonzero().squeeze(1))
    y = torch.randn(layout.num_tokens, 4)
    assert torch.equal(gather_outputs(y, layout, src), y[layout.item_dest[has_next]])
    with pytest.raises(TypeError, match="not a boolean mask"):
        gather_outputs(y, layout, has_next)


def test_lookup_kjt_carries_host_sizes():
    """The lookup KJT has the keys, values and lengths of the device-reading one, and its per-key
    lengths/offsets were given (torchrec would otherwise compute them from the device lengths)."""
    _, splits, model, _ = _setup("retrieval", "EmbeddingArgs.embedding_backend='dynamic'")
    batch = splits.train.collate(list(range(5))).to("cpu")
    extra = torch.tensor([3, 1, 4, 1, 5])
    kjt = model.embeddings.lookup_kjt(batch, extra)
    assert kjt._length_per_key is not None and kjt._offset_per_key is not None
    assert kjt.keys() == model.embeddings.features
    n = [int(kjt[k].lengths().sum()) for k in kjt.keys()]
    assert kjt._length_per_key == n
    assert kjt[EXTRA_ITEM_FEATURE].values().tolist() == extra.tolist()
    assert torch.equal(kjt[ITEM_FEATURE].values(), batch.features[ITEM_FEATURE].values())
    # lookups agree with the device-reading code (eval: no inserts, so the two calls see one state)
    model.eval()
    new = model.lookup(batch, extra)
    old = _old_lookup(model, batch, extra)
    assert new.keys() == old.keys()
    for k in new:
        assert torch.equal(new[k].values(), old[k].values()), k
        assert torch.equal(new[k].lengths(), old[k].lengths()), k


# ---- attention metadata ---------------------------------------------------------------------------


def _attn_inputs(lengths: list[int], ctx: int, tgt: list[int]) -> AttentionInputs:
    lens = torch.tensor(lengths)
    offs = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offs[1:] = torch.cumsum(lens, 0)
    return AttentionInputs(
        seq_offsets=offs.clone(),
        max_seqlen=int(lens.max()),
        num_contexts=torch.full((len(lengths),), ctx),
        num_targets=torch.tensor(tgt),
        host_seq_offsets=offs,
        host_num_contexts=torch.full((len(lengths),), ctx),
        host_num_targets=torch.tensor(tgt),
    )


def test_attention_inputs_host_copies():
    a = _attn_inputs([5, 3, 7], 1, [2, 0, 3])
    dev = a.kernel_metadata(torch.device("cpu"))
    assert dev[0] is a.seq_offsets and dev[2] is a.num_targets
    # on CUDA the compiled op gets the CPU copies (it validates them without a device read)
    host = a.kernel_metadata(torch.device("cuda", 0))
    assert host[0] is a.host_seq_offsets and host[1] is a.host_num_contexts
    with pytest.raises(ValueError, match="both be given or both None"):
        AttentionInputs(
            a.seq_offsets, 7, num_targets=a.num_targets, host_seq_offsets=a.host_seq_offsets
        )
    with pytest.raises(TypeError, match="CPU int64"):
        AttentionInputs(a.seq_offsets, 7, host_seq_offsets=a.host_seq_offsets.int())
    with pytest.raises(ValueError, match="shape"):
        AttentionInputs(a.seq_offsets, 7, host_seq_offsets=a.host_seq_offsets[:-1])


def test_attention_entry_accepts_cpu_metadata():
    """hstu_attention with the host copies gives the reference result (CPU path); the metadata
    is moved to q's device where the reference needs it."""
    torch.manual_seed(0)
    a = _attn_inputs([5, 3, 7], 1, [2, 0, 3])
    t = int(a.host_seq_offsets[-1])
    q, k, v = (torch.randn(t, 2, 8) for _ in range(3))
    offs, ctx, tgt = a.kernel_metadata(torch.device("cuda"))
    out = hstu_attention(q, k, v, offs, a.max_seqlen, num_contexts=ctx, num_targets=tgt)
    ref = reference.hstu_attention(
        q, k, v, a.seq_offsets, a.max_seqlen, num_contexts=a.num_contexts, num_targets=tgt
    )
    assert torch.equal(out, ref)
