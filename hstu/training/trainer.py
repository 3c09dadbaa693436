"""The training loop: a short loop over components (data, model, optimizers, checkpointer, logger).

``run_training(config, device_mode)`` is what both launchers call. It works the same on one CPU
process (CPU development mode), N gloo processes, or N GPUs under torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.profiler import record_function
from tqdm import tqdm

from hstu.config.gin_utils import RunConfig
from hstu.config.limits import dense_optimizer_states
from hstu.data.batch import Batch
from hstu.data.loader import BatchIterator, PrefetchIterator, linear_cost_coefficient
from hstu.data.registry import build_samples, load_sequence_data
from hstu.embeddings.stack import format_memory_plan
from hstu.models.base import GenerativeRecommender
from hstu.models.builder import build_model
from hstu.modules.metrics import (
    RankingMetrics,
    RetrievalEvaluator,
    held_out_histories,
    ks_from_metric_names,
)
from hstu.training.best import (
    BestMetric,
    eval_metric_names,
    headline_metric,
    resolve_best_metric,
)
from hstu.training.checkpoint import Checkpointer, capture_rng_state, restore_rng_state
from hstu.training.distributed import (
    DistInfo,
    FlatGradients,
    all_reduce_sum,
    all_reduce_sum_host,
    barrier,
    cleanup,
    init_distributed,
    wrap_model,
)
from hstu.training.flops import StackShape, peak_tflops_for, step_flops
from hstu.training.gc_control import StepGC
from hstu.training.logger import MetricLogger, format_duration
from hstu.training.optim import build_dense_optimizer, build_lr_scheduler, clip_grad_norm
from hstu.training.pipeline import SparseDistPipeline
from hstu.training.reshard import (
    fit_optimizer_state_shapes,
    restore_into,
    to_portable,
    unexpected_keys,
    upgrade_state_keys,
)
from hstu.training.rundir import (
    append_metrics,
    config_identity,
    mark_finished,
    mark_started,
    setup_run_dir,
)
from hstu.training.step_graphs import (
    StepGraphs,
    StepOutputs,
    float_learning_rates,
    graph_safe_optimizer,
    staged,
    step_graphs_unsupported,
    update_tables,
)

__all__ = ["TrainResult", "Trainer", "run_training"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, global mean loss)
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    final_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_dir: Path | None = None
    # TrainerArgs.best_metric: {"metric", "mode", "value", "step", "checkpoint"} of the best
    # evaluation; the step early stopping ended the run at (TrainerArgs.early_stop_patience)
    best: dict | None = None
    stopped_early_at: int | None = None


def _progress_enabled(cfg: RunConfig, info: DistInfo) -> bool:
    return (
        info.is_main
        and cfg.trainer.progress_bar
        and sys.stderr.isatty()
        and not os.environ.get("CI")
    )


def _loss_count(batch: Batch, task: str) -> int:
    """Number of loss terms in the batch: candidates (ranking) or next-item pairs (retrieval)."""
    if task == "ranking":
        return int(batch.num_candidates.sum())
    return int(torch.clamp(batch.history_lengths() - 1, min=0).sum())


# statistics of at most this many steps wait on the device before being read back
_MAX_PENDING_STEPS = 64


@dataclass
class _PendingStep:
    """Statistics of a step whose device values have not been read back yet."""

    loss_sum: torch.Tensor  # [1] float64 on the device, summed over ranks
    global_count: float
    samples: float
    local_tokens: float
    lengths: torch.Tensor | None  # attention sequence lengths of this rank (CPU when known)
    grad_norm: torch.Tensor | None
    task_losses: torch.Tensor | None


def _dense_optimizer_of(state: dict) -> str | None:
    """The dense optimizer a rank file's ``dense_optimizer`` state belongs to, for files written
    before the name was recorded in meta.json: "sgd", "adam", "adamw", "adam/adamw" (torch
    versions whose param groups do not tell them apart) or None when it cannot be told."""
    groups = (state.get("dense_optimizer") or {}).get("param_groups") or []
    if not groups:
        return None
    group = groups[0]
    if "momentum" in group and "dampening" in group:
        return "sgd"
    if "betas" in group:
        if "decoupled_weight_decay" in group:
            return "adamw" if group["decoupled_weight_decay"] else "adam"
        return "adam/adamw"
    return None


def precision_note(autocast_dtype: torch.dtype | None) -> str:
    """A warning for a compute dtype that trains with a known risk ("" for none): float16
    autocast has no loss scaling here, so gradients below float16's range become zero."""
    if autocast_dtype != torch.float16:
        return ""
    return (
        "NetworkArgs.dtype_str='float16' trains without loss scaling: gradients smaller than "
        "float16 can hold (~6e-8) become zero and training may stall or degrade silently; "
        "'bfloat16' (the default) keeps float32's range"
    )


class Trainer:
    """Holds the components of one run; ``fit()`` trains, evaluates and checkpoints."""

    def __init__(self, cfg: RunConfig, device_type: str = "cpu") -> None:
        self.cfg = cfg
        self.info = init_distributed(device_type)
        # PyTorch's CPU thread count while this trainer runs (TrainerArgs.cpu_threads; restored
        # by close and after a failed start)
        self._cpu_threads_before = torch.get_num_threads()
        if cfg.trainer.cpu_threads:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        try:
            self._setup(cfg)
        except BaseException:
            # a run that cannot start leaves no process group (nor threads, files) behind: the
            # next Trainer of this process starts as cleanly as the first
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Releases what a failed `__init__` had set up."""
        for name in ("pipeline", "tb"):
            part = getattr(self, name, None)
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - the original error is the one to raise
                    logger.warning("closing %s after a failed start", name, exc_info=True)
        cleanup(self.info)
        torch.set_num_threads(self._cpu_threads_before)

    def _setup(self, cfg: RunConfig) -> None:
        t = cfg.trainer
        self.device = self.info.device
        torch.manual_seed(t.seed)
        np.random.seed(t.seed % (2**32))
        # run directory before any work: output locations checked, a new run never reuses an
        # earlier run's directory, resuming into one is explicit (hstu.training.rundir)
        self.run = setup_run_dir(cfg, self.info.rank, self.info.world_size)
        self.run_dir = self.run.path

        # data
        # ranking needs RankingArgs.num_tasks action signals; retrieval needs none (the synthetic
        # generator still makes 8)
        if cfg.task == "ranking":
            num_tasks = cfg.ranking.num_tasks
        else:
            num_tasks = 8 if cfg.dataset.dataset_name == "synthetic" else 0
        self.data = load_sequence_data(cfg.dataset, num_tasks=num_tasks)
        splits = build_samples(self.data, cfg.dataset, cfg.task)
        self.train_samples, self.eval_samples = splits.train, splits.eval
        net = cfg.network
        # global batch split over ranks by HSTU cost L^2 + c L (hstu.data.loader); 1 rank: no-op
        balance = {
            "balance": t.rank_balance,
            "linear_cost": linear_cost_coefficient(
                net.hidden_size, net.num_attention_heads, net.kv_channels
            ),
        }
        # the next batches are collated (and pinned, on GPU) in a background thread; the
        # checkpointed data position is that of the batches consumed
        self.train_iter = PrefetchIterator(
            BatchIterator(
                self.train_samples,
                t.train_batch_size,
                shuffle=cfg.dataset.shuffle,
                seed=t.seed,
                rank=self.info.rank,
                world_size=self.info.world_size,
                drop_last=True,
                loss_counts=getattr(self.train_samples, "loss_counts", lambda: None)(),
                **balance,
            ),
            depth=2,
            pin_memory=self.device.type == "cuda",
            device=self.device,
        )
        self.eval_iter = BatchIterator(
            self.eval_samples,
            t.eval_batch_size,
            shuffle=False,
            seed=t.seed,
            rank=self.info.rank,
            world_size=self.info.world_size,
            drop_last=False,
            batch_size_binding="TrainerArgs.eval_batch_size",
            **balance,
        )

        # model
        model = build_model(cfg, self.data, device_type=self.device.type)
        model.embeddings.configure_sparse_optimizer(self.device.type)
        # CUDA graphs of the whole step where they apply; on several processes the step then
        # averages the gradients itself inside the graph (FlatGradients) instead of DDP
        self._no_step_graphs = self._step_graphs_unsupported(model)
        own_reduce = self._averages_gradients_itself()
        self.model = wrap_model(
            model, self.info, model.embeddings, data_parallel=False if own_reduce else None
        )
        self.core: GenerativeRecommender = self.model.module
        self.embeddings = self.core.embeddings
        # plain tables trained like sparse ones (EmbeddingArgs.plain_table_optimizer='sparse')
        self.table_optimizer = self.embeddings.build_plain_table_optimizer()
        tables = self.table_optimizer.param_groups if self.table_optimizer is not None else []
        table_params = [p for g in tables for p in g["params"]]
        dense = [
            p
            for n, p in self.model.named_parameters()
            if p.requires_grad
            and not self.embeddings.is_sparse_parameter(n)
            and all(p is not q for q in table_params)
        ]
        self.num_dense_params = sum(p.numel() for p in dense)
        self.dense_params = dense
        self.optimizer = build_dense_optimizer(dense, cfg.optimizer)
        self.grad_reducer = (
            FlatGradients(dense + table_params, self.info.world_size) if own_reduce else None
        )
        # CUDA graphs of the whole step where they apply (before the scheduler: the learning
        # rate becomes a device tensor that it fills); the encoder's own graphs otherwise
        self.step_graphs: StepGraphs | None = None
        if not self._no_step_graphs:
            self.step_graphs = StepGraphs(
                self.core,
                self._optimize,
                dense + table_params,
                self.device,
                autocast=self._autocast,
                pad_sizes_per_octave=net.cuda_graph_pad_sizes,
                split_eager=own_reduce,
            )
            graph_safe_optimizer(self.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer, t.max_train_iters)
        self.autocast_dtype = _DTYPES[cfg.network.dtype_str] if self.device.type == "cuda" else None
        note = precision_note(self.autocast_dtype)
        if note and self.info.is_main:
            logger.warning(note)
        self.stack_shape = StackShape(
            net.num_layers, net.hidden_size, net.num_attention_heads, net.kv_channels
        )
        self.peak_tflops = peak_tflops_for(self.device, t.peak_tflops)

        # logging, checkpoints (the run directory was set up first thing)
        self.checkpointer = Checkpointer(self.run.ckpt_dir, keep_last=t.ckpt_keep_last)
        self.tb = MetricLogger(str(self.run_dir), enabled=self.info.is_main)
        # Python GC at fixed steps on every rank (active inside fit() and the benchmarks' loops)
        self.gc = StepGC(t.gc_interval)
        # the host half of each training batch's layout is computed on the prefetch thread,
        # while the GPU runs the steps before it (BaseGR.prepare_host; a graphed step's padding
        # and layout: StepGraphs.prepare)
        if self.step_graphs is not None:
            self.train_iter.set_prepare(self.step_graphs.prepare)
        else:
            self.train_iter.set_prepare(
                functools.partial(self.core.prepare_host, device=self.device)
            )
        # sharded dynamic tables: the ids of training batch i+1 go to their owner ranks (gloo,
        # background thread) while step i runs; the same decision on every rank (config only).
        # Graphed steps on several ranks route their padded batch's ids and the corpus
        split = self.step_graphs is not None and self.step_graphs.split_eager
        self.pipeline = SparseDistPipeline(
            self.train_iter,
            self.embeddings,
            ahead=t.route_ids_ahead,
            start=self.step_graphs.start_input_dist if split else None,
            fixed_extra_ids=split,
        )
        self.step = 0
        self.best = self._best_metric()
        self._saved: tuple[int, Path] | None = None  # the step and directory saved last
        if t.ckpt_load_dir:
            self._load_checkpoint(t.ckpt_load_dir)
            if self.step_graphs is not None:
                graph_safe_optimizer(self.optimizer, self.device)  # the loaded groups' flags
        if self.info.is_main:
            mark_started(self.run, cfg)  # from now on a run of the same name gets a new directory
        if self.info.is_main:
            logger.info(
                "model: %d dense parameters, tables %s; run directory %s; %d CPU threads",
                self.num_dense_params,
                [(s.name, s.num_embeddings, s.embedding_dim) for s in self.core.table_specs],
                self.run_dir,
                torch.get_num_threads(),
            )
            plan = self.embeddings.memory_plan(
                self.info.world_size,
                self.device.type,
                dense_optimizer_states(cfg.optimizer),
            )
            logger.info("embedding tables:\n%s", format_memory_plan(plan))
            choices = self.core.encoder.kernel_choices(self.device)
            choices["cuda_graphs"] = self._graphs_choice()
            torchrec_lookup = self.embeddings.torchrec_lookup()
            if torchrec_lookup:
                choices["torchrec_lookup"] = torchrec_lookup
            logger.info("kernels: %s", ", ".join(f"{k}={v}" for k, v in choices.items()))

    # ---- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict:
        # Sharded torchrec tensors become (offset, piece) records (hstu.training.reshard), so the
        # files load on any world size.
        state = {
            "step": self.step,
            "world_size": self.info.world_size,
            "model": to_portable(self.model.state_dict()),
            "fused_optimizer": to_portable(self.model.fused_optimizer.state_dict()),
            "dense_optimizer": float_learning_rates(self.optimizer.state_dict()),
            "scheduler": float_learning_rates(self.scheduler.state_dict()),
            "train_iter": self.pipeline.state_dict(),
            "rng": capture_rng_state(),
        }
        if self.table_optimizer is not None:
            state["table_optimizer"] = self.table_optimizer.state_dict()
        if self.best is not None:
            state["best_metric"] = self.best.state_dict()
        # table state outside state_dict() (dynamic rows + their optimizer state)
        state.update(self.embeddings.checkpoint_state())
        return state

    def save_checkpoint(self) -> Path:
        """Saves this step's checkpoint (collective), once: a second call at the same step (the
        best evaluation's save, then the interval's or the final one) returns the first's."""
        if self._saved is not None and self._saved[0] == self.step:
            return self._saved[1]
        path = self.checkpointer.save(
            self.step,
            self._state(),
            rank=self.info.rank,
            world_size=self.info.world_size,
            extra_meta={
                "task": self.cfg.task,
                "dataset": self.cfg.dataset.dataset_name,
                # compared on resume before any state is loaded
                "dense_optimizer": self.cfg.optimizer.optimizer_str,
                "sparse_optimizer": self.cfg.embedding.sparse_optimizer_str,
                "config_identity": config_identity(self.cfg),
                **self.embeddings.checkpoint_meta(),
            },
        )
        if self.info.is_main:
            logger.info("checkpoint saved: %s", path)
        self._saved = (self.step, path)
        return path

    def _best_metric(self) -> BestMetric | None:
        """The tracker of TrainerArgs.best_metric (None when unset), its name checked against
        what this run's evaluations report."""
        t = self.cfg.trainer
        if not t.best_metric.strip():
            return None
        ks = ks_from_metric_names(self.cfg.retrieval.eval_metrics)
        names = eval_metric_names(self.cfg.task, self._task_names(), ks)
        headline = headline_metric(self.cfg.task, self.cfg.retrieval.eval_metrics, names)
        metric, mode = resolve_best_metric(t.best_metric, t.best_metric_mode, names, headline)
        return BestMetric(metric, mode, t.early_stop_patience)

    def _load_checkpoint(self, load_dir: str) -> None:
        """Restore a checkpoint written by any number of ranks.

        Same world size: each rank reads its own file. Different world size: each rank maps every
        saved rank file and takes torchrec shards by their global offsets (whatever the planner
        placed here), dynamic rows by id hash (the merged dumps, each rank keeping the ids it
        owns), and the replicated parts (dense weights, dense optimizer, scheduler, data
        position) from rank 0. RNG: see `_restore_rng`.
        """
        step, state, meta = self.checkpointer.load(
            load_dir, rank=self.info.rank, world_size=self.info.world_size
        )
        saved_ws = int(meta.get("world_size", 1))
        resharded = saved_ws != self.info.world_size
        if resharded and int(meta.get("format_version", 1)) < 2:
            raise ValueError(
                f"checkpoint {load_dir} was written by {saved_ws} processes in checkpoint format "
                f"{meta.get('format_version', 1)}, whose torchrec shards are tied to that world "
                f"size; resume it with --nproc_per_node={saved_ws} and save again (the new "
                f"format loads on any number of processes)"
            )
        self.embeddings.check_checkpoint(
            meta.get("extra_meta", {}), state, f"checkpoint {load_dir}"
        )
        reset = bool(self.cfg.trainer.ckpt_reset_optimizer)
        self._check_optimizers(meta.get("extra_meta", {}), state, f"checkpoint {load_dir}", reset)
        # authoritative copy first: this rank's own file, or rank 0's when re-sharding
        sources = Checkpointer.load_all_ranks(meta["path"], mmap=True) if resharded else [state]
        # files written before the tables moved into model.embeddings name them one level up
        sources = [upgrade_state_keys(s) for s in sources]
        current = self.model.state_dict()
        extra = unexpected_keys(current, sources[0]["model"])
        if extra:
            raise ValueError(
                f"checkpoint {load_dir} holds model entries this model lacks: {extra[:8]}; was "
                f"it written with a different configuration?"
            )
        where = f"checkpoint {meta['path']}"
        model_state = restore_into(current, [s["model"] for s in sources], f"{where} model")
        self.model.load_state_dict(model_state)
        self.embeddings.load_checkpoint_state(sources)
        fused = restore_into(
            self.model.fused_optimizer.state_dict(),
            [s["fused_optimizer"] for s in sources],
            f"{where} fused_optimizer",
        )
        self.model.fused_optimizer.load_state_dict(fused)
        if self.table_optimizer is not None:
            # replicated like the dense optimizer: the authoritative copy's; the sparse
            # optimizer's state is always restored (it lives with the tables)
            if "table_optimizer" not in sources[0]:
                raise ValueError(
                    f"{where} holds no state of the plain tables' sparse optimizer (written "
                    "with EmbeddingArgs.plain_table_optimizer='dense'?); resume with "
                    "--gin-bindings \"EmbeddingArgs.plain_table_optimizer='dense'\""
                )
            self.table_optimizer.load_state_dict(sources[0]["table_optimizer"])
        if reset:
            self._start_schedule_at(int(step))
        else:
            # the implementation flags (fused / foreach) are this run's choice for this device,
            # not the saving run's (a file written on CPU, or before the fused Adam, resumes fused)
            groups = self.optimizer.param_groups
            impl = [{k: g.get(k) for k in ("fused", "foreach", "capturable")} for g in groups]
            configured = list(self.scheduler.base_lrs)
            self.optimizer.load_state_dict(sources[0]["dense_optimizer"])
            # states saved for a parameter whose shape changed since (an older checkpoint's
            # position bias [2L-1] is now [1, 2L-1]) are reshaped to it
            fit_optimizer_state_shapes(self.optimizer)
            for group, flags in zip(self.optimizer.param_groups, impl):
                group.update(flags)
            self.scheduler.load_state_dict(sources[0]["scheduler"])
            if self.info.is_main and not np.allclose(self.scheduler.base_lrs, configured):
                logger.warning(
                    "resuming with the checkpoint's learning rate %s, not OptimizerArgs."
                    "learning_rate=%s (the optimizer state carries it); set "
                    "TrainerArgs.ckpt_reset_optimizer=True to apply the configured one",
                    self.scheduler.base_lrs,
                    configured,
                )
        self.pipeline.load_state_dict(sources[0]["train_iter"])
        if self.best is not None and "best_metric" in sources[0]:
            if not self.best.load_state_dict(sources[0]["best_metric"]) and self.info.is_main:
                logger.info(
                    "%s followed another best metric (%s); %s starts over",
                    where,
                    sources[0]["best_metric"].get("metric"),
                    self.best.metric,
                )
        self._restore_rng(state["rng"], resharded, int(step))
        self.step = int(step)
        if self.info.is_main:
            logger.info(
                "resumed from %s at step %d (saved by %d processes, now %d)",
                load_dir,
                self.step,
                saved_ws,
                self.info.world_size,
            )

    def _check_optimizers(self, extra_meta: dict, state: dict, where: str, reset: bool) -> None:
        """Refuses a checkpoint written with another dense optimizer (unless
        TrainerArgs.ckpt_reset_optimizer) or another sparse optimizer, before any state is
        loaded. Files from before the names were recorded: the dense one is told by its state."""
        saved = extra_meta.get("dense_optimizer") or _dense_optimizer_of(state)
        current = self.cfg.optimizer.optimizer_str
        if saved and current not in saved.split("/") and not reset:
            raise ValueError(
                f"{where} was written with OptimizerArgs.optimizer_str='{saved}' but this run "
                f"uses '{current}': resume with --gin-bindings "
                f"\"OptimizerArgs.optimizer_str='{saved.split('/')[0]}'\", or set "
                f"TrainerArgs.ckpt_reset_optimizer=True to start a fresh {current} state "
                "(weights, step, data position and RNG are still restored)"
            )
        saved = extra_meta.get("sparse_optimizer")
        current = self.cfg.embedding.sparse_optimizer_str
        # sparse optimizer state in the file: torchrec's fused one, or table state the stack
        # keeps outside state_dict() (any entry `_state` does not write itself)
        own = {"step", "world_size", "model", "fused_optimizer", "dense_optimizer", "scheduler"}
        own |= {"train_iter", "rng"}
        has_sparse = bool(state.get("fused_optimizer", {}).get("state")) or bool(set(state) - own)
        if saved and saved != current and has_sparse:
            raise ValueError(
                f"{where} was written with EmbeddingArgs.sparse_optimizer_str='{saved}' but this "
                f"run uses '{current}': resume with --gin-bindings "
                f"\"EmbeddingArgs.sparse_optimizer_str='{saved}'\" (the sparse optimizer's "
                "state lives in the tables and is always restored)"
            )

    def _start_schedule_at(self, step: int) -> None:
        """TrainerArgs.ckpt_reset_optimizer: the fresh dense optimizer continues the configured
        learning-rate schedule at ``step`` (as if the schedule had run all along)."""
        sched = self.scheduler
        sched.last_epoch = step
        lrs = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs  # what get_last_lr() reports
        if self.info.is_main:
            logger.info(
                "TrainerArgs.ckpt_reset_optimizer: the dense optimizer (%s) starts fresh at step "
                "%d with learning rate %s",
                self.cfg.optimizer.optimizer_str,
                step,
                lrs,
            )

    def _restore_rng(self, saved: dict, resharded: bool, step: int) -> None:
        """Same world size: this rank's saved RNG streams (bit-exact resume). Otherwise the
        per-rank streams have no counterpart, so every rank reseeds Python, NumPy and torch
        (CPU + CUDA) from (TrainerArgs.seed, step, rank): reproducible, distinct per rank."""
        if not resharded:
            restore_rng_state(saved)
            return
        seq = np.random.SeedSequence([self.cfg.trainer.seed, step, self.info.rank])
        seed = int(seq.generate_state(1, dtype=np.uint64)[0] % (2**63))
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    # ---- steps -----------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None or self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_dtype)

    def train_step(self) -> dict[str, float]:
        """One optimisation step; returns its statistics as floats (one host<->device sync).

        `fit()` uses `_train_step_async()` instead and resolves statistics only every
        `TrainerArgs.log_interval` steps, so the host can queue the next step's kernels while the
        GPU still runs this one."""
        return self._resolve([self._train_step_async()])[0]

    def _train_step_async(self) -> _PendingStep:
        """One optimisation step without host<->device syncs of its own: loss-term counts come
        from the host-side batch (the global counts the loader attached, else the local counts
        summed over ranks through a gloo group), the loss, gradient
        norm and attention lengths stay on the device until `_resolve`."""
        self.gc.step()
        if not self.model.training:
            # after an evaluation (model.eval() sets every module): one recursive pass then, not
            # a walk over the whole module tree at every step (host time the GPU waits for)
            self.model.train()
        # pinned already on GPU (PrefetchIterator); sparse_input: its embedding input dist,
        # started during the previous step (SparseDistPipeline)
        host_batch, sparse_input = next(self.pipeline)
        if host_batch.global_counts is not None:
            # known from the global batch on every rank: no per-step host collective (it would
            # make every rank's host wait for the slowest one at the start of each step)
            global_count, samples = host_batch.global_counts
        else:
            local_count = _loss_count(host_batch, self.cfg.task)
            global_count, samples = all_reduce_sum_host([local_count, host_batch.batch_size])
        normalizer = max(global_count, 1.0) / self.info.world_size
        # the graphs copy the (padded) host batch themselves; None: the step runs eagerly here
        done = None
        if self.step_graphs is not None:
            done = self.step_graphs.step(host_batch, normalizer, sparse_input)
        if done is not None:
            outputs, lengths, tokens = done
        else:
            if self.device.type == "cuda":
                # the device batch keeps host_batch as its CPU twin: the model reads sizes from it
                batch = host_batch.to(self.device, non_blocking=True)
            else:
                batch = host_batch.to(self.device)
            if self.step_graphs is not None and self.step_graphs.split_eager:
                out, grad_norm = self._update_split(batch, normalizer, sparse_input)
            else:
                out, grad_norm = self._update(batch, normalizer, sparse_input)
            outputs = self._step_outputs(out, grad_norm)
            attn = self.core.last_attention_inputs
            lengths = attn.real_lengths() if attn is not None else None
            tokens = out["num_tokens"]
        self.scheduler.step()
        if self.info.world_size > 1:
            # queued on the stream, no host wait; after the gradients' all-reduce (inside a
            # graphed step or `_update`), so every rank issues the same collectives per step
            # whichever way its step ran
            torch.distributed.all_reduce(outputs.loss_sum)
        return _PendingStep(
            loss_sum=outputs.loss_sum,
            global_count=float(global_count),
            samples=float(samples),
            local_tokens=float(tokens),
            lengths=lengths,
            grad_norm=outputs.grad_norm,
            task_losses=outputs.task_losses,
        )

    def _update(self, batch: Batch, normalizer, sparse_input=None):
        """Forward, backward, gradient clipping, the dense optimizer's step and the gradients
        zeroed: (the model's outputs, the gradient norm or None). The scheduler steps outside."""
        with record_function("hstu/forward"), self._autocast():
            out = self.model(batch, loss_normalizer=normalizer, sparse_input=sparse_input)
        with record_function("hstu/backward"):
            out["loss"].backward()
        if self.grad_reducer is not None:  # several processes without DDP (graphed steps)
            with record_function("hstu/gradient_all_reduce"):
                self.grad_reducer.all_reduce()
        with record_function("hstu/optimizer"):
            grad_norm = clip_grad_norm(
                self.dense_params, self.cfg.optimizer.grad_clip_norm, as_tensor=True
            )
            for optimizer in (self.optimizer, self.table_optimizer):
                if optimizer is not None:
                    optimizer.step()
                    # the step graphs hold the gradients' addresses, and FlatGradients' are
                    # views of its buffers: zeroed in place then
                    optimizer.zero_grad(
                        set_to_none=self.step_graphs is None and self.grad_reducer is None
                    )
        return out, grad_norm

    def _update_split(self, batch: Batch, normalizer, sparse_input=None):
        """`_update` split at the dynamic and torchrec tables' rows, as a graphed step runs it:
        their lookup, the step on copies of the rows (the dense gradients' all-reduce inside
        it), then the tables' updates from the copies' gradients. On several processes with
        graphed steps a step that runs eagerly (a batch the graphs do not take, graphs turned
        off after a failed capture) so issues its collectives in a replay's order: the rows'
        exchange, the all-reduce, the gradients' exchange."""
        with record_function("hstu/table_lookup"):
            rows = self.step_graphs.lookup_sparse(batch, sparse_input)
        with staged(self.embeddings, rows) as leaves:
            out, grad_norm = self._update(batch, normalizer)
        with record_function("hstu/table_update"):
            update_tables(rows, leaves)
        return out, grad_norm

    def _optimize(self, batch: Batch, normalizer) -> StepOutputs:
        """The step that `StepGraphs` captures (and runs eagerly on a padded batch): `_update`,
        returning its loss sum (float64 [1]), gradient norm and per-task losses (ranking)."""
        return self._step_outputs(*self._update(batch, normalizer))

    def _step_outputs(self, out: dict, grad_norm) -> StepOutputs:
        """What a step reports from the model's outputs ``out`` and its gradient norm."""
        loss_sum = out["loss_sum"].detach().to(torch.float64).reshape(1)
        task_losses = out.get("task_losses") if self.cfg.task == "ranking" else None
        return StepOutputs(
            loss_sum, grad_norm, task_losses if task_losses is None else task_losses.detach()
        )

    def _averages_gradients_itself(self) -> bool:
        """Whether the step averages the dense gradients over the ranks itself
        (`FlatGradients`, inside the step's graphs) instead of DDP: several processes whose
        whole step is graphed."""
        return self.info.world_size > 1 and not self._no_step_graphs

    def _step_graphs_unsupported(self, model: GenerativeRecommender) -> str:
        """Why this run's training step (of ``model``, before or after its wrapping) is not
        graphed whole ("" when it is)."""
        net = self.cfg.network
        if self.device.type != "cuda":
            return "CPU"
        if not net.cuda_graphs:
            return "NetworkArgs.cuda_graphs=False"
        if net.cuda_graph_scope != "step":
            return f"NetworkArgs.cuda_graph_scope={net.cuda_graph_scope!r}"
        return step_graphs_unsupported(model, self.cfg.optimizer.optimizer_str, self.cfg.task)

    def _resolve(self, pending: list[_PendingStep]) -> list[dict[str, float]]:
        """Converts queued step statistics to floats: one device->host copy for all of them, one
        host-side collective for the token and FLOP totals."""
        if not pending:
            return []
        dev = [p.loss_sum.reshape(1) for p in pending]
        if pending[0].grad_norm is not None:
            dev += [p.grad_norm.detach().to(dev[0]).reshape(1) for p in pending]
        host = torch.cat(dev).cpu().tolist()
        n = len(pending)
        local = [float(p.local_tokens) for p in pending]
        local += [
            0.0 if p.lengths is None else step_flops(self.stack_shape, p.lengths.cpu()).total
            for p in pending
        ]
        totals = all_reduce_sum_host(local)
        out = []
        for i, p in enumerate(pending):
            row = {
                "loss": host[i] / max(p.global_count, 1.0),
                "tokens": totals[i],
                "samples": p.samples,
                "flops": totals[n + i],
            }
            if p.grad_norm is not None:
                row["grad_norm"] = host[n + i]
            if p.task_losses is not None:
                for name, value in zip(self._task_names(), p.task_losses.tolist()):
                    row[f"task_loss/{name}"] = value
            out.append(row)
        return out

    def _embedding_stats(self) -> dict[str, float]:
        """`embeddings/<table>/<stat>` (summed over ranks when sharded; collective then, so
        every rank calls it)."""
        return {f"embeddings/{k}": float(v) for k, v in self.embeddings.stats().items()}

    def _task_names(self) -> list[str]:
        names = list(self.data.action_names)[: self.cfg.ranking.num_tasks]
        return names + [f"task{i}" for i in range(len(names), self.cfg.ranking.num_tasks)]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        max_batches = self.cfg.trainer.max_eval_iters or None
        loss_sum = count = 0.0
        if self.cfg.task == "ranking":
            metrics = RankingMetrics(self.cfg.ranking.num_tasks, self._task_names())
        else:
            rt = self.cfg.retrieval
            corpus = torch.from_numpy(self.data.item_corpus())
            evaluator = RetrievalEvaluator(
                corpus,
                ks=ks_from_metric_names(rt.eval_metrics),
                exclude_history=rt.eval_exclude_history,
            )
            corpus_emb = self._corpus_embeddings(corpus)
        batches = self.eval_iter.eval_index_batches()
        if max_batches:
            batches = batches[:max_batches]
        for idx in batches:
            empty = len(idx) == 0
            # every rank runs the same number of forwards (sharded tables are collective); a rank
            # whose share of the last batch is empty runs sample 0 and discards it
            host_batch = self.eval_samples.collate(idx if not empty else [0])
            if self.device.type == "cuda":  # pinned: the copy does not wait for the GPU
                host_batch = host_batch.pin_memory()
            batch = host_batch.to(self.device, non_blocking=self.device.type == "cuda")
            with self._autocast():
                out = self.model(batch)
            if empty:
                continue
            if "loss_sum" in out:
                loss_sum += float(out["loss_sum"])
                count += float(out["count"])
            if self.cfg.task == "ranking":
                metrics.update(out["logits"].float().cpu(), host_batch.labels)
            else:
                # scored against the whole corpus where the queries are (the GPU), in chunks
                evaluator.update(
                    out["query"].float(),
                    corpus_emb,
                    host_batch.target_item_ids,
                    held_out_histories(self.data, host_batch.user_ids)
                    if rt.eval_exclude_history
                    else None,
                )
        loss_sum, count = all_reduce_sum([loss_sum, count], self.device)
        result = metrics.compute() if self.cfg.task == "ranking" else evaluator.compute()
        if self.cfg.task == "ranking":
            result["loss"] = loss_sum / max(count, 1.0)
        return result

    def _corpus_embeddings(self, corpus: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
        """[C, D] float embeddings of the corpus, on the training device."""
        parts = []
        for s in range(0, corpus.numel(), chunk):
            ids = corpus[s : s + chunk].to(self.device)
            with self._autocast():
                parts.append(self.core.item_embeddings(ids).float())
        return torch.cat(parts)

    # ---- the loop --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        t = self.cfg.trainer
        fit_start = time.perf_counter()
        result = TrainResult(run_dir=self.run_dir)
        bar = tqdm(
            total=t.max_train_iters,
            initial=self.step,
            desc=f"{self.cfg.task} train",
            disable=not _progress_enabled(self.cfg, self.info),
            dynamic_ncols=True,
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with self.gc:
                self._fit_loop(result, bar)
        finally:
            bar.close()  # before any error line, so that it starts on a line of its own
        self._log_graph_stats()
        if not (result.evals and result.evals[-1][0] == self.step):  # stopped early: evaluated
            self._run_eval(result)
        result.final_metrics = result.evals[-1][1] if result.evals else {}
        if t.ckpt_save_interval >= 0:
            result.checkpoint_dir = self.save_checkpoint()
        if self.best is not None:
            result.best = self.best.summary()
        self.tb.hparams(
            self._hparams(), {f"hparam/{k}": v for k, v in result.final_metrics.items()}
        )
        self.tb.flush()
        if self.info.is_main:
            mark_finished(
                self.run,
                self.cfg,
                step=self.step,
                final_metrics=result.final_metrics,
                checkpoint=str(result.checkpoint_dir) if result.checkpoint_dir else None,
                best=result.best,
                stopped_early_at=result.stopped_early_at,
                # this process's training, evaluations and checkpoints (not its start-up)
                fit_s=round(time.perf_counter() - fit_start, 3),
            )
        barrier()
        return result

    def _graphs_choice(self) -> str:
        if self.step_graphs is not None:
            if self.grad_reducer is not None:
                return (
                    "on (the whole training step replayed per batch shape; the gradients "
                    "averaged over the ranks inside it, not by DDP)"
                )
            return "on (the whole training step replayed per batch shape)"
        if getattr(self.core.encoder, "graphs", None) is None:
            if not self.cfg.network.cuda_graphs:
                return "off (NetworkArgs.cuda_graphs=False)"
            return "off (the layers run a PyTorch attention)"
        if self.device.type != "cuda":
            return "n/a (CPU)"
        step = self._no_step_graphs
        if self.cfg.network.cuda_graph_scope == "step" and step:
            return f"on (encoder forward+backward per input shape; not the whole step: {step})"
        return "on (encoder forward+backward replayed per input shape)"

    def graph_stats(self):
        """The `GraphStats` of the step's CUDA graphs, else of the encoder's, or None where
        nothing is graphed."""
        if self.step_graphs is not None:
            return self.step_graphs.stats
        graphs = getattr(self.core.encoder, "graphs", None)
        return None if graphs is None else graphs.stats

    def _log_graph_stats(self) -> None:
        lookups = self.embeddings.lookup_graph_stats()
        if lookups and self.info.is_main:
            logger.info(
                "CUDA graphs of the dynamic tables' lookups: %d captures took %.2f s in all "
                "(one-time, inside the first steps of each id count); %d lookups replayed",
                lookups["captures"],
                lookups["capture_seconds"],
                lookups["replays"],
            )
        stats = self.graph_stats()
        if stats is None or self.device.type != "cuda" or not self.info.is_main:
            return
        what = "training step" if self.step_graphs is not None else "encoder"
        if stats.disabled:
            logger.info("CUDA graphs of the %s: off (%s)", what, stats.disabled)
            return
        runner = self.step_graphs if self.step_graphs is not None else self.core.encoder.graphs
        logger.info(
            "CUDA graphs of the %s: %d captures (%d shapes held) took %.1f s in all "
            "(one-time, inside the first steps of each shape); %d steps replayed, %d eager "
            "(shapes seen once, or over the limit of %d)",
            what,
            stats.captures,
            stats.graphs,
            stats.capture_seconds,
            stats.replays,
            stats.eager,
            runner.max_graphs,
        )

    def _fit_loop(self, result: TrainResult, bar: tqdm) -> None:
        """The training steps of `fit()` with their logging, evaluation and checkpoints."""
        t = self.cfg.trainer
        window_start = time.perf_counter()
        # elapsed time and ETA of the console line: the steps of this process, evaluations included
        loop_start, loop_first_step = window_start, self.step
        window_steps = 0
        window_tokens = window_samples = window_flops = 0.0
        pending: list[_PendingStep] = []
        while self.step < t.max_train_iters:
            pending.append(self._train_step_async())
            self.step += 1
            window_steps += 1
            bar.update(1)
            log_now = self.step % t.log_interval == 0 or self.step == t.max_train_iters
            eval_now = t.eval_interval > 0 and self.step % t.eval_interval == 0
            ckpt_now = t.ckpt_save_interval > 0 and self.step % t.ckpt_save_interval == 0
            if not (log_now or eval_now or ckpt_now or len(pending) >= _MAX_PENDING_STEPS):
                continue
            # statistics are read back here only (no per-step host<->device sync); a non-finite
            # loss is caught before any checkpoint or evaluation of the window
            first_step = self.step - len(pending) + 1
            for i, stats in enumerate(self._resolve(pending)):
                step_i = first_step + i
                window_tokens += stats["tokens"]
                window_samples += stats["samples"]
                window_flops += stats["flops"]
                result.losses.append((step_i, stats["loss"]))
                if not math.isfinite(stats["loss"]):
                    raise FloatingPointError(
                        f"loss became {stats['loss']} at step {step_i}; lower "
                        f"OptimizerArgs.learning_rate or set OptimizerArgs.grad_clip_norm"
                    )
            pending = []
            bar.set_postfix(loss=f"{stats['loss']:.4f}")
            if log_now:
                elapsed = time.perf_counter() - window_start
                scalars = {
                    "train/loss": stats["loss"],
                    # a device tensor where the step is graphed (`graph_safe_optimizer`)
                    "train/lr": float(self.scheduler.get_last_lr()[0]),
                    "perf/step_time_ms": 1000.0 * elapsed / window_steps,
                    "perf/samples_per_s": window_samples / elapsed,
                    "perf/tokens_per_s": window_tokens / elapsed,
                }
                tflops = window_flops / self.info.world_size / elapsed / 1e12
                scalars["perf/tflops_per_gpu"] = tflops
                if self.peak_tflops is not None:
                    scalars["perf/mfu"] = tflops / self.peak_tflops
                scalars.update(self._embedding_stats())
                if "grad_norm" in stats:
                    scalars["train/grad_norm"] = stats["grad_norm"]
                for k, v in stats.items():
                    if k.startswith("task_loss/"):
                        scalars[f"train/{k}"] = v
                if self.device.type == "cuda":
                    scalars["perf/gpu_mem_allocated_gb"] = (
                        torch.cuda.memory_allocated(self.device) / 2**30
                    )
                    scalars["perf/gpu_mem_peak_gb"] = (
                        torch.cuda.max_memory_allocated(self.device) / 2**30
                    )
                self.tb.scalars(scalars, self.step)
                if self.info.is_main and bar.disable:
                    run_s = time.perf_counter() - loop_start
                    done = self.step - loop_first_step
                    eta_s = (t.max_train_iters - self.step) * run_s / done if done else None
                    logger.info(
                        "step %d/%d (%d%%) loss %.5f lr %.3g | %.2f steps/s %.1f samples/s | "
                        "elapsed %s ETA %s",
                        self.step,
                        t.max_train_iters,
                        100 * self.step // max(t.max_train_iters, 1),
                        stats["loss"],
                        scalars["train/lr"],
                        window_steps / elapsed,
                        scalars["perf/samples_per_s"],
                        format_duration(run_s),
                        format_duration(eta_s),
                    )
                window_start, window_steps = time.perf_counter(), 0
                window_tokens = window_samples = window_flops = 0.0
            paused = time.perf_counter()
            evaluated = eval_now and self.step < t.max_train_iters  # fit() runs the last one
            if evaluated:
                self._run_eval(result)
            if ckpt_now:
                result.checkpoint_dir = self.save_checkpoint()
            # the throughput of the next window counts training steps only
            window_start += time.perf_counter() - paused
            if evaluated and self.best is not None and self.best.should_stop:
                # the same metrics on every rank (all-reduced): every rank stops here
                result.stopped_early_at = self.step
                if self.info.is_main:
                    logger.info(
                        "early stop at step %d: %s did not improve on %.4f (step %d) in %d "
                        "evaluations (TrainerArgs.early_stop_patience)",
                        self.step,
                        self.best.metric,
                        self.best.value if self.best.value is not None else math.nan,
                        self.best.step if self.best.step is not None else -1,
                        self.best.stale,
                    )
                break

    def _run_eval(self, result: TrainResult) -> None:
        self.gc.full()  # every rank evaluates at the same step
        start = time.perf_counter()
        metrics = self.evaluate()
        result.evals.append((self.step, metrics))
        self.tb.scalars({f"eval/{k}": v for k, v in metrics.items()}, self.step)
        if self.info.is_main:
            seconds = time.perf_counter() - start
            append_metrics(self.run_dir, self.step, metrics, seconds)
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            logger.info("eval @ step %d (%.1fs): %s", self.step, seconds, shown)
        if self.best is not None:
            self._track_best(metrics)

    def _track_best(self, metrics: dict[str, float]) -> None:
        """TrainerArgs.best_metric after an evaluation: a new best saves this step's checkpoint
        (unless checkpoints are off) and marks it best; else one more evaluation without
        improvement counts towards early stopping."""
        best = self.best
        # the tracker is part of the checkpoint: a save of this step before the evaluation (the
        # interval's, at the last step) is out of date now and is written again when asked for
        self._saved = None
        if best.update(self.step, metrics):
            if self.cfg.trainer.ckpt_save_interval >= 0:
                best.path = str(self.checkpointer.step_dir(self.step))  # saved with the state
                path = self.save_checkpoint()
                if self.info.is_main:
                    info = {"step": self.step, "metric": best.metric, "mode": best.mode}
                    self.checkpointer.mark_best(path, {**info, "value": best.value})
            if self.info.is_main:
                logger.info(
                    "best %s so far: %.4f at step %d%s",
                    best.metric,
                    best.value,
                    self.step,
                    f" (checkpoint {best.path})" if best.path else "",
                )
        elif self.info.is_main:
            logger.info(
                "%s did not improve on %s (step %s): %d evaluation%s without improvement%s",
                best.metric,
                "nan" if best.value is None else f"{best.value:.4f}",
                best.step,
                best.stale,
                "" if best.stale == 1 else "s",
                f" of {best.patience} allowed" if best.patience else "",
            )

    def _hparams(self) -> dict:
        out = {"task": self.cfg.task}
        for section in ("trainer", "dataset", "network", "optimizer", "embedding"):
            obj = getattr(self.cfg, section)
            for k, v in vars(obj).items():
                if isinstance(v, (int, float, str, bool)):
                    out[f"{type(obj).__name__}.{k}"] = v
        return out

    def close(self) -> None:
        self.pipeline.close()
        self.tb.close()
        if self.step_graphs is not None:
            # before the process group goes: a graph with a collective inside keeps it in use
            # (destroying the group first hangs); a failure here must not skip the cleanup
            try:
                self.step_graphs.release()
            except Exception:  # noqa: BLE001 - e.g. a CUDA error that ended the run: say, go on
                logger.warning("releasing the step's CUDA graphs failed", exc_info=True)
        cleanup(self.info)
        torch.set_num_threads(self._cpu_threads_before)


CONFIG_SUMMARY_FILENAME = "config_summary.txt"


def _save_config_summary(cfg: RunConfig, run_dir: Path) -> None:
    """The readable resolved configuration (changed fields marked ``*``) next to config.gin;
    the console gets one line naming both files."""
    path = Path(run_dir) / CONFIG_SUMMARY_FILENAME
    path.write_text(cfg.log_summary() + "\n", encoding="utf-8")
    logger.info(
        "configuration: %s (resolved, loads back with --gin-config-file) and %s (readable, "
        "changed settings marked *)",
        Path(run_dir) / "config.gin",
        path,
    )


def run_training(cfg: RunConfig, device_type: str = "cpu") -> TrainResult:
    """Builds a Trainer for ``cfg``, trains to TrainerArgs.max_train_iters and returns the results."""
    trainer = Trainer(cfg, device_type)
    try:
        if trainer.info.is_main:
            _save_config_summary(cfg, trainer.run_dir)
        return trainer.fit()
    finally:
        trainer.close()
