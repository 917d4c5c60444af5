"""`prefix-service bench` / `scripts/bench_prefix.py`: our engine with and without named prefixes,
transformers baselines, the gRPC server and vLLM's server, on the same model, machine and token ids.

Prints a table, writes JSON (schema: docs/benchmarks.md), a p99-latency-vs-QPS plot and a
throughput/TTFT-vs-concurrency plot.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from prefix_service.bench import report
from prefix_service.bench.plan import FULL, MODES, QUICK, Plan, with_overrides
from prefix_service.bench.systems import BY_NAME, KNOWN_SYSTEMS, SYSTEMS
from prefix_service.bench.workloads import CONSTRAINED_WORKLOADS, KNOWN_WORKLOADS, WORKLOADS

REPO = Path(__file__).resolve().parents[2]
DESCRIPTION = ("Benchmark operator-named prefixes: our engine with and without them, transformers baselines, "
               "the gRPC server and vLLM's server (where `make bench-peers` installed it), on the same model, "
               "machine and token ids. Prints a table, writes JSON and plots.")

EPILOG = """\
examples:
  prefix-service bench --quick                      # all systems, intent + no_shared, under 3 minutes
  prefix-service bench --json bench_out/full.json   # the full run of docs/benchmarks.md
  prefix-service bench --systems engine_prefix,engine_no_prefix --workloads intent --concurrency 1,16
  prefix-service bench --systems grpc_prefix,vllm_apc --workloads intent --modes closed_loop  # ours vs vLLM
  prefix-service bench --systems grpc_prefix,vllm_apc_bf16,vllm_apc_f32 --workloads intent  # vLLM in each dtype
  prefix-service bench --systems engine_prefix,grpc_prefix,vllm_apc_bf16 --workloads intent_labels  # labels as answers
  prefix-service bench --systems grpc_prefix,http_prefix,vllm_apc_bf16 --workloads doc_records  # JSON records
  prefix-service bench --systems grpc_prefix,http_prefix,vllm_apc_bf16 --workloads intent  # both servers over HTTP
"""


def _names(value: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(allowed)}")
    return names


def _ints(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {value!r}")
    return out


def _seconds(value: str) -> float:
    try:
        out = float(value)
    except ValueError:
        out = -1.0
    if not out >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {value!r}")
    return out


def _floats(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {value!r}")
    return tuple(sorted(out))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix-service bench", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--quick", action="store_true", help="a small plan (under 3 minutes on 2 CPU cores)")
    p.add_argument("--config", default=str(REPO / "configs" / "default.yaml"),
                   help="service config whose model, cache and scheduler every system uses (default: %(default)s)")
    p.add_argument("--model", help="override model.path of the config")
    p.add_argument("--json", default="bench_out/bench_prefix.json", metavar="PATH", help="default: %(default)s")
    p.add_argument("--plot", metavar="PATH", help="PNG of p99 latency vs offered QPS (default: the JSON path, .png)")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables as markdown (for docs/benchmarks.md)")
    p.add_argument("--workloads", type=lambda v: _names(v, KNOWN_WORKLOADS, "workload"),
                   help=f"default: {','.join(WORKLOADS)}; also answers under a constraint (the intent template's "
                        f"labels, the departures board's rows as JSON records): "
                        f"{','.join(w for w in KNOWN_WORKLOADS if w not in WORKLOADS)}")
    p.add_argument("--systems", type=lambda v: _names(v, KNOWN_SYSTEMS, "system"),
                   help=f"default: {','.join(SYSTEMS)}; also our server's HTTP API: {','.join(BY_NAME)}; vLLM in a "
                        f"stated dtype: {','.join(s for s in KNOWN_SYSTEMS if s not in SYSTEMS + BY_NAME)}")
    g = p.add_argument_group("modes")
    g.add_argument("--modes", type=lambda v: _names(v, MODES, "mode"), help=",".join(MODES) + " (default: all)")
    g.add_argument("--warmup", type=int, dest="warmup_requests", metavar="N", help="untimed requests per system")
    g.add_argument("--single-requests", type=int, metavar="N", help="single mode: requests per system and workload")
    g.add_argument("--concurrency", type=_ints, metavar="LIST",
                   help="closed loop on intent and the constrained workloads (intent_labels, doc_records), "
                        "e.g. 1,4,16,64")
    g.add_argument("--closed-min-requests", type=int, metavar="N", help="requests per closed-loop run (at least)")
    g.add_argument("--closed-rounds", type=int, metavar="N", help="closed loop: requests per client")
    g.add_argument("--closed-turns", type=int, metavar="N",
                   help="closed loop on the intent workloads: the requests in N parts, the systems taking turns "
                        "part by part "
                        "(A B, B A, ...), so that the machine's slow spells hit every system alike")
    g.add_argument("--qps", type=_floats, metavar="LIST", help="open loop: offered rates, tried in increasing order")
    g.add_argument("--open-duration-s", type=float, metavar="S", help="open loop: seconds of arrivals per rate")
    g.add_argument("--open-timeout-s", type=float, metavar="S", help="open loop: deadline of each request")
    g.add_argument("--slo-ms", type=float, metavar="MS", help="p99 end-to-end latency SLO (default 2000)")
    g.add_argument("--idle-wait-s", type=_seconds, metavar="S",
                   help="before each timed section, wait up to S seconds for the CPUs to go idle (default 5; "
                        "0: start at once, e.g. for a smoke run)")
    g = p.add_argument_group("workload sizes")
    g.add_argument("--prompt-tokens", type=int, metavar="N", help="intent: user prompt tokens (default 100)")
    g.add_argument("--total-tokens", type=int, metavar="N", help="ratio_0_32, no_shared: prompt tokens (default 1000)")
    g.add_argument("--output-tokens", type=int, metavar="N", help="generated tokens per request (default 30)")
    g.add_argument("--max-prefix-tokens", type=int, metavar="N", help="cut the templates to at most N tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    base = QUICK if args.quick else FULL
    sizes = dataclasses.replace(base.sizes, **{k: v for k, v in dict(
        prompt_tokens=args.prompt_tokens, total_tokens=args.total_tokens, output_tokens=args.output_tokens,
        max_prefix_tokens=args.max_prefix_tokens).items() if v is not None})
    closed = base.closed
    if args.concurrency or args.closed_turns:
        closed = tuple(dataclasses.replace(c, concurrencies=args.concurrency or c.concurrencies,
                                           turns=args.closed_turns if args.closed_turns is not None else c.turns)
                       if c.workload in ("intent",) + CONSTRAINED_WORKLOADS else c for c in closed)
    return with_overrides(base, workloads=args.workloads, systems=args.systems, modes=args.modes, sizes=sizes,
                          closed=closed,
                          warmup_requests=args.warmup_requests, single_requests=args.single_requests,
                          single_by_workload=() if args.single_requests is not None else None,
                          closed_min_requests=args.closed_min_requests, closed_rounds=args.closed_rounds,
                          qps=args.qps, open_duration_s=args.open_duration_s, open_timeout_s=args.open_timeout_s,
                          slo_ms=args.slo_ms, idle_wait_s=args.idle_wait_s)


def machine_info() -> dict:
    import grpc
    import torch
    import transformers
    from prefix_service import cpuinfo, envs
    cpu = cpuinfo.first_field("model name") or platform.processor() or ""
    # the kernel settings a run was made under (PREFIX_SERVICE_*: envs.py), {} where it used the machine's own choices
    return {"cpu": cpu, "cpu_vendor": cpuinfo.cpu_vendor(), "isa": cpuinfo.isa(), "cpu_march": cpuinfo.target(),
            "kernel_settings": envs.set_values(("kernels", "cuda")),
            "kernel_isa": cpuinfo.isa(cpuinfo.kernel_flags()), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "grpcio": grpc.__version__,
            "load_average_start": list(os.getloadavg())}


def isa_label(machine: dict) -> str:
    """machine_info()'s instruction sets for a table's or plot's heading: "AVX-512, AVX2", and the
    target the native kernels were built for where $PREFIX_SERVICE_CPU_MARCH named one."""
    label = ", ".join(machine.get("isa") or []) or "?"
    return label + (f", kernels built for -march={machine['cpu_march']}" if machine.get("cpu_march") else "")


def child_result(cmd: list[str], env: dict[str, str] | None, what: str, timeout_s: float | None = None) -> dict:
    """Run one measuring child process (a script's system in one round) and return the JSON it
    printed on its line starting with "RESULT "; exits with the child's error output if it failed.
    With timeout_s, a child still running after that long is killed with every process it started
    (it runs in a session of its own: vLLM's engine core is a grandchild) and TimeoutError raised."""
    import json
    import signal
    import tempfile
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                start_new_session=timeout_s is not None)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except BaseException as e:  # the timeout, or the parent interrupted: the child's session goes too
            if timeout_s is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                raise TimeoutError(f"{what}: no result within {timeout_s:.0f} s") from None
            raise
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"{what} failed:\n{err.read()[-3000:]}")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
    result: dict = json.loads(line[len("RESULT "):])
    return result


def git_commit(repo: str | Path = REPO) -> str | None:
    """The checkout's HEAD, marked "+uncommitted" where tracked files differ from it; None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_from_args(args)
    from prefix_service.bench.session import run
    started, machine = time.monotonic(), machine_info()
    result = run(plan, args.config, model_path=args.model, progress=not args.no_progress)
    out = {"machine": {**machine, "load_average_end": list(os.getloadavg())},
           "model": result["model"], "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "git_commit": git_commit(), "command": " ".join(["prefix-service bench", *(argv if argv is not None else sys.argv[1:])]),
           "duration_s": round(time.monotonic() - started, 1), "plan": _plan_json(plan),
           "workloads": result["workloads"], "records": result["records"],
           "targets": report.evaluate_targets(result["records"]), **result["extra"]}
    report.write_json(args.json, out)
    if args.markdown:
        Path(args.markdown).write_text(report.markdown(out), encoding="utf-8")
    plot = args.plot or str(Path(args.json).with_suffix(".png"))
    m = out["machine"]
    isa = f" ({isa_label(m)})" if m.get("isa") else ""
    title = f"{Path(out['model']['path']).name}, {m['cpu'] or 'CPU'}{isa}, {m['cpu_count']} CPU cores"
    plotted = report.plot_open_loop(plot, result["records"], plan.slo_ms, title)
    by_concurrency = str(Path(plot).with_name(Path(plot).stem + "-concurrency.png"))
    plotted_c = report.plot_concurrency(by_concurrency, result["records"], title)
    answer_plots = []  # the constrained workloads': requests/s and e2e p50
    for workload, suffix in (("intent_labels", "labels"), ("doc_records", "records")):
        path = str(Path(plot).with_name(f"{Path(plot).stem}-{suffix}-concurrency.png"))
        if report.plot_concurrency(path, result["records"], title, workload=workload):
            answer_plots.append(path)
    print(report.records_table(result["records"]))
    if any(r["mode"] == "open_loop" for r in result["records"]):
        print(f"\nopen loop (SLO: p99 end-to-end < {plan.slo_ms:.0f} ms)")
        print(report.open_loop_table(result["records"]))
    print("\ntargets")
    print(report.targets_table(out["targets"]))
    for name, why in result["extra"].get("skipped_systems", {}).items():
        print(f"skipped {name}: {why}")
    print(f"\nJSON: {args.json}" + (f"\nplot: {plot}" if plotted else "")
          + (f"\nplot: {by_concurrency}" if plotted_c else "") + "".join(f"\nplot: {p}" for p in answer_plots)
          + f"\ntook {out['duration_s']:.0f} s")
    return 0


def _plan_json(plan: Plan) -> dict:
    d = dataclasses.asdict(plan)
    d["single_by_workload"] = dict(plan.single_by_workload)
    d["caps"] = dict(plan.caps)
    return d


if __name__ == "__main__":
    sys.exit(main())
