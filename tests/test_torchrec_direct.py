"""The torchrec tables' training lookup on one rank without torchrec's distribution
(`hstu.embeddings.torchrec_direct.DirectLookup`, taken by `EmbeddingStack.lookup_sparse`): the
same rows as the sharded collection's forward and the same tables after the fused updates, over
several steps; collections it does not know are left to torchrec."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_helpers import small_model

from hstu.embeddings.torchrec_direct import DirectLookup
from hstu.training.distributed import DistInfo, wrap_model

ROWS = "torchrec:"


@pytest.fixture()
def one_rank(tmp_path):
    # (an earlier test of the session may have left a one-process default group behind)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield DistInfo(
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
        owns_group=False,
    )
    if owned:
        dist.destroy_process_group()


def _sharded(info, *bindings):
    _, _, splits, model = small_model(
        "retrieval",
        "EmbeddingArgs.embedding_backend='torchrec'",
        "NetworkArgs.use_contextual_features=True",
        *bindings,
    )
    wrapped = wrap_model(model, info, model.embeddings)
    model.train()
    return splits, model, wrapped


def _tables(wrapped) -> dict[str, torch.Tensor]:
    return {
        # (one rank: each sharded table's one local shard is the whole table)
        k: (v.local_tensor() if hasattr(v, "local_tensor") else v).detach().clone()
        for k, v in wrapped.state_dict().items()
        if "embedding_collection" in k
    }


def _direct_and_through_torchrec(info):
    """Two sharded models with the same tables: the first looks its torchrec tables up directly,
    the second through torchrec's forward. Returns (splits, stack a, stack b, wrapped a, b)."""
    splits, direct_model, a = _sharded(info)
    _, via_model, b = _sharded(info)
    b.load_state_dict(a.state_dict())
    stack_a, stack_b = direct_model.embeddings, via_model.embeddings
    assert stack_a._direct_lookup() is not None  # the planner's one-rank plan: table-wise
    stack_b._direct = (stack_b.embedding_collection, None)  # through torchrec's forward
    return splits, stack_a, stack_b, a, b


def _assert_same_tables(a, b, step) -> dict[str, torch.Tensor]:
    ta, tb = _tables(a), _tables(b)
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), (step, k)
    return ta


def test_the_direct_lookup_gives_the_collections_rows_and_updates(one_rank):
    splits, stack_a, stack_b, a, b = _direct_and_through_torchrec(one_rank)
    assert len(stack_a._static_keys) >= 2  # the item table and contextual tables
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = splits.train.collate(list(range(8 * step, 8 * step + 8)))
        ra, rb = stack_a.lookup_sparse(batch), stack_b.lookup_sparse(batch)
        assert sorted(ra) == sorted(rb) == sorted(ROWS + k for k in stack_a._static_keys)
        for name in ra:
            assert torch.equal(ra[name], rb[name]), (step, name)
        grads = [torch.randn(ra[n].shape, generator=g) for n in ra]
        torch.autograd.backward([ra[n] for n in ra], grads)  # the fused updates
        torch.autograd.backward([rb[n] for n in ra], grads)
        ta = _assert_same_tables(a, b, step)
    fresh = _tables(_sharded(one_rank)[2])
    assert all(not torch.equal(ta[k], fresh[k]) for k in ta)  # every table was updated


def test_the_forward_looks_up_directly_with_the_same_rows_and_updates(one_rank):
    """The eager forward (`EmbeddingStack.forward`) takes the direct lookup too: the same
    JaggedTensors (values and lengths, extra ids included) and tables after the updates."""
    splits, stack_a, stack_b, a, b = _direct_and_through_torchrec(one_rank)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = splits.train.collate(list(range(8 * step, 8 * step + 8)))
        extra = torch.randint(0, 100, (37,), generator=g)  # 37 over 8 samples
        oa, ob = stack_a(batch, extra), stack_b(batch, extra)
        assert sorted(oa) == sorted(ob) == sorted(stack_a.features)
        for k in oa:
            assert torch.equal(oa[k].values(), ob[k].values()), (step, k)
            assert torch.equal(oa[k].lengths(), ob[k].lengths()), (step, k)
        static = stack_a._static_keys
        grads = [torch.randn(oa[k].values().shape, generator=g) for k in static]
        torch.autograd.backward([oa[k].values() for k in static], grads)
        torch.autograd.backward([ob[k].values() for k in static], grads)
        _assert_same_tables(a, b, step)
    lengths = oa["extra_item_id"].lengths()
    assert lengths.tolist() == [5] * 5 + [4] * 3  # 37 = 8 * 4 + 5: the first 5 get one more


def test_collections_it_does_not_know_stay_with_torchrec(one_rank):
    _, _, _, model = small_model("retrieval", "EmbeddingArgs.embedding_backend='torchrec'")
    stack = model.embeddings
    # unsharded (no trainer around it): torchrec's own module
    assert DirectLookup.of(stack.embedding_collection, stack._static_keys) is None
    _, sharded, _ = _sharded(one_rank)
    ec = sharded.embeddings.embedding_collection
    assert DirectLookup.of(ec, sharded.embeddings._static_keys) is not None
    # a feature its modules do not look up
    assert DirectLookup.of(ec, [*sharded.embeddings._static_keys, "other"]) is None
    ec._sharding_type_to_sharding = {"row_wise": None, **ec._sharding_type_to_sharding}
    assert DirectLookup.of(ec, sharded.embeddings._static_keys) is None


def test_the_run_log_names_the_torchrec_lookup(one_rank):
    _, _, _, model = small_model("retrieval", "EmbeddingArgs.embedding_backend='torchrec'")
    assert model.embeddings.torchrec_lookup() == "torchrec (not sharded (EmbeddingCollection))"
    _, sharded, _ = _sharded(one_rank)
    assert sharded.embeddings.torchrec_lookup() == "direct"
    _, _, _, plain = small_model("retrieval", "EmbeddingArgs.embedding_backend='dense'")
    assert plain.embeddings.torchrec_lookup() == ""
