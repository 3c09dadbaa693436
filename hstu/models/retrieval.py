"""RetrievalGR: autoregressive next-item prediction with sampled softmax over negatives."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstu.data.batch import Batch
from hstu.models.base import EXTRA_ITEM_FEATURE, FeatureInfo, GenerativeRecommender, gather_outputs
from hstu.modules.preprocessor import item_values

__all__ = ["RetrievalGR", "NEGATIVE_SAMPLING"]

NEGATIVE_SAMPLING = ("random", "in_batch", "mixed")


class RetrievalGR(GenerativeRecommender):
    """Each history position predicts the next item.

    Query and item embeddings are L2-normalised; logits are cosine / temperature. Negatives:
    ``random`` (``num_negatives`` ids drawn uniformly from the item corpus, shared by the batch),
    ``in_batch`` (the other positions' positives) or ``mixed`` (both). A negative equal to the
    positive is masked out.
    """

    uses_extra_items = True

    def __init__(
        self,
        info: FeatureInfo,
        *,
        item_corpus: torch.Tensor,
        num_negatives: int = 128,
        temperature: float = 0.05,
        negative_sampling: str = "random",
        **kwargs,
    ) -> None:
        super().__init__(info, **kwargs)
        if negative_sampling not in NEGATIVE_SAMPLING:
            raise ValueError(
                f"RetrievalArgs.negative_sampling={negative_sampling!r} is not supported: "
                f"one of {list(NEGATIVE_SAMPLING)}"
            )
        if item_corpus.numel() == 0:
            raise ValueError("the item corpus is empty: the dataset has no interactions")
        self.register_buffer("item_corpus", item_corpus.long().clone(), persistent=False)
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.negative_sampling = negative_sampling

    @staticmethod
    def normalize(x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), dim=-1, eps=1e-6)

    def _sample_negatives(self) -> torch.Tensor | None:
        if self.negative_sampling == "in_batch" or self.num_negatives <= 0:
            return None
        idx = torch.randint(
            0, self.item_corpus.numel(), (self.num_negatives,), device=self.item_corpus.device
        )
        return self.item_corpus[idx]

    def forward(
        self, batch: Batch, loss_normalizer: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Training: sampled-softmax loss over every (position -> next item) pair.

        With ``batch.target_item_ids`` set (evaluation), also returns the query embedding of each
        sample's last history position as ``query``.
        """
        neg_ids = self._sample_negatives() if self.training else None
        y, layout, item_emb, neg_emb = self.encode(batch, neg_ids)
        ids = item_values(batch).to(y.device)
        out: dict[str, torch.Tensor] = {"num_tokens": torch.tensor(layout.num_tokens)}
        # position p predicts item p + 1 of the same sample
        has_next = layout.is_history & (
            layout.item_pos + 1 < layout.history_lengths[layout.item_sample]
        )
        src = has_next.nonzero().squeeze(1)
        q = self.normalize(gather_outputs(y, layout, has_next))
        pos_ids = ids[src + 1]
        pos = self.normalize(item_emb[src + 1])
        pos_logit = (q * pos).sum(-1, keepdim=True) / self.temperature
        logits = [pos_logit]
        if neg_ids is not None and neg_emb is not None and neg_emb.shape[0] > 0:
            neg = self.normalize(neg_emb)
            neg_logit = q @ neg.t() / self.temperature
            neg_logit = neg_logit.masked_fill(
                pos_ids.view(-1, 1) == neg_ids.view(1, -1), float("-inf")
            )
            logits.append(neg_logit)
        if self.negative_sampling in ("in_batch", "mixed") and self.training:
            ib_logit = q @ pos.t() / self.temperature
            ib_logit = ib_logit.masked_fill(
                pos_ids.view(-1, 1) == pos_ids.view(1, -1), float("-inf")
            )
            logits.append(ib_logit)
        all_logits = torch.cat(logits, dim=1)
        n = all_logits.shape[0]
        if n > 0:
            per = -torch.log_softmax(all_logits, dim=1)[:, 0]
            total = per.sum()
        else:
            total = y.sum() * 0.0
        out["loss"] = total / (loss_normalizer if loss_normalizer else max(1, n))
        out["loss_sum"] = total.detach()
        out["count"] = torch.tensor(float(n))
        if batch.target_item_ids is not None:
            last = layout.is_history & (
                layout.item_pos + 1 == layout.history_lengths[layout.item_sample]
            )
            # every eval sample has >= 1 history item, so `last` selects exactly one row per sample
            out["query"] = self.normalize(gather_outputs(y, layout, last))
        return out

    @torch.no_grad()
    def item_embeddings(self, item_ids: torch.Tensor) -> torch.Tensor:
        """L2-normalised embeddings of ``item_ids`` (e.g. the whole corpus) via the item table."""
        emb = self.lookup(None, item_ids)
        return self.normalize(emb[EXTRA_ITEM_FEATURE].values())
