"""How many time buckets a query row's causal keys span within one key tile.

The biased attention kernel's time term costs little for a (query row, key tile) pair whose
gaps all fall into one bucket and more for two or three buckets, or for more than three
(docs/kernels.md, "Relative attention bias in the kernel"). This prints the share of each class
for real timestamps (a prepared dataset's sequences) or for the synthetic gaps of
`scripts/bench_attention.py --bias time` (i.i.d. gaps log-uniform over 1 .. 10^6), with the
kernel's conventions: query row i measures gaps from the next token's timestamp (the last row
from its own), keys j <= i, tiles of ``--tile`` keys from each sequence's start.

    python scripts/bias_bucket_spans.py --dataset-dir data/ml-100k --min-length 300 --users 20
    python scripts/bias_bucket_spans.py --dataset-dir data/ml-100k --min-length 300 --synthetic

One JSON line: the shares of 1, 2, 3 and more buckets, pairs counted, sequences used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hstu.data.sequences import SequenceData  # noqa: E402
from hstu.ops.reference import time_bucket_edges, time_buckets  # noqa: E402


def bucket_span_counts(timestamps: torch.Tensor, tile: int, edges: torch.Tensor) -> np.ndarray:
    """[4] counts of (query row, key tile) pairs of one sequence whose causal keys span 1, 2, 3
    or more distinct time buckets (tiles of ``tile`` keys from the sequence's start)."""
    ts = timestamps.to(torch.int64)
    n = int(ts.numel())
    if n == 0:
        return np.zeros(4, dtype=np.int64)
    query_time = torch.cat([ts[1:], ts[-1:]])  # the next token's timestamp; the last its own
    buckets = time_buckets(query_time[:, None] - ts[None, :], edges)  # [n, n]
    rows = torch.arange(n)
    counts = np.zeros(4, dtype=np.int64)
    for start in range(0, n, tile):
        stop = min(start + tile, n)
        b = buckets[:, start:stop]
        cols = torch.arange(start, stop)
        causal = cols[None, :] <= rows[:, None]
        # distinct buckets of a row's causal keys: 1 + changes between causal neighbours
        changed = (b[:, 1:] != b[:, :-1]) & causal[:, 1:]
        distinct = 1 + changed.sum(1)
        seen = causal[:, 0]  # the row has at least one causal key in this tile
        d = distinct[seen].clamp(max=4)
        counts += np.bincount(d.numpy() - 1, minlength=4)[:4]
    return counts


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset-dir", required=True, help="a prepared dataset (hstu.data.prepare)")
    p.add_argument("--min-length", type=int, default=300, help="sequences at least this long")
    p.add_argument("--users", type=int, default=20, help="the first this many such sequences")
    p.add_argument("--tile", type=int, default=64, help="keys per tile")
    p.add_argument("--buckets", type=int, default=128, help="time buckets")
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="the same sequence lengths with bench_attention's gaps instead of the real ones",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tile < 1 or args.users < 1 or args.min_length < 1:
        p.error("--tile, --users and --min-length must be >= 1")
    return args


def main(argv=None) -> dict:
    args = _parse(argv)
    try:
        data = SequenceData.load(args.dataset_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not data.has_timestamps and not args.synthetic:
        raise SystemExit(
            f"{args.dataset_dir} ({data.name}) has no real timestamps (only the order of its "
            "file): take a dataset with timestamps, or --synthetic for the benchmark's gaps"
        )
    offsets, stamps = data.offsets, data.timestamps
    lengths = np.diff(offsets)
    chosen = np.flatnonzero(lengths >= args.min_length)[: args.users]
    if chosen.size == 0:
        raise SystemExit(f"no sequence of {args.min_length} or more tokens in {args.dataset_dir}")
    edges = time_bucket_edges(args.buckets)
    gen = torch.Generator().manual_seed(args.seed)
    counts = np.zeros(4, dtype=np.int64)
    for u in chosen:
        ts = torch.from_numpy(stamps[offsets[u] : offsets[u + 1]].astype(np.int64))
        if args.synthetic:  # bench_attention's gaps: floor(10 ** U(0, 6))
            gaps = torch.floor(10 ** (torch.rand(ts.numel(), generator=gen) * 6.0)).long()
            ts = torch.cumsum(gaps, 0)
        counts += bucket_span_counts(ts, args.tile, edges)
    total = int(counts.sum())
    row = {
        "timestamps": "synthetic (log-uniform gaps)" if args.synthetic else "real",
        "dataset": str(args.dataset_dir),
        "sequences": int(chosen.size),
        "tile": args.tile,
        "pairs": total,
        "share_1_bucket": counts[0] / total,
        "share_2_buckets": counts[1] / total,
        "share_3_buckets": counts[2] / total,
        "share_more": counts[3] / total,
    }
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
