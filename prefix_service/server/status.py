"""Map exceptions to gRPC status codes. The message is the exception's own: it is written to
say what was wrong and what to do, so the caller gets it verbatim (cut to MAX_DETAILS_CHARS: it
may quote a client's input, and status details travel in a size-limited trailer)."""
from __future__ import annotations

import logging

import grpc

from prefix_service.errors import (CacheExhausted, EngineStopped, InvalidRequest, PrefixBudgetExceeded,
                                   PrefixExists, PrefixNotFound, PrefixServiceError, QueueFull)

log = logging.getLogger("prefix_service.server")

MAX_DETAILS_CHARS = 1000


class ServerNotReady(PrefixServiceError):
    """The server is still loading the model or warming its templates, or is shutting down."""


class Unauthenticated(PrefixServiceError):
    """An admin call came without credentials."""


class PermissionDenied(PrefixServiceError):
    """An admin call came with the wrong token."""


class ChatTemplateMismatch(PrefixServiceError):
    """The model's chat template does not keep a system_prompt template as a token prefix."""


class PersistError(PrefixServiceError):
    """The state file could not be written."""


# First match wins: subclasses before their bases (CacheExhausted is a PromptTooLong, an InvalidRequest).
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (PrefixNotFound, grpc.StatusCode.NOT_FOUND),
    (PrefixExists, grpc.StatusCode.ALREADY_EXISTS),
    (CacheExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PrefixBudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (ServerNotReady, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ChatTemplateMismatch, grpc.StatusCode.FAILED_PRECONDITION),
)


def _details(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= MAX_DETAILS_CHARS else text[:MAX_DETAILS_CHARS - 3] + "..."


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, _details(exc)
    if isinstance(exc, PrefixServiceError):
        log.error("request failed: %s", _details(exc))
        return grpc.StatusCode.INTERNAL, _details(exc)
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status that fits exc. Never returns (context.abort raises)."""
    code, message = status_for(exc)
    await context.abort(code, message)
