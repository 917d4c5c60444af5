"""CPU linear layers three ways: `F.linear` (the BLAS torch links, MKL in the x86 wheels, as the torch
backend runs them), the same layers with their weights reordered once for oneDNN's inner product
(torch.ops.mkldnn), and packed for the native kernel the cpu backend runs
(prefix_service/backends/cpu/linear.py).

One pass runs every linear layer of the model's decoder stack (fused qkv, o, fused gate_up, down)
once on an input of N rows, with each layer's own weights, as a forward does: the weights stream
from memory, as they do in serving. The ways alternate pass by pass; the table gives the median
pass time, the FLOP rate and the weight bytes read per second, for N = 1 (a decode step) up to a
long prefill.

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

from prefix_service.backends.cpu import linear as cpu_linear  # noqa: E402


def onednn_available(dtype: torch.dtype) -> str | None:
    """None when this torch build runs oneDNN's inner product on a reordered weight, else why not."""
    try:
        layer = OneDNNLinear(torch.randn(48, 40, dtype=dtype))
        with torch.inference_mode():
            got = layer(torch.randn(5, 40, dtype=dtype))
    except (AttributeError, RuntimeError) as exc:
        return f"no oneDNN linear in this torch build ({str(exc).splitlines()[0]})"
    return None if got.shape == (5, 48) else "oneDNN linear gave the wrong shape"


class OneDNNLinear:
    """y = x @ W.T with W reordered once into oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias=None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


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
    shapes, num_layers, name = layer_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen) / i ** 0.5 for o, i in shapes] for _ in range(num_layers)]
    weight_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    layers: dict[str, list] = {"blas": [[(lambda x, w=w: F.linear(x, w), w.shape[1]) for w in layer]
                                        for layer in weights]}
    for way, check, cls in (("onednn", onednn_available, OneDNNLinear),
                            ("native", cpu_linear.available, cpu_linear.NativeLinear)):
        reason = check(torch.float32)
        if reason:
            print(f"{way}: not available here ({reason})", file=sys.stderr)
            continue
        layers[way] = [[(cls(w, None), w.shape[1]) for w in layer] for layer in weights]
    ways = list(layers)

    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{name}: {num_layers} layers x {len(shapes)} linears, {weight_bytes / 1e6:.0f} MB of float32 weights, "
          f"{torch.get_num_threads()} threads; ms a pass (GFLOP/s, GB/s of weights)")
    print(f"{'rows':>6} " + " ".join(f"{way + ' ms':>26}" for way in ways)
          + "".join(f" {way + ' vs blas':>16}" for way in ways[1:]))
    with torch.inference_mode():
        for rows in rows_list:
            xs = {i: torch.randn(rows, i, generator=gen) for _, i in shapes}

            def run(way: str) -> None:
                for layer in layers[way]:
                    for fn, fan_in in layer:
                        fn(xs[fan_in])

            times: dict[str, list[float]] = {way: [] for way in ways}
            for way in ways:  # warm
                run(way)
            for _ in range(args.passes):
                for way in ways:
                    t = time.perf_counter()
                    run(way)
                    times[way].append(time.perf_counter() - t)
            flop = 2 * rows * weight_bytes / 4
            r: dict = {"rows": rows}
            for way in ways:
                med = statistics.median(times[way])
                r.update({f"{way}_ms": round(med * 1e3, 4), f"{way}_gflop_s": round(flop / med / 1e9, 1),
                          f"{way}_gb_s": round(weight_bytes / med / 1e9, 1)})
            for way in ways[1:]:
                r[f"{way}_speedup"] = round(r["blas_ms"] / r[f"{way}_ms"], 2)
            results.append(r)
            print(f"{rows:>6} " + " ".join(f"{r[way + '_ms']:>9.1f} ({r[way + '_gflop_s']:>6.1f}, {r[way + '_gb_s']:>5.1f})"
                                          for way in ways)
                  + "".join(f" {r[way + '_speedup']:>15.2f}x" for way in ways[1:]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": name, "layers": num_layers, "weight_bytes": weight_bytes, "ways": ways,
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "cpu": platform.processor() or platform.machine(),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
