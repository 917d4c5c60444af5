"""Attention backends. The torch backend runs everywhere and is the oracle for the others.

Batch layout (built by the model runner): the first `num_decode_tokens` tokens are decodes
(one new token per sequence, attending over its block table); the rest are prefill chunks,
flattened varlen, each attending over [its cached context + its own new tokens] with causal
masking aligned bottom-right (query i of a chunk after c cached tokens sees keys [0, c + i]).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import cuda_ops
from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.backends.torch.cascade import CPU_FLASH, CascadeDecode, attend, attend_paged, cascade_decode, merge
from prefix_service.backends.cpu.packed_prefix import PackedPrefixKV, attend_packed


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Nd, max_blocks] int32, -1 padded
    decode_context_lens: torch.Tensor  # [Nd] int32, the new token included
    decode_max_context: int
    prefill_block_tables: torch.Tensor  # [Np, max_blocks] int32, -1 padded
    prefill_prefix_lens: torch.Tensor  # [Np] int32: tokens already in the cache (prefix, earlier chunks)
    prefill_cu_seqlens_q: torch.Tensor  # [Np + 1] int32, offsets within the prefill tokens
    prefill_q_lens: list[int]
    prefill_prefix_lens_list: list[int]
    prefill_max_q: int = 0
    prefill_max_k: int = 0
    prefill_total_k: int = 0  # sum of context + new tokens: the concat output's rows, known on the host
    # per prefill: (first block, number of blocks) of the leading run of its context's full blocks that
    # are consecutive in the cache (a template pinned by its warmup); (0, 0) when there is none
    prefill_ctx_runs: list[tuple[int, int]] = field(default_factory=list)
    decode_cascade: CascadeDecode | None = None  # decodes grouped by shared prefix blocks (2+ per group)
    # per prefill (empty: none at all): its template's full blocks packed for the CPU (packed_prefix.py)
    # when it continues such a template; they stand in for the leading run
    prefill_packed: list[PackedPrefixKV | None] = field(default_factory=list)
    decode_packed: list[PackedPrefixKV | None] = field(default_factory=list)  # the same, per decode

    # tensors derived from the above once per step and shared by all layers: causal masks (keyed by
    # shape), attend_paged's gather index and padding mask, the gathered-context block ids per prefill
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_q_lens)

    def causal_mask(self, q_len: int, ctx: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive bottom-right causal mask [q_len, ctx + q_len], built once per step for all layers."""
        key = (q_len, ctx, dtype)
        mask = self.cache.get(key)
        if mask is None:
            keep = torch.ones(q_len, ctx + q_len, dtype=torch.bool, device=device).tril(diagonal=ctx)
            mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
            self.cache[key] = mask
        return mask


class TorchAttentionBackend:
    """native: CPU prefill and decode attention, and the K/V store, in the native kernel
    (cpu_attention.py), float32 only; every other device stays on torch's kernels."""
    name = "torch"
    native = False

    def __init__(self, native: bool = False) -> None:
        self.native = native
        self.name = "torch+native" if native else "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
        if self.native and q.device.type == "cpu":
            return self._forward_native(q, k, v, k_cache, v_cache, meta, scale)
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if not meta.num_prefills:
            return self._decode(q, k_cache, v_cache, meta, scale)
        if not nd:
            return self._prefill(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale)
        return out

    @staticmethod
    def _store(k, v, k_cache, v_cache, slot_mapping) -> None:
        if k_cache.device.type == "cpu":  # every new token has a slot (the runner emits no -1): a plain row copy
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
        else:
            cuda_ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [Nd, Hq, D]. Sequences sharing a pinned prefix attend to it once, together; otherwise
        # each gathers its context through its block table (the native kernel: _forward_native).
        if meta.decode_cascade is not None:
            return cascade_decode(q, k_cache, v_cache, meta.decode_cascade, scale)
        out, _ = attend_paged(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                              meta.decode_max_context, scale, meta.cache)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [Tp, Hq, D]; k, v: [Tp, Hkv, D]: the new tokens of every prefill chunk
        if q.device.type == "cpu" and CPU_FLASH is not None:
            return self._prefill_split(q, k, v, k_cache, v_cache, meta, scale)
        k_all, v_all, cu_k = cuda_ops.concat_kvcache_with_prefix(
            k_cache, v_cache, meta.prefill_block_tables, meta.prefill_prefix_lens, k, v,
            meta.prefill_cu_seqlens_q, total_k=meta.prefill_total_k)  # [Tk, Hkv, D]
        return self._attend_prefill(q, k_all, v_all, cu_k, meta, scale)

    @staticmethod
    def _after_context(i: int, skip: int, ctx: int, ki, vi, k_cache, v_cache, meta: AttentionMetadata):
        """Prefill i's keys and values after its first `skip` blocks: the rest of its context
        (`ctx` tokens in all), gathered from its blocks, in front of its new tokens' ki, vi."""
        bs = k_cache.shape[1]
        rest = ctx - skip * bs
        if not rest:
            return ki, vi
        blocks = meta.cache.get(("rest_blocks", i))  # the same for every layer of the step
        if blocks is None:
            blocks = meta.cache[("rest_blocks", i)] = meta.prefill_block_tables[i, skip:-(-ctx // bs)].long()
        return (torch.cat([k_cache.index_select(0, blocks).flatten(0, 1)[:rest], ki]),
                torch.cat([v_cache.index_select(0, blocks).flatten(0, 1)[:rest], vi]))

    @staticmethod
    def _forward_native(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The native kernel (CPU): each call also stores its tokens' new K/V into their slots.
        Decodes: one call for all of them, each reading its context in place (a template from its
        packed copy). Prefills: one call per sequence, its new queries over its packed template
        (meta.prefill_packed, every key visible), then the rest of its context, read through its
        block table, and its new tokens (causal, bottom-right), in one softmax."""
        out = q.new_empty(q.shape)  # dense rows, whatever q's row stride
        nd = meta.num_decode_tokens
        slots = meta.slot_mapping
        if nd:
            packed = meta.decode_packed
            templates = [p.layer(k_cache) if p is not None else None for p in packed] if any(packed) else None
            cpu_attention.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                           scale, out=out[:nd], templates=templates,
                                           new_kv=(k[:nd], v[:nd], slots[:nd]))
        packed = meta.prefill_packed or [None] * meta.num_prefills
        bs = k_cache.shape[1]
        start = nd
        for i, (q_len, ctx) in enumerate(zip(meta.prefill_q_lens, meta.prefill_prefix_lens_list)):
            end = start + q_len
            template = packed[i].layer(k_cache) if packed[i] is not None else None
            first = packed[i].num_blocks * bs if packed[i] is not None else 0  # context tokens in the template
            cpu_attention.prefill_attention(q[start:end], k[start:end], v[start:end], scale, out=out[start:end],
                                            template=template, cache=(k_cache, v_cache),
                                            block_table=meta.prefill_block_tables[i], cached=(first, ctx - first),
                                            slots=slots[start:end])
            start = end
        return out

    @staticmethod
    def _prefill_split(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Per prefill sequence, its new queries over (a) the leading run of its context held in
        consecutive full blocks (a pinned template: read in place, every key visible) and (b) the
        rest of its context, gathered, then its new tokens (causal, bottom-right); the two merged by
        log-sum-exp. With no such run, (b) alone is the whole attention. A sequence whose template
        is packed (meta.prefill_packed) reads (a) from the packed copy."""
        out = torch.empty_like(q)
        bs, hkv, d = k_cache.shape[1:]
        hq = q.shape[1]
        g = hq // hkv
        runs = meta.prefill_ctx_runs or [(0, 0)] * meta.num_prefills  # none given: gather every context
        packed = meta.prefill_packed or [None] * meta.num_prefills
        start = 0
        for i, (q_len, ctx) in enumerate(zip(meta.prefill_q_lens, meta.prefill_prefix_lens_list)):
            first, n_run = runs[i] if packed[i] is None else (0, packed[i].num_blocks)
            rest = ctx - n_run * bs
            qi = q[start:start + q_len]
            ki, vi = TorchAttentionBackend._after_context(i, n_run, ctx, k[start:start + q_len], v[start:start + q_len],
                                                          k_cache, v_cache, meta)
            mask = meta.causal_mask(q_len, rest, q.dtype, q.device) if rest else None
            q4, k4, v4 = qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            if not n_run:
                o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None,
                                                   scale=scale, enable_gqa=True)
                out[start:start + q_len] = o[0].transpose(0, 1)
            else:
                o_b, lse_b = attend(q4, k4, v4, mask, scale, causal=mask is None)  # [1, Hq, q_len, D], [1, Hq, q_len]
                # the query heads of one KV head as the query rows of one attention (one read of the run
                # per KV head). Its rows come out in (KV head, head in group, token) order: o_b's order.
                qf = qi.view(q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * q_len, d)
                if packed[i] is not None:  # the template's blocks from their packed copy
                    o_a, lse_a = attend_packed(qf, *packed[i].layer(k_cache), scale)
                else:
                    k_run = k_cache[first:first + n_run].flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, run, D]
                    v_run = v_cache[first:first + n_run].flatten(0, 1).transpose(0, 1)[None]
                    o_a, lse_a = attend(qf, k_run, v_run, None, scale)
                o = merge(o_a[0].unflatten(1, (g, q_len)), lse_a[0].unflatten(1, (g, q_len)),
                          o_b[0].unflatten(0, (hkv, g)), lse_b[0].unflatten(0, (hkv, g)))  # [Hkv, G, q_len, D]
                out[start:start + q_len].view(q_len, hkv, g, d).copy_(o.permute(2, 0, 1, 3))
            start += q_len
        return out

    @classmethod
    def _attend_prefill(cls, q, k_all, v_all, cu_k, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return cls.attend_varlen(q, k_all, v_all, meta, scale)

    @staticmethod
    def attend_varlen(q, k_all, v_all, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Per prefill sequence, SDPA of its new queries over its contiguous [context + new] K/V,
        causal aligned bottom-right. q: [Tq, Hq, D]; k_all, v_all: [Tk, Hkv, D]."""
        out = torch.empty_like(q)
        q_start = k_start = 0
        for q_len, ctx in zip(meta.prefill_q_lens, meta.prefill_prefix_lens_list):
            k_len = ctx + q_len
            # a leading batch axis: on CPU, SDPA takes its flash kernel only for 4-D inputs (3-D ones
            # fall back to the unfused math path, 2-4x slower on long prompts)
            qi = q[q_start:q_start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            ki = k_all[k_start:k_start + k_len].transpose(0, 1)[None]  # [1, Hkv, k_len, D]
            vi = v_all[k_start:k_start + k_len].transpose(0, 1)[None]
            if ctx == 0:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=meta.causal_mask(q_len, ctx, q.dtype, q.device),
                                                   scale=scale, enable_gqa=True)
            out[q_start:q_start + q_len] = o[0].transpose(0, 1)
            q_start += q_len
            k_start += k_len
        return out


def make_backend(name: str, device: torch.device, native: bool = False):
    """'auto' picks the cuda backend on a GPU, torch elsewhere; native: the torch backend's CPU
    attention in the native kernel (the caller checked cpu_attention.available())."""
    if name == "cuda" and device.type != "cuda":
        from prefix_service.errors import ConfigError
        raise ConfigError(f"model.attention_backend: 'cuda' needs a CUDA device, the model is on {device}")
    if name == "cuda" or (name == "auto" and device.type == "cuda"):
        from prefix_service.backends.cuda.attention import CudaAttentionBackend
        return CudaAttentionBackend()
    return TorchAttentionBackend(native=native and device.type == "cpu")
