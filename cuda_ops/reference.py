"""Pure-torch references of the cuda_ops kernels. They run on any device and are the oracle
that the CUDA kernels are tested against (bitwise: these ops only copy)."""
from __future__ import annotations

import torch


def concat_kvcache_with_prefix_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, -1 past each row's blocks
    prefix_lens: torch.Tensor,  # [num_seqs] int32, cached tokens per sequence (may be 0)
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim] new tokens, flattened varlen
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence in k_new
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence i, out rows are `prefix_lens[i]` cached tokens read through
    `block_tables[i]`, then its `cu_seqlens_q[i+1] - cu_seqlens_q[i]` new tokens.

    Returns (k_out, v_out, cu_seqlens_k): k_out/v_out `[total_k, num_kv_heads, head_dim]`,
    cu_seqlens_k `[num_seqs + 1]` int32 with total_k = sum(prefix_lens) + total_q.
    """
    block_size = k_cache.shape[1]
    num_seqs = prefix_lens.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    k_lens = q_lens + prefix_lens.to(torch.int64)
    cu_seqlens_k = torch.zeros(num_seqs + 1, dtype=torch.int32, device=k_new.device)
    cu_seqlens_k[1:] = torch.cumsum(k_lens, 0).to(torch.int32)
    k_parts, v_parts = [], []
    prefix_list = prefix_lens.tolist()
    cu_q = cu_seqlens_q.tolist()
    for i in range(num_seqs):
        p = prefix_list[i]
        if p > 0:
            n_blocks = (p + block_size - 1) // block_size
            blocks = block_tables[i, :n_blocks].to(torch.int64)
            # [n_blocks * block_size, H, D] -> first p rows
            k_parts.append(k_cache.index_select(0, blocks).flatten(0, 1)[:p])
            v_parts.append(v_cache.index_select(0, blocks).flatten(0, 1)[:p])
        k_parts.append(k_new[cu_q[i] : cu_q[i + 1]])
        v_parts.append(v_new[cu_q[i] : cu_q[i + 1]])
    if not k_parts:
        empty = k_new.new_empty((0,) + tuple(k_new.shape[1:]))
        return empty, empty.clone(), cu_seqlens_k
    return torch.cat(k_parts), torch.cat(v_parts), cu_seqlens_k


def store_kvcache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64/int32 flat slot, -1 = skip
) -> None:
    """k_cache.view(-1, H, D)[slot] = k[token] for every token whose slot is not -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def copy_blocks_ref(
    k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor],
    src_dst: torch.Tensor,  # [num_pairs, 2] int64: copy block src -> block dst in every layer
) -> None:
    """Copy whole blocks, all layers: the copy-on-write of a partial prefix tail block."""
    if src_dst.numel() == 0:
        return
    src = src_dst[:, 0].to(torch.int64)
    dst = src_dst[:, 1].to(torch.int64)
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
