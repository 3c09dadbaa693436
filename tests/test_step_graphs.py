"""CUDA graphs of the whole training step (hstu.training.step_graphs).

CPU: the padding to a step key (shapes, weights, lengths, keys that repeat), a padded batch
gives the unpadded batch's loss and gradients (every negative sampling mode, contextual tokens,
timestamps), the preprocessor's static layout equals its copied one, the capturable optimizer's
learning rate is filled in place, what the step graphs refuse; ranking batches padded in tokens
and candidates give the same loss, task losses and gradients; the trainer's close releases the
graphs before the process group. GPU (-m gpu): training with step
graphs follows the eager losses and replays its graphs (retrieval, ranking, plain tables trained
by the sparse optimizer); random negatives and dropout still draw fresh values per replay; a
failed capture leaves a run that trains on eagerly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from model_helpers import (
    fail_retrieval_captures,
    graphed_run,
    needs_compiled_kernels,
    small_model,
)

from hstu.config.gin_utils import load_config
from hstu.modules.graphed_encoder import SEQ_GRAIN
from hstu.modules.preprocessor import StaticLayout, padded_token_count
from hstu.training import step_graphs
from hstu.training.optim import build_dense_optimizer, build_lr_scheduler
from hstu.training.step_graphs import (
    WHOLE_CORPUS_ROWS,
    float_learning_rates,
    graph_safe_optimizer,
    pad_batch,
    step_graphs_unsupported,
)


def _padded(batch, f=0, sizes=8):
    return pad_batch(batch, num_contextual=f, pad_sizes_per_octave=sizes)


@pytest.mark.parametrize("f", [0, 1])
def test_padding_reaches_a_token_bucket_with_weighted_out_samples(f):
    _, _, splits, _ = small_model("retrieval")
    batch = splits.train.collate(list(range(13)))
    p = _padded(batch, f)
    b = batch.batch_size
    items = batch.item_lengths()
    key, pb = p.key, p.batch
    assert key.samples % SEQ_GRAIN == 0 and key.samples > b
    tokens = key.items + key.samples * f
    assert tokens == padded_token_count(tokens, 8)  # a bucket: the preprocessor adds no rows
    new = pb.item_lengths()
    assert torch.equal(new[:b], items) and bool((new[b:] >= 1).all())
    assert int(new[b:].max()) <= int(items.max())  # the longest sequence stays the batch's
    assert torch.equal(pb.history_lengths(), new)  # padding items are history
    assert pb.sample_weights.tolist() == [1.0] * b + [0.0] * (key.samples - b)
    assert key.loss_rows == int((new - 1).clamp(min=0).sum())
    assert key.values == pb.features.values().numel()
    assert p.max_seqlen == int(items.max()) + f
    assert torch.equal(p.real_lengths, items + f) and p.real_tokens == int(items.sum()) + b * f
    # the real samples' values are untouched, the padding repeats the batch's first item
    values = pb.features["item_id"].values()
    n = int(items.sum())
    assert torch.equal(values[:n], batch.features["item_id"].values())
    assert bool((values[n:] == values[0]).all())
    assert bool((pb.features["action"].values()[n:] == 0).all())
    assert pb.global_counts == batch.global_counts


def test_keys_repeat_across_batches_of_similar_size():
    _, _, splits, _ = small_model("retrieval")
    keys = {_padded(splits.train.collate(list(range(i, i + 32)))).key for i in range(0, 160, 32)}
    assert len(keys) <= 3, keys


@pytest.mark.parametrize("f", [0, 1])
def test_a_ranking_batch_pads_its_tokens_and_candidates_to_buckets(f):
    _, _, splits, _ = small_model("ranking", "DatasetArgs.max_num_candidates=5")
    batch = splits.train.collate(list(range(13)))
    p = _padded(batch, f)
    b, key, pb = batch.batch_size, p.key, p.batch
    hist, cand = batch.history_lengths(), batch.num_candidates
    assert int(cand.max()) > 1 and batch.labels is not None
    assert key.samples % SEQ_GRAIN == 0 and key.samples > b
    tokens = key.items + key.samples * f
    assert tokens == padded_token_count(tokens, 8)
    n_cand = int(pb.num_candidates.sum())
    assert key.loss_rows == n_cand == padded_token_count(n_cand, 8)
    new_hist, new_cand = pb.history_lengths(), pb.num_candidates
    assert torch.equal(new_hist[:b], hist) and torch.equal(new_cand[:b], cand)
    assert bool((new_hist[b:] >= 1).all()) and bool((new_cand[b:] >= 1).all())
    assert int(new_hist[b:].max()) <= int(hist.max())
    assert int(new_cand[b:].max()) <= int(cand.max())
    assert int((new_hist + new_cand)[b:].max()) <= int((hist + cand).max())
    assert torch.equal(pb.item_lengths(), new_hist + new_cand)
    real = int(cand.sum())
    assert torch.equal(pb.labels[:real], batch.labels) and bool((pb.labels[real:] == 0).all())
    assert pb.sample_weights.tolist() == [1.0] * b + [0.0] * (key.samples - b)
    assert p.max_seqlen == int((hist + cand).max()) + f


def test_batches_a_step_graph_does_not_take():
    _, _, splits, _ = small_model("retrieval")
    assert _padded(splits.eval.collate([0, 1])) is None  # evaluation targets
    once = _padded(splits.train.collate([0, 1]))
    assert _padded(once.batch) is None  # weights already set


def _loss_and_grads(model, batch, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(batch, loss_normalizer=7.0)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out["loss"].detach(), grads


def _assert_padding_adds_nothing(model, batch):
    """``batch`` and its padded copy give the same loss and gradients (fp32 rounding only);
    returns the padded batch."""
    model.train()
    padded = _padded(batch, model.preprocessor.num_contextual)
    assert padded.key.samples > batch.batch_size
    loss, grads = _loss_and_grads(model, batch, seed=3)
    loss_p, grads_p = _loss_and_grads(model, padded.batch, seed=3)
    torch.testing.assert_close(loss_p, loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == grads_p.keys()
    for name, g in grads.items():
        # the same terms summed in other orders (larger matmuls): fp32 rounding only
        err = float((grads_p[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < 1e-6, (name, err)
    return padded


@pytest.mark.parametrize(
    "bindings",
    [
        ("RetrievalArgs.negative_sampling='random'",),
        ("RetrievalArgs.negative_sampling='in_batch'",),
        ("RetrievalArgs.negative_sampling='mixed'",),
        ("NetworkArgs.relative_attention_bias='position_time'",),
        ("NetworkArgs.use_contextual_features=True", "NetworkArgs.relative_attention_bias='time'"),
    ],
)
def test_a_padded_batch_gives_the_same_loss_and_gradients(bindings):
    """Padding samples add nothing: the same loss and the same gradients up to fp32 rounding (the
    random negatives of the real rows are the same draws: the padding rows come last)."""
    _, _, splits, model = small_model("retrieval", "RetrievalArgs.num_negatives=8", *bindings)
    _assert_padding_adds_nothing(model, splits.train.collate(list(range(11))))


@pytest.mark.parametrize(
    "bindings",
    [
        (),
        ("NetworkArgs.use_contextual_features=True", "NetworkArgs.target_group_size=2"),
        ("NetworkArgs.relative_attention_bias='position_time'",),
    ],
)
def test_a_padded_ranking_batch_gives_the_same_loss_and_gradients(bindings):
    """Ranking: the padding samples' candidates are weighted out of the loss and the per-task
    losses; the real candidates see the same attention (the padding sequences are separate)."""
    _, _, splits, model = small_model("ranking", "DatasetArgs.max_num_candidates=4", *bindings)
    batch = splits.train.collate(list(range(11)))
    padded = _assert_padding_adds_nothing(model, batch)
    torch.manual_seed(3)
    tasks = model(batch, loss_normalizer=7.0)["task_losses"]
    torch.manual_seed(3)
    tasks_p = model(padded.batch, loss_normalizer=7.0)["task_losses"]
    torch.testing.assert_close(tasks_p, tasks, rtol=1e-6, atol=1e-7)


def test_the_static_layout_equals_the_copied_one():
    _, _, splits, model = small_model(
        "retrieval", "NetworkArgs.relative_attention_bias='position_time'"
    )
    model.eval()
    pre = model.preprocessor
    batch = _padded(splits.train.collate(list(range(9)))).batch
    emb = model.embeddings(batch)
    items = emb["item_id"]
    ctx = [emb[n].values() for n in model.contextual_names]
    x, layout = pre(batch, ctx, items)
    index = torch.from_numpy(pre.host_index(batch, "cpu"))
    longest = int(batch.item_lengths().max()) + pre.num_contextual
    pre.static = StaticLayout(
        index=index, seqlen_bound=256, inv_max_seqlen=torch.tensor([1.0 / longest])
    )
    try:
        xs, ls = pre(batch, ctx, items)
    finally:
        pre.static = None
    torch.testing.assert_close(xs, x, rtol=0, atol=0)
    assert ls.attn.max_seqlen == 256 and ls.attn.inv_max_seqlen is not None
    for name in ("item_dest", "item_sample", "item_pos", "is_history", "history_lengths"):
        assert torch.equal(getattr(ls, name), getattr(layout, name)), name
    assert torch.equal(ls.attn.seq_offsets, layout.attn.seq_offsets)
    assert torch.equal(ls.attn.timestamps, layout.attn.timestamps)
    pre.static = StaticLayout(index=index[:-1], seqlen_bound=256, inv_max_seqlen=torch.ones(1))
    try:
        with pytest.raises(RuntimeError, match="static layout buffer holds"):
            pre(batch, ctx, items)
    finally:
        pre.static = None


def test_the_capturable_learning_rate_is_filled_in_place():
    cfg = load_config(
        "retrieval", [], ["OptimizerArgs.warmup_iters=4", "OptimizerArgs.learning_rate=0.01"]
    )
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_dense_optimizer([p], cfg.optimizer)
    graph_safe_optimizer(opt, torch.device("cpu"))
    group = opt.param_groups[0]
    lr = group["lr"]
    assert isinstance(lr, torch.Tensor) and group["capturable"] is True
    assert group["initial_lr"] == 0.01
    sched = build_lr_scheduler(opt, cfg.optimizer, 100)
    assert group["lr"] is lr and abs(float(lr) - 0.0025) < 1e-9  # warmup step 1 of 4
    for want in (0.005, 0.0075, 0.01, 0.01):
        sched.step()
        assert group["lr"] is lr and abs(float(lr) - want) < 1e-9
    assert sched.get_last_lr() == [pytest.approx(0.01)]
    graph_safe_optimizer(opt, torch.device("cpu"))  # again, e.g. after loading a state dict
    assert float(group["lr"]) == pytest.approx(0.01) and group["initial_lr"] == 0.01
    # checkpoints carry floats, so any run (graphed or not, any device) loads them
    saved_opt = float_learning_rates(opt.state_dict())
    saved_sched = float_learning_rates(sched.state_dict())
    assert type(saved_opt["param_groups"][0]["lr"]) is float
    assert all(type(v) is float for v in saved_sched["_last_lr"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live groups unchanged
    plain = build_dense_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg.optimizer)
    plain.load_state_dict(saved_opt)
    assert plain.param_groups[0]["lr"] == pytest.approx(0.01)


def test_what_the_step_graphs_refuse(monkeypatch):
    _, _, _, model = small_model("retrieval", "EmbeddingArgs.embedding_backend='dense'")
    assert "step graphs: retrieval, ranking" in step_graphs_unsupported(model, "adam", "x")
    # on CPU the encoder has no graphs (no compiled attention)
    assert "compiled attention" in step_graphs_unsupported(model, "adam", "retrieval")
    _, _, _, ranker = small_model("ranking", "EmbeddingArgs.embedding_backend='dense'")
    ranker.encoder.graphs = object()
    assert step_graphs_unsupported(ranker, "adam", "ranking") == ""
    _, _, _, ranker = small_model("ranking")  # torchrec tables: taken too
    ranker.encoder.graphs = object()
    assert step_graphs_unsupported(ranker, "adam", "ranking") == ""
    model.encoder.graphs = object()  # as on a GPU with the compiled attention
    assert step_graphs_unsupported(model, "adam", "retrieval") == ""
    assert "sgd" in step_graphs_unsupported(model, "sgd", "retrieval")
    # random negatives: a corpus looked up whole, up to WHOLE_CORPUS_ROWS items (100 here)
    monkeypatch.setattr(step_graphs, "WHOLE_CORPUS_ROWS", 99)
    model.whole_corpus_rows = 99
    assert "more than 99 items" in step_graphs_unsupported(model, "adam", "retrieval")
    model.whole_corpus_rows = 100
    assert step_graphs_unsupported(model, "adam", "retrieval") == ""
    model.whole_corpus_rows = 99
    model.negative_sampling = "in_batch"
    assert step_graphs_unsupported(model, "adam", "retrieval") == ""


def test_the_whole_corpus_gives_the_distinct_ids_loss_and_gradients():
    """What a graphed step changes for a corpus above num_negatives * hidden_size: the whole
    corpus looked up instead of the distinct sampled ids, the same logits from the same draws."""
    _, _, splits, model = small_model(
        "retrieval", "RetrievalArgs.num_negatives=4", "EmbeddingArgs.embedding_backend='dense'"
    )
    model.train()
    batch = splits.train.collate(list(range(7)))
    model.whole_corpus_rows = 0  # distinct ids
    loss, grads = _loss_and_grads(model, batch, seed=5)
    model.whole_corpus_rows = WHOLE_CORPUS_ROWS
    loss_w, grads_w = _loss_and_grads(model, batch, seed=5)
    assert model._sample_negatives(3).whole_corpus
    torch.testing.assert_close(loss_w, loss, rtol=1e-6, atol=1e-7)
    for name, g in grads.items():
        err = float((grads_w[name] - g).abs().max() / g.abs().max().clamp(min=1e-12))
        assert err < 1e-5, (name, err)


def test_a_replayed_batch_has_its_ids_checked_on_the_host():
    """A replay runs none of the lookup's Python: the runner checks the id ranges itself."""
    import contextlib

    from hstu.training.step_graphs import StepGraphs

    _, _, splits, model = small_model("retrieval", "EmbeddingArgs.embedding_backend='dense'")
    runner = StepGraphs(model, None, [], torch.device("cpu"), autocast=contextlib.nullcontext)
    batch = splits.train.collate(list(range(5)))
    padded = runner.pad(batch)
    assert padded.key.index == padded.index.shape[0] > 0
    model.embeddings.check_host_ids(padded.batch)  # in range: no error
    kjt = padded.batch.features
    kjt.values()[kjt.offset_per_key()[kjt.keys().index("item_id")]] = 10**6  # past the table
    with pytest.raises(ValueError, match="ids must lie in"):
        model.embeddings.check_host_ids(padded.batch)


def test_sample_weights_of_a_wrong_shape_are_refused():
    _, _, splits, model = small_model("retrieval")
    model.train()
    batch = splits.train.collate(list(range(4)))
    batch.sample_weights = torch.ones(3)
    with pytest.raises(ValueError, match=r"sample_weights must be float \[B\] = \[4\]"):
        model(batch)
    _, _, splits, ranker = small_model("ranking")
    batch = splits.train.collate(list(range(4)))
    batch.sample_weights = torch.ones(3)
    with pytest.raises(ValueError, match=r"sample_weights must be float32 \[4\]"):
        ranker(batch)
    batch.sample_weights = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sample_weights must be float32 \[4\]"):
        ranker(batch)


def test_the_scope_is_a_checked_choice():
    cfg = load_config("retrieval", [], ["NetworkArgs.cuda_graph_scope='encoder'"])
    assert cfg.network.cuda_graph_scope == "encoder"
    with pytest.raises(Exception, match="cuda_graph_scope"):
        load_config("retrieval", [], ["NetworkArgs.cuda_graph_scope='all'"])


# ---- GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


_needs_kernels = needs_compiled_kernels


@gpu
def test_step_graphs_follow_the_eager_losses(tmp_path, run_dir_bindings):
    """No random draws (in-batch negatives, no dropout): the graphed step and the encoder-graphed
    step see the same batches and follow the same losses within bf16 noise; the graphs replay
    most steps, with a warmup schedule (the learning rate read from device memory)."""
    _needs_kernels()
    det = ("RetrievalArgs.negative_sampling='in_batch'", "NetworkArgs.hidden_dropout=0.0")
    step, res_step = graphed_run(tmp_path, run_dir_bindings, "step", "step", *det)
    enc, res_enc = graphed_run(tmp_path, run_dir_bindings, "enc", "encoder", *det)
    assert step.step_graphs is not None and enc.step_graphs is None
    stats = step.graph_stats()
    assert stats.disabled == "" and stats.captures >= 1, stats
    assert stats.replays >= 40, stats
    a = torch.tensor([loss for _, loss in res_step.losses])
    b = torch.tensor([loss for _, loss in res_enc.losses])
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    for k in ("HR@10", "NDCG@10"):
        assert abs(res_step.final_metrics[k] - res_enc.final_metrics[k]) < 0.05, k


@gpu
def test_step_graphs_draw_fresh_negatives_and_dropout_per_replay(tmp_path, run_dir_bindings):
    """Random negatives and dropout inside the graphs: the losses of replayed steps differ from
    step to step as eager ones do and the run learns as the eager run does."""
    _needs_kernels()
    rand = ("RetrievalArgs.negative_sampling='random'", "NetworkArgs.hidden_dropout=0.2")
    step, res_step = graphed_run(tmp_path, run_dir_bindings, "step", "step", *rand)
    enc, res_enc = graphed_run(tmp_path, run_dir_bindings, "enc", "encoder", *rand)
    assert step.graph_stats().replays >= 40
    a = np.array([loss for _, loss in res_step.losses])
    b = np.array([loss for _, loss in res_enc.losses])
    assert np.isfinite(a).all() and len(set(a.round(6).tolist())) == len(a)
    # same trend: the mean of the last 20 losses within 10% of the eager run's
    assert abs(a[-20:].mean() - b[-20:].mean()) < 0.1 * b[-20:].mean()
    assert a[-20:].mean() < a[:10].mean()


@gpu
def test_a_failed_capture_leaves_a_run_that_trains_eagerly(tmp_path, run_dir_bindings, monkeypatch):
    """A capture that fails (here: a host read inside the captured step) turns the step graphs
    off and the run goes on eagerly, random negatives and dropout included (the generator is
    not left marked as capturing)."""
    _needs_kernels()
    fail_retrieval_captures(monkeypatch)
    rand = ("RetrievalArgs.negative_sampling='random'", "NetworkArgs.hidden_dropout=0.2")
    step, res = graphed_run(tmp_path, run_dir_bindings, "fails", "step", *rand)
    stats = step.graph_stats()
    assert "capturing failed" in stats.disabled and stats.replays == 0, stats
    losses = np.array([loss for _, loss in res.losses])
    assert len(losses) == 80 and np.isfinite(losses).all()
    assert losses[-3:].mean() < losses[:3].mean()
    torch.rand(4, device="cuda")  # the default generator still works after the run


@gpu
def test_ranking_step_graphs_follow_the_eager_losses(tmp_path, run_dir_bindings):
    """Ranking (candidates, labels, contextual tokens, target groups) with plain tables trained
    by row-wise Adagrad: the graphed step follows the encoder-graphed step's losses on the same
    batches (no random draws) and replays most steps."""
    _needs_kernels()
    ranking = (
        "DatasetArgs.max_num_candidates=6",
        "NetworkArgs.num_attention_heads=2",
        "NetworkArgs.kv_channels=32",
        "NetworkArgs.hidden_dropout=0.0",
        "NetworkArgs.target_group_size=2",
        "NetworkArgs.use_contextual_features=True",
        "NetworkArgs.relative_attention_bias='none'",
        "EmbeddingArgs.plain_table_optimizer='sparse'",
        "EmbeddingArgs.sparse_learning_rate=0.05",
    )
    runs = {
        scope: graphed_run(tmp_path, run_dir_bindings, scope, scope, *ranking, task="ranking")
        for scope in ("step", "encoder")
    }
    (step, res_step), (enc, res_enc) = runs["step"], runs["encoder"]
    assert step.step_graphs is not None and enc.step_graphs is None
    stats = step.graph_stats()
    assert stats.disabled == "" and stats.replays >= 40, stats
    a = torch.tensor([loss for _, loss in res_step.losses])
    b = torch.tensor([loss for _, loss in res_enc.losses])
    assert len(a) == len(b) == 80
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@gpu
def test_step_graphs_train_a_plain_table_with_the_sparse_optimizer(tmp_path, run_dir_bindings):
    """Retrieval with the plain item table trained by row-wise Adagrad inside the graphs: the
    same losses as the encoder-graphed (eager) step on the same batches, the loss falling."""
    _needs_kernels()
    det = (
        "RetrievalArgs.negative_sampling='in_batch'",
        "NetworkArgs.hidden_dropout=0.0",
        "EmbeddingArgs.plain_table_optimizer='sparse'",
        "EmbeddingArgs.sparse_learning_rate=0.2",
    )
    step, res_step = graphed_run(tmp_path, run_dir_bindings, "step", "step", *det)
    enc, res_enc = graphed_run(tmp_path, run_dir_bindings, "enc", "encoder", *det)
    assert step.table_optimizer is not None and step.step_graphs is not None
    stats = step.graph_stats()
    assert stats.disabled == "" and stats.replays >= 40, stats
    a = torch.tensor([loss for _, loss in res_step.losses])
    b = torch.tensor([loss for _, loss in res_enc.losses])
    torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    assert a[-10:].mean() < a[:10].mean()


def test_a_batch_padded_ahead_is_the_one_its_step_takes(monkeypatch):
    """`StepGraphs.prepare` (the prefetch thread) pads and lays the batch out; the step takes that
    padded batch instead of padding again, and a batch it did not see is padded at its step."""
    _, _, splits, model = small_model("retrieval")
    graphs = step_graphs.StepGraphs(
        model,
        lambda b, n: None,
        list(model.parameters()),
        torch.device("cpu"),
        autocast=contextlib.nullcontext,
        pad_sizes_per_octave=4,
    )
    host = splits.train.collate(list(range(9)))
    graphs.prepare(host)
    ahead = graphs._padded(host)
    assert ahead is not None and ahead.key.samples > host.batch_size
    direct = graphs.pad(host)
    assert ahead.key == direct.key
    np.testing.assert_array_equal(ahead.index, direct.index)
    assert not host.host_memo  # taken out: a second step of the batch pads it anew
    calls = []
    monkeypatch.setattr(graphs, "pad", lambda b: calls.append(b) or direct)
    graphs.prepare(host)
    assert graphs._padded(host) is direct and len(calls) == 1
    assert graphs._padded(host) is direct and len(calls) == 2  # not prepared: padded now
    # a batch the graphs do not take is remembered as such (no second try at its step)
    evaluation = splits.eval.collate([0, 1])
    monkeypatch.undo()
    graphs.prepare(evaluation)
    assert graphs._padded(evaluation) is None
    # disabled graphs: the model's own host layout instead, for its eager step
    graphs.stats.disabled = True
    other = splits.train.collate(list(range(5)))
    graphs.prepare(other)
    assert other.host_memo and all(k[0] != "step_graphs" for k in other.host_memo)


def test_close_releases_the_graphs_before_the_process_group(monkeypatch):
    """A graph that holds `FlatGradients`' all-reduce keeps NCCL's communicator in use:
    destroying the process group first never returned at the end of a two-GPU run. `close`
    releases the step's graphs first, and a release that fails does not skip the cleanup."""
    from types import SimpleNamespace

    from hstu.training import trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "cleanup", lambda info: calls.append("cleanup"))
    closable = SimpleNamespace(close=lambda: calls.append("close"))

    def trainer_with(release):
        return SimpleNamespace(
            pipeline=closable,
            tb=closable,
            info=None,
            step_graphs=SimpleNamespace(release=release),
            _cpu_threads_before=torch.get_num_threads(),
        )

    trainer_mod.Trainer.close(trainer_with(lambda: calls.append("release")))
    assert calls == ["close", "close", "release", "cleanup"]

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    calls.clear()
    trainer_mod.Trainer.close(trainer_with(broken))
    assert calls == ["close", "close", "cleanup"]
