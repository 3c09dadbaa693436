"""Prepared data carries its own proof; bad inputs and outputs of prepare are one line.

The manifest records every array's shape, dtype and sha256 and the data file's size; loading
checks them, so counts that no longer match, an ``.npz`` swapped for another dataset's, an empty
or truncated file each stop with one line naming the file and the exact prepare command to re-run.
Manifests from before the checksums load with a warning. prepare itself: truncated or mislabelled
``.gz`` inputs, an output path that is a file, an unwritable or full output directory are one line
and never leave a half-written dataset.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import ROOT, launcher_env, prepare_sequences_cli

from hstu.data.prepare import main as prepare_main
from hstu.data.prepare import prepare_dataset
from hstu.data.registry import load_sequence_data
from hstu.data.sequences import (
    ARRAY_NAMES,
    DATA_FILE,
    MANIFEST_FILE,
    PreparedDataError,
    SequenceData,
    array_checksum,
)
from hstu.data.sources import DataFormatError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LINES = FIXTURES / "sequences" / "lines.txt"
PAIRS = FIXTURES / "sequences" / "pairs.txt"


def _prepare(tmp_path: Path, source: Path = LINES, name: str = "out") -> Path:
    out = tmp_path / name
    prepare_dataset("sequences", source, out, progress=False)
    return out


def _manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST_FILE).read_text())


def _load_error(out: Path) -> str:
    with pytest.raises(PreparedDataError) as info:
        SequenceData.load(out)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def _rerun(out: Path) -> str:
    """The exact prepare command the manifest records, as the error message gives it."""
    return _manifest(out)["command"] + " --force"


# ---- the manifest's proof ------------------------------------------------------------------------


def test_manifest_records_every_array(tmp_path):
    out = _prepare(tmp_path)
    m = _manifest(out)
    data = SequenceData.load(out)
    assert sorted(m["arrays"]) == sorted(ARRAY_NAMES)
    for name in ARRAY_NAMES:
        a = getattr(data, name)
        rec = m["arrays"][name]
        assert rec["shape"] == list(a.shape) and rec["dtype"] == a.dtype.str
        assert rec["sha256"] == hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    assert m["data_file"] == {"name": DATA_FILE, "bytes": (out / DATA_FILE).stat().st_size}
    # the command re-creates this output from anywhere: absolute paths
    assert m["command"] == (
        f"python -m hstu.data.prepare --dataset sequences --source {LINES.resolve()} "
        f"--output {out.resolve()}"
    )


def test_manifest_counts_that_do_not_match_the_arrays(tmp_path):
    out = _prepare(tmp_path)
    m = _manifest(out)
    m["num_interactions"] += 1
    (out / MANIFEST_FILE).write_text(json.dumps(m))
    msg = _load_error(out)
    assert msg.startswith(f"{out / DATA_FILE}: manifest.json records num_interactions=7 but ")
    assert msg.endswith(f"re-create it with: {_rerun(out)}")


def test_npz_swapped_for_another_datasets(tmp_path):
    a, b = _prepare(tmp_path, LINES, "a"), _prepare(tmp_path, PAIRS, "b")
    shutil.copy(b / DATA_FILE, a / DATA_FILE)
    msg = _load_error(a)
    assert msg.startswith(f"{a / DATA_FILE}: ")
    assert "does not match" in msg or "records" in msg
    assert "damaged or was replaced" in msg and msg.endswith(_rerun(a))


def test_same_size_npz_with_other_values_fails_the_checksum(tmp_path):
    out = _prepare(tmp_path)
    data = SequenceData.load(out)
    other = np.savez  # same shapes and dtypes, one timestamp changed: only the checksum differs
    arrays = data.arrays()
    arrays["timestamps"] = arrays["timestamps"].copy()
    arrays["timestamps"][-1] += 1
    other(out / DATA_FILE, **arrays)
    msg = _load_error(out)
    assert "array 'timestamps' has sha256 " in msg and "but manifest.json records" in msg


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_empty_truncated_or_garbage_npz(tmp_path, damage):
    out = _prepare(tmp_path)
    path = out / DATA_FILE
    raw = path.read_bytes()
    path.write_bytes(
        {"empty": b"", "truncated": raw[: len(raw) // 2], "garbage": os.urandom(len(raw))}[damage]
    )
    msg = _load_error(out)
    assert msg.startswith(f"{path}: ")
    want = {
        "empty": "the file is empty (0 bytes)",
        "truncated": f"the file has {len(raw) // 2} bytes but manifest.json records {len(raw)}",
        "garbage": "not a readable .npz archive",
    }[damage]
    assert want in msg and msg.endswith(f"re-create it with: {_rerun(out)}")


def test_manifest_that_is_not_json(tmp_path):
    out = _prepare(tmp_path)
    (out / MANIFEST_FILE).write_text('{"name": "seq", ')
    msg = _load_error(out)
    assert msg.startswith(f"{out / MANIFEST_FILE}: unreadable manifest (JSONDecodeError")
    assert "--force" in msg


def test_registry_message_names_the_file_and_the_command(tmp_path):
    from hstu.config import load_config

    out = _prepare(tmp_path)
    (out / DATA_FILE).write_bytes(b"")
    cfg = load_config(
        "retrieval",
        None,
        ['DatasetArgs.dataset_name="seq"', f'DatasetArgs.dataset_path="{out}"'],
    )
    with pytest.raises(PreparedDataError) as info:
        load_sequence_data(cfg.dataset, num_tasks=0)
    assert str(info.value) == (
        f"{out / DATA_FILE}: the file is empty (0 bytes); the prepared dataset is damaged or "
        f"was replaced, re-create it with: {_rerun(out)}"
    )


def test_the_rerun_command_repairs_the_dataset(tmp_path):
    out = _prepare(tmp_path)
    good = SequenceData.load(out).item_ids.copy()
    (out / DATA_FILE).write_bytes(b"")
    argv = _rerun(out).split()[3:]  # after "python -m hstu.data.prepare"
    assert prepare_main(argv) == 0
    assert np.array_equal(SequenceData.load(out).item_ids, good)
    # without --force too: damaged output is never "up to date"
    (out / DATA_FILE).write_bytes(b"")
    assert not prepare_dataset("sequences", LINES, out, progress=False).up_to_date


def test_manifest_without_checksums_loads_with_a_warning(tmp_path, caplog):
    out = _prepare(tmp_path)
    m = _manifest(out)
    del m["arrays"], m["data_file"]
    (out / MANIFEST_FILE).write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="hstu"):
        data = SequenceData.load(out)
    assert data.num_interactions == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"{out / MANIFEST_FILE} has no checksums")
    assert warnings[0].endswith(f"re-create it to add them: {_rerun(out)}")
    # counts are still checked without checksums
    m["num_users"] = 99
    (out / MANIFEST_FILE).write_text(json.dumps(m))
    assert "records num_users=99 but the arrays hold 3" in _load_error(out)
    # re-running prepare (inputs unchanged) rebuilds and adds the checksums
    assert not prepare_dataset("sequences", LINES, out, progress=False).up_to_date
    assert "arrays" in _manifest(out)
    assert prepare_dataset("sequences", LINES, out, progress=False).up_to_date


def test_a_hand_made_manifest_without_command_gets_a_generic_fix(tmp_path):
    data = SequenceData.load(_prepare(tmp_path))
    data.save(tmp_path / "mine")
    (tmp_path / "mine" / DATA_FILE).write_bytes(b"")
    msg = _load_error(tmp_path / "mine")
    assert msg.endswith(
        "re-create it with: python -m hstu.data.prepare --dataset <name> --source <raw files> "
        f"--output {tmp_path / 'mine'} --force"
    )


# ---- corrupt inputs to prepare ---------------------------------------------------------------------


def _gz(tmp_path: Path, payload: bytes, name: str = "seq.txt.gz") -> Path:
    path = tmp_path / name
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("truncated", "the gzip file is truncated (it ends before its end-of-stream marker)"),
        ("mislabelled", "not a gzip file although its name ends in .gz (it starts with b'1 10 11"),
        ("corrupt", "corrupt gzip data"),
    ],
)
def test_damaged_gzip_inputs_name_the_file(tmp_path, kind, needle, caplog):
    text = LINES.read_bytes() * 200
    packed = gzip.compress(text)
    payload = {
        "truncated": packed[: len(packed) // 2],
        "mislabelled": text,
        "corrupt": packed[:20] + bytes(b ^ 0xFF for b in packed[20:60]) + packed[60:],
    }[kind]
    src = _gz(tmp_path, payload)
    out = tmp_path / "out"
    with pytest.raises(DataFormatError) as info:
        prepare_dataset("sequences", src, out, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{src}: ") and needle in msg and "\n" not in msg
    assert not out.exists() and not list(tmp_path.glob(".out.writing-*"))
    with caplog.at_level(logging.ERROR, logger="hstu"):
        argv = ["--dataset", "sequences", "--source", str(src), "--output", str(out)]
        assert prepare_main(argv) == 2  # bad input data
    assert caplog.records[-1].getMessage() == msg


def test_damaged_gzip_in_a_csv_dataset(tmp_path):
    """The pandas path (ml-20m's ratings.csv.gz) reports the file the same way."""
    src = tmp_path / "ml-20m"
    src.mkdir()
    raw = (FIXTURES / "ml-20m" / "ratings.csv").read_bytes()
    rows = raw.splitlines(keepends=True)
    big = rows[0] + b"".join(rows[1:]) * 3000
    packed = gzip.compress(big)
    (src / "ratings.csv.gz").write_bytes(packed[: len(packed) - 100])
    with pytest.raises(DataFormatError, match=r"ratings\.csv\.gz: the gzip file is truncated"):
        prepare_dataset("ml-20m", src, tmp_path / "out", progress=False)


def test_prepare_cli_damaged_input_in_a_subprocess(tmp_path):
    src = _gz(tmp_path, b"1 2\n1 3\n")
    proc, errors = prepare_sequences_cli(src, tmp_path / "out")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(errors) == 1 and f"{src}: not a gzip file" in errors[0]


# ---- the output location ---------------------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True])
def test_output_path_that_is_a_file(tmp_path, inside, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    out = blocker / "sub" if inside else blocker
    monkeypatch.setattr(
        "hstu.data.prepare.sha256_file", lambda *a: pytest.fail("inputs read before the check")
    )
    with pytest.raises(NotADirectoryError) as info:
        prepare_dataset("sequences", LINES, out, progress=False)
    msg = str(info.value)
    where = f"is inside {blocker}, which is a file" if inside else "is a file"
    assert msg == (
        f"output directory {out} {where}, not a directory; pass --output a directory (it is "
        "created if missing)"
    )
    assert blocker.read_text() == "not a directory"
    argv = ["--dataset", "sequences", "--source", str(LINES), "--output", str(out)]
    assert prepare_main(argv) == 2  # a usage error


def test_unwritable_output_directory(tmp_path, monkeypatch):
    import tempfile

    def denied(*a, dir=None, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    monkeypatch.setattr(
        "hstu.data.sources.sasrec.build_sequence_data", lambda *a, **k: pytest.fail("built")
    )
    out = tmp_path / "ro" / "out"
    with pytest.raises(PermissionError) as info:
        prepare_dataset("sequences", LINES, out, progress=False)
    assert str(info.value) == (
        f"cannot write to {tmp_path / 'ro'}: Permission denied; pass --output a writable directory"
    )
    argv = ["--dataset", "sequences", "--source", str(LINES), "--output", str(out)]
    assert prepare_main(argv) == 1  # a runtime failure (permissions), not bad input


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory_for_real(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=r"^cannot write to .*ro.*pass --output"):
            prepare_dataset("sequences", LINES, ro / "out", progress=False)
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("existing", [False, True])
def test_full_disk_leaves_nothing_half_written(tmp_path, monkeypatch, caplog, existing):
    out = tmp_path / "out"
    if existing:
        _prepare(tmp_path)  # a good previous output that must survive
        before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_savez = np.savez

    def full(path, **arrays):
        real_savez(path, **arrays)
        with open(path, "r+b") as fh:  # half of it made it to disk
            fh.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("hstu.data.sequences.np.savez", full)
    with pytest.raises(OSError) as info:
        prepare_dataset("sequences", PAIRS, out, progress=False, force=True)
    err = info.value
    assert err.errno == errno.ENOSPC and "\n" not in str(err)
    assert str(err).startswith(f"no space left on the device of {out} while writing the prepared")
    assert "free space or pass --output on another disk (nothing was changed there)" in str(err)
    leftovers = [p.name for p in tmp_path.rglob("*") if ".writing-" in p.name]
    assert leftovers == []
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert SequenceData.load(out).num_interactions == 6
    else:
        assert not out.exists()
    with caplog.at_level(logging.ERROR, logger="hstu"):
        code = prepare_main(
            ["--dataset", "sequences", "--source", str(PAIRS), "--output", str(out), "--force"]
        )
    assert code == 1  # a runtime failure, not bad input
    assert caplog.records[-1].getMessage() == str(err)


def test_no_stale_files_after_a_rebuild(tmp_path):
    out = _prepare(tmp_path)
    prepare_dataset("sequences", PAIRS, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, DATA_FILE]
    assert SequenceData.load(out).num_interactions == _manifest(out)["num_interactions"]


# ---- through the launcher ---------------------------------------------------------------------------


@pytest.mark.cpu_only
@pytest.mark.parametrize("damage", ["swapped", "empty"])
def test_launcher_refuses_damaged_prepared_data(tmp_path, damage):
    a = _prepare(tmp_path, LINES, "a")
    if damage == "swapped":
        b = _prepare(tmp_path, PAIRS, "b")
        shutil.copy(b / DATA_FILE, a / DATA_FILE)
    else:
        (a / DATA_FILE).write_bytes(b"")
    bindings = [
        'DatasetArgs.dataset_name="seq"',
        f'DatasetArgs.dataset_path="{a}"',
        "DatasetArgs.max_history_seqlen=4",
        "TrainerArgs.train_batch_size=1",
        "TrainerArgs.max_train_iters=1",
        f"TrainerArgs.log_dir='{tmp_path / 'runs'}'",
        "NetworkArgs.hidden_size=8",
        "NetworkArgs.kv_channels=4",
        "RetrievalArgs.num_negatives=2",
    ]
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain_gr_retrieval.py")]
    for b in bindings:
        cmd += ["--gin-bindings", b]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=launcher_env(allow_non_a100=True),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {a / DATA_FILE}: ")
    assert errors[0].endswith(f"re-create it with: {_rerun(a)}")


# ---- the real data in ../shared/data ----------------------------------------------------------------


def test_real_sasrec_ml_1m_proof_and_truncation(tmp_path, shared_data):
    src = shared_data("ml-1m-sasrec", "ml-1m.txt.gz")
    out = _prepare(tmp_path, src, "ml1m")
    data = SequenceData.load(out)
    assert (data.num_users, data.num_interactions) == (6040, 999611)
    assert _manifest(out)["arrays"]["item_ids"]["shape"] == [999611]
    cut = tmp_path / "ml-1m.txt.gz"
    raw = src.read_bytes()
    cut.write_bytes(raw[: len(raw) * 2 // 3])
    with pytest.raises(DataFormatError, match=r"ml-1m\.txt\.gz: the gzip file is truncated"):
        prepare_dataset("sequences", cut, tmp_path / "cut", progress=False)
    assert not (tmp_path / "cut").exists()


def test_a_dataset_without_user_features_saves_and_loads(tmp_path):
    """A [U, 0] feature array (no contextual features) has a checksum (of no bytes) and its
    dataset round-trips."""
    assert array_checksum(np.zeros((3, 0), dtype=np.int64)) == hashlib.sha256(b"").hexdigest()
    data = SequenceData.load(_prepare(tmp_path))
    data.user_features = np.zeros((data.num_users, 0), dtype=np.int64)
    data.user_feature_names = []
    data.save(tmp_path / "nofeatures")
    back = SequenceData.load(tmp_path / "nofeatures")
    assert back.user_features.shape == (data.num_users, 0)
    assert np.array_equal(back.item_ids, data.item_ids)
