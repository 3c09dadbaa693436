"""Config: validated dataclasses, gin files + bindings, errors naming the binding, config.gin."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hstu.config import (
    ARG_CLASSES,
    ConfigError,
    DatasetArgs,
    EmbeddingArgs,
    NetworkArgs,
    OptimizerArgs,
    RankingArgs,
    RetrievalArgs,
    RunConfig,
    TrainerArgs,
    default_config_file,
    load_config,
    split_bindings,
)
from hstu.config.gin_utils import format_gin_value
from hstu.training.cli import config_from_args, parse_args

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("clean_gin")


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- dataclass validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, exc, needle",
    [
        (TrainerArgs, {"train_batch_size": 0}, ValueError, "TrainerArgs.train_batch_size=0 must be a positive integer"),
        (TrainerArgs, {"eval_batch_size": -4}, ValueError, "TrainerArgs.eval_batch_size=-4"),
        (TrainerArgs, {"seed": "abc"}, TypeError, "TrainerArgs.seed='abc' must be an integer"),
        (TrainerArgs, {"log_interval": True}, TypeError, "TrainerArgs.log_interval=True must be an integer"),
        (TrainerArgs, {"ckpt_save_interval": -2}, ValueError, "-1 = never save"),
        (TrainerArgs, {"progress_bar": 1}, TypeError, "TrainerArgs.progress_bar=1 must be True or False"),
        (TrainerArgs, {"run_name": "a/b"}, ValueError, "TrainerArgs.run_name='a/b'"),
        (TrainerArgs, {"log_dir": ""}, ValueError, "TrainerArgs.log_dir='' must be a non-empty string"),
        (NetworkArgs, {"kernel_backend": "triton"}, ValueError, "NetworkArgs.kernel_backend='triton' is not supported: only 'cutlass'"),
        (NetworkArgs, {"dtype_str": "int8"}, ValueError, "NetworkArgs.dtype_str='int8' is not supported: choose one of 'bfloat16', 'float16', 'float32'"),
        (NetworkArgs, {"kv_channels": 0}, ValueError, "NetworkArgs.kv_channels=0 must be a positive integer"),
        (NetworkArgs, {"hidden_dropout": 1.0}, ValueError, "NetworkArgs.hidden_dropout=1.0 must be in [0, 1)"),
        (NetworkArgs, {"num_layers": 2.5}, TypeError, "NetworkArgs.num_layers=2.5 must be an integer"),
        (NetworkArgs, {"target_group_size": 0}, ValueError, "NetworkArgs.target_group_size=0"),
        (OptimizerArgs, {"learning_rate": -1e-3}, ValueError, "OptimizerArgs.learning_rate=-0.001 must be > 0"),
        (OptimizerArgs, {"learning_rate": "fast"}, TypeError, "OptimizerArgs.learning_rate='fast' must be a number"),
        (OptimizerArgs, {"lr_scheduler": "step"}, ValueError, "OptimizerArgs.lr_scheduler='step' is not supported: choose one of 'constant', 'cosine', 'linear'"),
        (OptimizerArgs, {"optimizer_str": "lamb"}, ValueError, "'adam', 'adamw', 'sgd'"),
        (OptimizerArgs, {"adam_beta2": 1.0}, ValueError, "OptimizerArgs.adam_beta2=1.0 must be in [0, 1)"),
        (OptimizerArgs, {"min_lr_ratio": 2.0}, ValueError, "OptimizerArgs.min_lr_ratio=2.0 must be in [0, 1]"),
        (EmbeddingArgs, {"embedding_backend": "hash"}, ValueError, "'torchrec', 'dynamic'"),
        (EmbeddingArgs, {"sparse_optimizer_str": "lamb"}, ValueError, "'rowwise_adagrad'"),
        (EmbeddingArgs, {"eviction_policy": "fifo"}, ValueError, "EmbeddingArgs.eviction_policy='fifo'"),
        (EmbeddingArgs, {"item_capacity": -1}, ValueError, "EmbeddingArgs.item_capacity=-1 must be a non-negative integer"),
        (DatasetArgs, {"dataset_name": "../x"}, ValueError, "DatasetArgs.dataset_name='../x' must be a plain name"),
        (DatasetArgs, {"max_history_seqlen": 0}, ValueError, "DatasetArgs.max_history_seqlen=0"),
        (DatasetArgs, {"shuffle": "yes"}, TypeError, "DatasetArgs.shuffle='yes' must be True or False"),
        (RankingArgs, {"prediction_head_arch": [256, 0]}, ValueError, "RankingArgs.prediction_head_arch=[256, 0] must hold positive integers"),
        (RankingArgs, {"prediction_head_arch": 256}, TypeError, "must be a list or tuple"),
        (RankingArgs, {"task_weights": [1.0, 2.0]}, ValueError, "RankingArgs.task_weights has 2 entries but RankingArgs.num_tasks=8"),
        (RankingArgs, {"num_tasks": 0}, ValueError, "RankingArgs.num_tasks=0 must be a positive integer"),
        (RetrievalArgs, {"temperature": 0.0}, ValueError, "RetrievalArgs.temperature=0.0 must be > 0"),
        (RetrievalArgs, {"negative_sampling": "hard"}, ValueError, "'random', 'in_batch', 'mixed'"),
        (RetrievalArgs, {"eval_metrics": ["HR@0"]}, ValueError, "RetrievalArgs.eval_metrics contains 'HR@0'"),
        (RetrievalArgs, {"eval_metrics": []}, ValueError, "must name at least one metric"),
        (RetrievalArgs, {"eval_metrics": ["MRR", "mrr"]}, ValueError, "more than once"),
    ],
)  # fmt: skip
def test_invalid_values_name_the_binding(cls, kwargs, exc, needle):
    with pytest.raises(exc) as info:
        cls(**kwargs)
    assert needle in str(info.value)


def test_defaults_validate_and_normalise():
    for cls in ARG_CLASSES.values():
        cls()  # defaults are valid
    r = RankingArgs(prediction_head_arch=[512, 8], task_weights=[1, 2, 1, 1, 1, 1, 1, 1])
    assert r.prediction_head_arch == (512, 8)
    assert r.task_weights == (1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert r.head_hidden_sizes() == (512,)  # recsys-examples: trailing num_tasks = output layer
    assert RankingArgs().head_hidden_sizes() == (256, 128)
    assert RankingArgs().resolved_task_weights() == (1.0,) * 8
    assert OptimizerArgs(learning_rate=1).learning_rate == 1.0
    assert isinstance(OptimizerArgs(learning_rate=1).learning_rate, float)
    assert TrainerArgs(max_train_iters=1e4).max_train_iters == 10000
    ret = RetrievalArgs(eval_metrics=["hr@10", "ndcg@5", "MRR"])
    assert ret.eval_metrics == ("HR@10", "NDCG@5", "MRR")
    assert ret.metric_ks() == (5, 10)
    assert DatasetArgs(dataset_name="ml-100k").dataset_name == "ml-100k"


# ---- loading: defaults, files, bindings ---------------------------------------------------


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_shipped_configs_equal_the_dataclass_defaults(task):
    path = default_config_file(task)
    assert path is not None and path == REPO / "configs" / f"synthetic_{task}.gin"
    from_file = load_config(task, [path], [])
    assert from_file == RunConfig(task=task)
    assert load_config(task, [], []) == RunConfig(task=task)
    # the shipped file sets every field of the classes it lists (no silent gaps)
    text = path.read_text()
    for cls_name in ("TrainerArgs", "DatasetArgs", "NetworkArgs", "OptimizerArgs", "EmbeddingArgs"):
        for f in dataclasses.fields(ARG_CLASSES[cls_name]):
            assert f"{cls_name}.{f.name} =" in text, f"{path.name} lacks {cls_name}.{f.name}"
    head = "RankingArgs" if task == "ranking" else "RetrievalArgs"
    for f in dataclasses.fields(ARG_CLASSES[head]):
        assert f"{head}.{f.name} =" in text


def test_without_configs_dir_defaults_still_apply(monkeypatch, tmp_path):
    import hstu.config.gin_utils as gu

    monkeypatch.setattr(gu, "_CONFIGS_DIR", tmp_path / "missing")
    cfg = load_config("ranking", [], [])
    assert cfg == RunConfig(task="ranking")
    assert cfg.sources == ("built-in defaults",)


def test_bindings_override_values():
    cfg = load_config(
        "ranking",
        [],
        [
            "TrainerArgs.max_train_iters=7",
            "OptimizerArgs.learning_rate=5e-4; NetworkArgs.num_layers=3\nDatasetArgs.dataset_name='ml-1m'",
            "RankingArgs.prediction_head_arch=[64, 32]",
        ],
    )
    assert cfg.trainer.max_train_iters == 7
    assert cfg.optimizer.learning_rate == 5e-4
    assert cfg.network.num_layers == 3
    assert cfg.dataset.dataset_name == "ml-1m"
    assert cfg.ranking.prediction_head_arch == (64, 32)
    # gin keeps this run's bindings: a class built elsewhere sees the same values
    assert NetworkArgs().num_layers == 3


def test_later_files_win_and_bindings_win_over_files(tmp_path):
    a = write(tmp_path, "a.gin", "TrainerArgs.seed = 1\nTrainerArgs.max_train_iters = 11\n")
    b = write(tmp_path, "b.gin", "TrainerArgs.seed = 2\n")
    cfg = load_config("retrieval", [a, b], [])
    assert (cfg.trainer.seed, cfg.trainer.max_train_iters) == (2, 11)
    cfg = load_config("retrieval", [b, a], [])
    assert cfg.trainer.seed == 1
    cfg = load_config("retrieval", [a, b], ["TrainerArgs.seed = 3"])
    assert cfg.trainer.seed == 3
    assert cfg.sources == (str(a), str(b), "--gin-bindings 'TrainerArgs.seed = 3'")
    # a given file replaces the embedded default; untouched fields keep the defaults
    assert cfg.network == NetworkArgs()


def test_repeated_loads_do_not_leak(tmp_path):
    load_config("ranking", [], ["TrainerArgs.seed=99"])
    assert load_config("ranking", [], []).trainer.seed == 1234


def test_recsys_examples_style_file(tmp_path):
    path = write(
        tmp_path,
        "rx.gin",
        """
TrainerArgs.train_batch_size = 128
TrainerArgs.eval_interval = 100
DatasetArgs.dataset_name = 'ml-20m'
DatasetArgs.max_history_seqlen = 200
DatasetArgs.max_num_candidates = 20
NetworkArgs.dtype_str = "bfloat16"
NetworkArgs.kernel_backend = "cutlass"
RankingArgs.prediction_head_arch = [
    512, 10
]
RankingArgs.num_tasks = 10
OptimizerArgs.optimizer_str = 'adam'
""",
    )
    cfg = load_config("ranking", [path], [])
    assert cfg.dataset.dataset_name == "ml-20m"
    assert cfg.ranking.head_hidden_sizes() == (512,)


def test_include_resolves_next_to_the_file_and_is_checked(tmp_path, monkeypatch):
    write(tmp_path, "base.gin", "TrainerArgs.seed = 5\nTrainerArgs.log_interval = 1\n")
    top = write(tmp_path, "top.gin", "include 'base.gin'\nTrainerArgs.log_interval = 2\n")
    monkeypatch.chdir(tmp_path.parent)  # the include is relative to the file, not the cwd
    cfg = load_config("ranking", [top], [])
    assert (cfg.trainer.seed, cfg.trainer.log_interval) == (5, 2)
    write(tmp_path, "bad.gin", "TrainerArgs.seed = 5\nFoo.x = 1\n")
    top2 = write(tmp_path, "top2.gin", "include 'bad.gin'\n")
    with pytest.raises(ConfigError, match=r"Unknown config class 'Foo'.*bad.gin, line 2"):
        load_config("ranking", [top2], [])


def test_split_bindings_keeps_brackets_and_quotes():
    out = split_bindings(["A.b = [1,\n 2]; C.d = 'x;y'  # c; not a binding\nE.f = 3", "  "])
    assert out == ["A.b = [1,\n 2]", "C.d = 'x;y'", "E.f = 3"]


# ---- errors ------------------------------------------------------------------------------


def test_unknown_class_is_a_clear_error(tmp_path):
    path = write(tmp_path, "bad.gin", "TrainerArgs.seed = 1\n\nTrainerArg.seed = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [path], [])
    msg = str(info.value)
    assert "Unknown config class 'TrainerArg'" in msg
    assert f"{path}, line 3" in msg
    assert "Known classes: DatasetArgs, EmbeddingArgs" in msg
    assert "\n" not in msg


def test_unknown_field_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [], ["NetworkArgs.num_heads=4"])
    msg = str(info.value)
    assert "Unknown field 'NetworkArgs.num_heads'" in msg
    assert "--gin-bindings" in msg
    assert "num_attention_heads" in msg  # lists the known fields


def test_removed_dataset_num_workers_is_an_unknown_field(tmp_path):
    """DatasetArgs.num_workers is gone (batches are built by one prefetch thread): an old config
    that still sets it fails naming the binding, from a file and from --gin-bindings."""
    assert "num_workers" not in {f.name for f in dataclasses.fields(DatasetArgs)}
    path = write(tmp_path, "old.gin", "DatasetArgs.shuffle = True\nDatasetArgs.num_workers = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [path], [])
    assert "Unknown field 'DatasetArgs.num_workers'" in str(info.value)
    assert f"{path}, line 2" in str(info.value)
    with pytest.raises(ConfigError, match="Unknown field 'DatasetArgs.num_workers'"):
        load_config("ranking", [], ["DatasetArgs.num_workers=0"])


def test_recsys_examples_only_names_get_a_hint():
    with pytest.raises(ConfigError, match="use DatasetArgs.max_history_seqlen"):
        load_config("ranking", [], ["DatasetArgs.max_sequence_length=200"])
    with pytest.raises(ConfigError, match="tensor parallelism is not supported"):
        load_config("ranking", [], ["TensorModelParallelArgs.tensor_model_parallel_size=1"])


@pytest.mark.parametrize(
    "binding, needle",
    [
        ("TrainerArgs.train_batch_size=0", "TrainerArgs.train_batch_size=0 must be a positive integer"),
        ("NetworkArgs.kernel_backend='triton'", "NetworkArgs.kernel_backend='triton' is not supported: only 'cutlass'"),
        ("NetworkArgs.dtype_str='int8'", "NetworkArgs.dtype_str='int8' is not supported"),
        ("OptimizerArgs.learning_rate=-0.1", "OptimizerArgs.learning_rate=-0.1 must be > 0"),
        ("OptimizerArgs.lr_scheduler='step'", "OptimizerArgs.lr_scheduler='step' is not supported"),
        ("TrainerArgs.seed='x'", "TrainerArgs.seed='x' must be an integer"),
    ],
)  # fmt: skip
def test_invalid_binding_values_name_binding_and_source(binding, needle):
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [], [binding])
    msg = str(info.value)
    assert needle in msg
    assert "set by" in msg and "--gin-bindings" in msg
    assert "In call to configurable" not in msg  # gin's own trailer is stripped


def test_invalid_value_in_file_names_file_and_line(tmp_path):
    path = write(tmp_path, "c.gin", "# x\nOptimizerArgs.optimizer_str = 'lamb'\n")
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [path], [])
    assert "OptimizerArgs.optimizer_str='lamb'" in str(info.value)
    assert f"{path}, line 2" in str(info.value)


def test_unquoted_string_and_syntax_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [], ["DatasetArgs.dataset_name=ml-1m"])
    assert "strings need quotes" in str(info.value)
    assert "DatasetArgs.dataset_name=ml-1m" in str(info.value)
    assert "ast." not in str(info.value)
    with pytest.raises(ConfigError, match="Cannot parse"):
        load_config("ranking", [], ["TrainerArgs.seed"])
    with pytest.raises(ConfigError, match="literal value"):
        load_config("ranking", [], ["TrainerArgs.seed=%SEED"])
    with pytest.raises(ConfigError, match="Scoped binding"):
        load_config("ranking", [], ["eval/TrainerArgs.seed=1"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("ranking", [tmp_path / "nope.gin"], [])
    assert "nope.gin" in str(info.value) and "does not exist" in str(info.value)
    assert "synthetic_ranking.gin" in str(info.value)  # points at the shipped configs
    with pytest.raises(ConfigError, match="is a directory"):
        load_config("ranking", [tmp_path], [])


def test_task_level_checks():
    with pytest.raises(ConfigError, match="task='ranker'"):
        load_config("ranker", [], [])
    with pytest.raises(ConfigError, match="DatasetArgs.max_num_candidates=0"):
        load_config("ranking", [], ["DatasetArgs.max_num_candidates=0"])
    assert load_config("retrieval", [], ["DatasetArgs.max_num_candidates=0"])


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- resolved config: config.gin, summary ----------------------------------------------


def test_config_gin_round_trip(tmp_path):
    cfg = load_config(
        "retrieval",
        [],
        [
            "OptimizerArgs.learning_rate=3e-4",
            "RetrievalArgs.eval_metrics=['HR@5']",
            "RankingArgs.task_weights=(1, 2, 3, 4, 5, 6, 7, 8)",
            'TrainerArgs.run_name="it\'s \\"quoted\\""',
            "OptimizerArgs.adam_eps=1e-12",
            "RankingArgs.prediction_head_arch=()",
        ],
    )
    path = cfg.save(tmp_path / "run")
    assert path == tmp_path / "run" / "config.gin"
    text = path.read_text()
    for obj in cfg.args():
        for f in dataclasses.fields(obj):
            assert f"{type(obj).__name__}.{f.name} = " in text
    assert "RetrievalArgs.eval_metrics = ('HR@5',)" in text
    again = load_config("retrieval", [path], [])
    assert again == cfg
    assert again.trainer.run_name == 'it\'s "quoted"'
    assert list(tmp_path.joinpath("run").iterdir()) == [path]  # no temp files left


def test_format_gin_value():
    assert format_gin_value(()) == "()"
    assert format_gin_value((3,)) == "(3,)"
    assert format_gin_value(True) == "True"
    assert format_gin_value(1e-8) == "1e-08"
    with pytest.raises(TypeError):
        format_gin_value(object())


def test_log_summary_marks_overrides():
    cfg = load_config("ranking", [], ["NetworkArgs.num_layers=5"])
    summary = cfg.log_summary()
    assert "HSTU ranking configuration" in summary
    assert "embedded default synthetic_ranking.gin" in summary
    lines = summary.splitlines()
    assert any(line.strip().startswith("* num_layers") and "= 5" in line for line in lines)
    assert any(line.strip().startswith("hidden_size") for line in lines)


# ---- command line ------------------------------------------------------------------------


def test_parse_args_and_config_from_args(tmp_path):
    a = write(tmp_path, "a.gin", "TrainerArgs.seed = 1\n")
    b = write(tmp_path, "b.gin", "TrainerArgs.seed = 2\nTrainerArgs.log_interval = 3\n")
    ns = parse_args(
        [
            "--gin-config-file", str(a),
            "--gin-config-file", str(b),
            "--gin-bindings", "TrainerArgs.log_interval=4",
            "--gin-bindings", "NetworkArgs.num_layers=1; NetworkArgs.hidden_size=16",
            "--log-level", "debug",
        ],
        "ranking",
    )  # fmt: skip
    assert ns.gin_config_file == [str(a), str(b)]
    assert len(ns.gin_bindings) == 2
    assert ns.allow_non_a100 is False and ns.log_level == "DEBUG" and ns.task == "ranking"
    cfg = config_from_args(ns)
    assert (cfg.trainer.seed, cfg.trainer.log_interval) == (2, 4)
    assert (cfg.network.num_layers, cfg.network.hidden_size) == (1, 16)

    ns = parse_args(["--allow-non-a100"], "retrieval")
    assert ns.allow_non_a100 and ns.gin_config_file == [] and ns.gin_bindings == []
    assert ns.log_level == "INFO"


def test_parse_args_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--log-level", "loud"], "ranking")
    assert info.value.code == 2
    assert "--log-level 'loud' is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--gin-binding-typo", "x"], "ranking")


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"], "retrieval")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc_per_node=8 scripts/pretrain_gr_retrieval.py" in out
    assert "--gin-bindings" in out and "HSTU_ALLOW_NON_A100=1" in out


def test_failed_load_leaves_no_bindings_behind():
    """A config that fails to load (here a bad value) clears gin's state: code that builds e.g.
    NetworkArgs() afterwards in the same process gets the defaults, not the rejected binding."""
    with pytest.raises(ConfigError, match="pad_tokens"):
        load_config("ranking", [], ["NetworkArgs.pad_tokens='sometimes'"])
    assert NetworkArgs().pad_tokens == "auto"
