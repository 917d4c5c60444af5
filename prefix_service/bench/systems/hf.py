"""Hugging Face transformers baselines on the same token ids.

  hf_generate        `model.generate` on prefix + prompt ids: no reuse.
  hf_prompt_cache    the pattern the transformers docs recommend for a shared prompt: run the
                     prefix once into a `DynamicCache`, then per request `copy.deepcopy` it and
                     `generate` on the full ids (generate skips the cached positions).
  hf_generate_batch  continuous batching (`init_continuous_batching`, the manager behind
                     `generate_batch`): paged KV cache, chunked prefill, and, in the installed
                     version, prefix block sharing (`allow_block_sharing`: full pages are hashed and
                     reused across requests, and stay cached after their requests end).

`generate` serves one request at a time: concurrent callers queue on a lock (so closed-loop
throughput at any concurrency is the sequential throughput; latency includes the wait). Time to
first token comes from a streamer whose second `put` is the first generated token (the first
is the prompt). Greedy, EOS ignored (`min_new_tokens` = `max_new_tokens`), sdpa attention, the
engine's device and dtype (model.dtype as the engine resolves it), the same torch threads as our
engine. None of them runs a constrained workload (labels, records): they have no constraints.
"""
from __future__ import annotations

import concurrent.futures
import copy
import itertools
import logging
import threading

import torch

from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import System, now
from prefix_service.bench.workloads import BenchRequest, Workload


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype):
    """The checkpoint through transformers, on our engine's device and dtype."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    # transformers wraps PreTrainedModel.to in a decorator whose annotations lose torch's signature
    return model.to(device).eval()  # type: ignore[arg-type]


class _FirstTokenStreamer:
    """A `generate` streamer that stamps the first generated token."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self._puts = 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:  # put #1 is the prompt
            self.timing.first = now()

    def end(self) -> None:
        pass


class HFGenerate(System):
    """hf_generate (prompt_cache=False) and hf_prompt_cache (True) on one shared model."""

    def __init__(self, model, tokenizer, prompt_cache: bool, lock: threading.Lock) -> None:
        self.model = model
        self.uses_prefix = prompt_cache
        self.name = "hf_prompt_cache" if prompt_cache else "hf_generate"
        self._lock = lock  # shared by both: one generate at a time on the model
        self._caches: dict[str, object] = {}
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def supports(self, workload: Workload) -> bool:
        return not workload.constrained and (workload.has_prefix or not self.uses_prefix)  # no constraints here

    @torch.inference_mode()
    def prepare(self, workload: Workload) -> None:
        if self.uses_prefix and workload.name not in self._caches:
            from transformers import DynamicCache
            with self._lock:
                cache = DynamicCache(config=self.model.config)
                ids = torch.tensor([list(workload.prefix_ids)], device=self.model.device)
                self._caches[workload.name] = self.model(input_ids=ids, past_key_values=cache,
                                                         use_cache=True).past_key_values

    @torch.inference_mode()
    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        from transformers import GenerationConfig
        ids = torch.tensor([workload.full_ids(req)], device=self.model.device)
        n = workload.output_tokens
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=self._pad)
        timing = Timing(start=now())
        with self._lock:
            kwargs = {}
            if self.uses_prefix:
                kwargs["past_key_values"] = copy.deepcopy(self._caches[workload.name])
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=_FirstTokenStreamer(timing), **kwargs)
            timing.end = now()
        timing.output_tokens = out.shape[1] - ids.shape[1]
        return timing


class HFGenerateBatch(System):
    """Continuous batching through the manager's request API; one thread routes finished results."""

    name = "hf_generate_batch"
    uses_prefix = True  # automatic: its prefix sharing finds the shared pages by hash

    def __init__(self, model, *, page_size: int, num_blocks: int, max_batch_tokens: int, max_requests: int,
                 output_tokens: int) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.ERROR)
        self.model = model
        gen = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=-1)
        cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_requests, allow_block_sharing=True)
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._router = threading.Thread(target=self._route, name="bench-hf-cb-results", daemon=True)
        self._router.start()
        self._warm: set[str] = set()

    def _route(self) -> None:
        while not self._stop.is_set():
            result = self.manager.get_result(timeout=0.05)
            if result is None or not result.is_finished():
                continue
            with self._lock:
                fut = self._pending.pop(result.request_id, None)
            if fut is not None:
                fut.set_result(result)

    def supports(self, workload: Workload) -> bool:
        return not workload.constrained  # no structured outputs in transformers' batching

    def prepare(self, workload: Workload) -> None:
        """One untimed request on the workload, so its prefix pages are cached like our pinned ones."""
        if workload.has_prefix and workload.name not in self._warm:
            self.run(workload, workload.request(-1))
            self._warm.add(workload.name)

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        request_id = f"bench-{next(self._ids)}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending[request_id] = fut
        timing = Timing(start=now())
        self.manager.add_request(workload.full_ids(req), request_id=request_id, max_new_tokens=workload.output_tokens,
                                 record_timestamps=True, eos_token_id=-1)
        try:
            result = fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.manager.cancel_request(request_id)
            timing.error = f"no answer within {timeout_s:.0f} s"
            return timing
        if result.error is not None:
            timing.error = str(result.error)
        stamps = result.timestamps or []
        timing.first = stamps[0] if stamps else None
        timing.end = stamps[-1] if stamps else now()
        timing.output_tokens = len(result.generated_tokens)
        return timing

    def close(self) -> None:
        self._stop.set()
        self._router.join()
        self.manager.stop(block=True, timeout=30)
