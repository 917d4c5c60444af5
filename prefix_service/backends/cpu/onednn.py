"""Linear layers through oneDNN (csrc/onednn_linear.cpp), each weight prepacked once at load, behind
plain C functions the native decoder stack calls through a function pointer.

oneDNN is the GEMM library inside torch; it picks AMX, AVX512-BF16, AVX-512 or AVX2 for the machine,
and it is how the cpu backend multiplies bfloat16 weights. torch does not export oneDNN's symbols,
but it exports ATen, which reaches oneDNN two ways: the operators mkldnn::_reorder_linear_weight and
mkldnn::_linear_pointwise (the inner product), and at::native::cpublas::brgemm and pack (oneDNN's
batch-reduce GEMM micro-kernel, AMX tiles). So a second, small library, built against torch's
headers and linked to its libraries (the native library, native.py, is plain C++ and links
neither), calls them and exports C functions: ps_onednn_pack (a handle), ps_onednn_linear (y = x W^T
+ b, x and y float32, rows strided), ps_onednn_linear_bf16 (the same with x and y as bf16 rows where
the caller asks: the decoder stack's hand-offs), ps_onednn_free, ps_onednn_brgemm_vnni, ps_onednn_threads_used
and ps_onednn_last_error. It is built on first use into native.cache_dir(), keyed by its source, the
torch build and the compiler (with OpenMP, so its own parallel loops run on torch's threads), in
15-25 seconds.

A float32 weight is packed and multiplied in float32. A bfloat16 weight runs one of three kernels
(`KERNELS`; `default_kernel()` picks for the machine, and on AMX times brgemm against the inner
product per shape, "measure": brgemm, the inner product, or brgemm for calls of up to a row count
beside the inner product, `brgemm_rows`):
  inner_product  where torch's oneDNN supports bf16 here (`bf16_native()`: AVX-512 BW/VL/DQ or
                 AVX-NE-CONVERT) and the CPU has no AMX: the weight is packed in bf16; each call
                 rounds x to bf16, runs the bf16 inner product (float32 sums, bf16 output) and
                 widens the output into y. Where the CPU has
                 AVX512-BF16 the weight is also packed for the few-row kernel (`few_rows_default()`),
                 which takes the calls of up to 128 rows, or every call on a Zen 4 (the inner
                 product's copy is then not made; with int8 weights, model.quantization, it reads
                 int8 blocks: `OneDnnLinear(int8=...)`, ps_onednn_pack's q);
  brgemm         where timing on AMX (`brgemm_vnni()`) picks it, elsewhere by choice
                 ($PREFIX_SERVICE_BF16_LINEAR=brgemm): the weight in blocks of 32 output columns
                 (`brgemm_columns()`), each packed once; each call rounds x to bf16 and runs
                 oneDNN's micro-kernel per (block, 32 rows), the kernels generated once per
                 shape, on VNNI-packed blocks where it takes them (`brgemm_vnni()`: AMX),
                 elsewhere through torch's fallback GEMM: correct, not fast;
  emulated       elsewhere (AVX2 machines): the weight is widened exactly to float32 and packed as a
                 float32 weight; each call rounds x through bf16, runs the float32 inner product and
                 rounds the output through bf16.
All three multiply bf16 operands (their products are exact in float32), sum in float32 and round
the output to bf16, so they agree up to the order of the sums. In all, the bias is rounded to bf16
(as torch's bf16 F.linear holds it) and added to the float32 sums before the output is rounded.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import platform
import statistics
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prefix_service import cpuinfo, envs
from prefix_service.backends.cpu import native
from prefix_service.errors import ConfigError
from prefix_service.model.quantize import int8_problem

log = logging.getLogger("prefix_service.engine")

SOURCES = (native.CSRC / "onednn_linear.cpp", native.CSRC / "onednn_attention.cpp")
# the sources' includes: part of the build's key
HEADERS = (native.CSRC / "simd.h", native.CSRC / "onednn_error.h", native.CSRC / "onednn_scratch.h",
           native.CSRC / "onednn_bf16.h")
# -fopenmp: at::parallel_for is a header that splits work over torch's OpenMP threads only where the
# including code is compiled with OpenMP; without it the brgemm kernel ran on one thread.
# -march=native: the brgemm kernel's own loops (rounding x to bf16, the bias and bf16 rounding of
# its output) vectorize for this CPU (the build is keyed by it): the output pass of 64 x 3072 took
# 138 us on one core built for baseline x86-64 and 57 us built for the CPU (AVX2)
FLAGS = ("-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20")

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
# name: (argument types, return type) of each function the library exports
SIGNATURES = {
    "ps_onednn_pack": ([_ptr, _i32, _i64, _i64, _ptr, _i32, _i32, _i32, _ptr, _ptr, _i32], _ptr),
    "ps_onednn_few_rows": ([_ptr], _i32),
    "ps_onednn_few_rows_built": ([], _i32),
    "ps_onednn_brgemm_rows": ([_ptr], _i32),
    "ps_onednn_brgemm_calls": ([], _i64),
    "ps_onednn_int8": ([_ptr], _i32),
    "ps_onednn_linear": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_onednn_linear_bf16": ([_ptr, _ptr, _i32, _i64, _i32, _ptr, _i32, _i64, _i32], _i32),
    "ps_onednn_free": ([_ptr], None),
    "ps_onednn_last_error": ([], ctypes.c_char_p),
    "ps_onednn_brgemm_vnni": ([], _i32),
    "ps_onednn_threads_used": ([_i64], _i32),
    "ps_onednn_template_pack": ([_ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32], _ptr),
    "ps_onednn_template_kernel_rule": ([_i64, _i32, _i32], _i32),
    "ps_onednn_template_attend": ([_ptr, _i32, _ptr, _i64, _i32, _ptr, _i64, _ptr, _ptr], _i32),
    "ps_onednn_template_bytes": ([_ptr], _i64),
    "ps_onednn_template_free": ([_ptr], None),
    "ps_onednn_template_calls": ([], _i64),
    "ps_onednn_template_kernel": ([_i64, _i32], _i32),
    "ps_onednn_template_packed_kernel": ([_ptr], _i32),
    "ps_onednn_template_key_rows": ([_ptr], _i32),
    "ps_onednn_causal_attend": ([_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, ctypes.c_float, _ptr, _i64, _ptr,
                                 _i64], _i32),  # called by native code (causal_attend_fn)
    "ps_onednn_causal_calls": ([], _i64),
}
# a bf16 weight's kernels, as ps_onednn_pack numbers them
KERNELS = {"inner_product": 0, "emulated": 1, "brgemm": 2}


class OneDnnBuildError(RuntimeError):
    pass


class OneDnnError(RuntimeError):
    pass


class OneDnnSettingError(ConfigError, OneDnnError):
    """A PREFIX_SERVICE_BF16_* environment variable holds a value it does not take, or asks for what this
    machine lacks: a config error (the CLI reports it in a line, as a config file's), and a OneDnnError."""


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for this torch: its ABI and headers, its libraries."""
    root = Path(torch.__file__).parent
    inc, lib = root / "include", root / "lib"
    return ([f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{inc}",
             f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}"],
            [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"])


def build(cxx: str) -> Path:
    """SOURCES compiled against this torch (native.compile_library); its key also covers the
    torch build (version, ABI, location) and the sources' headers."""
    cflags, ldflags = _torch_flags()
    return native.compile_library(cxx, "prefix_service_onednn", SOURCES, (*FLAGS, *cflags), tuple(ldflags),
                                  (torch.__version__.encode(), *(h.read_bytes() for h in HEADERS)), OneDnnBuildError)


@functools.lru_cache(maxsize=None)
def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) where it builds and runs a float32 product, else (None, the reason)."""
    if platform.system() != "Linux":
        return None, f"the oneDNN linear library is built for Linux, not {platform.system()}"
    if not torch.backends.mkldnn.is_available():
        return None, "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    cxx = native.compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        lib = ctypes.CDLL(str(build(cxx)))
    except (OneDnnBuildError, OSError) as exc:
        return None, str(exc)
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    # a 1 x 1 pack finds both operators: a torch without them says so here, once
    one = ctypes.c_float(1.0)
    handle = lib.ps_onednn_pack(ctypes.byref(one), 0, 1, 1, None, 0, 0, 0, None, None, 0)
    if not handle:
        return None, lib.ps_onednn_last_error().decode(errors="replace")
    lib.ps_onednn_free(handle)
    return lib, None


def last_error() -> str:
    """What the library's last failing call on this thread said ("" when nothing failed)."""
    lib = load()[0]
    return lib.ps_onednn_last_error().decode(errors="replace") if lib is not None else ""


@functools.lru_cache(maxsize=None)
def bf16_native() -> bool:
    """Whether torch's oneDNN multiplies bf16 here; elsewhere bf16 weights run emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # no such operator in this torch: emulate, which is always right
        return False


@functools.lru_cache(maxsize=None)
def brgemm_vnni() -> bool:
    """Whether oneDNN's brgemm micro-kernel multiplies VNNI-packed bf16 here (AMX)."""
    lib = load()[0]
    return lib is not None and bool(lib.ps_onednn_brgemm_vnni())


def brgemm_calls() -> int:
    """How many linear calls have run on brgemm in this process: 0 without the library."""
    lib = load()[0]
    return 0 if lib is None else int(lib.ps_onednn_brgemm_calls())


def threads_used(items: int) -> int:
    """On how many of torch's threads the library splits `items` work items (the brgemm kernel's
    split of a call): torch.get_num_threads() when there are enough items; 0 without the library."""
    lib = load()[0]
    return 0 if lib is None else int(lib.ps_onednn_threads_used(items))


KERNEL_ENV = "PREFIX_SERVICE_BF16_LINEAR"
# what KERNEL_ENV takes: a kernel, or "measure" (each weight shape's calls timed on brgemm and the
# inner product, then brgemm, the inner product, or brgemm up to a row count and the inner product
# above: time_linear)
KERNEL_CHOICES = envs.BY_NAME[KERNEL_ENV].choices
BRGEMM_ROWS_ENV = "PREFIX_SERVICE_BF16_BRGEMM_ROWS"
COLUMNS_ENV = "PREFIX_SERVICE_BF16_BRGEMM_COLUMNS"
DEFAULT_BRGEMM_COLUMNS = 32
FEW_ROWS_ENV = "PREFIX_SERVICE_BF16_FEW_ROWS"
FEW_ROWS_EVERY_CALL = 2 ** 31 - 1  # OneDnnLinear.few_rows where every call runs the few-row kernel
# how a bf16 inner-product weight takes the few-row kernel, as ps_onednn_pack numbers it: not at all,
# for calls of up to 128 rows (beside oneDNN's inner product, which takes the rest), or for every call
FEW_ROWS_NONE, FEW_ROWS_SOME, FEW_ROWS_ALL = 0, 1, 2
FEW_ROWS_MODES = {"0": FEW_ROWS_NONE, "1": FEW_ROWS_SOME, "all": FEW_ROWS_ALL}  # by FEW_ROWS_ENV's value


def few_rows_default() -> int:
    """How a bf16 inner-product weight takes the few-row kernel (AVX512-BF16 dot products) by default
    (FEW_ROWS_MODES): $PREFIX_SERVICE_BF16_FEW_ROWS where set (1, 0 or all), else for every call where
    the dot products lead oneDNN's inner product at every call size (cpuinfo.bf16_dots_lead_every_call:
    AMD's Zen 4; the weight is then packed once, for them alone), else for calls of up to 128 rows, a
    decode step's or a short prompt's (the weight's bytes once more). Where the CPU lacks AVX512-BF16
    nothing is packed for it either way."""
    chosen = envs.choice(FEW_ROWS_ENV, OneDnnSettingError)
    if chosen is not None:
        return FEW_ROWS_MODES[chosen]
    return FEW_ROWS_ALL if cpuinfo.bf16_dots_lead_every_call() else FEW_ROWS_SOME


DOT_ROWS = 128  # the most rows a call runs on the few-row kernel beside the inner product (kDotRows)


def few_rows_choice() -> str:
    """Which calls of a bf16 linear run the few-row kernel by default here, in words (`prefix-service
    env`): none where the library has no AVX512-BF16 dot products or another kernel takes every call
    (AMX's timed choice, brgemm, emulated), else as few_rows_default() says."""
    lib = load()[0]
    if lib is None or not lib.ps_onednn_few_rows_built():
        return "none (no AVX512-BF16 dot products here)"
    if (kernel := default_kernel()) != "inner_product":
        return f"none (bf16 linears: {kernel})"
    return {FEW_ROWS_NONE: f"none ({FEW_ROWS_ENV}=0)", FEW_ROWS_SOME: f"calls of up to {DOT_ROWS} rows",
            FEW_ROWS_ALL: "every call"}[few_rows_default()]


def few_rows_words(few_rows: int) -> str:
    """Which calls an OneDnnLinear.few_rows (non-zero) runs on the few-row kernel, in words."""
    return "for every call" if few_rows == FEW_ROWS_EVERY_CALL else f"up to {few_rows} rows"


def brgemm_columns() -> int:
    """The brgemm kernel's output columns per packed weight block: $PREFIX_SERVICE_BF16_BRGEMM_COLUMNS
    where set (16, 32, 48 or 64: one to four whole AMX tiles, the widest block oneDNN packs for them;
    to compare block widths on one machine, as a wider block runs fewer micro-kernel calls per
    product), else 32."""
    chosen = envs.choice(COLUMNS_ENV, OneDnnSettingError)
    return DEFAULT_BRGEMM_COLUMNS if chosen is None else int(chosen)


def _check_columns(columns: int, what: str) -> int:
    if columns < 16 or columns > 64 or columns % 16:
        raise OneDnnError(f"{what}: 16, 32, 48 or 64 is needed (whole AMX tiles, at most four)")
    return columns


def default_kernel() -> str:
    """The kernel a bfloat16 weight runs by default here: $PREFIX_SERVICE_BF16_LINEAR where set (one
    of KERNEL_CHOICES: to compare them on one machine), else "measure" where the CPU has AMX: each
    weight shape is timed on brgemm and on the inner product when the first weight of that shape
    is packed, and runs brgemm, the inner product, or brgemm for calls up to a row count and the
    inner product above (time_linear). On AMX brgemm's decode steps ran 0.97-2.3x as fast as the inner
    product's with f32 hand-offs, while oneDNN's own inner product on bf16 rows ran calls of 16 to 64
    rows 1.6-2x as fast as brgemm (docs/benchmarks.md, "Run 8"): the crossover is the machine's.
    Elsewhere oneDNN's bf16 inner product where torch supports it, else emulated (brgemm alone on AMX
    without it, which no CPU has: tests simulate AMX on CPUs without bf16 units)."""
    chosen = envs.choice(KERNEL_ENV, OneDnnSettingError)
    if chosen is not None:
        if chosen in ("inner_product", "measure") and not bf16_native():
            raise OneDnnSettingError(f"{KERNEL_ENV}={chosen}: torch's oneDNN refuses bf16 inner products on this "
                                     "CPU")
        return chosen
    if brgemm_vnni():  # nothing to time brgemm against where torch refuses the bf16 inner product
        return "measure" if bf16_native() else "brgemm"
    return "inner_product" if bf16_native() else "emulated"


def invariant_kernel() -> tuple[str | None, str]:
    """The one kernel a bfloat16 weight runs for every call size where each output row must not
    depend on the call's other rows (model.batch_invariant), and why: "brgemm" where the default
    kernel is brgemm or timed against it (AMX), "dot" (the few-row kernel's AVX512-BF16 dot products)
    where it is the inner product and the library has them, else None: the inner products of torch's
    oneDNN (native or emulated) choose their blocking, and so the order of a row's sums, by the call's
    rows."""
    kernel = default_kernel()
    if kernel in ("brgemm", "measure"):
        return "brgemm", "oneDNN's brgemm micro-kernel for every call"
    lib = load()[0]
    if kernel == "inner_product" and lib is not None and lib.ps_onednn_few_rows_built():
        return "dot", "the AVX512-BF16 dot-product kernel for every call"
    return None, (f"bf16 linears run oneDNN's {'emulated ' if kernel == 'emulated' else ''}inner product here "
                  f"(no AMX, no AVX512-BF16 dot products), whose sums depend on a call's rows")


def brgemm_rows_default() -> int:
    """For an inner-product weight: the most rows a call runs on brgemm instead (a second copy of
    the weight, packed for it; the few-row kernel is then not packed), $PREFIX_SERVICE_BF16_BRGEMM_ROWS
    where set (to compare crossovers on one machine), else 0 (none)."""
    return envs.count(BRGEMM_ROWS_ENV, 0, OneDnnSettingError)


def _check_rows(name: str, t: torch.Tensor, cols: int, rows: int | None = None) -> None:
    """t must be a float32 CPU [rows, cols] tensor whose rows are dense and do not overlap."""
    want = f"[{'M' if rows is None else rows}, {cols}]"
    if t.dtype != torch.float32:
        raise OneDnnError(f"{name}: float32 is needed, got {t.dtype}")
    if t.device.type != "cpu":
        raise OneDnnError(f"{name}: a CPU tensor is needed, got one on {t.device}")
    if t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows):
        raise OneDnnError(f"{name}: shape {want} is needed, got {tuple(t.shape)}")
    if (cols > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < cols):
        raise OneDnnError(f"{name}: rows of {cols} adjacent floats, not overlapping, are needed, got strides "
                          f"{t.stride()}")


class OneDnnLinear:
    """y = x @ W.T + b with W packed once for oneDNN. x: [M, K] float32 (rows may be strided).
    kernel: a bfloat16 weight's (KERNELS; default: default_kernel()); columns: the brgemm kernel's
    block width (default: brgemm_columns()); few_rows: how an inner-product weight takes the few-row
    kernel where the CPU has AVX512-BF16 (FEW_ROWS_MODES: False or FEW_ROWS_NONE not at all, True or
    FEW_ROWS_SOME for calls of up to 128 rows, FEW_ROWS_ALL for every call; default: few_rows_default()).
    `few_rows` then holds the most rows a call runs through it (0: none; FEW_ROWS_EVERY_CALL: every
    call). brgemm_rows: for an inner-product weight, the most rows a call runs on brgemm instead
    (default: brgemm_rows_default(); the few-row kernel is then not packed). kernel "measure" times
    the shape (time_linear, once per shape and thread count) and sets both; `timing` then holds what
    it found (else None). invariant: one kernel for every call size, so that an output row does not
    depend on the call's other rows (a bfloat16 weight only: invariant_kernel()'s, whatever `kernel`
    and `few_rows` say; OneDnnError where there is none).

    `handle` and `fn` (the address of ps_onednn_linear) let native code make the same call, and for a
    bf16 weight `call.run_bf16` (ps_onednn_linear_bf16) the call with bf16 hand-offs (`rows_bf16`);
    the handle lives as long as this object and is freed after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None,
                 columns: int | None = None, few_rows: int | None = None,
                 int8: tuple[torch.Tensor, torch.Tensor] | None = None, brgemm_rows: int | None = None,
                 invariant: bool = False) -> None:
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise OneDnnError(f"weight: a float32 or bfloat16 CPU tensor [N, K] is needed, got {weight.dtype} "
                              f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and (bias.shape != (self.out_features,) or bias.device.type != "cpu"):
            raise OneDnnError(f"bias: a CPU tensor [{self.out_features}] is needed, got {tuple(bias.shape)} "
                              f"on {bias.device}")
        lib, reason = load()
        if lib is None:
            raise OneDnnError(f"no oneDNN linear here: {reason}")
        self.dtype = weight.dtype
        if kernel is not None and kernel not in KERNEL_CHOICES:
            raise OneDnnError(f"kernel: one of {', '.join(KERNEL_CHOICES)} is needed, got {kernel!r}")
        if few_rows is not None and few_rows not in FEW_ROWS_MODES.values():
            raise OneDnnError(f"few_rows: one of {sorted(FEW_ROWS_MODES.values())} is needed, got {few_rows!r}")
        if brgemm_rows is not None and brgemm_rows < 0:
            raise OneDnnError(f"brgemm_rows: 0 or more is needed, got {brgemm_rows}")
        self.invariant = invariant
        if invariant:
            if self.dtype == torch.float32:
                raise OneDnnError("invariant: oneDNN's float32 inner product depends on a call's rows; the native "
                                  "kernel (linear.NativeLinear) does not")
            one, why = invariant_kernel()
            if one is None:
                raise OneDnnError(f"invariant: {why}")
            kernel, few_rows, brgemm_rows = ("brgemm", FEW_ROWS_NONE, 0) if one == "brgemm" \
                else ("inner_product", FEW_ROWS_ALL, 0)
        # float32: oneDNN's float32 inner product, whatever `kernel` says
        self.kernel = "float32" if self.dtype == torch.float32 else kernel or default_kernel()
        self.timing: LinearTiming | None = None

        def block_width() -> int:  # read only where a call may run brgemm
            return brgemm_columns() if columns is None else _check_columns(columns, f"columns={columns}")
        if self.kernel == "measure":
            self.timing = time_linear(self.out_features, self.in_features, block_width())
            self.kernel, brgemm_rows, few_rows = self.timing.kernel, self.timing.brgemm_rows, FEW_ROWS_NONE
        self.emulated = self.kernel == "emulated"
        if self.kernel != "inner_product":
            brgemm_rows = 0
        elif brgemm_rows is None:
            brgemm_rows = brgemm_rows_default()
        self.columns = block_width() if self.kernel == "brgemm" or brgemm_rows else 0  # brgemm's block width
        w = weight.detach().contiguous()  # [N, K]; the library copies it
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()  # [N]
        q = scale = None  # int8 weights: the few-row kernel reads them where it is packed
        if int8 is not None:
            if problem := int8_problem(int8, tuple(weight.shape)):
                raise OneDnnError(problem)
            q, scale = (t.detach().contiguous() for t in int8)
        handle = lib.ps_onednn_pack(w.data_ptr(), int(self.dtype == torch.bfloat16), self.out_features,
                                    self.in_features, None if b is None else b.data_ptr(),
                                    KERNELS.get(self.kernel, 0), self.columns,
                                    int(few_rows_default() if few_rows is None else few_rows),
                                    None if q is None else q.data_ptr(), None if scale is None else scale.data_ptr(),
                                    brgemm_rows)
        if not handle:
            raise OneDnnError(lib.ps_onednn_last_error().decode(errors="replace"))
        self.handle: int = handle
        self.few_rows = int(lib.ps_onednn_few_rows(handle))
        if invariant and self.kernel == "inner_product" and self.few_rows != FEW_ROWS_EVERY_CALL:
            lib.ps_onednn_free(handle)
            raise OneDnnError("invariant: the library packed no few-row kernel for this weight")
        self.brgemm_rows = int(lib.ps_onednn_brgemm_rows(handle))
        self.int8 = bool(lib.ps_onednn_int8(handle))  # whether the few-row calls read int8 weights
        self.fn = native.address(lib.ps_onednn_linear)
        bf16_fn = native.address(lib.ps_onednn_linear_bf16) if self.dtype == torch.bfloat16 else 0
        self.call = native.LinearCall(self.fn, self.handle, bf16_fn)
        self._lib = lib
        self._finalizer = weakref.finalize(self, lib.ps_onednn_free, handle)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_rows("x", x, self.in_features)
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, self.out_features, dtype=torch.float32)
        else:
            _check_rows("out", out, self.out_features, m)
        if native.call_linear(self.call, x, out):  # the stack's path and timer
            raise OneDnnError(self._lib.ps_onednn_last_error().decode(errors="replace"))
        return out

    def rows_bf16(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x @ W.T + b with the bf16 hand-offs the decoder stack makes (csrc/cpu_layer.cpp's
        PsLinearBf16Fn): x [M, K] bfloat16 (taken as it is) or float32 (rounded here), the output
        [M, N] in out_dtype (bfloat16: the rounded outputs; float32: widened). A bf16 weight only;
        the same numbers as calling it on x widened to float32."""
        if self.dtype != torch.bfloat16:
            raise OneDnnError("rows_bf16: a bfloat16 weight is needed; this one is float32")
        if (x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] != self.in_features
                or x.device.type != "cpu"):
            raise OneDnnError(f"x: a bfloat16 or float32 CPU tensor [M, {self.in_features}] is needed, got {x.dtype} "
                              f"{tuple(x.shape)}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise OneDnnError(f"out_dtype: bfloat16 or float32 is needed, got {out_dtype}")
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=out_dtype)
        if self._lib.ps_onednn_linear_bf16(self.handle, x.data_ptr(), int(x.dtype == torch.bfloat16), self.in_features,
                                           m, out.data_ptr(), int(out_dtype == torch.bfloat16), self.out_features,
                                           torch.get_num_threads()):
            raise OneDnnError(self._lib.ps_onednn_last_error().decode(errors="replace"))
        return out

    def __repr__(self) -> str:
        mode = "float32" if self.dtype == torch.float32 else f"bf16 {self.kernel}"
        if self.brgemm_rows:
            mode += f", brgemm up to {self.brgemm_rows} rows"
        if self.columns != DEFAULT_BRGEMM_COLUMNS and self.columns:
            mode += f", {self.columns}-column blocks"
        if self.timing is not None:
            mode += ", timed"
        if self.few_rows:
            mode += f", {'int8 ' if self.int8 else ''}dot products {few_rows_words(self.few_rows)}"
        return f"OneDnnLinear(in_features={self.in_features}, out_features={self.out_features}, {mode})"


# --- bf16 linears on AMX: brgemm, the inner product, or brgemm for few rows ---------------------

LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts timed, in order, until brgemm loses
LINEAR_CALLS = 5  # timed calls of each kernel at each row count, alternating, after 2 untimed


@dataclass(frozen=True)
class LinearTiming:
    """What timing a weight shape's calls found: microseconds a call (median) for each kernel
    ("brgemm", "inner_product") at each row count timed, and the choice: `kernel` with
    `brgemm_rows` (the inner product with calls of up to that many rows on brgemm; 0: none)."""
    kernel: str
    brgemm_rows: int
    why: str
    us: dict[str, dict[int, float]] = field(default_factory=dict)


def choose_linear(us: dict[str, dict[int, float]]) -> tuple[str, int, str]:
    """(kernel, brgemm_rows, why) from per-call medians: brgemm for the row counts, from 1 up, at
    which it was no slower than the inner product, and the inner product from the first at which it
    was slower; brgemm alone where it was never slower at any row count timed."""
    rows = sorted(us["brgemm"])
    won = 0
    for r in rows:
        if us["brgemm"][r] > us["inner_product"].get(r, float("inf")):
            break
        won = r
    else:
        return "brgemm", 0, f"brgemm no slower at every row count timed, 1 to {rows[-1]}"
    if not won:
        return "inner_product", 0, "the inner product faster from one row"
    return "inner_product", won, f"brgemm up to {won} rows, the inner product faster at {r}"


_LINEAR_TIMINGS: dict[tuple[int, int, int, int], LinearTiming] = {}


def time_linear(n: int, k: int, columns: int) -> LinearTiming:
    """Times a bf16 weight of n x k (random values) on brgemm (blocks of `columns`) and on oneDNN's
    inner product at LINEAR_ROWS in order until brgemm is slower, and returns choose_linear()'s
    choice; once per shape, block width and torch thread count in a process (what it found is kept)."""
    key = (n, k, columns, torch.get_num_threads())
    if key in _LINEAR_TIMINGS:
        return _LINEAR_TIMINGS[key]
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
    layers = {"brgemm": OneDnnLinear(w, None, kernel="brgemm", columns=columns),
              "inner_product": OneDnnLinear(w, None, kernel="inner_product", few_rows=False, brgemm_rows=0)}
    us: dict[str, dict[int, float]] = {name: {} for name in layers}
    for r in LINEAR_ROWS:
        x = torch.randn(r, k, generator=gen)
        outs = {name: torch.empty(r, n) for name in layers}
        samples: dict[str, list[float]] = {name: [] for name in layers}
        for call in range(LINEAR_CALLS + 2):
            for name in (layers if call % 2 == 0 else reversed(list(layers))):
                start = time.perf_counter()
                layers[name](x, outs[name])
                if call >= 2:
                    samples[name].append((time.perf_counter() - start) * 1e6)
        for name in layers:
            us[name][r] = statistics.median(samples[name])
        if us["brgemm"][r] > us["inner_product"][r]:
            break
    kernel, rows, why = choose_linear(us)
    timing = _LINEAR_TIMINGS[key] = LinearTiming(kernel, rows, why, us)
    log.info("bf16 linear %d x %d timed on %d threads: %s (%s)", n, k, key[3],
             kernel if not rows else f"brgemm up to {rows} rows, the inner product above", why)
    return timing


class OneDnnTemplate:
    """A pinned template's keys and values of one layer, packed for the matrix-product template
    attention (csrc/onednn_attention.cpp): k, v [R, Hkv, D] bfloat16 (D even), copied.

    `attend(h, q)` gives, for query rows q [rows, D] float32 (each query times the attention scale)
    over KV head h, each row's softmax state after the template's R keys: (o [rows, D] unnormalised
    output, m [rows] maximum score, l [rows] sum of exponentials). `handle` and
    `template_attend_fn()` let native code make the same call.

    Every kernel but the dot products walks the keys as the rows of its products (the key-row walk:
    two products per 256 keys for up to 64 query rows, whatever the kernel); the dot products walk
    the keys 64 at a time a few query rows at a time (attend_dot), which is faster with them, unless
    `key_rows` asks for the key-row walk on them too (to check its VNNI operands on a CPU without
    AMX, and to compare the two). `products` caps the kernel as template_products() does (a
    TEMPLATE_KERNELS number; None: template_products())."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, key_rows: bool = False, products: int | None = None) -> None:
        if (k.dim() != 3 or k.shape != v.shape or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
                or k.device.type != "cpu" or v.device.type != "cpu"):
            raise OneDnnError(f"k, v: bfloat16 CPU tensors [R, Hkv, D] of one shape are needed, got {k.dtype} "
                              f"{tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
        lib, reason = load()
        if lib is None:
            raise OneDnnError(f"no oneDNN library here: {reason}")
        self.num_tokens, self.num_kv_heads, self.head_size = k.shape
        # one row stride for both, each head's D elements dense
        if k.stride()[1:] != (self.head_size, 1) or v.stride() != k.stride():
            k, v = k.contiguous(), v.contiguous()
        handle = lib.ps_onednn_template_pack(k.data_ptr(), v.data_ptr(), k.stride(0), self.num_tokens,
                                             self.num_kv_heads, self.head_size,
                                             template_products() if products is None else products, int(key_rows))
        if not handle:
            raise OneDnnError(lib.ps_onednn_last_error().decode(errors="replace"))
        self.handle: int = handle
        self.nbytes = int(lib.ps_onednn_template_bytes(handle))
        self.kernel = TEMPLATE_KERNELS[int(lib.ps_onednn_template_packed_kernel(handle))]  # what multiplies
        self.key_rows = bool(lib.ps_onednn_template_key_rows(handle))  # how it walks the keys
        self._lib = lib
        self._finalizer = weakref.finalize(self, lib.ps_onednn_template_free, handle)

    def attend(self, h: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check_rows("q", q, self.head_size)
        rows = q.shape[0]
        o = torch.empty(rows, self.head_size, dtype=torch.float32)
        m = torch.empty(rows, dtype=torch.float32)
        l = torch.empty(rows, dtype=torch.float32)
        if self._lib.ps_onednn_template_attend(self.handle, h, q.data_ptr(), q.stride(0) if rows > 1 else self.head_size,
                                               rows, o.data_ptr(), self.head_size, m.data_ptr(), l.data_ptr()):
            raise OneDnnError(self._lib.ps_onednn_last_error().decode(errors="replace"))
        return o, m, l


TEMPLATE_ATTENTION_ENV = "PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION"
TEMPLATE_ATTENTIONS = envs.BY_NAME[TEMPLATE_ATTENTION_ENV].choices
TEMPLATE_ATTENTION_ALIASES = dict(envs.BY_NAME[TEMPLATE_ATTENTION_ENV].aliases)  # a value's older name, still taken
# what ps_onednn_template_kernel numbers: the products of the matrix-product template attention
TEMPLATE_KERNELS = {0: "fallback GEMM", 1: "AVX512-BF16 dot products", 2: "AMX brgemm"}


TEMPLATE_PRODUCTS_ENV = "PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS"
# the most capable of TEMPLATE_KERNELS (its number) that each value lets the template's products use
TEMPLATE_PRODUCTS = {"auto": 2, "dot": 1, "fallback": 0}


def _has_dot(head_size: int) -> bool:
    """Whether the library's AVX512-BF16 dot products can multiply heads of head_size here."""
    lib = load()[0]
    return lib is not None and TEMPLATE_KERNELS[int(lib.ps_onednn_template_kernel(head_size, 1))] == TEMPLATE_KERNELS[1]


def template_products() -> int:
    """The most capable kernel (a TEMPLATE_KERNELS number) the matrix-product template attention
    may multiply with: $PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS where set ("dot": the AVX512-BF16
    dot products, not AMX tiles, to compare the two on a CPU that has both; "fallback": torch's
    fallback GEMM, on any CPU), else "auto" (AMX tiles, else the dot products, else the fallback).
    Read when a template is packed."""
    chosen = envs.choice(TEMPLATE_PRODUCTS_ENV, OneDnnSettingError) or "auto"
    if chosen == "dot" and not _has_dot(16):
        raise OneDnnSettingError(f"{TEMPLATE_PRODUCTS_ENV}=dot: this CPU has no AVX512-BF16 dot products for the "
                                 "library to use")
    return TEMPLATE_PRODUCTS[chosen]


def template_kernel(head_size: int, products: int | None = None) -> str:
    """What multiplies the matrix-product template attention's bf16 products here for heads of
    head_size (a value of TEMPLATE_KERNELS; the library decides, as it does when it packs a
    template): oneDNN's brgemm micro-kernel on AMX tiles; elsewhere, where the CPU has AVX512-BF16
    (AMD Zen 4 on, Intel Cooper Lake), the library's own loops of bf16 dot-product instructions;
    each for head sizes that are a multiple of 16; else torch's fallback GEMM. "fallback GEMM" as
    well without the library. None above what `products` (a TEMPLATE_KERNELS number; None:
    template_products()) allows."""
    lib = load()[0]
    if lib is None:
        return TEMPLATE_KERNELS[0]
    most = template_products() if products is None else products
    return TEMPLATE_KERNELS[int(lib.ps_onednn_template_kernel(head_size, most))]


def template_kernel_rule(head_size: int, amx: bool, dot: bool) -> str:
    """template_kernel()'s rule for a CPU with or without AMX's VNNI brgemm and the library's
    AVX512-BF16 dot products, as the library applies it (to check it where the CPU has neither)."""
    lib = load()[0]
    if lib is None:
        raise OneDnnError("no oneDNN library here")
    return TEMPLATE_KERNELS[int(lib.ps_onednn_template_kernel_rule(head_size, int(amx), int(dot)))]


def _dot_by_default(head_size: int) -> bool:
    """Whether the attention's bf16 products run on the AVX512-BF16 dot products by default here: where
    they multiply the template's products (template_kernel) and the CPU has no AMX and runs them
    faster than float32 FMAs (cpuinfo.bf16_dots_are_fast: AMD's Zen 4 and 5, not Intel's cores), or
    $PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=dot asks for them (on AMX the native kernels by default,
    whatever would multiply)."""
    dot = template_kernel(head_size) == TEMPLATE_KERNELS[1]
    if envs.choice(TEMPLATE_PRODUCTS_ENV, OneDnnSettingError) == "dot":
        return dot
    return dot and not brgemm_vnni() and cpuinfo.bf16_dots_are_fast()


def template_attention(head_size: int) -> str:
    """How a bfloat16 model's rows attend over a pinned template's keys, for heads of head_size:
    "native" (the native kernels' float32 FMAs over a float32 copy), "matrix" (matrix products in
    bf16 with float32 sums, OneDnnTemplate, on template_kernel(): AMX tiles, AVX512-BF16 dot products
    or the fallback GEMM), or "measure": the decoder stack times both on the model when it is built
    and keeps the faster (tuning.py). The environment variable PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION
    chooses ("brgemm", its older name, means "matrix"). By default: "matrix" where its products are
    the AVX512-BF16 dot products on an AMD CPU (no AMX), which take 10-25% off the attention of a
    prefill or a batched decode on a template there (docs/benchmarks.md; on an Intel core they took
    1.2-1.4x the native kernels' time, so "native" there); "measure" where they are
    AMX's tiles, whose key-row walk has no figure yet (the walk it replaced made the first token of
    a 100-token prompt on a template 3x slower at 16 threads there, docs/benchmarks.md, "Run 8");
    "native" elsewhere: the fallback GEMM is 2-3x slower than the native kernels. With
    PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=dot (template_products()) the default is "matrix" on AMX
    too, on the dot products: to measure them against the native kernels there."""
    chosen = envs.choice(TEMPLATE_ATTENTION_ENV, OneDnnSettingError)
    if chosen is None:
        if _dot_by_default(head_size):
            return "matrix"
        return "measure" if template_kernel(head_size) == TEMPLATE_KERNELS[2] else "native"
    return chosen


def template_attend_calls() -> int:
    """How many template-part calls (OneDnnTemplate.attend, or native code's through
    template_attend_fn) have run in this process: 0 without the library."""
    lib = load()[0]
    return 0 if lib is None else int(lib.ps_onednn_template_calls())


PROMPT_ATTENTION_ENV = "PREFIX_SERVICE_BF16_PROMPT_ATTENTION"
PROMPT_ATTENTIONS = envs.BY_NAME[PROMPT_ATTENTION_ENV].choices


def prompt_attention(head_size: int) -> str:
    """How a bfloat16 model's prompt attends over its own keys when nothing comes before it in the
    cache (a prompt that names no template, and a template being pinned) and it has
    PROMPT_ATTENTION_MIN_TOKENS tokens or more: "native" (the native kernels' float32 FMAs) or
    "dot" (the template attention's AVX512-BF16 dot products, causal: ps_onednn_causal_attend,
    through causal_attend_fn(); q and P rounded to bf16 as for a template), or "measure": the
    decoder stack times both on the model when it is built and keeps the faster (tuning.py). The
    environment variable PREFIX_SERVICE_BF16_PROMPT_ATTENTION chooses; by default "dot" where the
    template's products run on them by default (AMD's AVX512-BF16, no AMX), "measure" where the CPU has
    them beside AMX (not timed there yet), else "native"."""
    chosen = envs.choice(PROMPT_ATTENTION_ENV, OneDnnSettingError)
    if chosen is None:
        if _dot_by_default(head_size):
            return "dot"
        return "measure" if brgemm_vnni() and _has_dot(head_size) else "native"
    if chosen in ("dot", "measure") and not _has_dot(head_size):
        raise OneDnnSettingError(f"{PROMPT_ATTENTION_ENV}={chosen}: the AVX512-BF16 dot products are not available "
                                 f"here for head size {head_size}")
    return chosen


# a prompt of fewer tokens (nearly all in its first chunk of keys) stays on the native kernels
# (cpu_attention.cpp's kCausalMin)
PROMPT_ATTENTION_MIN_TOKENS = 128


def causal_attend_calls() -> int:
    """How many prompts' own attentions (one a layer) have run on the dot products in this process: 0
    without the library."""
    lib = load()[0]
    return 0 if lib is None else int(lib.ps_onednn_causal_calls())


def causal_attend_fn() -> int:
    """The address of ps_onednn_causal_attend, the call native code makes for a prompt's own keys."""
    lib = load()[0]
    if lib is None:
        raise OneDnnError(f"no oneDNN library here: {load()[1]}")
    return native.address(lib.ps_onednn_causal_attend)


def template_attend_fn() -> int:
    """The address of ps_onednn_template_attend, the call native code makes with a template's handle."""
    lib = load()[0]
    if lib is None:
        raise OneDnnError(f"no oneDNN library here: {load()[1]}")
    return native.address(lib.ps_onednn_template_attend)
