"""Builds the compiled kernels when a CUDA torch and nvcc are present; CPU installs skip it.

Knobs (environment):
  HSTU_CUDA_ARCH_LIST   ";"-separated compute capabilities, default "8.0" (A100). H100/H200:
                        "8.0;9.0a" (9.0a adds the d256 attention's wgmma kernels; "9.0"
                        builds the SM80 kernels only).
  HSTU_KERNEL_DIMS      comma list of substrings; only instantiation files (kernels/*/instantiations/)
                        whose name contains one of them are built (e.g. "bf16_hdim128"); the
                        layer_norm_mul_dropout family always builds all of its files.
  HSTU_KERNELS          comma list of kernel families to build (default: all), e.g. "hstu_attention"
                        or "layer_norm_mul_dropout" (the fused layer's LayerNorm*u*dropout step).
  HSTU_SKIP_KERNELS=1   never build kernels.
  MAX_JOBS              parallel compile jobs of each extension (torch's ninja build); the
                        extensions build at the same time, so the small ones add a few jobs.
  CUTLASS_INCLUDE_DIR   CUTLASS/CuTe headers; default: the nvidia-cutlass package's copy.
"""

from __future__ import annotations

import copy
import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cutlass_include() -> str | None:
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env:
        return env
    try:
        import cutlass_library  # type: ignore

        path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
        return path if os.path.isdir(path) else None
    except ImportError:
        return None


def _archs() -> list[str]:
    """HSTU_CUDA_ARCH_LIST as a list, e.g. ["8.0", "9.0a"]."""
    archs = os.environ.get("HSTU_CUDA_ARCH_LIST", "8.0").replace(",", ";").split(";")
    return [a.strip() for a in archs if a.strip()]


def _arch_flags() -> list[str]:
    flags = []
    for a in _archs():
        num = a.replace(".", "")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    return flags + _sm90a_defines()


def _sm90a_defines() -> list[str]:
    """-DHSTU_SM90A when the arch list has "9.0a": the attention's wgmma kernels
    (kernels/hstu_attention/*_sm90.h) are built and dispatched on 9.0 devices."""
    return ["-DHSTU_SM90A"] if "9.0a" in _archs() else []


# Families whose instantiations/ are per dtype only (all are needed): HSTU_KERNEL_DIMS skips them.
_ALL_INSTANTIATIONS = ("layer_norm_mul_dropout",)


def _sources(name: str) -> list[str]:
    base = os.path.join("kernels", name)
    srcs = sorted(glob.glob(os.path.join(base, "*.cpp")) + glob.glob(os.path.join(base, "*.cu")))
    inst = sorted(glob.glob(os.path.join(base, "instantiations", "*.cu")))
    dims = [d.strip() for d in os.environ.get("HSTU_KERNEL_DIMS", "").split(",") if d.strip()]
    if dims and name not in _ALL_INSTANTIATIONS:
        inst = [s for s in inst if any(d in os.path.basename(s) for d in dims)]
    return srcs + inst


def _extensions():
    if os.environ.get("HSTU_SKIP_KERNELS") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("hstu: CPU torch or no CUDA toolkit: skipping compiled kernels", file=sys.stderr)
        return [], {}
    cutlass = _cutlass_include()
    nvcc = [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
    ] + _arch_flags()
    exts = []
    for name, module in (
        ("hstu_attention", "hstu._hstu_attention_C"),
        ("dynamic_embedding", "hstu._dynamic_embedding_C"),
        ("layer_norm_mul_dropout", "hstu._layer_norm_mul_dropout_C"),
    ):
        wanted = [k.strip() for k in os.environ.get("HSTU_KERNELS", "").split(",") if k.strip()]
        if wanted and name not in wanted:
            continue
        srcs = _sources(name)
        if not srcs:
            continue
        inc = [os.path.join(ROOT, "kernels", name)]
        if name == "hstu_attention":
            if cutlass is None:
                print(
                    "hstu: CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0 or "
                    "set CUTLASS_INCLUDE_DIR): skipping the attention kernel",
                    file=sys.stderr,
                )
                continue
            inc.append(cutlass)
        exts.append(
            CUDAExtension(
                module,
                srcs,
                include_dirs=inc,
                # residual_gemm.cpp calls cuBLASLt (torch's CUDA build ships and loads it)
                libraries=["cublasLt"] if name == "layer_norm_mul_dropout" else [],
                extra_compile_args={"cxx": ["-O3", "-std=c++17"] + _sm90a_defines(), "nvcc": nvcc},
            )
        )
    if not exts:
        return [], {}

    class ParallelBuildExtension(BuildExtension):
        """Builds the extensions at the same time, each in its own temporary folder: torch
        writes one build.ninja into the folder it is given, so extensions sharing the default
        one could not run together. Building them one after the other left the cores idle while
        the small extensions compiled their few files (the attention extension alone takes most
        of the build)."""

        def finalize_options(self):
            super().finalize_options()
            if not self.parallel:
                self.parallel = len(self.extensions)

        def build_extension(self, ext):
            own = copy.copy(self)  # the shared command object keeps the shared folder
            own.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
            os.makedirs(own.build_temp, exist_ok=True)
            BuildExtension.build_extension(own, ext)

    return exts, {"build_ext": ParallelBuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
