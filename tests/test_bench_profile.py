"""scripts/bench_e2e.py --profile on CPU: the profiled steps run, the trace is written, the
summary row is printed (kernel figures are 0 without a GPU)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_bench(prof_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """bench_e2e.py on CPU: tiny synthetic config, reference attention, --profile prof_dir."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_e2e.py"),
            "--device",
            "cpu",
            "--config",
            "configs/synthetic_ranking.gin",
            "--paths",
            "reference",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--mean-seq-len",
            "20",
            "--max-seq-len",
            "40",
            "--num-users",
            "200",
            "--profile",
            str(prof_dir),
            *extra,
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.cpu_only
def test_bench_e2e_profile_writes_trace_and_summary(tmp_path):
    prof_dir = tmp_path / "prof"
    proc = _run_bench(prof_dir, "--profile-steps", "2", "--profile-stack")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    prof = rows[-1]["profile"]
    assert prof["steps"] == 2 and prof["step_ms_profiled"] > 0
    assert prof["kernel_ms_per_step"] == 0.0 and prof["top_kernels_ms_per_step"] == []
    trace = json.loads(gzip.open(prof["trace"]).read())
    events = trace["traceEvents"]
    names = {e.get("name") for e in events}
    assert any(str(n).startswith("aten::") for n in names)  # CPU ops were recorded
    # --profile-stack: Python frames of the step are in the trace
    assert any(
        e.get("cat") == "python_function" and "trainer.py" in str(e.get("name")) for e in events
    )
    # the host's issue time per step into an empty queue, and its share of the step
    row = rows[-1]
    assert row["issue_probes"] == 15 and row["host_issue_alone_ms"] > 0
    low, high = row["host_issue_alone_range_ms"]
    assert 0 < low <= row["host_issue_alone_ms"] <= high
    assert row["host_issue_share"] == pytest.approx(row["host_issue_alone_ms"] / row["step_ms"])
    # host summary: top-level operators per step, their time, the largest first
    assert prof["host_ops_per_step"] > 10 and prof["host_op_ms_per_step"] > 0
    top = prof["top_host_ops_ms_per_step"]
    assert 0 < len(top) <= 15 and all(len(t) == 3 for t in top)
    assert [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
    assert sum(t[1] for t in top) <= prof["host_op_ms_per_step"] + 1e-9
    # the step's phases by the trainer's labels, one call each per step
    phases = {name: (ms, calls) for name, ms, calls in prof["host_phases_ms_per_step"]}
    for name in ("hstu/forward", "hstu/backward", "hstu/optimizer"):
        assert phases[name][0] > 0 and phases[name][1] == 1, (name, phases)


def test_host_ops_counts_top_level_operators_per_thread(load_script):
    _host_ops = load_script("bench_e2e")._host_ops

    def op(name, ts, dur, tid=1):
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        op("aten::linear", 0, 10),
        op("aten::addmm", 1, 8),  # nested in linear
        op("aten::add", 12, 2),
        op("aten::linear", 20, 6),
        op("aten::mul", 0, 5, tid=2),  # another thread: top level there
        {"cat": "kernel", "name": "k", "ts": 0, "dur": 100},
    ]
    host = _host_ops(events)
    assert host["count"] == 4 and host["total_us"] == 23
    assert host["top"][0] == ("aten::linear", (16, 2))


def test_host_phases_sum_the_codes_labels(load_script):
    _host_phases = load_script("bench_e2e")._host_phases

    def label(name, ts, dur):
        return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1}

    events = [
        label("bench_step_0", 0, 100),  # the benchmark's own step mark: not a phase
        label("hstu/step_graphs/table_lookup", 0, 30),
        label("hstu/step_graphs/replay", 30, 10),
        label("hstu/step_graphs/table_lookup", 100, 50),
        {"cat": "cpu_op", "name": "hstu/not_a_label", "ts": 0, "dur": 5},
        label("nccl:all_to_all", 5, 3),
    ]
    assert _host_phases(events) == [
        ("hstu/step_graphs/table_lookup", (80, 2)),
        ("hstu/step_graphs/replay", (10, 1)),
    ]


def test_host_waits_charges_blocking_calls_to_the_innermost_operator(load_script):
    _host_waits = load_script("bench_e2e")._host_waits

    def op(name, ts, dur, tid=1):
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    def rt(name, ts, dur, tid=1):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        op("aten::unique", 0, 100),
        op("aten::_local_scalar_dense", 10, 80),  # nested: the innermost owner
        rt("cudaStreamSynchronize", 20, 60),
        rt("cudaMemcpyAsync", 85, 3),  # a short copy: not a wait
        op("aten::item", 200, 50),
        rt("cudaMemcpyAsync", 210, 30),  # a copy that waited
        rt("cudaDeviceSynchronize", 300, 5),  # outside every operator
        rt("cudaStreamSynchronize", 20, 7, tid=2),  # another thread, no operator there
        rt("cudaLaunchKernel", 30, 40),  # not blocking
    ]
    waits = _host_waits(events)
    assert waits["count"] == 4 and waits["total_us"] == 60 + 30 + 5 + 7
    top = dict((k, v) for k, v in waits["top"])
    assert top == {
        "aten::_local_scalar_dense <- cudaStreamSynchronize": (60, 1),
        "aten::item <- cudaMemcpyAsync": (30, 1),
        "(none) <- cudaStreamSynchronize": (7, 1),
        "(none) <- cudaDeviceSynchronize": (5, 1),
    }
    assert waits["top"][0][0] == "aten::_local_scalar_dense <- cudaStreamSynchronize"


def test_steady_steps_charge_gpu_work_to_the_issuing_step(load_script):
    bench = load_script("bench_e2e")
    mark = bench.STEP_MARK

    def step(i, ts, dur):
        return {"cat": "user_annotation", "name": f"{mark}{i}", "ts": ts, "dur": dur, "tid": 1}

    def launch(corr, ts, cat="cuda_runtime", tid=1):
        return {"cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}  # fmt: skip

    def gpu(cat, corr, ts, dur):
        return {"cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        step(0, 0, 10), launch(1, 2), launch(2, 5),
        step(1, 10, 10), launch(3, 12), launch(7, 15, "cuda_driver", tid=2),  # cuBLAS, autograd
        step(2, 20, 10), launch(4, 22),
        step(3, 30, 10), launch(5, 32),
        launch(6, 50),  # outside every step: not charged
        gpu("kernel", 1, 100, 300), gpu("gpu_memcpy", 2, 400, 100),  # step 0: 500 us from 100
        gpu("kernel", 3, 1100, 700), gpu("kernel", 7, 1800, 100),  # step 1 from 1100: 1000 us
        gpu("kernel", 4, 2000, 900), gpu("gpu_memset", 4, 2950, 10),  # step 2 (captured)
        gpu("kernel", 5, 3000, 100), gpu("kernel", 6, 1000, 5000),
    ]  # fmt: skip
    # step 2 captured: only the pair (0, 1) is steady
    got = bench._steady_steps(events, [True, True, False, True])
    assert got["steady_steps"] == 1
    assert got["steady_gpu_step_ms"] == pytest.approx(1.0)
    assert got["steady_kernel_ms"] == pytest.approx(0.3)
    assert got["steady_copy_ms"] == pytest.approx(0.1)
    assert got["steady_gpu_idle_ms"] == pytest.approx(0.6)
    both = bench._steady_steps(events, [True] * 4)  # periods 1000, 900, 1000 us
    assert both["steady_steps"] == 3
    assert both["steady_gpu_step_ms"] == pytest.approx((1.0 + 0.9 + 1.0) / 3)
    # step 1's second kernel came from a driver-API launch on another thread
    assert both["steady_kernel_ms"] == pytest.approx((0.3 + 0.8 + 0.9) / 3)
    assert bench._steady_steps(events, [False] * 4) == {"steady_steps": 0}
    # with the steps' FLOPs: 2e9 per step over a 1 ms period and 0.3 ms of kernels, two ranks
    rated = bench._steady_steps(events, [True, True, False, True], [4e9] * 4, world=2)
    assert rated["steady_tflops_per_gpu"] == pytest.approx(2.0)
    assert rated["steady_kernel_tflops_per_gpu"] == pytest.approx(2e9 / 0.3e-3 / 1e12)


class _FakeGraphs:
    """GraphStats as the warm-up and the probes read it; the steps it is handed say which steps
    replay ("r"), capture ("c") or run eagerly ("e")."""

    def __init__(self, steps: str):
        self.replays = self.eager = self.captures = 0
        self.disabled = ""
        self.steps = iter(steps)

    def step(self):
        kind = next(self.steps)
        if kind == "r":
            self.replays += 1
        elif kind == "c":
            self.captures += 1
            self.replays += 1  # a capture's step replays the graph it captured
        else:
            self.eager += 1


class _FakeTrainer:
    def __init__(self, graphs, world_size: int = 1):
        self.graphs, self.device = graphs, type("D", (), {"type": "cpu"})()
        self.info = type("Info", (), {"world_size": world_size})()
        self.steps = 0

    def train_step(self):
        self.steps += 1
        self.graphs.step()

    def _train_step_async(self):
        self.train_step()
        return None

    def _resolve(self, pending):
        return []


def test_graph_warmup_runs_until_steps_in_a_row_replayed(load_script, monkeypatch):
    bench = load_script("bench_e2e")
    monkeypatch.setattr(bench, "GRAPH_SETTLE_STEPS", 3)
    graphs = _FakeGraphs("ercrrerrrrrrr")
    trainer = _FakeTrainer(graphs)
    assert bench._warm_graphs(trainer, graphs, cap=100) == 9  # "ercrre" then "rrr"
    graphs = _FakeGraphs("e" * 20)
    assert bench._warm_graphs(_FakeTrainer(graphs), graphs, cap=5) == 5  # the cap
    assert bench._warm_graphs(_FakeTrainer(graphs), None, cap=5) == 0  # graphs off


def test_graph_warmup_on_several_ranks_lasts_until_every_rank_settled(load_script, monkeypatch):
    """With several ranks the warm-up goes on until every rank had its steps in a row (DDP's
    collectives need the same step count on all ranks): the other rank here settles 4 steps later
    than this one; a rank whose graphs are off or settled still steps along."""
    from hstu.training import distributed

    bench = load_script("bench_e2e")
    monkeypatch.setattr(bench, "GRAPH_SETTLE_STEPS", 3)
    other = iter([1.0] * 7 + [0.0] * 10)  # the other rank: not settled for its first 7 checks
    calls = []

    def all_reduce_sum(values, device):
        calls.append(values)
        return [values[0] + next(other)]

    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    graphs = _FakeGraphs("crrr" + "r" * 10)
    trainer = _FakeTrainer(graphs, world_size=2)
    assert bench._warm_graphs(trainer, graphs, cap=100) == 7 and trainer.steps == 7
    assert len(calls) == 8  # one agreement per step, and the last that ends the warm-up
    other = iter([1.0] * 3 + [0.0])
    trainer = _FakeTrainer(_FakeGraphs("e" * 5), world_size=2)
    assert bench._warm_graphs(trainer, None, cap=100) == 3  # graphs off here, not there
    other = iter([1.0] * 10)
    trainer = _FakeTrainer(_FakeGraphs("r" * 10), world_size=2)
    assert bench._warm_graphs(trainer, trainer.graphs, cap=5) == 5  # the cap ends it everywhere


def test_issue_probes_keep_only_replayed_steps_with_graphs(load_script):
    bench = load_script("bench_e2e")
    graphs = _FakeGraphs("rere")
    row = bench._issue_alone(_FakeTrainer(graphs), 4, graphs)
    assert row["issue_probes"] == 2 and row["host_issue_alone_ms"] >= 0
    graphs = _FakeGraphs("ee")
    assert bench._issue_alone(_FakeTrainer(graphs), 2, graphs) == {"host_issue_alone_ms": None}
    assert bench._issue_alone(_FakeTrainer(_FakeGraphs("")), 0, None) == {}


def test_profile_taken_again_while_profiled_steps_captured(load_script, monkeypatch):
    """With graphs, a profile whose steps captured a graph is taken again (the summary is a
    steady step's), at most PROFILE_RETRIES times more; the row says how many it took."""
    bench = load_script("bench_e2e")
    captures = iter([2, 1, 0, 5])
    calls = []

    def once(trainer, args, path):
        calls.append(path)
        return {"steps": 5, "graph_captures_profiled": next(captures)}

    monkeypatch.setattr(bench, "_profile_once", once)
    summary = bench._profile(None, None, "compiled")
    assert summary == {"steps": 5, "graph_captures_profiled": 0, "profile_attempts": 3}
    assert calls == ["compiled"] * 3
    # never settles: the last attempt's summary, captures and all
    monkeypatch.setattr(bench, "PROFILE_RETRIES", 1)
    monkeypatch.setattr(bench, "_profile_once", lambda t, a, p: {"graph_captures_profiled": 1})
    assert bench._profile(None, None, "x") == {"graph_captures_profiled": 1, "profile_attempts": 2}
    # no graphs: one profile
    monkeypatch.setattr(bench, "_profile_once", lambda t, a, p: {"steps": 2})
    assert bench._profile(None, None, "x") == {"steps": 2, "profile_attempts": 1}


def test_bench_e2e_profile_gpu_only_needs_cuda():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--device", "cpu",
         "--profile", "x", "--profile-gpu-only"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--profile-gpu-only traces GPU work only" in proc.stderr


def test_bench_e2e_find_syncs_needs_cuda():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--device", "cpu",
         "--find-syncs", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--find-syncs needs a CUDA device" in proc.stderr


def test_bench_small_profile_stack_needs_profile():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_small.py"), "--profile-stack"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--profile-stack needs --profile" in proc.stderr


def test_bench_e2e_profile_stack_needs_profile():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--profile-stack"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--profile-stack needs --profile" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--profile-steps", "0", "--profile-steps must be >= 1"),
        ("--issue-probes", "-1", "--issue-probes must be >= 0"),
        ("--graph-warmup", "-2", "--graph-warmup must be >= 0"),
        ("--find-syncs", "-1", "--find-syncs must be >= 0"),
        ("--launch-timeout", "-5", "--launch-timeout must be >= 0"),
    ],
)
def test_bench_e2e_rejects_bad_step_counts(flag, value, message):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), flag, value],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr


def test_bench_e2e_profile_two_processes_trace_every_rank(tmp_path):
    """--nproc 2 --profile: both ranks run the profiled steps (they hold collectives, so a rank-0
    only profile would hang) and each writes its own trace."""
    prof_dir = tmp_path / "prof"
    proc = _run_bench(prof_dir, "--profile-steps", "1", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    run = [r for r in rows if r.get("world_size") == 2]
    assert run and run[0]["profile"]["steps"] == 1
    assert (prof_dir / "reference_w2_trace.json.gz").exists()
    assert (prof_dir / "reference_w2_rank1_trace.json.gz").exists()


def test_bench_e2e_memory_history_needs_cuda():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--device", "cpu",
         "--memory-history"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--memory-history records the CUDA allocator" in proc.stderr


def test_peak_breakdown_takes_the_tensors_alive_at_the_allocated_peak(load_script):
    """--memory-history: the allocation history is replayed to its allocated peak; the tensors
    alive there are summed by the innermost hstu/ or scripts/ frame that allocated them, and
    blocks alive from before the history count in the peak."""
    peak_breakdown = load_script("bench_e2e").peak_breakdown
    gib = 2**30

    def frames(*sites):
        return [{"filename": f, "line": n, "name": fn} for f, n, fn in sites]

    layer = frames(("/t/torch/_ops.py", 1, "__call__"), ("/r/hstu/modules/layer.py", 7, "fwd"))
    table = frames(("/r/hstu/embeddings/table.py", 3, "empty"))
    head = frames(("/r/scripts/bench_e2e.py", 9, "step"))
    trace = [
        {"action": "segment_alloc", "addr": 100, "size": 4 * gib, "frames": table},
        {"action": "alloc", "addr": 1, "size": 3 * gib, "frames": table},
        {"action": "segment_alloc", "addr": 200, "size": 3 * gib, "frames": layer},
        {"action": "alloc", "addr": 2, "size": 2 * gib, "frames": layer},
        {"action": "alloc", "addr": 3, "size": 1 * gib, "frames": layer},  # the peak: 6 GB
        {"action": "free_requested", "addr": 2, "size": 2 * gib},
        {"action": "free_requested", "addr": 3, "size": 1 * gib},
        {"action": "segment_alloc", "addr": 300, "size": 2 * gib, "frames": head},  # held: 9 GB
        {"action": "alloc", "addr": 4, "size": 2 * gib, "frames": head},  # 5 GB: below the peak
        {"action": "free_completed", "addr": 2, "size": 2 * gib},
        {"action": "segment_free", "addr": 200, "size": 3 * gib},  # held: 6 GB
    ]
    segments = [
        {"device": 0, "blocks": [
            {"address": 1, "size": 3 * gib, "state": "active_allocated"},
            {"address": 9, "size": gib // 2, "state": "active_allocated"},  # before the history
            {"address": 4, "size": 2 * gib, "state": "active_allocated"},
            {"address": 5, "size": gib, "state": "inactive"},
        ]},
    ]  # fmt: skip
    out = peak_breakdown({"device_traces": [trace], "segments": segments})
    assert out["peak_gb"] == 6.5 and out["before_history_gb"] == 0.5
    assert out["by_site_gb"] == {"table.py:3:empty": 3.0, "layer.py:7:fwd": 3.0}
    assert out["peak_site"] == ["_ops.py:1:__call__", "layer.py:7:fwd"]
    # the held segments at their peak (9 GB), by the site that made each
    assert out["reserved_seen_peak_gb"] == 9.0
    assert out["reserved_by_site_gb"] == {
        "table.py:3:empty": 4.0,
        "layer.py:7:fwd": 3.0,
        "bench_e2e.py:9:step": 2.0,
    }
    assert out["reserved_peak_site"] == ["bench_e2e.py:9:step"]
    empty = peak_breakdown({"device_traces": [[]], "segments": []})
    assert empty == {
        "reserved_seen_peak_gb": 0.0,
        "reserved_by_site_gb": {},
        "reserved_peak_site": [],
        "peak_gb": 0.0,
        "before_history_gb": 0.0,
        "by_site_gb": {},
        "peak_site": [],
    }


def test_sync_site_names_the_innermost_hstu_frame(load_script):
    """--find-syncs reports each synchronising call by the innermost frame inside the hstu
    package, whatever library frames (torch, the standard library) sit below it."""
    import traceback

    _sync_site = load_script("bench_e2e")._sync_site
    FS = traceback.FrameSummary
    stack = [
        FS("/x/scripts/bench_e2e.py", 10, "main"),
        FS("/repo/hstu/training/trainer.py", 457, "_train_step_async"),
        FS("/repo/hstu/modules/preprocessor.py", 120, "forward"),
        FS("/venv/site-packages/torch/_tensor.py", 50, "item"),
    ]
    site = _sync_site(stack, "called a synchronizing CUDA operation\nmore text")
    assert (
        site == "hstu/modules/preprocessor.py:120 forward | called a synchronizing CUDA operation"
    )
    assert _sync_site(stack[:1], "x").startswith("(outside hstu) | x")
    assert _sync_site([], "").endswith("| ?")


def test_idle_gaps_charge_each_gap_to_the_operator_that_issued_the_next_work(load_script):
    _idle_gaps = load_script("bench_e2e")._idle_gaps

    def op(name, ts, dur, tid=1):
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    def launch(corr, ts, tid=1, cat="cuda_runtime"):
        return {"cat": cat, "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 0,
                "tid": tid, "args": {"correlation": corr}}  # fmt: skip

    def gpu(corr, ts, dur, cat="kernel"):
        return {"cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        op("aten::linear", 0, 50),
        op("aten::mm", 5, 40),  # nested: the innermost
        launch(1, 10),
        op("Optimizer.step", 100, 30, tid=2),  # another thread issues the second kernel
        launch(2, 110, tid=2, cat="cuda_driver"),
        launch(3, 200),  # outside every operator
        gpu(1, 20, 30),  # 20..50
        gpu(2, 60, 10),  # gap 10, charged to the optimizer
        gpu(3, 71, 5, cat="gpu_memset"),  # gap 1 < 2 us: the launch pipeline's own
        gpu(9, 76, 4),  # no launch event known
        gpu(4, 100, 50),  # gap 20, launch 4 unknown too
        gpu(5, 120, 10),  # inside the previous kernel's span (another stream): no gap
    ]
    gaps = _idle_gaps(events)
    assert gaps["count"] == 2 and gaps["total_us"] == 30
    assert dict(gaps["top"]) == {"(unknown launch)": (20, 1), "Optimizer.step": (10, 1)}
    # kernel 2 was launched at 110, after the GPU went idle at 50: the host was late
    assert gaps["host_late_us"] == 10 and gaps["launched_before_us"] == 0
    events.append(gpu(6, 160, 5))  # gap 10 after 150, issued from outside every operator
    events.append(launch(6, 140))
    events.append(gpu(7, 170, 1))  # gap 5, issued inside aten::linear > aten::mm
    events.append(launch(7, 30))
    gaps = _idle_gaps(events)
    top = dict(gaps["top"])
    assert top["(no operator)"] == (10, 1)
    assert top["aten::linear > aten::mm"] == (5, 1)
    # kernels 6 and 7 were launched (140, 30) before their gaps began (150, 165): the GPU waited
    # on something other than the host
    assert gaps["host_late_us"] == 10 and gaps["launched_before_us"] == 15


def test_idle_gaps_without_cpu_operators_name_the_gpu_work_around_each_gap(load_script):
    """--profile-gpu-only traces hold no CPU operators: a gap is named "previous -> next" by the
    GPU work that finished last before it and the work that ends it."""
    _idle_gaps = load_script("bench_e2e")._idle_gaps

    def gpu(name, ts, dur, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": ts}}

    events = [
        gpu("gemm", 0, 100),
        gpu("short_other_stream", 10, 5),  # ends before gemm: gemm is still the last one
        gpu("embedding_fwd", 110, 20),  # gap 10 after gemm
        gpu("ln", 131, 10),  # gap 1: the launch pipeline's own
        gpu("Memcpy HtoD", 150, 5, cat="gpu_memcpy"),  # gap 9 after ln
        gpu("embedding_fwd", 175, 5),  # gap 20 after the copy
    ]
    gaps = _idle_gaps(events)
    assert gaps["count"] == 3 and gaps["total_us"] == 39
    assert dict(gaps["top"]) == {
        "Memcpy HtoD -> embedding_fwd": (20, 1),
        "gemm -> embedding_fwd": (10, 1),
        "ln -> Memcpy HtoD": (9, 1),
    }


def test_host_waits_name_the_copy_kind_and_the_hstu_frame(load_script):
    """With Python stacks in the trace (--profile-stack), a blocking copy is charged to the
    innermost frame of the hstu package around it, and its GPU side names the copy's kind."""
    _host_waits = load_script("bench_e2e")._host_waits
    events = [
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 10, "dur": 50, "pid": 0, "tid": 1},
        {"cat": "python_function", "name": "hstu/data/batch.py(86): to", "ts": 0, "dur": 100,
         "pid": 0, "tid": 1},
        {"cat": "python_function", "name": "/x/site-packages/torchrec/jagged.py(9): to",
         "ts": 5, "dur": 80, "pid": 0, "tid": 1},
        {"cat": "python_function", "name": "/repo/hstu/x.py(1): f", "ts": 0, "dur": 5,
         "pid": 0, "tid": 1},  # ends before the copy
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 20, "dur": 30, "pid": 0,
         "tid": 1, "args": {"correlation": 7}},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 40, "dur": 2,
         "args": {"correlation": 7}},
    ]  # fmt: skip
    top = dict(_host_waits(events)["top"])
    assert top == {
        "aten::copy_ <- cudaMemcpyAsync [Memcpy HtoD (Pageable -> Device)]"
        " @ hstu/data/batch.py(86): to": (30, 1)
    }
    bench = load_script("bench_e2e")
    assert bench._is_hstu_frame("/repo/hstu/modules/a.py(3): g")
    assert not bench._is_hstu_frame("/venv/site-packages/torch/nn/a.py(3): hstu")


def test_host_sites_group_top_level_operators_by_the_innermost_hstu_frame(load_script):
    _host_sites = load_script("bench_e2e")._host_sites

    def ev(cat, name, ts, dur, tid=1):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        ev("python_function", "hstu/models/loss.py(10): forward", 0, 100),
        ev("python_function", "hstu/models/loss.py(20): norm", 10, 20),
        ev("python_function", "/venv/torch/functional.py(5): norm", 12, 15),  # not hstu
        ev("cpu_op", "aten::linalg_vector_norm", 14, 10),  # inside norm
        ev("cpu_op", "aten::div", 40, 5),  # inside forward only
        ev("cpu_op", "aten::mul", 41, 2),  # nested in aten::div: not top level
        ev("cpu_op", "aten::add", 200, 4),  # outside every hstu frame
    ]
    top = dict(_host_sites(events)["top"])
    assert top == {
        "hstu/models/loss.py(20): norm": (10, 1),
        "hstu/models/loss.py(10): forward": (5, 1),
        "(outside hstu)": (4, 1),
    }
    assert _host_sites([ev("cpu_op", "aten::add", 0, 1)])["top"] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile-gpu-only"], "--profile-gpu-only needs --profile DIR"),
        (["--profile", "x", "--profile-gpu-only", "--profile-stack"], "no Python stacks"),
        (["--host-profile", "-1"], "--host-profile must be >= 0"),
    ],
)
def test_bench_e2e_profile_option_errors(argv, message):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr


@pytest.mark.cpu_only
def test_bench_e2e_host_profile_lists_the_step_functions(tmp_path):
    """--host-profile on CPU: cProfile over synchronised steps, the backward on the calling
    thread, so the fused layer's Python backward is in the table as well as its forward."""
    prof_dir = tmp_path / "prof"
    proc = _run_bench(prof_dir, "--host-profile", "2", "--issue-probes", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    hp = row["host_profile"]
    assert hp["steps"] == 2 and hp["ms_per_step"] > 0
    for key in ("top_own", "top_cumulative"):
        assert 0 < len(hp[key]) <= 25 and all(len(r) == 4 for r in hp[key])
    cum = [r[2] for r in hp["top_cumulative"]]
    assert cum == sorted(cum, reverse=True) and cum[0] <= hp["ms_per_step"] * 1.01
    names = " ".join(r[0] for r in hp["top_cumulative"])
    assert "_train_step_async" in names
    text = (prof_dir / "reference_host_profile.txt").read_text()
    assert "hstu/training/trainer.py" in text and "(backward)" in text


def test_bench_e2e_repeat_batch_times_one_batch(tmp_path):
    """--repeat-batch on CPU: the run completes with the profile, the row says so, and the
    warm-up count includes the untimed steps on the repeated batch."""
    proc = _run_bench(tmp_path / "prof", "--repeat-batch", "--steps", "3", "--issue-probes", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    assert row["repeat_batch"] is True and row["warmup_steps"] == 1 + 3
    assert row["profile"]["steps"] == 5 and row["tokens_per_step"] > 0


def test_one_batch_hands_out_the_pipelines_next_batch_at_every_step(load_script):
    one_batch = load_script("bench_e2e")._OneBatch

    class _Pipeline:
        def __init__(self):
            self.handed, self.closed = 0, False

        def __next__(self):
            self.handed += 1
            return (f"batch{self.handed}", None)

        def close(self):
            self.closed = True

        def state_dict(self):
            return {"position": self.handed}

    src = _Pipeline()
    rep = one_batch(src)
    assert [next(rep) for _ in range(4)] == [("batch1", None)] * 4 and src.handed == 1
    assert rep.state_dict() == {"position": 1}
    rep.close()
    assert src.closed


def test_bench_e2e_repeat_batch_is_one_process_only():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--repeat-batch",
         "--nproc", "2", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--repeat-batch runs on one process" in proc.stderr
