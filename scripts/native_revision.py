"""The native library (prefix_service/backends/cpu/csrc) as a git revision of this repository has it,
built here with the working tree's flags: the other side of a kernel A/B in one process
(`scripts/bench_cpu_decode_call.py --against REV`, `scripts/bench_cpu_linear.py --against REV`)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from prefix_service.backends.cpu import native  # noqa: E402


class RevisionUnavailable(Exception):
    """REV names no commit here, or its library does not build: the message says which and why."""


def library_of(rev: str) -> tuple[str, ctypes.CDLL]:
    """(the commit `rev` names, its library built and loaded: library_at), or RevisionUnavailable
    ("no library of REV: why")."""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", rev], check=True, capture_output=True,
                                text=True).stdout.strip()
        with tempfile.TemporaryDirectory() as folder:
            return commit, library_at(rev, Path(folder))
    except (subprocess.CalledProcessError, native.NativeBuildError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        detail = detail.decode() if isinstance(detail, bytes) else detail
        raise RevisionUnavailable(f"no library of {rev}: {detail.strip()}") from exc


def library_at(rev: str, folder: Path) -> ctypes.CDLL:
    """Revision `rev`'s sources of the library (native.SOURCES) and headers from git into `folder`,
    built as native.build builds the working tree's and loaded, with the working tree's signature set
    on each entry point `rev` has."""
    csrc = native.CSRC.resolve().relative_to(Path(ROOT).resolve()).as_posix()
    for path in (*native.SOURCES, *native.HEADERS):
        (folder / path.name).write_bytes(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{csrc}/{path.name}"],
                                                        check=True, capture_output=True).stdout)
    cxx = native.compiler()
    if cxx is None:
        raise native.NativeBuildError("no C++ compiler found (set CXX)")
    built = native.compile_library(cxx, "prefix_service_native", tuple(folder / p.name for p in native.SOURCES),
                                   key_parts=tuple((folder / h.name).read_bytes() for h in native.HEADERS))
    lib = ctypes.CDLL(str(built))
    for name, (args, res) in native.SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
    return lib
