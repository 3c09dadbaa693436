"""Draw the documentation plots from the measured results under docs/data/.

    python scripts/make_figures.py --data docs/data --out docs/img

Reads the small JSON files that docs/benchmarks.md, docs/multi_gpu.md and docs/results.md
transcribe (each records its command and hardware) and writes one PNG per figure:

- attention_tflops.png   HSTU attention TF/s per benchmark shape, forward and forward+backward,
                         the compiled kernel against the PyTorch reference (attention_h100.json)
- multi_gpu_scaling.png  samples/s speed-up over one GPU against the GPU count, with the ideal
                         line (multi_gpu_scaling_h200.json)
- ml1m_retrieval.png     ML-1M HR@10 and NDCG@10 over training against the paper's final values
                         (ml1m_retrieval_h100.json)

Needs matplotlib (not a dependency of the package; `python3 -m pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 100


def load(data_dir: Path, name: str) -> dict:
    with open(data_dir / name) as f:
        return json.load(f)


def finish(fig: plt.Figure, data: dict, out: Path, top: float = 1.0) -> None:
    """Lays the figure out above a small-print footer (hardware and command), saves, closes."""
    width = int(fig.get_figwidth() * 24)  # characters of 6-pt text per line
    lines = [data["hardware"], *textwrap.wrap(data["command"], width)]
    inch = 0.11 * len(lines) + 0.1  # footer height in inches
    fig.tight_layout(rect=(0, inch / fig.get_figheight(), 1, top))
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=6, va="bottom")
    fig.savefig(out, dpi=DPI, pil_kwargs={"optimize": True})
    plt.close(fig)


def attention_figure(data: dict, out: Path) -> None:
    rows = data["rows"]
    shapes = [r["shape"] for r in rows]
    x = range(len(shapes))
    width = 0.27
    series = (
        ("kernel, CUDA graph", "graph", "tab:blue"),
        ("kernel, eager", "eager", "tab:cyan"),
        ("PyTorch reference", "ref", "tab:gray"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, (title, key) in zip(axes, (("forward", "fwd"), ("forward + backward", "fwd_bwd"))):
        for i, (label, kind, color) in enumerate(series):
            field = f"ref_{key}" if kind == "ref" else f"{key}_{kind}"
            values = [r[field] for r in rows]
            ax.bar([p + (i - 1) * width for p in x], values, width, label=label, color=color)
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels(shapes, rotation=20)
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s (log scale)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, 0.94))
    fig.suptitle(data["title"])
    finish(fig, data, out, top=0.9)


def scaling_figure(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.4))
    max_gpus = 1
    for inv in data["invocations"]:
        rows = sorted(inv["rows"], key=lambda r: r["gpus"])
        base = next(r["samples_per_s"] for r in rows if r["gpus"] == 1)
        gpus = [r["gpus"] for r in rows]
        speedup = [r["samples_per_s"] / base for r in rows]
        max_gpus = max(max_gpus, *gpus)
        ax.plot(gpus, speedup, marker="o", label=inv["name"])
    ax.plot([1, max_gpus], [1, max_gpus], "k--", label="ideal")
    ax.set_xticks(range(1, max_gpus + 1))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("samples/s relative to 1 GPU")
    ax.set_title(data["title"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    finish(fig, data, out)


def retrieval_figure(data: dict, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.6))
    paper = data["paper"]
    for ax, metric in zip(axes, ("HR@10", "NDCG@10")):
        for run in data["runs"]:
            ax.plot(run["epochs"], run[metric], marker="o", label=run["label"])
        ax.axhline(
            paper[metric], color="k", linestyle="--", label=f"{paper['label']}: {paper[metric]}"
        )
        ax.annotate(
            f"paper {paper[metric]:.3f}",
            (0, paper[metric]),
            xycoords=("axes fraction", "data"),
            xytext=(4, 3),
            textcoords="offset points",
            fontsize=7,
        )
        ax.set_xlabel("epochs (evaluated every 2,000 steps)")
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(data["title"])
    finish(fig, data, out)


FIGURES = (
    ("attention_h100.json", "attention_tflops.png", attention_figure),
    ("multi_gpu_scaling_h200.json", "multi_gpu_scaling.png", scaling_figure),
    ("ml1m_retrieval_h100.json", "ml1m_retrieval.png", retrieval_figure),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("docs/data"), help="measured results (JSON)")
    ap.add_argument("--out", type=Path, default=Path("docs/img"), help="where the PNGs go")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for source, target, draw in FIGURES:
        path = args.out / target
        draw(load(args.data, source), path)
        print(f"{path}: {path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
