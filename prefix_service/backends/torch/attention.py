"""Paged attention in plain torch: the reference every other backend is tested against.

A step's rows are decodes first (one new token each, over its block table), then prefill
chunks, flattened varlen, each attending over [its cached context + its own new tokens] with
causal masking aligned bottom-right (query i of a chunk after c cached tokens sees keys
[0, c + i]). Every layer first writes its new K/V into their slots.

    decode:  decodes that share a pinned template's full blocks attend to them once, as a group,
             and to their own blocks apart, merged by log-sum-exp (cascade.py); the rest gather
             their context through their block tables
    prefill: per sequence, its cached context gathered from its blocks, its new K/V after it,
             one scaled_dot_product_attention
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prefix_service.backends.base import StepTensors
from prefix_service.backends.torch.cascade import CascadeDecode, PrefixGroup, attend_paged, cascade_decode

if TYPE_CHECKING:
    from prefix_service.engine.step import StepBatch


class CausalMasks:
    """Additive bottom-right causal masks [q_len, ctx + q_len], made once per step for all layers."""

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}

    def __call__(self, q_len: int, ctx: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (q_len, ctx, dtype)
        mask = self._masks.get(key)
        if mask is None:
            keep = torch.ones(q_len, ctx + q_len, dtype=torch.bool, device=device).tril(diagonal=ctx)
            mask = self._masks[key] = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(
                ~keep, float("-inf"))
        return mask


@dataclass
class PagedMetadata:
    """One step's attention inputs on the device, shared by every layer."""
    slots: torch.Tensor  # [T] int64: each row's cache slot
    num_decodes: int
    decode_tables: torch.Tensor  # [Nd, W] int32, -1 padded
    decode_lens: torch.Tensor  # [Nd] int32: context tokens, the new one included
    decode_max: int
    cascade: CascadeDecode | None  # decodes grouped by shared template blocks (2+ per group)
    prefill_blocks: list[torch.Tensor]  # per prefill: int64 ids of the blocks that hold its cached context
    prefill_new: list[int]
    prefill_context: list[int]
    masks: CausalMasks = field(default_factory=CausalMasks, repr=False)
    cache: dict = field(default_factory=dict, repr=False)  # attend_paged's gather index and mask, for all layers

    @classmethod
    def build(cls, step: StepBatch, host: StepTensors, block_size: int, device: torch.device) -> PagedMetadata:
        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        nd = step.num_decodes
        tables = host.block_tables
        prefill_context = [r.num_computed for r in step.prefills]
        return cls(
            slots=to_device(host.slots),
            num_decodes=nd,
            decode_tables=to_device(tables[:nd]),
            decode_lens=to_device(host.context_lens[:nd]),
            decode_max=max((r.context_len for r in step.decodes), default=0),
            cascade=_cascade(step, host, block_size, to_device),
            prefill_blocks=[to_device(tables[nd + j, :-(-ctx // block_size)].long())
                            for j, ctx in enumerate(prefill_context)],
            prefill_new=[r.num_new_tokens for r in step.prefills],
            prefill_context=prefill_context)


def _cascade(step: StepBatch, host: StepTensors, block_size: int, to_device) -> CascadeDecode | None:
    """Group the decodes by the pinned template blocks they share. A group pays off with two or
    more sequences (one read of the template instead of several; read in place when its blocks
    are consecutive, as a template's warmup allocates them); a lone sequence gathers its whole
    context instead, one attention over it costing less than two and a merge."""
    decodes = step.decodes
    chosen = []
    for rows in step.template_groups():
        first = decodes[rows[0]]
        blocks = list(first.block_ids[:first.num_template_blocks])
        consecutive = blocks == list(range(blocks[0], blocks[0] + len(blocks)))
        chosen.append((rows, blocks, blocks[0] if consecutive else None))
    if not chosen:
        return None
    shared = [0] * len(decodes)
    for rows, blocks, _ in chosen:
        for i in rows:
            shared[i] = len(blocks)
    suffix_lens = [r.context_len - n * block_size for r, n in zip(decodes, shared)]
    width = max(len(r.block_ids) - n for r, n in zip(decodes, shared))
    tables = [list(r.block_ids[n:]) + [-1] * (width - len(r.block_ids) + n) for r, n in zip(decodes, shared)]
    return CascadeDecode(
        groups=[PrefixGroup(to_device(torch.tensor(blocks)), to_device(torch.tensor(rows)), first)
                for rows, blocks, first in chosen],
        suffix_block_tables=to_device(torch.tensor(tables, dtype=torch.int32).view(len(decodes), width)),
        suffix_lens=to_device(torch.tensor(suffix_lens, dtype=torch.int32)),
        max_suffix=max(suffix_lens))


class PagedAttention:
    """One step's attention for every layer: `attention(layer, q, k, v, scale)` as the model calls
    it. q: [T, Hq, D]; k, v: [T, Hkv, D] (rows may be strided views of a fused projection)."""

    def __init__(self, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], meta: PagedMetadata) -> None:
        self.kv_layers = kv_layers
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_layers[layer]  # [num_blocks, block_size, Hkv, D]
        meta = self.meta
        # the new K/V in the cache's dtype (no copy where it is the model's), stored, and read so by this
        # step's queries too: a key is the same number from the step's rows as from the cache
        held_k, held_v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        store_kv(held_k, held_v, k_cache, v_cache, meta.slots)
        k, v = held_k.to(q.dtype), held_v.to(q.dtype)
        nd = meta.num_decodes
        if not meta.prefill_new:
            return self._decode(q, k_cache, v_cache, scale)
        prefill = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, scale)
        if not nd:
            return prefill
        return torch.cat([self._decode(q[:nd], k_cache, v_cache, scale), prefill])

    def _decode(self, q, k_cache, v_cache, scale: float) -> torch.Tensor:
        # q: [Nd, Hq, D] -> [Nd, Hq, D]
        meta = self.meta
        if meta.cascade is not None:
            return cascade_decode(q, k_cache, v_cache, meta.cascade, scale)
        out, _ = attend_paged(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, meta.decode_max, scale,
                              meta.cache)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
        # q: [Tp, Hq, D]; k, v: [Tp, Hkv, D]: the new tokens of every prefill chunk
        meta = self.meta
        k_parts, v_parts, start = [], [], 0
        for blocks, q_len, ctx in zip(meta.prefill_blocks, meta.prefill_new, meta.prefill_context):
            if ctx:  # the cached context, gathered from its blocks, in front of the new tokens
                k_parts.append(k_cache.index_select(0, blocks).flatten(0, 1)[:ctx].to(k.dtype))
                v_parts.append(v_cache.index_select(0, blocks).flatten(0, 1)[:ctx].to(v.dtype))
            k_parts.append(k[start:start + q_len])
            v_parts.append(v[start:start + q_len])
            start += q_len
        return attend_contiguous(q, torch.cat(k_parts), torch.cat(v_parts), meta.prefill_new, meta.prefill_context,
                                 scale, meta.masks)


def store_kv(k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
    """Write each row's K/V into its flat cache slot (every new token has one: no -1)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def attend_contiguous(q, k_all, v_all, q_lens: list[int], ctx_lens: list[int], scale: float,
                      masks: CausalMasks) -> torch.Tensor:
    """Per prefill sequence, SDPA of its new queries over its contiguous [context + new] K/V,
    causal aligned bottom-right. q: [Tq, Hq, D]; k_all, v_all: [Tk, Hkv, D], the sequences' keys
    one after another."""
    out = torch.empty_like(q)
    q_start = k_start = 0
    for q_len, ctx in zip(q_lens, ctx_lens):
        k_len = ctx + q_len
        # a leading batch axis: on CPU, SDPA takes its flash kernel only for 4-D inputs (3-D ones
        # fall back to the unfused math path, 2-4x slower on long prompts)
        qi = q[q_start:q_start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        ki = k_all[k_start:k_start + k_len].transpose(0, 1)[None]  # [1, Hkv, k_len, D]
        vi = v_all[k_start:k_start + k_len].transpose(0, 1)[None]
        if ctx == 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=masks(q_len, ctx, q.dtype, q.device),
                                               scale=scale, enable_gqa=True)
        out[q_start:q_start + q_len] = o[0].transpose(0, 1)
        q_start += q_len
        k_start += k_len
    return out
