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
