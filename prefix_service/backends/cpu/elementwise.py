"""A decoder layer's element-wise work in the native CPU library (csrc/cpu_elementwise.cpp). The
decoder stack calls the kernels from C++; the functions here call them from Python (the final
norm, tests).

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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D]: x += residual (in place, when given); returns x / sqrt(mean(x^2) + eps) * weight."""
    lx = _rows(x, "x")
    t, d = x.shape
    lr = 0
    if residual is not None:
        lr = _rows(residual, "residual")
        if residual.shape != x.shape:
            raise NativeKernelError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != (d,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise NativeKernelError(f"weight: float32 [{d}] is needed, got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(t, d, dtype=torch.float32)
    _call("ps_add_rms_norm", x.data_ptr(), lx, residual.data_ptr() if residual is not None else None, lr,
          weight.data_ptr(), eps, out.data_ptr(), d, t, d)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] ([gate | up]) -> silu(gate) * up [T, I]."""
    ld = _rows(gate_up, "gate_up")
    t, two_i = gate_up.shape
    if two_i % 2:
        raise NativeKernelError(f"gate_up: an even width [gate | up] is needed, got {two_i}")
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    _call("ps_silu_mul", gate_up.data_ptr(), ld, out.data_ptr(), two_i // 2, t, two_i // 2)
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
