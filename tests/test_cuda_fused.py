"""cuda_ops.fused (a layer's RMSNorm with its residual add, rotary embedding, SiLU-and-mul as one
Triton kernel each) and the cuda backend's FusedForward over them. On CPU: the kernels in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest without a GPU) against their torch references and
the model's reference forward; on a GPU, the compiled kernels against the same references.

The interpreter rounds float32 to bfloat16 its own way (not to nearest even, as torch and a GPU
do), so on CPU the bfloat16 cases are held to a bound and the float32 and float16 ones to the last
bits; on a GPU the bfloat16 rotation and SiLU are bit for bit the reference's."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from cuda_ops import fused
from cuda_ops.paged_decode import triton_available

needs_interpreter = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="needs triton with TRITON_INTERPRET=1 (set by conftest without a GPU; "
                                              "a GPU runs the compiled kernels in the tests below instead)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tables(d: int, positions: int = 2048, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> None:
    """float32: the last bits of a differently ordered sum; float16: a rounding of it; bfloat16 in
    the interpreter: its rounding, a unit in the last place of the bf16 value and then some."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
           torch.bfloat16: (2e-2, 2e-2) if interpreted else (8e-3, 8e-3)}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1])


def _check_ops(device: str, dtype: torch.dtype, interpreted: bool) -> None:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    for hidden in (576, 100):  # a power of two's fraction, and a width the kernel masks
        x, res = rand(7, hidden), rand(7, hidden)
        w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
        want, want_sum = fused.rms_norm_ref(x, w, 1e-5, res)
        held = res.clone()
        got, got_sum = fused.rms_norm(x, w, 1e-5, residual=held)
        assert got_sum is held  # the residual is updated in place
        _close(got, want, dtype, interpreted)
        _close(got_sum, want_sum, dtype, interpreted)
        alone, same = fused.rms_norm(x, w, 1e-5)
        assert same is x
        _close(alone, fused.rms_norm_ref(x, w, 1e-5)[0], dtype, interpreted)
    # q and k heads as the model has them: a row-strided view of the fused projection [T, q + 2 kv]
    hq, hkv, d = 9, 3, 64
    qkv = rand(5, (hq + 2 * hkv) * d)
    qk = qkv[:, :(hq + hkv) * d].view(5, hq + hkv, d)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    cos, sin = (t.to(device) for t in _tables(d))
    positions = torch.tensor([0, 3, 900, 17, 2047], device=device)
    want = fused.rope_ref(qk, cos, sin, positions)
    assert fused.rope_(qk, cos, sin, positions) is qk
    _close(qk, want, dtype, interpreted)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched
    gate_up = rand(6, 2 * 1536)
    _close(fused.silu_mul(gate_up), fused.silu_mul_ref(gate_up), dtype, interpreted)
    # no rows: nothing launched, empty results
    assert fused.silu_mul(rand(0, 8)).shape == (0, 4) and fused.rms_norm(rand(0, 8), w[:8], 1e-5)[0].shape == (0, 8)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter), pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_match_their_references(device, dtype):
    _check_ops(device, dtype, interpreted=device == "cpu")


@needs_interpreter
def test_the_ops_follow_the_reference_where_it_differs_from_plain_math():
    """The residual sum rounded before the norm reads it, the rotation's tables at each token's own
    position: a wrong position or an unrounded sum moves the float16 results past the bound."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 64, generator=g) * 100).half()
    res = (torch.randn(3, 64, generator=g) * 0.01).half()
    w = torch.ones(64).half()
    got, _ = fused.rms_norm(x, w, 1e-6, residual=res.clone())
    torch.testing.assert_close(got, fused.rms_norm_ref(x, w, 1e-6, res)[0], rtol=0, atol=0)
    cos, sin = _tables(16)
    qk = torch.randn(2, 4, 16, generator=g).half()
    positions = torch.tensor([5, 700])
    rotated = fused.rope_(qk.clone(), cos, sin, positions)
    torch.testing.assert_close(rotated, fused.rope_ref(qk, cos, sin, positions), rtol=0, atol=0)
    assert not torch.allclose(rotated.float(), fused.rope_ref(qk, cos, sin, positions.flip(0)).float(), atol=1e-2)


def _tiny_model(arch_kind: str, dtype: torch.dtype, device: str = "cpu"):
    from prefix_service.model.llama import LlamaForCausalLM, ModelArch
    arch = ModelArch(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                     tie_word_embeddings=arch_kind != "llama", qkv_bias=arch_kind == "qwen2",
                     qk_norm=arch_kind == "qwen3", sliding_window=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch, 256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # the norms' weights start at one: make them count
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype).eval()


def _causal(layer, q, k, v, scale):
    """One sequence's attention over its own tokens: the step's attention the forward is given."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@needs_interpreter
@pytest.mark.parametrize("arch_kind", ["llama", "qwen2", "qwen3"])
def test_fused_forward_matches_the_reference_forward_interpreted(arch_kind):
    """FusedForward's hidden states and greedy next tokens against the model's own forward, float32,
    for Llama (untied head), Qwen2 (q/k/v biases) and Qwen3 (per-head q and k norms)."""
    from prefix_service.backends.cuda.layers import FusedForward
    model = _tiny_model(arch_kind, torch.float32)
    ids = torch.tensor([5, 17, 3, 88, 42, 42, 7, 60, 1, 96, 30])
    positions = torch.arange(20, 20 + len(ids))  # after a context, as a template's user segment is
    want = model(ids, positions, _causal)
    got = FusedForward(model)(ids, positions, _causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.compute_logits(got).argmax(-1), model.compute_logits(want).argmax(-1))


@needs_interpreter
def test_layers_off_by_config_or_a_failed_build_run_the_reference(make_engine, monkeypatch, caplog):
    """model.cuda_fused_layers: false, or kernels that do not build (one warning with the reason):
    the backend runs the model's own layers and says so; both serve the torch backend's tokens."""
    import functools

    import prefix_service.engine.core as core_mod
    from helpers import run_ids
    from prefix_service.backends.cuda.attention import decode_triton, prefill_sdpa_loop
    from prefix_service.backends.cuda.backend import CudaBackend
    from prefix_service.backends.cuda.layers import FusedForward
    prompt = [(7 * i + 5) % 500 + 3 for i in range(9)]
    expected = run_ids(make_engine(backend="torch"), prompt, max_tokens=5)
    cuda = functools.partial(CudaBackend, prefill=("sdpa_loop", prefill_sdpa_loop), decode=("triton_paged", decode_triton))
    monkeypatch.setattr(core_mod, "select_backend", lambda *args: cuda)
    off = make_engine(cuda_fused_layers=False)
    assert off.info.backend_description.endswith("reference layers)")
    assert run_ids(off, prompt, max_tokens=5) == expected

    def broken(self, device):
        raise RuntimeError("PTX assembly failed\nmore detail")
    monkeypatch.setattr(FusedForward, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="prefix_service.engine"):
        fallen = make_engine()
    assert fallen.info.backend_description.endswith("reference layers)")
    assert [r.getMessage() for r in caplog.records if "fused layers off" in r.getMessage()] == [
        "fused layers off, running the model's reference layers: RuntimeError: PTX assembly failed"]
    assert run_ids(fallen, prompt, max_tokens=5) == expected


# --- on a GPU ------------------------------------------------------------------------------------

@needs_gpu
def test_bf16_rotation_and_silu_are_the_reference_bit_for_bit_on_gpu():
    """Where the reference rounds, the kernels round (to nearest even, as torch): the rotation and
    SiLU-and-mul in bfloat16 are the reference's bits; the norm differs only by its sum's order."""
    g = torch.Generator().manual_seed(2)
    qk = torch.randn(64, 40, 128, generator=g).to("cuda", torch.bfloat16)
    cos, sin = (t.cuda() for t in _tables(128, 8192, 500000.0))
    positions = torch.randint(0, 8192, (64,), generator=g).cuda()
    want = fused.rope_ref(qk, cos, sin, positions)
    assert torch.equal(fused.rope_(qk.clone(), cos, sin, positions), want)
    gate_up = torch.randn(64, 2 * 14336, generator=g).to("cuda", torch.bfloat16)
    same = (fused.silu_mul(gate_up) == fused.silu_mul_ref(gate_up)).float().mean().item()
    assert same > 0.999, f"{same:.5f} of SiLU-and-mul's values are the reference's"
    x = torch.randn(64, 4096, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.2 * torch.randn(4096, generator=g)).to("cuda", torch.bfloat16)
    same = (fused.rms_norm(x, w, 1e-5)[0] == fused.rms_norm_ref(x, w, 1e-5)[0]).float().mean().item()
    assert same > 0.98, f"{same:.5f} of the norm's values are the reference's"


@needs_gpu
@pytest.mark.parametrize("arch_kind", ["llama", "qwen3"])
def test_fused_forward_matches_the_reference_forward_on_gpu(arch_kind):
    from prefix_service.backends.cuda.layers import FusedForward
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        model = _tiny_model(arch_kind, dtype, "cuda")
        ids = torch.tensor([5, 17, 3, 88, 42, 42, 7, 60, 1, 96, 30], device="cuda")
        positions = torch.arange(20, 20 + len(ids), device="cuda")
        want = model(ids, positions, _causal)
        got = FusedForward(model)(ids, positions, _causal)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# --- a step's inputs in one copy (backends/cuda/staging.py) ----------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_staging_moves_a_steps_tensors_in_one_copy(device):
    """Mixed int32 and int64 tensors of any shape, empty ones included, come back equal, typed and
    shaped as given, each 16-byte aligned (as a fresh allocation); later calls reuse the host
    buffers (and grow them) without touching what earlier calls returned. On a GPU the host buffers
    are pinned and the copies asynchronous: a buffer is refilled only after its copy has run."""
    from prefix_service.backends.cuda.staging import Staging
    staging = Staging(torch.device(device))
    assert staging.pinned == (device == "cuda")
    g = torch.Generator().manual_seed(4)
    kept = []
    for step in range(5):
        parts = [torch.randint(-2**40, 2**40, (3 + step,), generator=g), torch.randint(-9, 9, (2, 5), generator=g,
                                                                                       dtype=torch.int32),
                 torch.zeros(0, dtype=torch.int64), torch.zeros((0, 7), dtype=torch.int32),
                 torch.randint(0, 2**30, (step * 700,), generator=g, dtype=torch.int32),  # grows the buffers
                 torch.randint(0, 9, (4, 2), generator=g)[:, :1]]  # not contiguous
        moved = staging.to_device(parts)
        assert staging.copies == step + 1
        for host, dev in zip(parts, moved):
            assert dev.dtype == host.dtype and dev.shape == host.shape and torch.equal(dev.cpu(), host)
            assert dev.data_ptr() % 16 == 0
        kept.append((parts, moved))
    for parts, moved in kept:  # what each call returned is its own
        assert all(torch.equal(h, d.cpu()) for h, d in zip(parts, moved))
    with pytest.raises(TypeError, match="int32 and int64"):
        staging.to_device([torch.zeros(2)])
