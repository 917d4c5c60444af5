"""FleetEngine and FleetRegistry: the engine client and template registry the front ends (gRPC
servicers, the OpenAI HTTP API) call, backed by the fleet instead of one in-process Engine. They
implement server/interfaces.py's EngineClient and TemplateRegistryClient, whose docstrings say
where a fleet differs from one process.

A generation request is tokenized by the front end as for one process, then sent through the
replicas' deployment handle with its template's holders (the controller's routes, cached for
ROUTES_TTL_S), least loaded first, for the router. The replica answers its id first (it took the
request), then the engine's outputs; a replica that no longer holds the template answers
TemplateNotHeld, and the request is sent again with fresh routes. A request no holder takes within
ACCEPT_TIMEOUT_S, or whose replica dies under it, ends with ReplicaUnavailable (gRPC UNAVAILABLE,
HTTP 503); other requests are untouched.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import random
import time
import uuid
from typing import Any, AsyncGenerator, Sequence

from prefix_service.engine.api import EngineInfo, EngineStatus
from prefix_service.engine.template_pins import TemplateInfo, TemplateView
from prefix_service.engine.sequence import GenerateRequest, RequestOutput, ScoreOutput, ScoreRequest
from prefix_service.errors import EngineStopped, TemplateNotFound
from prefix_service.fleet.calls import TemplateNotHeld, call, call_sync, unwrap
from prefix_service.server.status import CUT_OFF, ReplicaUnavailable
from prefix_service.server.store import TemplateSource

log = logging.getLogger("prefix_service.fleet")

ROUTES_TTL_S = 0.5
ACCEPT_TIMEOUT_S = 60.0
RESEND_PAUSE_S = 0.05  # before resending a request whose replica no longer held its template
CALL_TIMEOUT_S = 30.0
SCORE_TIMEOUT_S = 300.0  # a Score call's computing, after a replica took it
ADMIN_TIMEOUT_S = 900.0


class FleetEngine:
    def __init__(self, replicas: Any, controller: Any, tokenizer: Any) -> None:
        self.replicas = replicas
        self._streaming = replicas.options(stream=True)  # generate's handle: made once, not per request
        self.controller = controller
        self.tokenizer = tokenizer
        self._routes: dict[str, tuple[str, ...]] = {}
        self._routes_at = -1e9
        self._routes_lock = asyncio.Lock()
        self.accept_timeout_s = ACCEPT_TIMEOUT_S
        self._refresher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: set[Any] = set()  # the streams in flight (shutdown cuts them off)
        self._inflight: collections.Counter[str] = collections.Counter()  # this front end's calls, by replica
        self._stopped = False

    async def start(self) -> None:
        """Fetch the routes, then keep them fresh in the background (known() reads them)."""
        self._loop = asyncio.get_running_loop()
        await self.routes(fresh=True)
        self._refresher = asyncio.ensure_future(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(ROUTES_TTL_S)
            try:
                await self.routes()
            except Exception as e:  # noqa: BLE001 - the controller restarting: try again
                log.warning("refreshing the fleet's routes failed: %s", e)

    # --- routes -------------------------------------------------------------------------------
    async def routes(self, fresh: bool = False) -> dict[str, tuple[str, ...]]:
        if fresh or time.monotonic() - self._routes_at > ROUTES_TTL_S:
            async with self._routes_lock:
                if fresh or time.monotonic() - self._routes_at > ROUTES_TTL_S:
                    self._routes = await call(self.controller.routes.remote(), CALL_TIMEOUT_S, "the fleet controller")
                    self._routes_at = time.monotonic()
        return self._routes

    def known(self, name: str) -> bool:
        """From the cached routes (no call: the event loop asks)."""
        return bool(name) and name in self._routes

    # --- the engine surface -------------------------------------------------------------------
    def get_template(self, name: str) -> TemplateView:
        view: TemplateView = call_sync(self.controller.get_template.remote(name), CALL_TIMEOUT_S, "the fleet controller")
        return view

    async def generate_stream(self, req: GenerateRequest, executor: concurrent.futures.Executor | None = None
                              ) -> AsyncGenerator[RequestOutput, None]:
        """EngineClient.generate_stream: outputs until the last sample's last (finished); closing
        early cancels the call on its replica, which aborts the request there. Nothing here blocks,
        so `executor` is not used."""
        if self._stopped:
            raise EngineStopped("the server is shutting down and takes no new requests")
        if req.request_id is None:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        stream, replica = await self._submit(req)
        self._active.add(stream)
        self._inflight[replica] += 1
        finished = False
        remaining = req.sampling.n  # samples not finished yet
        try:
            while not finished:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001 - the replica's error, or its death
                    finished = True
                    if self._stopped:  # shutdown() cancelled it
                        raise EngineStopped(CUT_OFF) from None
                    raise await self._error(e) from None
                remaining -= int(out.finished)
                finished = remaining == 0 or out.error is not None
                if out.error is not None:
                    raise out.error
                yield out
        finally:
            self._active.discard(stream)
            self._inflight[replica] -= 1
            if self._inflight[replica] <= 0:
                del self._inflight[replica]
            if not finished:
                stream.cancel()

    async def _submit(self, req: GenerateRequest) -> tuple[Any, str]:
        """Send req to a replica that holds its template, the least loaded first (by this front
        end's calls in flight); returns (stream, replica id) once a replica took it."""
        name = req.prefix_name
        routes = await self._routes_with(name)
        deadline = time.monotonic() + self.accept_timeout_s
        while True:
            kwargs = {"holders": self._least_loaded(routes.get(name or "", ()))}
            stream = self._streaming.generate.remote(req, **kwargs)
            first = asyncio.ensure_future(stream.__anext__())
            try:
                while True:
                    done, _ = await asyncio.wait({first}, timeout=1.0)
                    if done:
                        try:
                            replica = first.result()  # the replica's id: taken
                        except Exception as e:  # noqa: BLE001
                            err = await self._error(e)
                            if not isinstance(err, TemplateNotHeld) or time.monotonic() > deadline:
                                raise err from None
                            log.debug("resending request %s: %s", req.request_id, err)
                            await asyncio.sleep(RESEND_PAUSE_S)
                            routes = await self.routes(fresh=True)  # the template moved: resend it
                            if name not in routes:
                                raise TemplateNotFound(f"prefix template {name!r} was removed") from None
                            break
                        return stream, replica
                    if time.monotonic() > deadline:
                        on = f" (template {name!r} is on: {', '.join(routes[name]) or 'none yet'})" if name else ""
                        raise ReplicaUnavailable(
                            f"no replica took the request within {self.accept_timeout_s:.0f} s{on}")
                    if name:  # the holders it waits for may have left: send it to the new ones
                        fresh = await self.routes(fresh=True)
                        if name not in fresh:
                            raise TemplateNotFound(f"prefix template {name!r} was removed")
                        if fresh[name] and not set(fresh[name]) & set(routes[name]):
                            _abandon(first, stream)
                            routes = fresh
                            break
            except BaseException:  # given up (no replica in time, the template gone, the caller cancelled):
                _abandon(first, stream)  # withdraw the call from the router, or it runs later for nobody
                raise

    async def _routes_with(self, name: str | None, fresh: bool = False) -> dict[str, tuple[str, ...]]:
        """The routes, fresh ones if they do not know the template; TemplateNotFound if it is not there."""
        routes = await self.routes(fresh)
        if name and name not in routes and not fresh:
            routes = await self.routes(fresh=True)
        if name and name not in routes:
            raise TemplateNotFound(f"no prefix template named {name!r} (known: {', '.join(sorted(filter(None, routes)))})")
        return routes

    def _least_loaded(self, holders: Sequence[str]) -> list[str]:
        """A template's holders ("" in the routes: every serving replica), the fewest of this front
        end's calls in flight first; ties in any order, not always the first."""
        shuffled = list(holders)
        random.shuffle(shuffled)
        return sorted(shuffled, key=lambda r: self._inflight[r])

    async def _error(self, exc: BaseException) -> BaseException:
        err = unwrap(exc, "the replica serving this request")
        if isinstance(err, ReplicaUnavailable):
            await self.routes(fresh=True)
        return err

    async def score_async(self, req: ScoreRequest, executor: concurrent.futures.Executor | None = None
                          ) -> ScoreOutput:
        """EngineClient.score_async: on a replica that holds the template, the least loaded first,
        sent again with fresh routes when the placement moved the template away. Cancelling cancels
        the call, which aborts the request on its replica. Nothing here blocks: `executor` is unused."""
        if self._stopped:
            raise EngineStopped("the server is shutting down and takes no new requests")
        if req.request_id is None:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        name = req.prefix_name
        deadline = time.monotonic() + self.accept_timeout_s
        routes = await self._routes_with(name)
        while True:
            holders = self._least_loaded(routes.get(name or "", ()))
            first = holders[0] if holders else ""
            self._inflight[first] += 1  # counted on the replica it most likely runs on
            try:
                out: ScoreOutput = await call(self.replicas.score.remote(req, holders=holders),
                                              self.accept_timeout_s + SCORE_TIMEOUT_S, "the replica scoring this request")
                return out
            except TemplateNotHeld:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RESEND_PAUSE_S)
                routes = await self._routes_with(name, fresh=True)
            except ReplicaUnavailable:
                await self.routes(fresh=True)
                raise
            finally:
                self._inflight[first] -= 1
                if self._inflight[first] <= 0:
                    del self._inflight[first]

    async def drain_aborts(self) -> None:
        """Nothing to wait for: a stream closed early cancels its call at once, and the replica
        aborts the request itself (the cancelled call closes the engine stream there)."""

    def list_templates(self) -> list[TemplateInfo]:
        return [info for info, _, _ in call_sync(self.controller.listing.remote(), CALL_TIMEOUT_S,
                                                 "the fleet controller")]

    def kv_stats(self) -> dict[str, int]:
        """The replicas' KV counters (as of their last poll), summed."""
        return _summed_stats(self.replica_reports())

    def replica_reports(self) -> dict[str, dict[str, Any]]:
        """replica id -> its last report: ready, held [(TemplateInfo, origin)], stats (KV counters,
        requests taken by template), node (the Ray node it runs on), startup (seconds from its
        start to its engine loaded and to its templates pinned, and where their K/V came from)."""
        reports: dict[str, dict[str, Any]] = call_sync(self.controller.reports.remote(), CALL_TIMEOUT_S,
                                                       "the fleet controller")
        return reports

    def engine_infos(self) -> dict[str, EngineInfo]:
        """replica id -> what its engine runs (its last report's EngineInfo), for the replicas that have
        reported one."""
        return _engine_infos(self.replica_reports())

    def status(self) -> EngineStatus:
        """The three reads above from one call to the controller (the replicas' last reports)."""
        listing, reports = call_sync(self.controller.status.remote(), CALL_TIMEOUT_S, "the fleet controller")
        return EngineStatus(_summed_stats(reports), [info for info, _, _ in listing], _engine_infos(reports))

    def check_integrity(self) -> None:
        call_sync(self.controller.fan_out.remote("check_integrity"), CALL_TIMEOUT_S, "the fleet controller")

    def shutdown(self) -> None:
        """As Engine.shutdown for the front end (any thread): new requests are refused, the
        streams in flight end with EngineStopped (UNAVAILABLE) and their replicas abort them.
        The fleet outlives its clients: the launcher shuts Ray Serve down."""
        self._stopped = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._cut_off)

    def _cut_off(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for stream in list(self._active):
            stream.cancel()


def _summed_stats(reports: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The replicas' integer KV counters, summed."""
    total: dict[str, int] = {}
    for report in reports.values():
        for key, value in report.get("stats", {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def _engine_infos(reports: dict[str, dict[str, Any]]) -> dict[str, EngineInfo]:
    return {replica: report["engine"] for replica, report in reports.items()
            if isinstance(report.get("engine"), EngineInfo)}


def _abandon(first: asyncio.Future[Any], stream: Any) -> None:
    """Give up a call no replica has taken yet: cancel it, and consume the error its first item
    then ends with (RequestCancelledError), which nobody awaits."""
    stream.cancel()
    first.cancel()
    first.add_done_callback(lambda f: f.cancelled() or f.exception())


class FleetRegistry:
    """TemplateRegistryClient over the controller (admin fan-out; the controller keeps the state
    file)."""

    def __init__(self, engine: FleetEngine) -> None:
        self.engine = engine
        self.controller = engine.controller

    def add(self, src: TemplateSource) -> TemplateInfo:
        info: TemplateInfo
        info, _ = call_sync(self.controller.add.remote(src), ADMIN_TIMEOUT_S, "the fleet controller")
        return info

    def remove(self, name: str) -> bool:
        freed: bool = call_sync(self.controller.remove.remote(name), ADMIN_TIMEOUT_S, "the fleet controller")
        return freed

    def listing(self) -> list[tuple[TemplateInfo, str, tuple[str, ...]]]:
        items: list[tuple[TemplateInfo, str, tuple[str, ...]]] = call_sync(
            self.controller.listing.remote(), CALL_TIMEOUT_S, "the fleet controller")
        return items

    def list(self) -> list[tuple[TemplateInfo, str]]:
        return [(info, origin) for info, origin, _ in self.listing()]

    def known(self, name: str) -> bool:
        return self.engine.known(name)

    async def lookup(self, name: str) -> bool:
        return self.engine.known(name) or (bool(name) and name in await self.engine.routes(fresh=True))
