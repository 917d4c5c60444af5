"""Engine: the Python API. A background thread runs the step loop and is the only thread that
touches EngineCore; callers reach it through a command queue (add, abort, template admin,
introspection) answered with futures. `generate` blocks; `generate_stream` is an async iterator
safe to call from many coroutines. Engine is the one-process EngineClient the server drives
(server/interfaces.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable, Iterable, TypeVar

import torch

from prefix_service import cpuinfo
from prefix_service.backends.base import BackendFactory
from prefix_service.config import EngineConfig, ServiceConfig
from prefix_service.engine.core import EngineCore, is_fatal_device_error
from prefix_service.engine.threads import compute_executor, lower_thread_priority, thread_nice
from prefix_service.errors import EngineStopped
from prefix_service.engine.template_pins import TemplateInfo, TemplateView
from prefix_service.engine.sequence import (FinishReason, GenerateRequest, RequestOutput, ScoreOutput, ScoreRequest,
                                            TokenLogprob)
from prefix_service.model.llama import ModelArch
from prefix_service.sampling_params import StructuredOutput
from prefix_service.engine.snapshots import SnapshotMismatch, SnapshotReader, SnapshotStore, snapshot_key
from prefix_service.engine.template_snapshots import TemplateSnapshots

log = logging.getLogger("prefix_service.engine")
T = TypeVar("T")


@dataclass
class GenerateResult:
    """A finished request: all of its text and token ids."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    samples: list[GenerateResult] | None = None  # with n > 1: every sample in order (this result is the first)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine runs, fixed once it is built (for benchmarks and reports)."""
    model_path: str
    device: str  # cpu, cuda:0, ...
    dtype: str  # float32, bfloat16, ...
    arch: ModelArch
    max_model_len: int
    num_blocks: int  # KV cache blocks
    block_size: int
    backend: str  # torch, cpu or cuda
    backend_description: str  # with its kernel choices, e.g. "cuda (prefill flash_attn, decode triton_paged)"
    quantization: str = "none"  # model.quantization: none or int8
    kv_cache_dtype: str = ""  # what the KV cache holds (cache.kv_cache_dtype resolved), e.g. float32, bfloat16
    batch_invariant: bool = False  # model.batch_invariant
    cpu_isa: str = ""  # a CPU engine's instruction sets, e.g. "AVX-512,AVX2" (cpuinfo.isa; "" on a GPU)
    cpu_march: str = ""  # the target its native kernels were built for, where $PREFIX_SERVICE_CPU_MARCH named one


def prompt_token_ids(tokenizer: Any, req: GenerateRequest) -> list[int]:
    """The request's own token ids, after its template's: its prompt_token_ids, or its prompt tokenized
    (on a template the prompt continues it: no special tokens, no second BOS)."""
    if req.prompt_token_ids is not None:
        if req.prompt is not None:
            from prefix_service.errors import InvalidRequest
            raise InvalidRequest("give prompt or prompt_token_ids, not both")
        return list(req.prompt_token_ids)
    ids: list[int] = tokenizer.encode(req.prompt or "", add_special_tokens=not req.prefix_name)
    return ids


def least_max_model_len(infos: Iterable[EngineInfo]) -> int | None:
    """The longest request every one of these engines takes (a fleet's replicas may differ): the
    least max_model_len; None for no engine."""
    return min((info.max_model_len for info in infos), default=None)


@dataclass(frozen=True)
class EngineStatus:
    """What a metrics scrape reads, taken at once: kv_stats(), list_templates() and engine_infos()."""
    kv_stats: dict[str, int]
    templates: list[TemplateInfo]
    infos: dict[str, EngineInfo]


class Engine:
    """config: a ServiceConfig's engine part is used. backend: build the backend with this instead
    of the class model.backend selects (a benchmark that compares one backend's kernels).

    The EngineCore is private to the loop thread. Tests reach it white-box through `_core` (its
    fixed attributes, or anything once the engine is shut down) and `_run` (a function of the core,
    run on the loop thread between two steps)."""

    def __init__(self, config: EngineConfig | ServiceConfig, *, backend: BackendFactory | None = None) -> None:
        if isinstance(config, ServiceConfig):
            config = config.engine
        self.config = config
        self._commands: deque[tuple[Callable[[EngineCore], Any], concurrent.futures.Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._aborts: set[asyncio.Future[None]] = set()  # aborts of streams that ended early, still running
        # where the async API submits and aborts when its caller names no executor (made on first use)
        self._submits: concurrent.futures.ThreadPoolExecutor | None = None
        built: concurrent.futures.Future[EngineCore] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(config, backend, built),
                                        name="prefix-service-engine", daemon=True)
        self._thread.start()
        self._core: EngineCore = built.result()  # the model load's error, if any, is raised here
        self.tokenizer: Any = self._core.tokenizer
        core = self._core
        self.info = EngineInfo(config.model.path, str(core.device), str(core.dtype).replace("torch.", ""),
                               core.arch, core.max_model_len, core.allocator.num_blocks, core.block_size,
                               core.backend.name, core.backend.describe(), config.model.quantization,
                               str(core.backend.kv_dtype).replace("torch.", ""), config.model.batch_invariant,
                               ",".join(cpuinfo.isa()) if core.device.type == "cpu" else "",
                               (cpuinfo.target() or "") if core.device.type == "cpu" else "")
        self._config = config
        self._snapshots: TemplateSnapshots | None = None
        self._codec: SnapshotStore | None = None  # the snapshot format of this engine's KV (made when needed)
        if config.cache.snapshot_dir:
            self._codec = SnapshotStore(config.cache.snapshot_dir, snapshot_key(config, core.device, core.dtype))
            self._snapshots = TemplateSnapshots(self._codec)
            self._run(lambda c: setattr(c, "snapshots", self._snapshots))
        # Where a template's K/V may come from when it has no snapshot here, before a prefill: a
        # fleet replica asks one that holds it (name, token ids -> a snapshot's bytes, or None).
        self.peer_kv: Callable[[str, list[int]], bytes | None] | None = None
        # Called once, on the loop thread, when a device error ends the engine (is_fatal_device_error);
        # fatal_error holds that error from then on.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal_error: BaseException | None = None

    # --- the loop thread ----------------------------------------------------------------------
    def _main(self, config: EngineConfig, backend: BackendFactory | None,
              built: concurrent.futures.Future[EngineCore]) -> None:
        # The loop thread also builds the EngineCore, so that all of the engine's torch work (loading,
        # packing, every step) runs on one thread: OpenMP keeps one pool of workers per thread that
        # starts parallel work, and with more pool threads than cores GNU OpenMP's workers stop
        # spin-waiting between operations (docs/architecture.md, "Threads").
        try:
            # before the thread's first torch work, so that the OpenMP workers it starts inherit it
            nice = lower_thread_priority(thread_nice(config.model))
            if nice is not None:
                log.info("engine threads at nice %d (model.thread_nice): the front ends' threads preempt a step", nice)
            self._core = EngineCore(config, backend)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(self._core)
        self._loop()

    def _loop(self) -> None:
        core = self._core
        while True:
            with self._wake:
                while not self._commands and not core.has_work() and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._commands:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(core))
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            if core.has_work():
                try:
                    core.step()
                except Exception as e:
                    if is_fatal_device_error(e):
                        self._fail(e)
                        return
                    # a bug or a bad input that got this far: fail what is in flight, keep serving
                    log.exception("engine step failed; aborting in-flight requests")
                    try:
                        core.abort_all(error=e)
                    except Exception:  # noqa: BLE001 - the loop must outlive it, or every caller waits forever
                        log.exception("aborting the requests in flight failed")
        core.abort_all(error=EngineStopped("the engine shut down"))

    def _fail(self, error: Exception) -> None:
        """The device failed for good (is_fatal_device_error): every later step would fail too. Stop
        taking work, fail what is in flight and queued, and tell on_fatal (the server ends the process,
        so that its supervisor starts a new one on a fresh device context)."""
        log.critical("the device failed; the engine stops (restart the process): %s", error)
        stopped = EngineStopped(f"the engine stopped after a device error: {error}")
        self.fatal_error = error
        with self._wake:
            self._stopping = True
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(stopped)
        self._core.abort_all(error=stopped)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:  # the engine is stopped either way
                log.exception("on_fatal failed")

    def _call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                raise self._stopped()
            self._commands.append((fn, fut))
            self._wake.notify()
        return fut

    def _stopped(self) -> EngineStopped:
        if self.fatal_error is not None:
            return EngineStopped(f"the engine stopped after a device error: {self.fatal_error}")
        return EngineStopped("the engine is shut down")

    def _run(self, fn: Callable[[EngineCore], T]) -> T:
        return self._call(fn).result()

    def _start(self, executor: concurrent.futures.Executor | None, fn: Callable[..., T], *args: Any
               ) -> asyncio.Future[T]:
        """fn(*args) run on `executor`, or else on the engine's own pool (made on first use), whose
        threads share the cores with the engine's steps (threads.py) as a server's executor does.
        Raises EngineStopped once the engine is shut down (and its pool with it)."""
        if executor is None:
            with self._wake:
                if self._stopping:
                    raise self._stopped()
                if self._submits is None:
                    self._submits = compute_executor(32, thread_nice(self.config.model), "prefix-service-submit")
                executor = self._submits
        try:
            return asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except RuntimeError:  # the pool was shut down since
            if self._stopping:
                raise self._stopped() from None
            raise

    # --- templates ----------------------------------------------------------------------------
    def tokenize_template(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True)
        return ids

    def add_template(self, name: str, text: str | None = None, *, token_ids: list[int] | None = None,
                     source: dict[str, str] | None = None, structured: StructuredOutput | None = None) -> TemplateInfo:
        """Tokenize, prefill and pin a template. Blocks until it is pinned. Raises TemplateExists,
        TemplateBudgetExceeded, PromptTooLong or InvalidRequest. structured: the default output of the
        requests on it that name none (kind "text" or None: free text)."""
        from prefix_service.config import validate_template_name
        from prefix_service.errors import ConfigError, InvalidRequest
        try:
            validate_template_name(name)
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
        if token_ids is None:
            if text is None:
                raise InvalidRequest("add_template needs text or token_ids")
            token_ids = self.tokenize_template(text)
        source = source if source is not None else ({"content": text} if text is not None else {})
        compiled = self._core.structured.compile(structured) if structured is not None else None
        output = (structured, compiled) if structured is not None and compiled is not None else None
        ids, src = list(token_ids), source
        snapshots = self._snapshots
        if snapshots is not None or self.peer_kv is not None:  # a template refused costs no snapshot read or fetch
            self._run(lambda core: core.check_template(name, ids))
        reader = snapshots.open(name, ids) if snapshots is not None else None
        if reader is not None and snapshots is not None:  # its K/V from a snapshot instead of a prefill
            with reader:
                restored = self._restore(name, ids, src, reader, output, "snapshot",
                                         lambda why: snapshots.not_used(name, why))
            if restored is not None:
                return restored
        if self.peer_kv is not None:  # or from a replica that holds it
            restored = self._from_peer(name, ids, src, output)
            if restored is not None:
                return restored
        done: concurrent.futures.Future[TemplateInfo] = concurrent.futures.Future()

        def on_pinned(result: TemplateInfo | BaseException) -> None:
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

        self._run(lambda core: core.add_template(name, ids, src, on_pinned, output))
        return done.result()

    def _restore(self, name: str, ids: list[int], src: dict[str, str], reader: SnapshotReader,
                 output: tuple[StructuredOutput, Any] | None, kv_source: str,
                 refused: Callable[[object], None]) -> TemplateInfo | None:
        """Pin a template from an open snapshot; None when it is not used (refused(reason): one
        warning) or its blocks are not free now: the caller prefills it. The data is read and
        checked here first, so a damaged snapshot costs the engine's thread nothing; a cache in
        host memory then gets it straight from the snapshot (a file in the page cache by now) on
        the engine's thread, any other through tensors read here."""
        try:
            kv: SnapshotReader | dict[str, torch.Tensor]
            if self._core.device.type == "cpu":
                reader.check()
                kv = reader
            else:
                kv = reader.read()
            restored: TemplateInfo | None = self._run(
                lambda core: core.restore_template(name, ids, src, kv, output, kv_source))
            return restored
        except (SnapshotMismatch, OSError) as e:
            refused(e)
        except ValueError as e:  # shapes that are not this cache's
            refused(f"it does not fit this KV cache: {e}")
        return None

    def _from_peer(self, name: str, ids: list[int], src: dict[str, str],
                   output: tuple[StructuredOutput, Any] | None) -> TemplateInfo | None:
        """Pin a template from the snapshot bytes peer_kv brings (kv_source "peer"); None when
        there are none or they are not used (one warning): the caller prefills it."""
        assert self.peer_kv is not None

        def refused(why: object) -> None:
            log.warning("prefix template %r: the K/V another replica sent is not used (%s); prefilling it instead",
                        name, why)
        try:
            data = self.peer_kv(name, ids)
        except Exception as e:  # noqa: BLE001 - a holder gone, a timeout: prefill as without peers
            refused(f"fetching it failed: {type(e).__name__}: {e}")
            return None
        if data is None:
            return None
        try:
            reader = self.snapshot_codec().decode(data, ids)
        except SnapshotMismatch as e:
            refused(e)
            return None
        with reader:
            return self._restore(name, ids, src, reader, output, "peer", refused)

    def snapshot_codec(self) -> SnapshotStore:
        """The snapshot format of this engine's K/V (its weights, dtype, block size): the snapshot
        folder's store, or one without a folder (encode and decode only)."""
        if self._codec is None:
            core = self._core
            self._codec = SnapshotStore(None, snapshot_key(self._config, core.device, core.dtype))
        return self._codec

    def export_template_kv(self, name: str) -> bytes:
        """A pinned template's K/V as a snapshot's bytes (what its snapshot file would hold), for
        another replica of the same model to pin it from (add_template through peer_kv) instead of
        prefilling it. Raises TemplateNotFound."""
        ids, kv = self._run(lambda core: core.template_kv(name))
        return self.snapshot_codec().encode(name, ids, kv)

    def remove_template(self, name: str, *, keep_snapshot: bool = False) -> bool:
        """Unregister a template, and remove its snapshot unless keep_snapshot (a fleet replica
        letting a template move to another keeps it: the folder may be shared). True if its blocks
        were freed now, False if deferred until the requests using it finish. Raises TemplateNotFound."""
        freed: bool = self._run(lambda core: core.templates.remove(name))
        if self._snapshots is not None and not keep_snapshot:  # after its save, on the same writer thread
            self._snapshots.remove(name)
        return freed

    def flush_snapshots(self) -> None:
        """Wait until the snapshots of the templates pinned so far are written (and removals done)."""
        if self._snapshots is not None:
            self._snapshots.flush()

    def list_templates(self) -> list[TemplateInfo]:
        return self._run(lambda core: core.templates.list())

    def get_template(self, name: str) -> TemplateView:
        """The template's name, token ids and source (a copy). Raises TemplateNotFound."""
        return self._run(lambda core: core.templates.get(name).view())

    # --- generation ---------------------------------------------------------------------------
    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        return prompt_token_ids(self.tokenizer, req)

    def submit(self, req: GenerateRequest, sink: Callable[[RequestOutput], None]) -> str:
        """Queue a request; sink receives its outputs from the loop thread. Returns its id.
        Raises the validation error (InvalidRequest, PromptTooLong, TemplateNotFound, QueueFull)."""
        return self.submit_many([req], [sink])[0]

    def submit_many(self, requests: list[GenerateRequest], sinks: list[Callable[[RequestOutput], None]]) -> list[str]:
        """Queue requests together: they enter the engine in one command, before its next step (one
        submit after another would each wait for a step boundary). Returns their ids. Raises the first
        validation error; then none of them runs. Their ttft_ms counts from this call."""
        arrival = time.perf_counter()
        prepared = []
        for req in requests:  # tokenizing and compiling constraints here, not on the engine's thread (structured.py)
            structured = req.sampling.structured
            matcher = self._core.structured.compile(structured) if structured is not None else None
            prepared.append((req.request_id or uuid.uuid4().hex, self._prompt_ids(req), req, matcher))

        def add_all(core: EngineCore) -> None:
            added: list[str] = []
            try:
                for (request_id, prompt_ids, req, matcher), sink in zip(prepared, sinks, strict=True):
                    core.add_request(request_id, prompt_ids, req.prefix_name, req.sampling, sink, matcher, arrival)
                    added.append(request_id)
            except BaseException:
                for request_id in added:
                    core.abort(request_id)
                raise
        self._run(add_all)
        return [request_id for request_id, _, _, _ in prepared]

    def submit_score(self, req: ScoreRequest, sink: Callable[[ScoreOutput], None]) -> str:
        """Queue a Score request; sink receives its ScoreOutput from the loop thread. Returns its id.
        Raises the validation error."""
        request_id = req.request_id or uuid.uuid4().hex
        prompt_ids = self._prompt_ids(GenerateRequest(prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                                      prefix_name=req.prefix_name))
        candidates = [list(c) if not isinstance(c, str) else self.tokenizer.encode(c, add_special_tokens=False)
                      for c in req.candidates]
        self._run(lambda core: core.add_score(request_id, prompt_ids, req.prefix_name, candidates, sink))
        return request_id

    def score(self, req: ScoreRequest) -> ScoreOutput:
        """Score the candidates (blocking). Raises the validation error, or the error that ended it."""
        done: concurrent.futures.Future[ScoreOutput] = concurrent.futures.Future()
        self.submit_score(req, done.set_result)
        out = done.result()
        if out.error is not None:
            raise out.error
        return out

    async def score_async(self, req: ScoreRequest,
                          executor: concurrent.futures.Executor | None = None) -> ScoreOutput:
        """score() for an event loop: submitting runs on `executor` (default: the engine's own pool);
        cancelling aborts the request."""
        loop = asyncio.get_running_loop()
        request_id = req.request_id or uuid.uuid4().hex
        req = dataclasses.replace(req, request_id=request_id)
        result: asyncio.Future[ScoreOutput] = loop.create_future()

        def deliver(out: ScoreOutput) -> None:
            if not result.done():
                result.set_result(out)

        def sink(out: ScoreOutput) -> None:  # on the loop thread
            loop.call_soon_threadsafe(deliver, out)

        submitted = self._start(executor, self.submit_score, req, sink)
        try:
            await asyncio.shield(submitted)
        except asyncio.CancelledError:
            self._abort_later(submitted, request_id, executor)
            raise
        try:
            out = await result
        except asyncio.CancelledError:
            self._abort_later(submitted, request_id, executor)
            raise
        if out.error is not None:
            raise out.error
        return out

    def _abort_later(self, submitted: asyncio.Future[str], request_id: str,
                     executor: concurrent.futures.Executor | None) -> None:
        abort = asyncio.ensure_future(self._abort_when_submitted(submitted, request_id, executor))
        self._aborts.add(abort)  # kept alive until done
        abort.add_done_callback(self._aborts.discard)

    def abort(self, request_id: str) -> bool:
        """End a request (its last output has finish reason ABORT) and free its blocks."""
        try:
            return self._run(lambda core: core.abort(request_id))
        except EngineStopped:
            return False

    def generate(self, requests: list[GenerateRequest] | GenerateRequest) -> list[GenerateResult]:
        """Run requests to completion, batched together (submit_many: they enter the engine at the
        same step). Raises the first request's validation error before any runs; the error that ends
        one of them (or an interrupt while waiting), once the others still running are aborted, since
        their results would reach nobody."""
        if isinstance(requests, GenerateRequest):
            requests = [requests]
        collectors = [_Collector(req.sampling.n) for req in requests]
        ids = self.submit_many(requests, list(collectors))
        try:
            return [col.result() for col in collectors]
        except BaseException:
            for request_id, col in zip(ids, collectors):
                if not col.done:
                    self.abort(request_id)
            raise

    async def generate_stream(self, req: GenerateRequest, executor: concurrent.futures.Executor | None = None
                              ) -> AsyncGenerator[RequestOutput, None]:
        """Yield a RequestOutput per step with new text; the last has finished=True. Raises the
        request's validation error, or the error that ended it. Closing the iterator early or
        cancelling its task, even while the request is still being submitted, aborts the request
        and frees its blocks: the abort runs on in the background once the submission has landed
        (`drain_aborts` waits for it), so the caller is not held up by the engine's current step.
        Submitting and aborting block on the engine's loop thread: they run on `executor`
        (default: the engine's own pool, at the engine's priority)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = req.request_id
        if request_id is None:
            request_id = uuid.uuid4().hex
            req = dataclasses.replace(req, request_id=request_id)

        def sink(out: RequestOutput) -> None:  # on the loop thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        submitted = self._start(executor, self.submit, req, sink)
        finished = False  # the engine holds nothing for this request any more
        try:
            try:
                await asyncio.shield(submitted)  # a cancel here must not lose track of the submission
            except Exception:
                finished = True  # refused: nothing was queued
                raise
            remaining = req.sampling.n  # samples not finished yet
            while not finished:
                out = await queue.get()
                remaining -= int(out.finished)
                finished = remaining == 0 or out.error is not None
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            if not finished:
                self._abort_later(submitted, request_id, executor)

    async def _abort_when_submitted(self, submitted: asyncio.Future[str], request_id: str,
                                    executor: concurrent.futures.Executor | None) -> None:
        try:
            await submitted
        except BaseException:  # noqa: BLE001 - never queued, nothing to abort
            return
        try:
            await self._start(executor, self.abort, request_id)
        except (RuntimeError, EngineStopped):  # the executor or the engine is shut down: the stop ends the request
            log.debug("request %s: abort skipped, the executor or the engine is shut down", request_id)

    async def drain_aborts(self) -> None:
        """Wait for the aborts of streams that ended early (before shutting the engine down)."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)

    # --- introspection and lifecycle ------------------------------------------------------------
    @property
    def running(self) -> bool:
        """The loop thread is alive and not stopping (a health check's question)."""
        return self._thread.is_alive() and not self._stopping

    def check_integrity(self) -> None:
        self._run(lambda core: core.check_integrity())

    def kv_stats(self) -> dict[str, int]:
        """KV blocks: num_blocks, used (pinned templates included), peak_used (the most used at once
        since reset_kv_peak or the start), free, pinned; running, waiting, preemptions; the bytes of
        the templates' packed copies."""
        return self._run(lambda core: core.kv_stats())

    def engine_infos(self) -> dict[str, EngineInfo]:
        """{"": info}: this one engine (EngineClient's, which a fleet answers per replica)."""
        return {"": self.info}

    def status(self) -> EngineStatus:
        """kv_stats(), list_templates() and engine_infos() in one command between engine steps."""
        stats, templates = self._run(lambda core: (core.kv_stats(), core.templates.list()))
        return EngineStatus(stats, templates, self.engine_infos())

    def reset_kv_peak(self) -> None:
        """Start kv_stats()["peak_used"] over from the blocks in use now (a benchmark's window)."""
        self._run(lambda core: core.reset_kv_peak())

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight end with an EngineStopped error."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if self._submits is not None:  # an abort still to run finds it shut down: the stop ended its request
            self._submits.shutdown(wait=False)
        if self._snapshots is not None:  # the pending writes finish
            self._snapshots.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _Collector:
    """Gathers one request's outputs for the blocking API."""

    def __init__(self, n: int = 1) -> None:
        self._done = threading.Event()
        self._parts: list[list[RequestOutput]] = [[] for _ in range(n)]
        self._remaining = n
        self._error: BaseException | None = None  # the first sample's that failed: the request's

    def __call__(self, out: RequestOutput) -> None:
        self._parts[out.index].append(out)
        self._remaining -= int(out.finished)
        if out.error is not None and self._error is None:
            self._error = out.error
        if self._remaining == 0 or out.error is not None:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> GenerateResult:
        self._done.wait()
        if self._error is not None:  # whatever the other samples have delivered by now
            raise self._error
        results = [self._sample(parts) for parts in self._parts]
        if len(results) > 1:
            results[0].samples = results
        return results[0]

    @staticmethod
    def _sample(parts: list[RequestOutput]) -> GenerateResult:
        last = parts[-1]
        logprobs = None if last.logprobs is None else [lp for p in parts for lp in p.logprobs or ()]
        assert last.finish_reason is not None  # a finished output has its reason
        return GenerateResult(
            last.request_id, "".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
            last.finish_reason, last.prompt_tokens, last.cached_tokens, last.completion_tokens, last.ttft_ms,
            logprobs)
