"""GPU policy: A100 only, exact refusal text, override to warning / CPU development mode."""

from __future__ import annotations

import logging

import pytest
import torch

from hstu.training.gpu_policy import DeviceMode, allow_non_a100_from_env, check_gpu

OK_TEXT = "[GPU Check] Detected A100 GPU (SM 8.0) - OK"


def fake_gpu(monkeypatch, name: str | None, capability: tuple[int, int] = (0, 0), count: int = 1):
    """Make torch.cuda report one GPU (or none when name is None)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if name is not None else 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("HSTU_ALLOW_NON_A100", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


REFUSED = [
    ("NVIDIA H100 80GB HBM3", (9, 0)),
    ("Tesla V100-SXM2-32GB", (7, 0)),
    ("NVIDIA GeForce RTX 4090", (8, 9)),
    ("NVIDIA A10", (8, 6)),
    ("NVIDIA A30", (8, 0)),  # SM 8.0 but not an A100
]


def expected(name: str, sm: str) -> str:
    return (
        f"This code is optimized for A100 GPU (SM 8.0) only. Detected {name} (SM {sm}). "
        "Please use an A100 GPU."
    )


def test_a100_passes(monkeypatch, caplog):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with caplog.at_level(logging.INFO, logger="hstu.training.gpu_policy"):
        mode = check_gpu(False)
    assert mode == DeviceMode("cuda", True, False, "NVIDIA A100-SXM4-80GB", (8, 0), 0)
    assert mode.backend == "nccl" and not mode.use_reference_ops
    assert OK_TEXT in caplog.text
    assert "WARNING" not in caplog.text


@pytest.mark.parametrize("name, cap", REFUSED)
def test_non_a100_gpus_refused_with_exact_message(monkeypatch, name, cap):
    fake_gpu(monkeypatch, name, cap)
    with pytest.raises(RuntimeError) as info:
        check_gpu(False)
    assert str(info.value) == expected(name, f"{cap[0]}.{cap[1]}")


def test_no_gpu_refused(monkeypatch):
    fake_gpu(monkeypatch, None)
    with pytest.raises(RuntimeError) as info:
        check_gpu(False)
    assert str(info.value) == expected("no CUDA GPU", "n/a")


@pytest.mark.parametrize("via_env", [False, True])
@pytest.mark.parametrize("name, cap", REFUSED)
def test_override_turns_refusal_into_warning(monkeypatch, caplog, name, cap, via_env):
    fake_gpu(monkeypatch, name, cap)
    if via_env:
        monkeypatch.setenv("HSTU_ALLOW_NON_A100", "1")
    with caplog.at_level(logging.WARNING, logger="hstu.training.gpu_policy"):
        mode = check_gpu(allow_non_a100=not via_env)
    assert mode.device == "cuda" and mode.dev_mode and not mode.is_a100
    assert mode.capability == cap and mode.name == name and mode.backend == "nccl"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and expected(name, f"{cap[0]}.{cap[1]}") in warnings[0].getMessage()
    assert "HSTU_CUDA_ARCH_LIST" in warnings[0].getMessage()  # how to rebuild for this arch


@pytest.mark.parametrize("via_env", [False, True])
def test_override_without_gpu_is_cpu_dev_mode(monkeypatch, caplog, via_env):
    fake_gpu(monkeypatch, None)
    if via_env:
        monkeypatch.setenv("HSTU_ALLOW_NON_A100", "true")
    with caplog.at_level(logging.WARNING, logger="hstu.training.gpu_policy"):
        mode = check_gpu(allow_non_a100=not via_env)
    assert mode.device == "cpu" and mode.dev_mode and mode.capability is None
    assert mode.backend == "gloo" and mode.use_reference_ops
    assert mode.torch_device == torch.device("cpu")
    assert "CPU DEVELOPMENT MODE" in caplog.text


def test_env_zero_keeps_policy(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv("HSTU_ALLOW_NON_A100", "0")
    with pytest.raises(RuntimeError, match="Please use an A100 GPU"):
        check_gpu(False)


@pytest.mark.parametrize(
    "raw, allowed",
    [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("on", True),
     ("0", False), ("false", False), ("no", False), ("off", False), ("", False)],
)  # fmt: skip
def test_env_var_parsing(raw, allowed):
    assert allow_non_a100_from_env({"HSTU_ALLOW_NON_A100": raw}) is allowed
    assert allow_non_a100_from_env({}) is False


def test_env_var_garbage_is_an_error():
    with pytest.raises(ValueError, match="HSTU_ALLOW_NON_A100='maybe' is not understood"):
        allow_non_a100_from_env({"HSTU_ALLOW_NON_A100": "maybe"})


def test_checks_the_local_rank_device(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    names = {0: "NVIDIA A100-SXM4-40GB", 1: "NVIDIA H100 80GB HBM3"}
    caps = {0: (8, 0), 1: (9, 0)}

    def name(device=None):
        asked.append(device)
        return names[device]

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps[device])
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"Detected NVIDIA H100 80GB HBM3 \(SM 9.0\)"):
        check_gpu(False)
    assert asked == [1]
    monkeypatch.setenv("LOCAL_RANK", "0")
    mode = check_gpu(False)
    assert mode.is_a100 and mode.torch_device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="only 2 CUDA device"):
        check_gpu(False)


def test_real_machine_consistent():
    """On this machine the policy agrees with torch's own view (no mocks)."""
    if torch.cuda.is_available() and "A100" in torch.cuda.get_device_name(0):
        assert check_gpu(False).is_a100
    else:
        with pytest.raises(RuntimeError) as info:
            check_gpu(False)
        assert str(info.value).startswith("This code is optimized for A100 GPU (SM 8.0) only.")
