"""scripts/time_kernel_choices.py on a tiny model's shape (random weights): the cpu backend is
built in bfloat16 with the template attention (and, asked for, each linear shape) timed at each
thread count asked for, and the table and JSON give what it timed and kept (the rules' choices from
those timings)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_service import cpuinfo
from prefix_service import synthetic as models
from prefix_service.backends.cpu import linear, native, onednn, tuning

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "time_kernel_choices.py"
REASON = native.load()[1] or linear.available(torch.bfloat16)


@pytest.mark.skipif(REASON is not None, reason=f"no cpu backend in bfloat16 here: {REASON}")
def test_each_thread_count_gets_a_backend_that_times_and_keeps_a_way(tmp_path, tokenizer_dir):
    model = models.build_config_only(tmp_path / "llama", tokenizer_dir, "llama", max_position_embeddings=2048)
    out = tmp_path / "timing.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--load-format", "dummy",
                           "--thread-counts", "1,2", "--repeat", "2", "--linears", "measure", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    if not onednn.bf16_native():  # timing the linears needs the inner product: refused, and said why
        assert proc.returncode != 0 and "refuses bf16 inner products on this CPU" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["threads"], r["run"]) for r in data["results"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert data["machine"]["isa"] is not None and data["commit"]
    for r in data["results"]:
        if "avx512_bf16" in cpuinfo.kernel_flags():  # a prompt's own attention timed too
            ms = r["prompt"]["ms"]
            assert (r["prompt"]["choice"], r["prompt"]["why"]) == tuning.choose_prompt(ms)
            assert f"a 512-token prompt's own attention: native {ms['native']:.2f} ms, dot {ms['dot']:.2f} ms" in (
                proc.stdout)
        else:
            assert r["prompt"] is None
        assert set(r["linear_timings"]) == {"qkv", "o", "gate_up", "down", "head"}
        for name, lin in r["linear_timings"].items():
            us = {kernel: {int(rows): t for rows, t in by_rows.items()} for kernel, by_rows in lin["us"].items()}
            kernel, rows, why = onednn.choose_linear(us)
            assert (lin["kernel"], lin["brgemm_rows"], lin["why"]) == (kernel, rows, why)
            assert f"{name}" in r["linears"] and r["linears"] in proc.stdout
        if not r["ms"]:  # no bf16 units for the products here: nothing to time against
            assert r["choice"] == "native" and "no matrix products on bf16 units" in r["why"]
            continue
        assert r["template_tokens"] == tuning.TEMPLATE_TOKENS and "native" in r["ms"]
        way, why = tuning.choose(r["ms"])
        assert (r["kernel"] or "native", r["why"]) == (way, why)
        assert f"{r['threads']:7d} {r['run']:3d} kept: {way} ({why})" in proc.stdout
        for name, t in r["ms"].items():
            assert f"{name:<26} {t['prefill']:10.2f} {t['decode']:10.2f}" in proc.stdout


def test_a_backend_that_times_nothing_is_refused(tmp_path, tokenizer_dir):
    model = models.build_config_only(tmp_path / "llama", tokenizer_dir, "llama", max_position_embeddings=2048)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--load-format", "dummy",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "it times no template attention" in proc.stderr
