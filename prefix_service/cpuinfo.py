"""What the host CPU can compute with, from the flags the kernel reports (/proc/cpuinfo): the
dtype choice (`model.dtype: auto`) and every benchmark record read it here.

bf16 matrix units: AMX-BF16 (tiles, Intel Sapphire Rapids on) and AVX512-BF16 (dot products, Intel
Cooper Lake on, AMD Zen 4 on). AMX's tiles multiply bf16 several times faster than float32, and a
Zen 4 or 5 core runs a bf16 dot product at twice its float32 FMA rate; elsewhere bf16 is converted to
float32 on the way and gains nothing. An Intel core's AVX512-BF16 dot product runs at half its
float32 FMA rate (measured on a Xeon whose hypervisor hides AMX), so without AMX its bf16 is slower
than float32: bf16_is_faster() says where `model.dtype: auto` picks bf16.

`PREFIX_SERVICE_CPU_MARCH` names a compiler target (`-march`) for the native kernels in place of
this CPU (backends/cpu/native.py): kernel_flags() then answers with the instruction sets the
compiler enables for it, which the kernels compute with. It serves a fleet that builds for the
instruction sets its machines share (x86-64-v3: AVX2 + FMA), and a guest whose hypervisor hides an
instruction set its host's CPU executes. The dtype choice keeps the flags the CPU reports
(cpu_flags), since bf16's gain is in the linear layers, which oneDNN multiplies on the instruction
sets the CPU reports to it. A target the CPU cannot run stops the process with SIGILL at the first
instruction it lacks.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess

from prefix_service import envs
from prefix_service.errors import ConfigError

# the instruction sets we name, strongest first: (flag in /proc/cpuinfo, name)
ISA_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
BF16_UNITS = ("AMX-BF16", "AVX512-BF16")


MARCH_ENV = "PREFIX_SERVICE_CPU_MARCH"
# the compiler's macro for each instruction set we read, and its flag in /proc/cpuinfo
TARGET_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
                 "__AVX512VL__": "avx512vl", "__AVX512BF16__": "avx512_bf16", "__AMX_TILE__": "amx_tile",
                 "__AMX_BF16__": "amx_bf16"}


def target() -> str | None:
    """$PREFIX_SERVICE_CPU_MARCH where it names a target other than `native`, else None."""
    march = envs.value(MARCH_ENV)
    return march if march and march != "native" else None


def compiler() -> str | None:
    """The system C++ compiler: $CXX, else c++, g++ or clang++ (the first on PATH), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=None)
def target_flags(march: str) -> frozenset[str]:
    """The /proc/cpuinfo flags (of TARGET_MACROS) the C++ compiler enables for -march=`march`;
    ConfigError (a ValueError) where there is no compiler or it does not know the target."""
    cxx = compiler()
    if cxx is None:
        raise ConfigError(f"{MARCH_ENV}={march}: no C++ compiler found to read the target's instruction sets (set CXX)")
    proc = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"{MARCH_ENV}={march}: the compiler does not know this target: "
                          f"{(proc.stderr.strip().splitlines() or [''])[0][:300]}")
    defined = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in TARGET_MACROS.items() if macro in defined)


@functools.lru_cache(maxsize=None)
def first_field(name: str) -> str | None:
    """The value of the first processor's `name` line in /proc/cpuinfo ("model name", "vendor_id",
    "flags"), stripped; None where the file cannot be read (not Linux) or has no such line."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str:
    """The first processor's vendor_id, e.g. GenuineIntel, AuthenticAMD ("" where /proc/cpuinfo cannot
    be read or names none)."""
    return first_field("vendor_id") or ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (empty where /proc/cpuinfo cannot be read: not Linux)."""
    return frozenset((first_field("flags") or "").split())


def kernel_flags() -> frozenset[str]:
    """The flags the native kernels are built for: $PREFIX_SERVICE_CPU_MARCH's target's (target_flags)
    where it names one, else this CPU's."""
    march = target()
    return target_flags(march) if march else cpu_flags()


def isa(flags: frozenset[str] | None = None) -> list[str]:
    """The named instruction sets this CPU has, strongest first: e.g. ["AVX-512", "AVX2"]."""
    flags = cpu_flags() if flags is None else flags
    return [name for flag, name in ISA_FLAGS if flag in flags]


def bf16_units(flags: frozenset[str] | None = None) -> list[str]:
    """The bf16 matrix or dot-product units this CPU has (AMX-BF16, AVX512-BF16), or []."""
    return [name for name in isa(flags) if name in BF16_UNITS]


INTEL = "GenuineIntel"


def bf16_dots_are_fast(vendor: str | None = None) -> bool:
    """Whether this CPU's AVX512-BF16 dot products (where it has them) outrun its float32 FMAs: on
    AMD's Zen 4 and 5, not on Intel's cores, where `vdpbf16ps` runs at half the FMA rate (88 against
    178 GFLOP/s on one core of an Emerald Rapids Xeon) and the library's dot-product attention took
    1.2-1.6x the native kernels' float32 FMAs (docs/benchmarks.md). `vendor`: cpu_vendor()'s."""
    return (cpu_vendor() if vendor is None else vendor) != INTEL


AMD = "AuthenticAMD"
ZEN4_FAMILY = 25  # AMD's family 25 (0x19): Zen 3 and Zen 4, of which Zen 4 alone has AVX512-BF16


def cpu_family() -> int | None:
    """The first processor's `cpu family` number (25 for AMD's Zen 3 and 4, 26 for Zen 5), or None
    where /proc/cpuinfo cannot be read or names none."""
    raw = first_field("cpu family")
    return int(raw) if raw is not None and raw.isdigit() else None


def bf16_dots_lead_every_call(vendor: str | None = None, family: int | None = None) -> bool:
    """Whether this CPU's AVX512-BF16 dot products (the cpu backend's few-row kernel) outrun oneDNN's
    bf16 inner product at every call size, so a bf16 linear runs them for every call: on AMD's Zen 4
    (family 25; a core there runs a 512-bit instruction as two 256-bit halves, so oneDNN's blocking
    for wide calls gains nothing over them: they led by 7% at 129 rows and 1-2% at 1,000 to 2,048,
    docs/benchmarks.md), not on Zen 5 (family 26, whole 512-bit units: oneDNN leads from 512 rows) or
    Intel's cores. `vendor`, `family`: cpu_vendor()'s, cpu_family()'s."""
    vendor = cpu_vendor() if vendor is None else vendor
    family = cpu_family() if family is None else family
    return vendor == AMD and family == ZEN4_FAMILY


def bf16_is_faster(flags: frozenset[str] | None = None, vendor: str | None = None) -> bool:
    """Whether bf16 outruns float32 on this CPU (`model.dtype: auto`): with AMX-BF16, or with
    AVX512-BF16 on a CPU not made by Intel (AMD Zen 4 and 5: docs/benchmarks.md, "The cpu backend in
    bfloat16"). Intel's AVX512-BF16 without AMX (Cooper Lake, or a later Xeon whose kernel or
    hypervisor does not let a process use AMX) runs bf16 dot products at half its float32 FMA rate,
    and the cpu backend's decode steps took 1.2-1.6x float32's there."""
    units = bf16_units(flags)
    return "AMX-BF16" in units or ("AVX512-BF16" in units and bf16_dots_are_fast(vendor))
