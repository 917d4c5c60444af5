"""Structured outputs over the OpenAI HTTP API, on a tiny random model that would never produce
them by itself: OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs
and its older guided_* fields, on chat and completions, whole and streamed, with n samples and
log-probabilities, through the official client's `parse` too; each field maps to the engine's
StructuredOutput naming it, and every bad constraint is a 400 naming its field, also in a burst
beside good requests whose outputs it leaves unchanged; a template's default output applies
unless a request names its own or asks for text."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, ServerThread, assert_error, make_config, openai_client, raw

from prefix_service.config import TemplateSpec
from prefix_service.errors import InvalidRequest
from prefix_service.sampling_params import StructuredOutput
from prefix_service.server.openai_api import ChatBody, CompletionBody

CHOICES = ["order", "refund", "shipping value"]
TEMPLATES = (TemplateSpec("sys", system_prompt=SYSTEM_PROMPT), TemplateSpec("doc", content=DOCUMENT),
             TemplateSpec("labels", content=DOCUMENT, structured_output=StructuredOutput("choice", choices=tuple(CHOICES))))

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INTENT = {"type": "object", "properties": {"intent": {"enum": ["order", "refund", "shipping"]},
                                           "urgent": {"type": "boolean"}, "items": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
          "required": ["intent", "urgent", "items"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
GRAMMAR = 'start: "ticket-" DIGIT DIGIT " " WORD\nDIGIT: /[0-9]/\nWORD: "open" | "closed"'
GRAMMAR_RE = r"ticket-[0-9]{2} (open|closed)"


def is_intent(text: str) -> bool:
    """Whether `text` is compact JSON conforming to INTENT."""
    record = json.loads(text)
    return (text == json.dumps(record, separators=(",", ":")) and set(record) == {"intent", "urgent", "items"}
            and record["intent"] in ("order", "refund", "shipping") and isinstance(record["urgent"], bool)
            and type(record["items"]) is int and 0 <= record["items"] <= 9)


def is_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_torch_thread):
    st = ServerThread(make_config(model_dir, prefixes=TEMPLATES, http_address="127.0.0.1:0",
                                  state_file=tmp_path_factory.mktemp("state") / "state.json")).start()
    yield st
    st.stop()


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").check_clean()


# --- the mapping of each field -------------------------------------------------------------------

def mapped(fields: dict[str, Any]) -> StructuredOutput | None:
    """What a completions body with these fields asks of the engine (chat maps them the same)."""
    completion = CompletionBody.model_validate({"prompt": "x", **fields}).sampling(None).structured
    chat = ChatBody.model_validate({"messages": [{"role": "user", "content": "x"}], **fields}).sampling(None).structured
    assert completion == chat
    return completion


def json_schema(schema: Any, name: str = "intent", **extra: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, **extra}}}


@pytest.mark.parametrize("fields,want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, StructuredOutput("text", param="response_format")),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", param="response_format")),
    (json_schema(INTENT), StructuredOutput("json_schema", json.dumps(INTENT),
                                           param="response_format.json_schema.schema")),
    (json_schema(INTENT, strict=False, description="d"),
     StructuredOutput("json_schema", json.dumps(INTENT), param="response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutput("json_object", param="response_format.json_schema")),
    ({"structured_outputs": {"json": INTENT}}, StructuredOutput("json_schema", json.dumps(INTENT),
                                                                param="structured_outputs.json")),
    ({"structured_outputs": {"json": '{"type": "object"}'}},
     StructuredOutput("json_schema", '{"type": "object"}', param="structured_outputs.json")),
    ({"structured_outputs": {"regex": REGEX, "disable_any_whitespace": False}},
     StructuredOutput("regex", REGEX, param="structured_outputs.regex")),
    ({"structured_outputs": {"choice": CHOICES, "disable_any_whitespace": True}},
     StructuredOutput("choice", choices=tuple(CHOICES), param="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutput("grammar", GRAMMAR,
                                                                    param="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", param="structured_outputs.json_object")),
    ({"structured_outputs": {"json_object": False, "regex": REGEX}},
     StructuredOutput("regex", REGEX, param="structured_outputs.regex")),
    ({"guided_json": INTENT, "guided_decoding_backend": "xgrammar"},
     StructuredOutput("json_schema", json.dumps(INTENT), param="guided_json")),
    ({"guided_json": "{not json"}, StructuredOutput("json_schema", "{not json", param="guided_json")),
    ({"guided_regex": REGEX}, StructuredOutput("regex", REGEX, param="guided_regex")),
    ({"guided_choice": CHOICES}, StructuredOutput("choice", choices=tuple(CHOICES), param="guided_choice")),
    ({"guided_grammar": GRAMMAR}, StructuredOutput("grammar", GRAMMAR, param="guided_grammar")),
    # text is explicitly free text: any other constraint takes its place
    ({"response_format": {"type": "text"}, "guided_regex": REGEX},
     StructuredOutput("regex", REGEX, param="guided_regex")),
])
def test_each_field_maps_to_one_structured_output_naming_it(fields, want):
    assert mapped(fields) == want


def test_disable_additional_properties_closes_every_object_schema_that_says_nothing():
    schema = {"type": "object", "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}}}},
              "properties": {
                  # a property named like a keyword is a name, not a keyword
                  "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                  "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                  "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True},
                  "either": {"anyOf": [{"type": "object", "properties": {"c": {}}}, {"type": "null"}]},
                  "tags": {"type": "object", "patternProperties": {"^t": {"type": "string"}}}}}
    got = mapped({"structured_outputs": {"json": schema, "disable_additional_properties": True}})
    closed = json.loads(got.spec)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["properties"]["additionalProperties"] is False and "additionalProperties" not in props
    assert props["properties"]["properties"] == {"a": {"type": "integer"}}
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert props["items"] == {"type": "array", "items": {"$ref": "#/$defs/item"}}
    assert props["open"]["additionalProperties"] is True
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {
        "type": "null"}
    assert props["tags"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the body's schema is left as it was
    as_text = mapped({"structured_outputs": {"json": json.dumps(schema), "disable_additional_properties": True}})
    assert json.loads(as_text.spec) == closed
    assert json.loads(mapped({"structured_outputs": {"json": schema}}).spec) == schema


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": REGEX}}, "structured_outputs"),
    ({**json_schema(INTENT), "guided_json": INTENT}, "guided_json"),
    ({"structured_outputs": {"regex": REGEX}, "guided_choice": CHOICES}, "guided_choice"),
    ({"guided_regex": REGEX, "guided_grammar": GRAMMAR}, "guided_grammar"),
    ({"structured_outputs": {"regex": REGEX, "choice": CHOICES}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": REGEX, "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": REGEX, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_regex": REGEX, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_conflicts_and_unsupported_options_are_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as e:
        mapped(fields)
    assert e.value.param == param


# --- outputs that conform ------------------------------------------------------------------------

def generate(st: ServerThread, chat: bool, fields: dict[str, Any], **body: Any) -> tuple[int, dict]:
    if chat:
        body = {"messages": [{"role": "user", "content": "where is my order"}], **body}
    else:
        body = {"prompt": "the table has a row for each order", **body}
    return raw(st, "POST", "/v1/chat/completions" if chat else "/v1/completions",
               {"max_tokens": 60, "temperature": 0, **fields, **body})


def texts(resp: dict, chat: bool) -> list[str]:
    return [c["message"]["content"] if chat else c["text"] for c in resp["choices"]]


FORMS = [
    pytest.param(json_schema(INTENT), is_intent, id="response_format.json_schema"),
    pytest.param(json_schema(INTENT, strict=False), is_intent, id="response_format.json_schema-not-strict"),
    pytest.param({"response_format": {"type": "json_object"}}, is_object, id="response_format.json_object"),
    pytest.param({"structured_outputs": {"json": INTENT}}, is_intent, id="structured_outputs.json"),
    pytest.param({"structured_outputs": {"json": json.dumps(INTENT)}}, is_intent, id="structured_outputs.json-text"),
    pytest.param({"structured_outputs": {"json": {k: v for k, v in INTENT.items() if k != "additionalProperties"},
                                         "disable_additional_properties": True}}, is_intent,
                 id="structured_outputs.json-closed"),
    pytest.param({"structured_outputs": {"json_object": True}}, is_object, id="structured_outputs.json_object"),
    pytest.param({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t),
                 id="structured_outputs.regex"),
    pytest.param({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES, id="structured_outputs.choice"),
    pytest.param({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(GRAMMAR_RE, t),
                 id="structured_outputs.grammar"),
    pytest.param({"guided_json": INTENT}, is_intent, id="guided_json"),
    pytest.param({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t), id="guided_regex"),
    pytest.param({"guided_choice": CHOICES}, lambda t: t in CHOICES, id="guided_choice"),
    pytest.param({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t), id="guided_grammar"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,conforms", FORMS)
def test_each_form_produces_conforming_output(server, chat, fields, conforms):
    status, resp = generate(server, chat, fields)
    assert status == 200, resp
    [text] = texts(resp, chat)
    assert conforms(text), text
    assert resp["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_without_a_constraint_the_model_conforms_to_none(server, chat):
    """The random model's own output is none of the forms: the constraint is what makes them conform."""
    status, resp = generate(server, chat, {})
    assert status == 200
    [text] = texts(resp, chat)

    def conforms(check) -> bool:
        try:
            return bool(check(text))
        except ValueError:
            return False
    assert not any(conforms(form.values[1]) for form in FORMS), text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_template_default_output_unless_the_request_names_one(server, chat):
    """A template's default output (YAML structured_output) constrains the requests on it that name
    none; response_format text opts out (the output is the same template's without a default), and
    a request's own constraint replaces it."""
    status, resp = generate(server, chat, {}, model="labels")
    assert status == 200 and texts(resp, chat)[0] in CHOICES
    status, free = generate(server, chat, {"response_format": {"type": "text"}}, model="labels", max_tokens=8,
                            ignore_eos=True)
    status_doc, doc = generate(server, chat, {}, model="doc", max_tokens=8, ignore_eos=True)
    assert status == status_doc == 200 and texts(free, chat) == texts(doc, chat)
    assert texts(free, chat)[0] not in CHOICES
    status, own = generate(server, chat, {"guided_regex": REGEX}, model="labels")
    assert status == 200 and re.fullmatch(REGEX, texts(own, chat)[0])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_output_conforms_and_equals_the_whole_one(server, chat):
    for fields, conforms in ((json_schema(INTENT), is_intent), ({"guided_choice": CHOICES}, lambda t: t in CHOICES)):
        whole = texts(generate(server, chat, fields)[1], chat)[0]
        status, text = generate(server, chat, fields, stream=True)
        assert status == 200
        events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        parts = [c["choices"][0]["delta"].get("content") or "" if chat else c["choices"][0]["text"] for c in events]
        assert "".join(parts) == whole and conforms(whole), whole
        assert events[-1]["choices"][0]["finish_reason"] == "stop" and text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_sample_keeps_the_constraint(server, chat):
    for fields, conforms in ((json_schema(INTENT), is_intent), ({"structured_outputs": {"regex": REGEX}},
                                                                lambda t: re.fullmatch(REGEX, t))):
        status, resp = generate(server, chat, fields, n=4, temperature=1.5, seed=5)
        assert status == 200, resp
        outs = texts(resp, chat)
        assert len(outs) == 4 and len(set(outs)) > 1  # different samples, every one conforming
        assert all(conforms(t) for t in outs), outs


# --- refusals ------------------------------------------------------------------------------------

BAD = [
    (json_schema({"type": "objekt"}), "response_format.json_schema.schema"),
    (json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": "one"}}}),
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": INTENT}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ({"guided_json": {"type": "objekt"}}, "guided_json"),
    ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs.regex"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"choice": "order"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": REGEX, "choice": CHOICES}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": REGEX, "structural_tag": {"type": "structural_tag"}}},
     "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": REGEX, "whitespace_pattern": "[ ]?"}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": INTENT, "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "guided_regex": REGEX}, "guided_regex"),
    ({"structured_outputs": {"frobnicate": 1}}, "structured_outputs.frobnicate"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", BAD)
def test_a_bad_constraint_is_400_naming_its_field(server, chat, fields, param):
    err = assert_error(generate(server, chat, fields), 400, "invalid_value", param)
    assert err["type"] == "invalid_request_error"


def test_a_burst_of_bad_schemas_leaves_good_requests_unchanged(server):
    """A steady stream of good greedy requests, constrained and free, while 24 requests with bad
    schemas arrive at once (each compiled, and refused, on a worker thread): every good request
    answers what it answers alone, every bad one its 400."""
    good = [({"guided_choice": CHOICES}, True), ({}, False), (json_schema(INTENT), True),
            ({"structured_outputs": {"regex": REGEX}}, False), ({}, True), (json_schema(INTENT), False)]

    def run(fields: dict[str, Any], chat: bool) -> tuple[int, Any]:
        status, resp = generate(server, chat, fields, max_tokens=24, ignore_eos=not fields, return_token_ids=True)
        return status, resp["choices"][0]["token_ids"] if status == 200 else resp

    alone = [run(f, chat) for f, chat in good]
    assert all(status == 200 for status, _ in alone)
    bad = [(json_schema({"type": "objekt", "title": str(i)}), "response_format.json_schema.schema") if i % 3 == 0
           else ({"guided_json": '{"type": "object", "properties": {"a": {"type": "nope%d"}}}' % i}, "guided_json")
           if i % 3 == 1 else ({"structured_outputs": {"regex": "([a-%d" % i}}, "structured_outputs.regex")
           for i in range(24)]
    start = threading.Barrier(2 + len(bad))
    results: dict[str, list] = {"good": [], "bad": []}

    def steady(offset: int) -> None:
        start.wait()
        for k in range(len(good)):
            fields, chat = good[(k + offset) % len(good)]
            results["good"].append(((k + offset) % len(good), run(fields, chat)))

    def refused(fields: dict[str, Any], param: str) -> None:
        start.wait()
        results["bad"].append((param, generate(server, False, fields)))

    with ThreadPoolExecutor(2 + len(bad)) as pool:
        futures = [pool.submit(steady, 0), pool.submit(steady, 3)] + [pool.submit(refused, *b) for b in bad]
        for f in futures:
            f.result()
    assert sorted(results["good"]) == sorted((i % len(good), alone[i % len(good)]) for i in range(2 * len(good)))
    assert len(results["bad"]) == len(bad)
    for param, answer in results["bad"]:
        assert_error(answer, 400, "invalid_value", param)
    server.check_clean()  # integrity, nothing left running or holding blocks


# --- the official client -------------------------------------------------------------------------

class Ticket(BaseModel):
    intent: Literal["order", "refund", "shipping"]
    urgent: bool
    channel: Literal["email", "phone"]


def test_official_client_parse_returns_the_pydantic_object(server):
    api = openai_client(server)
    messages = [{"role": "user", "content": "refund the order"}]
    resp = api.chat.completions.parse(model="sys", messages=messages, response_format=Ticket, max_tokens=60,
                                      temperature=0)
    message = resp.choices[0].message
    assert isinstance(message.parsed, Ticket), message
    assert message.parsed == Ticket.model_validate_json(message.content)
    sampled = api.chat.completions.parse(model="sys", messages=messages, response_format=Ticket, max_tokens=60,
                                         temperature=1.2, seed=3, n=3)
    assert all(isinstance(c.message.parsed, Ticket) for c in sampled.choices) and len(sampled.choices) == 3


def test_json_schema_with_logprobs_and_n_from_the_official_client(server):
    api = openai_client(server)
    resp = api.chat.completions.create(
        model="sys", messages=[{"role": "user", "content": "where is my order"}], max_tokens=60, temperature=1.0,
        seed=11, n=3, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "intent", "schema": INTENT, "strict": True}})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice in resp.choices:
        assert is_intent(choice.message.content) and choice.finish_reason == "stop"
        tokens = choice.logprobs.content
        assert "".join(t.token for t in tokens) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    completion = api.completions.create(model="sys", prompt=" the order", max_tokens=20, temperature=0, logprobs=2,
                                        extra_body={"structured_outputs": {"choice": CHOICES}})
    assert completion.choices[0].text in CHOICES
    assert "".join(completion.choices[0].logprobs.tokens) == completion.choices[0].text
