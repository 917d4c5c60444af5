"""Map exceptions to what each protocol answers: one table, read by gRPC (a status code) and by
the HTTP API (an HTTP status and OpenAI's error body). The message is the exception's own: it is
written to say what was wrong and what to do, so the caller gets it verbatim (cut to
MAX_DETAILS_CHARS: it may quote a client's input, and status details travel in a size-limited
trailer)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NoReturn

import grpc

from prefix_service.errors import (CacheExhausted, EngineStopped, InvalidRequest, TemplateBudgetExceeded,
                                   TemplateExists, TemplateNotFound, PrefixServiceError, PromptTooLong, QueueFull)

log = logging.getLogger("prefix_service.server")

MAX_DETAILS_CHARS = 1000


class ServerNotReady(PrefixServiceError):
    """The server is still loading the model or warming its templates, or is shutting down."""


class ReplicaUnavailable(PrefixServiceError):
    """A fleet replica stopped while serving the call, or none that could take it was up in time
    (prefix_service/fleet/): the call may be retried."""


class Unauthenticated(PrefixServiceError):
    """A call that needs a bearer token (admin; the HTTP API with an API key) came without one."""


class PermissionDenied(PrefixServiceError):
    """A call that needs a bearer token came with the wrong one."""


class ChatTemplateMismatch(PrefixServiceError):
    """The model's chat template does not keep a system_prompt template as a token prefix."""


class PersistError(PrefixServiceError):
    """The state file could not be written."""


class ModelNotFound(TemplateNotFound):
    """An HTTP request's `model` is neither the served model nor a template; `param` names the
    field (the HTTP API reports it in the error body)."""


class RequestTooLarge(InvalidRequest):
    """An HTTP request body over the server's limit."""


@dataclass(frozen=True)
class ErrorKind:
    grpc_code: grpc.StatusCode
    http_status: int
    type: str  # OpenAI's error.type
    code: str  # OpenAI's error.code: a short, stable identifier


CUT_OFF = "the server is shutting down; the request was cut off"  # EngineStopped's, past the grace period


# First match wins: subclasses before their bases (CacheExhausted is a PromptTooLong, an InvalidRequest;
# ModelNotFound is a TemplateNotFound).
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (ModelNotFound, ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found")),
    (TemplateNotFound, ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "prefix_not_found")),
    (TemplateExists, ErrorKind(grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error", "prefix_exists")),
    (CacheExhausted, ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "cache_exhausted")),
    (PromptTooLong, ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error",
                              "context_length_exceeded")),
    (RequestTooLarge, ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error",
                                "request_too_large")),
    (InvalidRequest, ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_value")),
    (QueueFull, ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "queue_full")),
    (TemplateBudgetExceeded, ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
                                       "prefix_budget_exceeded")),
    (EngineStopped, ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "server_error", "unavailable")),
    (ServerNotReady, ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "server_error", "unavailable")),
    (ReplicaUnavailable, ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "server_error", "unavailable")),
    (Unauthenticated, ErrorKind(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "missing_api_key")),
    (PermissionDenied, ErrorKind(grpc.StatusCode.PERMISSION_DENIED, 401, "authentication_error",
                                 "invalid_api_key")),
    (ChatTemplateMismatch, ErrorKind(grpc.StatusCode.FAILED_PRECONDITION, 409, "invalid_request_error",
                                     "chat_template_mismatch")),
)
INTERNAL = ErrorKind(grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error")


def is_answer(exc: BaseException) -> bool:
    """exc is one of the service's answers to a caller (in the error table), not a server fault."""
    return any(isinstance(exc, cls) for cls, _ in _KINDS)


def _details(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= MAX_DETAILS_CHARS else text[:MAX_DETAILS_CHARS - 3] + "..."


def classify(exc: BaseException) -> tuple[ErrorKind, str]:
    """The kind of error and the message the caller gets. Unexpected errors are logged here, with
    their traceback, and reach the caller without internals."""
    for cls, kind in _KINDS:
        if isinstance(exc, cls):
            return kind, _details(exc)
    if isinstance(exc, PrefixServiceError):
        log.error("request failed: %s", _details(exc))
        return INTERNAL, _details(exc)
    log.error("internal error", exc_info=exc)
    return INTERNAL, f"internal error ({type(exc).__name__}); the server log has the details"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    kind, message = classify(exc)
    return kind.grpc_code, message


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status that fits exc. Never returns (context.abort raises)."""
    code, message = status_for(exc)
    await context.abort(code, message)
    raise AssertionError("grpc's context.abort returned")  # it raises grpc.aio.AbortError
