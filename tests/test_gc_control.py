"""StepGC: automatic garbage collection off inside the training loop, young generations collected
every `interval` steps, automatic collection restored on exit (also after an error)."""

from __future__ import annotations

import gc

import pytest

from hstu.config.gin_utils import load_config
from hstu.training.gc_control import StepGC


def _collections(gen: int) -> int:
    return gc.get_stats()[gen]["collections"]


def test_collects_every_interval_steps_and_restores():
    assert gc.isenabled()
    sgc = StepGC(3)
    with sgc:
        assert not gc.isenabled()
        before = _collections(1)
        for _ in range(2):
            sgc.step()
        assert _collections(1) == before  # automatic collection is off, no interval reached
        sgc.step()
        assert _collections(1) == before + 1
        full = _collections(2)
        sgc.full()
        assert _collections(2) == full + 1
    assert gc.isenabled()


def test_restores_after_error_and_zero_is_a_no_op():
    with pytest.raises(RuntimeError):
        with StepGC(5):
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()
    off = StepGC(0)
    with off:
        assert gc.isenabled()
        full = _collections(2)
        off.step()
        off.full()
        assert _collections(2) == full
    assert gc.isenabled()


def test_keeps_collection_off_when_it_was_off_before():
    gc.disable()
    try:
        with StepGC(2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_interval_binding_is_validated():
    assert load_config("ranking", [], ["TrainerArgs.gc_interval=0"]).trainer.gc_interval == 0
    with pytest.raises(ValueError, match="gc_interval"):
        load_config("ranking", [], ["TrainerArgs.gc_interval=-1"])
