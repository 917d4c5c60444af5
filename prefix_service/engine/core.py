"""EngineCore: one step of the engine, single-threaded. Owns the backend (the model and the KV
cache on a device), the scheduler and the template pins; validates requests, samples,
detokenizes, checks stops and hands each request's outputs to its sink. `Engine` (api.py)
drives it from a background thread.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from prefix_service.backends import hostmem, select_backend
from prefix_service.backends.base import Backend, BackendFactory
from prefix_service.backends.kv_cache import auto_kv_cache_memory
from prefix_service.config import CacheConfig, EngineConfig
from prefix_service.engine.block_allocator import BlockAllocator
from prefix_service.engine.detokenizer import IncrementalDetokenizer
from prefix_service.errors import (CacheExhausted, ConfigError, EngineStopped, InvalidRequest, PrefixServiceError,
                                   PromptTooLong, QueueFull)
from prefix_service.model.loader import choose_dtype, dummy_model, load_model, load_tokenizer, read_arch
from prefix_service.model.quantize import quantize_model, release_int8
from prefix_service.engine.template_pins import TemplatePins, TemplateHandle, TemplateInfo
from prefix_service.engine.sampler import sample, token_logprobs, uniforms
from prefix_service.engine.scheduler import MAX_FAILED_STEPS, ScheduledSeq, Scheduler, SchedulerOutput
from prefix_service.engine.scoring import Scoring, ScoreSink, check_candidates
from prefix_service.engine.structured import StructuredOutputs, only_token, start
from prefix_service.engine.snapshots import SnapshotReader
from prefix_service.engine.speculation import Drafter
from prefix_service.engine.template_snapshots import TemplateSnapshots
from prefix_service.engine.sequence import FinishReason, RequestOutput, Sequence, SeqStatus, TokenLogprob
from prefix_service.sampling_params import SamplingParams, StructuredOutput

log = logging.getLogger("prefix_service.engine")

Sink = Callable[[RequestOutput], None]


# What a CUDA error looks like once the device's context is broken (an illegal address, a
# device-side assert, a failed launch): the same context fails every later call. Out-of-memory is
# not one of them (torch.OutOfMemoryError, a request that can fail alone).
_FATAL_DEVICE_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                         "CUBLAS_STATUS_EXECUTION_FAILED", "CUDA driver error")


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether `error` leaves the GPU unusable for this process (then it must restart)."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
        return False  # the allocator's or a library's workspace: the context is still good
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises CUDA errors as this
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _FATAL_DEVICE_MARKERS)


@dataclass
class _Tracked:
    """A request in flight, as the core follows it: where its outputs go and its timing."""
    seq: Sequence
    sink: Sink | None  # None for a template's warmup prefill
    detok: IncrementalDetokenizer | None
    arrival: float
    first_token_time: float | None = None
    on_pinned: Callable[[TemplateInfo | BaseException], None] | None = None
    source: dict[str, str] | None = None
    prefix_name: str | None = None  # a warmup's template (always set), or the template a request names
    default_output: tuple[StructuredOutput, Any] | None = None  # a warmup's template's: spec, compiled matcher
    held: _Held | None = None  # a forced run waiting for its logprobs


@dataclass
class _Held:
    """A forced run taken after a sampled token, for a request that asked for logprobs: it goes to the
    caller once the steps that compute its tokens have given their logprobs (Sequence.held_from),
    with their texts, and ends the request then if one of them did (reason)."""
    tokens: list[int]
    texts: list[str]
    reason: FinishReason | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Drafted:
    """A drafted sequence's step while its rows are drawn from (EngineCore._verify_drafts): the
    draft, its rows' logits, and the tokens drawn so far with their texts and logprobs."""
    tracked: _Tracked
    draft: tuple[int, ...]
    rows: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    kept: int = 0  # draft tokens drawn at their places
    reason: FinishReason | None = None


@dataclass
class _Samples:
    """A request for n > 1 samples: its prompt, a fork point, until it is computed; then n
    sequences forked from it, each sampling on its own."""
    request_id: str
    sink: Sink
    parent: Sequence | None
    arrival: float
    prefix_name: str | None
    remaining: int  # samples not finished yet
    matcher: Any = None  # the samples' structured output, compiled (each sample starts a copy)
    children: list[str] = field(default_factory=list)  # the samples' tracked ids (request id NUL index)


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
        if mc.max_model_len is not None and mc.max_model_len > self.arch.max_position_embeddings:
            # past the positions the model was trained on (and its rotary tables were sized for; 1e8
            # asked for 25 GB of them)
            raise ConfigError(f"model.max_model_len: {mc.max_model_len} is over the model's "
                              f"max_position_embeddings {self.arch.max_position_embeddings}; leave it unset for that")
        max_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.arch.sliding_window:
            max_len = min(max_len, self.arch.sliding_window)  # full attention inside the window
        self.max_model_len = max_len
        # first of what the engine loads: on a CPU it also sets malloc up for the rest (hostmem.py)
        if backend is None:
            backend = select_backend(mc.backend, self.device, self.dtype, self.arch)  # says which, and why
            if isinstance(backend, type):  # a cache it cannot hold: refused before the weights load
                backend.cache_dtype(config.cache, self.dtype)
                if mc.batch_invariant:
                    backend.require_batch_invariance(self.dtype)
        else:
            if mc.batch_invariant and not (isinstance(backend, type) and issubclass(backend, Backend)):
                raise ConfigError("model.batch_invariant: the engine was handed a backend factory, not a backend "
                                  "class (a factory fixes the backend's choices itself)")
            if self.device.type == "cpu":
                hostmem.keep_freed_memory()
        self.tokenizer = load_tokenizer(mc.path)
        if mc.load_format == "dummy":
            model = dummy_model(mc.path, self.dtype, self.device, max_positions=max_len, seed=mc.seed)
        else:
            model = load_model(mc.path, self.dtype, self.device, max_positions=max_len)
        if mc.quantization != "none":
            count = quantize_model(model, mc.quantization)
            log.info("model.quantization %s: %d decoder linears hold int8 weights, one scale per output row "
                     "(the output head and embeddings as loaded)", mc.quantization, count)
        cache = config.cache
        if cache.num_blocks is None and cache.kv_cache_memory == "auto" and self.device.type == "cuda":
            cache = dataclasses.replace(cache, kv_cache_memory=auto_kv_cache_memory(model, config, self.device))
            log.info("KV cache: %.1f GiB (cache.kv_cache_memory auto: %.0f%% of the GPU's memory after the model)",
                     int(cache.kv_cache_memory) / (1 << 30), 100 * cache.gpu_memory_utilization)
        if mc.batch_invariant and isinstance(backend, type) and issubclass(backend, Backend):  # (checked above)
            self.backend = backend(model, cache, batch_invariant=True)  # owns the model from here on
        else:
            self.backend = backend(model, cache)
        release_int8(model)  # int8 weights: the backend has packed what it reads of them
        if mc.quantization != "none" and not self.backend.int8_linears:
            log.warning("model.quantization %s: no linear of this backend reads the int8 weights (%s); they run as "
                        "their values in %s, with int8's rounding and none of its speed", mc.quantization,
                        self.backend.describe(), str(self.dtype).removeprefix("torch."))
        self.block_size = config.cache.block_size
        self.allocator = BlockAllocator(self.backend.num_blocks)
        self.templates = TemplatePins(self.allocator, self.block_size, self._prefix_budget(config.cache),
                                      hooks=self.backend)
        self.drafter = Drafter(config.scheduler, self.max_model_len) if config.scheduler.speculative_tokens else None
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.templates, self.block_size, self.drafter)
        self._tracked: dict[str, _Tracked] = {}
        self._scorings: dict[str, Scoring] = {}
        self._scoring_of: dict[int, Scoring] = {}  # id(sequence) -> the Score request it belongs to
        self._samples: dict[str, _Samples] = {}  # requests with n > 1
        self._samples_of: dict[int, _Samples] = {}  # id(fork point) -> its request
        self._warmups = 0  # numbers the warmups' request ids
        self._undeliverable: list[str] = []  # requests whose sink raised, aborted at the next step
        self._seed_rng = random.Random(mc.seed)
        self.eos_token_ids = self._eos_ids()
        sc = config.scheduler
        self.structured = StructuredOutputs(self.tokenizer, sc.grammar_compile_fuel, sc.grammar_step_fuel,
                                            vocab_size=self.arch.vocab_size)
        self.snapshots: TemplateSnapshots | None = None  # set by the Engine when cache.snapshot_dir is
        self.backend.prepare(config, self.max_model_len)
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens (%s), max_model_len %d, backend %s",
                 mc.path, self.device, str(self.dtype).replace("torch.", ""), self.allocator.num_blocks,
                 self.block_size, str(self.backend.kv_dtype).replace("torch.", ""), self.max_model_len,
                 self.backend.describe())

    def _prefix_budget(self, cache: CacheConfig) -> int:
        """The blocks templates may pin: cache.prefix_budget_blocks (half the cache unset), and never the
        whole cache, since a request needs a block of its own to run."""
        total = self.allocator.num_blocks
        budget = cache.prefix_budget_blocks
        if budget is None:
            return total // 2
        if budget >= total:
            log.warning("cache.prefix_budget_blocks %d is not below the KV cache's %d blocks (%d tokens): templates "
                        "may pin at most %d blocks, so that requests keep one; raise cache.kv_cache_memory or "
                        "lower the budget", budget, total, total * self.block_size, total - 1)
            return total - 1
        return budget

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
        """Context, then KV capacity: tokens in shared (pinned) template blocks take no own block."""
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

    def _check_max_tokens(self, num_tokens: int, max_tokens: int | None, template: str) -> None:
        """A max_tokens the caller gave must fit the context beside the prompt (a 400, as vLLM and OpenAI
        answer); the server's default (max_tokens unset) is cut at the context instead."""
        if max_tokens is not None and num_tokens + max_tokens > self.max_model_len:
            raise PromptTooLong(
                f"max_tokens {max_tokens} and the prompt's {num_tokens} tokens{template} need "
                f"{num_tokens + max_tokens} tokens; the model's context is {self.max_model_len} tokens: ask for at "
                f"most {self.max_model_len - num_tokens}, or leave max_tokens unset to generate up to the context",
                param="max_tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], prefix_name: str | None,
                    sampling: SamplingParams, sink: Sink, matcher: Any = None, arrival: float | None = None) -> None:
        """Validate and queue. Raises InvalidRequest, PromptTooLong (CacheExhausted), TemplateNotFound or
        QueueFull (when scheduler.max_queue requests wait already). matcher: sampling.structured
        compiled (StructuredOutputs.compile) off this thread; None: compiled here if needed. arrival:
        when the engine was handed the request (time.perf_counter(); default: now), which its ttft_ms
        counts from: a submission waits for the loop's current step before it gets here, and under load
        that step can be a long prefill."""
        arrival = time.perf_counter() if arrival is None else arrival
        self._check_new_id(request_id)
        sink = self._guarded(request_id, sink)
        sampling.validate(max_tokens_cap=self.config.scheduler.max_tokens_cap, vocab_size=self.arch.vocab_size)
        self._check_prompt_ids(prompt_ids)
        cap = self.config.scheduler.max_prompt_tokens
        if cap is not None and len(prompt_ids) > cap:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {cap} "
                                f"per request after the prefix template (scheduler.max_prompt_tokens)", param="prompt")
        handle = self.templates.get(prefix_name) if prefix_name else None
        reused = handle if handle is not None and self.config.cache.enable_prefix else None  # its blocks shared
        token_ids = (list(handle.token_ids) if handle else []) + list(prompt_ids)
        if not token_ids:
            raise InvalidRequest("the prompt is empty and no prefix template was named", param="prompt")
        shared = 0
        if reused is not None:  # the full template blocks the scheduler will share (see Scheduler._attach_template)
            shared = reused.reused_tokens(len(token_ids)) // self.block_size * self.block_size
        self._check_fits(len(token_ids), "the prompt" + (f" (with prefix {prefix_name!r})" if handle else ""), shared)
        self._check_max_tokens(len(token_ids), sampling.max_tokens,
                               f" ({len(handle.token_ids)} of them the template {prefix_name!r})" if handle else "")
        self._check_queue()  # after validation: a bad request hears why
        sc = self.config.scheduler
        max_tokens = sampling.max_tokens or min(sc.default_max_tokens, sc.max_tokens_cap)  # the cap bounds it too
        if sampling.min_tokens > max_tokens:
            raise InvalidRequest(f"invalid sampling parameters: min_tokens {sampling.min_tokens} exceeds max_tokens "
                                 f"{max_tokens} (the server's default; set max_tokens)", param="min_tokens")
        if sampling.structured is not None:  # the request's own (Engine.submit compiled it), or free text
            compiled = matcher if matcher is not None else self.structured.compile(sampling.structured)
        else:  # the template's default output, if it has one
            compiled = handle.matcher if handle is not None else None
        if sampling.n > 1:
            capacity = self.scheduler.capacity_blocks() * self.block_size
            need = len(token_ids) - shared + sampling.n * max_tokens
            if need > capacity:
                raise CacheExhausted(f"n = {sampling.n} samples of up to {max_tokens} tokens each need {need} tokens of "
                                     f"KV cache beside the pinned templates, which has room for {capacity}; lower n or "
                                     f"max_tokens")
            parent = Sequence(f"{request_id}/prompt", token_ids, sampling, max_tokens, reused, None, fork_point=True)
            group = _Samples(request_id, sink, parent, arrival, prefix_name, sampling.n, compiled)
            self._samples[request_id] = group
            self._samples_of[id(parent)] = group
            self._hold_template(reused, handle)
            self.scheduler.add(parent)
            return
        seq = Sequence(request_id, token_ids, sampling, max_tokens, reused, self._generator(sampling))
        if compiled is not None:
            seq.matcher = start(compiled)
        self._hold_template(reused, handle)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, sampling.stop)
        self._tracked[request_id] = _Tracked(seq, sink, detok, arrival, prefix_name=prefix_name)
        self.scheduler.add(seq)

    def _generator(self, sampling: SamplingParams, offset: int = 0) -> np.random.Generator | None:
        """A sampling request's own generator: seeded seed + offset (sample `offset` of n), or from the
        engine's seed when the request has none; None for greedy. On the host whatever the device: the
        sampler draws each row's one uniform a step there and hands the step's uniforms to the device
        in one copy (a generator on a GPU launched a kernel per row), and a seed draws the same
        uniforms on every backend. PCG64 takes every bit of a 64-bit seed (torch's CPU generator keeps
        the low 32, so seeds that differed above them drew the same tokens) and gives float64 uniforms."""
        if sampling.greedy:
            return None
        seed = sampling.seed + offset if sampling.seed is not None else self._seed_rng.getrandbits(64)
        return np.random.Generator(np.random.PCG64(seed % 2**64))

    def _hold_template(self, reused: TemplateHandle | None, named: TemplateHandle | None) -> None:
        """A new request on a template: it holds the template's blocks it reuses, or, when the
        engine reuses none (cache.enable_prefix false), only counts as served."""
        if reused is not None:
            self.templates.acquire(reused)
        elif named is not None:
            self.templates.count_unreused(named)

    def _check_prompt_ids(self, prompt_ids: list[int]) -> None:
        bad = [t for t in prompt_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.arch.vocab_size}); got {bad[:4]}",
                                 param="prompt")

    def _check_queue(self) -> None:
        max_queue = self.config.scheduler.max_queue
        if self.scheduler.waiting_requests() >= max_queue:
            raise QueueFull(f"the waiting queue is full ({max_queue} requests wait already, scheduler.max_queue); "
                            f"retry later with backoff")

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start children on the computed parent's KV (Scheduler.fork) and end the parent. Each child
        holds the template too; the request was counted as served once, by the parent. Where this
        fails the step fails, and abort_all ends the children and, by its sweep, the parent."""
        copies = self.scheduler.fork(parent, children)
        for child in children:  # queued now: each releases its template when it ends (Scheduler.finish)
            if child.template is not None:
                self.templates.acquire(child.template, served=False)
        if copies:  # now, while the parent's blocks are still held
            self.backend.copy_blocks(copies)
        self.scheduler.finish(parent, FinishReason.STOP)

    def _fork_samples(self, parent: Sequence) -> None:
        """A request's prompt is computed: its n samples continue it, each with its own generator
        (seeded seed + i when the request has a seed) and, for a structured output, its own matcher.
        Each sample's parts are made before any is registered: where making one fails (a matcher's
        start, a detokenizer), the request ends with the error, unforked, and the step and every other
        request go on."""
        group = self._samples_of[id(parent)]
        p = parent.sampling
        made: list[tuple[Sequence, IncrementalDetokenizer]] = []
        try:
            for i in range(p.n):
                # a NUL in the id: no request id a client can send collides with it
                child = Sequence(f"{group.request_id}\x00{i}", parent.token_ids, p, parent.max_tokens,
                                 parent.template, self._generator(p, i))
                if group.matcher is not None:
                    child.matcher = start(group.matcher)
                made.append((child, IncrementalDetokenizer(self.tokenizer, child.token_ids, p.stop)))
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            log.error("request %s: starting its %d samples failed; ending it", group.request_id, p.n, exc_info=e)
            self._end_unforked(group, FinishReason.ABORT, e)
            return
        del self._samples_of[id(parent)]
        for i, (child, detok) in enumerate(made):
            group.children.append(child.request_id)
            self._tracked[child.request_id] = _Tracked(child, self._sample_sink(group, i), detok, group.arrival,
                                                       prefix_name=group.prefix_name)
        group.parent = None  # its samples end the request from here on, each through its sink
        self._fork(parent, [child for child, _ in made])

    def _sample_sink(self, group: _Samples, index: int) -> Sink:
        def sink(out: RequestOutput) -> None:
            out.request_id, out.index = group.request_id, index
            if out.finished:
                group.remaining -= 1
                if group.remaining == 0:
                    del self._samples[group.request_id]
            group.sink(out)
            if out.error is not None and group.remaining:  # the request fails as a whole: its other samples end
                self.abort(group.request_id)
        return sink

    def _end_unforked(self, group: _Samples, reason: FinishReason, error: BaseException | None) -> None:
        """End a request for n samples before its prompt was computed: each sample ends."""
        parent = group.parent
        assert parent is not None
        self._samples_of.pop(id(parent), None)
        self.scheduler.finish(parent, reason)
        del self._samples[group.request_id]
        for i in range(parent.sampling.n):
            group.sink(RequestOutput(group.request_id, "", [], finished=True, finish_reason=reason,
                                     prompt_tokens=parent.num_prompt_tokens, error=error, index=i))

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._tracked or request_id in self._scorings or request_id in self._samples:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")

    def _guarded(self, request_id: str, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """sink, never raising into the engine: one that raises (its client's event loop closed, a
        caller's bug) is logged once and its request aborted at the next step; the step and every
        other request go on. (It failed the step, and the abort of everything in flight that followed
        called it again, which ended the engine's thread.)"""
        failed = False

        def guarded(out: Any) -> None:
            nonlocal failed
            if failed:
                return
            try:
                sink(out)
            except Exception:  # noqa: BLE001 - the caller's code, not the engine's
                failed = True
                log.exception("request %s: delivering its output failed; aborting it", request_id)
                self._undeliverable.append(request_id)
        return guarded

    def add_score(self, request_id: str, prompt_ids: list[int], prefix_name: str | None,
                  candidates: list[list[int]], sink: ScoreSink) -> None:
        """Validate and queue a Score request (scoring.py): sink gets its ScoreOutput once every
        candidate is scored. Raises as add_request does."""
        self._check_new_id(request_id)
        sink = self._guarded(request_id, sink)
        check_candidates(candidates, self.arch.vocab_size)
        self._check_prompt_ids(prompt_ids)
        handle = self.templates.get(prefix_name) if prefix_name else None
        reused = handle if self.config.cache.enable_prefix else None  # the template whose KV it continues
        base = (list(handle.token_ids) if handle else []) + list(prompt_ids)
        if not base:
            raise InvalidRequest("the prompt is empty and no prefix template was named: a candidate's first token "
                                 "needs something before it", param="prompt")
        longest = len(base) - 1 + max(len(c) for c in candidates)
        shared = reused.num_tokens - 1 if reused is not None else 0
        self._check_fits(longest, "the prompt with its longest candidate", shared // self.block_size * self.block_size)
        self._check_queue()
        scoring = Scoring(request_id, sink, [tuple(c) for c in candidates], len(base),
                          reused.num_tokens if reused is not None else 0)
        seq = scoring.fork_point(base, reused)
        self._hold_template(reused, handle)
        self._scorings[request_id] = scoring
        self._scoring_of[id(seq)] = scoring
        self.scheduler.add(seq)

    def check_template(self, name: str, token_ids: list[int]) -> None:
        """Raise what add_template would raise now for this template (empty, too long, the name
        taken, over the budget), claiming nothing: before a snapshot is read or fetched for it."""
        if not token_ids:
            raise InvalidRequest(f"prefix template {name!r} is empty")
        self._check_fits(len(token_ids), f"prefix template {name!r}")
        self.templates.check(name, len(token_ids))

    def add_template(self, name: str, token_ids: list[int], source: dict[str, str],
                     on_pinned: Callable[[TemplateInfo | BaseException], None],
                     default_output: tuple[StructuredOutput, Any] | None = None) -> None:
        """Queue a template's warmup prefill; on_pinned gets its TemplateInfo (or the error) when done.
        default_output: the output of requests on it that name none, and its compiled matcher."""
        self.check_template(name, token_ids)
        self.templates.reserve(name, len(token_ids))
        request_id = f"prefix-warmup:{name}:{self._warmups}"
        self._warmups += 1
        seq = Sequence(request_id, token_ids, SamplingParams(max_tokens=1), 1, None, None, prefill_only=True)
        self._tracked[request_id] = _Tracked(seq, None, None, time.perf_counter(), on_pinned=on_pinned, source=source,
                                             prefix_name=name, default_output=default_output)
        self.scheduler.add(seq)

    def restore_template(self, name: str, token_ids: list[int], source: dict[str, str],
                         kv: dict[str, torch.Tensor] | SnapshotReader,
                         default_output: tuple[StructuredOutput, Any] | None = None,
                         kv_source: str = "snapshot") -> TemplateInfo | None:
        """Pin a template from a snapshot instead of a prefill: fresh blocks, the K/V written into
        them, pinned. kv: the K/V, read and checked off this thread, or an open snapshot whose data
        is read here straight into the blocks when the cache is in host memory (its checksum
        failing raises SnapshotMismatch, the blocks freed). None when its blocks are not free now
        (requests hold them): the caller prefills it instead, queued like any request."""
        self.check_template(name, token_ids)
        self.templates.reserve(name, len(token_ids))
        need = self.templates.blocks_for(len(token_ids))
        if need > self.allocator.num_free:
            self.templates.cancel(name)
            return None
        # one run of blocks where there is one, as a prefilled template gets (its K/V one slice of the cache)
        blocks = self.allocator.allocate_contiguous(need) or self.allocator.allocate(need)
        try:
            if isinstance(kv, SnapshotReader):
                caches = self.backend.host_cache()
                if caches is not None:
                    kv.read_into(caches, blocks)
                else:  # a cache on a device: through host memory
                    self.backend.write_blocks(blocks, kv.read())
            else:
                self.backend.write_blocks(blocks, kv)
            structured, matcher = default_output or (None, None)
            handle = self.templates.pin(name, token_ids, blocks, source, structured, matcher, kv_source=kv_source)
        except BaseException:
            self.templates.cancel(name)
            raise
        finally:
            self.allocator.free(blocks)  # the pin holds its own reference
        return handle.info()

    def template_kv(self, name: str) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
        """A pinned template's token ids and a host copy of its K/V (Backend.read_blocks)."""
        handle = self.templates.get(name)
        return handle.token_ids, self.backend.read_blocks(handle.block_table)

    def abort(self, request_id: str) -> bool:
        group = self._samples.get(request_id)
        if group is not None:
            if group.parent is not None:
                self._end_unforked(group, FinishReason.ABORT, None)
            else:  # each sample still running ends (its sink counts it)
                for key in group.children:
                    if key in self._tracked:
                        self._finish(self._tracked[key], FinishReason.ABORT)
            return True
        scoring = self._scorings.get(request_id)
        if scoring is not None:
            self._end_scoring(scoring, FinishReason.ABORT, EngineStopped(f"score request {request_id} was aborted"))
            return True
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False
        self._finish(tracked, FinishReason.ABORT)
        return True

    def abort_all(self, error: BaseException | None = None) -> None:
        """End every request in flight (after a failed step, at shutdown). Each ends on its own: one
        whose end fails is logged and the others still end. Then every sequence the scheduler still
        holds is ended too, freeing its blocks: such a one belongs to no request any more (the prompt
        of a fork that failed half-way)."""
        for request_id, tracked in list(self._tracked.items()):
            if request_id in self._tracked:  # not ended with a sibling sample before its turn (_sample_sink)
                self._end_alone(request_id, self._finish, tracked, FinishReason.ABORT, error=error)
        for scoring in list(self._scorings.values()):
            self._end_alone(scoring.request_id, self._end_scoring, scoring, FinishReason.ABORT,
                            error or EngineStopped("the engine stopped"))
        for group in list(self._samples.values()):
            if group.parent is not None:
                self._end_alone(group.request_id, self._end_unforked, group, FinishReason.ABORT, error)
        for seq in self.scheduler.running + list(self.scheduler.waiting):
            self.scheduler.finish(seq, FinishReason.ABORT)

    @staticmethod
    def _end_alone(request_id: str, end: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """end(*args, **kwargs) for one request of abort_all: a failure is logged, not raised."""
        try:
            end(*args, **kwargs)
        except Exception:  # noqa: BLE001 - every other request must still end
            log.exception("request %s: ending it failed", request_id)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> None:
        while self._undeliverable:  # requests whose sink raised (_guarded): nobody can read them
            self.abort(self._undeliverable.pop())
        start = time.perf_counter()
        out = self.scheduler.schedule()
        for stuck in out.unschedulable:
            # Ended, never retried: with no output yet it fails (CacheExhausted, RESOURCE_EXHAUSTED at
            # the API); with output it finishes with LENGTH, like a request that reaches the context.
            log.warning("request %s does not fit in the KV cache even alone; ending it", stuck.request_id)
            err = CacheExhausted(f"request {stuck.request_id} needs more KV blocks than the cache has beside the "
                                 f"pinned templates ({self.allocator.num_blocks} blocks in all); shorten the prompt, "
                                 f"or raise cache.kv_cache_memory (server operator)")
            self._end_sequence(stuck, FinishReason.LENGTH, err, error_with_output=False)
        if out.is_empty:
            return
        try:
            logits = self.backend.execute(out.step)
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            self._step_failed(out, e)
            return
        sample_seqs, sample_logits, drafted = self._score_rows(out.with_logits, logits)
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if sample_seqs:
            assert sample_logits is not None
            sample_seqs, tokens, logprobs = self._sample(sample_logits, sample_seqs)
        self.scheduler.postprocess(out, sample_seqs, tokens)
        for s in out.scheduled:
            seq = s.seq
            if seq.num_uncomputed or seq.samples or seq.status is SeqStatus.FINISHED:  # finished: failed this step
                continue
            if seq.prefill_only:
                self._pin_warmup(self._tracked[seq.request_id])
            elif seq.fork_point and id(seq) in self._samples_of:
                self._fork_samples(seq)
            elif seq.fork_point:
                self._fork_scoring(seq)
            else:
                self._scored(seq)
        now = time.perf_counter()
        for seq, token, logprob in zip(sample_seqs, tokens, logprobs):
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:  # ended by this step already: a sample whose sibling failed
                continue
            try:
                self._after_token(tracked, token, logprob, now)
            except Exception as e:
                if is_fatal_device_error(e):
                    raise
                self._fail_row(seq, e, "handling its new token failed")
        if drafted:
            self._verify_drafts(drafted, now)
        if self.drafter is not None and all(s.is_decode for s in out.scheduled):
            # what a decode step costs by its rows decides how many draft tokens are worth theirs
            self.drafter.cost.observe(out.num_tokens, time.perf_counter() - start)

    def _end_sequence(self, seq: Sequence, reason: FinishReason, error: Exception,
                      error_with_output: bool = True) -> None:
        """End the request `seq` belongs to (a score, a request for n samples before its fork, a
        request or sample, a template's warmup) with `error`; error_with_output false: a sequence
        that has output already finishes with `reason` and without the error."""
        scoring = self._scoring_of.get(id(seq))
        if scoring is not None:
            self._end_scoring(scoring, reason, error)
            return
        group = self._samples_of.get(id(seq))
        if group is not None:
            self._end_unforked(group, reason, error)
            return
        tracked = self._tracked.get(seq.request_id)
        if tracked is not None:
            self._finish(tracked, reason, error=error if error_with_output or seq.num_output_tokens == 0 else None)

    def _step_failed(self, out: SchedulerOutput, error: Exception) -> None:
        """The backend failed to compute the step (not the device itself: is_fatal_device_error). Its
        sequences are computed again, each in a step alone first (Scheduler.quarantine); the one
        that fails alone ends with the error (INTERNAL at the API), and the others go on."""
        guilty = self.scheduler.quarantine(out)
        if not guilty:
            log.error("a step of %d sequences failed; each runs a step alone to find the one it fails on",
                      len(out.scheduled), exc_info=error)
        how = "with it alone" if len(out.scheduled) == 1 else f"with it ({MAX_FAILED_STEPS} failed steps)"
        for seq in guilty:
            log.error("request %s: a step failed %s; ending it", seq.request_id, how, exc_info=error)
            self._end_sequence(seq, FinishReason.ABORT, error)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]
                ) -> tuple[list[Sequence], list[int], list[TokenLogprob | None]]:
        """sample() over the step's rows -> the rows sampled, their tokens and logprobs. Where the
        batch fails (a structured output's matcher, a bug one row's parameters reach), each row is
        sampled alone: a row that fails again ends its own request with the error (INTERNAL at the
        API) and the others go on. Each row's uniform is drawn before anything can fail, so a row
        sampled again draws the token it would have drawn in the batch."""
        ops = self.backend.sampler_ops
        drawn = uniforms(seqs)
        try:
            tokens, logprobs = sample(logits, seqs, self.eos_token_ids, ops, drawn)
            return seqs, tokens, logprobs
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            log.warning("sampling a step of %d rows failed (%s: %s); sampling each row alone", len(seqs),
                        type(e).__name__, e)
        kept: list[Sequence] = []
        tokens, logprobs = [], []
        for i, seq in enumerate(seqs):
            try:
                token, logprob = sample(logits[i:i + 1], [seq], self.eos_token_ids, ops, drawn[i:i + 1])
            except Exception as e:
                if is_fatal_device_error(e):
                    raise
                self._fail_row(seq, e, "sampling its next token failed")
                continue
            kept.append(seq)
            tokens.append(token[0])
            logprobs.append(logprob[0])
        return kept, tokens, logprobs

    def _fail_row(self, seq: Sequence, error: Exception, what: str) -> None:
        """One row of a step failed: its request ends with the error; the step and the rest go on."""
        log.error("request %s: %s; ending it", seq.request_id, what, exc_info=error)
        self._end_sequence(seq, FinishReason.ABORT, error)

    def _score_rows(self, with_logits: list[ScheduledSeq], logits: torch.Tensor | None
                    ) -> tuple[list[Sequence], torch.Tensor | None, list[tuple[ScheduledSeq, torch.Tensor]]]:
        """Record the logits of scoring rows and of held forced runs (_held_logprobs); -> the
        sequences to sample and their logits, and each drafted sequence with its rows' logits."""
        if all(s.seq.samples and s.seq.held_from is None and not s.draft for s in with_logits):
            return [s.seq for s in with_logits], logits, []
        assert logits is not None  # rows that score have logits
        sample_seqs: list[Sequence] = []
        rows: list[int] = []
        held: list[tuple[Sequence, int, int]] = []  # (sequence, logits row, the token it gives the logprob of)
        drafted: list[tuple[ScheduledSeq, torch.Tensor]] = []
        start = 0
        for s in with_logits:
            n, seq = s.num_logits, s.seq
            if s.draft:
                drafted.append((s, logits[start:start + n]))
            elif seq.samples:
                first = seq.num_computed_tokens + s.num_new_tokens - n  # the position of its first row
                for j in range(n):
                    if first + j + 1 < len(seq.token_ids):  # a held token's logprob
                        held.append((seq, start + j, seq.token_ids[first + j + 1]))
                if first + n == len(seq.token_ids):  # its last token's row: the next draw
                    sample_seqs.append(seq)
                    rows.append(start + n - 1)
            else:
                self._record_scores(s, logits[start:start + n])
            start += n
        if held:
            ended = self._held_logprobs(held, logits)
            keep = [i for i, seq in enumerate(sample_seqs) if id(seq) not in ended]
            sample_seqs, rows = [sample_seqs[i] for i in keep], [rows[i] for i in keep]
        return sample_seqs, logits[rows] if rows else None, drafted

    def _verify_drafts(self, drafted: list[tuple[ScheduledSeq, torch.Tensor]], now: float) -> None:
        """Each drafted sequence's rows are drawn from in turn, as steps of their own would: row r
        gives the token after the r tokens before it (sampled as any row, its penalties and
        min_tokens seeing those tokens, its seeded draw the next of its generator), and the next row
        is drawn from while that token is the draft's at its place. The drawn tokens go out
        together; the first that is not the draft's, or the one after the whole draft, is computed
        by the next step. The tokens are those of a step each wherever the rows' logits are."""
        assert self.drafter is not None  # drafts come from it
        runs = []
        for s, rows in drafted:
            tracked = self._tracked.get(s.seq.request_id)
            if tracked is not None:  # else ended by this step already
                runs.append(_Drafted(tracked, s.draft, rows))
                if tracked.first_token_time is None:  # a sample's first step (its prompt's last token a decode row)
                    tracked.first_token_time = now
        done: list[_Drafted] = []
        r = 0
        while runs:
            kept, tokens, logprobs = self._sample(torch.stack([run.rows[r] for run in runs]),
                                                  [run.tracked.seq for run in runs])
            by_seq = {id(run.tracked.seq): run for run in runs}
            runs = []
            for seq, token, logprob in zip(kept, tokens, logprobs):
                run = by_seq[id(seq)]
                hit = r < len(run.draft) and token == run.draft[r]
                try:
                    self.scheduler.take_drafted(seq, token, computed=hit)
                    assert run.tracked.detok is not None  # a request's
                    run.reason, text = self._take_token(seq, run.tracked.detok, token)
                except Exception as e:
                    if is_fatal_device_error(e):
                        raise
                    self._fail_row(seq, e, "handling its new token failed")
                    continue
                run.tokens.append(token)
                run.texts.append(text)
                run.logprobs.append(logprob)
                run.kept += hit
                (runs if hit and run.reason is None else done).append(run)
            r += 1
        for run in done:
            seq = run.tracked.seq
            self.drafter.learn(seq, len(run.draft), run.kept)
            self.scheduler.trim_blocks(seq)
            if run.reason is None:  # the tokens a structured output forces after the run
                try:
                    assert run.tracked.detok is not None  # a request's
                    run.reason = self._jump_forward(seq, run.tracked.detok, run.tokens, run.texts)
                except Exception as e:
                    if is_fatal_device_error(e):
                        raise
                    self._fail_row(seq, e, "handling its new token failed")
                    continue
            wanted = seq.sampling.logprobs is not None
            self._send(run.tracked, run.tokens, run.texts, run.logprobs if wanted else None, run.reason)

    def _held_logprobs(self, held: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> set[int]:
        """The logprobs of held forced tokens, from the step's logits rows; a held run whose every
        logprob is known goes to its caller, and ends its request where one of its tokens did ->
        id() of the sequences that ended (they sample nothing more)."""
        raw = logits[[row for _, row, _ in held]].float()
        lps = token_logprobs(raw, [token for _, _, token in held],
                             [seq.sampling.logprobs or 0 for seq, _, _ in held], self.backend.sampler_ops)
        ended: set[int] = set()
        for (seq, _, _), lp in zip(held, lps):
            tracked = self._tracked.get(seq.request_id)
            if tracked is None or tracked.held is None:  # ended by this step already
                continue
            run = tracked.held
            run.logprobs.append(lp)
            if len(run.logprobs) < len(run.tokens):
                continue
            tracked.held, seq.held_from = None, None
            if run.reason is None:
                assert tracked.sink is not None  # a request's
                tracked.sink(RequestOutput(seq.request_id, "".join(run.texts), run.tokens, logprobs=run.logprobs))
            else:
                ended.add(id(seq))
                self._finish(tracked, run.reason, text="".join(run.texts), token_ids=run.tokens,
                             logprobs=run.logprobs)
        return ended

    def _record_scores(self, s: ScheduledSeq, logits: torch.Tensor) -> None:
        """A scoring row's logits go to its Score request; where that fails, the request ends with the
        error (INTERNAL at the API) and the step and every other request go on."""
        scoring = self._scoring_of.get(id(s.seq))
        if scoring is None:  # its request ended with an earlier row of this step
            return
        try:
            scoring.record(s.seq, s.seq.num_computed_tokens + s.num_new_tokens, logits)
        except Exception as e:
            if is_fatal_device_error(e):
                raise
            self._fail_scoring(scoring, e, "scoring its candidates failed")

    def _fail_scoring(self, scoring: Scoring, error: Exception, what: str) -> None:
        log.error("score request %s: %s; ending it", scoring.request_id, what, exc_info=error)
        self._end_scoring(scoring, FinishReason.ABORT, error)

    def _fork_scoring(self, parent: Sequence) -> None:
        """A Score request's prompt is computed: its candidates continue it (Scheduler.fork)."""
        scoring = self._scoring_of.pop(id(parent))
        children = scoring.candidate_sequences(parent)
        for child in children:
            self._scoring_of[id(child)] = scoring
        self._fork(parent, children)

    def _scored(self, seq: Sequence) -> None:
        scoring = self._scoring_of.pop(id(seq))
        self.scheduler.finish(seq, FinishReason.STOP)
        if not scoring.finished(seq):
            return
        try:
            output = scoring.output()
        except Exception as e:
            self._fail_scoring(scoring, e, "putting its scores together failed")
            return
        del self._scorings[scoring.request_id]
        scoring.sink(output)

    def _end_scoring(self, scoring: Scoring, reason: FinishReason, error: BaseException) -> None:
        for seq in list(scoring.members):
            self._scoring_of.pop(id(seq), None)
            self.scheduler.finish(seq, reason)
        scoring.members.clear()
        del self._scorings[scoring.request_id]
        scoring.sink(scoring.output(error))

    def _pin_warmup(self, tracked: _Tracked) -> None:
        seq, name = tracked.seq, tracked.prefix_name
        assert name is not None  # a warmup names its template
        try:  # the backend hears of the pin (on_pin) and may fail, e.g. out of memory for a packed copy
            output = tracked.default_output
            handle = self.templates.pin(name, seq.token_ids, seq.block_table, tracked.source or {},
                                        *(output or (None, None)))
        except Exception as e:  # noqa: BLE001 - the warmup fails, nothing else does
            log.exception("pinning prefix template %r failed", tracked.prefix_name)
            self._finish(tracked, FinishReason.ABORT, error=e)
            return
        self.scheduler.finish(seq, FinishReason.STOP)  # the pin keeps the blocks
        del self._tracked[seq.request_id]
        if self.snapshots is not None and self.snapshots.saving:  # a copy of its K/V, written off this thread
            self.snapshots.save(name, handle.token_ids, self.backend.read_blocks(handle.block_table))
        if tracked.on_pinned:
            tracked.on_pinned(handle.info())

    def _after_token(self, tracked: _Tracked, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """A sequence got `token` (the scheduler appended it): stream it, or finish on a stop. Then,
        while its structured output forces the next token (_jump_forward), that one is appended and
        handled the same way, without a step of its own: they go out together, and the next step
        computes their K/V, a decode row each (Scheduler.schedule), or none when they complete the output."""
        seq, detok = tracked.seq, tracked.detok
        assert detok is not None  # a request's (a warmup samples no token)
        if tracked.first_token_time is None:
            tracked.first_token_time = now
        reason, text = self._take_token(seq, detok, token)
        tokens, texts = [token], [text]
        if reason is None:
            reason = self._jump_forward(seq, detok, tokens, texts)
        self._send(tracked, tokens, texts, [logprob] if logprob is not None else None, reason)

    def _jump_forward(self, seq: Sequence, detok: IncrementalDetokenizer, tokens: list[int], texts: list[str]
                      ) -> FinishReason | None:
        """While seq's structured output forces the token after its last (_forced_tokens, each checked
        against the mask), take it without a step: appended to seq (the next step computes its K/V)
        and to tokens and texts -> why the sequence ends with one, or None."""
        for token in self._forced_tokens(seq):
            if only_token(seq.matcher, self.arch.vocab_size) != token:
                break  # not forced after all: the next step samples it
            self.scheduler.append_token(seq, token)
            uniforms([seq])  # the draw a step of its own would have taken: later ones stay the same
            reason, text = self._take_token(seq, detok, token)
            tokens.append(token)
            texts.append(text)
            if reason is not None:
                return reason
        return None

    def _send(self, tracked: _Tracked, tokens: list[int], texts: list[str], logprobs: list[Any] | None,
              reason: FinishReason | None) -> None:
        """A step's new tokens of one request to its caller: those drawn from rows (as many as
        `logprobs` where it asked for them), then those its structured output forced after them.
        Forced tokens wait for the logprobs the next step gives them (a held run); ABORT: its
        matcher failed (_take_token), and the request ends with the error naming its constraint."""
        seq = tracked.seq
        if reason is FinishReason.ABORT:  # its mask hit a bound (grammar_step_fuel)
            self._finish(tracked, reason, text="".join(texts), token_ids=tokens, logprobs=logprobs,
                         error=self._structured_error(seq))
        elif logprobs is not None and len(tokens) > len(logprobs):
            # the drawn tokens go now, the forced ones once a step has given their logprobs
            drawn = len(logprobs)
            tracked.held = _Held(tokens[drawn:], texts[drawn:], reason)
            seq.held_from = len(seq.token_ids) - len(tokens) + drawn - 1  # the last drawn token's row gives the first
            assert tracked.sink is not None  # a request's
            tracked.sink(RequestOutput(seq.request_id, "".join(texts[:drawn]), tokens[:drawn], logprobs=logprobs))
        else:
            self._deliver(tracked, tokens, texts, logprobs, reason)

    def _deliver(self, tracked: _Tracked, tokens: list[int], texts: list[str], logprobs: list[Any] | None,
                 reason: FinishReason | None) -> None:
        """A step's new tokens of one request (each token's text, their logprobs where asked for) to
        its caller, with its end where `reason` says it ends."""
        if reason is None:
            assert tracked.sink is not None  # a request's
            tracked.sink(RequestOutput(tracked.seq.request_id, "".join(texts), tokens, logprobs=logprobs))
        else:
            self._finish(tracked, reason, text="".join(texts), token_ids=tokens, logprobs=logprobs)

    def _take_token(self, seq: Sequence, detok: IncrementalDetokenizer, token: int) -> tuple[FinishReason | None, str]:
        """Feed one new token (the last of seq.token_ids) to the matcher and the detokenizer ->
        (why the sequence ends with it, or None; its text). ABORT: the matcher failed."""
        p = seq.sampling
        if seq.matcher is not None:  # the mask allowed the token
            seq.matcher.consume_token(token)
            if seq.matcher.is_error():  # its mask hit a bound (grammar_step_fuel)
                return FinishReason.ABORT, ""
        reason, text = None, ""
        may_stop = seq.num_output_tokens > p.min_tokens  # the sampler masks stop tokens until then
        if may_stop and ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids):
            reason = FinishReason.STOP
        else:
            text, hit_stop = detok.add(token, check_stop=may_stop)
            if hit_stop:
                reason = FinishReason.STOP
        if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            reason = FinishReason.STOP  # the structured output is complete
        if reason is None and (seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = FinishReason.LENGTH
        return reason, text

    def _forced_tokens(self, seq: Sequence) -> list[int]:
        """The tokens seq's structured output forces next, where scheduler.jump_forward is on:
        llguidance's fast-forward tokens, each checked against the mask before it is taken
        (_after_token); with logprobs asked for, the run is held until a step gives theirs."""
        if seq.matcher is None or not self.config.scheduler.jump_forward:
            return []
        return list(seq.matcher.compute_ff_tokens())

    def _structured_error(self, seq: Sequence) -> InvalidRequest:
        spec = seq.sampling.structured
        param = spec.param if spec is not None else "prefix_name"
        return InvalidRequest(f"{param}: {seq.matcher.get_error()} (a sequence's mask may take at most "
                              f"scheduler.grammar_step_fuel = {self.config.scheduler.grammar_step_fuel} of work a "
                              f"step)", param=param)

    def _finish(self, tracked: _Tracked, reason: FinishReason, *, text: str = "", token_ids: list[int] | None = None,
                error: BaseException | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        seq = tracked.seq
        reused = seq.cached_tokens
        if tracked.held is not None:  # a forced run not sent yet goes with the end, its logprobs as far as known
            run, tracked.held = tracked.held, None
            text, token_ids = "".join(run.texts) + text, run.tokens + (token_ids or [])
            logprobs = run.logprobs + (logprobs or [])
        self.scheduler.finish(seq, reason)
        del self._tracked[seq.request_id]
        if tracked.sink is None:  # a warmup that did not complete
            assert tracked.prefix_name is not None  # a warmup names its template
            self.templates.cancel(tracked.prefix_name)
            if tracked.on_pinned:
                tracked.on_pinned(error or PrefixServiceError(f"warmup of prefix template {tracked.prefix_name!r} was aborted"))
            return
        if tracked.detok is not None:
            try:
                text += tracked.detok.flush()
            except Exception as e:  # noqa: BLE001 - the request still ends: its caller must not wait forever
                log.exception("request %s: decoding its last text failed", seq.request_id)
                if error is None:
                    reason, error = FinishReason.ABORT, e
        ttft = None if tracked.first_token_time is None else (tracked.first_token_time - tracked.arrival) * 1000
        tracked.sink(RequestOutput(
            seq.request_id, text, token_ids or [], finished=True, finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=reused,
            completion_tokens=seq.num_output_tokens, ttft_ms=ttft, error=error,
            logprobs=logprobs if logprobs is not None else ([] if seq.sampling.logprobs is not None else None)))

    # --- introspection -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Allocator invariants, and every block's count equals the references its holders claim."""
        expected = self.templates.held_refs()
        for b, c in self.scheduler.held_refs().items():
            expected[b] = expected.get(b, 0) + c
        self.allocator.check_integrity(expected)
        self.backend.check_integrity(self.templates.pinned_handles())
        if any(s.status is SeqStatus.FINISHED for s in self.scheduler.running):
            raise AssertionError("a finished sequence is still running")

    def reset_kv_peak(self) -> None:
        """Start kv_stats()["peak_used"] over from the blocks in use now."""
        self.allocator.reset_peak()

    def kv_stats(self) -> dict[str, int]:
        return {"num_blocks": self.allocator.num_blocks, "used": self.allocator.num_used,
                "peak_used": self.allocator.peak_used,  # most in use at once since reset_kv_peak()
                "free": self.allocator.num_free, "pinned": self.templates.num_pinned_blocks,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "waiting_requests": self.scheduler.waiting_requests(),
                "preemptions": self.scheduler.num_preemptions,
                "failed_steps": self.scheduler.num_failed_steps,  # the backend failed to compute (quarantine)
                # speculative decoding: draft tokens steps checked, and those kept
                "draft_tokens": self.drafter.drafted if self.drafter else 0,
                "accepted_draft_tokens": self.drafter.accepted if self.drafter else 0,
                # host memory the backend holds for pinned templates (packed K/V copies), outside the KV cache
                "packed_template_bytes": self.backend.packed_template_bytes()}
