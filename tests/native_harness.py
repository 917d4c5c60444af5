"""The native CPU library's kernels called one at a time from Python, each with its operands
checked: the tests' way into them. Serving calls most of them only from C++, inside the decoder
stack (prefix_service/backends/cpu/stack.py, csrc/cpu_layer.cpp); from Python it calls only the
fused add and norm (elementwise.add_rms_norm) and the linear layers (linear.py). test_cpu_stack.py
runs a forward kernel by kernel through these to check the stack bit for bit, and the kernel tests
(test_cpu_attention.py, test_cpu_elementwise.py, test_cpu_bf16.py) call them directly.

Refused operands and a kernel's nonzero status raise NativeKernelError (native.check), as the
serving path's wrappers do.
"""
from __future__ import annotations

import ctypes

import torch

from prefix_service.backends.cpu import native, onednn
from prefix_service.backends.cpu.attention import KV_DTYPES, PANEL
from prefix_service.backends.cpu.elementwise import _call, _rows
from prefix_service.backends.cpu.native import NativeKernelError


# --- attention (csrc/cpu_attention.cpp) -----------------------------------------------------------

def _head_rows(x: torch.Tensor, name: str) -> int:
    """Row stride (in elements) of a [N, H, D] float32 CPU tensor whose heads are dense."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3:
        raise NativeKernelError(f"{name}: a float32 CPU tensor [N, H, D] is needed, got {x.dtype} {tuple(x.shape)}"
                                f" on {x.device}")
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise NativeKernelError(f"{name}: its heads must be dense (strides {x.stride()})")
    return x.stride(0)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, d: int) -> int:
    """1 for a bfloat16 cache, 0 for a float32 one; raises for anything else."""
    if (v_cache.shape != k_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != d
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype):
        raise NativeKernelError(f"the cache must be two contiguous float32 or bfloat16 [blocks, block_size, Hkv, {d}] "
                                f"tensors alike, got {k_cache.dtype} {tuple(k_cache.shape)} and {v_cache.dtype} "
                                f"{tuple(v_cache.shape)}")
    return int(k_cache.dtype == torch.bfloat16)


def _check_slots(slots: torch.Tensor, n: int) -> None:
    if slots.dtype != torch.int64 or slots.shape != (n,) or not slots.is_contiguous():
        raise NativeKernelError(f"slots: int64 [{n}] is needed, got {slots.dtype} {tuple(slots.shape)}")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None,
                      template: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                      cache: tuple[torch.Tensor, torch.Tensor] | None = None, block_table: torch.Tensor | None = None,
                      cached: tuple[int, int] = (0, 0), slots: torch.Tensor | None = None,
                      matrix: onednn.OneDnnTemplate | None = None, causal: bool = False) -> torch.Tensor:
    """Attention of one sequence's new tokens.

    q: [M, Hq, D]; template: (K panels, V rows, R) from attention.pack_keys/pack_values, R keys every
    query sees, first; cached = (start, L): then the sequence's cached tokens [start, start + L),
    read from cache = (k_cache, v_cache) [blocks, block_size, Hkv, D] (float32, or bfloat16) through
    block_table (int32 [W]);
    then k, v: [N, Hkv, D], N >= M (the new tokens' own K/V, after any further context); query i
    sees all of those but the last M - i - 1. slots (int64 [N]): k and v are also written into
    these slots of the cache, as a layer stores its new tokens. Rows may be strided (views of a
    fused projection); heads must be dense. matrix: the template packed as onednn.OneDnnTemplate,
    whose matrix-product attention then runs the template's part. Returns out [M, Hq, D]."""
    lib = native.require()
    m, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[2] != d or n < m:
        raise NativeKernelError(f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if out is None:
        out = torch.empty(m, hq, d, dtype=q.dtype)
    qs, ks, vs, os_ = _head_rows(q, "q"), _head_rows(k, "k"), _head_rows(v, "v"), _head_rows(out, "out")
    if template is None:
        kt = vt = None
        r = 0
    else:
        kt, vt, r = template
        if kt.shape != (hkv, -(-r // PANEL), d, PANEL) or vt.shape != (hkv, r, d) or not (
                kt.is_contiguous() and vt.is_contiguous()):
            raise NativeKernelError(f"template layout: K {tuple(kt.shape)}, V {tuple(vt.shape)} for {r} keys")
    start, length = cached
    kc = vc = None
    blocks = bs = width = kv_bf16 = 0
    if cache is not None:
        kc, vc = cache
        kv_bf16 = _check_cache(kc, vc, d)
        blocks, bs = kc.shape[0], kc.shape[1]
        if kc.shape[2] != hkv:
            raise NativeKernelError(f"the cache holds {kc.shape[2]} KV heads, k has {hkv}")
    if length:
        if kc is None or block_table is None:
            raise NativeKernelError("cached tokens need the cache and a block table")
        if block_table.dtype != torch.int32 or block_table.dim() != 1 or block_table.stride(0) != 1:
            raise NativeKernelError(f"block_table: int32 [W] is needed, got {block_table.dtype} "
                                    f"{tuple(block_table.shape)}")
        width = block_table.shape[0]
    if slots is not None:
        if kc is None:
            raise NativeKernelError("storing into slots needs the cache")
        _check_slots(slots, n)
    code = lib.ps_prefill_attention(
        q.data_ptr(), qs, out.data_ptr(), os_, m, hq, hkv, d, scale,
        kt.data_ptr() if kt is not None else None, vt.data_ptr() if vt is not None else None, r,
        k.data_ptr(), ks, v.data_ptr(), vs, n,
        kc.data_ptr() if kc is not None else None, vc.data_ptr() if vc is not None else None, blocks, bs,
        block_table.data_ptr() if length else None, width, start, length,
        slots.data_ptr() if slots is not None else None, None, kv_bf16,
        matrix.handle if matrix is not None else None, onednn.template_attend_fn() if matrix is not None else 0,
        onednn.causal_attend_fn() if causal else 0)
    native.check(code, "ps_prefill_attention", onednn.last_error)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     templates: list[tuple[torch.Tensor, torch.Tensor, int] | None] | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     matrix: list[onednn.OneDnnTemplate | None] | None = None,
                     lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Attention of N decoding sequences' new tokens over their paged cache.

    q: [N, Hq, D] (rows may be strided); k_cache, v_cache: [blocks, block_size, Hkv, D] (float32 or
    bfloat16), the new tokens' K/V already stored, or new_kv = (k, v, slots): k, v [N, Hkv, D] written first into
    the slots (int64 [N]); block_tables: int32 [N, W]; context_lens: int32 [N], the new token
    included; templates: per sequence None or (K panels, V rows, R) of attention.pack_keys/pack_values, R a
    multiple of the block size: its first R / block_size blocks are read from there; matrix: per
    sequence None or the same template packed as onednn.OneDnnTemplate, whose matrix-product attention
    (ps_onednn_template_attend) then runs the template's part; lib: the native library to call (default:
    native.require()'s). Returns out."""
    lib = lib or native.require()
    n, hq, d = q.shape
    kv_bf16 = _check_cache(k_cache, v_cache, d)
    blocks, bs, hkv, _ = k_cache.shape
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != n
            or block_tables.stride(1) != 1 or context_lens.dtype != torch.int32 or context_lens.shape != (n,)
            or not context_lens.is_contiguous()):
        raise NativeKernelError(f"block_tables int32 [{n}, W] and context_lens int32 [{n}] are needed")
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype)
    qs, os_ = _head_rows(q, "q"), _head_rows(out, "out")
    skip = kt_ptrs = vt_ptrs = None
    if templates is not None and any(t is not None for t in templates):
        if len(templates) != n:
            raise NativeKernelError(f"{len(templates)} templates for {n} sequences")
        for t in templates:
            if t is not None and (t[2] % bs or t[0].shape != (hkv, -(-t[2] // PANEL), d, PANEL)
                                  or t[1].shape != (hkv, t[2], d)):
                raise NativeKernelError(f"template layout: K {tuple(t[0].shape)}, V {tuple(t[1].shape)} for {t[2]} "
                                        f"keys in blocks of {bs}")
        skip = torch.tensor([t[2] // bs if t is not None else 0 for t in templates], dtype=torch.int32)
        kt_ptrs = torch.tensor([t[0].data_ptr() if t is not None else 0 for t in templates], dtype=torch.int64)
        vt_ptrs = torch.tensor([t[1].data_ptr() if t is not None else 0 for t in templates], dtype=torch.int64)
    th_ptrs = None
    if matrix is not None:
        if templates is None or len(matrix) != n:
            raise NativeKernelError(f"{len(matrix)} matrix templates for {n} sequences, and templates are needed")
        th_ptrs = torch.tensor([t.handle if t is not None else 0 for t in matrix], dtype=torch.int64)
    kn = vn = slots = None
    if new_kv is not None:
        kn, vn, slots = new_kv
        if kn.shape != (n, hkv, d) or vn.shape != kn.shape:
            raise NativeKernelError(f"new K/V: [{n}, {hkv}, {d}] are needed, got {tuple(kn.shape)} and "
                                    f"{tuple(vn.shape)}")
        _check_slots(slots, n)
    code = lib.ps_decode_attention(
        q.data_ptr(), qs, out.data_ptr(), os_, n, hq, hkv, d, scale, k_cache.data_ptr(), v_cache.data_ptr(), bs,
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        skip.data_ptr() if skip is not None else None, kt_ptrs.data_ptr() if kt_ptrs is not None else None,
        vt_ptrs.data_ptr() if vt_ptrs is not None else None,
        kn.data_ptr() if kn is not None else None, _head_rows(kn, "k") if kn is not None else 0,
        vn.data_ptr() if vn is not None else None, _head_rows(vn, "v") if vn is not None else 0,
        slots.data_ptr() if slots is not None else None, blocks, None, kv_bf16,
        th_ptrs.data_ptr() if th_ptrs is not None else None, onednn.template_attend_fn() if th_ptrs is not None else 0)
    native.check(code, "ps_decode_attention", onednn.last_error)
    return out


# --- element-wise (csrc/cpu_elementwise.cpp) ------------------------------------------------------

def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gate_up [T, 2I] ([gate | up]), float32 or bfloat16 (read as the bf16 rows a bf16 linear hands
    over) -> silu(gate) * up [T, I] in out_dtype (bfloat16: rounded to bf16)."""
    if gate_up.dtype == torch.bfloat16:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            raise NativeKernelError("gate_up: rows of adjacent bf16 values are needed")
        ld = gate_up.stride(0)
    else:
        ld = _rows(gate_up, "gate_up")
    t, two_i = gate_up.shape
    if two_i % 2:
        raise NativeKernelError(f"gate_up: an even width [gate | up] is needed, got {two_i}")
    out = torch.empty(t, two_i // 2, dtype=out_dtype)
    _call("ps_silu_mul", gate_up.data_ptr(), ld, out.data_ptr(), two_i // 2, t, two_i // 2,
          int(gate_up.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16))
    return out


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] (heads dense, rows may be strided): each head normalized in place,
    x / sqrt(mean(x^2) + eps) * weight (weight [D]: Qwen3's q or k norm); returns x."""
    ld = _rows(x, "x", dims=3)
    t, h, d = x.shape
    if weight.shape != (d,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise NativeKernelError(f"weight: float32 [{d}] is needed, got {weight.dtype} {tuple(weight.shape)}")
    _call("ps_head_rms_norm", x.data_ptr(), ld, t, h, d, weight.data_ptr(), eps)
    return x


class Rotation:
    """The rotary embedding of one forward's `positions` (int64 [T]), from cos and sin tables
    [P, D] indexed by position; checked once, then applied to each layer's q and k heads."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if positions.dtype != torch.int64 or positions.dim() != 1 or positions.device.type != "cpu":
            raise NativeKernelError(f"positions: int64 [T] on the CPU is needed, got {positions.dtype} "
                                    f"{tuple(positions.shape)} on {positions.device}")
        for name, table in (("cos", cos), ("sin", sin)):
            if (table.dtype != torch.float32 or table.dim() != 2 or table.shape != cos.shape or table.shape[1] % 2
                    or not table.is_contiguous()):
                raise NativeKernelError(f"{name}: a contiguous float32 [positions, even head size] table like "
                                        f"cos is needed, got {table.dtype} {tuple(table.shape)}")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
            raise NativeKernelError(f"positions out of the tables' range [0, {cos.shape[0]})")
        self.positions = positions.contiguous()
        self.cos, self.sin = cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (heads dense, rows may be strided) in place; returns x."""
        ld = _rows(x, "x", dims=3)
        t, h, d = x.shape
        if t != self.positions.shape[0] or d != self.cos.shape[1]:
            raise NativeKernelError(f"x {tuple(x.shape)} does not match {self.positions.shape[0]} positions of "
                                    f"head size {self.cos.shape[1]}")
        _call("ps_rope", x.data_ptr(), ld, t, h, d, self.positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr())
        return x
