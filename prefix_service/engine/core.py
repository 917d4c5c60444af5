"""EngineCore: one step of the engine, single-threaded. Owns the backend (the model and the KV
cache on a device), the scheduler and the prefix manager; validates requests, samples,
detokenizes, checks stops and hands each request's outputs to its sink. `Engine` (api.py)
drives it from a background thread.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from prefix_service.backends import hostmem, select_backend
from prefix_service.backends.base import BackendFactory
from prefix_service.config import EngineConfig
from prefix_service.engine.block_allocator import BlockAllocator
from prefix_service.engine.detokenizer import IncrementalDetokenizer
from prefix_service.errors import CacheExhausted, InvalidRequest, PrefixServiceError, PromptTooLong, QueueFull
from prefix_service.model.loader import choose_dtype, dummy_model, load_model, load_tokenizer, read_arch
from prefix_service.engine.prefix_cache import PrefixCacheManager, PrefixInfo
from prefix_service.engine.sampler import sample
from prefix_service.engine.scheduler import Scheduler
from prefix_service.engine.sequence import FinishReason, RequestOutput, Sequence, SeqStatus
from prefix_service.sampling_params import SamplingParams

log = logging.getLogger("prefix_service.engine")

Sink = Callable[[RequestOutput], None]


@dataclass
class _Tracked:
    """A request in flight, as the core follows it: where its outputs go and its timing."""
    seq: Sequence
    sink: Sink | None  # None for a template's warmup prefill
    detok: IncrementalDetokenizer | None
    arrival: float
    first_token_time: float | None = None
    on_pinned: Callable[[PrefixInfo | BaseException], None] | None = None
    source: dict[str, str] | None = None
    prefix_name: str | None = None  # a warmup's template (always set), or the template a request names


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise PrefixServiceError("model.device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


class EngineCore:
    """backend: builds the backend instead of the class model.backend selects (select_backend);
    for a benchmark that fixes a backend's kernel choices."""

    def __init__(self, config: EngineConfig, backend: BackendFactory | None = None) -> None:
        self.config = config
        mc = config.model
        if mc.num_threads is not None:
            torch.set_num_threads(mc.num_threads)  # process-wide: one engine per process
        self.device = resolve_device(mc.device)
        self.dtype, why = choose_dtype(mc.dtype, mc.path, self.device)
        log.info("model dtype %s: %s", str(self.dtype).replace("torch.", ""), why)
        self.arch = read_arch(mc.path)
        max_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.arch.sliding_window:
            max_len = min(max_len, self.arch.sliding_window)  # full attention inside the window
        self.max_model_len = max_len
        # first of what the engine loads: on a CPU it also sets malloc up for the rest (hostmem.py)
        if backend is None:
            backend = select_backend(mc.backend, self.device, self.dtype, self.arch)  # says which, and why
        elif self.device.type == "cpu":
            hostmem.keep_freed_memory()
        self.tokenizer = load_tokenizer(mc.path)
        if mc.load_format == "dummy":
            model = dummy_model(mc.path, self.dtype, self.device, max_positions=max_len, seed=mc.seed)
        else:
            model = load_model(mc.path, self.dtype, self.device, max_positions=max_len)
        self.backend = backend(model, config.cache)  # owns the model from here on
        self.block_size = config.cache.block_size
        self.allocator = BlockAllocator(self.backend.num_blocks)
        budget = config.cache.prefix_budget_blocks
        if budget is None:
            budget = self.allocator.num_blocks // 2
        self.prefixes = PrefixCacheManager(self.allocator, self.block_size, min(budget, self.allocator.num_blocks),
                                           hooks=self.backend)
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.prefixes, self.block_size)
        self._tracked: dict[str, _Tracked] = {}
        self._warmups = 0  # numbers the warmups' request ids
        self._seed_rng = random.Random(mc.seed)
        self.eos_token_ids = self._eos_ids()
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d, backend %s",
                 mc.path, self.device, str(self.dtype).replace("torch.", ""), self.allocator.num_blocks,
                 self.block_size, self.max_model_len, self.backend.describe())

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            import json
            from pathlib import Path
            gen = Path(self.config.model.path) / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except (OSError, ValueError):
            pass
        return ids

    # --- submission ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def _check_fits(self, num_tokens: int, what: str, shared_tokens: int = 0) -> None:
        """Context, then KV capacity: tokens in shared (pinned) prefix blocks take no own block."""
        if num_tokens >= self.max_model_len:
            raise PromptTooLong(
                f"{what} has {num_tokens} tokens; the model's context is {self.max_model_len} tokens "
                f"(prompt plus at least one generated token)")
        capacity = self.scheduler.capacity_blocks() * self.block_size
        if num_tokens - shared_tokens + 1 > capacity:
            raise CacheExhausted(
                f"{what} has {num_tokens - shared_tokens} tokens of its own but the KV cache has room for "
                f"{capacity} tokens beside the pinned templates, so it could never run; shorten it, or raise "
                f"cache.kv_cache_memory (server operator)")

    def add_request(self, request_id: str, prompt_ids: list[int], prefix_name: str | None,
                    sampling: SamplingParams, sink: Sink) -> None:
        """Validate and queue. Raises InvalidRequest, PromptTooLong (CacheExhausted), PrefixNotFound or
        QueueFull (when scheduler.max_queue requests wait already)."""
        if request_id in self._tracked:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        sampling.validate(max_tokens_cap=self.config.scheduler.max_tokens_cap, vocab_size=self.arch.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.arch.vocab_size}); got {bad[:4]}")
        cap = self.config.scheduler.max_prompt_tokens
        if cap is not None and len(prompt_ids) > cap:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {cap} "
                                f"per request after the prefix template (scheduler.max_prompt_tokens)")
        handle = self.prefixes.get(prefix_name) if prefix_name else None
        reused = handle if handle is not None and self.config.cache.enable_prefix else None  # its blocks shared
        token_ids = (list(handle.token_ids) if handle else []) + list(prompt_ids)
        if not token_ids:
            raise InvalidRequest("the prompt is empty and no prefix template was named")
        shared = 0
        if reused is not None:  # the full prefix blocks the scheduler will share (see Scheduler._attach_prefix)
            shared = reused.reused_tokens(len(token_ids)) // self.block_size * self.block_size
        self._check_fits(len(token_ids), "the prompt" + (f" (with prefix {prefix_name!r})" if handle else ""), shared)
        max_queue = self.config.scheduler.max_queue  # checked after validation: a bad request hears why
        if len(self.scheduler.waiting) >= max_queue:
            raise QueueFull(f"the waiting queue is full ({max_queue} requests wait already, scheduler.max_queue); "
                            f"retry later with backoff")
        max_tokens = sampling.max_tokens or self.config.scheduler.default_max_tokens
        generator = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed % 2**63 if seed >= 2**63 else seed)
        seq = Sequence(request_id, token_ids, sampling, max_tokens, reused, generator)
        if reused is not None:
            self.prefixes.acquire(reused)
        elif handle is not None:
            self.prefixes.count_unreused(handle)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, sampling.stop)
        self._tracked[request_id] = _Tracked(seq, sink, detok, time.perf_counter(), prefix_name=prefix_name)
        self.scheduler.add(seq)

    def add_prefix(self, name: str, token_ids: list[int], source: dict[str, str],
                   on_pinned: Callable[[PrefixInfo | BaseException], None]) -> None:
        """Queue a template's warmup prefill; on_pinned gets its PrefixInfo (or the error) when done."""
        if not token_ids:
            raise InvalidRequest(f"prefix template {name!r} is empty")
        self._check_fits(len(token_ids), f"prefix template {name!r}")
        self.prefixes.reserve(name, len(token_ids))
        request_id = f"prefix-warmup:{name}:{self._warmups}"
        self._warmups += 1
        seq = Sequence(request_id, token_ids, SamplingParams(max_tokens=1), 1, None, None, prefill_only=True)
        self._tracked[request_id] = _Tracked(seq, None, None, time.perf_counter(), on_pinned=on_pinned, source=source,
                                             prefix_name=name)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False
        self._finish(tracked, FinishReason.ABORT)
        return True

    def abort_all(self, error: BaseException | None = None) -> None:
        for tracked in list(self._tracked.values()):
            self._finish(tracked, FinishReason.ABORT, error=error)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        out = self.scheduler.schedule()
        for stuck in out.unschedulable:
            # Ended, never retried: with no output yet it fails (CacheExhausted, RESOURCE_EXHAUSTED at
            # the API); with output it finishes with LENGTH, like a request that reaches the context.
            log.warning("request %s does not fit in the KV cache even alone; ending it", stuck.request_id)
            err = CacheExhausted(f"request {stuck.request_id} needs more KV blocks than the cache has beside the "
                                 f"pinned templates ({self.allocator.num_blocks} blocks in all); shorten the prompt, "
                                 f"or raise cache.kv_cache_memory (server operator)")
            self._finish(self._tracked[stuck.request_id], FinishReason.LENGTH,
                         error=err if stuck.num_output_tokens == 0 else None)
        if out.is_empty:
            return
        logits = self.backend.execute(out.step)
        sample_seqs = out.sampled
        tokens = sample(logits, sample_seqs) if logits is not None else []
        self.scheduler.postprocess(out, sample_seqs, tokens)
        for s in out.scheduled:
            if s.seq.prefill_only and s.seq.num_uncomputed == 0:
                self._pin_warmup(self._tracked[s.seq.request_id])
        now = time.perf_counter()
        for seq, token in zip(sample_seqs, tokens):
            self._after_token(self._tracked[seq.request_id], token, now)

    def _pin_warmup(self, tracked: _Tracked) -> None:
        seq, name = tracked.seq, tracked.prefix_name
        assert name is not None  # a warmup names its template
        try:  # the backend hears of the pin (on_pin) and may fail, e.g. out of memory for a packed copy
            handle = self.prefixes.pin(name, seq.token_ids, seq.block_table, tracked.source or {})
        except Exception as e:  # noqa: BLE001 - the warmup fails, nothing else does
            log.exception("pinning prefix template %r failed", tracked.prefix_name)
            self._finish(tracked, FinishReason.ABORT, error=e)
            return
        self.scheduler.finish(seq, FinishReason.STOP)  # the pin keeps the blocks
        del self._tracked[seq.request_id]
        if tracked.on_pinned:
            tracked.on_pinned(handle.info())

    def _after_token(self, tracked: _Tracked, token: int, now: float) -> None:
        """A sequence got `token` (the scheduler appended it): stream it, or finish on a stop."""
        seq, sink, detok = tracked.seq, tracked.sink, tracked.detok
        assert sink is not None and detok is not None  # a request's (a warmup samples no token)
        if tracked.first_token_time is None:
            tracked.first_token_time = now
        reason = None
        p = seq.sampling
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = FinishReason.STOP
            text = ""
        else:
            text, hit_stop = detok.add(token)
            if hit_stop:
                reason = FinishReason.STOP
        if reason is None and (seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is None:
            sink(RequestOutput(seq.request_id, text, [token]))
        else:
            self._finish(tracked, reason, text=text, token_ids=[token])

    def _finish(self, tracked: _Tracked, reason: FinishReason, *, text: str = "", token_ids: list[int] | None = None,
                error: BaseException | None = None) -> None:
        seq = tracked.seq
        reused = seq.num_prefix_tokens_reused
        self.scheduler.finish(seq, reason)
        del self._tracked[seq.request_id]
        if tracked.sink is None:  # a warmup that did not complete
            assert tracked.prefix_name is not None  # a warmup names its template
            self.prefixes.cancel(tracked.prefix_name)
            if tracked.on_pinned:
                tracked.on_pinned(error or PrefixServiceError(f"warmup of prefix template {tracked.prefix_name!r} was aborted"))
            return
        if tracked.detok is not None:
            text += tracked.detok.flush()
        ttft = None if tracked.first_token_time is None else (tracked.first_token_time - tracked.arrival) * 1000
        tracked.sink(RequestOutput(
            seq.request_id, text, token_ids or [], finished=True, finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens, prefix_tokens=reused,
            completion_tokens=seq.num_output_tokens, ttft_ms=ttft, error=error))

    # --- introspection -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Allocator invariants, and every block's count equals the references its holders claim."""
        expected = self.prefixes.held_refs()
        for b, c in self.scheduler.held_refs().items():
            expected[b] = expected.get(b, 0) + c
        self.allocator.check_integrity(expected)
        self.backend.check_integrity(self.prefixes.pinned_handles())
        if any(s.status is SeqStatus.FINISHED for s in self.scheduler.running):
            raise AssertionError("a finished sequence is still running")

    def reset_kv_peak(self) -> None:
        """Start kv_stats()["peak_used"] over from the blocks in use now."""
        self.allocator.reset_peak()

    def kv_stats(self) -> dict[str, int]:
        return {"num_blocks": self.allocator.num_blocks, "used": self.allocator.num_used,
                "peak_used": self.allocator.peak_used,  # most in use at once since reset_kv_peak()
                "free": self.allocator.num_free, "pinned": self.prefixes.num_pinned_blocks,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "preemptions": self.scheduler.num_preemptions,
                # host memory the backend holds for pinned templates (packed K/V copies), outside the KV cache
                "packed_prefix_bytes": self.backend.packed_template_bytes()}
