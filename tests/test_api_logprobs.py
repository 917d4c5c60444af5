"""Log-probabilities and penalties through both front ends: OpenAI's shapes over HTTP (the official
client, whole and streamed, completions and chat) and the same per token over gRPC; each equals
what the engine itself reports for the same request (which tests/test_logprobs_penalties.py
checks against the model's logits)."""
from __future__ import annotations

import http.client
import json
import math

import openai
import pytest

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, Clients, ServerThread, make_config

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb

TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_torch_thread):
    st = ServerThread(make_config(model_dir, prefixes=TEMPLATES, http_address="127.0.0.1:0",
                                  state_file=tmp_path_factory.mktemp("state") / "state.json")).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def grpc_clients(server):
    c = Clients(server.address)
    yield c
    c.close()


def client(st: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def engine_result(st: ServerThread, prompt: str, prefix: str | None, **kw):
    """The engine's own answer for a completion on a template (the prompt continues it: no special tokens)."""
    ids = st.engine.tokenizer.encode(prompt, add_special_tokens=not prefix)
    return st.engine.generate([GenerateRequest(prompt_token_ids=ids, prefix_name=prefix,
                                               sampling=SamplingParams(**kw))])[0]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=1e-5)


def text_of(st: ServerThread, token: int) -> str:
    return st.engine.tokenizer.decode([token])


def test_completion_logprobs_in_openais_shape(server):
    want = engine_result(server, " the order", "doc", max_tokens=6, ignore_eos=True, logprobs=3)
    resp = client(server).completions.create(model="doc", prompt=" the order", max_tokens=6, temperature=0,
                                             logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp.tokens == [text_of(server, t) for t in want.token_ids]
    assert all(close(a, b.logprob) for a, b in zip(lp.token_logprobs, want.logprobs, strict=True))
    offsets = [0]
    for tok in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp.text_offset == offsets
    for top, w, tok in zip(lp.top_logprobs, want.logprobs, lp.tokens, strict=True):
        expected = {text_of(server, t): v for t, v in w.top}
        expected[tok] = w.logprob  # the chosen token is always there, as OpenAI's
        assert top.keys() == expected.keys() and all(close(top[k], expected[k]) for k in top)

    chunks = list(client(server).completions.create(model="doc", prompt=" the order", max_tokens=6, temperature=0,
                                                    logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert all(close(a, b) for a, b in zip([x for s in streamed for x in s.token_logprobs], lp.token_logprobs))
    plain = client(server).completions.create(model="doc", prompt=" the order", max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_in_openais_shape(server):
    api = client(server)
    messages = [{"role": "user", "content": "refund the order"}]
    whole = api.chat.completions.create(model="sys", messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == [text_of(server, t) for t in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content if "\ufffd" not in c.token)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-6 for c in content)  # greedy: the chosen is the top one
    assert all(c.token == c.top_logprobs[0].token for c in content)

    chunks = list(api.chat.completions.create(model="sys", messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True,
                                              extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(c.token, round(c.logprob, 5)) for c in content]
    no_top = api.chat.completions.create(model="sys", messages=messages, max_tokens=2, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in no_top.choices[0].logprobs.content)
    assert api.chat.completions.create(model="sys", messages=messages, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_bytes_join_into_the_text_where_tokens_split_a_character(server):
    """A character spread over several tokens (the emoji here, which a constraint makes the model
    spell): each token's text alone is U+FFFD, and its bytes are its own, as OpenAI gives them, so
    the bytes of the choice's tokens join into its text (they were U+FFFD's three bytes each)."""
    whole = client(server).chat.completions.create(
        model="sys", messages=[{"role": "user", "content": "the order"}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"structured_outputs": {"regex": "\U0001F30D!"},
                                                   "return_token_ids": True})
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert choice.message.content == "\U0001F30D!" and len(content) > 2
    assert any(c.token == "\ufffd" for c in content)
    assert b"".join(bytes(c.bytes) for c in content) == "\U0001F30D!".encode()
    for c in content:  # the alternatives by the same rule
        assert all(bytes(t.bytes) == t.token.encode() for t in c.top_logprobs if "\ufffd" not in t.token)


def test_grpc_logprobs_per_token(server, grpc_clients):
    want = engine_result(server, " the price", "doc", max_tokens=5, ignore_eos=True, logprobs=2)
    req = pb.GenerateRequest(prefix_name="doc", prompt=" the price",
                             sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2))
    got = [lp for msg in grpc_clients.generation.Generate(req) for lp in msg.logprobs]
    assert [lp.token_id for lp in got] == want.token_ids
    assert all(close(a.logprob, b.logprob) for a, b in zip(got, want.logprobs, strict=True))
    assert all([t.token_id for t in a.top] == [t for t, _ in b.top] for a, b in zip(got, want.logprobs))
    assert all(a.token == text_of(server, a.token_id) for a in got)
    plain = pb.GenerateRequest(prefix_name="doc", prompt=" the price", sampling=pb.SamplingParams(max_tokens=2))
    assert all(not msg.logprobs for msg in grpc_clients.generation.Generate(plain))


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=1.7),
                                dict(min_tokens=4)])
def test_penalties_reach_the_engine_from_both_front_ends(server, grpc_clients, kw):
    """Each front end passes the parameters on unchanged: its tokens are the engine's for the same
    parameters, which differ from the tokens without them."""
    base = dict(max_tokens=16, ignore_eos=True)
    plain = engine_result(server, " the order", "doc", **base).token_ids
    if "min_tokens" in kw:  # stopping at the first token, unless min_tokens holds it off
        kw = dict(kw, stop_token_ids=(plain[0],))
    want = engine_result(server, " the order", "doc", **base, **kw).token_ids
    assert want != plain
    body = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}
    http = client(server).completions.create(model="doc", prompt=" the order", temperature=0, max_tokens=16,
                                             extra_body={"ignore_eos": True, "return_token_ids": True, **body})
    assert http.choices[0].model_extra["token_ids"] == want
    req = pb.GenerateRequest(prefix_name="doc", prompt=" the order", sampling=pb.SamplingParams(**base, **kw))
    assert [t for msg in grpc_clients.generation.Generate(req) for t in msg.token_ids] == want


def test_logit_bias_from_both_front_ends(server, grpc_clients):
    plain = engine_result(server, " the order", "doc", max_tokens=3, ignore_eos=True).token_ids
    banned = plain[0]
    want = engine_result(server, " the order", "doc", max_tokens=3, ignore_eos=True,
                         logit_bias=((banned, -100.0),)).token_ids
    assert want[0] != banned
    http = client(server).completions.create(model="doc", prompt=" the order", temperature=0, max_tokens=3,
                                             logit_bias={str(banned): -100},
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    assert http.choices[0].model_extra["token_ids"] == want
    req = pb.GenerateRequest(prefix_name="doc", prompt=" the order",
                             sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={banned: -100.0}))
    assert [t for msg in grpc_clients.generation.Generate(req) for t in msg.token_ids] == want


def test_bad_values_over_grpc_are_invalid_argument(server, grpc_clients):
    import grpc
    for sampling in (pb.SamplingParams(logprobs=50), pb.SamplingParams(presence_penalty=3),
                     pb.SamplingParams(logit_bias={10**6: 1.0}), pb.SamplingParams(min_tokens=5, max_tokens=2)):
        with pytest.raises(grpc.RpcError) as e:
            list(grpc_clients.generation.Generate(pb.GenerateRequest(prefix_name="doc", prompt="x", sampling=sampling)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server.check_clean()


# --- label scoring ---------------------------------------------------------------------------------

def post(st: ServerThread, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


LABELS = [" order", " refund", " shipping", " account"]


def test_score_over_grpc_and_http_equals_the_engine(server, grpc_clients):
    """Score(prefix_name, prompt, candidates) over gRPC and POST /v1/scores over HTTP answer what the
    engine's own scoring does (which tests/test_scoring.py checks against teacher forcing)."""
    from prefix_service import ScoreRequest
    want = server.engine.score(ScoreRequest(LABELS, prompt=" the price of", prefix_name="doc"))
    resp = grpc_clients.generation.Score(pb.ScoreRequest(prefix_name="doc", prompt=" the price of", candidates=LABELS))
    assert [c.candidate for c in resp.candidates] == LABELS
    for got, w in zip(resp.candidates, want.candidates, strict=True):
        assert list(got.token_ids) == list(w.token_ids)
        assert close(got.logprob, w.logprob) and all(close(a, b) for a, b in zip(got.token_logprobs, w.token_logprobs))
    doc_tokens = server.engine.get_template("doc").num_tokens
    assert resp.usage.prefix_tokens == doc_tokens and resp.usage.prompt_tokens == want.prompt_tokens

    status, body = post(server, "/v1/scores", {"model": "doc", "prompt": " the price of", "candidates": LABELS})
    assert status == 200, body
    assert [d["candidate"] for d in body["data"]] == LABELS and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(close(d["logprob"], w.logprob) for d, w in zip(body["data"], want.candidates))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == doc_tokens
    _, by_ids = post(server, "/v1/scores", {"prefix_name": "doc", "prompt": " the price of",
                                            "candidates": [list(c.token_ids) for c in want.candidates]})
    assert [round(d["logprob"], 4) for d in by_ids["data"]] == [round(d["logprob"], 4) for d in body["data"]]


def test_a_score_logs_and_counts_its_prompt_tokens(server, grpc_clients, caplog):
    """A Score's request log line (gRPC and HTTP) carries its prompt and template tokens, no finish
    reason and no completion tokens (they were all null)."""
    import json
    import logging
    caplog.set_level(logging.INFO, logger="prefix_service.requests")
    resp = grpc_clients.generation.Score(pb.ScoreRequest(prefix_name="doc", prompt=" the price of", candidates=LABELS))
    status, _ = post(server, "/v1/scores", {"model": "doc", "prompt": " the price of", "candidates": LABELS})
    assert status == 200
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "prefix_service.requests"]
    assert [(line["protocol"], line["code"]) for line in lines] == [("grpc", "OK"), ("http", "OK")]
    for line in lines:
        assert (line["prompt_tokens"], line["cached_tokens"]) == (resp.usage.prompt_tokens, resp.usage.prefix_tokens)
        assert (line["finish_reason"], line["completion_tokens"]) == (None, 0)


def test_score_refusals(server, grpc_clients):
    import grpc
    for body, status, param in [({"model": "doc", "prompt": "x", "candidates": []}, 400, "candidates"),
                                ({"model": "doc", "prompt": "x", "candidates": ["a", ""]}, 400, "candidates"),
                                ({"model": "doc", "prompt": "x"}, 400, "candidates"),
                                ({"model": "nope", "prompt": "x", "candidates": ["a"]}, 404, "model"),
                                ({"model": "doc", "prompt": "x", "candidates": ["a"], "n": 2}, 400, "n")]:
        got_status, answer = post(server, "/v1/scores", body)
        assert got_status == status and answer["error"]["param"] == param, (body, answer)
    for req, code in [(pb.ScoreRequest(prefix_name="doc", prompt="x"), grpc.StatusCode.INVALID_ARGUMENT),
                      (pb.ScoreRequest(prefix_name="nope", prompt="x", candidates=["a"]), grpc.StatusCode.NOT_FOUND)]:
        with pytest.raises(grpc.RpcError) as e:
            grpc_clients.generation.Score(req)
        assert e.value.code() == code
    server.check_clean()


# --- n samples ------------------------------------------------------------------------------------

def engine_samples(st: ServerThread, prompt: str, prefix: str, **kw):
    return engine_result(st, prompt, prefix, **kw).samples


def test_n_choices_over_http_whole_and_streamed(server):
    want = engine_samples(server, " the order", "doc", max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, n=3)
    api = client(server)
    resp = api.completions.create(model="doc", prompt=" the order", max_tokens=6, temperature=1.0, seed=7, n=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in resp.choices] == [s.token_ids for s in want]
    assert [c.text for c in resp.choices] == [s.text for s in want]
    assert resp.usage.completion_tokens == 18 and resp.usage.prompt_tokens == want[0].prompt_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == want[0].cached_tokens

    messages = [{"role": "user", "content": "refund the order"}]
    whole = api.chat.completions.create(model="sys", messages=messages, max_tokens=5, temperature=1.0, seed=3, n=2,
                                        extra_body={"ignore_eos": True})
    chunks = list(api.chat.completions.create(model="sys", messages=messages, max_tokens=5, temperature=1.0, seed=3,
                                              n=2, stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_n_samples_over_grpc(server, grpc_clients):
    want = engine_samples(server, " the price", "doc", max_tokens=5, ignore_eos=True, temperature=1.0, seed=11, n=2)
    req = pb.GenerateRequest(prefix_name="doc", prompt=" the price",
                             sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=11, n=2))
    msgs = list(grpc_clients.generation.Generate(req))
    for i in range(2):
        mine = [m for m in msgs if m.index == i]
        assert [t for m in mine for t in m.token_ids] == want[i].token_ids
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH and mine[-1].usage.completion_tokens == 5


def test_grpc_logprobs_name_every_token(server):
    """Over gRPC each token's text comes with its log-probability, with logprobs 0 (the chosen token
    only) too, and each alternative has its text."""
    c = Clients(server.address)
    try:
        for k in (0, 2):
            req = pb.GenerateRequest(prefix_name="doc", prompt=" the price",
                                     sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=k))
            got = [lp for msg in c.generation.Generate(req) for lp in msg.logprobs]
            assert len(got) == 4 and all(len(lp.top) == k for lp in got)
            assert [lp.token for lp in got] == [text_of(server, lp.token_id) for lp in got]
            assert all(t.token == text_of(server, t.token_id) for lp in got for t in lp.top)
    finally:
        c.close()


def test_grpc_score_echoes_its_request_id(server):
    """A Score's response carries its request id: the one given, else the one made for it."""
    c = Clients(server.address)
    try:
        mine = c.generation.Score(pb.ScoreRequest(prefix_name="doc", prompt=" the", candidates=[" order"],
                                                  request_id="score-7"))
        assert mine.request_id == "score-7"
        assert c.generation.Score(pb.ScoreRequest(prefix_name="doc", prompt=" the", candidates=[" order"])).request_id
    finally:
        c.close()
