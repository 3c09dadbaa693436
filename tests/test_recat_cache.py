"""hstu.training.distributed.install_torchrec_recat_cache: torchrec's KJT all-to-all recat
permutation built once per argument set instead of a blocking host->device copy per forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")

from torchrec.distributed import dist_data  # noqa: E402

from hstu.training.distributed import install_torchrec_recat_cache  # noqa: E402

CASES = [
    dict(local_split=2, num_splits=4, stagger=1),
    dict(local_split=3, num_splits=2, stagger=1),
    dict(local_split=2, num_splits=4, stagger=2),
    dict(local_split=0, num_splits=4, stagger=1),
    dict(local_split=2, num_splits=2, stagger=1, batch_size_per_rank=[3, 5]),
]


def _unwrapped():
    fn = dist_data._get_recat
    return getattr(fn, "__wrapped__", fn)


def test_install_is_idempotent_and_cpu_calls_fall_through():
    assert install_torchrec_recat_cache()
    first = dist_data._get_recat
    assert install_torchrec_recat_cache() and dist_data._get_recat is first
    original = _unwrapped()
    for case in CASES:
        want = original(**case, device=torch.device("cpu"))
        got = dist_data._get_recat(**case, device=torch.device("cpu"))
        if want is None:
            assert got is None
        else:
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_cuda_recat_cached_equal_and_sync_free():
    install_torchrec_recat_cache()
    original = _unwrapped()
    dev = torch.device("cuda")
    for case in CASES:
        want = original(**case, device=dev)
        got = dist_data._get_recat(**case, device=dev)
        if want is None:
            assert got is None
            continue
        assert got.device.type == "cuda" and torch.equal(got, want)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = dist_data._get_recat(**case, device=dev)  # cached: no copy, no sync
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert again is got
