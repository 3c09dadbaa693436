"""The attention dispatcher: CPU -> reference; CUDA -> compiled kernel, odd head dims zero-padded."""

from __future__ import annotations

import pytest
import torch

from hstu.ops import attention, reference


def _inputs(d: int, device: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 37, 70, 5])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    t = int(offsets[-1])
    q, k, v = (torch.randn(t, 2, d, generator=g).to(device, dtype) for _ in range(3))
    return q, k, v, offsets.to(device), int(lengths.max())


def test_cpu_dispatch_is_the_reference():
    q, k, v, offs, n = _inputs(50, "cpu")
    torch.testing.assert_close(
        attention.hstu_attention(q, k, v, offs, n), reference.hstu_attention(q, k, v, offs, n)
    )


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_attention")
@pytest.mark.parametrize("d", [50, 96])
def test_cuda_pads_unsupported_head_dims(d):
    q, k, v, offs, n = _inputs(d, "cuda", torch.bfloat16)
    for x in (q, k, v):
        x.requires_grad_(True)
    nt = torch.tensor([0, 0, 3, 10, 1], device="cuda")
    out = attention.hstu_attention(q, k, v, offs, n, num_targets=nt)
    ref_in = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    ref = reference.hstu_attention(*ref_in, offs, n, num_targets=nt)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for a, b in zip((q, k, v), ref_in):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)
