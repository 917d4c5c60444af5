"""The cuda backend: the model's reference forward on a GPU, attention through cuda_ops' kernels
(store, concat of a template's paged K/V with the new tokens'), FlashAttention varlen prefill
and the Triton paged decode (attention.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

import cuda_ops
from prefix_service.backends.base import Backend, StepTensors
from prefix_service.backends.cuda.attention import (DecodeFn, PrefillFn, VarlenAttention, VarlenMetadata, pick_decode,
                                                    pick_prefill)
from prefix_service.config import CacheConfig
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.step import StepBatch

log = logging.getLogger("prefix_service.engine")


class CudaBackend(Backend):
    """prefill, decode: (name, implementation) to use instead of the fastest that runs here."""
    name = "cuda"

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, prefill: tuple[str, PrefillFn] | None = None,
                 decode: tuple[str, DecodeFn] | None = None) -> None:
        super().__init__(model, cache)
        self.model = model
        self.prefill_name, self.prefill = prefill or pick_prefill(self.dtype)
        self.decode_name, self.decode = decode or pick_decode()

    def describe(self) -> str:
        return f"cuda (prefill {self.prefill_name}, decode {self.decode_name})"

    def forward(self, step: StepBatch, host: StepTensors) -> torch.Tensor | None:
        device = self.device
        meta = VarlenMetadata.build(step, host, device)
        ids = host.token_ids.to(device, non_blocking=True)
        positions = host.positions.to(device, non_blocking=True)
        hidden = self.model(ids, positions, VarlenAttention(self.kv_layers, meta, self.prefill, self.decode))
        if not host.logit_rows.numel():
            return None
        return self.model.compute_logits(hidden[host.logit_rows.to(device, non_blocking=True)])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        cuda_ops.copy_blocks(self.kv_cache.k, self.kv_cache.v, torch.tensor(pairs, dtype=torch.int64))
