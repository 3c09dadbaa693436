"""Plain tables trained by the sparse optimizer (EmbeddingArgs.plain_table_optimizer='sparse').

CPU: `PlainTableOptimizer` against the dynamic tables' reference update (every optimizer, with
and without weight decay, duplicate ids, rows a step does not look up); a training run with a
plain item table equals the run with a dynamic table started from the same rows; only looked-up
rows change; checkpoints resume exactly and a layout change is refused; the config checks. The
GPU tests of the optimizer inside the whole-step CUDA graphs are in tests/test_step_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from hstu.config.args import EmbeddingArgs
from hstu.config.gin_utils import load_config
from hstu.config.limits import plain_table_states
from hstu.embeddings import reference_table as ref
from hstu.embeddings.plain_optimizer import PLAIN_TABLE_OPTIMIZERS, PlainTableOptimizer

ROWS, DIM = 24, 6


def _reference_table(weights: torch.Tensor) -> ref.TableState:
    """A reference table whose slot i holds id i with the given rows and zero state."""
    rows = weights.shape[0]
    state = ref.TableState.empty(rows, DIM * 3 + 1, weights.device)
    state.keys.copy_(torch.arange(rows))
    state.values[:, :DIM] = weights
    return state


def _reference_state(kind: str, state: ref.TableState) -> list[torch.Tensor]:
    v = state.values
    if kind == "adagrad":
        return [v[:, DIM : 2 * DIM]]
    if kind == "rowwise_adagrad":
        return [v[:, DIM]]
    if kind == "adam":
        return [v[:, DIM : 2 * DIM], v[:, 2 * DIM : 3 * DIM], v[:, 3 * DIM]]
    return []


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("kind", PLAIN_TABLE_OPTIMIZERS)
def test_the_update_is_the_dynamic_tables_update(kind, weight_decay):
    """Three steps of lookups with repeated ids: the plain table's rows and optimizer state equal
    the reference dynamic table's; rows never looked up keep their initial values."""
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(ROWS, DIM, generator=gen)
    table = torch.nn.Parameter(w0.clone())
    opt = PlainTableOptimizer(
        [table], kind, 0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay
    )
    state = _reference_table(w0)
    code = ref.OPT_CODES[kind]
    for _ in range(3):
        ids = torch.randint(0, ROWS - 4, (15,), generator=gen)  # the last 4 rows: never
        grads = torch.randn(15, DIM, generator=gen)
        table.grad = torch.zeros(ROWS, DIM).index_add_(0, ids, grads)
        opt.step()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        ref.update(
            state, DIM, uniq, uniq, inverse, None, None, grads,
            (code, 0.05, 0.8, 0.95, 1e-6, weight_decay),
        )  # fmt: skip
    torch.testing.assert_close(table.data, state.values[:, :DIM], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table.data[-4:], w0[-4:], rtol=0, atol=0)
    ours = list(opt.state[table].values())
    for a, b in zip(ours, _reference_state(kind, state), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_row_wise_statistics_average_over_the_given_width():
    """A table padded to 8 columns with width 6: the row-wise sum is over the 6 columns."""
    table = torch.nn.Parameter(torch.ones(4, 8))
    opt = PlainTableOptimizer([{"params": [table], "dim": 6}], "rowwise_adagrad", 0.1)
    grad = torch.zeros(4, 8)
    grad[1, :6] = 2.0
    table.grad = grad
    opt.step()
    torch.testing.assert_close(opt.state[table]["sum"], torch.tensor([0.0, 4.0, 0.0, 0.0]))
    assert plain_table_states("rowwise_adagrad", 50) == pytest.approx(1 / 50)
    assert plain_table_states("adam", 50) == pytest.approx(2 + 1 / 50)
    assert plain_table_states("sgd", 50) == 0.0


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="no plain-table update"):
        PlainTableOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], "lamb", 0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        PlainTableOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], "sgd", 0.0)
    with pytest.raises(ValueError, match="plain_table_optimizer='sparse' applies to plain"):
        EmbeddingArgs(embedding_backend="dynamic", plain_table_optimizer="sparse")
    with pytest.raises(ValueError, match="plain_table_optimizer"):
        EmbeddingArgs(embedding_backend="dense", plain_table_optimizer="rows")
    EmbeddingArgs(embedding_backend="dense", plain_table_optimizer="sparse")
    EmbeddingArgs(
        embedding_backend="dynamic", contextual_tables="dense", plain_table_optimizer="sparse"
    )
    opt = PlainTableOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], "adagrad", 0.1)
    other = PlainTableOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], "rowwise_adagrad", 0.1)
    with pytest.raises(ValueError, match="sparse_optimizer_str='adagrad'"):
        opt.load_state_dict(other.state_dict())


SMALL = [
    "DatasetArgs.synthetic_num_users=200",
    "DatasetArgs.synthetic_num_items=120",
    "DatasetArgs.max_history_seqlen=20",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=16",
    "NetworkArgs.num_attention_heads=1",
    "NetworkArgs.kv_channels=16",
    "NetworkArgs.use_contextual_features=False",
    "TrainerArgs.train_batch_size=16",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.max_eval_iters=1",
    "TrainerArgs.log_interval=1",
    "TrainerArgs.ckpt_save_interval=-1",
    "TrainerArgs.progress_bar=False",
    "RetrievalArgs.num_negatives=8",
    "EmbeddingArgs.sparse_optimizer_str='rowwise_adagrad'",
    "EmbeddingArgs.sparse_learning_rate=0.2",
]
PLAIN = ["EmbeddingArgs.embedding_backend='dense'", "EmbeddingArgs.plain_table_optimizer='sparse'"]


def _trainer(tmp_path, name, *bindings):
    from hstu.training.trainer import Trainer

    cfg = load_config(
        "retrieval",
        [],
        SMALL + [f"TrainerArgs.log_dir='{tmp_path}'", f"TrainerArgs.run_name='{name}'", *bindings],
    )
    return Trainer(cfg, device_type="cpu")


def _item_weight(trainer) -> torch.nn.Parameter:
    return trainer.embeddings.dense_tables.table_of("item_id").weight


def test_a_plain_table_trains_as_the_dynamic_table_it_replaces(tmp_path):
    """The same model, batches and negatives with a dynamic item table (row-wise Adagrad) and a
    plain one trained by the same sparse optimizer, started from the same rows and dense weights:
    the same losses, the same rows after training; the dense optimizer never holds the plain
    table and rows no batch looked up keep their initial values."""
    plain = _trainer(tmp_path, "plain", *PLAIN, "TrainerArgs.max_train_iters=12")
    dynamic = _trainer(
        tmp_path, "dynamic", "EmbeddingArgs.embedding_backend='dynamic'",
        "TrainerArgs.max_train_iters=12",
    )  # fmt: skip
    try:
        weight = _item_weight(plain)
        assert plain.table_optimizer is not None and dynamic.table_optimizer is None
        assert all(p is not weight for g in plain.optimizer.param_groups for p in g["params"])
        assert all(p is not weight for p in plain.dense_params)  # not clipped either
        w0 = weight.detach().clone()
        coll = dynamic.embeddings.dynamic_collection
        table = coll.tables["item_table"]
        rows = w0.shape[0]
        coll.load(
            {
                "item_table/keys": torch.arange(rows),
                "item_table/values": w0.clone(),
                "item_table/optimizer_state": torch.zeros(rows, table.config.state_dim),
                "item_table/scores": torch.zeros(rows, dtype=torch.int64),
                "item_table/step": torch.tensor(0),
            }
        )
        dense = dict(plain.model.named_parameters())
        with torch.no_grad():
            for name, p in dynamic.model.named_parameters():
                if name in dense:
                    p.copy_(dense[name])
        torch.manual_seed(7)
        res_plain = plain.fit()
        torch.manual_seed(7)
        res_dynamic = dynamic.fit()
        a = torch.tensor([loss for _, loss in res_plain.losses])
        b = torch.tensor([loss for _, loss in res_dynamic.losses])
        assert len(a) == 12
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        dump = table.dump()
        trained = weight.detach()[dump["keys"]]
        torch.testing.assert_close(trained, dump["values"], rtol=1e-4, atol=1e-5)
        changed = (weight.detach() != w0).any(1)
        state = plain.table_optimizer.state[weight]["sum"]
        assert changed.any() and torch.equal(changed, state > 0)
    finally:
        plain.close()
        dynamic.close()


def test_checkpoints_resume_exactly_and_refuse_another_layout(tmp_path):
    from hstu.training.trainer import Trainer

    first = _trainer(tmp_path, "a", *PLAIN, "TrainerArgs.max_train_iters=4")
    try:
        first.fit()
        ckpt = first.save_checkpoint()
        saved = first.table_optimizer.state_dict()
    finally:
        first.close()
    load = f"TrainerArgs.ckpt_load_dir='{ckpt}'"
    straight = _trainer(tmp_path, "b", *PLAIN, "TrainerArgs.max_train_iters=8")
    try:
        full = straight.fit()
    finally:
        straight.close()
    # (built after the straight run: resuming restores the global RNG streams)
    resumed = _trainer(tmp_path, "c", *PLAIN, "TrainerArgs.max_train_iters=8", load)
    try:
        state = resumed.table_optimizer.state[_item_weight(resumed)]["sum"]
        torch.testing.assert_close(state, next(iter(saved["state"].values()))["sum"])
        rest = resumed.fit()
        assert len(rest.losses) == 4 and rest.losses == full.losses[4:]
        torch.testing.assert_close(_item_weight(resumed), _item_weight(straight))
    finally:
        resumed.close()
    cfg = load_config(
        "retrieval",
        [],
        SMALL
        + [
            f"TrainerArgs.log_dir='{tmp_path}'",
            "TrainerArgs.run_name='d'",
            "EmbeddingArgs.embedding_backend='dense'",
            load,
        ],
    )
    with pytest.raises(ValueError, match="plain_table_optimizer='sparse'"):
        Trainer(cfg, device_type="cpu")


def test_the_memory_plan_counts_the_sparse_state(tmp_path):
    trainer = _trainer(tmp_path, "m", *PLAIN, "TrainerArgs.max_train_iters=1")
    try:
        plan = {r["table"]: r for r in trainer.embeddings.memory_plan(1, "cuda")}
        item = plan["item_table"]
        # weights + gradient + one row-wise Adagrad float per row
        assert item["bytes"] == item["rows"] * (16 * 4 * 2 + 4)
    finally:
        trainer.close()


def test_the_start_up_estimate_counts_the_sparse_state():
    """The start-up memory estimate of plain tables trained by row-wise Adagrad: weights and
    gradients plus one float per row (the dense optimizer's Adam would add two per element)."""
    from hstu.config.limits import DataSizes, estimate_memory
    from hstu.data.synthetic import generate_synthetic
    from hstu.models.builder import build_model

    data = generate_synthetic(60, 40, 0, 8)
    terms = {}
    for opt in ("sparse", "dense"):
        cfg = load_config(
            "ranking",
            [],
            [
                "NetworkArgs.hidden_size=16",
                "EmbeddingArgs.embedding_backend='dense'",
                f"EmbeddingArgs.plain_table_optimizer='{opt}'",
            ],
        )
        est = estimate_memory(cfg, DataSizes.of(data), device_type="cpu")["host"]
        terms[opt] = {t.what: t.bytes for t in est.terms}["embedding tables"]
    model = build_model(cfg, data)
    shapes = [p.shape for n, p in model.named_parameters() if n.startswith("embeddings.")]
    assert terms["sparse"] == sum(r * w * 4 * 2 + r * 4 for r, w in shapes)
    assert terms["dense"] == sum(r * w * 4 * 4 for r, w in shapes)
