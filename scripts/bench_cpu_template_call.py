"""The matrix-product template attention's cost per call: query rows over one KV head of a pinned
template (`onednn.OneDnnTemplate.attend`, the call the native decode and prefill kernels make per
task through `template_fn`), the template kept in cache, on the calling thread.

A decode step's task holds the query heads of up to 8 tiles of sequences on one KV head (SmolLM2:
3 query heads a KV head, so 3 rows for one sequence, 24 for 8), a prefill's task as many rows as
leave each thread two tasks (a 100-token prefill: 152 rows on 2 threads, 28 on 16); each call
walks every key of the template. What this times is the products' own loops and the online softmax
between them, without the rest of a step: a change to csrc/onednn_attention.cpp shows here at its
size, where a whole decode step's spread on a shared machine would hide it. The table names the
kernel the products run on this CPU (`onednn.template_kernel`).

    python scripts/bench_cpu_template_call.py --json bench_out/cpu_template_call.json
    python scripts/bench_cpu_template_call.py --rows 3,24 --tokens 2000 --head-size 128
    python scripts/bench_cpu_template_call.py --key-rows   # the dot products in the key-row walk

With `--key-rows` the template is walked as the rows of its products (the walk AMX's brgemm and the
fallback GEMM take) on any kernel, the AVX512-BF16 dot products included, to compare the two walks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.backends.cpu import onednn  # noqa: E402


def call_us(template: onednn.OneDnnTemplate, q: torch.Tensor, calls: int) -> tuple[float, float]:
    """(minimum, median) microseconds of one call over `calls` timed calls, after 3 untimed ones."""
    for _ in range(3):
        template.attend(0, q)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        template.attend(0, q)
        times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    return times[0], times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=939, help="the template's length (default: the intent template's)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--rows", default="3,12,24,48,300", help="query rows a call, comma-separated")
    p.add_argument("--calls", type=int, default=200, help="timed calls per row count")
    p.add_argument("--key-rows", action="store_true", help="the key-row walk on any kernel (the dot products too)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    lib, reason = onednn.load()
    if lib is None:
        print(f"no oneDNN library here: {reason}", file=sys.stderr)
        return 1
    from prefix_service import cpuinfo
    torch.manual_seed(0)
    shape = (args.tokens, args.kv_heads, args.head_size)
    template = onednn.OneDnnTemplate(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16(),
                                     key_rows=args.key_rows)
    kernel = template.kernel
    walk = "the key-row walk" if template.key_rows else "64 keys at a time"
    print(f"{', '.join(cpuinfo.isa()) or 'no listed ISA'}: a {args.tokens}-token template, head size "
          f"{args.head_size}, products on {kernel}, {walk}, {args.calls} calls a row count, one thread")
    print(f"{'rows':>6} {'min us':>10} {'p50 us':>10} {'us a row':>10}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        q = torch.randn(rows, args.head_size) * args.head_size ** -0.5
        best, median = call_us(template, q, args.calls)
        results.append({"rows": rows, "min_us": round(best, 2), "p50_us": round(median, 2),
                        "min_us_per_row": round(best / rows, 3)})
        print(f"{rows:6d} {best:10.1f} {median:10.1f} {best / rows:10.2f}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"isa": cpuinfo.isa(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "kernel": kernel, "key_rows": template.key_rows, "tokens": args.tokens,
                       "kv_heads": args.kv_heads,
                       "head_size": args.head_size, "calls": args.calls,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=1)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
