"""A decoder layer's element-wise work in the native CPU library (csrc/cpu_elementwise.cpp). The
decoder stack calls the kernels from C++; `add_rms_norm` calls the fused add and norm from Python
(the final norm), and tests call the others through tests/native_harness.py.

torch computes an RMSNorm as six operators (square, mean, add, rsqrt, two products), the rotary
embedding as seven, the gated activation as two, and the residual adds apart: each a pass over
the activations and a parallel region of its own. On a short prefill or a decode step their
fixed costs are most of that work's time; on a long prefill their passes over memory are. Here
each is one pass: the residual add fused into the next norm, the rotation in place on the fused
q/k projection. float32, the same formulas; only the order of the norm's sum of squares
differs from torch's.
"""
from __future__ import annotations

import torch

from prefix_service.backends.cpu import native
from prefix_service.backends.cpu.native import NativeKernelError


def available(dtype: torch.dtype) -> str | None:
    """None when the element-wise kernels can serve a model of `dtype` here, else the reason."""
    return native.unavailable(dtype)


def _call(name: str, *args) -> None:
    """Run the library's `name`, torch's thread count last; a nonzero status is an error (native.check)."""
    native.check(getattr(native.require(), name)(*args, torch.get_num_threads()), name)


def _rows(x: torch.Tensor, name: str, dims: int = 2) -> int:
    """Row stride of a float32 CPU tensor whose trailing dimensions are dense."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != dims:
        raise NativeKernelError(f"{name}: a float32 CPU tensor of {dims} dimensions is needed, got {x.dtype} "
                                f"{tuple(x.shape)} on {x.device}")
    inner = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size > 1 and stride != inner:
            raise NativeKernelError(f"{name}: its rows must be dense (shape {tuple(x.shape)}, "
                                    f"strides {x.stride()})")
        inner *= size
    return x.stride(0)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [T, D]: x += residual (in place, when given); returns x / sqrt(mean(x^2) + eps) * weight, in
    float32 or, out_dtype bfloat16, rounded to bf16 (the rows the decoder stack hands a bf16 linear)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise NativeKernelError(f"out_dtype: float32 or bfloat16 is needed, got {out_dtype}")
    lx = _rows(x, "x")
    t, d = x.shape
    lr = 0
    if residual is not None:
        lr = _rows(residual, "residual")
        if residual.shape != x.shape:
            raise NativeKernelError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != (d,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise NativeKernelError(f"weight: float32 [{d}] is needed, got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(t, d, dtype=out_dtype)
    _call("ps_add_rms_norm", x.data_ptr(), lx, residual.data_ptr() if residual is not None else None, lr,
          weight.data_ptr(), eps, out.data_ptr(), d, t, d, int(out_dtype == torch.bfloat16))
    return out
