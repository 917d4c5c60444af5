"""EngineReplica: one Engine on one Ray Serve replica.

Start: load the engine, join the controller (which answers with the templates this replica must
pin under the placement), pin them, report them. Ray Serve sends a replica traffic only once its
constructor has returned, so a new (or restarted) replica holds its templates before its first
request.

Then the replica long-polls the controller: each poll carries its report (the templates it holds
with their counters, its KV and request counters) and brings back the commands queued for it
(pin, unpin, token_ids, export_kv, check_integrity), whose outcomes go back through `done`. The poll is the
replica's heartbeat: one that stops polling (killed, hung) leaves the placement at the controller's
lease; one that Ray Serve stops says goodbye (`leave`) once its requests have drained.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import ray
from ray import serve

from prefix_service import envs
from prefix_service.config import ServiceConfig
from prefix_service.engine import Engine
from prefix_service.engine.template_pins import TemplateInfo
from prefix_service.engine.sequence import GenerateRequest, RequestOutput, ScoreOutput, ScoreRequest
from prefix_service.errors import TemplateNotFound
from prefix_service.fleet import log_to_serve
from prefix_service.fleet.calls import TemplateNotHeld, call_sync
from prefix_service.heap import freeze_startup_objects
from prefix_service.server.store import TemplateSource
from prefix_service.server.templates import TemplateRegistry
from prefix_service.server.warmup import warm_up

if TYPE_CHECKING:
    from prefix_service.fleet.controller import Command

log = logging.getLogger("prefix_service.fleet")

COMMANDS = ("pin", "unpin", "token_ids", "export_kv", "check_integrity")  # what the controller may ask a replica to run
KV_FETCH_TIMEOUT_S = 120.0  # asking the controller for a template's K/V and getting it from the holder
LEAVE_TIMEOUT_S = 2.0  # a stopping replica's goodbye; the controller may be stopping as well
REPORT_WAIT_S = 1.0  # a poll waits this long for a fresh report, then goes with the last one


class EngineReplica:
    # Ray Serve awaits an async constructor, which the type checker's rule for __init__ does not know
    async def __init__(self, config: ServiceConfig, controller: Any) -> None:  # type: ignore[misc]
        log_to_serve()
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()  # the Ray node it runs on, in its reports
        self._controller = controller
        self.startup: dict[str, Any] = {}  # how its start went (in its reports): seconds, K/V sources
        self.kernel_settings = envs.set_values(envs.ENGINE_SCOPES)  # the head's (build_app), in its reports
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(None, Engine, config)
        loaded = time.monotonic()
        self.engine.peer_kv = self._kv_from_peer  # a template it pins comes from a holder if one serves
        self.registry = TemplateRegistry(self.engine, None, config.server.max_template_bytes)
        self.requests: collections.Counter[str] = collections.Counter()  # requests taken, by template ("" for none)
        # each report numbered as it is taken (one at a time), so that the controller keeps the newest: a poll's
        # report taken while the constructor pinned can reach it after the ready() that carried a later one
        self._report_seq = itertools.count(1)
        self._report_lock = threading.Lock()
        assigned: list[TemplateSource] = await controller.join.remote(self.id)
        self._poller = asyncio.create_task(self._poll_forever())
        configured = [s for s in assigned if s.origin == "config"]
        admin = [s for s in assigned if s.origin != "config"]
        pinned = await loop.run_in_executor(None, warm_up, self.registry, configured, admin)
        done = time.monotonic()
        sources = collections.Counter(info.kv_source for info, _ in self.registry.list())
        self.startup = {"engine_s": loaded - started, "templates_s": done - loaded, "total_s": done - started,
                        "templates": pinned, "kv_sources": dict(sources)}
        report = await loop.run_in_executor(None, self.report)
        freeze_startup_objects()  # the replica owns its process (prefix_service/heap.py)
        await controller.ready.remote(self.id, self._token_ids(), report)
        log.info("replica %s ready in %.1f s (engine %.1f s, templates %.1f s): %d of %d assigned templates pinned "
                 "(K/V: %s)%s", self.id, done - started, loaded - started, done - loaded, pinned, len(assigned),
                 ", ".join(f"{n} {k}" for k, n in sorted(sources.items())) or "none",
                 "; kernel settings: " + envs.listed(self.kernel_settings) if self.kernel_settings else "")

    def _token_ids(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for info in self.engine.list_templates():
            with contextlib.suppress(TemplateNotFound):
                out[info.name] = self.engine.get_template(info.name).token_ids
        return out

    def report(self) -> dict[str, Any]:
        with self._report_lock:
            return {"seq": next(self._report_seq), "held": self.registry.list(), "stats": self.stats(),
                    "node": self.node, "startup": self.startup, "engine": self.engine.info,
                    "kernel_settings": self.kernel_settings}

    async def _poll_forever(self) -> None:
        """Poll the controller with a fresh report, or, while the engine is in a long step (a report
        waits for the step's end), with the last one: the poll is the heartbeat, and a replica
        busy with a long prefill is alive (it was dropped at the controller's lease)."""
        loop = asyncio.get_running_loop()
        taking: asyncio.Future[dict[str, Any]] | None = None
        last: dict[str, Any] = {}
        while True:
            if taking is None:
                taking = loop.run_in_executor(None, self.report)
            await asyncio.wait([taking], timeout=REPORT_WAIT_S)
            if taking.done():
                done, taking = taking, None
                try:
                    last = done.result()
                except Exception as e:  # noqa: BLE001 - the engine stopping: the last report goes
                    log.warning("replica %s: taking its report failed: %s", self.id, e)
            try:
                commands = await self._controller.poll.remote(self.id, last)
            except Exception as e:  # noqa: BLE001 - the controller restarting: poll again
                log.warning("replica %s: polling the controller failed: %s", self.id, e)
                await asyncio.sleep(1.0)
                continue
            for cmd in commands:
                asyncio.create_task(self._run(cmd))

    async def _run(self, cmd: Command) -> None:
        try:
            if cmd.method not in COMMANDS:
                raise ValueError(f"unknown command {cmd.method!r}")
            result = await asyncio.get_running_loop().run_in_executor(None, getattr(self, cmd.method), *cmd.args)
            ok = True
        except Exception as e:  # noqa: BLE001 - the controller gets the error itself
            result, ok = e, False
        try:
            await self._controller.done.remote(self.id, cmd.id, ok, result)
        except Exception as e:  # noqa: BLE001 - the controller fails the command at its timeout
            log.warning("replica %s: reporting command %s failed: %s", self.id, cmd.method, e)

    # --- serving ------------------------------------------------------------------------------
    async def score(self, req: ScoreRequest, holders: Any = None) -> ScoreOutput:
        """Score on this replica's engine (cancelling the call aborts it). A template this replica
        does not hold (any more) raises TemplateNotHeld, which the caller retries elsewhere."""
        if req.prefix_name and not self.registry.known(req.prefix_name):
            raise TemplateNotHeld(f"replica {self.id} does not hold prefix template {req.prefix_name!r}")
        self.requests[req.prefix_name or ""] += 1
        return await self.engine.score_async(req)

    async def generate(self, req: GenerateRequest, holders: Any = None) -> AsyncIterator[RequestOutput | str]:
        """This replica's id first (it took the request), then the engine's outputs. Closing the
        stream (the caller cancelled) aborts the request and frees its blocks. A template this
        replica does not hold (any more) raises TemplateNotHeld, which the caller retries elsewhere."""
        if req.prefix_name and not self.registry.known(req.prefix_name):
            raise TemplateNotHeld(f"replica {self.id} does not hold prefix template {req.prefix_name!r}")
        self.requests[req.prefix_name or ""] += 1
        yield self.id
        async with contextlib.aclosing(self.engine.generate_stream(req)) as stream:
            async for out in stream:
                yield out

    # --- the controller's commands -----------------------------------------------------------
    def pin(self, src: TemplateSource) -> tuple[TemplateInfo, tuple[int, ...]]:
        info = self.registry.add(src, persist=False)
        return info, self.engine.get_template(src.name).token_ids

    def unpin(self, name: str, forget: bool = False) -> bool:
        """True if freed now (or not held), False if deferred until its requests finish. forget:
        the template left the fleet (its snapshot, if any, goes too); else it only moves."""
        try:
            return self.registry.remove(name, keep_snapshot=not forget)
        except TemplateNotFound:
            return True

    def export_kv(self, name: str) -> list[Any]:
        """A template this replica holds, as a snapshot's bytes in Ray's object store, for a replica
        that pins it (FleetController.template_kv): [the object's ref]."""
        return [ray.put(self.engine.export_template_kv(name))]

    def _kv_from_peer(self, name: str, token_ids: list[int]) -> bytes | None:
        """Engine.peer_kv, on the thread pinning the template: a holder's snapshot bytes, or None
        (no holder serving: prefill). Raises on a failed fetch (the engine warns, then prefills)."""
        answer = call_sync(self._controller.template_kv.remote(self.id, name), KV_FETCH_TIMEOUT_S, "the controller")
        if not answer:
            return None
        data: bytes = ray.get(answer[0], timeout=KV_FETCH_TIMEOUT_S)  # from the holder's node
        return data

    def token_ids(self, name: str) -> tuple[int, ...]:
        return self.engine.get_template(name).token_ids

    def stats(self) -> dict[str, Any]:
        """KV counters (Engine.kv_stats) and the generation requests taken, by template."""
        return {"requests": dict(self.requests), **self.engine.kv_stats()}

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop has stopped takes no traffic."""
        if not self.engine.running:
            raise RuntimeError(f"replica {self.id}: the engine loop has stopped")

    async def __del__(self) -> None:
        """Ray Serve stops this replica (scaled down, replaced, the application deleted) once its
        requests have drained: it leaves the fleet, so its templates move to other replicas now
        rather than at the controller's lease, then stops its engine."""
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.cancel()
        if hasattr(self, "id"):
            try:
                await asyncio.wait_for(self._controller.leave.remote(self.id), LEAVE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the controller stopping too: the lease drops it
                log.info("replica %s: leaving the fleet failed (%s); the controller's lease drops it", self.id,
                         type(e).__name__)
        engine = getattr(self, "engine", None)
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
