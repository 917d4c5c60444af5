"""Int8 weights (model.quantization: int8, model/quantize.py): the quantizer's arithmetic, the cpu
backend's int8 few-row kernel against the exact products, and engines with int8 weights against
transformers running the same dequantized weights and against themselves without a template.

- quantize_int8: symmetric per output row, q in -127 .. 127, |W - q scale| <= scale / 2.
- The bf16 kernel (ps_onednn_pack's q): each output is round_bf16(scale sum(round_bf16(x) q) + bias)
  up to the order of the float32 sums, for 1 to 128 rows; a call of more rows multiplies the
  handle's bf16 copy, bit for bit the plain bf16 linear over it.
- An engine in float32 with int8 weights gives transformers' greedy ids and logits on a
  checkpoint holding q diag(scale) (the torch and cpu backends); in bfloat16 its greedy ids on a
  template equal those without one, or first differ at a near tie.
"""
import logging

import pytest
import torch

from helpers import dequantized_checkpoint, engine_last_logits, hf_greedy, run_ids
from test_cpu_bf16 import assert_templates_equal_no_template, needs_bf16
from test_cpu_onednn import (DOT_ROWS, FEW_ROWS, assert_nan_stays_in_its_row, assert_rows_independent_of_the_call,
                             assert_same_bits_on_threads, needs_few_rows)
from prefix_service import CacheConfig, EngineConfig, ModelConfig, cpuinfo
from prefix_service.backends.cpu import linear, native, onednn
from prefix_service.config import ConfigError, load_config
from prefix_service.engine.snapshots import snapshot_key
from prefix_service.errors import ModelLoadError
from prefix_service.model.quantize import (dequantize, int8_weight, quantize_int8, quantize_model, quantized_linears,
                                           release_int8)

LOGITS_ATOL = 2e-3  # float32 against transformers, as tests/test_real_model.py
# the int8 few-row kernel is the few-row kernel over int8 blocks: where that one is packed
needs_int8_kernel = needs_few_rows


# --- the quantizer ------------------------------------------------------------------------------

def test_quantize_int8_is_symmetric_per_row_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0.0  # a row of zeros
    w[7, 3] = -w[7].abs().max() * 2  # the largest magnitude negative
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape and scale.shape == (37,)
    assert q.min() >= -127 and q.max() <= 127
    assert torch.equal(scale, w.abs().amax(1) / 127)
    assert scale[5] == 0 and not q[5].any()
    assert q[7, 3] == -127 and (q.abs().amax(1)[scale > 0] == 127).all()  # each row reaches the end of the range
    err = (w.double() - q.double() * scale.double()[:, None]).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize(q, scale, torch.float32), q.float() * scale[:, None])
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_int8_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int32))
    bad = torch.ones(2, 3)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(bad)


def test_quantize_model_replaces_each_decoder_linear(llama_dir):
    from prefix_service.model.loader import load_model
    model = load_model(llama_dir, torch.float32, torch.device("cpu"), 64)
    before = {name: m.weight.detach().clone() for name, m in quantized_linears(model)}
    head = model.embed_tokens.weight.detach().clone()
    assert quantize_model(model, "none") == 0 and all(int8_weight(m) is None for _, m in quantized_linears(model))
    layers = len(model.layers)
    assert quantize_model(model, "int8") == 4 * layers == len(before)
    for name, m in quantized_linears(model):
        q, scale = int8_weight(m)
        assert torch.equal(q, quantize_int8(before[name])[0]) and torch.equal(scale, quantize_int8(before[name])[1])
        assert torch.equal(m.weight, dequantize(q, scale, torch.float32))
        assert not torch.equal(m.weight, before[name])
    assert torch.equal(model.embed_tokens.weight, head)  # embeddings and the output head as loaded
    release_int8(model)  # what the engine does once its backend has packed them
    assert all(int8_weight(m) is None for _, m in quantized_linears(model))
    assert torch.equal(model.layers[0].mlp.down_proj.weight, dequantize(*quantize_int8(before["layers.0.mlp.down_proj"]),
                                                                        torch.float32))
    with pytest.raises(ValueError, match="quantization 'int4'"):
        quantize_model(model, "int4")
    broken = load_model(llama_dir, torch.float32, torch.device("cpu"), 64)
    with torch.no_grad():
        broken.layers[1].mlp.down_proj.weight[2, 3] = float("inf")
    with pytest.raises(ModelLoadError, match=r"cannot quantize layers\.1\.mlp\.down_proj\.weight: .*inf or NaN"):
        quantize_model(broken, "int8")


def test_quantize_model_keeps_a_bf16_models_weights_in_bf16(llama_dir):
    """A bfloat16 model's quantized linears hold q diag(scale) rounded once to bfloat16: the model keeps
    one dtype, as the backends that run it expect."""
    from prefix_service.model.loader import load_model
    model = load_model(llama_dir, torch.bfloat16, torch.device("cpu"), 64)
    assert quantize_model(model, "int8") == 4 * len(model.layers)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for _, m in quantized_linears(model):
        q, scale = int8_weight(m)
        assert torch.equal(m.weight, dequantize(q, scale, torch.bfloat16))


def test_model_quantization_is_checked_and_read_from_yaml(tmp_path, llama_dir):
    with pytest.raises(ConfigError, match="model.quantization: 'int4' is not one of none, int8"):
        ModelConfig(path=str(llama_dir), quantization="int4")
    assert ModelConfig(path=str(llama_dir)).quantization == "none"
    cfg = tmp_path / "service.yaml"
    cfg.write_text(f"model:\n  path: {llama_dir}\n  quantization: int8\n")
    assert load_config(cfg).engine.model.quantization == "int8"


def test_snapshots_of_int8_weights_are_their_own(llama_dir):
    """A template's K/V made with int8 weights must not load into an engine without them."""
    keys = {q: snapshot_key(EngineConfig(ModelConfig(path=str(llama_dir), quantization=q), CacheConfig()),
                            torch.device("cpu"), torch.float32) for q in ("none", "int8")}
    assert keys["none"].fingerprint != keys["int8"].fingerprint
    assert keys["none"].dtype == keys["int8"].dtype


# --- the int8 few-row kernel --------------------------------------------------------------------

def int8_case(m: int, n: int, k: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.01, 1.0, n)[:, None]
    q, scale = quantize_int8(w)
    x = torch.randn(m, k, generator=g) * 3
    b = torch.randn(n, generator=g) if bias else None
    return x, q, scale, b


def exact_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """scale sum(round_bf16(x) q) + round_bf16(b) in float64 (the products are exact)."""
    y = (x.bfloat16().double() @ q.double().T) * scale.double()
    return y + (b.bfloat16().double() if b is not None else 0.0)


def assert_int8_rounding(got: torch.Tensor, x, q, scale, b) -> None:
    """got is the exact result rounded to bf16, up to one bf16 step where float32 sums in another
    order may have crossed a rounding boundary (bounded by the sums' float32 error)."""
    want = exact_int8(x, q, scale, b)
    assert torch.equal(got, got.bfloat16().float())  # rounded to bf16
    sum_err = (x.bfloat16().double().abs() @ q.double().abs().T) * scale.double() * (q.shape[1] * 2.0 ** -24)
    excess = (got.double() - want).abs() - (2.0 ** -8 * want.abs() + sum_err + 1e-30)
    assert excess.max().item() <= 0, excess.max().item()


@needs_int8_kernel
@pytest.mark.parametrize("n,k", [(49, 37), (96, 576), (256, 72), (3072, 64), (5, 1)])
def test_the_int8_kernel_is_the_exact_product_rounded(n, k):
    """1 to DOT_ROWS rows through the int8 kernel (a pass of up to 8 rows, widening the int8 block once):
    the exact product rounded to bf16; from DOT_ROWS + 1 rows the handle's bf16 copy, exactly the plain linear
    over q diag(scale) in bf16; bits independent of the thread count; a NaN stays in its row."""
    x, q, scale, b = int8_case(DOT_ROWS + 6, n, k, seed=n + k)
    copy = dequantize(q, scale, torch.bfloat16)
    layer = onednn.OneDnnLinear(copy, b, kernel="inner_product", few_rows=True, int8=(q, scale))
    plain = onednn.OneDnnLinear(copy, b, kernel="inner_product", few_rows=False)
    assert layer.int8 and layer.few_rows == DOT_ROWS and f"int8 dot products up to {DOT_ROWS} rows" in repr(layer)
    for m in (1, 2, 3, 4, 7, 8, 9, 17, 100, DOT_ROWS - 1, DOT_ROWS, DOT_ROWS + 1, DOT_ROWS + 6):
        got = layer(x[:m])
        if m <= DOT_ROWS:
            assert_int8_rounding(got, x[:m], q, scale, b)
        else:
            assert torch.equal(got, plain(x[:m]))
    assert_rows_independent_of_the_call(layer, x)
    assert_same_bits_on_threads(layer, x, (1, 6, 40), (1, 2, 3))
    # the bf16 hand-offs the decoder stack makes give the same bits
    assert torch.equal(layer.rows_bf16(x[:5].bfloat16(), torch.float32), layer(x[:5].bfloat16().float()))
    assert_nan_stays_in_its_row(layer, x)


@needs_int8_kernel
def test_int8_weights_are_checked():
    x, q, scale, b = int8_case(2, 40, 24, seed=3)
    copy = dequantize(q, scale, torch.bfloat16)
    # the inner product, which packs the few-row kernel that reads them (on AMX the default times
    # brgemm against it and packs no few-row kernel)
    with pytest.raises(onednn.OneDnnError, match="int8: q int8"):
        onednn.OneDnnLinear(copy, b, kernel="inner_product", few_rows=True, int8=(q.float(), scale))
    with pytest.raises(onednn.OneDnnError, match="int8: q int8"):
        onednn.OneDnnLinear(copy, b, kernel="inner_product", few_rows=True, int8=(q, scale[:-1]))
    low = q.clone()
    low[3, 4] = -128
    with pytest.raises(onednn.OneDnnError, match="-128"):
        onednn.OneDnnLinear(copy, b, kernel="inner_product", few_rows=True, int8=(low, scale))


@needs_bf16
def test_without_the_few_row_kernel_int8_weights_run_as_their_bf16_copy():
    """Where the weight is not packed for the few-row kernel (brgemm, few_rows off, or a CPU without
    AVX512-BF16) int8 weights are not used: the layer is the plain bf16 linear over the copy."""
    x, q, scale, b = int8_case(5, 40, 24, seed=4)
    copy = dequantize(q, scale, torch.bfloat16)
    for kernel, few in (("brgemm", True), (None, False)):
        layer = onednn.OneDnnLinear(copy, b, kernel=kernel, few_rows=few, int8=(q, scale))
        assert not layer.int8 and "int8" not in repr(layer)
        assert torch.equal(layer(x), onednn.OneDnnLinear(copy, b, kernel=kernel, few_rows=few)(x))


# --- the float32 kernel over int8 weights --------------------------------------------------------

needs_native = pytest.mark.skipif(native.load()[1] is not None, reason=f"no native CPU kernels here: {native.load()[1]}")


def assert_float32_int8(got: torch.Tensor, x, q, scale, b) -> None:
    """got is (x q^T) scale + b up to float32 sums of K products (each term exact in float64)."""
    want = (x.double() @ q.double().T) * scale.double() + (b.double() if b is not None else 0.0)
    size = (x.double().abs() @ q.double().abs().T) * scale.double() + (b.double().abs() if b is not None else 0.0)
    excess = (got.double() - want).abs() - size * (q.shape[1] + 2) * 2.0 ** -24
    assert excess.max().item() <= 0, excess.max().item()


@needs_native
@pytest.mark.parametrize("n,k", [(49, 37), (96, 576), (70, 130), (3072, 64), (5, 1)])
def test_the_float32_kernel_over_int8_weights(n, k):
    """A float32 weight with (q, scale) holds only q (packed as the float32 kernel reads its panels)
    and every call, 1 to 100 rows, computes (x q^T) scale + b in float32; strided rows; bits
    independent of the thread count; a NaN stays in its row."""
    x, q, scale, b = int8_case(100, n, k, seed=n + 7 * k)
    layer = linear.NativeLinear(dequantize(q, scale, torch.float32), b, int8=(q, scale))
    assert layer.packed is None and layer.held.dtype == torch.int8
    assert layer.held.shape == (-(-n // linear.PANEL), k, linear.PANEL)
    for m in (1, 2, 5, 6, 7, 13, 16, 17, 64, 100):
        assert_float32_int8(layer(x[:m]), x[:m], q, scale, b)
    wide = torch.randn(9, k + 5)
    rows = wide[:, 2:2 + k]  # rows k + 5 apart
    out = torch.full((9, n + 3), 7.0)
    layer(rows, out=out[:, :n])
    assert_float32_int8(out[:, :n], rows, q, scale, b)
    assert (out[:, n:] == 7.0).all()
    assert_same_bits_on_threads(layer, x, (1, 7, 40), (1, 2, 3))
    assert_nan_stays_in_its_row(layer, x)
    with pytest.raises(native.NativeKernelError, match="int8: q int8"):
        linear.NativeLinear(dequantize(q, scale, torch.float32), b, int8=(q.to(torch.int16), scale))
    with pytest.raises(native.NativeKernelError, match=rf"x: \[M, {k}\] is needed"):  # the handle's K, not x's
        layer(torch.randn(3, k + 1))
    with pytest.raises(native.NativeKernelError, match=rf"out: float32 \[3, {n}\]"):
        layer(x[:3], out=torch.empty(3, n + 1))


@needs_native
def test_the_int8_kernel_built_for_avx2_agrees_with_this_build():
    """The same sources built for AVX2 + FMA alone (x86-64-v3, no AVX-512: what an AVX2 machine
    builds) run ps_linear_int8 to the same bound and agree with this machine's build."""
    import ctypes
    if not {"avx2", "fma"} <= set(cpuinfo.cpu_flags()):
        pytest.skip("this CPU cannot run an AVX2 build")
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native.FLAGS)
    path = native.compile_library(native.compiler(), "prefix_service_native_avx2_check", native.SOURCES, flags,
                                  key_parts=tuple(h.read_bytes() for h in native.HEADERS))
    lib = ctypes.CDLL(str(path))
    assert lib.ps_isa() == 256
    x, q, scale, b = int8_case(13, 70, 130, seed=5)
    packed = linear.pack_weight(q, torch.int8)
    got = torch.empty(13, 70)
    fn = lib.ps_linear_int8
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    assert fn(x.data_ptr(), 130, 13, 130, packed.data_ptr(), 70, scale.data_ptr(), b.data_ptr(), got.data_ptr(), 70,
              2) == 0
    assert_float32_int8(got, x, q, scale, b)
    here = linear.NativeLinear(dequantize(q, scale, torch.float32), b, int8=(q, scale))(x)
    assert torch.allclose(got, here, rtol=1e-5, atol=1e-5)


# --- engines with int8 weights ------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_int8_engine_matches_transformers_on_the_dequantized_weights(make_engine, model_dirs, tmp_path, backend,
                                                                     which, caplog):
    """Greedy ids and logits of transformers on the checkpoint rewritten to q diag(scale); a backend
    none of whose linears read int8 (torch's) says so at start."""
    if backend == "cpu" and native.load()[1] is not None:
        pytest.skip(f"no native CPU kernels here: {native.load()[1]}")
    ref_dir = dequantized_checkpoint(model_dirs[which], tmp_path / "dequantized")
    ids = [(11 * i + 5) % 500 + 3 for i in range(19)]
    want, want_logits = hf_greedy(ref_dir, ids, 16)
    with caplog.at_level(logging.WARNING, logger="prefix_service.engine"):
        engine = make_engine(model_dirs[which], dtype="float32", backend=backend, quantization="int8")
    assert engine.info.quantization == "int8"
    unread = [r.getMessage() for r in caplog.records if "no linear of this backend reads" in r.getMessage()]
    if backend == "cpu":  # the float32 kernel reads q in every call
        stack = engine._core.backend.stack
        assert stack.int8_linears == 4 * stack.num_layers == engine._core.backend.int8_linears
        assert f"int8 weights in {4 * stack.num_layers} linears" in engine.info.backend_description
        assert unread == []
    else:
        assert unread == ["model.quantization int8: no linear of this backend reads the int8 weights (torch); they "
                          "run as their values in float32, with int8's rounding and none of its speed"]
    assert run_ids(engine, ids, max_tokens=16) == want
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, want_logits, atol=LOGITS_ATOL, rtol=0), (logits - want_logits).abs().max()
    # and not the unquantized model's logits
    plain = hf_greedy(model_dirs[which], ids, 1)[1]
    assert (plain - want_logits).abs().max() > 10 * LOGITS_ATOL


@needs_bf16
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_int8_bf16_engine_on_a_template_equals_no_template(make_engine, model_dirs, which):
    """bf16 with int8 weights (the int8 kernel for calls of up to 128 rows where the CPU has
    AVX512-BF16): greedy ids on a pinned template equal those of the same ids without it, or first
    differ at a near tie (tests/test_cpu_bf16.py's NEAR_TIE)."""
    engine = make_engine(model_dirs[which], dtype="bfloat16", backend="cpu", quantization="int8")
    stack = engine._core.backend.stack
    # none on AMX, whose linears pack no few-row kernel (brgemm or the inner product, by timing)
    few_rows = FEW_ROWS and onednn.few_rows_default() and not onednn.brgemm_vnni()
    assert stack.int8_linears == (4 * stack.num_layers if few_rows else 0)
    assert ("int8 weights in" in engine._core.backend.describe()) == bool(stack.int8_linears)
    assert_templates_equal_no_template(engine, (3, 4, 9, 17), 20)
