"""What the engine profiling scripts (scripts/profile_prefill.py, scripts/profile_decode.py) share:
the options that say which engine to build, the engine config they give, pinning a template by
stepping an EngineCore in this thread, and timing a backend's kernels by kind of work."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Iterator

import torch

from prefix_service.bench.main import REPO
from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, load_config
from prefix_service.backends.base import Backend
from prefix_service.engine.core import EngineCore

DEFAULT_CONFIG = str(REPO / "configs" / "default.yaml")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="service YAML (its engine part is used)")
    p.add_argument("--model", help="a model directory instead of the config's (default cache settings)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="with --model")
    p.add_argument("--threads", type=int, help="torch threads (default: the config's, else torch's)")
    p.add_argument("--backend", choices=("auto", "torch", "cpu", "cuda"), help="model.backend (default: the config's)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config's engine (or --model's with default settings), --threads and --backend applied,
    prefix support on."""
    if args.model:
        cfg = EngineConfig(ModelConfig(path=args.model, load_format=args.load_format), CacheConfig())
    else:
        cfg = load_config(args.config).engine
    if args.threads:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_threads=args.threads))
    if args.backend:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, backend=args.backend))
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, enable_prefix=True))


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
    profiler is read over the operators it runs."""
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
        raise NotImplementedError("the cuda backend has no kernel timers yet; profile it with torch.profiler "
                                  "(CUDA activity) or nsys")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield times
    times.update(linear=0.0, attention=0.0)
    for event in prof.events():
        kind = _torch_op_kind(event.name)
        if kind is not None:
            times[kind] += event.self_cpu_time_total / 1e3


_LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear")
_ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::logsumexp", "aten::index_copy_")  # the math path, the store


def _torch_op_kind(name: str) -> str | None:
    if name in _LINEAR_OPS:
        return "linear"
    if "attention" in name or name in _ATTENTION_OPS:
        return "attention"
    return None
