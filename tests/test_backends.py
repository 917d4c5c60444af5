"""The backend boundary (prefix_service/backends/): which backend `model.backend` picks and why, each
backend against the torch backend on the same token ids, and the layout rules the boundary keeps
(no platform code outside backends/, no import cycles)."""
import ast
import logging
from pathlib import Path

import pytest
import torch

from helpers import engine_last_logits, generate_together, greedy, mixed_generate
from prefix_service import GenerateRequest
from prefix_service.backends import select_backend
from prefix_service.backends.cpu import native
from prefix_service.config import ConfigError, ModelConfig, config_from_dict
from prefix_service.model.loader import read_arch

REASON = native.load()[1]
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
PACKAGE = Path(__file__).resolve().parent.parent / "prefix_service"


# --- choosing a backend ----------------------------------------------------------------------------

@needs_native
def test_auto_picks_cpu_where_its_kernels_run_and_says_so(llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="prefix_service.engine")
    arch = read_arch(llama_dir)
    assert select_backend("auto", torch.device("cpu"), torch.float32, arch).name == "cpu"
    assert f"backend cpu ({native.isa()} kernels): auto, the native CPU kernels run here" in caplog.text
    assert select_backend("cpu", torch.device("cpu"), torch.float32, arch).name == "cpu"
    assert select_backend("torch", torch.device("cpu"), torch.float32, arch).name == "torch"


def test_auto_falls_back_to_torch_with_a_warning(llama_dir, caplog):
    """float16 (the native kernels serve float32 and bfloat16): torch, and one warning naming why."""
    caplog.set_level(logging.INFO, logger="prefix_service.engine")
    arch = read_arch(llama_dir)
    assert select_backend("auto", torch.device("cpu"), torch.float16, arch).name == "torch"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the cpu backend cannot run here" in warnings[0].getMessage()
    assert ("float16" in warnings[0].getMessage()) or REASON is not None


def test_a_backend_that_cannot_run_is_a_clear_error(llama_dir, monkeypatch):
    arch = read_arch(llama_dir)
    with pytest.raises(ConfigError, match=r"model.backend: cpu was asked for, but .*float16.*; use auto or torch"):
        select_backend("cpu", torch.device("cpu"), torch.float16, arch)
    monkeypatch.setattr(native, "load", lambda: (None, "no C++ compiler found (set CXX)"))
    with pytest.raises(ConfigError, match=r"cpu was asked for, but no C\+\+ compiler found"):
        select_backend("cpu", torch.device("cpu"), torch.float32, arch)
    assert select_backend("auto", torch.device("cpu"), torch.float32, arch).name == "torch"
    with pytest.raises(ConfigError, match="'cuda' needs a CUDA device, the model is on cpu"):
        select_backend("cuda", torch.device("cpu"), torch.float32, arch)
    with pytest.raises(ConfigError, match="'cpu' runs on the CPU, the model is on meta"):
        select_backend("cpu", torch.device("meta"), torch.float32, arch)


def test_backend_config_is_checked():
    with pytest.raises(ConfigError, match=r"model\.backend: 'fast' is not one of auto, torch, cpu, cuda"):
        ModelConfig(path="m", backend="fast")
    assert config_from_dict({"model": {"path": "m", "backend": "torch"}}).engine.model.backend == "torch"
    assert ModelConfig(path="m").backend == "auto"
    with pytest.raises(ConfigError, match=r"model: unknown key\(s\) cpu_linear; known keys: .*backend"):
        config_from_dict({"model": {"path": "m", "cpu_linear": "auto"}})




# --- every backend against the torch backend ---------------------------------------------------------

@needs_native
@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "qwen3", "tied"])
def test_cpu_backend_generates_the_torch_backends_tokens(make_engine, model_dirs, tied_llama_dir, which):
    """Plain prompts, then the same prompts on a template (prefills over its blocks, decodes that
    share them), chunked and batched: the same greedy ids; the same last logits within float32
    tolerance."""
    model_dir = tied_llama_dir if which == "tied" else model_dirs[which]
    ref = make_engine(model_dir, num_blocks=160, max_num_batched_tokens=16, backend="torch")
    cpu = make_engine(model_dir, num_blocks=160, max_num_batched_tokens=16, backend="cpu")
    assert (ref.info.backend, cpu.info.backend) == ("torch", "cpu")
    want = mixed_generate(ref)
    assert all(len(ids) == 24 for ids in want)
    assert mixed_generate(cpu) == want
    ids = [(7 * i + 3) % 500 + 3 for i in range(37)]
    got, ref_logits = engine_last_logits(cpu, ids), engine_last_logits(ref, ids)
    assert (got - ref_logits).abs().max().item() <= 1e-4


@needs_native
def test_cpu_backend_equals_torch_under_preemption_and_copy_on_write(make_engine):
    """A cache too small for the batch (preemptions), templates with partial tail blocks
    (copy-on-write) and without, one step at a time: the same ids on both backends."""
    prefixes = {"a": [(3 * i + 1) % 500 + 3 for i in range(9)], "b": [(5 * i + 2) % 500 + 3 for i in range(8)]}
    batch = [GenerateRequest(prompt_token_ids=[(11 * i + k) % 500 + 3 for i in range(3 + 2 * k)],
                             prefix_name=[None, "a", "b"][k % 3], sampling=greedy(20)) for k in range(9)]
    results = {}
    for backend in ("torch", "cpu"):
        engine = make_engine(num_blocks=40, prefix_budget_blocks=10, max_num_batched_tokens=20, backend=backend)
        for name, ids in prefixes.items():
            engine.add_template(name, token_ids=ids)
        results[backend] = generate_together(engine, batch)
        assert engine.kv_stats()["preemptions"] > 0
    assert results["cpu"] == results["torch"]


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, tokenizer_dir):
    from prefix_service import synthetic as models
    return models.build_model(tmp_path_factory.mktemp("tied") / "llama", "llama", tokenizer_dir, seed=7,
                              tie_word_embeddings=True)


# --- the layout the boundary keeps --------------------------------------------------------------------

def _imports() -> dict[str, set[str]]:
    """module -> the modules of this package and cuda_ops it imports (lazy and TYPE_CHECKING imports included)."""
    root = PACKAGE.parent
    modules = {}
    for path in list(PACKAGE.rglob("*.py")) + list((root / "cuda_ops").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                found = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + ".") and not target.startswith(name + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def test_no_platform_code_outside_the_backends():
    """Only backends/ (and the benchmark harness, which compares them) imports the native CPU
    library, the CUDA backend or cuda_ops."""
    platform = ("prefix_service.backends.cpu", "prefix_service.backends.cuda", "cuda_ops")
    leaks = {name: sorted(t for t in targets if t.startswith(platform))
             for name, targets in _imports().items()
             if name.startswith("prefix_service.") and not name.startswith(("prefix_service.backends",
                                                                           "prefix_service.bench"))}
    assert {name: found for name, found in leaks.items() if found} == {}


def test_no_import_cycles():
    graph = _imports()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_engine_asks_no_backend_what_it_can_do():
    """Outside backends/, nothing probes a backend with getattr/hasattr."""
    probes = []
    for path in PACKAGE.rglob("*.py"):
        if "backends" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and node.args and "backend" in ast.unparse(node.args[0])):
                probes.append(f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}")
    assert probes == []
