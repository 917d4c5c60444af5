"""Benchmark: a decoder layer's element-wise work, cuda_ops.fused's kernels against the model's torch ops.

For each op (the residual add with the RMSNorm after it, the rotary embedding of q and k, SiLU
and the gate's mul) and each token count: GPU time per call of the reference (the torch operators
prefix_service/model/llama.py runs) and of the fused Triton kernel, and the fused kernel's bytes
moved (every input read once, every output written once) against the device's copy rate. Shapes
default to Llama-3-8B (hidden 4096, 32 query and 8 KV heads of 128, intermediate 14336, bf16).
A decode step runs each op on its batch's rows, a prefill on its tokens; per layer and step the
norm runs twice, the rest once. Each figure is the median of --iters samples of --reps calls
back to back, timed with CUDA events after --warmup calls.

Usage (from the repository root, PYTHONPATH=.):
  python scripts/bench_cuda_layers.py [--tokens 1 16 64 1000] [--json bench_out/cuda_layers.json]
Needs a CUDA GPU: exits with status 2 and a message otherwise.
"""
from __future__ import annotations

import argparse
import sys

import torch

from cuda_ops.timing import add_timing_args, copy_bandwidth_gbps, gpu_or_say, median_ms, write_results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 1000], help="rows per call")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    add_timing_args(p, reps=20)
    return p.parse_args(argv)


def cases(args, t: int) -> list[tuple[str, object, object, int]]:
    """(op, reference call, fused call, bytes the fused kernel moves) for t rows."""
    from cuda_ops import fused
    dtype = getattr(torch, args.dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)
    x, res, w = rand(t, args.hidden), rand(t, args.hidden), rand(args.hidden)
    heads = args.heads + args.kv_heads
    qkv = rand(t, (heads + args.kv_heads) * args.head_dim)
    qk = qkv[:, :heads * args.head_dim].view(t, heads, args.head_dim)
    inv = 1.0 / (500000.0 ** (torch.arange(0, args.head_dim, 2, device="cuda").float() / args.head_dim))
    freqs = torch.arange(8192, device="cuda").float()[:, None] * inv[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    positions = torch.randint(0, 8192, (t,), generator=g, device="cuda")
    gate_up = rand(t, 2 * args.intermediate)
    return [
        ("add + rms_norm", lambda: fused.rms_norm_ref(x, w, 1e-5, res),
         lambda: fused.rms_norm(x, w, 1e-5, residual=res), 4 * t * args.hidden * size),
        ("rope (q and k)", lambda: fused.rope_ref(qk, cos, sin, positions), lambda: fused.rope_(qk, cos, sin, positions),
         2 * qk.numel() * size + 4 * t * args.head_dim * 4),
        ("silu * up", lambda: fused.silu_mul_ref(gate_up), lambda: fused.silu_mul(gate_up), 3 * t * args.intermediate * size),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not gpu_or_say("bench_cuda_layers"):
        return 2
    copy_gbps = copy_bandwidth_gbps(args.warmup, args.iters)
    rows = []
    with torch.inference_mode():
        for t in args.tokens:
            for op, ref, fused_call, moved in cases(args, t):
                ref_ms = median_ms(ref, args.warmup, args.iters, args.reps)
                fused_ms = median_ms(fused_call, args.warmup, args.iters, args.reps)
                gbps = moved / (fused_ms * 1e-3) / 1e9
                rows.append(dict(op=op, tokens=t, reference_us=ref_ms * 1e3, fused_us=fused_ms * 1e3,
                                 speedup=ref_ms / fused_ms, fused_gbps=gbps, pct_of_copy=100 * gbps / copy_gbps))
    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}; plain device copy: {copy_gbps:.0f} GB/s (read + write)")
    print(f"shape: hidden {args.hidden}, {args.heads} + {args.kv_heads} heads of {args.head_dim}, "
          f"intermediate {args.intermediate}, {args.dtype}")
    header = f"{'op':<16}{'tokens':>7}{'reference us':>14}{'fused us':>10}{'x':>7}{'GB/s':>8}{'% copy':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<16}{r['tokens']:>7}{r['reference_us']:>14.1f}{r['fused_us']:>10.1f}{r['speedup']:>7.1f}"
              f"{r['fused_gbps']:>8.0f}{r['pct_of_copy']:>7.0f}%")
    write_results(args, copy_gbps, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
