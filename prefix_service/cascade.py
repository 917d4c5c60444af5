"""Shared-prefix (cascade) decode attention.

Decoding sequences that continue the same pinned prefix share its full blocks. Instead of
gathering the prefix KV once per sequence, the queries of the whole group attend to it once, as
one dense matmul (reading the blocks in place when they are consecutive, as a template's warmup
allocates them); each sequence then attends to its own suffix (its copy-on-write tail, user and
generated tokens), and the two partial softmaxes are merged by their log-sum-exp:

    out = (o_prefix * e^(lse_prefix - m) + o_suffix * e^(lse_suffix - m)) / (e^(lse_prefix - m) + e^(lse_suffix - m))

The suffix is never empty: the new token is always written to the sequence's own blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixGroup:
    block_ids: torch.Tensor  # [nb] int64: the shared full blocks, in order
    rows: torch.Tensor  # [n] int64: rows of the decode batch that share them
    first_block: int | None = None  # set when block_ids are consecutive: the KV is a slice, no gather


@dataclass
class CascadeDecode:
    groups: list[PrefixGroup]
    suffix_block_tables: torch.Tensor  # [Nd, w] int32: each row's blocks after its shared ones, -1 padded
    suffix_lens: torch.Tensor  # [Nd] int32: context tokens after the shared ones (>= 1)
    max_suffix: int


def attend_paged(q, k_cache, v_cache, block_tables, lens, max_len: int, scale: float):
    """Each row's query over its own blocks. q: [N, Hq, D] -> (out [N, Hq, D], lse [N, Hq] float32).
    One bmm per kv head over strided views of the gathered K/V (no transposing copy)."""
    n, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    nb = -(-max_len // bs)
    idx = block_tables[:, :nb].clamp(min=0).long().flatten()
    k = k_cache.index_select(0, idx).view(n, nb * bs, hkv, d)[:, :max_len]  # [N, L, Hkv, D]
    v = v_cache.index_select(0, idx).view(n, nb * bs, hkv, d)[:, :max_len]
    qg = q.view(n, hkv, g, d)
    pad = (torch.arange(max_len, device=q.device)[None, :] >= lens[:, None])[:, None, :]  # [N, 1, L]
    out = torch.empty(n, hkv, g, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, hkv, g, dtype=torch.float32, device=q.device)
    for h in range(hkv):
        s = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).float() * scale  # [N, G, L]
        s.masked_fill_(pad, float("-inf"))
        lse[:, h] = torch.logsumexp(s, dim=-1)
        out[:, h] = torch.bmm(torch.exp(s - lse[:, h, :, None]).to(v.dtype), v[:, :, h])  # [N, G, D]
    return out.view(n, hq, d), lse.view(n, hq)


def attend_shared(q, k_cache, v_cache, group: PrefixGroup, scale: float):
    """All rows' queries over one shared run of full blocks. q: [n, Hq, D] -> (out, lse)."""
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
    qg = q.view(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)  # [Hkv, n*G, D]
    s = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale  # [Hkv, n*G, Lp]
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, n*G]
    out = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v.transpose(0, 1))  # [Hkv, n*G, D]
    out = out.view(hkv, n, g, d).transpose(0, 1).reshape(n, hq, d)
    return out, lse.view(hkv, n, g).transpose(0, 1).reshape(n, hq)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two attentions over disjoint key sets. out: [n, H, D]; lse: [n, H]."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # [n, H]
    out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / (wa + wb)[..., None]
    return out.to(out_a.dtype)


def cascade_decode(q, k_cache, v_cache, cascade: CascadeDecode, scale: float) -> torch.Tensor:
    # q: [Nd, Hq, D] -> [Nd, Hq, D]
    out, lse = attend_paged(q, k_cache, v_cache, cascade.suffix_block_tables, cascade.suffix_lens,
                            cascade.max_suffix, scale)
    for group in cascade.groups:
        o_p, lse_p = attend_shared(q.index_select(0, group.rows), k_cache, v_cache, group, scale)
        rows = group.rows
        out[rows] = merge(o_p, lse_p, out.index_select(0, rows), lse.index_select(0, rows))
    return out
