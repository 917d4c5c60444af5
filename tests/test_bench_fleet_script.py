"""scripts/bench_fleet.py on a tiny model: one process and a fleet of 2 replicas in Ray Serve's
throughput mode, one turn, no wait for an idle CPU (a local Ray cluster keeps the CPUs busy enough
that every timed request would wait the full 5 s); the JSON has every section's figures and the
fleet's Ray Serve settings, the fleet's outputs equal the single process's, nothing failed, and
every server stopped on SIGTERM with exit code 0. The fleet on Ray Serve's defaults
(--ray-defaults) is checked without a run: the system it adds, its settings, and its ratios."""
from __future__ import annotations

import json

import pytest

from helpers import load_script

pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")

pytestmark = pytest.mark.ray


def test_ray_defaults_adds_the_same_fleet_on_ray_serves_defaults_and_its_ratios(monkeypatch):
    bench = load_script("bench_fleet", monkeypatch)
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    specs = bench.build_specs([1, 2], True, 4)
    assert [(s.name, s.replicas, s.threads) for s in specs] == [
        ("single", 0, 4), ("fleet_1", 1, 4), ("fleet_1_ray_defaults", 1, 4), ("fleet_2", 2, 2),
        ("fleet_2_ray_defaults", 2, 2)]
    assert [s.name for s in bench.build_specs([2], False, 2)] == ["single", "fleet_2"]
    by_name = {s.name: s for s in specs}
    assert by_name["single"].serve_env() == {}
    assert by_name["fleet_2"].serve_env()["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"  # what serve --ray sets
    assert by_name["fleet_2_ray_defaults"].serve_env()["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"

    def figures(tok_s, ttft, tpot):
        return {"throughput_output_tok_s": tok_s, "latency_ttft_p50_ms": ttft, "latency_tpot_p50_ms": tpot,
                "latency_e2e_p50_ms": ttft + 10 * tpot}
    got = bench.ratios({"single": figures(100.0, 50.0, 5.0), "fleet_2": figures(150.0, 60.0, 6.0),
                        "fleet_2_ray_defaults": figures(120.0, 70.0, 6.5)})
    assert got == {"fleet_2_vs_single_throughput": 1.5, "fleet_2_vs_ray_defaults_throughput": 1.25,
                   "fleet_2_vs_ray_defaults_ttft_ms": -10.0, "fleet_2_vs_ray_defaults_tpot_ms": -0.5}


def test_bench_fleet_smoke(tmp_path, capsys, monkeypatch):
    bench = load_script("bench_fleet", monkeypatch)
    out = tmp_path / "fleet.json"
    assert bench.main(["--hidden-size", "64", "--layers", "2", "--replicas", "2", "--turns", "1",
                       "--latency-requests", "3", "--requests", "6", "--concurrency", "2", "--max-prefix-tokens", "60",
                       "--prompt-tokens", "30", "--output-tokens", "4", "--idle-wait-s", "0",
                       "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    assert {"machine", "date", "git_commit", "command", "model", "workload", "summary", "ratios", "runs"} <= set(report)
    assert report["outputs_equal"] is True
    assert set(report["summary"]) == {"single", "fleet_2"}
    assert report["summary"]["fleet_2"]["replicas"] == 2 and report["summary"]["single"]["replicas"] == 0
    assert report["summary"]["fleet_2"]["serve_env"]["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert report["summary"]["single"]["serve_env"] == {}
    for name, s in report["summary"].items():
        assert s["failed"] == 0 and s["turns"] == 1, name
        assert s["throughput_output_tok_s"] > 0 and s["latency_ttft_p50_ms"] > 0, name
    assert [r["system"] for r in report["runs"]] == ["single", "fleet_2"]
    for r in report["runs"]:
        assert r["latency"]["num_requests"] == 3 and r["throughput"]["num_requests"] == 6 and not r["errors"]
        assert r["exit_code"] == 0, r  # SIGTERM stopped it gracefully (Ray's own handler would not)
    # no fleet_1 run: no router figure; no fleet on Ray Serve's defaults: no comparison with it
    assert set(report["ratios"]) == {"fleet_2_vs_single_throughput"}
    assert report["workload"]["prefix_tokens"] > 0 and report["workload"]["idle_wait_s"] == 0
    printed = capsys.readouterr().out
    assert "fleet_2" in printed and "greedy outputs equal on every system: True" in printed
