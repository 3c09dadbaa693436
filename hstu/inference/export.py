"""Export of a retrieval checkpoint into a self-contained inference artifact.

`export_retrieval` loads the checkpoint as `Retriever.from_checkpoint` does (any world size),
freezes the embedding tables to plain tensors and traces the query encoder with `torch.export`:

- ``model.pt2``: the `torch.export` program of `DenseQueryEncoder`: a batch of users laid out
  densely (each user's contextual tokens, then its last L = max_history_seqlen items, padded
  after) -> one L2-normalised query per user. The frozen item and contextual tables are its
  constants, so it needs no embedding library. The batch dimension is dynamic.
- ``tables.pt``: the corpus ids (sorted) with their L2-normalised embeddings (the scoring side),
  the frozen item rows' ids, and the dataset's users with their contextual feature ids.
- ``config.gin``: the resolved configuration the model was trained with (for people).
- ``manifest.json``: format version, library versions, the source checkpoint, the model's
  fixed sizes and a sha256 and size of every file.

`hstu.inference.artifact.RetrievalArtifact` loads it with torch alone. The dense layout gives
the same numbers as the training-time forward: padding tokens come after every real token, so
the causal mask keeps them out of the real tokens' attention; the attention scaling takes the
batch's longest sequence from the lengths (the model's default `scaling_seqlen`); the last
history token's query time in the relative time bias is the request time, as in evaluation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hstu
from hstu.data.batch import ITEM_FEATURE
from hstu.embeddings.stack import EXTRA_ITEM_FEATURE
from hstu.inference.artifact import ARTIFACT_FORMAT, ARTIFACT_VERSION, FILES
from hstu.inference.requests import UserHistory
from hstu.inference.retriever import CheckpointModel, Retriever, locate_checkpoint
from hstu.ops import reference

__all__ = ["DenseQueryEncoder", "DenseRanker", "export_checkpoint", "export_retrieval"]

logger = logging.getLogger(__name__)


class _DenseHSTU(nn.Module):
    """The shared part of the exported programs: a trained model's input tokens and layers over
    a dense batch layout (each user's contextual tokens, then its item tokens, padded after),
    with the item and contextual tables frozen in as constants."""

    def __init__(
        self,
        model: nn.Module,
        max_history: int,
        item_rows: torch.Tensor,
        contextual_rows: list[torch.Tensor],
    ) -> None:
        super().__init__()
        pre = model.preprocessor
        enc = model.encoder
        for layer in enc.layers:
            if layer.attention_type != "hstu":
                raise ValueError(
                    f"export supports the HSTU attention only; this model's layers run "
                    f"NetworkArgs.attention_type={layer.attention_type!r}"
                )
        self.max_history = int(max_history)
        self.num_contextual = len(contextual_rows)
        self.item_table = nn.Parameter(item_rows.detach().float().clone(), requires_grad=False)
        self.ctx_tables = nn.ParameterList(
            [nn.Parameter(t.detach().float().clone(), requires_grad=False) for t in contextual_rows]
        )
        self.item_scale = float(pre.item_scale)
        self.max_positions = int(pre.max_positions)
        self.position = nn.Parameter(
            pre.position_embedding.weight.detach().float().clone(), requires_grad=False
        )
        self.history = nn.Parameter(pre.history_embedding.detach().float().clone(), False)
        self.action = nn.Parameter(pre.action_embedding.detach().float().clone(), False)
        self.num_action_bits = int(pre.num_action_bits)
        self.layers = enc.layers
        self.final_norm = enc.final_norm
        self.uses_time = any(
            layer.relative_bias is not None and layer.relative_bias.uses_time
            for layer in enc.layers
        )
        nb = 0
        for layer in enc.layers:
            rel = layer.relative_bias
            if rel is not None and getattr(rel, "time_weight", None) is not None:
                nb = rel.time_weight.shape[1] - 1
        self.register_buffer(
            "time_edges",
            reference.time_bucket_edges(nb) if nb else torch.ones(1, dtype=torch.int64),
            persistent=False,
        )

    def _action_tokens(self, actions: torch.Tensor) -> torch.Tensor:
        bits = (actions.unsqueeze(-1) >> torch.arange(self.num_action_bits)) & 1
        return bits.float() @ self.action

    def _items(self, rows: torch.Tensor) -> torch.Tensor:
        items = F.embedding(rows, self.item_table)
        return items * self.item_scale if self.item_scale != 1.0 else items

    def _history_tokens(self, item_rows, lengths, actions) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, L, D] history tokens as the preprocessor builds them, zero past each length;
        [B, L] bool real)."""
        pos = torch.arange(self.max_history)
        real = pos.view(1, -1) < lengths.view(-1, 1)
        tok = self._items(item_rows) + self.position[pos.clamp(max=self.max_positions - 1)]
        tok = tok + (self._action_tokens(actions) + self.history)
        return tok * real.unsqueeze(-1), real

    def _contexts(self, ctx_rows: torch.Tensor) -> list[torch.Tensor]:
        return [F.embedding(ctx_rows[:, i], t).unsqueeze(1) for i, t in enumerate(self.ctx_tables)]

    def _rab(self, layer, qt, timestamps, n):
        """[B or 1, Hw, N, N] relative bias: query i compares its query time qt[:, i]."""
        rel = layer.relative_bias
        pos = torch.arange(n)
        out = None
        pos_w = getattr(rel, "pos_weight", None)
        if pos_w is not None:
            rel_pos = (pos.view(1, n) - pos.view(n, 1)).clamp(-rel.max_pos, rel.max_pos)
            out = F.embedding(rel_pos + rel.max_pos, pos_w.float().t()).permute(2, 0, 1)
            out = out.unsqueeze(0)  # [1, Hw, N, N]
        time_w = getattr(rel, "time_weight", None)
        if time_w is not None:
            gaps = qt.unsqueeze(2) - timestamps.unsqueeze(1)  # [B, N, N]
            buckets = reference.time_buckets(gaps, self.time_edges)
            t = F.embedding(buckets, time_w.float().t()).permute(0, 3, 1, 2)
            out = t if out is None else out + t
        return out

    def _encode(self, x, ts, qt, seq_len, num_targets=None) -> torch.Tensor:
        """The layers and the final norm over dense tokens x [B, N, D] (times ts, query times
        qt [B, N]); sequence b holds seq_len[b] tokens, its contextual ones first, its last
        num_targets[b] tokens targets."""
        b, n = x.shape[0], x.shape[1]
        f = self.num_contextual
        contexts = torch.full_like(seq_len, f) if f else None
        longest = seq_len.max().float()
        masks: dict[tuple[int, int], torch.Tensor] = {}
        for layer in self.layers:
            key = (int(layer.target_group_size), int(layer.window_size))
            if key not in masks:
                masks[key] = reference.hstu_attention_mask(
                    seq_len, n, contexts, num_targets, key[0], key[1]
                ).unsqueeze(1)  # [B, 1, N, N]
            h, d = layer.num_heads, layer.head_dim
            z = F.silu(layer.uvqk(layer.input_norm(x)))
            u, v, q, k = torch.split(z, h * d, dim=-1)
            q, k, v = (t.reshape(b, n, h, d).transpose(1, 2) for t in (q, k, v))
            alpha = layer.alpha if layer.alpha is not None else d**-0.5
            scores = torch.matmul(q, k.transpose(-1, -2)) * alpha
            if layer.relative_bias is not None:
                scores = scores + self._rab(layer, qt, ts, n)
            scale = longest if layer.scaling_seqlen is None else float(layer.scaling_seqlen)
            attn = F.silu(scores) * masks[key] / scale
            a = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, h * d)
            x = x + layer.out_proj(layer.attn_norm(a) * u)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x


class DenseQueryEncoder(_DenseHSTU):
    """The retrieval query of a trained model over a dense batch layout (module docstring).

    forward(item_rows [B, L], lengths [B], actions [B, L], ctx_rows [B, F], timestamps [B, L],
    query_time [B]) -> [B, D] float32 queries. ``item_rows`` index the frozen item table,
    ``ctx_rows`` the contextual tables (column f: feature f); positions past a user's length are
    ignored. ``timestamps`` / ``query_time`` matter only with a relative time bias."""

    def __init__(
        self,
        retriever: Retriever,
        item_rows: torch.Tensor,
        contextual_rows: list[torch.Tensor],
    ) -> None:
        super().__init__(retriever.model, retriever.max_history, item_rows, contextual_rows)
        self.float()
        self.eval()

    def forward(
        self,
        item_rows: torch.Tensor,
        lengths: torch.Tensor,
        actions: torch.Tensor,
        ctx_rows: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: torch.Tensor,
    ) -> torch.Tensor:
        b = item_rows.shape[0]
        f = self.num_contextual
        tok, real = self._history_tokens(item_rows, lengths, actions)
        parts = self._contexts(ctx_rows)
        x = torch.cat([*parts, tok], dim=1) if parts else tok  # [B, N, D]
        n = x.shape[1]
        seq_len = lengths + f
        # contextual tokens take the first item's time, padding tokens the request time
        first = timestamps[:, :1].expand(b, f)
        ts = torch.cat([first, torch.where(real, timestamps, query_time.view(-1, 1))], dim=1)
        # query time of token i: the next token's, the request time for the last real token
        pos = torch.arange(n)
        nxt = torch.cat([ts[:, 1:], query_time.view(-1, 1)], dim=1)
        qt = torch.where(pos.view(1, n) == (seq_len - 1).view(-1, 1), query_time.view(-1, 1), nxt)
        y = self._encode(x, ts, qt, seq_len)
        last = y[torch.arange(b), seq_len - 1]
        return F.normalize(last.float(), dim=-1, eps=1e-6)


class DenseRanker(_DenseHSTU):
    """A trained ranking model over a dense batch layout: each user's contextual tokens, its
    last L history items, then its candidates (the trailing targets), padded after.

    forward(item_rows [B, L], lengths [B], actions [B, L], ctx_rows [B, F], timestamps [B, L],
    cand_rows [B, C], cand_counts [B], cand_times [B, C]) -> logits [B, C, num_tasks] (rows
    past a user's count are meaningless). Computes what the model's forward on history +
    candidates computes: the candidates' position is the history length, the last token queries
    the time bias at its own time."""

    def __init__(
        self,
        ranker,
        item_rows: torch.Tensor,
        contextual_rows: list[torch.Tensor],
    ) -> None:
        super().__init__(ranker.model, ranker.max_history, item_rows, contextual_rows)
        self.head = ranker.model.head
        self.float()
        self.eval()

    def forward(
        self,
        item_rows: torch.Tensor,
        lengths: torch.Tensor,
        actions: torch.Tensor,
        ctx_rows: torch.Tensor,
        timestamps: torch.Tensor,
        cand_rows: torch.Tensor,
        cand_counts: torch.Tensor,
        cand_times: torch.Tensor,
    ) -> torch.Tensor:
        b, c = cand_rows.shape
        f, lmax = self.num_contextual, self.max_history
        hist, real = self._history_tokens(item_rows, lengths, actions)
        cpos = torch.arange(c)
        is_cand = cpos.view(1, c) < cand_counts.view(-1, 1)  # [B, C]
        cand = self._items(cand_rows) + self.position[
            lengths.clamp(max=self.max_positions - 1)
        ].unsqueeze(1)
        cand = cand * is_cand.unsqueeze(-1)
        # token slots: contexts [0, f), history [f, f + l), candidates [f + l, f + l + n)
        n = f + lmax + c
        slots = (f + lengths).view(-1, 1) + cpos.view(1, c)  # [B, C]
        x = torch.zeros(b, n, hist.shape[-1], dtype=hist.dtype)
        if f:
            x = x.index_copy(1, torch.arange(f), torch.cat(self._contexts(ctx_rows), dim=1))
        x = x.index_copy(1, torch.arange(f, f + lmax), hist)
        x = x.scatter_add(1, slots.unsqueeze(-1).expand(b, c, hist.shape[-1]), cand)
        seq_len = f + lengths + cand_counts
        # times: contexts take the first item's, padding 0 (masked)
        ts = torch.zeros(b, n, dtype=torch.int64)
        if f:
            ts = ts.index_copy(1, torch.arange(f), timestamps[:, :1].expand(b, f))
        ts = ts.index_copy(1, torch.arange(f, f + lmax), timestamps * real)
        ts = ts.scatter_add(1, slots, cand_times * is_cand)
        pos = torch.arange(n)
        nxt = torch.cat([ts[:, 1:], ts[:, -1:]], dim=1)
        qt = torch.where(pos.view(1, n) == (seq_len - 1).view(-1, 1), ts, nxt)
        y = self._encode(x, ts, qt, seq_len, cand_counts)
        rows = y.gather(1, slots.unsqueeze(-1).expand(b, c, y.shape[-1]))  # [B, C, D]
        return self.head(rows).float()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _contextual_rows(retriever: CheckpointModel) -> list[torch.Tensor]:
    """Every row of each contextual table (ids 0 .. cardinality - 1), in feature order."""
    model, data = retriever.model, retriever.data
    names = list(model.contextual_names)
    cards = dict(zip(data.user_feature_names, data.user_feature_cardinalities))
    if not names:
        return []
    n = max(int(cards[name]) for name in names)
    item = int(retriever.corpus[0])
    users = [
        UserHistory(
            user_id=-1,
            items=[item],
            features={name: min(i, int(cards[name]) - 1) for name in data.user_feature_names},
        )
        for i in range(n)
    ]
    batch = retriever.make_batch(users).to(retriever.device)
    with torch.no_grad():
        emb = model.embeddings(batch)
    return [emb[name].values()[: int(cards[name])].float().cpu() for name in names]


def _item_rows(model: CheckpointModel, chunk: int = 65536) -> torch.Tensor:
    """The raw (not normalised) item table rows of the corpus, in corpus order."""
    parts = []
    with torch.no_grad():
        for s in range(0, model.corpus.numel(), chunk):
            ids = model.corpus[s : s + chunk]
            if isinstance(model, Retriever):
                emb = model.model.lookup(None, ids.to(model.device))
                parts.append(emb[EXTRA_ITEM_FEATURE].values().float().cpu())
            else:  # a ranking model has no extra-id feature: the ids as users' histories
                zeros = {name: 0 for name in model.data.user_feature_names}
                step = model.max_history
                users = [
                    UserHistory(user_id=-1, items=ids[j : j + step].tolist(), features=zeros)
                    for j in range(0, ids.numel(), step)
                ]
                emb = model.model.embeddings(model.make_batch(users).to(model.device))
                parts.append(emb[ITEM_FEATURE].values().float().cpu())
    return torch.cat(parts)


def export_retrieval(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config_file: str | os.PathLike | None = None,
    bindings: tuple[str, ...] | list[str] = (),
    overwrite: bool = False,
) -> Path:
    """`export_checkpoint` of a retrieval checkpoint (refuses another task)."""
    return export_checkpoint(
        checkpoint, out, config_file=config_file, bindings=bindings, overwrite=overwrite,
        task="retrieval",
    )  # fmt: skip


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config_file: str | os.PathLike | None = None,
    bindings: tuple[str, ...] | list[str] = (),
    overwrite: bool = False,
    task: str | None = None,
) -> Path:
    """Writes the artifact of ``checkpoint`` (a run directory, checkpoint root or step
    directory of a retrieval or ranking run) to ``out``; returns ``out``. Written into a
    staging directory first and moved into place at the end, so a failed export leaves no
    partial artifact. ``task``: the task the checkpoint must hold (None: either)."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty: choose another --out or pass --overwrite"
        )
    start = time.perf_counter()
    found = locate_checkpoint(checkpoint, config_file)[3]
    if task is not None and found != task:
        raise ValueError(f"checkpoint {checkpoint} holds a {found} model, not a {task} model")
    if found == "ranking":
        from hstu.inference.ranker import Ranker

        loaded: CheckpointModel = Ranker.from_checkpoint(
            checkpoint, "cpu", config_file=config_file, bindings=bindings
        )
    else:
        loaded = Retriever.from_checkpoint(
            checkpoint, "cpu", config_file=config_file, bindings=bindings
        )
    net = loaded.cfg.network
    item_rows, ctx_rows = _item_rows(loaded), _contextual_rows(loaded)
    names = list(loaded.model.contextual_names)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    data = loaded.data
    user_ids = np.asarray(data.user_ids, dtype=np.int64)
    order = np.argsort(user_ids, kind="stable")
    feats = np.asarray(data.user_features, dtype=np.int64).reshape(len(user_ids), -1)
    name_index = [list(data.user_feature_names).index(n) for n in names]
    tables = {
        "corpus": loaded.corpus.clone(),
        "user_ids": torch.from_numpy(user_ids[order].copy()),
        "user_features": torch.from_numpy(feats[order][:, name_index].copy()),
    }
    # the history inputs both programs take, batch-sized along dim 0
    dynamic = {k: {0: batch} for k in ("item_rows", "lengths", "actions", "ctx_rows", "timestamps")}
    if found == "ranking":
        model: _DenseHSTU = DenseRanker(loaded, item_rows, ctx_rows)
        example = _example_inputs(model, batch=2)[:5] + _example_candidates(batch=2, count=3)
        cands = torch.export.Dim("candidates", min=1, max=1 << 16)
        dynamic.update(
            cand_rows={0: batch, 1: cands},
            cand_counts={0: batch},
            cand_times={0: batch, 1: cands},
        )
        extra = {"num_tasks": int(loaded.model.num_tasks)}
    else:
        model = DenseQueryEncoder(loaded, item_rows, ctx_rows)
        example = _example_inputs(model, batch=2)
        dynamic.update(query_time={0: batch})
        tables["corpus_embeddings"] = loaded.corpus_embeddings().float().cpu().clone()
        extra = {}
    with torch.no_grad():
        program = torch.export.export(model, example, dynamic_shapes=dynamic)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        torch.export.save(program, str(stage / FILES["model"]))
        torch.save(tables, stage / FILES["tables"])
        run_config = _run_config(loaded, config_file)
        if run_config is not None:
            shutil.copyfile(run_config, stage / FILES["config"])
        manifest: dict[str, Any] = {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "task": found,
            "hstu_version": hstu.__version__,
            "torch_version": torch.__version__,
            "created_unix": int(time.time()),
            "source": {
                "checkpoint": str(loaded.checkpoint),
                "step": loaded.step,
                "dataset": data.name,
            },
            "model": {
                "max_history": model.max_history,
                "hidden_size": int(net.hidden_size),
                "contextual_features": names,
                "contextual_cardinalities": [int(t.shape[0]) for t in model.ctx_tables],
                "time_bias": bool(model.uses_time),
                "use_contextual_features": bool(net.use_contextual_features),
                "corpus_size": int(loaded.corpus.numel()),
                **extra,
            },
            "files": {
                name: {"sha256": _sha256(stage / name), "bytes": (stage / name).stat().st_size}
                for name in sorted(p.name for p in stage.iterdir())
            },
        }
        (stage / FILES["manifest"]).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    logger.info(
        "exported %s (%s, step %d) to %s in %.1f s", loaded.checkpoint, found, loaded.step, out,
        time.perf_counter() - start,
    )  # fmt: skip
    return out


def _run_config(loaded: CheckpointModel, config_file) -> Path | None:
    if config_file is not None:
        return Path(config_file)
    from hstu.inference.retriever import find_run_config

    return find_run_config(Path(loaded.checkpoint))


def _example_candidates(batch: int, count: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(batch, count, dtype=torch.int64),
        torch.tensor([count] + [1] * (batch - 1), dtype=torch.int64),
        torch.arange(count, dtype=torch.int64).repeat(batch, 1),
    )


def _example_inputs(model: _DenseHSTU, batch: int) -> tuple[torch.Tensor, ...]:
    lmax = model.max_history
    lengths = torch.tensor([lmax] + [max(1, lmax // 2)] * (batch - 1), dtype=torch.int64)
    return (
        torch.zeros(batch, lmax, dtype=torch.int64),
        lengths,
        torch.zeros(batch, lmax, dtype=torch.int64),
        torch.zeros(batch, model.num_contextual, dtype=torch.int64),
        torch.arange(lmax, dtype=torch.int64).repeat(batch, 1),
        torch.full((batch,), lmax, dtype=torch.int64),
    )
