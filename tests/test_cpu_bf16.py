"""The cpu backend serving bfloat16 models: bfloat16 weights and KV cache, float32 activations.

- The attention kernels over a bfloat16 cache give, bit for bit, what they give over a float32
  cache holding the same (bf16-representable) values, and the K/V they store are torch's own
  round-to-nearest-even narrowing of what a float32 cache would hold.
- The decoder stack over a bfloat16 cache equals the kernel-by-kernel forward in which each new
  token's K and V are rounded to bf16 after the rotation, on every step of a mixed workload.
- The engine's last logits are within a stated bound of the torch backend's in bfloat16; greedy ids
  on a pinned template equal those without it, or first differ at a stated near tie; seeded
  sampling repeats; the engine reports the cpu backend, bfloat16 and a bfloat16 KV cache.
"""
import ctypes

import pytest
import torch

from helpers import PREFIX, PROMPTS, engine_last_logits, generate_together, greedy, run_ids
from native_harness import decode_attention, prefill_attention
from prefix_service import GenerateRequest, SamplingParams, cpuinfo
from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.backends.cpu import linear, native, onednn
from test_cpu_onednn import default_dot_rows
from test_cpu_stack import check_mixed_workload

REASON = native.load()[1] or linear.available(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels for bfloat16 here: {REASON}")
BS = 4


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 precision, kept float32 (widening back is exact)."""
    return x.bfloat16().float()


def awkward_values(n: int) -> torch.Tensor:
    """n float32 values whose bf16 rounding is easy to get wrong (ties to even both ways, just
    either side of a tie, subnormals, -0, overflow to inf), then ordinary ones."""
    bits = [0x3F808000, 0x3F818000, 0xBF818000, 0x3F808001, 0x3F807FFF, 0x00018000, 0x00008000, 0x80000000,
            0x7F7FFFFF, 0x3F800000, 0x4049_0FDB, 0xC2C8_8000]
    special = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(n)
    return torch.cat([special, torch.randn(n - len(special), generator=g)])


# --- the attention kernels over a bfloat16 cache -----------------------------------------------------

def prefill_case(r: int, cached: int, m: int, hq: int, hkv: int, d: int, rounded: bool = True):
    """A float32 cache in shuffled blocks, the sequence's table, a template of r keys packed, and m
    new tokens' q/k/v as views of one fused projection; every K/V value bf16-representable unless
    `rounded` is False (then the new K/V are not, and some are awkward_values)."""
    g = torch.Generator().manual_seed(100 * r + 10 * cached + m)
    n_blocks = -(-(r + cached + m) // BS)
    kc = bf16_exact(torch.randn(n_blocks + 5, BS, hkv, d, generator=g))
    vc = bf16_exact(torch.randn(n_blocks + 5, BS, hkv, d, generator=g))
    table = torch.randperm(n_blocks + 5, generator=g)[:n_blocks].to(torch.int32)
    qkv = torch.randn(m, hq + 2 * hkv, d, generator=g)
    if rounded:
        qkv[:, hq:] = bf16_exact(qkv[:, hq:])
    else:
        qkv[0, hq:] = awkward_values(2 * hkv * d).view(2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    kt, vt = bf16_exact(torch.randn(r, hkv, d, generator=g)), bf16_exact(torch.randn(r, hkv, d, generator=g))
    template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r) if r else None
    slots = torch.tensor([int(table[p // BS]) * BS + p % BS for p in range(r + cached, r + cached + m)])
    return q, k, v, kc, vc, table, template, slots


@needs_bf16
@pytest.mark.parametrize("r,cached,m,hq,hkv,d", [
    (0, 0, 7, 6, 2, 32),  # plain causal
    (8, 9, 7, 6, 2, 32),  # a template, cached context through the table, new tokens
    (32, 70, 20, 4, 1, 64),  # more than one chunk of keys
    (16, 0, 1, 8, 8, 16),  # one new token on a template
    (0, 13, 66, 9, 3, 64),  # new tokens over several chunks
])
def test_prefill_over_a_bf16_cache_is_the_float32_result_bit_for_bit(r, cached, m, hq, hkv, d):
    """The same bf16-representable K/V in a float32 and a bfloat16 cache: the same output, bit for
    bit; after the store the bfloat16 cache is the float32 one narrowed."""
    q, k, v, kc, vc, table, template, slots = prefill_case(r, cached, m, hq, hkv, d)
    kc16, vc16 = kc.bfloat16(), vc.bfloat16()
    assert torch.equal(kc16.float(), kc) and torch.equal(vc16.float(), vc)
    outs = []
    for cache in ((kc, vc), (kc16, vc16)):
        outs.append(prefill_attention(q, k, v, d ** -0.5, template=template, cache=cache,
                                      block_table=table, cached=(r, cached), slots=slots))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(kc.view(-1, hkv, d)[slots], k) and torch.equal(vc.view(-1, hkv, d)[slots], v)
    assert torch.equal(kc16, kc.bfloat16()) and torch.equal(vc16, vc.bfloat16())


@needs_bf16
def test_prefill_narrows_what_it_stores_as_torch_does():
    """New K/V that are not bf16-representable (ties, subnormals, overflow among them): the bfloat16
    cache holds, bit for bit, torch's round-to-nearest-even of what the float32 cache holds."""
    q, k, v, kc, vc, table, template, slots = prefill_case(8, 5, 9, 6, 2, 32, rounded=False)
    kc16, vc16 = kc.bfloat16(), vc.bfloat16()
    for cache in ((kc, vc), (kc16, vc16)):
        prefill_attention(q, k, v, 32 ** -0.5, template=template, cache=cache, block_table=table,
                          cached=(8, 5), slots=slots)
    assert torch.equal(kc.view(-1, 2, 32)[slots], k)  # the float32 cache holds them as they are
    assert not torch.equal(bf16_exact(k), k)  # so narrowing them is a real test
    assert torch.equal(kc16.view(torch.int16), kc.bfloat16().view(torch.int16))  # bits: -0 and inf included
    assert torch.equal(vc16.view(torch.int16), vc.bfloat16().view(torch.int16))


def decode_case(lens: list[int], hq: int, hkv: int, d: int, seed: int, rounded: bool = True):
    """Decodes over a float32 cache in shuffled blocks (bf16-representable values), their tables,
    templates of two blocks packed for the sequences longer than that, and the new K/V with slots."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // BS) for n in lens]
    num_blocks = sum(widths) + 3
    kc = bf16_exact(torch.randn(num_blocks, BS, hkv, d, generator=g))
    vc = bf16_exact(torch.randn(num_blocks, BS, hkv, d, generator=g))
    order = torch.randperm(num_blocks, generator=g)[:sum(widths)].tolist()
    tables = torch.full((len(lens), max(widths) + 1), -1, dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor(order[:w], dtype=torch.int32)
        order = order[w:]
    q = torch.randn(len(lens), hq + 2 * hkv, d, generator=g)[:, :hq]  # strided rows
    r = 2 * BS
    kt, vt = bf16_exact(torch.randn(r, hkv, d, generator=g)), bf16_exact(torch.randn(r, hkv, d, generator=g))
    packed = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r)
    templates = [packed if n > r else None for n in lens]
    k, v = torch.randn(len(lens), hkv, d, generator=g), torch.randn(len(lens), hkv, d, generator=g)
    if rounded:
        k, v = bf16_exact(k), bf16_exact(v)
    else:
        k[0] = awkward_values(hkv * d).view(hkv, d)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens)])
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), templates, (k, v, slots)


@needs_bf16
@pytest.mark.parametrize("with_templates", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 32), (8, 1, 64), (4, 4, 16)])
def test_decode_over_a_bf16_cache_is_the_float32_result_bit_for_bit(with_templates, hq, hkv, d):
    """Decodes storing their new K/V (bf16-representable), over packed templates or not: the same
    output over a float32 and a bfloat16 cache, bit for bit; the bfloat16 cache is the float32 one
    narrowed."""
    lens = [1, 5, 9, 13, 22, 71]
    q, kc, vc, tables, ctx, templates, new_kv = decode_case(lens, hq, hkv, d, seed=hq + d + with_templates)
    kc16, vc16 = kc.bfloat16(), vc.bfloat16()
    outs = [decode_attention(q, kcache, vcache, tables, ctx, d ** -0.5,
                             templates=templates if with_templates else None, new_kv=new_kv)
            for kcache, vcache in ((kc, vc), (kc16, vc16))]
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    k, v, slots = new_kv
    assert torch.equal(kc.view(-1, hkv, d)[slots], k) and torch.equal(vc.view(-1, hkv, d)[slots], v)
    assert torch.equal(kc16, kc.bfloat16()) and torch.equal(vc16, vc.bfloat16())


# The matrix-product template attention rounds each query (times the scale) and each probability to
# bf16 where the native kernels keep them in float32: a score moves by up to 2^-9 of sum |q k| and a
# weight by up to 2^-9 of itself. Measured max |diff| of the decodes' outputs (values ~N(0, 1))
# over the decode shapes below and 5 seeds each: 0.0042 (9 query heads on 3 KV heads of 64); the
# bound leaves ~2.4x margin (the prefill cases' differences fall inside it too).
MATRIX_TEMPLATE_BOUND = 0.01


def unpacked(template):
    """(K, V) [R, Hkv, D] of a template packed by attention.pack_keys / pack_values."""
    kp, vp, r = template
    return kp.permute(1, 3, 0, 2).reshape(-1, kp.shape[0], kp.shape[2])[:r], vp.transpose(0, 1)


@needs_bf16
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 32), (8, 1, 64), (4, 4, 16), (9, 3, 64)])
def test_decode_over_a_template_as_matrix_products_is_within_bf16_rounding(hq, hkv, d):
    """The decodes' template part through the matrix-product attention (onednn.OneDnnTemplate,
    ps_onednn_template_attend) instead of the native kernels: the sequences without a template get
    the same output bit for bit, those on one within MATRIX_TEMPLATE_BOUND; both store the same K/V."""
    lens = [1, 5, 9, 13, 22, 71]
    q, kc, vc, tables, ctx, templates, new_kv = decode_case(lens, hq, hkv, d, seed=hq * d)
    k, v = unpacked(next(t for t in templates if t is not None))
    matrix = onednn.OneDnnTemplate(k.bfloat16(), v.bfloat16())
    caches = [(kc.bfloat16(), vc.bfloat16()) for _ in range(2)]
    native_out, matrix_out = (
        decode_attention(q, kcache, vcache, tables, ctx, d ** -0.5, templates=templates, new_kv=new_kv, matrix=mat)
        for (kcache, vcache), mat in zip(caches, (None, [matrix if t is not None else None for t in templates])))
    on = torch.tensor([t is not None for t in templates])
    assert on.any() and not on.all()
    assert torch.equal(native_out[~on], matrix_out[~on])
    diff = (native_out[on] - matrix_out[on]).abs().max().item()
    assert 0 < diff <= MATRIX_TEMPLATE_BOUND, diff
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@needs_bf16
@pytest.mark.parametrize("r,cached,m,hq,hkv,d", [(8, 9, 7, 6, 2, 32), (32, 70, 20, 4, 1, 64), (16, 0, 1, 8, 8, 16),
                                             (64, 3, 40, 9, 3, 64)])
def test_prefill_over_a_template_as_matrix_products_is_within_bf16_rounding(r, cached, m, hq, hkv, d):
    """A prefill's template part through the matrix-product attention instead of the native
    kernels: within MATRIX_TEMPLATE_BOUND; the same K/V stored."""
    q, k, v, kc, vc, table, template, slots = prefill_case(r, cached, m, hq, hkv, d)
    kt, vt = unpacked(template)
    matrix = onednn.OneDnnTemplate(kt.bfloat16(), vt.bfloat16())
    caches = [(kc.bfloat16(), vc.bfloat16()) for _ in range(2)]
    native_out, matrix_out = (prefill_attention(q, k, v, d ** -0.5, template=template, cache=cache, block_table=table,
                                                cached=(r, cached), slots=slots, matrix=mat)
                              for cache, mat in zip(caches, (None, matrix)))
    diff = (native_out - matrix_out).abs().max().item()
    assert 0 < diff <= MATRIX_TEMPLATE_BOUND, diff
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# the prompt's own attention on the dot products (ps_onednn_causal_attend) needs AVX512-BF16
DOT_REASON = REASON or (None if "avx512_bf16" in cpuinfo.kernel_flags() and onednn.load()[0] is not None
                        else "this CPU has no AVX512-BF16 dot products (or no oneDNN library)")
needs_dot = pytest.mark.skipif(DOT_REASON is not None,
                               reason=f"the prompt's dot products cannot run here: {DOT_REASON}")


@needs_dot
@pytest.mark.parametrize("m,hq,hkv,d", [(onednn.PROMPT_ATTENTION_MIN_TOKENS, 6, 2, 16), (130, 9, 3, 64),
                                        (300, 4, 4, 32), (257, 8, 1, 64)])
def test_a_prompt_over_its_own_keys_on_the_dot_products_is_within_bf16_rounding(m, hq, hkv, d):
    """A prompt with nothing before it, from PROMPT_ATTENTION_MIN_TOKENS tokens, over its own keys
    through the causal dot products (q and P rounded to bf16) instead of the native kernels: within
    MATRIX_TEMPLATE_BOUND of them, and of the exact causal softmax in float64 (row t sees keys [0, t]:
    a row that saw a later key would be far off); the same K/V stored."""
    q, k, v, kc, vc, table, _, slots = prefill_case(0, 0, m, hq, hkv, d)
    caches = [(kc.bfloat16(), vc.bfloat16()) for _ in range(2)]
    native_out, dot_out = (prefill_attention(q, k, v, d ** -0.5, cache=cache, block_table=table, slots=slots,
                                             causal=causal) for cache, causal in zip(caches, (False, True)))
    diff = (native_out - dot_out).abs().max().item()
    assert 0 < diff <= MATRIX_TEMPLATE_BOUND, diff
    g = hq // hkv
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.repeat_interleave(g, 1).transpose(0, 1).double(),
        v.repeat_interleave(g, 1).transpose(0, 1).double(), is_causal=True, scale=d ** -0.5).transpose(0, 1)
    assert (dot_out.double() - exact).abs().max().item() <= MATRIX_TEMPLATE_BOUND
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@needs_dot
@pytest.mark.parametrize("m,hq,hkv,d", [(130, 9, 3, 64), (200, 4, 2, 48), (257, 8, 1, 16)])
def test_a_prompts_last_token_on_the_causal_dot_products_is_the_template_products_bit_for_bit(m, hq, hkv, d,
                                                                                             monkeypatch):
    """The causal dot products pack a prompt's own keys and values on each call, from float32 rows that
    hold bf16 values (rows wider than the keys, as the projection leaves them); a template is packed once
    from bf16. The prompt's last token sees every key, so its rows must come out as the template products'
    over all of them on the same dot products, bit for bit: a key or value packed differently (a pair's
    halves, a chunk's end, another head's rows) shows."""
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "dot")  # on AMX too: the causal path has no tiles
    torch.manual_seed(m)
    scale = float(torch.tensor(d ** -0.5, dtype=torch.float32))  # the same scale in float32 on both sides
    q = torch.randn(m, hq, d)
    kv = torch.randn(m, 2 * hkv * d + 8).bfloat16().float()
    k, v = kv[:, :hkv * d], kv[:, hkv * d:2 * hkv * d]
    out = torch.empty(m, hq, d)
    lib = onednn.load()[0]
    assert lib.ps_onednn_causal_attend(q.data_ptr(), hq * d, out.data_ptr(), hq * d, m, hq, hkv, d,
                                       ctypes.c_float(scale), k.data_ptr(), kv.stride(0), v.data_ptr(),
                                       kv.stride(0)) == 0, onednn.last_error()
    template = onednn.OneDnnTemplate(k.reshape(m, hkv, d).bfloat16(), v.reshape(m, hkv, d).bfloat16())
    assert template.kernel == onednn.TEMPLATE_KERNELS[1]
    g = hq // hkv
    for h in range(hkv):
        o, _, l = template.attend(h, (q[-1, h * g:(h + 1) * g] * scale).contiguous())
        assert torch.equal(out[-1, h * g:(h + 1) * g], o * (1.0 / l)[:, None]), h


@needs_dot
@pytest.mark.parametrize("r,cached,m,kv_dtype", [(0, 0, onednn.PROMPT_ATTENTION_MIN_TOKENS - 1, torch.bfloat16),
                                                 (0, 5, 200, torch.bfloat16), (8, 0, 200, torch.bfloat16),
                                                 (0, 0, 200, torch.float32)])
def test_the_prompt_dot_products_are_kept_to_long_prompts_with_nothing_before_them(r, cached, m, kv_dtype):
    """Too few tokens, a cached part before them, a template before them, or a float32 cache: the
    native kernels run, bit for bit, whether or not the dot products are offered."""
    q, k, v, kc, vc, table, template, slots = prefill_case(r, cached, m, 6, 2, 32)
    caches = [(kc.to(kv_dtype), vc.to(kv_dtype)) for _ in range(2)]
    native_out, offered = (prefill_attention(q, k, v, 32 ** -0.5, template=template, cache=cache, block_table=table,
                                             cached=(r, cached), slots=slots, causal=causal)
                           for cache, causal in zip(caches, (False, True)))
    assert torch.equal(native_out, offered)


@needs_bf16
def test_decode_narrows_what_it_stores_as_torch_does():
    """new_kv that is not bf16-representable: stored as torch's round-to-nearest-even of it."""
    q, kc, vc, tables, ctx, templates, new_kv = decode_case([3, 10, 17], 6, 2, 32, seed=9, rounded=False)
    kc16, vc16 = kc.bfloat16(), vc.bfloat16()
    for kcache, vcache in ((kc, vc), (kc16, vc16)):
        decode_attention(q, kcache, vcache, tables, ctx, 0.2, templates=templates, new_kv=new_kv)
    k, _, slots = new_kv
    assert torch.equal(kc.view(-1, 2, 32)[slots], k) and not torch.equal(bf16_exact(k), k)
    assert torch.equal(kc16.view(torch.int16), kc.bfloat16().view(torch.int16))
    assert torch.equal(vc16.view(torch.int16), vc.bfloat16().view(torch.int16))


# --- the decoder stack in bfloat16 ----------------------------------------------------------------------

@needs_bf16
@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen3"])
def test_bf16_stack_gives_the_kernel_by_kernel_forward_with_rounded_kv(make_engine, model_dirs, which, monkeypatch):
    """Every step of a mixed workload (test_cpu_stack's) runs kernel by kernel first, from a copy
    of the bfloat16 cache, with the new K/V rounded to bf16 after the rotation, then through the
    stack: the same hidden states and cache, bit for bit. Without that rounding the forward differs
    (the stack's rounding is what the comparison sees). The native template attention, whose
    float32 template layout the kernel-by-kernel forward reads."""
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, "native")
    engine = make_engine(model_dirs[which], num_blocks=160, max_num_batched_tokens=24, dtype="bfloat16",
                         backend="cpu")
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in engine._core.backend.kv_layers)
    assert any(check_mixed_workload(engine, monkeypatch, round_kv=True))


# --- the engine in bfloat16 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, tokenizer_dir):
    from prefix_service import synthetic as models
    return models.build_model(tmp_path_factory.mktemp("tied") / "llama", "llama", tokenizer_dir, seed=7,
                              tie_word_embeddings=True)


# The torch backend runs bf16 activations, the cpu backend float32 ones over the same bf16 weights
# and bf16-rounded linear outputs, so their logits differ by a few bf16 steps (logits here are
# |x| <= 6, where a bf16 step is 1/32). Measured max |diff| over these models and ids: 0.129
# (mistral); each backend alone is within 0.14 of float32. The bound leaves ~2.3x margin.
LOGITS_BOUND = 0.3


# the linear kernels the engine tests run: the machine's default, and brgemm on any machine (without
# AMX its blocks run through torch's fallback GEMM): onednn.py
KERNELS = [None, "brgemm"]


def choose_kernel(monkeypatch, kernel: str | None) -> None:
    if kernel is not None:
        monkeypatch.setenv(onednn.KERNEL_ENV, kernel)


@needs_bf16
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral", "qwen3", "tied"])
def test_bf16_logits_match_the_torch_backend(make_engine, model_dirs, tied_llama_dir, which, kernel, monkeypatch):
    choose_kernel(monkeypatch, kernel)
    model_dir = tied_llama_dir if which == "tied" else model_dirs[which]
    ref = make_engine(model_dir, dtype="bfloat16", backend="torch")
    cpu = make_engine(model_dir, dtype="bfloat16", backend="cpu")
    assert (ref.info.backend, cpu.info.backend) == ("torch", "cpu")
    for ids in ([(7 * i + 3) % 500 + 3 for i in range(37)], PREFIX + PROMPTS[3], [5, 9, 11]):
        got, want = engine_last_logits(cpu, ids), engine_last_logits(ref, ids)
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= LOGITS_BOUND, (which, len(ids))


def ids_of(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * salt + 5) % 500 + 3 for i in range(n)]


# A prefill over a packed template does not sum its scores in the order of a plain prefill (the
# kernel's template panels vs its rows), so their float32 results differ by ~1e-5; in bfloat16
# every linear output is rounded to bf16, which now and then turns that into one bf16 step of a
# hidden value or logit (the logits are bf16 values too). Greedy ids then flip only where the top
# two logits are that close. Measured over llama/qwen2/mistral/qwen3, template lengths 1..17 and 8
# salts each: 1 of 192 runs differs (llama, length 4), at a top-two gap of 0.03125, one bf16 step at
# |logit| in [4, 8).
NEAR_TIE = 0.1


def assert_same_or_near_tie(engine, ids: list[int], want: list[int], got: list[int], what,
                            either_order: bool = False) -> None:
    """got (on a template) == want (the same ids without one), or at the first step where they
    differ the no-template logits' top two are within NEAR_TIE and got took the runner-up. With
    either_order, the two tokens may be the top two in either order: where a long prompt's attention
    runs on the dot products, a position's logits computed in a prefill (q and P rounded to bf16) and
    in a decode step (float32 over the cache) differ by bf16 roundings, so recomputing them need not
    rank want's token first at a near tie."""
    assert len(got) == len(want), what
    if got == want:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    top = engine_last_logits(engine, ids + want[:j]).topk(2)
    gap = (top.values[0] - top.values[1]).item()
    # the two tokens are the top two (in either order where their logits are equal bf16 values)
    order = top.indices.tolist()
    either = (either_order or gap == 0) and sorted(order) == sorted([want[j], got[j]])
    assert (order == [want[j], got[j]] or either) and gap <= NEAR_TIE, (what, j, top, gap)


def assert_templates_equal_no_template(engine, prefix_lens, max_tokens: int) -> None:
    """For each length, 9 more ids after a template of that many: greedy ids on the pinned template
    equal those of the same ids without it, or first differ at a near tie (assert_same_or_near_tie)."""
    for prefix_len in prefix_lens:
        full = ids_of(prefix_len + 9, salt=prefix_len)
        expected = run_ids(engine, full, max_tokens=max_tokens)
        engine.add_template("p", token_ids=full[:prefix_len])
        got = run_ids(engine, full[prefix_len:], prefix="p", max_tokens=max_tokens)
        assert engine.remove_template("p")
        assert_same_or_near_tie(engine, full, expected, got, prefix_len)


# the template attentions the engine tests run: the native kernels (the default) and the matrix
# products (onednn.OneDnnTemplate) on the CPU's best kernel for them (AMX tiles, AVX512-BF16 dot
# products, else torch's fallback GEMM) and on the fallback GEMM whatever the CPU has
TEMPLATE_ATTENTIONS = ["native", "matrix", "matrix-fallback"]
FAST_PRODUCTS = onednn.template_kernel(16) != "fallback GEMM"  # the CPU has AMX or AVX512-BF16


def choose_template_attention(monkeypatch, how: str) -> None:
    monkeypatch.setenv(onednn.TEMPLATE_ATTENTION_ENV, how.split("-")[0])
    monkeypatch.setenv(onednn.TEMPLATE_PRODUCTS_ENV, "fallback" if how.endswith("-fallback") else "auto")


@needs_bf16
@pytest.mark.parametrize("how", TEMPLATE_ATTENTIONS)
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_bf16_prefix_equals_no_prefix(make_engine, model_dirs, which, how, monkeypatch):
    """Greedy ids on a pinned template (read from its packed copy: float32 for the native kernels,
    bf16 for the matrix products) equal the ids of the same tokens without it, or differ first at
    a near tie (NEAR_TIE), for templates around block boundaries. llama's length-4 case takes the
    near-tie branch with the native kernels."""
    choose_template_attention(monkeypatch, how)
    engine = make_engine(model_dirs[which], block_size=BS, dtype="bfloat16", backend="cpu")
    assert engine._core.backend.stack.template_matrix == how.startswith("matrix")
    assert ("(fallback GEMM)" in engine._core.backend.describe()) == (how == "matrix-fallback"
                                                                      or (how == "matrix" and not FAST_PRODUCTS))
    calls = onednn.template_attend_calls()
    assert_templates_equal_no_template(engine, (1, BS - 1, BS, BS + 1, 2 * BS, 4 * BS + 1), 24)
    # the decodes on templates of a full block or more ran their template part as matrix products
    assert (onednn.template_attend_calls() > calls) == how.startswith("matrix")


@needs_dot
@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_bf16_long_prompts_on_the_dot_products(make_engine, model_dirs, which, monkeypatch):
    """An engine whose long prompts attend over their own keys on the dot products (the default where
    the template's products run on them) gives the greedy ids of one on the native kernels, or
    differs first at a near tie: for a 200-token prompt with no template, and for a 150-token
    template it pins that way, with and without the template, in one step and in chunks."""
    monkeypatch.delenv(onednn.PROMPT_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(onednn.TEMPLATE_ATTENTION_ENV, raising=False)
    monkeypatch.delenv(onednn.TEMPLATE_PRODUCTS_ENV, raising=False)
    default = onednn.prompt_attention(64)  # "measure" on AMX: the stack times both ways
    for budget in (2048, 160):
        monkeypatch.delenv(onednn.PROMPT_ATTENTION_ENV, raising=False)  # the default (set below, each round)
        dot = make_engine(model_dirs[which], block_size=BS, dtype="bfloat16", backend="cpu",
                          max_num_batched_tokens=budget)
        monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "native")
        native_engine = make_engine(model_dirs[which], block_size=BS, dtype="bfloat16", backend="cpu",
                                    max_num_batched_tokens=budget)
        monkeypatch.setenv(onednn.PROMPT_ATTENTION_ENV, "dot")
        timing = dot._core.backend.stack.prompt_timing
        want_default = timing.choice == "dot" if default == "measure" else default == "dot"
        assert dot._core.backend.stack.prompt_dot == want_default and not native_engine._core.backend.stack.prompt_dot
        if not want_default:  # a CPU with AMX where the timing kept the native kernels: asked for, as here
            dot = make_engine(model_dirs[which], block_size=BS, dtype="bfloat16", backend="cpu",
                              max_num_batched_tokens=budget)
        assert "own attention as AVX512-BF16 dot products" in dot._core.backend.describe()
        assert "own attention" not in native_engine._core.backend.describe()
        prompt = ids_of(200, salt=budget)
        calls = onednn.causal_attend_calls()
        run_ids(native_engine, prompt, max_tokens=1)
        assert onednn.causal_attend_calls() == calls
        run_ids(dot, prompt, max_tokens=1)  # its first chunk, of 160 or all 200 tokens, on the dot products
        assert onednn.causal_attend_calls() == calls + dot._core.arch.num_layers
        assert_same_or_near_tie(native_engine, prompt, run_ids(native_engine, prompt, max_tokens=12),
                                run_ids(dot, prompt, max_tokens=12), ("alone", budget), either_order=True)
        full = ids_of(170, salt=budget + 1)
        expected = run_ids(dot, full, max_tokens=12)
        dot.add_template("p", token_ids=full[:150])
        assert_same_or_near_tie(dot, full, expected, run_ids(dot, full[150:], prefix="p", max_tokens=12),
                                ("template", budget), either_order=True)
        assert dot.remove_template("p")


@needs_bf16
@pytest.mark.parametrize("how", TEMPLATE_ATTENTIONS)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("budget", [2048, 7], ids=["batched", "chunked-prefill"])
def test_bf16_mixed_batch_on_templates_equals_no_prefix(make_engine, budget, kernel, how, monkeypatch):
    """Plain requests and requests on three templates, entering together (one schedule: prefills
    beside decodes, chunked under a small budget): each request's greedy ids are those of its full
    token ids run alone without a template, or differ first at a near tie."""
    choose_kernel(monkeypatch, kernel)
    choose_template_attention(monkeypatch, how)
    prefixes = {"a": ids_of(9, 100), "b": ids_of(4, 200), "c": ids_of(14, 300)}
    engine = make_engine(block_size=BS, max_num_batched_tokens=budget, dtype="bfloat16", backend="cpu")
    reqs, full, expected = [], [], []
    for k in range(9):
        name = [None, "a", "b", "c"][k % 4]
        user = ids_of(3 + 2 * k, salt=k + 1)
        reqs.append(GenerateRequest(prompt_token_ids=user, prefix_name=name, sampling=greedy(20)))
        full.append((prefixes[name] if name else []) + user)
        expected.append(run_ids(engine, full[-1], max_tokens=20))
    for name, ids in prefixes.items():
        engine.add_template(name, token_ids=ids)
    for k, got in enumerate(generate_together(engine, reqs)):
        assert_same_or_near_tie(engine, full[k], expected[k], got, k)


@needs_bf16
def test_an_engine_on_wider_brgemm_blocks_says_so_and_matches_the_default(make_engine, monkeypatch):
    """PREFIX_SERVICE_BF16_BRGEMM_COLUMNS reaches every linear of the stack: the backend names the
    width, and the greedy ids are the default width's (the same sums, cut differently; where the
    micro-kernel's order of sums were to differ, a near tie may flip)."""
    monkeypatch.setenv(onednn.KERNEL_ENV, "brgemm")
    default = make_engine(dtype="bfloat16", backend="cpu")
    assert "column blocks" not in default._core.backend.describe()
    want = [run_ids(default, p, max_tokens=8) for p in PROMPTS]
    monkeypatch.setenv(onednn.COLUMNS_ENV, "64")
    wide = make_engine(dtype="bfloat16", backend="cpu")
    assert "64-column blocks" in wide._core.backend.describe()
    for k, p in enumerate(PROMPTS):
        assert_same_or_near_tie(default, p, want[k], run_ids(wide, p, max_tokens=8), k)


@needs_bf16
def test_an_engine_on_amx_names_its_default_linears_and_the_tiles(make_engine, monkeypatch):
    """Where oneDNN has AMX tiles (brgemm_vnni), the default linears are each shape timed on brgemm and
    the inner product, without the few-row kernel, and the start-up line says so and what each runs;
    the inner product, asked for, names the tiles oneDNN runs it on."""
    monkeypatch.delenv(onednn.KERNEL_ENV, raising=False)
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: True)
    backend = make_engine(dtype="bfloat16", backend="cpu")._core.backend
    described = backend.describe()
    if not onednn.bf16_native():  # AMX simulated where torch refuses bf16 inner products: brgemm alone
        assert onednn.default_kernel() == "brgemm" and "oneDNN brgemm bf16 linears" in described, described
        return
    assert (f"oneDNN bf16 linears, each shape timed on brgemm and the inner product (AMX; {backend.linear_choices()})"
            in described and "dot products up to" not in described), described
    monkeypatch.setenv(onednn.KERNEL_ENV, "inner_product")
    described = make_engine(dtype="bfloat16", backend="cpu")._core.backend.describe()
    few_rows = "avx512_bf16" in cpuinfo.kernel_flags() and onednn.few_rows_default()
    assert (f"oneDNN bf16 linears (AMX; AVX512-BF16 dot products {default_dot_rows()})" if few_rows
            else "oneDNN bf16 linears (AMX)") in described, described


@needs_bf16
def test_bf16_engine_reports_itself_and_samples_deterministically(make_engine):
    engine = make_engine(dtype="bfloat16", backend="cpu")
    core = engine._core
    assert core.backend.name == "cpu" and core.dtype == torch.bfloat16
    described = core.backend.describe()
    assert "bf16" in described and ("AMX" in described) == onednn.brgemm_vnni()
    # the default linears: on AMX each shape timed on brgemm and the inner product, else oneDNN's inner
    # product on every CPU whose torch runs it in bf16, a decode step's small calls on the few-row kernel
    # where the CPU has AVX512-BF16 (the test env's default)
    amx = onednn.brgemm_vnni()
    inner = onednn.bf16_native() and not amx
    few_rows = inner and "avx512_bf16" in cpuinfo.kernel_flags() and onednn.few_rows_default() > 0
    assert ("oneDNN bf16 linears, each shape timed on brgemm and the inner product (AMX; " in described) == amx
    assert ("oneDNN bf16 linears" in described) == (inner or amx)
    assert (f"AVX512-BF16 dot products {default_dot_rows()}" in described) == few_rows
    assert len(core.backend.kv_layers) > 0
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in core.backend.kv_layers)
    engine.add_template("tpl", token_ids=PREFIX)

    def sample(seed: int) -> list[list[int]]:
        sampling = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        reqs = [GenerateRequest(prompt_token_ids=p, prefix_name="tpl" if k % 2 else None, sampling=sampling)
                for k, p in enumerate(PROMPTS)]
        return [o.token_ids for o in engine.generate(reqs)]
    first = sample(123)
    assert all(len(ids) == 16 for ids in first)
    assert sample(123) == first
    assert sample(124) != first  # the seed is what makes it repeat: the tokens are sampled
