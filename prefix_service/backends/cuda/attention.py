"""Attention on a GPU.

store:   the CUDA store kernel writes each row's K/V into its slot (cuda_ops.store_kvcache)
prefill: concat_kvcache_with_prefix (CUDA kernel) gathers each sequence's cached context and its
         new K/V into one contiguous varlen buffer, then FlashAttention varlen, causal aligned
         bottom-right (query i of a chunk after c cached tokens sees keys [0, c + i]);
         FlashAttention comes from the flash-attn package when it is importable, else from
         PyTorch's own (`torch.nn.attention.varlen.varlen_attn`); both take only float16 and
         bfloat16, so a float32 model runs SDPA per sequence
decode:  the Triton paged kernel over block tables (cuda_ops.paged_decode), or gather + SDPA; rows
         that continue the same template read its shared blocks once per group (cascade, built
         here from the step's rows: `VarlenMetadata.cascade`)

Each implementation is a plain function of (q, the step's tensors, scale), so tests can run this
glue on CPU tensors (cuda_ops' references, Triton's interpreter).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch

import cuda_ops
from cuda_ops.paged_decode import (CascadeGroups, cascade_supported, paged_decode_attention, paged_decode_attention_ref,
                                   rows_per_chunk, triton_available, work_items)
from prefix_service.backends.base import StepTensors
from prefix_service.backends.torch.attention import CausalMasks, attend_contiguous

if TYPE_CHECKING:
    from prefix_service.backends.cuda.staging import Staging
    from prefix_service.engine.step import StepBatch


def cascade_rows(step: StepBatch) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """The step's template groups (StepBatch.template_groups) as the cascade takes them: each decode
    row's first own block (its group's shared full blocks, else 0) and the groups as (shared blocks, rows)."""
    first = [0] * step.num_decodes
    groups = []
    for rows in step.template_groups():
        blocks = step.decodes[rows[0]].num_template_blocks
        groups.append((blocks, rows))
        for r in rows:
            first[r] = blocks
    return first, groups


@dataclass
class VarlenMetadata:
    """One step's attention inputs on the device, shared by every layer."""
    slots: torch.Tensor  # [T] int64
    num_decodes: int
    decode_tables: torch.Tensor  # [Nd, W] int32, -1 padded
    decode_lens: torch.Tensor  # [Nd] int32, the new token included
    decode_max: int
    prefill_tables: torch.Tensor  # [Np, W] int32, -1 padded
    prefill_context: torch.Tensor  # [Np] int32: tokens already in the cache
    cu_seqlens_q: torch.Tensor  # [Np + 1] int32: offsets within the prefill rows
    prefill_new_list: list[int]
    prefill_context_list: list[int]
    max_q: int
    max_k: int
    total_k: int  # sum of context + new tokens: the concat output's rows, known on the host
    masks: CausalMasks = field(default_factory=CausalMasks, repr=False)  # the SDPA path's, for all layers
    cascade: CascadeGroups | None = None  # decode rows grouped by the template they share, if any
    decode_own_max: int = 0  # with a cascade: the most tokens a decode row reads outside its group's template

    @classmethod
    def build(cls, step: StepBatch, host: StepTensors, staging: Staging, block_size: int | None = None,
              heads: tuple[int, int] = (1, 1), also: Sequence[torch.Tensor] = ()
              ) -> tuple[VarlenMetadata, list[torch.Tensor]]:
        """The step's metadata on the device, moved there by one copy (staging) with the host
        tensors `also` (returned on the device, in order). block_size: the cache's, to group
        decode rows by template (None: no cascade); heads: the model's (query heads, kv heads),
        which set the cascade's rows per chunk."""
        def ints(data) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int32)

        nd = step.num_decodes
        new = [r.num_new_tokens for r in step.prefills]
        context = [r.num_computed for r in step.prefills]
        cu_q = [0]
        for n in new:
            cu_q.append(cu_q[-1] + n)
        parts = [host.slots, host.block_tables[:nd], host.context_lens[:nd], host.block_tables[nd:], ints(context),
                 ints(cu_q)]
        groups: list[tuple[int, list[int]]] = []
        own_max = 0
        if block_size is not None and cascade_supported(block_size) and step.num_decodes >= 2:
            first, groups = cascade_rows(step)
            if groups:
                width = max(len(rows) for _, rows in groups)
                sizes = [len(rows) for _, rows in groups]
                items = work_items(sizes, rows_per_chunk(*heads))
                parts += [ints(first), ints([rows + [-1] * (width - len(rows)) for _, rows in groups]), ints(sizes),
                          ints([b for b, _ in groups]), ints(items).view(len(items), 2)]
                own_max = max(r.context_len - f * block_size for r, f in zip(step.decodes, first))
        moved = staging.to_device(list(also) + parts)
        extra, moved = moved[:len(also)], moved[len(also):]
        meta = cls(
            slots=moved[0],
            num_decodes=nd,
            decode_tables=moved[1],
            decode_lens=moved[2],
            decode_max=max((r.context_len for r in step.decodes), default=0),
            prefill_tables=moved[3],
            prefill_context=moved[4],
            cu_seqlens_q=moved[5],
            prefill_new_list=new,
            prefill_context_list=context,
            max_q=max(new, default=0),
            max_k=max((a + b for a, b in zip(new, context)), default=0),
            total_k=sum(new) + sum(context),
            cascade=CascadeGroups(moved[6], moved[7], moved[8], moved[9], moved[10]) if groups else None,
            decode_own_max=own_max)
        return meta, extra


# prefill(q [Tq, Hq, D], k [Tk, Hkv, D], v, cu_seqlens_k [Np+1], meta, scale) -> [Tq, Hq, D]
PrefillFn = Callable[..., torch.Tensor]
# decode(q [Nd, Hq, D], k_cache, v_cache, meta, scale) -> [Nd, Hq, D]
DecodeFn = Callable[..., torch.Tensor]


def prefill_flash_attn(q, k, v, cu_k, meta: VarlenMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # causal is bottom-right aligned since 2.1
    return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, cu_k, meta.max_q, meta.max_k, softmax_scale=scale,
                                  causal=True)


def _torch_varlen_kwargs() -> dict[str, Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    elif "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        return None
    kwargs["_gqa"] = "enable_gqa" in params
    return kwargs


_TORCH_VARLEN = _torch_varlen_kwargs()


def prefill_torch_varlen(q, k, v, cu_k, meta: VarlenMetadata, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn
    kwargs = dict(_TORCH_VARLEN or {})
    native_gqa = kwargs.pop("_gqa", False)
    if q.shape[1] != k.shape[1]:
        if native_gqa:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = varlen_attn(q, k, v, meta.cu_seqlens_q, cu_k, meta.max_q, meta.max_k, scale=scale, **kwargs)
    return cast(torch.Tensor, out)  # the output alone: no return_aux asked for


def prefill_sdpa_loop(q, k, v, cu_k, meta: VarlenMetadata, scale: float) -> torch.Tensor:
    return attend_contiguous(q, k, v, meta.prefill_new_list, meta.prefill_context_list, scale, meta.masks)


def decode_triton(q, k_cache, v_cache, meta: VarlenMetadata, scale: float) -> torch.Tensor:
    if meta.cascade is not None:  # each row's own pass covers only its blocks after its group's template
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                                      meta.decode_own_max, scale, cascade=meta.cascade)
    return paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, meta.decode_max, scale)


def decode_gather_sdpa(q, k_cache, v_cache, meta: VarlenMetadata, scale: float) -> torch.Tensor:
    return paged_decode_attention_ref(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, meta.decode_max,
                                      scale)


def pick_prefill(dtype: torch.dtype) -> tuple[str, PrefillFn]:
    """The fastest varlen prefill that takes `dtype`."""
    if dtype in (torch.float16, torch.bfloat16):
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


class VarlenAttention:
    """One step's attention for every layer, `attention(layer, q, k, v, scale)` as the model calls it."""

    def __init__(self, kv_layers, meta: VarlenMetadata, prefill: PrefillFn, decode: DecodeFn) -> None:
        self.kv_layers = kv_layers
        self.meta = meta
        self.prefill = prefill
        self.decode = decode

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; the caches: [num_blocks, block_size, Hkv, D]
        k_cache, v_cache = self.kv_layers[layer]
        meta = self.meta
        check = layer == 0  # every layer's tensors have the first's shapes: checked once a step
        cuda_ops.store_kvcache(k, v, k_cache, v_cache, meta.slots, check=check)
        nd = meta.num_decodes
        parts = []
        if nd:
            parts.append(self.decode(q[:nd], k_cache, v_cache, meta, scale))
        if meta.prefill_new_list:
            k_all, v_all, cu_k = cuda_ops.concat_kvcache_with_prefix(
                k_cache, v_cache, meta.prefill_tables, meta.prefill_context, k[nd:], v[nd:], meta.cu_seqlens_q,
                total_k=meta.total_k, check=check)  # [Tk, Hkv, D]
            parts.append(self.prefill(q[nd:], k_all, v_all, cu_k, meta, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
