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
A float32 weight whose every value is a bf16 one (a bf16 checkpoint served in float32, as
`model.dtype: auto` serves one on a CPU without bf16 units) is held in bf16 instead and widened
exactly in registers: the same bits from half the bytes, which is what a decode step's few rows wait
on (`PREFIX_SERVICE_F32_PANELS=float32` keeps float32 panels; `float32_panels()`).

Past a hundred rows or so (a long prompt's prefill, a template being pinned) oneDNN's own float32
inner product, which blocks the product for the caches, can be the faster one: on a Zen 3 (AVX2) it
ran the model's linears 6% faster at 128 rows and 12-18% faster from 256, while the kernel here led
by 1.3-1.7x up to 64 rows (docs/benchmarks.md). So where the kernel is built for AVX2 a float32
weight is held by both (`SplitLinear`, its bytes twice) and a call of more than 128 rows runs oneDNN's
(`float32_kernel()`, `float32_native_rows()`); elsewhere (AVX-512: even at 1,000 rows on an Intel
Xeon) the kernel here alone. `PREFIX_SERVICE_F32_LINEAR=measure` times the crossover on the machine
instead, when the decoder stack is built (tuning.measure_float32_linears). A row's bits then depend
on which side of the crossover its call falls (the two sum in different orders, within float32's
summation error of each other).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Protocol

import torch

from prefix_service import envs
from prefix_service.backends.cpu import native, onednn
from prefix_service.backends.cpu.native import NativeKernelError, NativeSettingError
from prefix_service.model.quantize import int8_problem

log = logging.getLogger("prefix_service.engine")

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


def bf16_valued(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 weight is a bf16 one (the low 16 bits of each zero: a bf16
    checkpoint served in float32): held in bf16 it loses nothing."""
    if weight.dtype != torch.float32:
        return False
    return not bool(weight.detach().contiguous().view(torch.int32).bitwise_and(0xFFFF).any())


def pack_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight of bf16 values (bf16_valued) -> its panels in bf16 with each two rows k, k + 1
    side by side per column, [ceil(N/16), ceil(K/2), 16, 2] (a zero row past an odd K): one 64-byte
    line of the kernel's holds a panel's two rows."""
    p = pack_weight(weight)
    if p.shape[1] % 2:
        p = torch.cat([p, p.new_zeros(p.shape[0], 1, PANEL)], dim=1)
    return p.view(p.shape[0], -1, 2, PANEL).transpose(2, 3).to(torch.bfloat16).contiguous()


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


def _through_call(m: CpuLinear, x: torch.Tensor, out: torch.Tensor | None, who: str) -> torch.Tensor:
    """x [M, in] (rows may be strided) through m's C entry point, as the decoder stack calls it, into
    `out` or a new [M, out]; `who` names the entry point in an error (with the oneDNN library's own
    reason where it failed there)."""
    _check_x(x)
    if x.shape[1] != m.in_features:
        raise NativeKernelError(f"x: [M, {m.in_features}] is needed, got {tuple(x.shape)}")
    out = _output(out, x.shape[0], m.out_features)
    native.check(native.call_linear(m.call, x, out), who, onednn.last_error)
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
    """y = x @ W.T + b in the native float32 kernel, W held only in its layout (pack_weight). Where
    every value of W is a bf16 one and `panels` (default: float32_panels()) is "auto", W is held in
    bf16 instead (pack_weight_bf16, `bf16_panels`), half the bytes, and the kernel widens it exactly:
    the same bits. int8: the weight's (q, scale) where it was quantized (W is q diag(scale)): then only
    q is held, packed the same way, a quarter of the bytes. Either way every call reads what is held
    (`packed`, the float32 panels, is None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None, panels: str | None = None) -> None:
        lib = native.require()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        bias_ptr = self.bias.data_ptr() if self.bias is not None else None
        self.int8 = int8 is not None
        self.packed: torch.Tensor | None = None
        self.bf16_panels = False
        self._args: ctypes.Structure
        if int8 is None:
            self.bf16_panels = held_in_bf16(weight, panels)
            self._entry = "ps_packed_linear_bf16w" if self.bf16_panels else "ps_packed_linear"
            self.held = pack_weight_bf16(weight) if self.bf16_panels else pack_weight(weight)
            if not self.bf16_panels:
                self.packed = self.held
                _check_weight(self.packed, self.out_features, self.in_features, self.bias)
            self._args = _PackedArgs(self.held.data_ptr(), self.out_features, self.in_features, bias_ptr)
        else:
            if problem := int8_problem(int8, tuple(weight.shape)):
                raise NativeKernelError(problem)
            q, scale = int8
            self.held = pack_weight(q, torch.int8)
            self.scale = scale.detach().contiguous()
            self._args = _PackedInt8Args(self.held.data_ptr(), self.scale.data_ptr(), self.out_features,
                                         self.in_features, bias_ptr)
            self._entry = "ps_packed_linear_int8"
        self.fn = native.address(getattr(lib, self._entry))
        self.handle = ctypes.addressof(self._args)
        self.call = native.LinearCall(self.fn, self.handle)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; out (2-D x only): where to write, rows may be strided."""
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return linear(x, self.packed, self.out_features, self.bias, out=out)
        return _through_call(self, x, out, self._entry)  # bf16 panels or int8: the handle holds K

    @property
    def weight_bytes(self) -> int:
        """The bytes of weight each call reads (its panels)."""
        return self.held.numel() * self.held.element_size()


class _SplitArgs(ctypes.Structure):  # csrc/cpu_layer.cpp's PsSplitLinear
    _fields_ = [("few", native.LinearCall), ("many", native.LinearCall), ("rows", ctypes.c_int64)]


class SplitLinear:
    """A float32 weight held by both kernels: calls of up to `native_rows` rows run the native kernel
    (`few`, NativeLinear), calls of more oneDNN's float32 inner product (`many`, onednn.OneDnnLinear);
    the weight's bytes twice."""
    int8 = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, native_rows: int) -> None:
        if weight.dtype != torch.float32:
            raise NativeKernelError(f"a split linear takes a float32 weight, got {weight.dtype}")
        if native_rows < 1:
            raise NativeKernelError(f"native_rows: 1 or more is needed (0: oneDNN alone), got {native_rows}")
        lib = native.require()
        self.out_features, self.in_features = weight.shape
        self.native_rows = native_rows
        self.few = NativeLinear(weight, bias)
        self.many = onednn.OneDnnLinear(weight, bias)
        self._args = _SplitArgs(self.few.call, self.many.call, native_rows)
        self.fn = native.address(lib.ps_split_linear)
        self.handle = ctypes.addressof(self._args)
        self.call = native.LinearCall(self.fn, self.handle)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; out (2-D x only): where to write, rows may be strided."""
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return _through_call(self, x, out, "ps_split_linear")

    def __repr__(self) -> str:
        return (f"SplitLinear(in_features={self.in_features}, out_features={self.out_features}, native up to "
                f"{self.native_rows} rows, oneDNN's float32 inner product above)")


# --- float32 weights: the native kernel, oneDNN's inner product, or both split by row count -------

FLOAT32_ENV = "PREFIX_SERVICE_F32_LINEAR"
# what FLOAT32_ENV takes: the native kernel alone; oneDNN's inner product above FLOAT32_ROWS_ENV rows (the
# native kernel up to them); or the crossover timed when the decoder stack is built
# (tuning.measure_float32_linears)
FLOAT32_KERNELS = envs.BY_NAME[FLOAT32_ENV].choices
FLOAT32_ROWS_ENV = "PREFIX_SERVICE_F32_NATIVE_ROWS"
# with the inner product: the most rows a call runs on the native kernel by default. On a Zen 3 (AVX2)
# the native kernel ran the model's linears 1.3x as fast at 64 rows, oneDNN's 1.07x at 128 and
# 1.14-1.22x from 256 (docs/benchmarks.md); 128 keeps a decode step's calls and a template's usual
# user segment (100 tokens and the step's decodes) on the native kernel.
DEFAULT_NATIVE_ROWS = 128


F32_PANELS_ENV = "PREFIX_SERVICE_F32_PANELS"
# what F32_PANELS_ENV takes: the native kernel's float32 weights held in bf16 where every value of the
# weight is a bf16 one (the same products, half the bytes to stream), or in float32 whatever they hold
F32_PANELS = envs.BY_NAME[F32_PANELS_ENV].choices


def float32_panels() -> str:
    """How the native kernel holds a float32 weight: $PREFIX_SERVICE_F32_PANELS where set (one of
    F32_PANELS: "float32" to compare the two on one machine), else "auto" (bf16 where lossless)."""
    return envs.choice(F32_PANELS_ENV, NativeSettingError) or "auto"


def held_in_bf16(weight: torch.Tensor, panels: str | None = None) -> bool:
    """Whether a float32 weight (or table) is held in bf16: every value of it a bf16 one (bf16_valued)
    and `panels` (default: float32_panels()) "auto"."""
    return (panels or float32_panels()) == "auto" and bf16_valued(weight)


def float32_kernel() -> str:
    """How a float32 model's layers multiply here: $PREFIX_SERVICE_F32_LINEAR where set (one of
    FLOAT32_KERNELS: to compare them on one machine, or to time them), else "inner_product" (above
    float32_native_rows() rows) where the native kernel is built for AVX2 and the oneDNN library
    loads, else "native"."""
    chosen = envs.choice(FLOAT32_ENV, NativeSettingError)
    if chosen is not None:
        if chosen != "native" and (reason := onednn.load()[1]) is not None:
            raise NativeSettingError(f"{FLOAT32_ENV}={chosen}: no oneDNN library here: {reason}")
        return chosen
    return "inner_product" if native.isa() == "avx2" and _library_loads() else "native"


@functools.lru_cache(maxsize=None)
def _library_loads() -> bool:
    reason = onednn.load()[1]
    if reason is not None:
        log.info("float32 linears on the native kernel alone: no oneDNN library here (%s)", reason)
    return reason is None


def float32_native_rows() -> int:
    """With the inner product: the most rows a call runs on the native kernel instead,
    $PREFIX_SERVICE_F32_NATIVE_ROWS where set (0: oneDNN for every call), else DEFAULT_NATIVE_ROWS."""
    return envs.count(FLOAT32_ROWS_ENV, DEFAULT_NATIVE_ROWS, NativeSettingError)


def float32_choice(native_rows: int | None) -> str:
    """What a float32 weight made with this `native_rows` (make_linear) runs, in words."""
    if native_rows is None:
        return "the native kernel"
    if native_rows == 0:
        return "oneDNN's inner product"
    return f"the native kernel up to {native_rows} rows, oneDNN's inner product above"


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                int8: tuple[torch.Tensor, torch.Tensor] | None = None, native_rows: int | None = None,
                invariant: bool = False) -> CpuLinear:
    """W [out, in] packed for the kernel of its dtype: float32 -> the native kernel (native_rows None),
    oneDNN's float32 inner product (0), or both, calls of up to native_rows rows on the native kernel
    (SplitLinear); bfloat16 -> oneDNN (onednn.default_kernel()). int8: the weight's (q, scale) where it
    was quantized (model/quantize.py; W is q diag(scale) in its dtype): a bf16 weight's few-row calls
    then read q (OneDnnLinear), a float32 weight's every call (NativeLinear, whatever native_rows says).
    invariant: one kernel for every call size, so that an output row does not depend on the call's
    other rows (model.batch_invariant): float32 -> the native kernel, whatever native_rows says;
    bfloat16 -> onednn.invariant_kernel()'s."""
    if weight.dtype == torch.float32:
        if int8 is not None or native_rows is None or invariant:
            return NativeLinear(weight, bias, int8=int8)
        if native_rows == 0:
            return onednn.OneDnnLinear(weight, bias)
        return SplitLinear(weight, bias, native_rows)
    if weight.dtype == torch.bfloat16:
        return onednn.OneDnnLinear(weight, bias, int8=int8, invariant=invariant)
    raise NativeKernelError(f"no CPU linear kernel for {weight.dtype} weights (float32 and bfloat16 are served)")
