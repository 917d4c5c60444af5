"""The cpu backend in each dtype, engine to engine, on the intent workload (the 939-token intent
template pinned, 100-token user segments, 30 greedy tokens, EOS ignored): time to first token of
one request on the cached template, and output tokens per second with 16 and 64 requests submitted
together (Engine.generate). Every timed request sends a segment never sent before.

`--vllm-dtypes bfloat16,float32` adds vLLM engine to engine (its offline `LLM.generate`, automatic
prefix caching on, the same token ids, sequences and tokens per step; its environment from `make
bench-peers`, started as its CPU docs ask): one untimed request caches the template's blocks, its
TTFT is the wall time of a one-token request (ours: the engine's own TTFT), tok/s as ours. A second
table (and the JSON's `against_vllm`) sets each of our systems against each vLLM one: how many times
sooner our first token comes and our tok/s over vLLM's, and whether the targets hold (1.5x sooner,
1.3x the tok/s at 16 and 64 requests).

Each (system, round) runs in a fresh child process, the systems in turns, so a noisy machine
spreads over all of them; the table gives medians over rounds. A system is a dtype, optionally of
another checkout of this repository (`--baseline PATH`: the same measures with that tree's
package, for an A/B of one dtype before and after a change), or a dtype under environment
variables (`--system NAME:DTYPE:VAR=VALUE[,VAR=VALUE]`, repeatable: a kernel choice against the
default in the same turns). A dtype `+int8` runs with int8 weights (model.quantization: int8). The
JSON records the CPU, its instruction sets (AMX-BF16, AVX512-BF16, AVX-512, AVX2) and the load.

    python scripts/bench_cpu_dtype.py --json bench_out/cpu_dtype.json
    python scripts/bench_cpu_dtype.py --system bf16-matrix:bfloat16:PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION=matrix
    python scripts/bench_cpu_dtype.py --dtypes float32 --baseline /tmp/before --json bench_out/ab.json
    python scripts/bench_cpu_dtype.py --vllm-dtypes bfloat16,float32 --json bench_out/cpu_dtype_vllm.json
    python scripts/bench_cpu_dtype.py --concurrency 1,4,16,64 --plot bench_out/cpu_dtype.png
    python scripts/bench_cpu_dtype.py --dtypes bfloat16 --temperature 1.0 --baseline /tmp/before
    python scripts/bench_cpu_dtype.py --dtypes bfloat16 --temperature 0.7 --top-p 0.9 --baseline /tmp/before
    python scripts/bench_cpu_dtype.py --dtypes bfloat16,bfloat16+int8 --concurrency 1,4,16,64
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# our systems' dtypes: a model.dtype, with int8 weights after "+int8" (model.quantization)
DTYPES = ("float32", "bfloat16", "float32+int8", "bfloat16+int8")


# issue targets for the cpu backend against vLLM on the same machine: its first token at least this
# many times sooner, and at least this multiple of vLLM's tok/s at these request counts
TTFT_TARGET = 1.5
TOK_S_TARGET = 1.3
TOK_S_TARGET_AT = (16, 64)


def against_vllm(table: dict[str, dict], concurrency: list[int]) -> list[dict]:
    """Each of our systems against each vLLM system ("vllm-..." in table, the medians): how many times
    sooner our first token comes (theirs / ours), our tok/s over theirs at each request count, and
    whether the targets hold (None where a measure or target count is missing)."""
    from prefix_service.bench.report import ratio
    ours = [n for n in table if not n.startswith("vllm-")]
    rows = []
    for peer in (n for n in table if n.startswith("vllm-")):
        for name in ours:
            a, b = table[name], table[peer]
            ttft = ratio(b.get("ttft_ms"), a.get("ttft_ms"))
            tok = {c: ratio(a.get(f"tok_s_{c}"), b.get(f"tok_s_{c}")) for c in concurrency}
            checked = [tok[c] for c in TOK_S_TARGET_AT if c in tok]
            tok_met = None if not checked or None in checked else all(r >= TOK_S_TARGET for r in checked)
            rows.append({"ours": name, "vllm": peer, "ttft_x_sooner": ttft, "tok_s_ratio": tok,
                         "ttft_target_met": None if ttft is None else ttft >= TTFT_TARGET,
                         "tok_s_target_met": tok_met})
    return rows


def child(args: argparse.Namespace) -> None:
    """One system, one round: measures printed as one JSON line."""
    sys.path.insert(0, str(Path(args.repo).resolve()))
    from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
    from prefix_service import SchedulerConfig
    from prefix_service.bench.workloads import Sizes, build_workload
    from prefix_service.prepare_model import prepare_default_model

    model = args.model or prepare_default_model(progress=False)
    dtype, _, quantization = args.child.partition("+")  # e.g. bfloat16+int8: model.quantization int8
    engine = Engine(EngineConfig(ModelConfig(path=str(model), dtype=dtype, device="cpu", backend="cpu",
                                             load_format=args.load_format, quantization=quantization or "none"),
                                 CacheConfig(block_size=16, kv_cache_memory=1 << 30),
                                 SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
    work = build_workload("intent", engine.tokenizer, Sizes())
    start = time.perf_counter()
    engine.add_template(work.prefix_name, token_ids=list(work.prefix_ids))
    warm_ms = (time.perf_counter() - start) * 1e3
    params = SamplingParams(max_tokens=work.output_tokens, ignore_eos=True, temperature=args.temperature,
                            top_p=args.top_p)
    index = iter(range(args.round * 100_000, 10**9))  # segments of this round only: never sent before

    def batch(n: int) -> tuple[float, list]:
        reqs = [GenerateRequest(prompt_token_ids=list(work.request(next(index)).prompt_ids),
                                prefix_name=work.prefix_name, sampling=params) for _ in range(n)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        return time.perf_counter() - t0, out

    batch(2)  # warm: the kernels' first calls
    # start-up's objects out of later collections, as the server does once it serves (inline, not
    # prefix_service/heap.py: a --baseline checkout may predate it)
    gc.collect()
    gc.freeze()
    ttft = [batch(1)[1][0].ttft_ms for _ in range(args.singles)]
    result = {"template_warmup_ms": warm_ms, "ttft_ms": statistics.median(ttft), "ttft_all_ms": ttft,
              "backend": engine.info.backend_description, "quantization": quantization or "none"}
    for n in args.concurrency:
        wall, out = batch(n)
        assert all(len(o.token_ids) == work.output_tokens for o in out)
        result[f"tok_s_{n}"] = n * work.output_tokens / wall
    engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def vllm_child(args: argparse.Namespace) -> None:
    """vLLM in one dtype, one round, in its own environment: measures printed as one JSON line. The
    token ids come from the parent (--ids: the template's, and each round's segments)."""
    import statistics as st

    from vllm import LLM, SamplingParams, TokensPrompt
    ids = json.loads(Path(args.ids).read_text())
    prefix, segments = ids["prefix"], iter(ids["segments"][str(args.round)])  # this round's only
    llm = LLM(model=ids["model"], dtype=args.vllm_child, enable_prefix_caching=True, max_num_seqs=64,
              max_num_batched_tokens=2048, max_model_len=4096, seed=0,
              gpu_memory_utilization=0.3)  # its CPU KV cache: 30% of memory, as the harness starts its server

    def batch(n: int, tokens: int) -> float:
        prompts = [TokensPrompt(prompt_token_ids=prefix + next(segments)) for _ in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=args.temperature,
                                                    top_p=args.top_p), use_tqdm=False)
        wall = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return wall

    batch(2, ids["output_tokens"])  # the template's blocks cached, the kernels warm
    ttft = [batch(1, 1) * 1e3 for _ in range(args.singles)]
    result = {"ttft_ms": st.median(ttft), "ttft_all_ms": ttft, "backend": f"vllm {args.vllm_child}"}
    for n in args.concurrency:
        result[f"tok_s_{n}"] = n * ids["output_tokens"] / batch(n, ids["output_tokens"])
    print("RESULT " + json.dumps(result), flush=True)


def workload_ids(path: Path, rounds: int, per_round: int) -> None:
    """The intent workload's token ids for vLLM: the template's, and per round `per_round` segments of
    that round only (the same segments our engine gets in that round)."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from prefix_service.bench.workloads import Sizes, build_workload
    from prefix_service.prepare_model import prepare_default_model
    model = prepare_default_model(progress=False)
    work = build_workload("intent", AutoTokenizer.from_pretrained(str(model)), Sizes())
    segments = {r: [list(work.request(r * 100_000 + i).prompt_ids) for i in range(per_round)] for r in range(rounds)}
    path.write_text(json.dumps({"model": str(model), "prefix": list(work.prefix_ids), "segments": segments,
                                "output_tokens": work.output_tokens}))




def parse_system(spec: str) -> tuple[str, str, str, dict[str, str]]:
    """--system NAME:DTYPE:VAR=VALUE[,VAR=VALUE] as a system of this checkout; exits naming the
    problem when the spec is malformed."""
    parts = spec.split(":", 2)
    if len(parts) != 3 or not parts[0] or parts[1] not in DTYPES:
        sys.exit(f"--system {spec!r}: NAME:DTYPE:VAR=VALUE[,VAR=VALUE] with DTYPE one of {', '.join(DTYPES)} is needed")
    variables = {}
    for item in parts[2].split(","):
        var, eq, value = item.partition("=")
        if not var or not eq:
            sys.exit(f"--system {spec!r}: {item!r} is not VAR=VALUE")
        variables[var] = value
    return parts[0], str(REPO), parts[1], variables


def plot(path: Path, table: dict[str, dict], concurrency: list[int], title: str) -> bool:
    """Output tok/s against the requests submitted together, one line per system (vLLM's dashed), and
    each system's TTFT; False (nothing drawn) with fewer than two concurrencies."""
    if len(set(concurrency)) < 2:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    xs = sorted(set(concurrency))
    color = {name: f"C{i}" for i, name in enumerate(table)}  # a system's color in both panels
    for name, row in table.items():
        xy = [(n, row[f"tok_s_{n}"]) for n in xs if row.get(f"tok_s_{n}") is not None]
        left.plot([x for x, _ in xy], [y for _, y in xy], "--" if name.startswith("vllm") else "-", marker="o",
                  label=name, color=color[name])
    left.set_xscale("log", base=2)
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    left.set_xticks(xs)
    left.set_xlabel("requests submitted together")
    left.set_ylabel("output tokens/s")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    names = [name for name, row in table.items() if row.get("ttft_ms") is not None]
    bars = right.bar(names, [table[name]["ttft_ms"] for name in names], color=[color[name] for name in names])
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_ylabel("TTFT, template cached, one request (ms)")
    right.tick_params(axis="x", labelrotation=30, labelsize=8)
    right.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"intent, engine to engine: {title}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--baseline", help="another checkout: its package runs the same dtypes as systems 'base-*'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--singles", type=int, default=5, help="single requests per round (TTFT median)")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--vllm-dtypes", default="", help="vLLM systems, e.g. bfloat16,float32 (make bench-peers)")
    ap.add_argument("--system", action="append", default=[], metavar="NAME:DTYPE:VAR=VALUE[,VAR=VALUE]",
                    help="one more system: DTYPE with these environment variables (repeatable)")
    ap.add_argument("--model", help="a model directory instead of the default model (prepare-model)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights from --model's config.json (a host without the model's weights; "
                         "speed only, the tokens are noise)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's (default 0: greedy; 1.0: what an OpenAI client gets by default)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="every request's (default 1.0: none; with a --temperature above 0)")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="a PNG: output tok/s against the requests submitted together (two or more "
                                   "--concurrency values), and TTFT, per system")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.child:
        child(args)
        return
    if args.vllm_child:
        vllm_child(args)
        return
    # (name, package checkout or "vllm", dtype, environment variables it runs under)
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        sys.exit(f"--dtypes: {', '.join(bad)} is none of {', '.join(DTYPES)}")
    systems: list[tuple[str, str, str, dict[str, str]]] = [(d, str(REPO), d, {}) for d in dtypes]
    if args.baseline:
        systems = [(f"base-{d}", args.baseline, d, {}) for d in dtypes] + systems
    for spec in args.system:
        systems.append(parse_system(spec))
    if len({name for name, *_ in systems}) != len(systems):
        sys.exit(f"system names must differ: {[name for name, *_ in systems]}")
    vllm_dtypes = [d for d in args.vllm_dtypes.split(",") if d]
    ids_file = Path(tempfile.mkdtemp()) / "ids.json"
    if vllm_dtypes:
        sys.path.insert(0, str(REPO))
        from prefix_service.bench.systems.vllm import server_env, vllm_python
        python, why = vllm_python()
        if python is None:
            sys.exit(why)
        workload_ids(ids_file, args.rounds, 2 + args.singles + sum(args.concurrency))
        systems += [(f"vllm-{d}", "vllm", d, {}) for d in vllm_dtypes]
    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, git_commit, isa_label, machine_info
    info = machine_info()
    runs: dict[str, list[dict]] = {name: [] for name, *_ in systems}
    for r in range(args.rounds):
        for name, repo, dtype, variables in systems:
            common = ["--round", str(r), "--singles", str(args.singles), "--concurrency",
                      ",".join(map(str, args.concurrency)), "--load-format", args.load_format,
                      "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
            if args.model:
                common += ["--model", args.model]
            env = None
            if repo == "vllm":
                cmd = [python, __file__, "--vllm-child", dtype, "--ids", str(ids_file), *common]
                env = server_env(python)
            else:
                cmd = [sys.executable, __file__, "--child", dtype, "--repo", repo, *common]
                env = {**os.environ, **variables} if variables else None
            runs[name].append(child_result(cmd, env, f"{name} (round {r})"))
            print(f"round {r} {name}: {runs[name][-1]['backend']}", file=sys.stderr)
    keys = ["ttft_ms"] + [f"tok_s_{n}" for n in args.concurrency] + ["template_warmup_ms"]
    # a measure a system does not make (vLLM has no template warmup of its own) is None
    table = {name: {k: statistics.median(run[k] for run in rs) if all(k in run for run in rs) else None
                    for k in keys} for name, rs in runs.items()}
    info["load_average_end"] = list(os.getloadavg())
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs, medians of {args.rounds} rounds")
    print("| system | " + " | ".join(keys) + " |")
    print("| --- | " + " | ".join("---" for _ in keys) + " |")
    for name, row in table.items():
        print(f"| {name} | " + " | ".join("-" if row[k] is None else f"{row[k]:.1f}" for k in keys) + " |")
    versus = against_vllm(table, args.concurrency)
    if versus:
        def cell(r: float | None) -> str:
            return "-" if r is None else f"{r:.2f}x"

        def met(ok: bool | None) -> str:
            return "-" if ok is None else "yes" if ok else "NO"
        print(f"\nagainst vLLM (targets: first token >= {TTFT_TARGET}x sooner; tok/s >= {TOK_S_TARGET}x at "
              f"{' and '.join(map(str, TOK_S_TARGET_AT))} requests)")
        print("| ours | vLLM | TTFT, x sooner | " + " | ".join(f"tok/s x, {c}" for c in args.concurrency)
              + " | TTFT target | tok/s target |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in args.concurrency) + " | --- | --- |")
        for v in versus:
            print(f"| {v['ours']} | {v['vllm']} | {cell(v['ttft_x_sooner'])} | "
                  + " | ".join(cell(v["tok_s_ratio"][c]) for c in args.concurrency)
                  + f" | {met(v['ttft_target_met'])} | {met(v['tok_s_target_met'])} |")
    if args.plot:
        title = f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs, medians of {args.rounds} rounds"
        if plot(Path(args.plot), table, args.concurrency, title):
            print(f"plot: {args.plot}")
        else:
            print("no plot: it needs two or more --concurrency values", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        described = {name: {"dtype": dtype, "checkout": repo, "environment": variables,
                            **({} if repo == "vllm" else {"git_commit": git_commit(repo)})}
                     for name, repo, dtype, variables in systems}
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "systems": described,
                                               "medians": table, "against_vllm": versus, "runs": runs,
                                               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                               "git_commit": git_commit()},
                                              indent=2))


if __name__ == "__main__":
    main()
