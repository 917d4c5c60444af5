"""Per-request timings and the summary measures of one run.

Every time is `time.perf_counter()` in the benchmark process, taken by the client: `start` just
before the request is handed to the system (so queueing inside the system counts), `first` when
the first generated token reaches the client, `end` when the last one does. Our own systems also
report the engine's TTFT of each request (its admission by the engine to its first sampled token:
`RequestOutput.ttft_ms`, the gRPC answer's `usage.ttft_ms`); the client's TTFT less it is the time the
request spent outside the engine (submission, and for gRPC the front end and the transport).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Timing:
    start: float
    first: float | None = None
    end: float | None = None
    output_tokens: int = 0
    error: str | None = None  # set when the request failed or was cut off (open loop)
    engine_ttft_ms: float | None = None  # the engine's own TTFT, where the system reports it
    text: str = ""  # the answer, where the workload checks it (labels); "" otherwise

    def add_tokens(self, count: int, at: float, text: str = "") -> None:
        """`count` streamed tokens (and their `text`) arrived at `at`; the first arrival with any is
        the first token."""
        if count:
            if self.first is None:
                self.first = at
            self.output_tokens += count
        self.text += text

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.start) * 1000

    @property
    def ttft_outside_engine_ms(self) -> float | None:
        """The client's TTFT less the engine's: the first token's time outside the engine."""
        ttft = self.ttft_ms
        return None if ttft is None or self.engine_ttft_ms is None else ttft - self.engine_ttft_ms

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end is None else (self.end - self.start) * 1000

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first) * 1000 / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timings: list[Timing], wall_s: float) -> dict:
    """The record fields of one run: latency percentiles over the requests that finished, and
    throughput over the run's wall time."""
    done = [t for t in timings if t.ok]
    ttft = [t.ttft_ms for t in done if t.ttft_ms is not None]
    tpot = [t.tpot_ms for t in done if t.tpot_ms is not None]
    e2e = [t.e2e_ms for t in done if t.e2e_ms is not None]  # every one: a done request has ended
    engine_ttft = [t.engine_ttft_ms for t in done if t.engine_ttft_ms is not None]
    outside = [x for x in (t.ttft_outside_engine_ms for t in done) if x is not None]
    out_tokens = sum(t.output_tokens for t in done)
    return {
        "num_requests": len(timings),
        "num_failed": len(timings) - len(done),
        "ttft_p50_ms": _round(percentile(ttft, 50)),
        "ttft_p99_ms": _round(percentile(ttft, 99)),
        "engine_ttft_p50_ms": _round(percentile(engine_ttft, 50)),  # None: the system reports none
        "ttft_outside_engine_p50_ms": _round(percentile(outside, 50)),
        "tpot_p50_ms": _round(percentile(tpot, 50)),
        "e2e_p50_ms": _round(percentile(e2e, 50)),
        "e2e_p99_ms": _round(percentile(e2e, 99)),
        "output_tok_s": _round(out_tokens / wall_s if wall_s > 0 else None, 3),
        "req_s": _round(len(done) / wall_s if wall_s > 0 else None, 4),
        "wall_s": _round(wall_s, 3),
    }


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)
