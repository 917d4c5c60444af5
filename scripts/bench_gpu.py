#!/usr/bin/env python
"""GPU benchmark of the engine on the seed workload (900-token prefix, 100-token user prompt,
30 output tokens) with a Llama-3-8B-shaped model of random bf16 weights (load_format: dummy).

Measures, in one run:
  * the device's ceilings: bf16 matmul TFLOP/s and device-to-device copy GB/s;
  * prefill TTFT with and without the named prefix, next to the roofline bound for those tokens
    (max of FLOP time at the measured matmul rate and weight-read time at the measured bandwidth);
  * decode tokens/s at batch 1, 16, 64 with and without the prefix, for each way to decode
    (the Triton paged kernel under CUDA graphs and eagerly, gather + SDPA: an engine each; TTFT on
    the first).
Prints a table and writes JSON (--json). `--device cpu --shape tiny` is a smoke run of the script.
`--trace DIR` also records, for each way to decode, its first timed batch on the template under
torch's profiler (host threads and, on a GPU, its kernels) as a Chrome trace in DIR
(`trace_<way>.json`, open in Perfetto), and prints that batch's busiest host operators: where
an eager step's time goes beside the GPU's.

    python scripts/bench_gpu.py --json bench_out/gpu.json
    python scripts/bench_gpu.py --decode-batches 1 --trace bench_out/traces
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
from prefix_service.backends.base import BackendFactory
from prefix_service.config import SchedulerConfig, parse_size_or_auto
from prefix_service.synthetic import LLAMA3_8B, build_config_only, build_tokenizer

SHAPES = {"llama3-8b": LLAMA3_8B,
          "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096)}
PREFIX_LEN, USER_LEN, OUT_LEN = 900, 100, 30
BATCH_TIMEOUT_S = 600  # a batch that takes longer is stuck: fail rather than hang


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = timed(lambda: a @ b, device, 10)
    big = torch.randn((1 << 28) // 2 if device.type == "cuda" else 1 << 24, device=device, dtype=torch.bfloat16)
    cp = timed(lambda: big.clone(), device, 10)
    return {"matmul_tflops": 2 * n**3 / mm / 1e12, "copy_gbps": 2 * big.numel() * big.element_size() / cp / 1e9}


def roofline_ms(arch, n_new: int, n_ctx: int, dtype: torch.dtype, ceilings: dict) -> float:
    """Lower bound for a forward of n_new tokens after n_ctx cached tokens: max(FLOP time, weight-read time)."""
    flops = sum(arch.forward_flops(n_new, n_ctx))  # the lm_head only for the last token
    elem = torch.tensor([], dtype=dtype).element_size()
    weight_bytes = (arch.num_layers * arch.layer_linear_params + 2 * arch.hidden_size * arch.vocab_size) * elem
    return 1000 * max(flops / (ceilings["matmul_tflops"] * 1e12), weight_bytes / (ceilings["copy_gbps"] * 1e9))


def seed_ids(k: int, vocab: int) -> list[int]:
    return [(7919 * (i + 1) + 104729 * k) % (vocab - 10) + 5 for i in range(USER_LEN)]


def run_batch(engine: Engine, reqs: list[GenerateRequest]) -> dict:
    """Submit all at once; returns TTFTs and steady decode throughput (after every request has its
    first token, until the last finishes)."""
    lock = threading.Lock()
    first, done, stamps = {}, threading.Event(), []
    finished = [0]
    errors: list[BaseException] = []

    def sink_for(i):
        def sink(out):
            now = time.perf_counter()
            with lock:
                if out.error is not None:  # raised here, on the caller's thread: the engine's would drop it
                    errors.append(out.error)
                    done.set()
                    return
                first.setdefault(i, now)
                stamps.append((now, len(out.token_ids)))
                if out.finished:
                    finished[0] += 1
                    if finished[0] == len(reqs):
                        done.set()
        return sink

    t0 = time.perf_counter()
    engine.submit_many(reqs, [sink_for(i) for i in range(len(reqs))])  # all enter at one step
    if not done.wait(BATCH_TIMEOUT_S):
        raise TimeoutError(f"{len(reqs)} requests: {finished[0]} finished within {BATCH_TIMEOUT_S} s")
    if errors:
        raise errors[0]
    t_all_first = max(first.values())
    t_end = max(t for t, _ in stamps)
    decode_tokens = sum(n for t, n in stamps if t > t_all_first)
    return {"ttft_ms": [(first[i] - t0) * 1000 for i in range(len(reqs))],
            "decode_tok_s": decode_tokens / (t_end - t_all_first) if t_end > t_all_first else float("nan")}


def traced(engine: Engine, reqs: list[GenerateRequest], path: Path) -> dict:
    """run_batch under torch's profiler (every thread's operators, and the GPU's kernels where there
    is one): its Chrome trace to `path`, its busiest host operators printed."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:  # the engine steps on a thread of its own, started before the profiler
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without it records the calling thread's operators only
        config = None
    with profile(activities=activities, experimental_config=config) as prof:
        run = run_batch(engine, reqs)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    busiest = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    print(f"trace {path}: busiest host operators (self ms over the batch): "
          + "; ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f}" for e in busiest), flush=True)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=10, help="sequential requests per TTFT measurement")
    ap.add_argument("--decode-batches", default="1,16,64")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="auto", help="cache.kv_cache_memory of each engine (auto: the GPU's)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--trace", type=Path, help="write a profiler trace of each way's first timed batch here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (or --device cpu --shape tiny for a smoke run)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.decode_batches.split(",")]

    ceilings = device_ceilings(device, dtype)
    print(f"device: matmul {ceilings['matmul_tflops']:.1f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp) / "tok")
        model_dir = build_config_only(Path(tmp) / "model", tok, "llama", **SHAPES[args.shape])
        cfg = EngineConfig(
            ModelConfig(path=str(model_dir), device=args.device, dtype=str(dtype).replace("torch.", ""),
                        load_format="dummy", backend="cuda" if device.type == "cuda" else "auto"),
            CacheConfig(block_size=16, kv_cache_memory=parse_size_or_auto(args.kv_cache_memory, "--kv-cache-memory")
                        if device.type == "cuda" else 1 << 28),
            SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=8192, max_tokens_cap=8192))
        result: dict = {"ttft": [], "decode": []}
        for i, (impl, backend, graphs) in enumerate(decode_engines(device)):
            model = dataclasses.replace(cfg.model, cuda_graph_max_batch=graphs)
            with Engine(dataclasses.replace(cfg, model=model), backend=backend) as engine:
                part = bench(engine, args, ceilings, dtype, batches, impl or engine.info.backend, ttft=i == 0)
            del engine  # its weights and KV cache go before the next engine's are allocated
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            result["ttft"] += part["ttft"]
            result["decode"] += part["decode"]
    result.update(machine=_machine(device), date=datetime.date.today().isoformat(), git_commit=_git_commit(),
                  shape=args.shape, dtype=str(dtype).replace("torch.", ""), ceilings=ceilings,
                  workload={"prefix_tokens": PREFIX_LEN, "user_tokens": USER_LEN, "output_tokens": OUT_LEN})
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


def decode_engines(device: torch.device) -> list[tuple[str | None, BackendFactory | None, int]]:
    """(decode kernel, backend, model.cuda_graph_max_batch) of each engine the decode table compares.
    On a GPU: the cuda backend with the Triton paged kernel under CUDA graphs, the same kernel run
    eagerly, and gather + SDPA (eagerly), an engine each; elsewhere one engine with the backend
    model.backend picks (None: named after it)."""
    if device.type != "cuda":
        return [(None, None, 0)]
    from prefix_service.backends.cuda.attention import decode_gather_sdpa, decode_triton
    from prefix_service.backends.cuda.backend import CudaBackend
    return [(label, functools.partial(CudaBackend, decode=(name, fn)), graphs)
            for label, name, fn, graphs in (("triton_graphs", "triton_paged", decode_triton, 256),
                                            ("triton_eager", "triton_paged", decode_triton, 0),
                                            ("gather_sdpa", "gather_sdpa", decode_gather_sdpa, 0))]


def bench(engine: Engine, args, ceilings: dict, dtype, batches: list[int], impl_name: str, ttft: bool) -> dict:
    """The decode rows of this engine (its kernel: impl_name), and the TTFT rows when `ttft`."""
    arch = engine.info.arch
    vocab = arch.vocab_size
    prefix = [(104729 * (i + 3)) % (vocab - 10) + 5 for i in range(PREFIX_LEN)]
    engine.add_template("seed", token_ids=prefix)

    def request(k, with_prefix, max_tokens=OUT_LEN):
        user = seed_ids(k, vocab)
        s = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return (GenerateRequest(prompt_token_ids=user, prefix_name="seed", sampling=s) if with_prefix
                else GenerateRequest(prompt_token_ids=prefix + user, sampling=s))

    ttft_rows = []
    for with_prefix in ((True, False) if ttft else ()):
        engine.generate([request(-1, with_prefix), request(-2, with_prefix)])  # warm-up
        times = [engine.generate([request(k, with_prefix)])[0].ttft_ms for k in range(args.requests)]
        n_new = USER_LEN if with_prefix else PREFIX_LEN + USER_LEN
        ttft_rows.append({"system": "engine_prefix" if with_prefix else "engine_no_prefix",
                          "ttft_p50_ms": statistics.median(times), "ttft_min_ms": min(times),
                          "roofline_ms": roofline_ms(arch, n_new, PREFIX_LEN if with_prefix else 0, dtype, ceilings)})
        print(f"ttft {ttft_rows[-1]['system']}: {ttft_rows[-1]['ttft_p50_ms']:.1f} ms "
              f"(bound {ttft_rows[-1]['roofline_ms']:.1f} ms)", flush=True)

    decode = []
    for b in batches:
        # warm-up: this batch size's kernels compiled and libraries' plans made for the contexts timed below
        run_batch(engine, [request(-3 - k, True, args.decode_tokens) for k in range(b)])
        for with_prefix in (True, False):
            reqs = [request(k, with_prefix, args.decode_tokens) for k in range(b)]
            if args.trace is not None and not decode and with_prefix:
                run = traced(engine, reqs, args.trace / f"trace_{impl_name}.json")
            else:
                run = run_batch(engine, reqs)
            decode.append({"decode_impl": impl_name, "batch": b, "with_prefix": with_prefix,
                           "decode_tok_s": run["decode_tok_s"], "ttft_p50_ms": statistics.median(run["ttft_ms"])})
            print(f"decode {impl_name} batch {b} prefix={with_prefix}: {run['decode_tok_s']:.0f} tok/s", flush=True)
    engine.check_integrity()
    return {"ttft": ttft_rows, "decode": decode}


def print_table(r: dict) -> None:
    print(f"\n{r['shape']} {r['dtype']} on {r['machine']['device']} ({r['date']}, {r['git_commit']})")
    print(f"{'system':<18}{'TTFT p50 ms':>12}{'roofline ms':>13}{'ratio':>7}")
    for t in r["ttft"]:
        print(f"{t['system']:<18}{t['ttft_p50_ms']:>12.1f}{t['roofline_ms']:>13.1f}{t['ttft_p50_ms'] / t['roofline_ms']:>7.1f}")
    print(f"\n{'decode impl':<14}{'batch':>6}{'prefix tok/s':>14}{'no-prefix tok/s':>17}")
    rows = {}
    for d in r["decode"]:
        rows.setdefault((d["decode_impl"], d["batch"]), {})[d["with_prefix"]] = d["decode_tok_s"]
    for (impl, b), v in rows.items():
        print(f"{impl:<14}{b:>6}{v.get(True, float('nan')):>14.0f}{v.get(False, float('nan')):>17.0f}")


def _machine(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "python": platform.python_version()}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
