"""glibc malloc settings for an engine that computes on the CPU.

torch's CPU tensors come from malloc. A prefill of a thousand tokens allocates and frees a few
hundred megabytes of activations per forward, in blocks of up to tens of megabytes. glibc's
defaults adapt to the history of the process: blocks above a moving threshold are mapped afresh
for each allocation, and free memory at the top of a heap beyond another threshold is handed back
to the kernel, so the next forward takes a page fault for every 4 KiB it touches again
(docs/benchmarks.md measures what that costs a long prefill). `keep_freed_memory` fixes both thresholds:
blocks up to 32 MiB (glibc's largest mapping threshold) come from the heap, and up to 1 GiB of
freed heap is kept for reuse.

A thread other than the main one (the Engine's loop thread) allocates from an arena of its own,
made of heaps of at most 64 MiB each, and glibc unmaps such a heap as soon as it is entirely free,
whatever the trim threshold says, unless the heap below it has less room left than the top pad. A
step that needs a second heap (a long prefill's operator outputs) then maps it afresh and faults on
every page of it each time, or not, depending on where earlier allocations happened to land. The top
pad is therefore set to 64 MiB too: no heap of a thread's arena is unmapped once it has been needed,
and the main heap keeps that much beyond its top (address space only, until used).

An operator's own settings win: nothing is changed when MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or GLIBC_TUNABLES is set, or the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger("prefix_service.engine")

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # the size of a thread arena's heap (HEAP_MAX_SIZE on 64-bit)
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_applied: str | None = None


def keep_freed_memory() -> str:
    """Set glibc's mapping and trim thresholds and its top pad (process-wide, once). Returns what was done."""
    global _applied
    if _applied is not None:
        return _applied
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _applied = f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'}): malloc left as is"
    elif any(os.environ.get(name) for name in _ENV):
        _applied = "malloc settings from the environment kept"
    else:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in
                 ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
        _applied = (f"malloc: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, up to {TRIM_THRESHOLD >> 20} MiB "
                    f"of freed heap kept, {TOP_PAD >> 20} MiB top pad" if ok
                    else "mallopt refused the settings: malloc left as is")
    log.info("%s", _applied)
    return _applied
