#!/usr/bin/env python
"""Autoscaling's scale-up on Ray Serve (docs/scale-out.md): how long a replica that Ray Serve adds
under load takes from its start to holding its share of the templates, with the template K/V
taken from the replica that holds them (`ray.template_kv_from_peers`, the default) and with every
template of its share prefilled (the setting off).

Each (system, round) is a fresh child process with a local Ray cluster: a fleet of
`min_replicas: 1, max_replicas: 2` (template_replication 1, one CPU and one torch thread per
replica) pins N templates of about T tokens on its first replica; then client threads call
Generate on the templates until Ray Serve has added a second replica and it holds its share. The
second replica's own report gives its start: the engine (model load) and its templates, and where
each template's K/V came from. Systems alternate their order over the rounds.

| system | the new replica's share |
| --- | --- |
| `peers` | from the first replica's K/V, through Ray's object store |
| `prefill` | prefilled (ray.template_kv_from_peers: false) |

    python scripts/bench_scale_up.py --json bench_out/scale_up.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("peers", "prefill")


def templates(model: str, n: int, tokens: int) -> dict[str, str]:
    """N texts of about `tokens` tokens: a header naming the template, then the departures table."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    doc = tok.encode((REPO / "configs" / "prompts" / "lisbon_departures.md").read_text(), add_special_tokens=False)
    out = {}
    for i in range(n):
        head = tok.encode(f"Departures board {i} of {n}. Answer from this table only.\n", add_special_tokens=False)
        ids = (head + doc * (tokens // max(len(doc), 1) + 1))[:tokens]
        out[f"board_{i:02d}"] = tok.decode(ids)
    return out


class Fleet:
    """fleet_server(config) on an event loop in a thread of this process (the Ray cluster local)."""

    def __init__(self, config) -> None:
        from prefix_service.fleet.launcher import fleet_server
        self.server = fleet_server(config)
        self.port: int | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._started.wait(600):
            raise TimeoutError("the fleet did not start within 600 s")
        if self._error is not None:
            raise self._error

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            self.port = await self.server.start()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        await self.server.stop(0.0)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)


def child(args: argparse.Namespace, system: str, texts: dict[str, str]) -> dict:
    import ray
    from ray import serve

    from prefix_service.client import PrefixServiceClient
    from prefix_service.config import (CacheConfig, EngineConfig, ModelConfig, TemplateSpec, RayConfig, SchedulerConfig,
                                       ServerConfig, ServiceConfig)
    block = 16
    pinned = sum(-(-args.template_tokens // block) for _ in texts) + len(texts)
    config = ServiceConfig(
        EngineConfig(ModelConfig(path=args.model, dtype=args.dtype, device="cpu", num_threads=1,
                                 load_format=args.load_format),
                     CacheConfig(block_size=block, num_blocks=pinned + 512, prefix_budget_blocks=pinned),
                     SchedulerConfig(max_num_batched_tokens=2048)),
        ServerConfig(address="127.0.0.1:0", http_address="", metrics_address="127.0.0.1:0"),
        tuple(TemplateSpec(name=n, content=t) for n, t in texts.items()), None,
        RayConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.0,
                  downscale_delay_s=3600.0, look_back_period_s=11.0, template_replication=1,
                  num_cpus_per_replica=1, template_kv_from_peers=system == "peers",
                  app_name=f"bench-scale-up-{system}"))
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    fleet = Fleet(config)
    stop = threading.Event()
    calls, failures = [0], []

    def load(i: int) -> None:
        client = PrefixServiceClient(f"127.0.0.1:{fleet.port}")
        names = sorted(texts)
        k = i
        while not stop.is_set():
            try:
                for _ in client.generate("\nQ: Which gate does TP 1045 leave from?\nA:", names[k % len(names)],
                                         max_tokens=8, ignore_eos=True, timeout=300):
                    pass
                calls[0] += 1
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                failures.append(f"{type(e).__name__}: {e}")
            k += 1
        client.close()

    try:
        reports = fleet.server.engine.replica_reports()
        [first] = reports
        load_start = time.monotonic()
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.timeout
        second = None
        while time.monotonic() < deadline:
            reports = fleet.server.engine.replica_reports()
            ready = [r for r, rep in reports.items() if r != first and rep.get("ready") and rep.get("startup")]
            if ready:
                second = ready[0]
                break
            time.sleep(0.2)
        scaled_s = time.monotonic() - load_start
        stop.set()
        for t in threads:
            t.join(300)
        if second is None:
            raise TimeoutError(f"no second replica was ready within {args.timeout} s of load")
        share = [info.name for info, _ in reports[second]["held"]]
        return {"first": reports[first]["startup"], "second": reports[second]["startup"], "share": share,
                "load_to_second_ready_s": scaled_s, "calls": calls[0], "failures": failures[:5]}
    finally:
        fleet.stop()
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--template-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4, help="client threads calling while the fleet scales up")
    ap.add_argument("--timeout", type=float, default=600, help="seconds of load a scale-up may take")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", help="a model directory (default: the prepared default model)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--json")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--texts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.model is None:
        from prefix_service.prepare_model import prepare_default_model
        args.model = str(prepare_default_model(progress=False))
    if args.system:
        texts = json.loads(Path(args.texts).read_text())
        print("RESULT " + json.dumps(child(args, args.system, texts)), flush=True)
        return

    from prefix_service.bench.main import child_result, git_commit, isa_label, machine_info
    from prefix_service.bench.report import write_json
    work = Path(tempfile.mkdtemp(prefix="bench-scale-up-"))
    texts_file = work / "texts.json"
    texts_file.write_text(json.dumps(templates(args.model, args.templates, args.template_tokens)))
    info = machine_info()
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            cmd = [sys.executable, __file__, "--system", system, "--texts", str(texts_file), "--model", args.model,
                   "--dtype", args.dtype, "--load-format", args.load_format, "--template-tokens",
                   str(args.template_tokens), "--clients", str(args.clients), "--timeout", str(args.timeout)]
            run = child_result(cmd, dict(os.environ), f"{system} (round {r})")
            runs[system].append(run)
            second = run["second"]
            print(f"round {r} {system}: the new replica held its {len(run['share'])} templates "
                  f"{second['total_s']:.1f} s after its start ({second['kv_sources']})", file=sys.stderr)
    info["load_average_end"] = list(os.getloadavg())

    def med(system: str, key: str) -> float:
        return statistics.median(run["second"][key] for run in runs[system])
    table = {s: {"engine_s": med(s, "engine_s"), "templates_s": med(s, "templates_s"), "total_s": med(s, "total_s"),
                 "share": statistics.median(len(run["share"]) for run in runs[s]),
                 "load_to_second_ready_s": statistics.median(run["load_to_second_ready_s"] for run in runs[s]),
                 "first_replica_templates_s": statistics.median(run["first"]["templates_s"] for run in runs[s])}
             for s in SYSTEMS}
    sources_ok = all(set(run["second"]["kv_sources"]) <= {"peer"} for run in runs["peers"]) and \
        all(set(run["second"]["kv_sources"]) <= {"prefill"} for run in runs["prefill"])
    failures = sum(len(run["failures"]) for s in SYSTEMS for run in runs[s])
    speedup = table["prefill"]["templates_s"] / max(table["peers"]["templates_s"], 1e-9)
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs; {args.templates} templates of "
          f"{args.template_tokens} tokens, medians of {args.rounds} rounds")
    print("| system | new replica: engine s | its templates s | start to holding its share s | templates in its "
          "share | load start to it ready s | first replica's templates s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s, row in table.items():
        print(f"| {s} | {row['engine_s']:.1f} | {row['templates_s']:.2f} | {row['total_s']:.1f} | {row['share']:g} | "
              f"{row['load_to_second_ready_s']:.1f} | {row['first_replica_templates_s']:.1f} |")
    print(f"the new replica's templates: {speedup:.1f}x faster from its peer than prefilled; kv sources as expected: "
          f"{sources_ok}; failed calls: {failures}")
    if args.json:
        write_json(args.json, {
            "machine": info, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
            "command": " ".join(["python scripts/bench_scale_up.py", *sys.argv[1:]]), "args": vars(args),
            "medians": table, "speedup_templates": speedup, "kv_sources_ok": sources_ok, "failed_calls": failures,
            "runs": runs})


if __name__ == "__main__":
    main()
