"""model.batch_invariant: a request's tokens and log-probabilities are the same bits whether it runs
alone or beside others (a long prompt that is chunked with it, short ones decoding with it), on the
cpu backend. The float32 cases force what AVX2 CPUs run by default (the native kernel up to a row
count, oneDNN's inner product above, whose sums run in another order); bf16 runs where the CPU has a kernel for every call size (AMX or AVX512-BF16) and is refused,
naming why, where it has none; the torch backend is refused before any weight loads."""
from __future__ import annotations

import pytest
import torch

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.backends.cpu import linear, native, onednn
from prefix_service.config import ConfigError, ModelConfig, config_from_dict

PROBE = [9, 40, 77, 120, 301, 17]


def probe() -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=PROBE, sampling=SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4))


def crowd() -> list[GenerateRequest]:
    """A long prompt (several chunks of a 64-token step budget, so the probe's prefill shares steps
    with it) and short ones decoding beside the probe."""
    long = GenerateRequest(prompt_token_ids=[(7 * i) % 500 + 3 for i in range(150)],
                           sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    short = [GenerateRequest(prompt_token_ids=[11 + k] * (2 + k), sampling=SamplingParams(max_tokens=12, ignore_eos=True))
             for k in range(5)]
    return [long, *short[:2], probe(), *short[2:]]


def bits(out) -> tuple:
    """The probe's tokens and every log-probability it reports, as exact floats."""
    return tuple(out.token_ids), tuple((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs)


def alone_and_crowded(engine) -> tuple[tuple, tuple]:
    alone = bits(engine.generate([probe()])[0])
    crowded = bits(engine.generate(crowd())[3])
    return alone, crowded


@pytest.fixture
def split_float32(monkeypatch):
    """Float32 linears as AVX2 runs them: the native kernel up to 8 rows, oneDNN's inner product above."""
    if native.load()[0] is None or onednn.load()[0] is None:
        pytest.skip(f"the native and oneDNN libraries are both needed: {native.load()[1] or onednn.load()[1]}")
    monkeypatch.setenv(linear.FLOAT32_ENV, "inner_product")
    monkeypatch.setenv(linear.FLOAT32_ROWS_ENV, "8")


def test_the_option_is_read_from_yaml_and_checked():
    assert ModelConfig(path="m").batch_invariant is False
    cfg = config_from_dict({"model": {"path": "m", "batch_invariant": True}})
    assert cfg.engine.model.batch_invariant is True
    with pytest.raises(ConfigError, match=r"model\.batch_invariant: expected true or false, got 'yes'"):
        ModelConfig(path="m", batch_invariant="yes")


def test_float32_a_split_linear_depends_on_the_call_and_an_invariant_one_does_not(split_float32):
    """Each row's bits in a 300-row call and alone: SplitLinear takes oneDNN for the first and the
    native kernel for the second, whose sums run in another order; make_linear's invariant one stays native."""
    torch.manual_seed(0)
    w, x = torch.randn(256, 576), torch.randn(300, 576)
    split = linear.make_linear(w, native_rows=8)
    assert isinstance(split, linear.SplitLinear) and not torch.equal(split(x), one_by_one(split, x))
    one = linear.make_linear(w, native_rows=8, invariant=True)
    assert isinstance(one, linear.NativeLinear) and torch.equal(one(x), one_by_one(one, x))


def test_float32_engine_alone_and_crowded_give_the_same_bits(make_engine, split_float32):
    varying = make_engine(backend="cpu", max_num_batched_tokens=64)
    assert "the native kernel up to 8 rows, oneDNN's inner product above" in varying.info.backend_description
    invariant = make_engine(backend="cpu", max_num_batched_tokens=64, batch_invariant=True)
    assert "linears on the native kernel (batch invariant)" in invariant.info.backend_description
    alone, crowded = alone_and_crowded(invariant)
    assert alone == crowded
    assert alone == alone_and_crowded(invariant)[0]  # and run to run


def test_bf16_is_batch_invariant_where_a_kernel_serves_every_call_size_else_refused(make_engine):
    if native.load()[0] is None or onednn.load()[0] is None:
        pytest.skip(f"the native and oneDNN libraries are both needed: {native.load()[1] or onednn.load()[1]}")
    kernel, why = onednn.invariant_kernel()
    if kernel is None:
        with pytest.raises(ConfigError, match=r"model\.batch_invariant: bf16 linears run oneDNN's .*inner product "
                                              r"here .*; use model\.dtype: float32"):
            make_engine(backend="cpu", dtype="bfloat16", batch_invariant=True)
        return
    engine = make_engine(backend="cpu", dtype="bfloat16", max_num_batched_tokens=64, batch_invariant=True)
    assert f"batch invariant: {why}" in engine.info.backend_description
    alone, crowded = alone_and_crowded(engine)
    assert alone == crowded


def one_by_one(m, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([m(x[i:i + 1]) for i in range(x.shape[0])])


def test_a_bf16_weight_runs_one_kernel_for_every_call_size():
    """Each row of a 300-row call has the bits of the same row alone; the handle says which kernel. By
    default (AVX512-BF16) the call of 300 rows would leave the dot products for oneDNN's inner product."""
    if onednn.load()[0] is None:
        pytest.skip(f"no oneDNN library here: {onednn.load()[1]}")
    kernel, why = onednn.invariant_kernel()
    torch.manual_seed(0)
    w, b, x = torch.randn(256, 576).to(torch.bfloat16), torch.randn(256), torch.randn(300, 576)
    if kernel is None:
        with pytest.raises(onednn.OneDnnError, match="invariant: bf16 linears run oneDNN's"):
            onednn.OneDnnLinear(w, None, invariant=True)
        return
    m = onednn.OneDnnLinear(w, b, invariant=True)
    assert (m.kernel, m.few_rows) == (("brgemm", 0) if kernel == "brgemm" else ("inner_product",
                                                                                 onednn.FEW_ROWS_EVERY_CALL))
    assert torch.equal(m(x), one_by_one(m, x))
    if kernel == "dot":
        default = onednn.OneDnnLinear(w, b, kernel="inner_product", few_rows=True)
        assert default.few_rows == 128 and not torch.equal(default(x), one_by_one(default, x))
        assert torch.equal(m(x[:100]), default(x[:100]))  # the same kernel where the default takes it


def test_a_bf16_brgemm_weight_runs_brgemm_for_every_call_size():
    """The kernel AMX takes for batch invariance, here on torch's fallback GEMM where there is no AMX."""
    if onednn.load()[0] is None:
        pytest.skip(f"no oneDNN library here: {onednn.load()[1]}")
    m = onednn.OneDnnLinear(torch.randn(96, 64).to(torch.bfloat16), torch.randn(96), kernel="brgemm")
    x = torch.randn(300, 64)
    assert torch.equal(m(x), one_by_one(m, x))


def test_a_float32_onednn_weight_refuses_invariance():
    if onednn.load()[0] is None:
        pytest.skip(f"no oneDNN library here: {onednn.load()[1]}")
    with pytest.raises(onednn.OneDnnError, match="oneDNN's float32 inner product depends on a call's rows"):
        onednn.OneDnnLinear(torch.randn(8, 8), None, invariant=True)


def test_the_torch_backend_is_refused_before_the_weights_load(make_engine, monkeypatch):
    import prefix_service.engine.core as core
    monkeypatch.setattr(core, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    with pytest.raises(ConfigError, match=r"model\.batch_invariant: the torch backend runs torch's matrix products"):
        make_engine(backend="torch", batch_invariant=True)


def test_make_linear_and_a_bf16_invariant_engines_head_give_a_row_the_same_bits_in_any_call(make_engine, tmp_path,
                                                                                          tokenizer_dir):
    """make_linear's bf16 weight with invariant set, and the output head of an engine with
    model.batch_invariant (whose calls take a row per sampled sequence, and every prompt row for a
    prompt's logprobs): each row of a 300-row call has the bits of the same row alone. The model is
    576 wide, as SmolLM2 is: at that width a 300-row call on the default kernels sums in another order."""
    from prefix_service import synthetic
    if native.load()[0] is None or onednn.load()[0] is None:
        pytest.skip(f"the native and oneDNN libraries are both needed: {native.load()[1] or onednn.load()[1]}")
    if onednn.invariant_kernel()[0] is None:
        pytest.skip(f"no bf16 kernel serves every call size here: {onednn.invariant_kernel()[1]}")
    torch.manual_seed(0)
    m = linear.make_linear(torch.randn(256, 576).to(torch.bfloat16), invariant=True)
    x = torch.randn(300, 576)
    assert torch.equal(m(x), one_by_one(m, x))
    model = synthetic.build_model(tmp_path / "wide", "llama", tokenizer_dir, seed=5, hidden_size=576,
                                  num_attention_heads=9, num_key_value_heads=3)
    head = make_engine(model, backend="cpu", dtype="bfloat16", batch_invariant=True)._core.backend.head
    x = torch.randn(300, head.in_features)
    assert torch.equal(head(x), one_by_one(head, x))
