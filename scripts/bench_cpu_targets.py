"""Every target of the cpu backend against vLLM in one run on one machine, and the table that judges
them: the measures of docs/benchmarks.md's "Every bf16 target in one run", in the same order, one
after the other with nothing else running, each writing its JSON into OUT, then one table.

1. our own ratios in our dtype (`profile_prefill.py`, paths prefix, no_prefix and alone): a 1,000-token
   prompt alone against its last 100 tokens on the 900-token template (full / prefix), and those
   100 tokens on the template against the same 100 alone (prefix / alone);
2. engine to engine (`bench_cpu_dtype.py`): our float32 and bf16 against vLLM's offline engine in
   bf16 (its default for this checkpoint) and float32, TTFT and tok/s at 1, 4, 16 and 64 requests
   submitted together, with a plot;
3. through the servers (`prefix-service bench`, single and closed loop): our gRPC server against
   vLLM's OpenAI server in its default dtype and, where the engine run found the other one faster
   here, in that one too (--vllm-servers leaves one out: on a CPU without bf16 units vLLM's bf16 is
   emulated, ~10 tok/s here, and its server runs alone would take over an hour);
4. the open loop through the servers: the most requests/s each system serves with p99 end to end
   under 2 s, at rates set from step 3's closed-loop throughput unless --qps names them;
5. the ratios of step 1 again (the machine after the rest).

Before each step the script waits for the machine to settle (idle over SETTLE_WINDOW_S, at most
--settle-s): a server of the step before may still be going away, and a step started in its tail
measured it (a second ratios run straight after the open loop gave 7.39x where the quiet rerun gave
8.19x, docs/benchmarks.md).

Ours is the dtype `model.dtype: auto` picks on this CPU (bf16 where it has bf16 units). The table
(OUT/targets.md, and OUT/targets.json with the machine, its instruction sets and the load) has a
row per target and vLLM system. It needs vLLM's environment (`make bench-peers`). --summary-only
reads the JSON an earlier run left in OUT and prints the table again; --resume skips the steps
whose JSON is there already.

    make bench-peers
    python scripts/bench_cpu_targets.py --out bench_out/targets
    python scripts/bench_cpu_targets.py --out bench_out/targets --qps 1.5,2,2.5,3,3.5,4
    python scripts/bench_cpu_targets.py --out bench_out/targets --resume --vllm-servers float32
    python scripts/bench_cpu_targets.py --out bench_out/targets --summary-only
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# the targets (the issue's): our tok/s over vLLM's at 16 and 64 requests, how many times sooner our
# first token comes, our most requests/s under the SLO over vLLM's, and our own ratios (the in bf16)
TOK_S_AT_LEAST = 1.3
TTFT_AT_LEAST = 1.5
OPEN_LOOP_AT_LEAST = 1.5
FULL_OVER_PREFIX_AT_LEAST = 7.5
PREFIX_OVER_ALONE_AT_MOST = 1.45
OUTPUT_TOKENS = 30  # the intent workload's, per request
# the open loop's rates, as fractions of a system's closed-loop requests/s at 64 clients
OPEN_FRACTIONS = (0.35, 0.5, 0.65, 0.8)
SETTLE_WINDOW_S = 2.0  # before each step: the CPUs idle over this long (bench.modes.wait_idle)
SETTLE_MAX_S = 120.0  # the default of --settle-s

# each step's JSON in OUT
FILES = {"ratios-1": "ratios-1.json", "engine": "engine.json", "servers": "servers.json", "open": "open.json",
         "ratios-2": "ratios-2.json"}
VLLM_SERVER = {"bfloat16": "vllm_apc_bf16", "float32": "vllm_apc_f32"}


class TargetsError(RuntimeError):
    """A step's JSON is missing or lacks a measure the table needs."""


def load(out: Path, step: str) -> dict[str, Any]:
    path = out / FILES[step]
    if not path.exists():
        raise TargetsError(f"{path} is missing: run the step {step!r} first (without --summary-only)")
    with path.open() as f:
        data: dict[str, Any] = json.load(f)
    return data


def ours_dtype() -> str:
    """The dtype `model.dtype: auto` picks on this CPU."""
    import torch
    from prefix_service.model.loader import choose_dtype
    return "bfloat16" if choose_dtype("auto", REPO, torch.device("cpu"))[0] == torch.bfloat16 else "float32"


def vllm_dtypes(engine: dict[str, Any]) -> list[str]:
    """vLLM's dtypes to judge against: its default for this checkpoint (bfloat16), and its faster one
    engine to engine here (more tok/s at 16 requests) where that is the other."""
    medians = engine["medians"]
    out = ["bfloat16"]
    speeds = {d: (medians.get(f"vllm-{d}") or {}).get("tok_s_16") for d in ("bfloat16", "float32")}
    if speeds["float32"] is not None and (speeds["bfloat16"] is None or speeds["float32"] > speeds["bfloat16"]):
        out.append("float32")
    return out


def planned(data: dict[str, Any], system: str) -> bool:
    """Whether a bench run was asked to run a system (its JSON's plan); true for JSON that names no plan."""
    systems = (data.get("plan") or {}).get("systems")
    return systems is None or system in systems


def vllm_server_names(text: str) -> list[str]:
    """--vllm-servers' value: comma-separated vLLM dtypes, each one of VLLM_SERVER's."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in names if d not in VLLM_SERVER]
    if unknown or not names:
        what = f"unknown dtype(s) {', '.join(unknown)}" if unknown else f"no dtype in {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(VLLM_SERVER)}")
    return names


def server_dtypes(engine: dict[str, Any], chosen: list[str] | None) -> list[str]:
    """vLLM's dtypes to run through the servers: those the engine run judges (vllm_dtypes), or of them the
    ones --vllm-servers names."""
    judged = vllm_dtypes(engine)
    return judged if chosen is None else [d for d in judged if d in chosen]


def open_rates(servers: dict[str, Any], systems: list[str]) -> list[float]:
    """Offered rates for the open loop: OPEN_FRACTIONS of each system's closed-loop requests/s at 64
    clients, rounded to 0.5 (at least 0.5), in increasing order."""
    rates: set[float] = set()
    for system in systems:
        rec = record(servers, system, "closed_loop", 64)
        per_s = rec["output_tok_s"] / OUTPUT_TOKENS
        rates.update(max(0.5, math.floor(per_s * f * 2 + 0.5) / 2) for f in OPEN_FRACTIONS)
    return sorted(rates)


def record(data: dict[str, Any], system: str, mode: str, concurrency: int | None = None) -> dict[str, Any]:
    """The bench record of a system in a mode (at a concurrency)."""
    for rec in data["records"]:
        if rec["system"] == system and rec["mode"] == mode and (concurrency is None or rec["concurrency"] == concurrency):
            return dict(rec)
    at = f" at concurrency {concurrency}" if concurrency is not None else ""
    raise TargetsError(f"no {mode} record of {system}{at} in the servers' or open loop's JSON")


def row(measure: str, ours: float | None, theirs: float | None, value: float | None, target: str,
        met: bool | None, vllm: str | None = None) -> dict[str, Any]:
    return {"measure": measure, "vllm": vllm, "ours": ours, "theirs": theirs, "value": value, "target": target,
            "met": met}


def compared(measure: str, ours: float | None, theirs: float | None, at_least: float, vllm: str,
             sooner: bool = False) -> dict[str, Any]:
    """A row judging our figure against vLLM's: ours / theirs, or theirs / ours for a time (sooner),
    at least at_least; no figure (met None) where either is missing."""
    value = (theirs / ours if sooner else ours / theirs) if ours and theirs else None
    return row(measure, ours, theirs, value, f">= {at_least}x" + (" sooner" if sooner else ""),
               None if value is None else value >= at_least, vllm)


def summarize(out: Path, ours: str | None = None) -> dict[str, Any]:
    """The targets table from the steps' JSON in out. ours: our dtype (default: auto's choice here)."""
    ours = ours or ours_dtype()
    steps = {step: load(out, step) for step in ("engine", "servers", "open", "ratios-1", "ratios-2")}
    engine, servers, opened = steps["engine"], steps["servers"], steps["open"]
    medians = engine["medians"]
    if ours not in medians:
        raise TargetsError(f"the engine run has no {ours!r} system (ours, auto's choice here)")
    peers = vllm_dtypes(engine)
    rows = []
    for dtype in peers:
        peer, server = medians.get(f"vllm-{dtype}"), VLLM_SERVER[dtype]
        if peer is None:
            raise TargetsError(f"the engine run has no vllm-{dtype} system")
        served = planned(servers, server) and planned(opened, server)

        def via_servers(measure: str, data: dict[str, Any], mode: str, key: str, at_least: float,
                        n: int | None = None, sooner: bool = False) -> dict[str, Any]:
            """A row judging our server's figure against this vLLM server's in a mode; for a server left out
            of the runs (--vllm-servers), no figure, and a note saying why."""
            if not served:
                return compared(measure, None, None, at_least, dtype, sooner) | {
                    "note": f"{server} not run (--vllm-servers)"}
            ours_fig, theirs_fig = (record(data, s, mode, n).get(key) for s in ("grpc_prefix", server))
            return compared(measure, ours_fig, theirs_fig, at_least, dtype, sooner)

        for n in (16, 64):
            rows.append(compared(f"tok/s, {n} requests together, engine to engine", medians[ours].get(f"tok_s_{n}"),
                                 peer.get(f"tok_s_{n}"), TOK_S_AT_LEAST, dtype))
        for n in (16, 64):
            rows.append(via_servers(f"tok/s, {n} clients, through the servers", servers, "closed_loop",
                                    "output_tok_s", TOK_S_AT_LEAST, n))
        rows.append(compared("TTFT, template cached, one request, engine to engine (ms; x sooner)",
                             medians[ours].get("ttft_ms"), peer.get("ttft_ms"), TTFT_AT_LEAST, dtype, sooner=True))
        rows.append(via_servers("TTFT p50, template cached, single requests, through the servers (ms; x sooner)",
                                servers, "single", "ttft_p50_ms", TTFT_AT_LEAST, sooner=True))
        open_row = via_servers("most requests/s with p99 e2e < 2 s, open loop, through the servers", opened,
                               "open_loop", "max_qps_under_slo", OPEN_LOOP_AT_LEAST)
        if open_row["value"] is None and served:  # under the SLO at no rate tried: ours leads where only vLLM has none
            open_row["met"] = (bool(open_row["ours"]) and not open_row["theirs"]) or None
        rows.append(open_row)
    full = [steps[s]["ratio"]["ttft_p50"] for s in ("ratios-1", "ratios-2")]
    in_dtype = steps["ratios-1"].get("dtype", "bfloat16")  # earlier runs' JSON named none: they ran bf16
    alone = [steps[s]["ratio"]["alone_p50"] for s in ("ratios-1", "ratios-2")]
    rows.append(row(f"TTFT full / prefix in {in_dtype} (1,000 tokens alone; the last 100 on the 900-token template), "
                    "two runs",
                    None, None, min(full), f">= {FULL_OVER_PREFIX_AT_LEAST}x",
                    min(full) >= FULL_OVER_PREFIX_AT_LEAST) | {"values": full})
    rows.append(row(f"TTFT prefix / alone in {in_dtype} (100 tokens on the template; the same 100 alone), two runs",
                    None, None, max(alone), f"<= {PREFIX_OVER_ALONE_AT_MOST}x",
                    max(alone) <= PREFIX_OVER_ALONE_AT_MOST) | {"values": alone})
    return {"ours": ours, "vllm_dtypes": peers, "machine": engine.get("machine"), "git_commit": engine.get("git_commit"),
            "load_average": {s: steps[s].get("machine", {}).get("load_average_start") for s in FILES}, "rows": rows,
            "all_met": all(r["met"] is True for r in rows)}


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown(summary: dict[str, Any]) -> str:
    """The table of summarize()'s rows."""
    from prefix_service.bench.main import isa_label
    m = summary.get("machine") or {}
    lines = [f"Machine: {m.get('cpu', '?')}, {m.get('cpu_count', '?')} CPUs, ISA {isa_label(m)}; "
             f"tree {str(summary.get('git_commit') or '?')[:7]}; ours: {summary['ours']} (auto's choice here)", "",
             "| measure | vLLM dtype | ours | vLLM | ratio | target | result |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        value = (", ".join(f"{v:.2f}x" for v in r["values"]) if "values" in r else
                 "-" if r["value"] is None else f"{r['value']:.2f}x")
        result = {True: "met", False: "missed", None: "no figure"}[r["met"]]
        result += f" ({r['note']})" if "note" in r else ""
        lines.append(f"| {r['measure']} | {r['vllm'] or '-'} | {_num(r['ours'])} | {_num(r['theirs'])} | {value} | "
                     f"{r['target']} | {result} |")
    lines.append("")
    lines.append(verdict(summary["rows"]))
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict[str, Any]]) -> str:
    """The table's last line: every target met, or how many were met, missed, and left without a figure."""
    met = sum(r["met"] is True for r in rows)
    if met == len(rows):
        return "every target met"
    missed, none = sum(r["met"] is False for r in rows), sum(r["met"] is None for r in rows)
    return (f"not every target met: {met} of {len(rows)} met, {missed} missed, {none} without a figure"
            + (" (every target with a figure met)" if missed == 0 else ""))


def commands(out: Path, args: argparse.Namespace, step: str) -> list[list[str]]:
    """The command of a step (the open loop's rates and vLLM's servers read from earlier steps)."""
    py, scripts = sys.executable, REPO / "scripts"
    ratios = [py, str(scripts / "profile_prefill.py"), "--backend", "cpu", "--device", "cpu", "--dtype", ours_dtype(),
              "--runs", "15", "--profile-runs", "5", "--paths", "prefix,no_prefix,alone"]
    bench = [py, "-m", "prefix_service.cli", "bench", "--workloads", "intent"]
    if step in ("ratios-1", "ratios-2"):
        return [ratios + ["--json", str(out / FILES[step])]]
    if step == "engine":
        return [[py, str(scripts / "bench_cpu_dtype.py"), "--dtypes", "float32,bfloat16", "--vllm-dtypes",
                 "bfloat16,float32", "--rounds", str(args.rounds), "--singles", "3", "--concurrency", "1,4,16,64",
                 "--json", str(out / FILES[step]), "--plot", str(out / "engine.png")]]
    chosen = getattr(args, "vllm_servers", None)
    systems = ",".join(["grpc_prefix"] + [VLLM_SERVER[d] for d in server_dtypes(load(out, "engine"), chosen)])
    if step == "servers":
        return [bench + ["--systems", systems, "--modes", "single,closed_loop", "--concurrency", "1,4,16,64",
                         "--single-requests", "10", "--closed-min-requests", "64", "--closed-turns", "2",
                         "--json", str(out / FILES[step])]]
    qps = args.qps or ",".join(f"{r:g}" for r in open_rates(load(out, "servers"), systems.split(",")))
    return [bench + ["--systems", systems, "--modes", "open_loop", "--qps", qps, "--open-duration-s",
                     str(args.open_duration_s), "--json", str(out / FILES[step])]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a folder for each step's JSON and the table")
    p.add_argument("--qps", help="the open loop's offered rates (default: from the closed loop's throughput)")
    p.add_argument("--open-duration-s", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=2, help="engine to engine: rounds of every system")
    p.add_argument("--vllm-servers", metavar="DTYPES", type=vllm_server_names,
                   help="vLLM's dtypes to run through the servers (steps 3 and 4), of those the engine run judges "
                        "(default: all). Where its bf16 is emulated (no bf16 units) its server runs take an hour or "
                        "more; `--vllm-servers float32` leaves them out and their rows read 'no figure'")
    p.add_argument("--summary-only", action="store_true", help="only the table, from the JSON already in --out")
    p.add_argument("--resume", action="store_true", help="skip the steps whose JSON is in --out already")
    p.add_argument("--settle-s", type=float, default=SETTLE_MAX_S,
                   help=f"before each step, wait up to this long for the CPUs to be idle over {SETTLE_WINDOW_S:g} s "
                        "(0: not at all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        from prefix_service.bench import modes
        from prefix_service.bench.systems.vllm import vllm_python
        python, why = vllm_python()
        if python is None:  # every step but our own ratios needs it: say so before the first one runs
            print(f"error: {why}", file=sys.stderr)
            return 2
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        for step in FILES:
            if args.resume and (out / FILES[step]).exists():
                print(f"=== {step}: {out / FILES[step]} is there already", flush=True)
                continue
            waited = modes.wait_idle(args.settle_s, SETTLE_WINDOW_S)
            print(f"=== {step}: the machine settled in {waited:.1f} s (load average "
                  f"{', '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
            for cmd in commands(out, args, step):
                print(f"=== {step} ({time.strftime('%H:%M:%S')}): {' '.join(cmd)}", flush=True)
                if subprocess.run(cmd, cwd=REPO, env=env).returncode != 0:
                    print(f"step {step} failed; rerun with --resume to carry on from it", file=sys.stderr)
                    return 1
    try:
        summary = summarize(out)
    except TargetsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = markdown(summary)
    (out / "targets.md").write_text(table)
    (out / "targets.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table, end="")
    print(f"wrote {out / 'targets.md'} and {out / 'targets.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
