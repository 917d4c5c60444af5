"""Structured outputs in the engine (engine/structured.py, llguidance): a choice, a regex, a JSON
schema and any JSON object constrain what a request generates, on a random model that would
never produce them by itself; constrained and free requests share steps without changing the free
ones; n samples each keep the constraint; a bad constraint is refused naming it, before anything
is queued."""
import json
import re

import pytest

from prefix_service import FinishReason, GenerateRequest, InvalidRequest, SamplingParams
from prefix_service.sampling_params import StructuredOutput

PROMPT = [41, 77, 301, 12, 9, 130]
CHOICES = ("order", "refund", "shipping value")


def generate(engine, structured, **kw):
    params = dict(max_tokens=40, structured=structured)
    params.update(kw)
    return engine.generate(GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(**params)))[0]


def test_choice_regex_and_json(make_engine):
    engine = make_engine()
    for kw in (dict(), dict(temperature=1.0, seed=3)):
        out = generate(engine, StructuredOutput("choice", choices=CHOICES), **kw)
        assert out.text in CHOICES and out.finish_reason is FinishReason.STOP
    out = generate(engine, StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.text) and out.finish_reason is FinishReason.STOP
    schema = {"type": "object", "properties": {"intent": {"enum": ["order", "refund"]}, "urgent": {"type": "boolean"}},
              "required": ["intent", "urgent"], "additionalProperties": False}
    out = generate(engine, StructuredOutput("json_schema", json.dumps(schema)), max_tokens=60)
    record = json.loads(out.text)
    assert set(record) == {"intent", "urgent"} and record["intent"] in ("order", "refund")
    assert isinstance(record["urgent"], bool)
    out = generate(engine, StructuredOutput("json_object"), max_tokens=60, temperature=0.7, seed=1)
    assert out.finish_reason is FinishReason.LENGTH or isinstance(json.loads(out.text), dict)


def test_free_requests_beside_constrained_ones_are_unchanged(make_engine):
    engine = make_engine()
    free = [GenerateRequest(prompt_token_ids=[5 + k] * 6, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
            for k in range(3)]
    alone = [o.token_ids for o in engine.generate(free)]
    constrained = [GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=20, structured=StructuredOutput("choice", choices=CHOICES))) for _ in range(2)]
    outs = engine.generate(free[:1] + constrained[:1] + free[1:] + constrained[1:])
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == alone
    assert outs[1].text in CHOICES and outs[4].text in CHOICES


def test_each_sample_keeps_the_constraint(make_engine):
    engine = make_engine()
    out = generate(engine, StructuredOutput("choice", choices=CHOICES), n=4, temperature=1.5, seed=7)
    assert all(s.text in CHOICES for s in out.samples)


@pytest.mark.parametrize("spec,match", [
    (StructuredOutput("regex", "([a-"), "regex"), (StructuredOutput("json_schema", "{not json"), "json_schema"),
    (StructuredOutput("json_schema", json.dumps({"type": "objekt"})), "json_schema"),
    (StructuredOutput("grammar", "start: ("), "grammar"), (StructuredOutput("choice"), "choice"),
    (StructuredOutput("yaml", "x"), "unknown kind")])
def test_a_bad_constraint_is_refused_naming_it(make_engine, spec, match):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=match) as e:
        generate(engine, spec)
    assert e.value.param == "structured_output"
    assert engine.kv_stats()["waiting"] == 0
