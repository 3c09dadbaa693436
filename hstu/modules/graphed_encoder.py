"""CUDA graphs of the HSTU encoder's training forward and backward, one pair per input shape.

A small model issues hundreds of short kernels per step and the host's per-operator cost, not
the GPU, sets the step time (docs/benchmarks.md). `EncoderGraphs` captures the encoder's forward
and its backward (`torch.autograd.grad` of the output with respect to the input and every
parameter) into two CUDA graphs and afterwards replays them: one launch each instead of every
layer's operators.

Shapes. A graph replays fixed shapes and fixed kernel arguments, so a graph is keyed by `GraphKey`:
the token rows (the preprocessor already rounds them, `padded_token_count`), the number of
sequences rounded up to a multiple of `SEQ_GRAIN` (the extra ones are empty), an upper bound of the
longest sequence (the next power of two, at least 64: it sizes the attention grid; blocks past a
sequence's end exit at once) and which optional inputs are present. A batch whose key has no graph
replays one of the same rows and inputs with more sequence slots or a larger bound where one exists
(`_covering`), so a token count is captured again only for a longer bound or more sequences than
any of its graphs holds. The batch's own values travel through device memory that the graph reads:
the jagged offsets, contextual and target counts, timestamps, the last query times and 1 / the
longest sequence (`AttentionInputs.inv_max_seqlen`, the attention's default scaling, which the
kernel reads at run time). Dropout masks are drawn inside the graph (torch's generators and the
gating kernel's device-side seed, `layer_norm_mul_dropout.draw_seed_tensor`), so each replay draws
fresh ones.

The compiled attention op validates its metadata on every eager call; a replay cannot, so
`run` checks each batch's host copy of the metadata (`AttentionInputs.host_*`) against the key
before replaying and runs the encoder eagerly, with the op's own checks, when it does not fit.

Memory. All graphs capture into one memory pool and are replayed strictly as forward then
backward of one key, so their temporaries share memory; a call while a replay still waits for
its backward (the encoder called twice before one backward) runs eagerly. A capture's eager
warm-up passes allocate in that pool too once graphs hold it (`_warmup_allocations`), so the
capture reuses the blocks its warm-up freed; the first capture's warm-up runs in the ordinary
pool, whose cached blocks are released before the capture. Warm-up and capture differentiate with
respect to fresh leaves over the parameters' storage (`fresh_parameter_leaves`), never through a
gradient accumulator that an earlier step's graph keeps alive. The input, the output
and the gradients of every key are views of three shared buffers: the output's gradient and the
input's share one (the backward graph reads the first at its start and writes the second at its
end), the output keeps its own (code after the encoder may read it after the backward). They
grow to `BUFFER_HEADROOM` times the rows of a larger shape when one arrives: every graph is
dropped and captured again, and the dropped graphs' pool goes back to the device at once (a
replay's autograd node lets go of its graphs after its backward, so an output kept from an
earlier step does not hold them; `reset` empties the allocator's cache). The parameter gradients
land in one shared buffer per parameter (the fused layers' projection weight GEMMs write theirs
there directly, `weight_grads_into`; the rest are copied there at the end of the backward
graph): the persistent cost is those buffers, not a copy per key.

When. A key is captured the first time it is seen, while fewer than `max_graphs` exist; otherwise
the step runs eagerly. Capturing at first sight keeps a large model's steps out of the ordinary
pool: an eager step of a new shape would hold a whole step's activations there beside the graphs'
pool (a second copy of the activations; docs/benchmarks.md measured 54.8 GB reserved against
24.2 GB eager when keys were captured the second time they were seen). After each capture the
allocator's cached free blocks of the ordinary pool go back to the device (the first capture's
warm-up passes ran there; later ones run in the graphs' pool, "Memory"): the graphs' own pool
holds what a replay needs. Captures are counted and
timed (`stats`) so that logs and benchmarks can report them apart from the steady state.
Training only (evaluation runs the encoder eagerly), on one CUDA process or several: under DDP
each rank captures and replays its own graphs (their keys follow its own share of the batch) and
the backward replay returns every parameter's gradient to autograd at once, where DDP's hooks
start the gradient all-reduce; nothing inside a graph communicates.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from hstu.graph_capture import GraphStats, release_generator
from hstu.modules import fused_hstu_layer
from hstu.modules.attention_inputs import AttentionInputs

__all__ = [
    "GRAPH_PAD_SIZES_PER_OCTAVE",
    "EncoderGraphs",
    "fresh_parameter_leaves",
    "GraphKey",
    "GraphStats",
    "SEQ_GRAIN",
    "seqlen_bound",
]

logger = logging.getLogger(__name__)

# default token counts per power of two that the preprocessor pads to for a call the encoder may
# replay (`NetworkArgs.cuda_graph_pad_sizes`; one graph pair per count; `PAD_SIZES_PER_OCTAVE`
# otherwise): the benchmark model's ~28k-token batches meet ~9 counts at 8, ~60 at 32
GRAPH_PAD_SIZES_PER_OCTAVE = 8
SEQ_GRAIN = 8  # sequences per key rounded up to a multiple of this (empty sequences fill up)
MIN_SEQLEN_BOUND = 64  # the attention kernels' smallest query tile
# shared buffers grow to this multiple of the rows that outgrew them. Growing drops every graph
# (captured again at first sight; the old pool goes back to the device, `reset`). The benchmark
# model's batches spanned 18k-45k rows in one run, mean ~29k; on its timed batches 1.25 held
# 26.85 GB of device memory at the peak against 29.97 GB with 1.5 (docs/benchmarks.md)
BUFFER_HEADROOM = 1.25
# the allocator's calls that route a thread's allocations to a graphs' pool (`_warmup_allocations`)
_POOL_ROUTING = (
    "_cuda_beginAllocateCurrentThreadToPool",
    "_cuda_endAllocateToPool",
    "_cuda_releasePool",
)


def seqlen_bound(max_seqlen: int) -> int:
    """The attention grid's bound for a batch whose longest sequence is ``max_seqlen``: the next
    power of two, at least `MIN_SEQLEN_BOUND`."""
    return max(MIN_SEQLEN_BOUND, 1 << max(0, int(max_seqlen) - 1).bit_length())


@dataclass(frozen=True)
class GraphKey:
    rows: int
    hidden: int
    dtype: torch.dtype
    num_seqs: int  # sequences in the static metadata (a multiple of SEQ_GRAIN)
    seqlen_bound: int
    contexts: bool
    targets: bool
    timestamps: bool
    last_query_time: bool
    input_grad: bool
    autocast: tuple[bool, torch.dtype]


@dataclass
class _Entry:
    key: GraphKey
    offsets: torch.Tensor
    contexts: torch.Tensor | None
    targets: torch.Tensor | None
    timestamps: torch.Tensor | None
    last_query_time: torch.Tensor | None
    inv_max_seqlen: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    # the output's gradient going in, the input's coming out (module docstring "Memory")
    grad: torch.Tensor
    used: list[bool] = field(default_factory=list)  # per parameter: has a gradient
    fwd: torch.cuda.CUDAGraph | None = None
    bwd: torch.cuda.CUDAGraph | None = None


class _Replay(torch.autograd.Function):
    """The captured forward as one autograd node; its backward replays the captured backward."""

    @staticmethod
    def forward(ctx, runner: EncoderGraphs, entry: _Entry, x: torch.Tensor, *params):  # type: ignore[override]
        entry.x.copy_(x)
        entry.fwd.replay()
        ctx.runner, ctx.entry = runner, entry
        # the replay's activations stay in the pool until this node's backward
        runner._pending = weakref.ref(ctx)
        return entry.y.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):  # type: ignore[override]
        runner, entry = ctx.runner, ctx.entry
        runner._pending = None
        entry.grad.copy_(grad_y)
        entry.bwd.replay()
        grads = []
        for p, used, buf in zip(runner.params, entry.used, runner.param_grads):
            if not used:
                grads.append(None)
            elif p.grad is None:
                # detached: autograd installs the buffer as p.grad without a copy; the next
                # replay writes it again, after the optimizer has consumed and dropped it
                grads.append(buf.detach())
            else:  # accumulating into an existing gradient: hand over a copy
                grads.append(buf.clone())
        grad_x = entry.grad.detach() if entry.key.input_grad else None
        # the node outlives its backward while its output is referenced (a trainer's last loss):
        # without these references it no longer keeps dropped graphs and their pool alive
        ctx.runner = ctx.entry = None
        return (None, None, grad_x, *grads)


@contextlib.contextmanager
def fresh_parameter_leaves(module: nn.Module, params: list[torch.Tensor]):
    """Within the block, ``module``'s parameters among ``params`` are fresh leaf tensors that share
    their storage (yielded in the order of ``params``; a parameter two modules share gets one).
    A capture differentiates with respect to these, so its autograd graph reaches no gradient
    accumulator made earlier: one that a previous step's graph keeps alive (its output or loss
    still referenced) belongs to the stream it was made on, and the backward would make that
    stream wait on an event recorded inside the capture, which invalidates the capture."""
    fresh = {id(p): p.detach().requires_grad_(p.requires_grad) for p in params}
    swapped = []
    try:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in fresh:
                    mod._parameters[name] = fresh[id(p)]
                    swapped.append((mod, name, p))
        yield [fresh[id(p)] for p in params]
    finally:
        for mod, name, p in reversed(swapped):
            mod._parameters[name] = p


class _IntoBuffer(torch.autograd.Function):
    """``y`` copied into ``buf`` as an autograd identity: the result is ``buf`` (a view of it), so
    nothing holds ``y`` afterwards unless its own node saved it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, buf: torch.Tensor):  # type: ignore[override]
        buf.copy_(y)
        return buf

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class EncoderGraphs:
    """CUDA graphs of an encoder's training forward + backward (module docstring).

    The encoder hands itself to every call: ``encoder.forward_eager(x, attn)`` is its own
    forward (the layers; the final norm runs outside the graphs, on the rows the model reads).
    ``max_graphs``: graph pairs kept at most;
    ``min_uses``: how often a shape is seen before it is captured; ``warmup``: eager forward +
    backward passes before a capture; ``pad_sizes_per_octave``: token counts per power of two
    that a graphed call's tokens are padded to (fewer: fewer graphs, more padding rows)."""

    def __init__(
        self,
        *,
        max_graphs: int = 64,
        min_uses: int = 1,
        warmup: int = 1,
        pad_sizes_per_octave: int = GRAPH_PAD_SIZES_PER_OCTAVE,
    ) -> None:
        if max_graphs < 1 or min_uses < 1 or warmup < 1:
            raise ValueError(
                f"EncoderGraphs: max_graphs, min_uses and warmup must be >= 1; got {max_graphs}, "
                f"{min_uses}, {warmup}"
            )
        if pad_sizes_per_octave < 1 or pad_sizes_per_octave & (pad_sizes_per_octave - 1):
            raise ValueError(
                "NetworkArgs.cuda_graph_pad_sizes must be a power of two (token counts per power "
                f"of two that a graphed call pads to); got {pad_sizes_per_octave}"
            )
        self.max_graphs = int(max_graphs)
        # token counts per power of two that the preprocessor pads a graphed call to
        self.pad_sizes_per_octave = int(pad_sizes_per_octave)
        self.min_uses = int(min_uses)
        self.warmup = int(warmup)
        self.stats = GraphStats()
        self._seen: dict[GraphKey, int] = {}
        self._entries: dict[GraphKey, _Entry] = {}
        self._cover: dict[GraphKey, GraphKey] = {}  # keys without a graph -> the one they replay
        self._pool = None
        self._rows_capacity = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self.params: list[nn.Parameter] = []
        self.param_grads: list[torch.Tensor] = []
        self._param_ptrs: tuple[int, ...] = ()
        self._stream: torch.cuda.Stream | None = None
        # the last forward replay's autograd node while its backward has not run (`run`)
        self._pending: weakref.ref | None = None
        self._warned_routing = False  # `_warmup_allocations` said once that torch lacks it

    # ---- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drops every graph and buffer (they are captured again on demand); the graphs' pool
        goes back to the device once no pending replay holds its graphs."""
        if self._entries:
            self.stats.resets += 1
        held_pool = self._pool is not None
        self._entries.clear()
        self._cover.clear()
        self._seen.clear()
        self._buffers.clear()
        self._rows_capacity = 0
        self.params, self.param_grads, self._param_ptrs = [], [], ()
        self._pool = None
        self.stats.graphs = 0
        if (
            held_pool
            and torch.cuda.is_initialized()
            and not torch.cuda.is_current_stream_capturing()
        ):
            # a dropped pool's blocks stay reserved until the allocator's cache is emptied: the
            # buffers' regrowth would otherwise hold the old pool beside the new one
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _settings(self) -> dict:
        return dict(
            max_graphs=self.max_graphs,
            min_uses=self.min_uses,
            warmup=self.warmup,
            pad_sizes_per_octave=self.pad_sizes_per_octave,
        )

    # copies and pickles of a model start without graphs (they hold device state)
    def __getstate__(self) -> dict:
        return self._settings()

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __deepcopy__(self, memo) -> EncoderGraphs:
        return EncoderGraphs(**self._settings())

    def _disable(self, reason: str) -> None:
        if not self.stats.disabled:
            logger.warning("CUDA graphs of the encoder are off: %s; it runs eagerly", reason)
        self.stats.disabled = reason
        self.reset()

    # ---- dispatch ------------------------------------------------------------------------------
    def applies(self, encoder: nn.Module, device: torch.device) -> bool:
        """Whether a call on ``device`` may use graphs: CUDA, training with gradients, not
        inside another capture."""
        if self.stats.disabled or torch.device(device).type != "cuda":
            return False
        if not (encoder.training and torch.is_grad_enabled()):
            return False
        # Under DDP (several ranks) too: the graphs hold no collective; the backward replay hands
        # every parameter's gradient to autograd at its end, where DDP's hooks reduce them
        return not torch.cuda.is_current_stream_capturing()

    def run(self, encoder: nn.Module, x: torch.Tensor, attn: AttentionInputs) -> torch.Tensor:
        """``encoder``'s forward of (x, attn) from a graph where one applies (captured first
        if due), else eagerly."""
        # off CUDA (which `applies` keeps away; a caller that skips it) the step runs eagerly
        key = self._key(x, attn) if x.device.type == "cuda" else None
        if key is None or not self._fits(key, x, attn) or self._replay_pending():
            self.stats.eager += 1
            return encoder.forward_eager(x, attn)
        entry = self._entries.get(key) or self._covering(key)
        why = "first seen"
        if entry is not None and self._param_ptrs != tuple(p.data_ptr() for p in self.params):
            self.reset()  # parameters were replaced (e.g. moved): the graphs read stale addresses
            entry, why = None, "parameters moved"
        if entry is None:
            seen = self._seen.get(key, 0) + 1
            self._seen[key] = seen
            if seen < self.min_uses or len(self._entries) >= self.max_graphs:
                self.stats.eager += 1
                return encoder.forward_eager(x, attn)
            entry = self._capture(encoder, key, x, attn, why)
            if entry is None:
                self.stats.eager += 1
                return encoder.forward_eager(x, attn)
        self._load(entry, x, attn)
        self.stats.replays += 1
        return _Replay.apply(self, entry, x, *self.params)

    def _replay_pending(self) -> bool:
        """Whether a forward replay still waits for its backward: its activations and its input
        live in the pool and the shared buffers, which another replay or capture would
        overwrite (e.g. the encoder called twice before one backward), so the call runs eagerly.
        A forward whose autograd graph was dropped without a backward no longer counts."""
        if self._pending is None:
            return False
        if self._pending() is None:
            self._pending = None
            return False
        return True

    # ---- keys and checks -----------------------------------------------------------------------
    def _key(self, x: torch.Tensor, attn: AttentionInputs) -> GraphKey | None:
        if attn.host_seq_offsets is None or x.dim() != 2:
            return None  # no host copy to check the metadata against: eager (the op checks)
        n = attn.seq_offsets.numel() - 1
        dev = x.device.type
        return GraphKey(
            rows=int(x.shape[0]),
            hidden=int(x.shape[1]),
            dtype=x.dtype,
            num_seqs=-(-max(n, 1) // SEQ_GRAIN) * SEQ_GRAIN,
            seqlen_bound=seqlen_bound(attn.max_seqlen),
            contexts=attn.num_contexts is not None,
            targets=attn.num_targets is not None,
            timestamps=attn.timestamps is not None,
            last_query_time=attn.last_query_time is not None,
            input_grad=x.requires_grad,
            autocast=(torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)),
        )

    def _covering(self, key: GraphKey) -> _Entry | None:
        """A captured pair that can run ``key``'s batch: the same rows, inputs and autocast, at
        least as many sequence slots (the extra ones are loaded empty) and at least the length
        bound (the attention grid's blocks past a sequence's end exit at once); the smallest such
        one, None if there is none. Without it every batch whose longest sequence or sequence
        count crosses a boundary would be captured again at a token count already captured (the
        benchmark model's batches met both bounds 2048 and 4096 at one count)."""
        if key in self._cover:
            return self._entries.get(self._cover[key])
        best = None
        for entry in self._entries.values():
            k = entry.key
            if (
                k.num_seqs >= key.num_seqs
                and k.seqlen_bound >= key.seqlen_bound
                and k == replace(key, num_seqs=k.num_seqs, seqlen_bound=k.seqlen_bound)
                and (
                    best is None
                    or (k.seqlen_bound, k.num_seqs) < (best.key.seqlen_bound, best.key.num_seqs)
                )
            ):
                best = entry
        if best is not None:  # remembered until the graphs change (a capture or a reset)
            self._cover[key] = best.key
        return best

    @staticmethod
    def _fits(key: GraphKey, x: torch.Tensor, attn: AttentionInputs) -> bool:
        """The checks the attention op makes on every eager call, on the host copy (no sync):
        a batch that fails them runs eagerly and gets the op's own error."""
        offs = attn.host_seq_offsets
        if offs.numel() < 1 or int(offs[0]) != 0 or int(offs[-1]) != key.rows:
            return False
        lengths = offs[1:] - offs[:-1]
        if lengths.numel() and (bool((lengths < 0).any()) or int(lengths.max()) > attn.max_seqlen):
            return False
        if attn.max_seqlen <= 0:
            return False
        used = torch.zeros_like(lengths)
        for host in (attn.host_num_contexts, attn.host_num_targets):
            if host is None:
                continue
            if host.shape != lengths.shape or bool((host < 0).any()):
                return False
            used = used + host
        if bool((used > lengths).any()):
            return False
        for t, n in ((attn.timestamps, key.rows), (attn.last_query_time, lengths.numel())):
            if t is not None and (t.device != x.device or t.shape != (n,)):
                return False
        return True

    # ---- buffers -------------------------------------------------------------------------------
    def _ensure_capacity(self, encoder: nn.Module, key: GraphKey, x: torch.Tensor) -> bool:
        """Shared buffers large enough for ``key``; True when they had to be made anew (every
        graph captured before is then dropped)."""
        buf = self._buffers.get("x")
        if (
            buf is not None
            and key.rows <= self._rows_capacity
            and buf.shape[1] == key.hidden
            and buf.dtype == key.dtype
        ):
            return False
        if self._entries:
            logger.info(
                "CUDA graphs: %d token rows outgrow the shared buffers (%d); capturing anew",
                key.rows,
                self._rows_capacity,
            )
        captured_before = self.stats.captures
        self.reset()
        self.stats.captures = captured_before
        rows = max(key.rows, int(key.rows * BUFFER_HEADROOM))
        opts = dict(dtype=key.dtype, device=x.device)
        # "grad": the output's gradient (read first by the backward graph) and the input's
        # (written last), module docstring "Memory"
        self._buffers = {
            name: torch.zeros((rows, key.hidden), **opts) for name in ("x", "y", "grad")
        }
        self._rows_capacity = rows
        # the layers' parameters: the graphs run the layers only (`forward_eager`)
        self.params = [p for p in encoder.layers.parameters() if p.requires_grad]
        self.param_grads = [torch.zeros_like(p) for p in self.params]
        self._param_ptrs = tuple(p.data_ptr() for p in self.params)
        self._pool = torch.cuda.graph_pool_handle()
        return True

    @contextlib.contextmanager
    def _warmup_allocations(self, device: torch.device):
        """Where a capture's eager warm-up allocates: in the graphs' pool once graphs hold it
        (the capture then reuses the blocks its warm-up freed, and the ordinary pool never holds
        a second step's activations beside the pool), in the ordinary pool before. The routing
        takes the calling thread's allocations, so the backward runs on this thread too.
        Entering a pool that nothing holds would leave it unowned on exit, and the allocator
        refuses to take such a pool again, so the first capture warms up outside it."""
        # The graphs' pool is a bare id (`graph_pool_handle`), routed to as `use_mem_pool` routes
        # to a MemPool's. No MemPool object is made: one destroyed by a garbage collection while
        # any CUDA graph capture is under way (another trainer's step graphs) aborts the process.
        routing = [getattr(torch._C, n, None) for n in _POOL_ROUTING]
        if self._entries and None in routing and not self._warned_routing:
            self._warned_routing = True
            logger.warning(
                "this torch (%s) lacks %s: CUDA graph captures warm up in the ordinary memory "
                "pool, so a capture can hold a second step's activations beside the graphs' "
                "pool (more reserved memory; docs/architecture.md, CUDA graphs)",
                torch.__version__,
                ", ".join(n for n, f in zip(_POOL_ROUTING, routing) if f is None),
            )
        if not self._entries or None in routing:
            yield
            return
        begin, end, release = routing
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        begin(index, self._pool)
        try:
            with torch.autograd.set_multithreading_enabled(False):
                yield
        finally:
            end(index, self._pool)
            release(index, self._pool)

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The one stream every capture (and its warm-up) runs on. The caching allocator hands a
        freed block only to allocations on the stream it was made on, in the graphs' pool as in
        the ordinary one: captures on streams of their own (torch's stream pool gives each new
        stream object the next of its streams) could not reuse each other's freed memory, and
        every token bucket kept a step's activations of its own."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def _new_entry(self, key: GraphKey, x: torch.Tensor) -> _Entry:
        dev = x.device
        s = key.num_seqs

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=dev)

        return _Entry(
            key=key,
            offsets=ints(s + 1),
            contexts=ints(s) if key.contexts else None,
            targets=ints(s) if key.targets else None,
            timestamps=ints(key.rows) if key.timestamps else None,
            last_query_time=ints(s) if key.last_query_time else None,
            inv_max_seqlen=torch.ones(1, dtype=torch.float32, device=dev),
            x=self._buffers["x"][: key.rows],
            y=self._buffers["y"][: key.rows],
            grad=self._buffers["grad"][: key.rows],
        )

    @staticmethod
    def _load(entry: _Entry, x: torch.Tensor, attn: AttentionInputs) -> None:
        """The batch's metadata into the graph's device memory (device copies and fills, no host
        round trip); sequences past the batch's are empty."""
        n = attn.seq_offsets.numel() - 1
        s = entry.key.num_seqs
        entry.offsets[: n + 1].copy_(attn.seq_offsets)
        if n < s:
            entry.offsets[n + 1 :].fill_(entry.key.rows)
        for dst, src in (
            (entry.contexts, attn.num_contexts),
            (entry.targets, attn.num_targets),
            (entry.last_query_time, attn.last_query_time),
        ):
            if dst is None:
                continue
            dst[:n].copy_(src)
            if n < s:
                dst[n:].zero_()
        if entry.timestamps is not None:
            entry.timestamps.copy_(attn.timestamps)
        entry.inv_max_seqlen.fill_(1.0 / float(attn.max_seqlen))

    # ---- capture -------------------------------------------------------------------------------
    def _static_forward(self, encoder: nn.Module, entry: _Entry, x: torch.Tensor) -> torch.Tensor:
        key = entry.key
        attn = AttentionInputs(
            seq_offsets=entry.offsets,
            max_seqlen=key.seqlen_bound,
            num_contexts=entry.contexts,
            num_targets=entry.targets,
            timestamps=entry.timestamps,
            last_query_time=entry.last_query_time,
            inv_max_seqlen=entry.inv_max_seqlen,
        )
        enabled, dtype = key.autocast
        # no autocast cache: a cached weight cast made outside the graph would be read stale
        with torch.autocast("cuda", enabled=enabled, dtype=dtype, cache_enabled=False):
            return encoder.forward_eager(x, attn)

    def _grads(self, entry: _Entry, y: torch.Tensor, x_leaf: torch.Tensor, params: list):
        inputs = ([x_leaf] if entry.key.input_grad else []) + params
        return torch.autograd.grad(y, inputs, entry.grad, allow_unused=True)

    def _capture(
        self,
        encoder: nn.Module,
        key: GraphKey,
        x: torch.Tensor,
        attn: AttentionInputs,
        why: str = "first seen",
    ) -> _Entry | None:
        """Captures ``key``'s pair of graphs; None (graphs then off, the reason logged) when that
        fails. Out of memory is tried once more after the allocator hands its cached free blocks
        back to the device: the eager steps before a capture leave them reserved in the ordinary
        pool, where the graphs' pool cannot use them (a large model's step needs ~20 GB of
        activations, docs/architecture.md)."""
        for attempt in (1, 2):
            try:
                return self._capture_once(encoder, key, x, attn, why)
            except torch.OutOfMemoryError as exc:
                error, retry = f"{type(exc).__name__}: {exc}", attempt == 1
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly, say why
                error, retry = f"{type(exc).__name__}: {exc}", False
            # here the failed attempt's tensors are gone with its traceback
            torch.cuda.synchronize(x.device)
            release_generator(x.device)
            if not retry:
                break
            freed = torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device)
            torch.cuda.empty_cache()
            logger.info(
                "CUDA graphs: capture ran out of memory (%s); retrying once after releasing "
                "%.1f GB of cached blocks",
                error.splitlines()[0],
                freed / 2**30,
            )
        self._disable(f"capturing failed ({error})")
        return None

    def _capture_once(
        self,
        encoder: nn.Module,
        key: GraphKey,
        x: torch.Tensor,
        attn: AttentionInputs,
        why: str = "first seen",
    ) -> _Entry:
        # the queued steps finish first, so that the seconds counted are the capture's own
        torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        had = len(self._entries)
        if self._ensure_capacity(encoder, key, x) and had:
            why = f"buffers grew; {had} graphs dropped"
        entry = self._new_entry(key, x)
        self._load(entry, x, attn)
        entry.x.copy_(x)
        x_leaf = entry.x.detach().requires_grad_(key.input_grad)
        current = torch.cuda.current_stream()
        side = self._capture_stream(x.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side), fresh_parameter_leaves(encoder, self.params) as params:
                # compilation, kernel setup, algorithm choices (module docstring "Memory": where)
                with self._warmup_allocations(x.device):
                    for _ in range(self.warmup):
                        y = self._static_forward(encoder, entry, x_leaf)
                        self._grads(entry, y, x_leaf, params)
                    del y
                torch.cuda.synchronize(x.device)
                if not self._entries:
                    # the first capture into this pool: its warm-up's blocks go back before the
                    # capture takes the same amount again in the pool
                    torch.cuda.empty_cache()
                fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                fwd.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    # the backward starts from the buffer, so the layers' own output block is
                    # free again once copied: the backward's temporaries reuse it
                    y = _IntoBuffer.apply(self._static_forward(encoder, entry, x_leaf), entry.y)
                finally:
                    fwd.capture_end()
                bwd.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    # the fused layers' projection weight gradients are written straight into
                    # the replay's buffers; the others are copied there
                    into = {id(p): buf for p, buf in zip(params, self.param_grads)}
                    with fused_hstu_layer.weight_grads_into(into):
                        grads = list(self._grads(entry, y, x_leaf, params))
                    if key.input_grad:
                        entry.grad.copy_(grads.pop(0))
                    entry.used = [g is not None for g in grads]
                    # one multi-tensor copy kernel for all of them, not one copy per parameter
                    pairs = [
                        (buf, g)
                        for buf, g in zip(self.param_grads, grads)
                        if g is not None and g.data_ptr() != buf.data_ptr()
                    ]
                    if pairs:
                        torch._foreach_copy_([b for b, _ in pairs], [g for _, g in pairs])
                finally:
                    bwd.capture_end()
                del y, grads, params
        finally:
            current.wait_stream(side)
        entry.fwd, entry.bwd = fwd, bwd
        # the warm-up passes' activations sit freed in the ordinary pool, where replays never
        # use them: hand them back (module docstring, "When")
        torch.cuda.synchronize(x.device)
        torch.cuda.empty_cache()
        self._entries[key] = entry
        self._cover.clear()  # a smaller graph may cover some keys now
        took = time.perf_counter() - start
        flags = "".join(
            c
            for c, on in zip(
                "CTSLI",
                (key.contexts, key.targets, key.timestamps, key.last_query_time, key.input_grad),
            )
            if on
        )
        note = (
            f"rows={key.rows} seqs={key.num_seqs} seqlen<={key.seqlen_bound} inputs={flags or '-'}"
            f" autocast={key.autocast[0]} ({why}; {len(self._entries)} held)"
        )
        self.stats.record_capture(note, took, len(self._entries))
        logger.info("CUDA graphs: captured %s in %.2f s", note, took)
        return entry
