"""Fuzzed HTTP bodies (hypothesis): random JSON of every type in the known fields, unknown fields,
bytes that are no JSON, huge numbers and strings. The server never answers 5xx, always answers an
error in OpenAI's shape, stays up, and holds no request or block afterwards."""
from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, ServerThread, make_config

from prefix_service.config import TemplateSpec

FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))

pytestmark = pytest.mark.usefixtures("one_torch_thread")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-2, 20),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
                    st.sampled_from(["doc", "sys", "user", "text", "the order"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
COMPLETION_FIELDS = ["model", "prompt", "prefix_name", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                     "stream", "stream_options", "n", "echo", "logprobs", "ignore_eos", "return_token_ids",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f != "prompt"] + ["messages", "max_completion_tokens", "tools",
                                                                  "top_logprobs"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.text("the order price refund ", max_size=40)})
common = {"max_tokens": st.integers(1, 3), "temperature": st.sampled_from([0, 0.7, 1]), "stream": st.booleans(),
          "ignore_eos": st.booleans(), "seed": st.integers(0, 2**63), "top_p": st.sampled_from([0.5, 1]),
          "stop": st.lists(st.text("the ", min_size=1, max_size=4), max_size=2),
          "return_token_ids": st.booleans()}
tame = {
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.sampled_from(["doc", "sys", "nope"]), "prompt": st.text("the order price ", max_size=40)},
        optional=common),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.sampled_from(["doc", "sys", "nope"]), "messages": st.lists(message, min_size=1, max_size=3)},
        optional=common),
}
FIELDS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}


@st.composite
def bodies(draw, path: str) -> bytes:
    """A third valid, a third with some fields wild (or unknown ones added), some no JSON object at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.one_of(st.binary(max_size=60), st.text(max_size=60).map(str.encode),
                              values.map(lambda v: json.dumps(v).encode())))
    body = draw(tame[path])
    if kind >= 4:
        for name in draw(st.lists(st.sampled_from(FIELDS[path]), unique=True, min_size=1, max_size=3)):
            body[name] = draw(values)
        if draw(st.integers(0, 3)) == 0:
            body[draw(st.text(min_size=1, max_size=10))] = draw(values)
        body.setdefault("max_tokens", 3)  # keep the valid ones short
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_torch_thread):
    st_ = ServerThread(make_config(model_dir, prefixes=TEMPLATES, max_tokens_cap=8, default_max_tokens=3,
                                   http_address="127.0.0.1:0",
                                   state_file=tmp_path_factory.mktemp("state") / "state.json")).start()
    yield st_
    st_.stop()


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check(server: ServerThread, path: str, body: bytes) -> None:
    status, data = post(server.server.http_port, path, body)
    event(f"HTTP {status}")
    assert status < 500, (body, data)
    if status != 200:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], data
    elif data.startswith(b"data: "):
        assert data.rstrip().endswith(b"data: [DONE]"), data
    else:
        assert json.loads(data)["choices"], data


@FUZZ
@given(body=bodies("/v1/completions"))
def test_fuzzed_completions(server, body):
    check(server, "/v1/completions", body)


@FUZZ
@given(body=bodies("/v1/chat/completions"))
def test_fuzzed_chat(server, body):
    check(server, "/v1/chat/completions", body)


def test_still_serving_and_clean(server):
    status, _ = post(server.server.http_port, "/v1/completions",
                     json.dumps({"model": "doc", "prompt": " the", "max_tokens": 2}).encode())
    assert status == 200
    server.check_clean()
