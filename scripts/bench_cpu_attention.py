"""Attention on the CPU, ours against vLLM's CPU attention on the same batch, the model's attention
shape (SmolLM2: 30 layers, 9 query heads, 3 KV heads of 64), milliseconds of attention (every layer):
a decode step of N sequences, each one token after a 939-token template and a 100-token segment,
and the prefill of one such segment after the template.

Ours: the attention kernels' own timers in a decode step of the engine (scripts/profile_decode.py: the
template's K/V read once a step for all the sequences on it, the rest of each context through its
block table, the new tokens' K/V stored by the same call) and of the segment's prefill
(scripts/profile_prefill.py's path `prefix`), per system: `float32`, `bfloat16` (a bf16
KV cache, the native kernels) and `bfloat16-matrix` (the template's part as bf16 matrix products,
PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION=matrix).

vLLM (`vllm-bfloat16`, `vllm-float32`; its environment from `make bench-peers`, started as its CPU
docs ask): the op its CPU attention backend runs, `cpu_attention_with_kv_cache`, after
`cpu_attn_reshape_and_cache` stores the new tokens' K/V, on 30 layers of paged caches in its layout
(blocks of 128 tokens, its CPU default; the template's full blocks shared by every sequence, as its
prefix cache shares them), its scheduler metadata made once a step; the wall time of a step's calls;
a prefill the same way, the segment's queries causal over the template and themselves. Its kernel
reads the template once per sequence.

Each (system, round) runs in a fresh process, the systems in turns; the table gives medians over
rounds of each run's per-step figure. The JSON records the CPU and its instruction sets.

    python scripts/bench_cpu_attention.py --json bench_out/cpu_attention.json
    python scripts/bench_cpu_attention.py --systems float32,vllm-bfloat16 --batches 16,64 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = {"float32": ("float32", {}), "bfloat16": ("bfloat16", {}),
        "bfloat16-matrix": ("bfloat16", {"PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION": "matrix"})}
VLLM = {"vllm-bfloat16": "bfloat16", "vllm-float32": "float32"}
VLLM_BLOCK = 128  # vLLM's CPU default block size


def attention_shape(model: Path) -> dict[str, int]:
    """Layers, query heads, KV heads and head size from a model's config.json."""
    cfg = json.loads((model / "config.json").read_text())
    hq = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "hq": hq, "hkv": cfg.get("num_key_value_heads", hq),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // hq}


def vllm_child(args: argparse.Namespace) -> None:
    """vLLM's CPU attention op over a decode step of each batch: one JSON line."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = getattr(torch, args.vllm_child)
    shape = json.loads(args.shape)
    layers, hq, hkv, d = shape["layers"], shape["hq"], shape["hkv"], shape["head_dim"]
    bs = VLLM_BLOCK
    isa = _get_attn_isa(dtype, bs, d)
    # the context ours is timed at: the template, the segment, the first token and the timed steps
    ctx = args.prefix_tokens + args.prompt_tokens + 1 + args.steps
    shared = args.prefix_tokens // bs  # the template's full blocks, one copy for every sequence
    gen = torch.Generator().manual_seed(args.round)

    def median_ms(n: int, new: int, ctx: int) -> float:
        """n sequences, each `new` tokens (causal among themselves) after ctx cached ones: the median
        wall time of a step's calls over every layer."""
        own = math.ceil((ctx + new) / bs) - shared
        blocks = shared + n * own
        caches = [torch.randn(blocks, hkv, bs, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
        table = torch.tensor([list(range(shared)) + [shared + i * own + j for j in range(own)] for i in range(n)],
                             dtype=torch.int32)
        seq_lens = torch.full((n,), ctx + new, dtype=torch.int32)
        starts = torch.arange(0, n * new + 1, new, dtype=torch.int32)
        slots = torch.tensor([int(table[i, t // bs]) * bs + t % bs for i in range(n) for t in range(ctx, ctx + new)],
                             dtype=torch.int64)
        q = torch.randn(n * new, hq, d, generator=gen).to(dtype)
        k = torch.randn(n * new, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n * new, hkv, d, generator=gen).to(dtype)
        out = torch.empty(n * new, hq, d, dtype=dtype)

        def step() -> None:
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=n, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq_lens, dtype=dtype,
                query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
            for cache in caches:  # its layout: [blocks, KV heads, block, 2 D] viewed as K and V halves
                key_cache, value_cache = cache.view(blocks, hkv, bs * 2, d).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
                ops.cpu_attention_with_kv_cache(
                    query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
                    seq_lens=seq_lens, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                    block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)

        for _ in range(2):  # warm
            step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        if not torch.isfinite(out).all():
            raise RuntimeError(f"vLLM's attention gave non-finite outputs ({n} sequences of {new} new tokens)")
        return statistics.median(times) * 1e3

    result: dict = {"isa": isa, "threads": torch.get_num_threads(), "context": ctx + 1,
                    "step_ms": {str(n): median_ms(n, 1, ctx) for n in args.batches},
                    "prefill_ms": median_ms(1, args.prompt_tokens, args.prefix_tokens)}
    print("RESULT " + json.dumps(result), flush=True)


def ours(args: argparse.Namespace, dtype: str, env: dict[str, str], model: str | None) -> dict:
    """The attention kernels' time in each batch's decode step (profile_decode.py) and in the segment's
    prefill on the template (profile_prefill.py's path `prefix`), each script in a child process."""
    out = Path(tempfile.mkdtemp()) / "profile.json"
    common = ["--backend", "cpu", "--device", "cpu", "--dtype", dtype, "--prefix-tokens", str(args.prefix_tokens),
              "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.round), "--json", str(out)]
    if model:
        common += ["--model", model, "--load-format", args.load_format]

    def profile(script: str, *extra: str) -> tuple[dict, str]:
        cmd = [sys.executable, str(REPO / "scripts" / script), *common, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        if proc.returncode != 0:
            raise RuntimeError(f"{script} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text()), proc.stdout

    decode, printed = profile("profile_decode.py", "--batches", ",".join(map(str, args.batches)),
                              "--steps", str(args.steps))
    # the backend as the script describes it: "... threads, backend <description>; template ..."
    described = next((line.split(", backend ", 1)[1].split("; template")[0] for line in printed.splitlines()
                      if ", backend " in line), "")
    prefill_runs, _ = profile("profile_prefill.py", "--paths", "prefix", "--runs", "1",
                              "--profile-runs", str(args.prefill_runs))
    prefill = next(r for r in prefill_runs["results"] if r["path"] == "prefix")
    return {"threads": decode["threads"], "backend": described,
            "step_ms": {str(r["batch"]): r["kernels_ms"]["attention"] for r in decode["results"]},
            "decode_step_ms": {str(r["batch"]): r["step_p50_ms"] for r in decode["results"]},
            "profiled_step_ms": {str(r["batch"]): r["profiled_step_ms"] for r in decode["results"]},
            "prefill_ms": prefill["attention_ms"], "prefill_ttft_ms": prefill["ttft_p50_ms"],
            "prefill_profiled_ttft_ms": prefill["profiled_ttft_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join([*OURS, *VLLM]),
                    help=f"of {', '.join([*OURS, *VLLM])} (vLLM's skipped, with the reason, without its environment)")
    ap.add_argument("--batches", default="1,16,64", help="sequences decoding together")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    ap.add_argument("--prefill-runs", type=int, default=3, help="our prefills timed by the kernels' timers")
    ap.add_argument("--prefix-tokens", type=int, default=939)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--model", help="a model directory instead of the default model (prepare-model)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights from --model's config.json (attention does not depend on them)")
    ap.add_argument("--json")
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        args.batches = [int(b) for b in str(args.batches).split(",")]
    except ValueError:
        ap.error(f"--batches: expected numbers like 1,16,64, got {args.batches!r}")
    if args.vllm_child:
        vllm_child(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in OURS and s not in VLLM]
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {', '.join([*OURS, *VLLM])}")
    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, git_commit, isa_label, machine_info
    from prefix_service.bench.systems.vllm import server_env, vllm_python
    from prefix_service.prepare_model import prepare_default_model

    skipped: dict[str, str] = {}
    python, why = vllm_python()
    if python is None:
        skipped = {s: why for s in systems if s in VLLM}
        systems = [s for s in systems if s not in VLLM]
        for s, reason in skipped.items():
            print(f"skipped {s}: {reason}", file=sys.stderr)
    model = args.model or str(prepare_default_model(progress=False))
    shape = attention_shape(Path(model))
    info = machine_info()
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        args.round = r
        for s in systems:
            if s in OURS:
                dtype, env = OURS[s]
                runs[s].append(ours(args, dtype, env, args.model))
            else:
                assert python is not None
                cmd = [python, __file__, "--vllm-child", VLLM[s], "--shape", json.dumps(shape), "--round", str(r),
                       "--batches", ",".join(map(str, args.batches)), "--steps", str(args.steps),
                       "--prefix-tokens", str(args.prefix_tokens), "--prompt-tokens", str(args.prompt_tokens)]
                runs[s].append(child_result(cmd, server_env(python), f"{s} (round {r})"))
            print(f"round {r} {s}: " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in runs[s][-1]["step_ms"].items())
                  + f", prefill {runs[s][-1]['prefill_ms']:.1f} ms", file=sys.stderr)
    table = {s: {**{str(n): statistics.median(run["step_ms"][str(n)] for run in rs) for n in args.batches},
                 "prefill": statistics.median(run["prefill_ms"] for run in rs)} for s, rs in runs.items()}
    info["load_average_end"] = list(os.getloadavg())
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs; {shape['layers']} layers, "
          f"{shape['hq']} query heads, {shape['hkv']} KV heads of {shape['head_dim']}; template "
          f"{args.prefix_tokens} tokens, segment {args.prompt_tokens}; attention ms (every layer), medians of "
          f"{args.rounds} rounds")
    print("| step | " + " | ".join(table) + " |")
    print("| --- | " + " | ".join("---" for _ in table) + " |")
    for n in args.batches:
        print(f"| decode, {n} sequences | " + " | ".join(f"{table[s][str(n)]:.1f}" for s in table) + " |")
    print(f"| prefill, {args.prompt_tokens} tokens | " + " | ".join(f"{table[s]['prefill']:.1f}" for s in table) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(), "args": vars(args),
            "shape": shape,
            "model": model, "medians_ms": table, "runs": runs, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
