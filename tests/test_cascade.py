"""The torch backend's attention helpers (backends/torch/cascade.py): `attend` on torch's CPU flash
kernel and on its math fallback equals an explicit softmax, with its log-sum-exp; shared-prefix
(cascade) decode attention equals plain paged attention over the whole context; the torch backend
groups decodes on one template into a cascade."""
import pytest
import torch

import prefix_service.backends.torch.cascade as cascade_mod
from cuda_ops.paged_decode import paged_decode_attention_ref
from helpers import greedy, pinned_handle, run_ids
from prefix_service import GenerateRequest
from prefix_service.backends.torch.cascade import CascadeDecode, PrefixGroup, attend, cascade_decode


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("consecutive", [False, True], ids=["gathered", "in-place"])
def test_cascade_equals_full_attention(dtype, tol, bs, consecutive):
    g = torch.Generator().manual_seed(bs)
    hq, hkv, d, nblocks = 6, 2, 32, 200
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    if consecutive:  # prefixes at blocks 0-2 and 3-7, read as slices of the cache
        prefixes = [[0, 1, 2], [3, 4, 5, 6, 7]]
        free = iter((8 + torch.randperm(nblocks - 8, generator=g)).tolist())
    else:
        free = iter(torch.randperm(nblocks, generator=g).tolist())
        prefixes = [[next(free) for _ in range(n)] for n in (3, 5)]  # two shared prefixes (full blocks)
    # rows: (prefix index or None, own tokens)
    rows = [(0, 1), (0, bs + 2), (1, 3), (None, 2 * bs + 1), (1, 1), (0, 5)]
    tables, ctx, suffix_tables, suffix_lens = [], [], [], []
    for p, own in rows:
        own_blocks = [next(free) for _ in range(-(-own // bs))]
        shared = prefixes[p] if p is not None else []
        tables.append(shared + own_blocks)
        ctx.append(len(shared) * bs + own)
        suffix_tables.append(own_blocks)
        suffix_lens.append(own)
    width = max(map(len, tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    sw = max(map(len, suffix_tables))
    st = torch.tensor([t + [-1] * (sw - len(t)) for t in suffix_tables], dtype=torch.int32)
    q = torch.randn(len(rows), hq, d, generator=g).to(dtype)
    cascade = CascadeDecode(
        groups=[PrefixGroup(torch.tensor(prefixes[p]), torch.tensor([i for i, r in enumerate(rows) if r[0] == p]),
                            prefixes[p][0] if consecutive else None) for p in (0, 1)],
        suffix_block_tables=st, suffix_lens=torch.tensor(suffix_lens, dtype=torch.int32), max_suffix=max(suffix_lens))
    ref = paged_decode_attention_ref(q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), max(ctx), d ** -0.5)
    out = cascade_decode(q, kc, vc, cascade, d ** -0.5)
    assert out.dtype == dtype
    assert (out.float() - ref.float()).abs().max() <= tol


def test_engine_uses_cascade_for_shared_prefix_batches(make_engine, monkeypatch):
    import prefix_service.backends.torch.attention as attention
    calls = []
    real = attention.cascade_decode

    def counting(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)

    monkeypatch.setattr(attention, "cascade_decode", counting)
    engine = make_engine(block_size=4, backend="torch")  # the cpu backend's kernel reads each context instead
    prefix = [(3 * i + 7) % 500 + 3 for i in range(23)]
    users = [[(5 * i + k) % 500 + 3 for i in range(2 + k)] for k in range(5)]
    expected = [run_ids(engine, prefix + u, max_tokens=12) for u in users]
    assert not calls  # no shared prefix, no cascade
    engine.add_template("p", token_ids=prefix)
    outs = engine.generate([GenerateRequest(prompt_token_ids=u, prefix_name="p", sampling=greedy(12)) for u in users])
    assert [o.token_ids for o in outs] == expected
    assert calls and max(calls) == len(users)
    # the warmup pinned the template in consecutive blocks (the groups read it in place); a lone
    # request gathers its whole context instead of splitting it
    table = pinned_handle(engine, "p").block_table
    assert list(table) == list(range(table[0], table[0] + len(table)))
    calls.clear()
    assert run_ids(engine, users[0], prefix="p", max_tokens=12) == expected[0]
    assert not calls


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
