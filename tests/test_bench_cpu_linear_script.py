"""scripts/bench_cpu_linear.py on a tiny model's shapes: every way that runs here runs, the table and JSON agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefix_service.backends.cpu import linear as cpu_linear

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_linear.py"


def onednn_linear_available(dtype):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_cpu_linear
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_cpu_linear.onednn_available(dtype)


def test_bench_cpu_linear_script(llama_dir, tmp_path):
    want = ["blas"] + [way for way, check in (("onednn", onednn_linear_available), ("native", cpu_linear.available))
                       if check(torch.float32) is None]
    out = tmp_path / "linear.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--rows", "1,5",
                           "--passes", "2", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["rows"] for r in data["results"]] == [1, 5]
    assert data["ways"] == want
    for r in data["results"]:
        for way in want:
            assert r[f"{way}_ms"] > 0
            assert r[f"{way}_gb_s"] == pytest.approx(data["weight_bytes"] / r[f"{way}_ms"] / 1e6, rel=0.02, abs=0.06)
        for way in want[1:]:
            assert r[f"{way}_speedup"] == pytest.approx(r["blas_ms"] / r[f"{way}_ms"], rel=0.02, abs=0.006)
    assert data["threads"] == 1 and data["weight_bytes"] > 0
    assert "blas ms" in proc.stdout and "JSON:" in proc.stdout
