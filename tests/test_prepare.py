"""Dataset preparation: official formats from tiny fixtures, ordering, action bitmasks, manifests,
re-run behaviour, errors with line numbers, and the real data in ../shared/data when present."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import runpy
import shutil
import sys
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hstu.data.prepare import main, prepare_dataset
from hstu.data.sequences import DATA_FILE, MANIFEST_FILE, SequenceData
from hstu.data.sources import DATASETS, DataFormatError, DownloadError
from hstu.data.sources.movielens import rating_to_actions

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / "raw" / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _prep(dataset: str, source: Path, tmp_path: Path, **kw):
    out = tmp_path / "out" / dataset
    res = prepare_dataset(dataset, source, out, progress=False, **kw)
    return res, SequenceData.load(res.output_dir)


def _user(d: SequenceData, raw_user: int) -> slice:
    return d.user_slice(int(np.flatnonzero(d.user_ids == raw_user)[0]))


# ---- official formats ----------------------------------------------------------------------------
def test_rating_bitmask_definition():
    # bit k set iff rating >= k+1: whole stars are exact, half stars round down.
    assert rating_to_actions(np.array([1, 2, 3, 4, 5])).tolist() == [1, 3, 7, 15, 31]
    assert rating_to_actions(np.array([0.5, 3.5, 4.5, 5.0])).tolist() == [0, 7, 15, 31]
    # task "rating >= 4" is bit 3
    assert ((rating_to_actions(np.array([3, 4, 5])) >> 3) & 1).tolist() == [0, 1, 1]


def test_ml_1m(tmp_path):
    res, d = _prep("ml-1m", _copy("ml-1m", tmp_path), tmp_path)
    assert d.user_ids.tolist() == [1, 2, 3]
    assert d.offsets.tolist() == [0, 4, 8, 10]
    # user 1: sorted by timestamp; user 2: a timestamp tie (978299000) keeps file order 3068, 1537
    assert d.item_ids.tolist() == [3408, 1193, 914, 661, 1357, 3068, 1537, 647, 2355, 1197]
    assert d.actions.tolist() == [15, 31, 7, 7, 31, 15, 3, 7, 1, 31]
    assert np.all(np.diff(d.timestamps[_user(d, 1)]) >= 0)
    assert d.action_names == [f"rating>={k}" for k in range(1, 6)]
    assert d.user_feature_names == ["user_id", "sex", "age_group", "occupation", "zip_prefix"]
    # user 1 = F, age group "1", occupation 10, zip 48067; user 2 = M, 56+, occupation 16, 70072
    assert d.user_features.tolist() == [[1, 1, 1, 11, 2], [2, 2, 7, 17, 4], [3, 2, 3, 16, 3]]
    stats = res.manifest["stats"]
    assert stats["feature_vocabularies"]["zip_prefix"] == ["024", "480", "551", "700"]
    assert stats["users_in_user_file_without_ratings"] == 1  # user 4
    assert res.manifest["rows_read"] == {"ratings": 10, "users": 4}


def test_ml_100k(tmp_path):
    res, d = _prep("ml-100k", _copy("ml-100k", tmp_path), tmp_path)
    assert d.user_ids.tolist() == [22, 186, 196]
    assert d.offsets.tolist() == [0, 3, 5, 8]
    # user 196: 377 @878887116, then 242 and 86 tied @881250949 in file order
    assert d.item_ids[_user(d, 196)].tolist() == [377, 242, 86]
    assert d.actions[_user(d, 196)].tolist() == [1, 7, 31]
    assert d.item_ids[_user(d, 22)].tolist() == [265, 51, 474]
    # ages bucketed into the ml-1m groups (25 -> "25", 39 -> "35", 49 -> "45");
    # occupations in u.occupation order (executive = 7, writer = 21)
    assert d.user_features.tolist() == [[1, 2, 3, 21, 2], [2, 1, 4, 7, 1], [3, 2, 5, 21, 3]]
    assert [i["role"] for i in res.manifest["inputs"]] == ["ratings", "users", "occupations"]


def test_ml_20m(tmp_path):
    res, d = _prep("ml-20m", _copy("ml-20m", tmp_path), tmp_path)
    assert d.user_ids.tolist() == [1, 2, 3]
    assert d.item_ids[_user(d, 1)].tolist() == [29, 47, 32, 2]
    # user 2: 62 (0.5 stars) and 70 (4.5) tie at 974820598, file order kept; then 3 (4.0)
    assert d.item_ids[_user(d, 2)].tolist() == [62, 70, 3]
    assert d.actions[_user(d, 2)].tolist() == [0, 15, 15]
    assert d.user_feature_names == ["user_id"]
    assert d.user_features[:, 0].tolist() == [1, 2, 3]
    assert res.manifest["num_interactions"] == 8


def test_kuairand_pure(tmp_path):
    res, d = _prep("kuairand-pure", _copy("kuairand-pure", tmp_path), tmp_path)
    assert d.user_ids.tolist() == [0, 5, 9]
    # user 0 over both standard logs by time_ms (the random log is not used; the tie at
    # 1649467982289 keeps file order)
    assert d.item_ids[_user(d, 0)].tolist() == [346081, 4354972, 1329429, 346081]
    # bits: click=1 like=2 follow=4 comment=8 forward=16 hate=32 long_view=64 profile_enter=128
    assert d.actions[_user(d, 0)].tolist() == [1 | 16, 0, 1 | 2 | 64, 1 | 64]
    assert d.actions[_user(d, 5)].tolist() == [32, 1 | 4 | 8 | 64 | 128, 255]
    assert d.action_names == [
        "is_click",
        "is_like",
        "is_follow",
        "is_comment",
        "is_forward",
        "is_hate",
        "long_view",
        "is_profile_enter",
    ]
    assert d.user_feature_names[0] == "user_id" and "user_active_degree" in d.user_feature_names
    feats = dict(zip(d.user_feature_names, d.user_features[_user_row(d, 9)].tolist()))
    assert feats["user_active_degree"] == 0  # empty in the file -> unknown
    assert feats["follow_user_num_range"] == 8  # "500+" is the 8th official value
    feats0 = dict(zip(d.user_feature_names, d.user_features[_user_row(d, 0)].tolist()))
    assert feats0["user_active_degree"] == 2  # high_active
    assert feats0["register_days_range"] == 4  # 91-180
    assert res.manifest["stats"]["users_in_user_file_without_logs"] == 1  # user 7
    roles = [i["role"] for i in res.manifest["inputs"]]
    assert roles == [
        "log_standard_4_08_to_4_21",
        "log_standard_4_22_to_5_08",
        "user_features",
    ]


def _user_row(d: SequenceData, raw_user: int) -> int:
    return int(np.flatnonzero(d.user_ids == raw_user)[0])


def test_kuairand_27k_parts_and_release_layout(tmp_path):
    """27k ships its logs as _part1/_part2; a source may also be the release root (…/data)."""
    src = _copy("kuairand-pure", tmp_path)
    _, ref = _prep("kuairand-pure", src, tmp_path)
    root = tmp_path / "KuaiRand-27K"
    data_dir = root / "data"
    data_dir.mkdir(parents=True)
    for period in ("4_08_to_4_21", "4_22_to_5_08"):
        lines = (src / f"log_standard_{period}_pure.csv").read_text().splitlines(keepends=True)
        half = 1 + (len(lines) - 1) // 2
        (data_dir / f"log_standard_{period}_27k_part1.csv").write_text("".join(lines[:half]))
        (data_dir / f"log_standard_{period}_27k_part2.csv").write_text(
            lines[0] + "".join(lines[half:])
        )
    shutil.copy(src / "user_features_pure.csv", data_dir / "user_features_27k.csv")
    res, d = _prep("kuairand-27k", root, tmp_path)
    assert len(res.manifest["inputs"]) == 5
    for key in ("user_ids", "offsets", "item_ids", "actions", "timestamps", "user_features"):
        assert np.array_equal(getattr(d, key), getattr(ref, key)), key


def test_sequences_pairs_and_lines(tmp_path):
    res_p, p = _prep("sequences", FIXTURES / "sequences" / "pairs.txt", tmp_path / "p")
    res_l, q = _prep("sequences", FIXTURES / "sequences" / "lines.txt", tmp_path / "l")
    assert res_p.manifest["stats"]["format"] == "pairs"
    assert res_l.manifest["stats"]["format"] == "lines"
    for d in (p, q):
        assert d.user_ids.tolist() == [1, 2, 3]
        assert d.offsets.tolist() == [0, 3, 5, 6]
        assert d.item_ids.tolist() == [10, 11, 12, 10, 13, 14]
        assert d.actions.tolist() == [1] * 6
        assert d.action_names == ["interaction"]
        assert d.user_feature_names == ["user_id"]
    # timestamps are file positions: user 1's third item is the 4th pair in the file
    assert p.timestamps.tolist() == [0, 1, 3, 2, 4, 5]
    assert q.timestamps.tolist() == [0, 1, 2, 3, 4, 5]


def test_sequences_forced_format_and_gz(tmp_path):
    gz = tmp_path / "pairs.txt.gz"
    gz.write_bytes(gzip.compress((FIXTURES / "sequences" / "pairs.txt").read_bytes()))
    _, d = _prep("sequences", gz, tmp_path / "a", fmt="lines")  # each line: a user with 1 item
    assert d.item_ids.tolist() == [10, 11, 12, 10, 13, 14]
    with pytest.raises(DataFormatError, match=r"line 1: '1 10 11 12'"):
        _prep("sequences", FIXTURES / "sequences" / "lines.txt", tmp_path / "b", fmt="pairs")


def test_gzip_inputs_match_plain(tmp_path):
    src = _copy("ml-1m", tmp_path)
    _, plain = _prep("ml-1m", src, tmp_path / "plain")
    gz_dir = tmp_path / "gz"
    gz_dir.mkdir()
    for f in src.iterdir():
        (gz_dir / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes()))
    _, packed = _prep("ml-1m", gz_dir, tmp_path / "packed")
    assert np.array_equal(plain.item_ids, packed.item_ids)
    assert np.array_equal(plain.user_features, packed.user_features)


# ---- manifest and re-runs ------------------------------------------------------------------------
def test_manifest_contents(tmp_path):
    src = _copy("ml-1m", tmp_path)
    res, d = _prep("ml-1m", src, tmp_path)
    m = json.loads((res.output_dir / MANIFEST_FILE).read_text())
    assert m["format_version"] == 1 and m["dataset"] == "ml-1m"
    assert (m["num_users"], m["num_items"], m["num_interactions"]) == (3, 10, 10)
    assert m["item_id_range"] == [647, 3408]
    assert m["user_id_range"] == [1, 3]
    assert m["timestamp_range"] == [978298709, 978824291]
    assert m["sequence_length_range"] == [2, 4]
    assert m["rows_dropped_total"] == 0
    assert m["command"].startswith("python -m hstu.data.prepare --dataset ml-1m --source ")
    by_role = {i["role"]: i for i in m["inputs"]}
    for role, name in (("ratings", "ratings.dat"), ("users", "users.dat")):
        raw = (src / name).read_bytes()
        assert by_role[role]["sha256"] == hashlib.sha256(raw).hexdigest()
        assert by_role[role]["bytes"] == len(raw)
    assert by_role["ratings"]["rows"] == 10 and by_role["users"]["rows"] == 4
    assert m["user_feature_cardinalities"] == [4, 3, 8, 18, 5]  # max id + 1


def test_rerun_noop_change_and_force(tmp_path, caplog):
    src = _copy("ml-100k", tmp_path)
    out = tmp_path / "out"
    args = ["--dataset", "ml-100k", "--source", str(src), "--output", str(out)]
    assert main(args) == 0
    mtime = (out / DATA_FILE).stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hstu"):
        assert main(args) == 0
    assert "up to date" in caplog.text
    assert (out / DATA_FILE).stat().st_mtime_ns == mtime

    res = prepare_dataset("ml-100k", src, out, force=True, progress=False)
    assert not res.up_to_date

    with open(src / "u.data", "a") as f:  # inputs changed -> rebuilt with the new row
        f.write("22\t999\t5\t899999999\n")
    res = prepare_dataset("ml-100k", src, out, progress=False)
    assert not res.up_to_date
    assert res.manifest["num_interactions"] == 9
    assert SequenceData.load(out).item_ids[-6:-5].tolist() == [999]  # user 22's last item
    assert prepare_dataset("ml-100k", src, out, progress=False).up_to_date


def test_failed_rebuild_keeps_previous_output(tmp_path):
    src = _copy("ml-1m", tmp_path)
    out = tmp_path / "out"
    prepare_dataset("ml-1m", src, out, progress=False)
    _edit(src / "ratings.dat", 2, "1::661::x::978302109")
    with pytest.raises(DataFormatError, match="line 2"):
        prepare_dataset("ml-1m", src, out, progress=False)
    assert SequenceData.load(out).num_interactions == 10


def test_rerun_with_other_format_rebuilds(tmp_path):
    src = FIXTURES / "sequences" / "pairs.txt"
    out = tmp_path / "o"
    assert not prepare_dataset("sequences", src, out, progress=False).up_to_date
    assert prepare_dataset("sequences", src, out, progress=False).up_to_date
    assert not prepare_dataset("sequences", src, out, fmt="pairs", progress=False).up_to_date


# ---- errors --------------------------------------------------------------------------------------
def _edit(path: Path, line_no: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[line_no - 1] = text
    path.write_text("\n".join(lines) + "\n")


def test_missing_file_names_file_and_place(tmp_path):
    src = _copy("ml-1m", tmp_path)
    (src / "users.dat").unlink()
    with pytest.raises(FileNotFoundError, match=r"users\.dat not found .* in .*ml-1m"):
        _prep("ml-1m", src, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _prep("ml-1m", tmp_path / "nowhere", tmp_path)


def test_wrong_separator(tmp_path):
    src = _copy("ml-1m", tmp_path)
    text = (src / "ratings.dat").read_text().replace("::", ",")
    (src / "ratings.dat").write_text(text)
    with pytest.raises(DataFormatError) as e:
        _prep("ml-1m", src, tmp_path)
    msg = str(e.value)
    assert "ratings.dat: line 1" in msg and "'1,1193,5,978300760'" in msg
    assert "contains commas" in msg and "wrong separator" in msg


def test_wrong_separator_in_header_file(tmp_path):
    src = _copy("ml-20m", tmp_path)
    (src / "ratings.csv").write_text((src / "ratings.csv").read_text().replace(",", "\t"))
    with pytest.raises(DataFormatError, match=r"line 1 \(header\).*contains tabs.*wrong separator"):
        _prep("ml-20m", src, tmp_path)


def test_missing_column(tmp_path):
    src = _copy("ml-20m", tmp_path)
    lines = (src / "ratings.csv").read_text().splitlines()
    (src / "ratings.csv").write_text("\n".join(",".join(x.split(",")[:3]) for x in lines) + "\n")
    with pytest.raises(DataFormatError, match=r"lacks column\(s\) \['timestamp'\]"):
        _prep("ml-20m", src, tmp_path)
    src = _copy("kuairand-pure", tmp_path / "k")
    path = src / "log_standard_4_22_to_5_08_pure.csv"
    path.write_text(path.read_text().replace("is_hate", "is_hated", 1))
    with pytest.raises(
        DataFormatError, match=r"log_standard_4_22_to_5_08_pure\.csv.*\['is_hate'\]"
    ):
        _prep("kuairand-pure", src, tmp_path)


def test_non_integer_id_reports_line(tmp_path):
    src = _copy("ml-1m", tmp_path)
    _edit(src / "ratings.dat", 3, "2::abc::4::978299000")
    with pytest.raises(DataFormatError) as e:
        _prep("ml-1m", src, tmp_path)
    assert "ratings.dat: 1 bad row(s): column 'MovieID' must be an integer" in str(e.value)
    assert "line 3: '2::abc::4::978299000'" in str(e.value)


def test_negative_id_reports_line(tmp_path):
    src = _copy("kuairand-pure", tmp_path)
    path = src / "log_standard_4_08_to_4_21_pure.csv"
    _edit(path, 4, "5,-2528540,20220410,1200,1649563200000,1,0,1,1,0,0,1,5332,11450,3000,0,1,0,0")
    with pytest.raises(DataFormatError) as e:
        _prep("kuairand-pure", src, tmp_path)
    assert "column 'video_id' must be >= 0 (negative ids are not allowed)" in str(e.value)
    assert "line 4: '5,-2528540," in str(e.value)


def test_bad_values_report_lines(tmp_path):
    src = _copy("ml-20m", tmp_path)
    _edit(src / "ratings.csv", 5, "2,3,6.0,974820889")
    _edit(src / "ratings.csv", 7, "1,47,3.25,1112484727")
    with pytest.raises(DataFormatError) as e:
        _prep("ml-20m", src, tmp_path)
    assert "2 bad row(s): column 'rating' must be one of" in str(e.value)
    assert "line 5: '2,3,6.0,974820889'; line 7:" in str(e.value)
    src = _copy("kuairand-pure", tmp_path / "k")
    path = src / "log_standard_4_22_to_5_08_pure.csv"
    _edit(path, 3, "0,346081,20220501,2300,1651446000000,2,0,0,0,0,0,1,30000,11696,0,0,0,0,1")
    with pytest.raises(DataFormatError, match=r"'is_click' must be <= 1\. line 3: '0,346081,"):
        _prep("kuairand-pure", src, tmp_path)


def test_short_long_and_blank_rows(tmp_path):
    src = _copy("ml-100k", tmp_path)
    _edit(src / "u.data", 4, "22\t51\t2")
    with pytest.raises(DataFormatError, match=r"column 'timestamp' must be an integer\. line 4:"):
        _prep("ml-100k", src, tmp_path)
    src = _copy("ml-100k", tmp_path / "b")
    _edit(src / "u.data", 6, "22\t474\t4\t884182806\t7")
    with pytest.raises(DataFormatError, match=r"line 6 has 5 tab-separated fields, expected 4"):
        _prep("ml-100k", src, tmp_path)
    src = _copy("ml-100k", tmp_path / "c")
    _edit(src / "u.data", 2, "")
    with pytest.raises(DataFormatError, match=r"blank line\(s\), first at line\(s\) \[2\]"):
        _prep("ml-100k", src, tmp_path)


def test_empty_files(tmp_path):
    src = _copy("ml-1m", tmp_path)
    (src / "users.dat").write_text("")
    with pytest.raises(DataFormatError, match=r"users\.dat: line 1 is empty"):
        _prep("ml-1m", src, tmp_path)
    src = _copy("ml-20m", tmp_path / "b")
    (src / "ratings.csv").write_text("userId,movieId,rating,timestamp\n")
    with pytest.raises(DataFormatError, match=r"ratings\.csv: no data rows"):
        _prep("ml-20m", src, tmp_path)


def test_sequence_file_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1 10 11\n2 x 13\n3 14\n")
    with pytest.raises(
        DataFormatError, match=r"bad\.txt: 1 bad line\(s\): ids must be integers.*line 2: '2 x 13'"
    ):
        _prep("sequences", bad, tmp_path)
    bad.write_text("1,10\n1,11\n")
    with pytest.raises(DataFormatError, match=r"line 1: '1,10'.*wrong separator"):
        _prep("sequences", bad, tmp_path)
    bad.write_text("1 10\n1 -11\n")
    with pytest.raises(DataFormatError, match=r"negative id\. line 2: '1 -11'"):
        _prep("sequences", bad, tmp_path)
    bad.write_text("1 10 11\n\n2 12\n")
    with pytest.raises(DataFormatError, match=r"blank line.*line 2"):
        _prep("sequences", bad, tmp_path)
    bad.write_text("1 10 11\n2\n")
    with pytest.raises(DataFormatError, match=r"needs at least one item\. line 2: '2'"):
        _prep("sequences", bad, tmp_path)


def test_cli_reports_errors_without_traceback(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="hstu"):
        assert main(["--dataset", "sequences"]) == 2  # usage / data errors exit 2
    assert "pass --source" in caplog.text
    with pytest.raises(SystemExit):  # argparse: unknown dataset name
        main(["--dataset", "ml-2m"])
    with pytest.raises(ValueError, match="--format applies to the sequence-file datasets"):
        prepare_dataset("ml-1m", FIXTURES / "ml-1m", tmp_path, fmt="pairs")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy re-run
def test_command_line_entry_points(tmp_path, monkeypatch, caplog):
    """`python -m hstu.data.prepare` and scripts/prepare_data.py (run in-process as __main__)."""
    out = tmp_path / "o"
    argv = ["prepare_data.py", "--dataset", "sequences", "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["--source", str(FIXTURES / "sequences" / "lines.txt")])
    with caplog.at_level(logging.INFO, logger="hstu"), pytest.raises(SystemExit) as ok:
        runpy.run_path(str(REPO / "scripts" / "prepare_data.py"), run_name="__main__")
    assert ok.value.code == 0
    assert "3 users, 5 items, 6 interactions" in caplog.text
    assert SequenceData.load(out).num_interactions == 6

    caplog.clear()
    monkeypatch.setattr(sys, "argv", ["prepare", "--dataset", "ml-1m", "--source", str(tmp_path)])
    with caplog.at_level(logging.INFO, logger="hstu"), pytest.raises(SystemExit) as bad:
        runpy.run_module("hstu.data.prepare", run_name="__main__")
    assert bad.value.code == 2
    assert "ratings.dat not found" in caplog.text


def test_byte_order_mark_is_tolerated(tmp_path):
    src = _copy("kuairand-pure", tmp_path)
    path = src / "user_features_pure.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    _, d = _prep("kuairand-pure", src, tmp_path)
    assert d.user_features[_user_row(d, 5), 1] == 1  # full_active


def test_download_offline_error(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr("urllib.request.urlopen", offline)
    with pytest.raises(
        DownloadError,
        match=r"could not download https://files\.grouplens\.org/.*ml-1m\.zip.*offline.*--source",
    ):
        prepare_dataset("ml-1m", None, tmp_path / "out", raw_dir=tmp_path / "raw", progress=False)
    assert not list((tmp_path / "raw").glob("*.part"))


def test_cached_archive_is_unpacked_and_used(tmp_path, monkeypatch):
    """Without --source: an archive already in the download cache is unpacked, not re-fetched."""
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: pytest.fail("network used"))
    raw = tmp_path / "raw"
    raw.mkdir()
    with zipfile.ZipFile(raw / "ml-100k.zip", "w") as z:
        for f in (FIXTURES / "ml-100k").iterdir():
            z.write(f, f"ml-100k/{f.name}")
    res = prepare_dataset("ml-100k", None, tmp_path / "out", raw_dir=raw, progress=False)
    assert res.manifest["num_interactions"] == 8
    assert (raw / "ml-100k" / "ml-100k" / "u.data").is_file()
    assert DATASETS["ml-100k"].url == "https://files.grouplens.org/datasets/movielens/ml-100k.zip"


# ---- real data (../shared/data, absent on users' machines: the tests skip) ----------------------


def test_real_ml_1m_sasrec(tmp_path, shared_data):
    res, d = _prep("sequences", shared_data("ml-1m-sasrec", "ml-1m.txt.gz"), tmp_path)
    m = res.manifest
    assert (m["num_users"], m["num_items"], m["num_interactions"]) == (6040, 3416, 999611)
    assert m["stats"]["format"] == "pairs"
    assert m["user_id_range"] == [1, 6040] and m["item_id_range"] == [1, 3416]
    assert d.lengths().min() >= 18


def test_real_ml_100k(tmp_path, shared_data):
    res, d = _prep("ml-100k", shared_data("ml-100k"), tmp_path)
    m = res.manifest
    assert (m["num_users"], m["num_items"], m["num_interactions"]) == (943, 1682, 100000)
    assert m["rows_dropped_total"] == 0 and m["stats"]["users_without_features"] == 0
    assert np.all(d.user_features[:, 1:] > 0)  # every user has sex/age/occupation/zip
    for u in range(d.num_users):
        assert np.all(np.diff(d.timestamps[d.user_slice(u)]) >= 0)


def test_real_amazon_beauty(tmp_path, shared_data):
    res, _ = _prep("amazon-beauty", shared_data("amazon-beauty"), tmp_path)
    m = res.manifest
    assert (m["num_users"], m["num_items"], m["num_interactions"]) == (22363, 12101, 198502)
    assert m["stats"]["format"] == "lines"


# ---- the dataset gin files -----------------------------------------------------------------------
DATASET_CONFIGS = {
    "ml_1m_retrieval.gin": ("retrieval", "ml-1m"),
    "ml_1m_ranking.gin": ("ranking", "ml-1m"),
    "ml_20m_retrieval.gin": ("retrieval", "ml-20m"),
    "ml_20m_ranking.gin": ("ranking", "ml-20m"),
    "ml_100k_ranking.gin": ("ranking", "ml-100k"),
    "ml_100k_retrieval.gin": ("retrieval", "ml-100k"),
    "kuairand_pure_ranking.gin": ("ranking", "kuairand-pure"),
    "kuairand_1k_ranking.gin": ("ranking", "kuairand-1k"),
    "kuairand_27k_ranking.gin": ("ranking", "kuairand-27k"),
    "sequences_retrieval.gin": ("retrieval", "sequences"),
    "amazon_beauty_retrieval.gin": ("retrieval", "amazon-beauty"),
}


@pytest.mark.parametrize("name", sorted(DATASET_CONFIGS))
def test_dataset_configs_load(name):
    from hstu.config.gin_utils import load_config

    task, dataset = DATASET_CONFIGS[name]
    cfg = load_config(task, [REPO / "configs" / name])
    assert cfg.dataset.dataset_name == dataset and dataset in DATASETS
    if task == "ranking":  # one task per action bit the converter writes
        assert cfg.ranking.num_tasks == (8 if dataset.startswith("kuairand") else 5)
    if dataset in ("sequences", "amazon-beauty"):
        assert cfg.dataset.dataset_path == f"data/{dataset}"


def test_ml_1m_retrieval_config_is_the_paper_setup():
    from hstu.config.gin_utils import load_config

    cfg = load_config("retrieval", [REPO / "configs" / "ml_1m_retrieval.gin"])
    n, d, r = cfg.network, cfg.dataset, cfg.retrieval
    assert (n.num_layers, n.num_attention_heads, n.hidden_size, n.kv_channels) == (2, 1, 50, 50)
    assert d.max_history_seqlen == 200 and cfg.trainer.train_batch_size == 128
    assert (r.num_negatives, r.temperature, cfg.optimizer.learning_rate) == (128, 0.05, 1e-3)


def test_prepared_output_loads_through_the_config(tmp_path):
    """What prepare writes is what training loads (DatasetArgs.dataset_path -> SequenceData)."""
    from hstu.config.gin_utils import load_config
    from hstu.data.registry import load_sequence_data

    res, _ = _prep("ml-100k", _copy("ml-100k", tmp_path), tmp_path)
    cfg = load_config(
        "ranking",
        [REPO / "configs" / "ml_100k_ranking.gin"],
        [f'DatasetArgs.dataset_path = "{res.output_dir}"'],
    )
    data = load_sequence_data(cfg.dataset, num_tasks=cfg.ranking.num_tasks)
    assert data.num_interactions == 8 and data.num_tasks == cfg.ranking.num_tasks
