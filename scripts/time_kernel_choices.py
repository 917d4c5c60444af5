"""What the bf16 cpu backend's start-up timing keeps on this machine, at each thread count asked for:
the backend is built for the model in bfloat16 with the template attention set to "measure"
(PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION, the default where the CPU has AMX tiles:
prefix_service/backends/cpu/tuning.py), which times the native kernels and each kernel of the
matrix products the CPU has on a synthetic template, a 100-token prefill and a 16-sequence decode
step, and keeps one; where the CPU has AVX512-BF16 a prompt's own attention (native kernels or dot
products, a 512-token prompt) is timed as well. The table gives the medians and the ways kept.
With --linears measure (the default on AMX) each linear shape is timed on brgemm and the inner
product as well, and what each runs is printed and kept in the JSON. --repeat builds the backend
again to show how stable the attention choices are on a busy machine (a process times each linear
shape once per thread count, so repeats reuse the linears' first timing).

    python scripts/time_kernel_choices.py --thread-counts 2,16 --json bench_out/kernel_choices.json
    python scripts/time_kernel_choices.py --model DIR --load-format dummy --repeat 3 --linears measure
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.bench.main import git_commit, machine_info  # noqa: E402
from prefix_service.bench.profiling import add_engine_args, engine_config  # noqa: E402
from prefix_service.backends.cpu import onednn  # noqa: E402
from prefix_service.engine.core import EngineCore  # noqa: E402


def linear_timings(backend) -> dict:
    """Per linear of the first layer and the head: what timing found (us a call by kernel and rows), where timed."""
    return {name: {"shape": [m.out_features, m.in_features], "kernel": m.kernel, "brgemm_rows": m.brgemm_rows,
                   "why": m.timing.why, "us": m.timing.us}
            for name, m in backend.named_linears().items() if getattr(m, "timing", None) is not None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.set_defaults(backend="cpu", device="cpu", dtype="bfloat16")
    p.add_argument("--thread-counts", default=str(torch.get_num_threads()),
                   help="comma-separated torch thread counts, each timed with a backend of its own")
    p.add_argument("--repeat", type=int, default=1, help="backends built per thread count")
    p.add_argument("--linears", choices=onednn.KERNEL_CHOICES,
                   help=f"{onednn.KERNEL_ENV} for the run (default: as set, else the machine's default)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.linears:
        os.environ[onednn.KERNEL_ENV] = args.linears
    if args.threads:
        args.thread_counts = str(args.threads)
    os.environ[onednn.TEMPLATE_ATTENTION_ENV] = "measure"
    from prefix_service import cpuinfo
    if "avx512_bf16" in cpuinfo.kernel_flags():  # the dot products a prompt's own attention may run on
        os.environ[onednn.PROMPT_ATTENTION_ENV] = "measure"
    machine = machine_info()
    results = []
    print(f"{'threads':>7} {'run':>3} {'way':<26} {'prefill ms':>10} {'decode ms':>10}  kept")
    for threads in (int(t) for t in args.thread_counts.split(",")):
        for run in range(args.repeat):
            cfg = engine_config(args)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_threads=threads))
            start = time.perf_counter()
            core = EngineCore(cfg)
            built_s = time.perf_counter() - start
            stack = getattr(core.backend, "stack", None)
            timing = getattr(stack, "template_timing", None)
            if timing is None:
                print(f"the backend built is {core.backend.describe()}: it times no template attention "
                      f"(a bfloat16 model on the cpu backend does)", file=sys.stderr)
                return 1
            kept = timing.kernel or "native"
            for way, t in timing.ms.items():
                print(f"{threads:7d} {run:3d} {way:<26} {t['prefill']:10.2f} {t['decode']:10.2f}  "
                      f"{'<-' if way == kept else ''}")
            print(f"{threads:7d} {run:3d} kept: {kept} ({timing.why})", flush=True)
            linears = core.backend.linear_choices()
            print(f"{threads:7d} {run:3d} linears: {linears}", flush=True)
            prompt = stack.prompt_timing
            if prompt is not None:
                times = ", ".join(f"{w} {t:.2f} ms" for w, t in prompt.ms.items())
                print(f"{threads:7d} {run:3d} a {prompt.tokens}-token prompt's own attention: {times}; kept: "
                      f"{prompt.choice} ({prompt.why})", flush=True)
            results.append({"threads": threads, "run": run, "choice": timing.choice, "kernel": timing.kernel,
                            "why": timing.why, "template_tokens": timing.template_tokens, "ms": timing.ms,
                            "linears": linears, "linear_timings": linear_timings(core.backend),
                            "prompt": None if prompt is None else {"choice": prompt.choice, "why": prompt.why,
                                                                   "tokens": prompt.tokens, "ms": prompt.ms},
                            "backend_built_s": round(built_s, 3)})
            del core
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "model": args.model or args.config, "load_average_end": list(os.getloadavg()),
                       "results": results}, f, indent=1)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
