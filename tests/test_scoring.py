"""Label scoring (engine/scoring.py): each candidate's score is the sum of its tokens'
log-probabilities under teacher forcing (checked against log-softmaxes of the torch backend's
logits, on every backend), computed on the template's and the prompt's KV without prefilling the
prompt again per candidate, in one step; bad input is refused before anything is queued; a score
survives preemption and leaves no block behind when aborted."""
import threading

import pytest
import torch

from helpers import engine_last_logits, greedy
from server_fixtures import slow_steps
from prefix_service import GenerateRequest, InvalidRequest, TemplateNotFound, ScoreRequest
from prefix_service.engine.scoring import MAX_CANDIDATES

TEMPLATE = [(3 * i + 7) % 500 + 3 for i in range(22)]  # 5 full blocks of 4 and 2 tokens
PROMPT = [41, 77, 301, 12, 9]
CANDIDATES = [[17], [250, 3], [88, 402, 19, 7], [17, 250], [5, 5, 5, 5, 5, 5]]


def teacher_forced(oracle, base: list[int], candidate: list[int]) -> list[float]:
    return [torch.log_softmax(engine_last_logits(oracle, base + candidate[:k]), -1)[candidate[k]].item()
            for k in range(len(candidate))]


def count_steps(engine):
    """Records each step's rows: (request id, new tokens, logits)."""
    steps = []
    backend = engine._core.backend
    real = backend.execute

    def execute(step):
        steps.append([(r.request_id, r.num_new_tokens, r.num_logits) for r in step.rows])
        return real(step)
    backend.execute = execute
    return steps


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", ["template+prompt", "template", "prompt"])
def test_scores_are_teacher_forced_logprobs(make_engine, backend, case):
    oracle = make_engine(backend="torch")
    engine = make_engine(backend=backend)
    engine.add_template("t", token_ids=TEMPLATE)
    prefix = None if case == "prompt" else "t"
    prompt = [] if case == "template" else PROMPT
    base = (TEMPLATE if prefix else []) + prompt
    out = engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=prompt, prefix_name=prefix))
    assert [list(c.token_ids) for c in out.candidates] == CANDIDATES
    for cand, score in zip(CANDIDATES, out.candidates):
        want = teacher_forced(oracle, base, cand)
        assert max(abs(a - b) for a, b in zip(score.token_logprobs, want)) < 1e-4
        assert abs(score.logprob - sum(want)) < 1e-3
    assert out.prompt_tokens == len(base)
    assert out.cached_tokens == (len(TEMPLATE) if prefix else 0)


def test_no_candidate_prefills_the_prompt_again(make_engine):
    """The prompt is computed once; then every candidate in one step, each computing the prompt's
    last token (for the logits that score its first token) and its own tokens but the last."""
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    steps = count_steps(engine)
    engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    assert steps[0] == [(steps[0][0][0], len(PROMPT), 0)]  # the prompt alone, after the template: no logits
    assert len(steps) == 2
    assert sorted(steps[1]) == sorted((r, len(c), len(c)) for r, c in zip((r for r, _, _ in steps[1]), CANDIDATES))
    assert sum(n for _, n, _ in steps[1]) == sum(map(len, CANDIDATES))


def test_text_candidates_and_prompts(make_engine):
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    tok = engine.tokenizer
    labels = [" order", " refund", " shipping"]
    by_text = engine.score(ScoreRequest(labels, prompt=" the price", prefix_name="t"))
    ids = [tok.encode(s, add_special_tokens=False) for s in labels]
    by_ids = engine.score(ScoreRequest(ids, prompt_token_ids=tok.encode(" the price", add_special_tokens=False),
                                       prefix_name="t"))
    assert [c.token_ids for c in by_text.candidates] == [tuple(i) for i in ids]
    assert [c.logprob for c in by_text.candidates] == pytest.approx([c.logprob for c in by_ids.candidates], abs=1e-5)


def test_score_beside_generation_and_under_preemption(make_engine):
    """Scores are the same with generation running beside them, and in a cache so small that
    sequences are preempted and recomputed."""
    calm = make_engine(num_blocks=256)
    calm.add_template("t", token_ids=TEMPLATE)
    want = calm.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    tight = make_engine(num_blocks=28, block_size=4)
    tight.add_template("t", token_ids=TEMPLATE)
    done = threading.Event()
    finished = []

    def sink(out):
        if out.finished:
            finished.append(out)
            if len(finished) == 4:
                done.set()
    for k in range(4):  # queued first: together they need more blocks than the cache has
        tight.submit(GenerateRequest(prompt_token_ids=[5 + k] * 9, sampling=greedy(30)), sink)
    got = tight.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    assert done.wait(120)
    for a, b in zip(got.candidates, want.candidates):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    assert tight.kv_stats()["preemptions"] > 0


def test_a_preempted_candidate_is_recomputed(make_engine):
    """A candidate preempted part-way (its forked blocks freed) starts again from the template and
    computes the prompt itself: the same scores."""
    calm = make_engine()
    calm.add_template("t", token_ids=TEMPLATE)
    want = calm.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    engine = make_engine(max_num_batched_tokens=3)  # chunks of 3 tokens: candidates run part-way
    engine.add_template("t", token_ids=TEMPLATE)

    def drive(core):
        from prefix_service.engine.scheduler import SchedulerOutput
        got, victims = [], []
        core.add_score("s", PROMPT, "t", CANDIDATES, got.append)
        while not got:
            core.step()
            partial = [q for q in core.scheduler.running if q.score_from is not None and q.num_uncomputed]
            if partial and not victims:
                victims.append((partial[0].request_id, partial[0].num_computed_tokens))
                core.scheduler._preempt(partial[0], SchedulerOutput())
        return got[0], victims
    got, victims = engine._run(drive)
    assert victims and victims[0][1] >= len(TEMPLATE) + len(PROMPT) - 1  # it had started on the fork's KV
    for a, b in zip(got.candidates, want.candidates):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def test_a_released_candidate_on_a_template_with_an_empty_prompt_is_rescored(make_engine):
    """A candidate waiting its turn (max_num_seqs=1) whose forked blocks are released starts again
    on the template: with an empty prompt the template covers the fork point, but the candidate
    still computes the template's last token for the logits that score its first token."""
    calm = make_engine()
    calm.add_template("t", token_ids=TEMPLATE)
    want = calm.score(ScoreRequest(CANDIDATES, prompt_token_ids=[], prefix_name="t"))
    engine = make_engine(max_num_seqs=1)
    engine.add_template("t", token_ids=TEMPLATE)

    def drive(core):
        from prefix_service.engine.scheduler import SchedulerOutput
        got, released = [], []
        core.add_score("s", [], "t", CANDIDATES, got.append)
        while not got:
            core.step()
            if not released and any(q.forked and q.block_table for q in core.scheduler.waiting):
                released.append(core.scheduler._release_a_waiting_hold(SchedulerOutput()))
        return got[0], released
    got, released = engine._run(drive)
    assert released == [True]
    assert got.error is None, got.error
    assert [c.token_ids for c in got.candidates] == [c.token_ids for c in want.candidates]
    for a, b in zip(got.candidates, want.candidates, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def test_abort_frees_every_block(make_engine):
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    got = []
    undo = slow_steps(engine, 0.5)  # a score takes two steps at least: the abort comes before its end
    engine._run(lambda core: core.add_score("s1", PROMPT, "t", CANDIDATES, got.append))
    assert engine._run(lambda core: core.abort("s1")) is True
    undo()
    assert len(got) == 1 and got[0].error is not None and got[0].candidates == []
    engine.check_integrity()
    stats = engine.kv_stats()
    assert stats["used"] == stats["pinned"] and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("candidates,match", [
    ([], "at least one"), ([[1], []], r"candidates\[1\] is empty"), ([[1]] * (MAX_CANDIDATES + 1), "at most"),
    ([[10**6]], r"candidates\[0\]: token ids")])
def test_bad_candidates_are_refused(make_engine, candidates, match):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=match) as e:
        engine.score(ScoreRequest(candidates, prompt_token_ids=PROMPT))
    assert e.value.param == "candidates"


@pytest.mark.parametrize("bad", ["vocab_size", -1])
def test_candidate_token_ids_outside_the_vocabulary_are_refused(make_engine, bad):
    """The vocabulary's ids are [0, vocab_size): vocab_size itself and -1 are the caller's error,
    refused before anything is queued, not an engine failure."""
    engine = make_engine()
    vocab_size = engine._core.arch.vocab_size
    token = vocab_size if bad == "vocab_size" else bad
    with pytest.raises(InvalidRequest, match=rf"candidates\[1\]: token ids must be in \[0, {vocab_size}\)") as e:
        engine.score(ScoreRequest([[17], [5, token]], prompt_token_ids=PROMPT))
    assert e.value.param == "candidates"
    ok = engine.score(ScoreRequest([[17], [5, vocab_size - 1]], prompt_token_ids=PROMPT))  # the last id is valid
    assert [c.token_ids for c in ok.candidates] == [(17,), (5, vocab_size - 1)]


def test_exactly_max_candidates_are_scored(make_engine):
    """MAX_CANDIDATES one-token candidates are accepted, each scored by the prompt's last logits;
    one more is refused."""
    engine = make_engine(num_blocks=2 * MAX_CANDIDATES, max_num_seqs=MAX_CANDIDATES)
    candidates = [[t] for t in range(3, 3 + MAX_CANDIDATES)]
    out = engine.score(ScoreRequest(candidates, prompt_token_ids=PROMPT))
    assert [c.token_ids for c in out.candidates] == [tuple(c) for c in candidates]
    want = torch.log_softmax(engine_last_logits(engine, PROMPT), -1)
    assert [c.logprob for c in out.candidates] == pytest.approx([want[c[0]].item() for c in candidates], abs=1e-4)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_CANDIDATES} per request"):
        engine.score(ScoreRequest(candidates + [[3]], prompt_token_ids=PROMPT))


def test_a_score_counts_as_one_request_served_on_its_template(make_engine):
    """A Score request is one request on its template however many candidates it forks."""
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    (info,) = [t for t in engine.list_templates() if t.name == "t"]
    assert (info.requests_served, info.active_requests) == (1, 0)


def test_unknown_template_and_empty_context_are_refused(make_engine):
    engine = make_engine()
    with pytest.raises(TemplateNotFound):
        engine.score(ScoreRequest([[1]], prompt_token_ids=PROMPT, prefix_name="nope"))
    with pytest.raises(InvalidRequest, match="needs something before it"):
        engine.score(ScoreRequest([[1]], prompt_token_ids=[]))


def test_candidates_that_each_fit_are_scored_on_a_tight_cache(make_engine):
    """14 candidates of 29 tokens each need 8 of the 16 blocks: forked, each waits its turn holding
    its share of the prompt's blocks. Those holds are freed for the one that runs (only running
    sequences were preempted, so one candidate was called too large for the cache)."""
    engine = make_engine(block_size=4, num_blocks=16, max_num_batched_tokens=16)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(10)]
    candidates = [[(k * 13 + j) % 500 + 3 for j in range(20)] for k in range(14)]
    out = engine.score(ScoreRequest(candidates, prompt_token_ids=prompt))
    roomy = make_engine(block_size=4, num_blocks=256)
    expected = roomy.score(ScoreRequest(candidates, prompt_token_ids=prompt))
    assert [c.token_ids for c in out.candidates] == [c.token_ids for c in expected.candidates]
    assert [c.logprob for c in out.candidates] == pytest.approx([c.logprob for c in expected.candidates], abs=1e-4)


@pytest.mark.parametrize("where", ["block copy", "scheduler"])
def test_a_score_whose_fork_fails_half_way_ends_with_the_error_and_frees_every_block(make_engine, where):
    """Handing the computed prompt's blocks to the candidates fails (the backend's copy of its
    partial last block, or the scheduler's fork): the Score request ends with the error, every
    block comes back, the fork point's too, and the same request scores as before afterwards."""
    engine = make_engine()
    engine.add_template("t", token_ids=TEMPLATE)
    want = engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    pinned = engine.kv_stats()["used"]
    core = engine._core
    owner, name = (core.backend, "copy_blocks") if where == "block copy" else (core.scheduler, "fork")

    def fail(*args):
        raise RuntimeError("the fork failed")
    setattr(owner, name, fail)
    got = []
    done = threading.Event()
    # 22 + 5 tokens in blocks of 4: each candidate copies the fork point's partial last block
    engine._run(lambda c: c.add_score("s", PROMPT, "t", CANDIDATES, lambda out: (got.append(out), done.set())))
    assert done.wait(60)
    assert len(got) == 1 and "the fork failed" in str(got[0].error) and got[0].candidates == []
    engine._run(lambda c: delattr(owner, name))
    engine.check_integrity()
    assert engine.kv_stats()["used"] == pinned and engine.kv_stats()["running"] == 0
    again = engine.score(ScoreRequest(CANDIDATES, prompt_token_ids=PROMPT, prefix_name="t"))
    for a, b in zip(again.candidates, want.candidates, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)


def test_a_candidate_with_many_bad_token_ids_is_refused_quoting_its_first_four(make_engine):
    engine = make_engine()
    vocab_size = engine._core.arch.vocab_size
    bad = [vocab_size + k for k in range(6)]
    with pytest.raises(InvalidRequest, match=rf"candidates\[0\]: token ids must be in \[0, {vocab_size}\)") as e:
        engine.score(ScoreRequest([[17, *bad, 5]], prompt_token_ids=PROMPT))
    assert str(e.value).endswith(f"got {bad[:4]}")
