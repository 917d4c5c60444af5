#!/usr/bin/env python
"""Load test a running prefix_service server: N concurrent streams for T seconds.

Each of --concurrency workers sends Generate calls back to back (each with a deadline of
--timeout seconds; after a failed call a worker pauses --failure-pause seconds) until --duration
has passed or --max-requests calls were started; calls in flight at the end are allowed to
finish within their deadline. Prints completed calls, failures
by status code and latency percentiles (end to end and time to first token), and writes the same
as JSON with --json.

    python scripts/load_test.py --address 127.0.0.1:50051 --template intent_classifier \\
        --prompt $'Message: "I was charged twice"\\nIntent:' --max-tokens 8 --concurrency 16 --duration 30
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc  # noqa: E402

MAX_DURATION_S = 3600
MAX_CONCURRENCY = 1024


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values) if values else None, "mean": sum(values) / len(values) if values else None}


def channel(address: str, tls_ca: str | None, tls: bool) -> grpc.aio.Channel:
    if tls_ca is None and not tls:
        return grpc.aio.insecure_channel(address)
    roots = Path(tls_ca).read_bytes() if tls_ca else None
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots))


async def run(args: argparse.Namespace) -> dict:
    request = pb.GenerateRequest(prefix_name=args.template or "", prompt=args.prompt,
                                 sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                            ignore_eos=args.ignore_eos))
    latencies: list[float] = []
    ttfts: list[float] = []
    codes: Counter[str] = Counter()
    tokens = 0
    started = 0
    chan = channel(args.address, args.tls_ca, args.tls)
    stub = pb_grpc.GenerationStub(chan)
    t_start = time.perf_counter()
    stop_at = t_start + args.duration

    async def worker() -> None:
        nonlocal tokens, started
        while time.perf_counter() < stop_at and (args.max_requests is None or started < args.max_requests):
            started += 1
            t0 = time.perf_counter()
            first = None
            try:
                async for msg in stub.Generate(request, timeout=args.timeout):
                    if first is None and msg.token_ids:
                        first = time.perf_counter() - t0
                    if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        tokens += msg.usage.completion_tokens
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] += 1
                await asyncio.sleep(args.failure_pause)  # a refused call is not retried in a hot loop
                continue
            codes["OK"] += 1
            latencies.append(time.perf_counter() - t0)
            if first is not None:
                ttfts.append(first)

    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await chan.close()
    elapsed = time.perf_counter() - t_start
    completed = codes.pop("OK", 0)
    return {
        "address": args.address, "template": args.template, "concurrency": args.concurrency, "duration_s": elapsed,
        "requests": completed + sum(codes.values()), "completed": completed, "failed": dict(sorted(codes.items())),
        "requests_per_s": completed / elapsed if elapsed > 0 else 0.0,
        "completion_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "latency_s": summarize(latencies), "ttft_s": summarize(ttfts),
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def print_report(r: dict) -> None:
    print(f"{r['requests']} requests in {r['duration_s']:.1f} s against {r['address']} "
          f"(concurrency {r['concurrency']}, template {r['template'] or '-'})")
    print(f"completed  {r['completed']}  ({r['requests_per_s']:.2f} req/s, "
          f"{r['completion_tokens_per_s']:.1f} completion tokens/s)")
    failed = r["failed"]
    print("failed     " + (", ".join(f"{code} {n}" for code, n in failed.items()) if failed else "0"))
    print(f"{'ms':<10} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9} {'mean':>9}")
    for key, label in (("latency_s", "latency"), ("ttft_s", "ttft")):
        s = r[key]
        print(f"{label:<10} " + " ".join(f"{fmt(s[k]):>9}" for k in ("p50", "p90", "p99", "max", "mean")))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:50051", help="server host:port (default 127.0.0.1:50051)")
    p.add_argument("--template", "--prefix", dest="template", default="",
                   help="template to continue (default: none; --prefix is another name for it)")
    p.add_argument("--prompt", default=" Hello", help="prompt text (default ' Hello')")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--concurrency", "-n", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--duration", "-t", type=float, default=10.0, help="seconds to keep starting calls (default 10)")
    p.add_argument("--max-requests", type=int, default=None, help="stop after starting this many calls")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of each call in seconds (default 60)")
    p.add_argument("--failure-pause", type=float, default=0.05, metavar="S",
                   help="seconds a worker waits after a failed call (default 0.05)")
    p.add_argument("--tls", action="store_true", help="TLS, trusting the system's roots")
    p.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA or self-signed certificate")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        p.error(f"--concurrency must be in [1, {MAX_CONCURRENCY}]")
    if not 0 < args.duration <= MAX_DURATION_S:
        p.error(f"--duration must be in (0, {MAX_DURATION_S}] seconds")
    if args.max_requests is not None and args.max_requests < 1:
        p.error("--max-requests must be positive")
    if not 0 < args.timeout <= MAX_DURATION_S:
        p.error(f"--timeout must be in (0, {MAX_DURATION_S}] seconds")
    if not 0 <= args.failure_pause <= 60:
        p.error("--failure-pause must be in [0, 60] seconds")
    if args.max_tokens < 0:
        p.error("--max-tokens must be >= 0 (0: the server's default)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
