"""What one benchmark run measures: the full plan, the --quick plan, and the request counts.

The machine this was written for has 2 CPU cores, where a 1,000-token prefill of the default
model takes seconds; the full plan (about 20 minutes there) spends that time where the
comparisons are:

  * single mode: every system on every workload (a system with nothing to show on a workload,
    e.g. a prefix cache without a prefix, is left out); 12 requests each on intent and
    no_shared (the targets), 2 on the others.
  * closed loop: intent at concurrency 1, 4, 16, 64, and no_shared (the regression check) at 4
    for the engine with prefix support on and off: 8 rounds of requests (32), in 4 turns of 8
    per engine, A B B A A B B A. On the 2-core machine one burst of 8 such requests took 13.8 to
    17.3 s within a few minutes on two identical engines, so a 5% check needs many requests, in
    short turns that share the machine's slow spells.
    `caps` stops a system at a concurrency: hf_generate and hf_prompt_cache serve one request
    at a time (more clients only queue on their lock: the same throughput, longer waits) and
    stop at 4; the no-prefix systems and generate_batch stop at 16 (64 concurrent 1,000-token
    prefills, or generate_batch's slow CPU decode, take many minutes here and add nothing the 16
    point does not show).
    A run sends max(closed_min_requests, concurrency x max(closed_rounds, the spec's min_rounds))
    requests.
  * intent_labels (asked for by name: `--workloads intent_labels`): the intent workload's messages
    answered with one of the template's labels; single mode, the closed loop at 1, 16 and 64, and
    the open loop, for the systems that can constrain an output (our engine and server, vLLM).
  * doc_records (asked for by name): a flight's row of the departures board as a JSON record;
    single mode and the closed loop at 1, 4 and 16, for the same systems.
  * open loop: through the gRPC server, with and without the prefix, the rates of `qps` in
    increasing order while p99 latency stays under the SLO, or under `open_stop_factor` x the
    p99 at the first rate with no request missing its deadline (so the curve shows where each
    system saturates even where no rate meets the SLO); at least `min_points` rates.

--quick (under 3 minutes): intent only, one request per system, closed loop at 4 for the
prefix-reusing systems, two open-loop rates.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from prefix_service.bench.modes import IDLE_MAX_WAIT_S
from prefix_service.bench.systems import SYSTEMS, base_system
from prefix_service.bench.workloads import WORKLOADS, Sizes

MODES = ("single", "closed_loop", "open_loop")
Pairs = tuple  # tuple[tuple[str, int], ...]: a small frozen mapping


@dataclass(frozen=True)
class ClosedSpec:
    workload: str
    concurrencies: tuple[int, ...]
    systems: tuple[str, ...] = ()  # () = every system of the plan
    min_rounds: int = 1  # requests per client at least, whatever the plan's closed_rounds
    # the systems' bursts in turns: 0, each system's requests in one burst; n >= 2, the requests in n
    # equal parts, each part system by system, in plan order then in reverse on every other part
    # (A B, B A, A B, ...), one record per system over all its parts (runner.py says why)
    turns: int = 0

    def __post_init__(self) -> None:
        if self.turns < 0 or self.turns == 1:
            raise ValueError(f"ClosedSpec({self.workload!r}): turns is 0 (one burst per system) or at least 2, "
                             f"got {self.turns}")


@dataclass(frozen=True)
class Plan:
    workloads: tuple[str, ...] = WORKLOADS
    systems: tuple[str, ...] = SYSTEMS
    modes: tuple[str, ...] = MODES
    sizes: Sizes = field(default_factory=Sizes)
    warmup_requests: int = 1  # per system, untimed, before anything is measured
    single_requests: int = 2  # per system and workload, unless single_by_workload says otherwise
    single_by_workload: Pairs = (("intent", 12), ("no_shared", 12), ("intent_labels", 12), ("doc_records", 12))
    closed: tuple[ClosedSpec, ...] = (ClosedSpec("intent", (1, 4, 16, 64)),
                                      ClosedSpec("no_shared", (4,), ("engine_prefix", "engine_no_prefix"),
                                                 min_rounds=8, turns=4),
                                      ClosedSpec("intent_labels", (1, 16, 64)), ClosedSpec("doc_records", (1, 4, 16)))
    closed_min_requests: int = 2
    closed_rounds: int = 1
    caps: Pairs = (("hf_generate", 4), ("hf_prompt_cache", 4), ("engine_no_prefix", 16), ("grpc_no_prefix", 16),
                   ("hf_generate_batch", 16), ("vllm_no_apc", 16))
    open_workloads: tuple[str, ...] = ("intent", "intent_labels")  # those of them the run has
    open_systems: tuple[str, ...] = ("grpc_prefix", "grpc_no_prefix", "http_prefix", "vllm_apc", "vllm_no_apc")
    qps: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
    open_duration_s: float = 30.0  # arrivals per rate; the rate's requests then drain
    open_min_requests: int = 4
    open_timeout_s: float = 30.0  # per request; a request that misses it counts as failed
    min_points: int = 2
    open_stop_factor: float = 2.5
    slo_ms: float = 2000.0
    # each timed section (a single-mode request, a closed-loop burst, an open-loop rate) first waits
    # up to this long for the CPUs to go idle (modes.wait_idle); 0: it starts at once
    idle_wait_s: float = IDLE_MAX_WAIT_S
    hf_page_size: int = 16  # generate_batch page size (our block size by default)

    def single_requests_for(self, workload: str) -> int:
        return dict(self.single_by_workload).get(workload, self.single_requests)

    def closed_requests(self, concurrency: int, spec: ClosedSpec | None = None) -> int:
        rounds = max(self.closed_rounds, spec.min_rounds if spec else 1)
        return max(self.closed_min_requests, concurrency * rounds)

    def closed_allows(self, spec: ClosedSpec, system: str, concurrency: int) -> bool:
        if spec.systems and system not in spec.systems:
            return False
        return concurrency <= dict(self.caps).get(base_system(system), concurrency)

    def runs_open_loop(self, system: str) -> bool:
        return base_system(system) in self.open_systems

    def expected_requests(self) -> int:
        """For the progress bar: the open loop counted at its first min_points rates (the runner
        adds the rates it goes on to)."""
        singles = sum(self.single_requests_for(w) for w in self.workloads) if "single" in self.modes else 0
        n = len(self.systems) * (self.warmup_requests + singles)
        for spec in self.closed:
            if spec.workload in self.workloads and "closed_loop" in self.modes:
                n += sum(self.closed_requests(c, spec) * sum(self.closed_allows(spec, s, c) for s in self.systems)
                         for c in spec.concurrencies)
        per_rate = [self.open_requests(q) for q in self.qps[:self.min_points]]
        open_workloads = [w for w in self.open_workloads if w in self.workloads and "open_loop" in self.modes]
        return n + sum(per_rate) * sum(map(self.runs_open_loop, self.systems)) * len(open_workloads)

    def open_requests(self, qps: float) -> int:
        """About how many requests one open-loop rate sends (the progress bar's estimate)."""
        return max(self.open_min_requests, round(qps * self.open_duration_s))


FULL = Plan()

QUICK = Plan(
    workloads=("intent",),
    warmup_requests=0,  # preparing pins / caches / warms each prefix, which warms the model too
    single_requests=1,
    single_by_workload=(),
    closed=(ClosedSpec("intent", (4,)),),
    caps=(("hf_generate", 1), ("hf_prompt_cache", 1), ("engine_no_prefix", 1), ("grpc_no_prefix", 1),
          ("vllm_no_apc", 1)),
    open_stop_factor=0.0,  # exactly the two rates
    qps=(0.25, 1.0),
    open_duration_s=6.0,
    open_min_requests=2,
    open_timeout_s=12.0,
)


def with_overrides(plan: Plan, **overrides) -> Plan:
    """The plan with the given fields replaced (None values ignored)."""
    return replace(plan, **{k: v for k, v in overrides.items() if v is not None})
