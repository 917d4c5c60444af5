"""The OpenAI-compatible HTTP API against a tiny random model on 127.0.0.1, called with the official
`openai` client (and raw HTTP where the client would hide what is sent): templates chosen by
extra_body or by model, streamed and not; chat on a system_prompt template; output equal to
gRPC's token for token; cached_tokens; every error with its status and OpenAI's body; an API
key; a client that goes away frees its blocks; what the metrics and the log line record."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from typing import Callable

import grpc
import openai
import pytest

from server_fixtures import (DOCUMENT, SYSTEM_PROMPT, Clients, ServerThread, assert_error, collect, greedy_request,
                             make_config, raw, slow_steps, started_servers, wait_until)
from server_fixtures import openai_client as client

from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb

TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))
API_KEY_ENV = "PREFIX_SERVICE_TEST_API_KEY"
HTTP = {"http_address": "127.0.0.1:0", "api_key_env": API_KEY_ENV}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_torch_thread):
    st = ServerThread(make_config(model_dir, prefixes=TEMPLATES, metrics_address="127.0.0.1:0",
                                  state_file=tmp_path_factory.mktemp("state") / "state.json", **HTTP)).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def grpc_clients(server):
    c = Clients(server.address)
    yield c
    c.close()


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=TEMPLATES) as factory:
        yield lambda **kw: factory(**{**HTTP, **kw})


@pytest.fixture(autouse=True)
def no_api_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def grpc_ids(clients: Clients, prompt: str, prefix: str = "", max_tokens: int = 8) -> list[int]:
    return collect(clients.generation.Generate(greedy_request(prompt, prefix, max_tokens=max_tokens)))[1]


GREEDY = {"temperature": 0, "max_tokens": 8}
IDS = {"ignore_eos": True, "return_token_ids": True}


# --- the happy paths ----------------------------------------------------------------------------

def test_models_lists_the_model_and_every_template(server):
    models = client(server).models.list().data
    ids = [m.id for m in models]
    assert ids[0] == server.config.engine.model.path.rstrip("/").rsplit("/", 1)[-1]
    assert sorted(ids[1:]) == ["doc", "sys"]
    (info,) = server.engine.engine_infos().values()
    assert models[0].max_model_len == info.max_model_len > 0  # as vLLM's /v1/models gives it
    doc = next(m for m in models if m.id == "doc")
    assert doc.parent == ids[0] and doc.metadata["kind"] == "prefix_template"
    assert doc.metadata["template_tokens"] == server.engine.get_template("doc").num_tokens


def test_one_model_by_its_id(server):
    """GET /v1/models/{id} (the client's models.retrieve): the object /v1/models lists, or a 404."""
    listed = {m["id"]: m for m in raw(server, "GET", "/v1/models")[1]["data"]}
    for model_id, listed_one in listed.items():
        status, got = raw(server, "GET", f"/v1/models/{model_id}")
        assert status == 200 and {k: v for k, v in got.items() if k != "created"} == \
            {k: v for k, v in listed_one.items() if k != "created"}
    assert client(server).models.retrieve("doc").metadata["template_tokens"] == listed["doc"]["metadata"][
        "template_tokens"]
    assert_error(raw(server, "GET", "/v1/models/nope"), 404, "model_not_found", "model")


def test_tokenize_counts_the_tokens_a_generation_takes(server):
    """POST /tokenize gives what a generation on the same template takes: its own ids (count), the
    template's count, and prompt_tokens equal to the generation's usage; /detokenize gives the text back."""
    base = raw(server, "GET", "/v1/models")[1]["data"][0]
    tok = server.engine.tokenizer
    chat = [{"role": "user", "content": "Which row has the lowest price?"}]
    cases = [({"model": "doc", "prompt": " the order has a price row"}, "/v1/completions"),
             ({"prompt": "Hello there, table"}, "/v1/completions"),
             ({"model": "sys", "messages": chat}, "/v1/chat/completions"),
             ({"messages": chat}, "/v1/chat/completions")]
    for body, route in cases:
        status, got = raw(server, "POST", "/tokenize", body)
        assert status == 200, got
        status, done = raw(server, "POST", route, {**body, "max_tokens": 1, "temperature": 0})
        assert status == 200, done
        assert got["prompt_tokens"] == got["prefix_tokens"] + got["count"] == done["usage"]["prompt_tokens"], body
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == base["max_model_len"]
        template = body.get("model")
        assert got["prefix_tokens"] == (server.engine.get_template(template).num_tokens if template else 0)
        if "prompt" in body:  # on a template the prompt continues it: no special tokens
            assert got["tokens"] == tok.encode(body["prompt"], add_special_tokens=template is None)
            assert raw(server, "POST", "/detokenize", {"tokens": got["tokens"]}) == (200, {"prompt": body["prompt"]})
    same = raw(server, "POST", "/tokenize", {"prefix_name": "doc", "prompt": " the order has a price row"})[1]
    assert same == raw(server, "POST", "/tokenize", cases[0][0])[1]


@pytest.mark.parametrize("route,body,status,code,param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
    ("/tokenize", {"prefix_name": "nope", "prompt": "x"}, 404, "prefix_not_found", "prefix_name"),
    ("/tokenize", {"prompt": "x", "add_generation": 1}, 400, "invalid_value", "add_generation"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "invalid_value",
     "messages.0.content.0"),
    ("/tokenize", {"messages": []}, 400, "invalid_value", "messages"),
    ("/detokenize", {"tokens": [5, -1]}, 400, "invalid_value", "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "invalid_value", "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [5]}, 404, "model_not_found", "model"),
    ("/detokenize", {}, 400, "invalid_value", "tokens"),
])
def test_tokenize_errors_name_the_field(server, route, body, status, code, param):
    assert_error(raw(server, "POST", route, body), status, code, param)


def test_completion_on_a_template_equals_grpc_token_for_token(server, grpc_clients):
    expected = grpc_ids(grpc_clients, " the order", "doc")
    api = client(server)
    by_body = api.completions.create(model=ids_model(server), prompt=" the order", **GREEDY,
                                     extra_body={"prefix_name": "doc", **IDS})
    by_model = api.completions.create(model="doc", prompt=" the order", **GREEDY, extra_body=IDS)
    for resp in (by_body, by_model):
        choice = resp.choices[0]
        assert choice.model_extra["token_ids"] == expected
        assert choice.text == server.engine.tokenizer.decode(expected)
        assert choice.finish_reason == "length"
        doc_tokens = server.engine.get_template("doc").num_tokens
        assert resp.usage.prompt_tokens_details.cached_tokens == doc_tokens
        assert resp.usage.completion_tokens == 8
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert by_model.model == "doc"


def ids_model(st: ServerThread) -> str:
    return client(st).models.list().data[0].id


def test_streamed_completion_equals_the_whole_one(server, grpc_clients):
    expected = grpc_ids(grpc_clients, " the price", "doc")
    chunks = list(client(server).completions.create(
        model="doc", prompt=" the price", stream=True, stream_options={"include_usage": True}, **GREEDY,
        extra_body=IDS))
    text_chunks = [c for c in chunks if c.choices]
    assert [t for c in text_chunks for t in c.choices[0].model_extra["token_ids"]] == expected
    assert "".join(c.choices[0].text for c in text_chunks) == server.engine.tokenizer.decode(expected)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 8
    assert usage.usage.prompt_tokens_details.cached_tokens == server.engine.get_template("doc").num_tokens
    for path, body in (("/v1/completions", {"prompt": " the price"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the price"}]})):
        for include in (True, False):  # OpenAI's: "usage": null on every chunk but the last, when asked
            status, text = raw(server, "POST", path, {"model": "doc", "stream": True, "max_tokens": 3,
                                                      "stream_options": {"include_usage": include}, **body})
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert status == 200 and len(events) > 1
            if include:
                assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 3
            else:
                assert not any("usage" in e for e in events)


def test_prompt_as_token_ids_and_without_a_template(server, grpc_clients):
    api = client(server)
    ids = server.engine.tokenizer.encode(" the row", add_special_tokens=False)
    by_ids = api.completions.create(model="doc", prompt=ids, **GREEDY, extra_body=IDS)
    assert by_ids.choices[0].model_extra["token_ids"] == grpc_ids(grpc_clients, " the row", "doc")
    plain = api.completions.create(model=ids_model(server), prompt="the order has a price", **GREEDY, extra_body=IDS)
    assert plain.choices[0].model_extra["token_ids"] == grpc_ids(grpc_clients, "the order has a price")
    assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_on_a_system_prompt_template_equals_grpc(server, grpc_clients):
    req = pb.GenerateRequest(prefix_name="sys", messages=[pb.ChatMessage(role="user", content="refund the order")],
                             sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True))
    expected_text, expected, last = collect(grpc_clients.generation.Generate(req))
    api = client(server)
    messages = [{"role": "user", "content": "refund the order"}]
    whole = api.chat.completions.create(model="sys", messages=messages, **GREEDY, extra_body=IDS)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected_text
    assert whole.choices[0].model_extra["token_ids"] == expected
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.usage.prompt_tokens_details.cached_tokens == last.usage.prefix_tokens > 0
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens

    chunks = list(api.chat.completions.create(model=ids_model(server), messages=messages, stream=True, **GREEDY,
                                              extra_body={"prefix_name": "sys", **IDS}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_an_assistant_reply_sent_back_whole_continues_the_conversation(server):
    """A client appends the message it got (with OpenAI's null refusal, tool_calls, audio...) and
    asks again: the same tokens as the plain role and content; a refusal stands for absent content."""
    api = client(server)
    first = [{"role": "user", "content": "refund the order"}]
    reply = api.chat.completions.create(model="sys", messages=first, **GREEDY).choices[0].message
    sent = reply.model_dump()
    assert {"refusal", "tool_calls", "audio", "function_call"} <= set(sent)

    def ids(messages):
        return api.chat.completions.create(model="sys", messages=messages + [{"role": "user", "content": "why"}],
                                           **GREEDY, extra_body=IDS).choices[0].model_extra["token_ids"]
    assert ids(first + [sent]) == ids(first + [{"role": "assistant", "content": reply.content}])
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that", "annotations": []}
    assert ids(first + [refused]) == ids(first + [{"role": "assistant", "content": "I cannot help with that"}])


def test_a_negative_seed_is_its_64_bits_unsigned(server):
    api = client(server)

    def text(seed):
        return api.completions.create(model="doc", prompt=" the", temperature=1.0, seed=seed, max_tokens=8,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert text(-5) == text(2**64 - 5) != text(5)
    assert_error(raw(server, "POST", "/v1/completions", {"prompt": "x", "seed": -2**63 - 1}), 400, "invalid_value",
                 "seed")


def test_a_stream_ends_with_done(server):
    status, text = raw(server, "POST", "/v1/chat/completions",
                       {"model": "sys", "messages": [{"role": "user", "content": "order"}], "max_tokens": 3,
                        "stream": True, "ignore_eos": True})
    assert status == 200
    events = [line for line in text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sampling_with_a_seed_repeats(server):
    api = client(server)
    runs = [api.completions.create(model="doc", prompt=" the", temperature=1.0, top_p=0.9, seed=7, max_tokens=6,
                                   extra_body={"ignore_eos": True, "top_k": 20}).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_health(server):
    assert raw(server, "GET", "/health")[0] == 200


# --- errors -------------------------------------------------------------------------------------

def test_unknown_model_and_template_are_404(server):
    assert_error(raw(server, "POST", "/v1/completions", {"model": "nope", "prompt": "x"}), 404, "model_not_found",
                 "model")
    assert_error(raw(server, "POST", "/v1/completions", {"prompt": "x", "prefix_name": "nope"}), 404,
                 "prefix_not_found", "prefix_name")
    assert_error(raw(server, "POST", "/v1/scores", {"prompt": "x", "prefix_name": "nope", "candidates": ["a"]}), 404,
                 "prefix_not_found", "prefix_name")
    with pytest.raises(openai.NotFoundError) as info:
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {" 5 ": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\u0663": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 60, "05": 60}}, "logit_bias"),  # one token twice: 120 in all
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [1, -5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "model": "doc", "prefix_name": "sys"}, "prefix_name"),
    ({}, "prompt"),
])
def test_bad_completion_values_are_400_naming_the_field(server, body, param):
    err = assert_error(raw(server, "POST", "/v1/completions", body), 400, "invalid_value", param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text"}]}]},
     "messages.0.content.1.text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "detail": 1}]}]},
     "messages.0.content.0.detail"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
])
def test_bad_chat_values_are_400(server, body, param):
    assert_error(raw(server, "POST", "/v1/chat/completions", body), 400, "invalid_value", param)


def test_a_max_tokens_past_the_context_is_context_length_exceeded(server, grpc_clients):
    """As vLLM and OpenAI answer: a max_tokens (or max_completion_tokens) that cannot fit the context beside
    the prompt and its template is a 400 naming the field and the room left; gRPC's INVALID_ARGUMENT."""
    ctx = raw(server, "GET", "/v1/models")[1]["data"][0]["max_model_len"]
    err = assert_error(raw(server, "POST", "/v1/completions", {"model": "doc", "prompt": "x", "max_tokens": ctx}),
                       400, "context_length_exceeded", "max_tokens")
    assert f"the model's context is {ctx} tokens: ask for at most" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": ctx}
    err = assert_error(raw(server, "POST", "/v1/chat/completions", chat), 400, "context_length_exceeded",
                       "max_completion_tokens")
    assert err["message"].startswith(f"max_completion_tokens {ctx} and the prompt's")
    assert "leave max_completion_tokens unset" in err["message"]
    with pytest.raises(grpc.RpcError) as refused:
        collect(grpc_clients.generation.Generate(greedy_request("x", "doc", max_tokens=ctx)))
    details = refused.value.details()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ask for at most" in details
    room = int(details.split("ask for at most ")[1].split(",")[0])  # exactly the room left still runs
    status, body = raw(server, "POST", "/v1/completions", {"model": "doc", "prompt": "x", "max_tokens": room,
                                                           "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == room, body
    server.check_clean()


def test_malformed_and_oversized_bodies(server):
    assert_error(raw(server, "POST", "/v1/completions", b"{not json"), 400, "invalid_value")
    assert_error(raw(server, "POST", "/v1/completions", b"[1, 2]"), 400, "invalid_value")
    assert_error(raw(server, "POST", "/v1/completions", b"\xff\xfe"), 400, "invalid_value")
    big = json.dumps({"prompt": "x" * (5 << 20)})
    assert_error(raw(server, "POST", "/v1/completions", big), 413, "request_too_large")
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    assert_error(raw(server, "GET", "/v1/completions"), 405, "method_not_allowed")
    server.check_clean()


def test_a_prompt_over_the_limit_is_400(make_server):
    st = make_server(max_prompt_tokens=4)
    err = assert_error(raw(st, "POST", "/v1/completions", {"model": "doc", "prompt": " the order has a price row"}),
                       400, "context_length_exceeded", "prompt")
    assert "scheduler.max_prompt_tokens" in err["message"]


def test_queue_full_is_429(make_server):
    st = make_server(max_num_seqs=1, max_queue=1)
    undo = slow_steps(st.engine, 0.05)
    c = Clients(st.address)
    try:
        running = c.generation.Generate(greedy_request(" the", "doc", max_tokens=200))
        next(running)  # running
        waiting = c.generation.Generate(greedy_request(" the", "doc", max_tokens=200))
        deadline = time.monotonic() + 10
        while st.engine.kv_stats()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client(st).completions.create(model="doc", prompt=" x", max_tokens=2)
        assert info.value.body["code"] == "queue_full"
        running.cancel()
        waiting.cancel()
    finally:
        undo()
        c.close()


def test_a_request_the_cache_can_never_hold_is_429(make_server):
    st = make_server(num_blocks=80, prefix_budget_blocks=60)  # 320 tokens, ~190 of them the templates'
    err = assert_error(raw(st, "POST", "/v1/completions", {"model": "doc", "prompt": " the" * 200}), 429,
                       "cache_exhausted")
    assert err["type"] == "rate_limit_error"


def test_api_key(make_server, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(API_KEY_ENV, "k3y-secret")
    st = make_server()
    assert raw(st, "GET", "/health")[0] == 200  # open: load balancers probe it
    err = assert_error(raw(st, "POST", "/v1/completions", {"prompt": "x"}), 401, "missing_api_key")
    assert err["type"] == "authentication_error"
    assert_error(raw(st, "GET", "/v1/models", headers={"Authorization": "Bearer nope"}), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        client(st, "wrong").completions.create(model="doc", prompt=" the", max_tokens=2)
    ok = client(st, "k3y-secret").completions.create(model="doc", prompt=" the", max_tokens=2,
                                                      extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2
    assert "k3y-secret" not in caplog.text and "nope" not in caplog.text


def test_warming_up_is_503(model_dir, tmp_path):
    seen = []
    holder: dict[str, ServerThread] = {}

    def hook(name: str) -> None:  # runs while the templates warm up, the HTTP API already listening
        st = holder["st"]
        seen.append((assert_error(raw(st, "GET", "/health"), 503, "unavailable")["type"],
                     assert_error(raw(st, "POST", "/v1/completions", {"prompt": "x"}), 503, "unavailable")["code"],
                     raw(st, "GET", "/v1/models")[0]))

    st = holder["st"] = ServerThread(make_config(model_dir, prefixes=TEMPLATES, state_file=tmp_path / "s.json",
                                                 **HTTP), warmup_hook=hook)
    st.start()
    try:
        assert seen == [("server_error", "unavailable", 503)] * 2
        assert raw(st, "GET", "/health")[0] == 200
    finally:
        st.stop()


# --- a client that goes away --------------------------------------------------------------------

def test_a_dropped_stream_frees_its_blocks(make_server):
    st = make_server(metrics_address="127.0.0.1:0")
    undo = slow_steps(st.engine, 0.02)
    try:
        stream = client(st).completions.create(model="doc", prompt=" the", max_tokens=350, stream=True,
                                               extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert st.engine.kv_stats()["running"] == 1
        stream.close()
        st.check_clean()  # integrity, nothing running, only the templates' blocks held
    finally:
        undo()
    samples = scrape(st.server.metrics_port)
    assert samples.get(("prefix_service_requests_total", (("code", "CANCELLED"), ("protocol", "http"),
                                                          ("template", "doc")))) == 1
    assert samples[("prefix_service_kv_blocks_used", ())] == samples[("prefix_service_kv_blocks_pinned", ())]
    assert samples[("prefix_service_running_requests", ())] == 0


def test_a_closed_connection_aborts_a_whole_response(make_server):
    st = make_server()
    undo = slow_steps(st.engine, 0.02)
    try:
        body = json.dumps({"model": "doc", "prompt": " the", "max_tokens": 350, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", st.server.http_port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while st.engine.kv_stats()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()
        st.check_clean()
    finally:
        undo()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_the_first_token_is_not_computed_for_nobody(make_server, caplog, stream):
    """A client that closes its connection while its prompt waits or is prefilled (here ~19 chunked
    steps) aborts it then: no first token is computed for it. (The server noticed only at the
    first token, so an abandoned request was still prefilled.)"""
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(max_num_batched_tokens=16)
    undo = slow_steps(st.engine, 0.05)
    try:
        body = json.dumps({"prompt": list(range(10, 310)), "max_tokens": 4, "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", st.server.http_port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while st.engine.kv_stats()["running"] + st.engine.kv_stats()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()
        while not [r for r in caplog.records if r.name == "prefix_service.requests"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        st.check_clean()
    finally:
        undo()
    line, = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert (line["code"], line["ttft_ms"]) == ("CANCELLED", None), line


def _request_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]


def _one_request_cancelled(st, caplog, act: Callable[[], None]) -> None:
    """act(), on an engine whose steps are slowed, leaves one request behind that is aborted: its
    log line says CANCELLED, 499, and nothing is left running or holding blocks."""
    undo = slow_steps(st.engine, 0.05)
    try:
        act()
        wait_until(lambda: _request_lines(caplog), 10)
        st.check_clean()
    finally:
        undo()
    line, = _request_lines(caplog)
    assert (line["code"], line["http_status"]) == ("CANCELLED", 499), line


def test_a_client_gone_from_a_score_aborts_it(make_server, caplog):
    """A label score whose client closes the connection is aborted and counted CANCELLED, as a
    generation is (it was computed to the end for nobody and counted OK)."""
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(max_num_batched_tokens=16)

    def leave_a_score() -> None:
        body = json.dumps({"prompt": list(range(10, 310)), "candidates": [" the", " a row"]}).encode()
        sock = socket.create_connection(("127.0.0.1", st.server.http_port))
        sock.sendall(b"POST /v1/scores HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: st.engine.kv_stats()["running"] + st.engine.kv_stats()["waiting"] >= 1, 10)
        sock.close()
    _one_request_cancelled(st, caplog, leave_a_score)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/scores", "/tokenize"])
def test_a_client_gone_in_the_middle_of_its_body_is_cancelled_not_an_error(server, caplog, path):
    """The connection closes before the body declared by Content-Length has come: nobody is
    answered, nothing is logged as a server error and the request counts CANCELLED (it was a 500,
    INTERNAL, with a traceback)."""
    caplog.set_level(logging.INFO, logger="prefix_service")
    before = len(_request_lines(caplog))
    sock = socket.create_connection(("127.0.0.1", server.server.http_port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 400\r\n\r\n".encode() + b'{"model": "doc", "prompt": "the ta')
    time.sleep(0.2)
    sock.close()
    if path != "/tokenize":  # counted, as every generation and score is
        wait_until(lambda: len(_request_lines(caplog)) > before, 10)
        assert (_request_lines(caplog)[-1]["code"], _request_lines(caplog)[-1]["http_status"]) == ("CANCELLED", 499)
    else:
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    server.check_clean()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "doc", "prompt": " the", "max_tokens": 300, "ignore_eos": True}),
    ("/v1/scores", {"model": "doc", "prompt": list(range(10, 310)), "candidates": [" the", " a row"]})])
def test_a_handler_cancelled_by_a_proxy_in_front_counts_its_request_cancelled(make_server, caplog, path, body):
    """Behind a proxy that cancels the handler when its client goes (Ray Serve's does), the request is
    aborted and counted CANCELLED with a 499 log line (it was neither counted nor logged)."""
    from starlette.requests import Request

    from prefix_service.server.auth import ApiKeyAuth
    from prefix_service.server.openai_api import OpenAIApi

    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(max_num_batched_tokens=16)
    api = OpenAIApi(st.server.runtime, st.server.metrics, ApiKeyAuth(None), st.server.served_name)
    sent: list[bytes] = []

    async def receive():  # the body, then nothing more: the app itself never sees the client go
        if not sent:
            sent.append(data := json.dumps(body).encode())
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def main() -> None:
        handler = api.completions if path == "/v1/completions" else api.scores
        task = asyncio.ensure_future(handler(Request(scope, receive)))
        while st.engine.kv_stats()["running"] + st.engine.kv_stats()["waiting"] < 1:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    _one_request_cancelled(st, caplog, lambda: asyncio.run(main()))


def test_log_line_and_metrics_name_the_protocol(server, grpc_clients, caplog):
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    before = scrape(server.server.metrics_port)
    client(server).completions.create(model="doc", prompt=" the", max_tokens=2)
    raw(server, "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    grpc_ids(grpc_clients, " the", "doc", max_tokens=2)
    after = scrape(server.server.metrics_port)

    def delta(protocol: str, prefix: str, code: str) -> float:
        key = ("prefix_service_requests_total", (("code", code), ("protocol", protocol), ("template", prefix)))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("http", "doc", "OK") == 1
    assert delta("http", "_unknown", "NOT_FOUND") == 1  # as gRPC counts an unknown prefix_name
    assert delta("grpc", "doc", "OK") == 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert [(line["protocol"], line["code"], line.get("http_status"), line["template"]) for line in lines] == \
        [("http", "OK", 200, "doc"), ("http", "NOT_FOUND", 404, "nope"), ("grpc", "OK", None, "doc")]


def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_stop_ends_http_streams_and_frees_blocks(make_server):
    st = make_server(grace_period_s=0.2)
    undo = slow_steps(st.engine, 0.02)
    try:
        stream = client(st).completions.create(model="doc", prompt=" the", max_tokens=350, stream=True,
                                               extra_body={"ignore_eos": True})
        next(iter(stream))
        engine = st.engine
        st.stop(grace=0.2)
        with pytest.raises(openai.APIError, match="cut off"):  # the error event ends the stream
            for _ in stream:
                pass
        engine.shutdown()
        engine._core.check_integrity()
        assert engine._core.kv_stats()["running"] == 0
    finally:
        undo()


def test_requests_still_running_when_the_grace_period_ends_get_an_answer(make_server, caplog):
    """At the end of the grace period each HTTP request in flight is answered, not dropped: a stream
    ends with an `unavailable` error event, a whole response (running or still queued) is a 503; the
    requests are aborted and uvicorn has no task left to cancel."""
    st = make_server(grace_period_s=0.5, max_num_seqs=2)
    undo = slow_steps(st.engine, 0.02)
    conns = [http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=60) for _ in range(3)]
    try:
        long = {"model": "doc", "prompt": " the", "max_tokens": 350, "ignore_eos": True}
        conns[0].request("POST", "/v1/completions", json.dumps({**long, "stream": True}),
                         {"Content-Type": "application/json"})
        streamed = conns[0].getresponse()
        assert streamed.status == 200 and streamed.readline().startswith(b"data: {")  # running
        for conn in conns[1:]:  # one runs beside the stream, one waits for a place
            conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
        wait_until(lambda: st.engine.kv_stats()["waiting"] == 1, what="a request waiting for a place")
        engine = st.engine
        with caplog.at_level(logging.DEBUG):
            st.stop(grace=0.5)
        events = [line for line in streamed.read().decode().split("\n\n") if line]
        assert events[-1].startswith('data: {"error":') and "data: [DONE]" not in events, events[-3:]
        error = json.loads(events[-1][len("data: "):])["error"]
        assert (error["code"], error["type"]) == ("unavailable", "server_error") and "cut off" in error["message"]
        for conn in conns[1:]:
            answer = conn.getresponse()
            body = json.loads(answer.read())
            assert answer.status == 503 and body["error"]["code"] == "unavailable", body
        assert not [r for r in caplog.records if "Cancel" in r.getMessage() or r.exc_info], \
            [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        engine.shutdown()
        engine._core.check_integrity()
        assert engine._core.kv_stats()["running"] == engine._core.kv_stats()["waiting"] == 0
        cut = st.server.metrics.registry.get_sample_value(
            "prefix_service_requests_total", {"code": "UNAVAILABLE", "protocol": "http", "template": "doc"})
        assert cut == 3
    finally:
        undo()
        for conn in conns:
            conn.close()


def test_a_score_still_running_when_the_grace_period_ends_is_a_503(make_server):
    st = make_server(grace_period_s=0.2)
    undo = slow_steps(st.engine, 1.0)
    answers: list = []
    try:
        body = {"model": "doc", "prompt": " the order", "candidates": [" yes", " no"]}
        thread = threading.Thread(target=lambda: answers.append(raw(st, "POST", "/v1/scores", body)))
        thread.start()
        wait_until(lambda: st.server.http_front._api.in_flight() == 1, what="the score in flight")
        engine = st.engine
        st.stop(grace=0.2)
        thread.join(30)
        err = assert_error(answers[0], 503, "unavailable")
        assert "cut off" in err["message"]
        engine.shutdown()
        engine._core.check_integrity()
        assert engine._core.kv_stats()["running"] == 0
    finally:
        undo()


def test_a_stream_that_starts_after_the_cut_off_ends_after_its_first_output():
    """A response whose stream begins once the grace period is over (its first output came just
    before) sends that output, then the error event, and closes the engine's stream (the abort)."""
    from prefix_service.engine.sequence import RequestOutput
    from prefix_service.server.openai_api import OpenAIApi, _Shape

    class Trace:
        http_status = code = None
        request_id = "r"

        def output(self, out):
            pass

        def end(self):
            pass

    closed = []

    async def engine_stream():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield RequestOutput("r", " first", [5])
        finally:
            closed.append(True)

    async def run():
        api = OpenAIApi.__new__(OpenAIApi)
        api._cut, api._streams = asyncio.Event(), set()
        api.cut_off()
        stream = engine_stream()
        first = await anext(stream)  # as the request's first output is read before its response starts
        events = [e async for e in api._stream(first, stream, _Shape(False, "r", "m", False), Trace(), False, 1)]
        await asyncio.sleep(0.05)  # the cancelled pump closes the engine's stream
        return events, list(closed)  # (asyncio.run closes what is left open as it ends)

    events, closed_in_time = asyncio.run(run())
    assert len(events) == 2 and b'"text":" first"' in events[0] and b'"code":"unavailable"' in events[1], events
    assert closed_in_time == [True]


def test_http_off_by_empty_address(make_server):
    st = make_server(http_address="")
    assert st.server.http_port is None


def test_a_taken_http_port_fails_the_start(make_server, model_dir, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="server.http_address"):
            ServerThread(make_config(model_dir, http_address=f"127.0.0.1:{port}",
                                     state_file=tmp_path / "s.json")).start()
    finally:
        taken.close()


def test_a_grpc_port_another_grpc_server_holds_fails_the_start(model_dir, tmp_path, capfd):
    """gRPC servers share ports by default (SO_REUSEPORT): a second one bound the port too, and the
    calls were split between the two processes. Now the start fails naming the address and its
    setting, in one line of our own (no gRPC core log line before it)."""
    from concurrent import futures
    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        capfd.readouterr()
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(server.address\): Address already in "
                                          r"use \(is another server"):
            ServerThread(make_config(model_dir, address=f"127.0.0.1:{port}", state_file=tmp_path / "s.json")).start()
        assert "add_port" not in capfd.readouterr().err
        admin = make_config(model_dir, address="127.0.0.1:0", admin_address=f"127.0.0.1:{port}",
                            state_file=tmp_path / "s.json")
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(server.admin_address\)"):
            ServerThread(admin).start()
    finally:
        other.stop(None)


def test_tls_from_the_server_settings(make_server, tmp_path):
    import ssl

    from server_fixtures import self_signed_cert
    cert, key = self_signed_cert(tmp_path / "tls")
    st = make_server(tls_cert_file=str(cert), tls_key_file=str(key))
    ctx = ssl.create_default_context(cafile=str(cert))
    conn = http.client.HTTPSConnection("127.0.0.1", st.server.http_port, context=ctx, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "doc", "prompt": " the", "max_tokens": 2}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] >= 1
    conn.close()
    plain = http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # no plaintext side door
        plain.request("GET", "/health")
        plain.getresponse()
    plain.close()


def test_one_error_table_for_both_protocols():
    from prefix_service.errors import CacheExhausted, PromptTooLong, QueueFull
    from prefix_service.server.status import ChatTemplateMismatch, ModelNotFound, ServerNotReady, classify
    expected = {ModelNotFound("m"): (grpc.StatusCode.NOT_FOUND, 404, "model_not_found"),
                CacheExhausted("c"): (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "cache_exhausted"),
                PromptTooLong("p"): (grpc.StatusCode.INVALID_ARGUMENT, 400, "context_length_exceeded"),
                QueueFull("q"): (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full"),
                ChatTemplateMismatch("t"): (grpc.StatusCode.FAILED_PRECONDITION, 409, "chat_template_mismatch"),
                ServerNotReady("s"): (grpc.StatusCode.UNAVAILABLE, 503, "unavailable"),
                RuntimeError("boom"): (grpc.StatusCode.INTERNAL, 500, "internal_error")}
    for exc, (code, status, name) in expected.items():
        kind, message = classify(exc)
        assert (kind.grpc_code, kind.http_status, kind.code) == (code, status, name), exc
    assert "boom" not in classify(RuntimeError("boom"))[1]  # internals stay in the log


def test_stop_strings_end_a_completion(server):
    """`stop`, a string or a list, reaches the engine: the text ends before it, finish_reason stop."""
    base = {"model": "doc", "prompt": " the", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = raw(server, "POST", "/v1/completions", base)[1]["choices"][0]["text"]
    stop = full[6:9]
    assert stop.strip()
    for given in (stop, [stop]):
        status, body = raw(server, "POST", "/v1/completions", {**base, "stop": given})
        assert status == 200, body
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (full[:full.index(stop)], "stop"), given


def test_top_k_reaches_the_engine(server):
    """top_k 1 at temperature 1 draws the greedy tokens, where the same seed without it does not."""
    base = {"model": "doc", "prompt": " the", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}

    def ids(**kw) -> list[int]:
        status, body = raw(server, "POST", "/v1/completions", {**base, **kw})
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    greedy = ids(temperature=0)
    seed = next(s for s in range(10) if ids(temperature=1.0, seed=s) != greedy)  # a seed that samples off greedy
    assert ids(temperature=1.0, seed=seed, top_k=1) == greedy


def test_ignore_eos_is_passed_through(server):
    """With the end-of-text token made certain, ignore_eos keeps generating to max_tokens."""
    eos = server.engine.tokenizer.eos_token_id
    base = {"model": "doc", "prompt": " the", "max_tokens": 4, "temperature": 0, "logit_bias": {str(eos): 100}}
    stopped = raw(server, "POST", "/v1/completions", base)[1]
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", 1)
    kept = raw(server, "POST", "/v1/completions", {**base, "ignore_eos": True})[1]
    assert (kept["choices"][0]["finish_reason"], kept["usage"]["completion_tokens"]) == ("length", 4)


def test_the_x_request_id_header_names_the_request(server, caplog):
    """A client's x-request-id is the request's id: in the response's id and in its log line."""
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    for path, body, prefix in (("/v1/completions", {"prompt": " the"}, "cmpl-"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "chatcmpl-")):
        rid = f"mine-{prefix}42"
        status, got = raw(server, "POST", path, {"model": "doc", "max_tokens": 2, **body},
                          headers={"x-request-id": rid})
        assert status == 200 and got["id"] == prefix + rid, got
        assert _request_lines(caplog)[-1]["request_id"] == rid


def test_max_tokens_and_max_completion_tokens_must_agree(server):
    """Two different values are a 400 naming max_completion_tokens; the same value is fine."""
    body = {"model": "sys", "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    assert_error(raw(server, "POST", "/v1/chat/completions", {**body, "max_tokens": 3, "max_completion_tokens": 4}),
                 400, "invalid_value", "max_completion_tokens")
    status, got = raw(server, "POST", "/v1/chat/completions", {**body, "max_tokens": 3, "max_completion_tokens": 3})
    assert status == 200 and got["usage"]["completion_tokens"] == 3, got


API_ROUTES = [
    ("POST", "/v1/completions", {"model": "doc", "prompt": " the", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": "doc", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", "/v1/scores", {"model": "doc", "prompt": " the", "candidates": [" order"]}),
    ("POST", "/tokenize", {"model": "doc", "prompt": " the"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/doc", None),
]


def test_every_api_route_needs_the_api_key(make_server, monkeypatch):
    """With an API key set, each route of the API (not /health) is a 401 without it or with a wrong
    one, with OpenAI's body and `WWW-Authenticate: Bearer`; with the key it answers."""
    monkeypatch.setenv(API_KEY_ENV, "k3y")
    st = make_server()

    def answer(method: str, path: str, body: dict | None, headers: dict):
        conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=60)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read()), resp.getheader("WWW-Authenticate")
        finally:
            conn.close()

    for method, path, body in API_ROUTES:
        for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key")):
            status, got, challenge = answer(method, path, body, headers)
            assert_error((status, got), 401, code)
            assert challenge == "Bearer", path
        status, got, _ = answer(method, path, body, {"Authorization": "Bearer k3y"})
        assert status == 200, (path, got)


def _streaming_completion(st, max_tokens: int):
    """A streamed completion on "doc", read up to its first chunk: (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "doc", "prompt": " the", "max_tokens": max_tokens,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    return conn, resp


def _rest_of_the_stream(resp) -> list[str]:
    return [e.strip() for e in resp.read().decode().split("\n\n") if e.strip()]


def test_an_engine_stopped_mid_stream_is_counted_unavailable(make_server, caplog):
    """A stream ended by an error (its engine stopped under it) ends with an `unavailable` error
    event, and is counted and logged UNAVAILABLE, not CANCELLED (the client's doing)."""
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    st = make_server(metrics_address="127.0.0.1:0")
    undo = slow_steps(st.engine, 0.02)
    conn, resp = _streaming_completion(st, 300)
    try:
        st.engine.shutdown()
        events = _rest_of_the_stream(resp)
        assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "unavailable", events[-2:]
    finally:
        undo()
        conn.close()
    line = wait_until(lambda: _request_lines(caplog), 10)[-1]
    assert (line["code"], line["http_status"]) == ("UNAVAILABLE", 200), line
    assert st.server.metrics.registry.get_sample_value(
        "prefix_service_requests_total", {"protocol": "http", "template": "doc", "code": "UNAVAILABLE"}) == 1


def test_an_http_stream_is_cut_off_when_the_grace_period_ends(make_server, monkeypatch):
    """The cut-off comes at the end of the grace period, not at the end of the HTTP server's own wait
    after it (made 20 s here, so that the two are far apart)."""
    monkeypatch.setattr("prefix_service.server.parts.CUT_OFF_S", 20.0)
    st = make_server(grace_period_s=0.3)
    undo = slow_steps(st.engine, 0.02)
    conn, resp = _streaming_completion(st, 350)
    try:
        start = time.monotonic()
        st.stop(grace=0.3, wait=False)
        events = _rest_of_the_stream(resp)
        elapsed = time.monotonic() - start
        assert "cut off" in json.loads(events[-1].removeprefix("data: "))["error"]["message"]
        assert elapsed < 10, elapsed  # 0.3 s and a step; 20 s when the HTTP server's wait decides
    finally:
        undo()
        conn.close()
        st.stop()
