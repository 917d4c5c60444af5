"""The gRPC server against a tiny random model on 127.0.0.1: streaming equals the engine, many
concurrent streams, chat on system_prompt templates, cancellation/deadlines free blocks, health
during warmup, graceful shutdown, and every status code."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from server_fixtures import (DOCUMENT, SYSTEM_PROMPT, Clients, ServerThread, collect, greedy_request, make_config,
                             slow_steps)

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb

TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    st = ServerThread(make_config(model_dir, prefixes=TEMPLATES,
                                  state_file=tmp_path_factory.mktemp("state") / "state.json")).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def clients(server):
    c = Clients(server.address)
    yield c
    c.close()


@pytest.fixture
def make_server(model_dir, tmp_path):
    """Per-test servers; each is checked for leaks, then stopped."""
    started: list[ServerThread] = []

    def factory(**kwargs) -> ServerThread:
        kwargs.setdefault("prefixes", TEMPLATES)
        kwargs.setdefault("state_file", tmp_path / f"state{len(started)}.json")
        hook = kwargs.pop("warmup_hook", None)
        st = ServerThread(make_config(kwargs.pop("model", model_dir), **kwargs), warmup_hook=hook)
        started.append(st)
        return st.start()

    yield factory
    for st in started:
        if st.engine is not None:
            st.check_clean()
        st.stop()


@pytest.fixture(autouse=True)
def _integrity(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").check_clean()


def reference(engine, prompt="", prefix=None, max_tokens=12, ids=None, **sampling):
    req = GenerateRequest(prompt=None if ids is not None else prompt, prompt_token_ids=ids, prefix_name=prefix,
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    return engine.generate(req)[0]


def code_of(stream) -> tuple[grpc.StatusCode, str]:
    """Status code and message of a Generate stream that must fail."""
    with pytest.raises(grpc.RpcError) as info:
        collect(stream)
    return info.value.code(), info.value.details()


# --- streaming ------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["doc", "sys", ""])
def test_stream_equals_engine_generate(server, clients, prefix):
    prompt = " the order price"
    msgs = list(clients.generation.Generate(greedy_request(prompt, prefix, max_tokens=16)))
    ref = reference(server.engine, prompt, prefix or None, max_tokens=16)
    assert "".join(m.text for m in msgs) == ref.text
    assert [t for m in msgs for t in m.token_ids] == ref.token_ids
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.prefix_tokens, last.usage.completion_tokens) == \
        (ref.prompt_tokens, ref.cached_tokens, 16)
    assert last.usage.ttft_ms > 0
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
    if prefix:
        assert last.usage.prefix_tokens == server.engine.get_template(prefix).num_tokens > 0


def test_32_concurrent_streams(server, clients):
    prefixes = ["doc", "sys", ""]
    reqs = [greedy_request(f" the {w} row", prefixes[i % 3], max_tokens=4 + i % 9)
            for i, w in enumerate(["price", "order", "value", "table"] * 8)]
    refs = server.engine.generate([
        GenerateRequest(prompt=r.prompt, prefix_name=r.prefix_name or None,
                        sampling=SamplingParams(max_tokens=r.sampling.max_tokens, ignore_eos=True)) for r in reqs])
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda r: collect(clients.generation.Generate(r)), reqs))
    for (text, ids, last), ref in zip(got, refs):
        assert (text, ids) == (ref.text, ref.token_ids)
        assert last.usage.completion_tokens == len(ref.token_ids)


def test_sampling_defaults_and_seed(server, clients):
    # temperature 0 = greedy, top_p 0 = 1.0, top_k 0 = no limit, max_tokens 0 = configured default
    req = pb.GenerateRequest(prefix_name="doc", prompt=" the", sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True))
    assert collect(clients.generation.Generate(req))[1] == reference(server.engine, " the", "doc", 5).token_ids
    seeded = greedy_request(" the", "doc", max_tokens=8, temperature=1.0, seed=1234)
    a, b = (collect(clients.generation.Generate(seeded))[1] for _ in range(2))
    assert a == b == reference(server.engine, " the", "doc", 8, temperature=1.0, seed=1234).token_ids
    default = pb.GenerateRequest(prompt=" the", sampling=pb.SamplingParams(ignore_eos=True))
    assert collect(clients.generation.Generate(default))[2].usage.completion_tokens == \
        server.config.engine.scheduler.default_max_tokens


def test_stop_string(server, clients):
    full = reference(server.engine, " the", "doc", 16).text
    stop = full[6:9]
    assert stop.strip()
    text, _, last = collect(clients.generation.Generate(greedy_request(" the", "doc", 16, stop=[stop])))
    assert last.finish_reason == pb.FINISH_REASON_STOP and text == full[:full.index(stop)]


# --- chat ---------------------------------------------------------------------------------

def test_chat_on_system_prompt_template_equals_full_conversation(server, clients):
    user = [pb.ChatMessage(role="user", content="cancel my order")]
    sampling = pb.SamplingParams(max_tokens=12, ignore_eos=True)
    with_prefix = list(clients.generation.Generate(pb.GenerateRequest(prefix_name="sys", messages=user,
                                                                      sampling=sampling)))
    system = [pb.ChatMessage(role="system", content=SYSTEM_PROMPT)]
    without = list(clients.generation.Generate(pb.GenerateRequest(messages=system + user, sampling=sampling)))
    ids = lambda msgs: [t for m in msgs for t in m.token_ids]  # noqa: E731
    assert ids(with_prefix) == ids(without) and len(ids(without)) == 12
    assert "".join(m.text for m in with_prefix) == "".join(m.text for m in without)
    n_template = server.engine.get_template("sys").num_tokens
    assert with_prefix[-1].usage.prefix_tokens == n_template
    assert with_prefix[-1].usage.prompt_tokens == without[-1].usage.prompt_tokens
    assert without[-1].usage.prefix_tokens == 0
    # the same conversation rendered by hand through the tokenizer
    tok = server.engine.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": "cancel my order"}],
                                   tokenize=False, add_generation_prompt=True)
    assert ids(without) == reference(server.engine, ids=tok.encode(text, add_special_tokens=False)).token_ids


def test_chat_on_content_template_continues_it(server, clients):
    req = pb.GenerateRequest(prefix_name="doc", messages=[pb.ChatMessage(role="user", content="price?")],
                             sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
    tok = server.engine.tokenizer
    conv = tok.apply_chat_template([{"role": "user", "content": "price?"}], tokenize=False, add_generation_prompt=True)
    expected = reference(server.engine, prefix="doc", max_tokens=6, ids=tok.encode(conv, add_special_tokens=False))
    assert collect(clients.generation.Generate(req))[1] == expected.token_ids


def with_chat_template(model_dir, tmp_path, chat_template: str):
    """A copy of the model whose tokenizer has this chat template."""
    odd = tmp_path / "odd-model"
    shutil.copytree(model_dir, odd)
    cfg_path = odd / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(cfg))
    (odd / "chat_template.jinja").unlink(missing_ok=True)
    return odd


def test_chat_template_that_moves_the_system_prompt(model_dir, tmp_path, make_server):
    """FAILED_PRECONDITION when the rendered conversation does not start with the template's ids."""
    # system messages go last: the template's ids are no prefix of a conversation
    odd = with_chat_template(model_dir, tmp_path, (
        "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['role'] + ': ' + m['content'] "
        "+ '\n' }}{% endif %}{% endfor %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ 'rules: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"))
    st = make_server(model=odd, prefixes=(TemplateSpec("sys", system_prompt=SYSTEM_PROMPT),))
    req = pb.GenerateRequest(prefix_name="sys", messages=[pb.ChatMessage(role="user", content="hi")])
    code, details = code_of(Clients(st.address).generation.Generate(req))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "chat template does not keep the system prompt" in details


def test_a_chat_template_that_changes_only_the_last_token_of_the_system_prompt(model_dir, tmp_path, make_server):
    """The whole template must be a token prefix of the conversation, its last token too: a chat
    template that ends the system message one way alone and another way before a user's is refused."""
    # a last message without a generation prompt ends with <|endoftext|>, any other with <|im_end|>
    odd = with_chat_template(model_dir, tmp_path, (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{% if loop.last and not add_generation_prompt %}{{ '<|endoftext|>' }}"
        "{% else %}{{ '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"))
    st = make_server(model=odd, prefixes=(TemplateSpec("sys", system_prompt=SYSTEM_PROMPT),))
    tok = st.engine.tokenizer
    template = st.engine.get_template("sys").token_ids
    conversation = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                                       {"role": "user", "content": "hi"}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
    n = len(template)
    assert list(conversation[:n - 1]) == list(template[:-1]) and conversation[n - 1] != template[-1]
    req = pb.GenerateRequest(prefix_name="sys", messages=[pb.ChatMessage(role="user", content="hi")])
    code, details = code_of(Clients(st.address).generation.Generate(req))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "chat template does not keep the system prompt" in details


def test_health_watchers_see_not_serving_as_the_drain_begins(make_server):
    """A stop turns gRPC health NOT_SERVING at once (load balancers stop sending), while the calls in
    flight still run to their end: a Watch opened before sees it."""
    st = make_server(grace_period_s=30)
    undo = slow_steps(st.engine, 0.01)
    c = Clients(st.address)
    try:
        call = c.generation.Generate(greedy_request(" the", "doc", max_tokens=150))
        next(call)
        watch = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        st.stop(grace=None, wait=False)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert collect(call)[2].usage.completion_tokens == 150  # the drain lets it finish
    finally:
        undo()
        c.close()


# --- cancellation, deadlines, shutdown ----------------------------------------------------

def test_cancelled_stream_frees_its_blocks(server, clients):
    undo = slow_steps(server.engine, 0.01)
    try:
        call = clients.generation.Generate(greedy_request(" the", "doc", max_tokens=350))
        first = next(call)
        assert first.token_ids
        stats = server.engine.kv_stats()
        assert stats["running"] == 1 and stats["used"] > stats["pinned"]
        call.cancel()
        server.check_clean()  # waits for the abort: used blocks back to the pinned count
    finally:
        undo()


def test_deadline_aborts_the_request(server, clients):
    undo = slow_steps(server.engine, 0.01)
    try:
        call = clients.generation.Generate(greedy_request(" the", "doc", max_tokens=350), timeout=0.5)
        with pytest.raises(grpc.RpcError) as info:
            collect(call)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        server.check_clean()
    finally:
        undo()


def test_graceful_shutdown_lets_in_flight_requests_finish(make_server):
    st = make_server(grace_period_s=10)
    undo = slow_steps(st.engine, 0.005)
    c = Clients(st.address)
    call = c.generation.Generate(greedy_request(" the", "doc", max_tokens=60))
    next(call)
    st.stop(grace=None, wait=False)  # what SIGTERM does: the configured grace period
    deadline = time.monotonic() + 5
    while st.server.runtime.phase != "shutting down" and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as info:  # draining: new calls are refused
        collect(Clients(st.address).generation.Generate(greedy_request(" the", "doc", max_tokens=2), timeout=2))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    text, ids, last = collect(call)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 60
    st.stop()
    undo()
    with pytest.raises(grpc.RpcError) as info:
        collect(Clients(st.address).generation.Generate(greedy_request(" the", "doc", max_tokens=2), timeout=2))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    st.check_clean()


def test_grace_period_over_cancels_in_flight_requests(make_server, caplog):
    """Cut off when the grace period ends: UNAVAILABLE to the client with the service's message (a
    stream, and a score; gRPC's own cancel said only "Cancelling all calls"), and in the request log
    and the metrics too (they said CANCELLED, the client's own doing)."""
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(grace_period_s=0.3, max_num_batched_tokens=8)
    slow_steps(st.engine, 0.05)  # the score's prompt takes 25 steps, over a second: past the grace period
    clients = Clients(st.address)
    call = clients.generation.Generate(greedy_request(" the", "doc", max_tokens=350))
    next(call)
    scoring = clients.generation.Score.future(pb.ScoreRequest(prompt=" the" * 200, candidates=[" order", " row"]))
    deadline = time.monotonic() + 10
    while st.engine.kv_stats()["running"] + st.engine.kv_stats()["waiting"] < 2:  # the score is in too
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    st.stop(grace=None)
    assert time.monotonic() - t0 < 5
    with pytest.raises(grpc.RpcError) as info:
        collect(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "the request was cut off" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        scoring.result()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "the request was cut off" in info.value.details()
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert [line["code"] for line in lines] == ["UNAVAILABLE", "UNAVAILABLE"]
    st.check_clean()


# --- health, warmup, reflection -------------------------------------------------------------

def test_health_serving_only_after_warmup(model_dir):
    seen = []
    holder: dict[str, ServerThread] = {}

    def hook(src) -> None:  # runs in the warmup thread, before each template is pinned
        c = Clients(f"127.0.0.1:{holder['st'].server.port}")
        stub = health_pb2_grpc.HealthStub(c.channel)
        overall = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        gen = stub.Check(health_pb2.HealthCheckRequest(service="prefix_service.v1.Generation"), timeout=5).status
        with pytest.raises(grpc.RpcError) as info:
            collect(c.generation.Generate(greedy_request(" the", max_tokens=2), timeout=5))
        with pytest.raises(grpc.RpcError) as server_info:
            c.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert server_info.value.code() == grpc.StatusCode.UNAVAILABLE, server_info.value
        seen.append((src.name, overall, gen, info.value.code(), "warming up" in info.value.details()))
        c.close()

    st = holder["st"] = ServerThread(make_config(model_dir, prefixes=TEMPLATES), warmup_hook=hook)
    st.start()
    try:
        NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
        assert seen == [("doc", NOT_SERVING, NOT_SERVING, grpc.StatusCode.UNAVAILABLE, True),
                        ("sys", NOT_SERVING, NOT_SERVING, grpc.StatusCode.UNAVAILABLE, True)]
        stub = health_pb2_grpc.HealthStub(Clients(st.address).channel)
        for service in ("", "prefix_service.v1.Generation", "prefix_service.v1.PrefixAdmin"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == SERVING
        st.check_clean()
    finally:
        st.stop()


def test_server_info_names_what_the_engine_computes_with(server, clients):
    """GetServerInfo: the served model's id, its context, and the one engine's description, each field
    as the engine itself reports it (EngineInfo)."""
    info = clients.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    (expected,) = server.engine.engine_infos().values()
    assert info.model == server.server.served_name and info.version
    assert info.max_model_len == expected.max_model_len > 0
    (engine,) = info.engines
    assert engine.replica == ""
    assert engine.model == server.config.engine.model.path.rstrip("/").rsplit("/", 1)[-1]
    assert (engine.dtype, engine.kv_cache_dtype, engine.device, engine.backend, engine.backend_description) == (
        expected.dtype, expected.kv_cache_dtype, expected.device, expected.backend, expected.backend_description)
    assert (engine.max_model_len, engine.block_size, engine.num_blocks, engine.quantization) == (
        expected.max_model_len, expected.block_size, expected.num_blocks, expected.quantization)
    assert (engine.batch_invariant, engine.cpu_isa, engine.cpu_march) == (
        expected.batch_invariant, expected.cpu_isa, expected.cpu_march)


def test_server_info_of_a_fleet_lists_its_replicas_in_order_with_their_least_context(server):
    """The conversion a fleet's answer goes through: a replica per engine, in replica order, and the
    request limit the one with the least context sets."""
    import dataclasses

    from prefix_service.server.convert import server_info_to_proto
    (one,) = server.engine.engine_infos().values()
    infos = {"r2": dataclasses.replace(one, max_model_len=100), "r1": dataclasses.replace(one, max_model_len=300)}
    info = server_info_to_proto("base", infos)
    assert [(e.replica, e.max_model_len) for e in info.engines] == [("r1", 300), ("r2", 100)]
    assert (info.model, info.max_model_len) == ("base", 100)
    assert server_info_to_proto("base", {}).max_model_len == 0  # no engine yet


def test_reflection_lists_the_services(server, clients):
    stub = reflection_pb2_grpc.ServerReflectionStub(clients.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"prefix_service.v1.Generation", "prefix_service.v1.PrefixAdmin", "grpc.health.v1.Health"} <= names


# --- status codes --------------------------------------------------------------------------

def test_unknown_prefix_is_not_found(server, clients):
    code, details = code_of(clients.generation.Generate(greedy_request(" hi", "nope")))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in details and "doc" in details  # names the known templates


@pytest.mark.parametrize("sampling, needle", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(stop=["x" * 257]), "at most 256 characters"),
])
def test_bad_sampling_is_invalid_argument(server, clients, sampling, needle):
    req = pb.GenerateRequest(prompt=" the", sampling=pb.SamplingParams(**sampling))
    code, details = code_of(clients.generation.Generate(req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details


def test_an_error_that_quotes_a_long_input_is_cut_short(server, clients):
    """A refusal quotes what it refuses; the status details stay within 1,000 characters (they travel
    in a size-limited trailer), the cut marked."""
    req = pb.GenerateRequest(prompt=" the", sampling=pb.SamplingParams(stop=["x" * 5000]))
    code, details = code_of(clients.generation.Generate(req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop strings must be" in details
    assert len(details) == 1000 and details.endswith("...")


def test_invalid_requests(server, clients):
    cases = [
        (pb.GenerateRequest(prefix_name="doc", prompt=" the table" * 200), "context"),  # prompt too long
        (pb.GenerateRequest(prompt="x", messages=[pb.ChatMessage(role="user", content="y")]), "not both"),
        (pb.GenerateRequest(prompt=""), "empty"),
        (pb.GenerateRequest(prompt="x", request_id="r" * 500), "request_id"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="", content="y")]), "role"),
    ]
    for req, needle in cases:
        code, details = code_of(clients.generation.Generate(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (req, details)
        assert needle in details


def test_queue_full_is_resource_exhausted(make_server):
    st = make_server(max_num_seqs=1, max_queue=1)
    undo = slow_steps(st.engine, 0.01)
    c = Clients(st.address)
    running = c.generation.Generate(greedy_request(" the", "doc", max_tokens=200))
    next(running)  # admitted and running
    waiting = c.generation.Generate(greedy_request(" the", "doc", max_tokens=2))
    deadline = time.monotonic() + 5
    while st.engine.kv_stats()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    code, details = code_of(c.generation.Generate(greedy_request(" the", "doc", max_tokens=2)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in details
    running.cancel()
    undo()
    assert collect(waiting)[2].usage.completion_tokens == 2


def test_engine_stopped_is_unavailable(make_server):
    st = make_server()
    st.engine.shutdown()
    code, details = code_of(Clients(st.address).generation.Generate(greedy_request(" the", "doc")))
    assert code == grpc.StatusCode.UNAVAILABLE and "shut down" in details


def test_request_id_is_echoed_and_duplicates_refused(server, clients):
    undo = slow_steps(server.engine, 0.01)
    try:
        call = clients.generation.Generate(pb.GenerateRequest(prompt=" the", request_id="mine-1",
                                                              sampling=pb.SamplingParams(max_tokens=100)))
        assert next(call).request_id == "mine-1"
        code, details = code_of(clients.generation.Generate(pb.GenerateRequest(prompt=" a", request_id="mine-1")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in details
        call.cancel()
    finally:
        undo()


def test_many_cancels_under_load_leave_no_blocks(server, clients):
    undo = slow_steps(server.engine, 0.002)
    try:
        calls = [clients.generation.Generate(greedy_request(" the", ["doc", "sys", ""][i % 3], max_tokens=300))
                 for i in range(12)]
        for i, call in enumerate(calls):
            if i % 2:
                next(call)
            call.cancel()
        server.check_clean()
    finally:
        undo()


def test_threads_stay_bounded(server, clients):
    before = threading.active_count()
    for _ in range(5):
        collect(clients.generation.Generate(greedy_request(" the", "doc", max_tokens=2)))
    assert threading.active_count() <= before + 8


def test_a_signal_during_the_model_load_exits_without_waiting_for_it(model_dir):
    """SIGTERM while the model loads: serve() stops the server and exits at once (a worker thread
    cannot be interrupted, and the process would wait for it at its exit); the engine that arrives
    after the stop is shut down on the load's thread, not left running."""
    import asyncio
    import os
    import signal

    from prefix_service.engine import Engine
    from prefix_service.server import PrefixServer, serve
    from prefix_service.server.parts import LocalEngineProvider

    entered, release = threading.Event(), threading.Event()
    built: list[Engine] = []
    exits: list[int] = []

    def slow_load(config):  # a load that outlasts the signal
        entered.set()
        assert release.wait(30)
        built.append(Engine(config.engine))
        return built[-1]

    def make(config):
        server = PrefixServer(config, engine_provider=LocalEngineProvider(slow_load))
        server._exit = exits.append
        return server

    async def main() -> None:
        task = asyncio.ensure_future(serve(make_config(model_dir, prefixes=TEMPLATES), make))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 10)  # returns while the load still runs

    asyncio.run(main())
    assert exits == [0]
    release.set()
    deadline = time.monotonic() + 30
    while not (built and not built[0]._thread.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert built and not built[0]._thread.is_alive()  # shut down once its load ended
