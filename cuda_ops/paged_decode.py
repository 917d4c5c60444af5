"""Paged decode attention: one new query token per sequence over its block table.

`paged_decode_attention` is a Triton kernel (flash-decoding): the grid is (sequence, kv head,
split); each program serves the G = Hq / Hkv query heads that share one kv head, walks its
split of the sequence's blocks with an online softmax, and writes a partial (acc, max, sum);
a small torch reduction combines the splits. `paged_decode_attention_ref` (gather + SDPA) is
its oracle. With TRITON_INTERPRET=1 the kernel runs on CPU tensors, which is how CI tests it.

Cascade (`CascadeGroups`): rows that continue the same pinned template share its first P full
blocks. A second kernel reads those blocks once per chunk of up to RC of a group's rows and kv
head (grid: work item = (group, chunk), kv head, template split; the items are listed per step,
so a large group spreads over programs without a groups x chunks grid), multiplying each block
with the chunk's query rows at once (tl.dot over up to 64 query rows: RC rows times their G
heads), and writes its partials into extra split slots of the same buffers; the per-row kernel
then starts each grouped row at its block P. So a template's K/V is read from memory once per
step and chunk of RC rows instead of once per row. The cascade needs blocks of at least 16 tokens
(tl.dot's smallest tile).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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

    # Runtime integers that change with the step (counts, and the row strides of tables whose width
    # is the step's longest row) are not specialized on: Triton otherwise compiles a variant per
    # value class (1, a multiple of 16, other), a stall of a second in the middle of serving
    # whenever a growing context moves a value into a new class (an eager step's block table
    # reaching 64 blocks wide, say).
    @triton.jit(do_not_specialize=["stride_bt", "num_kv", "num_splits"])
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, acc_ptr, m_ptr, l_ptr,
        stride_qn, stride_qh,  # q: [N, Hq, D], last stride 1
        stride_kb, stride_kt, stride_kh,  # caches: [num_blocks, BS, Hkv, D], last stride 1
        stride_bt,  # block_tables: [N, max_blocks]
        first_ptr,  # [N] int32: the first block each row reads (after a cascaded template), or unused
        scale, num_kv, num_splits,
        G: tl.constexpr, GP: tl.constexpr,
        BS: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HAS_FIRST: tl.constexpr,
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
        # each row spreads its own blocks evenly over the splits (a short row next to a long one, or
        # a graph captured for max_model_len, still uses every split)
        last = tl.cdiv(ctx, BS)
        if HAS_FIRST:
            first = tl.load(first_ptr + seq)
        else:
            first = 0
        per = tl.cdiv(last - first, tl.num_programs(2))
        start = first + split * per
        end = tl.minimum(start + per, last)
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

    @triton.jit(do_not_specialize=["stride_bt", "stride_rows", "num_kv", "num_splits", "first_split"])
    def template_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, rows_ptr, sizes_ptr, blocks_ptr, work_ptr, acc_ptr, m_ptr, l_ptr,
        stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_rows,
        scale, num_kv, num_splits, first_split,
        G: tl.constexpr, GP: tl.constexpr, RC: tl.constexpr, TS: tl.constexpr,
        BS: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, F32_DOT: tl.constexpr,
    ):
        # F32_DOT: products in float32 (exact float32 inputs; also how the interpreter, whose dot has
        # no bfloat16, runs every dtype); else the inputs' own dtype, float32 sums
        # one program: work item (group `grp`, its rows from `c0`: RC rows, RC * GP query rows), kv head
        # `kvh`, its share `tsplit` of the template's P blocks; an unused item starts past its group's rows
        grp = tl.load(work_ptr + tl.program_id(0) * 2)
        c0 = tl.load(work_ptr + tl.program_id(0) * 2 + 1)
        kvh = tl.program_id(1)
        tsplit = tl.program_id(2)
        count = tl.load(sizes_ptr + grp)
        num_blocks = tl.load(blocks_ptr + grp)
        per = tl.cdiv(num_blocks, TS)
        b0 = tsplit * per
        b1 = tl.minimum(b0 + per, num_blocks)
        first_row = tl.load(rows_ptr + grp * stride_rows, mask=count > 0, other=0).to(tl.int64)
        offs_m = tl.arange(0, RC * GP)
        r_idx = offs_m // GP
        h_idx = offs_m % GP
        offs_t = tl.arange(0, BT)
        offs_d = tl.arange(0, BD)
        d_mask = offs_d < D
        t_mask = offs_t < BS
        kv_mask = t_mask[:, None] & d_mask[None, :]
        for c in range(c0, tl.minimum(count, c0 + RC), RC):  # once, or not at all
            m_mask = (c + r_idx < count) & (h_idx < G)
            rows = tl.load(rows_ptr + grp * stride_rows + c + r_idx, mask=m_mask, other=0).to(tl.int64)
            q = tl.load(q_ptr + rows[:, None] * stride_qn + (kvh * G + h_idx)[:, None] * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [RC * GP, BD]
            if F32_DOT:
                q = q.to(tl.float32)
            m_i = tl.full([RC * GP], float("-inf"), tl.float32)
            l_i = tl.zeros([RC * GP], tl.float32)
            acc = tl.zeros([RC * GP, BD], tl.float32)
            for b in range(b0, b1):
                block = tl.load(bt_ptr + first_row * stride_bt + b).to(tl.int64)
                off = block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
                k = tl.load(k_ptr + off, mask=kv_mask, other=0.0)  # [BT, BD]
                v = tl.load(v_ptr + off, mask=kv_mask, other=0.0)
                if F32_DOT:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(t_mask[None, :], s * scale, float("-inf"))  # [RC * GP, BT]
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if F32_DOT:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            part = (rows * num_kv + kvh) * num_splits + first_split + tsplit
            tl.store(acc_ptr + (part * GP + h_idx)[:, None] * BD + offs_d[None, :], acc, mask=m_mask[:, None])
            tl.store(m_ptr + part * GP + h_idx, m_i, mask=m_mask)
            tl.store(l_ptr + part * GP + h_idx, l_i, mask=m_mask)

    return paged_decode_kernel, template_decode_kernel


def _num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Enough programs to fill the device, at least 4 blocks per split, at most 32 splits."""
    if device.type != "cuda":
        return min(4, max(1, max_blocks // 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_blocks // 4, 32))


@dataclass(frozen=True)
class CascadeGroups:
    """Decode rows that share a template's first blocks: group i is rows[i, :sizes[i]] (indices into
    the step's decode rows, -1 padded), sharing their first blocks[i] full blocks; first[r] is the
    block row r's own pass starts at (blocks[i] for a grouped row, else 0). splits: programs per
    group and kv head over the template's blocks."""
    first: torch.Tensor  # [N] int32
    rows: torch.Tensor  # [num_groups, max_rows] int32
    sizes: torch.Tensor  # [num_groups] int32
    blocks: torch.Tensor  # [num_groups] int32
    work: torch.Tensor  # [num_items, 2] int32: (group, first row) per chunk of rows_per_chunk rows (work_items)
    splits: int = 8


UNUSED_ITEM = (0, 1 << 30)  # a work item past every group's rows: its programs do nothing


def rows_per_chunk(num_heads: int, num_kv_heads: int) -> int:
    """Rows of a group one template-kernel program serves: 64 query rows (its rows times their
    G = num_heads / num_kv_heads heads, G padded to a power of two) at most."""
    return max(1, 64 // _next_pow2(num_heads // num_kv_heads))


def work_items(sizes: list[int], rows_per_chunk: int) -> list[tuple[int, int]]:
    """(group, first row) of each chunk of each group's rows: a program per item and kv head and
    template split, so a large group spreads over as many programs as it has chunks."""
    return [(g, c) for g, n in enumerate(sizes) for c in range(0, n, rows_per_chunk)]


def cascade_supported(block_size: int) -> bool:
    """The template kernel's tile is a whole block of at least 16 tokens (tl.dot's smallest)."""
    return _next_pow2(block_size) >= 16


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_context: int, scale: float,
                           num_splits: int | None = None, cascade: CascadeGroups | None = None) -> torch.Tensor:
    # q: [N, Hq, D]; k_cache, v_cache: [num_blocks, BS, Hkv, D]; block_tables: [N, max_blocks] int32;
    # context_lens: [N] int32 (the new token included). Returns [N, Hq, D] in q's dtype.
    # cascade: grouped rows read their template's blocks through the template kernel (module doc);
    # max_context then only needs to cover each row's blocks after its first.
    n, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("paged_decode_attention: q rows and the caches must be contiguous in head_dim")
    if cascade is not None and not cascade_supported(bs):
        raise ValueError(f"paged_decode_attention: a cascade needs blocks of at least 16 tokens, these have {bs}")
    g = hq // hkv
    gp, bt, bd = max(_next_pow2(g), 1), _next_pow2(bs), _next_pow2(d)
    max_blocks = -(-max_context // bs)
    splits = num_splits or _num_splits(n, hkv, max_blocks, q.device)
    total = splits + (cascade.splits if cascade is not None else 0)
    acc = torch.empty((n, hkv, total, gp, bd), dtype=torch.float32, device=q.device)
    m = torch.empty((n, hkv, total, gp), dtype=torch.float32, device=q.device)
    l = torch.empty((n, hkv, total, gp), dtype=torch.float32, device=q.device)
    if cascade is not None:  # rows outside every group: empty template partials (weight 0)
        acc[:, :, splits:].zero_()
        m[:, :, splits:].fill_(float("-inf"))
        l[:, :, splits:].zero_()
    block_tables = block_tables.contiguous()
    row_kernel, template_kernel = _kernel(os.environ.get("TRITON_INTERPRET") == "1")
    row_kernel[(n, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, acc, m, l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), cascade.first if cascade is not None else context_lens,
        scale, hkv, total,
        G=g, GP=gp, BS=bs, BT=bt, D=d, BD=bd, HAS_FIRST=cascade is not None)
    if cascade is not None and cascade.work.shape[0]:
        rc = rows_per_chunk(hq, hkv)
        rows = cascade.rows.contiguous()
        work = cascade.work.contiguous()
        template_kernel[(work.shape[0], hkv, cascade.splits)](
            q, k_cache, v_cache, block_tables, rows, cascade.sizes, cascade.blocks, work, acc, m, l,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), rows.stride(0), scale, hkv, total, splits,
            G=g, GP=gp, RC=rc, TS=cascade.splits, BS=bs, BT=bt, D=d, BD=bd,
            F32_DOT=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1")
    # combine the splits: out = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M)
    m_max = m.amax(dim=2, keepdim=True)  # [N, Hkv, 1, GP]
    w = torch.exp(m - m_max)  # empty splits have m = -inf -> weight 0
    out = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]  # [N, Hkv, GP, BD]
    return out[:, :, :g, :d].reshape(n, hq, d).to(q.dtype)
