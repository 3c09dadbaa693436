"""Export of a retrieval checkpoint (python -m hstu.export) and serving it with torch alone (CPU).

The artifact's queries and top-K equal the checkpoint `Retriever`'s; a fresh process loads and
scores it without importing torchrec or gin; damaged artifacts and bad exports are clear errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from dist_helpers import run_fresh_python
from test_retriever import TINY

from hstu.config.gin_utils import load_config
from hstu.export import main as export_main
from hstu.infer import main as infer_main
from hstu.inference import Retriever
from hstu.inference.artifact import ArtifactError, RetrievalArtifact, read_manifest
from hstu.inference.export import export_retrieval
from hstu.inference.requests import as_user_history
from hstu.training.trainer import run_training


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = load_config(
        "retrieval", [], [*TINY, f"TrainerArgs.log_dir='{tmp}'", "TrainerArgs.run_name='run'"]
    )
    result = run_training(cfg)
    return result, tmp


@pytest.fixture(scope="module")
def artifact_dir(run):
    result, tmp = run
    return export_retrieval(result.run_dir, tmp / "artifact")


def _requests(r: Retriever, n: int = 40) -> list[dict]:
    """Dataset users with histories of 5 .. 44 items (some longer than max_history_seqlen=24,
    so the artifact keeps only the last 24 as the checkpoint path does)."""
    d = r.data
    out = []
    for row in range(n):
        lo, hi = int(d.offsets[row]), int(d.offsets[row + 1])
        sl = slice(lo, lo + min(hi - lo, 5 + row))
        out.append(
            {
                "user_id": int(d.user_ids[row]),
                "items": d.item_ids[sl].tolist(),
                "timestamps": d.timestamps[sl].tolist(),
                "actions": d.actions[sl].tolist(),
            }
        )
    out[3]["query_time"] = out[3]["timestamps"][-1] + 86_400  # a request a day later
    return out


def test_artifact_scores_equal_the_checkpoint(run, artifact_dir):
    result, _ = run
    retriever = Retriever.from_checkpoint(result.run_dir)
    art = RetrievalArtifact.load(artifact_dir)
    users = _requests(retriever)
    assert max(len(u["items"]) for u in users) > art.max_history
    q_ckpt = retriever.queries(retriever.make_batch([as_user_history(u) for u in users]))
    torch.testing.assert_close(art.queries(users), q_ckpt, rtol=0, atol=1e-6)
    ids_a, scores_a = art.retrieve(users, top_k=20)
    ids_r, scores_r = retriever.retrieve(users, top_k=20)
    assert torch.equal(ids_a, ids_r)
    torch.testing.assert_close(scores_a, scores_r, rtol=0, atol=1e-6)
    # any batch size (the exported batch dimension is dynamic); the attention scaling follows
    # the batch's longest sequence, as in the model, so compare with the same one-user batch
    one = retriever.queries(retriever.make_batch([as_user_history(users[0])]))
    torch.testing.assert_close(art.queries(users[:1]), one, rtol=0, atol=1e-6)


def test_manifest_describes_the_model_and_every_file(run, artifact_dir):
    result, _ = run
    m = read_manifest(artifact_dir)
    assert m["task"] == "retrieval" and m["source"]["step"] == 30
    assert m["model"]["max_history"] == 24 and m["model"]["time_bias"] is True
    assert set(m["files"]) == {"model.pt2", "tables.pt", "config.gin"}
    assert (artifact_dir / "config.gin").read_text() == (result.run_dir / "config.gin").read_text()


def test_fresh_process_serves_without_the_training_stack(run, artifact_dir):
    result, _ = run
    users = _requests(Retriever.from_checkpoint(result.run_dir), n=8)
    out = run_fresh_python(f"""
import json
from hstu.inference.artifact import RetrievalArtifact
art = RetrievalArtifact.load({str(artifact_dir)!r})
ids, scores = art.retrieve(json.loads({json.dumps(json.dumps(users))}), top_k=10)
print(json.dumps({{"ids": ids.tolist()}}))
""")
    assert out["heavy"] == []
    ids, _ = RetrievalArtifact.load(artifact_dir).retrieve(users, top_k=10)
    assert out["ids"] == ids.tolist()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip_tables", "sha256"),
        ("truncate_model", "bytes"),
        ("no_manifest", "manifest.json"),
        ("no_model", "lacks model.pt2"),
        ("bad_version", "format version"),
        ("not_json", "not readable JSON"),
    ],
)
def test_damaged_artifacts_are_clear_errors(artifact_dir, tmp_path, damage, message):
    art = _copy(artifact_dir, tmp_path / "a")
    if damage == "flip_tables":
        data = bytearray((art / "tables.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (art / "tables.pt").write_bytes(bytes(data))
    elif damage == "truncate_model":
        data = (art / "model.pt2").read_bytes()
        (art / "model.pt2").write_bytes(data[: len(data) // 2])
    elif damage == "no_manifest":
        (art / "manifest.json").unlink()
    elif damage == "no_model":
        (art / "model.pt2").unlink()
    elif damage == "bad_version":
        m = json.loads((art / "manifest.json").read_text())
        m["version"] = 99
        (art / "manifest.json").write_text(json.dumps(m))
    elif damage == "not_json":
        (art / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=message):
        RetrievalArtifact.load(art)


def test_bad_requests_are_clear_errors(artifact_dir):
    art = RetrievalArtifact.load(artifact_dir)
    with pytest.raises(ValueError, match="unknown item ids"):
        art.queries([{"user_id": 0, "items": [10**9], "timestamps": [1]}])
    with pytest.raises(ValueError, match="no timestamps"):
        art.queries([{"user_id": 0, "items": [int(art.corpus[0])]}])
    with pytest.raises(ValueError, match="not among the exported users"):
        art.queries([{"user_id": -5, "items": [int(art.corpus[0])], "timestamps": [1]}])
    with pytest.raises(ValueError, match="top_k"):
        art.retrieve([], top_k=0)


def test_export_cli_and_artifact_serving_cli(run, artifact_dir, tmp_path, capsys):
    result, _ = run
    out = tmp_path / "cli_artifact"
    assert export_main(["--checkpoint", str(result.run_dir), "--out", str(out)]) == 0
    assert read_manifest(out)["source"]["step"] == 30
    # an existing artifact is not overwritten without --overwrite; nothing partial is left
    assert export_main(["--checkpoint", str(result.run_dir), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))
    # serving: the same lines from the artifact as from the checkpoint
    users = _requests(Retriever.from_checkpoint(result.run_dir), n=6)
    req = tmp_path / "users.jsonl"
    req.write_text("".join(json.dumps(u) + "\n" for u in users))
    lines = {}
    for flag, src in (("--artifact", out), ("--checkpoint", result.run_dir)):
        dst = tmp_path / f"out{flag}.jsonl"
        code = infer_main(
            ["retrieve", flag, str(src), "--input", str(req), "--output", str(dst), "--top-k", "5"]
        )
        assert code == 0
        lines[flag] = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [x["items"] for x in lines["--artifact"]] == [x["items"] for x in lines["--checkpoint"]]
    # an artifact request must carry its items
    req.write_text(json.dumps({"user_id": users[0]["user_id"]}) + "\n")
    code = infer_main(["retrieve", "--artifact", str(out), "--input", str(req)])
    assert code == 2 and "give the user's 'items'" in capsys.readouterr().err
