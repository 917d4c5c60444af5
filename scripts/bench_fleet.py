#!/usr/bin/env python
"""One server process against a fleet of 1 and 2 replicas on Ray Serve (docs/scale-out.md):
throughput on the intent workload, and the latency the fleet adds to a request.

Every system is `prefix-service serve` in a process of its own, started for its turn and stopped
after it, with the intent template pinned, called over gRPC with the same requests:

    single     one process, one engine (model.num_threads = the machine's cores)
    fleet_N    `serve --ray`, N engine replicas on a local Ray cluster, each with cores / N threads
               and every template on every replica (template_replication unset)
    fleet_N_ray_defaults   (--ray-defaults) the same fleet with Ray Serve's own defaults instead of
               the throughput mode `serve --ray` sets (RAY_SERVE_THROUGHPUT_OPTIMIZED=0)

In each turn every system runs two timed sections, each on an idle CPU (modes.wait_idle, waiting at
most --idle-wait-s before each request and before the burst):

    latency    --latency-requests requests one after another: TTFT, TPOT and end-to-end p50; the
               fleet's added latency is fleet_1's minus single's (the same engine behind one more
               hop: the front end, Ray Serve's router and the deployment handle's stream)
    throughput --requests requests from --concurrency clients at once (closed loop): output tokens/s

Turns alternate the systems' order (A B C, C B A, ...). The medians over the turns go to the table
and the JSON, with every turn's figures. The latency section's greedy token ids must be equal on
every system (the fleet serves the same engine); `outputs_equal` says so.

    python scripts/bench_fleet.py --json docs/benchmarks/DATE-fleet.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prefix_service.bench.main import git_commit, machine_info  # noqa: E402
from prefix_service.bench.metrics import Timing, summarize  # noqa: E402
from prefix_service.bench.modes import IDLE_MAX_WAIT_S, run_closed_loop, wait_idle  # noqa: E402
from prefix_service.bench.systems import KVPeak, System, now  # noqa: E402
from prefix_service.bench.systems.grpc import ServerProcess  # noqa: E402
from prefix_service.bench.workloads import BenchRequest, Sizes, Workload, build_workload  # noqa: E402
from prefix_service.client import PrefixServiceClient  # noqa: E402
from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from prefix_service.fleet import SERVE_ENV  # noqa: E402


class ServedSystem(System):
    """A server process called through prefix_service.client; keeps each request's token ids."""

    uses_prefix = True

    def __init__(self, name: str, server: ServerProcess) -> None:
        self.name = name
        self.server = server
        self.client = PrefixServiceClient(server.address)
        self.token_ids: dict[int, list[int]] = {}

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        import grpc
        timing = Timing(start=now())
        ids: list[int] = []
        try:
            for msg in self.client.generate(req.prompt_text, workload.prefix_name, max_tokens=workload.output_tokens,
                                            ignore_eos=True, timeout=timeout_s):
                t = now()
                timing.add_tokens(len(msg.token_ids), t)
                ids.extend(msg.token_ids)
                if msg.finish_reason:
                    timing.end = t
        except grpc.RpcError as e:
            timing.error = f"{e.code().name}: {e.details()}"
        self.token_ids[req.index] = ids
        return timing

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str
    replicas: int  # 0: the single-process server
    threads: int  # torch threads of each engine
    env: tuple[tuple[str, str], ...] = ()  # the server's environment beside the benchmark's

    def serve_env(self) -> dict[str, str]:
        """Ray Serve's settings the fleet runs with (what `serve --ray` sets, unless the environment
        says otherwise); none for the single process."""
        if not self.replicas:
            return {}
        env = {**os.environ, **dict(self.env)}
        return {k: env.get(k, v) for k, v in SERVE_ENV.items()}

    def extra_config(self) -> dict:
        if not self.replicas:
            return {}
        return {"ray": {"num_replicas": self.replicas, "num_cpus_per_replica": 1,
                        "app_name": f"bench-{self.name.replace('_', '-')}"}}


def build_specs(sizes: list[int], ray_defaults: bool, cores: int) -> list[SystemSpec]:
    """The single process, then each fleet size (and, with ray_defaults, the same fleet on Ray
    Serve's own defaults); the cores split between a fleet's engines."""
    specs = [SystemSpec("single", 0, cores)]
    for n in sizes:
        specs.append(SystemSpec(f"fleet_{n}", n, max(1, cores // n)))
        if ray_defaults:
            specs.append(SystemSpec(f"fleet_{n}_ray_defaults", n, max(1, cores // n),
                                    (("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0"),)))
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: a random Llama-family model built from a config)")
    p.add_argument("--hidden-size", type=int, default=256, help="the built model's hidden size")
    p.add_argument("--layers", type=int, default=4, help="the built model's layers")
    p.add_argument("--replicas", default="1,2", help="fleet sizes to run beside the single process")
    p.add_argument("--ray-defaults", action="store_true",
                   help="also run each fleet with Ray Serve's own defaults (not its throughput mode)")
    p.add_argument("--turns", type=int, default=2, help="runs of every system, the order alternating")
    p.add_argument("--latency-requests", type=int, default=20)
    p.add_argument("--requests", type=int, default=64, help="requests of the throughput section")
    p.add_argument("--concurrency", type=int, default=16, help="clients of the throughput section")
    p.add_argument("--prompt-tokens", type=int, default=32, help="each request's own tokens after the template")
    p.add_argument("--max-prefix-tokens", type=int, default=400, help="cut the intent template to this many tokens")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to report SERVING")
    p.add_argument("--idle-wait-s", type=float, default=IDLE_MAX_WAIT_S, metavar="S",
                   help="before each timed request and burst, wait up to S seconds for the CPUs to go idle "
                        "(default %(default)g; 0: start at once, e.g. for a smoke run)")
    p.add_argument("--json", default="bench_out/fleet.json")
    return p


def make_model(args: argparse.Namespace, folder: Path) -> Path:
    if args.model:
        return Path(args.model).resolve()
    from prefix_service import synthetic
    tok = synthetic.build_tokenizer(folder / "tokenizer")
    return synthetic.build_model(folder / "model", "llama", tok, seed=5, hidden_size=args.hidden_size,
                                 intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers,
                                 num_attention_heads=max(1, args.hidden_size // 64),
                                 num_key_value_heads=max(1, args.hidden_size // 128), max_position_embeddings=2048)


def run_system(spec: SystemSpec, engine: EngineConfig, workload: Workload, latency_reqs: list[BenchRequest],
               throughput_reqs: list[BenchRequest], concurrency: int, start_timeout_s: float,
               idle_wait_s: float = IDLE_MAX_WAIT_S) -> dict:
    engine = dataclasses.replace(engine, model=dataclasses.replace(engine.model, num_threads=spec.threads))
    started = time.monotonic()
    server = ServerProcess(engine, [workload], start_timeout_s=start_timeout_s, extra=spec.extra_config(),
                           env=dict(spec.env))
    system = ServedSystem(spec.name, server)
    try:
        start_s = time.monotonic() - started
        for req in throughput_reqs[:2]:  # untimed: the first calls set up channels and handles
            system.run(workload, req)
        timings = []
        for req in latency_reqs:
            wait_idle(idle_wait_s)
            timings.append(system.run(workload, req))
        latency = summarize(timings, sum((t.e2e_ms or 0) for t in timings) / 1000)
        ids = {i: system.token_ids[i] for i in (r.index for r in latency_reqs)}
        result = run_closed_loop(system, workload, throughput_reqs, concurrency, KVPeak(system), lambda: None,
                                 idle_wait_s)
        throughput = summarize(result.timings, result.wall_s)
        errors = sorted({t.error for t in timings + result.timings if t.error})
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        system.close()  # SIGTERM: the server drains and exits 0
    return {"system": spec.name, "replicas": spec.replicas, "threads_per_engine": spec.threads,
            "serve_env": spec.serve_env(), "start_s": round(start_s, 1), "latency": latency, "throughput": throughput, "errors": errors,
            "exit_code": server.proc.returncode, "token_ids": ids}


def median_of(runs: list[dict], section: str, key: str) -> float | None:
    values = [r[section][key] for r in runs if r[section][key] is not None]
    return round(statistics.median(values), 3) if values else None


def summarize_systems(runs: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        mine = [r for r in runs if r["system"] == name]
        out[name] = {"replicas": mine[0]["replicas"], "threads_per_engine": mine[0]["threads_per_engine"],
                     "serve_env": mine[0]["serve_env"],
                     "turns": len(mine), "start_s": round(statistics.median(r["start_s"] for r in mine), 1),
                     **{f"latency_{k}": median_of(mine, "latency", k) for k in ("ttft_p50_ms", "tpot_p50_ms",
                                                                               "e2e_p50_ms")},
                     **{f"throughput_{k}": median_of(mine, "throughput", k) for k in ("output_tok_s", "req_s",
                                                                                     "e2e_p50_ms", "e2e_p99_ms")},
                     "failed": sum(r["latency"]["num_failed"] + r["throughput"]["num_failed"] for r in mine)}
    return out


def ratios(summary: dict) -> dict:
    out: dict = {}
    single = summary.get("single")
    f1, f2 = summary.get("fleet_1"), summary.get("fleet_2")
    if single and f1:
        out["router_added_ttft_ms"] = round(f1["latency_ttft_p50_ms"] - single["latency_ttft_p50_ms"], 2)
        out["router_added_tpot_ms"] = round(f1["latency_tpot_p50_ms"] - single["latency_tpot_p50_ms"], 3)
        out["router_added_e2e_ms"] = round(f1["latency_e2e_p50_ms"] - single["latency_e2e_p50_ms"], 2)
        out["fleet_1_vs_single_throughput"] = round(f1["throughput_output_tok_s"] / single["throughput_output_tok_s"], 3)
    if f1 and f2:
        out["fleet_2_vs_fleet_1_throughput"] = round(f2["throughput_output_tok_s"] / f1["throughput_output_tok_s"], 3)
    if single and f2:
        out["fleet_2_vs_single_throughput"] = round(f2["throughput_output_tok_s"] / single["throughput_output_tok_s"], 3)
    for name, fleet in summary.items():  # the throughput mode against Ray Serve's defaults, same fleet size
        base = summary.get(f"{name}_ray_defaults")
        if base:
            out[f"{name}_vs_ray_defaults_throughput"] = round(fleet["throughput_output_tok_s"]
                                                              / base["throughput_output_tok_s"], 3)
            out[f"{name}_vs_ray_defaults_ttft_ms"] = round(fleet["latency_ttft_p50_ms"]
                                                           - base["latency_ttft_p50_ms"], 2)
            out[f"{name}_vs_ray_defaults_tpot_ms"] = round(fleet["latency_tpot_p50_ms"]
                                                           - base["latency_tpot_p50_ms"], 3)
    return out


def table(summary: dict) -> str:
    head = ("system", "replicas", "threads", "start s", "TTFT p50", "TPOT p50", "e2e p50", "tok/s", "req/s",
            "e2e p50 (load)", "e2e p99 (load)", "failed")
    rows = [head] + [(name, str(s["replicas"] or "-"), str(s["threads_per_engine"]), f"{s['start_s']:.0f}",
                      f"{s['latency_ttft_p50_ms']:.1f}", f"{s['latency_tpot_p50_ms']:.2f}",
                      f"{s['latency_e2e_p50_ms']:.1f}", f"{s['throughput_output_tok_s']:.1f}",
                      f"{s['throughput_req_s']:.2f}", f"{s['throughput_e2e_p50_ms']:.0f}",
                      f"{s['throughput_e2e_p99_ms']:.0f}", str(s["failed"])) for name, s in summary.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.replicas.split(",") if x.strip()]
    if any(n < 1 for n in sizes) or args.turns < 1 or not args.idle_wait_s >= 0:
        raise SystemExit("--replicas takes fleet sizes >= 1, --turns at least 1, --idle-wait-s seconds >= 0")
    specs = build_specs(sizes, args.ray_defaults, os.cpu_count() or 1)
    began, machine = time.monotonic(), machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        model_dir = make_model(args, Path(tmp))
        from prefix_service.model.loader import load_tokenizer
        workload = build_workload("intent", load_tokenizer(model_dir),
                                  Sizes(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                        max_prefix_tokens=args.max_prefix_tokens))
        latency_reqs = [workload.request(i) for i in range(args.latency_requests)]
        throughput_reqs = [workload.request(args.latency_requests + i) for i in range(args.requests)]
        engine = EngineConfig(ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
                              CacheConfig(block_size=16, num_blocks=2048),
                              SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))
        runs = []
        for turn in range(args.turns):
            order = specs if turn % 2 == 0 else list(reversed(specs))
            for spec in order:
                print(f"turn {turn + 1}/{args.turns}: {spec.name} ...", flush=True)
                run = run_system(spec, engine, workload, latency_reqs, throughput_reqs, args.concurrency,
                                 args.start_timeout, args.idle_wait_s)
                runs.append({"turn": turn, **run})
    reference = runs[0]["token_ids"]
    outputs_equal = all(r["token_ids"] == reference for r in runs)
    summary = summarize_systems(runs, [s.name for s in specs])
    for r in runs:
        r.pop("token_ids")
    out = {"machine": {**machine, "load_average_end": list(os.getloadavg())},
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "git_commit": git_commit(),
           "command": " ".join(["python scripts/bench_fleet.py", *(argv if argv is not None else sys.argv[1:])]),
           "duration_s": round(time.monotonic() - began, 1),
           "ray_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_")},  # the benchmark's own
           "model": {"path": args.model or "random llama", "hidden_size": None if args.model else args.hidden_size,
                     "layers": None if args.model else args.layers},
           "workload": {"name": "intent", "prefix_tokens": len(workload.prefix_ids), "prompt_tokens": args.prompt_tokens,
                        "output_tokens": args.output_tokens, "latency_requests": args.latency_requests,
                        "requests": args.requests, "concurrency": args.concurrency,
                        "idle_wait_s": args.idle_wait_s},
           "outputs_equal": outputs_equal, "summary": summary, "ratios": ratios(summary), "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(table(summary))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in out["ratios"].items()))
    print(f"greedy outputs equal on every system: {outputs_equal}")
    print(f"\nJSON: {args.json}\ntook {out['duration_s']:.0f} s")
    return 0 if outputs_equal and all(s["failed"] == 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
