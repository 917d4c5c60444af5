"""Where a batched decode step's time goes: many requests continuing one pinned template.

One EngineCore runs in this process and thread. A template of --prefix-tokens random ids is pinned;
for each batch size of --batches, that many requests of --prompt-tokens ids name it and are stepped
until every one has its first token (their prefills are not timed); then --steps decode steps are
timed, each producing one token for every request, and the same number again under
bench/profiling.py's kernel_times (which observes the path that serves: the cpu backend's native
kernels time themselves, the torch backend's operators are read from torch's profiler). A step's time splits
into linear layers, attention (K/V store included), element-wise kernels where the backend times
them, and the rest: scheduling, input building, sampling, detokenizing, Python. The requests are
then aborted; the next batch starts from the template alone.

    python scripts/profile_decode.py --json bench_out/profile_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.bench.main import git_commit, machine_info  # noqa: E402
from prefix_service.bench.profiling import add_engine_args, engine_config, kernel_times, pin, with_scheduler  # noqa: E402
from prefix_service.engine.core import EngineCore  # noqa: E402
from prefix_service.sampling_params import SamplingParams  # noqa: E402

TEMPLATE = "profile_decode"


def decode_batch(core: EngineCore, prompts: list[list[int]], steps: int, tag: str) -> dict:
    """Seconds of each timed decode step and the kernel split of as many more, for len(prompts)
    requests on the template."""
    tokens = [0] * len(prompts)
    errors: list[str] = []

    def sink_for(i: int):
        def sink(out) -> None:
            tokens[i] += len(out.token_ids)
            if out.error is not None:
                errors.append(str(out.error))
        return sink

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        core.add_request(rid, prompt, TEMPLATE, SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True),
                         sink_for(i))
    while min(tokens) == 0:  # the prefills, untimed
        core.step()
    stats = core.kv_stats()
    if stats["running"] != len(prompts) or stats["waiting"]:
        raise RuntimeError(f"{stats['running']} of {len(prompts)} requests decode together ({stats['waiting']} wait): "
                           f"raise the KV cache or scheduler limits")
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        wall.append(time.perf_counter() - start)
    with kernel_times(core.backend) as kernel_ms:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        profiled = time.perf_counter() - start
    for rid in ids:
        core.abort(rid)
    while core.has_work():
        core.step()
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return {"wall": wall, "profiled_ms": profiled * 1e3 / steps,
            "kernels": {kind: ms / steps for kind, ms in kernel_ms.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--prefix-tokens", type=int, default=939)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--batches", default="1,16,64", help="requests decoding together, e.g. 1,16,64")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per batch (and as many profiled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: expected numbers like 1,16,64, got {args.batches!r}")
    if args.prefix_tokens < 1 or args.prompt_tokens < 1 or args.steps < 1 or min(args.batches) < 1:
        p.error("--prefix-tokens, --prompt-tokens, --steps and every --batches value must be >= 1")

    cfg = with_scheduler(engine_config(args), max_num_seqs=max(args.batches))  # the largest batch at once
    print(f"loading {cfg.model.path} ...", flush=True)
    core = EngineCore(cfg)
    arch = core.arch
    rng = random.Random(args.seed)
    pin(core, TEMPLATE, [rng.randrange(arch.vocab_size) for _ in range(args.prefix_tokens)])
    decode_batch(core, [[rng.randrange(arch.vocab_size) for _ in range(args.prompt_tokens)]], 2, "warmup")

    results = []
    for b in args.batches:
        prompts = [[rng.randrange(arch.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(b)]
        r = decode_batch(core, prompts, args.steps, f"batch{b}")
        step = statistics.median(r["wall"]) * 1e3
        kernels = {kind: round(ms, 3) for kind, ms in r["kernels"].items()}
        results.append({"batch": b, "step_p50_ms": round(step, 3), "step_min_ms": round(min(r["wall"]) * 1e3, 3),
                        "tok_s": round(b / step * 1e3, 1), "profiled_step_ms": round(r["profiled_ms"], 3),
                        "kernels_ms": kernels,
                        "other_ms": round(r["profiled_ms"] - sum(kernels.values()), 3)})
    core.check_integrity()

    kinds = sorted({k for r in results for k in r["kernels_ms"]})
    print(f"{os.path.basename(str(cfg.model.path).rstrip('/'))}: {arch.num_layers} layers, {core.device}, "
          f"{torch.get_num_threads()} threads, backend {core.backend.describe()}; template {args.prefix_tokens} "
          f"tokens, prompt {args.prompt_tokens}, {args.steps} steps per batch")
    print(f"{'batch':>5} {'step p50 ms':>11} {'min':>8} {'tok/s':>7} {'profiled':>9} "
          + " ".join(f"{k + ' ms':>14}" for k in kinds) + f" {'other ms':>9}")
    for r in results:
        print(f"{r['batch']:>5} {r['step_p50_ms']:>11.1f} {r['step_min_ms']:>8.1f} {r['tok_s']:>7.1f} "
              f"{r['profiled_step_ms']:>9.1f} " + " ".join(f"{r['kernels_ms'].get(k, 0.0):>14.1f}" for k in kinds)
              + f" {r['other_ms']:>9.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_info(), "model": str(cfg.model.path),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
                       "threads": torch.get_num_threads(), "backend": core.backend.name,
                       "dtype": str(core.dtype).removeprefix("torch."),
                       "kv_cache_dtype": str(core.backend.kv_dtype).removeprefix("torch."),
                       "prefix_tokens": args.prefix_tokens, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                       "results": results}, fh, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
