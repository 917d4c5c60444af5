"""Exceptions raised by the engine. Each maps to one gRPC status code at the API."""
from __future__ import annotations


class PrefixServiceError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(PrefixServiceError, ValueError):
    """A config value is missing, unknown or out of range."""


class ModelLoadError(PrefixServiceError):
    """The model directory is incomplete or holds an unsupported architecture."""


class InvalidRequest(PrefixServiceError, ValueError):
    """A request field is invalid (bad sampling values, empty input, ...). `param` names the field
    when one is to blame (the HTTP API reports it in the error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt (template included) does not fit the model's context or the KV cache, or is longer
    than scheduler.max_prompt_tokens."""


class CacheExhausted(PromptTooLong):
    """The request cannot fit in the KV cache even running alone beside the pinned templates: a
    capacity limit of this server rather than of the model (RESOURCE_EXHAUSTED at the API)."""


class TemplateNotFound(PrefixServiceError, KeyError):
    """No prefix template has this name. `param` names the request's field that gave it, where the
    caller knows it (the HTTP API reports it in the error body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "template not found"


class TemplateExists(PrefixServiceError):
    """A prefix template with this name already exists."""


class TemplateBudgetExceeded(PrefixServiceError):
    """Pinning this template would exceed the prefix budget (or the free KV blocks)."""


class QueueFull(PrefixServiceError):
    """The waiting queue is at its configured bound."""


class EngineStopped(PrefixServiceError):
    """The engine is shut down (or shutting down) and accepts no new work."""
