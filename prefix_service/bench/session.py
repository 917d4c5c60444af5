"""One benchmark session: config -> tokenizer -> workloads -> systems -> modes -> records.
Everything it starts (engines, the transformers batching thread, the server process) is stopped
on the way out, also on errors and Ctrl-C."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import warnings
from typing import Any

from prefix_service.bench.plan import Plan
from prefix_service.bench.runner import Runner, build_systems
from prefix_service.bench.systems import peer_of
from prefix_service.bench.systems.vllm import VllmSystem
from prefix_service.bench.workloads import build_workload
from prefix_service.config import load_config
from prefix_service.heap import freeze_startup_objects


def run(plan: Plan, config_path: str, *, model_path: str | None = None, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from prefix_service.model.loader import load_tokenizer, read_arch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    config = load_config(config_path)
    engine_config = config.engine
    if model_path:
        engine_config = dataclasses.replace(engine_config, model=dataclasses.replace(
            engine_config.model, path=os.path.abspath(model_path)))
    tokenizer = load_tokenizer(engine_config.model.path)
    workloads = {name: build_workload(name, tokenizer, plan.sizes) for name in plan.workloads}
    arch = read_arch(engine_config.model.path)

    bar = tqdm(total=plan.expected_requests(), unit="req", disable=not progress, dynamic_ncols=True)
    with bar, contextlib.ExitStack() as stack:
        status = bar.set_description_str
        skipped: dict[str, str] = {}
        systems = build_systems(plan, engine_config, list(workloads.values()), tokenizer, stack, status, skipped)
        def expect_more(n: int) -> None:
            bar.total += n
            bar.refresh()

        runner = Runner(plan, systems, workloads, lambda: bar.update(1), status, expect_more)
        runner.prepare()
        # no full collection pauses a timed request (prefix_service/heap.py); undone after the modes,
        # so that a caller in the same process (the tests run the benchmark in theirs) keeps its heap
        freeze_startup_objects()
        stack.callback(gc.unfreeze)
        for mode in plan.modes:
            getattr(runner, mode)()
        status("done")
        extra: dict[str, Any] = {}
        kv_blocks = next((s.kv_num_blocks for s in systems if getattr(s, "kv_num_blocks", None)), None)
        pinned = {s.name: s.kv_blocks_pinned() for s in systems if getattr(s, "kv_num_blocks", None)}
        if pinned:
            extra["pinned_kv_blocks_at_end"] = pinned
        mismatches = {s.name: s.usage_mismatches for s in systems
                      if hasattr(s, "usage_mismatches") and peer_of(s.name) is None}
        if mismatches:
            extra["grpc_usage_mismatches"] = mismatches
        peers = {s.name: {**s.server.settings, "usage_mismatches": s.usage_mismatches}
                 for s in systems if isinstance(s, VllmSystem)}
        if peers:
            extra["peers"] = peers
        if skipped:
            extra["skipped_systems"] = skipped
    model = {"path": engine_config.model.path, "name": os.path.basename(engine_config.model.path.rstrip("/")),
             "layers": arch.num_layers, "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size,
             "dtype": engine_config.model.dtype, "device": engine_config.model.device,
             "block_size": engine_config.cache.block_size,
             "kv_cache_memory": engine_config.cache.kv_cache_memory, "kv_cache_dtype": engine_config.cache.kv_cache_dtype,
             "kv_blocks": kv_blocks,
             "max_num_batched_tokens": engine_config.scheduler.max_num_batched_tokens,
             "max_num_seqs": engine_config.scheduler.max_num_seqs}
    return {"model": model, "workloads": {n: w.describe() for n, w in workloads.items()},
            "records": runner.records, "extra": extra}
