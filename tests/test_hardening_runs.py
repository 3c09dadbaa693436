"""Runs never overwrite runs: run-directory choice, output locations checked before any work,
disk full during a checkpoint write (hstu.training.rundir, hstu.training.checkpoint)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from dist_helpers import TINY_BINDINGS, error_lines, launch

from hstu.config.gin_utils import load_config
from hstu.training import checkpoint as ckpt_mod
from hstu.training import rundir as rundir_mod
from hstu.training.checkpoint import Checkpointer, CheckpointWriteError
from hstu.training.rundir import RUN_FILE, RunDirError, prepare_run_dir, setup_run_dir
from hstu.training.trainer import Trainer, run_training

TINY = [*TINY_BINDINGS, "TrainerArgs.progress_bar=False"]


def _cfg(log_dir: Path, *extra: str, files: list[Path] | None = None, task: str = "ranking"):
    bindings = [*TINY, f"TrainerArgs.log_dir='{log_dir}'", "TrainerArgs.run_name='run'"]
    return load_config(task, files or [], [*bindings, *extra])


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: (mtime_ns, contents)."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _finished_run(root: Path, cfg) -> Path:
    """A run directory as a finished run leaves it (run.json "started", a checkpoint)."""
    run = prepare_run_dir(cfg)
    rundir_mod.mark_started(run, cfg)
    Checkpointer(run.ckpt_dir).save(4, {"w": torch.ones(2)})
    (run.path / "events.out.tfevents.1.host").write_bytes(b"events")
    return run.path


# ---- choosing the run directory ----------------------------------------------------------------


def test_a_new_run_never_reuses_an_earlier_runs_directory(tmp_path):
    cfg = _cfg(tmp_path)
    first = _finished_run(tmp_path, cfg)
    assert first == tmp_path / "run"
    before = _snapshot(first)
    second = prepare_run_dir(cfg)
    assert second.path == tmp_path / "run-2" and not second.continuing
    assert second.ckpt_dir == tmp_path / "run-2" / "checkpoints"
    rundir_mod.mark_started(second, cfg)
    assert prepare_run_dir(cfg).path == tmp_path / "run-3"
    assert _snapshot(first) == before, "the earlier run's files changed"
    info = json.loads((second.path / RUN_FILE).read_text())
    assert info["status"] == "started" and info["identity"]["task"] == "ranking"
    assert (second.path / "config.gin").is_file()


def test_a_directory_left_by_a_failed_set_up_is_reused(tmp_path):
    cfg = _cfg(tmp_path)
    run = prepare_run_dir(cfg)  # "starting", owned by this process: its set-up raised
    assert json.loads((run.path / RUN_FILE).read_text())["status"] == "starting"
    assert prepare_run_dir(cfg).path == run.path
    # owned by a process that is gone
    info = json.loads((run.path / RUN_FILE).read_text())
    info["owner"]["pid"] = 2**22 + 12345
    (run.path / RUN_FILE).write_text(json.dumps(info))
    assert prepare_run_dir(cfg).path == run.path
    # owned by a live process (not this one): still setting up, not ours to take
    info["owner"]["pid"] = os.getppid()
    (run.path / RUN_FILE).write_text(json.dumps(info))
    assert prepare_run_dir(cfg).path == tmp_path / "run-2"


def test_an_empty_existing_directory_is_used(tmp_path):
    (tmp_path / "run").mkdir()
    assert prepare_run_dir(_cfg(tmp_path)).path == tmp_path / "run"


def test_continuing_a_run_from_its_latest_checkpoint_stays_in_its_directory(tmp_path):
    cfg = _cfg(tmp_path)
    first = _finished_run(tmp_path, cfg)
    for load in (first / "checkpoints", first / "checkpoints" / "step_00000004"):
        resumed = _cfg(tmp_path, f"TrainerArgs.ckpt_load_dir='{load}'")
        run = prepare_run_dir(resumed, Checkpointer.resolve(load))
        assert run.path == first and run.continuing
    # an earlier checkpoint is not a continuation (later ones would be replaced): a new directory
    Checkpointer(first / "checkpoints", keep_last=0).save(8, {"w": torch.ones(2)})
    old = first / "checkpoints" / "step_00000004"
    run = prepare_run_dir(_cfg(tmp_path, f"TrainerArgs.ckpt_load_dir='{old}'"), old)
    assert run.path == tmp_path / "run-2" and not run.continuing


def test_continuing_with_another_configuration_is_refused_unless_told(tmp_path):
    first = _finished_run(tmp_path, _cfg(tmp_path))
    before = _snapshot(first)
    load = f"TrainerArgs.ckpt_load_dir='{first / 'checkpoints'}'"
    changed = _cfg(tmp_path, load, "OptimizerArgs.learning_rate=0.05")
    with pytest.raises(RunDirError) as info:
        prepare_run_dir(changed, Checkpointer.resolve(first / "checkpoints"))
    msg = str(info.value)
    assert "\n" not in msg and str(first) in msg
    assert "OptimizerArgs.learning_rate: 0.001 -> 0.05" in msg
    assert "TrainerArgs.run_name" in msg and "TrainerArgs.allow_existing_run_dir=True" in msg
    assert info.value.exit_code == 2
    assert _snapshot(first) == before
    # operational fields (more steps, other intervals) are the same run
    longer = _cfg(tmp_path, load, "TrainerArgs.max_train_iters=8", "TrainerArgs.log_interval=1")
    assert prepare_run_dir(longer, Checkpointer.resolve(first / "checkpoints")).continuing
    told = _cfg(
        tmp_path,
        load,
        "OptimizerArgs.learning_rate=0.05",
        "TrainerArgs.allow_existing_run_dir=True",
    )
    assert prepare_run_dir(told, Checkpointer.resolve(first / "checkpoints")).path == first


def test_run_directories_written_before_run_json_are_compared_by_their_config_gin(tmp_path):
    first = _finished_run(tmp_path, _cfg(tmp_path))
    (first / RUN_FILE).unlink()
    load = f"TrainerArgs.ckpt_load_dir='{first / 'checkpoints'}'"
    resume = Checkpointer.resolve(first / "checkpoints")
    assert prepare_run_dir(_cfg(tmp_path, load), resume).continuing
    (first / RUN_FILE).unlink()
    with pytest.raises(RunDirError, match=r"NetworkArgs.num_layers: 1 -> 2"):
        prepare_run_dir(_cfg(tmp_path, load, "NetworkArgs.num_layers=2"), resume)


def test_explicit_checkpoint_directory_of_another_run_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    Checkpointer(ckpt).save(3, {"w": torch.ones(2)})
    before = _snapshot(ckpt)
    cfg = _cfg(tmp_path / "logs", f"TrainerArgs.ckpt_save_dir='{ckpt}'")
    with pytest.raises(RunDirError) as info:
        prepare_run_dir(cfg)
    msg = str(info.value)
    assert f"TrainerArgs.ckpt_save_dir='{ckpt}' already holds checkpoints" in msg
    assert "step_00000003" in msg and "allow_existing_run_dir=True" in msg
    assert not (tmp_path / "logs" / "run").exists(), "refused before claiming a directory"
    assert _snapshot(ckpt) == before
    # resuming from its latest checkpoint continues the series; told; never saving: accepted
    resume = _cfg(tmp_path / "logs", f"TrainerArgs.ckpt_save_dir='{ckpt}'")
    assert prepare_run_dir(resume, Checkpointer.resolve(ckpt)).ckpt_dir == ckpt
    for i, extra in enumerate(
        ["TrainerArgs.allow_existing_run_dir=True", "TrainerArgs.ckpt_save_interval=-1"]
    ):
        cfg = _cfg(tmp_path / f"logs{i}", f"TrainerArgs.ckpt_save_dir='{ckpt}'", extra)
        assert prepare_run_dir(cfg).ckpt_dir == ckpt


def test_explicit_checkpoint_directory_with_another_configuration_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = _cfg(tmp_path, f"TrainerArgs.ckpt_save_dir='{ckpt}'")
    identity = rundir_mod.config_identity(old)
    Checkpointer(ckpt).save(3, {"w": torch.ones(2)}, extra_meta={"config_identity": identity})
    new = _cfg(tmp_path, f"TrainerArgs.ckpt_save_dir='{ckpt}'", "NetworkArgs.hidden_size=32")
    with pytest.raises(RunDirError, match=r"NetworkArgs.hidden_size: 16 -> 32"):
        prepare_run_dir(new, Checkpointer.resolve(ckpt))


# ---- output locations ----------------------------------------------------------------------


def test_file_shaped_output_paths_are_one_line_errors(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    cases = [
        (_cfg(a_file), f"TrainerArgs.log_dir='{a_file}' is a file, not a directory"),
        (_cfg(a_file / "sub"), f"cannot be created: {a_file} is a file, not a directory"),
        (
            _cfg(tmp_path / "logs", f"TrainerArgs.ckpt_save_dir='{a_file}'"),
            f"TrainerArgs.ckpt_save_dir='{a_file}' is a file",
        ),
    ]
    for cfg, expected in cases:
        with pytest.raises(RunDirError) as info:
            prepare_run_dir(cfg)
        assert expected in str(info.value) and "\n" not in str(info.value)
        assert info.value.exit_code == 2
    assert a_file.read_text() == "keep me"
    (tmp_path / "logs2").mkdir()
    (tmp_path / "logs2" / "run").write_text("a file where the run directory goes")
    with pytest.raises(RunDirError, match="run directory .*run is a file"):
        prepare_run_dir(_cfg(tmp_path / "logs2"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_log_dir_is_a_one_line_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for log_dir in (ro, ro / "sub"):
            with pytest.raises(RunDirError, match=re.escape(f"TrainerArgs.log_dir='{log_dir}'")):
                prepare_run_dir(_cfg(log_dir))
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EACCES, "is not writable (permission denied)"),
        (errno.EROFS, "is not writable (the file system is read-only)"),
        (errno.ENOSPC, "has no space left (the disk is full)"),
    ],
)
def test_unwritable_or_full_output_dir_is_a_one_line_error(tmp_path, monkeypatch, code, expected):
    """The probe write fails as it would on such a disk (root ignores permission bits)."""

    def failing(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(rundir_mod.tempfile, "mkstemp", failing)
    with pytest.raises(RunDirError) as info:
        prepare_run_dir(_cfg(tmp_path / "logs"))
    msg = str(info.value)
    assert f"TrainerArgs.log_dir='{tmp_path / 'logs'}' {expected}" in msg
    assert "set TrainerArgs.log_dir to a writable directory" in msg
    assert info.value.exit_code == 1
    monkeypatch.undo()
    monkeypatch.setattr(rundir_mod.os, "fsync", failing)  # the probe's data reaching the disk
    with pytest.raises(RunDirError, match=re.escape(expected)):
        prepare_run_dir(_cfg(tmp_path / "logs"))
    monkeypatch.undo()
    assert not list((tmp_path / "logs").glob(".hstu-write-probe*")), "probe file left behind"


def test_output_paths_are_checked_before_data_loading_and_model_building(tmp_path, monkeypatch):
    import hstu.training.trainer as trainer_mod

    def no_work(*args, **kwargs):
        raise AssertionError("data loaded or model built before the output paths were checked")

    monkeypatch.setattr(trainer_mod, "load_sequence_data", no_work)
    monkeypatch.setattr(trainer_mod, "build_model", no_work)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(RunDirError, match="is a file"):
        Trainer(_cfg(a_file), "cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a missing checkpoint too
        Trainer(_cfg(tmp_path, f"TrainerArgs.ckpt_load_dir='{tmp_path / 'nope'}'"), "cpu")


def test_a_trainer_that_fails_to_start_leaves_no_process_group(tmp_path):
    """The process group a Trainer created is destroyed when its start fails (a later Trainer in
    the same process, e.g. a notebook's retry, starts as the first did)."""
    import torch.distributed as dist

    from hstu.training.trainer import Trainer

    before = dist.is_initialized()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trainer(_cfg(tmp_path, f"TrainerArgs.ckpt_load_dir='{tmp_path / 'nope'}'"), "cpu")
    assert dist.is_initialized() == before
    if before:  # one left by an earlier test: the failed start must not have closed it
        return
    trainer = Trainer(_cfg(tmp_path / "ok"), "cpu")
    try:
        assert trainer.info.owns_group and dist.is_initialized()
    finally:
        trainer.close()
    assert not dist.is_initialized()


# ---- end to end ----------------------------------------------------------------------------------


def test_rerunning_a_saved_config_gets_a_new_directory_and_resuming_continues(tmp_path):
    first = run_training(_cfg(tmp_path))
    run = tmp_path / "run"
    assert first.run_dir == run and first.checkpoint_dir == run / "checkpoints" / "step_00000004"
    before = _snapshot(run)
    # the saved config.gin records run_name='run': a new run of it gets run-2
    again = run_training(load_config("ranking", [run / "config.gin"], []))
    assert again.run_dir == tmp_path / "run-2"
    assert _snapshot(run) == before, "re-running the saved config changed the first run's files"
    assert len(list(run.glob("events.out.tfevents*"))) == 1
    # resuming from the run's checkpoints continues it in place, with its own config
    resumed = run_training(
        load_config(
            "ranking",
            [run / "config.gin"],
            [f"TrainerArgs.ckpt_load_dir='{run / 'checkpoints'}'", "TrainerArgs.max_train_iters=6"],
        )
    )
    assert resumed.run_dir == run and [s for s, _ in resumed.losses] == [5, 6]
    assert Checkpointer.resolve(run / "checkpoints").name == "step_00000006"


def test_two_ranks_agree_on_the_run_directory(tmp_path):
    import torch.multiprocessing as mp

    cfg = _cfg(tmp_path)
    _finished_run(tmp_path, cfg)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_setup_worker, args=(str(tmp_path / "init"), str(tmp_path), str(out)), nprocs=2)
    got = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] == {"ok": str(tmp_path / "run-2")}, got
    # an error on rank 0 is raised on every rank, with the same message
    (tmp_path / "file").write_text("")
    mp.spawn(
        _setup_worker, args=(str(tmp_path / "init2"), str(tmp_path / "file"), str(out)), nprocs=2
    )
    got = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and "is a file" in got[0]["error"], got


def _setup_worker(rank: int, init: str, log_dir: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        try:
            run = setup_run_dir(_cfg(Path(log_dir)), rank, 2)
            result = {"ok": str(run.path)}
        except RunDirError as e:
            result = {"error": str(e), "code": e.exit_code}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---- disk full while writing a checkpoint ----------------------------------------------------


def _disk_full_cases():
    def oserror(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def torch_zip_writer(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
            "data/0: file write failed"
        )

    return [oserror, torch_zip_writer]


@pytest.mark.parametrize("failure", _disk_full_cases(), ids=["ENOSPC", "inline_container"])
def test_disk_full_during_checkpoint_write(tmp_path, monkeypatch, failure):
    ck = Checkpointer(tmp_path / "ckpt")
    ck.save(1, {"w": torch.ones(2)})
    before = _snapshot(tmp_path / "ckpt")
    monkeypatch.setattr(ckpt_mod.torch, "save", failure)
    with pytest.raises(CheckpointWriteError) as info:
        ck.save(2, {"w": torch.full((2,), 2.0)})
    monkeypatch.undo()
    msg = str(info.value)
    assert msg.startswith(
        f"disk full while writing checkpoint {tmp_path / 'ckpt' / 'step_00000002'}"
    )
    assert "\n" not in msg and "latest checkpoint is still" in msg and "step_00000001" in msg
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert _snapshot(tmp_path / "ckpt") == before, "the partial write was not removed"
    step, state, _ = Checkpointer.load(tmp_path / "ckpt")
    assert step == 1 and torch.equal(state["w"], torch.ones(2))


def test_disk_full_while_committing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"w": torch.ones(2)})
    real = ckpt_mod._write_text_atomic

    def full(path, text):
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(ckpt_mod, "_write_text_atomic", full)
    with pytest.raises(CheckpointWriteError, match="^disk full while writing checkpoint"):
        ck.save(2, {"w": torch.ones(2)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert Checkpointer.load(tmp_path)[0] == 1


def test_disk_full_in_training_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "TrainerArgs.ckpt_save_interval=2")
    real_save = torch.save
    calls = []

    def full_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", full_on_the_second)
    with pytest.raises(CheckpointWriteError, match="^disk full while writing checkpoint"):
        run_training(cfg)
    monkeypatch.undo()
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]


# ---- through the launcher ----------------------------------------------------------------------


def _args(*bindings: str) -> list[str]:
    return [x for b in [*TINY, *bindings] for x in ("--gin-bindings", b)]


@pytest.mark.cpu_only
def test_launcher_file_shaped_log_dir_and_foreign_checkpoint_dir(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    proc = launch("ranking", _args(f"TrainerArgs.log_dir='{a_file}'"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"TrainerArgs.log_dir='{a_file}' is a file" in lines[0]
    ckpt = tmp_path / "ckpt"
    Checkpointer(ckpt).save(3, {"w": torch.ones(2)})
    proc = launch(
        "ranking",
        _args(f"TrainerArgs.log_dir='{tmp_path / 'logs'}'", f"TrainerArgs.ckpt_save_dir='{ckpt}'"),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "already holds checkpoints" in error_lines(proc.stderr)[0]


def test_cpu_threads_hold_while_the_trainer_runs_and_are_restored(tmp_path):
    import torch

    from hstu.training.trainer import Trainer

    before = torch.get_num_threads()
    seen = []
    trainer = Trainer(_cfg(tmp_path, "TrainerArgs.cpu_threads=1"), "cpu")
    try:
        seen.append(torch.get_num_threads())
        trainer.fit()
        seen.append(torch.get_num_threads())
    finally:
        trainer.close()
    assert seen == [1, 1] and torch.get_num_threads() == before
    # a start that fails restores them too
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bad = f"TrainerArgs.ckpt_load_dir='{tmp_path / 'nope'}'"
        Trainer(_cfg(tmp_path / "b", "TrainerArgs.cpu_threads=1", bad), "cpu")
    assert torch.get_num_threads() == before
    # 0 leaves PyTorch's count as it is
    trainer = Trainer(_cfg(tmp_path / "c"), "cpu")
    try:
        assert torch.get_num_threads() == before
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"TrainerArgs.cpu_threads=-1 must be a non-negative"):
        _cfg(tmp_path / "d", "TrainerArgs.cpu_threads=-1")


def test_metrics_log_reads_back_without_a_torn_last_line(tmp_path):
    from hstu.training.rundir import METRICS_FILE, append_metrics, read_metrics

    append_metrics(tmp_path, 3, {"HR@10": 0.25}, 0.5)
    append_metrics(tmp_path, 6, {"HR@10": 0.5}, 0.25)
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 9, "metr')  # a run killed while writing its line
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["metrics"]["HR@10"], r["eval_s"]) for r in rows] == [
        (3, 0.25, 0.5),
        (6, 0.5, 0.25),
    ]
    assert read_metrics(tmp_path / "none") == []
