"""Options that reproduce Meta's reference HSTU (research/ code of generative-recommenders):
relative position bias (its time part: tests/test_relative_bias.py), sqrt(d) item scaling,
init, no final LayerNorm, no contextual tokens, per-row random negatives, and the dense
embedding backend (CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_helpers import torchrun_losses
from model_helpers import small_model
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.config.args import NetworkArgs
from hstu.config.gin_utils import load_config
from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE
from hstu.embeddings.static import DenseEmbeddingCollection, TableSpec
from hstu.models.builder import build_model
from hstu.models.retrieval import NegativeSample
from hstu.modules.hstu_layer import AttentionInputs, HSTUEncoder, HSTULayer, RelativeAttentionBias
from hstu.modules.softmax_attention import softmax_attention
from hstu.ops.reference import hstu_attention
from hstu.training.trainer import run_training

GR_BINDINGS = [
    "EmbeddingArgs.embedding_backend='dense'",
    "EmbeddingArgs.initializer='truncated_normal'",
    "NetworkArgs.relative_attention_bias='position'",
    "NetworkArgs.scale_item_embeddings=True",
    "NetworkArgs.uvqk_init_std=0.02",
    "NetworkArgs.final_layernorm=False",
    "NetworkArgs.use_contextual_features=False",
    "NetworkArgs.attn_alpha=1.0",
]


def _jagged(lengths: list[int], h: int = 2, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.long)
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    return q, k, v, offsets


def test_reference_bias_matches_a_loop_and_gets_gradients():
    lengths = [5, 1, 3]
    q, k, v, offs = _jagged(lengths)
    n = max(lengths)
    bias = torch.randn(n, n, requires_grad=True)
    out = hstu_attention(q, k, v, offs, n, alpha=0.7, bias=bias)
    for b, length in enumerate(lengths):
        s = int(offs[b])
        for i in range(length):
            acc = torch.zeros(2, 4)
            for j in range(i + 1):
                score = 0.7 * (q[s + i] * k[s + j]).sum(-1) + bias[i, j]
                acc += F.silu(score).unsqueeze(-1) * v[s + j] / n
            torch.testing.assert_close(out[s + i], acc, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    # only causal pairs inside some sequence receive gradient
    assert torch.all(bias.grad.triu(1) == 0)
    # a zero bias is no bias
    torch.testing.assert_close(
        hstu_attention(q, k, v, offs, n, bias=torch.zeros(1, 1, n, n)),
        hstu_attention(q, k, v, offs, n),
    )


def test_reference_bias_bad_shape_is_a_clear_error():
    q, k, v, offs = _jagged([3, 2])
    with pytest.raises(ValueError, match="does not broadcast"):
        hstu_attention(q, k, v, offs, 3, bias=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="enlarge"):
        hstu_attention(q, k, v, offs, 3, bias=torch.zeros(2, 2, 2, 3, 3))
    with pytest.raises(TypeError, match="floating"):
        hstu_attention(q, k, v, offs, 3, bias=torch.zeros(3, 3, dtype=torch.long))


def test_softmax_attention_bias_matches_manual_softmax():
    q, k, v, offs = _jagged([4], h=1)
    bias = torch.randn(4, 4)
    out = softmax_attention(q, k, v, offs, 4, alpha=0.5, bias=bias)
    scores = 0.5 * q[:, 0] @ k[:, 0].t() + bias
    scores = scores.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v[:, 0]
    torch.testing.assert_close(out[:, 0], expected, atol=1e-5, rtol=1e-5)


def test_relative_position_bias_depends_on_offset_only():
    rel = RelativeAttentionBias("position", num_heads=2, max_pos=5)
    attn = AttentionInputs(seq_offsets=torch.tensor([0, 5, 9]), max_seqlen=5)
    m = rel.attention_kwargs(attn, dense=True)["bias"]  # [B, 1, N, N]
    w = rel.pos_weight[0]
    assert m.shape == (2, 1, 5, 5)
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert m[b, 0, i, j] == w[j - i + 5]
    # farther than max_pos: the end weights
    far = AttentionInputs(seq_offsets=torch.tensor([0, 8]), max_seqlen=8)
    m = rel.attention_kwargs(far, dense=True)["bias"]
    assert m[0, 0, 7, 0] == w[0] and m[0, 0, 0, 7] == w[10]


def test_layer_with_zero_bias_equals_layer_without():
    torch.manual_seed(0)
    plain = HSTULayer(8, 2, 4)
    biased = HSTULayer(8, 2, 4, relative_attention_bias="position", max_relative_position=9)
    state = dict(plain.state_dict())
    state["relative_bias.pos_weight"] = torch.zeros(1, 19)
    biased.load_state_dict(state)
    x = torch.randn(7, 8)
    attn = AttentionInputs(seq_offsets=torch.tensor([0, 3, 7]), max_seqlen=4)
    torch.testing.assert_close(biased(x, attn), plain(x, attn))
    with torch.no_grad():
        biased.relative_bias.pos_weight.normal_()
    y = biased(x, attn)
    assert not torch.allclose(y, plain(x, attn))
    y.sum().backward()
    assert biased.relative_bias.pos_weight.grad.abs().sum() > 0


def test_fused_layer_takes_the_bias():
    enc = HSTUEncoder(
        2, 8, fused=True, num_heads=1, head_dim=8, relative_attention_bias="position",
        max_relative_position=9,
    )  # fmt: skip
    assert all(layer.relative_bias is not None for layer in enc.layers)
    assert NetworkArgs(fused_layer=True, relative_attention_bias="position").fused_layer
    with pytest.raises(ValueError, match="relative_attention_bias"):
        NetworkArgs(relative_attention_bias="timing")


def test_uvqk_init_std_and_final_layernorm():
    torch.manual_seed(0)
    enc = HSTUEncoder(1, 50, num_heads=1, head_dim=50, uvqk_init_std=0.02, final_layernorm=False)
    w = enc.layers[0].uvqk.weight
    assert abs(float(w.detach().std()) - 0.02) < 0.002
    assert enc.final_norm is None
    x = torch.randn(3, 50)
    attn = AttentionInputs(seq_offsets=torch.tensor([0, 3]), max_seqlen=3)
    torch.testing.assert_close(enc(x, attn), enc.layers[0](x, attn))


_setup = small_model


def test_gr_options_build_the_reference_model():
    cfg, data, splits, model = _setup("retrieval", *GR_BINDINGS)
    assert (
        model.embeddings.embedding_collection is None and model.embeddings.dense_tables is not None
    )
    assert [s.name for s in model.embeddings.table_specs] == ["item_table"]  # no contextual tables
    assert model.encoder.final_norm is None
    assert all(layer.relative_bias is not None for layer in model.encoder.layers)
    # truncated normal rows: |w| <= 2 std
    w = model.embeddings.dense_tables.tables["item_table"].weight
    assert float(w.abs().max()) <= 2 * cfg.embedding.init_std + 1e-7
    # tokens: item * sqrt(d) + position (+ the action embedding of history tokens)
    batch = splits.eval.collate([0, 1])
    emb = model.lookup(batch)[ITEM_FEATURE]
    x, layout = model.preprocessor(batch, [], emb)
    pre = model.preprocessor
    assert layout.attn.num_contexts is None and layout.num_tokens == emb.values().shape[0]
    actions = batch.features[ACTION_FEATURE].values()
    bits = ((actions.view(-1, 1) >> torch.arange(pre.num_action_bits)) & 1).float()
    expected = (
        emb.values() * math.sqrt(cfg.network.hidden_size)
        + pre.position_embedding(layout.item_pos)
        + bits @ pre.action_embedding
        + pre.history_embedding
    )
    torch.testing.assert_close(x, expected)
    model.train()
    out = model(splits.train.collate(list(range(4))))
    out["loss"].backward()
    assert model.embeddings.dense_tables.tables["item_table"].weight.grad is not None
    for layer in model.encoder.layers:
        assert layer.relative_bias.pos_weight.grad.abs().sum() > 0


def test_per_row_negatives_loss_matches_manual():
    _, _, splits, model = _setup("retrieval", "RetrievalArgs.num_negatives=6", *GR_BINDINGS)
    model.train()
    batch = splits.train.collate(list(range(3)))
    torch.manual_seed(5)
    out = model(batch)
    rows = int((batch.history_lengths() - 1).clamp(min=0).sum())
    torch.manual_seed(5)
    sample = model._sample_negatives(rows)
    assert sample.ids.shape == (rows, 6)
    assert sample.whole_corpus  # 100 items <= 6 * hidden size: one corpus lookup
    # the same forward again (same seed) by hand: encoder outputs, then per-row logits
    torch.manual_seed(5)
    model._sample_negatives(rows)  # consume the same draws
    y, layout, item_emb, _ = model.encode(batch, sample.lookup_ids)
    has_next = layout.is_history & (
        layout.item_pos + 1 < layout.history_lengths[layout.item_sample]
    )
    src = has_next.nonzero().squeeze(1)
    q = F.normalize(y[layout.item_dest[has_next]], dim=-1, eps=1e-6)
    ids = batch.features[ITEM_FEATURE].values()
    pos_ids = ids[src + 1]
    pos = F.normalize(item_emb[src + 1], dim=-1, eps=1e-6)
    table = model.embeddings.dense_tables.tables["item_table"].weight
    neg = F.normalize(table[sample.ids], dim=-1, eps=1e-6)  # [R, K, D]
    neg_logit = torch.einsum("rd,rkd->rk", q, neg) / model.temperature
    neg_logit = neg_logit.masked_fill(pos_ids.view(-1, 1) == sample.ids, float("-inf"))
    pos_logit = (q * pos).sum(-1, keepdim=True) / model.temperature
    expected = -torch.log_softmax(torch.cat([pos_logit, neg_logit], 1), 1)[:, 0].mean()
    torch.testing.assert_close(out["loss"], expected, atol=1e-5, rtol=1e-5)


def test_whole_corpus_and_unique_lookup_give_the_same_logits():
    _, data, _, model = _setup("retrieval", *GR_BINDINGS)
    corpus = model.item_corpus
    g = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, corpus.numel(), (9, 7), generator=g)
    q = F.normalize(torch.randn(9, model.hidden_size, generator=g), dim=-1)
    table = model.embeddings.dense_tables.tables["item_table"].weight.detach()
    whole = NegativeSample(corpus, corpus[offsets], offsets, whole_corpus=True)
    uniq, inverse = torch.unique(offsets, return_inverse=True)
    part = NegativeSample(corpus[uniq], corpus[offsets], inverse, whole_corpus=False)
    a = model._negative_logits(q, table[whole.lookup_ids], whole)
    b = model._negative_logits(q, table[part.lookup_ids], part)
    torch.testing.assert_close(a, b)
    expected = torch.einsum("rd,rkd->rk", q, F.normalize(table[corpus[offsets]], dim=-1))
    torch.testing.assert_close(a, expected, atol=1e-6, rtol=1e-5)


def test_dense_collection_contract_and_errors():
    specs = [TableSpec("t", 5, 3, ["a", "b"])]
    coll = DenseEmbeddingCollection(specs, initializer="uniform", init_std=0.1)
    w = coll.tables["t"].weight
    assert float(w.abs().max()) <= 0.1
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 4, 0]), lengths=torch.tensor([2, 1])
    )
    out = coll(kjt)
    torch.testing.assert_close(out["a"].values(), w[[1, 4]])
    assert out["b"].lengths().tolist() == [1]
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys=["a"], values=torch.tensor([5]), lengths=torch.tensor([1])
    )
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
        coll(bad)
    with pytest.raises(ValueError, match="initializer"):
        DenseEmbeddingCollection(specs, initializer="xavier")


SMALL = [
    "DatasetArgs.synthetic_num_users=400",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=24",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "TrainerArgs.progress_bar=False",
    "TrainerArgs.train_batch_size=16",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.log_interval=4",
    "EmbeddingArgs.embedding_backend='dense'",
]


@pytest.fixture
def small_cfg(run_dir_bindings):
    """``small_cfg(task, run_dir, *extra)``: the SMALL config writing its run under run_dir."""

    def cfg(task: str, run_dir: Path, *extra: str):
        return load_config(task, [], SMALL + run_dir_bindings(run_dir) + list(extra))

    return cfg


def test_dense_backend_trains_and_resumes_exactly(tmp_path, small_cfg):
    extra = [*GR_BINDINGS, "NetworkArgs.hidden_dropout=0.1"]
    full = run_training(
        small_cfg("retrieval", tmp_path / "a", "TrainerArgs.max_train_iters=16", *extra)
    )
    losses = [loss for _, loss in full.losses]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
    first = run_training(
        small_cfg("retrieval", tmp_path / "b", "TrainerArgs.max_train_iters=8", *extra)
    )
    assert first.checkpoint_dir is not None
    resumed = run_training(
        small_cfg(
            "retrieval",
            tmp_path / "c",
            "TrainerArgs.max_train_iters=16",
            f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
            *extra,
        )
    )
    assert [s for s, _ in resumed.losses] == list(range(9, 17))
    np.testing.assert_allclose([v for _, v in resumed.losses], losses[8:], rtol=1e-6, atol=1e-7)

    # a dense-table checkpoint does not load into a torchrec-table run: a clear error, not
    # torch's missing-keys message
    with pytest.raises(ValueError, match="embedding_backend='dense'"):
        try:
            run_training(
                small_cfg(
                    "retrieval",
                    tmp_path / "d",
                    f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'",
                    *extra,
                    "EmbeddingArgs.embedding_backend='torchrec'",
                )
            )
        finally:
            if torch.distributed.is_initialized():  # the Trainer failed before owning cleanup
                torch.distributed.destroy_process_group()


@pytest.mark.cpu_only
def test_dense_backend_two_processes_match_one(tmp_path, run_dir_bindings):
    """Dense tables are replicated and all-reduced by DDP: 2 ranks train like 1."""
    curves = {}
    for nproc in (1, 2):
        bindings = SMALL + run_dir_bindings(tmp_path / str(nproc))
        bindings += [
            "TrainerArgs.max_train_iters=12",
            "TrainerArgs.ckpt_save_interval=-1",
            "NetworkArgs.hidden_dropout=0.0",
            "NetworkArgs.relative_attention_bias='position'",
        ]
        curves[nproc] = torchrun_losses(nproc, bindings, tmp_path / f"out_{nproc}")
    a, b = np.array(curves[1]), np.array(curves[2])
    assert a.shape == b.shape == (12,)
    np.testing.assert_allclose(b, a, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_attention")
def test_gr_options_on_cuda_match_cpu_and_train_in_bf16(monkeypatch):
    """The position bias, dense tables and per-row negatives on the GPU. The PyTorch reference
    attention on CUDA (HSTU_FORCE_REFERENCE_ATTENTION, fp32) gives the CPU model's eval query;
    the compiled kernel (bias in-kernel, bf16 autocast) stays close to that, and a bf16 training
    step gives a finite loss with gradients on the item table and the relative bias."""
    cfg, data, splits, model = _setup("retrieval", *GR_BINDINGS)
    monkeypatch.setenv("HSTU_FORCE_REFERENCE_ATTENTION", "1")
    ref_gpu = build_model(cfg, data)
    monkeypatch.delenv("HSTU_FORCE_REFERENCE_ATTENTION")
    gpu = build_model(cfg, data)
    ref_gpu.load_state_dict(model.state_dict())
    gpu.load_state_dict(model.state_dict())
    ref_gpu, gpu = ref_gpu.cuda(), gpu.cuda()
    model.eval()
    ref_gpu.eval()
    gpu.eval()
    batch = splits.eval.collate(list(range(8)))
    q_cpu = model(batch)["query"]
    with torch.no_grad():
        q_ref = ref_gpu(batch.to(torch.device("cuda")))["query"].cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q_kernel = gpu(batch.to(torch.device("cuda")))["query"].float().cpu()
    torch.testing.assert_close(q_ref, q_cpu, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q_kernel, q_cpu, atol=5e-2, rtol=5e-2)
    gpu.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = gpu(splits.train.collate(list(range(8))).to(torch.device("cuda")))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    assert gpu.embeddings.dense_tables.tables["item_table"].weight.grad.abs().sum() > 0
    assert all(layer.relative_bias.pos_weight.grad.abs().sum() > 0 for layer in gpu.encoder.layers)
