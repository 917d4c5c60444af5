"""CPU linear layers several ways, in float32 or bfloat16.

float32 (the default): `F.linear` (the BLAS torch links, MKL in the x86 wheels, as the torch
backend runs them), the same layers with their weights reordered once for oneDNN's inner product
(torch.ops.mkldnn), and packed for the native kernel the cpu backend runs
(prefix_service/backends/cpu/linear.py), on float32 panels and, with the weights rounded to bf16 values (a
bf16 checkpoint's, served in float32), on the bf16 panels it holds them in then (`native_bf16_panels`: the
same products from half the bytes); the ratios are against `F.linear`.

bfloat16 (`--dtype bfloat16`): the native float32 kernel on float32 weights (what `model.dtype:
auto` serves on a CPU), then on bf16 weights `F.linear` and oneDNN's prepacked inner product on
bf16 inputs (torch's operators alone), and the cpu backend's bf16 kernels (onednn.py) as the
decoder stack calls them, float32 rows in and out: `brgemm` (oneDNN's micro-kernel; AMX, else
torch's fallback GEMM) and `inner_product` (where torch's oneDNN runs bf16; with AVX512-BF16 its
calls of up to 128 rows run the few-row dot-product kernel, `inner_product_onednn` is oneDNN's
inner product for every call and `inner_product_dot` the dot products for every call, a Zen 4's
default) or `emulated` (elsewhere); the ratios are against the float32 kernel.

First, as the machine's reference, torch.mm on two square matrices (up to 2048; smaller where a
product would take over half a second) in float32 and in bfloat16: what the libraries torch links
reach on a compute-bound product here (--reference-size 0 leaves it out).

One pass runs every linear layer of the model's decoder stack (fused qkv, o, fused gate_up, down)
once on an input of N rows, with each layer's own weights, as a forward does: the weights stream
from memory, as they do in serving. The ways alternate pass by pass; the table gives the median
pass time, the FLOP rate and the weight bytes read per second, for N = 1 (a decode step) up to a
long prefill.

    python scripts/bench_cpu_linear.py --json bench_out/cpu_linear.json
    python scripts/bench_cpu_linear.py --dtype bfloat16 --rows 1,16,64,256 --json bench_out/cpu_linear_bf16.json
    python scripts/bench_cpu_linear.py --against HEAD~1 --rows 16,64,256 --rounds 5

`--against REV`: the native float32 kernel of revision REV (its sources from git, built here:
scripts/native_revision.py) and the working tree's in one process, in turns (`--rounds`, the order
reversed every other round), on the same packed weights and rows: over float32 panels and over the
bf16 panels of the same weights rounded to bf16 values. Each side's median of its rounds' minima (of
`--passes` passes), the median and range of the rounds' ratios (working tree / REV), and whether the
two gave the same bits (the script exits 1 where they did not). On a shared machine whose speed
drifts this is the kernel A/B to trust; two builds of the same code can still differ by a few percent
through their layout, which the panels a change leaves alone show.

int8 (`--dtype int8`): int8 weights (model.quantization: int8, one scale per output row) against
the float32 kernel: the float32 kernel over them (`native_int8`, what a float32 model serves with
them), and where the CPU has AVX512-BF16 the bf16 few-row kernel over bf16 blocks (`inner_product`)
and over int8 blocks (`inner_product_int8`, what a bf16 model serves), each as the CPU's default
takes it (from 129 rows both are oneDNN's bf16 inner product, but on a Zen 4, where every call runs
the dot products); then torch's own weight-only int8 kernel (aten._weight_int8pack_mm) on bf16
and on float32 rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

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


Layer = Callable[[torch.Tensor], torch.Tensor]


class Int8WeightOnly:
    """y = x @ (q diag(scale)).T, the int8 weights of model.quantization int8 (quantize_int8), through
    torch's weight-only int8 kernel (aten._weight_int8pack_mm); x in float32 or bf16."""

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> None:
        self.weight = pair[0].contiguous()
        self.scales = pair[1].to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)


def build_ways(weights: list[list[torch.Tensor]], dtype: str) -> dict[str, tuple[list[list[Layer]], torch.dtype]]:
    """way -> (its layers, the dtype of the rows it takes), the baseline first; ways that cannot run
    here are left out with the reason on stderr."""
    from prefix_service.backends.cpu import onednn

    def skip(way: str, reason: str) -> None:
        print(f"{way}: not available here ({reason})", file=sys.stderr)

    def each(make: Callable[[Any], Any], of: list[list[Any]] = weights) -> list[list[Any]]:
        """make(x) for each layer's weights x (or their int8 pairs)."""
        return [[make(w) for w in layer] for layer in of]

    f32, bf16 = torch.float32, torch.bfloat16
    ways: dict[str, tuple[list[list[Layer]], torch.dtype]] = {}
    native_reason = cpu_linear.available(f32)
    if dtype == "float32":
        ways["blas"] = (each(lambda w: lambda x: F.linear(x, w)), f32)
        reason = onednn_available(f32)
        if reason:
            skip("onednn", reason)
        else:
            ways["onednn"] = (each(OneDNNLinear), f32)
        if native_reason:
            skip("native", native_reason)
        else:
            ways["native"] = (each(lambda w: cpu_linear.NativeLinear(w, None, panels="float32")), f32)
            # the weights rounded to bf16 values (a bf16 checkpoint's), held in bf16 for the same kernel
            ways["native_bf16_panels"] = (each(lambda w: cpu_linear.NativeLinear(w.to(bf16).float(), None)), f32)
        return ways
    # bfloat16 and int8: against the float32 kernel, what auto serves
    if native_reason:
        skip("native", native_reason)
    else:
        ways["native"] = (each(lambda w: cpu_linear.NativeLinear(w, None)), f32)
    if dtype == "int8":
        from prefix_service.model.quantize import dequantize, quantize_int8
        pairs = each(quantize_int8)  # model.quantization int8's weights, per layer
        if not native_reason:
            ways["native_int8"] = (each(lambda p: cpu_linear.NativeLinear(dequantize(*p, f32), None, int8=p), pairs),
                                   f32)
        if not cpu_linear.available(bf16) and onednn.bf16_native():
            few = [[onednn.OneDnnLinear(dequantize(*p, bf16), None, kernel="inner_product") for p in layer]
                   for layer in pairs]
            if few[0][0].few_rows:  # the bf16 few-row kernel, and the same over int8 blocks
                ways["inner_product"] = (few, f32)
                ways["inner_product_int8"] = (each(lambda p: onednn.OneDnnLinear(
                    dequantize(*p, bf16), None, kernel="inner_product", int8=p), pairs), f32)
        for way, rows in (("int8_bf16", bf16), ("int8_f32", f32)):
            ways[way] = (each(lambda p, rows=rows: Int8WeightOnly(p, rows), pairs), rows)
        return ways
    wb = each(lambda w: w.to(bf16))
    ways["blas"] = (each(lambda w: lambda x: F.linear(x, w), wb), bf16)
    reason = onednn_available(bf16)
    if reason:
        skip("onednn", reason)
    else:
        ways["onednn"] = (each(OneDNNLinear, wb), bf16)
    reason = cpu_linear.available(bf16)
    if reason:
        skip("the service's bf16 kernels", reason)
    else:  # float32 rows in and out, as the decoder stack calls them
        # inner_product: calls of up to 128 rows on the dot-product kernel where the CPU has it (the
        # default but on a Zen 4, which runs every call on it), oneDNN's inner product above
        for kernel in ("brgemm", "inner_product" if onednn.bf16_native() else "emulated"):
            ways[kernel] = (each(lambda w, kernel=kernel: onednn.OneDnnLinear(
                w, None, kernel=kernel, few_rows=onednn.FEW_ROWS_SOME), wb), f32)
        if onednn.bf16_native() and getattr(ways["inner_product"][0][0][0], "few_rows", 0):
            # oneDNN alone
            ways["inner_product_onednn"] = (
                each(lambda w: onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=False), wb), f32)
            # and the dot products for every call (a Zen 4's default, and model.batch_invariant's kernel)
            ways["inner_product_dot"] = (each(lambda w: onednn.OneDnnLinear(
                w, None, kernel="inner_product", few_rows=onednn.FEW_ROWS_ALL), wb), f32)
    return ways


def reference_rates(size: int, passes: int, budget_s: float = 0.5) -> dict[str, dict[str, float]]:
    """GFLOP/s of torch.mm on two n x n matrices, float32 and bfloat16: a compute-bound product that
    fits the caches, as fast as the libraries torch links run on this machine (MKL or oneDNN; AMX
    where the CPU has it). The linears' rates read against it: a few-row linear is bound by its
    weights' bytes, a long prefill's by this. n doubles from 256 up to `size` while the next product
    would take under budget_s (torch's bf16 without bf16 instructions takes a minute at 2048), and
    the passes at that n stop after ~4 budgets. Per dtype: the n used and the median rate."""
    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        t = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - t

    gen = torch.Generator().manual_seed(1)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = min(256, size)
        while True:
            a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
            torch.mm(a, b)  # warm
            first = timed(a, b)
            if n >= size or 8 * first > budget_s:  # the next, twice the size, would take 8 times as long
                break
            n = min(2 * n, size)
        times = [first] + [timed(a, b) for _ in range(min(passes, int(4 * budget_s / first) + 1) - 1)]
        rates[str(dtype).removeprefix("torch.")] = {"size": n,
                                                     "gflop_s": round(2 * n ** 3 / statistics.median(times) / 1e9, 1)}
    return rates


def compare_native(rev: str, theirs: Any, shapes: list[tuple[int, int]], weights: list[list[torch.Tensor]],
                   rows_list: list[int], rounds: int, passes: int) -> list[dict]:
    """REV's native library (theirs) against the working tree's, in turns: a row per panel layout and
    row count."""
    import ctypes

    from prefix_service.backends.cpu import native
    threads = torch.get_num_threads()
    results = []
    libs = {"this": native.require(), rev: theirs}
    print(f"{rev}'s native kernel and the working tree's in turns, {rounds} rounds, a round's minimum of "
          f"{passes} passes (ms a pass over every layer)")
    print(f"{'panels':>8} {'rows':>6} {rev + ' ms':>15} {'this ms':>9} {'this/' + rev + ' (range)':>26} "
          f"{'same bits':>9}")
    for panels in ("float32", "bf16"):
        held = [[cpu_linear.NativeLinear(w if panels == "float32" else w.to(torch.bfloat16).float(), None,
                                         panels="float32" if panels == "float32" else "auto") for w in layer]
                for layer in weights]
        entry = held[0][0]._entry
        assert all(m._entry == entry for layer in held for m in layer), "every weight on one kind of panels"
        for rows in rows_list:
            gen = torch.Generator().manual_seed(rows)
            xs = {i: torch.randn(rows, i, generator=gen) for _, i in shapes}
            ys = {o: torch.empty(rows, o) for o, _ in shapes}

            def run(lib: ctypes.CDLL) -> float:
                fn = getattr(lib, entry)
                t = time.perf_counter()
                for layer in held:
                    for m, (o, i) in zip(layer, shapes):
                        fn(m.handle, xs[i].data_ptr(), i, rows, ys[o].data_ptr(), o, threads)
                return time.perf_counter() - t

            for lib in libs.values():  # warm
                run(lib)
            mins: dict[str, list[float]] = {side: [] for side in libs}
            for r in range(rounds):
                order = list(libs) if r % 2 == 0 else list(libs)[::-1]
                for side in order:
                    mins[side].append(min(run(libs[side]) for _ in range(passes)) * 1e3)
            same = True
            for layer in held:  # every layer's output from both, for the bits
                for m, (o, i) in zip(layer, shapes):
                    ys_both = [torch.empty(rows, o) for _ in libs]
                    for lib, y in zip(libs.values(), ys_both):
                        native.check(getattr(lib, entry)(m.handle, xs[i].data_ptr(), i, rows, y.data_ptr(), o,
                                                         threads), entry)
                    same = same and torch.equal(*ys_both)
            ratios = [a / b for a, b in zip(mins["this"], mins[rev])]
            r = {"panels": panels, "rows": rows, "theirs_ms": round(statistics.median(mins[rev]), 3),
                 "ours_ms": round(statistics.median(mins["this"]), 3),
                 "ratio": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                           "max": round(max(ratios), 3)}, "same_bits": same}
            results.append(r)
            ratio = f"{r['ratio']['median']:.3f} ({r['ratio']['min']:.2f}-{r['ratio']['max']:.2f})"
            print(f"{panels:>8} {rows:>6} {r['theirs_ms']:>15.2f} {r['ours_ms']:>9.2f} {ratio:>26} "
                  f"{'yes' if same else 'NO':>9}", flush=True)
    return results


def machine() -> dict:
    from prefix_service.bench.main import machine_info
    try:
        return machine_info()
    except ImportError:  # the bench extra's imports (grpc, transformers) are not needed for the CPU's name
        from prefix_service import cpuinfo
        return {"isa": cpuinfo.isa(), "cpu_count": os.cpu_count()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M's shape)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "int8"), default="float32",
                   help="the weights' dtype (bfloat16, int8 weight-only: against the float32 kernel)")
    p.add_argument("--rows", default="1,4,16,64,100,256,1000", help="input rows per call, comma-separated")
    p.add_argument("--passes", type=int, default=9, help="timed passes per way and row count")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--reference-size", type=int, default=2048,
                   help="torch.mm on two square matrices of up to this size, float32 and bf16, as the machine's "
                        "reference GEMM rate (0: none)")
    p.add_argument("--against", metavar="REV", help="time REV's native float32 kernel and the working tree's in "
                   "turns, over float32 and bf16 panels (--dtype float32)")
    p.add_argument("--rounds", type=int, default=5, help="with --against: rounds of the two in turns")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.reference_size < 0:
        p.error("--reference-size must be >= 0")
    if args.against and args.dtype != "float32":
        p.error("--against times the native float32 kernel: --dtype float32")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes, num_layers, name = layer_shapes(args.model)
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=gen) / i ** 0.5 for o, i in shapes] for _ in range(num_layers)]
    if args.against:
        from native_revision import RevisionUnavailable, library_of

        from prefix_service.backends.cpu import native
        if (reason := native.load()[1]) is not None:
            print(f"no native library here: {reason}", file=sys.stderr)
            return 1
        try:
            commit, theirs = library_of(args.against)
        except RevisionUnavailable as exc:
            print(exc, file=sys.stderr)
            return 1
        info = machine()
        print(f"{name}: {num_layers} layers x {len(shapes)} linears, {torch.get_num_threads()} threads, "
              f"ISA {', '.join(info.get('isa', [])) or '?'}")
        results = compare_native(args.against, theirs, shapes, weights, [int(r) for r in args.rows.split(",")],
                                 args.rounds, args.passes)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"model": name, "layers": num_layers, "against": args.against, "against_commit": commit,
                           "rounds": args.rounds,
                           "passes": args.passes, "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "machine": info, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results},
                          f, indent=2)
            print(f"JSON: {args.json}")
        return 0 if all(r["same_bits"] for r in results) else 1
    params = sum(w.numel() for layer in weights for w in layer)
    ways = build_ways(weights, args.dtype)
    names = list(ways)
    base = names[0]
    # the weight bytes each way streams a pass: 4 a parameter in float32, 2 in bf16 (the service's
    # emulated kernel holds its weights widened to float32)
    from prefix_service.backends.cpu import onednn
    # (int8: 1; inner_product_int8 reads its int8 blocks in calls of up to 128 rows, its bf16 copy above)
    per_param = {way: 1 if "int8" in way else 2 if dt == torch.bfloat16 or way.startswith(("brgemm", "inner_product"))
                 or way == "native_bf16_panels" else 4 for way, (_, dt) in ways.items()}
    weight_bytes = {way: params * per_param[way] for way in names}
    info = machine()

    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        reference = reference_rates(args.reference_size, args.passes) if args.reference_size else {}
    if reference:
        print("reference: torch.mm on n-square matrices, "
              + ", ".join(f"{dt} {r['gflop_s']:.1f} GFLOP/s (n = {r['size']})" for dt, r in reference.items()))
    print(f"{name}: {num_layers} layers x {len(shapes)} linears, {params / 1e6:.1f} M parameters, {args.dtype}, "
          f"{torch.get_num_threads()} threads, ISA {', '.join(info.get('isa', [])) or '?'}; ms a pass "
          f"(GFLOP/s, GB/s of weights)")
    print(f"{'rows':>6} " + " ".join(f"{way + ' ms':>26}" for way in names)
          + "".join(f" {way + ' vs ' + base:>18}" for way in names[1:]))
    with torch.inference_mode():
        for rows in rows_list:
            xs = {(i, dt): torch.randn(rows, i, generator=gen).to(dt) for _, i in shapes
                  for dt in {torch.float32, torch.bfloat16}}

            def run(way: str) -> None:
                layers, dt = ways[way]
                for layer in layers:
                    for fn, (_, fan_in) in zip(layer, shapes):
                        fn(xs[(fan_in, dt)])

            times: dict[str, list[float]] = {way: [] for way in names}
            for way in names:  # warm
                run(way)
            for _ in range(args.passes):
                for way in names:
                    t = time.perf_counter()
                    run(way)
                    times[way].append(time.perf_counter() - t)
            flop = 2 * rows * params
            r: dict = {"rows": rows}
            for way in names:
                med = statistics.median(times[way])
                r.update({f"{way}_ms": round(med * 1e3, 4), f"{way}_gflop_s": round(flop / med / 1e9, 1),
                          f"{way}_gb_s": round(weight_bytes[way] / med / 1e9, 1)})
            for way in names[1:]:
                r[f"{way}_speedup"] = round(r[f"{base}_ms"] / r[f"{way}_ms"], 2)
            results.append(r)
            print(f"{rows:>6} " + " ".join(f"{r[way + '_ms']:>9.1f} ({r[way + '_gflop_s']:>6.1f}, {r[way + '_gb_s']:>5.1f})"
                                          for way in names)
                  + "".join(f" {r[way + '_speedup']:>17.2f}x" for way in names[1:]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": name, "layers": num_layers, "dtype": args.dtype, "parameters": params,
                       "weight_bytes": weight_bytes, "ways": names, "baseline": base,
                       "bf16_native": onednn.bf16_native(),
                       "brgemm_vnni": onednn.brgemm_vnni(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "machine": info,
                       "reference": reference,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
