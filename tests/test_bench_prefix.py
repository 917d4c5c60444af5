"""scripts/bench_prefix.py end to end on a tiny random model: every system, every mode, a couple of
requests each, no wait for an idle CPU before them (the vLLM peers skipped, with the reason, as
where `make bench-peers` never ran); checks the JSON schema of docs/benchmarks.md and that the plots
are written. Beside it, the parts on their own: the summary measures and percentiles, the targets'
directions and figures, the tables and the JSON file, the plan's request counts, the runner's turns,
warm-up and open-loop rates, and the workloads' sizes."""
import gc
import json

import pytest

from helpers import load_script
from prefix_service.bench.workloads import Answers

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


def bench_float32(tmp_path, llama_dir, monkeypatch, scheduler: str, args: list[str]):
    """scripts/bench_prefix.py's main() with `args` on the tiny model in float32 (the vLLM peers
    skipped; `scheduler`: more scheduler settings, ", key: value") -> (the JSON report, its path)."""
    monkeypatch.setenv("PREFIX_SERVICE_VLLM_PYTHON", str(tmp_path / "no-vllm" / "bin" / "python"))
    config = tmp_path / "bench.yaml"
    config.write_text(f"model: {{path: {llama_dir}, device: cpu, dtype: float32}}\n"
                      "cache: {block_size: 4, num_blocks: 256}\n"
                      f"scheduler: {{max_num_seqs: 8, max_num_batched_tokens: 256{scheduler}}}\n")
    out = tmp_path / "report.json"
    assert load_script("bench_prefix").main(["--config", str(config), "--json", str(out), "--no-progress", *args]) == 0
    return json.loads(out.read_text()), out


def test_bench_labels_workload_answers_with_the_templates_labels(tmp_path, llama_dir, monkeypatch):
    """intent_labels beside intent: the systems that can constrain an output (our engine with and
    without the prefix, the server through gRPC and through its OpenAI HTTP API; the server holds the
    template both workloads share once) answer every request with one of the template's labels, the
    same labels on the same messages (float32, greedy), ending where the label does; transformers'
    systems are left out of it. http_prefix streams the intent workload's tokens too."""
    from prefix_service.bench.workloads import INTENT_LABELS
    report, _ = bench_float32(tmp_path, llama_dir, monkeypatch, "", [
        "--workloads", "intent,intent_labels",
        "--systems", "engine_prefix,engine_no_prefix,grpc_prefix,http_prefix,hf_generate",
        "--modes", "single,closed_loop",
        "--max-prefix-tokens", "60", "--prompt-tokens", "30", "--output-tokens", "4", "--warmup", "0",
        "--single-requests", "3", "--concurrency", "3", "--closed-min-requests", "3", "--idle-wait-s", "0"])
    labels = report["workloads"]["intent_labels"]
    assert labels["labels"] == [" " + label for label in INTENT_LABELS] and labels["prefix_name"] == "intent_classifier"
    assert report["workloads"]["intent"]["output_tokens"] == 4 and "labels" not in report["workloads"]["intent"]
    records = [r for r in report["records"] if r["workload"] == "intent_labels"]
    ours = ("engine_prefix", "engine_no_prefix", "grpc_prefix", "http_prefix")
    assert {(r["system"], r["mode"]) for r in records} == {(s, m) for s in ours for m in ("single", "closed_loop")}
    for r in records:
        assert r["num_failed"] == 0 and r["answers_not_labels"] == 0, r
        assert sum(r["label_counts"].values()) == r["num_requests"] == 3
        assert set(r["label_counts"]) <= set(INTENT_LABELS)
        assert r["req_s"] > 0
    for mode in ("single", "closed_loop"):
        counts = [r["label_counts"] for r in records if r["mode"] == mode]
        assert all(c == counts[0] for c in counts), counts
    assert report["grpc_usage_mismatches"] == {"grpc_prefix": 0, "http_prefix": 0}
    intent = [r for r in report["records"] if r["workload"] == "intent"]
    assert "hf_generate" in {r["system"] for r in intent} and all("answers_not_labels" not in r for r in intent)
    http = [r for r in intent if r["system"] == "http_prefix"]
    assert {r["mode"] for r in http} == {"single", "closed_loop"}
    for r in http:  # the OpenAI HTTP API's stream: every token of every request, counted as it came
        assert r["num_failed"] == 0 and r["ttft_p50_ms"] > 0
        # (wall_s is rounded to the millisecond: the product is off by up to tok/s x 0.0005)
        assert abs(r["output_tok_s"] * r["wall_s"] - 4 * r["num_requests"]) <= r["output_tok_s"] * 0.0005 + 0.01
        # a TPOT: two tokens or more counted per request (the tiny model's steps take well under a
        # millisecond, so the last three can come in one read of the stream: 0.0 ms)
        assert r["tpot_p50_ms"] is not None and r["tpot_p50_ms"] >= 0


def test_bench_records_workload_answers_with_json_records(tmp_path, llama_dir, monkeypatch):
    """doc_records: our engine and server (gRPC and HTTP) answer each flight's ask with a JSON record
    of the schema's fields (a record's strings a few letters here, so that the random model ends its
    records within the cap), the same records (as many tokens) on every path, the closed loop's
    plot drawn; transformers' systems are left out of it."""
    from prefix_service.bench import workloads
    short = {f: {"type": "string", "pattern": "^[a-z0-9 ]{0,3}$"} for f in workloads.RECORD_FIELDS}
    monkeypatch.setattr(workloads, "RECORD_SCHEMA", {**workloads.RECORD_SCHEMA, "properties": short})
    report, out = bench_float32(tmp_path, llama_dir, monkeypatch, ", speculative_tokens: 4", [
        "--workloads", "doc_records",
        "--systems", "engine_prefix,grpc_prefix,http_prefix,hf_generate", "--modes", "single,closed_loop",
        "--max-prefix-tokens", "60", "--warmup", "0", "--single-requests", "3", "--concurrency", "1,3",
        "--closed-min-requests", "3", "--idle-wait-s", "0"])
    described = report["workloads"]["doc_records"]
    assert described["record_fields"] == list(workloads.RECORD_FIELDS) and described["prefix_name"] == "table_qa"
    assert (described["output_tokens"], described["output_tokens_is"]) == (workloads.RECORD_MAX_TOKENS, "at most")
    records = report["records"]
    ours = ("engine_prefix", "grpc_prefix", "http_prefix")
    assert {(r["system"], r["mode"], r["concurrency"]) for r in records} == {
        (s, m, c) for s in ours for m, c in (("single", 1), ("closed_loop", 1), ("closed_loop", 3))}
    for r in records:
        assert r["num_failed"] == 0 and r["answers_not_records"] == 0 and r["num_requests"] == 3, r
        assert "answers_not_labels" not in r and r["req_s"] > 0
    for key in {(r["mode"], r["concurrency"]) for r in records}:  # the same records: as many tokens (to the
        # rounding of tok/s and wall time)
        tokens = [r["output_tok_s"] * r["wall_s"] for r in records if (r["mode"], r["concurrency"]) == key]
        assert max(tokens) - min(tokens) < 0.03 * max(tokens), (key, tokens)
    assert report["grpc_usage_mismatches"] == {"grpc_prefix": 0, "http_prefix": 0}
    plot = out.with_name("report-records-concurrency.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_records_answer_is_a_json_object_of_the_schemas_string_fields(llama_dir):
    from prefix_service.bench.workloads import RECORD_FIELDS, Sizes, build_workload
    from prefix_service.model.loader import load_tokenizer
    work = build_workload("doc_records", load_tokenizer(llama_dir), Sizes(max_prefix_tokens=60))
    whole = json.dumps({f: "x" for f in RECORD_FIELDS})
    wrong = [json.dumps({f: "x" for f in RECORD_FIELDS[:-1]}), json.dumps({**json.loads(whole), "gate": 7}),
             json.dumps({**json.loads(whole), "extra": "x"}), whole[:-1], "[]", ""]
    assert work.wrong_answers([whole, whole]) == {"answers_not_records": 0}
    assert work.wrong_answers([whole] + wrong) == {"answers_not_records": len(wrong)}
    assert work.structured_outputs() == {"json": work.record_schema, "disable_any_whitespace": True}
    assert work.structured_output() == {"json_schema": work.record_schema} and work.constrained
    ask = work.request(0).prompt_text
    assert ask.startswith("\nQ: ") and ask.endswith("\nA:") and "JSON" in ask


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

    assert {s.workload: s.turns for s in FULL.closed} == {"intent": 0, "no_shared": 4, "intent_labels": 0,
                                                         "doc_records": 0}
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

    class Workload(Answers):
        name, labels, record_schema = "no_shared", (), None

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

    class Workload(Answers):
        name, labels, record_schema = "intent", (), None

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
    # each record is measured at its highest rate under the SLO, or at the first rate where none was
    assert (records["a"]["measured_at_qps"], records["b"]["measured_at_qps"]) == (400.0, 100.0)
    assert records["a"]["e2e_p99_ms"] == records["a"]["points"][-1]["e2e_p99_ms"]
    assert [p["under_slo"] for p in records["b"]["points"]] == [False, False]
    assert records["b"]["max_qps_under_slo"] == 0.0


def test_percentile_interpolates_between_the_closest_ranks():
    """numpy's default percentile: the rank (n - 1) x q / 100, interpolated between its neighbours."""
    from prefix_service.bench.metrics import percentile
    xs = [40.0, 10.0, 30.0, 20.0]  # unsorted on purpose
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 40.0 and percentile(xs, 50) == 25.0
    assert percentile(xs, 99) == pytest.approx(39.7)  # rank 2.97: 30 + 0.97 x (40 - 30)
    assert percentile(xs, 10) == pytest.approx(13.0)  # rank 0.3
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def test_a_runs_summary_measures_finished_requests_and_counts_the_others_as_failed():
    """Latencies, tokens and req/s come from the requests that ended without an error; a request cut
    off (error set) or never ended counts as failed; TTFT is the first arrival that carried tokens,
    TPOT the time after it per later token, all in ms; a run of no time has no throughput."""
    from prefix_service.bench.metrics import Timing, summarize
    a = Timing(start=1.0)
    a.add_tokens(0, 1.05)  # an empty chunk is not the first token
    a.add_tokens(2, 1.1)
    a.add_tokens(3, 1.5)
    a.end = 1.5
    assert (a.first, a.output_tokens, a.ok) == (1.1, 5, True)
    assert (a.ttft_ms, a.e2e_ms, a.tpot_ms) == (pytest.approx(100.0), pytest.approx(500.0), pytest.approx(100.0))
    b = Timing(start=0.0, first=0.3, end=0.7, output_tokens=1)  # one token: no TPOT
    assert b.tpot_ms is None and b.ttft_ms == pytest.approx(300.0)
    cut = Timing(start=0.0, first=0.01, end=0.02, output_tokens=9, error="deadline")
    lost = Timing(start=0.0, first=0.01, output_tokens=9)
    record = summarize([a, cut, b, lost], wall_s=2.0)
    assert (record["num_requests"], record["num_failed"]) == (4, 2)
    assert (record["output_tok_s"], record["req_s"], record["wall_s"]) == (3.0, 1.0, 2.0)  # 6 tokens, 2 requests
    assert (record["ttft_p50_ms"], record["e2e_p50_ms"], record["tpot_p50_ms"]) == (200.0, 600.0, 100.0)
    assert record["e2e_p99_ms"] == pytest.approx(698.0)  # 500 and 700 ms: rank 0.99
    empty = summarize([], wall_s=0.0)
    assert (empty["num_requests"], empty["output_tok_s"], empty["req_s"], empty["ttft_p50_ms"]) == (0, None, None, None)


def _targets_rec(system, workload, mode, c, **fields):
    return {"system": system, "workload": workload, "mode": mode, "concurrency": c, **fields}


def test_each_target_is_judged_on_its_own_figures_in_its_own_direction():
    """The prefix's speed-up and lead are met at their thresholds, the slowdowns and TPOT ratio only
    at or under theirs; each ratio's value is the figures' quotient; a closed-loop target reads the
    records at its own concurrency; an open loop where neither system meets the SLO is missed, one
    where only the prefix does is met (with no ratio to show)."""
    from prefix_service.bench import report
    rec = _targets_rec
    records = [
        rec("engine_prefix", "intent", "single", 1, ttft_p50_ms=10.0, tpot_p50_ms=20.0),
        rec("engine_no_prefix", "intent", "single", 1, ttft_p50_ms=80.0, tpot_p50_ms=19.0),
        rec("hf_prompt_cache", "intent", "single", 1, ttft_p50_ms=10.0),
        rec("grpc_prefix", "intent", "open_loop", None, max_qps_under_slo=0.0),
        rec("grpc_no_prefix", "intent", "open_loop", None, max_qps_under_slo=0.0),
        rec("engine_prefix", "no_shared", "single", 1, e2e_p50_ms=110.0),
        rec("engine_no_prefix", "no_shared", "single", 1, e2e_p50_ms=100.0),
        rec("engine_prefix", "no_shared", "closed_loop", 4, output_tok_s=100.0),
        rec("engine_no_prefix", "no_shared", "closed_loop", 4, output_tok_s=110.0),
        rec("engine_prefix", "intent", "closed_loop", 4, output_tok_s=50.0),
        rec("hf_generate_batch", "intent", "closed_loop", 4, output_tok_s=300.0),
        rec("engine_prefix", "intent", "closed_loop", 16, output_tok_s=200.0),
        rec("hf_generate_batch", "intent", "closed_loop", 16, output_tok_s=100.0),
    ]
    got = {t["target"].split(" (")[0]: t for t in report.evaluate_targets(records)}

    def judged(name):
        return got[name]["value"], got[name]["met"]

    assert judged("intent TTFT speed-up, prefix vs no prefix") == (8.0, True)  # exactly the threshold
    assert judged("intent TTFT, prefix vs deep-copied HF prompt cache") == (1.0, False)  # a tie is no lead
    assert judged("max QPS under the SLO, prefix vs no prefix") == (None, False)
    assert "neither meets the SLO" in got["max QPS under the SLO, prefix vs no prefix"]["detail"]
    assert judged("decode TPOT, prefix / no prefix") == (pytest.approx(20 / 19, abs=1e-3), False)
    assert judged("no_shared slowdown with prefix support on: e2e p50 on / off") == (1.1, False)
    assert judged("no_shared slowdown with prefix support on: tok/s off / on") == (1.1, False)
    assert "c=4" in [t for t in report.evaluate_targets(records) if "tok/s off / on" in t["target"]][0]["target"]
    assert judged("closed-loop throughput c=16, engine_prefix / hf_generate_batch") == (2.0, True)

    records[3]["max_qps_under_slo"] = 4.0  # the prefix meets the SLO at 4 QPS, the full prompt never
    got = {t["target"].split(" (")[0]: t for t in report.evaluate_targets(records)}
    assert judged("max QPS under the SLO, prefix vs no prefix") == (None, True)
    records[4]["max_qps_under_slo"] = 1.0  # 4 QPS against 1: under the 5x asked
    got = {t["target"].split(" (")[0]: t for t in report.evaluate_targets(records)}
    assert judged("max QPS under the SLO, prefix vs no prefix") == (4.0, False)
    assert report.ratio(1.0, 0) is None and report.ratio(None, 2.0) is None and report.ratio(3.0, 2.0) == 1.5


def test_the_tables_order_the_modes_and_name_each_result(tmp_path):
    """The records table runs single, closed loop, open loop within a workload; the targets table
    says MET, MISSED or n/a; the markdown has one section per mode, the max-QPS column only in the
    open loop's, a missed target in bold."""
    from prefix_service.bench import report
    rec = _targets_rec
    records = [rec("engine_prefix", "intent", "open_loop", None, max_qps_under_slo=2.0,
                   points=[{"offered_qps": 2.0, "num_requests": 3, "num_failed": 0, "under_slo": True}]),
               rec("engine_prefix", "intent", "closed_loop", 16, output_tok_s=20.0),
               rec("engine_prefix", "intent", "closed_loop", 4, output_tok_s=40.0),
               rec("engine_prefix", "intent", "single", 1, output_tok_s=60.0)]
    lines = report.records_table(records).splitlines()[2:]
    assert [line.split()[2:4] for line in lines] == [["single", "1"], ["closed_loop", "4"], ["closed_loop", "16"],
                                                     ["open_loop", "-"]]
    targets = [{"target": "a", "value": 2.0, "threshold": "> 1", "met": True, "detail": ""},
               {"target": "b", "value": 0.5, "threshold": "> 1", "met": False, "detail": ""},
               {"target": "c", "value": None, "threshold": "> 1", "met": None, "detail": ""}]
    rows = {line.split()[0]: line.split()[-1] for line in report.targets_table(targets).splitlines()[2:]}
    assert rows == {"a": "MET", "b": "MISSED", "c": "n/a"}
    md = report.markdown({"records": records, "targets": targets})
    sections = {s.split("\n", 1)[0]: s for s in md.split("#### ")[1:]}
    assert list(sections) == ["single", "closed_loop", "open_loop", "open loop, every rate", "targets"]
    assert "max qps" in sections["open_loop"] and "max qps" not in sections["closed_loop"]
    assert sections["closed_loop"].index("| 4 |") < sections["closed_loop"].index("| 16 |")
    assert "| **missed** |" in sections["targets"] and "| met |" in sections["targets"]


def test_the_json_report_has_no_infinities_or_nans(tmp_path):
    """A figure that is not finite, at any depth, is written as null: the file stays strict JSON."""
    from prefix_service.bench import report
    path = tmp_path / "new" / "r.json"
    report.write_json(path, {"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": [{"e": float("-inf")}]}})

    def refuse(name):
        raise ValueError(name)
    assert json.loads(path.read_text(), parse_constant=refuse) == {"a": None, "b": [None, 1.5],
                                                                   "c": {"d": [{"e": None}]}}


def test_the_progress_estimate_counts_the_open_loops_first_rates():
    """expected_requests: the warm-up, then each open-loop system at the plan's first min_points
    rates, each rate at least open_min_requests (the runner adds the rates it goes on to)."""
    from prefix_service.bench.plan import FULL, with_overrides
    plan = with_overrides(FULL, workloads=("intent",), systems=("grpc_prefix", "engine_prefix"), modes=("open_loop",),
                          qps=(0.1, 1.0, 8.0), open_duration_s=10.0, open_min_requests=4, min_points=2)
    assert (plan.open_requests(0.1), plan.open_requests(1.0), plan.open_requests(8.0)) == (4, 10, 80)
    assert plan.expected_requests() == 2 * 1 + (4 + 10)  # two systems' warm-up, one of them in the open loop


def test_closed_loop_turns_of_unequal_size_send_every_request():
    """Requests that do not split evenly into the turns: the turns round up (4, 4, 2 of 10) and every
    request is sent once per system; fewer requests than turns is refused."""
    from prefix_service.bench.metrics import Timing
    from prefix_service.bench.plan import FULL, ClosedSpec, with_overrides
    from prefix_service.bench.runner import Runner
    from prefix_service.bench.systems import System, now

    sent: dict[str, list[int]] = {"a": [], "b": []}

    class Fake(System):
        def __init__(self, name):
            self.name = name

        def run(self, workload, req, timeout_s=None):
            sent[self.name].append(req.index)
            t = Timing(start=now())
            t.add_tokens(1, now())
            t.end = now()
            return t

    class Workload(Answers):
        name, labels, record_schema = "no_shared", (), None

        def request(self, index):
            return type("Req", (), {"index": index})()

    def runner(spec):
        plan = with_overrides(FULL, closed=(spec,), systems=("a", "b"), idle_wait_s=0.0)
        return Runner(plan, [Fake("a"), Fake("b")], {"no_shared": Workload()}, tick=lambda: None,
                      status=lambda s: None)

    run = runner(ClosedSpec("no_shared", (2,), ("a", "b"), min_rounds=5, turns=3))
    run.closed_loop()
    assert len(sent["a"]) == 10 and sorted(sent["a"]) == sorted(sent["b"]) == sorted(set(sent["a"]))
    assert {r["system"]: (r["num_requests"], r["turns"]) for r in run.records} == {"a": (10, 3), "b": (10, 3)}
    with pytest.raises(ValueError, match="a request per turn"):
        runner(ClosedSpec("no_shared", (1,), ("a", "b"), turns=4)).closed_loop()  # 2 requests in 4 turns


def test_an_open_loop_goes_on_while_p99_stays_within_the_stop_factor_of_the_first_rate():
    """Over the SLO, a system goes on to the next rate only while no request missed its deadline and
    its p99 is within open_stop_factor x the p99 at the first rate."""
    from prefix_service.bench.plan import FULL, with_overrides
    from prefix_service.bench.runner import Runner
    runner = Runner(with_overrides(FULL, open_stop_factor=2.5), [], {}, tick=lambda: None, status=lambda s: None)

    def point(p99, under=False):
        return {"e2e_p99_ms": p99, "under_slo": under}
    assert runner._keeps_up([point(100.0, True), point(10_000.0, True)])
    assert runner._keeps_up([point(100.0), point(250.0)])
    assert runner._keeps_up([point(100.0), point(200.0), point(250.0)])
    assert not runner._keeps_up([point(100.0), point(300.0)])
    assert not runner._keeps_up([point(100.0), point(200.0), point(300.0)])  # the first rate's, not the last's
    assert not runner._keeps_up([point(100.0), point(None)])


def test_warm_up_requests_are_not_the_timed_ones_and_the_batch_baseline_gets_the_engines_cache():
    """The warm-up draws negative request indices, never one a timed section sends; generate_batch
    gets as many token slots as our engine's KV cache holds (blocks x block size)."""
    from types import SimpleNamespace

    from prefix_service.bench.plan import FULL, with_overrides
    from prefix_service.bench.runner import Runner, _engine_capacity_tokens
    from prefix_service.bench.systems import System

    seen = []

    class Fake(System):
        name = "a"

        def run(self, workload, req, timeout_s=None):
            seen.append(req.index)

    class Workload(Answers):
        name, labels, record_schema = "intent", (), None

        def request(self, index):
            return type("Req", (), {"index": index})()

    Runner(with_overrides(FULL, warmup_requests=3), [Fake()], {"intent": Workload()}, tick=lambda: None,
           status=lambda s: None).prepare()
    assert len(seen) == 3 and len(set(seen)) == 3 and max(seen) < 0
    cfg = SimpleNamespace(cache=SimpleNamespace(block_size=4, num_blocks=None))
    assert _engine_capacity_tokens({"e": SimpleNamespace(kv_num_blocks=10), "h": Fake()}, cfg) == 40
    assert _engine_capacity_tokens({"h": Fake()}, cfg) == 2048 * 4


def test_an_open_loop_rate_counts_a_missed_deadline_as_an_infinite_latency():
    """A rate is under the SLO when p99 is below it (not at it); more than 1% of its requests missing
    their deadline leaves no p99 and is never under the SLO; arrivals come at least min_requests."""
    from prefix_service.bench.metrics import Timing
    from prefix_service.bench.modes import RunResult, open_loop_summary, poisson_arrivals

    def timed(ms, error=None):
        return Timing(start=0.0, first=ms / 2000, end=ms / 1000, output_tokens=2, error=error)
    at_slo = open_loop_summary(RunResult([timed(500.0)] * 10, 10.0, None), 1.0, slo_ms=500.0)
    assert (at_slo["e2e_p99_ms"], at_slo["under_slo"], at_slo["offered_qps"]) == (500.0, False, 1.0)
    assert open_loop_summary(RunResult([timed(500.0)] * 10, 10.0, None), 1.0, slo_ms=501.0)["under_slo"]
    missed = [timed(100.0)] * 98 + [timed(30_000.0, error="deadline")] * 2  # 2% missed
    point = open_loop_summary(RunResult(missed, 10.0, None), 1.0, slo_ms=500.0)
    assert (point["e2e_p99_ms"], point["under_slo"], point["num_failed"]) == (None, False, 2)
    arrivals = poisson_arrivals(0.1, 1.0, seed=0, min_requests=5)
    assert len(arrivals) >= 5 and arrivals == sorted(arrivals) and arrivals[0] > 0


def test_a_template_is_cut_at_a_line_end_within_the_budget():
    """cut_to_tokens keeps the most whole lines within max_tokens (a line that reaches it exactly
    stays), whole words and a newline when even the first line is longer, and refuses a budget
    too small for one word."""
    from prefix_service.bench.workloads import cut_to_tokens

    def words(text):
        return len(text.split())
    text = "a b\nc d\ne f\n"
    assert cut_to_tokens(text, None, words) == text and cut_to_tokens(text, 6, words) == text
    assert cut_to_tokens(text, 4, words) == "a b\nc d\n" and cut_to_tokens(text, 5, words) == "a b\nc d\n"
    assert cut_to_tokens("a b c d e\nf\n", 3, words) == "a b c\n"
    with pytest.raises(ValueError, match="too small"):
        cut_to_tokens(text, 0, words)


def test_workloads_build_prompts_of_the_asked_sizes(llama_dir):
    """intent: the whole template ending in one newline, or cut within max_prefix_tokens, and a user
    segment of exactly prompt_tokens ids; ratio_0_32: prefix : whole prompt at the ratio, the prefix
    within max_prefix_tokens; no_shared: no prefix and total_tokens ids; doc_qa: a question on the
    board. Each request's text, sent after the template, gives the template's ids and its own."""
    from dataclasses import replace

    from prefix_service.bench import corpus
    from prefix_service.bench.workloads import PROMPTS_DIR, Sizes, build_workload
    from prefix_service.model.loader import load_tokenizer
    tok = load_tokenizer(llama_dir)

    def count(text):
        return len(tok.encode(text, add_special_tokens=False))
    sizes = Sizes(prompt_tokens=30, total_tokens=200, output_tokens=4)
    intent = build_workload("intent", tok, sizes)
    assert intent.prefix_text == (PROMPTS_DIR / "intent_classifier.txt").read_text().rstrip() + "\n"
    for i in range(3):
        req = intent.request(i)
        assert len(req.prompt_ids) == 30 and req.prompt_text.endswith('"\nIntent:')
        assert tok.encode(intent.full_text(req), add_special_tokens=True) == intent.full_ids(req)
    assert intent.describe(sample=3)["prompt_tokens_min"] == intent.describe(sample=3)["prompt_tokens_max"] == 30
    cut = build_workload("intent", tok, replace(sizes, max_prefix_tokens=60))
    assert count(cut.prefix_text) <= 60 and intent.prefix_text.startswith(cut.prefix_text.rstrip("\n"))

    ratio = build_workload("ratio_0_32", tok, sizes)
    prefix, prompt = len(ratio.prefix_ids), len(ratio.request(0).prompt_ids)
    assert prefix <= round(0.32 * 200) and prefix / (prefix + prompt) == pytest.approx(0.32, abs=0.01)
    capped = build_workload("ratio_0_32", tok, replace(sizes, max_prefix_tokens=40))
    assert 0 < count(capped.prefix_text) <= 40

    alone = build_workload("no_shared", tok, sizes)
    assert (alone.prefix_name, alone.prefix_ids) == (None, ()) and len(alone.request(0).prompt_ids) == 200
    board = (PROMPTS_DIR / "lisbon_departures.md").read_text()
    qa = build_workload("doc_qa", tok, sizes)
    question = qa.request(0).prompt_text
    assert qa.prefix_text == board.rstrip() + "\n" and question.startswith("\nQ: ") and question.endswith("\nA:")
    assert any(dest in question for dest in corpus.destinations(board))
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("chat", tok, sizes)


def test_questions_cover_every_form_and_destination_of_the_board():
    """The board's destination column without its heading, each once; the first forms x destinations
    questions are all different; a customer-sentence stream depends on its seed alone."""
    import itertools

    from prefix_service.bench import corpus
    board = ("# Board\n\n| Flight | Airline | Destination | Gate |\n|---|---|---|---|\n| A1 | X | Rome | 1 |\n"
             "| A2 | Y | Porto | 2 |\n| A3 | Z | Rome | 3 |\n| A4 | W | Oslo | 4 |\n| A5 | V | Nice | 5 |\n")
    dests = corpus.destinations(board)
    assert dests == ("Rome", "Porto", "Oslo", "Nice")
    assert corpus.destinations("no table here") == corpus.FALLBACK_DESTINATIONS
    n = len(corpus.QUESTION_FORMS) * len(dests)
    assert len({corpus.question(i, dests) for i in range(n)}) == n
    assert all(any(d in corpus.question(i, dests) for i in range(n)) for d in dests)
    def stream(seed):
        return list(itertools.islice(corpus.sentences(seed), 50))
    first = stream("x")
    assert first == stream("x") != stream("y")
    assert sorted(first[:len(corpus.CUSTOMER_SENTENCES)]) == sorted(corpus.CUSTOMER_SENTENCES)


def test_an_open_loop_p99_that_reaches_a_missed_request_is_no_figure():
    """One missed deadline in 100 or 60 requests: the p99 rank falls between the slowest finished
    request and the missed one, so the rate has no p99 (not a figure interpolated towards the stand-in
    latency of a missed request) and is not under the SLO; in 101 requests the rank lands on a finished
    one and that is the p99."""
    from prefix_service.bench.metrics import Timing
    from prefix_service.bench.modes import RunResult, open_loop_summary

    def rate(finished, missed=1):
        timings = [Timing(start=0.0, first=0.05, end=0.1, output_tokens=2) for _ in range(finished)]
        timings += [Timing(start=0.0, first=0.05, output_tokens=1, error="deadline") for _ in range(missed)]
        return open_loop_summary(RunResult(timings, 10.0, None), 4.0, slo_ms=2000.0)
    for finished in (99, 59):
        point = rate(finished)
        assert (point["e2e_p99_ms"], point["under_slo"]) == (None, False), finished
    point = rate(100)
    assert (point["e2e_p99_ms"], point["under_slo"], point["num_failed"]) == (100.0, True, 1)


def test_each_open_loop_panel_draws_its_missed_rates_at_its_own_top(tmp_path, monkeypatch):
    """The open-loop plot, one panel per workload: a rate with no p99 is an x at the top of its own
    panel (above its own highest p99 and the SLO's 1.5x), not at another workload's, and each panel's
    ticks are its own rates."""
    import matplotlib.axes
    from prefix_service.bench import report
    drawn = []
    plot, set_xticks = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_xticks
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *a, **k: drawn.append((id(ax), "plot", list(a[0]), list(a[1]), k.get("marker")))
                        or plot(ax, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks",
                        lambda ax, ticks, *a, **k: drawn.append((id(ax), "ticks", list(ticks), None, None))
                        or set_xticks(ax, ticks, *a, **k))

    def record(workload, points):
        return {"mode": "open_loop", "workload": workload, "system": "grpc_prefix",
                "points": [{"offered_qps": q, "e2e_p99_ms": p99} for q, p99 in points]}
    records = [record("intent", [(1.0, 500.0), (2.0, 2500.0), (4.0, None)]),
               record("doc_qa", [(0.5, 40_000.0), (1.5, None)])]
    assert report.plot_open_loop(tmp_path / "open.png", records, 2000.0, "title")
    assert (tmp_path / "open.png").stat().st_size > 0
    panels = list(dict.fromkeys(a for a, *_ in drawn))
    assert len(panels) == 2  # doc_qa, then intent (sorted)
    misses = {a: (xs, ys) for a, kind, xs, ys, marker in drawn if kind == "plot" and marker == "x"}
    ticks = {a: xs for a, kind, xs, *_ in drawn if kind == "ticks"}
    doc_qa, intent = panels
    assert misses[doc_qa] == ([1.5], [pytest.approx(40_000.0 * 1.1)])
    assert misses[intent] == ([4.0], [pytest.approx(3000.0 * 1.1)])  # the SLO's 1.5x is above 2,500
    assert ticks == {doc_qa: [0.5, 1.5], intent: [1.0, 2.0, 4.0]}


def test_the_labels_concurrency_plot_draws_requests_and_end_to_end_times(tmp_path, monkeypatch):
    """plot_concurrency on intent_labels draws requests/s and e2e p50 against the clients (a label is a
    few tokens: tokens/s and the first token say little), on intent tokens/s and TTFT; each from its
    own workload's records only."""
    import matplotlib.axes
    from prefix_service.bench import report
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, *a, **k: drawn.append((list(a[0]), list(a[1]))) or plot(ax, *a, **k))

    def rec(workload, c, **fields):
        return {"system": "grpc_prefix", "workload": workload, "mode": "closed_loop", "concurrency": c, **fields}
    labels = dict(answers_not_labels=0, label_counts={"billing": 1})
    records = [rec("intent_labels", 16, req_s=12.0, e2e_p50_ms=1300.0, output_tok_s=40.0, ttft_p50_ms=1290.0,
                   **labels),
               rec("intent_labels", 1, req_s=11.0, e2e_p50_ms=90.0, output_tok_s=30.0, ttft_p50_ms=89.0, **labels),
               rec("intent", 1, req_s=0.5, e2e_p50_ms=900.0, output_tok_s=33.0, ttft_p50_ms=88.0),
               rec("intent", 4, req_s=1.0, e2e_p50_ms=1500.0, output_tok_s=90.0, ttft_p50_ms=200.0)]
    assert report.plot_concurrency(tmp_path / "labels.png", records, "t", workload="intent_labels")
    assert drawn == [([1, 16], [11.0, 12.0]), ([1, 16], [90.0, 1300.0])]
    drawn.clear()
    assert report.plot_concurrency(tmp_path / "intent.png", records, "t")
    assert drawn == [([1, 4], [33.0, 90.0]), ([1, 4], [88.0, 200.0])]
