"""Jump-forward decoding (scheduler.jump_forward): where a structured output allows one token only,
position after position, those tokens are taken without a step each: they go out with the token
sampled before them, and the next step computes their K/V as decode rows at consecutive
positions, or none is computed when they complete the output. The tokens, the text and the finish
are those of decoding them one step each, on every backend, with a stop string, a stop token,
max_tokens or a step budget inside the forced run, for n samples and for seeded draws; a request
that asks for logprobs gets the forced tokens with theirs, from the step that computes them, and
nothing is lost when it ends before; a token the constraint proposes that its mask does not allow
alone is not taken."""
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import counting, streamed
from prefix_service import FinishReason, GenerateRequest, SamplingParams
from prefix_service.config import SchedulerConfig
from prefix_service.errors import ConfigError
from prefix_service.engine import structured
from prefix_service.sampling_params import StructuredOutput

PROMPT = [41, 77, 301, 12, 9, 130]
TEMPLATE = [(5 * i + 11) % 480 + 20 for i in range(21)]
CHOICES = ("order status please", "refund of the shipping value", "shipping value")
SCHEMA = {"type": "object", "properties": {"intent": {"enum": ["order", "refund"]}, "urgent": {"type": "boolean"},
                                           "note": {"type": "string", "maxLength": 12}},
          "required": ["intent", "urgent", "note"], "additionalProperties": False}
CONSTRAINTS = {"choice": StructuredOutput("choice", choices=CHOICES),
               "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA))}


def request(structured_output, prefix=None, **kw):
    params = dict(max_tokens=60, structured=structured_output)
    params.update(kw)
    return GenerateRequest(prompt_token_ids=PROMPT, prefix_name=prefix, sampling=SamplingParams(**params))


def forced_runs(steps):
    """Per step, each request's decode rows when it has more than one: [(first position, rows)]."""
    runs = []
    for step in steps:
        positions: dict[str, list[int]] = {}
        for request_id, n, computed, decode in step:
            if decode:
                assert n == 1
                positions.setdefault(request_id, []).append(computed)
        runs += [(p[0], len(p)) for p in positions.values() if len(p) > 1 and p == list(range(p[0], p[0] + len(p)))]
    return runs


def written(results):
    """Each result as the tests compare them: (text, token ids, finish reason, logprobs as (token id,
    logprob, alternatives), and with n > 1 each sample so)."""
    def one(r):
        return r.text, r.token_ids, r.finish_reason, [(lp.token_id, lp.logprob, lp.top) for lp in r.logprobs or ()]
    return [(*one(o), [one(s) for s in o.samples or ()]) for o in results]


def run(make_engine, requests, jump_forward, **engine_kw):
    """-> (the outputs, written(), the steps) of one engine."""
    engine = make_engine(jump_forward=jump_forward, **engine_kw)
    engine.add_template("t", token_ids=TEMPLATE)
    steps = counting(engine)
    return written(engine.generate(requests)), steps


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_the_forced_tokens_take_no_step_and_change_nothing(make_engine, backend):
    requests = [request(spec, prefix) for spec in CONSTRAINTS.values() for prefix in (None, "t")]
    off, off_steps = run(make_engine, requests, False, backend=backend)
    on, on_steps = run(make_engine, requests, True, backend=backend)
    assert on == off
    assert all(reason is FinishReason.STOP for _, _, reason, *_ in on)
    assert json.loads(on[2][0])["intent"] in ("order", "refund")
    # the choices' tails and the record's keys are forced: far fewer steps, some with a forced run
    # as decode rows of one request at consecutive positions, and no step with a prefill after the prompts
    assert len(on_steps) < len(off_steps) - 5
    assert forced_runs(on_steps) and not forced_runs(off_steps)
    assert all(decode or computed <= len(TEMPLATE) for s in on_steps for _, _, computed, decode in s)


def test_a_choice_whose_tail_is_forced_ends_at_its_first_token(make_engine):
    """The whole answer is known once its first token is: no step after the prompt's."""
    spec = StructuredOutput("choice", choices=("refund of the shipping value", "order status please"))
    (out,), steps = run(make_engine, [request(spec, "t")], True)
    assert out[0] in spec.choices and len(out[1]) > 3 and out[2] is FinishReason.STOP
    assert [[row[1:] for row in step] for step in steps] == [[(len(PROMPT), len(TEMPLATE), False)]]


def test_a_forced_run_is_streamed_with_the_token_before_it(make_engine):
    engine = make_engine(jump_forward=True)
    got = streamed(engine, request(CONSTRAINTS["json_schema"]))
    alone = engine.generate(request(CONSTRAINTS["json_schema"]))[0]
    assert "".join(o.text for o in got) == alone.text
    assert [t for o in got for t in o.token_ids] == alone.token_ids
    assert max(len(o.token_ids) for o in got) > 2  # a forced run came with the token sampled before it


@pytest.mark.parametrize("limit", [
    dict(stop=("shipping",)),  # a stop string inside the forced tail
    dict(max_tokens=3),  # the length inside the forced tail
])
def test_a_stop_inside_the_forced_run_ends_it_where_a_step_each_would(make_engine, limit):
    spec = StructuredOutput("choice", choices=("refund of the shipping value",))
    off, _ = run(make_engine, [request(spec, "t", **limit)], False)
    on, steps = run(make_engine, [request(spec, "t", **limit)], True)
    assert on == off
    assert len(steps) == 1
    if "stop" in limit:
        assert on[0][0] == "refund of the " and on[0][2] is FinishReason.STOP
    else:
        assert len(on[0][1]) == 3 and on[0][2] is FinishReason.LENGTH


@pytest.mark.parametrize("min_tokens", [0, 6])
def test_a_forced_token_that_is_a_stop_token(make_engine, tokenizer_dir, min_tokens):
    """It stops the output as a sampled one would, or, before min_tokens, is taken as text (the
    constraint wins over min_tokens)."""
    from transformers import AutoTokenizer
    spec = StructuredOutput("choice", choices=("refund of the shipping value",))
    tail = AutoTokenizer.from_pretrained(tokenizer_dir).encode("refund of the shipping value", add_special_tokens=False)
    req = request(spec, "t", stop_token_ids=(tail[2],), min_tokens=min_tokens)
    off, _ = run(make_engine, [req], False)
    on, steps = run(make_engine, [req], True)
    assert on == off and len(steps) == 1
    assert len(on[0][1]) == (3 if min_tokens == 0 else len(tail))


@pytest.mark.parametrize("logprobs", [None, 3])
def test_a_step_budget_smaller_than_the_forced_run(make_engine, logprobs):
    """Cut by the budget, a run is computed over several steps (a held one gives its logprobs as
    they come)."""
    requests = [request(CONSTRAINTS["json_schema"], "t", logprobs=logprobs),
                request(CONSTRAINTS["json_schema"], logprobs=logprobs)]
    off, _ = run(make_engine, requests, False, max_num_batched_tokens=3)
    on, steps = run(make_engine, requests, True, max_num_batched_tokens=3)
    assert on == off
    assert max(sum(n for _, n, _, _ in s) for s in steps) <= 3
    runs = forced_runs(steps)
    assert any((first + 3, n) in runs for first, _ in runs for n in (2, 3))  # a forced run cut at the budget


def test_a_held_run_goes_with_the_end_of_a_request_that_fails_before_its_logprobs(make_engine):
    """A request whose steps fail (the one after its first token, and then its step alone: the
    fault is its own) ends with the error: a forced run still waiting for its logprobs goes out with
    the end, so the caller has every token its usage counts."""
    engine = make_engine(jump_forward=True)
    engine.add_template("t", token_ids=TEMPLATE)
    backend = engine._core.backend
    execute, calls = backend.execute, []

    def failing(step):
        calls.append(step)
        if len(calls) >= 2:
            raise RuntimeError("every step from the second fails")
        return execute(step)
    backend.execute = failing
    got = streamed(engine, request(StructuredOutput("choice", choices=("refund of the shipping value",)), "t",
                                   logprobs=1))
    end = got[-1]
    assert end.finished and end.error is not None and len(got) == 2
    assert got[0].token_ids and len(end.token_ids) > 3  # the first token went; the held tail with the end
    assert "".join(o.text for o in got) == "refund of the shipping value"
    assert sum(len(o.token_ids) for o in got) == end.completion_tokens


def test_preempted_in_a_forced_run_it_computes_it_again_and_changes_nothing(make_engine):
    """A cache too small for every request at once: sequences with forced tokens not yet computed
    are preempted, and computed again from the prompt on when they are back."""
    requests = [request(CONSTRAINTS["json_schema"], "t", temperature=0.9, seed=k) for k in range(8)]
    off, _ = run(make_engine, requests, False, num_blocks=40, prefix_budget_blocks=8)
    engine = make_engine(jump_forward=True, num_blocks=40, prefix_budget_blocks=8)
    engine.add_template("t", token_ids=TEMPLATE)
    sched = engine._core.scheduler
    preempt, in_a_run = sched._preempt, []

    def preempting(seq, out):
        in_a_run.append(seq.num_uncomputed > 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        preempt(seq, out)
    sched._preempt = preempting
    on = written(engine.generate(requests))
    assert on == off
    assert any(in_a_run)  # some were preempted with forced tokens waiting for their K/V


def test_n_samples_and_seeded_draws_are_those_of_a_step_each(make_engine):
    requests = [request(CONSTRAINTS["json_schema"], "t", n=3, temperature=1.0, seed=11),
                request(CONSTRAINTS["choice"], None, temperature=0.8, seed=5)]
    off, _ = run(make_engine, requests, False)
    on, _ = run(make_engine, requests, True)
    assert on == off
    assert len({tuple(ids) for _, ids, *_ in on[0][4]}) > 1  # the samples drew apart


@pytest.mark.parametrize("spec", ["json_schema", "choice"])
def test_a_request_for_logprobs_gets_each_forced_tokens_logprob_from_one_step(make_engine, spec, monkeypatch):
    """The forced run goes out once the step that computes it has given its tokens' logprobs: the
    same logprobs as a step each, in fewer steps; a run that completes the output ends then."""
    req = request(CONSTRAINTS[spec], "t", logprobs=2)
    (off,), off_steps = run(make_engine, [req], False)
    engine = make_engine(jump_forward=True)
    engine.add_template("t", token_ids=TEMPLATE)
    steps = counting(engine)
    got = streamed(engine, req)
    steps.clear()
    on = engine.generate(req)[0]
    on_steps = len(steps)
    assert written([on]) == [off]  # the tokens and the logprobs of a step each
    assert [lp.token_id for lp in on.logprobs] == on.token_ids
    assert forced_runs(steps) and on_steps < len(off_steps)
    # streamed: each output's logprobs with its tokens; a forced run comes after the token before it
    assert all(len(o.logprobs) == len(o.token_ids) for o in got if o.token_ids)
    assert [t for o in got for t in o.token_ids] == on.token_ids
    # each token's logprob read once: a forced token's from its run's rows, a drawn one's in sampling
    from prefix_service.engine import core
    counted = {"held": 0, "drawn": 0}
    for name, key in (("token_logprobs", "held"), ("sample", "drawn")):
        def wrap(*a, _real=getattr(core, name), _key=key, **kw):
            counted[_key] += len(a[1])  # (logits, tokens or sequences, ...)
            return _real(*a, **kw)
        monkeypatch.setattr(core, name, wrap)
    again = engine.generate(req)[0]
    assert again.token_ids == on.token_ids and counted["held"] + counted["drawn"] == len(on.token_ids)
    assert counted["held"] > 0
    if spec == "choice":  # the prompt's step, then the one that gives the tail's logprobs
        assert on_steps == 2 and len(off_steps) > 2 and [len(o.token_ids) for o in got if o.token_ids][0] == 1


def test_a_proposed_token_the_mask_does_not_allow_alone_is_not_taken(make_engine, monkeypatch):
    """llguidance's fast-forward tokens are checked against the mask: a proposal it does not force
    (here: every proposal moved to the next token id) leaves each token to its step."""
    req = request(CONSTRAINTS["json_schema"], "t")
    off, off_steps = run(make_engine, [req], False)
    proposed = []

    def only_token(matcher, vocab_size):
        token = real(matcher, vocab_size)
        proposed.append(token)
        return None if token is None else token + 1  # never the one proposed
    real = structured.only_token
    monkeypatch.setattr("prefix_service.engine.core.only_token", only_token)
    on, on_steps = run(make_engine, [req], True)
    assert on == off and len(on_steps) == len(off_steps)
    assert any(t is not None for t in proposed)  # there were proposals to turn down


def test_only_token_reads_the_one_allowed_token_off_the_mask(tokenizer_dir):
    from transformers import AutoTokenizer
    outputs = structured.StructuredOutputs(AutoTokenizer.from_pretrained(tokenizer_dir))
    choice = StructuredOutput("choice", choices=("refund of the shipping value", "order"))
    matcher = structured.start(outputs.compile(choice))
    vocab = len(outputs._hf)
    assert structured.only_token(matcher, vocab) is None  # two choices: more than one first token
    first = outputs._hf.encode("refund of the shipping value", add_special_tokens=False)
    matcher.consume_token(first[0])
    forced = matcher.compute_ff_tokens()
    assert forced and structured.only_token(matcher, vocab) == forced[0]
    for token in forced:
        assert structured.only_token(matcher, vocab) == token
        matcher.consume_token(token)
    assert matcher.is_stopped()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_jump_forward_must_be_a_boolean(value):
    with pytest.raises(ConfigError, match="scheduler.jump_forward: expected true or false"):
        SchedulerConfig(jump_forward=value)


WORDS = ("order", "refund", "ship", "the value", "a_b", "status please", "x")


@st.composite
def constrained_requests(draw):
    """A request on the template or not, under a choice, a regex or a JSON schema of random words,
    with random limits and sampling; some ask for logprobs or n samples."""
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True))
    kind = draw(st.sampled_from(["choice", "regex", "json_schema"]))
    if kind == "choice":
        tails = draw(st.lists(st.sampled_from(WORDS), min_size=len(words), max_size=len(words)))
        spec = StructuredOutput("choice", choices=tuple(dict.fromkeys(f"{w} {t}" for w, t in zip(words, tails))))
    elif kind == "regex":
        spec = StructuredOutput("regex", f"({'|'.join(map(re.escape, words))}) [0-9]{{1,3}} (yes|no)")
    else:
        schema = {"type": "object", "properties": {"pick": {"enum": words}, "n": {"type": "integer"}},
                  "required": ["pick", "n"], "additionalProperties": False}
        spec = StructuredOutput("json_schema", json.dumps(schema))
    sampled = draw(st.booleans())
    max_tokens = draw(st.integers(1, 30))
    params = dict(max_tokens=max_tokens, structured=spec,
                  temperature=0.9 if sampled else 0.0, seed=draw(st.integers(0, 50)) if sampled else None,
                  stop=tuple(draw(st.lists(st.sampled_from(["val", "s ", "1"]), max_size=1))),
                  min_tokens=draw(st.integers(0, min(3, max_tokens))), n=draw(st.sampled_from([1, 1, 2])),
                  logprobs=draw(st.sampled_from([None, None, 2])))
    return GenerateRequest(prompt_token_ids=PROMPT[:draw(st.integers(1, len(PROMPT)))],
                           prefix_name=draw(st.sampled_from([None, "t"])), sampling=SamplingParams(**params))


def test_random_constrained_batches_are_the_same_with_and_without_jump_forward(make_engine):
    """Batches of random constrained requests (random words, limits, stops, draws, samples and
    logprobs) give the same texts, tokens, finishes and logprobs with jump-forward as a step each."""
    engines = {}
    for on in (True, False):
        engines[on] = make_engine(jump_forward=on, max_num_batched_tokens=24)
        engines[on].add_template("t", token_ids=TEMPLATE)
    steps = counting(engines[True])

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(constrained_requests(), min_size=1, max_size=4))
    def check(batch):
        assert written(engines[True].generate(batch)) == written(engines[False].generate(batch))
    check()
    assert forced_runs(steps)  # the batches had forced runs to take
