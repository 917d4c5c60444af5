"""A fleet that Ray Serve scales between 1 and 2 replicas (template_replication 1, four
templates), serving gRPC and HTTP with TLS and an API key through Ray Serve's proxy.

Under load Ray Serve starts a second replica, which pins its share of the templates before it
takes traffic, and the first lets those go; without load one replica stops, says goodbye once its
requests have drained, and its templates move to the other. Clients call throughout: no request
fails, and every answer equals one process's. Deselect with -m "not ray"."""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import ssl
import threading

import grpc
import pytest

pytest.importorskip("ray", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")
pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")

from prefix_service import Engine  # noqa: E402
from prefix_service.config import TemplateSpec, RayConfig  # noqa: E402
from prefix_service.engine.sequence import GenerateRequest  # noqa: E402
from prefix_service.fleet.placement import holders  # noqa: E402
from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.sampling_params import SamplingParams  # noqa: E402
from server_fixtures import (DOCUMENT, TOKEN_ENV, Clients, collect, greedy_request, make_config,  # noqa: E402
                             running_fleet, self_signed_cert, wait_until)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]

TEMPLATES = {f"t{i}": f"{DOCUMENT} and note {i} of the table" for i in range(4)}
API_KEY_ENV = "PREFIX_SERVICE_TEST_FLEET_API_KEY"
API_KEY = "fleet-k3y"
LONG, SHORT = 200, 8  # output tokens of the load's requests and of the light ones
# what the clients call, in turn: every template, and none (any replica, the least loaded first, so a
# new replica takes requests even when the placement gives it no template)
CALLED = [*TEMPLATES, ""]


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    os.environ.pop(TOKEN_ENV, None)  # admin open on loopback
    os.environ[API_KEY_ENV] = API_KEY  # before the local cluster starts: the HTTP ingress reads it there
    folder = tmp_path_factory.mktemp("autoscaling")
    cert, key = self_signed_cert(folder / "tls")
    config = make_config(model_dir, prefixes=tuple(TemplateSpec(name=n, content=c) for n, c in TEMPLATES.items()),
                         num_blocks=1024, http_address="127.0.0.1:0", api_key_env=API_KEY_ENV,
                         tls_cert_file=str(cert), tls_key_file=str(key), grace_period_s=10.0)
    config = dataclasses.replace(config, ray=RayConfig(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.0, downscale_delay_s=2.0,
        look_back_period_s=11.0, template_replication=1, num_cpus_per_replica=1, app_name="prefix-service-autoscale"))
    try:
        with running_fleet(config, cert.read_bytes()) as (server, clients):
            yield server, clients, cert
    finally:
        os.environ.pop(API_KEY_ENV, None)


@pytest.fixture(scope="module")
def expected(model_dir):
    """One process's greedy ids for every template (and none: "") and length the clients ask for."""
    engine = Engine(make_config(model_dir, num_blocks=1024).engine)
    out = {}
    for name in CALLED:
        if name:
            engine.add_template(name, TEMPLATES[name])
        for n in (LONG, SHORT):
            sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            out[name, n] = engine.generate(GenerateRequest(prompt="the order", prefix_name=name or None,
                                                           sampling=sampling))[0].token_ids
    engine.shutdown()
    return out


class Load:
    """Client threads calling in a loop (each CALLED in turn) until stopped; every answer is checked
    against one process's."""

    def __init__(self, clients: Clients, expected: dict, threads: int, max_tokens: int) -> None:
        self.clients, self.expected, self.max_tokens = clients, expected, max_tokens
        self.stop_event = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop_event.is_set():
            name = CALLED[k % len(CALLED)]
            k += 1
            try:
                _, ids, _ = collect(self.clients.generation.Generate(greedy_request("the order", name,
                                                                                     self.max_tokens), timeout=90))
                if ids != self.expected[name, self.max_tokens]:
                    self.failures.append(f"{name}: other tokens than one process's")
                self.done += 1
            except grpc.RpcError as e:
                self.failures.append(f"{name}: {e.code().name} {e.details()}")

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)


def members(server) -> list[str]:
    return sorted(server.engine.replica_reports())


def placed(server, clients, n: int) -> bool:
    """n replicas serve (their constructors done), and every template is pinned where the placement
    over them puts it."""
    reports = server.engine.replica_reports()
    ms = sorted(reports)
    if len(ms) != n or not all(rep["ready"] for rep in reports.values()):
        return False
    listing = {t.name: list(t.replicas) for t in clients.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
    return all(listing.get(name) == holders(name, ms, 1) for name in TEMPLATES)


def test_the_fleet_scales_up_under_load_and_down_without_it(fleet, expected):
    server, clients, _ = fleet
    assert placed(server, clients, 1)  # min_replicas: one replica holds every template
    first = members(server)[0]

    def took(replica: str) -> int | None:
        """Requests it took, by its own counter as of its last poll (a second old at most); None while
        the controller holds no report of it (under load a replica that misses its lease leaves the
        reports until its next poll)."""
        report = server.engine.replica_reports().get(replica)
        if report is None or "stats" not in report:
            return None
        return sum(report["stats"].get("requests", {}).values())

    load = Load(clients, expected, threads=4, max_tokens=LONG)  # 4 in flight, 1 wanted per replica
    try:
        wait_until(lambda: placed(server, clients, 2), 180, "a second replica under load, holding its share")
        second = wait_until(lambda: next((m for m in members(server) if m != first), None), 60,
                            "the second replica in the controller's reports")
        # it takes traffic (a request without a template goes to the least loaded replica, whatever
        # share of the templates the placement gave it)
        wait_until(lambda: (took(second) or 0) > 0, 120,
                   f"the newcomer {second} taking requests (its report present and counting them)")
        # the newcomer's share came from the first replica's K/V (Ray's object store), not a prefill
        share = [n for n in TEMPLATES if holders(n, members(server), 1) == [second]]
        sources = {info.name: info.kv_source for info, _ in server.engine.replica_reports()[second]["held"]}
        assert all(sources[n] == "peer" for n in share), sources
    finally:
        load.stop()
    assert load.failures == [] and load.done > 0

    light = Load(clients, expected, threads=1, max_tokens=SHORT)  # at most 1 in flight: one replica is enough
    try:
        wait_until(lambda: placed(server, clients, 1), 180, "one replica stopping and its templates moving")
        present = members(server)
        gone = next(m for m in (first, second) if m not in present)
        # it said goodbye once drained, rather than being dropped at the lease
        assert server.engine.controller.departed.remote().result(timeout_s=30) == [gone]
        served = light.done
        wait_until(lambda: light.done >= served + 4, 60, "requests on the remaining replica")
    finally:
        light.stop()
    assert light.failures == [] and light.done > 0
    server.engine.check_integrity()


def _https(cert, port: int, method: str, path: str, body: dict | None = None,
           headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=str(cert)),
                                       timeout=60)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_http_through_ray_serve_takes_tls_and_the_api_key(fleet, expected):
    server, _, cert = fleet
    port = server.server.http_port
    body = {"model": "t2", "prompt": "the order", "max_tokens": SHORT, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, err = _https(cert, port, "POST", "/v1/completions", body)
    assert status == 401 and err["error"]["code"] == "missing_api_key", err
    status, err = _https(cert, port, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401 and err["error"]["code"] == "invalid_api_key", err
    status, ok = _https(cert, port, "POST", "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and ok["choices"][0]["token_ids"] == expected["t2", SHORT], ok
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # no plaintext side door
        plain.request("GET", "/health")
        plain.getresponse()
    plain.close()
