"""scripts/bench_snapshots.py on a tiny model: the restore start pins every template from the
snapshots the prefill start wrote, every start answers the same first tokens, and the JSON has the
timings the benchmarks doc quotes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_snapshots.py"


def test_bench_snapshots_script(llama_dir, tmp_path):
    out = tmp_path / "snapshots.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--templates", "3",
                           "--template-tokens", "40", "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["kv_sources_ok"] and data["first_tokens_equal"]
    assert [r[0]["kv_sources"] for r in data["runs"].values()] == [["prefill"] * 3, ["prefill"] * 3, ["snapshot"] * 3]
    assert set(data["medians"]) == {"off", "prefill", "restore"}
    assert data["kv_bytes"] > 0 and data["disk_read"][0]["bytes"] >= data["kv_bytes"]  # the files hold the K/V
    assert all(row["to_serving_ms"] >= row["templates_ms"] > 0 for row in data["medians"].values())
    assert "templates from snapshots" in proc.stdout
