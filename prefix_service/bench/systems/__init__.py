"""The systems under test, behind one small interface.

    engine_prefix      our Engine; requests name the workload's pinned prefix (none in no_shared)
    engine_no_prefix   our Engine with cache.enable_prefix: false; requests carry the full ids
    hf_generate        transformers `generate`, no reuse, one request at a time
    hf_prompt_cache    transformers `generate` on a deep copy of a prefix DynamicCache computed once
    hf_generate_batch  transformers continuous batching (its paged cache, with prefix block sharing)
    grpc_prefix        our gRPC server (a separate process) through prefix_service.client, naming the prefix
    grpc_no_prefix     the same server, the full prompt text and no prefix
    http_prefix        the same server's OpenAI HTTP API (/v1/completions, streamed), the template as the
                       model: the calls vLLM's server gets; asked for by name with --systems
    vllm_apc           vLLM's OpenAI server (a separate process), the full ids, automatic prefix caching on,
                       in the dtype our engine resolves (both compute alike)
    vllm_no_apc        the same with prefix caching off
    vllm_apc_bf16, vllm_no_apc_bf16, vllm_apc_f32, vllm_no_apc_f32
                       the same two in a stated dtype (bfloat16: vLLM's default for a bf16 checkpoint,
                       what `vllm serve` gives its users), asked for by name with --systems

`run` is blocking and thread-safe; the closed and open loops call it from many threads.
"""
from __future__ import annotations

import time

from prefix_service.bench.metrics import Timing
from prefix_service.bench.workloads import BenchRequest, Workload

SYSTEMS = ("engine_prefix", "engine_no_prefix", "hf_generate", "hf_prompt_cache", "hf_generate_batch",
           "grpc_prefix", "grpc_no_prefix", "vllm_apc", "vllm_no_apc")
PEERS = ("vllm_apc", "vllm_no_apc")  # other serving systems: run where their environment is installed
PEER_DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # a peer name's suffix: the dtype it runs
DTYPE_PEERS = tuple(f"{peer}_{suffix}" for peer in PEERS for suffix in PEER_DTYPES)
BY_NAME = ("http_prefix",)  # ours, asked for by name: not in a full run
KNOWN_SYSTEMS = SYSTEMS + BY_NAME + DTYPE_PEERS  # what --systems takes; a full run measures SYSTEMS


def peer_of(system: str) -> tuple[str, str | None] | None:
    """(its peer, its dtype or None: our engine's) for a peer system's name, else None:
    "vllm_apc_bf16" -> ("vllm_apc", "bfloat16"), "vllm_apc" -> ("vllm_apc", None)."""
    if system in PEERS:
        return system, None
    base, _, suffix = system.rpartition("_")
    return (base, PEER_DTYPES[suffix]) if base in PEERS and suffix in PEER_DTYPES else None


def base_system(system: str) -> str:
    """The system whose plan settings (caps, open loop) a system follows: a peer in a stated dtype
    follows the peer."""
    peer = peer_of(system)
    return peer[0] if peer is not None else system


class System:
    name: str = ""
    uses_prefix: bool = False  # sends the workload's prefix by reference (name or cache) when it has one
    kv_num_blocks: int | None = None  # our engine's KV cache blocks, where the system is our engine (hosted)

    def supports(self, workload: Workload) -> bool:
        """False where the system has nothing to show on this workload (e.g. a prefix cache, no prefix)."""
        return True

    def prepare(self, workload: Workload) -> None:
        """Untimed setup before the workload's first measured request (pin / compute the prefix)."""

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        raise NotImplementedError

    def kv_peak_start(self) -> bool:
        """Start a window for kv_blocks_peak; False where the system cannot count its KV blocks."""
        return False

    def kv_blocks_peak(self) -> int | None:
        """The most KV blocks in use at once (pinned prefixes included) since kv_peak_start; None
        where the system cannot say."""
        return None

    def kv_blocks_pinned(self) -> int | None:
        """KV blocks pinned by templates now; None where the system cannot say."""
        return None

    def close(self) -> None:
        pass


class KVPeak:
    """The most KV blocks a system had in use at once over the timed sections it wraps (`with
    KVPeak(system):` around each; `peak` accumulates over them, None where the system cannot say).
    The engine keeps the high-water mark itself (BlockAllocator.peak_used), read once before and
    once after each section: nothing polls the system while it serves the requests being timed."""

    def __init__(self, system: System) -> None:
        self._system = system
        self._on = False
        self.peak: int | None = None

    def __enter__(self) -> KVPeak:
        self._on = self._system.kv_peak_start()
        return self

    def __exit__(self, *exc) -> None:
        if self._on:
            value = self._system.kv_blocks_peak()
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
            self._on = False


def now() -> float:
    return time.perf_counter()
