"""Our Engine, in process: the same token ids with a named prefix or without one."""
from __future__ import annotations

import dataclasses
import threading

from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import System, now
from prefix_service.bench.workloads import BenchRequest, Workload
from prefix_service.config import EngineConfig
from prefix_service.engine import Engine
from prefix_service.sampling_params import SamplingParams, StructuredOutput
from prefix_service.engine.sequence import GenerateRequest, RequestOutput


class EngineSystem(System):
    """engine_prefix: prefix support on, requests name the workload's pinned template.
    engine_no_prefix: cache.enable_prefix false, requests carry prefix ids + prompt ids."""

    def __init__(self, config: EngineConfig, use_prefix: bool) -> None:
        self.uses_prefix = use_prefix
        self.name = "engine_prefix" if use_prefix else "engine_no_prefix"
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix=use_prefix))
        self.engine = Engine(config)
        self._pinned: set[str] = set()

    def prepare(self, workload: Workload) -> None:
        name = workload.prefix_name  # None: the workload has no prefix (has_prefix)
        if self.uses_prefix and name is not None and name not in self._pinned:
            self.engine.add_template(name, token_ids=list(workload.prefix_ids))
            self._pinned.add(name)

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        by_name = self.uses_prefix and workload.has_prefix
        constrained = workload.constrained
        constraint = workload.structured_output()
        sampling = (SamplingParams(max_tokens=workload.output_tokens, structured=StructuredOutput.from_dict(constraint))
                    if constraint else SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True))
        request = GenerateRequest(
            prompt_token_ids=list(req.prompt_ids) if by_name else workload.full_ids(req),
            prefix_name=workload.prefix_name if by_name else None, sampling=sampling)
        timing = Timing(start=now())
        done = threading.Event()

        def sink(out: RequestOutput) -> None:  # on the engine's loop thread: keep it short
            t = now()
            timing.add_tokens(len(out.token_ids), t, out.text if constrained else "")
            if out.finished:
                timing.end = t
                timing.engine_ttft_ms = out.ttft_ms
                if out.error is not None:
                    timing.error = f"{type(out.error).__name__}: {out.error}"
                done.set()

        try:
            request_id = self.engine.submit(request, sink)
        except Exception as e:  # refused: counts as a failed request
            timing.error = f"{type(e).__name__}: {e}"
            return timing
        if not done.wait(timeout_s):
            self.engine.abort(request_id)
            done.wait()
            timing.error = timing.error or f"no answer within {timeout_s:.0f} s"
        return timing

    def kv_peak_start(self) -> bool:
        self.engine.reset_kv_peak()
        return True

    def kv_blocks_peak(self) -> int | None:
        return self.engine.kv_stats()["peak_used"]

    def kv_blocks_pinned(self) -> int:
        return self.engine.kv_stats()["pinned"]

    def close(self) -> None:
        self.engine.shutdown()
