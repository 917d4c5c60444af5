"""One row of a step that fails (its sampling raises, handling its token raises, recording a Score
request's logits raises) ends its own request with the error; every other request of the step goes
on and gives the tokens (and scores) it gives alone. A request for n samples fails as a whole when
one sample fails: its other samples end at once."""
import threading

import pytest

from prefix_service import GenerateRequest, SamplingParams, ScoreRequest
from prefix_service.engine.sequence import FinishReason

PROMPTS = {"a": [41, 77, 301, 12, 9], "b": [130, 140, 8, 66], "c": [5, 17, 250, 33, 90, 12]}
PARAMS = {"a": dict(max_tokens=12, ignore_eos=True),
          "b": dict(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
          "c": dict(max_tokens=12, ignore_eos=True)}


class BrokenMatcher:
    """A grammar matcher whose every call fails (as a bug in the matcher's library would)."""

    def __getattr__(self, name):
        raise RuntimeError("matcher broke")


class BrokenDetokenizer:
    def add(self, token, check_stop=True):
        raise RuntimeError("detokenizer broke")

    def flush(self):  # the request ends with the first error all the same
        raise RuntimeError("flushing broke")


class Outputs:
    """A sink per request id that keeps its outputs; wait() until each request has finished."""

    def __init__(self, ids, n=1):
        self.got = {i: [] for i in ids}
        self.left = len(ids) * n
        self.done = threading.Event()

    def sink(self, request_id):
        def put(out):
            self.got[request_id].append(out)
            self.left -= int(getattr(out, "finished", True))  # a Score request's one output ends it
            if self.left == 0:
                self.done.set()
        return put

    def wait(self):
        assert self.done.wait(60), {k: [o.finished for o in v] for k, v in self.got.items()}

    def tokens(self, request_id):
        return [t for o in self.got[request_id] for t in o.token_ids]

    def last(self, request_id):
        return self.got[request_id][-1]


def alone(engine, request_id):
    req = GenerateRequest(prompt_token_ids=PROMPTS[request_id], sampling=SamplingParams(**PARAMS[request_id]))
    return engine.generate(req)[0].token_ids


def run_together(engine, break_c):
    """a, b and c added in one command (so they share every step), c broken by break_c(core)."""
    outs = Outputs(list(PROMPTS))

    def add(core):
        for request_id, prompt in PROMPTS.items():
            core.add_request(request_id, prompt, None, SamplingParams(**PARAMS[request_id]), outs.sink(request_id))
        break_c(core)
    engine._run(add)
    outs.wait()
    return outs


def test_a_row_whose_sampling_fails_ends_only_its_own_request(make_engine):
    engine = make_engine()
    refs = {k: alone(engine, k) for k in "ab"}
    outs = run_together(engine, lambda core: setattr(core._tracked["c"].seq, "matcher", BrokenMatcher()))
    for k in "ab":  # the greedy row and the seeded row beside it: what each gives alone
        assert outs.tokens(k) == refs[k] and outs.last(k).finish_reason is FinishReason.LENGTH
        assert outs.last(k).error is None
    c = outs.last("c")
    assert c.finished and c.finish_reason is FinishReason.ABORT and str(c.error) == "matcher broke"
    assert outs.tokens("c") == []
    assert engine.kv_stats()["used"] == 0
    assert alone(engine, "a") == refs["a"]  # and the engine serves on


def test_a_row_whose_token_handling_fails_ends_only_its_own_request(make_engine):
    engine = make_engine()
    refs = {k: alone(engine, k) for k in "ab"}
    outs = run_together(engine, lambda core: setattr(core._tracked["c"], "detok", BrokenDetokenizer()))
    for k in "ab":
        assert outs.tokens(k) == refs[k] and outs.last(k).error is None
    c = outs.last("c")
    assert c.finish_reason is FinishReason.ABORT and str(c.error) == "detokenizer broke"
    assert engine.kv_stats()["used"] == 0


@pytest.mark.parametrize("broken", [1, 0, 2])
def test_one_sample_failing_ends_its_siblings_and_the_request_raises_its_error(make_engine, broken):
    engine = make_engine()
    core = engine._core
    fork = core._fork_samples

    def fork_and_break(parent):
        fork(parent)
        core._tracked[f"r\x00{broken}"].seq.matcher = BrokenMatcher()
    engine._run(lambda core: setattr(core, "_fork_samples", fork_and_break))
    req = GenerateRequest(prompt_token_ids=PROMPTS["a"], request_id="r",
                          sampling=SamplingParams(n=3, max_tokens=150, ignore_eos=True, temperature=1.0, seed=1))
    with pytest.raises(RuntimeError, match="matcher broke"):
        engine.generate(req)
    # the failed sample's siblings ended with it: nothing of the request runs on
    assert engine._run(lambda core: (sorted(core._tracked), sorted(core._samples))) == ([], [])
    assert engine.kv_stats()["used"] == 0


class FlushFails:
    """The request's own detokenizer, except that its last flush fails."""

    def __init__(self, detok):
        self.detok = detok

    def add(self, token, check_stop=True):
        return self.detok.add(token, check_stop=check_stop)

    def flush(self):
        raise RuntimeError("flushing broke")


def test_a_request_whose_last_text_cannot_be_decoded_still_ends_with_the_error(make_engine):
    engine = make_engine()
    refs = {k: alone(engine, k) for k in "abc"}
    outs = run_together(engine, lambda core: setattr(core._tracked["c"], "detok", FlushFails(core._tracked["c"].detok)))
    for k in "ab":
        assert outs.tokens(k) == refs[k] and outs.last(k).error is None
    c = outs.last("c")
    assert c.finish_reason is FinishReason.ABORT and str(c.error) == "flushing broke"
    assert outs.tokens("c") == refs["c"]  # streamed up to its end


CANDIDATES = [[17], [250, 3], [88, 402, 19, 7]]
SCORE_PROMPTS = {"s1": [9, 12, 301, 77], "s2": [66, 8, 140]}


def fails(message):
    def broken(*args, **kwargs):
        raise RuntimeError(message)
    return broken


def output_fails(scoring):
    """scoring.output, except that its scores cannot be put together (an output with an error still can)."""
    real = scoring.output

    def output(error=None):
        if error is None:
            raise RuntimeError("putting scores together broke")
        return real(error)
    return output


@pytest.mark.parametrize("broken", ["record", "output"])
def test_a_score_request_that_fails_ends_alone(make_engine, broken):
    """Two Score requests and two generations share every step; one Score request's rows cannot be
    recorded (or its scores put together): it ends with that error, the other scores what it scores
    alone, the generations give their tokens, and no block is left held."""
    engine = make_engine()
    refs = {k: alone(engine, k) for k in "ab"}
    want = engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=SCORE_PROMPTS["s2"]))
    outs = Outputs(["a", "b", "s1", "s2"])

    def add(core):
        for request_id in "ab":
            core.add_request(request_id, PROMPTS[request_id], None, SamplingParams(**PARAMS[request_id]),
                             outs.sink(request_id))
        for request_id, prompt in SCORE_PROMPTS.items():
            core.add_score(request_id, prompt, None, CANDIDATES, outs.sink(request_id))
        scoring = core._scorings["s1"]
        if broken == "record":
            scoring.record = fails("recording scores broke")
        else:
            scoring.output = output_fails(scoring)
    engine._run(add)
    outs.wait()
    for k in "ab":
        assert outs.tokens(k) == refs[k] and outs.last(k).error is None
    (s1,), (s2,) = outs.got["s1"], outs.got["s2"]
    assert s1.candidates == [] and "broke" in str(s1.error)
    assert s2.error is None
    for a, b in zip(s2.candidates, want.candidates):
        assert a.token_ids == b.token_ids and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert engine._run(lambda core: (dict(core._scorings), dict(core._scoring_of), dict(core._tracked))) == ({}, {}, {})
    assert engine.kv_stats()["used"] == 0
    assert engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=SCORE_PROMPTS["s2"])).candidates == want.candidates
