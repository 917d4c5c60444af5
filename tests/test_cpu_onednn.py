"""The oneDNN linear library (backends/cpu/onednn.py): a float32 weight gives x W^T + b computed in
float64 for any row count, output and input width, strided rows; a bfloat16 weight gives the bf16
arithmetic (bf16 operands and bias, float32 sums, bf16 output) up to the order of the float32 sums,
and torch's own bf16 F.linear up to a rounding of the output, in each kernel (inner product,
emulated, brgemm) and in the few-row kernel (AVX512-BF16 dot products for calls of up to 128 rows),
which is packed where the CPU has AVX512-BF16 and gives the same bits on any thread count; the C
function behind `fn` is the call `__call__` makes; bad input gets an
error that names the problem; the weight is copied at pack time and the handle freed with the layer; a failed
build reports the compiler's error."""
import ctypes
import gc
import platform

import pytest
import torch
import torch.nn.functional as F

from prefix_service import cpuinfo
from prefix_service.backends.cpu import native, onednn

REASON = onednn.load()[1]
needs_lib = pytest.mark.skipif(REASON is not None, reason=f"no oneDNN linear library here: {REASON}")


def test_library_is_available_wherever_it_can_be_built():
    """Linux, a torch with oneDNN and a compiler: the library must build and load (a skip elsewhere
    must not hide a broken build here); otherwise the reason names what is missing."""
    if platform.system() == "Linux" and torch.backends.mkldnn.is_available() and native.compiler() is not None:
        assert REASON is None
    else:
        assert REASON and ("compiler" in REASON or "oneDNN" in REASON or "Linux" in REASON)


def case(m, n, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5,
            torch.randn(n, generator=g) if bias else None)


def close_f32(got, x, w, b):
    """float32 weight: within 1e-4 of the float64 product, relative to its largest output."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), err


def bf16_bounds(x, w, b):
    """(the exact product of the bf16-rounded operands and bias, a bound on float32 summation error)
    in float64. The products of bf16 values are exact in float32; a sum of k + 1 terms in float32,
    in any order, is within (k + 1) 2^-24 sum|terms| of the exact sum (doubled for slack)."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    bb = None if b is None else b.bfloat16().double()
    exact = F.linear(xb, wb, bb)
    terms = F.linear(xb.abs(), wb.abs(), None if bb is None else bb.abs())
    return exact, 2 * (x.shape[1] + 1) * 2.0 ** -24 * terms


def close_bf16(got, x, w, b):
    """got is a bf16 rounding (to nearest, within half an ulp: 2^-8 |got|) of some float32 sum of
    the bf16 products, within the summation bound of the exact one."""
    exact, sum_err = bf16_bounds(x, w, b)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert torch.equal(got, got.bfloat16().float())  # every output is a bf16 value
    excess = (got.double() - exact).abs() - (2.0 ** -8 * got.double().abs() + sum_err)
    assert excess.max().item() <= 0, excess.max().item()


@needs_lib
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("n,k", [(1, 7), (16, 64), (17, 40), (50, 8), (200, 96), (1000, 64)])
def test_float32_weight_equals_float64(m, n, k):
    x, w, b = case(m, n, k, bias=(m + n) % 2 == 0, seed=m * 1000 + n)
    layer = onednn.OneDnnLinear(w, b)
    assert (layer.in_features, layer.out_features, layer.dtype, layer.emulated) == (k, n, torch.float32, False)
    close_f32(layer(x), x, w, b)


# a bf16 weight's kernels under test: the machine's default, and brgemm on any machine (where its
# micro-kernel has no VNNI bf16, i.e. without AMX, the same blocks run through torch's fallback GEMM)
BF16_KERNELS = [None, "brgemm"]


@needs_lib
@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_strided_rows_out_and_no_rows(bias, kernel):
    x, w, b = case(9, 40, 24, bias=bias)
    wide = torch.randn(9, 50)
    wide[:, 3:27] = x
    strided = wide[:, 3:27]  # rows 50 floats apart
    assert not strided.is_contiguous()
    for weight, close in ((w, close_f32), (w.bfloat16(), close_bf16)):
        layer = onednn.OneDnnLinear(weight, b, kernel=kernel)
        close(layer(strided), x, w, b)
        out = torch.full((9, 48), 7.0)
        assert layer(strided, out=out[:, :40]).data_ptr() == out.data_ptr()
        close(out[:, :40], x, w, b)
        assert (out[:, 40:] == 7.0).all()  # nothing written past a row's N outputs
        close(layer(strided[4:5]), x[4:5], w, b)
        assert layer(x[:0]).shape == (0, 40)


@needs_lib
@pytest.mark.parametrize("kernel", BF16_KERNELS)
@pytest.mark.parametrize("m", [1, 5, 33, 64, 300])
@pytest.mark.parametrize("n,k", [(17, 40), (200, 96), (96, 1000), (40, 7)])
def test_bf16_weight_is_the_bf16_arithmetic(m, n, k, kernel):
    x, w, b = case(m, n, k, bias=(m + n) % 2 == 1, seed=m * 1000 + n + 1)
    layer = onednn.OneDnnLinear(w.bfloat16(), b, kernel=kernel)
    default = onednn.default_kernel()  # "measure" (AMX): what the timing chose
    want = kernel or (layer.timing.kernel if default == "measure" else default)
    assert layer.dtype == torch.bfloat16 and layer.kernel == want
    got = layer(x)
    close_bf16(got, x, w, b)
    # torch's own bf16 linear rounds its own float32 sums: the two outputs are each within half
    # an ulp of sums within the summation bound of the exact one
    theirs = F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()).double()
    _, sum_err = bf16_bounds(x, w, b)
    excess = (got.double() - theirs).abs() - (2.0 ** -8 * (got.double().abs() + theirs.abs()) + 2 * sum_err)
    assert excess.max().item() <= 0, excess.max().item()


@needs_lib
@pytest.mark.skipif(onednn.bf16_native(), reason="oneDNN runs bf16 natively here; the emulated mode is not used")
def test_emulated_mode_is_the_float32_product_of_rounded_operands():
    """Emulated: x, W and b rounded through bf16, the float32 product, the output rounded through
    bf16; the same packed float32 product gives the same sums, bit for bit."""
    x, w, b = case(37, 72, 56, seed=9)
    layer = onednn.OneDnnLinear(w.bfloat16(), b)
    assert layer.emulated
    rounded = onednn.OneDnnLinear(w.bfloat16().float(), b.bfloat16().float())
    want = rounded(x.bfloat16().float()).bfloat16().float()
    assert torch.equal(layer(x), want)


@needs_lib
def test_the_default_kernel_fits_the_machine():
    """On AMX each shape timed (brgemm, the inner product, or both by rows), else the bf16 inner
    product where torch's oneDNN supports bf16, else emulated; a float32 weight is oneDNN's float32."""
    want = "measure" if onednn.brgemm_vnni() else "inner_product" if onednn.bf16_native() else "emulated"
    assert onednn.default_kernel() == want
    layer = onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None)
    if want == "measure":
        assert layer.timing is not None and layer.kernel == layer.timing.kernel
    else:
        assert layer.kernel == want and layer.timing is None
    assert onednn.OneDnnLinear(torch.randn(8, 4), None, kernel="brgemm").kernel == "float32"
    if onednn.brgemm_vnni():  # AMX has the bf16 instructions the inner product needs too
        assert onednn.bf16_native()


@needs_lib
def test_amx_defaults_to_timing_the_kernels_and_the_environment_still_chooses(monkeypatch):
    """On AMX the default is to time brgemm against the inner product per shape (the tiles beat the
    few-row dot products there; which of the two wins depends on the rows); PREFIX_SERVICE_BF16_LINEAR
    still picks another. AMX simulated where torch refuses bf16 inner products: brgemm alone."""
    monkeypatch.delenv(onednn.KERNEL_ENV, raising=False)
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)
    bf16_native = onednn.bf16_native
    for has_units in (True, False):
        monkeypatch.setattr(onednn, "bf16_native", lambda n=has_units: n)
        assert onednn.default_kernel() == ("measure" if has_units else "brgemm")
    monkeypatch.setattr(onednn, "bf16_native", bf16_native)
    monkeypatch.setenv(onednn.KERNEL_ENV, "emulated")
    assert onednn.default_kernel() == "emulated"
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: False)
    monkeypatch.delenv(onednn.KERNEL_ENV)
    assert onednn.default_kernel() == ("inner_product" if onednn.bf16_native() else "emulated")


@needs_lib
def test_the_environment_chooses_the_default_kernel(monkeypatch):
    monkeypatch.setenv(onednn.KERNEL_ENV, "brgemm")
    assert onednn.default_kernel() == "brgemm"
    assert onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None).kernel == "brgemm"
    monkeypatch.setenv(onednn.KERNEL_ENV, "emulated")
    assert onednn.default_kernel() == "emulated"
    monkeypatch.setenv(onednn.KERNEL_ENV, "amx")
    with pytest.raises(onednn.OneDnnError,
                       match="PREFIX_SERVICE_BF16_LINEAR='amx': one of inner_product, emulated, brgemm, measure"):
        onednn.default_kernel()
    if not onednn.bf16_native():
        monkeypatch.setenv(onednn.KERNEL_ENV, "inner_product")
        with pytest.raises(onednn.OneDnnError, match="refuses bf16 inner products on this CPU"):
            onednn.default_kernel()


@needs_lib
@pytest.mark.skipif(not onednn.bf16_native(), reason="torch's oneDNN runs no bf16 inner product here")
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_brgemm_for_few_rows_beside_the_inner_product(rows, monkeypatch):
    """An inner-product weight with brgemm_rows: calls of up to that many rows give brgemm's bits,
    the others the inner product's (each kernel alone on the same weight), through both entry points
    (float32 rows and bf16 hand-offs); PREFIX_SERVICE_BF16_BRGEMM_ROWS sets the count by default, and
    the few-row kernel is not packed beside it."""
    x, w, b = case(90, 72, 100, seed=rows)
    wb = w.bfloat16()
    hybrid = onednn.OneDnnLinear(wb, b, kernel="inner_product", brgemm_rows=rows)
    alone = {"brgemm": onednn.OneDnnLinear(wb, b, kernel="brgemm"),
             "inner_product": onednn.OneDnnLinear(wb, b, kernel="inner_product", few_rows=False)}
    assert (hybrid.kernel, hybrid.brgemm_rows, hybrid.few_rows) == ("inner_product", rows, 0)
    assert hybrid.columns == onednn.DEFAULT_BRGEMM_COLUMNS and f"brgemm up to {rows} rows" in repr(hybrid)
    for m in sorted({1, rows, rows + 1, 90}):
        want = alone["brgemm" if m <= rows else "inner_product"]
        calls = onednn.brgemm_calls()
        got = hybrid(x[:m])
        assert onednn.brgemm_calls() == calls + (m <= rows), m  # the call ran where it should
        assert torch.equal(got, want(x[:m])), m
        assert torch.equal(hybrid.rows_bf16(x[:m]), want.rows_bf16(x[:m])), m
        close_bf16(got, x[:m], w, b)
    monkeypatch.setenv(onednn.BRGEMM_ROWS_ENV, str(rows))
    assert onednn.OneDnnLinear(wb, b, kernel="inner_product").brgemm_rows == rows
    assert onednn.OneDnnLinear(wb, b, kernel="brgemm").brgemm_rows == 0  # brgemm for every call already
    monkeypatch.setenv(onednn.BRGEMM_ROWS_ENV, "many")
    with pytest.raises(onednn.OneDnnSettingError, match="BRGEMM_ROWS='many': a count of rows, 0 or more"):
        onednn.OneDnnLinear(wb, b, kernel="inner_product")
    with pytest.raises(onednn.OneDnnError, match="brgemm_rows: 0 or more is needed, got -1"):
        onednn.OneDnnLinear(wb, b, kernel="inner_product", brgemm_rows=-1)


@needs_lib
@pytest.mark.parametrize("columns", [16, 48, 64])
def test_brgemm_blocks_of_any_width_are_the_bf16_arithmetic(columns, monkeypatch):
    """The brgemm kernel's block width (PREFIX_SERVICE_BF16_BRGEMM_COLUMNS) changes how the product
    is cut, not what it is: every width, with N not a multiple of it and fewer columns than one block,
    gives the bf16 arithmetic; through torch's fallback GEMM (no AMX) the same outputs as the default
    width bit for bit, and on AMX within the bound of two orders of the sums."""
    monkeypatch.setenv(onednn.COLUMNS_ENV, str(columns))
    for m, n, k in ((33, 200, 96), (5, 17, 40), (64, 300, 130)):
        x, w, b = case(m, n, k, bias=True, seed=m + n + columns)
        layer = onednn.OneDnnLinear(w.bfloat16(), b, kernel="brgemm")
        assert layer.columns == columns and f"{columns}-column blocks" in repr(layer)
        got = layer(x)
        close_bf16(got, x, w, b)
        monkeypatch.delenv(onednn.COLUMNS_ENV)
        default = onednn.OneDnnLinear(w.bfloat16(), b, kernel="brgemm")
        assert default.columns == onednn.DEFAULT_BRGEMM_COLUMNS and "column blocks" not in repr(default)
        other = default(x)
        if not onednn.brgemm_vnni():
            assert torch.equal(got, other)
        _, sum_err = bf16_bounds(x, w, b)
        excess = (got.double() - other.double()).abs() - (2.0 ** -8 * (got.double().abs() + other.double().abs())
                                                          + 2 * sum_err)
        assert excess.max().item() <= 0, excess.max().item()
        monkeypatch.setenv(onednn.COLUMNS_ENV, str(columns))


@needs_lib
@pytest.mark.parametrize("value", ["24", "0", "128", "256", "wide"])
def test_a_brgemm_block_width_that_is_not_whole_tiles_is_refused(value, monkeypatch):
    """One to four whole AMX tiles: oneDNN packs no wider block for them (a 256-column block failed
    to pack on AMX), so no machine takes one."""
    monkeypatch.setenv(onednn.COLUMNS_ENV, value)
    with pytest.raises(onednn.OneDnnError, match=f"PREFIX_SERVICE_BF16_BRGEMM_COLUMNS='{value}': 16, 32, 48 or 64"):
        onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None, kernel="brgemm")
    for columns in (40, 80):  # the width asked for by code
        with pytest.raises(onednn.OneDnnError, match=f"columns={columns}: 16, 32, 48 or 64"):
            onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None, kernel="brgemm", columns=columns)
    monkeypatch.delenv(onednn.COLUMNS_ENV)
    assert onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None, kernel="brgemm", columns=48).columns == 48
    monkeypatch.setenv(onednn.COLUMNS_ENV, value)
    # the other kernels and float32 weights have no blocks: the setting is not read
    assert onednn.OneDnnLinear(torch.randn(8, 4).bfloat16(), None, kernel="emulated").columns == 0
    assert onednn.OneDnnLinear(torch.randn(8, 4), None).columns == 0


@needs_lib
@pytest.mark.parametrize("kernel", ["inner_product", "emulated", "brgemm"])
def test_every_kernel_agrees_with_the_others(kernel):
    """Any kernel can be chosen on any machine (inner_product only where torch runs oneDNN's bf16):
    each is the bf16 arithmetic, and they differ from each other only in the order of the sums."""
    if kernel == "inner_product" and not onednn.bf16_native():
        pytest.skip("torch's oneDNN refuses bf16 inner products on this CPU")
    x, w, b = case(21, 70, 130, seed=11)
    got = onednn.OneDnnLinear(w.bfloat16(), b, kernel=kernel)(x)
    close_bf16(got, x, w, b)
    other = onednn.OneDnnLinear(w.bfloat16(), b, kernel="emulated")(x)
    _, sum_err = bf16_bounds(x, w, b)
    excess = (got.double() - other.double()).abs() - (2.0 ** -8 * (got.double().abs() + other.double().abs())
                                                      + 2 * sum_err)
    assert excess.max().item() <= 0, excess.max().item()


DOT_ROWS = 128  # the most rows a call runs on the few-row kernel (onednn_linear.cpp, kDotRows)
FEW_ROWS = onednn.load()[0] is not None and onednn.bf16_native() and "avx512_bf16" in cpuinfo.kernel_flags()
needs_few_rows = pytest.mark.skipif(not FEW_ROWS, reason="the few-row kernel needs AVX512-BF16 and torch's bf16 "
                                    "inner product; this CPU or torch has not both")


# the few-row kernel's reach where a weight is packed for it: every call on a Zen 4, else DOT_ROWS
DEFAULT_DOT_ROWS = onednn.FEW_ROWS_EVERY_CALL if cpuinfo.bf16_dots_lead_every_call() else DOT_ROWS


def default_dot_rows() -> str:
    """The calls the few-row kernel takes by default (as $PREFIX_SERVICE_BF16_FEW_ROWS says now), in the
    start-up line's words."""
    return "for every call" if onednn.few_rows_default() == onednn.FEW_ROWS_ALL else f"up to {DOT_ROWS} rows"


@needs_lib
def test_the_few_row_kernel_is_packed_where_the_cpu_has_avx512_bf16(monkeypatch):
    w = torch.randn(40, 24).bfloat16()
    monkeypatch.delenv(onednn.FEW_ROWS_ENV, raising=False)
    if onednn.bf16_native():
        layer = onednn.OneDnnLinear(w, None, kernel="inner_product")
        assert layer.few_rows == (DEFAULT_DOT_ROWS if FEW_ROWS else 0)
        words = "for every call" if DEFAULT_DOT_ROWS == onednn.FEW_ROWS_EVERY_CALL else f"up to {DOT_ROWS} rows"
        assert (f"dot products {words}" in repr(layer)) == FEW_ROWS
        assert onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=False).few_rows == 0
        assert onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=True).few_rows == (
            DOT_ROWS if FEW_ROWS else 0)
        every = onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=onednn.FEW_ROWS_ALL)
        assert every.few_rows == (onednn.FEW_ROWS_EVERY_CALL if FEW_ROWS else 0)
        assert ("dot products for every call" in repr(every)) == FEW_ROWS
        for value, rows in (("0", 0), ("1", DOT_ROWS), ("all", onednn.FEW_ROWS_EVERY_CALL)):
            monkeypatch.setenv(onednn.FEW_ROWS_ENV, value)
            assert onednn.OneDnnLinear(w, None, kernel="inner_product").few_rows == (rows if FEW_ROWS else 0), value
    # the other kernels and a float32 weight never take it
    for few in (True, onednn.FEW_ROWS_ALL):
        assert onednn.OneDnnLinear(w, None, kernel="brgemm", few_rows=few).few_rows == 0
        assert onednn.OneDnnLinear(w.float(), None, few_rows=few).few_rows == 0
    with pytest.raises(onednn.OneDnnError, match="few_rows: one of \\[0, 1, 2\\] is needed, got 3"):
        onednn.OneDnnLinear(w, None, few_rows=3)
    monkeypatch.setenv(onednn.FEW_ROWS_ENV, "yes")
    with pytest.raises(onednn.OneDnnSettingError, match="PREFIX_SERVICE_BF16_FEW_ROWS='yes': 1, 0 or all is needed"):
        onednn.OneDnnLinear(w, None, kernel="inner_product" if onednn.bf16_native() else "emulated")


@pytest.mark.parametrize("vendor,family,every_call", [
    ("AuthenticAMD", 25, True), ("AuthenticAMD", 26, False), ("AuthenticAMD", 23, False),
    ("GenuineIntel", 6, False), ("GenuineIntel", 25, False)])
def test_a_zen_4_runs_every_bf16_call_on_the_few_row_kernel(vendor, family, every_call, monkeypatch):
    """Unset, the few-row kernel's reach follows the CPU: every call on AMD's family 25 (Zen 4, whose
    dot products led oneDNN's inner product at every call size timed), calls of up to DOT_ROWS rows
    elsewhere (Zen 5 and Intel, where oneDNN leads on wide calls); the variable overrides the rule."""
    assert cpuinfo.bf16_dots_lead_every_call(vendor, family) == every_call
    monkeypatch.setattr(cpuinfo, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpuinfo, "cpu_family", lambda: family)
    monkeypatch.delenv(onednn.FEW_ROWS_ENV, raising=False)
    assert onednn.few_rows_default() == (onednn.FEW_ROWS_ALL if every_call else onednn.FEW_ROWS_SOME)
    monkeypatch.setenv(onednn.FEW_ROWS_ENV, "1")
    assert onednn.few_rows_default() == onednn.FEW_ROWS_SOME
    monkeypatch.setenv(onednn.FEW_ROWS_ENV, "all")
    assert onednn.few_rows_default() == onednn.FEW_ROWS_ALL
    if FEW_ROWS:
        monkeypatch.delenv(onednn.FEW_ROWS_ENV)
        layer = onednn.OneDnnLinear(torch.randn(40, 24).bfloat16(), None, kernel="inner_product")
        assert layer.few_rows == (onednn.FEW_ROWS_EVERY_CALL if every_call else DOT_ROWS)


@needs_lib
def test_the_env_report_names_the_calls_the_few_row_kernel_takes(monkeypatch):
    """`prefix-service env`'s bf16_dot_products: what a bf16 weight packed here would run on the few-row
    kernel, as OneDnnLinear packs it; none where the library has no dot products or another kernel
    takes every call."""
    monkeypatch.delenv(onednn.FEW_ROWS_ENV, raising=False)
    monkeypatch.delenv(onednn.KERNEL_ENV, raising=False)
    w = torch.randn(40, 24).bfloat16()
    if not FEW_ROWS:
        assert onednn.few_rows_choice().startswith("none (")
        return
    assert onednn.DOT_ROWS == onednn.OneDnnLinear(w, None, kernel="inner_product", few_rows=True).few_rows
    for value, want in (("0", "none (PREFIX_SERVICE_BF16_FEW_ROWS=0)"), ("1", f"calls of up to {DOT_ROWS} rows"),
                        ("all", "every call"), (None, "every call" if cpuinfo.bf16_dots_lead_every_call()
                                                 else f"calls of up to {DOT_ROWS} rows")):
        if value is None:
            monkeypatch.delenv(onednn.FEW_ROWS_ENV)
        else:
            monkeypatch.setenv(onednn.FEW_ROWS_ENV, value)
        assert onednn.few_rows_choice() == want, value
        rows = onednn.OneDnnLinear(w, None).few_rows
        assert rows == {"every call": onednn.FEW_ROWS_EVERY_CALL, "calls of up to 128 rows": DOT_ROWS}.get(want, 0)
    monkeypatch.setenv(onednn.KERNEL_ENV, "brgemm")
    assert onednn.few_rows_choice() == "none (bf16 linears: brgemm)"
    assert onednn.OneDnnLinear(w, None).few_rows == 0


def test_cpu_family_reads_proc_cpuinfo(monkeypatch):
    monkeypatch.setattr(cpuinfo, "first_field", lambda name: {"cpu family": "25"}.get(name))
    assert cpuinfo.cpu_family() == 25
    monkeypatch.setattr(cpuinfo, "first_field", lambda name: None)
    assert cpuinfo.cpu_family() is None
    monkeypatch.setattr(cpuinfo, "first_field", lambda name: {"cpu family": "?"}.get(name))
    assert cpuinfo.cpu_family() is None


@needs_few_rows
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(49, 37), (96, 576), (256, 72), (3072, 64)])
def test_the_few_row_kernel_agrees_with_the_inner_product(n, k, bias):
    """Calls of up to DOT_ROWS rows run the few-row kernel, more the inner product: both are the bf16
    arithmetic and differ only in the order of the sums; the few-row kernel splits a call by
    output columns, so its bits are the same on any number of threads (1 to 8 here, more than this
    machine may have); a NaN stays in its row."""
    x, w, b = case(DOT_ROWS + 6, n, k, bias=bias, seed=n + k)
    few = onednn.OneDnnLinear(w.bfloat16(), b, kernel="inner_product", few_rows=True)
    ip = onednn.OneDnnLinear(w.bfloat16(), b, kernel="inner_product", few_rows=False)
    for m in (1, 2, 3, 4, 5, 8, 9, 17, 100, DOT_ROWS - 1, DOT_ROWS, DOT_ROWS + 1, DOT_ROWS + 6):
        got, other = few(x[:m]), ip(x[:m])
        close_bf16(got, x[:m], w, b)
        _, sum_err = bf16_bounds(x[:m], w, b)
        excess = (got.double() - other.double()).abs() - (
            2.0 ** -8 * (got.double().abs() + other.double().abs()) + 2 * sum_err)
        assert excess.max().item() <= 0, (m, excess.max().item())
        if m > DOT_ROWS:
            assert torch.equal(got, other)  # the same kernel
    assert_rows_independent_of_the_call(few, x)
    assert_same_bits_on_threads(few, x, (1, 6, 40), (1, 2, 3, 8))
    assert_nan_stays_in_its_row(few, x)


def assert_same_bits_on_threads(layer, x, sizes, threads) -> None:
    """layer's outputs for x[:size], each size, are the same bits on each of these thread counts."""
    before = torch.get_num_threads()
    try:
        by_threads = []
        for count in threads:
            torch.set_num_threads(count)
            by_threads.append(torch.cat([layer(x[:size]) for size in sizes]))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(by_threads[0], t) for t in by_threads[1:])


def assert_rows_independent_of_the_call(layer, x) -> None:
    """A row's bits from the few-row kernel do not depend on the other rows of its call, whichever
    pass of 8 takes it: calls of the first 1, 5, 9 and 100 rows and of the last 3 give the bits of
    one call of x[:DOT_ROWS]."""
    whole = layer(x[:DOT_ROWS])
    for m in (1, 5, 9, 100):
        assert torch.equal(layer(x[:m]), whole[:m]), m
    assert torch.equal(layer(x[DOT_ROWS - 3:DOT_ROWS]), whole[-3:])


def assert_nan_stays_in_its_row(layer, x) -> None:
    """A NaN in the second of three rows makes that row's outputs NaN and no other's."""
    bad = x[:3].clone()
    bad[1, x.shape[1] // 2] = float("nan")
    y = layer(bad)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


@needs_lib
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_brgemm_split_runs_on_torchs_threads(threads):
    """The library's own parallel loops (the brgemm kernel's blocks) run on torch's OpenMP threads:
    built without OpenMP, ATen's parallel_for header runs them on the calling thread alone."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert onednn.threads_used(64) == threads
        assert onednn.threads_used(1) == 1
    finally:
        torch.set_num_threads(before)


@needs_lib
@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_fn_is_the_call_native_code_makes(kernel):
    x, w, b = case(6, 33, 20, seed=4)
    for weight in (w, w.bfloat16()):
        layer = onednn.OneDnnLinear(weight, b, kernel=kernel)
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
        out = torch.empty(6, 33)
        assert proto(layer.fn)(layer.handle, x.data_ptr(), 20, 6, out.data_ptr(), 33, 1) == 0
        assert torch.equal(out, layer(x))


# every bf16 kernel: the default (with the few-row kernel where it is packed, and then the inner
# product alone as well), brgemm, and emulated (any CPU runs it)
HAND_OFF_KERNELS = [None, "brgemm", "emulated"]


@needs_lib
@pytest.mark.parametrize("kernel", HAND_OFF_KERNELS)
@pytest.mark.parametrize("n,k", [(49, 37), (96, 64), (3072, 64)])
def test_bf16_hand_offs_are_the_float32_rows_bits(kernel, n, k):
    """The decoder stack hands a bf16 layer its rows already rounded to bf16, and takes the outputs
    still in bf16 (ps_onednn_linear_bf16, OneDnnLinear.rows_bf16): the same bits as the float32 rows
    the layer rounds and widens itself, at the row counts on either side of the few-row kernel's
    limit, with an odd K (the few-row kernel then pads its own copy of the rows) and with a bias."""
    x, w, b = case(DOT_ROWS + 6, n, k, seed=n + k, bias=True)
    layers = [onednn.OneDnnLinear(w.bfloat16(), b, kernel=kernel)]
    if kernel is None:
        layers.append(onednn.OneDnnLinear(w.bfloat16(), b, few_rows=False))
    for layer in layers:
        for m in (1, 3, 8, 9, DOT_ROWS - 1, DOT_ROWS, DOT_ROWS + 1, DOT_ROWS + 6):
            want = layer(x[:m])
            for rows in (x[:m], x[:m].bfloat16()):
                assert torch.equal(layer.rows_bf16(rows, torch.float32), want), (m, rows.dtype)
                got = layer.rows_bf16(rows)
                assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want), (m, rows.dtype)
    bad = x[:3].clone()
    bad[1, k // 2] = float("nan")
    y = layers[0].rows_bf16(bad.bfloat16())
    assert torch.isnan(y[1].float()).all() and not torch.isnan(y[[0, 2]].float()).any()


@needs_lib
def test_bf16_hand_offs_need_a_bf16_weight_and_good_rows():
    x, w, b = case(4, 8, 16, seed=3)
    with pytest.raises(onednn.OneDnnError, match="a bfloat16 weight is needed"):
        onednn.OneDnnLinear(w, b).rows_bf16(x)
    layer = onednn.OneDnnLinear(w.bfloat16(), b)
    with pytest.raises(onednn.OneDnnError, match=r"\[M, 16\] is needed"):
        layer.rows_bf16(x[:, :15])
    with pytest.raises(onednn.OneDnnError, match="out_dtype"):
        layer.rows_bf16(x, torch.float16)
    # native code calling a float32 weight's handle with bf16 rows gets an error, not a wrong product
    f32 = onednn.OneDnnLinear(w, b)
    lib = onednn.load()[0]
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    xb = x.bfloat16()
    assert lib.ps_onednn_linear_bf16(f32.handle, xb.data_ptr(), 1, 16, 4, out.data_ptr(), 1, 8, 1) == 5
    assert "need a bf16 weight" in lib.ps_onednn_last_error().decode()
    assert not f32.call.run_bf16 and layer.call.run_bf16


@needs_lib
@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_the_weight_is_copied(kernel):
    x, w, b = case(5, 24, 16, seed=2)
    for weight in (w.clone(), w.bfloat16()):
        layer = onednn.OneDnnLinear(weight, b, kernel=kernel)
        before = layer(x)
        weight.fill_(3.0)
        b_copy = b.clone()
        b.fill_(3.0)
        assert torch.equal(layer(x), before)
        b.copy_(b_copy)


@needs_lib
def test_bad_input_is_refused():
    x, w, b = case(4, 20, 8)
    layer = onednn.OneDnnLinear(w, b)
    with pytest.raises(onednn.OneDnnError, match="x: float32 is needed, got torch.bfloat16"):
        layer(x.bfloat16())
    with pytest.raises(onednn.OneDnnError, match=r"x: shape \[M, 8\] is needed, got \(4, 9\)"):
        layer(torch.randn(4, 9))
    with pytest.raises(onednn.OneDnnError, match=r"x: shape \[M, 8\] is needed, got \(32,\)"):
        layer(x.view(-1))
    with pytest.raises(onednn.OneDnnError, match="x: rows of 8 adjacent floats"):
        layer(x.t().contiguous().t())
    with pytest.raises(onednn.OneDnnError, match="x: rows of 8 adjacent floats"):
        layer(x[:1].expand(4, 8))  # rows that overlap
    with pytest.raises(onednn.OneDnnError, match=r"out: shape \[4, 20\] is needed, got \(4, 19\)"):
        layer(x, out=torch.empty(4, 19))
    with pytest.raises(onednn.OneDnnError, match="weight: a float32 or bfloat16 CPU tensor"):
        onednn.OneDnnLinear(w.double(), None)
    with pytest.raises(onednn.OneDnnError, match=r"bias: a CPU tensor \[20\] is needed, got \(19,\)"):
        onednn.OneDnnLinear(w, b[:19])
    with pytest.raises(onednn.OneDnnError,
                       match="kernel: one of inner_product, emulated, brgemm, measure is needed, got 'amx'"):
        onednn.OneDnnLinear(w.bfloat16(), b, kernel="amx")


@needs_lib
def test_the_c_functions_report_bad_operands():
    lib = onednn.load()[0]
    x = torch.randn(3, 8)
    y = torch.empty(3, 20)
    assert lib.ps_onednn_linear(None, x.data_ptr(), 8, 3, y.data_ptr(), 20, 1) == 5
    assert b"null handle" in lib.ps_onednn_last_error()
    assert "null handle" in onednn.last_error()  # what the decoder stack's errors quote
    layer = onednn.OneDnnLinear(torch.randn(20, 8), None)
    assert lib.ps_onednn_linear(layer.handle, x.data_ptr(), 4, 3, y.data_ptr(), 20, 1) == 5
    assert b"ldx = 4 for k = 8" in lib.ps_onednn_last_error()
    assert "ldx = 4 for k = 8" in onednn.last_error()  # the latest failure, not the first
    assert lib.ps_onednn_linear(layer.handle, None, 8, 0, None, 20, 1) == 0  # no rows: nothing read
    assert lib.ps_onednn_pack(None, 0, 0, 8, None, 0, 0, 0, None, None, 0) is None
    assert b"at least 1 x 1" in lib.ps_onednn_last_error()
    w = torch.randn(20, 8).bfloat16()
    assert lib.ps_onednn_pack(w.data_ptr(), 1, 20, 8, None, 3, 0, 0, None, None, 0) is None
    assert b"kernel 3 is none of" in lib.ps_onednn_last_error()
    # not whole 16-column tiles
    assert lib.ps_onednn_pack(w.data_ptr(), 1, 20, 8, None, 2, 40, 0, None, None, 0) is None
    assert b"must be 16, 32, 48 or 64 (or 0: 32), got 40" in lib.ps_onednn_last_error()
    assert lib.ps_onednn_pack(w.data_ptr(), 1, 20, 8, None, 2, 128, 0, None, None, 0) is None  # wider than AMX packs
    assert b"got 128" in lib.ps_onednn_last_error()
    q = torch.zeros(20, 8, dtype=torch.int8)
    assert lib.ps_onednn_pack(w.data_ptr(), 1, 20, 8, None, 0, 0, 1, q.data_ptr(), None, 0) is None  # q without scale
    assert b"int8 weights need both q and scale" in lib.ps_onednn_last_error()
    for kernel, rows in ((2, 16), (1, 16), (0, -1)):  # brgemm beside the inner product only, a count of rows
        assert lib.ps_onednn_pack(w.data_ptr(), 1, 20, 8, None, kernel, 0, 0, None, None, rows) is None
        want = f"brgemm_rows {rows} (brgemm for calls of few rows) needs a bf16 weight on the native inner"
        assert want.encode() in lib.ps_onednn_last_error()


@needs_lib
def test_the_handle_is_freed_with_the_layer():
    layer = onednn.OneDnnLinear(torch.randn(20, 8), None)
    release = layer._finalizer
    assert release.alive and layer.handle and layer.fn
    del layer
    gc.collect()
    assert not release.alive


@needs_lib
def test_the_build_is_cached():
    cxx = native.compiler()
    first = onednn.build(cxx)
    assert first.parent == native.cache_dir() and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert onednn.build(cxx) == first and first.stat().st_mtime_ns == stamp  # not built again


def test_a_failed_build_reports_the_compiler_error(tmp_path, monkeypatch):
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(onednn, "SOURCES", (bad,))
    monkeypatch.setenv("PREFIX_SERVICE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(onednn.OneDnnBuildError, match="compiling broken.cpp failed: .*error"):
        onednn.build(cxx)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left behind


# --- the template's part of attention as matrix products (csrc/onednn_attention.cpp) ----------------

def template_reference(q, k, v):
    """In float64, for q [rows, D] (scaled) over k, v [R, D] (bf16 values): the scores of the
    bf16-rounded queries, their maxima, sums of exponentials and normalised outputs, and a bound on
    the float32 summation error of each score."""
    qb, kd, vd = q.bfloat16().double(), k.double(), v.double()
    s = qb @ kd.T
    m = s.max(dim=1).values
    p = torch.exp(s - m[:, None])
    bound = 2 * (k.shape[1] + 1) * 2.0 ** -24 * (qb.abs() @ kd.abs().T).max(dim=1).values
    return m, p.sum(dim=1), (p @ vd) / p.sum(dim=1)[:, None], p / p.sum(dim=1)[:, None], bound


def pack_with(products, k, v, monkeypatch):
    """OneDnnTemplate(k, v) with PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=products, checked to multiply
    with the kernel that allows and to walk the keys as that kernel does; None where the CPU has no dot
    products to ask for (refused). "dot-rows": the dot products in the key-row walk (the VNNI operands
    AMX's brgemm multiplies, on a CPU without AMX)."""
    key_rows = products == "dot-rows"
    products = "dot" if key_rows else products
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, products)
    d = k.shape[-1]
    if products == "dot" and "avx512_bf16" not in cpuinfo.kernel_flags():
        with pytest.raises(onednn.OneDnnError, match="TEMPLATE_PRODUCTS=dot: this CPU has no AVX512-BF16"):
            onednn.OneDnnTemplate(k, v)
        return None
    packed = onednn.OneDnnTemplate(k, v, key_rows=key_rows)
    assert packed.kernel == onednn.template_kernel(d)
    assert packed.key_rows == (key_rows or packed.kernel != "AVX512-BF16 dot products")
    if products == "fallback":
        assert packed.kernel == "fallback GEMM"
    elif products == "dot":  # not AMX tiles, where the CPU has them too
        assert packed.kernel == ("AVX512-BF16 dot products" if d % 16 == 0 else "fallback GEMM")
    return packed


@needs_lib
@pytest.mark.parametrize("products", ["auto", "dot", "dot-rows", "fallback"])
@pytest.mark.parametrize("rows,r_len,hkv,d", [(1, 16, 1, 16), (45, 100, 3, 64), (32, 64, 2, 32), (7, 130, 1, 128),
                                               (5, 70, 1, 18), (150, 600, 1, 48), (64, 257, 2, 32)])
def test_template_attention_is_the_softmax_state_within_bf16_rounding(rows, r_len, hkv, d, products, monkeypatch):
    """Each row's state after the template: the maximum score within float32 summation error of
    the exact maximum of its bf16-rounded query's scores; the sum of exponentials and the
    normalised output within the rounding of the probabilities to bf16 (2^-8 relative, doubled for
    the normalisation); over more than one chunk of keys and more than one block of rows, strided
    query rows; on each kernel the products may be limited to."""
    g = torch.Generator().manual_seed(rows + r_len)
    k = torch.randn(r_len, hkv, d, generator=g).bfloat16()
    v = torch.randn(r_len, hkv, d, generator=g).bfloat16()
    packed = pack_with(products, k, v, monkeypatch)
    if packed is None:
        return
    assert (packed.num_tokens, packed.num_kv_heads, packed.head_size) == (r_len, hkv, d)
    assert packed.nbytes >= 2 * r_len * hkv * d * 2
    q = (torch.randn(rows, 2 * d, generator=g) * d ** -0.5)[:, :d]  # rows 2d apart
    for h in range(hkv):
        assert_template_state(packed, h, q, k[:, h].float(), v[:, h].float())


def assert_template_state(packed, h, q, k, v):
    """packed.attend(h, q) against template_reference(q, k, v) within the bounds above."""
    o, m, l = packed.attend(h, q)
    m_ref, l_ref, out_ref, w_ref, bound = template_reference(q, k, v)
    assert ((m.double() - m_ref).abs() <= bound + 1e-7).all()
    scale = torch.exp(m.double() - m_ref)  # l is relative to the kernel's own maximum
    assert ((l.double() / scale / l_ref - 1).abs() <= 2.0 ** -8).all()
    out = o.double() / l.double()[:, None]
    tol = 2 * 2.0 ** -8 * (w_ref @ v.double().abs()) + 1e-6
    assert ((out - out_ref).abs() <= tol).all(), (out - out_ref).abs().max().item()


@needs_lib
@pytest.mark.parametrize("products", ["auto", "dot-rows", "fallback"])
@pytest.mark.parametrize("shape", ["rising", "falling", "steps"])
def test_template_attention_follows_scores_that_move_far_between_chunks(shape, products, monkeypatch):
    """Scores that climb by 140 across the template's chunks (past float32's range: each row's
    exponentials must be taken against a reference that moves, and what came before rescaled), that
    fall (everything after the first chunk negligible), and that jump up and down by less and more
    than 8 within and between chunks: the state is still the softmax's, its maximum the largest
    score."""
    r_len, d, rows = 330, 64, 13
    g = torch.Generator().manual_seed(7)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    q = u[None, :] * (1.0 + 0.1 * torch.rand(rows, 1, generator=g)) + 0.05 * torch.randn(rows, d, generator=g)
    j = torch.arange(r_len, dtype=torch.float32)
    if shape == "rising":
        a = -30.0 + 140.0 * j / r_len  # the largest score in the last chunk, e^140 past float32
    elif shape == "falling":
        a = 40.0 - 60.0 * j / r_len  # the largest in the first chunk
    else:
        a = torch.tensor([0.0, 6.0, -3.0, 14.0, 9.0, 30.0, 22.0, 31.0])[(j // 42).long()] + torch.randn(r_len, generator=g)
    k = (a[:, None] * u[None, :] + 0.1 * torch.randn(r_len, d, generator=g)).bfloat16()
    v = torch.randn(r_len, d, generator=g).bfloat16()
    packed = pack_with(products, k[:, None, :], v[:, None, :], monkeypatch)
    if packed is None:  # no dot products here: pack_with checked that they were refused
        return
    assert_template_state(packed, 0, q, k.float(), v.float())


@needs_lib
def test_the_template_products_run_on_the_cpus_bf16_units():
    """AMX: oneDNN's brgemm micro-kernel; AVX512-BF16 without AMX: the library's dot products; else
    torch's fallback GEMM (AMX as the CPU reports it to oneDNN, the dot products as the library is built)."""
    want = ("AMX brgemm" if "amx_bf16" in cpuinfo.cpu_flags() else "AVX512-BF16 dot products"
            if "avx512_bf16" in cpuinfo.kernel_flags() else "fallback GEMM")
    assert onednn.template_kernel(64) == want
    # the tiles and the dot products take head sizes that are a multiple of 16; others run the fallback GEMM
    assert onednn.template_kernel(18) == "fallback GEMM"
    assert onednn.template_kernel(128) == want


def test_the_template_kernel_rule_gives_amx_every_head_size_a_multiple_of_16():
    """AMX's brgemm and the dot products take head sizes that are a multiple of 16 (AMX's, since the
    key-row walk packs nothing with oneDNN, 80, 128 and 256 too), AMX first where the CPU has both; other
    sizes run the fallback GEMM."""
    rule = onednn.template_kernel_rule
    for d in (16, 32, 48, 64, 80, 128, 256):
        assert rule(d, amx=True, dot=True) == rule(d, amx=True, dot=False) == "AMX brgemm"
        assert rule(d, amx=False, dot=True) == "AVX512-BF16 dot products"
        assert rule(d, amx=False, dot=False) == "fallback GEMM"
    for d in (18, 72, 100):
        assert rule(d, amx=True, dot=True) == rule(d, amx=False, dot=True) == "fallback GEMM"


@needs_lib
def test_template_attention_refuses_bad_operands():
    k = torch.randn(8, 2, 16).bfloat16()
    with pytest.raises(onednn.OneDnnError, match="bfloat16 CPU tensors"):
        onednn.OneDnnTemplate(k.float(), k.float())
    with pytest.raises(onednn.OneDnnError, match="a positive even head size"):
        onednn.OneDnnTemplate(k[..., :15], k[..., :15])
    packed = onednn.OneDnnTemplate(k, k)
    with pytest.raises(onednn.OneDnnError, match="head 2 of 2"):
        packed.attend(2, torch.randn(3, 16))
    with pytest.raises(onednn.OneDnnError, match=r"shape \[M, 16\] is needed"):
        packed.attend(0, torch.randn(3, 8))


def test_the_template_attention_is_chosen_by_the_environment(monkeypatch):
    monkeypatch.delenv(onednn.TEMPLATE_ATTENTION_ENV, raising=False)
    kernel = onednn.template_kernel(64)
    # the default, by the machine: the dot products without AMX, timed where AMX's tiles multiply
    fast = cpuinfo.bf16_dots_are_fast()  # AMD's, not Intel's: half the FMA rate there
    want = ("matrix" if kernel == "AVX512-BF16 dot products" and not onednn.brgemm_vnni() and fast
            else "measure" if kernel == "AMX brgemm" else "native")
    assert onednn.template_attention(64) == want
    assert onednn.template_attention(72) == "native"  # the dot products take multiples of 16
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)
    # on AMX with the dot products (or the fallback) multiplying: the native kernels by default
    # (with the tiles multiplying: "measure", tests/test_cpu_tuning.py)
    assert onednn.template_attention(64) == "native"
    monkeypatch.undo()
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "native")
    assert onednn.template_attention(64) == "native"
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "matrix")
    assert onednn.template_attention(64) == "matrix"
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "brgemm")  # the older name of matrix
    assert onednn.template_attention(64) == "matrix"
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "amx")
    with pytest.raises(onednn.OneDnnSettingError,
                       match="TEMPLATE_ATTENTION='amx': one of native, matrix, measure is needed"):
        onednn.template_attention(64)


def test_the_dot_product_attention_is_the_default_only_where_the_dots_outrun_float32(monkeypatch):
    """Without AMX, where the template's products would run on the AVX512-BF16 dot products: they are the
    default for the template's and a prompt's attention on AMD's cores, not on Intel's (half the FMA rate
    there: the native kernels' float32 FMAs instead)."""
    for name in (onednn.PROMPT_ATTENTION_ENV, onednn.TEMPLATE_ATTENTION_ENV, onednn.TEMPLATE_PRODUCTS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(onednn, "template_kernel", lambda head_size, products=None: onednn.TEMPLATE_KERNELS[1])
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: False)
    for vendor, template, prompt in (("AuthenticAMD", "matrix", "dot"), ("GenuineIntel", "native", "native")):
        monkeypatch.setattr(cpuinfo, "cpu_vendor", lambda v=vendor: v)
        assert (onednn.template_attention(64), onednn.prompt_attention(64)) == (template, prompt), vendor


@needs_lib
def test_the_prompt_attention_is_chosen_by_the_environment(monkeypatch):
    """PREFIX_SERVICE_BF16_PROMPT_ATTENTION: by default the dot products where the template's
    products run on them by default, both timed where the CPU has them beside AMX; "native"
    anywhere; "dot" and "measure" only where the CPU has the dot products for the head size; anything
    else refused with the values it takes."""
    for name in (onednn.PROMPT_ATTENTION_ENV, onednn.TEMPLATE_ATTENTION_ENV, onednn.TEMPLATE_PRODUCTS_ENV):
        monkeypatch.delenv(name, raising=False)
    has_dot = "avx512_bf16" in cpuinfo.kernel_flags()
    default_dot = has_dot and not onednn.brgemm_vnni() and cpuinfo.bf16_dots_are_fast()
    assert onednn.prompt_attention(64) == ("dot" if default_dot else "measure" if has_dot and onednn.brgemm_vnni()
                                           else "native")
    assert onednn.prompt_attention(72) == "native"  # the dot products take multiples of 16
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "native")
    assert onednn.prompt_attention(64) == "native"
    for way in ("dot", "measure"):  # each needs the dot products
        monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, way)
        if has_dot:
            assert onednn.prompt_attention(64) == way
        else:
            with pytest.raises(onednn.OneDnnError, match=f"PROMPT_ATTENTION={way}: the AVX512-BF16 dot products are"):
                onednn.prompt_attention(64)
        with pytest.raises(onednn.OneDnnError, match="not available here for head size 72"):
            onednn.prompt_attention(72)
    monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "matrix")
    with pytest.raises(onednn.OneDnnSettingError,
                       match="PROMPT_ATTENTION='matrix': one of native, dot, measure is needed"):
        onednn.prompt_attention(64)
    monkeypatch.delenv(onednn.PROMPT_ATTENTION_ENV)
    if has_dot:  # on AMX: timed against the native kernels, or asked for with the template's products
        monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)
        assert onednn.prompt_attention(64) == "measure"
        assert onednn.prompt_attention(72) == "native"
        monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "dot")
        assert onednn.prompt_attention(64) == "dot"


@needs_lib
def test_the_template_products_are_limited_by_the_environment(monkeypatch):
    """PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS: "fallback" on any CPU; "dot" where the CPU has
    AVX512-BF16, and then the matrix-product template attention by default on AMX too; anything else
    is refused with the values it takes."""
    monkeypatch.delenv(onednn.TEMPLATE_ATTENTION_ENV, raising=False)
    has_dot = "avx512_bf16" in cpuinfo.kernel_flags()
    auto = onednn.template_kernel(64)
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "auto")
    assert onednn.template_kernel(64) == auto
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "fallback")
    assert onednn.template_kernel(64) == onednn.template_kernel(128) == "fallback GEMM"
    assert onednn.template_attention(64) == "native"  # the fallback is slower than the native kernels
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "dot")
    if has_dot:
        assert onednn.template_kernel(64) == "AVX512-BF16 dot products"
        monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)  # as on AMX: asked for, they run there too
        assert onednn.template_attention(64) == "matrix"
        monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "auto")
        assert onednn.template_attention(64) == "native"
    else:
        with pytest.raises(onednn.OneDnnError, match="TEMPLATE_PRODUCTS=dot: this CPU has no AVX512-BF16"):
            onednn.template_kernel(64)
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "amx")
    with pytest.raises(onednn.OneDnnSettingError,
                       match="TEMPLATE_PRODUCTS='amx': one of auto, dot, fallback is needed"):
        onednn.template_kernel(64)
