"""Speculative decoding by prompt lookup (scheduler.speculative_tokens): a decoding sequence's draft
(the tokens that followed the latest earlier occurrence of its last few tokens) runs as decode rows
after its last token, and the engine draws from each row in turn while the draft holds. The tokens,
texts, logprobs and finishes are those of decoding a step each, greedy or seeded, with penalties, a
stop inside a draft, n samples and a template; fewer steps where drafts are kept; a draft never
preempts another sequence and never runs past max_tokens, the context or the step's budget."""
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import counting, streamed
from prefix_service import FinishReason, GenerateRequest, SamplingParams
from prefix_service.config import SchedulerConfig
from prefix_service.engine import structured
from prefix_service.engine.block_allocator import BlockAllocator
from prefix_service.engine.scheduler import Scheduler
from prefix_service.engine.sequence import Sequence
from prefix_service.engine.speculation import propose
from prefix_service.engine.template_pins import TemplatePins
from prefix_service.errors import ConfigError, InvalidRequest
from prefix_service.sampling_params import StructuredOutput

# a prompt that repeats itself, and a bias towards five of its tokens: the random model then writes
# loops and repeats of a small alphabet, which drafts foresee in part (as a model quoting its context)
BASE = [41, 77, 301, 12, 9, 130, 55, 402, 17]
PROMPT = BASE * 3 + BASE[:4]
TEMPLATE = [(5 * i + 11) % 480 + 20 for i in range(21)]
LOOP_BIAS = tuple((token, 5.0) for token in BASE[:5])


def holding_no_block_past_their_tokens(engine):
    """After each step, every running sequence holds the blocks its tokens fill and no more (a
    rejected draft's are freed)."""
    core = engine._core
    step = core.step

    def checked():
        step()
        block = core.block_size
        assert all(len(s.block_table) <= -(-len(s.token_ids) // block) for s in core.scheduler.running)
    core.step = checked


def written(results, exact=True):
    """Each result as the tests compare them; exact=False: log-probabilities to 1e-4 (where a row's
    arithmetic depends on the rows beside it: torch's float32 products)."""
    def value(x):
        return x if exact else pytest.approx(x, abs=1e-4)

    def one(r):
        return (r.text, r.token_ids, r.finish_reason, r.completion_tokens,
                [(lp.token_id, value(lp.logprob), tuple((t, value(v)) for t, v in lp.top)) for lp in r.logprobs or ()])
    return [(*one(o), [one(s) for s in o.samples or ()]) for o in results]


def run(make_engine, requests, speculative_tokens, exact=True, **kw):
    """-> (written outputs, steps, kv_stats) of one engine with the template "t" pinned."""
    kw.setdefault("speculative_max_running", 64)
    kw.setdefault("speculative_row_cost", 0.0)  # every draft worth its rows: as long as its lookup and earnings allow
    engine = make_engine(speculative_tokens=speculative_tokens, **kw)
    engine.add_template("t", token_ids=TEMPLATE)
    steps = counting(engine)
    holding_no_block_past_their_tokens(engine)
    out = written(engine.generate(requests), exact)
    return out, steps, engine.kv_stats()


def req(prefix=None, prompt=PROMPT, **params):
    params.setdefault("max_tokens", 40)
    params.setdefault("ignore_eos", True)
    params.setdefault("logit_bias", LOOP_BIAS)
    return GenerateRequest(prompt_token_ids=prompt, prefix_name=prefix, sampling=SamplingParams(**params))


KINDS = {
    "greedy": dict(),
    "seeded": dict(temperature=0.9, seed=7),
    "top_p": dict(temperature=1.3, top_p=0.8, top_k=50, seed=11),
    "penalties": dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3),
    "logprobs": dict(logprobs=2),
    "min_tokens": dict(ignore_eos=False, min_tokens=20, stop_token_ids=(77, 130)),
    "n": dict(n=3, temperature=0.8, seed=3),
}


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_drafts_change_no_token(make_engine, backend):
    # the cpu backend's rows are their own to the bit in float32: every kind, logprobs exact; torch's
    # products move a row's logits by a rounding with the rows beside it (as any batch does), which
    # can move a random draw to the next token: its greedy kinds, logprobs to 1e-4
    exact = backend == "auto"
    kinds = KINDS if exact else [k for k in KINDS if "temperature" not in KINDS[k]]
    requests = [req(prefix, **KINDS[kind]) for kind in kinds for prefix in (None, "t")]
    # blocks for every request at once: a preempted sequence's prompt computed again (as a prefill) moves
    # its logits by a rounding, in either engine
    off, off_steps, off_stats = run(make_engine, requests, 0, backend=backend, num_blocks=512)
    on, on_steps, on_stats = run(make_engine, requests, 5, exact, backend=backend, num_blocks=512)
    assert off_stats["preemptions"] == on_stats["preemptions"] == 0
    assert on == off
    assert off_stats["draft_tokens"] == 0
    assert 0 < on_stats["accepted_draft_tokens"] <= on_stats["draft_tokens"]
    # the requests whose drafts were kept take fewer steps (the batch as many: others draw at random)
    assert sum(map(len, map(requests_in, on_steps))) < sum(map(len, map(requests_in, off_steps))) - 10
    # a drafted step: a sequence's decode rows at consecutive positions
    assert any(n > 1 for n in rows_per_decode(on_steps)) and all(n == 1 for n in rows_per_decode(off_steps))


# constraints the biased model fills with its loops: a run of the loop's characters, a literal the
# constraint forces, more of them; a record whose first field's length closes it and forces the next key
STRUCTURED = {
    "regex": StructuredOutput("regex", "[Gkca*' ]{12}0123456789[Gkca*' ]{0,60}"),
    "json_schema": StructuredOutput("json_schema", json.dumps({
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 14}, "b": {"type": "string"}},
        "required": ["a", "b"], "additionalProperties": False})),
}


@pytest.mark.parametrize("kind", ["greedy", "seeded", "logprobs", "penalties", "min_tokens", "n"])
def test_drafts_under_a_structured_output_change_no_token(make_engine, kind):
    """A structured output's draft stops where its constraint refuses a token; each row is masked as
    the matcher stands after the tokens before it; the tokens the constraint forces after a drafted
    run are taken with it (jump-forward), their logprobs from the next step: the outputs are those of
    a step each."""
    requests = [req(prefix, structured=spec, max_tokens=50, **KINDS[kind])
                for spec in STRUCTURED.values() for prefix in (None, "t")]
    off, _, _ = run(make_engine, requests, 0, num_blocks=512)
    on, _, stats = run(make_engine, requests, 8, num_blocks=512)
    assert on == off
    assert 0 < stats["accepted_draft_tokens"] <= stats["draft_tokens"]
    texts = [text for text, *_, samples in on for text in [text] + [sample[0] for sample in samples]]
    regex, record = texts[:len(texts) // 2], texts[len(texts) // 2:]
    assert all(re.fullmatch(r"[Gkca*' ]{12}0123456789[Gkca*' ]*", text) for text in regex), regex
    assert all(re.match(r'\{"a":"[^"]*","b":"', text) for text in record), record


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_drafted_run_takes_the_tokens_its_constraint_forces_after_it(make_engine, logprobs):
    """The tokens a constraint forces after a drafted run come with it, as after a token of a step
    alone: no output ends where its constraint forces the next token, or, with logprobs, the next
    output is that forced run, once the next step has given their logprobs."""
    engine = make_engine(speculative_tokens=8, speculative_max_running=64, speculative_row_cost=0.0)
    vocab = engine._core.arch.vocab_size
    for spec in STRUCTURED.values():
        outputs = streamed(engine, req(structured=spec, max_tokens=50, logprobs=logprobs))
        matcher = structured.start(engine._core.structured.compile(spec))
        held = False  # the last output ended where the constraint forces the next token
        for out in outputs[:-1]:
            assert logprobs is None or len(out.logprobs) == len(out.token_ids)
            for token in out.token_ids:
                assert not held or structured.only_token(matcher, vocab) == token  # a held run: each forced
                matcher.consume_token(token)
            held = structured.only_token(matcher, vocab) is not None
            assert not held or logprobs is not None
        assert any(len(out.token_ids) > 1 for out in outputs)
    assert engine.kv_stats()["accepted_draft_tokens"] > 0


def test_a_structured_outputs_draft_stops_before_a_token_its_constraint_refuses(make_engine):
    """The draft is the lookup's tokens as far as the sequence's matcher takes them in turn (it is
    left as it stands): a token the mask would refuse could not be drawn at its row."""
    from prefix_service.engine.speculation import Drafter
    engine = make_engine()
    # 41 12 77: "G" "*" "k", which the constraint allows; 9: "'", which it refuses
    prompt, output = [41, 77, 12, 41, 9, 5, 6], [41, 77]
    seq = Sequence("s", prompt, SamplingParams(max_tokens=50), 512, None, None)
    seq.token_ids += output
    drafter = Drafter(SchedulerConfig(speculative_tokens=8, speculative_row_cost=0.0), 512)
    assert drafter(seq, 8) == (12, 41, 9, 5, 6, 41, 77)  # what followed the earlier "G" "k"
    seq.matcher = structured.start(engine._core.structured.compile(StructuredOutput("regex", "[Gk*]{0,5}")))
    seq.matcher.consume_tokens(output)
    assert drafter(seq, 8) == (12, 41)
    assert drafter(seq, 8) == (12, 41)  # the matcher consumed none of them (it takes 3 more characters)


def requests_in(step):
    return {request_id.split("\0")[0] for request_id, *_ in step}


def rows_per_decode(steps):
    counts = []
    for step in steps:
        per: dict[str, int] = {}
        for request_id, _, _, decode in step:
            if decode:
                per[request_id] = per.get(request_id, 0) + 1
        counts += per.values()
    return counts


@pytest.mark.parametrize("limit", [dict(max_tokens=7), dict(stop=("x",)), dict(max_tokens=23)])
def test_an_end_inside_a_draft_is_where_a_step_each_ends(make_engine, tokenizer_text_of_loop, limit):
    """max_tokens and a stop string that fall inside a kept draft end the output at the same token."""
    stop = limit.get("stop")
    if stop:
        limit = dict(stop=(tokenizer_text_of_loop,))
    requests = [req(prefix, **limit) for prefix in (None, "t")]
    off, _, _ = run(make_engine, requests, 0)
    on, _, stats = run(make_engine, requests, 6)
    assert on == off
    assert stats["accepted_draft_tokens"] > 0


@pytest.fixture
def tokenizer_text_of_loop(make_engine):
    """A piece of the text PROMPT's greedy output writes first in its last third (a stop string
    that falls after drafts were kept)."""
    text = make_engine().generate(req())[0].text
    for start in range(2 * len(text) // 3, len(text)):
        for end in range(start + 1, min(start + 6, len(text)) + 1):
            if text.find(text[start:end]) == start:
                return text[start:end]
    raise AssertionError(f"no piece of {text!r} first written in its last third")


def test_no_draft_above_max_running_or_when_off(make_engine):
    requests = [req(prefix) for prefix in (None, "t", None)]
    _, steps, stats = run(make_engine, requests, 4, speculative_max_running=2)
    # three requests run at once: none drafts until one ends (they end together: never)
    assert stats["draft_tokens"] == 0 and all(n == 1 for n in rows_per_decode(steps))
    _, steps, stats = run(make_engine, requests[:2], 4, speculative_max_running=2)
    assert stats["draft_tokens"] > 0


def test_a_steps_drafts_share_speculative_step_tokens(make_engine):
    """Each running sequence drafts at most its share of speculative_step_tokens."""
    requests = [req(prefix) for prefix in (None, "t", None, "t")]
    off, _, _ = run(make_engine, requests, 0)
    on, steps, stats = run(make_engine, requests, 8, speculative_step_tokens=8)
    assert on == off and stats["accepted_draft_tokens"] > 0
    # while all four run each drafts at most 2 (once fewer run, more); with the default share, more
    assert all(n <= 1 + 8 // len(requests_in(step)) for step in steps for n in rows_per_decode([step]))
    _, roomy, _ = run(make_engine, requests, 8)
    assert max(n for step in roomy if len(requests_in(step)) == 4 for n in rows_per_decode([step])) > 3


def scheduler(num_blocks, draft):
    alloc = BlockAllocator(num_blocks)
    pins = TemplatePins(alloc, 4, budget_blocks=4)
    return alloc, Scheduler(SchedulerConfig(speculative_tokens=8), alloc, pins, 4, draft)


def decoding(sched, *prompts):
    """Sequences of these prompts, their prompts computed and a token sampled for each (7 of them)."""
    seqs = [Sequence(f"s{i}", list(p), SamplingParams(max_tokens=50), 50, None, None) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    sched.postprocess(out, seqs, [7] * len(seqs))
    return seqs


def test_a_draft_takes_no_block_a_running_sequence_may_need():
    """A draft's blocks come from those left after one for each running sequence: a block the next
    decode of another sequence needs is never taken (which would preempt it)."""
    # a: 7 prompt tokens (2 blocks, its next token in them); b: 8 (2 blocks, its next token needs a 3rd)
    alloc, sched = scheduler(6, lambda seq, limit, running: tuple(range(100, 100 + min(limit, 8))))
    a, b = decoding(sched, range(7), range(8))
    assert alloc.num_free == 2
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens, s.draft) for s in out.scheduled] == [("s0", 1, ()), ("s1", 1, ())]
    assert not out.preempted and len(b.block_table) == 3


def test_a_drafts_rows_and_what_its_kept_tokens_leave():
    """The draft runs as decode rows after the last token, every one with logits; after the step only
    the last token counts as computed until a drawn token matches the draft at its place; the blocks
    past the kept tokens are freed."""
    alloc, sched = scheduler(16, lambda seq, limit, running: (100, 101, 102, 103, 104, 105))
    (a,) = decoding(sched, range(7))  # tokens 0..6 computed, 7 sampled
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft == (100, 101, 102, 103, 104, 105) and s.num_new_tokens == 7 and s.num_logits == 7
    rows = out.step.rows
    assert [r.token_ids for r in rows] == [(7,), (100,), (101,), (102,), (103,), (104,), (105,)]
    assert [r.num_computed for r in rows] == list(range(7, 14)) and all(r.num_logits == 1 for r in rows)
    assert len(a.block_table) == 4  # positions 0..13
    sched.postprocess(out, [], [])
    assert a.num_computed_tokens == 8 and a.num_uncomputed == 0
    sched.take_drafted(a, 100, computed=True)
    sched.take_drafted(a, 101, computed=True)
    sched.take_drafted(a, 55, computed=False)  # not the draft's 102: the next step computes it
    assert a.token_ids[-3:] == [100, 101, 55] and a.num_computed_tokens == 10 and a.num_uncomputed == 1
    sched.trim_blocks(a)
    assert len(a.block_table) == 3 and alloc.num_free == 13  # 11 tokens: 3 blocks
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 7 and out.step.rows[0].token_ids == (55,)


@pytest.mark.parametrize("max_tokens, context", [(12, None), (None, 15)])
def test_a_draft_never_runs_past_max_tokens_or_the_context(make_engine, max_tokens, context):
    """A draft's rows stop before the last token max_tokens or the context allow (a token no step
    computes): nothing is computed that the output cannot hold."""
    length = max_tokens or context
    kw = dict(max_model_len=len(PROMPT) + context) if context else {}
    (out,), steps, stats = run(make_engine, [req(None, max_tokens=max_tokens)], 8, **kw)
    assert out[2] is FinishReason.LENGTH and len(out[1]) == length
    assert max(computed + n for step in steps for _, n, computed, _ in step) == len(PROMPT) + length - 1
    assert stats["accepted_draft_tokens"] > 0


def test_drafts_count_in_the_step_budget_and_leave_every_decode_its_row(make_engine):
    requests = [req(None), req("t"), req(None, temperature=1.0, seed=5)]
    off, off_steps, _ = run(make_engine, requests, 0, max_num_batched_tokens=6)
    on, steps, stats = run(make_engine, requests, 8, max_num_batched_tokens=6)
    assert on == off
    assert all(sum(n for _, n, _, _ in step) <= 6 for step in steps)
    assert stats["accepted_draft_tokens"] > 0
    decoding = [step for step in steps if all(decode for *_, decode in step)]
    assert any(sum(n for _, n, _, _ in step) == 6 for step in decoding)  # drafts filled a step
    # no decode waits for another's draft: each request is in every step from its first to its last
    spans = {}
    for i, step in enumerate(steps):
        for request_id in requests_in(step):
            spans[request_id] = (spans.get(request_id, (i, i))[0], i)
    assert all(request_id in requests_in(steps[i]) for request_id, (a, b) in spans.items() for i in range(a, b + 1))


def test_propose_takes_the_longest_match_latest_first():
    ids = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    # the last 2 tokens (2, 3) occur at 1 and 5: the latest with the tokens asked for after it
    assert propose(ids, 3, max_ngram=2, min_ngram=2) == [7, 8, 5]
    assert propose(ids, 5, max_ngram=2, min_ngram=2) == [7, 8, 5, 2, 3]  # as many as follow it
    assert propose(ids, 6, max_ngram=2, min_ngram=2) == [9, 1, 2, 3, 7, 8]  # only the earliest has 6
    # with 3-grams: (5, 2, 3) never occurred before; falls back to 2
    assert propose(ids, 2, max_ngram=3, min_ngram=2) == [7, 8]
    ids3 = np.array([5, 2, 3, 4, 1, 2, 3, 6, 5, 2, 3], dtype=np.int64)
    assert propose(ids3, 2, max_ngram=3, min_ngram=2) == [4, 1]  # the 3-gram (5, 2, 3) wins over (2, 3)
    assert propose(ids3, 2, max_ngram=3, min_ngram=3) == [4, 1]
    assert propose(np.array([4, 5, 6], dtype=np.int64), 3, max_ngram=2, min_ngram=1) == []
    # a run of one token: its first occurrence has the most after it
    assert propose(np.array([8, 4, 4, 4, 4], dtype=np.int64), 3, max_ngram=2, min_ngram=1) == [4, 4]
    assert propose(ids, 0, max_ngram=2, min_ngram=2) == []


def lookup(ids: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """propose's contract written plainly: for n from max_ngram down, the earlier occurrences of the
    last n ids; of them the latest with num_tokens ids after it, else the earliest."""
    total = len(ids)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        starts = [s for s in range(total - n) if ids[s:s + n] == ids[total - n:]]
        if starts and num_tokens > 0:
            whole = [s for s in starts if s + n + num_tokens <= total]
            first = (whole[-1] if whole else starts[0]) + n
            return ids[first:first + num_tokens]
    return []


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(0, 4), min_size=1, max_size=40), num_tokens=st.integers(0, 9),
       ngrams=st.tuples(st.integers(1, 5), st.integers(1, 5)))
def test_propose_is_the_lookup_its_contract_says(ids, num_tokens, ngrams):
    """propose (one comparison over the ids, then over the few matches) against the lookup written
    plainly, on short runs of a small alphabet, where matches of every length abound."""
    min_ngram, max_ngram = sorted(ngrams)
    got = propose(np.array(ids, dtype=np.int64), num_tokens, max_ngram, min_ngram)
    assert got == lookup(ids, num_tokens, max_ngram, min_ngram)


@pytest.mark.parametrize("bad, message", [
    (dict(speculative_tokens=-1), "speculative_tokens"),
    (dict(speculative_tokens=16), "speculative_tokens"),
    (dict(speculative_min_ngram=0), "speculative_min_ngram"),
    (dict(speculative_max_ngram=1, speculative_min_ngram=2), "speculative_max_ngram"),
    (dict(speculative_max_running=0), "speculative_max_running"),
    (dict(speculative_step_tokens=0), "speculative_step_tokens"),
    (dict(speculative_row_cost=-0.1), "speculative_row_cost"),
    (dict(speculative_row_cost=1.5), "speculative_row_cost"),
    (dict(speculative_row_cost="auto"), "speculative_row_cost"),
    (dict(speculative_row_cost=True), "speculative_row_cost"),
])
def test_bad_speculative_settings_are_refused(bad, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**bad)


@pytest.mark.parametrize("fault", ["raises", "matcher"])
def test_a_fault_while_a_draft_is_drawn_from_ends_that_request_alone(make_engine, fault):
    """A token of a drafted run that cannot be handled ends its request with the error (INTERNAL at the
    API), or, where its structured output's matcher fails on it, with the error naming the constraint
    (INVALID_ARGUMENT); the other request goes on with the tokens it writes alone, and the blocks
    come back (the fixture checks the allocator)."""
    import threading

    engine = make_engine(speculative_tokens=8, speculative_max_running=64, speculative_row_cost=0.0)
    engine.add_template("t", token_ids=TEMPLATE)
    alone = engine.generate(req("t"))[0]
    core = engine._core
    verify, take = core._verify_drafts, core._take_token
    state = {"in_draft": False, "fired": False}

    def verifying(*args):
        state["in_draft"] = True
        try:
            verify(*args)
        finally:
            state["in_draft"] = False

    def taking(seq, detok, token):
        if seq.prefix_name_fault and state["in_draft"] and seq.num_output_tokens >= 6 and not state["fired"]:
            state["fired"] = True
            if fault == "raises":
                raise RuntimeError("detokenizer broke")
            seq.matcher.consume_token(token)
            return FinishReason.ABORT, ""  # as for a mask over scheduler.grammar_step_fuel
        return take(seq, detok, token)
    core._verify_drafts, core._take_token = verifying, taking
    outs: dict[str, list] = {"bad": [], "good": []}
    done = {k: threading.Event() for k in outs}

    def sink(key):
        def put(out):
            outs[key].append(out)
            if out.finished:
                done[key].set()
        return put
    core_add = core.add_request

    def add_request(request_id, prompt_ids, prefix_name, *rest, **kw):
        core_add(request_id, prompt_ids, prefix_name, *rest, **kw)
        core._tracked[request_id].seq.prefix_name_fault = prefix_name is None
    core.add_request = add_request
    engine.submit(req(None, structured=STRUCTURED["regex"] if fault == "matcher" else None), sink("bad"))
    engine.submit(req("t"), sink("good"))
    assert done["bad"].wait(60) and done["good"].wait(60)
    assert state["fired"]
    error = outs["bad"][-1].error
    if fault == "raises":
        assert error is not None and "detokenizer broke" in str(error)
    else:
        assert isinstance(error, InvalidRequest) and "grammar_step_fuel" in str(error), error
        assert outs["bad"][-1].finish_reason is FinishReason.ABORT
    good = outs["good"]
    assert good[-1].error is None and [t for o in good for t in o.token_ids] == alone.token_ids


def test_a_step_cost_is_fitted_to_the_steps_rows_and_times():
    """row_cost: a row's time over a step's fixed time, by least squares over recent steps; the
    default until the steps' rows differ; a fixed value where the config gives one."""
    from prefix_service.engine.speculation import DEFAULT_ROW_COST, StepCost
    cost = StepCost()
    assert cost.row_cost == DEFAULT_ROW_COST
    for _ in range(20):
        cost.observe(4, 0.012)
    assert cost.row_cost == DEFAULT_ROW_COST  # every step of 4 rows: no slope
    for rows in [1, 9, 4, 33, 17, 2, 40, 8] * 5:
        cost.observe(rows, 0.010 + 0.0005 * rows)  # a 10 ms step, 0.5 ms a row
    assert cost.row_cost == pytest.approx(0.05, rel=1e-6)
    for rows in [1, 9, 4, 33, 17, 2, 40, 8] * 40:  # the machine changed: the older steps fade
        cost.observe(rows, 0.004 + 0.002 * rows)
    assert cost.row_cost == pytest.approx(0.5, rel=0.02) and cost.observed == 380
    assert StepCost(0.2).row_cost == 0.2
    flat = StepCost()
    for rows in [1, 40] * 10:
        flat.observe(rows, 0.01 - 0.0001 * rows)  # more rows, less time: noise, rows cost nothing
    assert flat.row_cost == 0.0


def test_a_draft_is_as_long_as_its_tokens_are_worth_their_rows():
    """The k-th draft token is kept with the sequence's acceptance^k; it is worth its row while that is
    at least n r / (1 + n r) (n running, r a row's cost): a sequence whose drafts are kept drafts long
    even in a large batch, one whose drafts are missed drafts short alone and none in a batch."""
    from prefix_service.engine.speculation import Drafter
    drafter = Drafter(SchedulerConfig(speculative_tokens=8, speculative_row_cost=0.08), 512)
    quoting, writing = (Sequence(name, list(PROMPT), SamplingParams(max_tokens=50), 512, None, None)
                        for name in ("q", "w"))
    assert drafter.acceptance(quoting) == 0.5  # nothing drafted yet: the engine's rate, from 1 of 2
    for _ in range(6):
        drafter.learn(quoting, 8, 8)
        drafter.learn(quoting, 8, 7)
        for _ in range(3):
            drafter.learn(writing, 2, 0)
        drafter.learn(writing, 1, 1)
    p, q = drafter.acceptance(quoting), drafter.acceptance(writing)
    assert 0.9 < p < 1 and 0.25 < q < 0.35 and p > drafter.acceptance(Sequence("new", [1], SamplingParams(), 9, None, None))
    for n, want_p, want_q in ((1, 8, 2), (8, 8, 0), (64, 2, 0)):
        bar = n * 0.08 / (1 + n * 0.08)
        assert p ** want_p >= bar and (want_p == 8 or p ** (want_p + 1) < bar)
        assert drafter.worth(quoting, n) == want_p and drafter.worth(writing, n) == want_q
    assert Drafter(SchedulerConfig(speculative_tokens=8, speculative_row_cost=0.0), 512).worth(writing, 64) == 8


def test_drafts_not_worth_their_rows_are_not_made(make_engine):
    """Where a row costs as much as a step (row cost 1), no draft whose tokens are kept at most half the
    time is worth it: none is made, and the tokens are the same; with the cost measured, the engine
    fits it to its own decode steps."""
    requests = [req(prefix) for prefix in (None, "t")]
    off, _, _ = run(make_engine, requests, 0)
    dear, _, stats = run(make_engine, requests, 8, speculative_row_cost=1.0)
    assert dear == off and stats["draft_tokens"] == 0
    engine = make_engine(speculative_tokens=8, speculative_max_running=64)  # measured
    engine.add_template("t", token_ids=TEMPLATE)
    assert written(engine.generate(requests)) == off
    assert engine._core.drafter.cost.observed >= 10  # the decode steps of 2 x 40 tokens
