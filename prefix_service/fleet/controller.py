"""FleetController: the one place that knows the fleet (a single Ray Serve replica, on the head
node: the state file lives there).

It holds every template's definition (the config's, then the state file's, then admin adds),
the members (replicas that joined and still poll), where each template is pinned now
(`locations`), and computes where each should be (placement.py over the members).

Replicas talk to the controller, never the reverse: each long-polls `poll` (at most POLL_S
apart) with a report of what it holds and its counters, and gets back the commands queued for it
(pin, unpin, token_ids, export_kv, check_integrity), whose results it returns through `done`. The poll is
also the heartbeat: a member silent for LEASE_S has left, and its pending commands fail. A
replica that Ray Serve stops (scaled down, replaced, the application deleted) says so once its
requests have drained (`leave`), and its templates move at once instead of at the lease.

A loop every RECONCILE_S moves the fleet toward the placement:

    a ready member that should hold a template and does not: pin it there
    a member that holds a template it should not: unpin, once every target holds it (its route
        goes at once, its blocks HANDOVER_S later)

A joining replica pins its own share in its constructor (before Ray Serve routes to it), so the
loop only pins on members that are already serving. Routes (template -> members holding it)
answer from `locations`: a request is only ever sent where its template is pinned.

Admin calls (add, remove) run one at a time. An add pins on the template's targets and returns
once all hold it; if any fails the others are unpinned and the error is raised. Admin templates
are persisted in the state file (TemplateStore) once for the fleet.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Coroutine

from prefix_service.config import ServiceConfig
from prefix_service.engine.template_pins import TemplateInfo, TemplateView
from prefix_service.errors import TemplateExists, TemplateNotFound
from prefix_service.fleet import log_to_serve
from prefix_service.fleet.placement import holders
from prefix_service.server.status import PersistError, ReplicaUnavailable
from prefix_service.server.store import TemplateSource, TemplateStore, state_file_name

log = logging.getLogger("prefix_service.fleet")

RECONCILE_S = 0.5
POLL_S = 1.0  # the longest a replica's poll waits for a command
LEASE_S = 6.0  # a member that has not polled for this long has left
PIN_TIMEOUT_S = 600.0  # a template's prefill on one replica
CALL_TIMEOUT_S = 30.0
KV_EXPORT_TIMEOUT_S = 60.0  # a holder copying out a template's K/V for another replica
# A template moving off a replica: its routes drop the replica at once, its blocks are unpinned
# this much later, when every front end's cached routes (client.ROUTES_TTL_S) have been refreshed.
# A request that still reaches it is answered TemplateNotHeld and resent.
HANDOVER_S = 2.0
FORM_TIMEOUT_S = 120.0  # at the fleet's start: how long the first replicas wait for the others to join


@dataclass(frozen=True)
class Command:
    id: int
    method: str  # an EngineReplica method named in replica.COMMANDS
    args: tuple[Any, ...] = ()


@dataclass
class Member:
    ready: bool = False  # its constructor returned: it serves
    last_seen: float = field(default_factory=time.monotonic)
    report: dict[str, Any] = field(default_factory=dict)  # its newest: held templates, stats (see take_report)
    queue: list[Command] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    def take_report(self, report: dict[str, Any]) -> bool:
        """Keep `report` unless the one held was taken after it (a replica numbers its reports, `seq`, as
        it takes them): a poll's report taken while the replica was still pinning its templates can
        arrive after the ready() that carried a later one, and would stand for a poll's wait."""
        if report.get("seq", 0) >= self.report.get("seq", 0):
            self.report = report
            return True
        return False


class FleetController:
    def __init__(self, config: ServiceConfig, state_file: str | None, *, in_serve: bool = False) -> None:
        if in_serve:  # a Ray Serve replica: log where Ray Serve logs it
            log_to_serve()
        ray_cfg = config.ray
        self.replication = ray_cfg.template_replication if ray_cfg is not None else None
        self.kv_from_peers = ray_cfg.template_kv_from_peers if ray_cfg is not None else True
        # The first replicas to start wait (in join) until this many have joined, so the first
        # placement spreads the templates over the whole fleet instead of loading them all onto
        # the first replica up.
        self.expected = (ray_cfg.min_replicas or ray_cfg.num_replicas) if ray_cfg is not None else 1
        self._formed = asyncio.Event()
        self.store = TemplateStore(state_file) if state_file else None
        self.sources: dict[str, TemplateSource] = {}
        for p in config.prefixes:
            self.sources[p.name] = TemplateSource(p.name, content=None if p.system_prompt is not None else p.read_text(),
                                                  system_prompt=p.system_prompt, origin="config",
                                                  structured=p.structured_output)
        for src in self.store.load() if self.store is not None else []:
            if src.name in self.sources:
                log.warning("template %r from the state file is also in the config; the config's wins", src.name)
            else:
                self.sources[src.name] = src
        self.members: dict[str, Member] = {}
        self._departed: dict[str, None] = {}  # replicas that left by `leave` (in order): never members again
        self.locations: dict[str, set[str]] = {name: set() for name in self.sources}
        self.token_ids: dict[str, tuple[int, ...]] = {}
        # what the pins of an add answered, until a holder's report has the template (listing())
        self._pinned: dict[str, list[TemplateInfo]] = {}
        self._busy: set[tuple[str, str]] = set()  # (template, replica) with a pin or unpin in flight
        self._swept: dict[tuple[str, str], int] = {}  # (template, replica) unpinned by _sweep: the report's seq
        # requests served on each template, fleet-wide, never going down (a counter): the newest count each
        # holder reported (kept once it goes), and what its earlier pins there had served
        self._served_last: dict[tuple[str, str], int] = {}
        self._served_before: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._admin = asyncio.Lock()
        self._loop_task: asyncio.Task[None] | None = None

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._reconcile_forever())

    def _targets(self, name: str) -> list[str]:
        return holders(name, self.members, self.replication)

    # --- membership ---------------------------------------------------------------------------
    async def join(self, replica: str) -> list[TemplateSource]:
        """A replica starts: it becomes a member; returns the templates it must pin."""
        self._ensure_loop()
        self.members[replica] = Member()
        deadline = time.monotonic() + FORM_TIMEOUT_S
        while not self._formed.is_set():
            # a replica waiting here is alive: keep it from the lease, which counts polls
            self.members.setdefault(replica, Member()).last_seen = time.monotonic()
            if len(self.members) >= self.expected:
                self._formed.set()
            elif time.monotonic() > deadline:
                log.warning("%d of %d replicas joined within %.0f s; placing the templates on those",
                            len(self.members), self.expected, FORM_TIMEOUT_S)
                self._formed.set()
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._formed.wait(), 1.0)
        member = self.members.setdefault(replica, Member())
        member.last_seen = time.monotonic()
        mine = [src for name, src in self.sources.items() if replica in self._targets(name)]
        log.info("replica %s joins (%d members): it pins %d of %d templates", replica, len(self.members),
                 len(mine), len(self.sources))
        return mine

    async def ready(self, replica: str, held: dict[str, tuple[int, ...]], report: dict[str, Any]) -> None:
        """The replica's constructor is done: it serves, holding these templates (token ids by
        name), and reports as in a poll."""
        member = self.members.setdefault(replica, Member())
        member.ready = True
        member.last_seen = time.monotonic()
        if member.take_report(report):
            self._count_served(replica, report)
        for name, ids in held.items():
            if name in self.locations:
                self.locations[name].add(replica)
                self.token_ids.setdefault(name, tuple(ids))

    async def poll(self, replica: str, report: dict[str, Any]) -> list[Command]:
        """A replica's heartbeat: its report in, the commands queued for it out (waits up to
        POLL_S for one)."""
        self._ensure_loop()
        member = self.members.get(replica)
        if member is None and replica in self._departed:  # a poll sent before its leave
            return []
        if member is None:  # dropped after a missed lease, or this controller restarted: rejoin as serving
            held = [info.name for info, _ in report.get("held", ())]
            log.info("replica %s (re)joins by its poll, holding %d templates", replica, len(held))
            member = self.members[replica] = Member(ready=True)
            for name in held:
                if name in self.locations:
                    self.locations[name].add(replica)
        member.last_seen = time.monotonic()
        if member.take_report(report):
            self._count_served(replica, report)
        if not member.queue:
            member.wake.clear()
            try:
                await asyncio.wait_for(member.wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
        commands, member.queue = member.queue, []
        return commands

    async def leave(self, replica: str) -> None:
        """The replica is stopping, its requests drained: it leaves now, and the next round places
        its templates on the others."""
        self._departed[replica] = None
        self._drop(replica, "it is stopping")

    async def departed(self) -> list[str]:
        """The replicas that left by saying goodbye (stopped by Ray Serve), oldest first."""
        return list(self._departed)

    async def done(self, replica: str, command_id: int, ok: bool, result: Any) -> None:
        """A command's outcome: its result, or the exception it raised."""
        member = self.members.get(replica)
        future = member.pending.pop(command_id, None) if member is not None else None
        if future is not None and not future.done():
            if ok:
                future.set_result(result)
            else:
                future.set_exception(result)

    async def _command(self, replica: str, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        member = self.members.get(replica)
        if member is None:
            raise ReplicaUnavailable(f"replica {replica} has left the fleet")
        cmd = Command(next(self._ids), method, args)
        future = asyncio.get_running_loop().create_future()
        member.pending[cmd.id] = future
        member.queue.append(cmd)
        member.wake.set()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaUnavailable(f"replica {replica} did not finish {method} within {timeout_s:.0f} s") from None
        finally:
            member.pending.pop(cmd.id, None)

    def _count_served(self, replica: str, report: dict[str, Any]) -> None:
        for info, _ in report.get("held", ()):
            if info.name not in self.sources:  # removed (a report taken before the unpin)
                continue
            key = (info.name, replica)
            last = self._served_last.get(key, 0)
            if info.requests_served < last:  # pinned there again since: its count starts over
                self._served_before[info.name] = self._served_before.get(info.name, 0) + last
            self._served_last[key] = info.requests_served

    def served(self, name: str) -> int:
        """Requests served on `name` by every replica that has held it since it was added."""
        return self._served_before.get(name, 0) + sum(n for (t, _), n in self._served_last.items() if t == name)

    def _drop(self, replica: str, why: str) -> None:
        member = self.members.pop(replica, None)
        if member is None:
            return
        for where in self.locations.values():
            where.discard(replica)
        for future in member.pending.values():
            if not future.done():
                future.set_exception(ReplicaUnavailable(f"replica {replica} left the fleet ({why})"))
        log.warning("replica %s left the fleet (%s); %d members", replica, why, len(self.members))

    # --- the loop -----------------------------------------------------------------------------
    async def _reconcile_forever(self) -> None:
        while True:
            try:
                self._reconcile()
            except Exception:  # noqa: BLE001 - keep reconciling
                log.exception("fleet reconcile failed")
            await asyncio.sleep(RECONCILE_S)

    def _reconcile(self) -> None:
        now = time.monotonic()
        for replica, member in list(self.members.items()):
            if now - member.last_seen > LEASE_S:
                self._drop(replica, f"no poll for {now - member.last_seen:.1f} s")
        if self._admin.locked():
            return  # an add or remove is placing a template; look again next round
        for name, src in self.sources.items():
            targets = self._targets(name)
            where = self.locations[name]
            for replica in targets:
                if self.members[replica].ready and replica not in where and (name, replica) not in self._busy:
                    self._spawn(self._pin(src, replica))
            if all(t in where for t in targets):
                for replica in where - set(targets):
                    if (name, replica) not in self._busy:
                        where.discard(replica)  # no new requests go there...
                        # ...once the front ends' cached routes have expired: unpin after that
                        self._spawn(self._unpin(name, replica, after_s=HANDOVER_S))
        self._sweep()

    def _sweep(self) -> None:
        """Unpin what a member reports holding that the fleet no longer has: a template removed while
        a joining replica pinned it in its constructor, or pinned by a command whose answer the
        controller gave up on (the replica dropped at its lease meanwhile). Each (template, replica)
        once per report that shows it."""
        for replica, member in self.members.items():
            seq = member.report.get("seq", 0)
            for info, _ in member.report.get("held", ()):
                key = (info.name, replica)
                if info.name in self.sources:  # (added again since)
                    self._swept.pop(key, None)
                    continue
                if key in self._busy or self._swept.get(key, -1) >= seq:
                    continue
                self._swept[key] = seq
                log.warning("replica %s holds template %r, which the fleet no longer has: unpinning it", replica,
                            info.name)
                self._spawn(self._unpin(info.name, replica, forget=True))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.get_running_loop().create_task(coro)

    async def _pin(self, src: TemplateSource, replica: str) -> TemplateInfo | None:
        key = (src.name, replica)
        self._busy.add(key)
        info: TemplateInfo | None
        ids: tuple[int, ...] | None
        try:
            info, ids = await self._command(replica, "pin", src, timeout_s=PIN_TIMEOUT_S)
        except TemplateExists:  # it holds it already
            info = ids = None
        except Exception as e:  # noqa: BLE001 - the next round tries again
            log.warning("pinning %r on replica %s failed: %s", src.name, replica, e)
            return None
        finally:
            self._busy.discard(key)
        if self.sources.get(src.name) is src and replica in self.members:
            self.locations[src.name].add(replica)
            if ids is not None:
                self.token_ids.setdefault(src.name, tuple(ids))
            log.info("template %r pinned on replica %s", src.name, replica)
        elif info is not None:  # removed meanwhile, or the replica left: undo
            self._spawn(self._unpin(src.name, replica))
        return info

    async def _unpin(self, name: str, replica: str, after_s: float = 0.0, forget: bool = False) -> bool:
        """Unpin name on replica (after after_s). forget: the template is removed from the fleet,
        so its snapshot goes too; a template that only moves keeps it (a folder replicas share
        still serves the others)."""
        key = (name, replica)
        self._busy.add(key)
        try:
            await asyncio.sleep(after_s)
            freed: bool = await self._command(replica, "unpin", name, forget)
            return freed
        except Exception as e:  # noqa: BLE001 - a replica gone has nothing left to free
            log.warning("unpinning %r on replica %s failed: %s", name, replica, e)
            return True
        finally:
            self._busy.discard(key)

    async def template_kv(self, replica: str, name: str) -> list[Any] | None:
        """A replica about to pin `name` asks for its K/V: a serving holder other than itself
        exports it (its `export_kv` command: a snapshot's bytes, put in Ray's object store) and the
        answer is [the object's ref] (a ref inside a list stays a ref), which the replica gets from
        the holder's node directly. None when no holder is serving, when every one tried failed,
        or with ray.template_kv_from_peers off: the replica prefills."""
        if not self.kv_from_peers:
            return None
        holding = [r for r in sorted(self.locations.get(name, ()))
                   if r != replica and r in self.members and self.members[r].ready]
        for holder in holding[:2]:
            try:
                answer: list[Any] = await self._command(holder, "export_kv", name, timeout_s=KV_EXPORT_TIMEOUT_S)
                log.info("template %r: replica %s gets its K/V from replica %s", name, replica, holder)
                return answer
            except Exception as e:  # noqa: BLE001 - the next holder, else a prefill
                log.warning("template %r: replica %s could not export its K/V for replica %s: %s", name, holder,
                            replica, e)
        return None

    # --- what front ends ask ------------------------------------------------------------------
    async def routes(self) -> dict[str, tuple[str, ...]]:
        """template -> the serving members that hold it (possibly none, while it is being placed);
        "" (no template) -> every serving member."""
        serving = {r for r, m in self.members.items() if m.ready}
        out = {name: tuple(sorted(where & serving)) for name, where in self.locations.items()}
        out[""] = tuple(sorted(serving))
        return out

    async def get_template(self, name: str) -> TemplateView:
        """A template's token ids, definition and default output (the chat path needs them)."""
        src = self.sources.get(name)
        if src is None:
            raise TemplateNotFound(f"no prefix template named {name!r} (known: {', '.join(sorted(self.sources))})")
        if name not in self.token_ids:  # a restarted controller learns them from a holder
            where = (await self.routes()).get(name, ())
            if not where:
                raise ReplicaUnavailable(f"prefix template {name!r} is not pinned on any replica yet; retry")
            self.token_ids[name] = tuple(await self._command(where[0], "token_ids", name))
        return TemplateView(name, self.token_ids[name], src.definition(), src.structured)

    async def listing(self) -> list[tuple[TemplateInfo, str, tuple[str, ...]]]:
        """Every template with its counters summed over its holders (as of their last poll), its
        origin and its holders."""
        per: dict[str, list[TemplateInfo]] = {}
        for member in self.members.values():
            for info, _ in member.report.get("held", ()):
                per.setdefault(info.name, []).append(info)
        routes = await self.routes()
        out = []
        for name, src in self.sources.items():
            found = per.get(name, [])
            if found:
                self._pinned.pop(name, None)
            else:  # added a moment ago: no holder has reported it yet
                found = self._pinned.get(name, [])
            first = found[0] if found else None
            info = TemplateInfo(name, first.num_tokens if first else len(self.token_ids.get(name, ())),
                                first.num_blocks if first else 0, self.served(name),
                                sum(i.active_requests for i in found), src.definition(), src.structured,
                                ",".join(sorted({i.kv_source for i in found})))  # each holder's: prefill, snapshot, peer
            out.append((info, src.origin, routes[name]))
        return out

    async def reports(self) -> dict[str, dict[str, Any]]:
        """replica -> its last report (held templates, stats), for every member."""
        return {r: {"ready": m.ready, **m.report} for r, m in self.members.items()}

    async def status(self) -> tuple[list[tuple[TemplateInfo, str, tuple[str, ...]]], dict[str, dict[str, Any]]]:
        """listing() and reports() in one call (a metrics scrape's)."""
        return await self.listing(), await self.reports()

    async def fan_out(self, method: str) -> dict[str, Any]:
        """Run a no-argument replica command on every serving member: replica -> its answer."""
        serving = sorted(r for r, m in self.members.items() if m.ready)
        answers = await asyncio.gather(*(self._command(r, method) for r in serving))
        return dict(zip(serving, answers))

    # --- admin --------------------------------------------------------------------------------
    async def add(self, src: TemplateSource) -> tuple[TemplateInfo, tuple[str, ...]]:
        """Pin on every target; returns once all hold it (its info and its holders). Rolls the
        pins back if any fails, or if the state file cannot be written."""
        async with self._admin:
            if src.name in self.sources:
                raise TemplateExists(f"a prefix template named {src.name!r} already exists; remove it first")
            serving = [r for r, m in self.members.items() if m.ready]
            if not serving:
                raise ReplicaUnavailable("no replica is serving yet; retry when the fleet is up")
            targets = [r for r in self._targets(src.name) if self.members[r].ready] \
                or holders(src.name, serving, self.replication)
            results = await asyncio.gather(*(self._command(r, "pin", src, timeout_s=PIN_TIMEOUT_S) for r in targets),
                                           return_exceptions=True)
            failed = [e for e in results if isinstance(e, BaseException)]
            pinned = [p for p in results if not isinstance(p, BaseException)]  # (TemplateInfo, token ids) each
            if failed:
                done = [r for r, e in zip(targets, results) if not isinstance(e, BaseException)]
                await asyncio.gather(*(self._unpin(src.name, r, forget=True) for r in done))
                raise failed[0]
            self.sources[src.name] = src
            self.locations[src.name] = set(targets)
            info, ids = pinned[0]
            self.token_ids[src.name] = tuple(ids)
            self._pinned[src.name] = [i for i, _ in pinned]
            try:
                self._save()
            except OSError as e:
                del self.sources[src.name], self.locations[src.name], self._pinned[src.name]
                await asyncio.gather(*(self._unpin(src.name, r, forget=True) for r in targets))
                raise PersistError(f"template {src.name!r} was not added: cannot write the state file "
                                   f"{state_file_name(self.store)}: {e}") from e
            log.info("template %r added on %s", src.name, ", ".join(targets))
            return info, tuple(sorted(targets))

    async def remove(self, name: str) -> bool:
        """Unpin everywhere. True if every holder freed its blocks now, False if some deferred it
        until the requests using it finish."""
        async with self._admin:
            src = self.sources.pop(name, None)
            if src is None:
                raise TemplateNotFound(f"no prefix template named {name!r} (known: {', '.join(sorted(self.sources))})")
            where = self.locations.pop(name, set())
            self.token_ids.pop(name, None)
            self._pinned.pop(name, None)
            self._served_before.pop(name, None)  # a template added again under the name counts from 0
            for key in [k for k in self._served_last if k[0] == name]:
                del self._served_last[key]
            freed = await asyncio.gather(*(self._unpin(name, r, forget=True) for r in where))
            if src.origin == "admin":
                try:
                    self._save()
                except OSError as e:
                    raise PersistError(f"template {name!r} was removed, but the state file "
                                       f"{state_file_name(self.store)} could not be updated ({e}); it will come "
                                       f"back at the next start") from e
            log.info("template %r removed from %s", name, ", ".join(sorted(where)) or "no replica")
            return all(freed)

    def _save(self) -> None:
        if self.store is not None:
            self.store.save(s for s in self.sources.values() if s.origin == "admin")
