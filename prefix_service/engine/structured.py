"""Structured outputs: a constraint on what a request may generate, through llguidance.

A request's `SamplingParams.structured` names a JSON schema, any JSON object, a regular
expression, a choice of strings or a Lark grammar, or (kind "text") free text; a template may
carry one as its default output, which a request's own replaces. Engine.submit (and
Engine.add_template, for a template's) compiles and checks it on the caller's thread, so a long
compile never holds up the engine's steps: an error names the problem before anything is
queued, and a compiled constraint, kept per constraint, is a matcher that has consumed nothing.
Each sequence takes a copy of it (microseconds). Each step the sampler masks every constrained
row's logits to the tokens its matcher allows, in the same batch as free rows, and the engine
feeds the sampled token back; once the matcher can take nothing more, the output is complete
(finish reason stop). Where the mask allows one token only, position after position, the engine
takes those tokens without a step each (scheduler.jump_forward; only_token checks each).

Work is bounded (scheduler.grammar_compile_fuel, scheduler.grammar_step_fuel: llguidance's lexer
fuel): a constraint whose compile needs more is refused at admission; a sequence whose mask would
need more in one step ends with an error naming its constraint, and the step goes on for the rest.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from prefix_service.errors import InvalidRequest
from prefix_service.sampling_params import StructuredOutput

MAX_CACHED = 256  # compiled constraints kept
DEFAULT_COMPILE_FUEL = 1_000_000  # llguidance's lexer fuel for a compile (about 50k a millisecond)
DEFAULT_STEP_FUEL = 200_000  # for one sequence's mask in one step (about 14k a millisecond)


class StructuredOutputs:
    """Compiles constraints for one tokenizer (llguidance's view of it is built on first use).
    Thread-safe: callers' threads compile, the engine's thread copies the compiled matchers.
    vocab_size: the model's logits per row, which may pass the tokenizer's tokens (a vocabulary
    padded to a round size, as Qwen2.5's 151,936 rows for 151,665 tokens): the masks cover every
    row, the padding never allowed (None: the tokenizer's size)."""

    def __init__(self, hf_tokenizer: Any, compile_fuel: int = DEFAULT_COMPILE_FUEL,
                 step_fuel: int = DEFAULT_STEP_FUEL, vocab_size: int | None = None) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._tokenizer: Any = None
        self._limits: Any = None
        self._fuel = (compile_fuel, step_fuel)
        self._compiled: dict[StructuredOutput, Any] = {}
        self._lock = threading.Lock()

    def _llg(self) -> tuple[Any, Any]:
        """llguidance's tokenizer and the parser limits, built once."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf
                # verbose_errors off: an error names the problem, not the parser's state
                self._limits = llguidance.LLParserLimits(initial_lexer_fuel=self._fuel[0],
                                                         step_lexer_fuel=self._fuel[1], verbose_errors=False)
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size)
            return self._tokenizer, self._limits

    def compile(self, spec: StructuredOutput) -> Any:
        """A matcher for the constraint that has consumed nothing (each sequence takes a copy with
        `start`), or None for free text (kind "text"). InvalidRequest naming the problem."""
        if spec.kind == "text":
            return None
        with self._lock:
            cached = self._compiled.get(spec)
        if cached is not None:
            return cached
        import llguidance
        tokenizer, limits = self._llg()
        grammar = _grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error:
            raise InvalidRequest(f"{spec.param} ({spec.kind}): {error}", param=spec.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():  # a limit the validation did not reach
            raise InvalidRequest(f"{spec.param} ({spec.kind}): {matcher.get_error()}", param=spec.param)
        with self._lock:
            if len(self._compiled) >= MAX_CACHED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = matcher
        return matcher


def start(compiled: Any) -> Any:
    """A sequence's own matcher from a compiled one (StructuredOutputs.compile)."""
    return compiled.deep_copy()


def only_token(matcher: Any, vocab_size: int) -> int | None:
    """The one token matcher's mask allows next, or None where it allows more than one (or none)."""
    import llguidance.numpy as ln
    bitmask = ln.allocate_token_bitmask(1, vocab_size)
    ln.fill_next_token_bitmask(matcher, bitmask, 0)
    words = np.flatnonzero(bitmask[0])
    if len(words) != 1:
        return None
    word = int(bitmask[0, words[0]]) & 0xFFFFFFFF
    if word & (word - 1):  # more than one bit
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def _grammar(spec: StructuredOutput) -> str:
    import llguidance
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            # compact JSON, as OpenAI's outputs are: no run of whitespace for a model to wander in
            schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
            grammar: str = llguidance.grammar_from("json_schema", json.dumps(schema))
        elif spec.kind == "regex":
            grammar = llguidance.grammar_from("regex", spec.spec)
        elif spec.kind == "choice":
            if not spec.choices:
                raise ValueError("a choice needs at least one string")
            grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choices))
        elif spec.kind == "grammar":
            grammar = llguidance.grammar_from("lark", spec.spec)
        else:
            raise ValueError(f"unknown kind {spec.kind!r} (json_schema, json_object, regex, choice, grammar, text)")
    except ValueError as e:
        raise InvalidRequest(f"{spec.param} ({spec.kind}): {e}", param=spec.param) from None
    return grammar


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where bit k is set and -inf where it is not."""
    table = _BYTE_BIAS.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_BIAS[(device, dtype)] = torch.where(bits.bool(), 0.0, float("-inf")).to(device, dtype)
    return table


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Set logits[rows[i]] to -inf wherever matchers[i] allows no token (in place)."""
    # llguidance.numpy, not llguidance.torch: importing the latter runs a torch.compile decorator,
    # which loads dynamo and inductor (seconds) on the engine's thread at the first constrained step
    import llguidance.numpy as ln
    vocab = logits.shape[-1]
    bitmask = ln.allocate_token_bitmask(len(rows), vocab)  # [rows, ceil(vocab / 32)] int32, bit t: token t
    for i, matcher in enumerate(matchers):
        ln.fill_next_token_bitmask(matcher, bitmask, i)
    # each byte of the mask (8 tokens) looks up its 8 biases (0 or -inf), added to the rows: a
    # boolean masked_fill of the same rows costs about ten times as much on a CPU
    by = torch.from_numpy(bitmask).view(torch.uint8).to(logits.device).flatten().long()
    bias = _byte_bias(logits.device, logits.dtype).index_select(0, by).view(len(rows), -1)[:, :vocab]
    logits.index_add_(0, torch.tensor(rows, dtype=torch.int64, device=logits.device), bias)
