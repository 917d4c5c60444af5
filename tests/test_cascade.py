"""Shared-prefix (cascade) decode attention equals plain paged attention over the whole context."""
import pytest
import torch

from cuda_ops.paged_decode import paged_decode_attention_ref
from helpers import greedy, run_ids
from prefix_service import GenerateRequest
from prefix_service.backends.torch.cascade import CascadeDecode, PrefixGroup, cascade_decode


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
    engine = make_engine(block_size=4, cpu_attention="torch")  # the native kernel reads each context instead
    prefix = [(3 * i + 7) % 500 + 3 for i in range(23)]
    users = [[(5 * i + k) % 500 + 3 for i in range(2 + k)] for k in range(5)]
    expected = [run_ids(engine, prefix + u, max_tokens=12) for u in users]
    assert not calls  # no shared prefix, no cascade
    engine.add_prefix("p", token_ids=prefix)
    outs = engine.generate([GenerateRequest(prompt_token_ids=u, prefix_name="p", sampling=greedy(12)) for u in users])
    assert [o.token_ids for o in outs] == expected
    assert calls and max(calls) == len(users)
    # the warmup pinned the template in consecutive blocks (the groups read it in place); a lone
    # request gathers its whole context instead of splitting it
    table = engine.get_prefix("p").block_table
    assert list(table) == list(range(table[0], table[0] + len(table)))
    calls.clear()
    assert run_ids(engine, users[0], prefix="p", max_tokens=12) == expected[0]
    assert not calls
