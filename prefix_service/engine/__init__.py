"""The engine: requests, scheduling, KV block bookkeeping and pinned templates.

| module | job | owns |
| --- | --- | --- |
| `api.py` | `Engine`: the step loop's thread, its command queue, `generate` and `generate_stream` | the thread |
| `core.py` | `EngineCore.step()`: schedule, run the model, sample, detokenize, check stops | tracked requests |
| `scheduler.py` | continuous batching, chunked prefill, preemption | sequences |
| `block_allocator.py` | block ids, reference counts, the free list, `check_integrity()` | ref counts |
| `prefix_cache.py` | `PrefixCacheManager`: reserve, pin, use and remove named templates | pins |
| `sequence.py` | the request and output types, and a sequence's scheduling state | - |
| `sampler.py`, `detokenizer.py` | sampling on the logits; incremental text and stop strings | - |
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

_EXPORTS = {"Engine": "api", "GenerateResult": "api", "EngineCore": "core"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from prefix_service.engine.api import Engine, GenerateResult
    from prefix_service.engine.core import EngineCore


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefix_service.engine' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f"prefix_service.engine.{module}"), name)
    globals()[name] = value
    return value
