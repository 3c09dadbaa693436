"""RankingGR: multi-task ranking of candidates given the user's history and context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstu.config.args import NetworkArgs
from hstu.data.batch import Batch
from hstu.data.features import FeatureInfo
from hstu.embeddings.stack import EmbeddingStack, SparseInput
from hstu.models.base import GenerativeRecommender, gather_outputs, normalize_loss
from hstu.modules.heads import MLPHead
from hstu.modules.preprocessor import padded_token_count

__all__ = ["RankingGR", "label_bits"]


def label_bits(labels: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Action bitmask [N] -> float targets [N, num_tasks]."""
    shifts = torch.arange(num_tasks, device=labels.device)
    return ((labels.long().view(-1, 1) >> shifts) & 1).float()


class RankingGR(GenerativeRecommender):
    """Candidates are the trailing target tokens; an MLP maps each to one logit per task."""

    def __init__(
        self,
        info: FeatureInfo,
        net: NetworkArgs,
        embeddings: EmbeddingStack,
        *,
        num_tasks: int,
        head_hidden: list[int],
        head_dropout: float = 0.0,
        task_weights: list[float] | None = None,
        reference_attention: bool = False,
    ) -> None:
        super().__init__(info, net, embeddings, reference_attention=reference_attention)
        self.num_tasks = num_tasks
        self.head = MLPHead(self.hidden_size, list(head_hidden), num_tasks, head_dropout)
        weights = torch.tensor(task_weights if task_weights else [1.0] * num_tasks)
        if weights.numel() != num_tasks:
            raise ValueError(
                f"RankingArgs.task_weights has {weights.numel()} entries, expected num_tasks={num_tasks}"
            )
        self.register_buffer("task_weights", weights, persistent=False)

    def forward(
        self,
        batch: Batch,
        loss_normalizer: float | None = None,
        sparse_input: SparseInput | None = None,
    ) -> dict[str, torch.Tensor]:
        """Returns logits [N_cand, T], labels, per-task losses and the loss: task-weighted BCE
        summed over tasks and candidates, divided by ``loss_normalizer`` (default: the number of
        candidates here; the trainer passes global count / world size so that data-parallel
        gradient averaging gives exactly the global mean). ``Batch.sample_weights`` (padding
        samples of a graphed training step: 0) multiply each candidate's loss terms by its
        sample's weight; the per-task losses are then means over the weighted candidates."""
        # the final norm on the candidates' rows only (row by row: the same values)
        y, layout, _, _ = self.encode(batch, sparse_input=sparse_input, final_norm=False)
        index = layout.candidate_index
        n_cand = index.numel()
        if y.shape[0] > layout.num_tokens and n_cand > 0:
            # the tokens were padded (NetworkArgs.pad_tokens): pad the head's rows too, with
            # copies of candidate 0 whose logits are dropped, so its matmul shapes repeat as well
            extra = padded_token_count(n_cand) - n_cand
            index = torch.cat([index, index.new_full((extra,), 0)]) if extra else index
        logits = self.head(self.encoder.final(gather_outputs(y, layout, index))).float()[:n_cand]
        out = {"logits": logits, "num_tokens": torch.tensor(layout.num_tokens)}
        if batch.labels is not None:
            targets = label_bits(batch.labels, self.num_tasks)
            per = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")  # [N, T]
            n = max(1, per.shape[0])
            weights = self._candidate_weights(batch, per.shape[0])
            if weights is None:
                task_losses = per.sum(0) / n
            else:
                per = per * weights.unsqueeze(1)
                task_losses = per.sum(0) / weights.sum().clamp(min=1.0)
            out["labels"] = batch.labels
            out["task_losses"] = task_losses.detach()
            total = (per * self.task_weights).sum()
            out["loss"] = normalize_loss(total, loss_normalizer, n)
            out["loss_sum"] = total.detach()
            out["count"] = torch.tensor(float(per.shape[0]))
        return out

    @staticmethod
    def _candidate_weights(batch: Batch, n_cand: int) -> torch.Tensor | None:
        """[N_cand] float32 weight of each candidate (its sample's), or None without weights."""
        w = batch.sample_weights
        if w is None:
            return None
        if w.dtype != torch.float32 or w.shape != (batch.batch_size,):
            raise ValueError(
                f"Batch.sample_weights must be float32 [{batch.batch_size}] (one per sample), "
                f"got {w.dtype} {tuple(w.shape)}"
            )
        counts = batch.num_candidates.to(w.device)
        # output_size from the host: no read back of the counts' sum
        return torch.repeat_interleave(w, counts, output_size=n_cand)
