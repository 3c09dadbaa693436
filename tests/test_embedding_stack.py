"""EmbeddingStack: one interface over every table backend; the model and trainer never name one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hstu.config.args import EmbeddingArgs
from hstu.config.gin_utils import load_config
from hstu.data.batch import ITEM_FEATURE
from hstu.data.registry import build_samples, load_sequence_data
from hstu.embeddings.dynamic_table import DynamicEmbeddingCollection
from hstu.embeddings.stack import EXTRA_ITEM_FEATURE, EmbeddingStack, format_memory_plan
from hstu.models.builder import build_embedding_stack, feature_info
from hstu.training.checkpoint import Checkpointer
from hstu.training.reshard import upgrade_state_keys
from hstu.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[1]

SMALL = [
    "DatasetArgs.synthetic_num_users=300",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=16",
    "NetworkArgs.num_layers=1",
    "NetworkArgs.hidden_size=18",  # not a multiple of 4: torchrec tables get padded rows
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=8",
    "TrainerArgs.progress_bar=False",
]

BACKENDS = [
    ("torchrec", "torchrec"),
    ("dynamic", "torchrec"),
    ("dynamic", "dense"),
    ("dense", "torchrec"),
]


def _setup(task: str, *bindings: str):
    cfg = load_config(task, [], SMALL + list(bindings))
    data = load_sequence_data(cfg.dataset, num_tasks=8)
    return cfg, data, build_samples(data, cfg.dataset, task)


@pytest.mark.parametrize("backend,contextual", BACKENDS)
def test_every_backend_looks_up_through_one_interface(backend, contextual):
    cfg, data, splits = _setup(
        "retrieval",
        f"EmbeddingArgs.embedding_backend='{backend}'",
        f"EmbeddingArgs.contextual_tables='{contextual}'",
    )
    stack = build_embedding_stack(cfg, feature_info(data, cfg), extra_item_feature=True)
    batch = splits.train.collate(list(range(6)))
    extra = torch.tensor([1, 2, 3])
    out = stack(batch, extra)
    assert stack.features == [*data.user_feature_names, ITEM_FEATURE, EXTRA_ITEM_FEATURE]
    assert sorted(out) == sorted(stack.features)
    for name, jt in out.items():
        assert jt.values().shape[1] == 18, name
    n_items = int(batch.features[ITEM_FEATURE].lengths().sum())
    assert out[ITEM_FEATURE].values().shape[0] == n_items
    assert out[EXTRA_ITEM_FEATURE].values().shape[0] == 3
    # the same item id gives the same row whichever feature looks it up
    first = int(batch.features[ITEM_FEATURE].values()[0])
    again = stack(None, torch.tensor([first]))[EXTRA_ITEM_FEATURE].values()[0]
    torch.testing.assert_close(again, out[ITEM_FEATURE].values()[0])
    # sparse parameters are the torchrec tables' only (plain tables go to the dense optimizer)
    sparse = [n for n, _ in stack.named_parameters() if stack.is_sparse_parameter(n)]
    plain = [n for n, _ in stack.named_parameters() if not stack.is_sparse_parameter(n)]
    assert all(n.startswith("embedding_collection.") for n in sparse)
    assert bool(sparse) == (stack.embedding_collection is not None)
    assert bool(plain) == (stack.dense_tables is not None)
    # the layout a checkpoint records, and the rows that live outside state_dict()
    assert stack.checkpoint_meta() == {
        "embedding_backend": backend,
        "contextual_tables": contextual,
        "plain_table_optimizer": "dense",
    }
    assert ("dynamic_embeddings" in stack.checkpoint_state()) == (backend == "dynamic")


@pytest.mark.parametrize("backend,contextual", BACKENDS + [("hybrid", "dense")])
def test_serving_item_lookup_gives_the_rows_of_the_lookup(backend, contextual):
    """The serving lookup (no dedup, no host reads) returns exactly the eval lookup's item rows
    (known ids, unknown ones as zeros, repeats); it is absent for torchrec and hybrid item
    tables, and its host check refuses ids the table cannot hold."""
    storage = ["EmbeddingArgs.storage='hybrid'"] if backend == "hybrid" else []
    cfg, data, splits = _setup(
        "ranking",
        f"EmbeddingArgs.embedding_backend='{'dynamic' if backend == 'hybrid' else backend}'",
        f"EmbeddingArgs.contextual_tables='{contextual}'",
        "EmbeddingArgs.item_capacity=1000",
        *storage,
    )
    stack = build_embedding_stack(cfg, feature_info(data, cfg), extra_item_feature=False)
    batch = splits.train.collate(list(range(6)))
    with torch.no_grad():
        stack(batch)  # training mode: dynamic tables insert the batch's ids
    stack.eval()
    lookup = stack.serving_item_lookup()
    if backend in ("torchrec", "hybrid"):
        assert lookup is None
        return
    ids = batch.features[ITEM_FEATURE].values()
    unseen = 10_000 if backend == "dynamic" else 0  # an id no dynamic table has seen
    assert unseen not in ids.tolist()
    probe = torch.cat([ids, ids[:3], torch.tensor([unseen])])
    lookup.check(probe)
    got = lookup.rows(probe)
    with torch.no_grad():
        want = stack(batch)[ITEM_FEATURE].values()
    assert got.shape == (probe.numel(), 18)
    torch.testing.assert_close(got[: ids.numel()], want, rtol=0, atol=0)
    torch.testing.assert_close(got[ids.numel() : -1], want[:3], rtol=0, atol=0)
    if backend == "dynamic":
        assert bool((got[-1] == 0).all())
        with pytest.raises(ValueError, match="reserved"):
            lookup.check(torch.tensor([1, torch.iinfo(torch.int64).min]))
    else:
        with pytest.raises(ValueError, match="ids must lie in"):
            lookup.check(torch.tensor([1, 10**6]))


def test_dynamic_rows_round_trip_through_checkpoint_state():
    cfg, data, splits = _setup("ranking", "EmbeddingArgs.embedding_backend='dynamic'")
    info = feature_info(data, cfg)
    stack = build_embedding_stack(cfg, info, extra_item_feature=False)
    assert isinstance(stack.dynamic_collection, DynamicEmbeddingCollection)
    batch = splits.train.collate(list(range(8)))
    before = stack(batch)[ITEM_FEATURE].values().detach()  # inserts the batch's ids
    state = stack.checkpoint_state()
    fresh = build_embedding_stack(
        load_config(
            "ranking",
            [],
            SMALL + ["EmbeddingArgs.embedding_backend='dynamic'", "TrainerArgs.seed=5"],
        ),
        info,
        extra_item_feature=False,
    )
    fresh.load_checkpoint_state([state])
    fresh.eval()  # eval never inserts: every row must come from the loaded state
    torch.testing.assert_close(fresh(batch)[ITEM_FEATURE].values(), before)


def test_checkpoint_of_another_layout_is_refused_with_the_binding():
    info_cfg, data, _ = _setup("ranking")
    stack = EmbeddingStack(
        feature_info(data, info_cfg),
        EmbeddingArgs(embedding_backend="torchrec"),
        hidden_size=16,
        sparse_learning_rate=0.1,
    )
    with pytest.raises(ValueError, match="EmbeddingArgs.embedding_backend='dynamic'"):
        stack.check_checkpoint({}, {"dynamic_embeddings": {}}, "checkpoint x")
    with pytest.raises(ValueError, match="EmbeddingArgs.contextual_tables='dense'"):
        stack.check_checkpoint({"contextual_tables": "dense"}, {}, "checkpoint x")
    stack.check_checkpoint({"embedding_backend": "torchrec"}, {}, "checkpoint x")


def test_model_and_trainer_name_no_embedding_backend():
    """The models receive embeddings and the trainer asks the stack: no backend branches."""
    words = re.compile(
        r"dynamic_collection|embedding_collection|dense_tables|embedding_backend|"
        r"DynamicEmbedding|EmbeddingCollection|apply_sparse_optimizer|merge_collection_dumps|"
        r"global_stats|hasattr\("
    )
    for rel in ("hstu/models/base.py", "hstu/training/trainer.py"):
        found = words.findall((ROOT / rel).read_text())
        assert not found, f"{rel} names embedding backends: {sorted(set(found))}"


def test_old_checkpoint_names_upgrade():
    old = {
        "model": {"embedding_collection.embeddings.t.weight": 1, "encoder.w": 2},
        "fused_optimizer": {
            "state": {"embedding_collection.embeddings.t.weight": {"sum": 3}},
            "param_groups": [{"params": ["embedding_collection.embeddings.t.weight"]}],
        },
        "dense_optimizer": {"state": {}},
    }
    new = upgrade_state_keys(old)
    assert list(new["model"]) == [
        "embeddings.embedding_collection.embeddings.t.weight",
        "encoder.w",
    ]
    assert list(new["fused_optimizer"]["state"]) == [
        "embeddings.embedding_collection.embeddings.t.weight"
    ]
    assert new["fused_optimizer"]["param_groups"][0]["params"] == [
        "embeddings.embedding_collection.embeddings.t.weight"
    ]
    assert new["dense_optimizer"] is old["dense_optimizer"]
    assert upgrade_state_keys(new) == new  # current names stay


def test_checkpoint_with_the_earlier_table_names_resumes_exactly(tmp_path):
    """A rank file whose tables are named as before they moved into model.embeddings resumes
    with the same losses as the file as written."""
    common = SMALL + [
        "TrainerArgs.train_batch_size=16",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.max_eval_iters=1",
        "TrainerArgs.log_interval=2",
        "TrainerArgs.run_name='run'",
        "EmbeddingArgs.embedding_backend='dynamic'",
    ]

    def cfg(where, *extra):
        return load_config("ranking", [], common + [f"TrainerArgs.log_dir='{where}'", *extra])

    first = run_training(cfg(tmp_path / "a", "TrainerArgs.max_train_iters=3"))
    ckpt = Path(first.checkpoint_dir)
    resumed = run_training(
        cfg(tmp_path / "b", "TrainerArgs.max_train_iters=6", f"TrainerArgs.ckpt_load_dir='{ckpt}'")
    )
    # rename the tables' entries to the earlier names, in place
    rank_file = ckpt / "rank_0.pt"
    state = torch.load(rank_file, weights_only=False)
    assert any(k.startswith("embeddings.") for k in state["model"])

    def downgrade(obj):
        if isinstance(obj, dict):
            return type(obj)(
                (k.removeprefix("embeddings.") if isinstance(k, str) else k, downgrade(v))
                for k, v in obj.items()
            )
        if isinstance(obj, list):
            return [
                v.removeprefix("embeddings.") if isinstance(v, str) else downgrade(v) for v in obj
            ]
        return obj

    state["model"] = downgrade(state["model"])
    state["fused_optimizer"] = downgrade(state["fused_optimizer"])
    assert not any(k.startswith("embeddings.") for k in state["model"])
    torch.save(state, rank_file)
    assert Checkpointer.load(ckpt)[0] == 3
    old = run_training(
        cfg(tmp_path / "c", "TrainerArgs.max_train_iters=6", f"TrainerArgs.ckpt_load_dir='{ckpt}'")
    )
    assert old.losses == resumed.losses


def test_memory_plan_counts_rows_state_and_placement():
    cfg, data, _ = _setup("ranking")
    info = feature_info(data, cfg)
    plan = {
        r["table"]: r
        for r in build_embedding_stack(cfg, info, extra_item_feature=False).memory_plan(4, "cuda")
    }
    item = plan["item_table"]
    # torchrec table, row-wise Adagrad: the row, padded to 20 floats (the per-row state is left
    # out, as in the start-up estimate)
    assert (item["kind"], item["rows"], item["width"]) == ("torchrec", 200, 20)
    assert item["bytes"] == 200 * 20 * 4
    assert item["bytes_per_rank"] == -(-item["bytes"] // 4)
    assert item["where"] == "HBM, row-wise over 4 rank(s)"
    cfg, data, _ = _setup(
        "ranking", "EmbeddingArgs.embedding_backend='dynamic'", "EmbeddingArgs.item_capacity=1000"
    )
    plan = {
        r["table"]: r
        for r in build_embedding_stack(cfg, info, extra_item_feature=False).memory_plan(1, "cpu")
    }
    item = plan["item_table"]
    # dynamic: every slot of the capacity rounded up to whole 32-slot buckets (1024), each the
    # row (18 + 1 state floats -> 20) + 24 B of metadata
    assert (item["kind"], item["rows"]) == ("dynamic", 1000)
    assert item["bytes"] == 1024 * (20 * 4 + 24)
    assert item["where"] == "host memory, row-wise over 1 rank(s)"
    text = format_memory_plan(list(plan.values()))
    assert text.splitlines()[0].split()[:3] == ["table", "kind", "rows"]
    assert "item_table" in text and "1,000" in text


def test_memory_plan_of_a_hybrid_table_splits_hbm_and_host_memory():
    cfg, data, _ = _setup(
        "ranking",
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.item_capacity=1000",
        "EmbeddingArgs.storage='hybrid'",
        "EmbeddingArgs.hbm_cache=0.25",
    )
    stack = build_embedding_stack(cfg, feature_info(data, cfg), extra_item_feature=False)
    plan = {r["table"]: r for r in stack.memory_plan(2, "cuda")}
    item = plan["item_table"]
    # 2 ranks: 500 rows each -> 512 slots; rows of 18 + 1 state floats -> 20 (80 B); cache:
    # a quarter of the slots (128 rows) with 16 B of key and slot each
    assert item["storage"] == "hybrid"
    assert item["device_bytes_per_rank"] == 512 * 28 + 128 * (80 + 24) + 36
    assert item["host_bytes_per_rank"] == 512 * 80
    assert item["bytes_per_rank"] == item["device_bytes_per_rank"] + item["host_bytes_per_rank"]
    assert item["where"] == "host memory + 128-row cache in HBM, row-wise over 2 rank(s)"
    text = format_memory_plan(list(plan.values()))
    assert "HBM/rank" in text.splitlines()[0] and "128-row cache" in text
    # the tables it builds are hybrid, and hold the bytes the plan says (CPU: both tiers)
    table = stack.dynamic_collection.tables["item_table"]
    assert type(table).__name__ == "HybridDynamicEmbeddingTable"
    one = {r["table"]: r for r in stack.memory_plan(1, "cpu")}["item_table"]
    held = sum(x.numel() * x.element_size() for x in vars(table.state).values())
    held += table.host.rows.numel() * 4 + table.cache.values.numel() * 4
    held += sum(x.numel() * 8 for x in (table._row_keys, table.cache_slot, table._free))
    held += table.slot_row.numel() * 4 + table._n_free.numel() * 8
    assert held == one["bytes_per_rank"]


def test_training_with_hybrid_tables_gives_the_same_losses(tmp_path):
    """A whole run (ranking, dynamic item and user tables, a checkpoint and a resume) with the
    rows in host memory gives exactly the losses of the all-HBM run. The item table's cache
    (192 rows, ~170 distinct items a batch, 200 items) evicts and writes back every step."""
    common = SMALL + [
        "TrainerArgs.train_batch_size=16",
        "TrainerArgs.eval_interval=0",
        "TrainerArgs.max_eval_iters=1",
        "TrainerArgs.log_interval=1",
        "TrainerArgs.run_name='run'",
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.item_capacity=256",  # 200 items, ~140 distinct per batch
        "EmbeddingArgs.user_capacity=512",
        "EmbeddingArgs.sparse_optimizer_str='adagrad'",
    ]

    def run(name, *extra):
        cfg = load_config("ranking", [], common + [f"TrainerArgs.log_dir='{tmp_path / name}'",
                                                   *extra])  # fmt: skip
        return run_training(cfg)

    hbm = run("hbm", "TrainerArgs.max_train_iters=6")
    hybrid_args = ("EmbeddingArgs.storage='hybrid'", "EmbeddingArgs.hbm_cache=0.7")
    hybrid = run("hybrid", "TrainerArgs.max_train_iters=6", *hybrid_args)
    assert hybrid.losses == hbm.losses
    # a checkpoint of the hybrid run resumes under the all-HBM storage, and the other way
    resumed = run(
        "resumed",
        "TrainerArgs.max_train_iters=9",
        f"TrainerArgs.ckpt_load_dir='{hybrid.checkpoint_dir}'",
    )
    resumed_hybrid = run(
        "resumed_hybrid",
        "TrainerArgs.max_train_iters=9",
        f"TrainerArgs.ckpt_load_dir='{hbm.checkpoint_dir}'",
        *hybrid_args,
    )
    assert resumed.losses == resumed_hybrid.losses
