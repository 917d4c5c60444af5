"""The systems under test, behind one small interface.

    engine_prefix      our Engine; requests name the workload's pinned prefix (none in no_shared)
    engine_no_prefix   our Engine with cache.enable_prefix: false; requests carry the full ids
    hf_generate        transformers `generate`, no reuse, one request at a time
    hf_prompt_cache    transformers `generate` on a deep copy of a prefix DynamicCache computed once
    hf_generate_batch  transformers continuous batching (its paged cache, with prefix block sharing)
    grpc_prefix        our gRPC server (a separate process) through prefix_service.client, naming the prefix
    grpc_no_prefix     the same server, the full prompt text and no prefix

`run` is blocking and thread-safe; the closed and open loops call it from many threads.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from prefix_service.bench.metrics import Timing
from prefix_service.bench.workloads import BenchRequest, Workload

SYSTEMS = ("engine_prefix", "engine_no_prefix", "hf_generate", "hf_prompt_cache", "hf_generate_batch",
           "grpc_prefix", "grpc_no_prefix")


class System:
    name: str = ""
    uses_prefix: bool = False  # sends the workload's prefix by reference (name or cache) when it has one

    def supports(self, workload: Workload) -> bool:
        """False where the system has nothing to show on this workload (e.g. a prefix cache, no prefix)."""
        return True

    def prepare(self, workload: Workload) -> None:
        """Untimed setup before the workload's first measured request (pin / compute the prefix)."""

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        raise NotImplementedError

    def kv_blocks_used(self) -> int | None:
        """KV blocks in use now (pinned prefixes included); None where the system cannot say."""
        return None

    def close(self) -> None:
        pass


class PeakSampler:
    """Samples a gauge from a background thread while active; `peak` is the highest value seen.
    Re-entrant across runs: start()/stop() around each timed section, peak accumulates."""

    def __init__(self, read: Callable[[], int | None], interval_s: float = 0.05) -> None:
        self._read = read
        self._interval = interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        value = self._read()
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakSampler:
        if self._read() is None:  # the system cannot report: no thread
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-kv-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()


def now() -> float:
    return time.perf_counter()
