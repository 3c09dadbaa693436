"""CI: the dynamic embedding kernel sources compile with nvcc for sm_80 (no link, no GPU)."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "kernels", "dynamic_embedding")
SOURCES = sorted(
    glob.glob(os.path.join(KDIR, "*.cu")) + glob.glob(os.path.join(KDIR, "instantiations", "*.cu"))
)


@pytest.mark.parametrize("src", SOURCES, ids=[os.path.basename(s) for s in SOURCES])
def test_kernel_source_compiles_for_sm80(src, tmp_path, nvcc):
    cmd = [
        nvcc, "-c", "-std=c++17", "-O3", "--use_fast_math",
        "-gencode", "arch=compute_80,code=sm_80", "-I", KDIR,
        src, "-o", str(tmp_path / "out.o"),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"
    assert (tmp_path / "out.o").stat().st_size > 0


def test_there_are_kernel_sources():
    assert len(SOURCES) >= 2 and os.path.exists(os.path.join(KDIR, "api.cpp"))
