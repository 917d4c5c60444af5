"""Native CPU prefill and decode attention (csrc/cpu_attention.cpp). The decoder stack calls the
kernels from C++ (stack.py; tests call them one at a time through tests/native_harness.py); here
are the layouts they read: `pack_keys` / `pack_values` make the one a packed template is held in,
and KV_DTYPES and HEAD_SIZES say what cache and head sizes they take.

torch's CPU flash kernel does its products with the BLAS torch links, block by block; on small
head sizes and on CPUs MKL does not tune for, that runs at a fraction of the machine's FLOP rate
(docs/benchmarks.md). This kernel makes a prefill's scores 64 keys at a time in AVX-512 (or AVX2)
registers, exponentiates them with a polynomial exp, and accumulates P V in the same pass, for
all query heads of a KV head together, in one OpenMP parallel region on torch's own threads.
A pinned template's keys may come packed at pin time (PackedTemplate), so a request that
continues it reads them without any per-call reordering. The rest of a context is read through
the sequence's block table, and the new tokens' K/V can be stored into their cache slots by the
same call, so a layer's attention needs no torch operation around it.

It lives in the native library (native.py), built on first use with the system C++ compiler;
`available()` says why it cannot be used.
"""
from __future__ import annotations

import torch

from prefix_service.backends.cpu import native

PANEL = 16  # keys per K panel: the layout of pack_keys, as the kernel reads it
HEAD_SIZES = range(16, 257, 16)  # head sizes the kernel takes
KV_DTYPES = (torch.float32, torch.bfloat16)  # what the paged cache may hold (the arithmetic is float32)


def available() -> str | None:
    """None when the native kernel can be used here, else the reason."""
    return native.load()[1]


def pack_keys(k: torch.Tensor) -> torch.Tensor:
    """k [R, Hkv, D] -> the kernel's template K layout [Hkv, ceil(R/16), D, 16], zero-padded."""
    r, hkv, d = k.shape
    pad = -r % PANEL
    if pad:
        k = torch.cat([k, k.new_zeros(pad, hkv, d)])
    return k.view(-1, PANEL, hkv, d).permute(2, 0, 3, 1).contiguous()


def pack_values(v: torch.Tensor) -> torch.Tensor:
    """v [R, Hkv, D] -> the kernel's template V layout [Hkv, R, D]."""
    return v.transpose(0, 1).contiguous()
