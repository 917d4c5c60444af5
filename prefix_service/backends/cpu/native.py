"""The native CPU library (csrc/*.cpp): built on first use, loaded through ctypes.

One shared library holds the cpu backend's kernels: prefill and decode attention (attention.py),
linear layers (linear.py), a layer's element-wise work (elementwise.py), the decoder stack
that runs them all for a forward (stack.py), and the sampler's passes over the logits
(sampling.py). It is compiled with the system C++ compiler (`CXX`, else `c++`/`g++`/`clang++`),
`-march=native` (or `$PREFIX_SERVICE_CPU_MARCH`'s target: cpuinfo.py), into `$PREFIX_SERVICE_CACHE_DIR`
(default `~/.cache/prefix_service`), keyed by the sources, the compiler and the CPU; a few seconds, once
per machine. The kernels run on torch's OpenMP runtime (the same libgomp, the same threads).
The kernels are written once against a 16-float vector (csrc/simd.h) that the build maps onto
AVX-512 or onto AVX2 with FMA, whichever the CPU has (`isa()`). `load()` says why the library
cannot be used (not x86-64 Linux, no compiler, a failed build, neither AVX-512 nor AVX2), and
backend selection then falls back to the torch backend.

The entry points return 0 or a status (`STATUS`); `check` turns a nonzero one into a
`NativeKernelError` naming the entry point and what the status means. The Python wrappers raise
the same error for operands they refuse before the call, and `require()` for a library that
cannot be used here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from prefix_service import cpuinfo, envs
from prefix_service.errors import ConfigError

log = logging.getLogger("prefix_service.engine")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_attention.cpp", CSRC / "cpu_linear.cpp", CSRC / "cpu_elementwise.cpp", CSRC / "cpu_layer.cpp",
           CSRC / "cpu_sampling.cpp")
HEADERS = (CSRC / "simd.h", CSRC / "timers.h", CSRC / "bf16.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# name: (argument types, return type) of each function the library exports
SIGNATURES = {
    "ps_isa": ([], _i32),
    "ps_prefill_attention": ([_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _f32, _ptr, _ptr, _i32, _ptr, _i64,
                              _ptr, _i64, _i32, _ptr, _ptr, _i32, _i32, _ptr, _i32, _i32, _i32, _ptr, _ptr, _i32, _ptr,
                              _i64, _i64], _i32),
    "ps_prefill_scratch_floats": ([_i32, _i32, _i32], _i64),
    "ps_decode_attention": ([_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _f32, _ptr, _ptr, _i32, _ptr, _i64,
                             _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i32, _ptr, _i32, _ptr, _i64], _i32),
    "ps_decode_scratch_floats": ([_i32, _i32, _i32], _i64),
    "ps_packed_linear": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_packed_linear_int8": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_packed_linear_bf16w": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_call_linear": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_split_linear": ([_ptr, _ptr, _i64, _i32, _ptr, _i64, _i32], _i32),
    "ps_add_rms_norm": ([_ptr, _i64, _ptr, _i64, _ptr, _f32, _ptr, _i64, _i32, _i32, _i32, _i32], _i32),
    "ps_silu_mul": ([_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _i32], _i32),
    "ps_rope": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _ptr, _i32], _i32),
    "ps_head_rms_norm": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _f32, _i32], _i32),
    "ps_top_k_rows": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i32], _i32),
    "ps_logsumexp_rows": ([_ptr, _i64, _i32, _i32, _ptr, _i32], _i32),
    "ps_softmax_draw_rows": ([_ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i32], _i32),
    "ps_decoder_stack": ([_ptr, _i32, _i32, _i32, _ptr, _ptr, _ptr, _i32, _i32, _i32, _i32, _i32, _i32, _f32, _ptr,
                          _ptr, _ptr, _ptr, _i32, _ptr, _i64, _ptr, _ptr, _i32, _ptr, _ptr, _i64, _i32, _ptr, _ptr,
                          _ptr, _i32, _i32, _i64, _i64], _i32),
    "ps_stack_scratch_floats": ([_i32, _i32, _i32, _i32, _i32, _i32, _i32, _i32], _i64),
    "ps_copy_blocks": ([_ptr, _i32, _i32, _i64, _ptr, _i32], _i32),
    "ps_timers": ([_i32, _ptr], None),
    "ps_decode_prefetch": ([_i32], _i32),
}


class NativeBuildError(RuntimeError):
    """A library's compilation failed (compile_library): load() reports it as the reason the library
    cannot be used."""


class NativeKernelError(RuntimeError):
    """A native kernel refused its operands or failed (its status, `check`), or the library cannot be
    used here (`require`)."""


class NativeSettingError(ConfigError, NativeKernelError):
    """A PREFIX_SERVICE_* environment variable that chooses how the native kernels compute holds a value
    it does not take, or asks for what this machine lacks: a config error (the CLI reports it in a line,
    as a config file's), and a NativeKernelError."""


# what each nonzero status of the library's entry points means (csrc/*.cpp); the decoder stack
# returns the first failing kernel's
STATUS = {
    1: "the library was built without AVX-512 or AVX2",
    2: "unsupported head size or head counts (attention: a multiple of 16 up to 256, query heads a multiple of "
       "KV heads, no fewer keys than queries; rotation: an even head size)",
    3: "out of memory",
    4: "a slot or block id outside the cache",
    5: "a linear layer's library failed",
    6: "the template attention's library failed",
    7: "bf16 rows for a linear layer that takes float32 rows only",
}


def check(code: int, what: str, linear_error: Callable[[], str] | None = None) -> None:
    """Raise NativeKernelError when the entry point `what` returned a nonzero status `code`: what
    STATUS says it means, and for 5 and 6 what `linear_error()` says went wrong: the caller passes
    the oneDNN library's own report (onednn.last_error; onednn.py imports this module, so this one
    cannot import it)."""
    if not code:
        return
    meaning = STATUS.get(code, "a status the library does not document")
    if code in (5, 6) and linear_error is not None:
        meaning = f"{meaning}: {linear_error() or 'it gave no reason'}"
    raise NativeKernelError(f"{what} failed with status {code}: {meaning}")


class LinearCall(ctypes.Structure):
    """A linear layer as the decoder stack calls it (csrc/cpu_layer.cpp's PsLinear): the address of its C
    entry point and that of its state (linear.CpuLinear), and for a bf16 weight the address of its entry
    point with bf16 hand-offs (rows in and out as bf16 bits; 0: none)."""
    _fields_ = [("run", ctypes.c_void_p), ("self", ctypes.c_void_p), ("run_bf16", ctypes.c_void_p)]


def call_linear(call: LinearCall, x: torch.Tensor, out: torch.Tensor) -> int:
    """out = the linear layer `call` applied to x, through the library's ps_call_linear: the path
    and the timer (csrc/timers.h) of the decoder stack's own layers, so a layer called from Python
    (the output head) is timed with them. x [M, K] and out [M, N] float32 with dense rows, checked
    by the caller. Returns the layer's status (0: done)."""
    m = x.shape[0]
    if m == 0:
        return 0
    ldx = x.stride(0) if m > 1 else x.shape[1]  # one row: its stride is never used
    ldy = out.stride(0) if m > 1 else out.shape[1]
    return int(require().ps_call_linear(ctypes.byref(call), x.data_ptr(), ldx, m, out.data_ptr(), ldy,
                                        torch.get_num_threads()))


def address(fn: Any) -> int:
    """The address of a library's C function, fn its ctypes function (a LinearCall's `run`)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    if value is None:
        raise NativeKernelError(f"{getattr(fn, '__name__', 'a C function')} has no address")
    return value


CACHE_DIR_ENV = "PREFIX_SERVICE_CACHE_DIR"


def cache_dir() -> Path:
    root = envs.value(CACHE_DIR_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "prefix_service"


def compiler() -> str | None:
    return cpuinfo.compiler()


def _cpu_signature() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    flags = cpuinfo.cpu_flags()
    if not flags:  # not Linux
        return platform.processor()
    return f"{cpuinfo.first_field('model name') or ''}: {' '.join(sorted(flags))}"


def for_target(flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` with -march=native replaced by -march=$PREFIX_SERVICE_CPU_MARCH where that names a
    target (cpuinfo.target(): a CPU whose hypervisor hides an instruction set the host executes, or
    the instruction sets a fleet shares). A target this CPU cannot run stops the process with SIGILL
    at the first instruction it lacks, so the build logs which target it uses. A target the compiler
    does not know is a ConfigError (cpuinfo.target_flags), not a failed build a backend chosen by
    `auto` would leave out."""
    march = cpuinfo.target()
    if march is None:
        return flags
    cpuinfo.target_flags(march)
    _warn_target(march)
    return tuple(f"-march={march}" if f == "-march=native" else f for f in flags)


@functools.lru_cache(maxsize=None)
def _warn_target(march: str) -> None:
    log.warning("native kernels: compiled for -march=%s (%s), not for this CPU", march, cpuinfo.MARCH_ENV)


def compile_library(cxx: str, stem: str, sources: tuple[Path, ...], flags: tuple[str, ...] = FLAGS,
                    link: tuple[str, ...] = (), key_parts: tuple[bytes, ...] = (),
                    error: type[Exception] = NativeBuildError) -> Path:
    """Compile `sources` with `flags` (and `link` after them, so the linker resolves the sources'
    references) into cache_dir()/`stem`-KEY.so, or find it there; its path. KEY covers the sources,
    `key_parts` (what else the build depends on), the compiler, the flags and the CPU. A failed build
    raises `error` with the compiler's message and leaves nothing behind."""
    flags = for_target(flags)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [p.read_bytes() for p in sources] + list(key_parts)
    parts += [version.encode(), " ".join((*flags, *link)).encode(), _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([cxx, *flags, *map(str, sources), "-o", str(built), *link], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            names = ", ".join(p.name for p in sources)
            raise error(f"compiling {names} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same file
    log.info("built %s in %s", ", ".join(p.name for p in sources), target)
    return target


def build(cxx: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The native library of `sources` (compile_library), its key also covering the headers beside them."""
    return compile_library(cxx, "prefix_service_native", sources, key_parts=tuple(h.read_bytes() for h in HEADERS))


DECODE_PREFETCH_ENV = "PREFIX_SERVICE_DECODE_PREFETCH"
# how a decode's pass over each sequence's own cache rows asks for them ahead of reading them
# (csrc/cpu_attention.cpp, ps_decode_prefetch): "task", every row of a task into L2 as it starts; "paced",
# each key's and value's row into L1 a few keys before it is read. Neither changes a bit of the output.
DECODE_PREFETCHES = {"task": 0, "paced": 1}


def decode_prefetch(vendor: str | None = None) -> str:
    """The way of DECODE_PREFETCHES the library's decode attention asks for its rows here:
    $PREFIX_SERVICE_DECODE_PREFETCH where set; else "paced" on an Intel CPU, where a task's hundreds of
    prefetches at once stall the core (each that misses holds a line fill buffer) and paced took
    0.85-0.93x the pass's time on a Xeon, and "task" elsewhere, which was the faster on a Zen 3
    (docs/benchmarks.md). `vendor`: cpuinfo.cpu_vendor()'s."""
    chosen = envs.choice(DECODE_PREFETCH_ENV, NativeSettingError)
    if chosen is not None:
        return chosen
    return "paced" if (cpuinfo.cpu_vendor() if vendor is None else vendor) == cpuinfo.INTEL else "task"


def require() -> ctypes.CDLL:
    """The library, or NativeKernelError with the reason it cannot be used here."""
    lib, reason = load()
    if lib is None:
        raise NativeKernelError(reason)
    return lib


def unavailable(dtype: torch.dtype) -> str | None:
    """None when the library's kernels can serve a model of `dtype` here (float32 or bfloat16; the
    linear layers of a bfloat16 model also need onednn.py's library: linear.available), else the reason."""
    reason = load()[1]
    if reason is None and dtype not in (torch.float32, torch.bfloat16):
        reason = (f"the model runs in {str(dtype).replace('torch.', '')}, and the native kernels serve float32 and "
                  f"bfloat16")
    return reason


@functools.lru_cache(maxsize=None)
def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) where it builds with AVX-512 or AVX2 + FMA, else (None, the reason). The
    library's decode attention then asks for its rows the way decode_prefetch() says (NativeSettingError
    for a $PREFIX_SERVICE_DECODE_PREFETCH it does not know)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the native kernels are built for x86-64 Linux, not {platform.system()} {platform.machine()}"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX)"
    try:
        lib = ctypes.CDLL(str(build(cxx)))
    except (NativeBuildError, OSError) as exc:
        return None, str(exc)
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.ps_isa() not in (256, 512):
        return None, "this CPU has neither AVX-512 nor AVX2 with FMA"
    lib.ps_decode_prefetch(DECODE_PREFETCHES[decode_prefetch()])
    return lib, None


def isa() -> str:
    """The instruction set the loaded library computes with: "avx512", "avx2" or "" (not loaded)."""
    lib = load()[0]
    return {512: "avx512", 256: "avx2"}.get(lib.ps_isa(), "") if lib is not None else ""
