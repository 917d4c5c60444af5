"""A decoder layer's element-wise work as one Triton kernel each, instead of torch's handful.

The reference layers (prefix_service/model/llama.py) launch about 25 small kernels a layer outside
the matrix products and attention: RMSNorm as float(), pow, mean, add, rsqrt, mul, to() and the
weight's mul (twice); two residual adds; the rotary embedding as two muls, a negation, a cat and
an add; SiLU and the gate's mul. On a GPU each costs a launch on the host (an
eager step: a prefill, a decode step too large for the graphs) and a few microseconds of the GPU
even under a CUDA graph, which at one sequence is a third of a Llama-8B decode step. Here:

    rms_norm(x, weight, eps, residual=None)  -> (out, residual): with a residual, residual += x
        first (rounded to its dtype, as the model's add), then the norm of the sum; one kernel
    rope_(qk, cos, sin, positions)           rotates every head of qk [T, H, D] in place
    silu_mul(gate_up)                        -> silu(gate) * up, gate_up [T, 2 I]

Each rounds where the reference rounds (in bf16: the norm's normalised row before the weight, each
product of the rotation, SiLU before the mul), so the results differ from the reference only by
the order of the norm's sum. `*_ref` are those references, the oracles of the tests. With
TRITON_INTERPRET=1 the kernels run on CPU tensors, which is how CI tests them.
"""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

MAX_NORM_WIDTH = 16384  # the widest row a norm kernel holds at once (one program a row)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As the model: x = x + residual (a new tensor), then weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype).
    -> (normed, the sum: the next residual; x itself without a residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed, x


def rope_ref(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """qk [T, H, D] rotated (a new tensor), as the model: x * cos + rotate_half(x) * sin, with the
    tables' rows [max_positions, D] (float32) at positions taken in qk's dtype."""
    c, s = cos[positions].to(qk.dtype)[:, None, :], sin[positions].to(qk.dtype)[:, None, :]
    half = qk.shape[-1] // 2
    return qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Launch option of the kernels below: no multiply-add contraction. With it, a bfloat16 product that the
# reference rounds before adding (rope's x * cos + rotate_half(x) * sin) was compiled on a GPU into one
# fused multiply-add of the unrounded product, one bfloat16 ulp off the reference; these kernels are
# bound by memory, so the separate multiply and add cost nothing measurable.
EXACT = dict(enable_fp_fusion=False)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> SimpleNamespace:
    """Define the kernels on first use (TRITON_INTERPRET is read when a kernel is decorated)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # the residual add, rounded as the model's, written back in place
            total = (x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(res_ptr + row * stride_r + offs, total, mask=mask)
            x = total.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * (x * inv).to(dt).to(tl.float32)).to(dt), mask=mask)

    @triton.jit
    def rope_kernel(qk_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, stride_c, heads,
                    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BH)
        offs_d = tl.arange(0, BD)
        mask_d = offs_d < HALF
        mask = (offs_h < heads)[:, None] & mask_d[None, :]
        dt = qk_ptr.dtype.element_ty
        first = qk_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        row = pos * stride_c + offs_d
        c1 = tl.load(cos_ptr + row, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + row + HALF, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + row, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + row + HALF, mask=mask_d, other=0.0).to(dt).to(tl.float32)[None, :]
        # x * cos + rotate_half(x) * sin, each product rounded as the reference's
        out1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(first, out1.to(dt), mask=mask)
        tl.store(first + HALF, out2.to(dt), mask=mask)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        dt = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * stride_o + offs, (s * u).to(dt), mask=mask)

    return SimpleNamespace(rms_norm=rms_norm_kernel, rope=rope_kernel, silu_mul=silu_mul_kernel)


def _k() -> SimpleNamespace:
    return _kernels(os.environ.get("TRITON_INTERPRET") == "1")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's results in one kernel: x [T, n] (rows contiguous); residual [T, n], updated in
    place to residual + x and returned; without one, x is returned as the residual."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res = x if residual is None else residual
    if t:
        _k().rms_norm[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
                            HAS_RES=residual is not None, BLOCK=_next_pow2(n), **EXACT)
    return out, res


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """rope_ref's rotation in place on qk [T, H, D] (heads and tokens may be strided, D contiguous);
    returns qk."""
    t, h, d = qk.shape
    if t:
        _k().rope[(t,)](qk, cos, sin, positions, qk.stride(0), qk.stride(1), cos.stride(0), h,
                        HALF=d // 2, BH=_next_pow2(h), BD=_next_pow2(d // 2), **EXACT)
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref's [T, I] from gate_up [T, 2 I] (rows contiguous), one kernel."""
    t, two = gate_up.shape
    inter = two // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, _next_pow2(inter))
        _k().silu_mul[(t, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
                                                **EXACT)
    return out


def fits(hidden: int, head_dim: int, heads: int) -> bool:
    """Whether a model's rows fit these kernels: a norm's row in one program, an even head size."""
    return hidden <= MAX_NORM_WIDTH and head_dim % 2 == 0 and heads * head_dim // 2 <= MAX_NORM_WIDTH
