"""The sampler's native passes over logits (backends/cpu/sampling.py, csrc/cpu_sampling.cpp): each
row's k largest, sorted, equal values in index order, as a stable descending sort gives them; each
row's log-normaliser as torch's; a NaN as -inf in both; every split over threads the same."""
from __future__ import annotations

import pytest
import torch

from prefix_service.backends.cpu import native, sampling
from prefix_service.backends.cpu.native import NativeKernelError

REASON = native.load()[1]
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no native CPU library here: {REASON}")


def reference_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of a stable descending sort, NaN taken as -inf."""
    x = torch.where(x.isnan(), torch.tensor(float("-inf")), x)
    values, index = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k], index[:, :k]


def logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Model-like rows: a long tail, a few far above it, repeated values (ties), -inf (masked tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 2.0).round(decimals=1)  # many ties
    x[:, torch.randint(0, vocab, (max(1, vocab // 50),), generator=g)] += 9.0
    x[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    return x


@pytest.mark.parametrize("vocab", [1, 7, 16, 100, 1000, 4099, 49152])
def test_top_k_is_a_stable_descending_sorts_first_k(vocab):
    x = logits(5, vocab, seed=vocab)
    for k in sorted({1, min(vocab, 2), min(vocab, 50), min(vocab, 64), vocab // 3 or 1, vocab // 2 or 1, vocab}):
        values, index = sampling.top_k(x, k)
        want_v, want_i = reference_top_k(x, k)
        assert torch.equal(values, want_v), (vocab, k)
        assert torch.equal(index, want_i), (vocab, k)


def test_top_k_of_rows_with_nan_infinities_signed_zeros_and_few_finite_values():
    x = logits(6, 3000, seed=3)
    x[0, 17] = float("nan")  # counts as -inf
    x[1, :] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = float("-inf")
    x[3, 2900] = 1.0  # one finite value, the rest -inf in index order
    x[4, 10], x[4, 11] = -0.0, 0.0  # equal: index order
    x[4, 12:] = -1.0
    x[5, ::7] = float("nan")
    for k in (1, 3, 64, 700, 3000):
        values, index = sampling.top_k(x, k)
        want_v, want_i = reference_top_k(x, k)
        assert torch.equal(values, want_v), k
        assert torch.equal(index, want_i), k


def test_top_k_of_strided_rows_and_every_thread_count():
    full = logits(33, 2 * 5000, seed=4)
    x = full[:, 3:5003]  # rows 10,000 apart
    want = reference_top_k(x, 300)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            values, index = sampling.top_k(x, 300)
            assert torch.equal(values, want[0]) and torch.equal(index, want[1]), threads
    finally:
        torch.set_num_threads(before)


def test_logsumexp_is_torchs():
    x = logits(9, 49152, seed=5)
    x[0] = torch.randn(49152) * 30  # large spread
    x[1] = 80.0  # e^80 over and over: the sum past float32, its log not
    got = sampling.logsumexp(x)
    want = x.double().logsumexp(-1)
    assert ((got.double() - want).abs() <= 1e-5 * want.abs().clamp(min=1.0)).all(), (got.double() - want).abs().max()


def test_logsumexp_of_rows_of_infinities_and_nan():
    x = torch.zeros(4, 100)
    x[0] = float("-inf")
    x[1, 3] = float("inf")
    x[2, 4] = float("nan")  # counts as -inf: the row's other 99 zeros
    x[3, :] = float("nan")
    got = sampling.logsumexp(x)
    assert got[0].item() == float("-inf") and got[1].item() == float("inf")
    assert got[2].item() == pytest.approx(torch.tensor(99.0).log().item(), abs=1e-6)
    assert got[3].item() == float("-inf")


def test_bad_operands_are_refused_with_the_reason():
    x = torch.randn(2, 10)
    with pytest.raises(NativeKernelError, match=r"k must be in \[1, 10\], got 0"):
        sampling.top_k(x, 0)
    with pytest.raises(NativeKernelError, match=r"k must be in \[1, 10\], got 11"):
        sampling.top_k(x, 11)
    with pytest.raises(NativeKernelError, match="float32 CPU rows"):
        sampling.top_k(x.double(), 3)
    with pytest.raises(NativeKernelError, match="float32 CPU rows"):
        sampling.logsumexp(x.t())
    with pytest.raises(NativeKernelError, match="at least one value"):
        sampling.logsumexp(torch.empty(2, 0))
    assert sampling.top_k(torch.empty(0, 10), 4)[0].shape == (0, 4)
    assert not sampling.usable(x.double()) and sampling.usable(x)


def test_the_cpu_backend_engine_samples_through_the_native_passes(make_engine, monkeypatch):
    """A cpu-backend engine hands its sampler the native passes (CpuBackend.sampler_ops): seeded
    top-p, top-k and plain-temperature requests in one batch take them, and draw the tokens the same
    engine draws with torch's passes."""
    from helpers import generate_together
    from prefix_service import GenerateRequest
    from prefix_service.backends.base import TORCH_SAMPLER_OPS
    from prefix_service.backends.cpu.backend import CpuBackend
    from prefix_service.sampling_params import SamplingParams

    assert CpuBackend.sampler_ops is sampling.NATIVE_SAMPLER_OPS
    options = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, top_k=20), dict(temperature=1.0),
               dict(temperature=0.7, top_k=50, top_p=0.8)]
    batch = [GenerateRequest(prompt_token_ids=[(13 * i + 7 * k) % 500 + 3 for i in range(6 + k)],
                             sampling=SamplingParams(max_tokens=12, seed=100 + k, ignore_eos=True, **options[k % 4]))
             for k in range(8)]
    calls = []
    real_top_k = sampling.top_k
    monkeypatch.setattr(sampling, "top_k", lambda x, k: calls.append(k) or real_top_k(x, k))
    engine = make_engine(backend="cpu")
    assert engine.info.backend == "cpu"
    native_ids = generate_together(engine, batch)
    assert calls and all(len(ids) == 12 for ids in native_ids)
    monkeypatch.setattr(CpuBackend, "sampler_ops", TORCH_SAMPLER_OPS)
    calls.clear()
    assert generate_together(engine, batch) == native_ids
    assert calls == []


def test_softmax_draw_picks_the_torch_samplers_tokens():
    """Each row's token from its whole softmax over its temperature: the token the sampler's torch
    draw (the inverse of the cumulative softmax, engine/sampler.py) picks for the same uniform, over
    model-like rows, for random uniforms and 0. Just below 1 the two sums' roundings decide which of
    the last tokens comes: one that can come (a finite logit)."""
    from prefix_service.engine.sampler import _inverse_cdf

    x = logits(64, 49152, seed=8)
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.5] * 16)
    g = torch.Generator().manual_seed(9)
    for uniform in (torch.rand(64, generator=g, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)):
        want = _inverse_cdf((x / temperature[:, None]).softmax(-1), uniform)
        assert torch.equal(sampling.softmax_draw(x, temperature, uniform), want)
    got = sampling.softmax_draw(x, temperature, torch.full((64,), 1.0 - 2.0 ** -40, dtype=torch.float64))
    assert x.gather(1, got[:, None]).isfinite().all()


def test_softmax_draw_never_picks_a_masked_token_and_keeps_to_the_first_largest_where_nothing_is_finite():
    x = torch.full((5, 300), float("-inf"))
    x[0, 7], x[0, 250] = 0.0, 0.0  # two equal tokens
    x[1, 40], x[1, 41] = 1.0, float("nan")  # NaN: never drawn
    x[3, 99] = float("inf")
    x[4, 12], x[4, 13] = float("nan"), float("nan")
    uniform = torch.tensor([0.25, 0.999, 0.5, 0.5, 0.5], dtype=torch.float64)
    got = sampling.softmax_draw(x, torch.ones(5), uniform).tolist()
    assert got[:2] == [7, 40]
    assert got[2] == 0 and got[3] == 99 and got[4] == 0  # no finite logit: the first largest (NaN as -inf)
    assert sampling.softmax_draw(x[:1], torch.ones(1), torch.tensor([0.75], dtype=torch.float64)).item() == 250
    with pytest.raises(NativeKernelError, match="temperatures must be positive"):
        sampling.softmax_draw(x, torch.zeros(5), uniform)
    with pytest.raises(NativeKernelError, match="a temperature and a uniform per row"):
        sampling.softmax_draw(x, torch.ones(4), uniform)
