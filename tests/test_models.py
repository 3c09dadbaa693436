"""RankingGR / RetrievalGR on small synthetic batches (CPU, reference attention)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import small_model

from hstu.models.ranking import label_bits

_setup = small_model


def test_label_bits():
    bits = label_bits(torch.tensor([0, 1, 5, 255]), 8)
    assert bits[0].sum() == 0
    assert bits[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert bits[2].tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    assert bits[3].sum() == 8


def test_ranking_shapes_and_loss_value():
    cfg, data, splits, model = _setup("ranking")
    model.eval()
    batch = splits.train.collate(list(range(6)))
    out = model(batch)
    n = int(batch.num_candidates.sum())
    assert out["logits"].shape == (n, cfg.ranking.num_tasks)
    targets = label_bits(batch.labels, cfg.ranking.num_tasks)
    expected = (
        torch.nn.functional.binary_cross_entropy_with_logits(
            out["logits"], targets, reduction="sum"
        )
        / n
    )
    torch.testing.assert_close(out["loss"], expected)


@pytest.mark.parametrize("bias", ["none", "position_time"])
def test_ranking_candidates_do_not_see_each_other(bias):
    """Target tokens attend only to history (+ themselves): changing one candidate's item must not
    change another candidate's logits (docs/design.md target mask with target_group_size=1), with
    the relative position + time bias too (it adds to the scores of the same valid pairs)."""
    _, _, splits, model = _setup("ranking", f"NetworkArgs.relative_attention_bias='{bias}'")
    model.eval()
    idx = [i for i in range(len(splits.eval)) if splits.eval.collate([i]).num_candidates[0] >= 3][
        :1
    ]
    batch = splits.eval.collate(idx)
    base = model(batch)["logits"]
    kjt = batch.features
    values = kjt.values().clone()
    lengths = kjt.lengths()
    # the item feature's values; its last entry is the last candidate of the single sample
    keys = kjt.keys()
    start = int(lengths[: keys.index("item_id")].sum())
    end = start + int(lengths[keys.index("item_id")])
    values[end - 1] = (values[end - 1] + 7) % 100
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch.features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    changed = model(batch)["logits"]
    torch.testing.assert_close(changed[:-1], base[:-1])
    assert not torch.allclose(changed[-1], base[-1])


def test_ranking_learns_a_fixed_batch():
    _, _, splits, model = _setup("ranking")
    model.train()
    batch = splits.train.collate(list(range(16)))
    dense = [p for n, p in model.named_parameters()]
    opt = torch.optim.Adam(dense, lr=3e-3)
    losses = []
    for _ in range(25):
        loss = model(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]


def test_retrieval_loss_and_eval_query():
    cfg, data, splits, model = _setup("retrieval", "RetrievalArgs.num_negatives=16")
    model.train()
    batch = splits.train.collate(list(range(4)))
    out = model(batch)
    h = batch.history_lengths()
    assert out["count"] == float((h - 1).clamp(min=0).sum())
    assert torch.isfinite(out["loss"]) and out["loss"] > 0
    model.eval()
    ev = splits.eval.collate(list(range(5)))
    q = model(ev)["query"]
    assert q.shape == (5, cfg.network.hidden_size)
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(5), atol=1e-4, rtol=0)
    emb = model.item_embeddings(torch.from_numpy(data.item_corpus()[:10]))
    assert emb.shape == (10, cfg.network.hidden_size)


@pytest.mark.parametrize("sampling", ["random", "in_batch", "mixed"])
def test_retrieval_negative_sampling_modes(sampling):
    _, _, splits, model = _setup(
        "retrieval",
        f"RetrievalArgs.negative_sampling='{sampling}'",
        "RetrievalArgs.num_negatives=8",
    )
    model.train()
    out = model(splits.train.collate(list(range(4))))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    grads = [p.grad for p in model.encoder.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
