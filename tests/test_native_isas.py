"""The native kernels build for every x86-64 instruction set they are written for, not only this CPU's.

The libraries are compiled with -march=native where they run, so a machine without AVX-512 never
compiles the AVX-512 branches of csrc/simd.h or the AVX512-BF16 ones of csrc/onednn_attention.cpp.
Here each is compiled with the runtime's own flags and -march set to a target in turn: x86-64 (no
AVX2: the entry points return 1), x86-64-v3 (AVX2 + FMA), x86-64-v4 (AVX-512 without bf16) and
sapphirerapids (AVX512-BF16 and AMX). The disassembly shows that each build uses its instruction set
(zmm registers, bf16 dot products), so a branch that a macro left out would fail too. Only the
baseline build is loaded and called: the others may not run on this CPU. $PREFIX_SERVICE_CPU_MARCH,
which builds the kernels for a named target, is checked here too."""
import ctypes
import shutil
import subprocess

import pytest
import torch

from prefix_service import cpuinfo
from prefix_service.backends.cpu import native, onednn
from prefix_service.errors import ConfigError
from prefix_service.model.loader import choose_dtype

CXX = native.compiler()
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler found (set CXX)")
needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the builds' code")


def known(march: str) -> bool:
    """Whether the compiler knows the target."""
    assert CXX is not None
    return subprocess.run([CXX, f"-march={march}", "-x", "c++", "-E", "-"], input="", capture_output=True,
                          text=True, check=False).returncode == 0


def flags_for(flags: tuple[str, ...], march: str) -> tuple[str, ...]:
    assert "-march=native" in flags
    return tuple(f"-march={march}" if f == "-march=native" else f for f in flags)


def native_build(march: str, tmp_path, monkeypatch):
    """The native library built for `march` in a cache of its own: its path."""
    if not known(march):
        pytest.skip(f"{CXX} does not know -march={march}")
    monkeypatch.setenv("PREFIX_SERVICE_CACHE_DIR", str(tmp_path))
    return native.compile_library(CXX, f"native-{march}", native.SOURCES, flags_for(native.FLAGS, march),
                                  key_parts=tuple(h.read_bytes() for h in native.HEADERS))


def code(path) -> str:
    """The disassembled instructions of an object or library."""
    proc = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True)
    return proc.stdout


@needs_cxx
def test_baseline_build_reports_no_vector_unit_and_refuses_work(tmp_path, monkeypatch):
    """Without AVX2 and FMA (plain x86-64) the library still builds, says so through ps_isa, and every
    entry point returns 1 instead of computing: what native.load() turns into its reason."""
    lib = ctypes.CDLL(str(native_build("x86-64", tmp_path, monkeypatch)))
    assert lib.ps_isa() == 0
    x = torch.ones(2, 16)
    y = torch.zeros(2, 16)
    lib.ps_linear.restype = ctypes.c_int
    lib.ps_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    assert lib.ps_linear(x.data_ptr(), 16, 2, 16, x.data_ptr(), 16, None, y.data_ptr(), 16, 1) == 1
    assert torch.count_nonzero(y) == 0


@needs_cxx
@needs_objdump
@pytest.mark.parametrize("march, wide", [("x86-64-v3", False), ("x86-64-v4", True), ("sapphirerapids", True)])
def test_native_library_builds_for_each_vector_width(march, wide, tmp_path, monkeypatch):
    """AVX2 builds compute in ymm registers with FMA and never touch zmm; AVX-512 builds in zmm."""
    text = code(native_build(march, tmp_path, monkeypatch))
    assert "vfmadd" in text
    assert ("zmm" in text) == wide
    assert "ymm" in text


@needs_cxx
@needs_objdump
@pytest.mark.parametrize("march, dots", [("x86-64-v4", False), ("sapphirerapids", True)])
def test_onednn_attention_builds_with_and_without_bf16_dot_products(march, dots, tmp_path):
    """The oneDNN library's attention source, compiled as onednn.build compiles it: with AVX512-BF16 its
    dot-product kernels (vdpbf16ps) are in the code; on AVX-512 without it, the code has none and still
    builds."""
    if not known(march):
        pytest.skip(f"{CXX} does not know -march={march}")
    assert CXX is not None
    source = next(s for s in onednn.SOURCES if s.name == "onednn_attention.cpp")
    cflags, _ = onednn._torch_flags()
    flags = [f for f in flags_for(onednn.FLAGS, march) if f not in ("-shared", "-fPIC")]
    obj = tmp_path / f"attention-{march}.o"
    proc = subprocess.run([CXX, *flags, *cflags, "-c", str(source), "-o", str(obj)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = code(obj)
    assert "zmm" in text
    assert ("vdpbf16ps" in text) == dots


@needs_cxx
@pytest.mark.parametrize("march, names", [("x86-64-v3", ["AVX2"]), ("x86-64-v4", ["AVX-512", "AVX2"]),
                                          ("cooperlake", ["AVX512-BF16", "AVX-512", "AVX2"]),
                                          ("sapphirerapids", ["AMX-BF16", "AVX512-BF16", "AVX-512", "AVX2"])])
def test_a_named_target_stands_for_the_cpu(march, names, llama_dir, monkeypatch):
    """$PREFIX_SERVICE_CPU_MARCH: the kernels' instruction sets are the target's, as the compiler enables
    them, whatever this CPU reports; model.dtype: auto still follows what the CPU reports (to oneDNN)."""
    if not known(march):
        pytest.skip(f"{CXX} does not know -march={march}")
    host = choose_dtype("auto", llama_dir, torch.device("cpu"))
    monkeypatch.setenv(cpuinfo.MARCH_ENV, march)
    assert cpuinfo.target() == march
    assert cpuinfo.isa(cpuinfo.kernel_flags()) == names
    assert choose_dtype("auto", llama_dir, torch.device("cpu")) == host
    for vendor in ("GenuineIntel", "AuthenticAMD"):  # Intel's bf16 dot products without AMX lose to float32
        faster = "AMX-BF16" in names or ("AVX512-BF16" in names and vendor != "GenuineIntel")
        assert choose_dtype("auto", llama_dir, torch.device("cpu"), cpu_flags=cpuinfo.kernel_flags(),
                            cpu_vendor=vendor)[0] == (torch.bfloat16 if faster else torch.float32)
    assert native.for_target(native.FLAGS) == flags_for(native.FLAGS, march)


def test_native_or_unset_keeps_the_host(monkeypatch):
    for value in ("", "native", " "):
        monkeypatch.setenv(cpuinfo.MARCH_ENV, value)
        assert cpuinfo.target() is None
        assert cpuinfo.kernel_flags() == cpuinfo.cpu_flags()
        assert native.for_target(native.FLAGS) == native.FLAGS
    monkeypatch.delenv(cpuinfo.MARCH_ENV)
    assert cpuinfo.kernel_flags() == cpuinfo.cpu_flags()


@needs_cxx
def test_an_unknown_target_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(cpuinfo.MARCH_ENV, "not-a-cpu")
    with pytest.raises(ValueError, match="PREFIX_SERVICE_CPU_MARCH=not-a-cpu: the compiler does not know"):
        cpuinfo.kernel_flags()
    # before any build: a config error, not a failed build that backend auto would leave out
    with pytest.raises(ConfigError, match="PREFIX_SERVICE_CPU_MARCH=not-a-cpu: the compiler does not know"):
        native.for_target(native.FLAGS)


@needs_cxx
@needs_objdump
def test_the_native_library_is_built_for_the_named_target(tmp_path, monkeypatch):
    """native.build under $PREFIX_SERVICE_CPU_MARCH=x86-64-v3 compiles AVX2 code (no zmm) into its own
    key, whatever this CPU is."""
    assert CXX is not None
    monkeypatch.setenv("PREFIX_SERVICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(cpuinfo.MARCH_ENV, "x86-64-v3")
    built = native.build(CXX)
    text = code(built)
    assert "vfmadd" in text and "zmm" not in text
