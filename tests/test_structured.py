"""Structured outputs in the engine (engine/structured.py, llguidance): a choice, a regex, a JSON
schema and any JSON object constrain what a request generates, on a random model that would
never produce them by itself; constrained and free requests share steps without changing the free
ones; n samples each keep the constraint; a bad constraint is refused naming it, before anything
is queued; a template's default output applies to the requests on it that name none; the compile
and per-step bounds refuse or end only the request that exceeds them; the first constrained step
loads no compiler (torch.compile's dynamo and inductor take seconds to import on the engine's
thread)."""
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

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


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, tokenizer_dir):
    """A model with more logit rows (600) than its tokenizer has tokens (512), as real models pad
    their vocabulary to a round size (Qwen2.5: 151,936 rows, 151,665 tokens)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from prefix_service import synthetic
    path = tmp_path_factory.mktemp("padded") / "model"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(synthetic.tiny_config("llama", 600), dtype=torch.float32).save_pretrained(path)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_vocabulary_padded_past_the_tokenizer(make_engine, padded_dir, backend):
    """The masks cover every logit row, the padding never allowed: the constrained request conforms
    and the free one beside it is its own. (llguidance's view of the tokenizer was the tokenizer's
    size, its mask narrower than the logits: the step failed, and every request in it.)"""
    engine = make_engine(padded_dir, backend=backend)
    free = GenerateRequest(prompt_token_ids=[5, 17, 99], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    alone = engine.generate([free])[0].token_ids
    outs = engine.generate([free, GenerateRequest(prompt_token_ids=[41, 77], sampling=SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, structured=StructuredOutput("choice", choices=CHOICES)))])
    assert outs[0].token_ids == alone and outs[1].text in CHOICES
    assert all(t < 512 for t in outs[1].token_ids)


def test_each_sample_keeps_the_constraint(make_engine):
    engine = make_engine()
    out = generate(engine, StructuredOutput("choice", choices=CHOICES), n=4, temperature=1.5, seed=7)
    assert all(s.text in CHOICES for s in out.samples)


@pytest.mark.parametrize("spec,match", [
    (StructuredOutput("regex", "([a-"), "regex"), (StructuredOutput("json_schema", "{not json"), "json_schema"),
    (StructuredOutput("json_schema", json.dumps({"type": "objekt"})), "json_schema"),
    (StructuredOutput("grammar", "start: ("), "grammar")])
def test_a_bad_constraint_is_refused_naming_it(make_engine, spec, match):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=match) as e:
        generate(engine, spec)
    assert e.value.param == "structured_output"
    assert engine.kv_stats()["waiting"] == 0


@pytest.mark.parametrize("kind,fields,match", [
    ("choice", {}, "non-empty strings"), ("choice", {"choices": ("", " yes")}, "non-empty strings"),
    ("regex", {"spec": ""}, "non-empty string"), ("grammar", {}, "non-empty string"),
    ("json_schema", {}, "non-empty string"), ("yaml", {"spec": "x"}, "none of")])
def test_a_constraint_the_state_file_could_not_read_back_is_refused_when_made(kind, fields, match):
    """Every API builds a StructuredOutput, and a template's is written to the state file, which
    refuses these at the next start: so none is made (an empty choice or regex was served, and its
    template then kept the server from starting)."""
    with pytest.raises(InvalidRequest, match=match) as e:
        StructuredOutput(kind, param="structured_outputs.choice", **fields)
    assert e.value.param == "structured_outputs.choice"


def test_a_template_default_output_applies_unless_a_request_names_its_own(make_engine):
    engine = make_engine()
    engine.add_template("intent", token_ids=[7, 8, 9, 10, 11], structured=StructuredOutput("choice", choices=CHOICES))
    engine.add_template("plain", token_ids=[7, 8, 9, 10, 11])
    assert engine.get_template("intent").structured == StructuredOutput("choice", choices=CHOICES)
    assert {i.name: i.structured for i in engine.list_templates()}["plain"] is None

    def on(name, **kw):
        params = dict(max_tokens=12, ignore_eos=True)
        params.update(kw)
        return engine.generate(GenerateRequest(prompt_token_ids=PROMPT, prefix_name=name,
                                               sampling=SamplingParams(**params)))[0]
    assert on("intent").text in CHOICES
    assert all(s.text in CHOICES for s in on("intent", n=3, temperature=1.5, seed=2).samples)
    assert re.fullmatch(r"[0-9]{4}", on("intent", structured=StructuredOutput("regex", "[0-9]{4}")).text)
    free = on("intent", structured=StructuredOutput("text"))  # free text: as on the same template without one
    assert free.token_ids == on("plain").token_ids and free.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidRequest, match="regex") as e:
        engine.add_template("bad", token_ids=[7, 8], structured=StructuredOutput("regex", "([a-", param="regex"))
    assert e.value.param == "regex" and "bad" not in {i.name for i in engine.list_templates()}


def test_a_constraint_over_the_compile_bound_is_refused(make_engine):
    engine = make_engine(grammar_compile_fuel=5000)
    big = StructuredOutput("regex", "(" + "|".join(f"word{i}x" for i in range(2000)) + ")", param="guided_regex")
    with pytest.raises(InvalidRequest, match="too big") as e:
        generate(engine, big)
    assert e.value.param == "guided_regex" and engine.kv_stats()["waiting"] == 0
    assert re.fullmatch(r"[0-9]{3}", generate(engine, StructuredOutput("regex", "[0-9]{3}")).text)


def test_generate_aborts_the_rest_of_its_batch_when_one_request_fails(make_engine):
    """Engine.generate raises the error that ends one of its requests; the others, whose results
    would reach nobody, are aborted then rather than left running to their end."""
    engine = make_engine(grammar_step_fuel=1)
    bad = GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=10, structured=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")))
    long = GenerateRequest(prompt_token_ids=[5] * 6, sampling=SamplingParams(max_tokens=400, ignore_eos=True))
    with pytest.raises(InvalidRequest, match="grammar_step_fuel"):
        engine.generate([bad, long])
    stats = engine.kv_stats()
    assert (stats["running"], stats["waiting"], stats["used"]) == (0, 0, 0), stats


def test_a_mask_over_the_step_bound_ends_its_request_alone(make_engine):
    """With a step bound too small for any mask, each constrained request ends with an error naming
    its field at its first step; the free requests of the same steps finish as they would alone."""
    engine = make_engine(grammar_step_fuel=1)
    free = [GenerateRequest(prompt_token_ids=[5 + k] * 6, sampling=SamplingParams(max_tokens=10, ignore_eos=True))
            for k in range(2)]
    alone = [o.token_ids for o in engine.generate(free)]
    bad = GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=10, structured=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}", param="response_format")))
    with pytest.raises(InvalidRequest, match="grammar_step_fuel") as e:
        engine.generate([free[0], bad, free[1]])
    assert e.value.param == "response_format"
    assert [o.token_ids for o in engine.generate(free)] == alone
    outs = {}
    done = threading.Event()

    def sink_for(key):
        def sink(out):
            outs.setdefault(key, []).append(out)
            if len(outs) == 3 and all(v[-1].finished for v in outs.values()):
                done.set()
        return sink
    for key, req in (("a", free[0]), ("bad", bad), ("b", free[1])):
        engine.submit(req, sink_for(key))
    assert done.wait(60)
    assert [t for o in outs["a"] for t in o.token_ids] == alone[0]
    assert [t for o in outs["b"] for t in o.token_ids] == alone[1]
    last = outs["bad"][-1]
    assert last.finish_reason is FinishReason.ABORT and isinstance(last.error, InvalidRequest)


FIRST_CONSTRAINED_STEP = """
import json, sys
from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
from prefix_service.sampling_params import StructuredOutput
engine = Engine(EngineConfig(ModelConfig(path=sys.argv[1], dtype="float32", device="cpu"), CacheConfig(num_blocks=64)))
before = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
out = engine.generate(GenerateRequest(prompt_token_ids=[41, 77, 301], sampling=SamplingParams(
    max_tokens=8, structured=StructuredOutput("choice", choices=("order", "refund")))))[0]
after = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
engine.shutdown()
print(json.dumps({"text": out.text, "before": before, "after": after}))
"""


def test_the_first_constrained_step_loads_no_compiler(llama_dir):
    proc = subprocess.run([sys.executable, "-c", FIRST_CONSTRAINED_STEP, str(llama_dir)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["text"] in ("order", "refund")
    assert got["after"] == got["before"] == [], got["after"]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=5)])
def test_a_constraint_that_allows_only_a_stop_token_wins_over_min_tokens(make_engine, sampling):
    """min_tokens masks the stop tokens, and after "q" the regex "qz" allows only "z", here a stop
    token: the constraint wins (the output must conform), not a draw from a row of -inf (token 0,
    which the constraint refused, failing the request with a misleading error)."""
    engine = make_engine()
    z = engine.tokenizer.convert_tokens_to_ids("z")
    assert engine.tokenizer.convert_tokens_to_ids("q") != engine.tokenizer.unk_token_id
    free = GenerateRequest(prompt_token_ids=PROMPT[::-1], sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    alone = engine.generate(free)[0].token_ids
    outs = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=8, min_tokens=5, stop_token_ids=(z,), structured=StructuredOutput("regex", "qz"), **sampling)),
        free])
    assert (outs[0].text, outs[0].finish_reason) == ("qz", FinishReason.STOP)
    assert outs[1].token_ids == alone  # the row beside it as alone


@pytest.mark.parametrize("written,match", [
    ({"json_object": 1}, r"json_object: expected true, got 1"), ({"text": "yes"}, r"text: expected true, got 'yes'"),
    ({"json_object": False}, "expected true"), ({"choice": []}, "non-empty strings"), ({"choice": "yes"}, "non-empty"),
    ({"regex": ""}, "non-empty string"), ({"regex": 3}, "non-empty string"),
    ({"regex": "a", "choice": ["a"]}, "mapping of one key"), ({"yaml": "x"}, "mapping of one key")])
def test_a_written_constraint_other_than_its_documented_form_is_refused_naming_the_key(written, match):
    """The written form (a template's YAML, the state file) is one key: json_object and text take
    exactly true (not 1 or a string), choice a non-empty list, the others a non-empty string."""
    with pytest.raises(InvalidRequest, match=match) as e:
        StructuredOutput.from_dict(written, param="templates[0].output")
    kind = next(iter(written))
    assert e.value.param == ("templates[0].output" if len(written) != 1 or kind == "yaml" else
                             f"templates[0].output.{kind}")


@pytest.mark.parametrize("written", [
    {"json_object": True}, {"text": True}, {"choice": ["yes", "no"]}, {"regex": "[a-z]+"},
    {"grammar": "start: \"x\""}, {"json_schema": '{"type": "object"}'}])
def test_a_written_constraint_reads_back_as_it_was_written(written):
    assert StructuredOutput.from_dict(written).to_dict() == written
