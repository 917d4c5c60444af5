"""The Engine's API at its edges: a cancel while a score or a request is submitted or running aborts it;
a shutdown answers the calls queued and ends the requests in flight; a score raises the error that ended
it; text that continues a template or a prompt is tokenized without special tokens; a constraint wins
over min_tokens at its last held token; a score far below float32's range stays finite."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from helpers import greedy
from server_fixtures import slow_steps
from prefix_service import (CacheConfig, Engine, EngineConfig, FinishReason, GenerateRequest, ModelConfig,
                            SamplingParams, ScoreRequest)
from prefix_service.sampling_params import StructuredOutput

PROMPT = [41, 77, 301, 12, 9, 130]
LONG_CANDIDATES = [[(k * 13 + j) % 500 + 3 for j in range(24)] for k in range(8)]


SETTLED = {"running": 0, "waiting": 0, "used": 0}


def cancelled_and_settled(engine, call, until, landed: threading.Event | None = None) -> dict:
    """Run call() (a coroutine) as a task until until() holds, cancel it, wait for its abort (and
    for `landed`, its submission's end) -> the engine's running, waiting and used counts, read while
    the event loop lives (a server's does: after it closes, a failing sink ends a request anyway)."""
    async def main():
        task = asyncio.ensure_future(call())
        deadline = time.monotonic() + 60
        while not until():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await engine.drain_aborts()
        while landed is not None and not landed.is_set():
            await asyncio.sleep(0.01)
        stats = engine.kv_stats()
        return {k: stats[k] for k in SETTLED}

    return asyncio.run(main())


def slow_submission(engine, monkeypatch, method: str) -> tuple[threading.Event, threading.Event]:
    """engine.<method> (submit, submit_score) waits 0.3 s before it submits, so a cancel lands while
    the request is being submitted -> (started, landed) events."""
    submit = getattr(engine, method)
    started, landed = threading.Event(), threading.Event()

    def slow(req, sink):
        started.set()
        time.sleep(0.3)
        try:
            return submit(req, sink)
        finally:
            landed.set()

    monkeypatch.setattr(engine, method, slow)
    return started, landed


def test_cancelling_a_running_score_aborts_it(make_engine):
    """A score_async cancelled while its candidates run (a client that went away) is aborted: once
    drain_aborts returns, nothing of it runs on or holds a block."""
    engine = make_engine(block_size=4, max_num_batched_tokens=8)  # many steps for the candidates
    undo = slow_steps(engine, 0.1)  # the whole score would take ~3 s
    try:
        assert cancelled_and_settled(engine, lambda: engine.score_async(
            ScoreRequest(LONG_CANDIDATES, prompt_token_ids=PROMPT)), lambda: engine.kv_stats()["running"]) == SETTLED
    finally:
        undo()


def test_cancelling_a_score_during_submission_aborts_it(make_engine, monkeypatch):
    """As test_cancelling_during_submission_aborts_the_request, for score_async: a cancel while the
    score is still being submitted aborts it once it has landed."""
    engine = make_engine(block_size=4, max_num_batched_tokens=8)
    started, landed = slow_submission(engine, monkeypatch, "submit_score")
    undo = slow_steps(engine, 0.1)
    try:
        assert cancelled_and_settled(engine, lambda: engine.score_async(
            ScoreRequest(LONG_CANDIDATES, prompt_token_ids=PROMPT)), started.is_set, landed) == SETTLED
    finally:
        undo()


def test_cancelling_during_submission_aborts_the_request_while_the_loop_lives(make_engine, monkeypatch):
    """test_cancelling_during_submission_aborts_the_request, checked before the event loop closes (a
    server's loop lives on): once drain_aborts returns and the submission has landed, nothing runs.
    (Checked after asyncio.run, a request that was never aborted is ended anyway by its sink failing
    on the closed loop, or has not landed yet.)"""
    engine = make_engine(block_size=4)
    started, landed = slow_submission(engine, monkeypatch, "submit")
    undo = slow_steps(engine, 0.05)  # 500 tokens would take 25 s

    async def first_output():
        async for out in engine.generate_stream(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(500))):
            return out

    try:
        assert cancelled_and_settled(engine, first_output, started.is_set, landed) == SETTLED
    finally:
        undo()


def test_a_call_queued_as_the_engine_shuts_down_is_answered(llama_dir):
    """A command another thread queued before shutdown (a metrics scrape during a server's stop) is
    still answered: its caller never waits forever."""
    engine = Engine(EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu"),
                                 CacheConfig(num_blocks=32)))
    gate, entered = threading.Event(), threading.Event()
    engine._call(lambda core: entered.set() or gate.wait(30))  # the loop thread is busy with this one
    try:
        assert entered.wait(30)
        got: dict = {}

        def scrape():
            try:
                got["stats"] = engine.kv_stats()
            except Exception as e:  # noqa: BLE001 - EngineStopped would be an answer too
                got["error"] = e
        caller = threading.Thread(target=scrape, daemon=True)
        caller.start()
        deadline = time.monotonic() + 30
        while not engine._commands and time.monotonic() < deadline:  # queued behind the busy command
            time.sleep(0.005)
        assert engine._commands
        stopper = threading.Thread(target=engine.shutdown, daemon=True)
        stopper.start()
        while not engine._stopping and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        gate.set()
    caller.join(30)
    stopper.join(30)
    assert not caller.is_alive(), "a call queued before shutdown was never answered"
    assert "stats" in got or "error" in got


def test_requests_in_flight_at_shutdown_end_with_engine_stopped(llama_dir):
    """generate() running on another thread when the engine shuts down raises EngineStopped rather
    than waiting forever."""
    from prefix_service.errors import EngineStopped
    engine = Engine(EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu"),
                                 CacheConfig(num_blocks=64)))
    undo = slow_steps(engine, 0.05)  # 400 tokens: 20 s
    got: dict = {}

    def run():
        try:
            got["out"] = engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(400)))
        except Exception as e:  # noqa: BLE001
            got["error"] = e
    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while engine.kv_stats()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.shutdown()
    undo()
    caller.join(30)
    assert not caller.is_alive(), "generate() still waits after the engine shut down"
    assert isinstance(got.get("error"), EngineStopped)



def test_a_score_that_a_step_failure_ends_raises(make_engine):
    """Engine.score raises the error that ended the score (a failed step), not an empty result."""
    engine = make_engine(backend="torch")
    forward = engine._run(lambda core: core.backend.forward)

    def fail(*args, **kwargs):
        raise RuntimeError("shape '[2, 3]' is invalid for input of size 7")
    engine._run(lambda core: setattr(core.backend, "forward", fail))
    try:
        with pytest.raises(RuntimeError, match="is invalid for input"):
            engine.score(ScoreRequest([[17], [250, 3]], prompt_token_ids=PROMPT))
    finally:
        engine._run(lambda core: setattr(core.backend, "forward", forward))
    assert len(engine.score(ScoreRequest([[17], [250, 3]], prompt_token_ids=PROMPT)).candidates) == 2


def test_text_is_tokenized_without_special_tokens_where_it_continues(make_engine, monkeypatch):
    """A text candidate, and a prompt on a template, continue what comes before them: tokenized
    without special tokens (a tokenizer that adds a BOS, as Llama 3's, would put one inside the
    context); a prompt without a template gets them."""
    engine = make_engine()
    engine.add_template("t", token_ids=[7, 8, 9, 10, 11])
    calls = []
    encode = engine.tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append((text, kwargs.get("add_special_tokens", True)))
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    engine.score(ScoreRequest([" order", " refund"], prompt=" the price", prefix_name="t"))
    engine.generate(GenerateRequest(prompt=" on it", prefix_name="t", sampling=greedy(2)))
    engine.generate(GenerateRequest(prompt="alone", sampling=greedy(2)))
    assert calls == [(" the price", False), (" order", False), (" refund", False), (" on it", False),
                     ("alone", True)]



@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=5)])
def test_the_constraint_wins_over_min_tokens_at_its_last_held_token(make_engine, sampling):
    """test_a_constraint_that_allows_only_a_stop_token_wins_over_min_tokens with min_tokens=2: the
    regex "qz" allows only the stop token "z" as the second token, the last one min_tokens still
    holds back: the constraint wins there too."""
    engine = make_engine()
    z = engine.tokenizer.convert_tokens_to_ids("z")
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=8, min_tokens=2, stop_token_ids=(z,), structured=StructuredOutput("regex", "qz"), **sampling))])[0]
    assert (out.text, out.finish_reason) == ("qz", FinishReason.STOP)



def test_abort_after_shutdown_says_false(llama_dir):
    """abort() on a shut-down engine answers False (the stop ended every request), as its callers
    (generate's clean-up after an error, a server's cancel) expect, rather than raising."""
    engine = Engine(EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu"),
                                 CacheConfig(num_blocks=32)))
    engine.shutdown()
    assert engine.abort("any-request") is False



def test_a_candidate_far_below_float32s_range_keeps_a_finite_score():
    """A candidate token the model all but rules out (a logit 200 below the top: a probability
    under float32's smallest) still gets its log-probability, -200, not -inf (a softmax, then a log,
    underflows to log(0))."""
    import torch
    from prefix_service.engine.scoring import Scoring
    scoring = Scoring("s", lambda out: None, [(1,), (0, 1)], prompt_tokens=3, cached_tokens=0)
    parent = scoring.fork_point([5, 6, 7], None)
    first, second = scoring.candidate_sequences(parent)
    logits = torch.tensor([[0.0, -200.0, -1.0]])
    scoring.record(first, 3, logits)  # the logits at the fork point's last position score token 1
    scoring.record(second, 4, torch.tensor([[0.0, -1.0, -2.0], [0.0, -200.0, -1.0]]))
    lps = scoring.logprobs
    assert lps[0][0] == pytest.approx(-200.0 - torch.tensor([0.0, -200.0, -1.0]).logsumexp(0).item(), abs=1e-3)
    assert all(v is not None and v > -1e4 for row in lps for v in row), lps
