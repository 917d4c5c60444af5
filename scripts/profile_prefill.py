"""Where a prefill's time goes, with the named prefix and without it, in the engine's own steps.

One EngineCore runs in this process and thread. A template of --prefix-tokens random ids is pinned;
then requests of --prompt-tokens ids run one at a time, taking turns: (a) naming the template, so
only the prompt is computed over the pinned KV, (b) the template's ids and the prompt's with no
prefix, all of them computed, and (c) the prompt's ids alone (path alone): what the template's
attention adds to a prompt of the same length. Where the backend packs the template's K/V (cache.pack_prefix_kv on the cpu backend), a
second engine with packing off runs (a) too (path prefix_unpacked), in the same turns. For each:
time to first token (median and min over --runs), and, over --profile-runs more, the time in
linear layers, in attention, and in everything else (element-wise work, the scheduler, Python),
the last being the wall time minus the first two. The split comes from bench/profiling.py's
kernel_times, which observes the path that serves: the cpu backend's native kernels time
themselves, the torch backend's operators are read from torch's profiler.

Next to the times, each path's FLOPs (linear layers: 2 x tokens x weights; attention: 4 x heads x
head_dim x the keys each query sees). Their quotient is the TTFT ratio a prefix would give if both
paths ran at the same FLOP rate with no fixed cost per step; the measured ratio falls short of it
by the short path's lower efficiency (fewer rows per matmul, the same per-step overhead).

    python scripts/profile_prefill.py --json bench_out/profile_prefill.json
"""
from __future__ import annotations

import argparse
import dataclasses
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

TEMPLATE = "profile_prefill"


class Runner:
    def __init__(self, core: EngineCore, prefix_ids: list[int]) -> None:
        self.core = core
        self.prefix_ids = prefix_ids
        self.count = 0

    def pin(self) -> None:
        pin(self.core, TEMPLATE, self.prefix_ids)

    def ttft(self, prompt_ids: list[int], mode: str) -> float:
        """Seconds from submit to the first token, stepping the engine here. mode: "template" (the prompt on the
        pinned template, by name), "full" (the template's ids and the prompt's, no prefix) or "alone" (the
        prompt's ids, no prefix)."""
        first: list[float] = []
        errors: list[str] = []

        def sink(out) -> None:
            if out.token_ids and not first:
                first.append(time.perf_counter())
            if out.error is not None:
                errors.append(str(out.error))

        self.count += 1
        ids = self.prefix_ids + prompt_ids if mode == "full" else prompt_ids
        start = time.perf_counter()
        self.core.add_request(f"profile-{self.count}", ids, TEMPLATE if mode == "template" else None,
                              SamplingParams(max_tokens=1, ignore_eos=True), sink)
        while self.core.has_work():
            self.core.step()
        if errors or not first:
            raise RuntimeError(f"the request failed: {errors or 'no token'}")
        return first[0] - start


PATHS = ("prefix", "no_prefix", "alone", "prefix_unpacked")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--prefix-tokens", type=int, default=900)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--runs", type=int, default=10, help="timed requests per path")
    p.add_argument("--profile-runs", type=int, default=3, help="profiled requests per path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"the paths to run, of {', '.join(PATHS)} (prefix_unpacked only where the backend packs)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.prefix_tokens < 1 or args.prompt_tokens < 1 or args.runs < 1 or args.profile_runs < 0:
        p.error("--prefix-tokens, --prompt-tokens and --runs must be >= 1, --profile-runs >= 0")
    wanted = [name for name in args.paths.split(",") if name]
    if not wanted or any(name not in PATHS for name in wanted):
        p.error(f"--paths: names of {', '.join(PATHS)} are needed, got {args.paths!r}")

    # room for one request with the whole template in one step, whatever the config says
    cfg = with_scheduler(engine_config(args), max_num_batched_tokens=args.prefix_tokens + args.prompt_tokens + 1)
    print(f"loading {cfg.model.path} ...", flush=True)
    core = EngineCore(cfg)
    arch = core.arch
    rng = random.Random(args.seed)
    prefix_ids = [rng.randrange(arch.vocab_size) for _ in range(args.prefix_tokens)]
    runner = Runner(core, prefix_ids)
    runner.pin()
    prompts = [[rng.randrange(arch.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(2 + args.runs + args.profile_runs)]
    # path: (the engine, what the request holds); where the template's K/V is packed, the same requests
    # also run on an engine that does not pack (prefix_unpacked): what the packing buys, in the same turns
    paths = {name: path for name, path in (("prefix", (runner, "template")), ("no_prefix", (runner, "full")),
                                           ("alone", (runner, "alone"))) if name in wanted}
    if "prefix_unpacked" in wanted and core.kv_stats()["packed_template_bytes"]:
        unpacked = Runner(EngineCore(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, pack_prefix_kv=False))),
                          prefix_ids)
        unpacked.pin()
        paths["prefix_unpacked"] = (unpacked, "template")
    for prompt in prompts[:2]:  # warm-up
        for path_runner, mode in paths.values():
            path_runner.ttft(prompt, mode)

    times: dict[str, list[float]] = {name: [] for name in paths}
    for i, prompt in enumerate(prompts[2:2 + args.runs]):
        order = list(paths.items()) if i % 2 == 0 else list(paths.items())[::-1]
        for name, (path_runner, mode) in order:  # in turns, so a slow spell of the machine hits every path
            times[name].append(path_runner.ttft(prompt, mode))

    split: dict[str, dict[str, float]] = {name: {"linear": 0.0, "attention": 0.0} for name in paths}
    profiled: dict[str, float] = {name: 0.0 for name in paths}  # the profiled requests' own TTFT, ms per request
    if args.profile_runs:
        for name, (path_runner, mode) in paths.items():
            with kernel_times(path_runner.core.backend) as kernel_ms:
                for prompt in prompts[2 + args.runs:]:
                    profiled[name] += path_runner.ttft(prompt, mode) * 1e3 / args.profile_runs
            split[name] = {kind: ms / args.profile_runs for kind, ms in kernel_ms.items()}  # ms per request
    for path_runner, _ in paths.values():
        path_runner.core.check_integrity()

    results = []
    for name, (_, mode) in paths.items():
        tokens = args.prefix_tokens + args.prompt_tokens if mode == "full" else args.prompt_tokens
        context = args.prefix_tokens if mode == "template" else 0
        linear, attention = arch.forward_flops(tokens, context)
        f = {"linear_flop": linear, "attention_flop": attention, "flop": linear + attention}
        p50, best = statistics.median(times[name]) * 1e3, min(times[name]) * 1e3
        row = {"path": name, "tokens": tokens, "context": context, "ttft_p50_ms": round(p50, 2),
               "ttft_min_ms": round(best, 2), **f, "gflop": round(f["flop"] / 1e9, 3),
               "gflop_s_p50": round(f["flop"] / p50 / 1e6, 1)}
        if args.profile_runs:
            lin, att = split[name]["linear"], split[name]["attention"]
            # to 0.1 us: a few tokens' attention on a tiny model is a few microseconds on a fast CPU
            row.update(linear_ms=round(lin, 4), attention_ms=round(att, 4), other_ms=round(p50 - lin - att, 4),
                       profiled_ttft_ms=round(profiled[name], 2),
                       linear_gflop_s=round(f["linear_flop"] / lin / 1e6, 1) if lin else None,
                       attention_gflop_s=round(f["attention_flop"] / att / 1e6, 1) if att else None)
        results.append(row)
    by_path = {r["path"]: r for r in results}
    pre, full, unpacked_row = by_path.get("prefix"), by_path.get("no_prefix"), by_path.get("prefix_unpacked")
    alone = by_path.get("alone")
    ratio: dict[str, float] = {}  # those of the paths that ran
    if pre is not None and full is not None:
        ratio = {"ttft_p50": round(full["ttft_p50_ms"] / pre["ttft_p50_ms"], 2),
                 "ttft_min": round(full["ttft_min_ms"] / pre["ttft_min_ms"], 2),
                 "flop_bound": round(full["flop"] / pre["flop"], 2)}
    if pre is not None and alone is not None:  # what the template's attention adds: prefix / alone
        ratio.update(alone_p50=round(pre["ttft_p50_ms"] / alone["ttft_p50_ms"], 2),
                     alone_min=round(pre["ttft_min_ms"] / alone["ttft_min_ms"], 2),
                     alone_flop_bound=round(pre["flop"] / alone["flop"], 2))
    if pre is not None and unpacked_row is not None:
        ratio["packing_p50"] = round(unpacked_row["ttft_p50_ms"] / pre["ttft_p50_ms"], 3)

    print(f"{os.path.basename(str(cfg.model.path).rstrip('/'))}: {arch.num_layers} layers, {core.device}, "
          f"{torch.get_num_threads()} threads, backend {core.backend.describe()}; template {args.prefix_tokens} "
          f"tokens, prompt {args.prompt_tokens}, {args.runs} requests per path")
    head = f"{'path':<10} {'tokens':>6} {'TTFT p50':>9} {'min':>8} {'GFLOP':>7} {'GFLOP/s':>8}"
    if args.profile_runs:
        head += f" {'linear ms':>10} {'(GFLOP/s)':>9} {'attention ms':>13} {'(GFLOP/s)':>9} {'other ms':>9}"
    print(head)
    for r in results:
        line = (f"{r['path']:<10} {r['tokens']:>6} {r['ttft_p50_ms']:>9.1f} {r['ttft_min_ms']:>8.1f} "
                f"{r['gflop']:>7.1f} {r['gflop_s_p50']:>8.1f}")
        if args.profile_runs:
            line += (f" {r['linear_ms']:>10.1f} {r['linear_gflop_s'] or 0:>9.1f} {r['attention_ms']:>13.1f} "
                     f"{r['attention_gflop_s'] or 0:>9.1f} {r['other_ms']:>9.1f}")
        print(line)
    if "ttft_p50" in ratio:
        print(f"TTFT ratio no_prefix / prefix: {ratio['ttft_p50']:.2f}x at the medians, {ratio['ttft_min']:.2f}x at "
              f"the minimums; {ratio['flop_bound']:.2f}x at equal FLOP rates (the FLOP ratio)")
    if "alone_p50" in ratio:
        print(f"TTFT ratio prefix / alone: {ratio['alone_p50']:.2f}x at the medians, {ratio['alone_min']:.2f}x at "
              f"the minimums; {ratio['alone_flop_bound']:.2f}x at equal FLOP rates")
    if pre is not None and unpacked_row is not None:
        print(f"the template's packed K/V (cache.pack_prefix_kv): TTFT p50 {unpacked_row['ttft_p50_ms']:.1f} ms "
              f"without it, {pre['ttft_p50_ms']:.1f} with it ({ratio['packing_p50']:.3f}x)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_info(), "model": str(cfg.model.path),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(), "threads": torch.get_num_threads(),
                       "backend": core.backend.name, "dtype": str(core.dtype).replace("torch.", ""),
                       "prefix_tokens": args.prefix_tokens, "prompt_tokens": args.prompt_tokens, "runs": args.runs,
                       "profile_runs": args.profile_runs, "results": results, "ratio": ratio}, fh, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
