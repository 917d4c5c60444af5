"""The GPU attention backend.

prefill: store_kvcache (CUDA kernel) -> concat_kvcache_with_prefix (CUDA kernel) -> FlashAttention
varlen, causal aligned bottom-right (query i of a chunk after c cached tokens sees keys [0, c+i]).
FlashAttention comes from the flash-attn package when it is importable, else from PyTorch's own
(`torch.nn.attention.varlen.varlen_attn`), else a per-sequence SDPA loop.
decode: the Triton paged kernel over block tables (cuda_ops.paged_decode), or gather + SDPA.
Each implementation is a plain function, so tests can run this backend's glue on CPU.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch

from cuda_ops.paged_decode import paged_decode_attention, paged_decode_attention_ref, triton_available
from prefix_service.backends.torch.attention import AttentionMetadata, TorchAttentionBackend

log = logging.getLogger("prefix_service.attention")

# prefill(q [Tq, Hq, D], k [Tk, Hkv, D], v, cu_seqlens_k [Np+1], meta, scale) -> [Tq, Hq, D]
PrefillFn = Callable[..., torch.Tensor]
# decode(q [Nd, Hq, D], k_cache, v_cache, meta, scale) -> [Nd, Hq, D]
DecodeFn = Callable[..., torch.Tensor]


def prefill_flash_attn(q, k, v, cu_k, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # causal is bottom-right aligned since 2.1
    return flash_attn_varlen_func(q, k, v, meta.prefill_cu_seqlens_q, cu_k, meta.prefill_max_q,
                                  meta.prefill_max_k, softmax_scale=scale, causal=True)


def _torch_varlen_kwargs() -> dict | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    elif "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        return None
    kwargs["_gqa"] = "enable_gqa" in params
    return kwargs


def prefill_torch_varlen(q, k, v, cu_k, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    kwargs = dict(_TORCH_VARLEN or {})
    native_gqa = kwargs.pop("_gqa", False)
    if q.shape[1] != k.shape[1]:
        if native_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, meta.prefill_cu_seqlens_q, cu_k, meta.prefill_max_q, meta.prefill_max_k,
                       scale=scale, **kwargs)


def prefill_sdpa_loop(q, k, v, cu_k, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return TorchAttentionBackend.attend_varlen(q, k, v, meta, scale)


def decode_triton(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                  meta.decode_max_context, scale)


def decode_gather_sdpa(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return paged_decode_attention_ref(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                      meta.decode_max_context, scale)


_TORCH_VARLEN = _torch_varlen_kwargs()


def pick_prefill() -> tuple[str, PrefillFn]:
    try:
        import flash_attn  # noqa: F401
        return "flash_attn", prefill_flash_attn
    except ImportError:
        pass
    if _TORCH_VARLEN is not None:
        return "torch_varlen", prefill_torch_varlen
    return "sdpa_loop", prefill_sdpa_loop


def pick_decode() -> tuple[str, DecodeFn]:
    return ("triton_paged", decode_triton) if triton_available() else ("gather_sdpa", decode_gather_sdpa)


class CudaAttentionBackend(TorchAttentionBackend):
    """The torch backend's flow (store, then decode and prefill) with the GPU implementations:
    cuda_ops kernels for store and concat (dispatched by device), a FlashAttention varlen prefill
    and a paged decode kernel."""
    name = "cuda"

    def __init__(self, prefill: tuple[str, PrefillFn] | None = None, decode: tuple[str, DecodeFn] | None = None):
        self.prefill_name, self._attend_prefill = prefill or pick_prefill()
        self.decode_name, self._decode = decode or pick_decode()
        log.info("cuda attention backend: prefill %s, decode %s", self.prefill_name, self.decode_name)
