"""Structured outputs: a constraint on what a request may generate, through llguidance.

A request's `SamplingParams.structured` names a JSON schema, any JSON object, a regular
expression, a choice of strings or a Lark grammar. Engine.submit compiles and checks it on the
caller's thread, so a long compile never holds up the engine's steps (an error names the problem,
before anything is queued; a compiled grammar is kept per constraint, and admission on the
engine's thread finds it there); the sequence gets its own matcher. Each step the sampler masks every constrained
row's logits to the tokens its matcher allows, in the same batch as free rows, and the engine
feeds the sampled token back; once the matcher can take nothing more, the output is complete
(finish reason stop).
"""
from __future__ import annotations

import json
import threading
from typing import Any

import torch

from prefix_service.errors import InvalidRequest
from prefix_service.sampling_params import StructuredOutput

MAX_CACHED = 256  # compiled constraints kept


class StructuredOutputs:
    """Compiles constraints for one tokenizer (llguidance's view of it is built on first use).
    Thread-safe: callers' threads compile, the engine's thread finds the result."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self._tokenizer: Any = None
        self._grammars: dict[StructuredOutput, str] = {}
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf)
            return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The checked grammar of a constraint; InvalidRequest naming the problem."""
        with self._lock:
            cached = self._grammars.get(spec)
        if cached is not None:
            return cached
        import llguidance
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
                if not isinstance(schema, dict):
                    raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
                # compact JSON, as OpenAI's outputs are: no run of whitespace for a model to wander in
                schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
                grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
            elif spec.kind == "regex":
                grammar = llguidance.grammar_from("regex", spec.spec)
            elif spec.kind == "choice":
                if not spec.choices:
                    raise ValueError("a choice needs at least one string")
                grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choices))
            elif spec.kind == "grammar":
                grammar = llguidance.grammar_from("lark", spec.spec)
            else:
                raise ValueError(f"unknown kind {spec.kind!r} (json_schema, json_object, regex, choice, grammar)")
        except ValueError as e:
            raise InvalidRequest(f"structured output ({spec.kind}): {e}", param=spec.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequest(f"structured output ({spec.kind}): {error}", param=spec.param)
        with self._lock:
            if len(self._grammars) >= MAX_CACHED:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[spec] = grammar
        return grammar

    def matcher(self, grammar: str) -> Any:
        import llguidance
        return llguidance.LLMatcher(self.tokenizer, grammar)


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Set logits[rows[i]] to -inf wherever matchers[i] allows no token (in place)."""
    import llguidance.torch as lt
    vocab = logits.shape[-1]
    bitmask = lt.allocate_token_bitmask(len(rows), vocab)  # [rows, ceil(vocab / 32)] int32, bit t: token t
    for i, matcher in enumerate(matchers):
        lt.fill_next_token_bitmask(matcher, bitmask, i)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.int64)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
