"""Shared ``main()`` of the two launch scripts (scripts/pretrain_gr_*.py).

Exit convention (hstu.errors): 0 success, 1 runtime failure, 2 configuration, usage or data error.
An expected failure prints one ``error: ...`` line on stderr and no traceback, once per job: under
torchrun the first rank to fail prints it and writes torchrun's error file
(``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary shows the message instead of a
pointer to the docs. An unexpected exception keeps its full traceback (exit 1), also in that
file. ``--log-level DEBUG`` adds the traceback of an expected failure.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hstu.errors import EXIT_OK, EXIT_RUNTIME, error_line, exit_code_for
from hstu.training import warnings_filter
from hstu.training.cli import config_from_args, parse_args
from hstu.training.gpu_policy import GPURefusedError, check_gpu
from hstu.training.logger import format_duration

if TYPE_CHECKING:
    from hstu.config.gin_utils import RunConfig
    from hstu.training.trainer import TrainResult

__all__ = ["main", "main_metric", "run_summary"]

logger = logging.getLogger("hstu")

# created (O_EXCL) in torchrun's per-attempt directory by the first rank that reports an error
_REPORTED_MARKER = "hstu_error_reported"
EXIT_INTERRUPTED = 130


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _setup_logging(level: int) -> None:
    rank = _rank()
    # rank 0 speaks at the chosen level; other ranks only report warnings and errors
    # third-party libraries (fbgemm, torchrec) stay at WARNING; hstu's own loggers at `level`
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("hstu").setLevel(level if rank == 0 else max(level, logging.WARNING))


# ---- the exit convention -----------------------------------------------------------------------


def _first_to_report() -> bool:
    """True unless another worker of this torchrun attempt already printed its error line."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not error_file:
        return True  # launched directly: this process is the job
    # torchrun: <log_dir>/<run_id>/attempt_<n>/<local_rank>/error.json
    marker = Path(error_file).parent.parent / _REPORTED_MARKER
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot coordinate: rather twice than never
    os.close(fd)
    return True


def _write_torchrun_error_file(message: str, callstack: str | None) -> None:
    """torchrun's error file (its ErrorHandler's JSON layout): the failure summary torchrun prints
    shows ``py_callstack`` when present, else ``message``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path:
        return
    extra: dict[str, str] = {"timestamp": str(int(time.time()))}
    if callstack is not None:
        extra["py_callstack"] = callstack
    try:
        with open(path, "w") as fh:
            json.dump({"message": {"message": message, "extraInfo": extra}}, fh)
    except OSError:
        pass  # the message is on stderr already


def _report_expected(exc: BaseException, code: int, text: str | None = None) -> int:
    """One ``error:`` line (once per job), torchrun's error file; returns ``code``."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("traceback of the error below (shown at --log-level DEBUG)", exc_info=exc)
    line = error_line(text if text is not None else exc)
    _write_torchrun_error_file(
        f"none (expected failure, exit code {code}): {line[len('error: ') :]}", None
    )
    if _first_to_report():
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
    return code


def _record_unexpected(exc: BaseException) -> None:
    """What torch's ``@record`` does: the traceback into torchrun's error file."""
    _write_torchrun_error_file(
        f"{type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def main(task: str, argv: Sequence[str] | None = None) -> int:
    """Parse flags, apply the GPU policy (every rank, before anything else), train.

    Returns the exit code (hstu.errors): 0 success, 1 runtime failure (refused GPU, divergence,
    disk full, I/O), 2 bad flags/config/data; 130 on Ctrl-C. Unexpected exceptions propagate.
    """
    started = time.monotonic()
    warnings_filter.install()
    try:
        return _main(task, argv, started)
    except SystemExit:
        raise  # --help
    except KeyboardInterrupt as exc:
        return _report_expected(exc, EXIT_INTERRUPTED, "interrupted (Ctrl-C)")
    except GPURefusedError as exc:
        # the hardware policy's exact text, with the exception name it documents
        return _report_expected(exc, EXIT_RUNTIME, f"RuntimeError: {exc}")
    except Exception as exc:
        code = exit_code_for(exc)
        if code is None:
            _record_unexpected(exc)
            raise
        return _report_expected(exc, code)


def _main(task: str, argv: Sequence[str] | None, started: float) -> int:
    ns = parse_args(argv, task, raise_errors=True)
    _setup_logging(ns.log_level_int)
    mode = check_gpu(ns.allow_non_a100)

    from hstu.training.trainer import run_training

    cfg = config_from_args(ns)
    result = run_training(cfg, mode.device)
    if _rank() == 0:
        logger.info("%s", run_summary(cfg, result, time.monotonic() - started))
    return EXIT_OK


# ---- the end-of-run summary --------------------------------------------------------------------


def main_metric(cfg: RunConfig, names: Sequence[str]) -> str | None:
    """The task's headline metric among ``names``: the mean AUC over tasks (ranking), the first
    of RetrievalArgs.eval_metrics (retrieval); else the first AUC / the first name."""
    from hstu.training.best import headline_metric

    return headline_metric(cfg.task, cfg.retrieval.eval_metrics, names)


def run_summary(cfg: RunConfig, result: TrainResult, wall_s: float) -> str:
    """The lines logged at the end of a run: steps and wall time, best and final metrics, where
    the checkpoints and TensorBoard logs are."""
    steps = len(result.losses)
    last = result.losses[-1][0] if result.losses else None
    at = f", now at step {last}/{cfg.trainer.max_train_iters}" if last is not None else ""
    lines = [f"run finished in {format_duration(wall_s)} (wall time): {steps} steps trained{at}"]
    if result.stopped_early_at is not None:
        best = result.best or {}
        lines.append(
            f"  stopped early at step {result.stopped_early_at}: {best.get('metric')} did not "
            f"improve in {cfg.trainer.early_stop_patience} evaluations "
            "(TrainerArgs.early_stop_patience)"
        )
    if result.evals:
        name = main_metric(cfg, result.evals[-1][1].keys())
        scored = [(m[name], step) for step, m in result.evals if name in m] if name else []
        best = result.best
        if best is not None and best.get("step") is not None:
            where = f"; checkpoint {best['checkpoint']}" if best.get("checkpoint") else ""
            lines.append(
                f"  best {best['metric']} ({best['mode']}): {best['value']:.4f} at step "
                f"{best['step']} ({len(result.evals)} evaluation"
                f"{'s' if len(result.evals) != 1 else ''}{where})"
            )
        elif scored:
            best, best_step = max(scored, key=lambda p: p[0])
            lines.append(
                f"  best {name}: {best:.4f} at step {best_step} "
                f"({len(scored)} evaluation{'s' if len(scored) != 1 else ''})"
            )
        step, final = result.evals[-1]
        shown = ", ".join(f"{k}={v:.4f}" for k, v in final.items())
        lines.append(f"  final eval @ step {step}: {shown}")
    else:
        lines.append("  final eval: none (no evaluation ran)")
    if result.checkpoint_dir is not None:
        ckpt = Path(result.checkpoint_dir)
        lines.append(f"  checkpoints: {ckpt.parent} (latest: {ckpt.name})")
    else:
        lines.append("  checkpoints: none saved (TrainerArgs.ckpt_save_interval=-1)")
    lines.append(f"  run directory (config.gin, TensorBoard): {result.run_dir}")
    lines.append(f"  TensorBoard: tensorboard --logdir {result.run_dir}")
    return "\n".join(lines)
