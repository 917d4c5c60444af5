"""Benchmark: bandwidth of the concat_kvcache_with_prefix CUDA kernel vs a plain device copy.

Shapes default to Llama-3-8B (8 KV heads, head_dim 128, bf16, block 16) and batches of prefill
sequences that continue a 900-token prefix with a 100-token user segment. Bytes counted per
call: every output row of K and V read once and written once (4 * total_k * row_bytes).
Two cache layouts: `shared` (every sequence reads the same pinned prefix blocks, as in the
service; those reads mostly hit L2) and `distinct` (each sequence has its own prefix blocks).
Each figure is the median of --iters samples of --reps back-to-back calls timed with CUDA
events after --warmup calls; the copy baseline is `dst.copy_(src)` of a 1 GiB tensor.

Usage (from the repository root, package installed or PYTHONPATH=.):
  python scripts/bench_cuda_ops.py [--batches 1 4 16 64] [--json bench_out/cuda_ops.json]
Needs a CUDA GPU: exits with status 2 and a message otherwise.
"""
from __future__ import annotations

import argparse
import sys

import torch

from cuda_ops.timing import add_timing_args, copy_bandwidth_gbps, gpu_or_say, median_ms, write_results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="sequences per call")
    p.add_argument("--prefix-len", type=int, default=900)
    p.add_argument("--user-len", type=int, default=100)
    p.add_argument("--heads", type=int, default=8, help="num_kv_heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    add_timing_args(p, reps=10)
    return p.parse_args(argv)


def make_inputs(args, batch: int, shared: bool) -> dict:
    dtype = getattr(torch, args.dtype)
    bs = args.block_size
    n_prefix_blocks = (args.prefix_len + bs - 1) // bs
    num_blocks = n_prefix_blocks * (1 if shared else batch)
    cache_shape = (num_blocks, bs, args.heads, args.head_dim)  # [num_blocks, bs, H, D]
    ids = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    if shared:
        block_tables = ids.view(1, -1).expand(batch, -1).contiguous()  # [B, n_prefix_blocks]
    else:
        block_tables = ids.view(batch, n_prefix_blocks)
    total_q = batch * args.user_len
    return dict(
        k_cache=torch.randn(cache_shape, device="cuda").to(dtype),
        v_cache=torch.randn(cache_shape, device="cuda").to(dtype),
        block_tables=block_tables,
        prefix_lens=torch.full((batch,), args.prefix_len, dtype=torch.int32, device="cuda"),
        k_new=torch.randn(total_q, args.heads, args.head_dim, device="cuda").to(dtype),  # [T, H, D]
        v_new=torch.randn(total_q, args.heads, args.head_dim, device="cuda").to(dtype),
        cu_seqlens_q=torch.arange(0, total_q + 1, args.user_len, dtype=torch.int32, device="cuda"),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if not gpu_or_say("bench_cuda_ops"):
        return 2
    from cuda_ops import concat_kvcache_with_prefix, concat_kvcache_with_prefix_ref, load_cuda_ops

    load_cuda_ops()  # compile before timing
    copy_gbps = copy_bandwidth_gbps(args.warmup, args.iters)
    rows = []
    for mode in ("shared", "distinct"):
        for batch in args.batches:
            inputs = make_inputs(args, batch, shared=mode == "shared")
            total_k = batch * (args.prefix_len + args.user_len)
            row_bytes = args.heads * args.head_dim * inputs["k_cache"].element_size()
            moved = 4 * total_k * row_bytes
            kernel_ms = median_ms(lambda: concat_kvcache_with_prefix(**inputs, total_k=total_k),
                                  args.warmup, args.iters, args.reps)
            synced_ms = median_ms(lambda: concat_kvcache_with_prefix(**inputs),
                                  args.warmup, args.iters, args.reps)
            ref_ms = median_ms(lambda: concat_kvcache_with_prefix_ref(**inputs), 2, max(3, args.iters // 5), 1)
            gbps = moved / (kernel_ms * 1e-3) / 1e9
            rows.append(dict(mode=mode, batch=batch, total_k=total_k, mbytes=moved / 1e6,
                             kernel_us=kernel_ms * 1e3, kernel_gbps=gbps, pct_of_copy=100 * gbps / copy_gbps,
                             kernel_sync_us=synced_ms * 1e3, reference_us=ref_ms * 1e3,
                             speedup_vs_reference=ref_ms / kernel_ms))

    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}; plain device copy: {copy_gbps:.0f} GB/s (read + write)")
    print(f"shape: H={args.heads} D={args.head_dim} {args.dtype} block={args.block_size}; "
          f"prefix {args.prefix_len} + user {args.user_len} tokens per sequence")
    header = f"{'mode':<9}{'batch':>6}{'total_k':>9}{'MB':>9}{'kernel us':>11}{'GB/s':>8}{'% copy':>8}" \
             f"{'+sync us':>10}{'ref us':>10}{'x ref':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['mode']:<9}{r['batch']:>6}{r['total_k']:>9}{r['mbytes']:>9.1f}{r['kernel_us']:>11.1f}"
              f"{r['kernel_gbps']:>8.0f}{r['pct_of_copy']:>7.0f}%{r['kernel_sync_us']:>10.1f}"
              f"{r['reference_us']:>10.0f}{r['speedup_vs_reference']:>8.1f}")
    write_results(args, copy_gbps, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
