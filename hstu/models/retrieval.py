"""RetrievalGR: autoregressive next-item prediction with sampled softmax over negatives."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hstu.config.args import NEGATIVE_SAMPLING, NetworkArgs
from hstu.data.batch import Batch
from hstu.data.features import FeatureInfo
from hstu.embeddings.stack import EXTRA_ITEM_FEATURE, EmbeddingStack, SparseInput
from hstu.models.base import GenerativeRecommender, gather_outputs, normalize_loss
from hstu.modules.preprocessor import host_lengths, item_values, segment_ranges

__all__ = ["RetrievalGR", "NEGATIVE_SAMPLING", "NegativeSample"]


class NegativeSample(NamedTuple):
    """Random negatives of one training batch, ``num_negatives`` per supervised row."""

    lookup_ids: torch.Tensor  # item ids whose embeddings the batch looks up
    ids: torch.Tensor  # [R, K] sampled item id of each row's negatives
    index: torch.Tensor  # [R, K] position of each negative among the looked-up rows
    whole_corpus: bool  # lookup_ids is the whole corpus (index = corpus position)
    host_lookup_ids: torch.Tensor | None = None  # lookup_ids on the CPU, where known


class RetrievalGR(GenerativeRecommender):
    """Each history position predicts the next item.

    Query and item embeddings are L2-normalised; logits are cosine / temperature. Negatives:
    ``random`` (``num_negatives`` ids drawn uniformly, with replacement, from the item corpus for
    every supervised position separately, as Meta HSTU's "local" sampler), ``in_batch`` (the
    other positions' positives) or ``mixed`` (both). A negative equal to the positive is masked
    out.

    Per-row sampling costs no [rows, num_negatives, dim] tensor when the corpus is small: if
    ``corpus <= whole_corpus_rows`` (default ``num_negatives * dim``) the whole corpus is looked
    up once and each row's sampled logits are gathered from ``q @ corpus.T`` (same logits, fewer
    bytes); otherwise the distinct sampled ids are looked up and gathered per row (their count is
    read back from the GPU, so a CUDA graph of the step raises ``whole_corpus_rows`` instead:
    `hstu.training.step_graphs`).
    """

    uses_extra_items = True

    def __init__(
        self,
        info: FeatureInfo,
        net: NetworkArgs,
        embeddings: EmbeddingStack,
        *,
        item_corpus: torch.Tensor,
        num_negatives: int = 128,
        temperature: float = 0.05,
        negative_sampling: str = "random",
        reference_attention: bool = False,
    ) -> None:
        super().__init__(info, net, embeddings, reference_attention=reference_attention)
        if negative_sampling not in NEGATIVE_SAMPLING:
            raise ValueError(
                f"RetrievalArgs.negative_sampling={negative_sampling!r} is not supported: "
                f"one of {list(NEGATIVE_SAMPLING)}"
            )
        if item_corpus.numel() == 0:
            raise ValueError("the item corpus is empty: the dataset has no interactions")
        self.register_buffer("item_corpus", item_corpus.long().clone(), persistent=False)
        # the same ids on the CPU: the item table checks a whole-corpus lookup's ids there, not
        # by reading their min / max back from the GPU at every step
        self._host_corpus = item_corpus.detach().to("cpu", torch.int64).clone()
        self.num_negatives = num_negatives
        self.temperature = temperature
        self.negative_sampling = negative_sampling
        # corpora up to this many items are looked up whole (class docstring)
        self.whole_corpus_rows = num_negatives * self.hidden_size

    @staticmethod
    def normalize(x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), dim=-1, eps=1e-6)

    def _random_negatives(self) -> bool:
        """Whether the training forward draws negatives from the corpus."""
        return self.negative_sampling != "in_batch" and self.num_negatives > 0

    def _corpus_on_host(self) -> torch.Tensor | None:
        """The corpus ids on the CPU (None where the corpus was replaced without them)."""
        host = self._host_corpus
        return host if host.numel() == self.item_corpus.numel() else None

    def _sample_negatives(self, num_rows: int) -> NegativeSample | None:
        """Draws ``num_negatives`` corpus positions per supervised row (None without random
        negatives)."""
        if not self._random_negatives():
            return None
        corpus = self.item_corpus
        offsets = torch.randint(
            0, corpus.numel(), (num_rows, self.num_negatives), device=corpus.device
        )
        if corpus.numel() <= self.whole_corpus_rows:
            return NegativeSample(corpus, corpus[offsets], offsets, True, self._corpus_on_host())
        uniq, inverse = torch.unique(offsets, return_inverse=True)
        return NegativeSample(corpus[uniq], corpus[offsets], inverse, whole_corpus=False)

    def fixed_extra_ids(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The extra item ids (device, CPU) that every training forward looks up, known before
        it runs: the whole corpus with random negatives from a corpus of at most
        ``whole_corpus_rows`` items, none with in-batch negatives. Raises where they depend on
        the draw (the distinct sampled ids of a larger corpus)."""
        if not self._random_negatives():
            return None, None
        if self.item_corpus.numel() > self.whole_corpus_rows:
            raise RuntimeError(
                f"the negatives' ids of a corpus of {self.item_corpus.numel():,} items (more "
                f"than whole_corpus_rows={self.whole_corpus_rows:,}) are drawn in the forward"
            )
        return self.item_corpus, self._corpus_on_host()

    def _negative_logits(
        self, q: torch.Tensor, neg_emb: torch.Tensor, sample: NegativeSample
    ) -> torch.Tensor:
        """Cosine of each row's query with its own sampled negatives, [R, K] in fp32."""
        neg = self.normalize(neg_emb)
        with torch.autocast(q.device.type, enabled=False):
            if sample.whole_corpus:
                return (q @ neg.t()).gather(1, sample.index)
            return torch.einsum("rd,rkd->rk", q, neg[sample.index])

    def forward(
        self,
        batch: Batch,
        loss_normalizer: float | None = None,
        sparse_input: SparseInput | None = None,
    ) -> dict[str, torch.Tensor]:
        """Training: sampled-softmax loss over every (position -> next item) pair.

        With ``batch.target_item_ids`` set (evaluation), also returns the query embedding of each
        sample's last history position as ``query``.
        """
        host_history = host_lengths(batch).history
        w = batch.sample_weights
        if w is not None and (w.shape != (batch.batch_size,) or not w.is_floating_point()):
            raise ValueError(
                f"Batch.sample_weights must be float [B] = [{batch.batch_size}] (one weight per "
                f"sample); got {w.dtype} of shape {tuple(w.shape)}"
            )
        # supervised rows: history positions with a next history item (counted on the host)
        rows = int(torch.clamp(host_history - 1, min=0).sum())
        sampled = None
        if self.training:
            sampled = self._sample_negatives(rows)
        y, layout, item_emb, neg_emb = self.encode(
            batch,
            sampled.lookup_ids if sampled is not None else None,
            sparse_input,
            extra_host_ids=sampled.host_lookup_ids if sampled is not None else None,
            final_norm=False,  # applied to the rows read below (row by row: the same values)
        )
        ids = item_values(batch).to(y.device)
        out: dict[str, torch.Tensor] = {"num_tokens": torch.tensor(layout.num_tokens)}
        # position p predicts item p + 1 of the same sample: items [0, h - 1) of each sample
        starts = layout.item_offsets[:-1]
        src = segment_ranges(starts, torch.clamp(layout.history_lengths - 1, min=0), rows)
        q = self.normalize(self.encoder.final(gather_outputs(y, layout, src)))
        pos_ids = ids[src + 1]
        pos = self.normalize(item_emb[src + 1])
        pos_logit = (q * pos).sum(-1, keepdim=True) / self.temperature
        # padding samples (Batch.sample_weights 0, a graphed step's fixed shapes): their rows
        # count nothing and are no in-batch negatives of the others
        weights = None
        if batch.sample_weights is not None:
            sample_w = batch.sample_weights.to(y.device, torch.float32)
            weights = sample_w.index_select(0, layout.item_sample.index_select(0, src))
        logits = [pos_logit]
        if sampled is not None and neg_emb is not None and q.shape[0] > 0:
            neg_ids = sampled.ids
            if neg_ids.shape[0] != q.shape[0]:
                raise RuntimeError(
                    f"sampled negatives for {neg_ids.shape[0]} rows but the batch has "
                    f"{q.shape[0]} next-item positions"
                )
            neg_logit = self._negative_logits(q, neg_emb, sampled) / self.temperature
            neg_logit = neg_logit.masked_fill(pos_ids.view(-1, 1) == neg_ids, float("-inf"))
            logits.append(neg_logit)
        if self.negative_sampling in ("in_batch", "mixed") and self.training:
            ib_logit = q @ pos.t() / self.temperature
            same = pos_ids.view(-1, 1) == pos_ids.view(1, -1)
            if weights is not None:
                same = same | (weights == 0).view(1, -1)
            ib_logit = ib_logit.masked_fill(same, float("-inf"))
            logits.append(ib_logit)
        all_logits = torch.cat(logits, dim=1)
        n = all_logits.shape[0]
        if n > 0:
            per = -torch.log_softmax(all_logits, dim=1)[:, 0]
            total = per.sum() if weights is None else (per * weights).sum()
        else:
            total = y.sum() * 0.0
        out["loss"] = normalize_loss(total, loss_normalizer, max(1, n))
        out["loss_sum"] = total.detach()
        out["count"] = torch.tensor(float(n))
        if batch.target_item_ids is not None:
            # the last history item of each sample with one (every eval sample has >= 1 history
            # item, so this is exactly one row per sample)
            hist = layout.history_lengths
            last = segment_ranges(
                starts + hist - 1, (hist > 0).long(), int((host_history > 0).sum())
            )
            out["query"] = self.normalize(self.encoder.final(gather_outputs(y, layout, last)))
        return out

    @torch.no_grad()
    def item_embeddings(self, item_ids: torch.Tensor) -> torch.Tensor:
        """L2-normalised embeddings of ``item_ids`` (e.g. the whole corpus) via the item table."""
        emb = self.lookup(None, item_ids)
        return self.normalize(emb[EXTRA_ITEM_FEATURE].values())
