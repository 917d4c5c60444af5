"""Execution backends: everything platform-specific, behind one protocol (base.py).

| backend | runs | where |
| --- | --- | --- |
| `torch` | the model's reference forward; attention in plain torch (SDPA over gathered K/V, cascade decode) | any device; the oracle |
| `cpu` | the native library: all layers in one call, AVX-512 or AVX2 kernels, templates' K/V packed | an x86-64 CPU with AVX-512 or AVX2 + FMA and a C++ compiler, float32 |
| `cuda` | the reference forward with cuda_ops' store and concat kernels, FlashAttention varlen, Triton paged decode | a CUDA GPU |

`select_backend` picks one once, from `model.backend` (auto, torch, cpu, cuda), and logs why.
"""
from __future__ import annotations

import logging

import torch

from prefix_service.backends import hostmem
from prefix_service.backends.base import Backend, StepTensors
from prefix_service.config import BACKENDS
from prefix_service.errors import ConfigError
from prefix_service.model.llama import ModelArch

__all__ = ["Backend", "StepTensors", "select_backend"]

log = logging.getLogger("prefix_service.engine")


def select_backend(choice: str, device: torch.device, dtype: torch.dtype, arch: ModelArch) -> type[Backend]:
    """The backend class for model.backend = `choice` on `device`: auto is cuda on a GPU, cpu where
    its native library builds and runs the model, torch otherwise (with a warning saying why).
    Raises ConfigError when the backend asked for cannot run here.

    On a CPU it first fixes glibc malloc's thresholds for the process (hostmem.py). That must come
    before the engine allocates what it keeps (the tokenizer, the model's weights): with the
    thresholds set later, long prefills on the engine's thread faulted on fresh pages for most of
    their activations, every step (docs/benchmarks.md)."""
    if device.type == "cpu":
        hostmem.keep_freed_memory()
    if choice not in BACKENDS:
        raise ConfigError(f"model.backend: {choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "cuda" or (choice == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ConfigError(f"model.backend: 'cuda' needs a CUDA device, the model is on {device} (model.device)")
        from prefix_service.backends.cuda.backend import CudaBackend
        log.info("backend cuda: %s", "asked for" if choice == "cuda" else "auto, on a CUDA device")
        return CudaBackend
    if choice in ("cpu", "auto") and device.type == "cpu":
        from prefix_service.backends.cpu.backend import CpuBackend
        why = CpuBackend.unsupported(arch, dtype)
        if why is None:
            from prefix_service.backends.cpu import native
            log.info("backend cpu (%s kernels): %s", native.isa(),
                     "asked for" if choice == "cpu" else "auto, the native CPU kernels run here")
            return CpuBackend
        if choice == "cpu":
            raise ConfigError(f"model.backend: cpu was asked for, but {why}; use auto or torch")
        log.warning("backend torch: the cpu backend cannot run here, as %s", why)
    elif choice == "cpu":
        raise ConfigError(f"model.backend: 'cpu' runs on the CPU, the model is on {device} (model.device)")
    else:
        log.info("backend torch: %s", "asked for" if choice == "torch" else f"auto, on {device}")
    from prefix_service.backends.torch.backend import TorchBackend
    return TorchBackend
