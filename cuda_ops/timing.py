"""GPU time of a call for the op benchmarks (scripts/bench_cuda_ops.py, scripts/bench_cuda_layers.py):
CUDA events around calls queued back to back, and the device's plain copy rate to set them against."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch


def add_timing_args(p: argparse.ArgumentParser, reps: int) -> None:
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30, help="timed samples; the median is reported")
    p.add_argument("--reps", type=int, default=reps, help="calls per timed sample")
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")


def gpu_or_say(script: str) -> bool:
    """Whether a GPU is here; else says so on stderr (the script then exits with status 2)."""
    if torch.cuda.is_available():
        return True
    print(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
    return False


def write_results(args: argparse.Namespace, copy_gbps: float, rows: list[dict]) -> None:
    """The device, the copy rate, the arguments and the rows, as JSON into args.json (if given)."""
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                         cuda=torch.version.cuda, copy_gbps=copy_gbps, config=config, rows=rows),
                                    indent=2))
    print(f"wrote {args.json}")


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
