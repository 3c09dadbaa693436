"""Fixtures, markers and collection rules shared by the test modules.

Markers (``gpu`` and ``slow`` are also declared in pyproject.toml):

- ``gpu``: needs a CUDA GPU. Skipped where none is visible, so ``pytest -m gpu`` on a GPU
  machine runs them and a plain ``pytest`` on a CPU machine reports them as skipped. Tests that
  also need a compiled extension request the ``compiled_attention`` or
  ``dynamic_embedding_kernels`` fixture, which skip when it is not built.
- ``cpu_only``: behaviour of a machine without a GPU (gloo launches, the CPU refusal of the
  launchers, CPU smoke runs of the benchmarks); skipped where a GPU is visible.

Plain helpers that other helpers also use live in importable modules next to this file
(`dist_helpers`: launching subprocesses and torchrun; `model_helpers`: small synthetic models);
the fixtures below wrap what the test modules share.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gin
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real datasets next to the repository (../shared/data); absent on users' machines.
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cpu_only: behaviour without a GPU (skipped where a GPU is visible)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_cpu_only = pytest.mark.skip(reason="CPU-machine behaviour (a GPU is visible)")
    for item in items:
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        if cuda and item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip_cpu_only)


# ---- paths -------------------------------------------------------------------------------------


@pytest.fixture
def shared_data() -> Callable[..., Path]:
    """``shared_data("ml-100k")``: that path under ../shared/data, or a skip when it is absent."""

    def path(*parts: str) -> Path:
        p = SHARED_DATA.joinpath(*parts)
        if not p.exists():
            pytest.skip(f"{p} not present (the real data in ../shared/data)")
        return p

    return path


@pytest.fixture
def load_script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``load_script("bench_layer")``: scripts/bench_layer.py imported as a module (its
    ``main()`` not run), with scripts/ on ``sys.path`` for the helpers next to it."""

    def load(name: str) -> ModuleType:
        monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        # registered while it runs: dataclasses look their module up by name
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load


# ---- configuration ------------------------------------------------------------------------------


@pytest.fixture
def clean_gin():
    """gin's global bindings cleared before and after the test."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture
def run_dir_bindings() -> Callable[..., list[str]]:
    """``run_dir_bindings(path)``: the gin bindings that put a run's logs, TensorBoard files and
    checkpoints under ``path`` / ``name`` (default ``run``)."""

    def bindings(path: Path, name: str = "run") -> list[str]:
        return [f"TrainerArgs.log_dir='{path}'", f"TrainerArgs.run_name='{name}'"]

    return bindings


# ---- hardware and builds -----------------------------------------------------------------------


@pytest.fixture
def compiled_attention() -> None:
    """Skip unless a CUDA GPU is visible and the compiled HSTU attention kernel is built."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hstu.ops import compiled_attention_available

    if not compiled_attention_available():
        pytest.skip("compiled attention kernel not built")


@pytest.fixture
def dynamic_embedding_kernels() -> None:
    """Skip unless a CUDA GPU is visible and the dynamic embedding kernels are built."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hstu.embeddings import cuda_table

    if not cuda_table.available():
        pytest.skip("dynamic embedding kernels not built")


def find_nvcc() -> str | None:
    """nvcc from $NVCC, $CUDA_HOME / $CUDA_PATH, PATH or /usr/local/cuda, else None."""
    candidates = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@pytest.fixture(scope="session")
def nvcc() -> str:
    """Path of nvcc (kernel compile checks need no GPU), or a skip when there is none."""
    path = find_nvcc()
    if path is None:
        pytest.skip("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")
    return path
