"""prefix_service: LLM generation with operator-named, pinned KV-cache prefixes.

The names below load on first use, so light clients (the CLI's generate and template commands,
prefix_service.client) do not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CacheConfig": "config", "EngineConfig": "config", "ModelConfig": "config", "SchedulerConfig": "config",
    "ServiceConfig": "config", "load_config": "config",
    "Engine": "engine", "GenerateResult": "engine",
    "CacheExhausted": "errors", "InvalidRequest": "errors", "TemplateBudgetExceeded": "errors", "TemplateExists": "errors",
    "TemplateNotFound": "errors", "PrefixServiceError": "errors", "PromptTooLong": "errors",
    "SamplingParams": "sampling_params",
    "FinishReason": "engine.sequence", "GenerateRequest": "engine.sequence", "RequestOutput": "engine.sequence",
    "TokenLogprob": "engine.sequence", "ScoreRequest": "engine.sequence", "ScoreOutput": "engine.sequence",
    "CandidateScore": "engine.sequence",
}

__all__ = [
    "CandidateScore", "ScoreOutput", "ScoreRequest",
    "CacheConfig", "CacheExhausted", "Engine", "EngineConfig", "FinishReason", "GenerateRequest", "GenerateResult",
    "InvalidRequest", "ModelConfig", "TemplateBudgetExceeded", "TemplateExists", "TemplateNotFound",
    "PrefixServiceError", "PromptTooLong", "RequestOutput", "SamplingParams", "SchedulerConfig",
    "ServiceConfig", "TokenLogprob", "load_config",
]

if TYPE_CHECKING:
    from prefix_service.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServiceConfig,
                                       load_config)
    from prefix_service.engine import Engine, GenerateResult
    from prefix_service.errors import (CacheExhausted, InvalidRequest, TemplateBudgetExceeded, TemplateExists,
                                       TemplateNotFound, PrefixServiceError, PromptTooLong)
    from prefix_service.sampling_params import SamplingParams
    from prefix_service.engine.sequence import (CandidateScore, FinishReason, GenerateRequest, RequestOutput,
                                                ScoreOutput, ScoreRequest, TokenLogprob)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefix_service' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"prefix_service.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
