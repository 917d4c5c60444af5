"""GPU time of a call for the op benchmarks (scripts/bench_cuda_ops.py, scripts/bench_cuda_layers.py):
CUDA events around calls queued back to back, and the device's plain copy rate to set them against."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int, iters: int, reps: int) -> float:
    """Median over `iters` samples of the mean time of `reps` back-to-back calls, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def copy_bandwidth_gbps(warmup: int, iters: int) -> float:
    """GB/s of `dst.copy_(src)` of a 1 GiB tensor on the device, reads and writes counted."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, iters, 1)
    return 2 * src.numel() / (ms * 1e-3) / 1e9
