"""Dynamic and torchrec tables in the CUDA graphs of the whole training step
(hstu.training.step_graphs, "Dynamic and torchrec tables"): the tables are looked up before the
replay and updated after it; the graph reads the looked-up rows from fixed tensors
(`EmbeddingStack.stage_sparse`).

CPU: a step split that way (lookup, the model on staged copies of the rows, the tables' update
from the copies' gradients) gives exactly the losses, dense parameters and table contents of
the ordinary step, for retrieval (random and in-batch negatives) and ranking, with dynamic,
torchrec and mixed tables; staged rows of the wrong shape, names or count are refused; what the
step graphs refuse of these tables. GPU (-m gpu): graphed runs follow the encoder-graphed runs'
losses and replay most steps; a failed capture after the lookup finishes its step from the
looked-up rows.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from model_helpers import (
    fail_retrieval_captures,
    graphed_run,
    needs_compiled_kernels,
    small_model,
)

from hstu.training import step_graphs
from hstu.training.step_graphs import pad_batch, step_graphs_unsupported

DYNAMIC = (
    "EmbeddingArgs.embedding_backend='dynamic'",
    "EmbeddingArgs.contextual_tables='dense'",
    "EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'",
    "EmbeddingArgs.sparse_learning_rate=0.1",
)


def _plain_step(model, opt, batch, seed):
    torch.manual_seed(seed)
    out = model(batch, loss_normalizer=7.0)
    out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out["loss"].detach()


def _split_step(model, opt, batch, seed):
    """The step as the step graphs run it: lookup, the model on staged leaves, the update."""
    emb = model.embeddings
    rows = emb.lookup_sparse(batch, *model.fixed_extra_ids())
    with step_graphs.staged(emb, rows) as leaves:
        torch.manual_seed(seed)
        out = model(batch, loss_normalizer=7.0)
        out["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_graphs.update_tables(rows, leaves)
    return out["loss"].detach()


def _dump(model):
    emb = model.embeddings
    dump = emb.dynamic_collection.dump() if emb.dynamic_collection is not None else {}
    if emb.embedding_collection is not None:
        dump.update(emb.embedding_collection.state_dict())
    return {k: v.clone() for k, v in dump.items()}


RANDOM = ("RetrievalArgs.negative_sampling='random'", "RetrievalArgs.num_negatives=8")
CONTEXT = ("DatasetArgs.max_num_candidates=4", "NetworkArgs.use_contextual_features=True")
TORCHREC = (
    "EmbeddingArgs.embedding_backend='torchrec'",
    "EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'",
    "EmbeddingArgs.sparse_learning_rate=0.1",
)


@pytest.mark.parametrize(
    "task,bindings",
    [
        ("retrieval", (*DYNAMIC, *RANDOM)),
        ("retrieval", (*DYNAMIC, "RetrievalArgs.negative_sampling='in_batch'")),
        ("ranking", (*DYNAMIC, *CONTEXT)),
        # rows in host memory with an HBM cache (the staging is the same; the step graphs take
        # HBM tables only)
        ("retrieval", (*DYNAMIC, "EmbeddingArgs.storage='hybrid'", "EmbeddingArgs.hbm_cache=0.5")),
        # torchrec tables (their fused optimizer runs in the rows' backward)
        ("retrieval", (*TORCHREC, *RANDOM)),
        ("retrieval", (*TORCHREC, "RetrievalArgs.negative_sampling='in_batch'")),
        ("ranking", (*TORCHREC, *CONTEXT)),
        # a dynamic item table beside torchrec contextual tables
        ("ranking", (*DYNAMIC, "EmbeddingArgs.contextual_tables='torchrec'", *CONTEXT)),
    ],
)
def test_a_split_step_equals_the_plain_step(task, bindings):
    from hstu.embeddings.stack import EmbeddingStack

    models = [small_model(task, *bindings) for _ in range(2)]
    splits = models[0][2]
    plain, split = models[0][3], models[1][3]
    for m in (plain, split):
        m.train()
        m.embeddings.configure_sparse_optimizer("cpu")  # torchrec tables: fused into backward
        if hasattr(m, "whole_corpus_rows"):
            m.whole_corpus_rows = 10**6  # the whole corpus, as a graphed step looks it up
    emb = split.embeddings
    assert emb.has_sparse_tables
    opts = [
        torch.optim.Adam(
            [
                p
                for n, p in m.named_parameters()
                if p.requires_grad and not EmbeddingStack.is_sparse_parameter(n)
            ],
            lr=1e-2,
        )
        for m in (plain, split)
    ]
    first = _dump(plain)
    for step in range(3):
        batch = splits.train.collate(list(range(8 * step, 8 * step + 8)))
        padded = pad_batch(
            batch, num_contextual=plain.preprocessor.num_contextual, pad_sizes_per_octave=8
        ).batch
        a = _plain_step(plain, opts[0], padded, seed=step)
        b = _split_step(split, opts[1], padded, seed=step)
        assert torch.equal(a, b), (step, a, b)
    for (n, p), (_, q) in zip(plain.named_parameters(), split.named_parameters()):
        assert torch.equal(p, q), n
    da, db = _dump(plain), _dump(split)
    assert da.keys() == db.keys()
    for k in da:
        assert torch.equal(da[k], db[k]), k
    # the tables were trained: dynamic rows exist, torchrec rows moved from their initial values
    if emb.dynamic_collection is not None:
        assert any(k.endswith("/keys") and v.numel() > 0 for k, v in da.items())
    if emb.embedding_collection is not None:
        moved = [k for k in first if "/" not in k and not torch.equal(first[k], da[k])]
        assert moved and all(k.startswith("embeddings.") for k in moved), moved


def test_staged_rows_of_another_shape_or_count_are_refused():
    _, _, splits, model = small_model("retrieval", *DYNAMIC)
    model.train()
    table = model.embeddings.dynamic_collection.tables["item_table"]
    with pytest.raises(ValueError, match=r"staged rows must be \[n, \d+\] of torch.float32"):
        table.stage(torch.zeros(3, table.dim + 1))
    with pytest.raises(KeyError, match="no dynamic tables"):
        model.embeddings.stage_sparse({"nope": torch.zeros(1, table.dim)})
    model.embeddings.stage_sparse({"item_table": torch.zeros(3, table.dim)})
    try:
        with pytest.raises(RuntimeError, match="a lookup of .* ids met 3 staged rows"):
            model(splits.train.collate([0, 1, 2]), loss_normalizer=1.0)
    finally:
        model.embeddings.stage_sparse(None)
    model(splits.train.collate([0, 1, 2]), loss_normalizer=1.0)  # unstaged: looks up again
    # a 'custom' table takes its scores with the ids: lookup_tables refuses it, naming it
    table.config = dataclasses.replace(table.config, eviction_policy="custom")
    with pytest.raises(ValueError, match="'item_table' has eviction_policy='custom'"):
        model.embeddings.dynamic_collection.lookup_tables({"item_id": torch.arange(3)})


def test_staged_torchrec_rows_are_checked():
    _, _, splits, model = small_model("ranking", *TORCHREC, *CONTEXT)
    model.train()
    emb = model.embeddings
    batch = splits.train.collate([0, 1, 2])
    rows = emb.lookup_sparse(batch)
    static = [k for k in emb.features if k not in emb.dynamic_features]
    assert sorted(rows) == sorted("torchrec:" + k for k in static)
    looked = emb(batch)
    for k in static:
        assert torch.equal(rows["torchrec:" + k], looked[k].values())
    width = emb.table_dim
    with pytest.raises(ValueError, match=rf"feature 'item_id' must be \[n, {width}\]"):
        emb.stage_sparse({**rows, "torchrec:item_id": torch.zeros(3, width + 1)})
    with pytest.raises(KeyError, match="must name the features"):
        emb.stage_sparse({"torchrec:item_id": rows["torchrec:item_id"]})
    with pytest.raises(KeyError, match="no dynamic tables"):
        emb.stage_sparse({**rows, "item_table": rows["torchrec:item_id"]})
    assert emb._staged_torchrec is None  # a refused staging stages nothing
    emb.stage_sparse({**rows, "torchrec:item_id": torch.zeros(2, width)})
    try:
        with pytest.raises(RuntimeError, match="'item_id': a lookup of .* ids met 2 staged rows"):
            model(batch, loss_normalizer=1.0)
    finally:
        emb.stage_sparse(None)
    model(batch, loss_normalizer=1.0)  # unstaged: looks up again
    # torchrec rows for a model whose tables are plain
    _, _, _, plain = small_model("ranking", "EmbeddingArgs.embedding_backend='dense'")
    with pytest.raises(KeyError, match="for torchrec tables; there are none"):
        plain.embeddings.stage_sparse({"torchrec:item_id": torch.zeros(2, width)})


def test_what_the_step_graphs_refuse_of_dynamic_and_torchrec_tables():
    _, _, _, model = small_model("retrieval", *DYNAMIC)
    model.encoder.graphs = object()  # as on a GPU with the compiled attention
    assert step_graphs_unsupported(model, "adam", "retrieval") == ""
    # torchrec tables are taken (contextual ones beside a dynamic item table, or all of them)
    for backend in ("dynamic", "torchrec"):
        _, _, _, ranker = small_model("ranking", f"EmbeddingArgs.embedding_backend='{backend}'")
        ranker.encoder.graphs = object()
        assert ranker.embeddings.embedding_collection is not None
        assert step_graphs_unsupported(ranker, "adam", "ranking") == ""
    _, _, _, ranker = small_model("ranking", *DYNAMIC)
    ranker.encoder.graphs = object()
    assert step_graphs_unsupported(ranker, "adam", "ranking") == ""
    # (the configs offer lru and lfu; a table built by hand may take its scores with the ids)
    table = ranker.embeddings.dynamic_collection.tables["item_table"]
    table.config = dataclasses.replace(table.config, eviction_policy="custom")
    assert "eviction_policy='custom'" in step_graphs_unsupported(ranker, "adam", "ranking")
    # random negatives from a corpus looked up whole: Adam would move rows without gradient
    _, _, _, adam = small_model("retrieval", *DYNAMIC, "EmbeddingArgs.sparse_optimizer_str='adam'")
    adam.encoder.graphs = object()
    adam.whole_corpus_rows = 10
    assert "trained by the sparse Adam" in step_graphs_unsupported(adam, "adam", "retrieval")
    adam.negative_sampling = "in_batch"
    assert step_graphs_unsupported(adam, "adam", "retrieval") == ""
    # the same with a torchrec item table
    _, _, _, trec = small_model(
        "retrieval", *TORCHREC, *RANDOM, "EmbeddingArgs.sparse_optimizer_str='adam'"
    )
    trec.encoder.graphs = object()
    assert step_graphs_unsupported(trec, "adam", "retrieval") == ""  # corpus looked up whole
    trec.whole_corpus_rows = 10
    assert "trained by the sparse Adam" in step_graphs_unsupported(trec, "adam", "retrieval")
    trec.embeddings.args = dataclasses.replace(trec.embeddings.args, sparse_optimizer_str="sgd")
    assert step_graphs_unsupported(trec, "adam", "retrieval") == ""
    _, _, _, hybrid = small_model("retrieval", *DYNAMIC, "EmbeddingArgs.storage='hybrid'")
    hybrid.encoder.graphs = object()
    assert "storage='hybrid'" in step_graphs_unsupported(hybrid, "adam", "retrieval")


def test_the_fixed_extra_ids_are_those_the_forward_looks_up():
    _, _, _, model = small_model("retrieval", *DYNAMIC, "RetrievalArgs.negative_sampling='random'")
    model.whole_corpus_rows = 10**6
    ids, host = model.fixed_extra_ids()
    assert torch.equal(ids, model.item_corpus) and torch.equal(host, model.item_corpus.cpu())
    assert torch.equal(model._sample_negatives(3).lookup_ids, ids)
    model.whole_corpus_rows = 1
    with pytest.raises(RuntimeError, match="drawn in the forward"):
        model.fixed_extra_ids()
    model.negative_sampling = "in_batch"
    assert model.fixed_extra_ids() == (None, None)
    _, _, _, ranker = small_model("ranking", *DYNAMIC)
    assert ranker.fixed_extra_ids() == (None, None)


def test_a_one_rank_sharded_collection_looks_up_what_its_forward_does(tmp_path):
    """`ShardedDynamicEmbeddingCollection.lookup_tables` on one rank: the rows of forward, and
    the same tables after the same gradients (a table without a feature here looks up nothing,
    as forward's plan does)."""
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hstu.embeddings.dynamic_config import DynamicEmbeddingConfig
    from hstu.embeddings.sharding import ShardedDynamicEmbeddingCollection

    def configs():
        return [
            DynamicEmbeddingConfig("items", 8, 256, ["item", "cand"], learning_rate=0.1, seed=1),
            DynamicEmbeddingConfig("users", 4, 64, ["user"], optimizer="rowwise_adagrad"),
        ]

    # (an earlier test of the session may have left a one-process default group behind)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        a, b = (ShardedDynamicEmbeddingCollection(configs(), "cpu") for _ in range(2))
        for m in (a, b):
            m.train()
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            item, cand = (
                torch.randint(0, 50, (12,), generator=g),
                torch.randint(0, 50, (5,), generator=g),
            )
            kjt = KeyedJaggedTensor(
                keys=["item", "cand"], values=torch.cat([item, cand]), lengths=torch.tensor([12, 5])
            )
            out = a(kjt, host_ids={"item": item, "cand": cand})
            rows = b.lookup_tables({"item": item, "cand": cand}, {"item": item, "cand": cand})
            assert sorted(rows) == ["items", "users"] and rows["users"].shape == (0, 4)
            ref = torch.cat([out["item"].values(), out["cand"].values()])
            assert torch.equal(rows["items"], ref)
            grad = torch.randn(ref.shape, generator=g)
            ref.backward(grad)
            rows["items"].backward(grad)
        da, db = a.dump(), b.dump()
        for k in da:
            assert torch.equal(da[k], db[k]), k
        assert a.tables["users"].step == b.tables["users"].step == 3
        # (several ranks: tests/test_dynamic_embedding_sharding.py, the "split" modes)
        _staging_on_several_ranks(b, item, cand)
    finally:
        if owned:
            dist.destroy_process_group()


def _staging_on_several_ranks(coll, item, cand):
    """A sharded collection of several ranks stages this rank's own rows at the collection:
    forward returns them split per feature, without collectives, and refuses what does not fit
    (``coll`` is made to look like one of two ranks; nothing here communicates)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    coll.world_size = 2
    n = item.numel() + cand.numel()
    rows = {"items": torch.randn(n, 8), "users": torch.zeros(0, 4)}
    kjt = KeyedJaggedTensor(
        keys=["item", "cand"],
        values=torch.cat([item, cand]),
        lengths=torch.tensor([item.numel(), cand.numel()]),
    )
    dump = coll.dump()
    coll.stage(rows)
    try:
        out = coll(kjt)
        assert torch.equal(out["item"].values(), rows["items"][: item.numel()])
        assert torch.equal(out["cand"].values(), rows["items"][item.numel() :])
        short = KeyedJaggedTensor(keys=["item"], values=item[:2], lengths=torch.tensor([2]))
        with pytest.raises(RuntimeError, match="staged for another batch"):
            coll(short)
        with pytest.raises(RuntimeError, match="takes no input dist"):
            coll(kjt, dist_input=object())
    finally:
        coll.stage(None)
    for k, v in coll.dump().items():  # the shards were neither read nor changed
        assert torch.equal(v, dump[k]), k
    with pytest.raises(KeyError, match="no dynamic tables"):
        coll.stage({"nope": rows["items"]})
    with pytest.raises(ValueError, match="staged rows must be"):
        coll.stage({"items": torch.zeros(n, 3)})
    coll.stage({})  # nothing staged: as None
    assert coll._staged_tables is None
    coll.world_size = 1
    with pytest.raises(ValueError, match="one rank has no input dist"):
        coll.lookup_tables({"item": item}, dist_input=object())


def test_step_outputs_clone_every_field():
    from hstu.training.step_graphs import StepOutputs

    out = StepOutputs(torch.ones(1), torch.full((1,), 2.0), torch.arange(3.0))
    assert [f.name for f in dataclasses.fields(StepOutputs)] == [
        "loss_sum",
        "grad_norm",
        "task_losses",
    ]
    assert [t.data_ptr() for t in out.tensors()] == [
        getattr(out, f.name).data_ptr() for f in dataclasses.fields(StepOutputs)
    ]
    copy = out.clone()
    for a, b in zip(out.tensors(), copy.tensors()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert StepOutputs(torch.ones(1)).clone().grad_norm is None


# ---- GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _run(tmp_path, run_dir_bindings, name, scope, *extra, task="retrieval", tables=DYNAMIC):
    """A small synthetic run on the GPU with dynamic tables (or ``tables``) and CUDA graphs of
    ``scope``."""
    more = ("NetworkArgs.hidden_dropout=0.0", *tables, *extra)
    return graphed_run(tmp_path, run_dir_bindings, name, scope, *more, task=task)


def _losses(result):
    return torch.tensor([loss for _, loss in result.losses])


RANKING = (
    "DatasetArgs.max_num_candidates=6",
    "NetworkArgs.use_contextual_features=True",
    "NetworkArgs.target_group_size=2",
)


@gpu
@pytest.mark.parametrize(
    "task,extra,tables",
    [
        ("retrieval", ("RetrievalArgs.negative_sampling='in_batch'",), DYNAMIC),
        ("ranking", RANKING, DYNAMIC),
        ("retrieval", ("RetrievalArgs.negative_sampling='in_batch'",), TORCHREC),
        ("ranking", RANKING, TORCHREC),
        ("ranking", RANKING, (*DYNAMIC, "EmbeddingArgs.contextual_tables='torchrec'")),
    ],
    ids=["dynamic-retrieval", "dynamic-ranking", "torchrec-retrieval", "torchrec-ranking", "mixed"],
)
def test_step_graphs_with_sparse_tables_follow_the_eager_losses(
    tmp_path, run_dir_bindings, task, extra, tables, monkeypatch
):
    """No random draws: the graphed step (dynamic and torchrec tables looked up before each
    replay, updated after it) follows the encoder-graphed step's losses within bf16 noise,
    replays most steps, and leaves tables of the same size that serve the same evaluation."""
    needs_compiled_kernels()
    staged: set[str] = set()  # the rows the captures read (the trainer's close drops the graphs)
    capture_once = step_graphs.StepGraphs._capture_once

    def recording_capture(self, *args, **kwargs):
        entry = capture_once(self, *args, **kwargs)
        staged.update(entry.staged)
        return entry

    monkeypatch.setattr(step_graphs.StepGraphs, "_capture_once", recording_capture)
    run = functools.partial(_run, tmp_path, run_dir_bindings, task=task, tables=tables)
    step, res_step = run("step", "step", *extra)
    enc, res_enc = run("enc", "encoder", *extra)
    assert step.step_graphs is not None and enc.step_graphs is None
    stats = step.graph_stats()
    assert stats.disabled == "" and stats.replays >= 40, stats
    a, b = _losses(res_step), _losses(res_enc)
    assert len(a) == len(b) == 80
    # bf16 noise grows over the run (fbgemm's row updates sum duplicate ids in another order
    # with the padding's ids): step by step early, 10-step means late
    torch.testing.assert_close(a[:60], b[:60], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(a.view(8, 10).mean(1), b.view(8, 10).mean(1), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(a, b, rtol=0.1, atol=0.1)
    assert a[-10:].mean() < a[:10].mean()
    assert res_step.table_rows == res_enc.table_rows
    assert res_step.table_rows or tables == TORCHREC
    assert staged
    if "torchrec" in str(tables):
        assert any(n.startswith("torchrec:") for n in staged), staged
    for k, v in res_enc.final_metrics.items():
        assert abs(res_step.final_metrics[k] - v) < 0.05, k


@gpu
@pytest.mark.parametrize("tables", [DYNAMIC, TORCHREC], ids=["dynamic", "torchrec"])
def test_step_graphs_with_sparse_tables_and_random_negatives_learn(
    tmp_path, run_dir_bindings, tables
):
    needs_compiled_kernels()
    rand = ("RetrievalArgs.negative_sampling='random'", "RetrievalArgs.num_negatives=16")
    step, res_step = _run(tmp_path, run_dir_bindings, "step", "step", *rand, tables=tables)
    enc, res_enc = _run(tmp_path, run_dir_bindings, "enc", "encoder", *rand, tables=tables)
    assert step.graph_stats().replays >= 40
    a, b = _losses(res_step).numpy(), _losses(res_enc).numpy()
    assert np.isfinite(a).all() and a[-20:].mean() < a[:10].mean()
    assert abs(a[-20:].mean() - b[-20:].mean()) < 0.1 * b[-20:].mean()


@gpu
def test_a_failed_capture_after_the_lookup_finishes_its_step(
    tmp_path, run_dir_bindings, monkeypatch
):
    """The capture fails after the dynamic tables looked the batch up: that step runs from the
    looked-up rows (no second lookup), the mode turns off and the run trains on eagerly."""
    needs_compiled_kernels()
    fail_retrieval_captures(monkeypatch)
    det = ("RetrievalArgs.negative_sampling='in_batch'",)
    step, res = _run(tmp_path, run_dir_bindings, "fails", "step", *det)
    stats = step.graph_stats()
    assert "capturing failed" in stats.disabled and stats.replays == 0, stats
    losses = _losses(res).numpy()
    assert len(losses) == 80 and np.isfinite(losses).all()
    assert losses[-5:].mean() < losses[:5].mean()
    tables = step.embeddings.dynamic_collection.tables.values()
    assert all(t._staged is None for t in tables)


@gpu
@pytest.mark.parametrize(
    "tables",
    [("EmbeddingArgs.embedding_backend='dense'",), DYNAMIC, TORCHREC],
    ids=["plain", "dynamic", "torchrec"],
)
def test_a_graphed_run_resumes_from_its_checkpoint(tmp_path, run_dir_bindings, tables):
    """A run whose whole steps replay from graphs saves what they trained (the dense state with
    its tensor learning rates, and the tables updated after each replay); a graphed run resumed
    from that checkpoint continues the uninterrupted run's losses (GPU atomics and bf16: within
    5%)."""
    needs_compiled_kernels()
    det = ("RetrievalArgs.negative_sampling='in_batch'",)
    run = functools.partial(_run, tmp_path, run_dir_bindings, tables=tables)
    _, full = run("full", "step", *det, "TrainerArgs.max_train_iters=40")
    _, first = run(
        "first", "step", *det, "TrainerArgs.max_train_iters=20", "TrainerArgs.ckpt_save_interval=20"
    )
    assert first.checkpoint_dir is not None
    load = f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'"
    again, resumed = run("resumed", "step", *det, "TrainerArgs.max_train_iters=40", load)
    assert again.step_graphs is not None and again.graph_stats().replays >= 10
    assert [s for s, _ in resumed.losses] == list(range(21, 41))
    torch.testing.assert_close(_losses(resumed), _losses(full)[20:], rtol=5e-2, atol=5e-2)


def test_the_input_dist_started_ahead_is_that_of_the_padded_batch_and_the_corpus(monkeypatch):
    """`StepGraphs.start_input_dist` (the pipeline's lookahead on several processes) routes the
    ids the graphed step will look up: the padded batch's and the corpus that random negatives
    look up whole; the padding is kept for the step, and a batch the graphs do not take routes
    as it is."""
    import contextlib

    _, _, splits, model = small_model("retrieval", *DYNAMIC, *RANDOM)
    runner = step_graphs.StepGraphs(
        model, None, [], torch.device("cpu"), autocast=contextlib.nullcontext, split_eager=True
    )
    assert runner.split_eager
    started = []
    monkeypatch.setattr(
        model.embeddings,
        "start_input_dist",
        lambda batch, extra_host_ids=None: started.append((batch, extra_host_ids)) or "dist",
    )
    host = splits.train.collate(list(range(5)))
    assert runner.start_input_dist(host) == "dist"
    target, extra = started[-1]
    padded = runner._padded(host)  # the step takes the padding made for the input dist
    assert target is padded.batch and target.batch_size % 8 == 0 and target.batch_size > 5
    assert torch.equal(extra, model.fixed_extra_ids()[1])
    assert extra.numel() == model.item_corpus.numel()
    # prepared on the prefetch thread first: the same padding is routed
    host = splits.train.collate(list(range(5, 9)))
    runner.prepare(host)
    prepared = host.host_memo[runner._memo_key]
    runner.start_input_dist(host)
    assert started[-1][0] is prepared.batch
    # a batch the graphs do not take (weights already set) routes as it is
    host = splits.train.collate(list(range(3)))
    host.sample_weights = torch.ones(3)
    runner.start_input_dist(host)
    assert started[-1][0] is host and runner._padded(host) is None
    # one process (no split): the eager steps are not split
    plain = step_graphs.StepGraphs(
        model, None, [], torch.device("cpu"), autocast=contextlib.nullcontext
    )
    assert not plain.split_eager


def test_start_input_dist_refuses_extra_ids_off_the_cpu():
    """The input dist started ahead takes the extra ids on the CPU (it routes them over gloo
    from the host): device ids are refused, naming the fix, before any exchange starts."""
    _, _, splits, model = small_model("retrieval", *DYNAMIC, *RANDOM)
    emb = model.embeddings
    emb._input_dist_ahead = True  # as on several ranks (nothing is exchanged: refused first)
    batch = splits.train.collate(list(range(4)))
    with pytest.raises(ValueError, match="takes the extra ids on the CPU"):
        emb.start_input_dist(batch, torch.zeros(3, dtype=torch.int64, device="meta"))
