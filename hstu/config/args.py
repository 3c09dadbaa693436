"""Gin-configurable, validated run settings.

Seven dataclasses, one per concern. Every field is checked in ``__post_init__``; a bad value
raises ``ValueError`` (or ``TypeError`` for a wrong type) whose message names the gin binding
(``Class.field=value``) and what is allowed, so a launcher can print it and exit.

Class and field names follow NVIDIA recsys-examples (``examples/hstu``) where they overlap, so
its gin files load here; see ``docs/configuration.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import gin

from hstu.config.limits import (
    INT32_MAX,
    INT64_MAX,
    MAX_ITEM_ID,
    MAX_NUM_TASKS,
    STORAGES,
    parse_hbm_cache,
)

__all__ = [
    "ARG_CLASSES",
    "DatasetArgs",
    "EmbeddingArgs",
    "NetworkArgs",
    "OptimizerArgs",
    "RankingArgs",
    "RetrievalArgs",
    "SUPPORTED_DATASETS",
    "TrainerArgs",
]

# Datasets with a converter (docs/design.md "Data flow"). dataset_name is not limited to these: any
# plain name whose files were prepared under data/<name>/ (or DatasetArgs.dataset_path) loads.
SUPPORTED_DATASETS: tuple[str, ...] = (
    "synthetic",
    "ml-1m",
    "ml-20m",
    "kuairand-pure",
    "kuairand-1k",
    "kuairand-27k",
)
_DATASET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
KERNEL_BACKENDS: tuple[str, ...] = ("cutlass",)
# "hstu": pointwise SiLU attention; "softmax": the SASRec-style baseline (same layer otherwise)
ATTENTION_TYPES: tuple[str, ...] = ("hstu", "softmax")
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
DENSE_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd")
LR_SCHEDULERS: tuple[str, ...] = ("constant", "cosine", "linear")
EMBEDDING_BACKENDS: tuple[str, ...] = ("torchrec", "dynamic", "dense")
CONTEXTUAL_TABLES: tuple[str, ...] = ("torchrec", "dense")
PLAIN_TABLE_OPTIMIZER_CHOICES: tuple[str, ...] = ("dense", "sparse")
# NetworkArgs.relative_attention_bias: which learned relative attention bias terms every HSTU
# layer adds inside the SiLU (Meta HSTU's position and bucketed-time bias; docs/design.md)
RELATIVE_ATTENTION_BIAS: tuple[str, ...] = ("none", "position", "time", "position_time")
# NetworkArgs.num_time_buckets: at most this many (the compiled attention kernel's limit)
MAX_TIME_BUCKETS = 256
# NetworkArgs.fused_gate_kernel: the fused layer's LayerNorm(attn)*u*dropout implementation
FUSED_GATE_KERNELS: tuple[str, ...] = ("auto", "cuda", "compiled")
# boolean NetworkArgs fields that switch code paths of the fused layer (default True = on)
FUSED_LAYER_SWITCHES: tuple[str, ...] = (
    "fused_elementwise_kernels",
    "fused_layernorm_kernel",
    "fused_stage_compile",
    "fused_residual_gemm",
)
# token padding of the jagged batch: "auto" on CUDA only, "on" everywhere, "off" never
PAD_TOKENS: tuple[str, ...] = ("auto", "on", "off")
# NetworkArgs.cuda_graph_scope: what a CUDA graph replays
CUDA_GRAPH_SCOPES: tuple[str, ...] = ("step", "encoder")
SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adagrad", "rowwise_adagrad")
INITIALIZERS: tuple[str, ...] = ("normal", "uniform", "truncated_normal", "constant")
EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu")
NEGATIVE_SAMPLING: tuple[str, ...] = ("random", "in_batch", "mixed")
# how a global batch is split over ranks (hstu.data.loader.BatchIterator)
RANK_BALANCE: tuple[str, ...] = ("cost", "strided")
BEST_METRIC_MODES: tuple[str, ...] = ("auto", "max", "min")
_METRIC_RE = re.compile(r"^(HR|NDCG)@([1-9][0-9]*)$|^MRR$")
# why the upper bounds (hstu.config.limits) hold, for the messages
_DIM = "a tensor dimension: int32 in the CUDA kernels"
_LEN = "a jagged sequence length: int32 in the CUDA kernels"
_COUNT = "a step count: int64"
_MEM = "the memory check at model build bounds it further"


# --------------------------------------------------------------------------------------------
# Field checks. Each takes the binding name ("Class.field") so messages point at the gin line.
# --------------------------------------------------------------------------------------------


def _binding(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}.{name}"


def _int(
    obj: Any,
    name: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    why: str = "",
    what: str = "",
) -> int:
    """Check an int field; ``max_value`` bounds it from above, ``why`` says why (the message)."""
    value = getattr(obj, name)
    b = _binding(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        # Accept integral floats written as e.g. 1e4 in a gin file.
        if isinstance(value, float) and not isinstance(value, bool) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(
                f"{b}={value!r} must be an integer, got {type(value).__name__}"
                + (f" ({what})" if what else "")
            )
    if min_value is not None and value < min_value:
        if min_value == 1:
            raise ValueError(f"{b}={value!r} must be a positive integer")
        if min_value == 0:
            raise ValueError(f"{b}={value!r} must be a non-negative integer" + _hint(what))
        raise ValueError(f"{b}={value!r} must be an integer >= {min_value}" + _hint(what))
    if max_value is not None and value > max_value:
        raise ValueError(_too_large(b, value, max_value, why))
    object.__setattr__(obj, name, value)
    return value


def _too_large(binding: str, value: Any, max_value: int, why: str) -> str:
    limit = {INT32_MAX: "2^31 - 1", INT64_MAX: "2^63 - 1"}.get(max_value, "")
    bound = f"{max_value}" + (f" = {limit}" if limit else "")
    return f"{binding}={value!r} is too large: use at most {bound}" + _hint(why)


def _hint(what: str) -> str:
    return f" ({what})" if what else ""


def _float(
    obj: Any,
    name: str,
    *,
    min_value: float | None = None,
    max_value: float | None = None,
    min_exclusive: bool = False,
    max_exclusive: bool = False,
    what: str = "",
) -> float:
    value = getattr(obj, name)
    b = _binding(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{b}={value!r} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{b}={value!r} must be a finite number")
    lo_bad = min_value is not None and (value <= min_value if min_exclusive else value < min_value)
    hi_bad = max_value is not None and (value >= max_value if max_exclusive else value > max_value)
    if lo_bad or hi_bad:
        lo = "" if min_value is None else ("(" if min_exclusive else "[") + f"{min_value:g}"
        hi = "" if max_value is None else f"{max_value:g}" + (")" if max_exclusive else "]")
        if max_value is None:
            rng = f"> {min_value:g}" if min_exclusive else f">= {min_value:g}"
        elif min_value is None:
            rng = f"< {max_value:g}" if max_exclusive else f"<= {max_value:g}"
        else:
            rng = f"in {lo}, {hi}"
        raise ValueError(f"{b}={value!r} must be {rng}" + _hint(what))
    object.__setattr__(obj, name, value)
    return value


def _bool(obj: Any, name: str) -> bool:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise TypeError(
            f"{_binding(obj, name)}={value!r} must be True or False, got {type(value).__name__}"
        )
    return value


def _str(obj: Any, name: str, *, allow_empty: bool = True) -> str:
    value = getattr(obj, name)
    b = _binding(obj, name)
    if not isinstance(value, str):
        raise TypeError(f"{b}={value!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"{b}={value!r} must be a non-empty string")
    return value


def _choice(obj: Any, name: str, allowed: Sequence[str]) -> str:
    value = _str(obj, name)
    if value not in allowed:
        b = _binding(obj, name)
        if len(allowed) == 1:
            raise ValueError(f"{b}={value!r} is not supported: only {allowed[0]!r}")
        options = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{b}={value!r} is not supported: choose one of {options}")
    return value


def _seq(obj: Any, name: str) -> tuple[Any, ...]:
    """Gin gives lists or tuples; store a tuple so configs compare and hash alike."""
    value = getattr(obj, name)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{_binding(obj, name)}={value!r} must be a list or tuple, got {type(value).__name__}"
        )
    value = tuple(value)
    object.__setattr__(obj, name, value)
    return value


# --------------------------------------------------------------------------------------------
# The seven argument classes.
# --------------------------------------------------------------------------------------------


@gin.configurable
@dataclass
class TrainerArgs:
    """Loop lengths, batch sizes, evaluation, logging (TensorBoard) and checkpoints."""

    train_batch_size: int = 32  # global, summed over ranks
    eval_batch_size: int = 64  # global
    max_train_iters: int = 200
    max_eval_iters: int = 0  # 0 = the whole eval set
    eval_interval: int = 100  # 0 = only at the end
    log_interval: int = 10
    ckpt_save_interval: int = 0  # 0 = only at the end, -1 = never
    ckpt_save_dir: str = ""  # "" = <run_dir>/checkpoints
    ckpt_load_dir: str = ""  # resume from here when set
    seed: int = 1234
    log_dir: str = "runs"  # TensorBoard + run directories live under it
    run_name: str = ""  # "" = automatic (task + timestamp)
    progress_bar: bool = True
    peak_tflops: float = 0.0  # for MFU; 0 = 312 (A100 bf16 dense)
    rank_balance: str = "cost"  # split of a global batch over ranks: "cost" (LPT) or "strided"
    gc_interval: int = 50  # Python GC: young generations every N steps (all ranks), 0 = automatic
    route_ids_ahead: bool = True  # several ranks: exchange dynamic-table ids a step ahead
    # write into a run directory / ckpt_save_dir that holds another run or configuration
    allow_existing_run_dir: bool = False
    # resume weights, step, data position and RNG but a fresh dense optimizer state
    ckpt_reset_optimizer: bool = False
    ckpt_keep_last: int = 3  # checkpoints kept in ckpt_save_dir (older ones pruned); 0 = all
    # PyTorch's CPU threads (torch.set_num_threads) while the trainer runs; 0 = PyTorch's
    # default (one per core). Several runs sharing one machine: 1 (docs/benchmarks.md)
    cpu_threads: int = 0
    # the evaluation metric that picks the best checkpoint (exempt from ckpt_keep_last) and that
    # early stopping watches: "" = none, "auto" = the task's headline metric (auc/mean; the first
    # of RetrievalArgs.eval_metrics), or a name as the evaluations log it (NDCG@10, auc/click, loss)
    best_metric: str = ""
    best_metric_mode: str = "auto"  # max | min | auto (min for a loss, else max)
    # stop after this many evaluations in a row without a better best_metric; 0 = never
    early_stop_patience: int = 0

    def __post_init__(self) -> None:
        _int(self, "train_batch_size", min_value=1, max_value=INT32_MAX, why=_DIM)
        _int(self, "eval_batch_size", min_value=1, max_value=INT32_MAX, why=_DIM)
        _int(self, "max_train_iters", min_value=0, max_value=INT64_MAX, why=_COUNT)
        _int(
            self,
            "max_eval_iters",
            min_value=0,
            max_value=INT64_MAX,
            why=_COUNT,
            what="0 = the whole eval set",
        )
        _int(
            self,
            "eval_interval",
            min_value=0,
            max_value=INT64_MAX,
            why=_COUNT,
            what="0 = evaluate only at the end",
        )
        _int(self, "log_interval", min_value=1, max_value=INT64_MAX, why=_COUNT)
        _int(
            self,
            "cpu_threads",
            min_value=0,
            max_value=INT32_MAX,
            why="a thread count",
            what="0 = PyTorch's default",
        )
        _int(
            self,
            "ckpt_save_interval",
            min_value=-1,
            max_value=INT64_MAX,
            why=_COUNT,
            what="0 = save only at the end, -1 = never save",
        )
        _str(self, "ckpt_save_dir")
        _str(self, "ckpt_load_dir")
        _int(self, "seed", min_value=0, max_value=INT64_MAX, why="seeds: int64")
        _str(self, "log_dir", allow_empty=False)
        name = _str(self, "run_name")
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(
                f"TrainerArgs.run_name={name!r} must be a plain directory name (no path "
                "separators); set TrainerArgs.log_dir to choose the parent directory"
            )
        _bool(self, "progress_bar")
        _float(self, "peak_tflops", min_value=0.0, what="0 = 312, the A100 bf16 peak")
        _choice(self, "rank_balance", RANK_BALANCE)
        _int(
            self,
            "gc_interval",
            min_value=0,
            max_value=INT64_MAX,
            why=_COUNT,
            what="0 = Python's automatic collection",
        )
        _bool(self, "route_ids_ahead")
        _bool(self, "allow_existing_run_dir")
        _bool(self, "ckpt_reset_optimizer")
        _int(self, "ckpt_keep_last", min_value=0, max_value=INT64_MAX, what="0 = keep all")
        _str(self, "best_metric")
        _choice(self, "best_metric_mode", BEST_METRIC_MODES)
        _int(
            self,
            "early_stop_patience",
            min_value=0,
            max_value=INT64_MAX,
            why=_COUNT,
            what="evaluations without improvement; 0 = never stop early",
        )
        if self.early_stop_patience and not self.best_metric.strip():
            raise ValueError(
                f"TrainerArgs.early_stop_patience={self.early_stop_patience} needs the metric it "
                "watches: set TrainerArgs.best_metric (e.g. 'auto', the task's headline metric)"
            )
        if self.early_stop_patience and self.eval_interval == 0:
            raise ValueError(
                f"TrainerArgs.early_stop_patience={self.early_stop_patience} needs evaluations "
                "during training, but TrainerArgs.eval_interval=0 evaluates only at the end; set "
                "TrainerArgs.eval_interval to the steps between evaluations"
            )


@gin.configurable
@dataclass
class DatasetArgs:
    """Which dataset, where it lives, and the sequence shapes batches are cut to."""

    dataset_name: str = "synthetic"
    dataset_path: str = ""  # "" = data/<dataset_name>
    max_history_seqlen: int = 128
    max_num_candidates: int = 10
    shuffle: bool = True
    synthetic_num_users: int = 2000
    synthetic_num_items: int = 1000
    synthetic_seed: int = 0
    # planted time effect of the synthetic data (0 = off): the share of steps whose next item
    # follows the time gap since the previous interaction (docs/datasets.md)
    synthetic_time_effect: float = 0.0

    def __post_init__(self) -> None:
        name = _str(self, "dataset_name", allow_empty=False)
        if not _DATASET_NAME_RE.match(name):
            raise ValueError(
                f"DatasetArgs.dataset_name={name!r} must be a plain name (letters, digits, "
                "'-', '_', '.'), e.g. "
                + ", ".join(repr(n) for n in SUPPORTED_DATASETS)
                + "; put a path in DatasetArgs.dataset_path instead"
            )
        _str(self, "dataset_path")
        hist = _int(self, "max_history_seqlen", min_value=1, max_value=INT32_MAX, why=_LEN)
        cand = _int(self, "max_num_candidates", min_value=0, max_value=INT32_MAX, why=_LEN)
        if hist + cand > INT32_MAX:
            raise ValueError(
                f"DatasetArgs.max_history_seqlen + DatasetArgs.max_num_candidates = {hist + cand} "
                f"is too large: use at most {INT32_MAX} = 2^31 - 1 in total ({_LEN})"
            )
        _bool(self, "shuffle")
        _int(
            self,
            "synthetic_num_users",
            min_value=1,
            max_value=INT32_MAX,
            why="user ids: int32; the memory check bounds it further",
        )
        _int(
            self,
            "synthetic_num_items",
            min_value=2,
            max_value=MAX_ITEM_ID,
            why="item ids: int32, the range the tables index",
        )
        _int(self, "synthetic_seed", min_value=0)
        _float(self, "synthetic_time_effect", min_value=0.0, max_value=1.0)


@gin.configurable
@dataclass
class NetworkArgs:
    """HSTU stack shape, attention settings, kernel backend and compute dtype.

    ``kv_channels`` is the per-head width of q/k/v and is independent of ``hidden_size``
    (HSTU projects hidden_size -> heads * kv_channels), as in recsys-examples.

    Kernel and code-path choices (``kernel_backend``, ``fused_layer``, ``recompute_*``,
    ``fused_*``) are resolved once when the model is built and handed to `HSTUEncoder` as
    constructor arguments; `HSTUEncoder.kernel_choices()` reports what they resolved to.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 2
    kv_channels: int = 32
    hidden_dropout: float = 0.1
    kernel_backend: str = "cutlass"
    dtype_str: str = "bfloat16"
    target_group_size: int = 1
    max_attn_len: int = 0  # local window; 0 = unlimited
    attn_alpha: float = 0.0  # 0 = 1/sqrt(kv_channels)
    scaling_seqlen: int = 0  # 0 = the batch's max sequence length
    num_position_embeddings: int = 0  # 0 = derived from DatasetArgs
    attention_type: str = "hstu"  # "softmax" = SASRec-style baseline in the same layer
    # True: FusedHSTULayer (one autograd Function, the fast path on GPU: docs/benchmarks.md);
    # False: HSTULayer, the unfused twin (the reference the tests compare against)
    fused_layer: bool = False
    recompute_input_layernorm: bool = False  # fused layer: recompute LayerNorm(x) in backward
    recompute_uvqk_silu: bool = False  # fused layer: store only the uvqk pre-activation
    fused_gate_kernel: str = "auto"  # fused layer LayerNorm*u*dropout: auto | cuda | compiled
    # fused layer, CUDA: the hstu_lnmd chunk-major SiLU and fp32-gradient cast kernels where they
    # apply (False: the aten ops; A/B runs)
    fused_elementwise_kernels: bool = True
    # fused layer, CUDA, fp32 residual stream: the input LayerNorm (+ cast) forward and backward
    # kernels of hstu_lnmd (needs fused_elementwise_kernels; False: the torch.compiled stages)
    fused_layernorm_kernel: bool = True
    # fused layer, CUDA: torch.compile the elementwise PyTorch stages (False: eager; debugging)
    fused_stage_compile: bool = True
    # fused layer with the CUDA gating kernel and an fp32 residual stream: x + y W_o^T + b_o as
    # one GEMM that reads x (no 16-bit projection written and added back; False: two ops)
    fused_residual_gemm: bool = True
    # CUDA, fp32 embeddings: the preprocessor's token assembly (item + position + action
    # embeddings, contextual tokens, padding rows, input dropout) as one hstu_lnmd kernel each
    # way (hstu.modules.token_assembly; False: the PyTorch ops, ~80 kernels a step)
    fused_token_assembly: bool = True
    # Meta HSTU reference (research/) settings; the defaults keep this framework's own choices
    # learned relative attention bias inside the SiLU: none | position | time | position_time
    # ("time" needs a dataset with timestamps; docs/design.md "Relative attention bias")
    relative_attention_bias: str = "none"
    num_time_buckets: int = 128  # time bias: log-spaced buckets of the time gap (1 to 256)
    relative_attention_bias_per_head: bool = False  # one weight row per head (False: shared)
    scale_item_embeddings: bool = False  # item embedding * sqrt(hidden_size) before positions
    position_init_std: float = 0.02  # std of the position embedding rows
    uvqk_init_std: float = 0.0  # 0 = Xavier uniform W_uvqk; > 0 = N(0, std)
    final_layernorm: bool = True  # LayerNorm after the last layer
    use_contextual_features: bool = True  # False: no contextual tokens (item sequence only)
    pad_tokens: str = (
        "auto"  # pad the jagged token count so matmul shapes repeat: auto (CUDA) | on | off
    )
    # training on CUDA (one process or several): the training step replayed from CUDA graphs
    # captured per input shape (hstu.modules.graphed_encoder, hstu.training.step_graphs).
    # Opt-in (False: eager every step):
    # on in the small dataset configs (host-bound); a GPU-bound step such as the benchmark
    # model's runs faster eager (docs/benchmarks.md)
    cuda_graphs: bool = False
    # with cuda_graphs: token counts per power of two that a graphed step's tokens are padded to
    # (a power of two; one graph pair per count: fewer counts, fewer captures and more padding
    # rows, up to 1/count more; the eager step pads to 32)
    cuda_graph_pad_sizes: int = 8
    # with cuda_graphs: "step" replays the whole training step (forward, loss, backward,
    # optimizer; hstu.training.step_graphs) where it can (retrieval or ranking with plain,
    # dynamic or torchrec tables, Adam; on several processes too, the gradients averaged
    # inside the step instead of by DDP), the encoder's forward + backward
    # elsewhere; "encoder": the encoder only (large models whose host time is hidden: less
    # memory)
    cuda_graph_scope: str = "step"

    def __post_init__(self) -> None:
        _int(self, "num_layers", min_value=1, max_value=INT32_MAX, why=_MEM)
        _int(self, "hidden_size", min_value=1, max_value=INT32_MAX, why=_DIM)
        heads = _int(self, "num_attention_heads", min_value=1, max_value=INT32_MAX, why=_DIM)
        kv = _int(self, "kv_channels", min_value=1, max_value=INT32_MAX, why=_DIM)
        if 4 * heads * kv > INT32_MAX:
            raise ValueError(
                f"NetworkArgs.num_attention_heads x NetworkArgs.kv_channels = {heads * kv} is too "
                f"large: the u, v, q, k projection is 4 x {heads * kv} wide, at most {INT32_MAX} "
                "= 2^31 - 1; lower NetworkArgs.num_attention_heads or NetworkArgs.kv_channels"
            )
        _float(self, "hidden_dropout", min_value=0.0, max_value=1.0, max_exclusive=True)
        _choice(self, "kernel_backend", KERNEL_BACKENDS)
        _choice(self, "dtype_str", DTYPES)
        _int(self, "target_group_size", min_value=1, max_value=INT32_MAX, why=_LEN)
        _int(
            self,
            "max_attn_len",
            min_value=0,
            max_value=INT32_MAX,
            why=_LEN,
            what="0 = no local window",
        )
        _float(self, "attn_alpha", min_value=0.0, what="0 = 1/sqrt(kv_channels)")
        _int(
            self,
            "scaling_seqlen",
            min_value=0,
            max_value=INT32_MAX,
            why=_LEN,
            what="0 = the batch's max sequence length",
        )
        _int(
            self,
            "num_position_embeddings",
            min_value=0,
            max_value=INT32_MAX,
            why=_LEN,
            what="0 = derived from DatasetArgs",
        )
        _choice(self, "attention_type", ATTENTION_TYPES)
        _bool(self, "fused_layer")
        _bool(self, "recompute_input_layernorm")
        _bool(self, "recompute_uvqk_silu")
        _choice(self, "fused_gate_kernel", FUSED_GATE_KERNELS)
        _bool(self, "fused_elementwise_kernels")
        _bool(self, "fused_layernorm_kernel")
        _bool(self, "fused_stage_compile")
        _bool(self, "fused_residual_gemm")
        _bool(self, "fused_token_assembly")
        _choice(self, "relative_attention_bias", RELATIVE_ATTENTION_BIAS)
        _int(
            self,
            "num_time_buckets",
            min_value=1,
            max_value=MAX_TIME_BUCKETS,
            why="the compiled attention kernel's limit",
        )
        _bool(self, "relative_attention_bias_per_head")
        _bool(self, "scale_item_embeddings")
        _float(self, "position_init_std", min_value=0.0)
        _float(self, "uvqk_init_std", min_value=0.0, what="0 = Xavier uniform")
        _bool(self, "final_layernorm")
        _bool(self, "use_contextual_features")
        _choice(self, "pad_tokens", PAD_TOKENS)
        _choice(self, "cuda_graph_scope", CUDA_GRAPH_SCOPES)
        _bool(self, "cuda_graphs")
        sizes = _int(
            self,
            "cuda_graph_pad_sizes",
            min_value=1,
            max_value=1024,
            why="token counts per power of two; padding rounds to at least 128 rows anyway",
        )
        if sizes & (sizes - 1):
            raise ValueError(
                f"NetworkArgs.cuda_graph_pad_sizes={sizes} must be a power of two (1, 2, 4, ... "
                "1024): token counts per power of two that a graphed step pads to"
            )
        if not self.fused_layer and self.fused_gate_kernel != "auto":
            raise ValueError(
                f"NetworkArgs.fused_gate_kernel={self.fused_gate_kernel!r} applies only to the "
                "fused layer; set NetworkArgs.fused_layer=True or leave it at 'auto'"
            )
        if not self.fused_layer and (self.recompute_input_layernorm or self.recompute_uvqk_silu):
            raise ValueError(
                "NetworkArgs.recompute_input_layernorm / NetworkArgs.recompute_uvqk_silu apply "
                "only to the fused layer; set NetworkArgs.fused_layer=True or turn them off"
            )
        for name in FUSED_LAYER_SWITCHES:
            if not self.fused_layer and not getattr(self, name):
                raise ValueError(
                    f"NetworkArgs.{name}=False applies only to the fused layer; set "
                    "NetworkArgs.fused_layer=True or leave it at True"
                )


@gin.configurable
@dataclass
class OptimizerArgs:
    """Dense optimizer and learning-rate schedule."""

    optimizer_str: str = "adam"
    learning_rate: float = 1e-3
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0  # SGD only
    warmup_iters: int = 0
    lr_scheduler: str = "constant"
    min_lr_ratio: float = 0.0  # floor of cosine/linear decay, as a fraction of learning_rate
    grad_clip_norm: float = 0.0  # 0 = no clipping

    def __post_init__(self) -> None:
        _choice(self, "optimizer_str", DENSE_OPTIMIZERS)
        _float(self, "learning_rate", min_value=0.0, min_exclusive=True)
        _float(self, "adam_beta1", min_value=0.0, max_value=1.0, max_exclusive=True)
        _float(self, "adam_beta2", min_value=0.0, max_value=1.0, max_exclusive=True)
        _float(self, "adam_eps", min_value=0.0, min_exclusive=True)
        _float(self, "weight_decay", min_value=0.0)
        _float(self, "momentum", min_value=0.0, max_value=1.0, max_exclusive=True)
        _int(self, "warmup_iters", min_value=0)
        _choice(self, "lr_scheduler", LR_SCHEDULERS)
        _float(self, "min_lr_ratio", min_value=0.0, max_value=1.0)
        _float(self, "grad_clip_norm", min_value=0.0, what="0 = no clipping")


@gin.configurable
@dataclass
class EmbeddingArgs:
    """Embedding tables: backend, capacity of dynamic tables, sparse optimizer, init."""

    embedding_backend: str = "torchrec"  # torchrec | dynamic | dense (dense optimizer)
    # with the dynamic backend: the small contextual tables as torchrec tables (sharded, fused
    # sparse optimizer) or "dense" (plain nn.Embedding replicated by DDP, dense optimizer: no
    # torchrec input/output all-to-alls, which cost host time and a host sync per step)
    contextual_tables: str = "torchrec"
    item_capacity: int = 0  # dynamic tables; 0 = derived from the dataset
    user_capacity: int = 0
    sparse_optimizer_str: str = "rowwise_adagrad"
    sparse_learning_rate: float = 0.0  # 0 = OptimizerArgs.learning_rate
    # plain tables (embedding_backend 'dense', or contextual_tables 'dense'): "dense" = the dense
    # optimizer updates every row at every step (Meta's reference HSTU); "sparse" =
    # sparse_optimizer_str at sparse_learning_rate on the rows a step looked up, as a dynamic
    # table does (hstu.embeddings.plain_optimizer; CUDA-graph safe)
    plain_table_optimizer: str = "dense"
    initializer: str = "normal"
    init_std: float = 0.02  # std (normal), half-width (uniform) or the value (constant)
    eviction_policy: str = "lru"
    # dynamic tables: "hbm" keeps every row in GPU memory; "hybrid" keeps the rows (and their
    # optimizer state) in host memory and the hot ones in an HBM cache of `hbm_cache`
    storage: str = "hbm"
    # hybrid tables' HBM cache, per table and GPU: a fraction of the rows in (0, 1] (float) or
    # bytes (int > 1)
    hbm_cache: float | int = 0.1
    # the dynamic tables' training lookup replayed from CUDA graphs, one per padded id count
    # (hstu.embeddings.lookup_graphs; GPU tables with storage "hbm"): the same results, ~40
    # fewer ops for the host to issue per table and step
    dynamic_lookup_graphs: bool = True

    def __post_init__(self) -> None:
        _choice(self, "embedding_backend", EMBEDDING_BACKENDS)
        _choice(self, "contextual_tables", CONTEXTUAL_TABLES)
        if self.contextual_tables == "dense" and self.embedding_backend == "torchrec":
            raise ValueError(
                "EmbeddingArgs.contextual_tables='dense' needs embedding_backend='dynamic' (the "
                "torchrec backend keeps every table in one torchrec collection); use "
                "contextual_tables='torchrec' or embedding_backend='dynamic'"
            )
        for name in ("item_capacity", "user_capacity"):
            _int(
                self,
                name,
                min_value=0,
                max_value=INT64_MAX,
                why="table slots: int64; the memory check bounds it further",
                what="0 = derived from the dataset",
            )
        _choice(self, "sparse_optimizer_str", SPARSE_OPTIMIZERS)
        _float(self, "sparse_learning_rate", min_value=0.0, what="0 = OptimizerArgs.learning_rate")
        _choice(self, "plain_table_optimizer", PLAIN_TABLE_OPTIMIZER_CHOICES)
        plain = self.embedding_backend == "dense" or self.contextual_tables == "dense"
        if self.plain_table_optimizer == "sparse" and not plain:
            raise ValueError(
                "EmbeddingArgs.plain_table_optimizer='sparse' applies to plain tables, but "
                f"EmbeddingArgs.embedding_backend='{self.embedding_backend}' with "
                f"contextual_tables='{self.contextual_tables}' has none; set "
                "EmbeddingArgs.embedding_backend='dense' (or plain_table_optimizer='dense')"
            )
        _choice(self, "initializer", INITIALIZERS)
        _float(self, "init_std", min_value=0.0)
        _choice(self, "eviction_policy", EVICTION_POLICIES)
        _choice(self, "storage", STORAGES)
        if self.storage == "hybrid" and self.embedding_backend != "dynamic":
            raise ValueError(
                f"EmbeddingArgs.storage='hybrid' applies to dynamic tables, but "
                f"EmbeddingArgs.embedding_backend='{self.embedding_backend}'; set "
                "EmbeddingArgs.embedding_backend='dynamic' (or EmbeddingArgs.storage='hbm')"
            )
        cache = parse_hbm_cache(self.hbm_cache, "EmbeddingArgs.hbm_cache")
        object.__setattr__(self, "hbm_cache", cache)


@gin.configurable
@dataclass
class RankingArgs:
    """Multi-task ranking head: MLP hidden sizes, tasks, loss weights."""

    prediction_head_arch: tuple[int, ...] = (256, 128)
    num_tasks: int = 8
    task_weights: tuple[float, ...] = ()  # empty = all 1.0
    prediction_head_dropout: float = 0.0

    def __post_init__(self) -> None:
        arch = _seq(self, "prediction_head_arch")
        for size in arch:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"RankingArgs.prediction_head_arch={list(arch)!r} must hold positive "
                    f"integers (MLP hidden sizes), got {size!r}"
                )
            if size > INT32_MAX:
                raise ValueError(
                    _too_large("RankingArgs.prediction_head_arch", list(arch), INT32_MAX, _DIM)
                )
        tasks = _int(
            self,
            "num_tasks",
            min_value=1,
            max_value=MAX_NUM_TASKS,
            why="actions are an int64 bitmask, one bit per task",
        )
        weights = _seq(self, "task_weights")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 or w != w:
                raise ValueError(
                    f"RankingArgs.task_weights={list(weights)!r} must hold non-negative "
                    f"numbers, got {w!r}"
                )
        if weights and len(weights) != tasks:
            raise ValueError(
                f"RankingArgs.task_weights has {len(weights)} entries but "
                f"RankingArgs.num_tasks={tasks}: give one weight per task, or () for all 1.0"
            )
        object.__setattr__(self, "task_weights", tuple(float(w) for w in weights))
        _float(self, "prediction_head_dropout", min_value=0.0, max_value=1.0, max_exclusive=True)

    def head_hidden_sizes(self) -> tuple[int, ...]:
        """Hidden layer sizes of the MLP head (the num_tasks output layer is added after them).

        recsys-examples files list the output layer last (``[512, 8]`` with 8 tasks); such a
        trailing entry equal to ``num_tasks`` is taken as the output layer and dropped here.
        """
        arch = tuple(self.prediction_head_arch)
        if arch and arch[-1] == self.num_tasks:
            return arch[:-1]
        return arch

    def resolved_task_weights(self) -> tuple[float, ...]:
        """Per-task loss weights, 1.0 each when ``task_weights`` is empty."""
        return tuple(self.task_weights) if self.task_weights else (1.0,) * self.num_tasks


@gin.configurable
@dataclass
class RetrievalArgs:
    """Retrieval loss (sampled softmax) and evaluation metrics."""

    num_negatives: int = 128
    temperature: float = 0.05
    negative_sampling: str = "random"
    eval_metrics: tuple[str, ...] = (
        "HR@10",
        "NDCG@10",
        "HR@50",
        "NDCG@50",
        "HR@200",
        "NDCG@200",
        "MRR",
    )
    eval_exclude_history: bool = True  # don't rank items the user has already seen

    def __post_init__(self) -> None:
        _int(
            self,
            "num_negatives",
            min_value=1,
            max_value=INT32_MAX,
            why=_DIM + "; the memory check bounds it further",
        )
        _float(self, "temperature", min_value=0.0, min_exclusive=True)
        _choice(self, "negative_sampling", NEGATIVE_SAMPLING)
        metrics = _seq(self, "eval_metrics")
        if not metrics:
            raise ValueError(
                "RetrievalArgs.eval_metrics=() must name at least one metric: "
                "'HR@K', 'NDCG@K' (K a positive integer) or 'MRR'"
            )
        normalised = []
        for m in metrics:
            if not isinstance(m, str) or not _METRIC_RE.match(m.strip().upper()):
                raise ValueError(
                    f"RetrievalArgs.eval_metrics contains {m!r}, which is not supported: "
                    "use 'HR@K', 'NDCG@K' (K a positive integer) or 'MRR'"
                )
            if "@" in m and int(m.split("@")[1]) > INT32_MAX:
                raise ValueError(_too_large("RetrievalArgs.eval_metrics", m, INT32_MAX, _DIM))
            normalised.append(m.strip().upper())
        dup = sorted({m for m in normalised if normalised.count(m) > 1})
        if dup:
            raise ValueError(f"RetrievalArgs.eval_metrics lists {dup} more than once")
        object.__setattr__(self, "eval_metrics", tuple(normalised))
        _bool(self, "eval_exclude_history")

    def metric_ks(self) -> tuple[int, ...]:
        """The distinct cut-offs K named in ``eval_metrics``, ascending."""
        ks = {int(m.split("@")[1]) for m in self.eval_metrics if "@" in m}
        return tuple(sorted(ks))


ARG_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        TrainerArgs,
        DatasetArgs,
        NetworkArgs,
        OptimizerArgs,
        EmbeddingArgs,
        RankingArgs,
        RetrievalArgs,
    )
}


def field_names(cls: type) -> list[str]:
    """The configurable field names of one argument class, in declaration order."""
    return [f.name for f in fields(cls)]
