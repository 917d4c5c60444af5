"""The async streaming API: many coroutines at once, cancellation frees blocks."""
import asyncio

from helpers import greedy, run_ids
from server_fixtures import slow_steps
from prefix_service import GenerateRequest


def _ids(k):
    return [(19 * i + k) % 500 + 3 for i in range(4 + k % 7)]


def test_many_concurrent_streams_equal_blocking_results(make_engine):
    engine = make_engine(block_size=4)
    engine.add_template("p", token_ids=_ids(100) * 2)
    reqs = [GenerateRequest(prompt_token_ids=_ids(k), prefix_name="p" if k % 2 else None, sampling=greedy(16))
            for k in range(24)]

    async def consume(req):
        text, ids, last = "", [], None
        async for out in engine.generate_stream(req):
            text, ids, last = text + out.text, ids + out.token_ids, out
        return text, ids, last

    async def main():
        return await asyncio.gather(*(consume(r) for r in reqs))

    results = asyncio.run(main())
    expected = engine.generate(reqs)
    for (text, ids, last), exp in zip(results, expected):
        assert (text, ids) == (exp.text, exp.token_ids)
        assert last.finished and last.completion_tokens == 16


def test_closing_a_stream_aborts_and_frees_blocks(make_engine):
    engine = make_engine(block_size=4)

    async def main():
        stream = engine.generate_stream(GenerateRequest(prompt_token_ids=_ids(1), sampling=greedy(500)))
        async for out in stream:
            if not out.finished:
                break
        await stream.aclose()
        await engine.drain_aborts()  # the abort runs in the background

    asyncio.run(main())
    stats = engine.kv_stats()
    assert stats["used"] == 0 and stats["peak_used"] > 0  # the stream held blocks; all are back
    engine.reset_kv_peak()
    assert engine.kv_stats()["peak_used"] == 0
    assert run_ids(engine, _ids(1), max_tokens=8)  # still serving
    # the most in use at once since the reset: that request's KV, its prompt and the first 7 of its 8
    # tokens (the last one is sampled, never stored), in blocks of 4
    assert engine.kv_stats()["peak_used"] == -(-(len(_ids(1)) + 7) // 4)


def test_stream_raises_validation_errors(make_engine):
    import pytest
    from prefix_service import TemplateNotFound
    engine = make_engine()

    async def main():
        async for _ in engine.generate_stream(GenerateRequest(prompt="x", prefix_name="nope")):
            pass

    with pytest.raises(TemplateNotFound):
        asyncio.run(main())


def test_cancelling_during_submission_aborts_the_request(make_engine, monkeypatch):
    """A stream cancelled while its request is still being submitted (the gRPC servicer's case when
    a client goes away at once) aborts the request once it has landed: nothing runs on."""
    import time
    engine = make_engine(block_size=4)
    submit = engine.submit
    started = []

    def slow_submit(req, sink):  # the submission is under way when the cancel comes
        started.append(1)
        time.sleep(0.3)
        return submit(req, sink)
    monkeypatch.setattr(engine, "submit", slow_submit)
    undo = slow_steps(engine, 0.05)  # 500 tokens would take 25 s

    async def main():
        task = asyncio.ensure_future(_first(engine.generate_stream(
            GenerateRequest(prompt_token_ids=_ids(2), sampling=greedy(500)))))
        while not started:
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await engine.drain_aborts()

    asyncio.run(main())
    undo()
    stats = engine.kv_stats()
    assert (stats["running"], stats["waiting"], stats["used"]) == (0, 0, 0), stats


async def _first(stream):
    async for out in stream:
        return out
