"""Generation servicer: convert the request, submit it to the engine, stream its outputs, map
errors to status codes. A call that ends early (client cancel, deadline, server shutdown) aborts
its request, which frees the request's KV blocks, whether it was waiting or running. Every call
ends in its RequestTrace (metrics and the request's log line)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

import grpc

from prefix_service.engine import Engine
from prefix_service.errors import InvalidRequest, PrefixServiceError
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.engine.sequence import GenerateRequest, RequestOutput
from prefix_service.server.chat import chat_prompt_ids
from prefix_service.server.convert import (check_request_id, messages_from_proto, output_to_proto,
                                           sampling_from_proto)
from prefix_service.server.metrics import RequestTrace, ServiceMetrics
from prefix_service.server.runtime import Runtime
from prefix_service.server.status import status_for
from prefix_service.server.wire import check_decoded

log = logging.getLogger("prefix_service.server")


def build_request(engine: Engine, request: pb.GenerateRequest, request_id: str) -> GenerateRequest:
    """Proto -> engine request. Blocks (tokenizes; looks the prefix up): call it off the event loop."""
    prefix_name = request.prefix_name or None
    sampling = sampling_from_proto(request.sampling)
    if not request.messages:
        return GenerateRequest(prompt=request.prompt, prefix_name=prefix_name, sampling=sampling,
                               request_id=request_id)
    if request.prompt:
        raise InvalidRequest("give prompt or messages, not both")
    messages = messages_from_proto(request.messages)
    handle = engine.get_prefix(prefix_name) if prefix_name else None  # PrefixNotFound
    ids = chat_prompt_ids(engine.tokenizer, messages, prefix_name, handle and handle.token_ids,
                          handle and handle.source)
    return GenerateRequest(prompt_token_ids=ids, prefix_name=prefix_name, sampling=sampling, request_id=request_id)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, runtime: Runtime, metrics: ServiceMetrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self._aborts: set[asyncio.Task] = set()  # keeps fire-and-forget aborts alive

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        trace = self.metrics.trace(request.prefix_name if isinstance(request, pb.GenerateRequest) else "")
        submitted: asyncio.Future | None = None
        request_id = ""
        done = False  # the engine holds nothing for this call any more
        try:
            try:
                check_decoded(request)
                engine, _ = self.runtime.require_ready()
                request_id = check_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
            except PrefixServiceError as e:
                await _fail(context, trace, e)
            trace.request_id = request_id
            loop = asyncio.get_running_loop()
            outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

            def sink(out: RequestOutput) -> None:  # called on the engine thread
                loop.call_soon_threadsafe(outputs.put_nowait, out)

            def submit() -> None:
                engine.submit(build_request(engine, request, request_id), sink)

            submitted = loop.run_in_executor(self.runtime.executor, submit)
            try:
                await asyncio.shield(submitted)  # a cancel here must not lose track of the submission
            except Exception as e:  # refused: nothing was queued
                done = True
                await _fail(context, trace, e)
            while True:
                out = await outputs.get()
                if out.error is not None:
                    done = True
                    await _fail(context, trace, out.error)
                trace.output(out)
                done = out.finished
                yield output_to_proto(out)
                if done:
                    trace.code = grpc.StatusCode.OK
                    return
        except Exception:
            if trace.code is None:  # a bug; grpc answers UNKNOWN
                trace.code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            if submitted is not None and not done:
                self._abort_later(engine, submitted, request_id)
            try:
                trace.end(context)
            except Exception:  # noqa: BLE001 - bookkeeping must never change the call's outcome
                log.exception("recording request %s failed", request_id or "(no id)")

    def _abort_later(self, engine: Engine, submitted: asyncio.Future, request_id: str) -> None:
        """Abort once the submission has landed, without blocking the event loop."""
        async def run() -> None:
            try:
                await submitted
            except BaseException:  # noqa: BLE001 - never queued, nothing to abort
                return
            await asyncio.get_running_loop().run_in_executor(self.runtime.executor, engine.abort, request_id)

        task = asyncio.ensure_future(run())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def drain_aborts(self) -> None:
        """Wait for pending aborts (before the engine shuts down)."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)


async def _fail(context: grpc.aio.ServicerContext, trace: RequestTrace, exc: BaseException) -> None:
    """End the call with exc's status code, noted in the trace. Never returns."""
    trace.code, message = status_for(exc)
    await context.abort(trace.code, message)
