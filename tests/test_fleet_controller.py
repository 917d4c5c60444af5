"""FleetController without a cluster: replicas simulated on one event loop, speaking its protocol
(join, ready, poll, done), with the loop's timings shortened. Placement at start, handover when a
replica joins or leaves (a template never without a holder while one is serving), admin add
all-or-nothing, remove, the state file restored, token ids learnt from a holder."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from prefix_service.config import TemplateSpec, RayConfig
from prefix_service.engine.template_pins import TemplateInfo
from prefix_service.errors import TemplateBudgetExceeded, TemplateExists, TemplateNotFound
from prefix_service.fleet import controller as ctl_module
from prefix_service.fleet.controller import FleetController
from prefix_service.fleet.placement import holders
from prefix_service.sampling_params import StructuredOutput
from prefix_service.server.status import ReplicaUnavailable
from prefix_service.server.store import TemplateSource, TemplateStore
from server_fixtures import make_config

TEMPLATES = {f"t{i}": f"template text {i}" for i in range(6)}


@pytest.fixture(autouse=True)
def fast_loop(monkeypatch):
    monkeypatch.setattr(ctl_module, "RECONCILE_S", 0.02)
    monkeypatch.setattr(ctl_module, "POLL_S", 0.05)
    monkeypatch.setattr(ctl_module, "LEASE_S", 0.4)
    monkeypatch.setattr(ctl_module, "HANDOVER_S", 0.1)


class FakeReplica:
    """What EngineReplica does with the controller, with a dict for an engine."""

    def __init__(self, controller: FleetController, rid: str, refuse: set[str] = frozenset()) -> None:
        self.controller, self.id, self.refuse = controller, rid, refuse
        self.held: dict[str, TemplateSource] = {}
        self.task: asyncio.Task | None = None
        self.kv_from: dict[str, str] = {}  # template -> what the controller's template_kv gave ("prefill": none)
        self.exports: list[str] = []  # templates whose K/V it exported for another replica
        self.unpins: list[tuple[str, bool]] = []  # (template, forget)
        self.fail_export = False
        self.served: dict[str, int] = {}  # requests served on each template it holds, as its engine counts

    def pin(self, src: TemplateSource):
        if src.name in self.refuse:
            raise TemplateBudgetExceeded(f"replica {self.id}: no room for {src.name!r}")
        if src.name in self.held:
            raise TemplateExists(src.name)
        self.held[src.name] = src
        return self.info(src.name), self.token_ids(src.name)

    def unpin(self, name: str, forget: bool = False) -> bool:
        self.held.pop(name, None)
        self.unpins.append((name, forget))
        return True

    def export_kv(self, name: str) -> list[str]:
        if self.fail_export:
            raise RuntimeError(f"replica {self.id}: out of object store memory")
        assert name in self.held
        self.exports.append(name)
        return [f"kv of {name} from {self.id}"]

    def token_ids(self, name: str) -> tuple[int, ...]:
        return tuple(range(len(self.held[name].content or "")))

    def info(self, name: str) -> TemplateInfo:
        return TemplateInfo(name, len(self.held[name].content or ""), 1, self.served.get(name, 0), 0, {})

    def report(self) -> dict:
        return {"held": [(self.info(n), s.origin) for n, s in self.held.items()], "stats": {}}

    async def start(self) -> None:
        for src in await self.controller.join(self.id):
            answer = await self.controller.template_kv(self.id, src.name)  # as its engine's peer_kv asks
            self.pin(src)
            self.kv_from[src.name] = answer[0] if answer else "prefill"
        await self.controller.ready(self.id, {n: self.token_ids(n) for n in self.held}, self.report())
        self.task = asyncio.ensure_future(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            for cmd in await self.controller.poll(self.id, self.report()):
                try:
                    result, ok = getattr(self, cmd.method)(*cmd.args), True
                except Exception as e:  # noqa: BLE001
                    result, ok = e, False
                await self.controller.done(self.id, cmd.id, ok, result)

    def stop(self) -> None:  # killed: it polls no more
        self.task.cancel()

    async def leave(self) -> None:  # stopped by Ray Serve: no more polls, then goodbye
        self.task.cancel()
        await self.controller.leave(self.id)


def controller_for(model_dir, replicas: int, replication: int | None, state_file=None,
                   kv_from_peers: bool = True) -> FleetController:
    config = make_config(model_dir, prefixes=tuple(TemplateSpec(name=n, content=c) for n, c in TEMPLATES.items()))
    config = dataclasses.replace(config, ray=RayConfig(num_replicas=replicas, template_replication=replication,
                                                       template_kv_from_peers=kv_from_peers))
    return FleetController(config, str(state_file) if state_file else None)


async def until(predicate, timeout: float = 5.0, what: str = "the fleet"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout} s")
        await asyncio.sleep(0.01)


def run(coro):
    return asyncio.run(coro)


def held_by(replicas: list[FakeReplica]) -> dict[str, set[str]]:
    return {name: {r.id for r in replicas if name in r.held} for name in TEMPLATES}


def test_start_places_every_template_on_its_holders_before_serving(llama_dir):
    async def main():
        c = controller_for(llama_dir, 3, 2)
        reps = [FakeReplica(c, f"r{i}") for i in range(3)]
        await asyncio.gather(*(r.start() for r in reps))  # the first wait in join for the others
        members = [r.id for r in reps]
        for name in TEMPLATES:
            want = set(holders(name, members, 2))
            assert {r.id for r in reps if name in r.held} == want  # pinned in the "constructor"
            assert set((await c.routes())[name]) == want
        for r in reps:
            r.stop()
    run(main())


def test_a_joining_replica_takes_its_share_and_the_old_holder_lets_go_after(llama_dir):
    async def main():
        c = controller_for(llama_dir, 1, 1)
        a = FakeReplica(c, "a")
        await a.start()
        assert set(a.held) == set(TEMPLATES)
        b = FakeReplica(c, "b")
        seen_empty: list[str] = []

        async def watch():  # a template with no serving holder would stall its requests
            while True:
                seen_empty.extend(n for n, where in (await c.routes()).items() if not where)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        await b.start()
        share = {n for n in TEMPLATES if holders(n, ["a", "b"], 1) == ["b"]}
        assert set(b.held) == share  # pinned before it served
        await until(lambda: set(a.held) == set(TEMPLATES) - share, what="a unpinning b's share")
        watcher.cancel()
        assert seen_empty == []
        routes = await c.routes()
        assert routes.pop("") == ("a", "b")  # a request without a template: any serving member
        assert {n: set(w) for n, w in routes.items()} == held_by([a, b])
        a.stop(), b.stop()
    run(main())


@pytest.mark.parametrize("kv_from_peers", [True, False])
def test_a_joining_replica_gets_its_shares_kv_from_the_holder(llama_dir, kv_from_peers):
    """Each template b pins at its start comes from a, which holds it, through a's export_kv; a
    then lets the template go without forgetting it (a snapshot a shared folder holds stays). With
    ray.template_kv_from_peers off, b prefills and a exports nothing."""
    async def main():
        c = controller_for(llama_dir, 1, 1, kv_from_peers=kv_from_peers)
        a = FakeReplica(c, "a")
        await a.start()
        assert set(a.kv_from.values()) == {"prefill"}  # nobody held anything yet
        b = FakeReplica(c, "b")
        await b.start()
        share = {n for n in TEMPLATES if holders(n, ["a", "b"], 1) == ["b"]}
        assert share and set(b.held) == share
        if kv_from_peers:
            assert b.kv_from == {n: f"kv of {n} from a" for n in share}
            assert sorted(a.exports) == sorted(share)
        else:
            assert set(b.kv_from.values()) == {"prefill"} and a.exports == []
        await until(lambda: set(a.held) == set(TEMPLATES) - share, what="a unpinning b's share")
        assert sorted(a.unpins) == sorted((n, False) for n in share)  # moved, not removed
        a.stop(), b.stop()
    run(main())


def test_a_holder_that_cannot_export_leaves_the_joiner_to_prefill(llama_dir, caplog):
    async def main():
        c = controller_for(llama_dir, 1, 1)
        a = FakeReplica(c, "a")
        await a.start()
        a.fail_export = True
        b = FakeReplica(c, "b")
        await b.start()
        assert b.held and set(b.kv_from.values()) == {"prefill"}
        assert await c.template_kv("b", "no-such-template") is None
        a.stop(), b.stop()
    run(main())
    assert "could not export its K/V" in caplog.text and "out of object store memory" in caplog.text


def test_a_report_taken_before_the_one_held_does_not_replace_it(llama_dir):
    """A replica's poll that took its report while the replica was still pinning can reach the
    controller after the ready() that carried a later report: the controller keeps the later one (the
    replica numbers its reports as it takes them), and takes the next poll's newer one."""
    async def main():
        c = controller_for(llama_dir, 1, 1)
        r = FakeReplica(c, "r")
        assigned = await c.join("r")
        mine = [src.name for src in assigned]
        assert set(mine) == set(TEMPLATES)
        early = {"seq": 1, **r.report()}  # taken before any pin
        for src in assigned:
            r.pin(src)
        await c.ready("r", {n: r.token_ids(n) for n in r.held}, {"seq": 2, **r.report()})
        await c.poll("r", early)  # arrives late
        assert {info.name for info, _ in (await c.reports())["r"]["held"]} == set(TEMPLATES)
        r.unpin(mine[0])
        await c.poll("r", {"seq": 3, **r.report()})
        assert {info.name for info, _ in (await c.reports())["r"]["held"]} == set(TEMPLATES) - {mine[0]}
    run(main())


def test_a_replica_that_stops_polling_leaves_and_its_templates_move(llama_dir):
    async def main():
        c = controller_for(llama_dir, 2, 1)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b")
        await asyncio.gather(a.start(), b.start())
        b.stop()
        await until(lambda: set(a.held) == set(TEMPLATES), what="a taking every template over")
        routes = await c.routes()
        assert all(routes[n] == ("a",) for n in TEMPLATES)
        assert set((await c.reports())) == {"a"}
        a.stop()
    run(main())


def test_a_replica_that_leaves_is_dropped_at_once_and_its_templates_move(llama_dir):
    async def main():
        c = controller_for(llama_dir, 2, 1)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b")
        await asyncio.gather(a.start(), b.start())
        assert set(b.held)  # b holds a share (the ids hash the six templates over both)
        await b.leave()
        routes = await c.routes()
        assert routes[""] == ("a",) and not any("b" in where for where in routes.values())  # before any lease
        assert set((await c.reports())) == {"a"} and await c.departed() == ["b"]
        assert await c.poll("b", b.report()) == []  # a poll sent before its goodbye: no rejoin
        assert set((await c.reports())) == {"a"}
        await until(lambda: set(a.held) == set(TEMPLATES), timeout=ctl_module.LEASE_S * 0.75,
                    what="a taking every template over, sooner than the lease")
        routes = await c.routes()
        assert all(routes[n] == ("a",) for n in TEMPLATES)
        a.stop()
    run(main())


def test_a_template_a_replica_holds_that_the_fleet_no_longer_has_is_unpinned(llama_dir):
    """A replica reports a template the fleet does not have (removed while a joining replica pinned
    it, or pinned by a command the controller gave up on): the controller unpins it there, its
    snapshot too, so its blocks and its name are free again (they stayed held, the name refused
    by that replica, for good)."""
    async def main():
        c = controller_for(llama_dir, 2, None)
        reps = [FakeReplica(c, f"r{i}") for i in range(2)]
        await asyncio.gather(*(r.start() for r in reps))
        reps[1].held["ghost"] = TemplateSource("ghost", content="removed meanwhile", origin="admin")
        await until(lambda: "ghost" not in reps[1].held, what="the unknown template unpinned")
        assert reps[1].unpins == [("ghost", True)]
        assert set(reps[0].held) == set(reps[1].held) == set(TEMPLATES)  # the fleet's own stay
        await c.add(TemplateSource("ghost", content="added for real", origin="admin"))
        await asyncio.sleep(0.2)  # rounds of the loop: what the fleet has stays
        assert all("ghost" in r.held for r in reps) and reps[1].unpins == [("ghost", True)]
        for r in reps:
            r.stop()
    run(main())


def test_requests_served_on_a_template_never_go_down_when_a_holder_goes(llama_dir):
    """The fleet's count of requests served on a template is a counter: a holder that dies, or a
    pin that starts its count over, takes nothing off it (it dropped by what the holder had served,
    which Prometheus reads as a counter reset)."""
    async def main():
        c = controller_for(llama_dir, 2, None)  # every replica holds every template
        reps = [FakeReplica(c, f"r{i}") for i in range(2)]
        await asyncio.gather(*(r.start() for r in reps))

        async def served() -> int:
            return next(info.requests_served for info, _, _ in await c.listing() if info.name == "t0")
        reps[0].served["t0"], reps[1].served["t0"] = 5, 3
        await until(lambda: c.served("t0") == 8, what="both holders' counts")
        reps[1].stop()  # killed: its lease runs out
        await until(lambda: "r1" not in c.members, what="r1 dropped")
        assert await served() == 8
        reps[0].served["t0"] = 2  # pinned there again: its engine counts from 0
        await until(lambda: c.served("t0") == 10, what="the new pin's count added")
        assert await served() == 10
        reps[0].stop()
    run(main())


def test_add_pins_on_every_holder_or_rolls_back(llama_dir, tmp_path):
    async def main():
        state = tmp_path / "state.json"
        c = controller_for(llama_dir, 2, None, state)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b", refuse={"big"})
        await asyncio.gather(a.start(), b.start())
        info, where = await c.add(TemplateSource("small", content="fits"))
        assert info.name == "small" and where == ("a", "b") and "small" in a.held and "small" in b.held
        assert [t["name"] for t in json.loads(state.read_text())["templates"]] == ["small"]
        with pytest.raises(TemplateExists):
            await c.add(TemplateSource("small", content="again"))
        with pytest.raises(TemplateBudgetExceeded, match="no room"):  # b refuses: a's pin is undone
            await c.add(TemplateSource("big", content="too big for b"))
        assert "big" not in a.held and "big" not in (await c.routes())
        assert [t["name"] for t in json.loads(state.read_text())["templates"]] == ["small"]
        assert await c.remove("small") is True
        assert "small" not in a.held and "small" not in b.held and "small" not in (await c.routes())
        assert ("small", True) in a.unpins and ("small", True) in b.unpins  # removed: its snapshots go too
        assert json.loads(state.read_text())["templates"] == []
        with pytest.raises(TemplateNotFound):
            await c.remove("small")
        a.stop(), b.stop()
    run(main())


def test_a_restarted_controller_restores_the_state_file_and_learns_token_ids(llama_dir, tmp_path):
    async def main():
        state = tmp_path / "state.json"
        choice = StructuredOutput("choice", choices=("yes", "no"))
        TemplateStore(state).save([TemplateSource("saved", content="saved text", structured=choice)])
        c = controller_for(llama_dir, 1, None, state)
        assert c.sources["saved"].origin == "admin"
        a = FakeReplica(c, "a")
        await a.start()
        assert "saved" in a.held and set(TEMPLATES) <= set(a.held)
        c.token_ids.clear()  # as after a restart: asked of a holder
        view = await c.get_template("saved")
        assert view.token_ids == a.token_ids("saved") and view.source == {"content": "saved text"}
        assert view.structured == choice  # its default output, as the replicas pin it
        assert a.held["saved"].structured == choice
        assert {info.name: info.structured for info, _, _ in await c.listing()}["saved"] == choice
        with pytest.raises(TemplateNotFound):
            await c.get_template("nope")
        a.stop()
    run(main())


def test_a_template_keeps_its_replication_while_it_moves(llama_dir):
    """Replication 2 and a third replica joining slowly: an old holder lets a template go only once
    every new holder holds it, so no template ever has fewer than 2 serving holders."""
    async def main():
        c = controller_for(llama_dir, 2, 2)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b")
        await asyncio.gather(a.start(), b.start())
        short: list[str] = []

        async def watch():
            while True:
                short.extend(n for n, where in (await c.routes()).items() if n and len(where) < 2)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        template_kv = c.template_kv

        async def slow_template_kv(replica, name):  # the joiner's pins take a while (a prefill each)
            await asyncio.sleep(0.1)
            return await template_kv(replica, name)

        c.template_kv = slow_template_kv
        want = {n: set(holders(n, ["a", "b", "c"], 2)) for n in TEMPLATES}
        assert sum(want[n] != {"a", "b"} for n in TEMPLATES) >= 2  # the joiner takes some over
        x = FakeReplica(c, "c")
        await x.start()
        await until(lambda: held_by([a, b, x]) == want, what="every template on its 2 new holders")
        watcher.cancel()
        assert short == []
        for r in (a, b, x):
            r.stop()
    run(main())


def test_a_replica_that_stops_polling_is_dropped_soon_after_its_lease(llama_dir):
    async def main():
        c = controller_for(llama_dir, 2, 1)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b")
        await asyncio.gather(a.start(), b.start())
        b.stop()
        await until(lambda: "b" not in c.members, timeout=5 * ctl_module.LEASE_S, what="b dropped at its lease")
        a.stop()
    run(main())


def test_a_command_to_a_replica_that_dies_fails_at_its_lease(llama_dir):
    """An admin add whose holder dies mid-way fails with UNAVAILABLE once the holder's lease ends
    (and is rolled back), instead of holding the admin lock until the pin's timeout."""
    async def main():
        c = controller_for(llama_dir, 2, None)
        a, b = FakeReplica(c, "a"), FakeReplica(c, "b")
        await asyncio.gather(a.start(), b.start())
        b.stop()
        with pytest.raises(ReplicaUnavailable, match="replica b left the fleet"):
            await asyncio.wait_for(c.add(TemplateSource("new", content="x", origin="admin")), 30)
        assert "new" not in a.held and "new" not in (await c.routes())
        a.stop()
    run(main())


def test_a_restarted_controller_takes_polling_replicas_back_as_serving(llama_dir):
    async def main():
        c = controller_for(llama_dir, 1, None)
        a = FakeReplica(c, "a")
        await a.start()
        restarted = controller_for(llama_dir, 1, None)
        a.controller = restarted  # its next poll reaches the new controller
        await until(lambda: "a" in restarted.members, what="a polling the restarted controller")
        routes = await restarted.routes()
        assert routes[""] == ("a",) and all(routes[n] == ("a",) for n in TEMPLATES)
        a.stop()
    run(main())


def test_an_admin_add_does_not_wait_for_the_next_poll(llama_dir, monkeypatch):
    """A command wakes the replica's poll at once: an add with polls 30 s apart finishes well
    within them."""
    monkeypatch.setattr(ctl_module, "POLL_S", 30.0)
    monkeypatch.setattr(ctl_module, "LEASE_S", 120.0)

    async def main():
        c = controller_for(llama_dir, 1, None)
        a = FakeReplica(c, "a")
        await a.start()
        await asyncio.sleep(0.1)  # a waits in its poll
        info, where = await asyncio.wait_for(c.add(TemplateSource("new", content="x", origin="admin")), 10)
        assert where == ("a",) and "new" in a.held
        a.stop()
    run(main())


def test_a_moving_template_is_unpinned_only_after_the_handover(llama_dir, monkeypatch):
    """The old holder unpins HANDOVER_S after the new one serves (front ends' cached routes still
    name it until then), not at once."""
    monkeypatch.setattr(ctl_module, "HANDOVER_S", 1.0)

    async def main():
        c = controller_for(llama_dir, 1, 1)
        a = FakeReplica(c, "a")
        await a.start()
        times: list[float] = []
        unpin = a.unpin

        def timed_unpin(name, forget=False):
            times.append(time.monotonic())
            return unpin(name, forget)

        a.unpin = timed_unpin
        b = FakeReplica(c, "b")
        await b.start()
        serving = time.monotonic()
        await until(lambda: len(a.held) < len(TEMPLATES), what="a letting b's share go")
        assert min(times) - serving >= 0.5
        a.stop(), b.stop()
    run(main())
