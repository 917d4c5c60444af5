"""Sampling parameters of one request, validated at the edge."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from prefix_service.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
# a temperature below this is greedy (vLLM's bound): logits over a smaller one overflow float32, or
# the temperature itself rounds to 0 there, and the draw could only pick the argmax anyway
GREEDY_TEMPERATURE = 1e-5
# the least repetition penalty: a logit over a smaller one, then over the temperature, overflows
# float32 (below ~1e-38 the penalty itself rounds to 0 there), and the draw picks garbage
MIN_REPETITION_PENALTY = 1e-3
MAX_N = 64  # samples per request


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (engine/structured.py): kind json_schema (spec: the schema as
    JSON text), json_object (any JSON object), regex (spec), choice (choices: exactly one of
    them), grammar (spec: a Lark grammar) or text (free text, even on a template that has a
    default output). param: the request field it came from, for errors."""
    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    param: str = field(default="structured_output", compare=False)

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "text")

    def __post_init__(self) -> None:
        """Whatever the API it comes from, a constraint is one the state file can hold and read back
        (to_dict, from_dict): a choice of non-empty strings, a non-empty spec for a kind that has one.
        InvalidRequest naming param."""
        where = self.param
        if self.kind not in self.KINDS:
            raise InvalidRequest(f"{where}: the kind {self.kind!r} is none of {', '.join(self.KINDS)}", param=where)
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise InvalidRequest(f"{where}: expected a list of non-empty strings, got "
                                     f"{str(list(self.choices))[:80]!r}", param=where)
        elif self.kind in ("json_schema", "regex", "grammar") and (not isinstance(self.spec, str) or not self.spec):
            raise InvalidRequest(f"{where}: expected a non-empty string, got {str(self.spec)[:80]!r}", param=where)

    @classmethod
    def from_dict(cls, d: Any, param: str = "structured_output") -> StructuredOutput:
        """From its written form (YAML, the state file): one key of json_schema (a mapping, or JSON
        text), json_object (true), regex, choice (a list of strings), grammar or text (true).
        InvalidRequest naming param."""
        if not isinstance(d, dict) or len(d) != 1 or next(iter(d)) not in cls.KINDS:
            raise InvalidRequest(f"{param}: expected one of {', '.join(cls.KINDS)}, as a mapping of one key "
                                 f"(e.g. {{choice: [yes, no]}}), got {str(d)[:80]!r}", param=param)
        (kind, value), = d.items()
        where = f"{param}.{kind}"
        if kind in ("json_object", "text"):
            if value is not True:
                raise InvalidRequest(f"{where}: expected true, got {value!r}", param=where)
            return cls(kind, param=param)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest(f"{where}: expected a list of non-empty strings, got {str(value)[:80]!r}",
                                     param=where)
            return cls(kind, choices=tuple(value), param=param)
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{where}: expected a non-empty string, got {str(value)[:80]!r}", param=where)
        return cls(kind, value, param=param)

    def to_dict(self) -> dict[str, Any]:
        """The written form from_dict reads."""
        if self.kind in ("json_object", "text"):
            return {self.kind: True}
        if self.kind == "choice":
            return {"choice": list(self.choices)}
        return {self.kind: self.spec}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: the configured default
    temperature: float = 0.0  # 0 (or below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # None: drawn from the engine's generator
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: each new token's, with the k most likely alternatives
    # (the model's distribution: before penalties, logit_bias, min_tokens and temperature)
    logprobs: int | None = None
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from each token already generated
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the generated tokens
    # [0.001, 2]: logits of prompt and generated tokens divided (> 0) or multiplied
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, [-100, 100]) added to its logit
    min_tokens: int = 0  # EOS and stop token ids are masked, stop strings unchecked, until this many
    n: int = 1  # samples of this prompt, each its own output (RequestOutput.index); the prompt is computed once
    structured: StructuredOutput | None = None  # what the output must be; None: the template's default output, else free text

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the model's logits before the choice (besides temperature,
        top-k and top-p)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def validate(self, *, max_tokens_cap: int, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field."""
        def bad(msg: str, param: str | None = None) -> None:  # msg starts with the field's name
            raise InvalidRequest(f"invalid sampling parameters: {msg}", param=param or msg.split(" ", 1)[0])

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
            if self.max_tokens > max_tokens_cap:
                bad(f"max_tokens {self.max_tokens} exceeds the configured cap {max_tokens_cap}")
        if not _real(self.temperature) or self.temperature < 0 or self.temperature > 100:
            bad(f"temperature must be in [0, 100] (0 or below {GREEDY_TEMPERATURE:g} = greedy), "
                f"got {self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be >= 0 (0 or -1 = no limit), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            bad(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                bad(f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters, got {s!r}", "stop")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                bad(f"stop_token_ids must be token ids in [0, {vocab_size}), got {t!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -2 <= value <= 2:
                bad(f"{name} must be in [-2, 2], got {value!r}")
        if not _real(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            bad(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2] (1 = none), "
                f"got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
        biased: set[int] = set()
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                bad(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}", "logit_bias")
            if not _real(b) or not -100 <= b <= 100:
                bad(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}", "logit_bias")
            if t in biased:  # two biases would add up past the range
                bad(f"logit_bias gives token {t} more than one bias (keys such as \"{t}\" and \"0{t}\" name the "
                    f"same token); give each token one", "logit_bias")
            biased.add(t)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")


def _real(x: object) -> bool:
    """A finite number (not a bool); an int past float's range is not one."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
