"""CPU linear layers: `F.linear` (the BLAS torch links, MKL in the x86 wheels) against the same layers
with their weights packed once for oneDNN (`model.cpu_linear: onednn`, prefix_service/model/packed_linear.py).

One pass runs every linear layer of the model's decoder stack (fused qkv, o, fused gate_up, down)
once on an input of N rows, with each layer's own weights, as a forward does: the weights stream
from memory, as they do in serving. The two ways alternate pass by pass; the table gives the
median pass time and the weight bytes read per second, for N = 1 (a decode step) up to a long prefill.

    python scripts/bench_cpu_linear.py --json bench_out/cpu_linear.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.model.packed_linear import PackedLinear, onednn_linear_available  # noqa: E402


def layer_shapes(model_dir: str | None) -> tuple[list[tuple[int, int]], int, str]:
    """[(out, in)] of one decoder layer's linears, the layer count, and the model's name."""
    if model_dir:
        from prefix_service.model.loader import read_arch
        a = read_arch(model_dir)
        name = os.path.basename(model_dir.rstrip("/"))
    else:  # SmolLM2-135M's shape, with no files needed
        from types import SimpleNamespace
        a = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                            head_dim=64)
        name = "SmolLM2-135M shape"
    qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    return ([(qkv, a.hidden_size), (a.hidden_size, a.num_heads * a.head_dim),
             (2 * a.intermediate_size, a.hidden_size), (a.hidden_size, a.intermediate_size)], a.num_layers, name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M's shape)")
    p.add_argument("--rows", default="1,4,16,64,100,256,1000", help="input rows per call, comma-separated")
    p.add_argument("--passes", type=int, default=9, help="timed passes per way and row count")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reason = onednn_linear_available(torch.float32)
    if reason:
        print(f"oneDNN linears are not available here: {reason}", file=sys.stderr)
        return 1
    shapes, num_layers, name = layer_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen) / i ** 0.5 for o, i in shapes] for _ in range(num_layers)]
    packed = [[PackedLinear(w, None) for w in layer] for layer in weights]
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)

    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{name}: {num_layers} layers x {len(shapes)} linears, {weight_bytes / 1e6:.0f} MB of float32 weights, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rows':>6} {'F.linear ms':>12} {'oneDNN ms':>10} {'speed-up':>9} {'F.linear GB/s':>14} {'oneDNN GB/s':>12}")
    with torch.inference_mode():
        for rows in rows_list:
            xs = {i: torch.randn(rows, i, generator=gen) for _, i in shapes}

            def blas() -> None:
                for layer in weights:
                    for w in layer:
                        F.linear(xs[w.shape[1]], w)

            def onednn() -> None:
                for layer in packed:
                    for lin in layer:
                        lin(xs[lin.in_features])

            times = {"blas": [], "onednn": []}
            blas(), onednn()  # warm
            for _ in range(args.passes):
                for way, fn in (("blas", blas), ("onednn", onednn)):
                    t = time.perf_counter()
                    fn()
                    times[way].append(time.perf_counter() - t)
            b, o = statistics.median(times["blas"]), statistics.median(times["onednn"])
            results.append({"rows": rows, "blas_ms": round(b * 1e3, 4), "onednn_ms": round(o * 1e3, 4),
                            "speedup": round(b / o, 2), "blas_gb_s": round(weight_bytes / b / 1e9, 1),
                            "onednn_gb_s": round(weight_bytes / o / 1e9, 1)})
            r = results[-1]
            print(f"{rows:>6} {r['blas_ms']:>12.1f} {r['onednn_ms']:>10.1f} {r['speedup']:>8.2f}x "
                  f"{r['blas_gb_s']:>14.1f} {r['onednn_gb_s']:>12.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": name, "layers": num_layers, "weight_bytes": weight_bytes,
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "cpu": platform.processor() or platform.machine(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
