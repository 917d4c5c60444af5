"""Paged decode attention: one new query token per sequence over its block table.

`paged_decode_attention` is a Triton kernel (flash-decoding): the grid is (sequence, kv head,
split); each program serves the G = Hq / Hkv query heads that share one kv head, walks its
split of the sequence's blocks with an online softmax, and writes a partial (acc, max, sum);
a small torch reduction combines the splits. `paged_decode_attention_ref` (gather + SDPA) is
its oracle. With TRITON_INTERPRET=1 the kernel runs on CPU tensors, which is how CI tests it.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, max_context: int,
                               scale: float) -> torch.Tensor:
    # q: [N, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [N, max_blocks] (-1 padded)
    block_size = k_cache.shape[1]
    num_blocks = -(-max_context // block_size)
    tables = block_tables[:, :num_blocks].clamp(min=0).long()
    k = k_cache[tables].flatten(1, 2)[:, :max_context]  # [N, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_context]
    mask = torch.arange(max_context, device=q.device)[None, :] < context_lens[:, None]  # [N, L]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return o.squeeze(2)  # [N, Hq, D]


def triton_available() -> bool:
    """Without importing it: TRITON_INTERPRET must be set before triton's first import to count."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Define the kernel on first use (TRITON_INTERPRET is read when a kernel is decorated)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, acc_ptr, m_ptr, l_ptr,
        stride_qn, stride_qh,  # q: [N, Hq, D], last stride 1
        stride_kb, stride_kt, stride_kh,  # caches: [num_blocks, BS, Hkv, D], last stride 1
        stride_bt,  # block_tables: [N, max_blocks]
        scale, blocks_per_split, num_kv, num_splits,
        G: tl.constexpr, GP: tl.constexpr,
        BS: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        offs_g = tl.arange(0, GP)
        offs_t = tl.arange(0, BT)
        offs_d = tl.arange(0, BD)
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [GP, BD]
        ctx = tl.load(ctx_ptr + seq)
        start = split * blocks_per_split
        end = tl.minimum(start + blocks_per_split, tl.cdiv(ctx, BS))
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BD], tl.float32)
        for b in range(start, end):
            block = tl.load(bt_ptr + seq * stride_bt + b).to(tl.int64)
            t_mask = (offs_t < BS) & (b * BS + offs_t < ctx)
            off = block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)  # [BT, BD]
            v = tl.load(v_ptr + off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BT]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [GP, BT]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        part = (seq * num_kv + kvh) * num_splits + split
        tl.store(acc_ptr + (part * GP + offs_g[:, None]) * BD + offs_d[None, :], acc)
        tl.store(m_ptr + part * GP + offs_g, m_i)
        tl.store(l_ptr + part * GP + offs_g, l_i)

    return paged_decode_kernel


def _num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Enough programs to fill the device, at least 4 blocks per split, at most 32 splits."""
    if device.type != "cuda":
        return min(4, max(1, max_blocks // 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_blocks // 4, 32))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_context: int, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    # q: [N, Hq, D]; k_cache, v_cache: [num_blocks, BS, Hkv, D]; block_tables: [N, max_blocks] int32;
    # context_lens: [N] int32 (the new token included). Returns [N, Hq, D] in q's dtype.
    n, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("paged_decode_attention: q rows and the caches must be contiguous in head_dim")
    g = hq // hkv
    gp, bt, bd = max(_next_pow2(g), 1), _next_pow2(bs), _next_pow2(d)
    max_blocks = -(-max_context // bs)
    splits = num_splits or _num_splits(n, hkv, max_blocks, q.device)
    per_split = -(-max_blocks // splits)
    acc = torch.empty((n, hkv, splits, gp, bd), dtype=torch.float32, device=q.device)
    m = torch.empty((n, hkv, splits, gp), dtype=torch.float32, device=q.device)
    l = torch.empty((n, hkv, splits, gp), dtype=torch.float32, device=q.device)
    block_tables = block_tables.contiguous()
    kernel = _kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(n, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), scale, per_split, hkv, splits,
        G=g, GP=gp, BS=bs, BT=bt, D=d, BD=bd)
    # combine the splits: out = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M)
    m_max = m.amax(dim=2, keepdim=True)  # [N, Hkv, 1, GP]
    w = torch.exp(m - m_max)  # empty splits have m = -inf -> weight 0
    out = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]  # [N, Hkv, GP, BD]
    return out[:, :, :g, :d].reshape(n, hq, d).to(q.dtype)
