"""Decode attention's own cost on the CPU, the kernel alone (`ps_decode_attention` through the
tests' ctypes harness, tests/native_harness.py): N sequences, each one new token after a template
and its own tokens in shuffled blocks of a bf16 (or float32) cache, over 30 layers.

Each layer has its own cache, so a step reads every sequence's own rows from memory as serving
does (`--hot`: one layer's cache 30 times, so the rows stay in cache and what shows is the
arithmetic). The template's part runs as the engine runs it here (`--template matrix`: the
matrix-product template attention of a bf16 model; `native`: the float32 kernels over a packed
copy; `none`: no template). The table gives ms a step (30 calls, minimum and median of the
repeats) in the kernel, as the library's own attention timer measures it (csrc/timers.h: the calls
alone, as the decoder stack makes them), the median with the harness's Python around the calls
(which builds each call's arguments: at 64 sequences several ms a step), and the own rows' bytes
over the kernel's minimum (with a template, its part's time counts too).

`--against REV` times the kernel of revision REV (its native sources from git, built here) and the
working tree's in one process, in turns (`--rounds`, the order reversed every other round), each by
its own library's timer: each one's median of its rounds' minima, the median of the rounds' ratios (working tree / REV) with
their range, and whether the two gave the same bits. REV's `ps_decode_attention` must take the
working tree's arguments. On a shared machine whose speed drifts, this is the kernel A/B to trust:
what drifts slowly moves both sides of a round alike.

    python scripts/bench_cpu_decode_call.py --seqs 16,64 --json bench_out/cpu_decode_call.json
    python scripts/bench_cpu_decode_call.py --seqs 64 --template none --hot
    python scripts/bench_cpu_decode_call.py --seqs 1,4,16,64 --kv float32 --against HEAD~1 --rounds 15
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from native_harness import decode_attention  # noqa: E402
from native_revision import RevisionUnavailable, library_of  # noqa: E402

from prefix_service.backends.cpu import attention as cpu_attention  # noqa: E402
from prefix_service.backends.cpu import native, onednn  # noqa: E402


def make_step(n: int, args: argparse.Namespace) -> Callable[[ctypes.CDLL | None], torch.Tensor]:
    """One step of n decodes over `args.layers` layers, run on a given native library (None: the
    working tree's); it returns the last layer's output."""
    bs, hq, hkv, d = 16, args.query_heads, args.kv_heads, args.head_size
    dtype = torch.bfloat16 if args.kv == "bfloat16" else torch.float32
    r_blocks = -(-args.template_tokens // bs) if args.template != "none" else 0
    own_blocks = -(-args.own_tokens // bs)  # the template ends on a block boundary
    num_blocks = r_blocks + n * own_blocks + 1
    g = torch.Generator().manual_seed(n)
    layers = []
    for _ in range(1 if args.hot else args.layers):
        kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
        vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
        packed, matrix = None, None
        if r_blocks:
            kt, vt = kc[:r_blocks].flatten(0, 1), vc[:r_blocks].flatten(0, 1)
            packed = (cpu_attention.pack_keys(kt.float()), cpu_attention.pack_values(vt.float()), r_blocks * bs)
            if args.template == "matrix":
                matrix = onednn.OneDnnTemplate(kt.bfloat16().contiguous(), vt.bfloat16().contiguous())
        # the per-sequence lists the harness takes, made once, outside the timed loop
        layers.append((kc, vc, [packed] * n if packed is not None else None,
                       [matrix] * n if matrix is not None else None))
    own = (torch.randperm(num_blocks - r_blocks - 1, generator=g)[:n * own_blocks] + r_blocks).to(torch.int32)
    tables = torch.cat([torch.arange(r_blocks, dtype=torch.int32).repeat(n, 1), own.view(n, own_blocks)], 1)
    tables = tables.contiguous()
    ctx = torch.full((n,), r_blocks * bs + args.own_tokens, dtype=torch.int32)
    q = torch.randn(n, hq, d, generator=g)
    out = torch.empty(n, hq, d)

    def step(lib: ctypes.CDLL | None) -> torch.Tensor:
        for i in range(args.layers):
            kc, vc, templates, matrices = layers[i % len(layers)]
            decode_attention(q, kc, vc, tables, ctx, d ** -0.5, out=out, templates=templates, matrix=matrices,
                             lib=lib)
        return out
    return step


def timed_ms(step: Callable[[ctypes.CDLL | None], torch.Tensor], lib: ctypes.CDLL | None,
             repeats: int) -> tuple[list[float], list[float]]:
    """ms of `repeats` steps on lib, after one untimed: (in the kernel, by the library's attention
    timer; the whole step, the harness's Python included)."""
    timers = (lib or native.require()).ps_timers
    totals = (ctypes.c_int64 * 3)()
    step(lib)
    kernel, wall = [], []
    for _ in range(repeats):
        timers(1, None)  # the totals from zero, the timers on
        t = time.perf_counter()
        step(lib)
        wall.append((time.perf_counter() - t) * 1e3)
        timers(0, totals)
        kernel.append(totals[1] / 1e6)  # attention (timers.h: kAttention)
    return kernel, wall


def step_ms(n: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """(minimum, median) ms in the kernel of one step of n decodes over `args.layers` layers, and the
    median of the whole step, the harness included."""
    kernel, wall = timed_ms(make_step(n, args), None, args.repeats)
    return min(kernel), statistics.median(kernel), statistics.median(wall)


def against(n: int, args: argparse.Namespace, theirs: ctypes.CDLL) -> dict:
    """The working tree's kernel and REV's (theirs) on the same step, in turns: per side the median of
    its rounds' minima (ms), the rounds' ratios ours / theirs (median, min, max), and whether they agree
    to the bit."""
    step = make_step(n, args)
    ours_ms, theirs_ms = [], []
    for r in range(args.rounds):
        sides = [(None, ours_ms), (theirs, theirs_ms)]
        for lib, into in sides if r % 2 == 0 else sides[::-1]:
            into.append(min(timed_ms(step, lib, args.repeats)[0]))
    same = torch.equal(step(None).clone(), step(theirs))
    ratios = [a / b for a, b in zip(ours_ms, theirs_ms)]
    return {"seqs": n, "theirs_ms": round(statistics.median(theirs_ms), 3),
            "ours_ms": round(statistics.median(ours_ms), 3),
            "ratio": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                      "max": round(max(ratios), 3)}, "same_bits": same}


def measure(seqs: list[int], args: argparse.Namespace) -> list[dict]:
    """The working tree's kernel alone: a row per sequence count."""
    elem = 2 if args.kv == "bfloat16" else 4
    print(f"{'seqs':>5} {'min ms':>8} {'p50 ms':>8} {'with harness':>12} {'own MB':>8} {'GB/s':>6}")
    results = []
    for n in seqs:
        best, median, wall = step_ms(n, args)
        mb = n * args.own_tokens * args.kv_heads * args.head_size * 2 * elem * args.layers / 1e6
        results.append({"seqs": n, "min_ms": round(best, 3), "p50_ms": round(median, 3),
                        "p50_with_harness_ms": round(wall, 3), "own_mb": round(mb, 1), "own_gb_s": round(mb / best, 2)})
        print(f"{n:5d} {best:8.2f} {median:8.2f} {wall:12.2f} {mb:8.1f} {mb / best:6.1f}", flush=True)
    return results


def compare(seqs: list[int], args: argparse.Namespace, theirs: ctypes.CDLL) -> list[dict]:
    """REV's kernel (theirs) against the working tree's: a row per sequence count."""
    rev = args.against[:12]
    print(f"{rev}'s kernel and the working tree's in turns, {args.rounds} rounds, a round's minimum of "
          f"{args.repeats} steps")
    print(f"{'seqs':>5} {rev + ' ms':>15} {'this ms':>8} {'this/' + rev + ' (range)':>30} {'same bits':>9}")
    results = []
    for n in seqs:
        r = against(n, args, theirs)
        results.append(r)
        ratio = f"{r['ratio']['median']:.3f} ({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f})"
        print(f"{n:5d} {r['theirs_ms']:15.2f} {r['ours_ms']:8.2f} {ratio:>30} {'yes' if r['same_bits'] else 'NO':>9}",
              flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="16,64", help="decoding sequences a step, comma-separated")
    p.add_argument("--own-tokens", type=int, default=120, help="each sequence's tokens after the template")
    p.add_argument("--template-tokens", type=int, default=944, help="rounded up to whole blocks of 16")
    p.add_argument("--template", choices=("matrix", "native", "none"), default=None,
                   help="default: matrix where onednn.template_attention() picks it for the head size, else native")
    p.add_argument("--kv", choices=("bfloat16", "float32"), default="bfloat16", help="the cache's dtype")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--query-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--hot", action="store_true", help="one layer's cache for every layer: the rows stay in cache")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps (default 10; with --against 3 a round per side)")
    p.add_argument("--against", metavar="REV", help="time REV's kernel and the working tree's in turns")
    p.add_argument("--rounds", type=int, default=10, help="with --against: rounds of the two in turns")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.against else 10
    if native.load()[0] is None:
        print(f"no native library here: {native.load()[1]}", file=sys.stderr)
        return 1
    if args.template is None:
        args.template = "matrix" if onednn.template_attention(args.head_size) != "native" else "native"
    if args.template == "matrix" and onednn.load()[0] is None:
        print(f"no oneDNN library here for --template matrix: {onednn.load()[1]}", file=sys.stderr)
        return 1
    from prefix_service import cpuinfo
    print(f"{', '.join(cpuinfo.isa()) or 'no listed ISA'}, {torch.get_num_threads()} threads: {args.layers} layers, "
          f"template {args.template}, {args.own_tokens} own tokens a sequence, {args.kv} cache"
          f"{', in cache (--hot)' if args.hot else ''}")
    seqs = [int(s) for s in args.seqs.split(",")]
    from prefix_service.bench.main import git_commit, machine_info
    machine = machine_info()
    if args.against:
        try:
            args.against_commit, theirs = library_of(args.against)
        except RevisionUnavailable as exc:
            print(exc, file=sys.stderr)
            return 1
        results = compare(seqs, args, theirs)
    else:
        results = measure(seqs, args)
    if args.json:
        machine["load_average_end"] = list(os.getloadavg())
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"isa": cpuinfo.isa(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "machine": machine, "git_commit": git_commit(), "args": vars(args),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=1)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
