"""What the host CPU can compute with, from the flags the kernel reports (/proc/cpuinfo): the
dtype choice (`model.dtype: auto`) and every benchmark record read it here.

bf16 matrix units: AMX-BF16 (tiles, Intel Sapphire Rapids on) and AVX512-BF16 (dot products, Intel
Cooper Lake on, AMD Zen 4 on). Where a CPU has either, bfloat16 matrix products run several times
faster than float32 ones and stream half the weight bytes; elsewhere bf16 is converted to float32 on
the way and gains nothing.
"""
from __future__ import annotations

import functools

# the instruction sets we name, strongest first: (flag in /proc/cpuinfo, name)
ISA_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
BF16_UNITS = ("AMX-BF16", "AVX512-BF16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (empty where /proc/cpuinfo cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa(flags: frozenset[str] | None = None) -> list[str]:
    """The named instruction sets this CPU has, strongest first: e.g. ["AVX-512", "AVX2"]."""
    flags = cpu_flags() if flags is None else flags
    return [name for flag, name in ISA_FLAGS if flag in flags]


def bf16_units(flags: frozenset[str] | None = None) -> list[str]:
    """The bf16 matrix or dot-product units this CPU has (AMX-BF16, AVX512-BF16), or []."""
    return [name for name in isa(flags) if name in BF16_UNITS]
