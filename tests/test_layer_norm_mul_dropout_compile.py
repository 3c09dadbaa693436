"""CPU checks of kernels/layer_norm_mul_dropout: the CUDA sources compile for sm_80 (nvcc -c, no
link, no GPU), include no torch headers, and the Philox dropout mask code, built for the host
from the very header the kernels use, matches the published Philox4x32-10 known-answer vector
and the NumPy twin that the PyTorch reference uses."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hstu.modules import layer_norm_mul_dropout as lnmd

ROOT = Path(__file__).resolve().parents[1]
KDIR = ROOT / "kernels" / "layer_norm_mul_dropout"
CUDA_SOURCES = [
    "instantiations/bf16.cu",
    "instantiations/fp16.cu",
    "launch.cu",
    "silu.cu",
    "cast.cu",
    "colsum.cu",
    "tokens.cu",
]


def test_sources_present_and_torch_free():
    assert (KDIR / "api.cpp").is_file()
    kernel_files = list(KDIR.glob("*.h")) + list(KDIR.glob("*.cu")) + list(KDIR.glob("*/*.cu"))
    assert len(kernel_files) >= 8
    for path in kernel_files:
        text = path.read_text()
        for banned in ("#include <torch", "#include <ATen", "#include <c10"):
            assert banned not in text, f"{path.name} includes {banned[10:]}: keep it in api.cpp"
    api = (KDIR / "api.cpp").read_text()
    for needed in ("TORCH_LIBRARY(hstu_lnmd", "TORCH_LIBRARY_IMPL(hstu_lnmd, CUDA", "Meta"):
        assert needed in api
    # the chunk-major SiLU and cast ops: schema, CUDA and Meta implementations
    for op in ("silu_chunk_major", "silu_chunk_major_backward", "cast_colsum", "residual_gemm"):
        assert f'm.def("{op}(' in api
        assert api.count(f'm.impl("{op}", ') == 2, op


def test_setup_builds_every_kernel_source():
    """setup.py globs the family's top-level .cu/.cpp files and instantiations/: the SiLU, cast
    and partial-sum kernels (silu.cu, cast.cu, colsum.cu) are part of the extension with no
    source list to update."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hstu_setup_sources", ROOT / "setup.py")
    text = (ROOT / "setup.py").read_text()
    assert 'glob.glob(os.path.join(base, "*.cu"))' in text
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        env = os.environ.copy()
        os.environ["HSTU_SKIP_KERNELS"] = "1"  # importing setup.py must not start a build
        module = importlib.util.module_from_spec(spec)
        import setuptools

        real_setup = setuptools.setup
        setuptools.setup = lambda **kw: None
        try:
            spec.loader.exec_module(module)
        finally:
            setuptools.setup = real_setup
        srcs = module._sources("layer_norm_mul_dropout")
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
    names = sorted(os.path.relpath(s, "kernels/layer_norm_mul_dropout") for s in srcs)
    # the torch glue: api.cpp and residual_gemm.cpp (cuBLASLt with torch's handle), then kernels
    assert names == sorted(["api.cpp", "residual_gemm.cpp", "tokens_api.cpp", *CUDA_SOURCES]), names


@pytest.mark.parametrize("name", CUDA_SOURCES)
def test_compiles_for_sm80(name: str, tmp_path: Path, nvcc: str):
    out = tmp_path / "out.o"
    cmd = [
        nvcc, "-c", "-O3", "-std=c++17", "--use_fast_math", "--expt-relaxed-constexpr",
        "-gencode", "arch=compute_80,code=sm_80", "-Xptxas", "-v", "-I", str(KDIR),
        str(KDIR / name), "-o", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed for {name}:\n{proc.stderr[-6000:]}"
    assert out.stat().st_size > 0
    if name in ("silu.cu", "cast.cu", "colsum.cu", "tokens.cu"):
        # no spills (silu: fwd + bwd with a 16-bit or an fp32 dq per dtype; cast: per dtype;
        # colsum: the one partial-row sum kernel; tokens: the token assembly's fwd and bwd)
        spills = [ln for ln in proc.stderr.splitlines() if "spill stores" in ln]
        want = {"silu.cu": 6, "cast.cu": 2, "colsum.cu": 1, "tokens.cu": 2}[name]
        assert len(spills) == want, spills
        assert all(" 0 bytes spill stores" in ln for ln in spills), spills
    if name.startswith("instantiations/"):
        # 24 kernels per dtype: forward and backward of the gating step and of the input
        # LayerNorm for 6 row layouts each; only the two widest backwards (cols > 4096, 8 chunks
        # per thread) may spill registers
        spills = [ln for ln in proc.stderr.splitlines() if "spill stores" in ln]
        assert len(spills) == 24
        assert sum(" 0 bytes spill stores" not in ln for ln in spills) <= 2, proc.stderr


def _host_compiler() -> str | None:
    for c in (shutil.which("g++"), shutil.which("c++"), shutil.which("clang++")):
        if c:
            return c
    return None


def test_philox_host_build_matches_known_answer_and_numpy_twin(tmp_path: Path):
    cxx = _host_compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / "philox_check"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O2", str(KDIR / "tools" / "philox_check.cpp"), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    for seed, offset, p in ((0, 0, 0.1), (2**62 + 987654321, 2**33 + 4, 0.5), (123456789, 8, 0.03)):
        thr, _ = lnmd.dropout_threshold(p)
        rows, cols = 5, 64
        run = subprocess.run(
            [str(exe), str(seed), str(offset), str(thr), str(rows * cols // 8)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        lines = run.stdout.split("\n")
        # Random123's kat_vectors for philox4x32 10: counter 0 / key 0, counter and key all ones
        assert lines[0] == "6627e8d5 e169c58d bc57ac4c 9b00dbd8"
        assert lines[1] == "408f276d 41c83b0e a20bc7c6 6d5451fd"
        host_bits = torch.tensor([int(v) for v in lines[2:] if v])
        mask = lnmd.keep_mask(seed, offset, rows, cols, p).reshape(-1, 8).long()
        twin_bits = (mask << torch.arange(8)).sum(1)
        assert torch.equal(host_bits, twin_bits), (seed, offset, p)
