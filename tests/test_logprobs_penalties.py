"""Log-probabilities, penalties, logit_bias and min_tokens in the engine.

Each is checked against the model's own logits, taken by teacher forcing through the torch
backend (the oracle): a generated token's reported log-probability is the log-softmax of those
logits, and a penalized greedy choice is the argmax of those logits adjusted as the parameter says.
"""
import pytest
import torch

from helpers import engine_last_logits, greedy
from prefix_service import FinishReason, GenerateRequest, InvalidRequest, SamplingParams
from prefix_service.engine.sampler import adjust_logits
from prefix_service.engine.sequence import Sequence

PROMPT = [9, 40, 77, 120, 301, 17, 9, 40]


def generate(engine, ids=PROMPT, prefix=None, **kw):
    params = dict(max_tokens=8, ignore_eos=True)
    params.update(kw)
    return engine.generate([GenerateRequest(prompt_token_ids=list(ids), prefix_name=prefix,
                                            sampling=SamplingParams(**params))])[0]


def teacher_forced_logits(engine, ids, out_ids):
    """The model's logits before each of out_ids, [len(out_ids), vocab]."""
    return torch.stack([engine_last_logits(engine, list(ids) + out_ids[:k]) for k in range(len(out_ids))])


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_logprobs_are_the_models_log_softmax(make_engine, backend):
    """Each token's logprob and its top alternatives equal a log-softmax of the torch backend's logits
    at that position, under greedy and under temperature sampling (the model's distribution, not the
    tempered one), and under penalties, a logit_bias that pushes the model's top token away and
    min_tokens (taken before any of them); on a template as without."""
    oracle = make_engine(backend="torch")
    engine = make_engine(backend=backend)
    engine.add_template("t", token_ids=PROMPT[:5])
    top = generate(engine, max_tokens=1).token_ids[0]
    adjusted = dict(repetition_penalty=1.7, presence_penalty=1.0, logit_bias=((top, -100.0),), min_tokens=8,
                    ignore_eos=False)
    for kw in (dict(), dict(temperature=2.0, seed=5), adjusted):
        out = generate(engine, logprobs=3, **kw)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        want = torch.log_softmax(teacher_forced_logits(oracle, PROMPT, out.token_ids), dim=-1)
        for k, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - want[k, lp.token_id].item()) < 1e-4
            assert [t for t, _ in lp.top] == want[k].topk(3).indices.tolist()
            assert max(abs(v - want[k, t].item()) for t, v in lp.top) < 1e-4
        on_template = generate(engine, PROMPT[5:], prefix="t", logprobs=3, **kw)
        assert on_template.token_ids == out.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(on_template.logprobs, out.logprobs)) < 1e-4
    assert generate(engine, logprobs=0).logprobs[0].top == ()
    assert generate(engine).logprobs is None
    assert {len(lp.top) for lp in generate(engine, logprobs=20).logprobs} == {20}  # the most OpenAI allows


def test_logit_bias_moves_the_greedy_choice(make_engine):
    engine = make_engine()
    logits = engine_last_logits(engine, PROMPT)
    first, second = logits.topk(2).indices.tolist()
    assert generate(engine, max_tokens=1).token_ids == [first]
    assert generate(engine, max_tokens=1, logit_bias=((first, -100.0),)).token_ids == [second]
    forced = int(logits.argmin())
    assert generate(engine, max_tokens=4, logit_bias=((forced, 100.0),)).token_ids == [forced] * 4


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                dict(repetition_penalty=1.8), dict(repetition_penalty=0.5),
                                dict(frequency_penalty=-2.0, presence_penalty=0.5)])
def test_penalized_greedy_is_the_argmax_of_the_adjusted_logits(make_engine, kw):
    """Greedy under a penalty picks, at every step, the argmax of the model's logits adjusted as
    OpenAI (presence, frequency: over the generated tokens) and CTRL / vLLM (repetition: over
    the prompt and the generated tokens; positive logits divided, negative multiplied) define."""
    oracle = make_engine(backend="torch")
    engine = make_engine()
    out = generate(engine, max_tokens=20, **kw).token_ids
    plain = generate(engine, max_tokens=20).token_ids
    assert out != plain  # the penalty changed something, else this test shows nothing
    logits = teacher_forced_logits(oracle, PROMPT, out)
    p = SamplingParams(**kw)
    for k, token in enumerate(out):
        row = logits[k].clone()
        counts = torch.bincount(torch.tensor(out[:k], dtype=torch.int64), minlength=row.shape[0]).float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        seen = torch.tensor(sorted(set(PROMPT + out[:k])))
        r = p.repetition_penalty
        row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        assert row[token] >= row.max() - 1e-4, f"step {k}: chose {token}, adjusted argmax {int(row.argmax())}"


def test_adjust_row_arithmetic():
    """The adjustments on a known row: every term exactly as documented."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                  repetition_penalty=2.0, logit_bias=((0, 3.0), (3, 1.0))),
                   8, None, None)
    seq.token_ids += [4, 4, 2]  # generated: 4 twice, 2 once
    row = torch.tensor([[1.0, -1.0, 2.0, 4.0, 6.0, 8.0]])
    adjust_logits(row, [0], [seq], ())
    # token 0: untouched but for its bias; 1..3: prompt, repetition only; 2 also generated once;
    # 3: its bias first, then the repetition penalty, as vLLM orders them; 4: generated twice
    # (repetition, then 2 x 0.25 + 0.5); 5: untouched
    assert row[0].tolist() == [4.0, -2.0, 1.0 - 0.75, (4.0 + 1.0) / 2, 3.0 - 1.0, 8.0]


def _adjusted_alone(row: torch.Tensor, seq: Sequence, eos: tuple[int, ...]) -> torch.Tensor:
    """One row adjusted by itself, term by term over the whole vocabulary: the oracle for the batch."""
    p, row = seq.sampling, row.clone()
    for token, bias in p.logit_bias:
        row[token] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)))
        row[seen] = torch.where(row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty)
    counts = torch.bincount(torch.tensor(seq.token_ids[seq.num_prompt_tokens:], dtype=torch.int64),
                            minlength=row.shape[0]).float()
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if seq.num_output_tokens < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            row[token] = float("-inf")
    return row


def test_a_batch_is_adjusted_as_each_row_alone():
    """Rows asking for different adjustments (and rows asking for none) in one call: each row ends
    bit for bit as it would alone, rows that ask for nothing are untouched."""
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    options = [dict(repetition_penalty=1.3, logit_bias=tuple((t, 1.5) for t in range(0, 50, 3))),
               dict(presence_penalty=0.8, frequency_penalty=0.5), {},
               dict(logit_bias=((7, 2.5), (49, 4.0))), dict(min_tokens=9, stop_token_ids=(5,)),
               dict(min_tokens=9, ignore_eos=True), dict(repetition_penalty=0.7, frequency_penalty=-1.0, min_tokens=1),
               dict(presence_penalty=1.0)]
    seqs = []
    for k, kw in enumerate(options):
        prompt = torch.randint(0, vocab, (5 + k,), generator=gen).tolist()
        seq = Sequence(f"r{k}", prompt, SamplingParams(**kw), 16, None, None)
        seq.token_ids += torch.randint(0, vocab, (k,), generator=gen).tolist()  # row k has generated k tokens
        seqs.append(seq)
    logits = torch.randn(len(seqs), vocab, generator=gen)
    rows = [i for i, seq in enumerate(seqs) if seq.sampling.adjusts_logits]
    assert rows == [0, 1, 3, 4, 5, 6, 7]
    batch = logits.clone()
    adjust_logits(batch, rows, seqs, (2, 11))
    for i, seq in enumerate(seqs):
        expected = _adjusted_alone(logits[i], seq, (2, 11)) if i in rows else logits[i]
        assert torch.equal(batch[i], expected), f"row {i} ({options[i]})"
    assert torch.isinf(batch[4, [2, 5, 11]]).all() and not torch.isinf(batch[5]).any()


def test_min_tokens_masks_stops_until_reached(make_engine):
    engine = make_engine()
    first = generate(engine, max_tokens=6, ignore_eos=False)
    t0 = first.token_ids[0]
    stopped = generate(engine, max_tokens=6, stop_token_ids=(t0,))
    assert stopped.token_ids == [t0] and stopped.finish_reason is FinishReason.STOP
    held = generate(engine, max_tokens=6, stop_token_ids=(t0,), min_tokens=3)
    assert len(held.token_ids) >= 3 and t0 not in held.token_ids[:3]
    # a stop string is not looked for before min_tokens either
    stop = first.text.strip()[:2]
    assert stop
    early = generate(engine, max_tokens=6, stop=(stop,))
    late = generate(engine, max_tokens=6, stop=(stop,), min_tokens=6)
    assert len(late.token_ids) == 6 and late.finish_reason is FinishReason.LENGTH
    assert len(early.token_ids) < 6 and early.finish_reason is FinishReason.STOP


def test_a_stop_string_ending_on_the_min_tokens_th_token_does_not_stop(make_engine):
    """A stop string counts once the output has more than min_tokens tokens, as vLLM's check: one
    that ends exactly on the min_tokens-th token is passed over, one token sooner it stops."""
    engine = make_engine()
    first = generate(engine, max_tokens=6)
    stop = engine.tokenizer.decode(first.token_ids[:3])  # the output's first three tokens: ends on the third
    assert stop and stop not in engine.tokenizer.decode(first.token_ids[:2])
    passed = generate(engine, max_tokens=6, stop=(stop,), min_tokens=3)
    assert (passed.token_ids, passed.finish_reason) == (first.token_ids, FinishReason.LENGTH)
    stopped = generate(engine, max_tokens=6, stop=(stop,), min_tokens=2)
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == (first.token_ids[:3], "", FinishReason.STOP)


@pytest.mark.parametrize("kw,field", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias=((10**6, 1.0),)), "logit_bias"), (dict(logit_bias=((3, 101.0),)), "logit_bias"),
    (dict(logit_bias=((3, 60.0), (3, 60.0))), "logit_bias"),  # together past the range
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(min_tokens=10**6, max_tokens=None), "min_tokens"),
    # below 1e-3 a penalty's quotient overflows float32 (1e-300 rounds to 0): the draw was garbage
    (dict(repetition_penalty=1e-300), "repetition_penalty"), (dict(repetition_penalty=9e-4), "repetition_penalty"),
    # ints past float's range: OverflowError, not the field's refusal
    (dict(temperature=10**400), "temperature"), (dict(top_p=10**400), "top_p"),
    (dict(repetition_penalty=10**400), "repetition_penalty"), (dict(presence_penalty=10**400), "presence_penalty"),
    (dict(logit_bias=((3, 10**400),)), "logit_bias")])
def test_bad_values_are_refused_naming_the_field(make_engine, kw, field):
    engine = make_engine()
    params = dict(max_tokens=8)
    params.update(kw)
    with pytest.raises(InvalidRequest, match=field) as e:
        engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(**params))])
    assert e.value.param == field


def test_greedy_unchanged_by_neutral_parameters(make_engine):
    engine = make_engine()
    assert generate(engine, max_tokens=8, presence_penalty=0.0, repetition_penalty=1.0, logprobs=2).token_ids == \
        generate(engine, max_tokens=8).token_ids == greedy_ids(engine)


def greedy_ids(engine):
    return engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(8))])[0].token_ids


def test_ids_tensor_follows_the_sequence_as_it_grows():
    """Sequence.ids_tensor converts each token once, as token_ids grows: every call still gives
    exactly token_ids[start:], as a copy the sequence does not change afterwards."""
    seq = Sequence("r", [5, 6, 7], SamplingParams(), 8, None, None)
    assert seq.ids_tensor().tolist() == [5, 6, 7] and seq.ids_tensor(3).tolist() == []
    first = seq.ids_tensor()
    seq.token_ids += [8, 2**40]
    assert seq.ids_tensor().tolist() == [5, 6, 7, 8, 2**40] and seq.ids_tensor(3).tolist() == [8, 2**40]
    assert first.tolist() == [5, 6, 7]  # a copy, not a view of what grows
    seq.token_ids.append(9)
    assert seq.ids_tensor(4).tolist() == [2**40, 9] and seq.ids_tensor(9).tolist() == []
    seq.token_ids = [1]  # a shorter list in its place: converted again
    assert seq.ids_tensor().tolist() == [1] and seq.ids_tensor().dtype == torch.int64
