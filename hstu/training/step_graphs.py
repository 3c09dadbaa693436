"""CUDA graphs of the whole training step: forward, loss, backward and optimizer in one replay.

A small model's step (ML-1M: 2 layers of width 50, batch 128) issues ~550 kernels that take
~3 ms of GPU time, but the host needs ~10 ms to issue them (docs/benchmarks.md): graphing the
encoder alone (`hstu.modules.graphed_encoder`) leaves the embeddings, the preprocessor, the loss,
the autograd engine and the optimizer on the host. `StepGraphs` captures all of it, per batch
shape, and replays it with one launch; the host only pads the batch, lays out its indices with
NumPy and copies one buffer.

Shapes. A graph replays fixed shapes, so `pad_batch` gives every batch a shape from a small set:
its token count is rounded up to ``pad_sizes_per_octave`` counts per power of two
(`padded_token_count`, the same rounding as the encoder's graphs) by appending padding samples
(at least one, the sample count rounded up to a multiple of `SEQ_GRAIN`, none longer than the
batch's longest sample, so the longest sequence and the attention's scaling stay the batch's
own). Each padding sample repeats the batch's first item and carries
`Batch.sample_weights` 0: its loss terms are multiplied by 0 and it is no in-batch negative of
the others, so it adds nothing to the loss or to any gradient (the attention is per sequence,
every other op per row). `StepKey` = the padded sizes (samples, items, loss rows, values, the
layout buffer) + the bound of the longest sequence (`seqlen_bound`, which sizes the attention's
grid; the scaling 1 / longest sequence is read from device memory).

Inputs. Everything the step reads from the host travels in one int64 buffer per key, filled by
one non-blocking copy from pinned memory before each replay: the batch's features, lengths,
user ids, timestamps, sample weights, the preprocessor's index layout
(`SequencePreprocessor.host_index`, the same NumPy code as the eager step), the loss normalizer
and 1 / the longest sequence. While capturing, the preprocessor reads its layout from that
buffer (`StaticLayout`) instead of copying it. Random draws (negatives, dropout) come from
torch's graph-safe generators and the gating kernel's device-side seed: each replay draws fresh
ones. The learning rate is a device tensor that the scheduler fills (`graph_safe_optimizer`),
the optimizer is torch's capturable fused Adam, and the gradients are fixed tensors zeroed in
place after each step (never set to None: the graphs hold their addresses).

When. A key's first batch runs eagerly (padded, so that it computes what the graph computes;
it also creates the optimizer state); the second is captured (after one forward + backward on
the capture stream, whose gradients are zeroed again) and replayed; later ones replay. Captures
are counted and timed (`GraphStats`). A capture that fails turns the mode off for the run
(eager padded steps from then on). Applies to retrieval and ranking training with plain
embedding tables (trained by the dense optimizer or by `PlainTableOptimizer`), dynamic ones and
torchrec ones, Adam/AdamW, on CUDA, and for retrieval in-batch negatives or random ones
from a corpus of at most `WHOLE_CORPUS_ROWS` items (looked up whole:
`RetrievalGR.whole_corpus_rows`) (`step_graphs_unsupported` names what is missing); elsewhere
the encoder's graphs run.

Several processes. Without DDP: the trainer's step averages the dense gradients itself
(`hstu.training.distributed.FlatGradients`: one all-reduce of a flat buffer that the gradients
are views of, after the backward), so the collective is captured with the step and every replay
launches it. Every rank issues the same collectives per step whichever way its step runs
(replay, capture, eager); the warm-up pass before a capture has none. Sharded dynamic and
torchrec tables exchange ids and rows between ranks outside the graph (below): the lookup before
the replay sends the ids to their owner ranks and brings the rows back, the update after it
sends the gradients to the owners. So that the order of the collectives is the same on every
rank, every step of such a run is split at the tables (``split_eager``: a key's first, eager
step, and the trainer's own eager step for a batch the graphs do not take or after a failed
capture): the rows' exchange, the gradients' all-reduce, the gradients' exchange. The trainer's
`SparseDistPipeline` starts the gloo exchange of the padded batch's dynamic-table ids (and the
corpus, for random negatives) a step ahead (`start_input_dist`).

Dynamic and torchrec tables. A graph cannot replay a dynamic table's lookup with the step: the
lookup inserts and touches ids, and the capture's warm-up forward would do it a second time; a
torchrec table's lookup and fused update run fbgemm kernels behind torchrec's Python, which a
capture does not take either. So the step is split at the looked-up rows: before the replay
the tables look the batch up as an eager step would (`EmbeddingStack.lookup_sparse`: the same
ids, the whole corpus for random negatives (`fixed_extra_ids`); dynamic tables through their
own lookup graphs), and the rows are copied into fixed leaf tensors of the key
(`_Entry.staged`); the graph's forward reads those (`EmbeddingStack.stage_sparse` while
capturing) and its backward leaves their gradients in fixed tensors; after the replay the
looked-up rows' backward runs the tables' fused updates with those gradients, which are zeroed
for the next replay. The dense optimizer steps inside the graph and the table updates after it:
they touch different tensors, so the step computes what the eager one does (a CPU test checks
a step split this way bit for bit). A capture that fails after the lookup finishes its step
eagerly from the looked-up rows. Not taken: dynamic tables with host storage
(`storage="hybrid"`), the 'custom' eviction policy (its scores come with the ids), and
Adam-trained item tables with random negatives from a corpus larger than the model's own
``whole_corpus_rows`` (looking the whole corpus up, Adam would move rows that got no
gradient). For a large model the host is hidden anyway and each key's activations stay in the
graphs' pool: the benchmark ranking model keeps the encoder's graphs (docs/benchmarks.md).

Ranking. A ranking batch's candidates are padded too: the padding samples carry candidates
(at least one each, no more than the batch's largest count) so that the candidate count is a
`padded_token_count` size as well (`StepKey.loss_rows` = candidates), with label 0; the
candidates' loss terms are multiplied by their sample's weight (`RankingGR`), so the loss, the
per-task losses and the gradients are those of the real batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu.data.batch import ACTION_FEATURE, ITEM_FEATURE, Batch
from hstu.embeddings.stack import SparseInput
from hstu.graph_capture import release_generator
from hstu.modules.graphed_encoder import SEQ_GRAIN, GraphStats, seqlen_bound
from hstu.modules.preprocessor import StaticLayout, host_lengths, padded_token_count

__all__ = [
    "WHOLE_CORPUS_ROWS",
    "PaddedBatch",
    "StepGraphs",
    "StepKey",
    "StepOutputs",
    "float_learning_rates",
    "graph_safe_optimizer",
    "pad_batch",
    "stage_copies",
    "staged",
    "step_graphs_unsupported",
    "update_tables",
]

logger = logging.getLogger(__name__)

# a step function: (device batch, loss normalizer) -> `StepOutputs`; it runs forward, backward,
# clipping, the optimizer step and zeroes the gradients in place
StepFn = Callable[[Batch, "float | torch.Tensor"], "StepOutputs"]


@dataclass
class StepOutputs:
    """What a training step reports, device tensors: the loss sum (float64 [1]), the gradient
    norm (None without clipping) and ranking's per-task losses (None for retrieval)."""

    loss_sum: torch.Tensor
    grad_norm: torch.Tensor | None = None
    task_losses: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        """The fields in order (not `dataclasses.astuple`: that deep-copies each tensor, one
        more device copy apiece)."""
        return [self.loss_sum, self.grad_norm, self.task_losses]

    def clone(self) -> StepOutputs:
        return StepOutputs(*(None if t is None else t.clone() for t in self.tensors()))


@dataclass(frozen=True)
class StepKey:
    """The shapes a graph of the step replays (module docstring, "Shapes")."""

    samples: int
    items: int
    loss_rows: int
    values: int
    index: int
    seqlen_bound: int
    timestamps: bool


@dataclass
class PaddedBatch:
    """A CPU batch padded to a `StepKey`, with what the step reports about the real batch."""

    batch: Batch
    key: StepKey
    max_seqlen: int  # the real batch's longest sequence (contextual tokens included)
    real_lengths: torch.Tensor  # token lengths of the real sequences (FLOP accounting)
    real_tokens: int
    index: np.ndarray | None = None  # the preprocessor's layout of ``batch`` (`host_index`)


def _fill(total: int, caps: np.ndarray) -> np.ndarray | None:
    """``total`` split over slots of at most ``caps`` each, as evenly as the caps allow (water
    filling, the fullest slots first in order); None when it does not fit."""
    if total > int(caps.sum()):
        return None
    out = np.zeros(caps.shape[0], dtype=np.int64)
    left = int(total)
    for k, i in enumerate(np.argsort(caps, kind="stable")):
        take = min(int(caps[i]), -(-left // (caps.shape[0] - k)))
        out[i] = take
        left -= take
    return out


def _padding_lengths(
    history: np.ndarray, candidates: np.ndarray, f: int, pad_sizes_per_octave: int
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(padded sample count, each padding sample's history and candidate counts) that bring the
    batch's tokens to a `padded_token_count` size (and, with candidates, its candidate count to
    one too), or None. Each padding sample has >= 1 history item (and >= 1 candidate where the
    batch has candidates), no more history or candidates than the batch's largest, and no more
    items than its longest sample."""
    b = int(history.shape[0])
    items = history + candidates
    real_tokens = int(items.sum()) + b * f
    cap = int(items.max())
    hmax, cmax = int(history.max()), int(candidates.max())
    total_cand = int(candidates.sum())
    first = -(-(b + 1) // SEQ_GRAIN) * SEQ_GRAIN
    for samples in range(first, first + 64 * SEQ_GRAIN, SEQ_GRAIN):
        extra = samples - b
        pad_cand = 0
        if cmax > 0:
            pad_cand = padded_token_count(total_cand + extra, pad_sizes_per_octave) - total_cand
            if pad_cand > extra * cmax:
                continue
        cand = _fill(pad_cand, np.full(extra, cmax, dtype=np.int64))
        if cand is None or (cmax > 0 and int(cand.min()) < 1):
            continue
        hist_caps = np.minimum(hmax, cap - cand)
        if int(hist_caps.min()) < 1:
            continue
        base = real_tokens + extra * f + pad_cand
        rows = padded_token_count(base + extra, pad_sizes_per_octave)
        hist = _fill(rows - base - extra, hist_caps - 1)
        if hist is None:
            continue
        return samples, hist + 1, cand
    return None


def pad_batch(host: Batch, *, num_contextual: int, pad_sizes_per_octave: int) -> PaddedBatch | None:
    """``host`` (a CPU training batch: retrieval, or ranking with its candidates and labels) with
    padding samples appended so that its shapes are those of a `StepKey` (module docstring;
    ``index`` 0 until the caller lays the batch out); None for a batch that a step graph does
    not take (evaluation targets, weights already set, no items, candidates without labels)."""
    if host.target_item_ids is not None:
        return None
    if host.sample_weights is not None or not host.is_on_cpu:
        return None
    lengths = host_lengths(host)
    hist_real = lengths.history.numpy().astype(np.int64)
    cand_real = lengths.candidates.numpy().astype(np.int64)
    ranking = bool((cand_real > 0).any())
    if ranking != (host.labels is not None):
        return None  # candidates without labels, or labels without candidates
    b = int(hist_real.shape[0])
    if b == 0 or int(lengths.items.sum()) == 0:
        return None
    f = int(num_contextual)
    found = _padding_lengths(hist_real, cand_real, f, pad_sizes_per_octave)
    if found is None:
        return None
    samples, pad_hist, pad_cand = found
    extra = samples - b
    pad_items = pad_hist + pad_cand

    kjt = host.features
    keys = list(kjt.keys())
    ctx_names = set(host.contextual_feature_names)
    if ITEM_FEATURE not in keys or ACTION_FEATURE not in keys:
        return None
    values, lens = kjt.values(), kjt.lengths()
    offsets, counts = kjt.offset_per_key(), kjt.length_per_key()
    first_item = values[offsets[keys.index(ITEM_FEATURE)]]
    new_values, new_lengths, new_counts = [], [], []
    for k, name in enumerate(keys):
        v = values[offsets[k] : offsets[k] + counts[k]]
        ln = lens[k * b : (k + 1) * b]
        if name in ctx_names:
            pad_v = v[:1].expand(extra)  # the first sample's value (each sample has one)
            pad_l = torch.ones(extra, dtype=ln.dtype)
        elif name == ITEM_FEATURE:
            pad_v = first_item.expand(int(pad_items.sum()))
            pad_l = torch.from_numpy(pad_items).to(ln.dtype)
        elif name == ACTION_FEATURE:
            pad_v = torch.zeros(int(pad_hist.sum()), dtype=v.dtype)
            pad_l = torch.from_numpy(pad_hist).to(ln.dtype)
        else:
            return None  # a feature whose padding this function does not know
        new_values += [v, pad_v.to(v.dtype)]
        new_lengths += [ln, pad_l]
        new_counts.append(counts[k] + int(pad_l.sum()))
    new_offsets = [0]
    for c in new_counts:
        new_offsets.append(new_offsets[-1] + c)
    features = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(new_values),
        lengths=torch.cat(new_lengths),
        stride=samples,
        length_per_key=new_counts,
        offset_per_key=new_offsets,
    )
    timestamps = None
    if host.timestamps is not None:
        ts = host.timestamps
        timestamps = torch.cat([ts, ts[:1].expand(int(pad_items.sum()))])  # one time: no gaps
    labels = None
    if ranking:
        labels = torch.cat([host.labels, host.labels.new_zeros(int(pad_cand.sum()))])
    weights = torch.cat([torch.ones(b), torch.zeros(extra)]).to(torch.float32)
    padded = Batch(
        features=features,
        contextual_feature_names=list(host.contextual_feature_names),
        num_candidates=torch.cat(
            [host.num_candidates, torch.from_numpy(pad_cand).to(host.num_candidates.dtype)]
        ),
        user_ids=torch.cat([host.user_ids, host.user_ids[:1].expand(extra)]),
        labels=labels,
        timestamps=timestamps,
        sample_weights=weights,
        global_counts=host.global_counts,
    )
    if ranking:
        loss_rows = int(cand_real.sum() + pad_cand.sum())  # one row per candidate
    else:
        hist = np.concatenate([hist_real, pad_hist])
        loss_rows = int(np.maximum(hist - 1, 0).sum())
    real = torch.from_numpy(lengths.items.numpy().astype(np.int64) + f)
    key = StepKey(
        samples=samples,
        items=int(lengths.items.sum()) + int(pad_items.sum()),
        loss_rows=loss_rows,
        values=int(features.values().numel()),
        index=0,
        seqlen_bound=seqlen_bound(int(real.max())),
        timestamps=timestamps is not None,
    )
    return PaddedBatch(
        batch=padded,
        key=key,
        max_seqlen=int(real.max()),
        real_lengths=real,
        real_tokens=int(real.sum()),
    )


# A graphed step looks the whole item corpus up for random negatives up to this many items (the
# logits are those of the distinct sampled ids, `RetrievalGR`; [loss rows, corpus] floats of
# scores a step), so that no count is read back from the GPU
WHOLE_CORPUS_ROWS = 16384


def step_graphs_unsupported(model, optimizer_str: str, task: str) -> str:
    """Why the whole training step of ``model`` cannot be graphed ("" when it can), on one
    process or several."""
    if task not in ("retrieval", "ranking"):
        return f"the {task} task (step graphs: retrieval, ranking)"
    emb = model.embeddings
    tables = getattr(emb.dynamic_collection, "tables", None) or {}
    for table in tables.values():
        if table.config.storage != "hbm":
            return (
                f"dynamic table {table.config.name!r} with storage={table.config.storage!r} "
                "(step graphs: dynamic tables in HBM)"
            )
        if table.config.eviction_policy == "custom":
            return (
                f"dynamic table {table.config.name!r} with eviction_policy='custom' (its scores "
                "come with the batch's ids; the graphed step's lookup takes ids alone)"
            )
    if getattr(model.encoder, "graphs", None) is None:
        return "layers without the compiled attention"
    if str(optimizer_str).lower() not in ("adam", "adamw"):
        return f"OptimizerArgs.optimizer_str={optimizer_str!r} (step graphs: adam, adamw)"
    sampling = getattr(model, "negative_sampling", "in_batch")  # ranking: no negatives
    if sampling != "in_batch" and model.num_negatives > 0:
        corpus = model.item_corpus.numel()
        if corpus > max(model.whole_corpus_rows, WHOLE_CORPUS_ROWS):
            return (
                f"random negatives from a corpus of more than {WHOLE_CORPUS_ROWS:,} items (their "
                "distinct ids are counted on the GPU)"
            )
        item = [
            t.config.optimizer for t in tables.values() if ITEM_FEATURE in t.config.feature_names
        ]
        if not item and emb.embedding_collection is not None:  # a torchrec item table
            item = [emb.args.sparse_optimizer_str]
        if corpus > model.whole_corpus_rows and item == ["adam"]:
            return (
                "random negatives with an item table trained by the sparse Adam (a graphed step "
                "looks the whole corpus up, and Adam would move the rows that got no gradient)"
            )
    return ""


def graph_safe_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Makes ``optimizer`` (fused Adam / AdamW) capturable: ``capturable=True`` and each group's
    learning rate a device tensor that the scheduler fills in place (``initial_lr`` stays a
    float, so the scheduler computes on the host). Call again after loading a state dict."""
    for group in optimizer.param_groups:
        lr = group["lr"]
        value = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
        group.setdefault("initial_lr", value)
        if isinstance(group["initial_lr"], torch.Tensor):
            group["initial_lr"] = float(group["initial_lr"].item())
        group["lr"] = torch.tensor(value, dtype=torch.float32, device=device)
        group["capturable"] = True


def float_learning_rates(state: dict) -> dict:
    """An optimizer or scheduler ``state_dict()`` with tensor learning rates as floats (a
    checkpoint of a graphed run then loads into any run; the dicts are copies)."""
    state = dict(state)
    if "param_groups" in state:
        state["param_groups"] = [
            {k: float(v) if k == "lr" and isinstance(v, torch.Tensor) else v for k, v in g.items()}
            for g in state["param_groups"]
        ]
    if "_last_lr" in state:
        state["_last_lr"] = [
            float(v) if isinstance(v, torch.Tensor) else v for v in state["_last_lr"]
        ]
    return state


@dataclass
class _Entry:
    key: StepKey
    buffer: torch.Tensor  # int64, every input of the step (module docstring, "Inputs")
    graph: torch.cuda.CUDAGraph | None = None
    outputs: StepOutputs | None = None
    sizes: list[int] = dataclasses.field(default_factory=list)  # the buffer's parts
    # rows the graph reads, named as `EmbeddingStack.lookup_sparse` names them (dynamic table,
    # torchrec:<feature>): leaves with their gradients (module docstring, "Dynamic and torchrec
    # tables")
    staged: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def stage_copies(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the dynamic and torchrec tables' looked-up ``rows`` that the model reads
    instead (leaves that collect the rows' gradients)."""
    return {n: r.detach().clone().requires_grad_(r.requires_grad) for n, r in rows.items()}


@contextlib.contextmanager
def staged(embeddings, rows: dict[str, torch.Tensor]):
    """Inside the block the model's training lookups read copies of the dynamic and torchrec
    tables' looked-up ``rows`` (`stage_copies`, `EmbeddingStack.stage_sparse`); yields the
    copies, whose gradients then update the tables (`update_tables`)."""
    leaves = stage_copies(rows)
    embeddings.stage_sparse(leaves or None)
    try:
        yield leaves
    finally:
        embeddings.stage_sparse(None)


def update_tables(rows: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]) -> None:
    """The tables' fused updates: the backward of the looked-up ``rows`` with the gradients
    that their ``leaves`` collected."""
    pairs = [(rows[n], leaf.grad) for n, leaf in leaves.items() if leaf.grad is not None]
    pairs = [(r, g) for r, g in pairs if r.requires_grad]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])


def _zero_grads(leaves: dict[str, torch.Tensor]) -> None:
    """Zeroes the gradients that the staged ``leaves`` collected (in place: a graph holds them)."""
    for leaf in leaves.values():
        if leaf.grad is not None:
            leaf.grad.zero_()


_NOT_PREPARED = object()  # a batch `StepGraphs.prepare` has not seen


def _float_bits(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).view(np.int64)


class StepGraphs:
    """CUDA graphs of the training step, one per `StepKey` (module docstring).

    ``step_fn(batch, normalizer)``: the trainer's step on a device batch (forward, backward,
    clipping, optimizer, gradients zeroed in place); ``model``: the retrieval or ranking model
    (its preprocessor lays out the batches); ``params``: the parameters whose gradients the graphs
    hold; ``max_graphs``: graphs kept at most (later keys run eagerly); ``split_eager``: the
    eager steps, too, look the dynamic and torchrec tables up first and update them last
    (several processes: module docstring, "Several processes")."""

    def __init__(
        self,
        model,
        step_fn: StepFn,
        params: list[torch.nn.Parameter],
        device: torch.device,
        *,
        autocast: Callable[[], contextlib.AbstractContextManager],
        pad_sizes_per_octave: int = 8,
        max_graphs: int = 64,
        split_eager: bool = False,
    ) -> None:
        self.model = model
        # the encoder runs inside the step's graphs, not from graphs of its own; random
        # negatives come from the whole corpus (no count of distinct ids read back)
        model.encoder.graphs = None
        if hasattr(model, "whole_corpus_rows"):  # retrieval
            model.whole_corpus_rows = max(model.whole_corpus_rows, WHOLE_CORPUS_ROWS)
        self.step_fn = step_fn
        self.params = list(params)
        self.device = torch.device(device)
        self.autocast = autocast
        self.pad_sizes_per_octave = int(pad_sizes_per_octave)
        self.max_graphs = int(max_graphs)
        self.stats = GraphStats()
        # dynamic and torchrec tables: looked up before each replay, updated after it ("Dynamic
        # tables")
        emb = model.embeddings
        self._sparse = emb.has_sparse_tables
        self.split_eager = bool(split_eager) and self._sparse
        self._seen: dict[StepKey, int] = {}
        self._entries: dict[StepKey, _Entry] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._grad_ptrs: tuple[int, ...] = ()

    # ---- padding and inputs --------------------------------------------------------------------
    def prepare(self, host: Batch) -> None:
        """Pads and lays out CPU batch ``host`` ahead of its step, kept in ``host.host_memo``
        for `step` (the trainer calls this on the batch-prefetch thread, so the padding and the
        index layout overlap the GPU's work on the steps before). Once the graphs are disabled,
        the model's own host preparation instead (its eager step reads that)."""
        if self.stats.disabled:
            self.model.prepare_host(host, self.device)
        else:
            host.host_memo[self._memo_key] = self.pad(host)

    @property
    def _memo_key(self) -> tuple:
        return ("step_graphs", id(self), self.pad_sizes_per_octave)

    def _padded(self, host: Batch) -> PaddedBatch | None:
        """``host`` padded by `prepare` ahead of its step (taken out of its memo), else now."""
        memo = host.host_memo.pop(self._memo_key, _NOT_PREPARED)
        return self.pad(host) if memo is _NOT_PREPARED else memo

    def pad(self, host: Batch) -> PaddedBatch | None:
        """``host`` padded to its key, laid out by the model's preprocessor (None: not taken)."""
        pre = self.model.preprocessor
        padded = pad_batch(
            host, num_contextual=pre.num_contextual, pad_sizes_per_octave=self.pad_sizes_per_octave
        )
        if padded is not None:
            padded.index = pre.host_index(padded.batch, self.device)
            padded.key = dataclasses.replace(padded.key, index=int(padded.index.shape[0]))
        return padded

    def _host_inputs(self, padded: PaddedBatch, normalizer: float) -> list[np.ndarray]:
        """The step's inputs as int64 arrays, in the order of `_views` (``padded`` from `pad`)."""
        b = padded.batch
        parts = [
            b.features.values().numpy(),
            b.features.lengths().numpy(),
            b.num_candidates.numpy(),
            b.user_ids.numpy(),
            b.timestamps.numpy() if b.timestamps is not None else np.zeros(0, np.int64),
            b.sample_weights.numpy().astype(np.int64),  # 0 / 1
            b.labels.numpy() if b.labels is not None else np.zeros(0, np.int64),
            padded.index,
            _float_bits([normalizer, 1.0 / padded.max_seqlen]),
        ]
        return [p.astype(np.int64, copy=False) for p in parts]

    def _views(self, entry: _Entry, padded: PaddedBatch, sizes: list[int], ids_only=False):
        """The device batch (views of the entry's buffer), normalizer and `StaticLayout`;
        ``ids_only``: the batch alone, without its sample weights (for a lookup: no device
        work)."""
        values, lengths, cands, users, ts, weights, labels, index, scalars = torch.split(
            entry.buffer, sizes
        )
        host = padded.batch
        kjt = host.features
        features = KeyedJaggedTensor(
            keys=list(kjt.keys()),
            values=values,
            lengths=lengths,
            stride=host.batch_size,
            length_per_key=kjt.length_per_key(),
            offset_per_key=kjt.offset_per_key(),
        )
        batch = Batch(
            features=features,
            contextual_feature_names=list(host.contextual_feature_names),
            num_candidates=cands,
            user_ids=users,
            labels=labels if host.labels is not None else None,
            timestamps=ts if host.timestamps is not None else None,
            sample_weights=None if ids_only else weights.to(torch.float32),
            host=host,
        )
        if ids_only:
            return batch, None, None
        floats = scalars.view(torch.float64).to(torch.float32)
        static = StaticLayout(
            index=index, seqlen_bound=entry.key.seqlen_bound, inv_max_seqlen=floats[1:2]
        )
        return batch, floats[0], static

    # ---- the step ------------------------------------------------------------------------------
    def step(self, host: Batch, normalizer: float, sparse_input: SparseInput | None = None):
        """Runs the training step of ``host`` (a CPU batch): from a graph where one is held (or
        due), else eagerly on the padded batch. Returns (`StepOutputs`, the real sequences'
        token lengths, the real token count), or None for a batch that cannot
        be padded (the caller runs it eagerly as it is). ``sparse_input``: the input dist of the
        padded batch's dynamic-table ids, started ahead (`start_input_dist`; several
        processes)."""
        if self.stats.disabled and not self.split_eager:
            return None
        padded = self._padded(host)
        if padded is None:
            return None
        if self.stats.disabled:
            # several processes: the batch's input dist was started for its padded ids
            return self._eager(padded, normalizer, sparse_input=sparse_input)
        key = padded.key
        entry = self._entries.get(key)
        if entry is not None and self._grad_ptrs != self._grad_addresses():
            self.reset()  # gradients were replaced: the graphs would write stale addresses
            entry = None
        rows: dict[str, torch.Tensor] = {}
        if entry is None:
            seen = self._seen.get(key, 0) + 1
            self._seen[key] = seen
            if seen < 2 or len(self._entries) >= self.max_graphs:
                return self._eager(padded, normalizer, sparse_input=sparse_input)
            entry, rows = self._capture(padded, normalizer, sparse_input)
            if entry is None:
                # the tables looked this batch up already (rows) or not: the step goes on
                # from those rows (a second lookup would count and touch its ids twice)
                if rows:
                    return self._eager(padded, normalizer, rows)
                return self._eager(padded, normalizer, sparse_input=sparse_input)
        else:
            # a replay runs none of the lookup's Python: its id checks here, on the host
            self.model.embeddings.check_host_ids(padded.batch)
            self._load(entry, self._host_inputs(padded, normalizer))
            with record_function("hstu/step_graphs/table_lookup"):
                rows = self._lookup_sparse(entry, padded, sparse_input)
        with record_function("hstu/step_graphs/replay"):
            entry.graph.replay()
        self.stats.replays += 1
        with record_function("hstu/step_graphs/table_update"):
            self._update_sparse(entry, rows)
        # outputs live in the graphs' pool, which the next replay reuses: copy them out now
        outputs = entry.outputs.clone()
        return outputs, padded.real_lengths, padded.real_tokens

    def _eager(
        self,
        padded: PaddedBatch,
        normalizer: float,
        rows: dict[str, torch.Tensor] | None = None,
        sparse_input: SparseInput | None = None,
    ):
        """The step of ``padded`` op by op, on the stream the captures use: autograd then
        creates the parameters' gradient accumulators on that stream, as the captures need.
        ``rows``: the dynamic and torchrec tables' rows of this batch, looked up already (the
        model reads copies of them, whose gradients then update the tables); without them and
        with `split_eager` the step looks them up first (with ``sparse_input``)."""
        self.stats.eager += 1
        pinned = padded.batch.pin_memory()
        current = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            batch = pinned.to(self.device, non_blocking=True)
            if rows is None and self.split_eager:
                rows = self.lookup_sparse(batch, sparse_input)
            rows = rows or {}
            with staged(self.model.embeddings, rows) as leaves:
                outputs = self.step_fn(batch, normalizer)
        current.wait_stream(side)
        update_tables(rows, leaves)
        for t in outputs.tensors():
            if t is not None:
                t.record_stream(current)
        return outputs, padded.real_lengths, padded.real_tokens

    # ---- dynamic and torchrec tables ----------------------------------------------------------
    def _lookup_sparse(
        self, entry: _Entry, padded: PaddedBatch, sparse_input: SparseInput | None = None
    ) -> dict[str, torch.Tensor]:
        """The dynamic and torchrec tables' training lookups of the batch in ``entry``'s buffer
        (loaded), their rows copied into the rows the graph reads; returns the looked-up rows
        (their backward updates the tables: `_update_sparse`)."""
        if not self._sparse:
            return {}
        batch, _, _ = self._views(entry, padded, entry.sizes, ids_only=True)
        rows = self.lookup_sparse(batch, sparse_input)
        if entry.staged:
            with torch.no_grad():
                for name, r in rows.items():
                    entry.staged[name].copy_(r)
        return rows

    def lookup_sparse(
        self, batch: Batch, sparse_input: SparseInput | None = None
    ) -> dict[str, torch.Tensor]:
        """The dynamic and torchrec tables' training lookups of device ``batch`` (+ the model's
        fixed extra ids), named as `EmbeddingStack.lookup_sparse` names them; ``sparse_input``:
        the input dist of their dynamic-table ids started ahead (`start_input_dist`)."""
        extra, extra_host = self.model.fixed_extra_ids()
        with torch.enable_grad():
            return self.model.embeddings.lookup_sparse(batch, extra, extra_host, sparse_input)

    def start_input_dist(self, host: Batch) -> SparseInput | None:
        """Starts the input dist of the ids that the step of CPU ``host`` will look up
        (`EmbeddingStack.start_input_dist`): those of its padded batch and the model's fixed
        extra ids, or of ``host`` itself where the graphs do not take it. The trainer's
        `SparseDistPipeline` calls it a step ahead (several processes with sharded dynamic
        tables); the padding is then kept for the step (made now where `prepare` did not)."""
        memo = host.host_memo.get(self._memo_key, _NOT_PREPARED)
        if memo is _NOT_PREPARED:
            memo = host.host_memo[self._memo_key] = self.pad(host)
        _, extra_host = self.model.fixed_extra_ids()
        target = host if memo is None else memo.batch
        return self.model.embeddings.start_input_dist(target, extra_host)

    @staticmethod
    def _update_sparse(entry: _Entry, rows: dict[str, torch.Tensor]) -> None:
        """The fused updates of the looked-up ``rows`` with the gradients the replay left in the
        staged rows, which are zeroed for the next replay."""
        update_tables(rows, entry.staged)
        _zero_grads(entry.staged)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    @staticmethod
    def _load(entry: _Entry, parts: list[np.ndarray]) -> None:
        """``parts`` (`_host_inputs`) into the entry's device buffer: one non-blocking copy."""
        n = sum(p.shape[0] for p in parts)
        if n != entry.buffer.numel():
            raise RuntimeError(
                f"step graph inputs: {n} values for a buffer of {entry.buffer.numel()} "
                f"(key {entry.key})"
            )
        pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
        np.concatenate(parts, out=pinned.numpy())
        entry.buffer.copy_(pinned, non_blocking=True)

    def _grad_addresses(self) -> tuple[int, ...]:
        return tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in self.params)

    def reset(self) -> None:
        """Drops every graph (captured again on demand)."""
        if self._entries:
            self.stats.resets += 1
        self._drop()

    def release(self) -> None:
        """Drops every graph and waits for the device: the trainer's close, before the process
        group goes (a graph that holds a collective, `FlatGradients`' all-reduce, keeps NCCL's
        communicator in use; destroying the group first waits forever)."""
        self._drop()
        torch.cuda.synchronize(self.device)

    def _drop(self) -> None:
        """Destroys the graphs now, not when Python collects them (the last reference may sit in
        a cycle), and forgets the keys seen."""
        for entry in self._entries.values():
            if entry.graph is not None:
                entry.graph.reset()
        self._entries.clear()
        self._seen.clear()
        self._pool = None
        self.stats.graphs = 0

    def disable(self, reason: str) -> None:
        if not self.stats.disabled:
            logger.warning("CUDA graphs of the training step are off: %s", reason)
        self.stats.disabled = reason
        self.reset()

    # ---- capture -------------------------------------------------------------------------------
    def _capture(
        self, padded: PaddedBatch, normalizer: float, sparse_input: SparseInput | None = None
    ) -> tuple[_Entry | None, dict[str, torch.Tensor]]:
        """(the captured entry, with its buffer loaded; the dynamic and torchrec tables' rows
        looked up for this batch), or (None, rows looked up before the failure, if any) with
        the mode off."""
        rows: dict[str, torch.Tensor] = {}
        try:
            return self._capture_once(padded, normalizer, rows, sparse_input), rows
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, say why
            logger.warning("CUDA graphs of the step: the capture failed", exc_info=True)
            torch.cuda.synchronize(self.device)
            release_generator(self.device)
            self.disable(f"capturing failed ({type(exc).__name__}: {exc})")
            return None, rows

    def _capture_once(
        self,
        padded: PaddedBatch,
        normalizer: float,
        rows: dict[str, torch.Tensor],
        sparse_input: SparseInput | None = None,
    ) -> _Entry:
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        key = padded.key
        if any(p.grad is None for p in self.params):
            # the eager steps zero the gradients in place, so they exist after the first one
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        parts = self._host_inputs(padded, normalizer)
        sizes = [p.shape[0] for p in parts]
        entry = _Entry(
            key, torch.empty(sum(sizes), dtype=torch.int64, device=self.device), sizes=sizes
        )
        self._load(entry, parts)
        # this step's dynamic and torchrec lookups, before the capture (which reads their rows,
        # staged)
        rows.update(self._lookup_sparse(entry, padded, sparse_input))
        entry.staged = stage_copies(rows)
        for leaf in entry.staged.values():
            if leaf.requires_grad:
                leaf.grad = torch.zeros_like(leaf)  # a fixed tensor the graph accumulates into
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pre = self.model.preprocessor
        embeddings = self.model.embeddings
        current = torch.cuda.current_stream(self.device)
        side = self._side_stream()
        side.wait_stream(current)
        try:
            embeddings.stage_sparse(entry.staged or None)
            with torch.cuda.stream(side):
                # kernel setup and cuBLAS workspaces on this stream, outside the capture: one
                # forward + backward whose gradients are zeroed again (no optimizer step)
                batch, norm, static = self._views(entry, padded, sizes)
                pre.static = static
                with self.autocast():
                    out = self.model(batch, loss_normalizer=norm)
                out["loss"].backward()
                del out
                for p in self.params:
                    p.grad.zero_()
                _zero_grads(entry.staged)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    batch, norm, static = self._views(entry, padded, sizes)
                    pre.static = static
                    outputs = self.step_fn(batch, norm)
                finally:
                    graph.capture_end()
        finally:
            pre.static = None
            embeddings.stage_sparse(None)
            current.wait_stream(side)
        entry.graph, entry.outputs = graph, outputs
        torch.cuda.synchronize(self.device)
        self._entries[key] = entry
        self._grad_ptrs = self._grad_addresses()
        took = time.perf_counter() - start
        note = (
            f"samples={key.samples} items={key.items} loss_rows={key.loss_rows} "
            f"seqlen<={key.seqlen_bound} ({len(self._entries)} held)"
        )
        self.stats.record_capture(note, took, len(self._entries))
        logger.info("CUDA graphs of the step: captured %s in %.2f s", note, took)
        return entry
