"""The cuda backend: the model's reference forward on a GPU, attention through cuda_ops' kernels
(store, concat of a template's paged K/V with the new tokens'), FlashAttention varlen prefill
and the Triton paged decode (attention.py); decode steps replay CUDA graphs (graphs.py).

At start (`prepare`) the kernels are built (about 20 s the first time on a machine, then loaded
from the build cache); where they cannot be (no nvcc or ninja, a compiler error), the engine logs
one warning with the reason and runs cuda_ops' torch references instead, slower but the same
results. Then each layer's element-wise work is fused (layers.py: Triton kernels, compiled here on
a tiny input; where they cannot be, one warning and the model's reference layers), and the decode
graphs are captured."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

import torch

import cuda_ops
from cuda_ops.paged_decode import triton_available
from prefix_service.backends.base import Backend, StepTensors
from prefix_service.backends.cuda.attention import (DecodeFn, PrefillFn, VarlenAttention, VarlenMetadata, decode_triton,
                                                    pick_decode, pick_prefill)
from prefix_service.backends.cuda.graphs import DecodeGraphs
from prefix_service.backends.cuda.layers import FusedForward, fused_layers_fit
from prefix_service.backends.cuda.staging import Staging
from prefix_service.config import CacheConfig, EngineConfig
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.step import StepBatch

log = logging.getLogger("prefix_service.engine")


def load_kernels() -> str:
    """Build or load cuda_ops' kernels now, not at the first step. Where they cannot be used, this
    process runs their torch references from here on, after one warning with the reason. Returns
    which runs: "cuda_ops" or "cuda_ops references"."""
    if cuda_ops.cuda_ops_available():
        try:
            cuda_ops.load_cuda_ops()
            return "cuda_ops"
        except RuntimeError as exc:
            cuda_ops.use_references(str(exc).splitlines()[0])
            log.warning("cuda_ops kernels unavailable, running their torch references instead: %s", exc)
    return "cuda_ops references"


class CudaBackend(Backend):
    """prefill, decode: (name, implementation) to use instead of the fastest that runs here;
    fused_layers: False runs the model's reference layers (None: model.cuda_fused_layers decides)."""
    name = "cuda"

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, prefill: tuple[str, PrefillFn] | None = None,
                 decode: tuple[str, DecodeFn] | None = None, fused_layers: bool | None = None) -> None:
        super().__init__(model, cache)
        self.model = model
        self.prefill_name, self.prefill = prefill or pick_prefill(self.dtype)
        self.decode_name, self.decode = decode or pick_decode()
        self.graphs: DecodeGraphs | None = None
        self.kernels = "cuda_ops"
        self.staging = Staging(self.device)
        self.fused_layers = fused_layers
        # the forward: (input_ids, positions, attention) -> hidden states, the model's or FusedForward
        self.run_model: Callable[..., torch.Tensor] = model

    def describe(self) -> str:
        graphs = f", CUDA graphs up to {self.graphs.max_batch} rows" if self.graphs is not None else ""
        layers = "fused layers" if isinstance(self.run_model, FusedForward) else "reference layers"
        return f"cuda (prefill {self.prefill_name}, decode {self.decode_name}, {self.kernels}, {layers}{graphs})"

    def _pick_layers(self, configured: bool) -> None:
        """The fused layers where they are asked for (fused_layers, else model.cuda_fused_layers) and
        can run: Triton present (on CPU tensors: its interpreter), the model's shapes fitting;
        compiled now, else one warning and the reference layers."""
        if not (configured if self.fused_layers is None else self.fused_layers):
            return
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        reason = None
        if not triton_available():
            reason = "triton is not installed"
        elif self.device.type != "cuda" and not interpreted:
            reason = f"the model is on {self.device.type}, not a GPU (TRITON_INTERPRET=1 runs them there)"
        elif not fused_layers_fit(self.model):
            reason = "the model's rows are wider than the kernels hold"
        if reason is None:
            forward = FusedForward(self.model)
            try:
                forward.warm_up(self.device)
                self.run_model = forward
                return
            except Exception as exc:  # a Triton build error: the reference layers still serve
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("fused layers off, running the model's reference layers: %s", reason)

    def prepare(self, config: EngineConfig, max_model_len: int) -> None:
        self.kernels = load_kernels()
        self._pick_layers(config.model.cuda_fused_layers)
        max_batch = min(config.model.cuda_graph_max_batch, config.scheduler.max_num_seqs)
        # graphs replay the paged decode kernel; the gather + SDPA fallback would gather max_model_len rows
        if self.device.type == "cuda" and max_batch > 0 and self.decode is decode_triton:
            try:
                self.graphs = DecodeGraphs(self, max_batch, max_model_len)
            except Exception:  # a kernel that cannot be captured: eager steps still serve
                log.warning("CUDA graphs off: capturing the decode step failed", exc_info=True)
                self.graphs = None
                torch.cuda.synchronize(self.device)

    def forward(self, step: StepBatch, host: StepTensors) -> torch.Tensor | None:
        graphs = self.graphs
        if graphs is not None and graphs.fits(step) and host.block_tables.shape[1] <= graphs.width:
            return graphs.run(step, host)
        # every input in one copy, queued before the forward
        meta, (ids, positions, logit_rows) = VarlenMetadata.build(
            step, host, self.staging, self.block_size if self.decode is decode_triton else None,
            (self.arch.num_heads, self.arch.num_kv_heads), also=(host.token_ids, host.positions, host.logit_rows))
        hidden = self.run_model(ids, positions, VarlenAttention(self.kv_layers, meta, self.prefill, self.decode))
        if not host.logit_rows.numel():
            return None
        return self.model.compute_logits(hidden[logit_rows])

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        cuda_ops.copy_blocks(self.kv_cache.k, self.kv_cache.v, torch.tensor(pairs, dtype=torch.int64))
