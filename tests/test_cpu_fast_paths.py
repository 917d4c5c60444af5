"""CPU fast paths equal plain torch: oneDNN packed linears (PackedLinear, pack_linears,
model.cpu_linear), the flash/math `attend` of cascade.py and its single-group cascade decode, and
the split prefill of the torch attention backend (a leading run of context blocks read in place,
the rest of the context gathered, merged by log-sum-exp)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cuda_ops
import prefix_service.backends.torch.cascade as cascade_mod
from cuda_ops.paged_decode import paged_decode_attention_ref
from helpers import greedy
from prefix_service import Engine, GenerateRequest, ModelConfig
from prefix_service import synthetic as models
from prefix_service.backends.torch.attention import AttentionMetadata, TorchAttentionBackend
from prefix_service.backends.torch.cascade import CascadeDecode, PrefixGroup, attend, cascade_decode
from prefix_service.config import ConfigError, config_from_dict
from prefix_service.errors import PrefixServiceError
from prefix_service.model.packed_linear import PackedLinear, onednn_linear_available, pack_linears
from prefix_service.model_runner import ModelRunner


def need_onednn(dtype: torch.dtype) -> None:
    """Skip where this torch build or CPU cannot run the packed linear; a packed linear that runs
    but computes something else is a failure, not a reason to skip."""
    reason = onednn_linear_available(dtype)
    if reason is not None:
        if "disagreed" in reason:
            pytest.fail(f"{dtype}: {reason}")
        pytest.skip(f"oneDNN linear unusable for {dtype}: {reason}")


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


# --- PackedLinear / pack_linears -----------------------------------------------------------------

@pytest.mark.parametrize("dtype,rel_tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_f_linear(dtype, rel_tol, bias, rows):
    need_onednn(dtype)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    layer = PackedLinear(w, b)
    assert (layer.in_features, layer.out_features) == (96, 80)
    with torch.inference_mode():
        got = layer(x)
        got_strided = layer(x.t().contiguous().t())  # same values, a non-contiguous view
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (rows, 80) and got.dtype == dtype
    tol = rel_tol * want.abs().max().item()
    assert max_err(got, want) <= tol
    assert max_err(got, F.linear(x, w, b)) <= 2 * tol  # F.linear in the layer's own dtype
    assert max_err(got_strided, want) <= tol


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(24, 32, bias=False), nn.GELU(), nn.Sequential(nn.Linear(32, 24)))
            for _ in range(3))
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(self.norm(x))


def test_pack_linears_replaces_nested_layers():
    need_onednn(torch.float32)
    torch.manual_seed(0)
    model = _Nested().eval()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert n_linear == 8
    x = torch.randn(9, 12)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == n_linear
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == n_linear
    assert isinstance(model.blocks[1][2][0], PackedLinear) and model.blocks[1][2][0].bias is not None
    assert model.blocks[0][0].bias is None
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pack_linears(model) == 0  # nothing left to pack


# --- model.cpu_linear on an engine ---------------------------------------------------------------

@pytest.fixture
def build_engine(make_engine):
    """build_engine(model_dir, cpu_linear) -> Engine on CPU (block size 4), through `make_engine`:
    integrity-checked and shut down after the test."""
    def factory(model_dir, cpu_linear: str, dtype: str = "float32") -> Engine:
        return make_engine(model_dir, cpu_linear=cpu_linear, dtype=dtype, num_blocks=160, max_num_batched_tokens=512)
    return factory


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory, tokenizer_dir):
    return models.build_model(tmp_path_factory.mktemp("tied") / "llama", "llama", tokenizer_dir, seed=7,
                              tie_word_embeddings=True)


PREFIX = [(3 * i + 7) % 500 + 3 for i in range(22)]  # 5 full blocks of 4 + 2
PROMPTS = [[(5 * i + k) % 500 + 3 for i in range(2 + 3 * k)] for k in range(4)]


def _generate(engine: Engine, max_tokens: int = 24) -> list[list[int]]:
    """Plain prompts (batched prefill + decode), then the same prompts on a pinned template
    (prefill over a run of context blocks, cascade decode)."""
    plain = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy(max_tokens)) for p in PROMPTS])
    engine.add_prefix("tpl", token_ids=PREFIX)
    on_tpl = engine.generate([GenerateRequest(prompt_token_ids=p, prefix_name="tpl", sampling=greedy(max_tokens))
                              for p in PROMPTS])
    assert engine.remove_prefix("tpl")
    return [o.token_ids for o in plain + on_tpl]


@pytest.mark.parametrize("which", ["llama", "qwen2", "tied"])
def test_onednn_engine_generates_like_blas(build_engine, model_dirs, tied_llama_dir, which):
    need_onednn(torch.float32)
    model_dir = tied_llama_dir if which == "tied" else model_dirs[which]
    blas = build_engine(model_dir, "blas")
    onednn = build_engine(model_dir, "onednn")
    assert blas.core.cpu_linear == "blas" and onednn.core.cpu_linear == "onednn"
    blas_modules, onednn_modules = list(blas.core.model.modules()), list(onednn.core.model.modules())
    assert any(isinstance(m, nn.Linear) for m in blas_modules)
    assert not any(isinstance(m, PackedLinear) for m in blas_modules) and blas.core.model.packed_head is None
    assert any(isinstance(m, PackedLinear) for m in onednn_modules)
    assert not any(isinstance(m, nn.Linear) for m in onednn_modules)
    model = onednn.core.model
    if which == "tied":
        assert model.lm_head is None and model.packed_head is not None
        hidden = torch.randn(5, model.embed_tokens.weight.shape[1], generator=torch.Generator().manual_seed(0))
        want = F.linear(hidden, model.embed_tokens.weight)
        got = model.compute_logits(hidden)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert max_err(got, want) <= 1e-5 * want.abs().max().item()
    else:
        assert model.packed_head is None
    want_ids, got_ids = _generate(blas), _generate(onednn)
    assert all(len(ids) == 24 for ids in got_ids)
    assert got_ids == want_ids


def test_cpu_linear_auto_picks_onednn_without_the_native_kernel(build_engine, llama_dir, monkeypatch):
    need_onednn(torch.float32)
    from prefix_service.backends.cpu import linear as cpu_linear
    monkeypatch.setattr(cpu_linear, "available", lambda dtype: "no C++ compiler found (set CXX)")
    assert build_engine(llama_dir, "auto").core.cpu_linear == "onednn"


# --- model.cpu_linear config and fallbacks -------------------------------------------------------

def test_cpu_linear_config_rejects_unknown_value():
    with pytest.raises(ConfigError, match=r"model\.cpu_linear: 'fast' is not one of auto, native, onednn, blas"):
        config_from_dict({"model": {"path": "m", "cpu_linear": "fast"}})
    with pytest.raises(ConfigError, match=r"model\.cpu_linear"):
        ModelConfig(path="m", cpu_linear="fast")
    assert config_from_dict({"model": {"path": "m", "cpu_linear": "blas"}}).engine.model.cpu_linear == "blas"
    assert ModelConfig(path="m").cpu_linear == "auto"


def test_cpu_linear_without_onednn(build_engine, llama_dir, monkeypatch):
    import prefix_service.engine.core as core
    from prefix_service.backends.cpu import linear as cpu_linear
    reason = "this test's torch pretends to have no oneDNN"
    monkeypatch.setattr(core, "onednn_linear_available", lambda dtype: reason)
    monkeypatch.setattr(cpu_linear, "available", lambda dtype: "no C++ compiler found (set CXX)")
    with pytest.raises(PrefixServiceError, match=f"model.cpu_linear: onednn was asked for, but {reason}"):
        build_engine(llama_dir, "onednn")
    auto = build_engine(llama_dir, "auto")
    assert auto.core.cpu_linear == "blas"
    assert not any(isinstance(m, PackedLinear) for m in auto.core.model.modules())
    blas = build_engine(llama_dir, "blas")
    reqs = [GenerateRequest(prompt_token_ids=p, sampling=greedy(12)) for p in PROMPTS]
    got = [o.token_ids for o in auto.generate(reqs)]
    assert all(len(ids) == 12 for ids in got)
    assert got == [o.token_ids for o in blas.generate(reqs)]


# --- attend: flash vs math vs an explicit softmax -----------------------------------------------

def _softmax_ref(q, k, v, mask, scale, causal):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask.double()
    if causal:
        m, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()), torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", ["plain", "mask", "causal"])
@pytest.mark.parametrize("hkv", [6, 2], ids=["mha", "gqa"])
def test_attend_flash_math_and_reference_agree(monkeypatch, dtype, tol, case, hkv):
    g = torch.Generator().manual_seed(3)
    b, h, m, d = 2, 6, 9, 32
    n = m if case == "causal" else 21
    q = torch.randn(b, h, m, d, generator=g).to(dtype)
    # K and V as strided views ([B, L, Hkv, D] transposed), as the callers pass them; with GQA, query
    # head i reads KV head i // (h / hkv)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype).transpose(1, 2)
    mask = None
    if case == "mask":  # additive, broadcast over heads: some finite biases, some keys hidden per row
        mask = torch.randn(b, 1, m, n, generator=g)
        mask = mask.masked_fill(torch.rand(b, 1, m, n, generator=g) < 0.3, float("-inf"))
        mask[..., 0] = 0.0  # every row keeps a key
        mask = mask.to(dtype)
    causal = case == "causal"
    scale = d ** -0.5
    lse_tol = 1e-5 if dtype == torch.float32 else 2e-2
    want_out, want_lse = _softmax_ref(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                      mask, scale, causal)
    results = {}
    for path in ("flash", "math"):
        if path == "math":
            monkeypatch.setattr(cascade_mod, "CPU_FLASH", None)
        elif cascade_mod.CPU_FLASH is None:
            continue
        out, lse = attend(q, k, v, mask, scale, causal=causal)
        assert out.shape == (b, h, m, d) and out.dtype == dtype
        assert lse.shape == (b, h, m) and lse.dtype == torch.float32
        assert max_err(out, want_out) <= tol
        assert max_err(lse, want_lse) <= lse_tol
        results[path] = out, lse
    if "flash" in results:
        assert max_err(results["flash"][0], results["math"][0]) <= tol
        assert max_err(results["flash"][1], results["math"][1]) <= lse_tol


# --- cascade decode with one group covering every row (its fast path) ----------------------------

@pytest.mark.parametrize("flash", [True, False], ids=["flash", "math"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize("bs", [4, 16])
def test_cascade_single_group_equals_full_attention(monkeypatch, flash, consecutive, bs):
    if not flash:
        monkeypatch.setattr(cascade_mod, "CPU_FLASH", None)
    elif cascade_mod.CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash attention op")
    g = torch.Generator().manual_seed(bs + consecutive)
    hq, hkv, d, nblocks = 6, 2, 32, 120
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    if consecutive:
        prefix = list(range(5, 10))
        free = iter((10 + torch.randperm(nblocks - 10, generator=g)).tolist())
    else:
        free = iter(torch.randperm(nblocks, generator=g).tolist())
        prefix = [next(free) for _ in range(5)]
    own_lens = [1, bs + 2, 3, 2 * bs, 1]
    tables, ctx, suffix_tables = [], [], []
    for own in own_lens:
        own_blocks = [next(free) for _ in range(-(-own // bs))]
        tables.append(prefix + own_blocks)
        ctx.append(len(prefix) * bs + own)
        suffix_tables.append(own_blocks)
    width, sw = max(map(len, tables)), max(map(len, suffix_tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    st = torch.tensor([t + [-1] * (sw - len(t)) for t in suffix_tables], dtype=torch.int32)
    n = len(own_lens)
    q = torch.randn(n, hq, d, generator=g)
    cascade = CascadeDecode(
        groups=[PrefixGroup(torch.tensor(prefix), torch.arange(n), prefix[0] if consecutive else None)],
        suffix_block_tables=st, suffix_lens=torch.tensor(own_lens, dtype=torch.int32), max_suffix=max(own_lens))
    seen = []
    real_shared = cascade_mod.attend_shared
    monkeypatch.setattr(cascade_mod, "attend_shared", lambda qq, *a: seen.append(qq) or real_shared(qq, *a))
    scale = d ** -0.5
    out = cascade_decode(q, kc, vc, cascade, scale)
    assert len(seen) == 1 and seen[0] is q  # the fast path: the batch's queries as they are, no gather
    ref = paged_decode_attention_ref(q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), max(ctx), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_err(out, ref) <= 2e-6


# --- split prefill vs concat + varlen attention --------------------------------------------------

def _prefill_batch(bs: int):
    """(block table, context tokens, new tokens) per prefill sequence, covering every case of the
    split: a run + partial rest, exactly a run, no context, a run broken after one block, a run of
    one block then scattered blocks, and a context shorter than one block."""
    return [
        ([10, 11, 12, 13, 14], 3 * bs + 2, 5),  # run of 3 (block 13 is partial: not in the run), rest 2
        ([20, 21, 22], 2 * bs, 4),  # exactly a run: the new tokens alone causal
        ([30, 31], 0, 7),  # no context
        ([40, 5, 41, 42, 43], 3 * bs + 1, 3),  # consecutive only after the first block: run 1
        ([50, 2, 7, 60], 2 * bs + 3, 1),  # scattered: run 1; one new token
        ([70, 71], bs - 1, 4),  # context inside one partial block: no run, rest only
    ]


def _prefill_meta(seqs, bs: int) -> AttentionMetadata:
    width = max(len(t) for t, _, _ in seqs)
    q_lens = [n for _, _, n in seqs]
    ctx = [c for _, c, _ in seqs]
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        decode_max_context=0,
        prefill_block_tables=torch.tensor([t + [-1] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32),
        prefill_prefix_lens=torch.tensor(ctx, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        prefill_q_lens=q_lens,
        prefill_prefix_lens_list=ctx,
        prefill_max_q=max(q_lens),
        prefill_max_k=max(a + b for a, b in zip(q_lens, ctx)),
        prefill_total_k=sum(q_lens) + sum(ctx),
        prefill_ctx_runs=[ModelRunner._leading_run(t, c // bs) for t, c, _ in seqs],
    )


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "math"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bs", [4, 16])
def test_prefill_split_equals_concat_then_varlen(monkeypatch, flash, dtype, tol, bs):
    if not flash:  # the split's own attentions on the math fallback
        monkeypatch.setattr(cascade_mod, "CPU_FLASH", None)
    elif cascade_mod.CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash attention op")
    g = torch.Generator().manual_seed(bs)
    hq, hkv, d, nblocks = 6, 2, 32, 80
    seqs = _prefill_batch(bs)
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    tq = sum(n for _, _, n in seqs)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(tq, hkv, d, generator=g).to(dtype)
    v = torch.randn(tq, hkv, d, generator=g).to(dtype)
    scale = d ** -0.5

    meta = _prefill_meta(seqs, bs)
    assert meta.prefill_ctx_runs == [(10, 3), (20, 2), (0, 0), (40, 1), (50, 1), (0, 0)]
    got = TorchAttentionBackend._prefill_split(q, k, v, kc, vc, meta, scale)

    old_meta = _prefill_meta(seqs, bs)
    k_all, v_all, _ = cuda_ops.concat_kvcache_with_prefix(
        kc, vc, old_meta.prefill_block_tables, old_meta.prefill_prefix_lens, k, v,
        old_meta.prefill_cu_seqlens_q, total_k=old_meta.prefill_total_k)
    want = TorchAttentionBackend.attend_varlen(q, k_all, v_all, old_meta, scale)

    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got.float()).all()
    assert max_err(got, want) <= tol
    # every sequence, not just the largest error: per-sequence rows must match too
    start = 0
    for _, _, n in seqs:
        assert max_err(got[start:start + n], want[start:start + n]) <= tol
        start += n


# --- ModelRunner._leading_run --------------------------------------------------------------------

@pytest.mark.parametrize("table,full_blocks,run", [
    ([], 0, (0, 0)),
    ([7, 8, 9], 0, (0, 0)),  # no full block: no run, whatever the table holds
    ([7], 1, (7, 1)),
    ([7, 8, 9, 10], 4, (7, 4)),  # fully consecutive
    ([7, 8, 9, 3, 4], 5, (7, 3)),  # broken after 3 blocks
    ([7, 6, 5], 3, (7, 1)),  # descending is not a run
    ([7, 7, 8], 3, (7, 1)),
    ([7, 8, 9, 10, 11], 2, (7, 2)),  # only the first full_blocks count, the table goes on
    ([0, 1, 2], 3, (0, 3)),
])
def test_leading_run(table, full_blocks, run):
    assert ModelRunner._leading_run(table, full_blocks) == run
