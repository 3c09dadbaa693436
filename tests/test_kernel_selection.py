"""Kernel and code-path choices: NetworkArgs fields, validated, resolved once at model build and
handed to `HSTUEncoder` and its layers as constructor arguments (reported by
`HSTUEncoder.kernel_choices()`); attention chosen in one place (`hstu.ops.attention`); no
environment reads in hstu/modules or hstu/ops; one-way imports between the layer modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import hstu.modules.fused_hstu_layer as fused_mod
from hstu.config.args import FUSED_GATE_KERNELS, FUSED_LAYER_SWITCHES, NetworkArgs
from hstu.config.gin_utils import ConfigError, load_config
from hstu.modules.fused_hstu_layer import FusedHSTULayer
from hstu.modules.hstu_layer import AttentionInputs, HSTUEncoder, HSTULayer
from hstu.ops import attention, reference

ROOT = Path(__file__).resolve().parents[1]
KW = dict(num_heads=2, head_dim=8, dropout=0.0)
# HSTUEncoder argument of each boolean NetworkArgs switch of the fused layer
ENCODER_ARG = {
    "fused_elementwise_kernels": "elementwise_kernels",
    "fused_layernorm_kernel": "layernorm_kernel",
    "fused_stage_compile": "stage_compile",
    "fused_residual_gemm": "residual_gemm",
}
CHOICE_KEYS = {
    "layer",
    "attention",
    "gate_kernel",
    "elementwise_kernels",
    "layernorm_kernel",
    "stage_compile",
    "residual_gemm",
    "recompute",
}


def _attn(lengths=(3, 5)) -> AttentionInputs:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return AttentionInputs(seq_offsets=offsets, max_seqlen=max(lengths))


# ---- NetworkArgs ------------------------------------------------------------------------------


def test_switch_fields_default_on_and_listed():
    net = NetworkArgs()
    assert set(FUSED_LAYER_SWITCHES) == set(ENCODER_ARG)
    assert all(getattr(net, name) is True for name in FUSED_LAYER_SWITCHES)
    assert net.fused_gate_kernel == "auto" and net.kernel_backend == "cutlass"
    # turned off together with the fused layer: accepted
    off = NetworkArgs(fused_layer=True, **{name: False for name in FUSED_LAYER_SWITCHES})
    assert not any(getattr(off, name) for name in FUSED_LAYER_SWITCHES)


@pytest.mark.parametrize("name", FUSED_LAYER_SWITCHES)
def test_switch_fields_are_validated(name):
    with pytest.raises(TypeError, match=rf"NetworkArgs\.{name}='no' must be True or False"):
        NetworkArgs(fused_layer=True, **{name: "no"})
    with pytest.raises(ValueError, match=rf"NetworkArgs\.{name}=False applies only to the fused"):
        NetworkArgs(**{name: False})


def test_choice_fields_name_the_binding_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"NetworkArgs\.fused_gate_kernel='triton'.*'compiled'"):
        NetworkArgs(fused_layer=True, fused_gate_kernel="triton")
    with pytest.raises(ValueError, match=r"NetworkArgs\.kernel_backend='triton'.*'cutlass'"):
        NetworkArgs(kernel_backend="triton")
    with pytest.raises((ConfigError, ValueError), match=r"NetworkArgs\.fused_stage_compile"):
        load_config("ranking", [], ["NetworkArgs.fused_stage_compile=False"])


def test_switch_bindings_load_from_gin():
    cfg = load_config(
        "ranking",
        [],
        [
            "NetworkArgs.fused_layer=True",
            "NetworkArgs.fused_gate_kernel='compiled'",
            "NetworkArgs.fused_elementwise_kernels=False",
            "NetworkArgs.fused_layernorm_kernel=False",
            "NetworkArgs.fused_stage_compile=False",
        ],
    )
    net = cfg.network
    assert net.fused_gate_kernel == "compiled"
    assert not (net.fused_elementwise_kernels or net.fused_layernorm_kernel)
    assert not net.fused_stage_compile


# ---- HSTUEncoder: arguments reach the layers and kernel_choices() reports them -----------------


@pytest.mark.parametrize("gate", FUSED_GATE_KERNELS)
def test_gate_kernel_reaches_the_layers_and_the_report(gate):
    enc = HSTUEncoder(2, 16, fused=True, gate_kernel=gate, **KW)
    assert {layer.gate_kernel for layer in enc.layers} == {gate}
    for device in ("cpu", "cuda"):  # "cuda": what would run there (no GPU needed to report)
        choices = enc.kernel_choices(device)
        assert set(choices) == CHOICE_KEYS
        assert choices["gate_kernel"].split()[0] == gate
        assert choices["layer"].startswith("fused")
    assert "CPU" in enc.kernel_choices()["gate_kernel"]  # parameters on CPU: eager stages


@pytest.mark.parametrize("field", FUSED_LAYER_SWITCHES)
@pytest.mark.parametrize("value", [True, False])
def test_switches_reach_the_layers_and_the_report(field, value):
    arg = ENCODER_ARG[field]
    enc = HSTUEncoder(2, 16, fused=True, **{arg: value}, **KW)
    assert {getattr(layer, arg) for layer in enc.layers} == {value}
    for device in ("cpu", "cuda"):
        assert enc.kernel_choices(device)[arg].split()[0] == ("on" if value else "off")
    x = torch.randn(8, 16, requires_grad=True)
    enc(x, _attn()).sum().backward()  # every setting runs (CPU: the PyTorch paths)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_layernorm_kernel_report_names_its_dependency():
    enc = HSTUEncoder(1, 16, fused=True, elementwise_kernels=False, **KW)
    assert "needs elementwise_kernels" in enc.kernel_choices("cuda")["layernorm_kernel"]


def test_recompute_and_layer_in_the_report():
    enc = HSTUEncoder(1, 16, fused=True, recompute_uvqk_silu=True, **KW)
    assert enc.kernel_choices()["recompute"] == "uvqk_silu"
    enc = HSTUEncoder(1, 16, fused=True, recompute_input_layernorm=True, **KW)
    assert enc.kernel_choices()["recompute"] == "input_layernorm"
    plain = HSTUEncoder(1, 16, **KW).kernel_choices()
    assert set(plain) == CHOICE_KEYS and plain["layer"].startswith("unfused")
    assert plain["gate_kernel"].startswith("n/a")


@pytest.mark.parametrize("fused", [False, True])
def test_attention_in_the_report(fused):
    enc = HSTUEncoder(1, 16, fused=fused, **KW)
    assert enc.kernel_choices("cpu")["attention"].startswith("reference (CPU")
    on_gpu = enc.kernel_choices("cuda")["attention"]
    assert on_gpu.split()[0] == "cutlass"
    assert (on_gpu == "cutlass") == attention.compiled_attention_available()
    forced = HSTUEncoder(1, 16, fused=fused, reference_attention=True, **KW)
    assert forced.kernel_choices("cuda")["attention"].startswith("reference (reference_attention")
    soft = HSTUEncoder(1, 16, fused=fused, attention_type="softmax", **KW)
    assert soft.kernel_choices("cuda")["attention"].startswith("softmax")
    # the relative attention bias runs in-kernel (fused or not); the report says so
    for kind, text in (("position", "position"), ("position_time", "position + time")):
        biased = HSTUEncoder(
            1, 16, fused=fused, relative_attention_bias=kind, max_relative_position=7, **KW
        )
        on_gpu = biased.kernel_choices("cuda")["attention"]
        assert on_gpu.startswith(f"cutlass (relative {text} bias in-kernel"), on_gpu
        on_cpu = biased.kernel_choices("cpu")["attention"]
        assert on_cpu.startswith("reference (CPU development mode; relative"), on_cpu


def test_encoder_rejects_fused_only_choices_without_the_fused_layer():
    with pytest.raises(ValueError, match="gate_kernel='cuda'.*fused layer"):
        HSTUEncoder(1, 16, gate_kernel="cuda", **KW)
    for field, arg in ENCODER_ARG.items():
        with pytest.raises(ValueError, match=rf"{arg}=False.*NetworkArgs\.{field}=True"):
            HSTUEncoder(1, 16, **{arg: False}, **KW)
        with pytest.raises(TypeError, match=rf"NetworkArgs\.{field}="):
            HSTUEncoder(1, 16, fused=True, **{arg: "off"}, **KW)
    with pytest.raises(ValueError, match=r"NetworkArgs\.fused_gate_kernel='triton'"):
        HSTUEncoder(1, 16, fused=True, gate_kernel="triton", **KW)
    with pytest.raises(ValueError, match=r"NetworkArgs\.kernel_backend='triton'"):
        HSTUEncoder(1, 16, kernel_backend="triton", **KW)
    # None is "auto" (callers that predate the config field)
    assert HSTUEncoder(1, 16, fused=True, gate_kernel=None, **KW).layers[0].gate_kernel == "auto"


def test_reference_attention_reaches_every_layer():
    for fused in (False, True):
        enc = HSTUEncoder(2, 16, fused=fused, reference_attention=True, **KW)
        assert all(layer.reference_attention for layer in enc.layers)
        assert not any(layer.reference_attention for layer in HSTUEncoder(2, 16, **KW).layers)


def test_network_args_reach_the_built_model():
    """build_model resolves the NetworkArgs choices once and hands them to every layer."""
    from hstu.data.registry import load_sequence_data
    from hstu.models.builder import build_model

    bindings = [
        "DatasetArgs.synthetic_num_users=50",
        "DatasetArgs.synthetic_num_items=40",
        "DatasetArgs.max_history_seqlen=12",
        "NetworkArgs.fused_layer=True",
        "NetworkArgs.fused_gate_kernel='compiled'",
        *(f"NetworkArgs.{name}=False" for name in FUSED_LAYER_SWITCHES),
    ]
    cfg = load_config("ranking", [], bindings)
    torch.manual_seed(0)
    encoder = build_model(cfg, load_sequence_data(cfg.dataset, num_tasks=8)).encoder
    assert encoder.layers and all(type(x) is FusedHSTULayer for x in encoder.layers)
    for layer in encoder.layers:
        assert layer.gate_kernel == "compiled"
        assert not any(getattr(layer, arg) for arg in ENCODER_ARG.values())
    choices = encoder.kernel_choices()
    assert choices["gate_kernel"].startswith("compiled")
    assert all(choices[arg].startswith("off") for arg in ENCODER_ARG.values())


# ---- attention: chosen in one place ---------------------------------------------------------


def test_attention_path_is_the_hardware_policy():
    path = attention.attention_path
    assert path("cpu") == "reference"
    assert path("cuda") == "cutlass"
    assert path(torch.device("cuda", 1)) == "cutlass"
    assert path("cuda", bias=True) == "reference"  # the kernel takes no dense bias tensor
    assert path("cuda", force_reference=True) == "reference"  # tests / benchmarks only
    assert set(attention.ATTENTION_PATHS) == {"cutlass", "reference"}
    # the fused layer asks the same function for the kernel's ops
    assert attention.compiled_attention_ops("cpu", 64) is None
    assert attention.compiled_attention_ops("cuda", 64, force_reference=True) is None
    if not attention.compiled_attention_available():
        with pytest.raises(RuntimeError, match="HSTU_CUDA_ARCH_LIST"):
            attention.compiled_attention_ops("cuda", 64)


def test_entry_point_runs_a_bias_through_the_reference():
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 3, 8])
    q, k, v = (torch.randn(8, 2, 4, generator=g) for _ in range(3))
    bias = torch.randn(5, 5, generator=g)
    out = attention.hstu_attention(q, k, v, offsets, 5, bias=bias)
    torch.testing.assert_close(out, reference.hstu_attention(q, k, v, offsets, 5, bias=bias))
    assert not torch.allclose(out, attention.hstu_attention(q, k, v, offsets, 5))


def test_force_reference_env_parsing():
    parse = attention.force_reference_from_env
    assert parse({}) is False
    assert parse({attention.FORCE_REFERENCE_ENV: "0"}) is False
    assert parse({attention.FORCE_REFERENCE_ENV: ""}) is False
    assert parse({attention.FORCE_REFERENCE_ENV: "1"}) is True
    with pytest.raises(ValueError, match="HSTU_FORCE_REFERENCE_ATTENTION='yes'"):
        parse({attention.FORCE_REFERENCE_ENV: "yes"})


def test_fused_layer_with_reference_attention_matches_the_unfused_layer():
    torch.manual_seed(0)
    ref = HSTULayer(16, reference_attention=True, **KW)
    fused = FusedHSTULayer(16, reference_attention=True, **KW)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(8, 16)
    torch.testing.assert_close(fused(x, _attn()), ref(x, _attn()), atol=2e-5, rtol=1e-4)


# ---- no ambient state, one-way imports, constants defined once --------------------------------

_SOURCES = sorted((ROOT / "hstu" / "modules").glob("*.py")) + sorted(
    (ROOT / "hstu" / "ops").glob("*.py")
)


@pytest.mark.parametrize("path", _SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_environment_reads_in_modules_and_ops(path):
    text = path.read_text()
    code = ast.parse(text)
    for node in ast.walk(code):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            pytest.fail(f"{path.name}:{node.lineno} reads the environment (os.{node.attr})")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            module = getattr(node, "module", None)
            assert "os" not in names or module, f"{path.name}:{node.lineno} imports os"
            assert not (module == "os" and {"environ", "getenv"} & set(names)), path.name
    for name in ("HSTU_FUSED_", "HSTU_FORCE_REFERENCE_ATTENTION", "_BUILD_HINT"):
        if name in text and not (path.name == "attention.py" and path.parent.name == "ops"):
            pytest.fail(f"{path.name} mentions {name}")


def test_removed_switches_are_gone_from_the_package():
    text = "\n".join(p.read_text() for p in (ROOT / "hstu").rglob("*.py"))
    for name in (
        "HSTU_FUSED_GATE_KERNEL",
        "HSTU_FUSED_LN_KERNEL",
        "HSTU_FUSED_ELEMENTWISE_KERNELS",
        "HSTU_FUSED_LAYER_COMPILE",
    ):
        assert name not in text, name
    for name in ("set_stage_compile", "set_elementwise_kernels", "default_gate_kernel"):
        assert not hasattr(fused_mod, name), name


def _module_imports(path: Path) -> set[str]:
    """hstu.modules.* modules imported anywhere in ``path`` (also inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "hstu.modules":
                found |= {f"hstu.modules.{a.name}" for a in node.names}
            elif node.module.startswith("hstu.modules."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hstu.modules.")}
    return found


def test_layer_modules_import_one_way():
    graph = {
        f"hstu.modules.{p.stem}": _module_imports(p)
        for p in (ROOT / "hstu" / "modules").glob("*.py")
    }
    # depth-first search for a cycle
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail, node, dep]))
            if dep not in state:
                visit(dep, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])
    assert "hstu.modules.hstu_layer" not in graph["hstu.modules.fused_hstu_layer"]
    assert "hstu.modules.fused_hstu_layer" in graph["hstu.modules.hstu_layer"]


def test_constants_are_defined_once_in_config():
    from hstu.config import args
    from hstu.modules import softmax_attention

    assert fused_mod.GATE_KERNELS is args.FUSED_GATE_KERNELS
    assert softmax_attention.ATTENTION_TYPES is args.ATTENTION_TYPES
    literal = re.compile(r"""=\s*\(\s*["']auto["'],\s*["']cuda["'],\s*["']compiled["']""")
    for path in _SOURCES:
        assert not literal.search(path.read_text()), path.name
