"""Generation servicer: the proto request becomes a RequestSpec, then takes the request path both
front ends share (requests.py): prepare, stream through `Engine.generate_stream`, map errors to
status codes. A call that ends early (client cancel, deadline, server shutdown) closes the
stream, which aborts the request and frees its KV blocks, whether it was waiting or running.
Every call ends in its RequestTrace (metrics and the request's log line)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

import grpc

from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.server.convert import output_to_proto, score_to_proto, server_info_to_proto, spec_from_proto
from prefix_service.server.metrics import RequestTrace, ServiceMetrics
from prefix_service.server.requests import ScoreSpec, TokenTexts, prepare, request_id_for, score
from prefix_service.server.runtime import Runtime
from prefix_service.server.status import CUT_OFF, status_for
from prefix_service.server.wire import check_decoded

log = logging.getLogger("prefix_service.server")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, runtime: Runtime, metrics: ServiceMetrics, served_name: str = "") -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.served_name = served_name  # the base model's id, as the HTTP API names it
        self.token_texts = TokenTexts()  # for log-probabilities
        self._calls: set[asyncio.Task[Any]] = set()  # the Generate and Score calls in flight
        self._cutting = False

    def cut_off(self) -> None:
        """The stopping server's grace period is over: every call still in flight ends now with
        UNAVAILABLE and the service's own message (gRPC's cancel, a moment later, says only
        "Cancelling all calls")."""
        self._cutting = True
        for task in list(self._calls):
            task.cancel()

    @contextlib.asynccontextmanager
    async def _in_flight(self, context: grpc.aio.ServicerContext, trace: RequestTrace) -> AsyncIterator[None]:
        """The call, cancelled by cut_off: it ends with UNAVAILABLE, the request cut off (its stream,
        closed by the cancel, aborts it)."""
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._cutting:
                raise
            trace.code = grpc.StatusCode.UNAVAILABLE
            await context.abort(grpc.StatusCode.UNAVAILABLE, CUT_OFF)
        finally:
            self._calls.discard(task)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        trace = self.metrics.trace(request.prefix_name if isinstance(request, pb.GenerateRequest) else "", "grpc")
        request_id = ""
        try:
            async with self._in_flight(context, trace):
                try:
                    check_decoded(request)
                    spec = spec_from_proto(request)
                    request_id = trace.request_id = request_id_for(spec)
                    engine, req = await prepare(self.runtime, spec, request_id)
                except Exception as e:  # refused before anything was queued
                    await _fail(context, trace, e)
                token_text = self.token_texts.of(engine.tokenizer) if spec.sampling.logprobs is not None else None
                # the stream aborts the request (and frees its blocks) if the call ends before it does
                async with contextlib.aclosing(engine.generate_stream(req, self.runtime.executor)) as stream:
                    while True:
                        try:
                            out = await anext(stream)
                        except StopAsyncIteration:
                            break
                        except Exception as e:  # refused at submission, or ended by an error
                            await _fail(context, trace, e)
                        trace.output(out)
                        yield output_to_proto(out, token_text)
                trace.code = grpc.StatusCode.OK
        except Exception:
            if trace.code is None:  # a bug; grpc answers UNKNOWN
                trace.code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            try:
                trace.end(context.time_remaining())
            except Exception:  # noqa: BLE001 - bookkeeping must never change the call's outcome
                log.exception("recording request %s failed", request_id or "(no id)")

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        trace = self.metrics.trace(request.prefix_name if isinstance(request, pb.ScoreRequest) else "", "grpc")
        try:
            async with self._in_flight(context, trace):
                try:
                    check_decoded(request)
                    spec = ScoreSpec(list(request.candidates), prefix_name=request.prefix_name or None,
                                     prompt=request.prompt or None, request_id=request.request_id or None)
                    request_id = trace.request_id = request_id_for(spec)
                    out = await score(self.runtime, spec, request_id)
                except Exception as e:  # refused, or ended by an error
                    await _fail(context, trace, e)
                trace.code = grpc.StatusCode.OK
                trace.scored(out)
                return score_to_proto(out, request.candidates)
        finally:
            try:
                trace.end(context.time_remaining())
            except Exception:  # noqa: BLE001 - bookkeeping must never change the call's outcome
                log.exception("recording score request %s failed", trace.request_id or "(no id)")

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        try:
            check_decoded(request)
            engine, _ = self.runtime.require_ready()
            infos = await asyncio.get_running_loop().run_in_executor(self.runtime.executor, engine.engine_infos)
        except Exception as e:  # not ready (UNAVAILABLE), or the engine stopped
            code, message = status_for(e)
            await context.abort(code, message)
        return server_info_to_proto(self.served_name, infos)

    async def drain_aborts(self) -> None:
        """Wait for the aborts of calls that ended early (before the engine shuts down)."""
        engine = self.runtime.engine
        if engine is not None:
            await engine.drain_aborts()


async def _fail(context: grpc.aio.ServicerContext, trace: RequestTrace, exc: BaseException) -> None:
    """End the call with exc's status code, noted in the trace. Never returns."""
    trace.code, message = status_for(exc)
    await context.abort(trace.code, message)
