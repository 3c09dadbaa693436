"""Command-line inference from a training checkpoint or an exported artifact.

    python -m hstu.infer retrieve --checkpoint runs/<run> --input users.jsonl --top-k 100 \\
        [--output out.jsonl] [--batch-size 256] [--config config.gin] [--device cpu]
    python -m hstu.infer retrieve --artifact exported/ --input users.jsonl --top-k 100
    python -m hstu.infer rank --checkpoint runs/<ranking run> --input requests.jsonl \
        [--output out.jsonl] [--batch-size 64] [--device cuda]

``--artifact`` (from ``python -m hstu.export``) needs torch only: no torchrec, no gin, no
dataset; every request then gives its ``items``.

Each input line is one request, ``{"user_id": 1, "items": [10, 20, 30]}`` with optional
``timestamps`` and ``actions`` (one per item), ``query_time`` (the request's time, for models
with a relative time bias) and ``features`` (contextual feature name -> id; default: the user's
row of the dataset); ``items`` may be left out for a user of the dataset (its
whole stored history is used). Each output line is ``{"user_id": ..., "items": [...],
"scores": [...]}``, best first. ``rank`` requests add ``candidates``: one candidate set (a list
of item ids) or several (a list of lists); each history is encoded once and every set is scored
from its KV cache (`hstu.inference.ranker.Ranker`). Its output lines are ``{"user_id": ...,
"probabilities": ...}`` with one list of per-task probabilities per candidate, nested as the
candidates were given. Errors follow `hstu.errors`: one ``error:`` line, exit 2 for input and
configuration problems.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from hstu.errors import EXIT_OK, UsageError, error_line, exit_code_for

__all__ = ["build_parser", "main", "read_requests"]

logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse with a bad flag raised as `UsageError` (one line, exit 2)."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m hstu.infer", description="Inference from HSTU checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="{retrieve,rank}", parser_class=_Parser)
    sub.required = True
    r = sub.add_parser(
        "retrieve",
        help="top-K items for each user of a JSON-lines file",
        description="Top-K retrieval for each request of a JSON-lines file.",
    )
    source = r.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="run directory, checkpoint root (its 'latest') or step_XXXXXXXX directory",
    )
    source.add_argument(
        "--artifact",
        metavar="DIR",
        help="an exported artifact (python -m hstu.export): torch only, no training stack",
    )
    r.add_argument("--input", required=True, metavar="FILE", help="JSON lines, one user each")
    r.add_argument("--output", metavar="FILE", help="JSON lines out (default: stdout)")
    r.add_argument("--top-k", dest="top_k", type=_positive, default=100, metavar="K")
    r.add_argument("--batch-size", dest="batch_size", type=_positive, default=256, metavar="N")
    r.add_argument(
        "--config",
        metavar="FILE",
        help="the run's config.gin when it is not beside the checkpoints",
    )
    r.add_argument(
        "--gin-bindings",
        dest="gin_bindings",
        action="append",
        default=[],
        metavar="'Class.field=value'",
        help="bindings applied after the config (e.g. a moved DatasetArgs.dataset_path)",
    )
    r.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    r.add_argument(
        "--include-history",
        dest="include_history",
        action="store_true",
        help="allow items of the user's own history in the results",
    )
    r.add_argument(
        "--log-level", dest="log_level", default="WARNING", help="logging level (default WARNING)"
    )
    k = sub.add_parser(
        "rank",
        help="per-task probabilities of each request's candidates (ranking checkpoints)",
        description="Score candidate sets of each request of a JSON-lines file from a KV cache "
        "of its history.",
    )
    ksource = k.add_mutually_exclusive_group(required=True)
    ksource.add_argument("--checkpoint", metavar="DIR", help="a ranking run's checkpoint")
    ksource.add_argument(
        "--artifact", metavar="DIR", help="an exported ranking artifact (torch only; no cache)"
    )
    k.add_argument("--input", required=True, metavar="FILE", help="JSON lines, one user each")
    k.add_argument("--output", metavar="FILE", help="JSON lines out (default: stdout)")
    k.add_argument("--batch-size", dest="batch_size", type=_positive, default=64, metavar="N")
    k.add_argument("--config", metavar="FILE", help="the run's config.gin if elsewhere")
    k.add_argument(
        "--gin-bindings", dest="gin_bindings", action="append", default=[],
        metavar="'Class.field=value'", help="bindings applied after the config",
    )  # fmt: skip
    k.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    k.add_argument("--log-level", dest="log_level", default="WARNING", help="logging level")
    return parser


def read_requests(path: str | os.PathLike) -> list[dict]:
    """The requests of a JSON-lines file (blank lines skipped); ValueError naming the line of a
    line that is not a JSON object with the expected keys."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise FileNotFoundError(f"--input {file} {what}")
    out = []
    with open(file, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{file}:{n}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(f"{file}:{n}: expected a JSON object, got {type(obj).__name__}")
            if "user_id" not in obj:
                raise ValueError(f"{file}:{n}: missing 'user_id'")
            obj["_line"] = n
            out.append(obj)
    return out


def _progress(total: int) -> tqdm:
    """A bar on the terminal for inputs of 1000 users or more (off when not a TTY or in CI)."""
    return tqdm(
        total=total,
        desc="retrieve",
        unit="user",
        disable=not sys.stderr.isatty() or bool(os.environ.get("CI")) or total < 1000,
        dynamic_ncols=True,
    )


def _chunks(items: list, size: int) -> Iterator[list]:
    for s in range(0, len(items), size):
        yield items[s : s + size]


def _artifact_users(ns: argparse.Namespace, requests: list[dict]):
    """The artifact and the checked requests (each must give its items)."""
    from hstu.inference.artifact import RetrievalArtifact
    from hstu.inference.requests import as_user_history

    artifact = RetrievalArtifact.load(ns.artifact, device=ns.device)
    users = []
    for req in requests:
        where = f"{ns.input}:{req.pop('_line')}"
        if "items" not in req:
            raise ValueError(f"{where}: an artifact holds no histories; give the user's 'items'")
        user = as_user_history(req, where)
        try:
            artifact.inputs([user])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        users.append(user)
    return artifact, users


def _retrieve(ns: argparse.Namespace) -> None:
    if ns.artifact is not None:
        if ns.config or ns.gin_bindings:
            raise UsageError("--config and --gin-bindings apply to --checkpoint only")
        retriever, users = _artifact_users(ns, read_requests(ns.input))
    else:
        retriever, users = _checkpoint_users(ns)
    _write_results(ns, retriever, users)


def _request_user(model, req: dict, where: str):
    """The request's `UserHistory`: its ``items``, else the user's whole stored history."""
    from hstu.inference import as_user_history

    if "items" in req:
        return as_user_history(req, where)
    try:
        return model.dataset_user(req["user_id"])
    except (KeyError, TypeError):
        raise ValueError(
            f"{where}: user {req['user_id']!r} gives no 'items' and is not in the dataset"
        ) from None


def _checkpoint_and_requests(ns: argparse.Namespace, cls):
    """(``cls.from_checkpoint`` of ``--checkpoint``, the requests of ``--input``); a missing
    checkpoint is reported first, before the input is read."""
    ckpt = Path(ns.checkpoint)
    if not ckpt.exists():
        raise FileNotFoundError(f"--checkpoint {ckpt} does not exist")
    requests = read_requests(ns.input)
    model = cls.from_checkpoint(
        ckpt, device=ns.device, config_file=ns.config, bindings=ns.gin_bindings
    )
    return model, requests


@contextlib.contextmanager
def _output(ns: argparse.Namespace):
    """``--output`` opened for writing, or stdout."""
    if not ns.output:
        yield sys.stdout
        return
    with open(ns.output, "w", encoding="utf-8") as out:
        yield out


def _checkpoint_users(ns: argparse.Namespace):
    from hstu.inference import Retriever

    retriever, requests = _checkpoint_and_requests(ns, Retriever)
    users = []
    for req in requests:
        where = f"{ns.input}:{req.pop('_line')}"
        user = _request_user(retriever, req, where)
        retriever.check_users([user], where)
        users.append(user)
    return retriever, users


def _write_results(ns: argparse.Namespace, retriever, users: list) -> None:
    with _output(ns) as out, _progress(len(users)) as bar:
        for chunk in _chunks(users, ns.batch_size):
            ids, scores = retriever.retrieve(
                chunk,
                top_k=ns.top_k,
                exclude_history=not ns.include_history,
                batch_size=ns.batch_size,
            )
            for u, row_ids, row_scores in zip(chunk, ids.tolist(), scores.tolist()):
                kept = [(i, s) for i, s in zip(row_ids, row_scores) if i >= 0]
                line = {
                    "user_id": u.user_id,
                    "items": [i for i, _ in kept],
                    "scores": [round(s, 6) for _, s in kept],
                }
                out.write(json.dumps(line) + "\n")
            bar.update(len(chunk))
    if ns.output:
        logger.info("wrote %d users to %s", len(users), ns.output)


def _candidate_sets(value, where: str) -> tuple[list[list[int]], bool]:
    """(the request's candidate sets, whether it gave several) from its ``candidates``."""
    from hstu.inference.requests import _ints

    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'candidates' must be a non-empty list of item ids or of lists")
    nested = all(isinstance(c, list) for c in value)
    sets = value if nested else [value]
    return [_ints(c, f"{where}: candidates") for c in sets], nested


def _probabilities(user_id: int, logits: list, many: bool) -> str:
    """One output line: per-task probabilities of each candidate, nested as given."""
    probs = [[[round(p, 6) for p in row] for row in t.sigmoid().tolist()] for t in logits]
    return json.dumps({"user_id": user_id, "probabilities": probs if many else probs[0]}) + "\n"


def _rank_artifact(ns: argparse.Namespace) -> None:
    """``rank --artifact``: the exported program on history + each candidate set."""
    from hstu.inference.artifact import RankingArtifact
    from hstu.inference.requests import as_user_history

    if ns.config or ns.gin_bindings:
        raise UsageError("--config and --gin-bindings apply to --checkpoint only")
    artifact = RankingArtifact.load(ns.artifact)
    with _output(ns) as out:
        for req in read_requests(ns.input):
            where = f"{ns.input}:{req.pop('_line')}"
            if "candidates" not in req or "items" not in req:
                raise ValueError(f"{where}: an artifact request needs 'items' and 'candidates'")
            sets, many = _candidate_sets(req.pop("candidates"), where)
            user = as_user_history(req, where)
            try:
                logits = [artifact.score([user], [c]) for c in sets]
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            out.write(_probabilities(user.user_id, logits, many))


def _rank(ns: argparse.Namespace) -> None:
    from hstu.inference.ranker import Ranker

    if ns.artifact is not None:
        _rank_artifact(ns)
        return
    ranker, requests = _checkpoint_and_requests(ns, Ranker)
    users, sets, nested = [], [], []
    for req in requests:
        where = f"{ns.input}:{req.pop('_line')}"
        if "candidates" not in req:
            raise ValueError(f"{where}: missing 'candidates'")
        cand, many = _candidate_sets(req.pop("candidates"), where)
        user = _request_user(ranker, req, where)
        try:
            ranker.check_users([user], where)
            ranker.check_candidates(cand)
        except ValueError as exc:
            if str(exc).startswith(where):
                raise
            raise ValueError(f"{where}: {exc}") from None
        users.append(user)
        sets.append(cand)
        nested.append(many)
    logits = ranker.score_sets(users, sets, batch_size=ns.batch_size)
    with _output(ns) as out:
        for user, per_set, many in zip(users, logits, nested):
            out.write(_probabilities(user.user_id, per_set, many))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0, 1 runtime failure, 2 input/config problem)."""
    try:
        ns = build_parser().parse_args(None if argv is None else list(argv))
        logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.WARNING))
        if ns.command == "retrieve":
            _retrieve(ns)
        elif ns.command == "rank":
            _rank(ns)
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
