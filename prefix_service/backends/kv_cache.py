"""The paged KV cache: per layer K and V tensors of [num_blocks, block_size, num_kv_heads, head_dim],
allocated once and sized from a memory budget."""
from __future__ import annotations

import torch

from prefix_service.config import CacheConfig
from prefix_service.errors import ConfigError
from prefix_service.model.llama import ModelArch


def block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


class KVCache:
    def __init__(self, arch: ModelArch, config: CacheConfig, dtype: torch.dtype, device: torch.device) -> None:
        per_block = block_bytes(arch, config.block_size, dtype)
        self.num_blocks = config.num_blocks or config.kv_cache_memory // per_block
        if self.num_blocks < 2:
            raise ConfigError(
                f"cache.kv_cache_memory: {config.kv_cache_memory} bytes holds {self.num_blocks} blocks of "
                f"{per_block} bytes; give at least {2 * per_block} bytes")
        self.block_size = config.block_size
        self.bytes_per_block = per_block
        shape = (self.num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim)
        # k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v))
