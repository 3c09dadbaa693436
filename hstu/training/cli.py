"""Command-line flags shared by the two launchers (``scripts/pretrain_gr_{ranking,retrieval}.py``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from hstu.config.gin_utils import TASKS, RunConfig, load_config
from hstu.errors import EXIT_CONFIG, UsageError, error_line

__all__ = ["LOG_LEVELS", "config_from_args", "parse_args"]

LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")

_EPILOG = """\
examples:
  # the embedded synthetic {task} config (configs/synthetic_{task}.gin)
  torchrun --nproc_per_node=8 scripts/{script}

  # your own file, then overrides (later files win; bindings win over files)
  torchrun --nproc_per_node=8 scripts/{script} \\
      --gin-config-file configs/base.gin --gin-config-file configs/mine.gin \\
      --gin-bindings "TrainerArgs.max_train_iters=2000" \\
      --gin-bindings "OptimizerArgs.learning_rate=5e-4; NetworkArgs.num_layers=4"

  # strings need quotes inside the binding
  --gin-bindings 'DatasetArgs.dataset_name="ml-1m"'

  # no A100 here: CPU development mode (reference ops, gloo), or a non-A100 GPU
  HSTU_ALLOW_NON_A100=1 torchrun --nproc_per_node=2 scripts/{script} \\
      --gin-bindings "TrainerArgs.max_train_iters=20"

Every setting and its allowed values: docs/configuration.md
"""


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"--log-level {value!r} is not supported: choose one of {', '.join(LOG_LEVELS)}"
        )
    return level


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag raised as ``UsageError`` (one line, exit 2) instead of
    argparse's usage block + ``prog: error: ...``."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser(task: str) -> argparse.ArgumentParser:
    """The argument parser of the ``task`` launcher (a bad flag raises ``UsageError``)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not supported: choose one of {', '.join(TASKS)}")
    script = f"pretrain_gr_{task}.py"
    parser = _Parser(
        prog=script,
        description=(
            f"Train an HSTU {task} model (run it under torchrun). Settings come from gin files "
            "and bindings; without a file the embedded synthetic config is used."
        ),
        epilog=_EPILOG.format(task=task, script=script),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gin-config-file",
        dest="gin_config_file",
        action="append",
        default=[],
        metavar="FILE",
        help="gin config file; repeatable, later files override earlier ones "
        f"(default: configs/synthetic_{task}.gin)",
    )
    parser.add_argument(
        "--gin-bindings",
        dest="gin_bindings",
        action="append",
        default=[],
        metavar="'Class.field=value'",
        help="gin binding(s) applied after all files; repeatable, and one value may hold "
        "several separated by ';' or newlines",
    )
    parser.add_argument(
        "--allow-non-a100",
        dest="allow_non_a100",
        action="store_true",
        help="run on a non-A100 GPU, or in CPU development mode without a GPU, with a warning "
        "(same as HSTU_ALLOW_NON_A100=1)",
    )
    parser.add_argument(
        "--log-level",
        dest="log_level",
        type=_log_level,
        default="INFO",
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="logging level (default: INFO)",
    )
    return parser


def parse_args(
    argv: Sequence[str] | None, task: str, raise_errors: bool = False
) -> argparse.Namespace:
    """Parse launcher flags. ``argv`` None means ``sys.argv[1:]``. A bad flag prints one
    ``error: ...`` line and exits with code 2, or raises ``UsageError`` with ``raise_errors``
    (the launcher reports it once per job).

    The namespace has ``gin_config_file`` (list), ``gin_bindings`` (list), ``allow_non_a100``
    (bool), ``log_level`` (str, upper case, usable with ``logging``) and ``task``.
    """
    try:
        ns = build_parser(task).parse_args(None if argv is None else list(argv))
    except UsageError as exc:
        if raise_errors:
            raise
        print(error_line(exc), file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    ns.task = task
    ns.log_level_int = getattr(logging, ns.log_level)
    return ns


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """Resolve the run configuration named by parsed flags (raises ``ConfigError``)."""
    return load_config(ns.task, ns.gin_config_file, ns.gin_bindings)
