"""scripts/bench_attention.py's inputs on CPU: the uniform lengths of the design doc's shapes and
the e2e model's lognormal lengths (e2e_d256), both reproducible."""

from __future__ import annotations

import math

import torch


def test_e2e_shape_lengths_follow_the_synthetic_lognormal(load_script):
    bench = load_script("bench_attention")
    assert "e2e_d256" in bench.SHAPES and bench.LOGNORMAL_SHAPES <= set(bench.SHAPES)
    b, _, _, n, _, _ = bench.SHAPES["e2e_d256"]
    lengths, offsets, q, *_ = bench.make_inputs(b, 1, 8, n, 0, 0, device="cpu", lognormal=True)
    again = bench.make_inputs(b, 1, 8, n, 0, 0, device="cpu", lognormal=True)[0]
    assert torch.equal(lengths, again)  # seeded
    assert int(lengths.min()) >= 8 and int(lengths.max()) <= n
    assert offsets.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert q.shape == (int(lengths.sum()), 1, 8)
    # the same formula as hstu.data.synthetic (mean 1024, sigma 1): 8 + floor(exp(mu + z))
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(b, generator=gen, dtype=torch.float64)
    want = (8 + torch.floor(torch.exp(math.log(1016) - 0.5 + z))).long().clamp(8, n)
    assert torch.equal(lengths, want)
    # heavy-tailed: far wider than the uniform shapes' [N/2, N]
    assert int(lengths.max()) > 4 * int(lengths.min())


def test_uniform_shapes_keep_their_lengths(load_script):
    bench = load_script("bench_attention")
    lengths = bench.make_inputs(8, 1, 8, 4096, 0, 0, device="cpu")[0]
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(lengths, torch.randint(2048, 4097, (8,), generator=gen))


def test_bound_factor_below_one_is_refused(load_script, monkeypatch, capsys):
    """--bound-factor scales the kernel's max_seqlen (the grid's bound) above N; below 1 it
    would not bound the lengths: refused before anything runs, naming the option."""
    import pytest

    bench = load_script("bench_attention")
    monkeypatch.setattr("sys.argv", ["bench_attention.py", "--bound-factor", "0.5"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--bound-factor must be >= 1" in capsys.readouterr().err
