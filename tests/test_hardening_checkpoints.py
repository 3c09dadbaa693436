"""Safe checkpoints: weights-only loading refuses planted pickles (zip and legacy format), older
files still resume exactly, an optimizer change on resume is one line (or an explicit reset),
and kill -9 during checkpoint writes always leaves a loadable checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import random
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import TINY_BINDINGS, error_lines, launch

from hstu.config.gin_utils import load_config
from hstu.training.checkpoint import (
    Checkpointer,
    UnsafeCheckpointError,
    capture_rng_state,
    restore_rng_state,
)
from hstu.training.trainer import Trainer, run_training

TINY = [*TINY_BINDINGS, "TrainerArgs.progress_bar=False", "NetworkArgs.hidden_dropout=0.2"]


def _cfg(log_dir: Path, *extra: str, name: str = "run"):
    bindings = [*TINY, f"TrainerArgs.log_dir='{log_dir}'", f"TrainerArgs.run_name='{name}'"]
    return load_config("ranking", [], [*bindings, *extra])


class Planted:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _plant(file: Path, marker: Path, fmt: str) -> None:
    """Replace a rank file by one holding a payload next to real-looking entries."""
    obj = {"model": {"w": torch.zeros(2)}, "step": 1, "payload": Planted(marker)}
    if fmt == "zip":
        torch.save(obj, file)
    elif fmt == "legacy":
        torch.save(obj, file, _use_new_zipfile_serialization=False)
    else:  # a bare pickle, not written by torch at all
        file.write_bytes(pickle.dumps(obj, protocol=4))


def test_the_planted_payload_is_live(tmp_path):
    """(So that the tests below mean something: unpickling it does run code.)"""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Planted(marker)))
    assert marker.read_text() == "pwned"


@pytest.mark.parametrize("fmt", ["zip", "legacy", "pickle"])
@pytest.mark.parametrize("format_version", [3, 2])
def test_planted_pickle_is_refused_and_never_runs(tmp_path, fmt, format_version):
    marker = tmp_path / "ran"
    root = tmp_path / "ckpt"
    step_dir = Checkpointer(root).save(1, {"w": torch.ones(2)})
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["format_version"] = format_version  # format 2 also allows NumPy arrays: not this
    (step_dir / "meta.json").write_text(json.dumps(meta))
    rank_file = step_dir / "rank_0.pt"
    _plant(rank_file, marker, fmt)
    for load in (
        lambda: Checkpointer.load(root),
        lambda: Checkpointer.load_all_ranks(root, mmap=True),
        lambda: Checkpointer.load_all_ranks(root),
    ):
        with pytest.raises(UnsafeCheckpointError) as info:
            load()
        msg = str(info.value)
        assert msg.startswith(f"checkpoint file {rank_file} holds pickled objects"), msg
        assert "\n" not in msg and "could run code" in msg
        assert not marker.exists(), "the planted pickle ran"
    if fmt != "pickle":
        assert re.search(r"\(GLOBAL (builtins\.)?exec\)", msg), msg


def test_format_1_sharded_tensor_files_are_refused_with_one_line(tmp_path):
    root = tmp_path / "ckpt"
    step_dir = Checkpointer(root).save(1, {"w": torch.ones(2)})
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["format_version"] = 1
    (step_dir / "meta.json").write_text(json.dumps(meta))
    # what a pickled torchrec ShardedTensor starts with: a GLOBAL of its class
    glob = b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
    (step_dir / "rank_0.pt").write_bytes(b"\x80\x02" + glob + b"q\x00.")
    with pytest.raises(UnsafeCheckpointError, match=r"is in checkpoint format 1, whose torchrec"):
        Checkpointer.load(root)


def test_latest_never_points_outside_the_checkpoint_root(tmp_path):
    root = tmp_path / "ckpt"
    Checkpointer(root).save(1, {"w": torch.ones(2)})
    elsewhere = Checkpointer(tmp_path / "elsewhere").save(9, {"w": torch.ones(2)})
    (root / "latest").write_text(f"../elsewhere/{elsewhere.name}\n")
    with pytest.raises(FileNotFoundError, match="not a step_XXXXXXXX directory"):
        Checkpointer.load(root)


def test_save_refuses_values_that_would_not_load_back(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"w": torch.ones(2)})
    with pytest.raises(TypeError, match=r"\['rng'\]\['numpy'\] is a numpy.ndarray"):
        ck.save(2, {"w": torch.ones(2), "rng": {"numpy": np.zeros(3)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    with pytest.raises(TypeError, match="Planted"):
        ck.save(2, {"x": [Planted(tmp_path / "ran")]})
    assert not (tmp_path / "ran").exists()


def test_rng_state_is_plain_and_round_trips(tmp_path):
    random.seed(3)
    np.random.seed(3)
    np.random.randn()  # a cached Gaussian in the state
    torch.manual_seed(3)
    state = capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    draws = (random.random(), np.random.randn(3).tolist(), torch.rand(2).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_state(loaded)
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(2).tolist()) == draws


# ---- checkpoints written before format 3 ---------------------------------------------------------


def _to_format_2(step_dir: Path, legacy_serialization: bool) -> None:
    """Rewrite a checkpoint as the code before format 3 wrote it: the NumPy RNG state as the
    np.random.get_state() tuple (an ndarray inside), no optimizer names or config in meta."""
    file = step_dir / "rank_0.pt"
    state = torch.load(file, weights_only=False)
    plain = state["rng"]["numpy"]
    key = plain["key"].numpy().astype(np.uint32)
    state["rng"]["numpy"] = (
        plain["bit_generator"],
        key,
        plain["pos"],
        plain["has_gauss"],
        plain["gauss"],
    )
    torch.save(state, file, _use_new_zipfile_serialization=not legacy_serialization)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["format_version"] = 2
    for k in ("dense_optimizer", "sparse_optimizer", "config_identity"):
        meta["extra_meta"].pop(k)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_format_2_checkpoints_still_resume_exactly(tmp_path):
    first = run_training(_cfg(tmp_path / "a", "TrainerArgs.ckpt_save_interval=2"))
    ckpt = first.run_dir / "checkpoints" / "step_00000002"
    resumed = run_training(_cfg(tmp_path / "b", f"TrainerArgs.ckpt_load_dir='{ckpt}'"))
    for legacy in (False, True):
        old = tmp_path / f"old_{legacy}" / "step_00000002"
        shutil.copytree(ckpt, old)
        _to_format_2(old, legacy)
        with pytest.raises(pickle.UnpicklingError):  # not loadable without the NumPy types
            torch.load(old / "rank_0.pt", weights_only=True)
        again = run_training(_cfg(tmp_path / f"c{legacy}", f"TrainerArgs.ckpt_load_dir='{old}'"))
        assert again.losses == resumed.losses
        assert [s for s, _ in again.losses] == [3, 4]


# ---- optimizer change on resume --------------------------------------------------------------


@pytest.fixture(scope="module")
def adam_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adam")
    result = run_training(_cfg(root, "TrainerArgs.max_train_iters=2"))
    return Path(result.checkpoint_dir)


def test_dense_optimizer_change_is_one_line_naming_both(tmp_path, adam_checkpoint):
    load = f"TrainerArgs.ckpt_load_dir='{adam_checkpoint}'"
    before = {p.name: p.read_bytes() for p in adam_checkpoint.iterdir()}
    with pytest.raises(ValueError) as info:
        Trainer(_cfg(tmp_path, load, "OptimizerArgs.optimizer_str='sgd'"), "cpu")
    msg = str(info.value)
    assert "\n" not in msg and str(adam_checkpoint) in msg
    assert "OptimizerArgs.optimizer_str='adam' but this run uses 'sgd'" in msg
    assert "TrainerArgs.ckpt_reset_optimizer=True" in msg
    assert "--gin-bindings \"OptimizerArgs.optimizer_str='adam'\"" in msg
    assert {p.name: p.read_bytes() for p in adam_checkpoint.iterdir()} == before
    # a file from before the names were recorded: told by its state
    old = tmp_path / "old" / adam_checkpoint.name
    shutil.copytree(adam_checkpoint, old)
    _to_format_2(old, legacy_serialization=False)
    cfg = _cfg(tmp_path, f"TrainerArgs.ckpt_load_dir='{old}'", "OptimizerArgs.optimizer_str='sgd'")
    with pytest.raises(ValueError, match=r"optimizer_str='adam(/adamw)?' but this run uses 'sgd'"):
        Trainer(cfg, "cpu")


def test_sparse_optimizer_change_is_one_line(tmp_path, adam_checkpoint):
    cfg = _cfg(
        tmp_path,
        f"TrainerArgs.ckpt_load_dir='{adam_checkpoint}'",
        "EmbeddingArgs.sparse_optimizer_str='adagrad'",
    )
    expected = "sparse_optimizer_str='rowwise_adagrad' but this run uses 'adagrad'"
    with pytest.raises(ValueError, match=expected):
        Trainer(cfg, "cpu")
    # dynamic tables: their optimizer state is outside torchrec's fused optimizer
    dynamic = [
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.contextual_tables='dense'",
    ]
    first = run_training(_cfg(tmp_path / "d", "TrainerArgs.max_train_iters=1", *dynamic))
    load = f"TrainerArgs.ckpt_load_dir='{first.checkpoint_dir}'"
    cfg = _cfg(tmp_path / "e", load, "EmbeddingArgs.sparse_optimizer_str='adagrad'", *dynamic)
    with pytest.raises(ValueError, match=expected):
        Trainer(cfg, "cpu")


def test_reset_optimizer_resumes_weights_with_a_fresh_optimizer(tmp_path, adam_checkpoint):
    cfg = _cfg(
        tmp_path,
        f"TrainerArgs.ckpt_load_dir='{adam_checkpoint}'",
        "TrainerArgs.ckpt_reset_optimizer=True",
        "TrainerArgs.max_train_iters=4",
        "OptimizerArgs.optimizer_str='sgd'",
        "OptimizerArgs.learning_rate=0.01",
        "OptimizerArgs.lr_scheduler='linear'",
    )
    trainer = Trainer(cfg, "cpu")
    try:
        assert trainer.step == 2 and isinstance(trainer.optimizer, torch.optim.SGD)
        assert trainer.optimizer.state_dict()["state"] == {}
        saved = torch.load(adam_checkpoint / "rank_0.pt", weights_only=True)["model"]
        for k, v in trainer.model.state_dict().items():
            if isinstance(v, torch.Tensor) and isinstance(saved.get(k), torch.Tensor):
                torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
        # the configured schedule, at step 2 of 4: linear decay to 0 at step 4
        assert trainer.scheduler.get_last_lr() == pytest.approx([0.005])
        assert [s for s, _ in trainer.fit().losses] == [3, 4]
    finally:
        trainer.close()


# ---- through the launcher ----------------------------------------------------------------------


def _args(*bindings: str) -> list[str]:
    return [x for b in [*TINY, *bindings] for x in ("--gin-bindings", b)]


@pytest.mark.cpu_only
def test_launcher_planted_pickle_and_optimizer_change(tmp_path, adam_checkpoint):
    marker = tmp_path / "ran"
    planted = tmp_path / "planted"
    shutil.copytree(adam_checkpoint.parent, planted)
    _plant(planted / adam_checkpoint.name / "rank_0.pt", marker, "legacy")
    proc = launch(
        "ranking",
        _args(f"TrainerArgs.log_dir='{tmp_path}'", f"TrainerArgs.ckpt_load_dir='{planted}'"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not marker.exists()
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "holds pickled objects" in lines[0] and str(planted) in lines[0]
    proc = launch(
        "ranking",
        _args(
            f"TrainerArgs.log_dir='{tmp_path}'",
            f"TrainerArgs.ckpt_load_dir='{adam_checkpoint}'",
            "OptimizerArgs.optimizer_str='sgd'",
        ),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "but this run uses 'sgd'" in error_lines(proc.stderr)[0]


# ---- kill -9 during checkpoint writes ---------------------------------------------------------


def _saving_forever(root: str, seed: int) -> None:
    """Saves checkpoints of growing steps until killed; every state is derived from its step."""
    ck = Checkpointer(root, keep_last=2)
    step = Checkpointer.load(root)[0] + 1 if Checkpointer.list_checkpoints(root) else 0
    rng = np.random.default_rng(seed)
    while True:
        n = int(rng.integers(1, 200_000))
        ck.save(
            step, {"step": step, "w": torch.full((n,), float(step)), "rng": capture_rng_state()}
        )
        step += 1


def test_kill_9_during_checkpoint_writes_always_leaves_a_loadable_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    last_step = -1
    for i in range(12):
        proc = ctx.Process(target=_saving_forever, args=(str(root), i))
        proc.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        if not Checkpointer.list_checkpoints(root):
            continue  # killed before the first save completed
        step, state, meta = Checkpointer.load(root)
        assert state["step"] == step == meta["step"] >= last_step
        assert torch.equal(state["w"], torch.full_like(state["w"], float(step)))
        restore_rng_state(state["rng"])
        for p in Checkpointer.list_checkpoints(root):  # every complete one loads
            assert Checkpointer.load(p)[1]["step"] == int(re.sub(r"\D", "", p.name))
        last_step = step
    assert last_step > 0, "no checkpoint was ever completed"
