"""Fleet pieces that need no cluster: rendezvous placement, the router's eligibility rule and backoff, a
replica's health check, the `ray:` config section and `serve --ray`."""
from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import types

import pytest

from prefix_service.config import RayConfig, config_from_dict
from prefix_service.errors import ConfigError
from prefix_service.fleet.placement import holders, placement, weight

REPLICAS = [f"r{i}" for i in range(8)]
TEMPLATES = [f"template-{i}" for i in range(400)]


def test_holders_are_the_top_weights_and_deterministic():
    for t in TEMPLATES[:50]:
        top = holders(t, REPLICAS, 3)
        assert len(top) == 3 == len(set(top))
        ranked = sorted(REPLICAS, key=lambda r: weight(t, r), reverse=True)
        assert top == ranked[:3]
        assert holders(t, list(reversed(REPLICAS)), 3) == top  # the order of the member list does not matter
    assert holders("x", REPLICAS, None) == holders("x", REPLICAS, len(REPLICAS))  # None: every replica
    assert holders("x", ["a"], 3) == ["a"]  # fewer replicas than R: all of them
    assert holders("x", [], 2) == []


def test_a_replica_listed_twice_holds_a_template_once():
    """A member list that names a replica twice still gives R distinct holders, the same as without
    the repeat."""
    for t in TEMPLATES[:50]:
        doubled = holders(t, REPLICAS + REPLICAS[:4], 3)
        assert len(set(doubled)) == len(doubled) == 3
        assert doubled == holders(t, REPLICAS, 3)
    assert holders("x", ["a", "a"], 2) == ["a"]


def test_weights_keep_template_and_replica_apart_and_span_64_bits():
    """("ab", "c") and ("a", "bc") are different pairs, weighed independently; the weights are 64-bit
    numbers (a narrower hash would tie far more often)."""
    assert weight("ab", "c") != weight("a", "bc")
    assert weight("template-1", "0") != weight("template-", "10")
    weights = [weight(t, r) for t in TEMPLATES for r in REPLICAS]
    assert all(0 <= w < 2**64 for w in weights)
    assert max(weights) >= 2**63

def test_placement_spreads_templates_evenly():
    counts = collections.Counter(r for hs in placement(TEMPLATES, REPLICAS, 1).values() for r in hs)
    assert set(counts) == set(REPLICAS)
    expected = len(TEMPLATES) / len(REPLICAS)
    assert all(0.6 * expected < c < 1.4 * expected for c in counts.values()), counts


@pytest.mark.parametrize("replication", [1, 2, 3])
def test_membership_change_moves_only_what_it_must(replication):
    before = placement(TEMPLATES, REPLICAS, replication)
    # a replica joins: a template's holders change only by taking the newcomer in
    grown = placement(TEMPLATES, REPLICAS + ["r-new"], replication)
    for t in TEMPLATES:
        if "r-new" in grown[t]:
            assert set(grown[t]) - {"r-new"} <= set(before[t])
        else:
            assert grown[t] == before[t]
    assert 0 < sum("r-new" in hs for hs in grown.values()) < len(TEMPLATES) * replication / len(REPLICAS) * 1.6
    # a replica leaves: only the templates it held move, each to the next in its own order
    shrunk = placement(TEMPLATES, [r for r in REPLICAS if r != "r3"], replication)
    for t in TEMPLATES:
        if "r3" in before[t]:
            assert set(before[t]) - {"r3"} <= set(shrunk[t]) and "r3" not in shrunk[t]
        else:
            assert shrunk[t] == before[t]


def test_router_eligibility():
    pytest.importorskip("ray.serve", reason="the router module needs ray[serve] (pip install -e '.[ray]')")
    from prefix_service.fleet.router import eligible
    cands = ["a", "b", "c"]
    assert eligible(cands, {}, str) == cands  # no template: any replica (Ray Serve picks the least loaded)
    assert eligible(cands, {"holders": ("b", "c")}, str) == ["b", "c"]
    assert eligible(cands, {"holders": ("c", "a")}, str) == ["c", "a"]  # in the caller's order: least loaded first
    assert eligible(cands, {"holders": ("z",)}, str) == []  # its holders are down: wait, never a stranger
    assert eligible(cands, {"holders": ()}, str) == []


def test_router_asks_ray_serve_to_back_off_when_no_holder_can_take_a_call():
    """Ray Serve retries a call whose ranks gave no replica; without the backoff it calls
    choose_replicas again at once, never yielding the process's one router loop, and every
    deployment handle's calls in the process stall behind the waiting one."""
    pytest.importorskip("ray.serve", reason="the router module needs ray[serve] (pip install -e '.[ray]')")
    from ray.serve.request_router import PendingRequest

    from prefix_service.fleet.router import TemplateRouter
    cands = [types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=i)) for i in ("a", "b")]

    async def route(kwargs: dict) -> tuple[list[list[str]], bool]:
        pending = PendingRequest(args=[], kwargs=kwargs, metadata=None)
        assert not pending.routing_context.should_backoff
        ranks = await TemplateRouter.choose_replicas(None, cands, pending)
        return [[r.replica_id.unique_id for r in rank] for rank in ranks], pending.routing_context.should_backoff

    assert asyncio.run(route({"holders": ("gone",)})) == ([], True)  # its holder is down: wait, backing off
    assert asyncio.run(route({"holders": ("b", "a")})) == ([["b"], ["a"]], True)  # both full: wait too
    assert asyncio.run(route({})) == ([["a"], ["b"]], True)


def test_router_without_a_pending_request_offers_every_replica_in_its_own_rank():
    pytest.importorskip("ray.serve", reason="the router module needs ray[serve] (pip install -e '.[ray]')")
    from prefix_service.fleet.router import TemplateRouter
    cands = [types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id=i)) for i in ("a", "b", "c")]
    ranks = asyncio.run(TemplateRouter.choose_replicas(None, cands, None))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["a"], ["b"], ["c"]]


def test_ray_config_section(tmp_path):
    (tmp_path / "m").mkdir()
    cfg = config_from_dict({"model": {"path": "m"}, "ray": {"num_replicas": 3, "template_replication": 2}},
                           base_dir=tmp_path)
    assert cfg.ray == RayConfig(num_replicas=3, template_replication=2)
    assert config_from_dict({"model": {"path": "m"}}, base_dir=tmp_path).ray is None
    assert config_from_dict({"model": {"path": "m"}, "ray": {}}, base_dir=tmp_path).ray == RayConfig()
    auto = RayConfig(min_replicas=1, max_replicas=4)
    assert auto.autoscaling and not RayConfig().autoscaling


@pytest.mark.parametrize("raw, match", [
    ({"num_replicas": 0}, "ray.num_replicas"),
    ({"template_replication": 0}, "ray.template_replication"),
    ({"min_replicas": 2}, "go together"),
    ({"min_replicas": 3, "max_replicas": 2}, "ray.max_replicas"),
    ({"num_cpus_per_replica": -1}, "ray.num_cpus_per_replica"),
    ({"address": ""}, "ray.address"),
    ({"upscale_delay_s": -1}, "ray.upscale_delay_s: expected a number of seconds >= 0"),
    ({"downscale_delay_s": "soon"}, "ray.downscale_delay_s"),
    ({"look_back_period_s": 10}, "ray.look_back_period_s: expected a number of seconds > 10"),
    ({"template_kv_from_peers": "yes"}, "ray.template_kv_from_peers: expected true or false"),
    ({"replicas": 2}, "unknown key"),
])
def test_ray_config_errors_name_the_key(tmp_path, raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"model": {"path": "m"}, "ray": raw}, base_dir=tmp_path)


def test_serve_cli_takes_ray_flags():
    from prefix_service.cli import build_parser
    args = build_parser().parse_args(["serve", "--config", "c.yaml", "--ray", "--replicas", "3"])
    assert args.ray and args.replicas == 3
    assert not build_parser().parse_args(["serve", "--config", "c.yaml"]).ray


def test_serve_env_sets_what_the_operator_left_unset_before_ray_serve_loads():
    """use_serve_env in a fresh process (this one has Ray Serve loaded): the fleet's settings where
    the environment has none, the operator's own kept and returned; Ray Serve then reads them; called
    after Ray Serve loaded, with a setting missing, it refuses instead of silently not applying it."""
    pytest.importorskip("ray.serve", reason="Ray Serve's settings need ray[serve] (pip install -e '.[ray]')")
    from prefix_service.fleet import SERVE_ENV
    env = {k: v for k, v in os.environ.items() if k not in SERVE_ENV}
    code = ("import os; from prefix_service.fleet import use_serve_env, SERVE_ENV; own = use_serve_env(); "
            "import ray.serve._private.constants as c; "
            "print(own, c.RAY_SERVE_THROUGHPUT_OPTIMIZED, c.RAY_SERVE_USE_GRPC_BY_DEFAULT, "
            "c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP, c.RAY_SERVE_ENABLE_DIRECT_INGRESS, "
            "c.RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE, [os.environ[k] for k in SERVE_ENV])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["{}", "True", "True", "True", "False", "1", "['1',", "'1',", "'0',", "'1',", "'1']"], out
    out = subprocess.run([sys.executable, "-c", code], env={**env, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("{'RAY_SERVE_THROUGHPUT_OPTIMIZED': '0'} False False True False 1"), out
    late = subprocess.run([sys.executable, "-c", "import ray.serve; from prefix_service.fleet import use_serve_env; "
                           "use_serve_env()"], env=env, capture_output=True, text=True)
    assert late.returncode != 0 and "imported before the fleet's settings were set" in late.stderr


def test_replica_health_check_fails_once_its_engine_stops(llama_dir):
    pytest.importorskip("ray.serve", reason="the replica module needs ray[serve] (pip install -e '.[ray]')")
    import types

    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig, SchedulerConfig
    from prefix_service.fleet.replica import EngineReplica
    engine = Engine(EngineConfig(ModelConfig(path=str(llama_dir), device="cpu"),
                                 CacheConfig(block_size=4, num_blocks=32), SchedulerConfig()))
    replica = types.SimpleNamespace(id="r1", engine=engine)
    EngineReplica.check_health(replica)  # serving: healthy
    engine.check_integrity()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="r1: the engine loop has stopped"):
        EngineReplica.check_health(replica)


def test_a_replica_polls_on_while_its_engine_is_in_a_long_step(monkeypatch):
    """The poll is the heartbeat: while a report waits for the engine's step to end (a long
    prefill), the replica polls on time with its last report, then with the fresh one (it polled
    only once the step ended, and the controller's lease dropped it)."""
    pytest.importorskip("ray.serve", reason="the replica module needs ray[serve] (pip install -e '.[ray]')")
    import threading
    import time
    import types

    from prefix_service.fleet import replica as replica_module
    from prefix_service.fleet.replica import EngineReplica

    monkeypatch.setattr(replica_module, "REPORT_WAIT_S", 0.05)
    step_over = threading.Event()
    reports = iter([{"seq": 1}, {"seq": 2}])
    polls: list[dict] = []

    def report():  # the first waits for the "step"; the second comes at once
        got = next(reports)
        if got["seq"] == 1:
            assert step_over.wait(10)
        return got

    async def poll(rid, last):
        polls.append(last)
        await asyncio.sleep(0.02)  # the controller's long poll, shortened
        return []

    replica = types.SimpleNamespace(id="r1", report=report,
                                    _controller=types.SimpleNamespace(poll=types.SimpleNamespace(remote=poll)))

    async def main():
        task = asyncio.ensure_future(EngineReplica._poll_forever(replica))
        deadline = time.monotonic() + 5
        while len(polls) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        step_over.set()
        assert len(polls) >= 5, polls  # the step lasted 5 s: polls kept coming meanwhile
        while not polls or polls[-1].get("seq") != 2:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert polls[:5] == [{}] * 5  # on time during the step, with the last report (none yet)
    assert {"seq": 1} in polls and polls[-1] == {"seq": 2}  # then the fresh ones, in order


class FakeReplicas:
    """The replicas' deployment handle as FleetEngine calls it: generate.remote(req, holders=...) is
    `remote`, which returns the call's stream."""

    def __init__(self, remote) -> None:
        self.remote = remote

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self


def test_front_end_sends_a_call_to_the_least_loaded_holder_first():
    """FleetEngine orders a template's holders (every serving replica for no template) by its own
    calls in flight, and the router tries them in that order."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    import asyncio
    import time

    from prefix_service.engine.sequence import GenerateRequest
    from prefix_service.fleet.client import FleetEngine

    sent: list[tuple[str, ...]] = []

    class Stream:  # a replica's answer: its id first (taken), then nothing yet
        def __init__(self, replica: str) -> None:
            self.first = replica

        async def __anext__(self):
            return self.first

        def cancel(self) -> None:
            pass

    def taken_by_the_first(req, holders=()):  # the first holder takes the call
        sent.append(tuple(holders))
        return Stream(holders[0])

    engine = FleetEngine(FakeReplicas(taken_by_the_first), controller=None, tokenizer=None)
    engine._routes, engine._routes_at = {"": ("a", "b", "c"), "t": ("a", "b")}, time.monotonic() + 3600

    async def main() -> None:
        loads = {"a": 2, "b": 0, "c": 1}
        engine._inflight.update(loads)
        _, replica = await engine._submit(GenerateRequest(prompt="x", prefix_name="t"))
        assert replica == "b" and sent[-1] == ("b", "a")  # a template: its holders only, least loaded first
        _, replica = await engine._submit(GenerateRequest(prompt="x"))
        assert replica == "b" and sent[-1] == ("b", "c", "a")  # no template: every serving replica
        engine._inflight.clear()
        firsts = set()
        for _ in range(40):  # equal loads: any of them may come first
            firsts.add((await engine._submit(GenerateRequest(prompt="x")))[1])
        assert firsts == {"a", "b", "c"}

    asyncio.run(main())


def test_a_call_its_caller_gave_up_on_while_no_replica_took_it_is_withdrawn():
    """A caller cancelled (a gRPC deadline, an HTTP client gone) while its call waits in Ray Serve's
    router for a busy holder: the call is cancelled there, or it would run later for nobody."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    import time

    from prefix_service.engine.sequence import GenerateRequest
    from prefix_service.fleet.client import FleetEngine

    streams: list = []

    class Waiting:  # no replica takes the call
        cancelled = False

        async def __anext__(self):
            await asyncio.Event().wait()

        def cancel(self) -> None:
            self.cancelled = True

    def never_taken(req, holders=()):
        streams.append(Waiting())
        return streams[-1]

    engine = FleetEngine(FakeReplicas(never_taken), controller=None, tokenizer=None)
    engine._routes, engine._routes_at = {"": ("a",), "t": ("a",)}, time.monotonic() + 3600

    async def main() -> None:
        async def consume() -> None:
            async for _ in engine.generate_stream(GenerateRequest(prompt="x", prefix_name="t")):
                pass

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consume(), 0.3)  # less than the second after which it looks at fresh routes

    asyncio.run(main())
    assert len(streams) == 1 and streams[0].cancelled


def test_the_services_answers_are_not_logged_as_failed_requests():
    """In a replica, Ray Serve's "Request failed." record of an error the service answers a caller
    with becomes one INFO line without its traceback; any other failure stays as it was."""
    import logging
    import sys

    from prefix_service.errors import TemplateExists
    from prefix_service.fleet import AnsweredNotFailed

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", (), sys.exc_info())

    answered = record(TemplateExists("a prefix template named 'x' already exists"))
    assert AnsweredNotFailed().filter(answered)
    assert answered.levelno == logging.INFO and answered.exc_info is None
    assert answered.getMessage() == "request answered with TemplateExists: a prefix template named 'x' already exists"
    failed = record(RuntimeError("boom"))
    assert AnsweredNotFailed().filter(failed)
    assert failed.levelno == logging.ERROR and failed.exc_info is not None and failed.getMessage() == "Request failed."


def test_a_remote_error_reaches_the_caller_as_itself_and_a_dead_actor_as_unavailable():
    """calls.unwrap: a replica's or the controller's exception comes back as the service raised it
    (its own type and message, for its status code; not Ray's wrapper with the remote traceback),
    and a call to an actor that died is ReplicaUnavailable (UNAVAILABLE, 503: retry), not INTERNAL."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    from ray import exceptions as ray_errors

    from prefix_service.errors import TemplateExists
    from prefix_service.fleet.calls import unwrap
    from prefix_service.server.status import ReplicaUnavailable

    cause = TemplateExists("a prefix template named 'x' already exists")
    wrapped = ray_errors.RayTaskError("add", "Traceback (most recent call last): ...", cause).as_instanceof_cause()
    assert unwrap(wrapped) is cause
    gone = unwrap(ray_errors.ActorDiedError(), "the fleet controller")
    assert isinstance(gone, ReplicaUnavailable) and str(gone).startswith("the fleet controller stopped")


def test_a_call_past_its_timeout_is_unavailable_and_withdrawn():
    """calls.call: a call that does not answer in time ends as ReplicaUnavailable, and the call is
    cancelled (it would run later for nobody)."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    from prefix_service.fleet.calls import call
    from prefix_service.server.status import ReplicaUnavailable

    class NeverAnswers:
        cancelled = False

        def __await__(self):
            return asyncio.Event().wait().__await__()

        def cancel(self) -> None:
            self.cancelled = True

    response = NeverAnswers()
    with pytest.raises(ReplicaUnavailable, match="the replica did not answer"):
        asyncio.run(call(response, 0.05, "the replica"))
    assert response.cancelled


def test_a_stream_closed_early_cancels_its_call_and_its_load_count():
    """A caller that stops reading (a client gone) cancels the call on its replica, which aborts
    the request there, and the front end's count of its calls in flight (the least-loaded order)
    goes back down."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    import time

    from prefix_service.engine.sequence import GenerateRequest, RequestOutput
    from prefix_service.fleet.client import FleetEngine

    streams: list = []

    class Stream:  # the replica's id (it took the call), then outputs that never finish
        cancelled = False

        def __init__(self) -> None:
            self.items = iter(["a"] + [RequestOutput("r", "x", [5])] * 10)

        async def __anext__(self):
            return next(self.items)

        def cancel(self) -> None:
            self.cancelled = True

    def remote(req, holders=()):
        streams.append(Stream())
        return streams[-1]

    engine = FleetEngine(FakeReplicas(remote), controller=None, tokenizer=None)
    engine._routes, engine._routes_at = {"": ("a",)}, time.monotonic() + 3600

    async def main() -> None:
        gen = engine.generate_stream(GenerateRequest(prompt="x"))
        assert (await gen.__anext__()).token_ids == [5]
        assert engine._inflight == {"a": 1}
        await gen.aclose()

    asyncio.run(main())
    assert len(streams) == 1 and streams[0].cancelled
    assert not engine._inflight


def test_a_call_no_replica_takes_ends_unavailable_at_the_accept_timeout():
    """Every holder busy or gone: the caller gets UNAVAILABLE once accept_timeout_s has passed, not
    a call that waits forever."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    import time

    from prefix_service.engine.sequence import GenerateRequest
    from prefix_service.fleet.client import FleetEngine
    from prefix_service.server.status import ReplicaUnavailable

    class Waiting:
        async def __anext__(self):
            await asyncio.Event().wait()

        def cancel(self) -> None:
            pass

    engine = FleetEngine(FakeReplicas(lambda req, holders=(): Waiting()), controller=None, tokenizer=None)
    engine._routes, engine._routes_at = {"": ("a",)}, time.monotonic() + 3600
    engine.accept_timeout_s = 0.2

    async def main() -> None:
        async for _ in engine.generate_stream(GenerateRequest(prompt="x")):
            pass

    with pytest.raises(ReplicaUnavailable, match="no replica took the request"):
        asyncio.run(asyncio.wait_for(main(), 30))


class FakeController:
    """The controller's handle as FleetEngine calls it: routes.remote() answers `answer`."""

    def __init__(self, answer: dict) -> None:
        self.answer = answer
        self.calls = 0

    @property
    def routes(self):
        async def remote():
            self.calls += 1
            return dict(self.answer)
        return types.SimpleNamespace(remote=remote)


def test_the_routes_are_cached_for_their_ttl_then_asked_again():
    """A front end reads the routes from its cache within ROUTES_TTL_S and from the controller
    after it: a replica that joined gets calls that name no template, and a template's new holders
    get its calls, without a resend each."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    from prefix_service.fleet import client

    controller = FakeController({"": ("a",)})
    engine = client.FleetEngine(FakeReplicas(None), controller, tokenizer=None)

    async def main() -> None:
        assert await engine.routes(fresh=True) == {"": ("a",)}
        controller.answer = {"": ("a", "b"), "t": ("b",)}
        assert await engine.routes() == {"": ("a",)}  # within the TTL: the cache
        engine._routes_at -= client.ROUTES_TTL_S + 0.01  # as though the TTL had passed
        assert await engine.routes() == {"": ("a", "b"), "t": ("b",)}

    asyncio.run(main())
    assert controller.calls == 2


def test_a_template_added_after_the_cached_routes_is_found():
    """FleetRegistry.lookup of a name the cached routes lack asks the controller (an HTTP request
    naming a template added a moment ago is served, not a 404); one the fleet lacks too is not found."""
    pytest.importorskip("ray.serve", reason="the fleet client needs ray[serve] (pip install -e '.[ray]')")
    import time

    from prefix_service.fleet.client import FleetEngine, FleetRegistry

    engine = FleetEngine(FakeReplicas(None), FakeController({"": ("a",), "new": ("a",)}), tokenizer=None)
    engine._routes, engine._routes_at = {"": ("a",)}, time.monotonic() + 3600
    registry = FleetRegistry(engine)
    assert asyncio.run(registry.lookup("new")) is True
    assert asyncio.run(registry.lookup("nope")) is False


def test_the_replicas_deploy_with_the_template_router_and_the_configs_autoscaling(tmp_path):
    """build_app: the replicas' deployment routes with TemplateRouter (a call goes to a holder of its
    template) and scales within the `ray:` section's bounds, each delay where the operator set it."""
    pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")
    import dataclasses

    from prefix_service.fleet.launcher import build_app
    from server_fixtures import make_config

    ray = RayConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0.5, downscale_delay_s=7.0,
                    target_ongoing_requests=3)
    config = dataclasses.replace(make_config(tmp_path), ray=ray)
    deployment = build_app(config, None, http=False, served_name="x")._bound_deployment._deployment_config
    assert deployment.request_router_config.request_router_class == "prefix_service.fleet.router:TemplateRouter"
    auto = deployment.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.upscale_delay_s, auto.downscale_delay_s,
            auto.target_ongoing_requests) == (1, 3, 0.5, 7.0, 3)
