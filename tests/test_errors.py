"""Every bad input is a dedicated exception with a message that names the problem, and leaves
the engine intact (the fixture checks integrity afterwards)."""
import math

import pytest

from helpers import greedy, run_ids
from prefix_service import (GenerateRequest, InvalidRequest, TemplateBudgetExceeded, TemplateExists,
                            TemplateNotFound, PromptTooLong, SamplingParams)
from prefix_service.sampling_params import GREEDY_TEMPERATURE


def test_unknown_prefix(make_engine):
    engine = make_engine()
    engine.add_template("known", token_ids=[5, 6, 7])
    with pytest.raises(TemplateNotFound, match=r"no prefix template named 'nope' \(known: known\)"):
        engine.generate([GenerateRequest(prompt="hi", prefix_name="nope")])


def test_duplicate_name(make_engine):
    engine = make_engine()
    engine.add_template("p", token_ids=[5, 6, 7])
    with pytest.raises(TemplateExists, match="'p' already exists"):
        engine.add_template("p", token_ids=[8, 9])


def test_prefix_over_budget(make_engine):
    engine = make_engine(block_size=4, prefix_budget_blocks=3)
    engine.add_template("a", token_ids=list(range(3, 11)))  # 2 blocks
    with pytest.raises(TemplateBudgetExceeded, match=r"needs 2 blocks \(5 tokens\).*1 of 3 blocks left"):
        engine.add_template("b", token_ids=list(range(3, 8)))
    assert [p.name for p in engine.list_templates()] == ["a"]
    engine.add_template("c", token_ids=[3, 4])  # 1 block still fits


def test_prompt_over_max_length(make_engine):
    engine = make_engine(max_model_len=32)
    with pytest.raises(PromptTooLong, match="40 tokens; the model's context is 32"):
        run_ids(engine, list(range(3, 43)))
    engine.add_template("p", token_ids=list(range(3, 23)))
    with pytest.raises(PromptTooLong, match="with prefix 'p'"):
        run_ids(engine, list(range(3, 15)), prefix="p")
    with pytest.raises(PromptTooLong, match="prefix template 'big'"):
        engine.add_template("big", token_ids=list(range(3, 40)))


def test_a_max_tokens_given_must_fit_the_context_beside_the_prompt(make_engine):
    """As vLLM and OpenAI answer: prompt (template included) plus a max_tokens the caller gave over the
    context is refused up front, naming the room left; unset, the server's default is cut at the context."""
    engine = make_engine(max_model_len=32, default_max_tokens=64, max_tokens_cap=64)
    with pytest.raises(PromptTooLong, match="max_tokens 13 and the prompt's 20 tokens need 33 tokens; the model's "
                                            "context is 32 tokens: ask for at most 12") as caught:
        run_ids(engine, range(3, 23), max_tokens=13)
    assert caught.value.param == "max_tokens"
    assert len(run_ids(engine, range(3, 23), max_tokens=12)) == 12  # exactly fits
    unset = engine.generate([GenerateRequest(prompt_token_ids=list(range(3, 23)),
                                             sampling=SamplingParams(max_tokens=None, ignore_eos=True))])[0]
    assert (len(unset.token_ids), unset.finish_reason) == (12, "length")
    engine.add_template("p", token_ids=list(range(3, 19)))  # 16 tokens + 4 of the prompt
    with pytest.raises(PromptTooLong, match=r"the prompt's 20 tokens \(16 of them the template 'p'\) need 33 "
                                            r"tokens.*at most 12"):
        run_ids(engine, range(19, 23), prefix="p", max_tokens=13)
    assert len(run_ids(engine, range(19, 23), prefix="p", max_tokens=12)) == 12


def test_a_context_past_the_models_positions_is_a_config_error(make_engine):
    """model.max_model_len over max_position_embeddings (512 here) stops the start naming both; it
    started at that length, and 1e8 failed allocating 25 GB of rotary tables."""
    from prefix_service.errors import ConfigError
    with pytest.raises(ConfigError, match="model.max_model_len: 513 is over the model's max_position_embeddings 512"):
        make_engine(max_model_len=513)
    assert make_engine(max_model_len=512).info.max_model_len == 512


def test_prompt_larger_than_cache(make_engine):
    engine = make_engine(block_size=4, num_blocks=8)
    with pytest.raises(PromptTooLong, match="room for 32 tokens"):
        run_ids(engine, list(range(3, 43)))


@pytest.mark.parametrize("params,match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10**9), "exceeds the configured cap"),
    (dict(seed=-1), "seed"),
    (dict(stop=("",)), "stop strings"),
    (dict(stop_token_ids=(10**6,)), "stop_token_ids"),
])
def test_invalid_sampling(params, match, make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=match):
        engine.generate([GenerateRequest(prompt="hello", sampling=SamplingParams(**params))])


def test_invalid_inputs(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.generate([GenerateRequest(prompt_token_ids=[])])
    with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 512\)"):
        engine.generate([GenerateRequest(prompt_token_ids=[1, 99999])])
    with pytest.raises(InvalidRequest, match="invalid prefix name"):
        engine.add_template("bad name!", token_ids=[1, 2])
    with pytest.raises(InvalidRequest, match="is empty"):
        engine.add_template("empty", token_ids=[])


def test_bad_request_in_a_batch_runs_nothing(make_engine):
    engine = make_engine()
    good = GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=greedy(50))
    bad = GenerateRequest(prompt_token_ids=[5], prefix_name="missing")
    with pytest.raises(TemplateNotFound):
        engine.generate([good, bad])
    assert engine.kv_stats()["used"] == 0


CAP, VOCAB = 64, 512
BELOW, ABOVE = (lambda x: math.nextafter(x, -math.inf)), (lambda x: math.nextafter(x, math.inf))


@pytest.mark.parametrize("field,taken,refused", [
    ("max_tokens", [1, CAP], [0, CAP + 1, True]),
    ("temperature", [0.0, 100.0, 100], [BELOW(0.0), ABOVE(100.0), 101, True]),
    ("top_p", [ABOVE(0.0), 1.0, 1], [0.0, ABOVE(1.0)]),
    ("top_k", [-1, 0, 1], [-2, True]),
    ("seed", [0, 2**63, 2**64 - 1], [-1, 2**64, True]),
    ("logprobs", [0, 20], [-1, 21, True]),
    ("presence_penalty", [-2.0, 2.0, -2], [BELOW(-2.0), ABOVE(2.0)]),
    ("frequency_penalty", [-2.0, 2.0, 2], [BELOW(-2.0), ABOVE(2.0)]),
    ("repetition_penalty", [1e-3, 2.0, 2], [BELOW(1e-3), ABOVE(2.0)]),
    ("min_tokens", [0, 8], [-1, 9, True]),
    ("n", [1, 64], [0, 65, True]),
])
def test_each_sampling_bound_is_taken_and_one_step_past_it_is_refused_naming_the_field(field, taken, refused):
    """Every documented bound is inclusive where it says so: the value at the bound is a request,
    the nearest value past it (the next float, the next integer, or a bool for a number) is an
    InvalidRequest whose param is the field."""
    base = dict(max_tokens=8) if field != "max_tokens" else {}
    for value in taken:
        SamplingParams(**{**base, field: value}).validate(max_tokens_cap=CAP, vocab_size=VOCAB)
    for value in refused:
        with pytest.raises(InvalidRequest, match=f"^invalid sampling parameters: {field} ") as e:
            SamplingParams(**{**base, field: value}).validate(max_tokens_cap=CAP, vocab_size=VOCAB)
        assert e.value.param == field, value


def test_stop_strings_token_ids_and_logit_bias_are_bounded_at_their_documented_limits():
    """16 stop strings, a stop string of 256 characters, stop token ids and logit_bias keys below the
    vocabulary size, 300 logit_bias entries of [-100, 100]: each is taken at its limit and refused
    one past it, naming the field."""
    def check(**kw):
        SamplingParams(max_tokens=8, **kw).validate(max_tokens_cap=CAP, vocab_size=VOCAB)

    check(stop=tuple(str(i) for i in range(16)))
    check(stop=("x" * 256,), stop_token_ids=(0, VOCAB - 1))
    check(logit_bias=tuple((t, 100.0 if t % 2 else -100.0) for t in range(300)))
    check(logit_bias=((VOCAB - 1, 1.0),))
    for kw, param in [(dict(stop=tuple(str(i) for i in range(17))), "stop"), (dict(stop=("x" * 257,)), "stop"),
                      (dict(stop_token_ids=(VOCAB,)), "stop_token_ids"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
                      (dict(logit_bias=tuple((t, 1.0) for t in range(301))), "logit_bias"),
                      (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
                      (dict(logit_bias=((3, -100.5),)), "logit_bias")]:
        with pytest.raises(InvalidRequest) as e:
            check(**kw)
        assert e.value.param == param, kw


def test_a_temperature_below_the_greedy_bound_is_greedy_and_the_bound_itself_samples():
    """Below GREEDY_TEMPERATURE (1e-5) a request is greedy; at it, it samples."""
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=BELOW(GREEDY_TEMPERATURE)).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
