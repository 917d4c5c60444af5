"""The three load modes. Each returns timings (and, for the open loop, one summary per offered rate).

single       one request at a time, the systems taking turns request by request (so a noisy
             neighbour on the machine slows all of them alike), the order rotating each round
closed_loop  `concurrency` client threads, each sending its next request when the last one ends
open_loop    Poisson arrivals at a fixed offered rate for a fixed time; every request has a
             deadline, and one that misses it counts as a failure (its latency exceeds the SLO)
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Callable

from prefix_service.bench.metrics import Timing, percentile, summarize
from prefix_service.bench.systems import KVPeak, System, now
from prefix_service.bench.workloads import BenchRequest, Workload

Tick = Callable[[], None]  # called once per finished request (the progress bar)

IDLE_SHARE = 0.15  # the CPU counts as idle when under this share of it is busy for IDLE_WINDOW_S
IDLE_WINDOW_S = 0.1
IDLE_MAX_WAIT_S = 5.0  # the default of Plan.idle_wait_s and the scripts' --idle-wait-s


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_idle(max_wait_s: float = IDLE_MAX_WAIT_S, window_s: float = IDLE_WINDOW_S) -> float:
    """Wait until the machine's CPUs are idle (under IDLE_SHARE busy over a window of window_s), at
    most max_wait_s (0: not at all; a window once begun is waited out); returns the seconds waited. A
    timed section starts on an idle machine, not in the tail of what ran before it: vLLM's CPU server
    keeps a core busy for about a second after it answers, which slowed whichever system came next by
    up to a third. A longer window asks for a machine that has settled, not one between two bursts."""
    start = now()
    last = _cpu_jiffies()
    if last is None:
        return 0.0
    while now() - start < max_wait_s:
        threading.Event().wait(window_s)
        cur = _cpu_jiffies()
        if cur is None:
            break
        busy, total = cur[0] - last[0], cur[1] - last[1]
        last = cur
        if total > 0 and busy / total < IDLE_SHARE:
            break
    return now() - start


@dataclass
class RunResult:
    timings: list[Timing]
    wall_s: float
    peak_kv_blocks: int | None


def run_single(systems: list[System], workload: Workload, requests: list[BenchRequest],
               peaks: dict[str, KVPeak], tick: Tick, idle_wait_s: float = IDLE_MAX_WAIT_S) -> dict[str, RunResult]:
    """Every request on every system, in turns, each on an idle machine (wait_idle, at most
    idle_wait_s); each round starts one system later, so that no system always follows the same
    one. Wall time of a system = the sum of its latencies."""
    timings: dict[str, list[Timing]] = {s.name: [] for s in systems}
    for i, req in enumerate(requests):
        k = i % len(systems)
        for system in systems[k:] + systems[:k]:
            wait_idle(idle_wait_s)
            with peaks[system.name]:
                timings[system.name].append(system.run(workload, req))
            tick()
    return {s.name: RunResult(timings[s.name], sum((t.e2e_ms or 0) for t in timings[s.name]) / 1000,
                              peaks[s.name].peak) for s in systems}


def run_closed_loop(system: System, workload: Workload, requests: list[BenchRequest], concurrency: int,
                    peak_window: KVPeak, tick: Tick, idle_wait_s: float = IDLE_MAX_WAIT_S) -> RunResult:
    """`concurrency` clients share the request list; wall time runs from the first send to the last
    answer. It starts on an idle machine (wait_idle, at most idle_wait_s)."""
    todo = list(reversed(requests))
    lock = threading.Lock()
    timings: list[Timing] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                req = todo.pop()
            t = system.run(workload, req)
            with lock:
                timings.append(t)
            tick()

    wait_idle(idle_wait_s)
    with peak_window:
        start = now()
        threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = now() - start
    return RunResult(timings, wall, peak_window.peak)


def poisson_arrivals(qps: float, duration_s: float, seed: int, min_requests: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `qps` over `duration_s` (at least min_requests)."""
    rng = random.Random(seed)
    t = 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(qps)
        if t > duration_s and len(out) >= min_requests:
            return out
        out.append(t)


def run_open_loop_point(system: System, workload: Workload, requests: list[BenchRequest], arrivals: list[float],
                        timeout_s: float, tick: Tick, idle_wait_s: float = IDLE_MAX_WAIT_S) -> RunResult:
    """Send requests[i] at arrivals[i] (one thread each), wait for all (each bounded by timeout_s).
    The first is sent on an idle machine (wait_idle, at most idle_wait_s)."""
    timings: list[Timing | None] = [None] * len(arrivals)

    def send(i: int) -> None:
        timings[i] = system.run(workload, requests[i], timeout_s=timeout_s)
        tick()

    threads = []
    wait_idle(idle_wait_s)
    start = now()
    for i, offset in enumerate(arrivals):
        delay = start + offset - now()
        if delay > 0:
            threading.Event().wait(delay)
        th = threading.Thread(target=send, args=(i,), name=f"bench-arrival-{i}", daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return RunResult([t for t in timings if t is not None], now() - start, None)


def open_loop_summary(result: RunResult, offered_qps: float, slo_ms: float) -> dict:
    """One point of the latency-vs-load curve. A failed request (deadline missed) counts as an
    infinite latency, so p99 under the SLO means over 99% of the requests finished within it. A
    p99 that interpolates towards a missed request is infinite too: the rate has no p99 figure (never
    one drawn from the stand-in latency _MISSED, which one miss in 60 requests made a p99 of 4e11 ms)."""
    point = {"offered_qps": offered_qps, **summarize(result.timings, result.wall_s)}
    finished = [t.e2e_ms for t in result.timings if t.ok and t.e2e_ms is not None]
    p99 = percentile(finished + [_MISSED] * (len(result.timings) - len(finished)), 99)
    if p99 is None or not finished or p99 > max(finished):  # the p99 rank reaches a missed request
        point["e2e_p99_ms"], point["under_slo"] = None, False
    else:
        point["e2e_p99_ms"], point["under_slo"] = round(p99, 1), p99 < slo_ms
    return point


_MISSED = 1e12  # the latency a request that missed its deadline counts with
