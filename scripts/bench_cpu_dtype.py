"""The cpu backend in each dtype, engine to engine, on the intent workload (the 939-token intent
template pinned, 100-token user segments, 30 greedy tokens, EOS ignored): time to first token of
one request on the cached template, and output tokens per second with 16 and 64 requests submitted
together (Engine.generate). Every timed request sends a segment never sent before.

Each (system, round) runs in a fresh child process, the systems in turns, so a noisy machine
spreads over all of them; the table gives medians over rounds. A system is a dtype, optionally of
another checkout of this repository (`--baseline PATH`: the same measures with that tree's
package, for an A/B of one dtype before and after a change). The JSON records the CPU, its
instruction sets (AMX-BF16, AVX512-BF16, AVX-512, AVX2) and the load.

    python scripts/bench_cpu_dtype.py --json bench_out/cpu_dtype.json
    python scripts/bench_cpu_dtype.py --dtypes float32 --baseline /tmp/before --json bench_out/ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(args: argparse.Namespace) -> None:
    """One system, one round: measures printed as one JSON line."""
    sys.path.insert(0, str(Path(args.repo).resolve()))
    from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
    from prefix_service import SchedulerConfig
    from prefix_service.bench.workloads import Sizes, build_workload
    from prefix_service.prepare_model import prepare_default_model

    model = prepare_default_model(progress=False)
    engine = Engine(EngineConfig(ModelConfig(path=str(model), dtype=args.child, device="cpu", backend="cpu"),
                                 CacheConfig(block_size=16, kv_cache_memory=1 << 30),
                                 SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
    work = build_workload("intent", engine.tokenizer, Sizes())
    start = time.perf_counter()
    engine.add_prefix(work.prefix_name, token_ids=list(work.prefix_ids))
    warm_ms = (time.perf_counter() - start) * 1e3
    params = SamplingParams(max_tokens=work.output_tokens, ignore_eos=True)
    index = iter(range(args.round * 100_000, 10**9))  # segments of this round only: never sent before

    def batch(n: int) -> tuple[float, list]:
        reqs = [GenerateRequest(prompt_token_ids=list(work.request(next(index)).prompt_ids),
                                prefix_name=work.prefix_name, sampling=params) for _ in range(n)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        return time.perf_counter() - t0, out

    batch(2)  # warm: the kernels' first calls
    ttft = [batch(1)[1][0].ttft_ms for _ in range(args.singles)]
    result = {"template_warmup_ms": warm_ms, "ttft_ms": statistics.median(ttft), "ttft_all_ms": ttft,
              "backend": engine.core.backend.describe()}
    for n in args.concurrency:
        wall, out = batch(n)
        assert all(len(o.token_ids) == work.output_tokens for o in out)
        result[f"tok_s_{n}"] = n * work.output_tokens / wall
    engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def machine() -> dict:
    """The benchmark harness's machine record (CPU, its instruction sets, load...)."""
    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import machine_info
    return machine_info()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--baseline", help="another checkout: its package runs the same dtypes as systems 'base-*'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--singles", type=int, default=5, help="single requests per round (TTFT median)")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.child:
        child(args)
        return
    systems = [(d, str(REPO), d) for d in args.dtypes.split(",")]
    if args.baseline:
        systems = [(f"base-{d}", args.baseline, d) for d in args.dtypes.split(",")] + systems
    info = machine()
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in systems}
    for r in range(args.rounds):
        for name, repo, dtype in systems:
            cmd = [sys.executable, __file__, "--child", dtype, "--repo", repo, "--round", str(r), "--singles",
                   str(args.singles), "--concurrency", ",".join(map(str, args.concurrency))]
            with tempfile.TemporaryFile("w+") as err:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
                if proc.returncode != 0:
                    err.seek(0)
                    sys.exit(f"{name} (round {r}) failed:\n{err.read()[-3000:]}")
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            runs[name].append(json.loads(line[len("RESULT "):]))
            print(f"round {r} {name}: {runs[name][-1]['backend']}", file=sys.stderr)
    keys = ["ttft_ms"] + [f"tok_s_{n}" for n in args.concurrency] + ["template_warmup_ms"]
    table = {name: {k: statistics.median(run[k] for run in rs) for k in keys} for name, rs in runs.items()}
    info["load_average_end"] = list(os.getloadavg())
    print(f"{info['cpu']} ({', '.join(info['isa'])}), {info['cpu_count']} CPUs, medians of {args.rounds} rounds")
    print("| system | " + " | ".join(keys) + " |")
    print("| --- | " + " | ".join("---" for _ in keys) + " |")
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "medians": table, "runs": runs,
                                               "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
