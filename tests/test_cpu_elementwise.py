"""The cpu backend's element-wise kernels (csrc/cpu_elementwise.cpp: elementwise.add_rms_norm, the
others through native_harness.py): the fused residual add and RMSNorm, the gated activation and the
rotary embedding equal their torch formulas computed in float64, for widths that are not multiples
of the vector, strided rows and any positions; a row's result does not depend on the thread count;
bad input gets a clear error. (The engine on them: test_backends.py.)"""
import pytest
import torch
import torch.nn.functional as F

from native_harness import Rotation, head_rms_norm, silu_mul
from prefix_service.backends.cpu import elementwise as ce
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.model.llama import apply_rope

REASON = ce.available(torch.float32)
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")


def close(got, want, tol=2e-6):
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, want.abs().max().item()), err


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rotary_tables(positions, dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().float().contiguous(), emb.sin().float().contiguous()


@needs_native
@pytest.mark.parametrize("t", [1, 7, 100])
@pytest.mark.parametrize("d", [16, 40, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_float64(t, d, with_residual):
    x, r, w = rand(t, d, seed=1, scale=3.0), rand(t, d, seed=2), rand(d, seed=3)
    stream = x.clone()
    out = ce.add_rms_norm(stream, r if with_residual else None, w, 1e-5)
    h = x.double() + (r.double() if with_residual else 0)
    close(stream, h.float().double(), tol=1e-7)  # the residual stream, updated in place
    close(out, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double())


@needs_native
def test_add_rms_norm_on_strided_rows():
    wide, r, w = rand(9, 70, seed=4), rand(9, 50, seed=5), rand(50, seed=6)
    x = wide[:, 10:60]
    want = (x.double() + r.double())
    out = ce.add_rms_norm(x, r, w, 1e-6)
    close(wide[:, 10:60], want.float().double(), tol=1e-7)
    assert torch.equal(wide[:, :10], rand(9, 70, seed=4)[:, :10])  # nothing written outside the rows
    close(out, want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())


@needs_native
@pytest.mark.parametrize("t,inter", [(1, 16), (5, 40), (100, 1536)])
def test_silu_mul_equals_float64(t, inter):
    gate_up = rand(t, 2 * inter, seed=7, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # the exp's clamped range
    g, u = gate_up.double().split(inter, -1)
    close(silu_mul(gate_up), F.silu(g) * u)


@needs_native
@pytest.mark.parametrize("t,d", [(1, 16), (7, 40), (100, 576)])
def test_bf16_hand_offs_are_the_float32_results_rounded(t, d):
    """Where a norm or the gated activation feeds a bf16 linear layer, it writes bf16 rows, and the
    activation reads the gate/up projection's bf16 output as it is: the float32 results rounded to
    nearest even as torch rounds them, from the same float32 arithmetic (a NaN stays a NaN)."""
    def same(a, b):  # the same bf16 bits, NaN for NaN whatever its payload
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))

    x, w = rand(t, d, seed=3, scale=3.0), rand(d, seed=4)
    x[0, 0] = float("nan")
    x[-1, -1] = float("inf")
    want = ce.add_rms_norm(x.clone(), None, w, 1e-5)
    got = ce.add_rms_norm(x.clone(), None, w, 1e-5, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert same(got, want.bfloat16()) and got[0].isnan().all()
    gate_up = rand(t, 2 * d, seed=5, scale=4.0).bfloat16()
    gate_up[0, 1] = float("nan")
    widened = silu_mul(gate_up.float())
    assert torch.equal(silu_mul(gate_up).isnan(), widened.isnan()) and silu_mul(gate_up).dtype == torch.float32
    assert torch.equal(silu_mul(gate_up).nan_to_num(), widened.nan_to_num())
    rounded = silu_mul(gate_up, out_dtype=torch.bfloat16)
    assert same(rounded, widened.bfloat16()) and rounded[0, 1].isnan()
    assert same(silu_mul(gate_up.float(), out_dtype=torch.bfloat16), rounded)


@needs_native
@pytest.mark.parametrize("dim", [16, 40, 64, 128])
def test_rotation_equals_apply_rope(dim):
    """q and k heads as a strided view of a fused projection, rotated in place at any positions."""
    t, hq, hkv = 11, 3, 2
    qkv = rand(t, (hq + 2 * hkv) * dim, seed=8)
    qk = qkv[:, :(hq + hkv) * dim].view(t, hq + hkv, dim)
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    positions = torch.tensor([0, 1, 2, 900, 901, 77, 5, 4095, 3, 1000, 42])
    cos, sin = rotary_tables(4096, dim)
    want = apply_rope(qk.double(), cos.double()[positions][:, None], sin.double()[positions][:, None])
    got = Rotation(positions, cos, sin)(qk)
    assert got.data_ptr() == qk.data_ptr()  # in place
    close(qk, want)
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before)  # v untouched


@needs_native
@pytest.mark.parametrize("dim", [16, 40, 128])
def test_head_rms_norm_equals_float64(dim):
    """Qwen3's q/k norms: each head of a strided view of a fused projection normalized in place, the
    rest of the row untouched."""
    t, hq, hkv = 9, 4, 2
    qkv = rand(t, (hq + 2 * hkv) * dim, seed=9, scale=3.0)
    q = qkv[:, :hq * dim].view(t, hq, dim)
    rest_before = qkv[:, hq * dim:].clone()
    w = rand(dim, seed=10)
    x = q.double()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = head_rms_norm(q, w, 1e-6)
    assert got.data_ptr() == q.data_ptr()  # in place
    close(q, want)
    assert torch.equal(qkv[:, hq * dim:], rest_before)
    with pytest.raises(NativeKernelError, match="weight"):
        head_rms_norm(q, rand(dim + 1), 1e-6)


@needs_native
def test_results_do_not_depend_on_the_thread_count():
    x, r, w, gu = rand(400, 576, seed=9), rand(400, 576, seed=10), rand(576, seed=11), rand(400, 3072, seed=12)
    qk = rand(400, 12, 64, seed=13)
    cos, sin = rotary_tables(512, 64)
    rot = Rotation(torch.arange(400), cos, sin)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            xs, q = x.clone(), qk.clone()
            outs.append((ce.add_rms_norm(xs, r, w, 1e-5), xs, silu_mul(gu), rot(q)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@needs_native
def test_bad_input_is_refused():
    x, w = rand(4, 32), rand(32)
    with pytest.raises(NativeKernelError, match="float32 CPU tensor"):
        ce.add_rms_norm(x.double(), None, w, 1e-5)
    with pytest.raises(NativeKernelError, match="rows must be dense"):
        ce.add_rms_norm(x.t().contiguous().t(), None, w, 1e-5)
    with pytest.raises(NativeKernelError, match="does not match"):
        ce.add_rms_norm(x, rand(4, 31), w, 1e-5)
    with pytest.raises(NativeKernelError, match="weight"):
        ce.add_rms_norm(x, None, rand(31), 1e-5)
    with pytest.raises(NativeKernelError, match="even width"):
        silu_mul(rand(4, 33))
    cos, sin = rotary_tables(16, 8)
    with pytest.raises(NativeKernelError, match="out of the tables' range"):
        Rotation(torch.tensor([0, 16]), cos, sin)
    with pytest.raises(NativeKernelError, match="int64"):
        Rotation(torch.tensor([0, 1], dtype=torch.int32), cos, sin)
    with pytest.raises(NativeKernelError, match="does not match"):
        Rotation(torch.tensor([0, 1]), cos, sin)(rand(3, 2, 8))
    with pytest.raises(NativeKernelError, match="table"):
        Rotation(torch.tensor([0]), cos[:, :7].contiguous(), sin[:, :7].contiguous())
