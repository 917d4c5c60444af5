"""The torch backend: the model's reference forward, attention in plain torch. Runs on any device;
the oracle the cpu and cuda backends are tested against."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prefix_service.backends.base import Backend, StepTensors
from prefix_service.backends.torch.attention import PagedAttention, PagedMetadata
from prefix_service.config import CacheConfig
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.step import StepBatch


class TorchBackend(Backend):
    name = "torch"

    @classmethod
    def kv_dtype_unsupported(cls, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
        """Any: the new K/V are rounded to the cache's dtype as they are made and the cache's rows
        widened (or narrowed) to the model's as they are read (attention.py)."""
        return None

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig) -> None:
        super().__init__(model, cache)
        self.model = model

    def forward(self, step: StepBatch, host: StepTensors) -> torch.Tensor | None:
        device = self.device
        meta = PagedMetadata.build(step, host, self.block_size, device)
        ids = host.token_ids.to(device, non_blocking=True)
        positions = host.positions.to(device, non_blocking=True)
        hidden = self.model(ids, positions, PagedAttention(self.kv_layers, meta))  # [T, hidden]
        if not host.logit_rows.numel():
            return None
        return self.model.compute_logits(hidden[host.logit_rows.to(device, non_blocking=True)])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_layers:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
