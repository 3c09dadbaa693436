"""Ranking inference from a training checkpoint (CPU): `hstu.inference.ranker.Ranker` loads a
ranking run, encodes request histories once and scores candidate sets from the cache exactly as
the model's forward on history + candidates does; its errors name the problem."""

from __future__ import annotations

import pytest
import torch

from hstu.config.gin_utils import load_config
from hstu.inference.ranker import Ranker
from hstu.training.trainer import run_training

TINY = [
    "DatasetArgs.synthetic_num_users=120",
    "DatasetArgs.synthetic_num_items=90",
    "DatasetArgs.max_history_seqlen=20",
    "DatasetArgs.max_num_candidates=4",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "NetworkArgs.relative_attention_bias='position_time'",
    "EmbeddingArgs.embedding_backend='dense'",
    "TrainerArgs.progress_bar=False",
    "TrainerArgs.max_train_iters=20",
    "TrainerArgs.train_batch_size=16",
    "TrainerArgs.eval_batch_size=32",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.ckpt_save_interval=0",
]


@pytest.fixture(scope="module")
def ranker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranker")
    cfg = load_config(
        "ranking", [], [*TINY, f"TrainerArgs.log_dir='{tmp}'", "TrainerArgs.run_name='run'"]
    )
    result = run_training(cfg)
    assert result.checkpoint_dir is not None
    return Ranker.from_checkpoint(result.run_dir)


def _requests(r: Ranker, rows: list[int]) -> list[dict]:
    out = []
    for row in rows:
        u = r.dataset_user(int(r.data.user_ids[row]))
        out.append({"user_id": u.user_id, "items": u.items[:-1], "timestamps": u.timestamps[:-1],
                    "actions": u.actions[:-1]})  # fmt: skip
    return out


def test_cached_scores_equal_the_full_forward(ranker):
    users = _requests(ranker, [0, 3, 7])
    sets = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    cache = ranker.encode(users, num_candidates=3)
    got = ranker.score(cache, sets)
    want = ranker.score_full(users, sets)
    assert got.shape == (9, want.shape[1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # another candidate set from the same cache, and probabilities
    again = [[9, 8, 7], [6, 5, 4], [3, 2, 1]]
    torch.testing.assert_close(
        ranker.score(cache, again), ranker.score_full(users, again), rtol=0, atol=1e-5
    )
    probs = ranker.predict(cache, again)
    assert bool(((probs > 0) & (probs < 1)).all())


def test_errors_name_the_problem(ranker):
    users = _requests(ranker, [0, 1])
    cache = ranker.encode(users, num_candidates=2)
    with pytest.raises(ValueError, match="unknown candidate item ids"):
        ranker.score(cache, [[1, 10**9], [2, 3]])
    with pytest.raises(ValueError, match="at least one candidate"):
        ranker.score(cache, [[], [2, 3]])
    with pytest.raises(ValueError, match="encoded for 2 candidates"):
        ranker.score(cache, [[1, 2, 3], [2, 3, 4]])


def test_score_sets_groups_by_size_and_equals_the_full_forward(ranker):
    users = _requests(ranker, [0, 3, 7])
    sets = [[[1, 2, 3], [4, 5]], [[6, 7]], [[8, 9, 10], [11, 12, 13], [14, 15]]]
    # batches of one user: the model's default attention scaling is the batch's longest sequence,
    # so a user's scores depend on who shares its batch (a fixed scaling_seqlen removes that)
    out = ranker.score_sets(users, sets, batch_size=1)
    for u, user_sets in enumerate(sets):
        assert len(out[u]) == len(user_sets)
        for k, cand in enumerate(user_sets):
            want = ranker.score_full([users[u]], [cand])
            torch.testing.assert_close(out[u][k], want, rtol=0, atol=1e-5)


def test_cli_rank_end_to_end(ranker, tmp_path, capsys):
    import json

    from hstu.infer import main as infer_main

    users = _requests(ranker, [0, 3])
    rows = [
        {**users[0], "candidates": [1, 2, 3]},
        {**users[1], "candidates": [[4, 5], [6, 7, 8]]},
        {"user_id": int(ranker.data.user_ids[5]), "candidates": [9]},
    ]
    inp = tmp_path / "req.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run_dir = ranker.checkpoint.parent.parent if ranker.checkpoint else None
    code = infer_main(
        ["rank", "--checkpoint", str(run_dir), "--input", str(inp), "--output", str(out)]
        + ["--batch-size", "1"]
    )
    assert code == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["user_id"] for x in lines] == [r["user_id"] for r in rows]
    want0 = ranker.score_full([users[0]], [[1, 2, 3]]).sigmoid()
    torch.testing.assert_close(torch.tensor(lines[0]["probabilities"]), want0, atol=2e-6, rtol=0)
    assert len(lines[1]["probabilities"]) == 2 and len(lines[1]["probabilities"][1]) == 3
    want1 = ranker.score_full([users[1]], [[6, 7, 8]]).sigmoid()
    torch.testing.assert_close(torch.tensor(lines[1]["probabilities"][1]), want1, atol=2e-6, rtol=0)
    # a bad request: one error line naming the line, exit 2
    inp.write_text(json.dumps({**users[0], "candidates": [1, 10**9]}) + "\n")
    capsys.readouterr()
    assert infer_main(["rank", "--checkpoint", str(run_dir), "--input", str(inp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "req.jsonl:1" in err[0] and "unknown candidate item ids" in err[0]
    for row, message in (
        (users[0], "missing 'candidates'"),
        ({**users[0], "candidates": []}, "'candidates' must be a non-empty list"),
        ({**users[0], "candidates": [[1], []]}, "at least one candidate"),
    ):
        inp.write_text(json.dumps(row) + "\n")
        assert infer_main(["rank", "--checkpoint", str(run_dir), "--input", str(inp)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "req.jsonl:1" in err[0] and message in err[0], err


# ---- export of a ranking checkpoint -------------------------------------------------------------


@pytest.fixture(scope="module")
def ranking_artifact(ranker, tmp_path_factory):
    from hstu.inference.export import export_checkpoint

    run_dir = ranker.checkpoint.parent.parent
    return export_checkpoint(run_dir, tmp_path_factory.mktemp("rank_export") / "artifact")


def _long_requests(r: Ranker, rows: list[int]) -> list[dict]:
    """Whole dataset histories (some longer than max_history_seqlen=20: the last 20 are kept)."""
    out = []
    for row in rows:
        u = r.dataset_user(int(r.data.user_ids[row]))
        out.append({"user_id": u.user_id, "items": u.items, "timestamps": u.timestamps,
                    "actions": u.actions})  # fmt: skip
    return out


def test_ranking_artifact_equals_the_full_forward(ranker, ranking_artifact):
    from hstu.inference.artifact import RankingArtifact, load_artifact, read_manifest

    art = load_artifact(ranking_artifact)
    assert isinstance(art, RankingArtifact)
    manifest = read_manifest(ranking_artifact)
    assert manifest["task"] == "ranking" and manifest["model"]["num_tasks"] == 8
    users = _long_requests(ranker, [0, 1, 2, 5])
    assert max(len(u["items"]) for u in users) > art.max_history
    sets = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]  # counts differ: padded candidates
    got = art.score(users, sets)
    want = ranker.score_full(users, sets)
    assert got.shape == want.shape == (11, 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown item ids"):
        art.score(users[:1], [[10**9]])
    with pytest.raises(ValueError, match="at least one candidate"):
        art.score(users[:1], [[]])


def test_ranking_artifact_serves_in_a_fresh_process(ranker, ranking_artifact, tmp_path):
    import json

    from dist_helpers import run_fresh_python

    users = _long_requests(ranker, [0, 1])
    sets = [[1, 2, 3], [4, 5]]
    out = run_fresh_python(f"""
import json
from hstu.inference.artifact import load_artifact
art = load_artifact({str(ranking_artifact)!r})
probs = art.predict(json.loads({json.dumps(json.dumps(users))}), {sets!r})
print(json.dumps({{"probs": probs.tolist()}}))
""")
    assert out["heavy"] == []
    want = ranker.score_full(users, sets).sigmoid()
    torch.testing.assert_close(torch.tensor(out["probs"]), want, rtol=0, atol=1e-5)
    # the command line on the artifact
    from hstu.infer import main as infer_main

    inp = tmp_path / "req.jsonl"
    inp.write_text(json.dumps({**users[0], "candidates": [[1, 2, 3], [4, 5]]}) + "\n")
    res = tmp_path / "out.jsonl"
    argv = ["rank", "--artifact", str(ranking_artifact), "--input", str(inp), "--output", str(res)]
    assert infer_main(argv) == 0
    line = json.loads(res.read_text())
    want0 = ranker.score_full(users[:1], [[1, 2, 3]]).sigmoid()
    torch.testing.assert_close(torch.tensor(line["probabilities"][0]), want0, atol=2e-6, rtol=0)
    # an artifact holds no histories: a request must give its items
    inp.write_text(json.dumps({"user_id": users[0]["user_id"], "candidates": [1]}) + "\n")
    assert infer_main(["rank", "--artifact", str(ranking_artifact), "--input", str(inp)]) == 2


def test_export_applies_the_window_and_target_groups(tmp_path):
    """A model with a local window and candidate groups of 2: the exported program applies both
    mask rules as the model does (the full forward on the same batch)."""
    from hstu.inference.artifact import load_artifact
    from hstu.inference.export import export_checkpoint

    bindings = [b for b in TINY if "max_train_iters" not in b]
    bindings += ["TrainerArgs.max_train_iters=5", "NetworkArgs.max_attn_len=6"]
    bindings += ["NetworkArgs.target_group_size=2"]
    cfg = load_config(
        "ranking", [], [*bindings, f"TrainerArgs.log_dir='{tmp_path}'", "TrainerArgs.run_name='w'"]
    )
    result = run_training(cfg)
    ranker = Ranker.from_checkpoint(result.run_dir)
    assert all(layer.window_size == 6 for layer in ranker.model.encoder.layers)
    art = load_artifact(export_checkpoint(result.run_dir, tmp_path / "artifact"))
    users = _long_requests(ranker, [0, 1, 2])
    sets = [[1, 2, 3, 4], [5, 6, 7], [8]]
    torch.testing.assert_close(
        art.score(users, sets), ranker.score_full(users, sets), rtol=0, atol=1e-5
    )
