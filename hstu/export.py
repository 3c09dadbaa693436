"""Command-line export of a training checkpoint into a self-contained inference artifact.

    python -m hstu.export --checkpoint runs/<run> --out exported/ [--config config.gin] \\
        [--gin-bindings 'DatasetArgs.dataset_path="..."'] [--overwrite]

The checkpoint (a retrieval or a ranking run) may come from any number of ranks. The artifact
(docs/inference.md) holds the model as a `torch.export` program (retrieval: the query encoder;
ranking: history + candidates -> logits), the frozen tables, the configuration and a manifest
with checksums; ``python -m hstu.infer retrieve|rank --artifact DIR`` and
`hstu.inference.artifact.load_artifact` serve it with torch alone.
Errors follow `hstu.errors`: one ``error:`` line, exit 2 for input and configuration problems.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from hstu.errors import EXIT_OK, UsageError, error_line, exit_code_for

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hstu.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="run directory, checkpoint root (its 'latest') or step_XXXXXXXX directory")  # fmt: skip
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    p.add_argument("--config", metavar="FILE", help="the run's config.gin when not beside it")
    p.add_argument("--gin-bindings", dest="gin_bindings", action="append", default=[],
                   metavar="'Class.field=value'", help="bindings applied after the config")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.add_argument("--log-level", dest="log_level", default="INFO", help="logging level")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0, 1 runtime failure, 2 input/config problem)."""
    try:
        ns = build_parser().parse_args(None if argv is None else list(argv))
        logging.basicConfig(
            level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
            format="%(levelname)s %(name)s: %(message)s",
        )
        out = Path(ns.out)
        if out.exists() and not ns.overwrite and not (out.is_dir() and not any(out.iterdir())):
            raise UsageError(f"--out {out} exists and is not empty: choose another or --overwrite")
        from hstu.inference.export import export_checkpoint

        out = export_checkpoint(
            ns.checkpoint,
            ns.out,
            config_file=ns.config,
            bindings=ns.gin_bindings,
            overwrite=ns.overwrite,
        )
        print(out)
    except KeyboardInterrupt:
        print(error_line("interrupted"), file=sys.stderr)
        return 130
    except Exception as exc:
        code = exit_code_for(exc)
        if code is None:
            raise
        print(error_line(exc), file=sys.stderr)
        return code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
