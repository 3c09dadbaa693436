"""Ranking from a cached history (hstu.inference.kv_cache) equals the full recomputation (CPU).

Every mask the ranking model uses: contextual tokens, candidates as targets (groups of 1 and 2),
a local window; no bias, the position bias and position + time; fused and unfused layers; plain,
dynamic and torchrec item tables; a fixed scaling with candidate sets of other sizes. Equality is exact up to float32 rounding (asserted to
1e-5; measured 0 on the CPU reference path).
"""

from __future__ import annotations

import pytest
import torch

from hstu.config.gin_utils import load_config
from hstu.data.registry import build_samples, load_sequence_data
from hstu.inference.kv_cache import (
    encode_history,
    full_scores,
    score_candidates,
    split_candidates,
    with_candidates,
)
from hstu.models.builder import build_model

BASE = [
    "DatasetArgs.synthetic_num_users=100",
    "DatasetArgs.synthetic_num_items=80",
    "DatasetArgs.max_history_seqlen=20",
    "DatasetArgs.max_num_candidates=4",
    "NetworkArgs.num_layers=2",
    "NetworkArgs.hidden_size=32",
    "NetworkArgs.num_attention_heads=2",
    "NetworkArgs.kv_channels=16",
    "EmbeddingArgs.embedding_backend='dense'",
]


def _setup(extra: list[str], users: int = 6):
    torch.manual_seed(0)
    cfg = load_config("ranking", [], BASE + extra)
    data = load_sequence_data(cfg.dataset, num_tasks=8)
    model = build_model(cfg, data, device_type="cpu")
    samples = build_samples(data, cfg.dataset, "ranking").eval
    batch = samples.collate(list(range(users)))
    with torch.no_grad():
        model.embeddings(batch)  # training mode: dynamic tables insert the batch's ids
    return model.eval(), batch


CASES = {
    "plain": [],
    "position": ["NetworkArgs.relative_attention_bias='position'"],
    "position_time": ["NetworkArgs.relative_attention_bias='position_time'"],
    "groups_of_2": ["NetworkArgs.target_group_size=2"],
    "window": ["NetworkArgs.max_attn_len=6"],
    "no_contexts": ["NetworkArgs.use_contextual_features=False"],
    "fused_time": ["NetworkArgs.fused_layer=True", "NetworkArgs.relative_attention_bias='time'"],
    # the item rows from a dynamic table's serving lookup; from torchrec's lookup of a batch
    "dynamic_table": [
        "EmbeddingArgs.embedding_backend='dynamic'",
        "EmbeddingArgs.contextual_tables='dense'",
        "EmbeddingArgs.item_capacity=1000",
        "EmbeddingArgs.user_capacity=1000",
        "NetworkArgs.fused_layer=True",
    ],
    "torchrec_table": ["EmbeddingArgs.embedding_backend='torchrec'"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_scores_equal_the_full_recomputation(case):
    model, batch = _setup(CASES[case])
    ref = full_scores(model, batch)
    history, cands, times = split_candidates(batch)
    query_time = None if times is None else torch.stack([t[0] for t in times])
    cache = encode_history(model, history, int(batch.num_candidates[0]), query_time=query_time)
    got = score_candidates(model, cache, cands, times)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the cache serves further candidate sets of the same size
    other = [c.flip(0) for c in cands]
    full = with_candidates(history, other, times)
    torch.testing.assert_close(
        score_candidates(model, cache, other, times), full_scores(model, full), rtol=0, atol=1e-5
    )


def test_fixed_scaling_scores_any_number_of_candidates():
    model, batch = _setup(["NetworkArgs.scaling_seqlen=64"])
    history, cands, _ = split_candidates(batch)
    cache = encode_history(model, history, 4)
    for n in (1, 3, 7):
        sets = [torch.cat([c, c])[:n] for c in cands]
        got = score_candidates(model, cache, sets)
        torch.testing.assert_close(
            got, full_scores(model, with_candidates(history, sets)), rtol=0, atol=1e-5
        )


def test_cache_misuse_is_a_clear_error():
    model, batch = _setup(["NetworkArgs.relative_attention_bias='position_time'"])
    history, cands, times = split_candidates(batch)
    query_time = torch.stack([t[0] for t in times])
    cache = encode_history(model, history, 4, query_time=query_time)
    with pytest.raises(ValueError, match="encoded for 4 candidates"):
        score_candidates(model, cache, [c[:2] for c in cands], [t[:2] for t in times])
    shifted = [t + 1000 for t in times]
    with pytest.raises(ValueError, match="first candidate's time"):
        score_candidates(model, cache, cands, shifted)
    with pytest.raises(ValueError, match="one per user"):
        score_candidates(model, cache, cands[:-1], times[:-1])
    with pytest.raises(ValueError, match="ids must lie in"):  # checked before any lookup
        score_candidates(model, cache, [c + 10**6 for c in cands], times)
    with pytest.raises(ValueError, match="histories only"):
        encode_history(model, batch, 4)
    model.train()
    with pytest.raises(ValueError, match="eval mode"):
        encode_history(model, history, 4)


# ---- CUDA: the compiled cached attention and the captured scorer ----------------------------------


def _cuda_kernel() -> bool:
    if not torch.cuda.is_available():
        return False
    from hstu.ops import cuda_attention

    return cuda_attention.is_available()


needs_kernel = pytest.mark.skipif(not _cuda_kernel(), reason="needs a CUDA GPU and the kernel")


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("case", ["plain", "position_time", "groups_of_2", "window", "fused_time"])
def test_cuda_cached_and_graphed_scores_equal_the_full_recomputation(case):
    """bf16 on the compiled kernels: the cached scores (eager and replayed from a CUDA graph)
    against the model's forward on history + candidates, within bf16 noise."""
    from hstu.inference.kv_cache import GraphedScorer

    model, batch = _setup(CASES[case] + ["NetworkArgs.kv_channels=32"])
    model = model.cuda()
    history, cands, times = split_candidates(batch)
    query_time = None if times is None else torch.stack([t[0] for t in times])
    amp = torch.autocast("cuda", dtype=torch.bfloat16)
    with torch.no_grad(), amp:
        ref = full_scores(model, batch.to("cuda"))
        cache = encode_history(
            model, history.to("cuda"), int(batch.num_candidates[0]), query_time=query_time
        )
        eager = score_candidates(model, cache, cands, times)
        scorer = GraphedScorer(
            model, cache, [c.numel() for c in cands], autocast_dtype=torch.bfloat16
        )
        graphed = scorer(cands, times)
        on_host = scorer(cands, times, to_host=True)
        other = [c.flip(0) for c in cands]
        graphed_other = scorer(other, times)
        eager_other = score_candidates(model, cache, other, times)
    scale = float(ref.abs().max())
    assert float((eager - ref).abs().max()) <= 3e-2 * scale
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-5 * scale)
    assert on_host.device.type == "cpu"
    torch.testing.assert_close(on_host, graphed.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(graphed_other, eager_other, rtol=0, atol=1e-5 * scale)
    # other counts: refused (the cache's own count check comes first unless the scaling is fixed)
    with pytest.raises(ValueError, match="captured for|encoded for"):
        scorer([c[:1] for c in cands])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 5])  # 16: moved as 16-byte elements; 5: element by element
def test_cache_row_writes_equal_index_copy(dtype, width):
    from hstu.inference.kv_cache import _wide, _write_rows

    gen = torch.Generator().manual_seed(0)
    act = torch.randn(4, 7, 4 * width, generator=gen).to(dtype)
    rows = act[3].view(7, 4, width)  # a chunk of a larger buffer, as the layer's k and v are
    dst = torch.tensor([3, 9, 10, 11, 40, 41, 49])
    buf = torch.randn(50, 4, width, generator=gen).to(dtype)
    want = buf.clone().index_copy_(0, dst, rows)
    _write_rows(buf, dst, rows)
    assert torch.equal(buf, want)
    assert (_wide(rows) is not None) == (width == 16)
