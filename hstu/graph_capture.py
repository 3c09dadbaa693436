"""Helpers shared by the CUDA graph runners (the encoder's `hstu.modules.graphed_encoder`, the
whole step's `hstu.training.step_graphs`, the dynamic tables' `hstu.embeddings.lookup_graphs`):
the rounding of counts to a few sizes per power of two (a graph replays fixed shapes), the
capture counters, and the random generator's reset after a failed capture."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["GraphStats", "PAD_SIZES_PER_OCTAVE", "padded_token_count", "release_generator"]

RECENT_CAPTURES = 16  # captures GraphStats.recent_captures keeps


def release_generator(device: torch.device) -> None:
    """After a failed capture: the device's default CUDA generator gets a fresh copy of its
    state. A capture that ends in an error leaves the state marked as capturing, and every
    later random op (dropout, negatives) of the eager steps would then raise ("Offset increment
    outside graph capture"); the copy keeps the seed and offset without that mark."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    gen.graphsafe_set_state(gen.clone_state())


# Token counts per power of two that `padded_token_count` rounds to by default.
PAD_SIZES_PER_OCTAVE = 32


def padded_token_count(t: int, sizes_per_octave: int = PAD_SIZES_PER_OCTAVE) -> int:
    """``t`` rounded up to a multiple of 2**(bit_length(t) - 1) / ``sizes_per_octave``, at least
    128: with the default 32, at most ~1/32 more rows (1024 extra at most for 32k-64k tokens) and
    at most 32 sizes per power of two.

    Why: each batch has a different number of jagged tokens T, and cuBLAS picks its kernel for
    every new [T, K] x [K, N] shape on the host (measured on the H100: ~150-230 us per matmul for
    a new T, ~25 us for a repeated one; ~50 matmuls per step). Rounding T makes the shapes repeat.
    CUDA graphs of the encoder (one pair per size) use 8 sizes per power of two (at most 1/8 more
    rows): a large batch's token count spreads over dozens of the finer sizes.
    """
    if sizes_per_octave < 1 or sizes_per_octave & (sizes_per_octave - 1):
        raise ValueError(f"sizes_per_octave must be a power of two; got {sizes_per_octave}")
    if t <= 0:
        return t
    shift = t.bit_length() - 1 - (sizes_per_octave.bit_length() - 1)
    grain = max(128, 1 << max(0, shift))
    return -(-t // grain) * grain


@dataclass
class GraphStats:
    """Counts of one graph runner since it was built (the encoder's forward + backward, the
    whole step, a dynamic table's lookup): ``captures`` (recaptures after a buffer growth
    included) and the seconds they took, ``replays`` (calls run from a graph), ``eager`` (calls
    run eagerly: first sight of a shape, inputs that do not fit, the graph limits), ``graphs``
    (held now)."""

    captures: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    eager: int = 0
    graphs: int = 0
    disabled: str = ""  # why graphs are off for this runner ("" = on)
    # times every graph was dropped (buffers outgrown, parameters moved, `reset`)
    resets: int = 0
    # the last `RECENT_CAPTURES` captures, oldest first, as the runner describes them (the
    # encoder's: "rows=.. seqs=.. seqlen<=.. inputs=.. (C contexts, T targets, S timestamps,
    # L last query times, I input gradient) (why; held)")
    recent_captures: list[str] = field(default_factory=list)

    def record_capture(self, note: str, seconds: float, held: int) -> None:
        """Counts one capture of ``seconds`` (``note`` describes it) with ``held`` graphs now."""
        self.captures += 1
        self.graphs = held
        self.capture_seconds += seconds
        self.recent_captures = (self.recent_captures + [note])[-RECENT_CAPTURES:]
