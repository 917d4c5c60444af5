"""One CPU linear layer's cost per call, the same weight called over and over (cache-hot), per
kernel, rows and thread count.

Where `scripts/bench_cpu_linear.py` streams every layer's weights as a forward does, this keeps one
weight in cache, so what a call costs besides reading its weight shows: conversions, dispatch,
thread start-up, and how the work splits over threads (a kernel that gets no faster from 1 to 16
threads is not splitting its work). Ways: the native float32 kernel, torch's prepacked oneDNN
inner product on bf16 rows, torch's bf16 `F.linear`, and the cpu backend's bf16 kernels
(prefix_service/backends/cpu/onednn.py) on float32 rows as the decoder stack calls them, where
`inner_product` runs calls of up to 128 rows on the few-row dot-product kernel on a CPU with
AVX512-BF16 and `inner_product_onednn` is oneDNN's inner product for every call; a way this CPU
cannot run is left out with the reason.

    python scripts/bench_cpu_linear_call.py --threads 16,8,1 --json bench_out/cpu_linear_call.json
    python scripts/bench_cpu_linear_call.py --threads 2 --brgemm-columns 48,64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.backends.cpu import linear as cpu_linear  # noqa: E402
from prefix_service.backends.cpu import onednn  # noqa: E402


def per_call_us(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    """Median over 5 repeats of the mean time of `calls` calls, after 20 untimed ones."""
    for _ in range(20):
        fn(x)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def ways(w: torch.Tensor, brgemm_columns: tuple[int, ...] = ()
         ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]]:
    """name -> (the layer, the dtype of the rows it takes); brgemm_columns: more brgemm block widths,
    each a way `brgemm_c<width>`."""
    wb = w.bfloat16()
    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]] = {}
    out["native_f32"] = (cpu_linear.NativeLinear(w, None), torch.float32)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(wb)
        out["onednn_bf16_rows"] = (
            lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), torch.bfloat16)
    except RuntimeError as exc:
        print(f"onednn_bf16_rows: not available here ({str(exc).splitlines()[0]})", file=sys.stderr)
    out["F.linear_bf16"] = (lambda x: F.linear(x, wb), torch.bfloat16)
    for kernel in onednn.KERNELS:
        try:
            out[kernel] = (onednn.OneDnnLinear(wb, None, kernel=kernel), torch.float32)
        except onednn.OneDnnError as exc:
            print(f"{kernel}: not available here ({str(exc).splitlines()[0]})", file=sys.stderr)
    if getattr(out.get("inner_product", (None,))[0], "few_rows", 0):
        # inner_product runs calls of up to few_rows rows on the dot-product kernel; this, oneDNN alone
        out["inner_product_onednn"] = (onednn.OneDnnLinear(wb, None, kernel="inner_product", few_rows=False),
                                       torch.float32)
    if onednn.bf16_native():
        # what timing the shape on brgemm and the inner product keeps (AMX's default; its choice is printed)
        timed = onednn.OneDnnLinear(wb, None, kernel="measure")
        print(f"measure, {w.shape[0]} x {w.shape[1]}: {timed!r} ({timed.timing.why})", file=sys.stderr)
        out["measure"] = (timed, torch.float32)
    if "brgemm" in out:
        for columns in brgemm_columns:
            out[f"brgemm_c{columns}"] = (onednn.OneDnnLinear(wb, None, kernel="brgemm", columns=columns),
                                         torch.float32)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="3072x576,576x1536",
                   help="out x in of each weight (default: SmolLM2-135M's fused gate_up and down)")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--threads", default=None, help="torch thread counts, comma-separated (default: torch's)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per repeat")
    p.add_argument("--brgemm-columns", default="", help="more block widths for the brgemm kernel, e.g. 48,64 "
                   f"(16, 32, 48 or 64; `brgemm` itself: {onednn.COLUMNS_ENV} or {onednn.DEFAULT_BRGEMM_COLUMNS})")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    from prefix_service import cpuinfo
    torch.manual_seed(0)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    results = []
    for th in threads:
        torch.set_num_threads(th)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            layer_ways = ways(torch.randn(n, k) * 0.02, tuple(int(c) for c in args.brgemm_columns.split(",") if c))
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                row = {"threads": th, "out": n, "in": k, "rows": rows}
                for name, (fn, dtype) in layer_ways.items():
                    row[f"{name}_us"] = round(per_call_us(fn, x.to(dtype), args.calls), 1)
                results.append(row)
                print(f"threads {th:2d} {n}x{k} rows {rows:3d} us/call: "
                      + "  ".join(f"{name} {row[f'{name}_us']:8.1f}" for name in layer_ways), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"isa": cpuinfo.isa(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=1)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
