"""scripts/bench_prefix.py end to end on a tiny random model: every system, every mode, a couple of
requests each, no wait for an idle CPU before them (the vLLM peers skipped, with the reason, as
where `make bench-peers` never ran); checks the JSON schema of docs/benchmarks.md and that the plots
are written."""
import gc
import json

import pytest

from helpers import load_script

pytest.importorskip("matplotlib")

SYSTEMS = {"engine_prefix", "engine_no_prefix", "hf_generate", "hf_prompt_cache", "hf_generate_batch",
           "grpc_prefix", "grpc_no_prefix"}
RECORD_KEYS = {"system", "workload", "mode", "concurrency", "ttft_p50_ms", "ttft_p99_ms", "engine_ttft_p50_ms",
               "ttft_outside_engine_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tok_s", "req_s",
               "max_qps_under_slo", "peak_kv_blocks"}


def test_bench_prefix_smoke(tmp_path, llama_dir, capsys, monkeypatch):
    monkeypatch.setenv("PREFIX_SERVICE_VLLM_PYTHON", str(tmp_path / "no-vllm" / "bin" / "python"))
    config = tmp_path / "bench.yaml"
    config.write_text(f"model: {{path: {llama_dir}, device: cpu}}\n"
                      "cache: {block_size: 4, num_blocks: 256}\n"
                      "scheduler: {max_num_seqs: 8, max_num_batched_tokens: 256}\n")
    bench = load_script("bench_prefix")
    out = tmp_path / "bench.json"
    frozen = gc.get_freeze_count()
    assert bench.main(["--config", str(config), "--json", str(out), "--no-progress",
                       "--workloads", "intent,no_shared", "--max-prefix-tokens", "60", "--prompt-tokens", "30",
                       "--total-tokens", "90", "--output-tokens", "4", "--warmup", "0", "--single-requests", "2",
                       "--concurrency", "2", "--closed-min-requests", "2", "--qps", "4,8",
                       "--open-duration-s", "0.5", "--open-timeout-s", "30", "--idle-wait-s", "0"]) == 0

    assert gc.get_freeze_count() == frozen  # the timed part's gc.freeze is undone: this process's heap as before
    report = json.loads(out.read_text())
    assert {"machine", "model", "date", "git_commit", "records", "targets"} <= set(report)
    assert report["plan"]["idle_wait_s"] == 0
    records = report["records"]
    for r in records:
        assert RECORD_KEYS <= set(r), r
        assert r["system"] in SYSTEMS and r["workload"] in {"intent", "no_shared"}
        assert r["mode"] in {"single", "closed_loop", "open_loop"}
        assert r["num_failed"] == 0, r
        assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["e2e_p99_ms"] >= r["e2e_p50_ms"]
        assert (r["peak_kv_blocks"] is not None) == r["system"].startswith("engine_")
        # our systems report the engine's own TTFT; the client's holds it (the rest is outside the engine)
        ours = r["system"].startswith(("engine_", "grpc_"))
        assert (r["engine_ttft_p50_ms"] is not None) == ours == (r["ttft_outside_engine_p50_ms"] is not None), r
        if ours:
            assert 0 < r["engine_ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_outside_engine_p50_ms"] >= 0, r
    by_mode = {m: {(r["system"], r["workload"]) for r in records if r["mode"] == m}
               for m in ("single", "closed_loop", "open_loop")}
    assert {s for s, w in by_mode["single"] if w == "intent"} == SYSTEMS
    assert {s for s, w in by_mode["single"] if w == "no_shared"} == SYSTEMS - {"hf_prompt_cache", "grpc_prefix"}
    closed = {(r["workload"], r["concurrency"]) for r in records if r["mode"] == "closed_loop"}
    assert closed == {("intent", 2), ("no_shared", 4)}  # the plan's regression check runs at 4
    assert by_mode["open_loop"] == {("grpc_prefix", "intent"), ("grpc_no_prefix", "intent")}
    for r in records:
        if r["mode"] == "open_loop":
            assert r["concurrency"] is None and r["max_qps_under_slo"] in (0.0, 4.0, 8.0)
            assert [p["offered_qps"] for p in r["points"]] == [4.0, 8.0]
        else:
            assert r["max_qps_under_slo"] is None
    assert report["grpc_usage_mismatches"] == {"grpc_prefix": 0, "grpc_no_prefix": 0}
    skipped = report["skipped_systems"]
    assert set(skipped) == {"vllm_apc", "vllm_no_apc"} and all("make bench-peers" in why for why in skipped.values())
    assert {t["target"] for t in report["targets"]} and all("met" in t for t in report["targets"])

    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "engine_prefix" in printed and "targets" in printed and "skipped vllm_apc: no vLLM environment" in printed


def test_the_time_outside_the_engine_is_a_median_of_each_requests_difference():
    from prefix_service.bench.metrics import Timing, summarize
    # client TTFTs 100, 50, 300 ms; the engine's 90, 20, 295: outside it 10, 30, 5 ms (median 10),
    # not the medians' difference (100 - 90); a request without the engine's figure counts in neither
    timings = [Timing(start=0.0, first=f, end=1.0, output_tokens=2, engine_ttft_ms=e)
               for f, e in ((0.1, 90.0), (0.05, 20.0), (0.3, 295.0))]
    timings.append(Timing(start=0.0, first=0.2, end=1.0, output_tokens=2))
    record = summarize(timings, wall_s=1.0)
    assert (record["engine_ttft_p50_ms"], record["ttft_outside_engine_p50_ms"]) == (90.0, 10.0)
    assert record["ttft_p50_ms"] == 150.0  # every request's client TTFT: 50, 100, 200, 300
    assert summarize(timings[3:], wall_s=1.0)["ttft_outside_engine_p50_ms"] is None


def test_closed_loop_request_counts():
    from prefix_service.bench.plan import FULL, with_overrides
    specs = {s.workload: s for s in FULL.closed}
    # the no_shared regression check sends 8 rounds at c=4; intent one round per client
    assert FULL.closed_requests(4, specs["no_shared"]) == 32
    assert FULL.closed_requests(4, specs["intent"]) == 4
    assert FULL.closed_requests(1, specs["intent"]) == FULL.closed_min_requests == 2
    more = with_overrides(FULL, closed_rounds=10)  # --closed-rounds raises every spec, never lowers one
    assert more.closed_requests(4, specs["no_shared"]) == 40 and more.closed_requests(4, specs["intent"]) == 40
    fewer = with_overrides(FULL, closed_rounds=2)
    assert fewer.closed_requests(4, specs["no_shared"]) == 32 and fewer.closed_requests(4, specs["intent"]) == 8
    intent_only = with_overrides(FULL, workloads=("intent",), systems=("engine_prefix",), modes=("closed_loop",))
    assert intent_only.expected_requests() == 1 + 2 + 4 + 16 + 64  # warm-up + c=1, 4, 16, 64
    no_shared = with_overrides(FULL, workloads=("no_shared",), systems=("engine_prefix", "engine_no_prefix"),
                               modes=("closed_loop",))
    assert no_shared.expected_requests() == 2 * (1 + 32)


def test_closed_spec_turns_are_zero_or_at_least_two():
    from prefix_service.bench.plan import ClosedSpec
    for bad in (1, -2):
        with pytest.raises(ValueError, match="turns is 0"):
            ClosedSpec("no_shared", (4,), turns=bad)
    assert ClosedSpec("no_shared", (4,), turns=2).turns == 2 and ClosedSpec("intent", (4,)).turns == 0


def test_closed_loop_in_turns_alternates_the_systems_bursts():
    """The no_shared regression check: the requests in turns, each turn system by system, the order
    mirrored on every other turn, one record per system over all of its requests."""
    import threading

    from prefix_service.bench.metrics import Timing
    from prefix_service.bench.plan import FULL, ClosedSpec, with_overrides
    from prefix_service.bench.runner import Runner
    from prefix_service.bench.systems import System, now

    assert {s.workload: s.turns for s in FULL.closed} == {"intent": 0, "no_shared": 4}
    log, lock = [], threading.Lock()

    class Fake(System):
        def __init__(self, name):
            self.name = name

        def supports(self, workload):
            return True

        def run(self, workload, req, timeout_s=None):
            with lock:
                log.append((self.name, req.index))
            t = Timing(start=now())
            t.add_tokens(3, now())
            t.end = now()
            return t

        def kv_peak_start(self):
            return self.name == "a"

        def kv_blocks_peak(self):
            return 7

    class Workload:
        name = "no_shared"

        def request(self, index):
            return type("Req", (), {"index": index})()

    plan = with_overrides(FULL, closed=(ClosedSpec("no_shared", (2,), ("a", "b"), min_rounds=6, turns=3),),
                          systems=("a", "b"))
    runner = Runner(plan, [Fake("a"), Fake("b")], {"no_shared": Workload()}, tick=lambda: None, status=lambda s: None)
    runner.closed_loop()
    bursts = [(log[i][0], sorted(j for _, j in log[i:i + 4])) for i in range(0, len(log), 4)]
    turn = [sorted({j for _, j in log})[k:k + 4] for k in (0, 4, 8)]  # 12 requests: three turns of 4, at c=2
    assert bursts == [("a", turn[0]), ("b", turn[0]), ("b", turn[1]), ("a", turn[1]), ("a", turn[2]), ("b", turn[2])]
    for name in ("a", "b"):
        assert sorted(i for n, i in log if n == name) == sorted({i for _, i in log})  # every request, once
    records = {r["system"]: r for r in runner.records}
    assert set(records) == {"a", "b"}
    assert all(r["num_requests"] == 12 and r["num_failed"] == 0 and r["in_turns"] and r["turns"] == 3
               for r in records.values())
    assert records["a"]["peak_kv_blocks"] == 7 and records["b"]["peak_kv_blocks"] is None


def test_closed_turns_and_concurrency_options_shape_the_intent_spec():
    from prefix_service.bench.main import build_parser, plan_from_args
    plan = plan_from_args(build_parser().parse_args(["--closed-turns", "3", "--closed-rounds", "3"]))
    specs = {s.workload: s for s in plan.closed}
    assert (specs["intent"].concurrencies, specs["intent"].turns) == ((1, 4, 16, 64), 3)
    assert specs["no_shared"].turns == 4  # the regression check keeps its own
    plan = plan_from_args(build_parser().parse_args(["--concurrency", "16,64"]))
    assert {s.workload: (s.concurrencies, s.turns) for s in plan.closed}["intent"] == ((16, 64), 0)


def test_a_timed_section_waits_for_an_idle_cpu():
    """Processes that keep the CPU busy (as vLLM's server does for a second after it answers) hold
    the next timed section back until they stop. The spinners say when they spin: a Python start-up
    that waits on the disk is not busy enough to count, and timing from it raced."""
    import math
    import os
    import subprocess
    import sys

    from prefix_service.bench import modes
    if modes._cpu_jiffies() is None:
        pytest.skip("no /proc/stat on this platform: wait_idle does not wait")
    cpus = os.cpu_count() or 1
    count = min(cpus, max(1, math.ceil(2 * modes.IDLE_SHARE * cpus)))  # twice the idle share, at least
    code = "import sys, time\nprint('spinning', flush=True)\nt = time.time() + 1.5\nwhile time.time() < t: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
                for _ in range(count)]
    try:
        for spinner in spinners:
            assert spinner.stdout is not None and spinner.stdout.readline().strip() == "spinning"
        modes.wait_idle(max_wait_s=10)  # the spinners stop 1.5 s after they say so; a busy machine waits it all
        assert all(spinner.poll() is not None for spinner in spinners)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
            if spinner.stdout is not None:
                spinner.stdout.close()


def test_wait_idle_waits_out_a_whole_window():
    """A longer window asks for the CPUs idle over all of it: at least one window passes, however idle
    the machine (the targets script settles the machine this way between its steps)."""
    from prefix_service.bench import modes
    if modes._cpu_jiffies() is None:
        pytest.skip("no /proc/stat on this platform: wait_idle does not wait")
    assert modes.wait_idle(max_wait_s=5, window_s=0.6) >= 0.6
    assert modes.wait_idle(max_wait_s=0, window_s=0.6) == pytest.approx(0.0, abs=0.05)


def test_open_loop_runs_the_systems_rate_by_rate_in_turns():
    """Every system at a rate before the next rate, the first one moving along each rate, so that a
    rate's systems share the machine's minutes; a system that falls behind stops there, the others
    go on, and each gets its record (the highest rate under the SLO)."""
    import threading

    from prefix_service.bench.metrics import Timing
    from prefix_service.bench.plan import FULL, with_overrides
    from prefix_service.bench.runner import OPEN_BASE, Runner
    from prefix_service.bench.systems import System, now

    log, lock = [], threading.Lock()

    class Fake(System):
        def __init__(self, name, slow):
            self.name, self.slow = name, slow

        def supports(self, workload):
            return True

        def run(self, workload, req, timeout_s=None):
            rate = (req.index - OPEN_BASE) // 10_000
            with lock:
                if not log or log[-1] != (self.name, rate):
                    log.append((self.name, rate))
            t = Timing(start=now() - (0.05 * 10 ** rate if self.slow else 0.0))  # b: 50 ms, then 500: falls behind
            t.add_tokens(3, now())
            t.end = now()
            return t

    class Workload:
        name = "intent"

        def request(self, index):
            return type("Req", (), {"index": index})()

    plan = with_overrides(FULL, workloads=("intent",), open_workloads=("intent",), open_systems=("a", "b"),
                          systems=("a", "b", "c"), qps=(100.0, 200.0, 400.0), open_duration_s=0.03,
                          open_min_requests=2, slo_ms=20.0, idle_wait_s=0.0, min_points=2)
    systems = [Fake("a", slow=False), Fake("b", slow=True), Fake("c", slow=False)]  # c: no open loop
    runner = Runner(plan, systems, {"intent": Workload()}, tick=lambda: None, status=lambda s: None)
    runner.open_loop()
    assert log == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2)]
    records = {r["system"]: r for r in runner.records}
    assert set(records) == {"a", "b"}
    assert [p["offered_qps"] for p in records["a"]["points"]] == [100.0, 200.0, 400.0]
    assert records["a"]["max_qps_under_slo"] == 400.0
    assert [p["under_slo"] for p in records["b"]["points"]] == [False, False]
    assert records["b"]["max_qps_under_slo"] == 0.0
