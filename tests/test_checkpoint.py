"""Checkpointer: round trip, atomicity under simulated crashes, pruning, errors, RNG, 2 ranks."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hstu.training import checkpoint as ckpt_mod
from hstu.training.checkpoint import Checkpointer, capture_rng_state, restore_rng_state


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3, 2), float(step)), "b": torch.arange(4)},
        "step": step,
        "data_position": {"epoch": 1, "index": step * 7},
    }


def _step_dirs(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def _assert_no_invalid_step_dir(root):
    for p in root.iterdir():
        if p.name.startswith("step_") and not p.name.endswith(".tmp"):
            assert (p / "meta.json").is_file(), f"{p} looks like a checkpoint but has no meta.json"


def test_round_trip_root_and_step_dir(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt")
    path = ck.save(5, _state(5), extra_meta={"run": "abc"})
    assert path == tmp_path / "ckpt" / "step_00000005"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000005"
    for where in (tmp_path / "ckpt", path, str(path)):
        step, state, meta = Checkpointer.load(where)
        assert step == 5
        torch.testing.assert_close(state["model"]["w"], _state(5)["model"]["w"])
        assert state["data_position"] == {"epoch": 1, "index": 35}
        assert meta["world_size"] == 1 and meta["extra_meta"] == {"run": "abc"}
        assert meta["resharded"] is False
    on_disk = json.loads((path / "meta.json").read_text())
    assert on_disk["step"] == 5 and "time" in on_disk
    # re-saving the same step replaces it in place
    ck.save(5, _state(6))
    assert Checkpointer.load(tmp_path / "ckpt")[1]["step"] == 6
    assert _step_dirs(tmp_path / "ckpt") == ["step_00000005"]


def test_keep_last_prunes_oldest(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        ck.save(step, _state(step))
    assert _step_dirs(tmp_path) == ["step_00000030", "step_00000040"]
    assert Checkpointer.load(tmp_path)[0] == 40
    keep_all = Checkpointer(tmp_path / "all", keep_last=0)
    for step in range(5):
        keep_all.save(step, _state(step))
    assert len(Checkpointer.list_checkpoints(tmp_path / "all")) == 5
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=-1)


def test_crash_in_torch_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(1, _state(1))

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_mod.torch, "save", boom)
    with pytest.raises(OSError, match="simulated"):
        ck.save(2, _state(2))
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    _assert_no_invalid_step_dir(tmp_path)
    assert Checkpointer.load(tmp_path)[0] == 1


def test_crash_before_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(1, _state(1))
    real_replace = ckpt_mod.os.replace

    def replace_failing_on_step_dir(src, dst):
        if str(dst).endswith("step_00000002"):
            raise OSError("killed before rename (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", replace_failing_on_step_dir)
    with pytest.raises(OSError, match="simulated"):
        ck.save(2, _state(2))
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    _assert_no_invalid_step_dir(tmp_path)
    assert Checkpointer.load(tmp_path)[0] == 1


def test_interrupted_resave_of_same_step(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(5, _state(5))
    real_replace = ckpt_mod.os.replace

    def fail_moving_new_copy_in(src, dst):
        if str(src).endswith("step_00000005.tmp"):
            raise OSError("killed mid-swap (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", fail_moving_new_copy_in)
    with pytest.raises(OSError, match="simulated"):
        ck.save(5, _state(6))
    monkeypatch.undo()
    # the old copy was put back
    assert Checkpointer.load(tmp_path)[1]["data_position"]["index"] == 35
    _assert_no_invalid_step_dir(tmp_path)
    # a hard kill between the two renames leaves only step_X.old: load still finds it
    real_replace(tmp_path / "step_00000005", tmp_path / "step_00000005.old")
    assert Checkpointer.load(tmp_path)[0] == 5
    ck.save(6, _state(6))
    assert _step_dirs(tmp_path) == ["step_00000006"]


def test_leftover_tmp_from_killed_process_is_ignored_then_cleaned(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, _state(1))
    stale = tmp_path / "step_00000002.tmp"
    stale.mkdir()
    (stale / "rank_0.pt").write_bytes(b"half a file")
    assert Checkpointer.load(tmp_path)[0] == 1
    with pytest.raises(FileNotFoundError, match="incomplete"):
        Checkpointer.load(stale)
    ck.save(3, _state(3))
    assert not stale.exists()
    assert Checkpointer.load(tmp_path)[0] == 3


def test_clear_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        Checkpointer.load(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint found in {empty}")):
        Checkpointer.load(empty)

    ck = Checkpointer(tmp_path / "c")
    path = ck.save(7, _state(7))
    (path / "rank_0.pt").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=re.escape(f"{path / 'rank_0.pt'} is corrupt")):
        Checkpointer.load(tmp_path / "c")
    (path / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{path / 'meta.json'} is corrupt")):
        Checkpointer.load(path)
    (tmp_path / "c" / "latest").write_text("step_00000099\n")
    with pytest.raises(FileNotFoundError, match="step_00000099"):
        Checkpointer.load(tmp_path / "c")


def test_no_latest_file_falls_back_to_newest(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    (tmp_path / "latest").unlink()
    assert Checkpointer.load(tmp_path)[0] == 2


def _draw():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (3,)).tolist(),
    )


def test_rng_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    _draw()
    Checkpointer(tmp_path).save(1, {"rng": capture_rng_state()})
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    restore_rng_state(Checkpointer.load(tmp_path)[1]["rng"])
    assert _draw() == expected


def _save_worker(rank: int, world: int, init_file: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ck = Checkpointer(root, keep_last=1)
        for step in (1, 2):
            state = {"dense": torch.ones(2) * step, "shard": torch.arange(3) + 10 * rank}
            ck.save(step, state, rank=rank, world_size=world, extra_meta={"w": world})
    finally:
        dist.destroy_process_group()


def test_two_rank_save_and_reshard_load(tmp_path):
    root = tmp_path / "ckpt"
    mp.spawn(_save_worker, args=(2, str(tmp_path / "init"), str(root)), nprocs=2, join=True)
    assert _step_dirs(root) == ["step_00000002"]
    assert sorted(p.name for p in (root / "step_00000002").iterdir()) == [
        "meta.json",
        "rank_0.pt",
        "rank_1.pt",
    ]
    step, state, meta = Checkpointer.load(root, rank=1, world_size=2)
    assert step == 2 and meta["resharded"] is False
    torch.testing.assert_close(state["shard"], torch.tensor([10, 11, 12]))
    # world size changed: rank 0's copy for dense parts, all ranks for re-sharding
    step, state, meta = Checkpointer.load(root, rank=0, world_size=1)
    assert meta["resharded"] is True and meta["world_size"] == 2
    torch.testing.assert_close(state["dense"], torch.full((2,), 2.0))
    shards = [s["shard"] for s in Checkpointer.load_all_ranks(root)]
    torch.testing.assert_close(torch.cat(shards), torch.tensor([0, 1, 2, 10, 11, 12]))


# ---- re-sharding records (hstu.training.reshard) -------------------------------------------


def _record(full: torch.Tensor, bounds: list[tuple[int, int]]) -> list[dict]:
    """One record per 'rank', each holding rows [lo, hi) of ``full``."""
    from hstu.training.reshard import SHARDS_KEY

    return [
        {
            SHARDS_KEY: 1,
            "global_shape": list(full.shape),
            "pieces": [{"offsets": [lo, 0], "tensor": full[lo:hi].clone()}] if hi > lo else [],
        }
        for lo, hi in bounds
    ]


def test_restore_into_regroups_row_shards_and_takes_replicas_from_the_first_source():
    from hstu.training.reshard import restore_into

    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    saved = _record(full, [(0, 5), (5, 10)])  # written by 2 ranks
    # this rank's piece straddles both saved shards (3 ranks now: rows 3..6 here)
    target = {"table": _record(torch.zeros(10, 4), [(3, 7)])[0], "dense": torch.zeros(3), "lr": 0}
    sources = [
        {"table": saved[0], "dense": torch.ones(3), "lr": 0.5},
        {"table": saved[1], "dense": torch.full((3,), 7.0), "lr": 9.0},
    ]
    out = restore_into(target, sources)
    torch.testing.assert_close(target["table"]["pieces"][0]["tensor"], full[3:7])  # in place
    torch.testing.assert_close(out["dense"], torch.ones(3))  # the first source's replica
    assert out["lr"] == 0.5
    # a rank holding no piece of a table (table-wise placement elsewhere) needs nothing
    empty = _record(torch.zeros(10, 4), [(0, 0)])[0]
    restore_into(empty, [saved[0], saved[1]])


def test_restore_into_errors_name_the_entry():
    from hstu.training.reshard import restore_into

    full = torch.ones(6, 2)
    holes = _record(full, [(0, 2), (4, 6)])  # rows 2..3 are in no file
    target = _record(torch.zeros(6, 2), [(0, 6)])[0]
    with pytest.raises(ValueError, match=r"t: the checkpoint's shards cover 8 of the 12"):
        restore_into(target, holes, "t")
    bigger = _record(torch.zeros(8, 2), [(0, 8)])[0]
    with pytest.raises(ValueError, match=r"shape \[6, 2\] in the checkpoint but \[8, 2\]"):
        restore_into(bigger, _record(full, [(0, 6)]), "t")
    with pytest.raises(ValueError, match=r"state\['w'\] is in this run's state but not in"):
        restore_into({"w": torch.zeros(1)}, [{"v": torch.zeros(1)}])


def _dtensor_worker(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hstu.training.reshard import to_portable

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
        dt = distribute_tensor(full, mesh, [Shard(0)])  # uneven: 3 + 2 rows
        torch.save({"w": to_portable(dt)}, f"{out}/rank_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_dtensor_pieces_are_saved_with_their_offsets(tmp_path):
    from hstu.training.reshard import restore_into

    mp.spawn(_dtensor_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    saved = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=False)["w"] for r in range(2)]
    assert [p["offsets"] for s in saved for p in s["pieces"]] == [[0, 0], [3, 0]]
    target = torch.zeros(5, 3)
    restore_into(target, saved)
    torch.testing.assert_close(target, torch.arange(15, dtype=torch.float32).reshape(5, 3))
