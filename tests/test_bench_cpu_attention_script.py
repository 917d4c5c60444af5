"""scripts/bench_cpu_attention.py on a tiny model's shape (random weights): each of our systems' decode
and prefill attention come from the engine's kernel timers in its own dtype and environment, the
table and JSON agree, vLLM's systems are skipped with the reason where its environment is missing,
and an unknown system is refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_service import synthetic as models
from prefix_service.backends.cpu import linear, native

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_attention.py"
REASON = native.load()[1] or linear.available(torch.bfloat16)


def run(*args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(REASON is not None, reason=f"no cpu backend in bfloat16 here: {REASON}")
def test_our_systems_time_their_attention_and_vllm_is_skipped_without_its_environment(tmp_path, tokenizer_dir):
    model = models.build_config_only(tmp_path / "llama", tokenizer_dir, "llama")
    out = tmp_path / "attention.json"
    proc = run("--model", str(model), "--load-format", "dummy", "--systems", "bfloat16-matrix,vllm-bfloat16",
               "--batches", "1,3", "--rounds", "1", "--steps", "2", "--prefill-runs", "1", "--prefix-tokens", "40",
               "--prompt-tokens", "6", "--json", str(out),
               env={"PREFIX_SERVICE_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["git_commit"] and {"cpu", "isa", "load_average_end"} <= set(data["machine"])
    config = json.loads((model / "config.json").read_text())
    assert data["shape"] == {"layers": config["num_hidden_layers"], "hq": config["num_attention_heads"],
                             "hkv": config["num_key_value_heads"],
                             "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    assert set(data["runs"]) == {"bfloat16-matrix"}
    assert "no vLLM environment" in data["skipped"]["vllm-bfloat16"]
    assert "skipped vllm-bfloat16" in proc.stderr
    (matrix,) = data["runs"]["bfloat16-matrix"]  # its dtype and environment reached the engine
    assert "bf16 KV cache" in matrix["backend"] and "template attention as bf16 matrix products" in matrix["backend"]
    for name, (run_,) in data["runs"].items():
        # attention is part of the steps it was timed in (the profiled ones; the unprofiled steps' p50 is
        # another pass, which a busy machine can make the shorter), and each system's median is its one run
        for n in ("1", "3"):
            assert 0 < run_["step_ms"][n] < run_["profiled_step_ms"][n] and run_["decode_step_ms"][n] > 0
            assert data["medians_ms"][name][n] == run_["step_ms"][n]
        # the segment's prefill on the template: attention is part of the first token of the requests it
        # was timed in (a separate timed request's can be shorter than one slow spell of the machine)
        assert 0 < run_["prefill_ms"] < run_["prefill_profiled_ttft_ms"] and run_["prefill_ttft_ms"] > 0
        assert data["medians_ms"][name]["prefill"] == run_["prefill_ms"]
    m = data["medians_ms"]
    for n in ("1", "3"):
        assert f"| decode, {n} sequences | {m['bfloat16-matrix'][n]:.1f} |" in proc.stdout
    assert f"| prefill, 6 tokens | {m['bfloat16-matrix']['prefill']:.1f} |" in proc.stdout


def test_an_unknown_system_is_refused_by_name():
    proc = run("--systems", "float32,vllm-int8", timeout=120)
    assert proc.returncode != 0 and "unknown systems ['vllm-int8']" in proc.stderr
