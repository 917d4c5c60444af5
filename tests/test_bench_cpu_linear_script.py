"""scripts/bench_cpu_linear.py on a tiny model's shapes: both ways run, the table and JSON agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_service.model.packed_linear import onednn_linear_available

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_linear.py"


def test_bench_cpu_linear_script(llama_dir, tmp_path):
    reason = onednn_linear_available(torch.float32)
    if reason and "disagreed" not in reason:
        pytest.skip(reason)
    out = tmp_path / "linear.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--rows", "1,5",
                           "--passes", "2", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["rows"] for r in data["results"]] == [1, 5]
    for r in data["results"]:
        assert r["blas_ms"] > 0 and r["onednn_ms"] > 0
        assert r["speedup"] == pytest.approx(r["blas_ms"] / r["onednn_ms"], rel=0.02)
    assert data["threads"] == 1 and data["weight_bytes"] > 0
    assert "F.linear ms" in proc.stdout and "JSON:" in proc.stdout
