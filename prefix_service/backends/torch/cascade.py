"""Shared-prefix (cascade) decode attention.

Decoding sequences that continue the same pinned template share its full blocks. Instead of
gathering the prefix KV once per sequence, the queries of the whole group attend to it once, as
one dense matmul (reading the blocks in place when they are consecutive, as a template's warmup
allocates them); each sequence then attends to its own suffix (its copy-on-write tail, user and
generated tokens), and the two partial softmaxes are merged by their log-sum-exp:

    out = (o_prefix * e^lse_prefix + o_suffix * e^lse_suffix) / (e^lse_prefix + e^lse_suffix)

The suffix is never empty: the new token is always written to the sequence's own blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefixGroup:
    block_ids: torch.Tensor  # [nb] int64: the shared full blocks, in order
    rows: torch.Tensor  # [n] int64, ascending: rows of the decode batch that share them
    first_block: int | None = None  # set when block_ids are consecutive: the KV is a slice, no gather


@dataclass
class CascadeDecode:
    groups: list[PrefixGroup]
    suffix_block_tables: torch.Tensor  # [Nd, w] int32: each row's blocks after its shared ones, -1 padded
    suffix_lens: torch.Tensor  # [Nd] int32: context tokens after the shared ones (>= 1)
    max_suffix: int
    cache: dict = field(default_factory=dict, repr=False)  # per-step gather index and mask, shared by all layers


# On CPU, torch's fused flash-attention kernel, which also returns the log-sum-exp the merge needs.
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend(q, k, v, mask, scale: float, causal: bool = False):
    """Softmax attention that also returns its log-sum-exp. q: [B, H, M, D]; k, v: [B, Hkv, L, D] with H a
    multiple of Hkv (grouped query heads: head h reads KV head h // (H / Hkv)); strided views are fine;
    mask: additive, broadcastable to [B, H, M, L], or None; causal: top-left aligned (M == L)
    -> (out [B, H, M, D], lse [B, H, M] float32)."""
    if q.device.type == "cpu" and CPU_FLASH is not None:  # the kernel maps query heads to KV heads itself
        return CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if k.shape[1] != q.shape[1]:
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        s = s + mask
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v), lse


def attend_paged(q, k_cache, v_cache, block_tables, lens, max_len: int, scale: float, cache: dict | None = None):
    """Each row's query over its own blocks. q: [N, Hq, D] -> (out [N, Hq, D], lse [N, Hq] float32).
    The query heads of one KV head are the query rows of one attention (no K/V repeat); rows shorter
    than max_len are masked. `cache` keeps the gather index and mask across layers of a step."""
    n, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    cache = {} if cache is None else cache
    if "idx" not in cache:
        nb = -(-max_len // bs)
        cache["idx"] = block_tables[:, :nb].clamp(min=0).long().flatten()
        cache["mask"] = None
        if n > 1:
            pad = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]  # [N, L]
            cache["mask"] = torch.zeros(n, 1, 1, max_len, dtype=q.dtype, device=q.device).masked_fill_(
                pad[:, None, None, :], float("-inf"))
    idx, mask = cache["idx"], cache["mask"]
    nb = idx.shape[0] // n
    # [N, Hkv, L, D], in q's dtype (a cache of another dtype: cache.kv_cache_dtype)
    k = k_cache.index_select(0, idx).view(n, nb * bs, hkv, d)[:, :max_len].transpose(1, 2).to(q.dtype)
    v = v_cache.index_select(0, idx).view(n, nb * bs, hkv, d)[:, :max_len].transpose(1, 2).to(q.dtype)
    out, lse = attend(q.view(n, hkv, hq // hkv, d), k, v, mask, scale)
    return out.reshape(n, hq, d), lse.reshape(n, hq)


def attend_shared(q, k_cache, v_cache, group: PrefixGroup, scale: float):
    """All rows' queries over one shared run of full blocks, as one attention per KV head whose query
    rows are every sequence's query heads of that KV head. q: [n, Hq, D] -> (out, lse)."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    if group.first_block is not None:  # consecutive blocks: a view of the cache
        end = group.first_block + group.block_ids.shape[0]
        k = k_cache[group.first_block:end].flatten(0, 1)  # [Lp, Hkv, D]
        v = v_cache[group.first_block:end].flatten(0, 1)
    else:
        k = k_cache.index_select(0, group.block_ids).flatten(0, 1)
        v = v_cache.index_select(0, group.block_ids).flatten(0, 1)
    k, v = k.to(q.dtype), v.to(q.dtype)
    qg = q.view(n, hkv, g, d).transpose(0, 1).reshape(1, hkv, n * g, d)
    out, lse = attend(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scale)  # [1, Hkv, n*G, D]
    out = out.reshape(hkv, n, g, d).transpose(0, 1).reshape(n, hq, d)
    return out, lse.reshape(hkv, n, g).transpose(0, 1).reshape(n, hq)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two attentions over disjoint key sets. out: [..., D]; lse: out's shape without D
    (e.g. [n, H, D] and [n, H]). The weight of a is e^lse_a / (e^lse_a + e^lse_b) = sigmoid(lse_a - lse_b)."""
    w = torch.sigmoid(lse_a - lse_b)[..., None]
    return torch.lerp(out_b.float(), out_a.float(), w).to(out_a.dtype)


def cascade_decode(q, k_cache, v_cache, cascade: CascadeDecode, scale: float) -> torch.Tensor:
    # q: [Nd, Hq, D] -> [Nd, Hq, D]
    out, lse = attend_paged(q, k_cache, v_cache, cascade.suffix_block_tables, cascade.suffix_lens,
                            cascade.max_suffix, scale, cascade.cache)
    n = q.shape[0]
    for group in cascade.groups:
        rows = group.rows
        if rows.shape[0] == n:  # every row (rows are ascending and distinct): no gather, no scatter
            o_p, lse_p = attend_shared(q, k_cache, v_cache, group, scale)
            return merge(o_p, lse_p, out, lse)
        o_p, lse_p = attend_shared(q.index_select(0, rows), k_cache, v_cache, group, scale)
        out[rows] = merge(o_p, lse_p, out.index_select(0, rows), lse.index_select(0, rows))
    return out
