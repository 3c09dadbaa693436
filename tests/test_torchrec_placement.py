"""Where torchrec's planner places the torchrec tables on one rank
(`hstu.training.distributed.planner_constraints`): each table whole and table-wise. Left alone,
the planner places tables of the small configs' width (50, rows of 52 floats) row-wise even on
one GPU, and a row-wise lookup reads its bucketized lengths back from the GPU in every step (a
host-device sync)."""

from __future__ import annotations

import pytest
from model_helpers import small_model

from hstu.training.distributed import planner_constraints


def _plan(model, constraints):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    # a plan for one GPU of 80 GiB: the planner only estimates, no device is used
    topology = Topology(world_size=1, compute_device="cuda", hbm_cap=80 * 2**30)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.plan(model, model.embeddings.sharders(gradient_division=True))
    return {t: p.sharding_type for ps in plan.plan.values() for t, p in ps.items()}


@pytest.mark.parametrize(
    "backend,dynamic",
    [("torchrec", set()), ("dynamic", {"item_table", "ctx_user_id"})],
)
def test_one_rank_places_each_torchrec_table_whole_and_table_wise(backend, dynamic):
    _, _, _, model = small_model(
        "ranking",
        "NetworkArgs.hidden_size=50",  # rows of 52 floats (the small configs' width)
        "NetworkArgs.use_contextual_features=True",
        f"EmbeddingArgs.embedding_backend='{backend}'",
    )
    emb = model.embeddings
    constraints = planner_constraints(emb, world_size=1)
    torchrec_tables = {s.name for s in emb.table_specs if not s.dynamic}
    assert set(constraints) == torchrec_tables and "ctx_segment" in torchrec_tables
    assert all(c.sharding_types == ["table_wise"] for c in constraints.values())
    plan = _plan(model, constraints)
    assert {t: k for t, k in plan.items() if t in torchrec_tables} == dict.fromkeys(
        torchrec_tables, "table_wise"
    )
    assert {t: k for t, k in plan.items() if t in dynamic} == dict.fromkeys(dynamic, "row_wise")
    if backend == "torchrec":
        # what the constraints change: the planner alone places this item table row-wise
        assert _plan(model, None)["item_table"] == "row_wise"


def test_several_ranks_or_no_torchrec_tables_leave_the_planner_free():
    _, _, _, model = small_model("retrieval", "EmbeddingArgs.embedding_backend='torchrec'")
    assert planner_constraints(model.embeddings, world_size=2) is None
    _, _, _, plain = small_model("retrieval", "EmbeddingArgs.embedding_backend='dense'")
    assert planner_constraints(plain.embeddings, world_size=1) is None
