"""scripts/bench_cpu_template_call.py on a small template: a row per row count asked for, positive
times, the kernel the library reports, and the JSON the table prints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_service.backends.cpu import onednn

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_template_call.py"
REASON = onednn.load()[1]


@pytest.mark.skipif(REASON is not None, reason=f"no oneDNN library here: {REASON}")
def test_bench_cpu_template_call_script(tmp_path):
    out = tmp_path / "call.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "70", "--kv-heads", "2", "--head-size", "32",
                           "--rows", "1,5,33", "--calls", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["rows"] for r in data["results"]] == [1, 5, 33]
    assert all(0 < r["min_us"] <= r["p50_us"] for r in data["results"])
    assert data["kernel"] == onednn.template_kernel(32) and data["kernel"] in proc.stdout
    assert (data["tokens"], data["kv_heads"], data["head_size"]) == (70, 2, 32)
    table = [line.split() for line in proc.stdout.splitlines()[2:5]]
    for r, line in zip(data["results"], table):  # rows, then the minimum within the JSON's rounding
        assert int(line[0]) == r["rows"] and abs(float(line[1]) - r["min_us"]) <= 0.06, (line, r)
    assert "JSON:" in proc.stdout
    assert data["key_rows"] == (data["kernel"] != "AVX512-BF16 dot products")


@pytest.mark.skipif(REASON is not None, reason=f"no oneDNN library here: {REASON}")
def test_bench_cpu_template_call_script_walks_key_rows_when_asked(tmp_path):
    out = tmp_path / "call.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "70", "--kv-heads", "1", "--head-size", "32",
                           "--rows", "2", "--calls", "2", "--key-rows", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["key_rows"] is True and "the key-row walk" in proc.stdout
