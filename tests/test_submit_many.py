"""Requests handed over together enter the engine at the same step: Engine.generate and
submit_many add them in one command (one submit after another would each wait for a step
boundary), and a bad one among them lets none run."""
from __future__ import annotations

import threading

import pytest

from helpers import greedy
from prefix_service import GenerateRequest
from prefix_service.errors import TemplateNotFound


def _watch_steps(engine) -> list[int]:
    """The requests in the engine (running and waiting) at the start of each step from now on."""
    core = engine._core
    step = core.step
    seen: list[int] = []

    def counted() -> None:
        stats = core.kv_stats()
        seen.append(stats["running"] + stats["waiting"])
        step()
    engine._run(lambda c: setattr(c, "step", counted))
    return seen


def test_generate_enters_every_request_at_one_step(make_engine):
    engine = make_engine()
    seen = _watch_steps(engine)
    requests = [GenerateRequest(prompt_token_ids=[5 + k, 9, 13], sampling=greedy(4)) for k in range(5)]
    outs = engine.generate(requests)
    assert [len(o.token_ids) for o in outs] == [4] * 5
    assert seen[0] == 5  # all five at the first step, none trickling in later


def test_submit_many_with_a_bad_request_runs_none(make_engine):
    engine = make_engine()
    got: list = []
    requests = [GenerateRequest(prompt_token_ids=[5, 9, 13], sampling=greedy(4)),
                GenerateRequest(prompt_token_ids=[5, 9, 13], prefix_name="missing", sampling=greedy(4))]
    with pytest.raises(TemplateNotFound):
        engine.submit_many(requests, [got.append, got.append])
    stats = engine.kv_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["used"] == 0
    done = threading.Event()
    ids = engine.submit_many(requests[:1], [lambda out: out.finished and done.set()])
    assert len(ids) == 1 and done.wait(30)
