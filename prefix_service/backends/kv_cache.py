"""The paged KV cache: per layer K and V tensors of [num_blocks, block_size, num_kv_heads, head_dim],
allocated once and sized from a memory budget (cache.kv_cache_memory; `auto_kv_cache_memory` works
out "auto" on a GPU)."""
from __future__ import annotations

import torch

from prefix_service.config import CacheConfig, EngineConfig
from prefix_service.errors import ConfigError
from prefix_service.model.llama import LlamaForCausalLM, ModelArch


def block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def kv_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the KV cache holds for cache.kv_cache_dtype `choice`: auto is the model's dtype."""
    return model_dtype if choice == "auto" else getattr(torch, choice)


HOST_KV_CACHE_MEMORY = 1 << 30  # kv_cache_memory "auto" in host memory
GRAPH_RESERVE = 512 << 20  # left free on a GPU for the CUDA graphs' memory pool and the allocator's slack


def auto_kv_cache_memory(model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache on a GPU: gpu_memory_utilization of the device's memory, less what
    this process holds (the weights, the peak of a forward of max_num_batched_tokens tokens: the
    largest step), less what is used outside torch (the CUDA context, other processes), less a
    reserve for the CUDA graphs. Raises ConfigError when that leaves no room."""
    import torch.nn.functional as F
    sched, arch = config.scheduler, model.arch
    tokens = max(1, min(sched.max_num_batched_tokens, model.rotary.max_positions))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(tokens, device=device), attention)
    model.compute_logits(hidden[:min(tokens, sched.max_num_seqs)])
    del hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    budget = int(config.cache.gpu_memory_utilization * total) - outside - peak - GRAPH_RESERVE
    need = 2 * block_bytes(arch, config.cache.block_size, kv_dtype(config.cache.kv_cache_dtype,
                                                                  next(model.parameters()).dtype))
    if budget < need:
        gib = 1 << 30
        raise ConfigError(
            f"cache.kv_cache_memory auto: {config.cache.gpu_memory_utilization:.0%} of the GPU's {total / gib:.1f} GiB "
            f"leaves {max(budget, 0) / gib:.2f} GiB for the KV cache after the model's {peak / gib:.1f} GiB (weights "
            f"and a {tokens}-token forward) and {outside / gib:.1f} GiB used outside this engine; raise "
            f"cache.gpu_memory_utilization, lower scheduler.max_num_batched_tokens, or give kv_cache_memory in bytes")
    return budget


class KVCache:
    def __init__(self, arch: ModelArch, config: CacheConfig, dtype: torch.dtype, device: torch.device) -> None:
        per_block = block_bytes(arch, config.block_size, dtype)
        memory = HOST_KV_CACHE_MEMORY if config.kv_cache_memory == "auto" else int(config.kv_cache_memory)
        self.num_blocks = config.num_blocks or memory // per_block
        if self.num_blocks < 2:
            raise ConfigError(
                f"cache.kv_cache_memory: {memory} bytes holds {self.num_blocks} blocks of "
                f"{per_block} bytes; give at least {2 * per_block} bytes")
        self.block_size = config.block_size
        self.bytes_per_block = per_block
        shape = (self.num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim)
        # k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v))
