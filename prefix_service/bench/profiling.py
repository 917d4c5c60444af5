"""What the engine profiling scripts (scripts/profile_prefill.py, scripts/profile_decode.py) share:
the options that say which engine to build, the engine config they give, pinning a template by
stepping an EngineCore in this thread, and timing a backend's kernels by kind of work."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import Iterator

import torch

from prefix_service.bench.main import REPO
from prefix_service.config import KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, EngineConfig, ModelConfig, load_config
from prefix_service.backends.base import Backend
from prefix_service.engine.core import EngineCore

DEFAULT_CONFIG = str(REPO / "configs" / "default.yaml")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="service YAML (its engine part is used)")
    p.add_argument("--model", help="a model directory instead of the config's (default cache settings)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="with --model")
    p.add_argument("--threads", type=int, help="torch threads (default: the config's, else torch's)")
    p.add_argument("--backend", choices=("auto", "torch", "cpu", "cuda"), help="model.backend (default: the config's)")
    p.add_argument("--dtype", help="model.dtype (default: the config's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="model.device (default: the config's)")
    p.add_argument("--kv-cache-memory", help="cache.kv_cache_memory, e.g. 16GiB (default: the config's)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="cache.kv_cache_dtype (default: the config's)")
    p.add_argument("--cuda-graph-max-batch", type=int, help="model.cuda_graph_max_batch (0: eager; default: the config's)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, help="model.quantization (default: the config's)")
    p.add_argument("--cuda-fused-layers", type=int, choices=(0, 1),
                   help="model.cuda_fused_layers (0: the model's reference layers; default: the config's)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config's engine (or --model's with default settings), --threads and --backend applied,
    prefix support on, speculative decoding off (a timed decode step computes one token a request;
    scripts/bench_speculative.py times drafts)."""
    if args.model:
        cfg = EngineConfig(ModelConfig(path=args.model, load_format=args.load_format), CacheConfig())
    else:
        cfg = load_config(args.config).engine
    if args.threads:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_threads=args.threads))
    if args.backend:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, backend=args.backend))
    if getattr(args, "kv_cache_memory", None):
        from prefix_service.config import parse_size_or_auto
        size = parse_size_or_auto(args.kv_cache_memory, "--kv-cache-memory")
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_memory=size, num_blocks=None))
    if getattr(args, "kv_cache_dtype", None):
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, kv_cache_dtype=args.kv_cache_dtype))
    for field in ("dtype", "device", "cuda_graph_max_batch", "quantization"):
        if getattr(args, field, None) is not None:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{field: getattr(args, field)}))
    if getattr(args, "cuda_fused_layers", None) is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, cuda_fused_layers=bool(args.cuda_fused_layers)))
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, enable_prefix=True),
                               scheduler=dataclasses.replace(cfg.scheduler, speculative_tokens=0))


def with_scheduler(cfg: EngineConfig, **at_least: int) -> EngineConfig:
    """cfg with each named scheduler limit raised to at least the value given."""
    sched = cfg.scheduler
    raised = {k: max(v, getattr(sched, k)) for k, v in at_least.items()}
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(sched, **raised))


def pin(core: EngineCore, name: str, ids: list[int]) -> None:
    """Pin a template of these ids, stepping the engine here until it is done."""
    result: dict = {}
    core.add_template(name, ids, {}, lambda r: result.setdefault("r", r))
    while core.has_work():
        core.step()
    if isinstance(result.get("r"), BaseException):
        raise result["r"]


@contextlib.contextmanager
def kernel_times(backend: Backend) -> Iterator[dict[str, float]]:
    """Time the forwards `backend` runs inside, by kind of work, without changing what runs: yields
    a dict that holds, on exit, milliseconds in 'linear' (the linear layers, the output head
    included) and 'attention' (K/V store and attention), and for the cpu backend 'elementwise'.
    The cpu backend's native kernels time themselves (csrc/timers.h); for the torch backend, torch's
    profiler is read over the operators it runs; for the cuda backend, over the device's kernels
    (GPU time: 'linear', 'attention', 'elementwise'; a step whose wall time is well above their sum
    waits on the host), and the busiest kernels are printed to stderr."""
    times: dict[str, float] = {}
    if backend.name == "cpu":
        from prefix_service.backends.cpu.stack import kernel_timers
        kernel_timers(True)
        try:
            yield times
        finally:
            times.update(kernel_timers(False))
        return
    if backend.name == "cuda":
        yield from _cuda_kernel_times()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield times
    times.update(linear=0.0, attention=0.0)
    for event in prof.events():
        kind = _torch_op_kind(event.name)
        if kind is not None:
            times[kind] += event.self_cpu_time_total / 1e3


_GEMM_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma")
_ATTENTION_KERNELS = ("decode_kernel", "flash", "fmha", "attention", "attn", "concat_kv", "store_kv")


def _cuda_kernel_times() -> Iterator[dict[str, float]]:
    times: dict[str, float] = {}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        yield times
    torch.cuda.synchronize()
    times.update(linear=0.0, attention=0.0, elementwise=0.0)
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = getattr(event, "self_device_time_total", None)
        ms = (ms if ms is not None else event.self_cuda_time_total) / 1e3
        name = event.name.lower()
        kind = ("linear" if any(k in name for k in _GEMM_KERNELS) else
                "attention" if any(k in name for k in _ATTENTION_KERNELS) else "elementwise")
        times[kind] += ms
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + ms
    busiest = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    print("busiest kernels (ms over the profiled steps): " + "; ".join(f"{n[:60]} {ms:.2f}" for n, ms in busiest),
          file=sys.stderr, flush=True)


_LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear")
_ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::logsumexp", "aten::index_copy_")  # the math path, the store


def _torch_op_kind(name: str) -> str | None:
    if name in _LINEAR_OPS:
        return "linear"
    if "attention" in name or name in _ATTENTION_OPS:
        return "attention"
    return None
