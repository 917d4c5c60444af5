"""Just-in-time build and load of the cuda_ops CUDA kernels (csrc/) on first use.

`cuda_ops_available()` says, without compiling and without raising, whether the kernels can
be used at all (CUDA torch, a visible GPU, not disabled). `load_cuda_ops()` compiles them with
torch.utils.cpp_extension into a cache directory the first time (about a minute), loads the
library and returns the op namespace `torch.ops.prefix_service_ops`; a failed build raises a
RuntimeError carrying the tail of the compiler log, and later calls re-raise it without
rebuilding.

Environment:
  PREFIX_SERVICE_CUDA_OPS_CACHE    build cache root (default ~/.cache/prefix_service/cuda_ops)
  PREFIX_SERVICE_DISABLE_CUDA_OPS  "1": never use the kernels (the torch references run)
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "PREFIX_SERVICE_CUDA_OPS_CACHE"
DISABLE_ENV = "PREFIX_SERVICE_DISABLE_CUDA_OPS"
EXTENSION_NAME = "prefix_service_cuda_ops"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("kv_ops.cpp", "kv_ops.cu")
LOG_TAIL_LINES = 60

_lock = threading.Lock()
_ops = None  # torch.ops.prefix_service_ops once loaded
_error: RuntimeError | None = None  # the first build failure, re-raised on later calls


_references_reason: str | None = None  # set by use_references: the kernels are off in this process


def use_references(reason: str) -> None:
    """Turn the kernels off in this process (the torch reference ops run instead), e.g. after
    their build failed; `reason` is what references_reason() says."""
    global _references_reason
    _references_reason = reason


def references_reason() -> str | None:
    """Why this process runs the references although a GPU is here (use_references), else None."""
    return _references_reason


def cuda_ops_available() -> bool:
    """True when CUDA kernels can be used here: torch built with CUDA, a GPU visible, and not
    disabled by PREFIX_SERVICE_DISABLE_CUDA_OPS or use_references. Never raises and never compiles."""
    try:
        if _references_reason is not None or os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            return False
        return torch.version.cuda is not None and torch.cuda.is_available()
    except Exception:  # a broken driver install must not break the CPU path
        return False


def build_directory() -> Path:
    """Cache directory for this torch / CUDA / GPU-arch combination."""
    root = os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "prefix_service", "cuda_ops")
    major, minor = torch.cuda.get_device_capability()
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{major}{minor}".replace("+", "_")
    return Path(root).expanduser() / tag


def load_cuda_ops():
    """Compile (first use) and load the kernels; returns `torch.ops.prefix_service_ops`.

    Raises RuntimeError when torch has no CUDA, no GPU is visible, ninja is missing, or the
    build fails (with the compiler log's tail)."""
    global _ops, _error
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is None:
            if _error is not None:
                raise _error
            try:
                _ops = _build_and_load()
            except RuntimeError as exc:
                _error = exc
                raise
    return _ops


def _build_and_load():
    if torch.version.cuda is None:
        raise RuntimeError(
            f"cuda_ops: this torch ({torch.__version__}) is built without CUDA; "
            "the CUDA kernels cannot be built (the torch reference ops still work)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_ops: no CUDA GPU is visible; the CUDA kernels cannot be loaded")
    from torch.utils import cpp_extension  # imported late: it is slow and needs only CUDA hosts

    if not cpp_extension.is_ninja_available():
        raise RuntimeError(
            "cuda_ops: ninja is required to compile the CUDA kernels "
            "(pip install ninja)"
        )
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    if _needs_compile(build_dir / f"{EXTENSION_NAME}.so"):
        logger.warning("compiling cuda_ops kernels (first use, ~1 min) into %s ...", build_dir)
    try:
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(CSRC_DIR / s) for s in SOURCES],
            extra_cflags=["-O3"],
            # An explicit -gencode stops cpp_extension from adding its own arch list.
            extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            build_directory=str(build_dir),
            is_python_module=False,  # TORCH_LIBRARY registers torch.ops.prefix_service_ops
            verbose=False,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError, loader errors as OSError
        tail = "\n".join(str(exc).splitlines()[-LOG_TAIL_LINES:])
        raise RuntimeError(
            f"cuda_ops: compiling the CUDA kernels for sm_{arch} failed (build directory "
            f"{build_dir}). Set {DISABLE_ENV}=1 to run the torch reference ops instead.\n"
            f"--- compiler output (last {LOG_TAIL_LINES} lines) ---\n{tail}"
        ) from exc
    return torch.ops.prefix_service_ops


def _needs_compile(library: Path) -> bool:
    """No built library yet, or a source newer than it (then cpp_extension rebuilds)."""
    if not library.exists():
        return True
    built = library.stat().st_mtime
    return any(p.stat().st_mtime > built for p in CSRC_DIR.iterdir() if p.is_file())
