"""Load, resolve, log and save a run's configuration.

``load_config(task, files, bindings)`` applies gin files in order (later files win), then
``--gin-bindings`` (which win over files), builds and validates the seven argument classes and
returns them as one :class:`RunConfig`. With no file, the task's embedded default
(``configs/synthetic_<task>.gin``) is used; the dataclass defaults hold the same values, so an
installed package without the ``configs/`` folder behaves the same.

Every problem (unknown class or field, unparsable value, invalid value, missing file) becomes a
:class:`ConfigError` whose message names the binding, where it came from and what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import gin
from gin import config_parser

from hstu.config.args import (
    ARG_CLASSES,
    DatasetArgs,
    EmbeddingArgs,
    NetworkArgs,
    OptimizerArgs,
    RankingArgs,
    RetrievalArgs,
    TrainerArgs,
)

__all__ = [
    "CONFIG_FILENAME",
    "ConfigError",
    "RunConfig",
    "TASKS",
    "default_config_file",
    "format_gin_value",
    "load_config",
    "split_bindings",
]

logger = logging.getLogger(__name__)

TASKS: tuple[str, ...] = ("ranking", "retrieval")
CONFIG_FILENAME = "config.gin"
_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

# Settings of NVIDIA recsys-examples that have no counterpart here, with what to do instead.
_RECSYS_EXAMPLES_HINTS: dict[str, str] = {
    "DatasetArgs.max_sequence_length": "use DatasetArgs.max_history_seqlen",
    "DatasetArgs.num_workers": "batches are built by one background prefetch thread; remove the line",
    "TrainerArgs.profile": "profiling is not built in; remove the line",
    "TrainerArgs.profile_step_start": "profiling is not built in; remove the line",
    "TrainerArgs.profile_step_end": "profiling is not built in; remove the line",
    "TrainerArgs.pipeline_type": "there is a single training pipeline; remove the line",
    "TrainerArgs.enable_balanced_shuffler": "remove the line",
    "RankingArgs.prediction_head_bias": "the head's layers always have biases; remove the line",
    "RankingArgs.eval_metrics": "ranking always reports AUC per task; remove the line",
    "NetworkArgs.num_position_buckets": "use NetworkArgs.num_position_embeddings",
    "NetworkArgs.embedding_backend": "use EmbeddingArgs.embedding_backend",
    "NetworkArgs.norm_epsilon": "remove the line (LayerNorm eps is fixed)",
    "NetworkArgs.is_causal": "HSTU attention here is always causal; remove the line",
    "NetworkArgs.recompute_input_silu": "use NetworkArgs.recompute_uvqk_silu (with NetworkArgs.fused_layer=True)",
    "NetworkArgs.item_embedding_dim": "embeddings have NetworkArgs.hidden_size columns; "
    "remove the line",
    "NetworkArgs.contextual_embedding_dim": "embeddings have NetworkArgs.hidden_size columns; "
    "remove the line",
    "RankingArgs.prediction_head_act_type": "the head uses ReLU; remove the line",
    "RetrievalArgs.l2_norm_eps": "remove the line (fixed)",
    "EmbeddingArgs.feature_names": "tables are defined by the dataset; remove the line",
    "EmbeddingArgs.table_name": "tables are defined by the dataset; remove the line",
    "EmbeddingArgs.item_vocab_size_or_capacity": "use EmbeddingArgs.item_capacity",
    "EmbeddingArgs.sharding_type": "sharding is chosen by torchrec's planner; remove the line",
    "TensorModelParallelArgs": "tensor parallelism is not supported; remove these lines",
    "DynamicEmbeddingArgs": "set EmbeddingArgs.embedding_backend = 'dynamic' and "
    "EmbeddingArgs.item_capacity / user_capacity / eviction_policy",
    "BenchmarkDatasetArgs": "use DatasetArgs.dataset_name = 'synthetic' and the "
    "DatasetArgs.synthetic_* fields",
    "FeatureArgs": "use DatasetArgs.dataset_name = 'synthetic' and the "
    "DatasetArgs.synthetic_* fields",
}


class ConfigError(ValueError):
    """A configuration problem, with a message meant to be printed as is (launchers exit 2)."""


@dataclass
class RunConfig:
    """Everything one run is configured with: the task and the seven argument objects."""

    task: str
    trainer: TrainerArgs = field(default_factory=TrainerArgs)
    dataset: DatasetArgs = field(default_factory=DatasetArgs)
    network: NetworkArgs = field(default_factory=NetworkArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    embedding: EmbeddingArgs = field(default_factory=EmbeddingArgs)
    ranking: RankingArgs = field(default_factory=RankingArgs)
    retrieval: RetrievalArgs = field(default_factory=RetrievalArgs)
    # Where the values came from (files, then bindings), for the log; not part of equality.
    sources: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(
                f"task={self.task!r} is not supported: choose one of "
                + ", ".join(repr(t) for t in TASKS)
            )
        if self.task == "ranking" and self.dataset.max_num_candidates < 1:
            raise ConfigError(
                f"DatasetArgs.max_num_candidates={self.dataset.max_num_candidates} but ranking "
                "scores candidates: set it to at least 1"
            )

    def args(self) -> list[Any]:
        """The seven argument objects, in a fixed order."""
        return [
            self.trainer,
            self.dataset,
            self.network,
            self.optimizer,
            self.embedding,
            self.ranking,
            self.retrieval,
        ]

    def to_gin(self) -> str:
        """The resolved config as gin text: one ``Class.field = value`` line per field."""
        lines = [
            f"# Resolved HSTU configuration (task: {self.task}).",
            "# Every field of every class; load it with --gin-config-file to reproduce the run.",
        ]
        for obj in self.args():
            lines.append("")
            for f in fields(obj):
                value = format_gin_value(getattr(obj, f.name))
                lines.append(f"{type(obj).__name__}.{f.name} = {value}")
        return "\n".join(lines) + "\n"

    def save(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write ``config.gin`` into ``run_dir`` (created if needed) atomically; return its path."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / CONFIG_FILENAME
        fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".gin.tmp", dir=run_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(self.to_gin())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def log_summary(self) -> str:
        """A readable multi-line summary; fields that differ from the defaults are marked ``*``."""
        out = [f"HSTU {self.task} configuration"]
        if self.sources:
            out.append("  from: " + "; ".join(self.sources))
        else:
            out.append("  from: built-in defaults")
        for obj in self.args():
            out.append(f"  {type(obj).__name__}:")
            width = max(len(f.name) for f in fields(obj))
            for f in fields(obj):
                value = getattr(obj, f.name)
                mark = "*" if value != _field_default(f) else " "
                out.append(f"   {mark} {f.name:<{width}} = {format_gin_value(value)}")
        out.append("  (* = differs from the built-in default)")
        return "\n".join(out)


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def format_gin_value(value: Any) -> str:
    """Render a field value as a gin literal that parses back to the same value."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [format_gin_value(v) for v in value]
        if len(items) == 1:
            return f"({items[0]},)"
        return "(" + ", ".join(items) + ")"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a gin value")


def default_config_file(task: str) -> Path | None:
    """The embedded default config of ``task`` when the repo's ``configs/`` folder is present."""
    path = _CONFIGS_DIR / f"synthetic_{task}.gin"
    return path if path.is_file() else None


def split_bindings(bindings: Sequence[str]) -> list[str]:
    """Split each ``--gin-bindings`` value on top-level ``;`` and newlines.

    Separators inside quotes or brackets are kept, so ``X.y = [1,\\n 2]`` stays one binding.
    ``#`` outside quotes starts a comment that runs to the end of the line.
    """
    out: list[str] = []
    for text in bindings:
        if not isinstance(text, str):
            raise ConfigError(f"--gin-bindings value {text!r} must be a string")
        buf: list[str] = []
        depth, quote, comment = 0, "", False
        for ch in text:
            if comment:
                if ch == "\n":
                    comment = False
                else:
                    continue
            if quote:
                buf.append(ch)
                if ch == quote and (len(buf) < 2 or buf[-2] != "\\"):
                    quote = ""
                continue
            if ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(depth - 1, 0)
            elif ch == "#":
                comment = True
                continue
            elif ch in ";\n" and depth == 0:
                piece = "".join(buf).strip()
                if piece:
                    out.append(piece)
                buf = []
                continue
            buf.append(ch)
        piece = "".join(buf).strip()
        if piece:
            out.append(piece)
    return out


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _known_classes_text() -> str:
    return ", ".join(sorted(ARG_CLASSES))


def _field_list(cls: type) -> str:
    return ", ".join(f.name for f in fields(cls))


def _is_literal(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_literal(v) for v in value)
    if isinstance(value, dict):
        return all(_is_literal(k) and _is_literal(v) for k, v in value.items())
    return False


def _where(origin: str, line_num: int | None, is_file: bool) -> str:
    return f"{origin}, line {line_num}" if is_file and line_num is not None else origin


def _check_include(filename: str, parent: str, seen: dict[str, str], depth: int) -> None:
    """Check an included file like a top-level one (gin itself resolves it relative to cwd)."""
    if depth > 20:
        raise ConfigError(f"include {filename!r} in {parent}: includes nested too deep (a cycle?)")
    for candidate in (Path(filename), Path(parent).parent / filename):
        if candidate.is_file():
            text = candidate.read_text(encoding="utf-8")
            _check_statements(text, str(candidate), True, seen, depth + 1)
            return
    # Not found here: gin reports it when parsing (wrapped into a ConfigError).


def _check_statements(
    text: str, origin: str, is_file: bool, seen: dict[str, str], depth: int = 0
) -> None:
    """Check every binding of one gin text names a known class and field and a literal value.

    ``seen`` maps "Class.field" to a description of the last place that set it.
    """
    try:
        parser = config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
        statements = list(parser)
    except SyntaxError as exc:
        raise ConfigError(_syntax_message(exc, text, origin, is_file)) from None
    for st in statements:
        if isinstance(st, config_parser.IncludeStatement) and is_file:
            _check_include(st.filename, origin, seen, depth)
            continue
        if not isinstance(st, config_parser.BindingStatement):
            continue  # import statements: gin handles them (and reports their errors)
        line = (st.location.line_content or "").strip()
        where = _where(origin, st.location.line_num, is_file)
        if not st.arg_name:
            continue  # a macro definition (NAME = value); harmless, the fields take literals
        selector = st.selector.rsplit(".", 1)[-1]
        key = f"{selector}.{st.arg_name}"
        if selector not in ARG_CLASSES:
            hint = _RECSYS_EXAMPLES_HINTS.get(key) or _RECSYS_EXAMPLES_HINTS.get(selector)
            raise ConfigError(
                f"Unknown config class {st.selector!r} in {line!r} ({where}). "
                + (
                    f"This recsys-examples setting has no counterpart here: {hint}. "
                    if hint
                    else ""
                )
                + f"Known classes: {_known_classes_text()}."
            )
        if st.scope:
            raise ConfigError(
                f"Scoped binding {line!r} ({where}) is not supported: the argument classes "
                f"are built once, unscoped; write {key} = ... instead."
            )
        cls = ARG_CLASSES[selector]
        if st.arg_name not in {f.name for f in fields(cls)}:
            hint = _RECSYS_EXAMPLES_HINTS.get(key)
            raise ConfigError(
                f"Unknown field {key!r} in {line!r} ({where}). "
                + (
                    f"This recsys-examples setting has no counterpart here: {hint}. "
                    if hint
                    else ""
                )
                + f"{selector} fields: {_field_list(cls)}."
            )
        if not _is_literal(st.value):
            raise ConfigError(
                f"{key} in {line!r} ({where}) must be a literal value (a number, a quoted "
                "string, True/False, or a list/tuple of those); gin references (@name, %MACRO) "
                "are not supported for these settings."
            )
        seen[key] = f"{line!r} in {origin}" if not is_file else where


def _syntax_message(exc: BaseException, text: str, origin: str, is_file: bool) -> str:
    raw = str(exc.args[0]) if exc.args else str(exc)
    detail = [ln.strip() for ln in raw.splitlines() if ln.strip()]
    # gin appends the useful part ("Failed to parse token 'ml'") after an ast repr.
    token = [d for d in detail if d.startswith("Failed to parse")]
    msg = re.sub(r"\s*\(line \d+\)$", "", (token or detail or [type(exc).__name__])[0]).rstrip(".")
    lineno = getattr(exc, "lineno", None)
    if lineno is None and len(exc.args) > 1 and hasattr(exc.args[1], "line_num"):
        lineno = exc.args[1].line_num
    bad = ""
    lines = text.splitlines()
    if lineno is not None and 1 <= lineno <= len(lines):
        bad = f" {lines[lineno - 1].strip()!r}"
    return (
        f"Cannot parse gin config line{bad} ({_where(origin, lineno, is_file)}): {msg}. "
        "Expected Class.field = value, where strings need quotes "
        '(DatasetArgs.dataset_name = "ml-1m") and lists use brackets '
        "(RankingArgs.prediction_head_arch = [256, 128])."
    )


def _clean_gin_message(exc: BaseException) -> str:
    """Drop the lines gin appends ("In call to configurable ...", file excerpts)."""
    text = str(exc.args[0]) if exc.args else str(exc)
    keep = [ln for ln in text.splitlines() if not ln.startswith("  In ")]
    return " ".join(s.strip() for s in keep if s.strip())


def _drop_gin_path_probe(record: logging.LogRecord) -> bool:
    """gin logs an ERROR for every search-path miss while resolving includes; drop those."""
    return not str(record.msg).startswith("Path not found")


def _parse(text: str, origin: str, filename: str | None) -> None:
    """Hand one checked gin text to gin, turning gin's own errors into ConfigError."""
    try:
        if filename is not None:
            # Let `include 'x.gin'` also resolve next to the including file.
            gin.add_config_file_search_path(str(Path(filename).resolve().parent))
            root = logging.getLogger()
            root.addFilter(_drop_gin_path_probe)
            try:
                gin.parse_config_file(filename)
            finally:
                root.removeFilter(_drop_gin_path_probe)
        else:
            gin.parse_config(text)
    except SyntaxError as exc:
        raise ConfigError(_syntax_message(exc, text, origin, filename is not None)) from None
    except (ValueError, KeyError, ImportError, OSError) as exc:
        raise ConfigError(f"Invalid gin config ({origin}): {_clean_gin_message(exc)}") from None


def load_config(
    task: str,
    config_files: Sequence[str | os.PathLike[str]] | None = None,
    bindings: Sequence[str] | None = None,
) -> RunConfig:
    """Resolve the configuration of one run.

    ``config_files`` apply in order (later wins); ``bindings`` (each may hold several,
    separated by ``;`` or newlines) apply after them and win. Without files the task's embedded
    default is used. gin's global state is cleared first, then holds this run's bindings, so
    code that builds e.g. ``NetworkArgs()`` later sees the same values.
    """
    if task not in TASKS:
        raise ConfigError(
            f"task={task!r} is not supported: choose one of " + ", ".join(repr(t) for t in TASKS)
        )
    files = [Path(f) for f in (config_files or [])]
    sources: list[str] = []
    if not files:
        default = default_config_file(task)
        if default is not None:
            files = [default]
            sources.append(f"embedded default {default.name}")
        else:
            sources.append("built-in defaults")
    else:
        sources.extend(str(f) for f in files)
    split = split_bindings(list(bindings or []))
    sources.extend(f"--gin-bindings {b!r}" for b in split)

    gin.clear_config()
    try:
        return _load(task, files, split, sources)
    except BaseException:
        gin.clear_config()  # a config that failed to load leaves no bindings behind
        raise


def _load(task: str, files: list[Path], split: list[str], sources: list[str]) -> RunConfig:
    seen: dict[str, str] = {}
    for path in files:
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            shipped = sorted(p.name for p in _CONFIGS_DIR.glob("*.gin"))
            raise ConfigError(
                f"--gin-config-file {str(path)!r} {what} (looked at {path.resolve()})."
                + (f" Shipped configs in {_CONFIGS_DIR}: {', '.join(shipped)}." if shipped else "")
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"Cannot read --gin-config-file {str(path)!r}: {exc}") from None
        _check_statements(text, str(path), True, seen)
        _parse(text, str(path), str(path))
    for b in split:
        origin = "--gin-bindings"
        _check_statements(b, origin, False, seen)
        _parse(b, origin, None)

    built: dict[str, Any] = {}
    for name, cls in ARG_CLASSES.items():
        try:
            built[name] = cls()
        except (ValueError, TypeError) as exc:
            msg = _clean_gin_message(exc)
            m = re.match(r"(\w+\.\w+)", msg)
            origin = seen.get(m.group(1)) if m else None
            if origin is None and m:
                origin = "its built-in default"
            raise ConfigError(msg + (f" (set by {origin})" if origin else "")) from None
    config = RunConfig(
        task=task,
        trainer=built["TrainerArgs"],
        dataset=built["DatasetArgs"],
        network=built["NetworkArgs"],
        optimizer=built["OptimizerArgs"],
        embedding=built["EmbeddingArgs"],
        ranking=built["RankingArgs"],
        retrieval=built["RetrievalArgs"],
        sources=tuple(sources),
    )
    return config
