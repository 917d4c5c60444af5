"""The torch backend: the model's reference forward, attention in plain torch. Runs on any device;
the oracle the cpu and cuda backends are tested against."""
from __future__ import annotations

import torch

from prefix_service.backends.base import Backend, StepInputs
from prefix_service.backends.torch.attention import PagedAttention, PagedMetadata
from prefix_service.config import CacheConfig
from prefix_service.model.llama import LlamaForCausalLM


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig) -> None:
        super().__init__(model, cache)
        self.model = model

    def forward(self, step: StepInputs) -> torch.Tensor | None:
        device = self.device
        meta = PagedMetadata.build(step, self.block_size, device)
        ids = torch.tensor(step.token_ids, dtype=torch.int64).to(device, non_blocking=True)
        positions = torch.tensor(step.positions, dtype=torch.int64).to(device, non_blocking=True)
        hidden = self.model(ids, positions, PagedAttention(self.kv_layers, meta))  # [T, hidden]
        if not step.logit_rows:
            return None
        rows = torch.tensor(step.logit_rows, dtype=torch.int64).to(device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for k_cache, v_cache in self.kv_layers:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
