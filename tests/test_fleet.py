"""The fleet on a local Ray cluster (tiny random model, 2 replicas, template_replication 1, four
templates, a snapshot folder the replicas share): greedy outputs equal one process's, requests
land only on their template's holder, admin add/remove reach the holders (and the shared
snapshots), HTTP through Ray Serve's proxy, chat on a system-prompt template, a cancelled stream
and a request on stale routes, a request waiting for a holder holds up no other call, the front
end's shutdown cuts its streams off, a replica killed mid-stream fails only its own streams and
comes back holding its templates (from the shared snapshots), and one failing its health check is
replaced.

One fleet serves the whole module (starting one takes ~20 s; under pytest-xdist each worker that
runs some of its tests starts its own); the tests run in file order and read counters as
differences. Deselect with -m "not ray"."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")
pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")

from prefix_service import Engine, cpuinfo  # noqa: E402
from prefix_service.config import TemplateSpec, RayConfig  # noqa: E402
from prefix_service.engine.sequence import GenerateRequest, ScoreRequest  # noqa: E402
from prefix_service.fleet.launcher import REPLICA_DEPLOYMENT  # noqa: E402
from prefix_service.fleet.placement import holders  # noqa: E402
from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.sampling_params import SamplingParams  # noqa: E402
from prefix_service.server.chat import render_ids  # noqa: E402
from server_fixtures import (DOCUMENT, TOKEN_ENV, collect, fresh_reports, greedy_request, make_config,  # noqa: E402
                             running_fleet, wait_until)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]

TEMPLATES = {f"t{i}": f"{DOCUMENT} and note {i} of the table" for i in range(4)}
PROMPTS = ["the order", "a row for each price", "shipping value"]
MAX_TOKENS = 8
HEAD_SETTINGS = {"PREFIX_SERVICE_F32_NATIVE_ROWS": "128"}  # a kernel setting (its default value) in the head's env


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    os.environ.pop(TOKEN_ENV, None)  # admin open on loopback
    state = tmp_path_factory.mktemp("fleet") / "state.json"
    config = make_config(model_dir, prefixes=tuple(TemplateSpec(name=n, content=c) for n, c in TEMPLATES.items()),
                         state_file=state, num_blocks=1024, http_address="127.0.0.1:0",
                         metrics_address="127.0.0.1:0")
    config = dataclasses.replace(config, ray=RayConfig(num_replicas=2, template_replication=1,
                                                       num_cpus_per_replica=1, app_name="prefix-service-test"))
    # a snapshot folder the replicas share (as on a cluster's shared storage)
    shared = dataclasses.replace(config.engine.cache, snapshot_dir=str(state.parent / "snapshots"))
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, cache=shared))
    with running_fleet(config, env=HEAD_SETTINGS) as (server, clients):
        yield server, clients


def snapshots(server) -> set[str]:
    """The templates with a snapshot in the replicas' shared folder."""
    folder = Path(server.config.engine.cache.snapshot_dir)
    return {p.name.removesuffix(".kv.safetensors") for p in folder.glob("*.kv.safetensors")}


@pytest.fixture(scope="module")
def reference(model_dir):
    """One process's engine on the same model, templates and cache shape."""
    config = make_config(model_dir, num_blocks=1024)
    engine = Engine(config)
    for name, text in TEMPLATES.items():
        engine.add_template(name, text)
    yield engine
    engine.shutdown()


def expected_ids(engine: Engine, prefix: str, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(GenerateRequest(prompt=prompt, prefix_name=prefix, sampling=sampling))[0].token_ids


def listing(clients) -> dict[str, pb.PrefixTemplate]:
    return {t.name: t for t in clients.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}


def reports(server) -> dict[str, dict]:
    return server.engine.replica_reports()


def taken(server) -> dict[str, dict[str, int]]:
    """replica -> requests it took, by template (its own counter, as of its last poll)."""
    return {r: dict(rep["stats"]["requests"]) for r, rep in reports(server).items() if rep.get("stats")}


def stale_routes(engine, name: str, holders: tuple[str, ...]) -> None:
    """Make the front end's cached routes name `holders` for template `name`, and not refresh them
    until a request asks for fresh ones. Set on the engine's own loop under its routes lock: a
    background refresh already waiting on the controller (slow on a busy machine) would otherwise
    land after this and put the true routes back, and the request would never see the stale ones."""
    async def set_them() -> None:
        async with engine._routes_lock:
            engine._routes = {**engine._routes, name: holders}
            engine._routes_at = time.monotonic() + 3600

    asyncio.run_coroutine_threadsafe(set_them(), engine._loop).result(timeout=60)


def test_startup_places_each_template_on_its_rendezvous_holder(fleet):
    server, clients = fleet
    members = sorted(reports(server))
    assert len(members) == 2
    templates = listing(clients)
    assert set(templates) == set(TEMPLATES)
    for name, t in templates.items():
        assert list(t.replicas) == holders(name, members, 1), name
        assert t.origin == "config" and t.num_tokens > 0
    def held() -> dict[str, set[str]]:
        return {r: {info.name for info, _ in rep["held"]} for r, rep in reports(server).items()}

    # the replicas' reports come with their polls, a second apart at most (docs/scale-out.md)
    wait_until(lambda: set().union(*held().values()) == set(TEMPLATES), timeout=10,
               what="every template in its holder's report")
    assert not set.intersection(*held().values())
    # each holder wrote its templates' snapshots to the shared folder
    wait_until(lambda: snapshots(server) == set(TEMPLATES), what="a snapshot of every template in the shared folder")


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """The front end's /metrics: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family appears twice"
    return {(s.name, frozenset(s.labels.items())): s.value for fam in families for s in fam.samples}


class CallCounter:
    """Stands in for the controller's handle and records which of its methods are called."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.called: list[str] = []

    def __getattr__(self, name: str):
        self.called.append(name)
        return getattr(self.handle, name)


def test_metrics_count_the_whole_fleet(fleet):
    """The front end's /metrics: KV blocks summed over the replicas' reports, every template, all
    read from the controller in one call."""
    server, _ = fleet
    engine = server.engine
    counter = CallCounter(engine.controller)
    engine.controller = counter
    try:
        scraped = scrape(server)
    finally:
        engine.controller = counter.handle
    assert [name for name in counter.called if name != "routes"] == ["status"]  # routes: the background refresh
    samples = {name: value for (name, labels), value in scraped.items() if not labels}
    assert samples["prefix_service_kv_blocks_total"] == 2 * 1024  # two replicas of 1024 blocks
    assert samples["prefix_service_templates"] == len(TEMPLATES)
    def pinned() -> tuple[float, int]:  # a scrape's, and the reports' (each at most a poll old)
        scraped_now = {name: value for (name, labels), value in scrape(server).items() if not labels}
        return scraped_now["prefix_service_kv_blocks_pinned"], sum(
            info.num_blocks for rep in reports(server).values() for info, _ in rep["held"])

    assert samples["prefix_service_kv_blocks_pinned"] > 0
    wait_until(lambda: (lambda p: p[0] == p[1] > 0)(pinned()), timeout=10,
               what="the scraped pinned blocks equal to the reports'")
    # what each replica's engine computes with, one series each, from the replicas' own reports
    infos = {dict(labels)["replica"]: dict(labels) for (name, labels), value in scrape(server).items()
             if name == "prefix_service_engine_info" and value == 1}
    assert set(infos) == set(reports(server)) and len(infos) == 2
    for labels in infos.values():
        assert (labels["device"], labels["dtype"], labels["block_size"], labels["batch_invariant"]) == \
            ("cpu", "float32", "4", "false")
        assert labels["cpu_isa"] == ",".join(cpuinfo.isa())  # the replicas' machine: this one here


def test_server_info_describes_every_replica(fleet):
    """GetServerInfo through the front end: one engine per replica, named by its id, each as its own
    report describes it; the context is the replicas' least, as /v1/models through Ray Serve gives it."""
    server, clients = fleet
    info = clients.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
    replicas = reports(server)
    assert [e.replica for e in info.engines] == sorted(replicas) and len(info.engines) == 2
    for e in info.engines:
        assert (e.device, e.dtype, e.block_size, e.num_blocks, e.cpu_isa) == (
            "cpu", "float32", 4, 1024, ",".join(cpuinfo.isa()))
    assert info.max_model_len == min(e.max_model_len for e in info.engines) > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/v1/models", timeout=30) as resp:
        base = json.loads(resp.read())["data"][0]
    assert (base["id"], base["max_model_len"]) == (info.model, info.max_model_len)


def test_replicas_run_with_the_heads_kernel_settings(fleet):
    """The kernel settings in the head's environment reach every replica, through Ray's runtime_env (a
    replica on another node never sees the head's environment; here they were set after the local
    Ray cluster had started, so its workers did not inherit them)."""
    server, _ = fleet
    replicas = reports(server)
    assert {r: rep.get("kernel_settings") for r, rep in replicas.items()} == {r: HEAD_SETTINGS for r in replicas}
    assert len(replicas) == 2


def test_greedy_outputs_equal_one_process(fleet, reference):
    server, clients = fleet
    for name in TEMPLATES:
        for prompt in PROMPTS:
            _, ids, last = collect(clients.generation.Generate(greedy_request(prompt, name, MAX_TOKENS)))
            assert ids == expected_ids(reference, name, prompt), (name, prompt)
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
    # no template: any replica, same answer
    _, ids, _ = collect(clients.generation.Generate(greedy_request("the table has a row", "", MAX_TOKENS)))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert ids == reference.generate(GenerateRequest(prompt="the table has a row", sampling=sampling))[0].token_ids


def test_n_samples_through_the_fleet(fleet, reference):
    """n > 1 reaches the holder's engine and every sample comes back, each with its index."""
    server, clients = fleet
    name = next(iter(TEMPLATES))
    sampling = dict(max_tokens=5, ignore_eos=True, temperature=1.0, seed=21)
    msgs = list(clients.generation.Generate(pb.GenerateRequest(prefix_name=name, prompt=PROMPTS[0],
                                                               sampling=pb.SamplingParams(n=3, **sampling))))
    want = reference.generate(GenerateRequest(prompt=PROMPTS[0], prefix_name=name,
                                              sampling=SamplingParams(n=3, **sampling)))[0].samples
    for i in range(3):
        assert [t for m in msgs if m.index == i for t in m.token_ids] == want[i].token_ids
    assert sum(m.finish_reason == pb.FINISH_REASON_LENGTH for m in msgs) == 3


def test_label_scoring_through_the_fleet(fleet, reference):
    """Score reaches the template's holder (even from stale routes, resent) and its scores equal
    one process's."""
    server, clients = fleet
    labels = ["order", "refund", "shipping value"]
    want = reference.score(ScoreRequest(labels, prompt=PROMPTS[0], prefix_name="t2"))
    got = clients.generation.Score(pb.ScoreRequest(prefix_name="t2", prompt=PROMPTS[0], candidates=labels))
    assert [c.candidate for c in got.candidates] == labels
    for c, w in zip(got.candidates, want.candidates):
        assert list(c.token_ids) == list(w.token_ids) and c.logprob == pytest.approx(w.logprob, abs=1e-4)
    assert got.usage.prefix_tokens == want.cached_tokens > 0
    engine = server.engine
    holder = list(listing(clients)["t2"].replicas)[0]
    stranger = next(r for r in reports(server) if r != holder)
    stale_routes(engine, "t2", (stranger,))  # no refresh until the resend asks for one
    try:
        again = clients.generation.Score(pb.ScoreRequest(prefix_name="t2", prompt=PROMPTS[0], candidates=labels))
    finally:
        engine._routes_at = -1e9
    assert [c.logprob for c in again.candidates] == [c.logprob for c in got.candidates]
    with pytest.raises(grpc.RpcError) as info:
        clients.generation.Score(pb.ScoreRequest(prefix_name="nope", prompt="x", candidates=labels))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_requests_land_only_on_their_templates_holder(fleet):
    server, clients = fleet
    fresh_reports(server)  # every replica has reported since the last test's requests
    before = taken(server)
    per_template = 3
    for name in TEMPLATES:
        for _ in range(per_template):
            collect(clients.generation.Generate(greedy_request("the order", name, 2)))
    where = {name: list(t.replicas) for name, t in listing(clients).items()}

    def settled():
        after = taken(server)
        delta = {r: {t: n - before.get(r, {}).get(t, 0) for t, n in counts.items()} for r, counts in after.items()}
        got = {t: sum(d.get(t, 0) for d in delta.values()) for t in TEMPLATES}
        return delta if all(n == per_template for n in got.values()) else None

    delta = wait_until(settled, what="the replicas' request counters")
    for replica, counts in delta.items():
        for template, n in counts.items():
            if n:
                assert where[template] == [replica], f"{n} request(s) on {template} went to {replica}, not its holder"


def test_unknown_template_is_not_found(fleet):
    _, clients = fleet
    with pytest.raises(grpc.RpcError) as e:
        collect(clients.generation.Generate(greedy_request("x", "no-such-template", 2)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-template" in e.value.details()


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_through_ray_serve(fleet, reference):
    """The OpenAI API through Ray Serve's proxy; its calls, counted in the ingress, show in the front
    end's /metrics beside the gRPC calls (one series each, summed)."""
    server, clients = fleet
    port = server.server.http_port
    ok = ("prefix_service_requests_total", frozenset({"protocol": "http", "template": "t1", "code": "OK"}.items()))
    grpc_ok = ("prefix_service_requests_total", frozenset({"protocol": "grpc", "template": "t1", "code": "OK"}.items()))
    ttft = ("prefix_service_ttft_seconds_count", frozenset({"template": "t1"}.items()))
    before = scrape(server)
    status, body = _post(port, "/v1/completions", {"model": "t1", "prompt": "the order", "max_tokens": MAX_TOKENS,
                                                   "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == expected_ids(reference, "t1", "the order")
    status, counted = _post(port, "/tokenize", {"model": "t1", "prompt": "the order"})
    assert status == 200 and counted["prompt_tokens"] == body["usage"]["prompt_tokens"], counted
    # its request log line, as one process writes it, in the ingress's Ray Serve log (the session's
    # log folder has no public accessor)
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    request_id = body["id"].split("-", 1)[1]

    def logged() -> list[dict]:
        lines = [line for f in logs.glob(f"replica_{server.config.ray.app_name}_HttpIngress_*.log")
                 for line in f.read_text().splitlines() if request_id in line]
        return [json.loads(line[line.index("{"):]) for line in lines]

    line = wait_until(logged, timeout=10, what="the HTTP request's log line")[0]
    assert (line["protocol"], line["template"], line["code"], line["completion_tokens"]) == ("http", "t1", "OK",
                                                                                            MAX_TOKENS)
    collect(clients.generation.Generate(greedy_request("the order", "t1", 2)))
    status, body = _post(port, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    after = scrape(server)
    # (the module's earlier tests may have run in another process: a series may start here)
    assert after[ok] - before.get(ok, 0) == 1 and after[grpc_ok] - before.get(grpc_ok, 0) == 1
    assert after[ttft] - before.get(ttft, 0) == 2  # one histogram for both front ends
    assert any(name == "prefix_service_requests_total" and ("protocol", "http") in labels and ("code", "NOT_FOUND")
               in labels for name, labels in after)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        ids = {m["id"] for m in json.loads(resp.read())["data"]}
    assert set(TEMPLATES) <= ids


def test_admin_add_and_remove_reach_the_holders(fleet, reference):
    server, clients = fleet
    text = "the table has a row for each order and a price"
    added = clients.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="extra", content=text))
    assert added.name == "extra" and added.num_tokens > 0
    members = sorted(reports(server))
    want = holders("extra", members, 1)
    assert list(listing(clients)["extra"].replicas) == list(added.replicas) == want  # the add's answer names them
    wait_until(lambda: {r for r, rep in reports(server).items() if "extra" in {i.name for i, _ in rep["held"]}}
               == set(want), what="the replicas' reports of 'extra'")
    saved = json.loads(Path(server.config.server.state_file).read_text())
    assert [t["name"] for t in saved["templates"]] == ["extra"]
    wait_until(lambda: "extra" in snapshots(server), what="the holder writing the snapshot of 'extra'")
    reference.add_template("extra", text)
    _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", "extra", MAX_TOKENS)))
    assert ids == expected_ids(reference, "extra", "the order")
    with pytest.raises(grpc.RpcError) as e:
        clients.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="extra", content="again"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS

    clients.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="extra"))
    assert "extra" not in listing(clients)
    wait_until(lambda: not any("extra" in {i.name for i, _ in rep["held"]} for rep in reports(server).values()),
               what="every replica dropping 'extra'")
    assert json.loads(Path(server.config.server.state_file).read_text())["templates"] == []
    # removed from the fleet: its snapshot goes too (a template that only moves keeps its snapshot)
    wait_until(lambda: "extra" not in snapshots(server), what="the snapshot of 'extra' removed")
    assert set(TEMPLATES) <= snapshots(server)
    with pytest.raises(grpc.RpcError) as e:
        collect(clients.generation.Generate(greedy_request("the order", "extra", 2)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    server.engine.check_integrity()


def test_a_template_serves_everywhere_as_soon_as_its_add_returns(fleet):
    """Right after AddPrefixTemplate returns, before the replicas' next reports and the front ends'
    next routes refresh: the listing has its blocks and K/V source as the add answered them, HTTP
    takes it as a model, and the metrics count its requests under its name; right after its
    removal a request on it is counted as on an unknown template."""
    server, clients = fleet
    engine = server.engine
    engine._routes_at = time.monotonic() + 3600  # the front end's routes go stale: only a miss refreshes them
    try:
        added = clients.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(
            name="fresh", content="a fresh note on the table of orders and prices"))
        shown = listing(clients)["fresh"]
        assert (shown.num_tokens, shown.num_blocks, shown.kv_source) == (added.num_tokens, added.num_blocks,
                                                                         added.kv_source) and added.num_blocks > 0
        status, body = _post(server.server.http_port, "/v1/completions",
                             {"model": "fresh", "prompt": "the order", "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        collect(clients.generation.Generate(greedy_request("the order", "fresh", 2)))
        clients.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="fresh"))
        engine._routes_at = time.monotonic() + 3600
        with pytest.raises(grpc.RpcError) as e:
            collect(clients.generation.Generate(greedy_request("the order", "fresh", 2)))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        engine._routes_at = -1e9
    counted = scrape(server)

    def requests(protocol: str, template: str, code: str) -> float:
        return counted.get(("prefix_service_requests_total", frozenset(
            {"protocol": protocol, "template": template, "code": code}.items())), 0)

    assert requests("grpc", "fresh", "OK") == requests("http", "fresh", "OK") == 1
    assert requests("grpc", "fresh", "NOT_FOUND") == 0 and requests("grpc", "_unknown", "NOT_FOUND") >= 1
    server.engine.check_integrity()


def test_chat_on_a_system_prompt_template(fleet, reference):
    """The chat path reads the template's ids and definition from the controller; the answer equals
    one process's on the whole rendered conversation (no template)."""
    server, clients = fleet
    system = "You answer questions about orders."
    clients.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="sys", system_prompt=system))
    try:
        req = pb.GenerateRequest(prefix_name="sys", messages=[pb.ChatMessage(role="user", content="the order")],
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        _, ids, last = collect(clients.generation.Generate(req))
        conversation = [{"role": "system", "content": system}, {"role": "user", "content": "the order"}]
        full = render_ids(reference.tokenizer, conversation, add_generation_prompt=True)
        assert 0 < last.usage.prefix_tokens < last.usage.prompt_tokens == len(full)
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert ids == reference.generate(GenerateRequest(prompt_token_ids=full, sampling=sampling))[0].token_ids
    finally:
        clients.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="sys"))


def test_a_cancelled_stream_leaves_nothing_on_its_replica(fleet):
    server, clients = fleet
    call = clients.generation.Generate(greedy_request("the order", "t2", 300))
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            break
    call.cancel()
    assert got < 300

    def idle():  # every replica's own report: nothing running or waiting, only the templates' blocks used
        reps = reports(server)
        return all(rep["stats"]["running"] == 0 and rep["stats"]["waiting"] == 0
                   and rep["stats"]["used"] == rep["stats"]["pinned"] for rep in reps.values())

    fresh_reports(server)  # reports made after the cancel
    wait_until(idle, what="the cancelled request leaving its replica")
    server.engine.check_integrity()


def test_a_request_on_stale_routes_is_resent_to_the_holder(fleet, reference):
    """A front end whose cached routes still name a replica the template has left: that replica
    answers TemplateNotHeld without taking the request, and the front end resends it."""
    server, clients = fleet
    engine = server.engine  # the FleetEngine of the gRPC front end, in this process
    holder = list(listing(clients)["t1"].replicas)[0]
    stranger = next(r for r in reports(server) if r != holder)
    fresh_reports(server)  # every replica has reported since the last test's requests
    before = taken(server)
    stale_routes(engine, "t1", (stranger,))  # no refresh until the resend asks for one
    try:
        _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", "t1", MAX_TOKENS)))
    finally:
        engine._routes_at = -1e9
    assert ids == expected_ids(reference, "t1", "the order")
    after = wait_until(lambda: (lambda t: t if t.get(holder, {}).get("t1", 0) == before[holder].get("t1", 0) + 1
                                else None)(taken(server)), what="the holder's request counter")
    assert after[stranger].get("t1", 0) == before[stranger].get("t1", 0)


def test_a_request_waiting_for_an_unknown_holder_holds_up_no_other_call(fleet, reference):
    """Routes naming a replica Ray Serve's router does not know (one just started, or gone): the
    request waits in the router, which backs off instead of spinning on the process's one router
    loop, so the front end's other calls (the controller's routes, an admin listing, another
    request) go on, and the request itself is resent to the holder once fresh routes show it."""
    server, clients = fleet
    engine = server.engine
    stale_routes(engine, "t1", ("no-such-replica",))  # no refresh until the wait asks for one
    results: dict[str, object] = {}
    handle = engine._streaming
    handed = threading.Event()

    def remote(req, **kwargs):  # the handle's generate.remote, noting when the router gets the request
        stream = handle.generate.remote(req, **kwargs)
        if kwargs.get("holders") == ["no-such-replica"]:
            handed.set()
        return stream

    engine._streaming = types.SimpleNamespace(generate=types.SimpleNamespace(remote=remote))

    def run() -> None:
        try:
            results["ids"] = collect(clients.generation.Generate(greedy_request("the order", "t1", MAX_TOKENS),
                                                                 timeout=20))[1]
        except grpc.RpcError as e:
            results["ids"] = e

    thread = threading.Thread(target=run)
    try:
        thread.start()
        # the request is with the router, waiting for its holder (the front end asks for fresh
        # routes after a second of that)
        assert handed.wait(30), "the request never reached the router"
        assert "t1" in listing(clients)
        _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", "t2", MAX_TOKENS), timeout=20))
        assert ids == expected_ids(reference, "t2", "the order")
        thread.join(30)
    finally:
        engine._streaming = handle
        engine._routes_at = -1e9
    assert results["ids"] == expected_ids(reference, "t1", "the order"), results["ids"]


def test_front_end_shutdown_cuts_its_streams_off_with_unavailable(fleet):
    """What a second SIGTERM does (the front end's engine.shutdown): streams in flight end at once
    with UNAVAILABLE instead of running out the grace period, and new calls are refused. The front
    end is then set serving again for the tests after it."""
    server, clients = fleet
    results: dict[str, object] = {}
    streaming = threading.Event()

    def run() -> None:
        try:
            n = 0
            for msg in clients.generation.Generate(greedy_request("the order", "t1", 300)):
                n += len(msg.token_ids)
                streaming.set()
            results["stream"] = n
        except grpc.RpcError as e:
            results["stream"] = e
        finally:
            streaming.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert streaming.wait(60)
    server.engine.shutdown()
    thread.join(60)
    err = results["stream"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "shutting down" in err.details()
    with pytest.raises(grpc.RpcError) as e:
        collect(clients.generation.Generate(greedy_request("the order", "t2", 2)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    def idle():  # the replica aborted the cut-off request
        return all(rep["stats"]["running"] == 0 and rep["stats"]["used"] == rep["stats"]["pinned"]
                   for rep in reports(server).values())

    fresh_reports(server)  # reports made after the cut-off
    wait_until(idle, what="the cut-off request leaving its replica")
    asyncio.run_coroutine_threadsafe(_serve_again(server.engine), server._loop).result(30)


async def _serve_again(engine) -> None:
    engine._stopped = False
    await engine.start()


def test_killed_replica_fails_its_streams_only_and_comes_back(fleet, reference):
    server, clients = fleet
    where = {name: list(t.replicas)[0] for name, t in listing(clients).items()}
    members = sorted(reports(server))
    victim = where["t0"]
    survivor = next(m for m in members if m != victim)
    other_template = next((n for n, r in where.items() if r == survivor), None)
    if other_template is None:  # the replica ids hashed all four onto the victim (1 time in 8): add one
        other_template = next(f"probe{i}" for i in range(1000) if holders(f"probe{i}", members, 1) == [survivor])
        clients.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name=other_template, content=TEMPLATES["t1"]))
    long_tokens = 300  # the templates are ~160 tokens; the tiny model allows 512 positions
    results: dict[str, object] = {}
    first = threading.Event()

    def run(name: str, signal_first: bool) -> None:
        try:
            n = 0
            for msg in clients.generation.Generate(greedy_request("the order", name, long_tokens)):
                n += len(msg.token_ids)
                if signal_first:
                    first.set()
            results[name] = n
        except grpc.RpcError as e:
            results[name] = e
        finally:
            first.set()

    threads = [threading.Thread(target=run, args=("t0", True)), threading.Thread(target=run, args=(other_template, False))]
    for t in threads:
        t.start()
    assert first.wait(60)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{server.config.ray.app_name}#{REPLICA_DEPLOYMENT}#{victim}",
                           namespace="serve"), no_restart=True)
    for t in threads:
        t.join(120)
    err = results["t0"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert results[other_template] == long_tokens  # the other replica's stream finished whole

    # Ray Serve starts a replacement (a new replica id). Until it is up the survivor takes the
    # victim's templates over; then the placement over the two members holds again, the newcomer
    # having pinned its share before taking traffic.
    def back():
        now = reports(server)
        members = sorted(now)
        # both serving: a newcomer whose share is empty leaves the placement holding from its join on,
        # before its constructor is done and it has reported
        if len(members) != 2 or victim in members or not all(r["ready"] for r in now.values()):
            return None
        t = listing(clients)
        return t if all(list(t[n].replicas) == holders(n, members, 1) for n in TEMPLATES) else None

    placed = wait_until(back, timeout=180, what="a replacement replica joining and the placement holding again")
    newcomer = next(m for m in sorted(reports(server)) if m != survivor)
    # every template has a snapshot in the shared folder since the start: the survivor took the
    # victim's share over from it, and the newcomer its share (a local snapshot comes before a peer)
    share = [n for n in TEMPLATES if list(placed[n].replicas) == [newcomer]]
    # the listing's holders come from the pins the controller saw done, the held list from each
    # replica's last report: read reports made after the placement was seen
    sources = {info.name: info.kv_source for info, _ in fresh_reports(server)[newcomer]["held"]}
    assert all(sources[n] == "snapshot" for n in share), sources
    for name in TEMPLATES:  # every template serves again at once, on whichever replica now holds it
        _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", name, MAX_TOKENS), timeout=30))
        assert ids == expected_ids(reference, name, "the order"), name
    server.engine.check_integrity()


def test_a_replica_failing_its_health_check_is_replaced(fleet, reference):
    """A replica whose engine loop stopped fails its health check: Ray Serve stops routing to it and
    starts a replacement, which pins its share; every template then serves as before."""
    server, clients = fleet
    victim = list(listing(clients)["t1"].replicas)[0]

    def stop_engine(_actor) -> str:  # runs in the replica's process (Ray Serve builds its own class from ours)
        import gc
        gc.unfreeze()  # Ray Serve froze what the replica built at start (throughput mode), out of gc's sight
        replica = next(o for o in gc.get_objects() if type(o).__name__ == "EngineReplica" and hasattr(o, "engine"))
        replica.engine.shutdown()
        return replica.id

    actor = ray.get_actor(f"SERVE_REPLICA::{server.config.ray.app_name}#{REPLICA_DEPLOYMENT}#{victim}",
                          namespace="serve")
    assert ray.get(actor.__ray_call__.remote(stop_engine), timeout=60) == victim

    def replaced():
        members = sorted(reports(server))
        if len(members) != 2 or victim in members:
            return None
        t = listing(clients)
        return all(list(t[n].replicas) == holders(n, members, 1) for n in TEMPLATES)

    wait_until(replaced, timeout=180, what="the unhealthy replica replaced and the placement holding again")
    for name in TEMPLATES:
        _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", name, MAX_TOKENS), timeout=30))
        assert ids == expected_ids(reference, name, "the order"), name
    server.engine.check_integrity()


def test_stop_drains_http_as_one_process_does(fleet):
    """Last in the module: it stops the module's fleet. The HTTP ingress drains as one process's HTTP
    server does: as soon as the stop begins /health and new calls answer 503, and a stream still
    running when the grace period ends gets the error event that ends it (before, the ingress served
    on through the grace period and the fleet's shutdown cut its streams off mid-body)."""
    import http.client

    server, _ = fleet
    port = server.server.http_port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    long = {"model": "t0", "prompt": "the order", "max_tokens": 330, "n": 8, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
        streamed = conn.getresponse()
        assert streamed.status == 200 and streamed.readline().startswith(b"data: {")
        server.stop(grace=0.5, wait=False)

        def health() -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        wait_until(lambda: health() == 503, timeout=30, what="/health answering 503 once the stop began")
        status, body = _post(port, "/v1/completions", {"model": "t0", "prompt": "the order", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "unavailable", body
        events = [e for e in streamed.read().decode().split("\n\n") if e]
        assert events[-1].startswith('data: {"error":') and "data: [DONE]" not in events, events[-2:]
        error = json.loads(events[-1][len("data: "):])["error"]
        assert error["code"] == "unavailable" and "cut off" in error["message"], error
    finally:
        conn.close()
        server.stop(grace=0.5, wait=True)
