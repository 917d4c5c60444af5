"""PrefixAdmin servicer: authorize, convert, call the TemplateRegistry off the event loop, map
errors. An add returns once the template is prefilled and pinned (cancelling the call does not
stop it)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc

from prefix_service.errors import InvalidRequest
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.server.auth import BearerAuth
from prefix_service.server.convert import structured_from_proto, template_to_proto
from prefix_service.server.interfaces import TemplateRegistryClient
from prefix_service.server.runtime import Runtime
from prefix_service.server.status import abort
from prefix_service.server.store import TemplateSource
from prefix_service.server.wire import check_decoded

log = logging.getLogger("prefix_service.server")

T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


Handler = Callable[["PrefixAdminServicer", Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _mapped(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Turn any exception of an admin handler into its status code."""
    @functools.wraps(method)
    async def wrapper(self: PrefixAdminServicer, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status (INTERNAL for the unexpected)
            await abort(context, e)
    return wrapper


def source_from_proto(request: pb.AddPrefixTemplateRequest) -> TemplateSource:
    if bool(request.content) == bool(request.system_prompt):
        raise InvalidRequest("give exactly one of content (raw text) or system_prompt (a system message "
                             "rendered through the model's chat template)")
    structured = structured_from_proto(request.structured_output, "structured_output")
    if structured is not None and structured.kind == "text":
        structured = None  # free text is what a template without a default output gives
    return TemplateSource(request.name, request.content or None, request.system_prompt or None, origin="admin",
                          structured=structured)


class PrefixAdminServicer(pb_grpc.PrefixAdminServicer):
    def __init__(self, runtime: Runtime, auth: BearerAuth) -> None:
        self.runtime = runtime
        self.auth = auth

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.runtime.executor, fn, *args)

    def _registry(self, request: object, context: grpc.aio.ServicerContext) -> TemplateRegistryClient:
        """Authorize first (a stranger learns nothing, not even that a request was malformed)."""
        self.auth.check(context.invocation_metadata())
        check_decoded(request)
        return self.runtime.require_ready()[1]

    @_mapped
    async def AddPrefixTemplate(self, request: pb.AddPrefixTemplateRequest,
                                context: grpc.aio.ServicerContext) -> pb.PrefixTemplate:
        registry = self._registry(request, context)
        src = source_from_proto(request)
        t0 = time.perf_counter()
        info = await self._call(registry.add, src)
        log.info("prefix template %r added (%s): %d tokens, %d blocks, %.0f ms", info.name,
                 "system_prompt" if src.system_prompt is not None else "content", info.num_tokens,
                 info.num_blocks, (time.perf_counter() - t0) * 1000)
        # the replicas holding it (a fleet's; none in one process), as ListPrefixTemplates gives them
        replicas = next((r for i, _, r in await self._call(registry.listing) if i.name == info.name), ())
        return template_to_proto(info, "admin", replicas)

    @_mapped
    async def RemovePrefixTemplate(self, request: pb.RemovePrefixTemplateRequest,
                                   context: grpc.aio.ServicerContext) -> pb.RemovePrefixTemplateResponse:
        registry = self._registry(request, context)
        freed = await self._call(registry.remove, request.name)
        log.info("prefix template %r removed%s", request.name,
                 "" if freed else " (its blocks are freed when the requests using it finish)")
        return pb.RemovePrefixTemplateResponse(deferred=not freed)

    @_mapped
    async def ListPrefixTemplates(self, request: pb.ListPrefixTemplatesRequest,
                                  context: grpc.aio.ServicerContext) -> pb.ListPrefixTemplatesResponse:
        registry = self._registry(request, context)
        items = await self._call(registry.listing)
        return pb.ListPrefixTemplatesResponse(templates=[template_to_proto(i, origin, replicas)
                                                         for i, origin, replicas in items])
