"""Generation servicer: convert the request, stream it through `Engine.generate_stream`, map
errors to status codes. A call that ends early (client cancel, deadline, server shutdown) closes
the stream, which aborts the request and frees its KV blocks, whether it was waiting or running.
Every call ends in its RequestTrace (metrics and the request's log line)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import AsyncIterator

import grpc

from prefix_service.engine import Engine
from prefix_service.errors import InvalidRequest
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.engine.sequence import GenerateRequest
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

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        trace = self.metrics.trace(request.prefix_name if isinstance(request, pb.GenerateRequest) else "")
        request_id = ""
        try:
            try:
                check_decoded(request)
                engine, _ = self.runtime.require_ready()
                request_id = check_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
                trace.request_id = request_id
                executor = self.runtime.executor
                req = await asyncio.get_running_loop().run_in_executor(executor, build_request, engine, request,
                                                                       request_id)
            except Exception as e:  # refused before anything was queued
                await _fail(context, trace, e)
            # the stream aborts the request (and frees its blocks) if the call ends before it does
            async with contextlib.aclosing(engine.generate_stream(req, executor)) as stream:
                while True:
                    try:
                        out = await anext(stream)
                    except StopAsyncIteration:
                        break
                    except Exception as e:  # refused at submission, or ended by an error
                        await _fail(context, trace, e)
                    trace.output(out)
                    yield output_to_proto(out)
            trace.code = grpc.StatusCode.OK
        except Exception:
            if trace.code is None:  # a bug; grpc answers UNKNOWN
                trace.code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            try:
                trace.end(context)
            except Exception:  # noqa: BLE001 - bookkeeping must never change the call's outcome
                log.exception("recording request %s failed", request_id or "(no id)")

    async def drain_aborts(self) -> None:
        """Wait for the aborts of calls that ended early (before the engine shuts down)."""
        engine = self.runtime.engine
        if engine is not None:
            await engine.drain_aborts()


async def _fail(context: grpc.aio.ServicerContext, trace: RequestTrace, exc: BaseException) -> None:
    """End the call with exc's status code, noted in the trace. Never returns."""
    trace.code, message = status_for(exc)
    await context.abort(trace.code, message)
