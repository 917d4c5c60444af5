"""Linear layers of the cpu backend, each weight packed once at load: float32 weights in the native
kernel (csrc/cpu_linear.cpp), bfloat16 weights through oneDNN (onednn.py). `make_linear` picks by
the weight's dtype. Either is a `CpuLinear`: callable from Python (the output head, tests,
scripts/bench_cpu_linear.py), and a C entry point with its state (`fn`, `handle`) that the decoder
stack calls from C++ (csrc/cpu_layer.cpp, PsLinear).

oneDNN and MKL are tuned for large products with their operands in cache. Serving is the other
case: a forward reads every layer's weights once, from memory (a model is larger than the
caches), against one row (decode) to a few hundred (a request's own tokens after a template).
There both leave the FLOP units waiting on the weights (docs/benchmarks.md). The
kernel streams each weight panel from memory once per call with the next one prefetched, and
multiplies it against all the call's rows from registers. float32; the sums run in a fixed order
per output, so a row's result does not depend on the other rows of the call or the thread count.
"""
from __future__ import annotations

import ctypes
from typing import Protocol

import torch

from prefix_service.backends.cpu import native, onednn
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.model.quantize import int8_problem

PANEL = 16  # output columns per weight panel: the layout of pack_weight, as the kernel reads it


def available(dtype: torch.dtype) -> str | None:
    """None when linear layers of `dtype` can run here (float32: the native kernel; bfloat16: oneDNN),
    else the reason."""
    reason = native.unavailable(dtype)
    if reason is None and dtype == torch.bfloat16:
        reason = onednn.load()[1]
    return reason


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] -> the kernel's layout [ceil(N/16), K, 16] in dtype (float32, or int8 for int8
    weights): panels of 16 output columns, zero-padded."""
    n, k = weight.shape
    pad = -n % PANEL
    w = weight.detach().to(dtype)
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


def _check_x(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise NativeKernelError(f"x: a float32 CPU tensor [M, K] with dense rows is needed, got {x.dtype} "
                                f"{tuple(x.shape)} strides {x.stride()} on {x.device}")


def _check_weight(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> None:
    if packed.shape != (-(-n // PANEL), k, PANEL) or not packed.is_contiguous():
        raise NativeKernelError(f"packed weight {tuple(packed.shape)} does not hold {n} x {k}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise NativeKernelError(f"bias: float32 [{n}] is needed, got {bias.dtype} {tuple(bias.shape)}")


def _run(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The kernel call, its operands checked by the caller: through the decoder stack's linear path
    (native.call_linear), so a layer called from Python (the output head) is timed with its layers."""
    lib = native.require()
    args = _PackedArgs(packed.data_ptr(), n, x.shape[1], bias.data_ptr() if bias is not None else None)
    call = native.LinearCall(native.address(lib.ps_packed_linear), ctypes.addressof(args))
    native.check(native.call_linear(call, x, out), "ps_linear")
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ W.T + bias, W held as pack_weight(W) -> [M, N] float32."""
    native.require()
    _check_x(x)
    m, k = x.shape
    n = out_features
    _check_weight(packed, n, k, bias)
    return _run(x, packed, n, bias, _output(out, m, n))


def _output(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    """`out` checked as a call's output, float32 [m, n] with dense rows, or a new one."""
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise NativeKernelError(f"out: float32 [{m}, {n}] with dense rows is needed, got {tuple(out.shape)}")
    return out


class CpuLinear(Protocol):
    """A linear layer y = x W^T (+ b) with W packed once: x [M, in] float32 (rows may be strided) ->
    [M, out] float32. `fn` is the address of its C entry point and `handle` that of its state, the
    pair the decoder stack calls: int fn(const void* handle, const float* x, int64_t ldx, int M,
    float* y, int64_t ldy, int threads), 0 on success; `call` holds the two as the stack reads them."""
    in_features: int
    out_features: int
    int8: bool  # whether it reads int8 weights (model.quantization: int8), in some calls or all
    fn: int
    handle: int
    call: native.LinearCall

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


class _PackedArgs(ctypes.Structure):  # csrc/cpu_linear.cpp's PsPackedLinear
    _fields_ = [("panels", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class _PackedInt8Args(ctypes.Structure):  # csrc/cpu_linear.cpp's PsPackedLinearInt8
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class NativeLinear:
    """y = x @ W.T + b in the native float32 kernel, W held only in its layout (pack_weight). int8:
    the weight's (q, scale) where it was quantized (W is q diag(scale)): then only q is held, packed
    the same way, a quarter of the bytes, and every call multiplies it (`packed` is None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        lib = native.require()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        bias_ptr = self.bias.data_ptr() if self.bias is not None else None
        self.int8 = int8 is not None
        self.packed: torch.Tensor | None = None
        self._args: ctypes.Structure
        if int8 is None:
            self.packed = pack_weight(weight)
            _check_weight(self.packed, self.out_features, self.in_features, self.bias)
            self._args = _PackedArgs(self.packed.data_ptr(), self.out_features, self.in_features, bias_ptr)
            self.fn = native.address(lib.ps_packed_linear)
        else:
            if problem := int8_problem(int8, tuple(weight.shape)):
                raise NativeKernelError(problem)
            q, scale = int8
            self.q_packed = pack_weight(q, torch.int8)
            self.scale = scale.detach().contiguous()
            self._args = _PackedInt8Args(self.q_packed.data_ptr(), self.scale.data_ptr(), self.out_features,
                                         self.in_features, bias_ptr)
            self.fn = native.address(lib.ps_packed_linear_int8)
        self.handle = ctypes.addressof(self._args)
        self.call = native.LinearCall(self.fn, self.handle)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; out (2-D x only): where to write, rows may be strided."""
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return linear(x, self.packed, self.out_features, self.bias, out=out)
        _check_x(x)  # int8: through the stack's call, whose handle holds K
        if x.shape[1] != self.in_features:
            raise NativeKernelError(f"x: [M, {self.in_features}] is needed, got {tuple(x.shape)}")
        out = _output(out, x.shape[0], self.out_features)
        native.check(native.call_linear(self.call, x, out), "ps_packed_linear_int8")
        return out


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                int8: tuple[torch.Tensor, torch.Tensor] | None = None) -> CpuLinear:
    """W [out, in] packed for the kernel of its dtype: float32 -> the native kernel, bfloat16 -> oneDNN.
    int8: the weight's (q, scale) where it was quantized (model/quantize.py; W is q diag(scale) in its
    dtype): a bf16 weight's few-row calls then read q (OneDnnLinear), a float32 weight's every call
    (NativeLinear)."""
    if weight.dtype == torch.float32:
        return NativeLinear(weight, bias, int8=int8)
    if weight.dtype == torch.bfloat16:
        return onednn.OneDnnLinear(weight, bias, int8=int8)
    raise NativeKernelError(f"no CPU linear kernel for {weight.dtype} weights (float32 and bfloat16 are served)")
