"""What the engine profiling scripts (scripts/profile_prefill.py, scripts/profile_decode.py) share:
the options that say which engine to build, the engine config they give, and pinning a template
by stepping an EngineCore in this thread."""
from __future__ import annotations

import argparse
import dataclasses

from prefix_service.bench.main import REPO
from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, load_config
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
    core.add_prefix(name, ids, {}, lambda r: result.setdefault("r", r))
    while core.has_work():
        core.step()
    if isinstance(result.get("r"), BaseException):
        raise result["r"]
