"""CPU compile check of the HSTU attention kernels: nvcc -c (no link) for sm_80.

A kernel that does not compile for the A100 can never land. The kernel headers and
instantiation files include no ATen/torch headers, so nvcc + the CUTLASS headers suffice.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "kernels" / "hstu_attention"
# The smallest head dim compiles fastest; one forward and one backward instantiation, without
# and with the relative attention bias.
FILES = [
    "fwd_bf16_hdim64.cu",
    "bwd_fp16_hdim64.cu",
    "fwd_bias_fp16_hdim64.cu",
    "bwd_bias_bf16_hdim64.cu",
    "bwd_biaspos_bf16_hdim64.cu",
]


def _cutlass_include() -> str | None:
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env and os.path.isdir(env):
        return env
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def test_kernel_sources_have_no_torch_includes() -> None:
    for path in list(KERNEL_DIR.glob("*.h")) + list((KERNEL_DIR / "instantiations").glob("*.cu")):
        text = path.read_text()
        for banned in ("#include <torch", "#include <ATen", "#include <c10"):
            assert banned not in text, f"{path.name} includes {banned[10:]}: keep it in api.cpp"


def test_one_instantiation_per_dtype_headdim_direction_bias() -> None:
    names = {p.name for p in (KERNEL_DIR / "instantiations").glob("*.cu")}
    expected = {
        f"{direction}_{bias}{dtype}_hdim{d}.cu"
        for direction in ("fwd", "bwd")
        for bias in ("", "bias_")
        for dtype in ("bf16", "fp16")
        for d in (32, 64, 128, 256)
    }
    # the backward with the position term alone (the time term compiled out)
    expected |= {
        f"bwd_biaspos_{dtype}_hdim{d}.cu" for dtype in ("bf16", "fp16") for d in (32, 64, 128, 256)
    }
    assert names == expected


def _compile(nvcc: str, name: str, out: Path, arch: str, defines: tuple[str, ...] = ()) -> None:
    """nvcc -c of one instantiation file for `arch` (e.g. "80", "90a"); asserts it succeeds."""
    cutlass = _cutlass_include()
    if cutlass is None:
        pytest.skip(
            "CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0 or set "
            "CUTLASS_INCLUDE_DIR)"
        )
    cmd = [
        nvcc,
        "-c",
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        *defines,
        "-gencode",
        f"arch=compute_{arch},code=sm_{arch}",
        "-I",
        str(KERNEL_DIR),
        "-I",
        cutlass,
        str(KERNEL_DIR / "instantiations" / name),
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"nvcc failed for {name}:\n{proc.stderr[-6000:]}"
    assert out.stat().st_size > 0


@pytest.mark.parametrize("name", FILES)
def test_instantiation_compiles_for_sm80(name: str, tmp_path: Path, nvcc: str) -> None:
    _compile(nvcc, name, tmp_path / (name + ".o"), "80")


@pytest.mark.parametrize(
    "name, kernel",
    [
        ("fwd_fp16_hdim256.cu", b"hstu_fwd_kernel_sm90"),
        ("bwd_bf16_hdim256.cu", b"hstu_bwd_kernel_sm90"),
    ],
)
def test_sm90a_kernels_compile(name: str, kernel: bytes, tmp_path: Path, nvcc: str) -> None:
    """The wgmma kernels (fwd_kernel_sm90.h, bwd_kernel_sm90.h) compile for sm_90a with
    HSTU_SM90A, as setup.py builds them for HSTU_CUDA_ARCH_LIST "9.0a", and are instantiated."""
    out = tmp_path / (name + ".o")
    _compile(nvcc, name, out, "90a", ("-DHSTU_SM90A",))
    assert kernel in out.read_bytes()


def _build_tool(nvcc: str, name: str, tmp_path: Path, flag: str) -> Path:
    """nvcc -O2 of kernels/hstu_attention/tools/<name>.cu into an executable; returns its path."""
    exe = tmp_path / name
    cmd = [nvcc, "-O2", flag, str(KERNEL_DIR / "tools" / f"{name}.cu"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def test_reduction_throughput_tool_compiles(tmp_path: Path, nvcc: str) -> None:
    """tools/red_throughput.cu (the dQ reductions' access patterns, docs/kernels.md) builds for
    sm_90a with its patterns (fragment, whole-line reductions and stores, bulk)."""
    data = _build_tool(nvcc, "red_throughput", tmp_path, "-arch=sm_90a").read_bytes()
    for kernel in (b"fragment", b"whole_line", b"bulk"):
        assert kernel in data


def test_mask_rules_match_reference(tmp_path: Path, nvcc: str) -> None:
    """mask.h (host-compiled): its tile/row predicates agree with its element rule on every small
    configuration, and the element rule equals the PyTorch reference mask."""
    import torch

    from hstu.ops.reference import hstu_attention_mask

    exe = _build_tool(nvcc, "mask_check", tmp_path, "-std=c++17")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:]
    lines = run.stdout.splitlines()
    assert "0 failures" in lines[0]
    blocks = 0
    idx = 1
    while idx < len(lines):
        _, L, c, t, g, w, causal = lines[idx].split()
        L, c, t, g, w, causal = int(L), int(c), int(t), int(g), int(w), bool(int(causal))
        rows = lines[idx + 1 : idx + 1 + L]
        kernel = torch.tensor([[ch == "1" for ch in r] for r in rows])
        ref = hstu_attention_mask(
            torch.tensor([L]),
            L,
            torch.tensor([c]) if causal else None,
            torch.tensor([t]) if causal else None,
            g,
            w,
            causal,
        )[0]
        assert torch.equal(kernel, ref), f"mask differs for L={L} c={c} t={t} G={g} w={w}"
        blocks += 1
        idx += 1 + L
    assert blocks >= 8


# Declarations the CPU torch wheel's CUDA headers need from CUDA libraries the CPU toolkit lacks
# (the GPU build has the real ones); enough for a syntax check of the torch glue.
_CUDA_LIBRARY_STUBS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n"
    "const char* cusparseGetErrorString(cusparseStatus_t);\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
}


@pytest.mark.parametrize(
    "api",
    [
        "hstu_attention/api.cpp",
        "layer_norm_mul_dropout/api.cpp",
        "layer_norm_mul_dropout/tokens_api.cpp",
        "dynamic_embedding/api.cpp",
    ],
)
def test_torch_glue_compiles(api: str, tmp_path: Path, nvcc: str) -> None:
    """api.cpp (input checks, op schemas, CUDA and Meta implementations) passes a C++ syntax
    check against the installed torch's headers, so a broken op registration is caught before
    the GPU build."""
    import sysconfig

    import torch.utils.cpp_extension as ext

    for rel, text in _CUDA_LIBRARY_STUBS.items():
        path = tmp_path / "stubs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    homes = [
        os.environ.get("CUDA_HOME", ""),
        "/usr/local/cuda",
        str(Path(nvcc).resolve().parents[1]),
    ]
    found = [
        Path(h) / "include"
        for h in homes
        if h and (Path(h) / "include" / "cuda_runtime_api.h").is_file()
    ]
    if not found:
        pytest.skip("CUDA runtime headers not found (set CUDA_HOME)")
    cuda_include = found[0]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-I", str(tmp_path / "stubs")]
    for inc in [*ext.include_paths(), str(cuda_include), sysconfig.get_paths()["include"]]:
        cmd += ["-I", inc]
    cmd += [f"-DTORCH_EXTENSION_NAME=_{Path(api).parent.name}_C", str(ROOT / "kernels" / api)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0, f"{api} does not compile:\n" + "\n".join(errors[:40])
