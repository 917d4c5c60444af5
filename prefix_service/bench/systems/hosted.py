"""In-process systems, each group in a child process of its own.

torch's CPU kernels run on OpenMP, and GNU OpenMP keeps one pool of worker threads per thread that
starts parallel work. Once a process holds more pool threads than cores, the workers stop
spin-waiting between operations, so every operation pays a wake-up: two engines, or an engine
and a transformers model, in one process slow each other down even while only one is busy (a
decode step ~1.5x slower on 2 cores). So the benchmark process itself runs no torch work: each
group below (our engine with the prefix; without it; transformers `generate` and its prompt
cache, which share one model and serve one request at a time; transformers continuous batching)
lives in a child process, where the torch work of a group stays on one thread:

  * serial groups (`generate`): construction and every call run on a single worker thread, in
    arrival order (the lock a shared model needs anyway);
  * concurrent groups: construction runs on a thread that then exits (its pool goes with it),
    calls run on as many threads as callers, and only the system's own thread computes (our
    engine's loop thread; the continuous-batching manager's).

A call crosses a pipe (tens of microseconds); `run`'s start time is taken in this process before
it, and its first-token and end times in the child (`time.perf_counter` is the system-wide
monotonic clock on Linux, so the two agree).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import threading
import time
from typing import Any, Callable

from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import System, now
from prefix_service.bench.workloads import Answers, BenchRequest, Workload


@dataclasses.dataclass
class WorkloadView(Answers):
    """What a system reads from a Workload, without the tokenizer: it pickles to the child."""
    name: str
    prefix_name: str | None
    prefix_text: str
    prefix_ids: tuple[int, ...]
    output_tokens: int
    requests: dict[int, BenchRequest]  # made in this process: the ones `prepare` asks for
    labels: tuple[str, ...] = ()
    record_schema: dict[str, Any] | None = None

    @classmethod
    def of(cls, workload: Workload) -> WorkloadView:
        return cls(workload.name, workload.prefix_name, workload.prefix_text, workload.prefix_ids,
                   workload.output_tokens, {-1: workload.request(-1)}, workload.labels, workload.record_schema)

    @property
    def has_prefix(self) -> bool:
        return self.prefix_name is not None

    def request(self, index: int) -> BenchRequest:
        return self.requests[index]

    def full_ids(self, req: BenchRequest) -> list[int]:
        return list(self.prefix_ids) + list(req.prompt_ids)


def _child(conn, factory: Callable[..., dict[str, System]], args: tuple, serial: bool) -> None:
    import logging
    import warnings
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")
    send_lock = threading.Lock()
    if serial:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-host")
        build = pool.submit(factory, *args)
    else:
        pool = concurrent.futures.ThreadPoolExecutor(512, thread_name_prefix="bench-host")
        build = concurrent.futures.Future()
        threading.Thread(target=lambda: _settle(build, factory, args), name="bench-host-build").start()
    try:
        systems = build.result()
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", {name: {"uses_prefix": s.uses_prefix, "engine": hasattr(s, "engine"),
                                "kv_num_blocks": s.engine.kv_stats()["num_blocks"] if hasattr(s, "engine") else None}
                         for name, s in systems.items()}))

    def serve(call_id: int, name: str, method: str, call_args: tuple) -> None:
        try:
            reply = (call_id, True, getattr(systems[name], method)(*call_args))
        except BaseException as e:  # the caller raises it
            reply = (call_id, False, f"{type(e).__name__}: {e}")
        with send_lock:
            conn.send(reply)

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            msg = None
        if msg is None:
            break
        pool.submit(serve, *msg)
    pool.shutdown(wait=True)
    for system in systems.values():
        system.close()


def _settle(fut: concurrent.futures.Future, factory, args) -> None:
    try:
        fut.set_result(factory(*args))
    except BaseException as e:
        fut.set_exception(e)


class HostProcess:
    """A child process holding a group of systems, built there by `factory(*args)` (a module-level
    function returning {name: System}). The constructor starts the child and returns; ready() waits
    until the systems are built, so that several groups can load at the same time."""

    def __init__(self, label: str, factory: Callable[..., dict[str, System]], args: tuple, serial: bool,
                 start_timeout_s: float = 900) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.label = label
        self._start_timeout_s = start_timeout_s
        self._deadline = time.monotonic() + start_timeout_s
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child_conn, factory, args, serial), name=f"bench-{label}",
                                 daemon=True)
        self._proc.start()
        child_conn.close()
        self.systems: dict[str, dict] = {}  # filled by ready()
        self._ready = False
        self._stop_sent = False
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()

    def ready(self) -> dict[str, dict]:
        """Wait until the child has built its systems (start_timeout_s after the start at most);
        returns what it says of each, by name. RuntimeError if it failed or took too long."""
        if self._ready:
            return self.systems
        if not self._conn.poll(max(0.0, self._deadline - time.monotonic())):
            self._proc.kill()
            raise RuntimeError(f"bench host {self.label}: not ready within {self._start_timeout_s:.0f} s")
        kind, info = self._conn.recv()
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"bench host {self.label} failed to start: {info}")
        self.systems, self._ready = info, True
        self._reader = threading.Thread(target=self._read, name=f"bench-{self.label}-replies", daemon=True)
        self._reader.start()
        return self.systems

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(call_id, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(RuntimeError(value))
        for fut in list(self._pending.values()):  # the child died: nobody will answer
            fut.set_exception(RuntimeError("the bench host process exited"))

    def call(self, name: str, method: str, *args: Any) -> Any:
        call_id = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[call_id] = fut
        with self._send_lock:
            self._conn.send((call_id, name, method, args))
        return fut.result()

    def request_stop(self) -> None:
        """Ask the child to close its systems and exit, without waiting for it (stop() waits)."""
        if self._stop_sent:
            return
        self._stop_sent = True
        try:
            with self._send_lock:
                self._conn.send(None)
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        self.request_stop()
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


class HostedSystem(System):
    """A system of a HostProcess, behind the same interface."""

    def __init__(self, host: HostProcess, name: str) -> None:
        self._host = host
        self.name = name
        info = host.systems[name]
        self.uses_prefix = info["uses_prefix"]
        self.kv_num_blocks: int | None = info["kv_num_blocks"]  # our engine's KV cache size, else None
        self._views: dict[str, WorkloadView] = {}

    def _view(self, workload: Workload) -> WorkloadView:
        view = self._views.get(workload.name)
        if view is None:
            view = self._views[workload.name] = WorkloadView.of(workload)
        return view

    def supports(self, workload: Workload) -> bool:
        return self._host.call(self.name, "supports", self._view(workload))

    def prepare(self, workload: Workload) -> None:
        self._host.call(self.name, "prepare", self._view(workload))

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        start = now()
        timing: Timing = self._host.call(self.name, "run", self._view(workload), req, timeout_s)
        timing.start = start
        return timing

    def kv_peak_start(self) -> bool:
        return self.kv_num_blocks is not None and self._host.call(self.name, "kv_peak_start")

    def kv_blocks_peak(self) -> int | None:
        return self._host.call(self.name, "kv_blocks_peak") if self.kv_num_blocks is not None else None

    def kv_blocks_pinned(self) -> int | None:
        return self._host.call(self.name, "kv_blocks_pinned") if self.kv_num_blocks is not None else None
