"""Shared ``main()`` of the two torchrun entry points (scripts/pretrain_gr_*.py)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from hstu.training.cli import config_from_args, parse_args
from hstu.training.gpu_policy import check_gpu

__all__ = ["main"]

logger = logging.getLogger("hstu")


def _setup_logging(level: int) -> None:
    rank = int(os.environ.get("RANK", "0"))
    # rank 0 speaks at the chosen level; other ranks only report warnings and errors
    # third-party libraries (fbgemm, torchrec) stay at WARNING; hstu's own loggers at `level`
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("hstu").setLevel(level if rank == 0 else max(level, logging.WARNING))


def main(task: str, argv: Sequence[str] | None = None) -> int:
    """Parse flags, apply the GPU policy (every rank, before anything else), train.

    Exit codes: 0 success, 1 refused GPU or failed run, 2 bad flags/config/data.
    """
    ns = parse_args(argv, task)
    _setup_logging(ns.log_level_int)
    try:
        mode = check_gpu(ns.allow_non_a100)
    except RuntimeError as exc:
        print(f"RuntimeError: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # e.g. a malformed HSTU_ALLOW_NON_A100 or LOCAL_RANK
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from hstu.config.gin_utils import ConfigError
    from hstu.training.trainer import run_training

    try:
        cfg = config_from_args(ns)
    except (ConfigError, ValueError, TypeError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("resolved configuration:\n%s", cfg.log_summary())
    try:
        result = run_training(cfg, mode.device)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        # bad data or settings found while building the run: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(f"{k}={v:.4f}" for k, v in result.final_metrics.items())
        logger.info(
            "done: %d steps; final eval: %s; run directory %s",
            len(result.losses),
            shown,
            result.run_dir,
        )
    return 0
