"""The sampler's draws (engine/sampler.py's draw): every sampled row of a step together, each from
one uniform of its own generator. The frequencies of many draws match the distribution each option
defines (temperature, top-k, top-p, both), within 5 standard deviations; tokens outside it (masked,
past k, past the nucleus) never come; a row's token depends on its logits and generator only, not
on the rows beside it; and nuclei wider than the first candidates are found in full. On a CPU each
runs with the cpu backend's passes over its logits (backends/cpu/sampling.py) and with torch's."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefix_service.backends.base import TORCH_SAMPLER_OPS
from prefix_service.backends.cpu import native
from prefix_service.backends.cpu.sampling import NATIVE_SAMPLER_OPS
from prefix_service.engine import sampler
from prefix_service.sampling_params import SamplingParams


@pytest.fixture(params=["native", "torch"])
def ops(request):
    """The passes over the logits the sampler takes from its backend (Backend.sampler_ops): the cpu
    backend's native ones (backends/cpu/sampling.py; skipped where the library cannot load), or
    torch's topk and logsumexp, every other backend's."""
    if request.param == "torch":
        return TORCH_SAMPLER_OPS
    if native.load()[1] is not None:
        pytest.skip(f"no native CPU library here: {native.load()[1]}")
    return NATIVE_SAMPLER_OPS


def seqs_for(params: list[SamplingParams], seed: int = 0) -> list[SimpleNamespace]:
    return [SimpleNamespace(sampling=p, matcher=None, generator=np.random.Generator(np.random.PCG64(seed + i)))
            for i, p in enumerate(params)]


def frequencies(logits: torch.Tensor, params: SamplingParams, draws: int, ops=TORCH_SAMPLER_OPS) -> torch.Tensor:
    """How often each token is drawn from one row of logits, `draws` times (a row per draw)."""
    rows = logits.unsqueeze(0).expand(draws, -1).contiguous()
    tokens = sampler.draw(rows, list(range(draws)), seqs_for([params] * draws), ops)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double() / draws


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the options define, computed directly (a full sort, float64)."""
    x = logits.double() / p.temperature
    order = torch.sort(x, descending=True, stable=True).indices
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[:p.top_k if 0 < p.top_k < x.shape[0] else x.shape[0]]] = True
    probs = torch.where(keep, x, torch.tensor(float("-inf"), dtype=x.dtype)).softmax(-1)
    if p.top_p < 1.0:
        sorted_probs = probs[order]
        before = sorted_probs.cumsum(0) - sorted_probs
        dropped = order[before >= p.top_p]
        probs[dropped] = 0.0
        probs /= probs.sum()
    return probs


def assert_matches(freq: torch.Tensor, want: torch.Tensor, draws: int) -> None:
    assert (freq[want == 0] == 0).all(), "a token outside the distribution was drawn"
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-9).all(), (freq - want).abs().max().item()


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, float("-inf"), 0.25])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=1, temperature=1.0),
    SamplingParams(max_tokens=1, temperature=0.5),
    SamplingParams(max_tokens=1, temperature=2.0, top_k=3),
    SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8),
    SamplingParams(max_tokens=1, temperature=1.5, top_k=5, top_p=0.7),
], ids=["t1", "t0.5", "top_k", "top_p", "top_k_and_top_p"])
def test_draws_follow_the_distribution_the_options_define(params, ops):
    draws = 20_000
    want = reference(LOGITS, params)
    assert_matches(frequencies(LOGITS, params, draws, ops), want, draws)


def test_a_rows_token_depends_on_its_logits_and_generator_only(ops):
    torch.manual_seed(0)
    logits = torch.randn(12, 500) * 2
    params = [SamplingParams(max_tokens=1, temperature=0.9, top_k=(0, 7, 0)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3])
              for i in range(12)]
    together = sampler.draw(logits, list(range(12)), seqs_for(params, seed=40), ops)
    alone = [sampler.draw(logits[i:i + 1], [0], seqs_for([params[i]], seed=40 + i), ops)[0] for i in range(12)]
    assert together == alone
    # a subset of the rows, named by index among others (the greedy rows of a step are not drawn)
    seqs = seqs_for(params, seed=40)
    some = sampler.draw(logits, [1, 4, 9], seqs, ops)
    assert some == [alone[1], alone[4], alone[9]]


def test_a_nucleus_wider_than_the_candidates_is_found_in_full(monkeypatch, ops):
    """Flat logits: a top_p of 0.5 keeps half the vocabulary, far more than the first candidate
    counts; the draws spread over it and never past it."""
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", (8, 32))
    vocab, draws = 512, 4_000
    logits = torch.linspace(0.0, 0.01, vocab)  # nearly flat, token 511 the most likely
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5)
    freq = frequencies(logits, params, draws, ops)
    want = reference(logits, params)
    assert (want > 0).sum() > 200
    assert_matches(freq, want, draws)
    assert (freq > 0).sum() > 150  # many more tokens than the 32 candidates


def test_a_vocabulary_that_is_not_a_multiple_of_the_blocks_and_masked_rows():
    """An odd vocabulary (one block, no 16-token blocks) and a row whose every token but two is
    masked (as a structured-output constraint leaves it): only those two come, in proportion."""
    draws = 20_000
    logits = torch.full((37,), float("-inf"))
    logits[5], logits[30] = 1.0, 0.0
    params = SamplingParams(max_tokens=1, temperature=1.0)
    freq = frequencies(logits, params, draws)
    assert_matches(freq, reference(logits, params), draws)
    assert set(torch.nonzero(freq).flatten().tolist()) == {5, 30}


def test_the_sampled_and_greedy_rows_of_one_step():
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=1.0),
              SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.7, top_k=3)]
    tokens, _ = sampler.sample(logits, seqs_for(params, seed=3))
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()
    assert tokens[1] == sampler.draw(logits, [1], seqs_for(params, seed=3))[0]
    assert tokens[3] in logits[3].topk(3).indices.tolist()


def test_logprobs_of_rows_asking_for_different_counts_in_one_step(ops):
    """Each row's chosen token's log-probability and its own number of alternatives, most likely
    first, from the model's log-softmax; rows that ask for none get none."""
    torch.manual_seed(2)
    logits = torch.randn(5, 200) * 2
    params = [SamplingParams(max_tokens=1, logprobs=3), SamplingParams(max_tokens=1),
              SamplingParams(max_tokens=1, temperature=0.8, logprobs=0),
              SamplingParams(max_tokens=1, logprobs=7), SamplingParams(max_tokens=1, temperature=1.0, logprobs=1)]
    tokens, out = sampler.sample(logits, seqs_for(params, seed=9), (), ops)
    want = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    for i, k in ((0, 3), (2, 0), (3, 7), (4, 1)):
        lp = out[i]
        assert lp is not None and lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-6)
        top = want[i].topk(k) if k else None
        assert [t for t, _ in lp.top] == ([] if top is None else top.indices.tolist())
        assert [v for _, v in lp.top] == pytest.approx([] if top is None else top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("vocab", [2048, 49152, 50257, 3000, 100])
def test_first_argmax_is_torchs_argmax(vocab):
    """The blocked argmax picks torch's index on every row: ties within a block and across blocks
    (the first wins), the largest in a short tail block, rows masked to -inf but one, a NaN."""
    from prefix_service.engine.sampler import first_argmax
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(12, vocab, generator=g)
    rows[1, [5, vocab - 1]] = 50.0  # a tie across blocks: the first
    rows[2, vocab - 1] = 60.0  # the largest in the last (possibly short) block
    rows[3] = float("-inf")
    rows[3, vocab // 2] = 0.0
    rows[4] = 7.0  # every value equal: index 0
    rows[5, [vocab // 3, vocab // 3 + 1]] = 40.0  # a tie within a block
    rows[6, vocab - 2] = float("nan")
    rows[7, 0] = 30.0
    rows[8] = torch.round(rows[8])  # many ties among small integers
    got = first_argmax(rows)
    assert torch.equal(got, rows.argmax(dim=-1)), (got, rows.argmax(dim=-1))
    assert torch.equal(first_argmax(rows[::2]), rows[::2].argmax(dim=-1))  # rows not contiguous
    assert got[1] == 5 and got[2] == vocab - 1 and got[4] == 0 and got[5] == vocab // 3
