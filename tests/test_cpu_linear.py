"""The cpu backend's linear kernel (backends/cpu/linear.py): it equals x W^T + b computed in float64
for any row count, output width (partial panels, partial groups) and input width, strided rows
and both ways of sharing the work among threads; a row's result is the same bit for bit whatever
the other rows of the call and the thread count; bad input gets a clear error; the shared native
library's build (native.py) reports a compiler error and is cached; its entry points' status codes
are named by one decoder (native.check). (The engine on it: test_backends.py.)"""
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers import cpu_simd
from prefix_service.backends.cpu import linear as cpu_linear
from prefix_service.backends.cpu import native, onednn
from prefix_service.backends.cpu.native import NativeKernelError

REASON = cpu_linear.available(torch.float32)
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU linear here: {REASON}")


def test_kernel_is_available_wherever_it_can_be_built():
    """A compiler and a CPU with AVX-512 or AVX2: the kernel must build and load, with the vector
    width the CPU has (a skip elsewhere must not hide a broken build here); otherwise the reason
    names what is missing."""
    if native.compiler() is not None and cpu_simd():
        assert REASON is None
        assert native.isa() == cpu_simd()
    else:
        assert REASON and ("compiler" in REASON or "AVX" in REASON or "x86-64" in REASON)
    assert "float16" in cpu_linear.available(torch.float16)  # float32 and bfloat16 are served


def case(m, n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5,
            torch.randn(n, generator=g) if bias else None)


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def close(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= 2e-5 * max(1.0, want.abs().max().item()), err


def test_pack_weight_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = cpu_linear.pack_weight(w)
    assert p.shape == (2, 3, 16) and p.is_contiguous()
    assert torch.equal(p[0], w[:16].t()) and torch.equal(p[1, :, :4], w[16:].t())
    assert not p[1, :, 4:].any()  # columns past N are zeros


@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 100, 301])
@pytest.mark.parametrize("n,k", [(1, 7), (16, 64), (17, 33), (50, 8), (64, 576), (200, 96), (1000, 64)])
def test_equals_float64(m, n, k):
    """Row tails (M mod 6), panel tails (N mod 16), groups of 1-4 panels, by panels or by rows."""
    x, w, b = case(m, n, k, bias=(m + n) % 2 == 0, seed=m * 1000 + n)
    close(cpu_linear.NativeLinear(w, b)(x), reference(x, w, b))


@needs_native
def test_large_inputs_in_row_chunks():
    """x larger than a row chunk (1 MiB): the rows run in chunks over the same panels."""
    x, w, b = case(700, 96, 1536, seed=3)
    close(cpu_linear.NativeLinear(w, b)(x), reference(x, w, b))


@needs_native
def test_strided_rows_leading_dims_and_out():
    x, w, b = case(9, 40, 24)
    wide = torch.randn(9, 50)
    wide[:, 3:27] = x
    strided = wide[:, 3:27]
    assert not strided.is_contiguous()
    layer = cpu_linear.NativeLinear(w, b)
    close(layer(strided), reference(x, w, b))
    close(layer(x.view(3, 3, 24)).view(9, 40), reference(x, w, b))
    out = torch.full((9, 48), 7.0)
    cpu_linear.linear(x, layer.packed, 40, layer.bias, out=out[:, :40])
    close(out[:, :40], reference(x, w, b))
    assert (out[:, 40:] == 7.0).all()  # nothing written past the row's N outputs
    assert layer(x[:0]).shape == (0, 40)


@needs_native
@pytest.mark.parametrize("n", [48, 900])  # work split by rows (few panels) and by panels
def test_rows_do_not_depend_on_the_batch_or_threads(n):
    x, w, b = case(150, n, 80, seed=5)
    layer = cpu_linear.NativeLinear(w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(layer(x[37:38]), two[37:38])  # alone, as in decode
    assert torch.equal(layer(x[11:20]), two[11:20])


@needs_native
def test_bad_input_is_refused():
    x, w, b = case(4, 20, 8)
    layer = cpu_linear.NativeLinear(w, b)
    with pytest.raises(NativeKernelError, match="float32 CPU tensor"):
        cpu_linear.linear(x.double(), layer.packed, 20)
    with pytest.raises(NativeKernelError, match="dense rows"):
        cpu_linear.linear(x.t().contiguous().t(), layer.packed, 20)
    with pytest.raises(NativeKernelError, match="does not hold 33 x 8"):
        cpu_linear.linear(x, layer.packed, 33)
    with pytest.raises(NativeKernelError, match="does not hold 20 x 9"):
        cpu_linear.linear(torch.randn(4, 9), layer.packed, 20)
    with pytest.raises(NativeKernelError, match="bias"):
        cpu_linear.linear(x, layer.packed, 20, bias=torch.zeros(19))
    with pytest.raises(NativeKernelError, match="out"):
        cpu_linear.linear(x, layer.packed, 20, out=torch.empty(4, 19))
    # the layer itself (the output head's path)
    with pytest.raises(NativeKernelError, match="does not hold 20 x 9"):
        layer(torch.randn(4, 9))
    with pytest.raises(NativeKernelError, match="float32 CPU tensor"):
        layer(x.double())
    with pytest.raises(NativeKernelError, match=r"out: float32 \[4, 20\]"):
        layer(x, out=torch.empty(4, 19))


@needs_native
def test_a_bias_or_out_the_kernel_cannot_read_as_dense_float32_is_refused():
    """The kernel reads the bias as float32 [N] and writes out's rows as dense float32: a bias of another
    dtype or a strided one, or an out whose columns are strided, is refused rather than misread."""
    x, w, b = case(4, 20, 8)
    layer = cpu_linear.NativeLinear(w, b)
    with pytest.raises(NativeKernelError, match=r"bias: float32 \[20\] is needed, got torch.float64"):
        cpu_linear.linear(x, layer.packed, 20, bias=b.double())
    with pytest.raises(NativeKernelError, match=r"bias: float32 \[20\] is needed"):
        cpu_linear.linear(x, layer.packed, 20, bias=torch.zeros(40)[::2])
    with pytest.raises(NativeKernelError, match="dense rows"):
        cpu_linear.linear(x, layer.packed, 20, out=torch.empty(20, 4).t())
    with pytest.raises(NativeKernelError, match="dense rows"):
        layer(x, out=torch.empty(20, 4).t())


# --- float32 weights of bf16 values, held in bf16 (a bf16 checkpoint served in float32) --------------

def bf16_values(w):
    return w.to(torch.bfloat16).float()


def test_pack_weight_bf16_layout():
    """Rows k and k + 1 of a panel side by side per column; zeros past N and past an odd K."""
    w = bf16_values(torch.randn(20, 5))
    p = cpu_linear.pack_weight_bf16(w)
    assert p.shape == (2, 3, 16, 2) and p.dtype == torch.bfloat16 and p.is_contiguous()
    for k in range(5):
        assert torch.equal(p[0, k // 2, :, k % 2].float(), w[:16, k])
        assert torch.equal(p[1, k // 2, :4, k % 2].float(), w[16:, k])
    assert not p[1, :, 4:].float().any() and not p[:, 2, :, 1].float().any()


def test_bf16_valued_is_exact():
    w = bf16_values(torch.randn(30, 7))
    assert cpu_linear.bf16_valued(w) and cpu_linear.bf16_valued(w.t())  # strided too
    w[3, 4] = 1 + 2 ** -10  # one value between two bf16 ones
    assert not cpu_linear.bf16_valued(w)
    assert not cpu_linear.bf16_valued(torch.randn(4, 4).to(torch.bfloat16))  # only float32 weights are held so


@needs_native
def test_a_value_between_two_bf16_ones_keeps_float32_panels():
    """A float32 value whose bits past bf16's are only the first one (exactly half way between two bf16
    values) is not a bf16 one: the weight keeps float32 panels and the kernel gives its exact product."""
    x, w, b = case(5, 40, 24, seed=3)
    w = bf16_values(w)
    w[7, 5] = 1 + 2 ** -8
    assert not cpu_linear.bf16_valued(w)
    layer = cpu_linear.NativeLinear(w, b)
    assert not layer.bf16_panels
    assert torch.equal(layer(x), cpu_linear.NativeLinear(w, b, panels="float32")(x))
    close(layer(x), reference(x, w, b))


@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 24, 33, 100, 301])
@pytest.mark.parametrize("n,k", [(1, 7), (17, 33), (50, 8), (64, 576), (200, 96), (1000, 65)])
def test_bf16_panels_give_the_float32_panels_bits(m, n, k):
    """The same products in the same order from half the bytes: every bit equal to the float32 panels',
    odd K (a pair's lone row), row and panel tails, both ways of sharing the work, with and without a bias;
    from 24 rows on the AVX-512 kernel's tiles of 12 rows, with 1-11 rows left over (33: 6 and 3)."""
    x, w, b = case(m, n, k, bias=(m + n) % 2 == 1, seed=m * 1000 + n + 1)
    w = bf16_values(w)
    held = cpu_linear.NativeLinear(w, b)
    plain = cpu_linear.NativeLinear(w, b, panels="float32")
    assert held.bf16_panels and held.packed is None and not plain.bf16_panels
    assert held.weight_bytes == 2 * -(-n // 16) * 16 * (k + k % 2) and plain.weight_bytes == 4 * -(-n // 16) * 16 * k
    got = held(x)
    assert torch.equal(got, plain(x))
    close(got, reference(x, w, b))


@needs_native
def test_bf16_panels_strided_rows_out_and_threads():
    x, w, b = case(150, 900, 81, seed=8)
    w = bf16_values(w)
    held, plain = cpu_linear.NativeLinear(w, b), cpu_linear.NativeLinear(w, b, panels="float32")
    wide = torch.randn(150, 100)
    wide[:, 5:86] = x
    out = torch.full((150, 910), 7.0)
    held(wide[:, 5:86], out=out[:, :900])
    assert torch.equal(out[:, :900], plain(x)) and (out[:, 900:] == 7.0).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = held(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, out[:, :900]) and torch.equal(held(x[37:38]), one[37:38])
    assert held(x.view(10, 15, 81)).shape == (10, 15, 900) and held(x[:0]).shape == (0, 900)
    with pytest.raises(NativeKernelError, match=r"x: \[M, 81\] is needed"):
        held(torch.randn(3, 9))
    with pytest.raises(NativeKernelError, match="float32 CPU tensor"):
        held(x.double())


@needs_native
def test_a_weight_with_other_values_keeps_float32_panels(monkeypatch):
    """bf16 panels only where they lose nothing; PREFIX_SERVICE_F32_PANELS=float32 keeps float32 ones for
    every weight; a wrong value says what is expected."""
    x, w, b = case(5, 40, 24, seed=2)
    assert not cpu_linear.NativeLinear(w, b).bf16_panels  # randn: not bf16 values
    close(cpu_linear.NativeLinear(w, b)(x), reference(x, w, b))
    monkeypatch.setenv(cpu_linear.F32_PANELS_ENV, "float32")
    assert not cpu_linear.NativeLinear(bf16_values(w), b).bf16_panels
    monkeypatch.setenv(cpu_linear.F32_PANELS_ENV, "auto")
    assert cpu_linear.NativeLinear(bf16_values(w), b).bf16_panels
    monkeypatch.setenv(cpu_linear.F32_PANELS_ENV, "bf16")
    with pytest.raises(native.NativeSettingError,
                       match=r"PREFIX_SERVICE_F32_PANELS='bf16': one of auto, float32 is needed"):
        cpu_linear.NativeLinear(bf16_values(w), b)


# --- float32 weights split by row count between the native kernel and oneDNN (SplitLinear) ---------

ONEDNN_REASON = REASON or onednn.load()[1]
needs_onednn = pytest.mark.skipif(ONEDNN_REASON is not None, reason=f"no oneDNN linear here: {ONEDNN_REASON}")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_a_split_linear_runs_each_call_on_the_kernel_of_its_row_count(bias):
    """Up to native_rows rows: the native kernel's bits; more: oneDNN's float32 inner product's; both
    within float32 summation error of float64, through the decoder stack's call path, strided rows
    and `out` included. (The two kernels may sum in the same order, as they do on AVX2 for K up to
    ~1,000 without a bias: the side each call takes is checked below on two different weights.)"""
    x, w, b = case(40, 70, 1536, bias=bias, seed=9)
    split = cpu_linear.make_linear(w, b, native_rows=6)
    assert isinstance(split, cpu_linear.SplitLinear) and split.native_rows == 6 and not split.int8
    few, many = cpu_linear.NativeLinear(w, b), onednn.OneDnnLinear(w, b)
    for m in (1, 5, 6, 7, 40):
        got = split(x[:m])
        assert torch.equal(got, (few if m <= 6 else many)(x[:m])), m
        close(got, reference(x[:m], w, b))
    wide = torch.randn(40, 1600)
    wide[:, 3:1539] = x
    out = torch.full((40, 90), 7.0)
    split(wide[:, 3:1539], out=out[:, :70])
    assert torch.equal(out[:, :70], many(x)) and (out[:, 70:] == 7.0).all()
    assert split(x[:0]).shape == (0, 70)
    assert split(x.view(4, 10, 1536)).shape == (4, 10, 70)
    with pytest.raises(NativeKernelError, match=r"x: \[M, 1536\] is needed"):
        split(torch.randn(3, 9))
    with pytest.raises(NativeKernelError, match="1 or more is needed"):
        cpu_linear.SplitLinear(w, b, 0)


@needs_onednn
def test_a_split_linear_holds_a_weight_of_bf16_values_in_bf16_for_its_few_rows():
    """Its native side on bf16 panels (the float32 panels' bits), oneDNN's on the float32 weight."""
    x, w, b = case(40, 70, 1536, seed=9)
    w = bf16_values(w)
    split = cpu_linear.make_linear(w, b, native_rows=6)
    assert isinstance(split, cpu_linear.SplitLinear) and split.few.bf16_panels
    plain, many = cpu_linear.NativeLinear(w, b, panels="float32"), onednn.OneDnnLinear(w, b)
    for m in (1, 6):
        assert torch.equal(split(x[:m]), plain(x[:m])), m
    for m in (7, 40):
        assert torch.equal(split(x[:m]), many(x[:m])), m


@needs_onednn
def test_a_split_linear_sends_calls_above_its_rows_to_the_other_side():
    """The C dispatch (ps_split_linear) alone: with its `many` side pointed at a layer of another
    weight, calls of up to native_rows rows give the first weight's product and larger ones the other's."""
    x, w, b = case(12, 24, 32, seed=4)
    split = cpu_linear.SplitLinear(w, b, 3)
    other = cpu_linear.NativeLinear(-2 * w, b)
    split._args.many = other.call
    for m in (1, 3):
        assert torch.equal(split(x[:m]), cpu_linear.NativeLinear(w, b)(x[:m]))
    for m in (4, 12):
        assert torch.equal(split(x[:m]), other(x[:m]))


@needs_onednn
def test_make_linear_takes_native_rows_for_float32_weights_only():
    w = torch.randn(20, 8)
    assert isinstance(cpu_linear.make_linear(w), cpu_linear.NativeLinear)
    library = cpu_linear.make_linear(w, native_rows=0)
    assert isinstance(library, onednn.OneDnnLinear) and library.kernel == "float32"
    assert isinstance(cpu_linear.make_linear(w, native_rows=3), cpu_linear.SplitLinear)
    q = torch.randint(-127, 128, (20, 8), dtype=torch.int8)
    int8 = cpu_linear.make_linear(q.float() * 0.01, int8=(q, torch.full((20,), 0.01)), native_rows=3)
    assert isinstance(int8, cpu_linear.NativeLinear) and int8.int8  # int8 weights: the native kernel's every call


def test_the_float32_kernel_and_its_rows_come_from_the_environment_or_say_what_is_wrong(monkeypatch):
    monkeypatch.setenv(cpu_linear.FLOAT32_ENV, "fast")
    with pytest.raises(NativeKernelError, match=r"PREFIX_SERVICE_F32_LINEAR='fast': one of native, inner_product, "
                                                r"measure is needed"):
        cpu_linear.float32_kernel()
    monkeypatch.setenv(cpu_linear.FLOAT32_ENV, "native")
    assert cpu_linear.float32_kernel() == "native"
    monkeypatch.setenv(cpu_linear.FLOAT32_ROWS_ENV, "-2")
    with pytest.raises(native.NativeSettingError, match=r"PREFIX_SERVICE_F32_NATIVE_ROWS='-2': a count of rows"):
        cpu_linear.float32_native_rows()
    monkeypatch.setenv(cpu_linear.FLOAT32_ROWS_ENV, "96")
    assert cpu_linear.float32_native_rows() == 96
    monkeypatch.setenv(cpu_linear.FLOAT32_ROWS_ENV, "0")
    assert cpu_linear.float32_native_rows() == 0
    monkeypatch.delenv(cpu_linear.FLOAT32_ROWS_ENV)
    assert cpu_linear.float32_native_rows() == cpu_linear.DEFAULT_NATIVE_ROWS == 128
    monkeypatch.delenv(cpu_linear.FLOAT32_ENV)
    # by default: the split where the native kernel is built for AVX2 (and oneDNN loads), else the native kernel
    for isa, want in (("avx2", "inner_product"), ("avx512", "native")):
        monkeypatch.setattr(native, "isa", lambda isa=isa: isa)
        assert cpu_linear.float32_kernel() == (want if onednn.load()[0] is not None else "native"), isa
    monkeypatch.setattr(onednn, "load", lambda: (None, "no C++ compiler found (set CXX)"))
    monkeypatch.setenv(cpu_linear.FLOAT32_ENV, "inner_product")
    with pytest.raises(NativeKernelError, match=r"=inner_product: no oneDNN library here: no C\+\+ compiler"):
        cpu_linear.float32_kernel()


# --- the native library's build (native.py) -------------------------------------------------------

def test_a_failed_build_reports_the_compiler_error(tmp_path, monkeypatch):
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setenv("PREFIX_SERVICE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match="compiling cpu_attention.cpp, broken.cpp failed: .*error"):
        native.build(cxx, (native.SOURCES[0], bad))
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left behind


def test_build_goes_to_the_cache_dir_and_is_reused(tmp_path, monkeypatch):
    cxx = native.compiler()
    if cxx is None or shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PREFIX_SERVICE_CACHE_DIR", str(tmp_path))
    first = native.build(cxx)
    assert first.parent == tmp_path and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert native.build(cxx) == first and first.stat().st_mtime_ns == stamp  # not built again


# --- the native library's status codes (native.check) ---------------------------------------------

@pytest.mark.parametrize("code,meaning", [
    (1, "the library was built without AVX-512 or AVX2"),
    (2, "unsupported head size or head counts"),
    (3, "out of memory"),
    (4, "a slot or block id outside the cache"),
    (5, "a linear layer's library failed: ps_onednn_linear: bad operands"),  # quoting the library's own reason
])
def test_each_status_is_named_with_the_entry_point(code, meaning):
    with pytest.raises(NativeKernelError, match=re.escape(f"ps_decoder_stack failed with status {code}: {meaning}")):
        native.check(code, "ps_decoder_stack", lambda: "ps_onednn_linear: bad operands")


def test_an_unknown_status_still_raises_with_its_number_and_zero_raises_nothing():
    with pytest.raises(NativeKernelError, match="ps_linear failed with status 17: a status the library does not"):
        native.check(17, "ps_linear")
    assert native.check(0, "ps_linear") is None


def test_a_library_that_cannot_be_used_raises_the_same_error_with_the_reason(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: (None, "no C++ compiler found (set CXX)"))
    with pytest.raises(NativeKernelError, match=re.escape("no C++ compiler found (set CXX)")):
        native.require()
