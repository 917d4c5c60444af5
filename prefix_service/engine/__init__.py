"""The engine: requests, scheduling, KV block bookkeeping and pinned templates.

| module | job | owns |
| --- | --- | --- |
| `api.py` | `Engine`: the step loop's thread, its command queue, `generate` and `generate_stream` | the thread |
| `core.py` | `EngineCore.step()`: schedule, run the backend, sample, detokenize, check stops | tracked requests |
| `scheduler.py` | continuous batching, chunked prefill, preemption, the post-step update | sequences |
| `block_allocator.py` | block ids, reference counts, the free list, `check_integrity()` | ref counts |
| `template_pins.py` | `TemplatePins`: reserve, pin, use and remove named templates; tells the backend | pins, template counters |
| `sequence.py` | the request and output types, and a sequence's scheduling state | - |
| `sampler.py`, `detokenizer.py` | sampling on the logits; incremental text and stop strings | - |
| `snapshots.py` | a template's KV blocks on disk: the file format, its checks, atomic writes; offline verify, install, export | snapshot files |
| `template_snapshots.py` | the engine's side: save after a pin (one writer thread), load instead of a prefill, remove | the writer thread |

Everything that touches a device (the model's weights, the KV cache tensors, the forward pass) is
behind the backend boundary, prefix_service/backends/.
"""
from prefix_service.engine.api import Engine, EngineInfo, GenerateResult
from prefix_service.engine.core import EngineCore

__all__ = ["Engine", "EngineCore", "EngineInfo", "GenerateResult"]
