"""The one request path of both front ends. gRPC and HTTP turn their messages into a
`RequestSpec`; from there validation, tokenization (chat templates included), submission,
streaming and the abort of a call that ends early are the same code:

    spec = RequestSpec(...)                       # the front end's own parsing
    engine, req = await prepare(runtime, spec)    # ready? request id, chat rendering, tokenize
    async with aclosing(engine.generate_stream(req, runtime.executor)) as stream: ...

Errors are the engine's exceptions (prefix_service.errors, server.status); each front end maps
them with status.classify.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from prefix_service.engine.sequence import GenerateRequest, ScoreOutput, ScoreRequest
from prefix_service.errors import InvalidRequest
from prefix_service.sampling_params import SamplingParams
from prefix_service.server.chat import chat_prompt_ids
from prefix_service.server.interfaces import EngineClient
from prefix_service.server.runtime import Runtime

MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class RequestSpec:
    """A generation request as a front end parsed it. At most one of prompt, prompt_token_ids and
    messages; with none the prompt is empty (the template alone)."""
    prefix_name: str | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    messages: Sequence[dict[str, str]] | None = None  # rendered with the model's chat template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None  # None: one is generated


class TokenTexts:
    """A token id's text as log-probabilities show it: the token decoded alone (as vLLM does),
    kept once decoded; and its bytes, as OpenAI's chat logprobs give them. One per front end, for
    the engine's tokenizer."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._pieces: tuple[Callable[[str], bytes] | None] | None = None  # _piece_bytes, once asked

    def of(self, tokenizer: Any) -> Callable[[int], str]:
        texts = self._texts

        def text(token: int) -> str:
            s = texts.get(token)
            if s is None:
                s = texts[token] = tokenizer.decode([token])
            return s
        return text

    def bytes_of(self, tokenizer: Any) -> Callable[[int], bytes]:
        """A token's bytes: its text's UTF-8, except where the token holds part of a character (its text
        alone decodes to U+FFFD), whose own bytes the tokenizer's pieces spell (byte-level BPE's
        alphabet, or SentencePiece's <0xHH> byte pieces), so that a client joins a choice's bytes into
        its text."""
        text, held = self.of(tokenizer), self._bytes
        if self._pieces is None:
            self._pieces = (_piece_bytes(tokenizer),)
        (raw,) = self._pieces

        def of_token(token: int) -> bytes:
            b = held.get(token)
            if b is None:
                s = text(token)
                b = s.encode("utf-8")
                if "\ufffd" in s and raw is not None:
                    try:
                        b = raw(tokenizer.convert_ids_to_tokens(token))
                    except (KeyError, ValueError, TypeError):  # a piece outside the scheme: its text's
                        pass
                held[token] = b
            return b
        return of_token


def _piece_bytes(tokenizer: Any) -> Callable[[str], bytes] | None:
    """The bytes a token piece stands for, where the tokenizer spells bytes in its pieces: byte-level
    BPE (GPT-2's alphabet of 256 characters, one a byte) or SentencePiece's byte fallback (<0xHH>);
    None for another tokenizer."""
    rust = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own (the tokenizers library's)
    decoder = repr(getattr(rust, "decoder", None))
    if decoder.startswith("ByteLevel"):
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        alphabet = {c: b for b, c in bytes_to_unicode().items()}
        return lambda piece: bytes(alphabet[c] for c in piece)
    if "ByteFallback" in decoder:
        def sentencepiece(piece: str) -> bytes:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return sentencepiece
    return None


def check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters "
                             f"(or empty to have one generated), got {request_id[:40]!r}...", param="request_id")
    return request_id


@dataclass(frozen=True)
class ScoreSpec:
    """A Score request as a front end parsed it: candidates as text (each tokenized alone) or ids."""
    candidates: Sequence[str] | Sequence[Sequence[int]]
    prefix_name: str | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    request_id: str | None = None


def request_id_for(spec: RequestSpec | ScoreSpec) -> str:
    return check_request_id(spec.request_id) if spec.request_id else uuid.uuid4().hex


def build_request(engine: EngineClient, spec: RequestSpec, request_id: str) -> GenerateRequest:
    """Spec -> engine request. Blocks (renders chat messages; looks the template up): call it off
    the event loop."""
    given = [name for name, value in (("prompt", spec.prompt), ("prompt_token_ids", spec.prompt_token_ids),
                                      ("messages", spec.messages)) if value]
    if len(given) > 1:
        raise InvalidRequest(f"give {given[0]} or {given[1]}, not both", param=given[1])
    prefix_name = spec.prefix_name or None
    if spec.messages:
        view = engine.get_template(prefix_name) if prefix_name else None  # TemplateNotFound
        ids = chat_prompt_ids(engine.tokenizer, spec.messages, prefix_name, view.token_ids if view else None,
                              view.source if view else None)
        return GenerateRequest(prompt_token_ids=ids, prefix_name=prefix_name, sampling=spec.sampling,
                               request_id=request_id)
    if spec.prompt_token_ids:
        return GenerateRequest(prompt_token_ids=list(spec.prompt_token_ids), prefix_name=prefix_name,
                               sampling=spec.sampling, request_id=request_id)
    return GenerateRequest(prompt=spec.prompt or "", prefix_name=prefix_name, sampling=spec.sampling,
                           request_id=request_id)


async def score(runtime: Runtime, spec: ScoreSpec, request_id: str) -> ScoreOutput:
    """Score spec's candidates once the server serves (ServerNotReady before). Cancelling aborts it."""
    engine, _ = runtime.require_ready()
    if spec.prompt and spec.prompt_token_ids:
        raise InvalidRequest("give prompt or prompt_token_ids, not both", param="prompt")
    texts = [c for c in spec.candidates if isinstance(c, str)]
    if texts and len(texts) != len(spec.candidates):
        raise InvalidRequest("candidates: all text or all token ids, not both", param="candidates")
    candidates: list[str] | list[list[int]] = texts or [list(c) for c in spec.candidates if not isinstance(c, str)]
    req = ScoreRequest(candidates, prompt=spec.prompt or None,
                       prompt_token_ids=list(spec.prompt_token_ids) if spec.prompt_token_ids else None,
                       prefix_name=spec.prefix_name or None, request_id=request_id)
    return await engine.score_async(req, runtime.executor)


async def prepare(runtime: Runtime, spec: RequestSpec, request_id: str) -> tuple[EngineClient, GenerateRequest]:
    """The engine request for spec, once the server serves (ServerNotReady before)."""
    engine, _ = runtime.require_ready()
    req = await asyncio.get_running_loop().run_in_executor(runtime.executor, build_request, engine, spec,
                                                           request_id)
    return engine, req
