"""scripts/bench_cpu_dtype.py on a tiny model's shape (random weights): each system runs in its
own child with its dtype and environment, the table and JSON agree, the plot is written, and a
malformed --system is refused with a message that names it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_service import synthetic as models
from prefix_service import cpuinfo
from prefix_service.backends.cpu import linear, native

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_dtype.py"
REASON = native.load()[1] or linear.available(torch.bfloat16)


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory, tokenizer_dir):
    """A config and tokenizer with a context long enough for the intent template (no weights)."""
    return models.build_config_only(tmp_path_factory.mktemp("dtype") / "llama", tokenizer_dir, "llama",
                                    max_position_embeddings=4096)


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(REASON is not None, reason=f"no cpu backend in bfloat16 here: {REASON}")
def test_a_system_runs_its_dtype_under_its_environment(long_context_dir, tmp_path):
    out = tmp_path / "dtype.json"
    proc = run("--model", str(long_context_dir), "--load-format", "dummy", "--dtypes", "float32,bfloat16+int8",
               "--system", "bf16-matrix:bfloat16:PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION=matrix",
               "--rounds", "1", "--singles", "1", "--concurrency", "1,2", "--json", str(out),
               "--plot", str(tmp_path / "dtype.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["git_commit"]  # this checkout's, as is each of our systems'
    assert {name: system.pop("git_commit") for name, system in data["systems"].items()} == {
        "float32": data["git_commit"], "bfloat16+int8": data["git_commit"], "bf16-matrix": data["git_commit"]}
    assert data["systems"] == {
        "float32": {"dtype": "float32", "checkout": str(SCRIPT.parent.parent), "environment": {}},
        "bfloat16+int8": {"dtype": "bfloat16+int8", "checkout": str(SCRIPT.parent.parent), "environment": {}},
        "bf16-matrix": {"dtype": "bfloat16", "checkout": str(SCRIPT.parent.parent),
                        "environment": {"PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION": "matrix"}}}
    (f32,), (bf16,) = data["runs"]["float32"], data["runs"]["bf16-matrix"]
    assert "bf16" not in f32["backend"]
    assert "bf16 KV cache" in bf16["backend"] and "template attention as bf16 matrix products" in bf16["backend"]
    # int8 weights: read by the few-row kernel where the CPU has AVX512-BF16, else their bf16 copy
    (int8,) = data["runs"]["bfloat16+int8"]
    assert int8["quantization"] == "int8" and f32["quantization"] == bf16["quantization"] == "none"
    assert ("int8 weights in" in int8["backend"]) == ("avx512_bf16" in cpuinfo.kernel_flags())
    for name, run_ in data["runs"].items():
        row = data["medians"][name]
        assert row["ttft_ms"] == run_[0]["ttft_ms"] > 0 and row["tok_s_2"] == run_[0]["tok_s_2"] > 0
        assert f"| {name} | {row['ttft_ms']:.1f} |" in proc.stdout
        assert row["tok_s_1"] == run_[0]["tok_s_1"] > 0
    assert (tmp_path / "dtype.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "plot: " in proc.stdout


@pytest.mark.parametrize("spec,problem", [
    ("bf16:int8:A=1", "DTYPE one of float32, bfloat16, float32+int8, bfloat16+int8 is needed"),
    ("bf16:bfloat16:A", "'A' is not VAR=VALUE"),
    ("float32:float32:A=1", "system names must differ"),
])
def test_a_malformed_system_is_refused(spec, problem):
    proc = run("--dtypes", "float32", "--system", spec, timeout=120)
    assert proc.returncode != 0 and problem in proc.stderr


def test_an_unknown_dtype_is_refused():
    proc = run("--dtypes", "float32,bfloat16+int4", timeout=120)
    assert proc.returncode != 0 and "--dtypes: bfloat16+int4 is none of float32, bfloat16" in proc.stderr


def load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_cpu_dtype", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_our_systems_are_set_against_each_vllm_one_with_the_targets():
    script = load_script()
    table = {
        "bfloat16": {"ttft_ms": 100.0, "tok_s_1": 80.0, "tok_s_16": 200.0, "tok_s_64": 260.0},
        "float32": {"ttft_ms": 160.0, "tok_s_1": 50.0, "tok_s_16": 140.0, "tok_s_64": 150.0},
        "vllm-bfloat16": {"ttft_ms": 160.0, "tok_s_1": 40.0, "tok_s_16": 140.0, "tok_s_64": 200.0},
        "vllm-float32": {"ttft_ms": 200.0, "tok_s_1": None, "tok_s_16": 100.0, "tok_s_64": 120.0},
    }
    rows = {(r["ours"], r["vllm"]): r for r in script.against_vllm(table, [1, 16, 64])}
    assert set(rows) == {(o, v) for o in ("bfloat16", "float32") for v in ("vllm-bfloat16", "vllm-float32")}
    bf = rows["bfloat16", "vllm-bfloat16"]
    assert bf["ttft_x_sooner"] == pytest.approx(1.6) and bf["ttft_target_met"] is True
    assert bf["tok_s_ratio"] == {1: pytest.approx(2.0), 16: pytest.approx(200 / 140), 64: pytest.approx(1.3)}
    assert bf["tok_s_target_met"] is True  # 1.43x and 1.3x: both at least 1.3x
    f32 = rows["float32", "vllm-bfloat16"]
    assert f32["ttft_x_sooner"] == pytest.approx(1.0) and f32["ttft_target_met"] is False
    assert f32["tok_s_target_met"] is False  # 1.0x at 16
    assert rows["bfloat16", "vllm-float32"]["tok_s_ratio"][1] is None  # a measure vLLM lacks
    assert script.against_vllm(table, [1, 4])[0]["tok_s_target_met"] is None  # no 16 or 64 measured
    assert script.against_vllm({"bfloat16": table["bfloat16"]}, [1]) == []  # no vLLM: nothing to compare
