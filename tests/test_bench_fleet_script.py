"""scripts/bench_fleet.py on a tiny model: one process and a fleet of 2 replicas, one turn; the JSON
has every section's figures, the fleet's outputs equal the single process's, nothing failed, and
both servers stopped on SIGTERM with exit code 0."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")

pytestmark = pytest.mark.ray

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_fleet.py"


def test_bench_fleet_smoke(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_fleet", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_fleet", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "fleet.json"
    assert bench.main(["--hidden-size", "64", "--layers", "2", "--replicas", "2", "--turns", "1",
                       "--latency-requests", "3", "--requests", "6", "--concurrency", "2", "--max-prefix-tokens", "60",
                       "--prompt-tokens", "30", "--output-tokens", "4", "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    assert {"machine", "date", "git_commit", "command", "model", "workload", "summary", "ratios", "runs"} <= set(report)
    assert report["outputs_equal"] is True
    assert set(report["summary"]) == {"single", "fleet_2"}
    assert report["summary"]["fleet_2"]["replicas"] == 2 and report["summary"]["single"]["replicas"] == 0
    for name, s in report["summary"].items():
        assert s["failed"] == 0 and s["turns"] == 1, name
        assert s["throughput_output_tok_s"] > 0 and s["latency_ttft_p50_ms"] > 0, name
    assert [r["system"] for r in report["runs"]] == ["single", "fleet_2"]
    for r in report["runs"]:
        assert r["latency"]["num_requests"] == 3 and r["throughput"]["num_requests"] == 6 and not r["errors"]
        assert r["exit_code"] == 0, r  # SIGTERM stopped it gracefully (Ray's own handler would not)
    assert set(report["ratios"]) == {"fleet_2_vs_single_throughput"}  # no fleet_1 run: no router figure
    assert report["workload"]["prefix_tokens"] > 0
    printed = capsys.readouterr().out
    assert "fleet_2" in printed and "greedy outputs equal on every system: True" in printed
