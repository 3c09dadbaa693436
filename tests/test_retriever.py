"""Retrieval inference from a training checkpoint (CPU): the same metrics as training-time
evaluation, top-K against a brute-force scoring, history exclusion, the CLI and its errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples
from hstu.infer import main as infer_main
from hstu.inference import Retriever, UserHistory
from hstu.training.reshard import SHARDS_KEY
from hstu.training.trainer import run_training

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "DatasetArgs.synthetic_num_users=300",
    "DatasetArgs.synthetic_num_items=200",
    "DatasetArgs.max_history_seqlen=24",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "NetworkArgs.relative_attention_bias='position_time'",
    "TrainerArgs.progress_bar=False",
    "TrainerArgs.max_train_iters=30",
    "TrainerArgs.train_batch_size=32",
    "TrainerArgs.eval_batch_size=64",
    "TrainerArgs.eval_interval=0",
    "TrainerArgs.ckpt_save_interval=0",
    "OptimizerArgs.learning_rate=3e-3",
    "RetrievalArgs.num_negatives=32",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny retrieval run with a checkpoint at its last step (the step of its final eval)."""
    tmp = tmp_path_factory.mktemp("retriever")
    cfg = load_config(
        "retrieval", [], [*TINY, f"TrainerArgs.log_dir='{tmp}'", "TrainerArgs.run_name='run'"]
    )
    result = run_training(cfg)
    assert result.checkpoint_dir is not None and result.final_metrics
    return result


@pytest.fixture(scope="module")
def retriever(trained):
    return Retriever.from_checkpoint(trained.run_dir)


def _dataset_request(r: Retriever, row: int, length: int) -> dict:
    """The first ``length`` interactions of dataset row ``row`` as a request dict."""
    d = r.data
    lo = int(d.offsets[row])
    sl = slice(lo, lo + length)
    return {
        "user_id": int(d.user_ids[row]),
        "items": d.item_ids[sl].tolist(),
        "timestamps": d.timestamps[sl].tolist(),
        "actions": d.actions[sl].tolist(),
    }


def test_evaluate_equals_training_final_metrics(trained, retriever):
    assert retriever.step == 30
    assert not retriever.model.training
    assert retriever.evaluate() == trained.final_metrics  # exactly: same protocol, same floats
    # a checkpoint root and a step directory load the same model
    again = Retriever.from_checkpoint(trained.checkpoint_dir)
    assert again.evaluate() == trained.final_metrics


def test_retrieve_matches_brute_force_scoring(retriever):
    r = retriever
    samples = build_samples(r.data, r.cfg.dataset, "retrieval").eval
    i = 7
    batch = samples.collate([i])  # the dataset's own batch of one eval user
    history = batch.features["item_id"].values()
    with torch.no_grad():
        query = r.model(batch)["query"][0]
        scores = torch.stack([query @ r.model.item_embeddings(c.view(1))[0] for c in r.corpus])
    scores[torch.isin(r.corpus, history)] = float("-inf")
    order = torch.argsort(scores, descending=True, stable=True)[:20]
    # the same user as a request: its window's items, actions and times
    row = int(samples.user_rows[i])
    start, end = int(samples.starts[i]), int(samples.ends[i])
    req = {
        "user_id": int(r.data.user_ids[row]),
        "items": r.data.item_ids[start:end].tolist(),
        "timestamps": r.data.timestamps[start:end].tolist(),
        "actions": r.data.actions[start:end].tolist(),
        "query_time": int(batch.target_timestamps[0]),  # the evaluation queries at its time
    }
    ids, got = r.retrieve([req], top_k=20)
    assert ids.shape == (1, 20) and got.shape == (1, 20)
    torch.testing.assert_close(got[0], scores[order], rtol=1e-5, atol=1e-6)
    assert set(ids[0].tolist()) == set(r.corpus[order].tolist())
    # a Batch gives the same answer as the request built from it
    ids_b, got_b = r.retrieve(batch, top_k=20)
    assert torch.equal(ids_b, ids) and torch.equal(got_b, got)


def test_retrieve_excludes_history_and_sorts(retriever):
    r = retriever
    reqs = [_dataset_request(r, row, n) for row, n in ((0, 5), (3, 30), (10, 1))]
    ids, scores = r.retrieve(reqs, top_k=50, batch_size=2)
    assert ids.shape == (3, 50)
    for b, req in enumerate(reqs):
        assert not set(ids[b].tolist()) & set(req["items"])
        assert torch.all(scores[b, :-1] >= scores[b, 1:])
    # without exclusion every corpus item is rankable, the history included
    ids_all, scores_all = r.retrieve(reqs, top_k=r.corpus.numel(), exclude_history=False)
    assert set(ids_all[1].tolist()) == set(r.corpus.tolist())
    assert torch.isfinite(scores_all).all()
    # K larger than what is left: the rest of the row is id -1, score -inf
    ids_k, scores_k = r.retrieve(reqs[1:2], top_k=10_000)
    left = r.corpus.numel() - len(set(reqs[1]["items"]))
    assert ids_k.shape[1] == r.corpus.numel()
    assert (ids_k[0, left:] == -1).all() and torch.isneginf(scores_k[0, left:]).all()
    assert (ids_k[0, :left] >= 0).all()
    # UserHistory and dict requests are the same requests
    ids_u, _ = r.retrieve([UserHistory(**reqs[0])], top_k=50)
    assert torch.equal(ids_u[0], ids[0])


def test_retrieve_errors_name_the_problem(retriever):
    r = retriever
    bad = 10**9
    with pytest.raises(ValueError, match=f"unknown item ids {bad}"):
        r.retrieve([{"user_id": 1, "items": [1, bad], "timestamps": [1, 2]}])
    with pytest.raises(ValueError, match="relative time bias"):
        r.retrieve([{"user_id": 1, "items": [1, 2]}])  # this model needs times
    with pytest.raises(ValueError, match="2 timestamps for 3 items"):
        r.retrieve([{"user_id": 1, "items": [1, 2, 3], "timestamps": [1, 2]}])
    with pytest.raises(ValueError, match="not in dataset"):
        r.retrieve([{"user_id": 99999, "items": [1], "timestamps": [1]}])
    with pytest.raises(TypeError, match="'x' is not an integer"):
        r.retrieve([{"user_id": 1, "items": ["x"]}])
    with pytest.raises(ValueError, match="top_k=0"):
        r.retrieve([{"user_id": 1, "items": [1], "timestamps": [1]}], top_k=0)


def test_multi_rank_checkpoint_loads_into_one_model(trained, retriever, tmp_path):
    """A checkpoint whose table rows are split over two rank files (as two ranks write it)
    gives the same model as the one-rank file."""
    step_dir = Path(trained.checkpoint_dir)
    state = torch.load(step_dir / "rank_0.pt", weights_only=True)
    meta = json.loads((step_dir / "meta.json").read_text())
    halves = [dict(state, model=dict(state["model"])) for _ in range(2)]
    split = 0
    for key, value in state["model"].items():
        if isinstance(value, dict) and value.get(SHARDS_KEY):
            (piece,) = value["pieces"]
            t, rows = piece["tensor"], piece["tensor"].shape[0]
            cut = rows // 2
            for rank, (lo, hi) in enumerate(((0, cut), (cut, rows))):
                off = list(piece["offsets"])
                off[0] += lo
                halves[rank]["model"][key] = dict(
                    value, pieces=[{"offsets": off, "tensor": t[lo:hi].clone()}]
                )
            split += 1
    assert split > 0
    two = tmp_path / "ckpt" / step_dir.name
    two.mkdir(parents=True)
    for rank, s in enumerate(halves):
        torch.save(s, two / f"rank_{rank}.pt")
    (two / "meta.json").write_text(json.dumps(dict(meta, world_size=2)))
    shutil.copy(trained.run_dir / "config.gin", tmp_path / "ckpt" / "config.gin")
    r2 = Retriever.from_checkpoint(two)
    assert r2.evaluate() == trained.final_metrics


def test_ranking_checkpoint_and_missing_config_are_refused(trained, tmp_path):
    step_dir = Path(trained.checkpoint_dir)
    lone = tmp_path / "lone" / step_dir.name
    shutil.copytree(step_dir, lone)
    with pytest.raises(FileNotFoundError, match="no config.gin found .* --config"):
        Retriever.from_checkpoint(lone)
    meta = json.loads((lone / "meta.json").read_text())
    meta["extra_meta"]["task"] = "ranking"
    (lone / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds a ranking model"):
        Retriever.from_checkpoint(lone, config_file=trained.run_dir / "config.gin")


# ---- the command line ------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_cli_retrieve_end_to_end(trained, retriever, tmp_path):
    reqs = [_dataset_request(retriever, row, n) for row, n in ((0, 4), (5, 12))]
    users = _write_jsonl(tmp_path / "users.jsonl", [reqs[0], "", reqs[1], {"user_id": 2}])
    out = tmp_path / "out.jsonl"
    code = infer_main(
        [
            "retrieve",
            "--checkpoint",
            str(trained.run_dir),
            "--input",
            str(users),
            "--top-k",
            "7",
            "--output",
            str(out),
            "--batch-size",
            "2",
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["user_id"] for x in lines] == [reqs[0]["user_id"], reqs[1]["user_id"], 2]
    ids, scores = retriever.retrieve(reqs, top_k=7)
    for b in range(2):
        assert lines[b]["items"] == ids[b].tolist()
        assert lines[b]["scores"] == pytest.approx(scores[b].tolist(), abs=1e-6)
    # a dataset user without 'items': its whole stored history is the query and is excluded
    full = retriever.dataset_user(2)
    ids_full, _ = retriever.retrieve([full], top_k=7)
    assert lines[2]["items"] == ids_full[0].tolist()
    assert not set(lines[2]["items"]) & set(full.items)


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = infer_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_cli_errors(trained, tmp_path, capsys):
    ckpt = str(trained.run_dir)
    good = {"user_id": 1, "items": [1, 2], "timestamps": [1, 2]}
    code, err = _run_cli(
        ["retrieve", "--checkpoint", str(tmp_path / "nope"), "--input", "x.jsonl"], capsys
    )
    assert code == 2 and err.startswith("error: --checkpoint") and "does not exist" in err
    bad_json = _write_jsonl(tmp_path / "bad.jsonl", [good, "{not json"])
    code, err = _run_cli(["retrieve", "--checkpoint", ckpt, "--input", str(bad_json)], capsys)
    assert code == 2 and f"{bad_json}:2: not valid JSON" in err
    unknown = _write_jsonl(
        tmp_path / "unknown.jsonl",
        [good, {"user_id": 3, "items": [5, 123456, 777777], "timestamps": [1, 2, 3]}],
    )
    code, err = _run_cli(["retrieve", "--checkpoint", ckpt, "--input", str(unknown)], capsys)
    assert code == 2 and f"{unknown}:2: unknown item ids 123456, 777777" in err
    code, err = _run_cli(
        ["retrieve", "--checkpoint", ckpt, "--input", str(unknown), "--top-k", "0"], capsys
    )
    assert code == 2 and "--top-k" in err and err.startswith("error:")
    code, err = _run_cli(
        ["retrieve", "--checkpoint", ckpt, "--input", str(tmp_path / "missing.jsonl")], capsys
    )
    assert code == 2 and "missing.jsonl does not exist" in err
    lone = tmp_path / "lone"
    shutil.copytree(trained.checkpoint_dir, lone / Path(trained.checkpoint_dir).name)
    code, err = _run_cli(["retrieve", "--checkpoint", str(lone), "--input", str(unknown)], capsys)
    assert code == 2 and "no config.gin found" in err


def test_cli_as_a_module_exits_2_with_one_error_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "hstu.infer", "retrieve", "--checkpoint", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the following arguments are required: --input (see python -m hstu.infer "
        "retrieve --help)"
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_retrieve_matches_the_cpu(trained, retriever):
    """On the GPU (the model's dtype under autocast): the same top-K scores as the float32 CPU
    retriever within bf16 noise, history excluded, for requests and for a dataset Batch."""
    gpu = Retriever.from_checkpoint(trained.run_dir, device=torch.device("cuda"))
    reqs = [_dataset_request(retriever, row, n) for row, n in ((0, 5), (3, 30), (10, 1), (4, 24))]
    samples = build_samples(retriever.data, retriever.cfg.dataset, "retrieval").eval
    batch = samples.collate(list(range(16)))
    for inputs in (reqs, batch):
        ids_c, s_c = retriever.retrieve(inputs, top_k=20)
        ids_g, s_g = gpu.retrieve(inputs, top_k=20)
        assert ids_g.device.type == "cpu" and ids_g.shape == ids_c.shape
        torch.testing.assert_close(s_g, s_c, rtol=0, atol=3e-2)
        # most of the top 20 agree (near-ties may swap in bf16)
        same = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids_g, ids_c)]
        assert min(same) >= 15, same
    for b, req in enumerate(reqs):
        assert not set(gpu.retrieve(reqs, top_k=50)[0][b].tolist()) & set(req["items"])
