"""scripts/bench_cpu_targets.py's table, from steps' JSON made here (the steps themselves need vLLM's
environment and run in benchmarks, not tests): each target's ratio from the right figures, judged
against its threshold, vLLM's faster dtype added where it is float32, the open loop's rates from the
closed loop, and a missing step or record named."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_targets.py"
targets = load_script("bench_cpu_targets")


def engine(ours_tok=(200.0, 240.0), ours_ttft=50.0, bf16=(100.0, 150.0, 90.0), f32=None) -> dict:
    """bench_cpu_dtype.py's JSON: ours in bf16 (tok/s at 16 and 64, TTFT), vLLM's (tok/s at 16, 64, TTFT)."""
    medians = {"bfloat16": {"tok_s_16": ours_tok[0], "tok_s_64": ours_tok[1], "ttft_ms": ours_ttft},
               "float32": {"tok_s_16": 1.0, "tok_s_64": 1.0, "ttft_ms": 999.0},
               "vllm-bfloat16": {"tok_s_16": bf16[0], "tok_s_64": bf16[1], "ttft_ms": bf16[2]}}
    if f32 is not None:
        medians["vllm-float32"] = {"tok_s_16": f32[0], "tok_s_64": f32[1], "ttft_ms": f32[2]}
    return {"medians": medians, "machine": {"cpu": "Test CPU", "cpu_count": 2, "isa": ["AVX512-BF16"],
                                            "load_average_start": [0.5, 0.5, 0.5]}, "git_commit": "abc1234def"}


def servers(systems: dict[str, tuple[float, float, float]]) -> dict:
    """prefix-service bench's JSON: per system (closed-loop tok/s at 16, at 64, single TTFT p50)."""
    records = []
    for name, (c16, c64, ttft) in systems.items():
        records.append({"system": name, "mode": "single", "concurrency": 1, "ttft_p50_ms": ttft,
                        "output_tok_s": 1.0})
        records += [{"system": name, "mode": "closed_loop", "concurrency": c, "output_tok_s": tok, "ttft_p50_ms": 1.0}
                    for c, tok in ((16, c16), (64, c64))]
    return {"records": records, "machine": {"load_average_start": [1.0, 1.0, 1.0]}}


def opened(max_qps: dict[str, float | None]) -> dict:
    return {"records": [{"system": s, "mode": "open_loop", "concurrency": None, "max_qps_under_slo": q}
                        for s, q in max_qps.items()]}


def ratios(full: float, alone: float) -> dict:
    return {"ratio": {"ttft_p50": full, "alone_p50": alone}}


def write(out: Path, **steps: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for step, data in steps.items():
        (out / targets.FILES[step.replace("_", "-")]).write_text(json.dumps(data))
    return out


def complete(out: Path, **overrides: dict) -> Path:
    steps = {"ratios_1": ratios(8.0, 1.3), "ratios_2": ratios(7.9, 1.35), "engine": engine(),
             "servers": servers({"grpc_prefix": (180.0, 200.0, 60.0), "vllm_apc_bf16": (100.0, 120.0, 120.0)}),
             "open": opened({"grpc_prefix": 3.0, "vllm_apc_bf16": 1.5})}
    steps.update(overrides)
    return write(out, **steps)


def by_measure(summary: dict, start: str, vllm: str | None = "bfloat16") -> dict:
    [row] = [r for r in summary["rows"] if r["measure"].startswith(start) and r["vllm"] == vllm]
    return row


def test_every_ratio_comes_from_its_figures_and_is_judged(tmp_path):
    summary = targets.summarize(complete(tmp_path), ours="bfloat16")
    assert summary["vllm_dtypes"] == ["bfloat16"]
    assert by_measure(summary, "tok/s, 16 requests")["value"] == pytest.approx(2.0)
    assert by_measure(summary, "tok/s, 64 requests")["value"] == pytest.approx(1.6)
    assert by_measure(summary, "tok/s, 16 clients")["value"] == pytest.approx(1.8)
    assert by_measure(summary, "tok/s, 64 clients")["value"] == pytest.approx(200 / 120)
    engine_ttft = by_measure(summary, "TTFT, template cached, one request")
    assert (engine_ttft["ours"], engine_ttft["theirs"], engine_ttft["value"]) == (50.0, 90.0, pytest.approx(1.8))
    assert by_measure(summary, "TTFT p50")["value"] == pytest.approx(2.0)
    assert by_measure(summary, "most requests/s")["value"] == pytest.approx(2.0)
    full = by_measure(summary, "TTFT full / prefix", None)
    assert full["values"] == [8.0, 7.9] and full["value"] == 7.9 and full["met"] is True
    assert by_measure(summary, "TTFT prefix / alone", None)["value"] == 1.35
    assert summary["all_met"] is True and all(r["met"] is True for r in summary["rows"])
    table = targets.markdown(summary)
    assert "every target met" in table and "Test CPU" in table and "AVX512-BF16" in table and "abc1234" in table
    assert "-march" not in table
    summary["machine"] = {**summary["machine"], "cpu_march": "cooperlake"}  # kernels built for a named target
    assert "ISA AVX512-BF16, kernels built for -march=cooperlake; tree abc1234" in targets.markdown(summary)


def test_a_target_below_its_threshold_is_missed(tmp_path):
    out = complete(tmp_path, ratios_2=ratios(7.4, 1.5),
                   servers=servers({"grpc_prefix": (120.0, 200.0, 80.0), "vllm_apc_bf16": (100.0, 120.0, 100.0)}))
    summary = targets.summarize(out, ours="bfloat16")
    assert by_measure(summary, "tok/s, 16 clients")["met"] is False  # 1.2x
    assert by_measure(summary, "tok/s, 64 clients")["met"] is True
    assert by_measure(summary, "TTFT p50")["met"] is False  # 1.25x sooner
    assert by_measure(summary, "TTFT full / prefix", None)["met"] is False  # 7.4 in one run
    assert by_measure(summary, "TTFT prefix / alone", None)["met"] is False  # 1.5 in one run
    assert summary["all_met"] is False
    assert "not every target met" in targets.markdown(summary) and "| missed |" in targets.markdown(summary)
    missed = sum(r["met"] is False for r in summary["rows"])
    assert f"{len(summary['rows']) - missed} of {len(summary['rows'])} met, {missed} missed, 0 without a figure\n" \
        in targets.markdown(summary)


def test_vllms_faster_float32_is_judged_too(tmp_path):
    out = complete(tmp_path, engine=engine(f32=(110.0, 130.0, 80.0)),
                   servers=servers({"grpc_prefix": (180.0, 200.0, 60.0), "vllm_apc_bf16": (100.0, 120.0, 120.0),
                                    "vllm_apc_f32": (150.0, 160.0, 70.0)}),
                   open=opened({"grpc_prefix": 3.0, "vllm_apc_bf16": 1.5, "vllm_apc_f32": None}))
    summary = targets.summarize(out, ours="bfloat16")
    assert summary["vllm_dtypes"] == ["bfloat16", "float32"]
    assert by_measure(summary, "tok/s, 16 requests", "float32")["value"] == pytest.approx(200 / 110)
    assert by_measure(summary, "tok/s, 16 clients", "float32")["value"] == pytest.approx(1.2)
    assert by_measure(summary, "TTFT p50", "float32")["met"] is False  # 70 / 60
    # vLLM in float32 under the SLO at no rate tried, ours at 3 requests/s: met, with no ratio
    open_f32 = by_measure(summary, "most requests/s", "float32")
    assert (open_f32["value"], open_f32["met"]) == (None, True)
    commands = targets.commands(out, type("Args", (), {"qps": None, "open_duration_s": 60.0, "rounds": 2})(), "open")
    assert commands[0][commands[0].index("--systems") + 1] == "grpc_prefix,vllm_apc_bf16,vllm_apc_f32"


def test_the_open_loops_rates_come_from_the_closed_loop(tmp_path):
    data = servers({"grpc_prefix": (180.0, 300.0, 60.0), "vllm_apc_bf16": (100.0, 120.0, 120.0)})
    # 300 tok/s at 64 clients, 30 tokens a request: 10 requests/s -> 3.5, 5, 6.5, 8; 120 -> 4 requests/s ->
    # 1.4, 2, 2.6, 3.2, to the nearest 0.5
    assert targets.open_rates(data, ["grpc_prefix", "vllm_apc_bf16"]) == [1.5, 2.0, 2.5, 3.0, 3.5, 5.0, 6.5, 8.0]
    slow = servers({"grpc_prefix": (1.0, 6.0, 60.0)})  # 0.2 requests/s: every rate at least 0.5
    assert targets.open_rates(slow, ["grpc_prefix"]) == [0.5]


def test_a_missing_step_or_record_is_named(tmp_path):
    out = complete(tmp_path)
    (out / targets.FILES["open"]).unlink()
    with pytest.raises(targets.TargetsError, match="open.json is missing"):
        targets.summarize(out, ours="bfloat16")
    out = complete(tmp_path / "b", servers=servers({"grpc_prefix": (180.0, 200.0, 60.0)}))
    with pytest.raises(targets.TargetsError, match="no closed_loop record of vllm_apc_bf16 at concurrency 16"):
        targets.summarize(out, ours="bfloat16")
    with pytest.raises(targets.TargetsError, match="no 'float16' system"):
        targets.summarize(complete(tmp_path / "c"), ours="float16")


def test_summary_only_writes_the_table_or_names_what_is_missing(tmp_path):
    out = complete(tmp_path / "full", engine=engine() | {"medians": engine()["medians"] | {
        "float32": engine()["medians"]["bfloat16"]}})  # ours is auto's choice, float32 or bf16 by the CPU
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--summary-only"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "targets.md").read_text() in proc.stdout
    assert json.loads((out / "targets.json").read_text())["all_met"] is True
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "empty"), "--summary-only"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "engine.json is missing" in proc.stderr, proc.stderr[-2000:]


def test_a_run_without_vllms_environment_stops_before_its_first_step(tmp_path):
    """The steps take ~25 minutes and all but the first need vLLM: without its environment the script
    says so and runs nothing."""
    out = tmp_path / "run"
    env = dict(os.environ, PREFIX_SERVICE_VLLM_PYTHON=str(tmp_path / "nowhere" / "python"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and "no vLLM environment" in proc.stderr and "make bench-peers" in proc.stderr
    assert list(out.iterdir()) == []


def test_our_ratios_run_and_are_named_in_our_dtype(tmp_path, monkeypatch):
    """On a CPU without bf16 units ours is float32 (auto's choice): the ratio steps run profile_prefill
    in it and the rows name it; a run's JSON that names no dtype was bf16's."""
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setattr(targets, "ours_dtype", lambda d=dtype: d)
        [cmd] = targets.commands(tmp_path, None, "ratios-1")
        assert cmd[cmd.index("--dtype") + 1] == dtype and cmd[1].endswith("profile_prefill.py")
    out = complete(tmp_path / "f32", ratios_1=ratios(8.0, 1.3) | {"dtype": "float32"})
    rows = targets.summarize(out, ours="bfloat16")["rows"]
    assert by_measure({"rows": rows}, "TTFT full / prefix in float32", None)["values"] == [8.0, 7.9]
    assert by_measure({"rows": rows}, "TTFT prefix / alone in float32", None)["values"] == [1.3, 1.35]
    rows = targets.summarize(complete(tmp_path / "old"), ours="bfloat16")["rows"]
    assert by_measure({"rows": rows}, "TTFT full / prefix in bfloat16", None)["value"] == 7.9


def test_a_vllm_server_left_out_has_no_figure_and_says_why(tmp_path):
    """--vllm-servers float32: vLLM's bf16 (judged engine to engine) is not run through the servers; its
    server rows read 'no figure' with the reason, its engine rows are judged, and the float32 server's are."""
    planned = {"systems": ["grpc_prefix", "vllm_apc_f32"]}
    out = complete(tmp_path, engine=engine(f32=(110.0, 130.0, 80.0)),
                   servers=servers({"grpc_prefix": (180.0, 200.0, 60.0), "vllm_apc_f32": (150.0, 160.0, 70.0)})
                   | {"plan": planned},
                   open=opened({"grpc_prefix": 3.0, "vllm_apc_f32": 1.5}) | {"plan": planned})
    summary = targets.summarize(out, ours="bfloat16")
    assert summary["vllm_dtypes"] == ["bfloat16", "float32"]
    for measure in ("tok/s, 16 clients", "tok/s, 64 clients", "TTFT p50", "most requests/s"):
        left_out = by_measure(summary, measure, "bfloat16")
        assert (left_out["value"], left_out["met"]) == (None, None), left_out
        assert left_out["note"] == "vllm_apc_bf16 not run (--vllm-servers)"
        assert by_measure(summary, measure, "float32")["met"] is not None
    assert by_measure(summary, "tok/s, 16 requests", "bfloat16")["value"] == pytest.approx(2.0)
    assert by_measure(summary, "most requests/s", "float32")["value"] == pytest.approx(2.0)
    assert summary["all_met"] is False
    assert "| no figure (vllm_apc_bf16 not run (--vllm-servers)) |" in targets.markdown(summary)
    # the verdict counts them apart from the missed ones
    rows = len(summary["rows"])
    none = sum(r["met"] is None for r in summary["rows"])
    missed = sum(r["met"] is False for r in summary["rows"])
    assert none == 4
    assert f"not every target met: {rows - 4 - missed} of {rows} met, {missed} missed, 4 without a figure" \
        in targets.markdown(summary)
    # with nothing missed, the line says every target with a figure was met
    for r in summary["rows"]:
        r["met"] = True if r["met"] is False else r["met"]
    assert targets.markdown(summary).endswith(f"not every target met: {rows - 4} of {rows} met, 0 missed, 4 without a "
                                              f"figure (every target with a figure met)\n")
    # a system the plan names but whose record is missing is still an error
    broken = complete(tmp_path / "b", engine=engine(f32=(110.0, 130.0, 80.0)),
                      servers=servers({"grpc_prefix": (180.0, 200.0, 60.0)}) | {"plan": planned},
                      open=opened({"grpc_prefix": 3.0, "vllm_apc_f32": 1.5}) | {"plan": planned})
    with pytest.raises(targets.TargetsError, match="no closed_loop record of vllm_apc_f32"):
        targets.summarize(broken, ours="bfloat16")
    args = type("Args", (), {"qps": None, "open_duration_s": 60.0, "rounds": 2, "vllm_servers": ["float32"]})()
    [cmd] = targets.commands(out, args, "servers")
    assert cmd[cmd.index("--systems") + 1] == "grpc_prefix,vllm_apc_f32"
    assert targets.server_dtypes(targets.load(out, "engine"), None) == ["bfloat16", "float32"]
    assert targets.vllm_server_names(" float32 , bfloat16") == ["float32", "bfloat16"]
    for wrong, why in (("float32,fp8", "unknown dtype.s. fp8;"), (" , ", "no dtype in ' , ';")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{why} choose from bfloat16, float32"):
            targets.vllm_server_names(wrong)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x"), "--vllm-servers", "fp8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--vllm-servers: unknown dtype(s) fp8" in proc.stderr, proc.stderr[-2000:]


def test_each_step_starts_on_a_settled_machine(tmp_path, monkeypatch):
    """Before every step the script waits for the CPUs to be idle over SETTLE_WINDOW_S, at most
    --settle-s, and only then runs the step's command; the table follows from the steps' JSON."""
    from prefix_service.bench import modes
    from prefix_service.bench.systems import vllm
    events: list[tuple] = []
    monkeypatch.setattr(vllm, "vllm_python", lambda: (sys.executable, ""))
    monkeypatch.setattr(modes, "wait_idle", lambda max_s, window_s: events.append(("settle", max_s, window_s)) or 0.0)
    out = tmp_path / "run"
    data = {"ratios-1": ratios(8.0, 1.3), "ratios-2": ratios(7.9, 1.35), "engine": engine(),
            "servers": servers({"grpc_prefix": (180.0, 200.0, 60.0), "vllm_apc_bf16": (100.0, 120.0, 120.0)}),
            "open": opened({"grpc_prefix": 3.0, "vllm_apc_bf16": 1.5})}

    def run(cmd, **kwargs):  # each step "runs": its JSON appears
        step = next(s for s, f in targets.FILES.items() if str(out / f) in cmd)
        events.append(("run", step))
        (out / targets.FILES[step]).write_text(json.dumps(data[step]))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(targets.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["bench_cpu_targets.py", "--out", str(out), "--settle-s", "33"])
    assert targets.main() == 0
    want: list[tuple] = []
    for step in targets.FILES:
        want += [("settle", 33.0, targets.SETTLE_WINDOW_S), ("run", step)]
    assert events == want
    assert targets.SETTLE_WINDOW_S >= 1.0  # a settled machine, not a gap between two bursts
    assert (out / "targets.md").exists()
