"""A caller's sink that raises (a streaming client whose event loop has closed, a caller's bug):
its request alone ends, aborted at the next step; the requests beside it run on to the tokens
they give alone, and the engine's thread keeps serving. (It failed the step, and the abort of
everything in flight that followed called the sink again, which ended the engine's thread: every
later call waited forever.)"""
from __future__ import annotations

import asyncio
import threading

import pytest

from prefix_service import GenerateRequest, SamplingParams, ScoreRequest

PROMPT = [5, 17, 99, 230]


def request(n: int = 1, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=24, ignore_eos=True, n=n,
                                                                            **kw))


def collecting_sink(outputs: list, done: threading.Event, samples: int = 1):
    left = [samples]

    def sink(out) -> None:
        outputs.append(out)
        left[0] -= int(out.finished)
        if left[0] == 0:
            done.set()
    return sink


def raising_sink(calls: list, after: int = 2):
    def sink(out) -> None:
        calls.append(out)
        if len(calls) >= after:
            raise RuntimeError("Event loop is closed")
    return sink


@pytest.mark.parametrize("n", [1, 3])
def test_a_raising_sink_ends_its_request_alone(make_engine, n):
    engine = make_engine()
    alone = engine.generate([request()])[0].token_ids
    outputs, done, calls = [], threading.Event(), []
    engine.submit(request(), collecting_sink(outputs, done))
    engine.submit(request(n=n, temperature=1.0, seed=5), raising_sink(calls))
    assert done.wait(30)
    assert outputs[-1].error is None and [t for o in outputs for t in o.token_ids] == alone
    assert len(calls) == 2  # never called again once it raised
    assert engine._thread.is_alive()
    assert engine.generate([request()])[0].token_ids == alone  # still serving
    assert engine.kv_stats()["running"] == engine.kv_stats()["waiting"] == 0


def test_a_raising_score_sink_ends_its_request_alone(make_engine):
    engine = make_engine()
    alone = engine.generate([request()])[0].token_ids
    outputs, done, calls = [], threading.Event(), []
    engine.submit(request(), collecting_sink(outputs, done))
    engine.submit_score(ScoreRequest([[7, 8], [9]], prompt_token_ids=PROMPT), raising_sink(calls, after=1))
    assert done.wait(30)
    assert [t for o in outputs for t in o.token_ids] == alone and len(calls) == 1
    assert engine._thread.is_alive() and engine.generate([request()])[0].token_ids == alone


def test_a_stream_whose_event_loop_closed_ends_alone(make_engine):
    """The case met in serving: a stream's first output read on a loop that is then closed, the
    request still running; its outputs can no longer be handed over."""
    engine = make_engine()
    alone = engine.generate([request()])[0].token_ids
    outputs, done = [], threading.Event()
    engine.submit(request(), collecting_sink(outputs, done))

    async def first_output():
        stream = engine.generate_stream(GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
            max_tokens=200, ignore_eos=True)))
        return await anext(stream)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(first_output())
    loop.close()
    assert done.wait(30)
    assert outputs[-1].error is None and [t for o in outputs for t in o.token_ids] == alone
    assert engine._thread.is_alive() and engine.generate([request()])[0].token_ids == alone
