"""Sampling parameters of one request, validated at the edge."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefix_service.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: the configured default
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # None: drawn from the engine's generator
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, *, max_tokens_cap: int, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first bad field."""
        def bad(msg: str, param: str | None = None) -> None:  # msg starts with the field's name
            raise InvalidRequest(f"invalid sampling parameters: {msg}", param=param or msg.split(" ", 1)[0])

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
            if self.max_tokens > max_tokens_cap:
                bad(f"max_tokens {self.max_tokens} exceeds the configured cap {max_tokens_cap}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0 or self.temperature > 100:
            bad(f"temperature must be in [0, 100] (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) \
                or not 0 < self.top_p <= 1:
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
