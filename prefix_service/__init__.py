"""prefix_service: LLM generation with operator-named, pinned KV-cache prefixes."""
from prefix_service.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServiceConfig,
                                   load_config)
from prefix_service.engine import Engine, GenerateResult
from prefix_service.errors import (InvalidRequest, PrefixBudgetExceeded, PrefixExists, PrefixNotFound,
                                   PrefixServiceError, PromptTooLong)
from prefix_service.sampling_params import SamplingParams
from prefix_service.sequence import FinishReason, GenerateRequest, RequestOutput

__all__ = [
    "CacheConfig", "Engine", "EngineConfig", "FinishReason", "GenerateRequest", "GenerateResult",
    "InvalidRequest", "ModelConfig", "PrefixBudgetExceeded", "PrefixExists", "PrefixNotFound",
    "PrefixServiceError", "PromptTooLong", "RequestOutput", "SamplingParams", "SchedulerConfig",
    "ServiceConfig", "load_config",
]
