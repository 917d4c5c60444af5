"""The Prometheus endpoint (scraped over loopback) and the one log line per request: counts by
template and status code, latency histograms, engine gauges read at scrape time."""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_fixtures import (DOCUMENT, SYSTEM_PROMPT, Clients, ServerThread, collect, greedy_request, make_config,
                             slow_steps, started_servers)

from prefix_service import cpuinfo
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb


TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=TEMPLATES) as factory:
        yield factory


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the endpoint's text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def fails(stream) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        collect(stream)
    return info.value.code()


def test_endpoint_is_off_unless_configured(make_server):
    assert make_server().server.metrics_port is None


def test_scrape_counts_requests_latencies_and_engine_state(make_server, caplog):
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(metrics_address="127.0.0.1:0")
    c = Clients(st.address)
    for _ in range(3):
        collect(c.generation.Generate(greedy_request(" the order", "doc", max_tokens=5)))
    collect(c.generation.Generate(greedy_request(" the order", "", max_tokens=1)))
    assert fails(c.generation.Generate(greedy_request(" hi", "no-such-template"))) == grpc.StatusCode.NOT_FOUND
    assert fails(c.generation.Generate(greedy_request(" hi", "doc", temperature=-1.0))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    undo = slow_steps(st.engine, 0.01)
    try:
        call = c.generation.Generate(greedy_request(" the", "sys", max_tokens=400))
        next(call)
        call.cancel()
        assert fails(c.generation.Generate(greedy_request(" the", "sys", max_tokens=400), timeout=0.3)) == \
            grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        undo()
    st.check_clean()

    m = scrape(st.server.metrics_port)
    req = "prefix_service_requests_total"
    assert value(m, req, protocol="grpc", template="doc", code="OK") == 3
    assert value(m, req, protocol="grpc", template="_none", code="OK") == 1
    assert value(m, req, protocol="grpc", template="_unknown", code="NOT_FOUND") == 1  # a client's name is never a label
    assert value(m, req, protocol="grpc", template="doc", code="INVALID_ARGUMENT") == 1
    assert value(m, req, protocol="grpc", template="sys", code="CANCELLED") == 1
    assert value(m, req, protocol="grpc", template="sys", code="DEADLINE_EXCEEDED") == 1
    assert not any(dict(k[1]).get("template") == "no-such-template" for k in m)

    # latency histograms: e2e and TPOT for finished requests, TTFT for every first token
    assert value(m, "prefix_service_e2e_latency_seconds_count", template="doc") == 3
    assert value(m, "prefix_service_tpot_seconds_count", template="doc") == 3
    assert value(m, "prefix_service_tpot_seconds_count", template="_none") == 0  # one token: no TPOT
    assert value(m, "prefix_service_ttft_seconds_count", template="doc") == 3
    assert value(m, "prefix_service_ttft_seconds_count", template="sys") >= 1  # the cancelled one had a token
    assert value(m, "prefix_service_e2e_latency_seconds_count", template="sys") == 0
    assert 0 < value(m, "prefix_service_ttft_seconds_sum", template="doc") < \
        value(m, "prefix_service_e2e_latency_seconds_sum", template="doc")
    assert value(m, "prefix_service_e2e_latency_seconds_bucket", template="doc", le="+Inf") == 3

    doc_tokens = st.engine.get_template("doc").num_tokens
    assert value(m, "prefix_service_cached_tokens_total", template="doc") == 3 * doc_tokens
    assert value(m, "prefix_service_completion_tokens_total", template="doc") == 15

    stats = st.engine.kv_stats()
    # what the scrape read in one command: the same as the three reads one by one, on the idle engine
    status = st.engine.status()
    assert (status.kv_stats, status.templates, status.infos) == \
        (stats, st.engine.list_templates(), st.engine.engine_infos())
    assert value(m, "prefix_service_ready") == 1
    assert value(m, "prefix_service_kv_blocks_total") == stats["num_blocks"] == 256
    assert value(m, "prefix_service_kv_blocks_used") == value(m, "prefix_service_kv_blocks_pinned") == \
        stats["pinned"] > 0
    assert value(m, "prefix_service_kv_blocks_free") == stats["free"] == 256 - stats["pinned"]
    assert value(m, "prefix_service_queue_length") == 0
    assert value(m, "prefix_service_packed_template_bytes") == stats["packed_template_bytes"] > 0  # CPU, float32
    assert value(m, "prefix_service_running_requests") == 0
    assert value(m, "prefix_service_preemptions_total") == stats["preemptions"]
    assert value(m, "prefix_service_failed_steps_total") == stats["failed_steps"] == 0
    assert value(m, "prefix_service_draft_tokens_total") == stats["draft_tokens"] == 0  # speculation off
    assert value(m, "prefix_service_accepted_draft_tokens_total") == stats["accepted_draft_tokens"] == 0
    assert value(m, "prefix_service_templates") == 2
    assert value(m, "prefix_service_template_tokens", template="doc") == doc_tokens
    assert value(m, "prefix_service_template_from_snapshot", template="doc") == 0  # a first start: prefilled
    # requests accepted on the template: the bad-sampling one was refused before
    assert value(m, "prefix_service_template_requests_served_total", template="doc") == 3

    # what the engine computes with, one series of labels
    info = st.engine.info
    [(labels, one)] = [(dict(k[1]), v) for k, v in m.items() if k[0] == "prefix_service_engine_info"]
    assert one == 1 and labels == {
        "replica": "", "model": Path(info.model_path).name, "device": "cpu", "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype, "block_size": str(info.block_size), "backend": info.backend,
        "quantization": "none", "batch_invariant": "false", "cpu_isa": ",".join(cpuinfo.isa()),
        "cpu_march": cpuinfo.target() or ""}
    cache_dtype = str(st.engine._core.backend.kv_layers[0][0].dtype).removeprefix("torch.")
    assert info.kv_cache_dtype == info.dtype == cache_dtype

    # one JSON log line per request, without the prompt
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert len(lines) == 8
    ok = [line for line in lines if line["code"] == "OK" and line["template"] == "doc"]
    assert len(ok) == 3
    for line in ok:
        assert line["request_id"] and line["finish_reason"] == "length" and line["protocol"] == "grpc"
        assert "http_status" not in line
        assert (line["prompt_tokens"], line["cached_tokens"], line["completion_tokens"]) == \
            (doc_tokens + 2, doc_tokens, 5)
        assert 0 < line["ttft_ms"] <= line["latency_ms"]
    codes = sorted(line["code"] for line in lines)
    assert codes == sorted(["OK"] * 4 + ["NOT_FOUND", "INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED"])
    assert "the order" not in caplog.text


def test_engine_gauges_while_requests_wait(make_server):
    st = make_server(metrics_address="127.0.0.1:0", max_num_seqs=1)
    c = Clients(st.address)
    # whichever request lands first runs, for 300 steps of at least 50 ms (15 s: the other two are
    # surely queued before it ends, also on a slow machine); the other two wait
    undo = slow_steps(st.engine, 0.05)
    try:
        calls = [c.generation.Generate(greedy_request(" the", "doc", max_tokens=300)) for _ in range(3)]
        # until one runs and two wait: two may be queued before the engine's next step schedules the first
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            stats = st.engine.kv_stats()
            if stats["running"] == 1 and stats["waiting"] == 2:
                break
            time.sleep(0.01)
        stats = st.engine.kv_stats()
        assert (stats["running"], stats["waiting"]) == (1, 2), \
            f"the two later requests did not queue behind the first: {stats}"
        m = scrape(st.server.metrics_port)
        assert value(m, "prefix_service_queue_length") == 2
        assert value(m, "prefix_service_running_requests") == 1
        assert value(m, "prefix_service_kv_blocks_used") > value(m, "prefix_service_kv_blocks_pinned")
        assert value(m, "prefix_service_template_active_requests", template="doc") == 3
        for call in calls:
            call.cancel()
    finally:
        undo()


def test_metrics_before_ready_and_after_stop(model_dir):
    seen = {}

    def hook(src) -> None:  # during warmup the endpoint answers, with ready 0
        seen.setdefault("warmup", scrape(st.server.metrics_port))

    st = ServerThread(make_config(model_dir, prefixes=TEMPLATES, metrics_address="127.0.0.1:0"), warmup_hook=hook)
    try:
        st.start()
        assert value(seen["warmup"], "prefix_service_ready") == 0
        port = st.server.metrics_port
        assert value(scrape(port), "prefix_service_ready") == 1
        st.check_clean()
    finally:
        st.stop()
    with pytest.raises(OSError):
        scrape(port)


def test_chat_requests_count_on_their_template(make_server):
    st = make_server(metrics_address="127.0.0.1:0")
    c = Clients(st.address)
    req = pb.GenerateRequest(prefix_name="sys", messages=[pb.ChatMessage(role="user", content="refund")],
                             sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    last = collect(c.generation.Generate(req))[2]
    m = scrape(st.server.metrics_port)
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="sys", code="OK") == 1
    assert value(m, "prefix_service_cached_tokens_total", template="sys") == last.usage.prefix_tokens > 0


def test_series_of_another_process_are_summed_into_the_endpoints():
    """ServiceMetrics.add_source (the fleet's HTTP ingress into the gRPC front end's endpoint): one
    family per name, a sample per name and labels, values summed; a failing source is left out."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.server.metrics import ServiceMetrics
    runtime = SimpleNamespace(registry=None, engine=None, ready=True)
    front, ingress = ServiceMetrics(runtime), ServiceMetrics(runtime, requests_only=True)
    front.requests.labels("grpc", "doc", "OK").inc(2)
    front.ttft.labels("doc").observe(0.02)
    ingress.requests.labels("http", "doc", "OK").inc(3)
    ingress.requests.labels("grpc", "doc", "OK").inc(1)  # the same series in both: summed
    ingress.ttft.labels("doc").observe(0.3)
    assert "process_cpu_seconds_total" not in ingress.text() and "prefix_service_ready" not in ingress.text()

    def broken() -> str:
        raise TimeoutError("the ingress did not answer")

    front.add_source(ingress.text)
    front.add_source(broken)
    families = list(text_string_to_metric_families(generate_latest(front).decode()))
    assert len({f.name for f in families}) == len(families)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert got["prefix_service_requests_total", (("code", "OK"), ("protocol", "grpc"), ("template", "doc"))] == 3
    assert got["prefix_service_requests_total", (("code", "OK"), ("protocol", "http"), ("template", "doc"))] == 3
    assert got["prefix_service_ttft_seconds_count", (("template", "doc"),)] == 2
    assert got["prefix_service_ttft_seconds_bucket", (("le", "0.025"), ("template", "doc"))] == 1
    assert got["prefix_service_ttft_seconds_bucket", (("le", "0.5"), ("template", "doc"))] == 2
    assert got["prefix_service_ready", ()] == 1  # the front end's own series are there


def test_garbage_collector_pauses_are_exported_by_generation():
    """prefix_service_gc_pause_seconds and _max_seconds: each collection's time, added by generation."""
    import gc
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.server.metrics import ServiceMetrics

    def samples() -> dict[tuple[str, tuple], float]:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    metrics = ServiceMetrics(SimpleNamespace(registry=None, engine=None, ready=True))
    before = samples()
    gc.collect()
    gc.collect()
    after = samples()
    full = (("generation", "2"),)
    assert after["prefix_service_gc_pause_seconds_total", full] > before["prefix_service_gc_pause_seconds_total", full]
    assert 0 < after["prefix_service_gc_pause_max_seconds", full] <= (
        after["prefix_service_gc_pause_seconds_total", full])
    assert {labels for name, labels in after if name == "prefix_service_gc_pause_seconds_total"} == {
        (("generation", str(g)),) for g in range(3)}
    ingress = ServiceMetrics(SimpleNamespace(registry=None, engine=None, ready=True), requests_only=True)
    assert "prefix_service_gc_pause" not in ingress.text()  # the process's, reported by the front end


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it(monkeypatch):
    """TPOT of a finished request: (end - first token) / (completion_tokens - 1), on a clock the test sets."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.engine.sequence import FinishReason, RequestOutput
    from prefix_service.server import metrics as metrics_module
    from prefix_service.server.metrics import RequestTrace, ServiceMetrics

    now = [100.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    metrics = ServiceMetrics(SimpleNamespace(registry=None, engine=None, ready=True), requests_only=True)
    trace = RequestTrace(metrics, "grpc", "doc", "doc", start=100.0)
    now[0] = 100.5
    trace.output(RequestOutput("r", "a", [7]))
    now[0] = 102.5
    trace.output(RequestOutput("r", "bcde", [8, 9, 10, 11], finished=True, finish_reason=FinishReason.LENGTH,
                               prompt_tokens=3, completion_tokens=5))
    trace.code = grpc.StatusCode.OK
    trace.end()
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in fam.samples}
    assert value(m, "prefix_service_tpot_seconds_count", template="doc") == 1
    assert value(m, "prefix_service_tpot_seconds_sum", template="doc") == pytest.approx((102.5 - 100.5) / (5 - 1))
    assert value(m, "prefix_service_ttft_seconds_sum", template="doc") == pytest.approx(0.5)
    assert value(m, "prefix_service_e2e_latency_seconds_sum", template="doc") == pytest.approx(2.5)


def test_template_from_snapshot_counts_kv_from_a_snapshot_or_a_peer():
    """prefix_service_template_from_snapshot: 1 for a template whose K/V was loaded, from a snapshot
    file or another replica's copy ("peer"), 0 for one prefilled; read from the engine's status."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.engine.api import EngineStatus
    from prefix_service.engine.template_pins import TemplateInfo
    from prefix_service.server.metrics import ServiceMetrics

    stats = {"num_blocks": 64, "used": 6, "free": 58, "pinned": 6, "packed_template_bytes": 0,
             "waiting_requests": 0, "running": 0, "preemptions": 0}
    templates = [TemplateInfo(name, 8, 2, 0, 0, {}, kv_source=name)
                 for name in ("prefill", "snapshot", "peer")]
    engine = SimpleNamespace(status=lambda: EngineStatus(stats, templates, {}))
    metrics = ServiceMetrics(SimpleNamespace(registry=None, engine=engine, ready=True))
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in fam.samples}
    assert value(m, "prefix_service_templates") == 3
    assert {name: value(m, "prefix_service_template_from_snapshot", template=name)
            for name in ("prefill", "snapshot", "peer")} == {"prefill": 0, "snapshot": 1, "peer": 1}


def test_a_fleet_with_no_replica_reporting_still_answers_a_scrape():
    """Every replica of a fleet gone (the summed KV counters empty until a replacement reports): the
    scrape answers without the KV gauges, the request series still there (it was a 500, KeyError)."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.engine.api import EngineStatus
    from prefix_service.server.metrics import ServiceMetrics

    engine = SimpleNamespace(status=lambda: EngineStatus({}, [], {}))
    metrics = ServiceMetrics(SimpleNamespace(registry=None, engine=engine, ready=True))
    text = generate_latest(metrics.registry).decode()
    names = {fam.name for fam in text_string_to_metric_families(text)}
    assert "prefix_service_requests" in names and "prefix_service_ready" in names
    assert not any(n.startswith("prefix_service_kv_blocks") for n in names)


def test_the_prompt_tokens_counter_counts_the_template_too(make_server):
    """prefix_service_prompt_tokens counts a finished request's whole prompt, template included (as
    its usage.prompt_tokens), beside the cached tokens."""
    st = make_server(metrics_address="127.0.0.1:0")
    c = Clients(st.address)
    try:
        before = scrape(st.server.metrics_port)
        last = collect(c.generation.Generate(greedy_request(" the order", "doc", max_tokens=2)))[2]
        after = scrape(st.server.metrics_port)
    finally:
        c.close()
    key = ("prefix_service_prompt_tokens_total", (("template", "doc"),))
    assert last.usage.prompt_tokens > last.usage.prefix_tokens > 0
    assert after[key] - before.get(key, 0) == last.usage.prompt_tokens


def test_a_call_cancelled_while_the_server_cuts_off_counts_unavailable():
    """A call that ends CANCELLED while the server cuts its calls off (the grace period over) was the
    server's doing: it counts UNAVAILABLE; before the cut it counts CANCELLED (the client's doing)."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from prefix_service.server.metrics import RequestTrace, ServiceMetrics

    metrics = ServiceMetrics(SimpleNamespace(registry=None, engine=None, ready=True), requests_only=True)
    RequestTrace(metrics, "http", "", "_none").end()
    metrics.cutting_off = True
    RequestTrace(metrics, "http", "", "_none").end()
    text = generate_latest(metrics.registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def count(code: str) -> float:
        return samples[("prefix_service_requests_total", (("code", code), ("protocol", "http"), ("template", "_none")))]

    assert (count("CANCELLED"), count("UNAVAILABLE")) == (1, 1)


def test_the_queue_length_counts_requests_not_the_samples_they_forked(make_server):
    """A request for n = 6 samples with two running and four waiting is no request in the queue."""
    st = make_server(metrics_address="127.0.0.1:0", max_num_seqs=2)
    undo = slow_steps(st.engine, 0.02)
    c = Clients(st.address)
    try:
        call = c.generation.Generate(greedy_request(" the", "doc", max_tokens=100, n=6))
        next(call)
        stats = st.engine.kv_stats()
        assert stats["waiting"] > 0 and stats["waiting_requests"] == 0
        assert scrape(st.server.metrics_port)[("prefix_service_queue_length", ())] == 0
        call.cancel()
    finally:
        undo()
        c.close()


def test_the_ready_gauge_says_not_ready_as_the_drain_begins(make_server):
    """A stop turns prefix_service_ready to 0 at once, with gRPC health (and HTTP /health, which reads
    the same state), while the calls in flight still run to their end."""
    st = make_server(metrics_address="127.0.0.1:0", grace_period_s=30)
    undo = slow_steps(st.engine, 0.01)
    c = Clients(st.address)
    try:
        call = c.generation.Generate(greedy_request(" the", "doc", max_tokens=300))
        next(call)
        assert value(scrape(st.server.metrics_port), "prefix_service_ready") == 1
        st.stop(grace=None, wait=False)
        deadline = time.monotonic() + 1.0  # the call runs 3 s or more
        while value(scrape(st.server.metrics_port), "prefix_service_ready") != 0:
            assert time.monotonic() < deadline, "still ready after the stop began"
            time.sleep(0.01)
        assert collect(call)[2].usage.completion_tokens == 300  # the drain lets it finish
    finally:
        undo()
        c.close()


def _samples(metrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a ServiceMetrics' own registry, read without an endpoint."""
    from prometheus_client import generate_latest
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _bare_metrics(known=()):
    """Per-request series only, over a registry that knows the template names in `known`."""
    from types import SimpleNamespace

    from prefix_service.server.metrics import ServiceMetrics
    registry = SimpleNamespace(known=lambda name: name in known)
    return ServiceMetrics(SimpleNamespace(registry=registry, engine=None, ready=True), requests_only=True)


def test_a_request_counts_once_and_its_usage_only_when_it_ended_ok():
    """end() counts a request once however often it is called; a request whose last output is
    finished but whose call failed (its status not OK) counts no latency and no tokens."""
    from prefix_service.engine.sequence import FinishReason, RequestOutput

    metrics = _bare_metrics(known=("doc",))
    finished = RequestOutput("r", "ab", [7, 8], finished=True, finish_reason=FinishReason.ABORT, prompt_tokens=9,
                             cached_tokens=6, completion_tokens=2)
    trace = metrics.trace("doc", "grpc")
    trace.output(finished)
    trace.code = grpc.StatusCode.INTERNAL
    trace.end()
    trace.end()
    m = _samples(metrics)
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="doc", code="INTERNAL") == 1
    assert value(m, "prefix_service_ttft_seconds_count", template="doc") == 1  # it had a first token
    for name in ("e2e_latency_seconds_count", "tpot_seconds_count", "prompt_tokens_total", "cached_tokens_total",
                 "completion_tokens_total"):
        assert value(m, f"prefix_service_{name}", template="doc") == 0, name


def test_a_template_unknown_when_the_call_came_counts_under_its_name_if_known_at_the_end():
    """A fleet's routes may not know a new template when its first request arrives: the label is
    asked again at the end, so the request counts on the template, not on _unknown."""
    known: set[str] = set()
    metrics = _bare_metrics(known=known)
    trace = metrics.trace("fresh", "grpc")
    assert trace.label == "_unknown"
    known.add("fresh")
    trace.code = grpc.StatusCode.OK
    trace.end()
    never = metrics.trace("never", "grpc")
    never.code = grpc.StatusCode.NOT_FOUND
    never.end()
    m = _samples(metrics)
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="fresh", code="OK") == 1
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="_unknown", code="OK") == 0
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="_unknown", code="NOT_FOUND") == 1


def test_a_score_request_counts_its_prompt_and_cached_tokens():
    """A Score request's answer counts as a finished request: its prompt and cached tokens, no
    completion tokens, and an end-to-end latency."""
    from prefix_service.engine.sequence import ScoreOutput

    metrics = _bare_metrics(known=("doc",))
    trace = metrics.trace("doc", "grpc")
    trace.scored(ScoreOutput("s", [], prompt_tokens=14, cached_tokens=10))
    trace.code = grpc.StatusCode.OK
    trace.end()
    m = _samples(metrics)
    assert value(m, "prefix_service_prompt_tokens_total", template="doc") == 14
    assert value(m, "prefix_service_cached_tokens_total", template="doc") == 10
    assert value(m, "prefix_service_completion_tokens_total", template="doc") == 0
    assert value(m, "prefix_service_e2e_latency_seconds_count", template="doc") == 1


def test_ttft_runs_to_the_first_output_with_a_token(monkeypatch):
    """An output without tokens (text held back, or nothing printable yet) is no first token."""
    from types import SimpleNamespace

    from prefix_service.engine.sequence import FinishReason, RequestOutput
    from prefix_service.server import metrics as metrics_module
    from prefix_service.server.metrics import RequestTrace

    now = [10.0]
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    metrics = _bare_metrics(known=("doc",))
    trace = RequestTrace(metrics, "grpc", "doc", "doc", start=10.0)
    now[0] = 10.25
    trace.output(RequestOutput("r", "", []))
    now[0] = 11.0
    trace.output(RequestOutput("r", "a", [7], finished=True, finish_reason=FinishReason.LENGTH, prompt_tokens=3,
                               completion_tokens=1))
    trace.code = grpc.StatusCode.OK
    trace.end()
    assert value(_samples(metrics), "prefix_service_ttft_seconds_sum", template="doc") == pytest.approx(1.0)


def test_a_request_without_a_template_logs_template_null(caplog):
    """The log line of a request that names no template has "template": null (its label is _none)."""
    metrics = _bare_metrics()
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    trace = metrics.trace("", "http")
    trace.code = grpc.StatusCode.OK
    trace.end()
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert line["template"] is None and line["code"] == "OK"
    assert value(_samples(metrics), "prefix_service_requests_total", protocol="http", template="_none", code="OK") == 1


def test_merged_created_samples_keep_the_earliest_time():
    """merge_families: values of one name and labels are summed, but a _created sample (when the
    series began) keeps the earliest of the processes' times."""
    from prometheus_client.core import CounterMetricFamily

    from prefix_service.server.metrics import merge_families

    def family(value, created):
        fam = CounterMetricFamily("prefix_service_requests", "Requests", labels=["code"])
        fam.add_metric(["OK"], value, created=created)
        return fam

    [merged] = merge_families([family(2, 200.0), family(3, 100.0), family(1, 300.0)])
    got = {s.name: s.value for s in merged.samples}
    assert got == {"prefix_service_requests_total": 6, "prefix_service_requests_created": 100.0}


def test_the_engine_info_labels_name_the_model_folder_and_batch_invariance():
    """prefix_service_engine_info: the model is its folder's name (a path given with a trailing slash
    too), batch_invariant "true" for a batch-invariant engine; one series per replica."""
    from prefix_service.engine.api import EngineInfo
    from prefix_service.server.metrics import engine_info

    def info(path, invariant):
        return EngineInfo(path, "cpu", "bfloat16", None, 512, 64, 16, "cpu", "cpu", kv_cache_dtype="bfloat16",
                          batch_invariant=invariant)

    family = engine_info({"r1": info("/models/llama-1b/", True), "r0": info("/models/qwen", False)})
    labels = [s.labels for s in family.samples]
    assert [(x["replica"], x["model"], x["batch_invariant"]) for x in labels] == [
        ("r0", "qwen", "false"), ("r1", "llama-1b", "true")]


def test_a_long_template_name_is_cut_in_the_log_line(caplog):
    """Whatever a client sends as a template name, its log line holds at most the first 128 characters
    of it (the longest a template's name may be), and it counts under _unknown."""
    metrics = _bare_metrics(known=("doc",))
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    trace = metrics.trace("x" * 5000, "grpc")
    trace.code = grpc.StatusCode.NOT_FOUND
    trace.end()
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert line["template"] == "x" * 128
    m = _samples(metrics)
    assert value(m, "prefix_service_requests_total", protocol="grpc", template="_unknown", code="NOT_FOUND") == 1
