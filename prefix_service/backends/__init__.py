"""Execution backends: everything platform-specific, behind one protocol (base.py).

| backend | runs | where |
| --- | --- | --- |
| `torch` | the model's reference forward; attention in plain torch (SDPA over gathered K/V, cascade decode) | any device; the oracle |
| `cpu` | the native library: all layers in one call, AVX-512 or AVX2 kernels, templates' K/V packed | an x86-64 CPU with AVX-512 or AVX2 + FMA and a C++ compiler, float32 |
| `cuda` | the reference forward with cuda_ops' store and concat kernels, FlashAttention varlen, Triton paged decode | a CUDA GPU |

`select_backend` picks one once, from `model.backend` (auto, torch, cpu, cuda), by `pick_backend`'s
rule, and logs why.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from prefix_service.backends import hostmem
from prefix_service.backends.base import Backend, StepTensors
from prefix_service.config import BACKENDS
from prefix_service.errors import ConfigError
from prefix_service.model.llama import ModelArch

__all__ = ["Backend", "StepTensors", "cpu_kernel_choices", "pick_backend", "select_backend"]

log = logging.getLogger("prefix_service.engine")


def pick_backend(choice: str, device: torch.device, dtype: torch.dtype, arch: ModelArch) -> tuple[str, str, bool]:
    """select_backend's rule, without its side effects: (the backend's name, why, whether it is the
    torch backend standing in for a cpu backend that cannot run here). Raises ConfigError when the
    backend asked for cannot run here."""
    if choice not in BACKENDS:
        raise ConfigError(f"model.backend: {choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "cuda" or (choice == "auto" and device.type == "cuda"):
        if device.type != "cuda":
            raise ConfigError(f"model.backend: 'cuda' needs a CUDA device, the model is on {device} (model.device)")
        return "cuda", "asked for" if choice == "cuda" else "auto, on a CUDA device", False
    if choice in ("cpu", "auto") and device.type == "cpu":
        from prefix_service.backends.cpu.backend import CpuBackend
        why = CpuBackend.unsupported(arch, dtype)
        if why is None:
            return "cpu", "asked for" if choice == "cpu" else "auto, the native CPU kernels run here", False
        if choice == "cpu":
            raise ConfigError(f"model.backend: cpu was asked for, but {why}; use auto or torch")
        return "torch", f"the cpu backend cannot run here, as {why}", True
    if choice == "cpu":
        raise ConfigError(f"model.backend: 'cpu' runs on the CPU, the model is on {device} (model.device)")
    return "torch", "asked for" if choice == "torch" else f"auto, on {device}", False


def select_backend(choice: str, device: torch.device, dtype: torch.dtype, arch: ModelArch) -> type[Backend]:
    """The backend class for model.backend = `choice` on `device` (pick_backend): auto is cuda on a
    GPU, cpu where its native library builds and runs the model, torch otherwise (with a warning
    saying why). Raises ConfigError when the backend asked for cannot run here.

    On a CPU it first fixes glibc malloc's thresholds for the process (hostmem.py). That must come
    before the engine allocates what it keeps (the tokenizer, the model's weights): with the
    thresholds set later, long prefills on the engine's thread faulted on fresh pages for most of
    their activations, every step (docs/benchmarks.md)."""
    if device.type == "cpu":
        hostmem.keep_freed_memory()
    name, why, stands_in = pick_backend(choice, device, dtype, arch)
    if name == "cuda":
        from prefix_service.backends.cuda.backend import CudaBackend
        log.info("backend cuda: %s", why)
        return CudaBackend
    if name == "cpu":
        from prefix_service.backends.cpu import native
        from prefix_service.backends.cpu.backend import CpuBackend
        log.info("backend cpu (%s kernels): %s", native.isa(), why)
        return CpuBackend
    (log.warning if stands_in else log.info)("backend torch: %s", why)
    from prefix_service.backends.torch.backend import TorchBackend
    return TorchBackend


def cpu_kernel_choices(dtype: torch.dtype | None, head_size: int | None,
                       probe: Callable[[Callable[[], Any]], Any]) -> dict[str, Any]:
    """What the cpu backend's kernels would run here for a model of `dtype` (None: both dtypes') and
    `head_size` (None: unknown), each choice through `probe` (which reports a choice that raises in
    its place): the report `prefix-service env` shows (backends/cpu/choices.py)."""
    from prefix_service.backends.cpu.choices import kernel_choices
    return kernel_choices(dtype, head_size, probe)
