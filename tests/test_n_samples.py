"""n > 1 samples of one prompt: the prompt is computed once and each sample continues its KV
(shared full blocks, its own copy of the partial tail); sample i of a seeded request draws what a
request of seed + i draws alone; greedy samples equal the single greedy answer; bad n is refused;
an abort before or after the fork frees every block."""
import threading
import time

import pytest

from helpers import greedy
from prefix_service import CacheExhausted, GenerateRequest, InvalidRequest, SamplingParams

TEMPLATE = [(3 * i + 7) % 500 + 3 for i in range(22)]
PROMPT = [41, 77, 301, 12, 9, 130, 140]


def request(n, prefix=None, **kw):
    params = dict(max_tokens=10, ignore_eos=True, n=n)
    params.update(kw)
    return GenerateRequest(prompt_token_ids=PROMPT, prefix_name=prefix, sampling=SamplingParams(**params))


def collector(ends: int):
    """(outputs, event, sink): the sink keeps every output and sets the event at the ends-th finished one."""
    got = []
    done = threading.Event()

    def sink(out):
        got.append(out)
        if sum(o.finished for o in got) == ends:
            done.set()
    return got, done, sink


def add_bad_and_good(engine, bad_prefix, sink):
    """In one command: "bad", 3 seeded samples of PROMPT (on bad_prefix), and "good", one greedy answer
    on the template "t"; both run in the same steps."""
    def add(c):
        c.add_request("bad", PROMPT, bad_prefix, SamplingParams(n=3, max_tokens=10, ignore_eos=True,
                                                                temperature=1.0, seed=5), sink)
        c.add_request("good", PROMPT, "t", greedy(10), sink)
    engine._run(add)


@pytest.mark.parametrize("prefix", [None, "t"])
def test_seeded_samples_equal_single_requests_of_seed_plus_i(make_engine, prefix):
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    out = engine.generate(request(4, prefix, temperature=1.0, seed=100))[0]
    assert len(out.samples) == 4 and out.samples[0] is out
    for i, sample in enumerate(out.samples):
        alone = engine.generate(request(1, prefix, temperature=1.0, seed=100 + i))[0]
        assert sample.token_ids == alone.token_ids and sample.text == alone.text
        assert sample.completion_tokens == 10 and sample.prompt_tokens == alone.prompt_tokens
        assert sample.cached_tokens == alone.cached_tokens
    assert len({tuple(s.token_ids) for s in out.samples}) > 1  # different draws


def test_greedy_samples_and_the_prompt_computed_once(make_engine):
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    single = engine.generate(request(1, "t"))[0].token_ids
    steps = []
    backend = engine._core.backend
    execute = backend.execute
    backend.execute = lambda step: steps.append([(r.num_new_tokens, r.num_computed) for r in step.rows]) \
        or execute(step)
    out = engine.generate(request(3, "t"))[0]
    assert [s.token_ids for s in out.samples] == [single] * 3
    assert steps[0] == [(len(PROMPT), len(TEMPLATE))]  # the prompt once, after the template
    # then the three samples: each computes the prompt's last token on the shared KV, then decodes
    assert steps[1] == [(1, len(TEMPLATE) + len(PROMPT) - 1)] * 3


def test_samples_share_the_prompts_blocks(make_engine):
    long_prompt = [(7 * i + 3) % 500 + 3 for i in range(60)]
    engine = make_engine(num_blocks=256)

    def peak(reqs):
        engine.reset_kv_peak()
        engine.generate(reqs)
        return engine.kv_stats()["peak_used"]
    params = dict(max_tokens=4, ignore_eos=True)
    together = peak([GenerateRequest(prompt_token_ids=long_prompt, sampling=SamplingParams(n=4, **params))])
    apart = peak([GenerateRequest(prompt_token_ids=long_prompt, sampling=SamplingParams(**params))
                  for _ in range(4)])
    # 60 tokens: 15 blocks of 4 each when apart; shared, the samples add a copy of the tail and their own
    assert together < apart - 30, (together, apart)


@pytest.mark.parametrize("kw,error,field", [(dict(n=0), InvalidRequest, "n"), (dict(n=65), InvalidRequest, "n"),
                                            (dict(n=64, max_tokens=400), CacheExhausted, None)])
def test_bad_n_is_refused(make_engine, kw, error, field):
    engine = make_engine()
    params = dict(max_tokens=8)
    params.update(kw)
    with pytest.raises(error) as e:
        engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(**params)))
    if field:
        assert e.value.param == field


def test_abort_before_and_after_the_fork_frees_everything(make_engine):
    engine = make_engine(max_num_batched_tokens=2)  # the prompt takes several steps: abort it mid-way
    got, done, sink = collector(3)
    engine._run(lambda core: core.add_request("r", PROMPT, None, SamplingParams(n=3, max_tokens=50), sink))
    assert engine.abort("r") is True
    assert done.wait(30) and sorted(o.index for o in got if o.finished) == [0, 1, 2]
    engine.check_integrity()
    assert engine.kv_stats()["used"] == 0

    got.clear()
    done.clear()
    backend = engine._core.backend
    execute = backend.execute
    backend.execute = lambda step: time.sleep(0.01) or execute(step)  # 100 steps take a second at least
    engine._run(lambda core: core.add_request("s", PROMPT, None, SamplingParams(n=3, max_tokens=100,
                                                                                ignore_eos=True), sink))
    while not any(o.token_ids for o in got):  # forked and decoding
        engine._run(lambda core: None)
    assert engine.abort("s") is True
    assert done.wait(30)
    assert sorted(o.index for o in got if o.finished) == [0, 1, 2]
    assert all(o.request_id == "s" for o in got)
    engine.check_integrity()
    assert engine.kv_stats()["used"] == 0


def test_one_request_id_is_one_request(make_engine):
    """A sample's tracked id never collides with another request's id."""
    engine = make_engine()
    outs = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4, n=2), request_id="a"),
                            GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4), request_id="a/0"),
                            GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4), request_id="a\x01")])
    assert [o.request_id for o in outs] == ["a", "a/0", "a\x01"]
    assert outs[0].samples[1].token_ids == outs[1].token_ids


def test_samples_waiting_with_their_blocks_do_not_hold_a_request_off_forever(make_engine):
    """Two samples forked on a 9-token prompt wait holding its blocks, beside a 41-token request that
    needs 11 of the 12 blocks alone: the waiting holds are freed for it, and all finish. (Only
    running sequences were preempted: the long request preempted itself at the wall, step after
    step, or was ended as too large for the cache.)"""
    engine = make_engine(block_size=4, num_blocks=12, max_num_batched_tokens=12)
    samples = GenerateRequest(prompt_token_ids=PROMPT[:7] + [5, 6],
                              sampling=SamplingParams(max_tokens=2, n=2, ignore_eos=True))
    other = GenerateRequest(prompt_token_ids=[(5 * i + 1) % 500 + 3 for i in range(40)],
                            sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    done, left, errors = [threading.Event(), threading.Event()], [2, 1], []

    def sink(i):
        def f(out):
            if out.error is not None:
                errors.append(out.error)
            left[i] -= int(out.finished)
            if left[i] == 0:
                done[i].set()
        return f
    engine.submit_many([samples, other], [sink(0), sink(1)])
    finished = [d.wait(30) for d in done]
    if not all(finished):
        engine._run(lambda core: core.abort_all())  # the fixture's checks then run
    assert all(finished) and not errors, (finished, errors, engine.kv_stats())


def test_samples_waiting_their_turn_do_not_fill_the_request_queue(make_engine):
    """scheduler.max_queue bounds requests: the samples a request forked wait as part of it, so one
    n = 6 request does not make the next caller's request "queue full" (it counted each sample),
    while a request that does wait still counts."""
    from server_fixtures import slow_steps
    from prefix_service.errors import QueueFull

    engine = make_engine(max_num_seqs=2, max_queue=1)
    first = threading.Event()
    done = {"n": threading.Event(), "next": threading.Event()}

    def sink(name):
        def take(out):
            first.set()
            if out.finished and (name == "next" or out.index == 5):
                done[name].set()
        return take

    undo = slow_steps(engine, 0.01)
    try:
        engine.submit(request(6, max_tokens=40), sink("n"))
        assert first.wait(30)  # forked: two samples run, four wait
        assert engine.kv_stats()["waiting_requests"] == 0 < engine.kv_stats()["waiting"]
        engine.submit(request(1, max_tokens=2), sink("next"))  # the queue holds no request yet
        assert engine.kv_stats()["waiting_requests"] == 1
        with pytest.raises(QueueFull, match="1 requests wait already"):
            engine.submit(request(1, max_tokens=2), sink("third"))
    finally:
        undo()
    assert done["n"].wait(60) and done["next"].wait(60)


def test_a_finished_request_for_n_samples_frees_its_request_id(make_engine):
    engine = make_engine()
    first = engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4, n=2), request_id="x"))[0]
    assert engine._run(lambda core: dict(core._samples)) == {}
    again = engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4, n=2), request_id="x"))[0]
    assert again.token_ids == first.token_ids


def test_a_sample_that_cannot_start_ends_its_request_and_no_other(make_engine):
    """Making the samples at the fork fails (here sample 1's generator): that request ends with the
    error, each of its n samples once, and a request in the same steps answers as it does alone."""
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    alone = engine.generate(request(1, "t"))[0].token_ids
    pinned = engine.kv_stats()["used"]  # the template's blocks
    core = engine._core
    generator = core._generator

    def failing(sampling, offset=0):
        if offset == 1:
            raise RuntimeError("no generator for sample 1")
        return generator(sampling, offset)
    core._generator = failing
    got, done, sink = collector(4)
    add_bad_and_good(engine, "t", sink)
    assert done.wait(60)
    bad = [o for o in got if o.request_id == "bad"]
    assert sorted(o.index for o in bad) == [0, 1, 2] and all(o.finished for o in bad)
    assert all("no generator for sample 1" in str(o.error) and not o.token_ids for o in bad)
    good = [o for o in got if o.request_id == "good"]
    assert good[-1].finished and good[-1].error is None
    assert [t for o in good for t in o.token_ids] == alone
    engine.check_integrity()
    assert engine.kv_stats()["used"] == pinned
    assert engine.generate(request(1, "t"))[0].token_ids == alone  # the engine serves on


@pytest.mark.parametrize("where", ["block copy", "scheduler"])
def test_a_fork_that_fails_half_way_ends_every_request_and_frees_every_block(make_engine, where):
    """Handing a computed prompt's blocks to its samples fails (the backend's copy of the prompt's
    last block, or the scheduler's fork itself): the step fails, so every request in flight ends
    with the error, each sample once; every block comes back, the forked prompt's too; the engine
    serves on."""
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    alone = engine.generate(request(1, "t"))[0].token_ids
    pinned = engine.kv_stats()["used"]
    core = engine._core

    def fail(*args):
        raise RuntimeError("the fork failed")
    owner = core.backend if where == "block copy" else core.scheduler
    setattr(owner, "copy_blocks" if where == "block copy" else "fork", fail)
    got, done, sink = collector(4)
    add_bad_and_good(engine, None, sink)  # 7 prompt tokens in blocks of 4: each sample copies the last block
    assert done.wait(60)
    assert sum(o.finished for o in got) == 4
    assert sorted((o.request_id, o.index) for o in got if o.finished) == [("bad", 0), ("bad", 1), ("bad", 2),
                                                                         ("good", 0)]
    ends = {(o.request_id, o.index): o.error for o in got if o.finished}
    assert "the fork failed" in str(ends["good", 0])
    assert any("the fork failed" in str(ends["bad", i]) for i in range(3))  # its other samples end with it
    engine._run(lambda c: delattr(owner, "copy_blocks" if where == "block copy" else "fork"))
    engine.check_integrity()
    assert engine.kv_stats()["used"] == pinned and engine.kv_stats()["running"] == 0
    assert engine.generate(request(1, "t"))[0].token_ids == alone
    assert engine.generate(request(2))[0].samples[1].token_ids == engine.generate(request(1))[0].token_ids
