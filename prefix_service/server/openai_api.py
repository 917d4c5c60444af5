"""The OpenAI-compatible HTTP API: a FastAPI app on the same engine as gRPC.

    GET  /health               200 once every configured template is pinned, 503 before and while stopping
    GET  /v1/models            the served model, then every template as a model id of its own
    POST /v1/completions       prompt (text or token ids) continuing a template
    POST /v1/chat/completions  messages through the model's chat template (system_prompt templates reused)
    POST /v1/scores            each candidate continuation's log-probability after a prompt (label scoring)

A template is chosen by `prefix_name` in the body (the SDKs' `extra_body`) or by `model` naming
it; the served model's name (or no `model`) means none. Bodies are parsed here, strictly: a
wrong type, an unknown field or a value this server does not support (echo, best_of > 1,
tools, structured_outputs.structural_tag, ...) is a 400 naming the field. Log-probabilities come
in OpenAI's shapes (completions: tokens, token_logprobs, top_logprobs, text_offset; chat:
content[] with token, logprob, bytes and top_logprobs), from the model's distribution
(SamplingParams.logprobs). Structured outputs, on both endpoints, come as OpenAI's
response_format (json_object, json_schema), vLLM's structured_outputs (json, regex, choice,
grammar, json_object) or vLLM's older guided_* fields, at most one per request, each to a
SamplingParams.structured whose param names the field (a schema the engine cannot compile is a
400 naming it). From there the request takes the path gRPC takes (requests.py), and errors map
through the same table (status.classify) to an HTTP status and OpenAI's error body:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

A response waits for the request's first output before it starts, so that every refusal
(unknown template, queue full, prompt too long) is an HTTP status, not an error inside a stream.
A client that goes away (a dropped stream, a closed connection while a non-streamed request
runs) aborts its request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Literal, TypeVar, Union

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from prefix_service.engine.api import least_max_model_len, prompt_token_ids
from prefix_service.engine.sequence import FinishReason, RequestOutput, TokenLogprob
from prefix_service.errors import EngineStopped, InvalidRequest, TemplateNotFound
from prefix_service.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from prefix_service.server.auth import BearerAuth
from prefix_service.server.metrics import RequestTrace, ServiceMetrics
from prefix_service.server.requests import (RequestSpec, ScoreSpec, TokenTexts, build_request, prepare,
                                            request_id_for, score)
from prefix_service.server.runtime import Runtime
from prefix_service.server.status import CUT_OFF, ModelNotFound, RequestTooLarge, classify

log = logging.getLogger("prefix_service.server")
T = TypeVar("T")

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) before it is read whole
REQUEST_ID_HEADER = "x-request-id"
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request gives none (gRPC's is 0, greedy)


# --- request bodies ---------------------------------------------------------------------------
class _Body(BaseModel):
    # strict: "5" is not 5, 1.5 is not an int, true is not a number; unknown fields are refused
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


# structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields,
# each to one StructuredOutput whose param names the field that holds it (an engine error names it)
class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema. The schema is enforced whatever `strict` says; without
    a schema the output is any JSON object."""
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutput:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise InvalidRequest(f"response_format.json_schema: only with type json_schema, not {self.type}",
                                     param="response_format.json_schema")
            return StructuredOutput(self.type, param="response_format")
        if self.json_schema is None:
            raise InvalidRequest("response_format.json_schema is required with type json_schema",
                                 param="response_format.json_schema")
        if self.json_schema.schema_ is None:
            return StructuredOutput("json_object", param="response_format.json_schema")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_),
                                param="response_format.json_schema.schema")


class StructuredOutputsBody(_Body):
    """vLLM's structured_outputs: one constraint (json, regex, choice, grammar, json_object: true)
    and its options."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark
    json_object: bool | None = None  # false: not given
    disable_any_whitespace: bool = False  # either value: JSON output is compact, which false (any whitespace) allows
    disable_additional_properties: bool = False  # true: an object schema that says nothing takes no other keys
    whitespace_pattern: Any = None  # refused: JSON output is compact
    structural_tag: Any = None  # refused

    def constraint(self) -> StructuredOutput:
        for option in ("whitespace_pattern", "structural_tag"):
            if getattr(self, option) is not None:
                raise InvalidRequest(f"structured_outputs.{option}: not supported; leave it unset",
                                     param=f"structured_outputs.{option}")
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": True if self.json_object else None}
        given = [kind for kind, value in values.items() if value is not None]
        if not given:
            raise InvalidRequest("structured_outputs: give one of json, regex, choice, grammar, json_object",
                                 param="structured_outputs")
        if len(given) > 1:
            raise InvalidRequest(f"structured_outputs.{given[1]}: one constraint per request, and "
                                 f"structured_outputs.{given[0]} gives one already",
                                 param=f"structured_outputs.{given[1]}")
        kind = given[0]
        return _constraint(kind, values[kind], f"structured_outputs.{kind}",
                           closed=self.disable_additional_properties)


_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")  # a second one given is the field a conflict names


def _constraint(kind: str, value: Any, param: str, closed: bool = False) -> StructuredOutput:
    """vLLM's constraint `kind` (json, regex, choice, grammar, json_object) as a StructuredOutput.
    closed: object schemas that say nothing of additionalProperties get false."""
    if kind == "json":
        if closed:
            try:
                value = json.loads(value) if isinstance(value, str) else value
            except ValueError as e:
                raise InvalidRequest(f"{param}: not valid JSON: {e}", param=param) from None
            value = _closed_objects(value)
        return StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value), param=param)
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(value), param=param)
    if kind == "json_object":
        return StructuredOutput("json_object", param=param)
    return StructuredOutput(kind, value, param=param)  # regex, grammar


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
              "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed_objects(schema: Any) -> Any:
    """A copy of `schema` where each object schema with properties (or patternProperties) and no
    additionalProperties gets additionalProperties: false (vLLM's disable_additional_properties).
    Property names are never taken for keywords: only the keywords above lead to subschemas."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(s) for name, s in out[key].items()}
    if "additionalProperties" not in out and any(isinstance(out.get(k), dict)
                                                 for k in ("properties", "patternProperties")):
        out["additionalProperties"] = False
    return out


class _Sampling(_Body):
    model: str | None = None
    prefix_name: str | None = None  # extension: the template to continue (else `model` may name it)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's): 0 or -1 = no limit
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None  # extension (vLLM's)
    ignore_eos: bool = False  # extension (vLLM's)
    return_token_ids: bool = False  # extension (vLLM's): each choice (and chunk) also carries its token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's): 1 = none
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    min_tokens: int | None = None  # extension (vLLM's)
    n: int | None = None  # samples of the prompt, each a choice (the prompt is computed once)
    # structured outputs: at most one of response_format (json_object, json_schema), structured_outputs
    # (vLLM's) and guided_* (vLLM's older fields); structured_output() maps it
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Union[dict[str, Any], str, None] = None  # a JSON schema (or its text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark
    guided_decoding_backend: str | None = None  # accepted, unused: llguidance serves every constraint
    guided_whitespace_pattern: Any = None  # refused: JSON output is compact

    def structured_output(self) -> StructuredOutput | None:
        """The request's one constraint; a second one is a 400 naming its field. response_format
        text (explicitly free text) gives way to any other."""
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequest("guided_whitespace_pattern: not supported; JSON output is always compact",
                                 param="guided_whitespace_pattern")
        text = self.response_format is not None and self.response_format.type == "text"
        given = [name for name in _CONSTRAINT_FIELDS
                 if getattr(self, name) is not None and not (name == "response_format" and text)]
        if len(given) > 1:
            raise InvalidRequest(f"{given[1]}: one structured output per request, and {given[0]} gives one already",
                                 param=given[1])
        chosen = None if self.response_format is None else self.response_format.constraint()  # text too
        if not given or given[0] == "response_format":
            return chosen
        if given[0] == "structured_outputs":
            assert self.structured_outputs is not None
            return self.structured_outputs.constraint()
        return _constraint(given[0].removeprefix("guided_"), getattr(self, given[0]), given[0])

    def refuse_unsupported(self) -> None:
        def no(field: str, why: str) -> None:
            raise InvalidRequest(f"{field}: {why}", param=field)

        if self.stream_options is not None and not self.stream:
            no("stream_options", "only allowed with stream: true")

    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; k: each token's, with k alternatives."""
        return None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """Range checks are the engine's (SamplingParams.validate: 400 naming the field)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=_seed(self.seed),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs_wanted(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            min_tokens=self.min_tokens or 0,
            n=1 if self.n is None else self.n,
            structured=self.structured_output(),
        )


def _seed(seed: int | None) -> int | None:
    """OpenAI's seed is any integer, vLLM's a signed 64-bit one; the engine takes [0, 2^64): a
    negative seed in int64's range is the same 64 bits unsigned (out of range stays, for its 400)."""
    return seed % 2**64 if seed is not None and -2**63 <= seed < 0 else seed


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"-?[0-9]+", key):  # ASCII digits only: int() takes " 5 " and other scripts' digits
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias")
        out.append((int(key), value))
    return tuple(sorted(out))


class CompletionBody(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise InvalidRequest("echo: not supported; leave it false", param="echo")
        if self.best_of not in (None, 1):
            raise InvalidRequest(f"best_of: only 1 is supported, got {self.best_of}", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix: not supported; leave it unset", param="suffix")

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_fields(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequest(f"prompt: one prompt per request (got a batch of {len(p)}); send one request "
                                     f"each", param="prompt")
            p = p[0]
        if isinstance(p, str):
            return {"prompt": p}
        if not p:
            raise InvalidRequest("prompt: an empty list of token ids", param="prompt")
        return {"prompt_token_ids": p}


class ChatMessageBody(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    # a string, or parts: only text parts ({"type": "text", "text": ...}), checked by check() to name the part
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None  # accepted, unused
    # an assistant message's other fields, as OpenAI returns them (a client sends its reply back whole):
    # accepted empty; a refusal stands for the text of a message without content
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None

    def check(self, index: int) -> None:
        """A 400 naming the part of this message (messages.<index>) the server cannot take."""
        where = f"messages.{index}"
        for field in ("tool_calls", "function_call", "audio"):
            if getattr(self, field):
                raise InvalidRequest(f"{where}.{field}: not supported; send the message without it",
                                     param=f"{where}.{field}")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.get("type") != "text":
                raise InvalidRequest(f"{where}.content.{j}: only text parts are supported, got type "
                                     f"{_short(part.get('type'))}", param=f"{where}.content.{j}")
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.content.{j}.text: a text part needs its text as a string",
                                     param=f"{where}.content.{j}.text")
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise InvalidRequest(f"unknown field '{where}.content.{j}.{extra[0]}': this server does not support "
                                     f"it", param=f"{where}.content.{j}.{extra[0]}")

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        if not content and self.refusal:
            content = self.refusal
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ScoreBody(_Body):
    model: str | None = None
    prefix_name: str | None = None
    prompt: Union[str, list[int]] = ""
    candidates: Union[list[str], list[list[int]]]
    user: str | None = None  # accepted, unused


class TokenizeBody(_Body):
    """POST /tokenize: a prompt (text) or chat messages, on a template or not, as a generation takes them."""
    model: str | None = None
    prefix_name: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


class ChatBody(_Sampling):
    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for i, message in enumerate(self.messages):
            message.check(i)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: only with logprobs: true", param="top_logprobs")
        if self.tools:
            raise InvalidRequest("tools: tool calls are not supported; leave tools unset", param="tools")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest("max_completion_tokens: give it or max_tokens, not two different values",
                                 param="max_completion_tokens")

    def top_logprobs_wanted(self) -> int | None:
        if not self.logprobs:
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                                 param="top_logprobs")
        return self.top_logprobs or 0


# --- responses ---------------------------------------------------------------------------------
def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _usage(lasts: list[RequestOutput]) -> dict[str, Any]:
    """Usage of a request from its samples' last outputs: the prompt once, every sample's tokens."""
    prompt, completion = lasts[0].prompt_tokens, sum(out.completion_tokens for out in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": lasts[0].cached_tokens}}


def _finish(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    reasons: dict[FinishReason | None, str] = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
    return reasons.get(out.finish_reason, "abort")


class _Shape:
    """How one endpoint writes its response, whole and streamed. token_text: a token id's text,
    when the request asked for log-probabilities (else None); token_bytes: its bytes (chat's
    logprobs; else its text's UTF-8)."""

    def __init__(self, chat: bool, request_id: str, model: str, token_ids: bool,
                 token_text: Callable[[int], str] | None = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.chat = chat
        self.token_ids = token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.token_bytes = token_bytes
        self._offsets: dict[int, int] = {}  # per choice: completions' text_offset of its next token
        self._started: set[int] = set()  # choices whose first chunk went out
        self._lasts: dict[int, RequestOutput] = {}  # per choice: its last output, once finished

    def _logprobs(self, lps: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (None when the request asked for none)."""
        text = self.token_text
        if text is None or lps is None:
            return None
        if self.chat:  # the k most likely alternatives, each with its bytes
            def entry(token: int, logprob: float) -> dict[str, Any]:
                s = text(token)
                raw = self.token_bytes(token) if self.token_bytes is not None else s.encode("utf-8")
                return {"token": s, "logprob": logprob, "bytes": list(raw)}
            return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                              for x in lps], "refusal": None}
        tokens = [text(x.token_id) for x in lps]
        offsets, offset = [], self._offsets.get(index, 0)
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        self._offsets[index] = offset
        # as OpenAI's completions: the k most likely and the chosen token (up to k + 1 entries)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{**{text(t): v for t, v in x.top}, tokens[i]: x.logprob} for i, x in enumerate(lps)],
                "text_offset": offsets}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ids(self, choice: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = ids
        return choice

    def whole(self, samples: list[list[RequestOutput]]) -> dict[str, Any]:
        """The response from each choice's outputs, in index order."""
        choices = []
        for index, parts in enumerate(samples):
            text, ids, last = "".join(p.text for p in parts), [t for p in parts for t in p.token_ids], parts[-1]
            lps = None if last.logprobs is None else [lp for p in parts for lp in p.logprobs or ()]
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": self._logprobs(lps, index), "finish_reason": _finish(last)}
            else:
                choice = {"index": index, "text": text, "logprobs": self._logprobs(lps, index),
                          "finish_reason": _finish(last)}
            choices.append(self._ids(choice, ids))
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": _usage([parts[-1] for parts in samples])}

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        i = out.index
        first = i not in self._started
        self._started.add(i)
        if out.finished:
            self._lasts[i] = out
        if not self.chat:
            choice = {"index": i, "text": out.text, "logprobs": self._logprobs(out.logprobs, i),
                      "finish_reason": _finish(out)}
            return [{**self._head("text_completion"), "choices": [self._ids(choice, out.token_ids)]}]
        head = self._head("chat.completion.chunk")
        chunks = []
        if first:
            chunks.append({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        if out.text or ((self.token_ids or self.token_text is not None) and out.token_ids):
            choice = {"index": i, "delta": {"content": out.text}, "logprobs": self._logprobs(out.logprobs, i),
                      "finish_reason": None}
            chunks.append({**head, "choices": [self._ids(choice, out.token_ids)]})
        if out.finished:
            chunks.append({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                "finish_reason": _finish(out)}]})
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": _usage([self._lasts[i] for i in sorted(self._lasts)])}


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


# --- the app -----------------------------------------------------------------------------------
class OpenAIApi:
    def __init__(self, runtime: Runtime, metrics: ServiceMetrics, auth: BearerAuth, served_name: str) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.auth = auth
        self.served_name = served_name
        self.token_texts = TokenTexts()  # for log-probabilities
        self._cut = asyncio.Event()  # set when a stopping server's grace period is over (cut_off)
        self._streams: set[asyncio.Queue[RequestOutput | Exception]] = set()  # the outputs of streams in flight
        self._handling = 0  # generation and scoring calls before their response (a stream's then counts in _streams)
        self.app = FastAPI(title="prefix_service", summary="OpenAI-compatible API with operator-named, pinned "
                           "prompt templates", version="1", docs_url=None, redoc_url=None)
        app = self.app
        app.add_exception_handler(StarletteHTTPException, self._http_exception)
        app.add_exception_handler(RequestValidationError, self._http_exception)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/scores", self.scores, methods=["POST"])

    # --- errors --------------------------------------------------------------------------------
    @staticmethod
    def error(exc: BaseException, trace: RequestTrace | None = None) -> Response:
        """exc as OpenAI's error body with its HTTP status (and, with a trace, the request's end); a
        client that went away gets a 499 nobody reads, its request counted CANCELLED."""
        if isinstance(exc, ClientGone):
            if trace is not None:
                _gone(trace)
            return Response(status_code=499)
        kind, message = classify(exc)
        headers = {"WWW-Authenticate": "Bearer"} if kind.http_status == 401 else None
        if trace is not None:
            trace.code, trace.http_status = kind.grpc_code, kind.http_status
            _end(trace)
        return JSONResponse(error_body(message, kind.type, kind.code, getattr(exc, "param", None)),
                            status_code=kind.http_status, headers=headers)

    @staticmethod
    async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
        """Starlette's own refusals (unknown path, wrong method) in OpenAI's shape."""
        status = getattr(exc, "status_code", 400)
        detail = getattr(exc, "detail", None) or str(exc)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        message = f"{detail}: {request.method} {request.url.path}" if status in (404, 405) else str(detail)
        return JSONResponse(error_body(message, "invalid_request_error", code), status_code=status,
                            headers=getattr(exc, "headers", None))

    def in_flight(self) -> int:
        """Generation and scoring calls not answered yet (streams until their last event)."""
        return self._handling + len(self._streams)

    def cut_off(self) -> None:
        """The stopping server's grace period is over: every request still in flight is answered now
        (and aborted) rather than dropped with its connection; a stream ends with an `unavailable`
        error event, any other response is a 503, as are requests that arrive later."""
        self._cut.set()
        for outputs in self._streams:
            outputs.put_nowait(EngineStopped(CUT_OFF))

    # --- routes --------------------------------------------------------------------------------
    async def health(self) -> Response:
        if self.runtime.ready:
            return Response(status_code=200)
        return JSONResponse(error_body(f"the server is {self.runtime.phase}", "server_error", "unavailable"),
                            status_code=503)

    async def models(self, request: Request) -> Response:
        try:
            data = await self._model_list(request)
        except Exception as e:  # noqa: BLE001 - every refusal in OpenAI's shape
            return self.error(e)
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request, model: str) -> Response:
        """GET /v1/models/{model}: the base model or a template, as /v1/models lists it."""
        try:
            found = [m for m in await self._model_list(request) if m["id"] == model]
            if not found:
                raise ModelNotFound(f"the model {model[:128]!r} does not exist here: use {self.served_name!r} or a "
                                    f"template's name (GET /v1/models lists them)", param="model")
        except Exception as e:  # noqa: BLE001 - every refusal in OpenAI's shape
            return self.error(e)
        return JSONResponse(found[0])

    async def _model_list(self, request: Request) -> list[dict[str, Any]]:
        """The base model, then each template, as OpenAI's model objects."""
        self.auth.check(request.headers.items())
        engine, registry = self.runtime.require_ready()
        loop = asyncio.get_running_loop()
        # side by side: in a fleet each is a call to its controller
        templates, infos = await asyncio.gather(loop.run_in_executor(self.runtime.executor, registry.list),
                                                loop.run_in_executor(self.runtime.executor, engine.engine_infos))
        created = int(time.time())
        # max_model_len as vLLM gives it: the longest prompt plus output a request can have (the engines' least)
        data: list[dict[str, Any]] = [{"id": self.served_name, "object": "model", "created": created,
                                       "owned_by": "prefix_service", "root": self.served_name, "parent": None,
                                       "max_model_len": least_max_model_len(infos.values())}]
        for info, origin in templates:
            data.append({"id": info.name, "object": "model", "created": created, "owned_by": "prefix_service",
                         "root": self.served_name, "parent": self.served_name,
                         "metadata": {"kind": "prefix_template", "base_model": self.served_name,
                                      "template_tokens": info.num_tokens, "origin": origin}})
        return data

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize, as vLLM's: a prompt's (or chat messages') token ids as a generation on the same
        template would take them. count and tokens are the request's own; prompt_tokens adds the
        template's (prefix_tokens), as a generation's usage.prompt_tokens counts them."""
        body: TokenizeBody | None = None
        try:
            self.auth.check(request.headers.items())
            body = TokenizeBody.model_validate_json(await _read_body(request))
            for i, message in enumerate(body.messages or ()):
                message.check(i)
            if body.messages is not None and not body.messages:
                raise InvalidRequest("messages: an empty list", param="messages")
            template = await self._template(body.model, body.prefix_name)
            spec = RequestSpec(prefix_name=template, prompt=body.prompt,
                               messages=[m.as_dict() for m in body.messages] if body.messages else None)
            engine, _ = self.runtime.require_ready()
            loop = asyncio.get_running_loop()
            ids, prefix, infos = await loop.run_in_executor(self.runtime.executor, _tokenized, engine, spec)
        except ValidationError as e:
            return self.error(_validation_error(e))
        except Exception as e:  # noqa: BLE001 - every refusal in OpenAI's shape
            return self.error(_as_sent(e, body))
        return JSONResponse({"count": len(ids), "tokens": ids, "prefix_tokens": prefix,
                             "prompt_tokens": prefix + len(ids), "max_model_len": least_max_model_len(infos.values())})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize, as vLLM's: token ids -> their text."""
        try:
            self.auth.check(request.headers.items())
            body = DetokenizeBody.model_validate_json(await _read_body(request))
            await self._template(body.model, None)  # an unknown model is a 404, as elsewhere
            engine, _ = self.runtime.require_ready()
            size = len(engine.tokenizer)
            bad = [t for t in body.tokens if not 0 <= t < size]
            if bad:
                raise InvalidRequest(f"tokens: {bad[0]} is not a token id of this model's tokenizer (0 to {size - 1})",
                                     param="tokens")
            text = await asyncio.get_running_loop().run_in_executor(self.runtime.executor, engine.tokenizer.decode,
                                                                     body.tokens)
        except ValidationError as e:
            return self.error(_validation_error(e))
        except Exception as e:  # noqa: BLE001 - every refusal in OpenAI's shape
            return self.error(e)
        return JSONResponse({"prompt": text})

    async def completions(self, request: Request) -> Response:
        return await self._counted(self._generate(request, CompletionBody))

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(self._generate(request, ChatBody))

    async def scores(self, request: Request) -> Response:
        return await self._counted(self._score(request))

    async def _counted(self, handling: Awaitable[Response]) -> Response:
        self._handling += 1
        try:
            return await handling
        finally:
            self._handling -= 1

    async def _score(self, request: Request) -> Response:
        """Label scoring: {"model" or "prefix_name", "prompt", "candidates": [...]} -> each candidate's
        log-probability (the sum of its tokens'), its token ids and their log-probabilities."""
        trace = self.metrics.trace("", "http")
        body: ScoreBody | None = None
        try:
            self.auth.check(request.headers.items())
            body = ScoreBody.model_validate_json(await _read_body(request))
            template = await self._template(body.model, body.prefix_name)
            trace.set_template(template or "")
            prompt = body.prompt
            spec = ScoreSpec(body.candidates, prefix_name=template, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=prompt if isinstance(prompt, list) else None,
                             request_id=request.headers.get(REQUEST_ID_HEADER))
            request_id = trace.request_id = request_id_for(spec)
            out = await _race(request, self._cut, score(self.runtime, spec, request_id))
        except ValidationError as e:
            return self.error(_validation_error(e), trace)
        except asyncio.CancelledError:
            _gone(trace)
            raise
        except Exception as e:  # noqa: BLE001 - every refusal in OpenAI's shape
            return self.error(_as_sent(_named(e, body, trace), body), trace)
        assert body is not None
        trace.code, trace.http_status = grpc.StatusCode.OK, 200
        trace.scored(out)
        _end(trace)
        data = [{"index": i, "object": "candidate_score", "candidate": cand, "logprob": c.logprob,
                 "token_ids": list(c.token_ids), "token_logprobs": list(c.token_logprobs)}
                for i, (cand, c) in enumerate(zip(body.candidates, out.candidates))]
        return JSONResponse({"id": f"score-{request_id}", "object": "list", "created": int(time.time()),
                             "model": body.model or self.served_name, "data": data,
                             "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens,
                                       "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}})

    # --- generation ----------------------------------------------------------------------------
    async def _generate(self, request: Request, body_cls: type[_Sampling]) -> Response:
        trace = self.metrics.trace("", "http")
        body: _Sampling | None = None
        try:
            self.auth.check(request.headers.items())
            body = body_cls.model_validate_json(await _read_body(request))
            body.refuse_unsupported()
            template = await self._template(body.model, body.prefix_name)
            trace.set_template(template or "")
            spec = self._spec(body, template, request.headers.get(REQUEST_ID_HEADER))
            request_id = trace.request_id = request_id_for(spec)
            engine, req = await prepare(self.runtime, spec, request_id)
            stream = engine.generate_stream(req, self.runtime.executor)
            first = await _first_output(request, stream, self._cut)  # every refusal happens before this returns
        except ValidationError as e:
            return self.error(_validation_error(e), trace)
        except asyncio.CancelledError:
            _gone(trace)
            raise
        except Exception as e:  # noqa: BLE001 - refused before any output, or the client went away
            return self.error(_as_sent(_named(e, body, trace), body), trace)
        assert body is not None
        wants = body.top_logprobs_wanted() is not None
        shape = _Shape(body_cls is ChatBody, request_id, body.model or self.served_name, body.return_token_ids,
                       self.token_texts.of(engine.tokenizer) if wants else None,
                       self.token_texts.bytes_of(engine.tokenizer) if wants else None)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(first, stream, shape, trace, include_usage, req.sampling.n),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, first, stream, shape, trace, req.sampling.n)

    async def _template(self, model: str | None, prefix_name: str | None) -> str | None:
        """The template a request names: prefix_name, or `model` when it is a template's name."""
        template = None
        if model is not None and model != self.served_name:
            registry = self.runtime.registry
            if registry is None or not await registry.lookup(model):
                raise ModelNotFound(f"the model {model[:128]!r} does not exist here: use {self.served_name!r} or a "
                                    f"template's name (GET /v1/models lists them)", param="model")
            template = model
        if prefix_name is not None:
            if template is not None and prefix_name != template:
                raise InvalidRequest(f"model names template {template!r} but prefix_name names {prefix_name[:128]!r}; "
                                     f"name one template", param="prefix_name")
            template = prefix_name or None
        return template

    def _spec(self, body: _Sampling, template: str | None, request_id: str | None) -> RequestSpec:
        if isinstance(body, ChatBody):
            return RequestSpec(prefix_name=template, messages=[m.as_dict() for m in body.messages],
                               sampling=body.sampling(body.max_completion_tokens if body.max_completion_tokens
                                                      is not None else body.max_tokens),
                               request_id=request_id)
        assert isinstance(body, CompletionBody)
        return RequestSpec(prefix_name=template, sampling=body.sampling(body.max_tokens), request_id=request_id,
                           **body.prompt_fields())

    async def _whole(self, request: Request, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None],
                     shape: _Shape, trace: RequestTrace, n: int) -> Response:
        async def collect() -> None:
            out = first
            samples[out.index].append(out)
            trace.output(out)
            remaining = n - int(out.finished)
            async with contextlib.aclosing(stream):
                while remaining:
                    out = await anext(stream)
                    trace.output(out)
                    samples[out.index].append(out)
                    remaining -= int(out.finished)

        samples: list[list[RequestOutput]] = [[] for _ in range(n)]
        try:  # cancelling collect() closes the stream, which aborts the request
            await _race(request, self._cut, collect())
        except asyncio.CancelledError:
            _gone(trace)
            raise
        except Exception as e:  # noqa: BLE001 - the client went away, the cut-off, or an error after the start
            return self.error(e, trace)
        trace.code, trace.http_status = grpc.StatusCode.OK, 200
        _end(trace)
        return JSONResponse(shape.whole(samples))

    async def _stream(self, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None], shape: _Shape,
                      trace: RequestTrace, include_usage: bool, n: int) -> AsyncIterator[bytes]:
        trace.http_status = 200
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()  # the engine's, then cut_off's
        pump = asyncio.ensure_future(_pump(stream, outputs))
        # then the engine's stream is closed (a no-op once it has ended), which aborts its request if it is still
        # running: the pump may be cancelled before it ever reads it
        pump.add_done_callback(lambda _: _close_soon(stream))
        self._streams.add(outputs)
        if self._cut.is_set():  # a stream that starts after the cut-off ends after its first output
            outputs.put_nowait(EngineStopped(CUT_OFF))
        try:
            out, remaining = first, n
            while True:
                trace.output(out)
                for chunk in shape.chunks(out):  # with include_usage, "usage": null on each, as OpenAI's
                    yield _sse({**chunk, "usage": None} if include_usage else chunk)
                remaining -= int(out.finished)
                if not remaining:
                    break
                got = await outputs.get()
                if isinstance(got, Exception):  # ended by an error mid-stream (engine stopped, cut off): say so
                    kind, message = classify(got)
                    trace.code = kind.grpc_code
                    yield _sse(error_body(message, kind.type, kind.code))
                    return
                out = got
            if include_usage:
                yield _sse(shape.usage_chunk())
            yield b"data: [DONE]\n\n"
            trace.code = grpc.StatusCode.OK
        finally:  # a client that went away leaves code None: CANCELLED
            self._streams.discard(outputs)
            pump.cancel()
            _end(trace)


async def _pump(stream: AsyncGenerator[RequestOutput, None], outputs: asyncio.Queue[RequestOutput | Exception]
                ) -> None:
    """The engine's outputs after the first, or the error that ended them, into `outputs`, where the
    server's cut-off can put its own error in front of what is yet to come."""
    try:
        async for out in stream:
            outputs.put_nowait(out)
    except Exception as e:  # noqa: BLE001 - handed to the response
        outputs.put_nowait(e)


def _close_soon(stream: AsyncGenerator[RequestOutput, None]) -> None:
    _closing.add(task := asyncio.ensure_future(stream.aclose()))
    task.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()  # closes in flight (the loop keeps only weak references to tasks)


def _tokenized(engine: Any, spec: RequestSpec) -> tuple[list[int], int, dict[str, Any]]:
    """(the request's own token ids, its template's token count, the engines' infos). Blocks."""
    req = build_request(engine, spec, "tokenize")
    prefix = len(engine.get_template(spec.prefix_name).token_ids) if spec.prefix_name else 0
    return prompt_token_ids(engine.tokenizer, req), prefix, engine.engine_infos()


def _gone(trace: RequestTrace) -> None:
    """The request's end when its client went away (a closed connection, or the handler cancelled by a
    proxy in front that saw it go): counted CANCELLED, 499 in its log line."""
    trace.http_status = 499
    _end(trace)  # its code left unset: CANCELLED


def _end(trace: RequestTrace) -> None:
    try:
        trace.end()
    except Exception:  # noqa: BLE001 - bookkeeping must never change the request's outcome
        log.exception("recording request %s failed", trace.request_id or "(no id)")


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES whether or not it declares its length."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge(int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BodyTooLarge(size)
            chunks.append(chunk)
    except ClientDisconnect:  # gone before the whole body came: nobody to answer
        raise ClientGone() from None
    return b"".join(chunks)


class BodyTooLarge(RequestTooLarge):
    def __init__(self, size: int) -> None:
        super().__init__(f"the request body has {size} bytes or more; this server reads at most {MAX_BODY_BYTES}")


async def _first_output(request: Request, stream: AsyncGenerator[RequestOutput, None],
                        cut: asyncio.Event) -> RequestOutput:
    """The stream's first output, raising the request's refusal, ClientGone when the client closes
    the connection before it, or EngineStopped when the server cuts off what is in flight first.
    Each closes the stream, which aborts the request (queued or in its prefill) instead of computing
    it for nobody."""
    try:
        return await _race(request, cut, anext(stream))
    except BaseException:  # a cancelled handler too (a proxy in front cancels it when its client goes)
        await stream.aclose()
        raise


class ClientGone(Exception):
    """The client closed the connection before its answer: the work for it was cancelled."""


async def _race(request: Request, cut: asyncio.Event, work: Awaitable[T]) -> T:
    """work's result. work is cancelled (which aborts its request) when the client closes the
    connection first (ClientGone) or the server cuts off what is in flight (EngineStopped)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    stop = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait([task, gone, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise EngineStopped(CUT_OFF) if cut.is_set() else ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _named(e: Exception, body: _Sampling | ScoreBody | None, trace: RequestTrace) -> Exception:
    """e; a template or model not found is recorded under the name the request gave (its log line;
    the metrics' _unknown), as gRPC records an unknown prefix_name."""
    if isinstance(e, TemplateNotFound) and body is not None:
        trace.set_template(body.prefix_name or body.model or "")
    return e


def _as_sent(e: Exception, body: _Sampling | ScoreBody | TokenizeBody | None) -> Exception:
    """The engine's refusal naming the field as the request gave it: max_completion_tokens where a
    chat request gave that for max_tokens; an unknown template's prefix_name (or model)."""
    if isinstance(e, InvalidRequest) and e.param == "max_tokens" and isinstance(body, ChatBody) \
            and body.max_tokens is None and body.max_completion_tokens is not None:
        return type(e)(str(e).replace("max_tokens", "max_completion_tokens"), param="max_completion_tokens")
    if type(e) is TemplateNotFound and e.param is None and body is not None:
        return TemplateNotFound(str(e), param="prefix_name" if body.prefix_name else "model")
    return e


def _validation_error(e: ValidationError) -> InvalidRequest:
    """pydantic's first complaint as a 400 naming the field."""
    errors = e.errors(include_url=False)
    if not errors:
        return InvalidRequest(f"the body is not valid: {e}")
    err = errors[0]
    param = ".".join(str(x) for x in err.get("loc", ()) if _is_field(x)) or None
    if err.get("type") == "json_invalid":
        return InvalidRequest(f"the body is not valid JSON: {err.get('msg')}", param=None)
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown field {param!r}: this server does not support it", param=param)
    if err.get("type") == "missing":
        return InvalidRequest(f"{param} is required", param=param)
    return InvalidRequest(f"{param or 'the body'}: {err.get('msg')} (got {_short(err.get('input'))})", param=param)


def _is_field(part: Any) -> bool:
    """A field name or list index in pydantic's error location (not a union member's type tag)."""
    return isinstance(part, int) or (isinstance(part, str) and part.isidentifier() and part[:1].islower()
                                     and part not in ("str", "int", "float", "bool", "list", "dict"))


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
