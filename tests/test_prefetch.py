"""PrefetchIterator: background collation gives the wrapped iterator's batches, in order, and a
checkpointed position that is the position of the batches consumed, not prefetched."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch

from hstu.data.loader import BatchIterator, PrefetchIterator


class _Samples:
    """Minimal sample set: collate returns the indices (as a tensor) it was asked for."""

    def __init__(self, n: int, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.n = n
        self.fail_at = fail_at
        self.delay = delay
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def collate(self, idx: np.ndarray) -> torch.Tensor:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError(f"collate failed on call {self.calls}")
        return torch.as_tensor(np.asarray(idx))


def _plain(n=23, bs=4, seed=3):
    return BatchIterator(_Samples(n), bs, shuffle=True, seed=seed)


def test_same_batches_in_order_across_epochs():
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=2)
    try:
        for _ in range(17):  # 5 batches per epoch: crosses three epoch boundaries
            assert torch.equal(next(pre), next(ref))
            assert pre.state_dict() == ref.state_dict()
    finally:
        pre.close()


def test_state_is_the_consumed_position_and_resumes_exactly():
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=2)
    try:
        for _ in range(3):
            next(pre), next(ref)
        time.sleep(0.05)  # let the thread run ahead
        assert pre.source.position > ref.position or pre.source.epoch > ref.epoch
        state = pre.state_dict()
        assert state == ref.state_dict()
    finally:
        pre.close()
    resumed = PrefetchIterator(_plain(), depth=2)
    resumed.load_state_dict(state)
    try:
        for _ in range(8):
            assert torch.equal(next(resumed), next(ref))
    finally:
        resumed.close()


def test_load_state_dict_while_running_and_continue_after_close():
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=1)
    try:
        first = [next(pre) for _ in range(4)]
        pre.load_state_dict(_plain().state_dict())  # rewind to the start while prefetching
        for b in first:
            assert torch.equal(next(pre), b)
        pre.close()  # drops the prefetched batches; next() continues after the consumed ones
        for _ in range(4):
            next(ref)
        for _ in range(3):
            assert torch.equal(next(pre), next(ref))
    finally:
        pre.close()


def test_bounded_queue():
    samples = _Samples(40)
    pre = PrefetchIterator(BatchIterator(samples, 4, shuffle=False), depth=2)
    try:
        next(pre)
        time.sleep(0.2)
        # one returned + at most `depth` queued + one collated and waiting to be queued
        assert samples.calls <= 1 + 2 + 1
    finally:
        pre.close()


def test_worker_exception_is_raised_in_consumer_then_retried():
    samples = _Samples(20, fail_at=3)
    pre = PrefetchIterator(BatchIterator(samples, 4, shuffle=False), depth=2)
    try:
        assert next(pre).tolist() == [0, 1, 2, 3]
        assert next(pre).tolist() == [4, 5, 6, 7]
        with pytest.raises(RuntimeError, match="collate failed on call 3"):
            next(pre)
        assert pre.state_dict()["position"] == 2  # the failed batch was not consumed
        assert next(pre).tolist() == [8, 9, 10, 11]  # a later call starts over from there
    finally:
        pre.close()


def test_lookahead_sees_each_batch_one_next_before_it_is_returned():
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=2)
    seen: list[torch.Tensor] = []
    pre.set_lookahead(lambda b: seen.append(b.clone()))
    try:
        for i in range(12):  # crosses epoch boundaries
            b = next(pre)
            assert torch.equal(b, next(ref))
            assert len(seen) == i + 2  # this batch and the next one were looked at
            assert torch.equal(seen[i], b)
            assert pre.state_dict() == ref.state_dict()  # the position of the batches returned
        assert torch.equal(seen[12], next(ref))
    finally:
        pre.close()


def test_lookahead_close_and_rewind_keep_the_batch_sequence():
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=2)
    seen: list[torch.Tensor] = []
    pre.set_lookahead(lambda b: seen.append(b.clone()))
    try:
        got = [next(pre) for _ in range(3)]
        pre.close()  # drops the looked-ahead batch; it is looked at again when fetched again
        got += [next(pre) for _ in range(3)]
        want = [next(ref) for _ in range(6)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(seen[3], want[3]) and torch.equal(seen[4], want[3])
        pre.load_state_dict(_plain().state_dict())
        assert torch.equal(next(pre), want[0])
    finally:
        pre.close()


def test_lookahead_defers_a_worker_error_to_the_batch_that_failed():
    samples = _Samples(20, fail_at=3)
    pre = PrefetchIterator(BatchIterator(samples, 4, shuffle=False), depth=2)
    pre.set_lookahead(lambda b: None)
    try:
        assert next(pre).tolist() == [0, 1, 2, 3]
        assert next(pre).tolist() == [4, 5, 6, 7]  # batch 3 already failed behind it
        with pytest.raises(RuntimeError, match="collate failed on call 3"):
            next(pre)
        assert pre.state_dict()["position"] == 2
        assert next(pre).tolist() == [8, 9, 10, 11]
    finally:
        pre.close()


def test_close_stops_the_thread():
    pre = PrefetchIterator(BatchIterator(_Samples(40, delay=0.01), 4, shuffle=False), depth=2)
    next(pre)
    pre.close()
    assert not any(t.name == "hstu-batch-prefetch" for t in threading.enumerate())


def test_dropped_iterator_stops_its_thread():
    pre = PrefetchIterator(BatchIterator(_Samples(40), 4, shuffle=False), depth=1)
    next(pre)
    del pre
    gc.collect()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not any(t.name == "hstu-batch-prefetch" for t in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(t.name == "hstu-batch-prefetch" for t in threading.enumerate())


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth=0"):
        PrefetchIterator(_plain(), depth=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            PrefetchIterator(_plain(), pin_memory=True)


def test_prepare_runs_on_the_thread_for_every_batch_in_order():
    """`set_prepare(fn)`: fn sees every batch on the prefetch thread before it is handed out
    (here it records the batch and the thread); batches already prefetched are collated again."""
    seen = []
    main = threading.get_ident()
    ref = _plain()
    pre = PrefetchIterator(_plain(), depth=2)
    try:
        first = next(pre)  # the thread is running and has prefetched past it
        assert torch.equal(first, next(ref))
        pre.set_prepare(lambda b: seen.append((b.clone(), threading.get_ident())))
        for _ in range(6):
            got = next(pre)
            assert torch.equal(got, next(ref))
        assert len(seen) >= 6 and all(tid != main for _, tid in seen)
        handed = [b for b, _ in seen[:6]]
        ref2 = _plain()
        next(ref2)
        for b in handed:  # the prepared batches are the ones handed out, in order
            assert torch.equal(b, next(ref2))
    finally:
        pre.close()


def test_prepare_must_be_a_function():
    pre = PrefetchIterator(_plain(), depth=2)
    try:
        with pytest.raises(TypeError, match="function of one batch"):
            pre.set_prepare("not callable")
        pre.set_prepare(None)  # no preparation: allowed
        assert next(pre) is not None
    finally:
        pre.close()
