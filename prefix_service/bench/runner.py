"""Runs a Plan: builds the systems, warms them up, runs the three modes and makes one record per
system x workload x mode x concurrency.

Request indices: every run draws its requests from its own index range, the same range for every
system, so all systems see the same token ids and no system sees one prompt twice (which would
let generate_batch's automatic prefix sharing reuse a whole prompt). Warm-ups use negative indices.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Callable

from prefix_service.bench import modes
from prefix_service.bench.metrics import summarize
from prefix_service.bench.plan import Plan
from prefix_service.bench.systems import KVPeak, System, peer_of
from prefix_service.bench.workloads import Workload
from prefix_service.config import EngineConfig

if TYPE_CHECKING:
    from prefix_service.bench.systems.hosted import HostProcess

log = logging.getLogger("prefix_service.bench")

SINGLE_BASE, CLOSED_BASE, OPEN_BASE = 0, 10_000, 1_000_000


def build_systems(plan: Plan, engine_config: EngineConfig, workloads: list[Workload], tokenizer,
                  stack: contextlib.ExitStack, status: Callable[[str], None],
                  skipped: dict[str, str] | None = None) -> list[System]:
    """The plan's systems, in the plan's order; each is closed by `stack`. The in-process ones run in
    child processes of their own (systems/hosted.py says why); the gRPC and vLLM servers are processes
    too. A peer whose environment is not installed is left out, with the reason in `skipped`.

    Nothing is timed yet, so the groups load at the same time: our engines and transformers'
    `generate` at once; continuous batching once an engine has said how large its KV cache is
    (it gets as much), beside the gRPC server's start. On the way out every group is asked to
    close before any is waited for."""
    from prefix_service.bench.systems.hosted import HostedSystem, HostProcess
    built: dict[str, System] = {}
    names = plan.systems
    hosts: list[HostProcess] = []

    def start(label: str, factory, args: tuple, serial: bool) -> HostProcess:
        proc = HostProcess(label, factory, args, serial)
        stack.callback(proc.stop)
        hosts.append(proc)
        return proc

    def settle(proc: HostProcess) -> None:
        for name in proc.ready():
            built[name] = HostedSystem(proc, name)

    engines = [start(name, _engine_group, (engine_config, use_prefix), serial=False)
               for use_prefix, name in ((True, "engine_prefix"), (False, "engine_no_prefix")) if name in names]
    device, dtype = _device_dtype(engine_config)
    threads = engine_config.model.num_threads
    hf = tuple(n for n in ("hf_generate", "hf_prompt_cache") if n in names)
    later: list[HostProcess] = []  # the transformers groups, waited for after the gRPC server's start
    if hf:
        later.append(start("hf_generate", _hf_group, (engine_config.model.path, device, dtype, threads, hf),
                           serial=True))
    if engines:
        status(f"loading {', '.join(proc.label for proc in engines)}" + (" and the transformers model" if hf else ""))
    for proc in engines:
        settle(proc)
    if "hf_generate_batch" in names:
        cfg = engine_config
        capacity = _engine_capacity_tokens(built, cfg)
        options = dict(page_size=plan.hf_page_size, num_blocks=max(1, capacity // plan.hf_page_size),
                       max_batch_tokens=cfg.scheduler.max_num_batched_tokens, max_requests=cfg.scheduler.max_num_seqs,
                       output_tokens=plan.sizes.output_tokens)
        later.append(start("hf_generate_batch", _hf_batch_group, (cfg.model.path, device, dtype, threads, options),
                           serial=False))
    if {"grpc_prefix", "grpc_no_prefix", "http_prefix"} & set(names):
        from prefix_service.bench.systems.grpc import GrpcSystem, HttpSystem, ServerProcess
        status("starting the gRPC server (model load + template warmup)")
        server = ServerProcess(engine_config, workloads, http="http_prefix" in names)
        stack.callback(server.stop)
        for use_prefix, name in ((True, "grpc_prefix"), (False, "grpc_no_prefix")):
            if name in names:
                built[name] = stack.enter_context(contextlib.closing(GrpcSystem(server, use_prefix)))
        if "http_prefix" in names:
            built["http_prefix"] = HttpSystem(server)
    if later:
        status(f"loading {', '.join(proc.label for proc in later)}")
    for proc in later:
        settle(proc)
    peers = [n for n in names if peer_of(n) is not None]
    if peers:
        from prefix_service.bench.systems.vllm import VllmServer, VllmSystem, vllm_python
        python, why = vllm_python()
        if python is None:
            log.warning("%s skipped: %s", ", ".join(peers), why)
            if skipped is not None:
                skipped.update({n: why for n in peers})
        else:
            for name in peers:
                peer, dtype = peer_of(name) or (name, None)
                caching = peer == "vllm_apc"
                status(f"starting vLLM's server for {name} (model load + compilation)")
                vllm = VllmServer(python, engine_config, prefix_caching=caching, dtype=dtype)
                stack.callback(vllm.stop)
                built[name] = VllmSystem(vllm, caching, name=name)
    stack.callback(_request_stops, hosts)  # registered last, so it runs first: the groups close at once
    return [built[n] for n in names if n in built]


def _request_stops(hosts: list[HostProcess]) -> None:
    for proc in hosts:
        proc.request_stop()


# Group factories: run in the child process (module-level, so that they pickle by name).
def _engine_group(engine_config: EngineConfig, use_prefix: bool) -> dict[str, System]:
    from prefix_service.bench.systems.engine import EngineSystem
    system = EngineSystem(engine_config, use_prefix)
    return {system.name: system}


def _hf_group(path: str, device, dtype, threads: int | None, names: tuple[str, ...]) -> dict[str, System]:
    import threading

    import torch

    from prefix_service.bench.systems.hf import HFGenerate, load_hf_model
    from prefix_service.model.loader import load_tokenizer
    if threads:
        torch.set_num_threads(threads)  # the engine's model.num_threads, so both compute alike
    model, tokenizer, lock = load_hf_model(path, device, dtype), load_tokenizer(path), threading.Lock()
    return {name: HFGenerate(model, tokenizer, name == "hf_prompt_cache", lock) for name in names}


def _hf_batch_group(path: str, device, dtype, threads: int | None, options: dict) -> dict[str, System]:
    import torch

    from prefix_service.bench.systems.hf import HFGenerateBatch, load_hf_model
    if threads:
        torch.set_num_threads(threads)
    return {"hf_generate_batch": HFGenerateBatch(load_hf_model(path, device, dtype), **options)}


def _device_dtype(cfg: EngineConfig):
    from prefix_service.engine.core import resolve_device
    from prefix_service.model.loader import resolve_dtype
    device = resolve_device(cfg.model.device)
    return device, resolve_dtype(cfg.model.dtype, cfg.model.path, device)


def _engine_capacity_tokens(built: dict[str, System], cfg: EngineConfig) -> int:
    """Token slots of our KV cache, so generate_batch gets the same amount of cache."""
    blocks = next((s.kv_num_blocks for s in built.values() if getattr(s, "kv_num_blocks", None)), None)
    if blocks is not None:
        return blocks * cfg.cache.block_size
    return (cfg.cache.num_blocks or 2048) * cfg.cache.block_size  # no engine in this run: a fixed size


class Runner:
    def __init__(self, plan: Plan, systems: list[System], workloads: dict[str, Workload],
                 tick: Callable[[], None], status: Callable[[str], None],
                 expect_more: Callable[[int], None] = lambda n: None) -> None:
        self.plan = plan
        self.systems = systems
        self.workloads = workloads
        self.tick = tick
        self.status = status
        self.expect_more = expect_more  # the progress bar's total grows by n
        self.records: list[dict] = []

    def _record(self, system: System, workload: Workload, mode: str, concurrency: int | None,
                result: modes.RunResult, **extra) -> dict:
        rec = {"system": system.name, "workload": workload.name, "mode": mode, "concurrency": concurrency,
               **summarize(result.timings, result.wall_s), "max_qps_under_slo": None,
               "peak_kv_blocks": result.peak_kv_blocks, "load_1m": round(os.getloadavg()[0], 2), **extra}
        errors = sorted({t.error for t in result.timings if t.error})
        if errors:
            rec["errors"] = errors[:5]
        # each finished answer must be a label (how often each came) or a record of the schema
        rec.update(workload.wrong_answers([t.text for t in result.timings if t.ok]))
        self.records.append(rec)
        return rec

    def prepare(self) -> None:
        for workload in self.workloads.values():
            for system in self.systems:
                if system.supports(workload):
                    self.status(f"{system.name}: preparing {workload.name}")
                    system.prepare(workload)
        first = next(iter(self.workloads.values()))
        for system in self.systems:
            self.status(f"{system.name}: warm-up")
            for i in range(self.plan.warmup_requests):
                system.run(first, first.request(-2 - i))
                self.tick()

    def single(self) -> None:
        for workload in self.workloads.values():
            systems = [s for s in self.systems if s.supports(workload)]
            requests = [workload.request(SINGLE_BASE + i) for i in range(self.plan.single_requests_for(workload.name))]
            self.status(f"single: {workload.name}")
            peaks = {s.name: KVPeak(s) for s in systems}
            results = modes.run_single(systems, workload, requests, peaks, self.tick, self.plan.idle_wait_s)
            for name, result in results.items():
                self._record(next(s for s in systems if s.name == name), workload, "single", 1, result)

    def closed_loop(self) -> None:
        for k, spec in enumerate(self.plan.closed):
            workload = self.workloads.get(spec.workload)
            if workload is None:
                continue
            for j, c in enumerate(spec.concurrencies):
                base = CLOSED_BASE + 10_000 * k + 1000 * j
                requests = [workload.request(base + i) for i in range(self.plan.closed_requests(c, spec))]
                systems = [s for s in self.systems
                           if s.supports(workload) and self.plan.closed_allows(spec, s.name, c)]
                if spec.turns:
                    self._closed_in_turns(systems, workload, requests, c, spec.turns)
                    continue
                for system in systems:
                    self.status(f"closed loop: {system.name} {workload.name} c={c}")
                    result = modes.run_closed_loop(system, workload, requests, c, KVPeak(system),
                                                   self.tick, self.plan.idle_wait_s)
                    self._record(system, workload, "closed_loop", c, result)

    def _closed_in_turns(self, systems: list[System], workload: Workload, requests: list, c: int, turns: int) -> None:
        """A closed loop whose systems' bursts take turns: the requests in `turns` equal parts, each
        part system by system, in plan order on even parts and in reverse on odd ones (A B, B A, A B,
        B A), each system's record over all of its parts (wall time: the sum of its parts').

        Why: on a shared 2-core VM, one system's whole burst after the other's made the one that went
        first ~2-4% slower (engine_prefix and engine_no_prefix on no_shared, the same code path, in
        both orders), and the machine's speed drifts over minutes (a burst of 8 requests took 13.8 to
        17.3 s within a few minutes on two identical engines): more than the resolution a 5%
        regression check needs. Short turns in mirrored order put both systems through the same
        spells, and a linear drift cancels over each A B B A."""
        if len(requests) < turns:  # ClosedSpec checks turns >= 2
            raise ValueError(f"a closed loop in {turns} turns needs a request per turn, got {len(requests)} requests")
        size = -(-len(requests) // turns)
        parts: dict[str, list[modes.RunResult]] = {s.name: [] for s in systems}
        windows = {s.name: KVPeak(s) for s in systems}  # one per system: its peak over all of its turns
        for k in range(turns):
            batch = requests[k * size:(k + 1) * size]
            if not batch:
                break
            for system in (systems if k % 2 == 0 else systems[::-1]):
                self.status(f"closed loop: {system.name} {workload.name} c={c} (turn {k + 1}/{turns})")
                parts[system.name].append(modes.run_closed_loop(system, workload, batch, c,
                                                                windows[system.name], self.tick,
                                                                self.plan.idle_wait_s))
        for system in systems:
            runs = parts[system.name]
            self._record(system, workload, "closed_loop", c,
                         modes.RunResult([t for r in runs for t in r.timings], sum(r.wall_s for r in runs),
                                         windows[system.name].peak), in_turns=True, turns=len(runs))

    def open_loop(self) -> None:
        """Each rate of plan.qps in turn, every system at it before the next rate (the system that
        starts a rate moves one along each time), so that systems compared at a rate run in the same
        minutes of the machine; a system stops at the first rate where it falls behind (_keeps_up)."""
        plan = self.plan
        for name in plan.open_workloads:
            workload = self.workloads.get(name)
            if workload is None:
                continue
            going = [s for s in self.systems if plan.runs_open_loop(s.name) and s.supports(workload)]
            runs: dict[str, tuple[list[dict], list]] = {s.name: ([], []) for s in going}
            for j, qps in enumerate(plan.qps):
                if not going:
                    break
                arrivals = modes.poisson_arrivals(qps, plan.open_duration_s, seed=j, min_requests=plan.open_min_requests)
                base = OPEN_BASE + 10_000 * j
                requests = [workload.request(base + i) for i in range(len(arrivals))]
                for system in going[j % len(going):] + going[:j % len(going)]:
                    points, results = runs[system.name]
                    if j >= plan.min_points:
                        self.expect_more(plan.open_requests(qps))
                    self.status(f"open loop: {system.name} {name} {qps:g} QPS ({len(arrivals)} requests)")
                    result = modes.run_open_loop_point(system, workload, requests, arrivals, plan.open_timeout_s,
                                                       self.tick, plan.idle_wait_s)
                    points.append(modes.open_loop_summary(result, qps, plan.slo_ms))
                    results.append(result)
                going = [s for s in going if len(runs[s.name][0]) < plan.min_points or self._keeps_up(runs[s.name][0])]
            for system in self.systems:
                if system.name in runs and runs[system.name][0]:
                    self._open_record(system, workload, *runs[system.name])

    def _keeps_up(self, points: list[dict]) -> bool:
        """Go on to the next rate? While under the SLO, or while no request missed its deadline
        and p99 stays within open_stop_factor x the p99 at the first rate."""
        last, first = points[-1], points[0]
        if last["under_slo"]:
            return True
        if last["e2e_p99_ms"] is None or first["e2e_p99_ms"] is None:
            return False
        return last["e2e_p99_ms"] <= self.plan.open_stop_factor * first["e2e_p99_ms"]

    def _open_record(self, system: System, workload: Workload, points: list[dict], results: list) -> None:
        """Measures at the highest rate under the SLO (all rates up to it were under it too), or at the
        lowest rate tried when none was."""
        ok = 0
        while ok < len(points) and points[ok]["under_slo"]:
            ok += 1
        at = max(ok - 1, 0)
        self._record(system, workload, "open_loop", None, results[at], slo_ms=self.plan.slo_ms,
                     measured_at_qps=points[at]["offered_qps"], e2e_p99_ms=points[at]["e2e_p99_ms"],
                     max_qps_under_slo=points[ok - 1]["offered_qps"] if ok else 0.0, points=points)
