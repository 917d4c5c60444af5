"""Tests of cuda_ops.

CPU (always): the torch references against an independent per-token Python loop, bitwise;
the checked wrappers' dispatch and every validation error; the kernel-only checks through a
fake kernel namespace; the build helpers on a machine without CUDA.
CUDA (skipped without a GPU): the compiled kernels against the references, bitwise, with
outputs poisoned first so that an unwritten element shows.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import cuda_ops.ops as ops_mod
from cuda_ops import (
    concat_kvcache_with_prefix,
    concat_kvcache_with_prefix_ref,
    copy_blocks,
    copy_blocks_ref,
    cuda_ops_available,
    load_cuda_ops,
    store_kvcache,
    store_kvcache_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZES = [1, 16, 256]
SHAPES = [(2, 8), (1, 64)]  # (num_kv_heads, head_dim) for the CPU grid
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.is_floating_point():
        got, want = got.view(INT_VIEW[got.dtype]), want.view(INT_VIEW[want.dtype])
    assert torch.equal(got.cpu(), want.cpu())


# ------------------------------------------------------------------------------ naive oracles


def naive_concat(k_cache, v_cache, block_tables, prefix_lens, k_new, v_new, cu_seqlens_q):
    """One row at a time: prefix rows through the block table, then the new rows."""
    block_size = k_cache.shape[1]
    tables, prefixes, cu_q = block_tables.tolist(), prefix_lens.tolist(), cu_seqlens_q.tolist()
    k_rows, v_rows, cu_k = [], [], [0]
    for i, p in enumerate(prefixes):
        for t in range(p):
            block, offset = tables[i][t // block_size], t % block_size
            k_rows.append(k_cache[block, offset])
            v_rows.append(v_cache[block, offset])
        for j in range(cu_q[i], cu_q[i + 1]):
            k_rows.append(k_new[j])
            v_rows.append(v_new[j])
        cu_k.append(len(k_rows))
    empty = k_new.new_empty((0, *k_new.shape[1:]))
    k_out = torch.stack(k_rows) if k_rows else empty
    v_out = torch.stack(v_rows) if v_rows else empty.clone()
    return k_out, v_out, torch.tensor(cu_k, dtype=torch.int32, device=k_new.device)


def naive_store(k, v, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def naive_copy_blocks(k_caches, v_caches, src_dst):
    for src, dst in src_dst.tolist():
        for cache in [*k_caches, *v_caches]:
            cache[dst] = cache[src].clone()


# ------------------------------------------------------------------------------ batches


@dataclass
class Batch:
    args: dict  # keyword arguments of concat_kvcache_with_prefix
    total_k: int


def random_values(shape, dtype, gen, device="cpu") -> torch.Tensor:
    x = torch.randn(shape, generator=gen).to(dtype)
    flat = x.view(-1)
    flat[: min(3, flat.numel())] = torch.tensor([float("nan"), -0.0, float("inf")])[: min(3, flat.numel())].to(dtype)
    return x.to(device)


def make_batch(block_size, dtype, *, heads=2, head_dim=8, seed=0, index_dtype=torch.int32,
               device="cpu", prefix_lens=None, row_pad=0) -> Batch:
    """Sequences whose full prefix blocks are shared (one pinned prefix) and whose partial tail
    block is their own; prefix lengths 0, 1, bs-1, bs, bs+1 by default; 0-4 new tokens each."""
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    if prefix_lens is None:
        prefix_lens = [0, 1, max(block_size - 1, 0), block_size, block_size + 1]
        rnd.shuffle(prefix_lens)
    q_lens = [rnd.randint(0, 4) for _ in prefix_lens]
    if q_lens:
        q_lens[rnd.randrange(len(q_lens))] = 3
    full = [p // block_size for p in prefix_lens]
    tails = [p % block_size != 0 for p in prefix_lens]
    num_blocks = max(full + [0]) + sum(tails) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    shared, own = ids[: max(full + [0])], iter(ids[max(full + [0]):])
    max_blocks = max([f + t for f, t in zip(full, tails)] + [1]) + 1
    tables = torch.full((len(prefix_lens), max_blocks), -1, dtype=torch.int64)
    for i, (f, t) in enumerate(zip(full, tails)):
        row = shared[:f] + ([next(own)] if t else [])
        tables[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    cache_shape = (num_blocks, block_size, heads, head_dim)
    total_q = sum(q_lens)
    fused = random_values((total_q, 2, heads * head_dim + row_pad), dtype, gen, device)  # [T, 2, HD+pad]
    cu_q = [0]
    for q in q_lens:
        cu_q.append(cu_q[-1] + q)
    args = dict(
        k_cache=random_values(cache_shape, dtype, gen, device),
        v_cache=random_values(cache_shape, dtype, gen, device),
        block_tables=tables.to(index_dtype).to(device),
        prefix_lens=torch.tensor(prefix_lens, dtype=index_dtype, device=device),
        k_new=fused[:, 0, : heads * head_dim].unflatten(1, (heads, head_dim)),  # rows may be strided
        v_new=fused[:, 1, : heads * head_dim].unflatten(1, (heads, head_dim)),
        cu_seqlens_q=torch.tensor(cu_q, dtype=index_dtype, device=device),
    )
    return Batch(args, sum(prefix_lens) + total_q)


# ------------------------------------------------------------------------------ CPU: references


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", SHAPES)
def test_concat_reference_matches_naive_loop(block_size, dtype, heads, head_dim):
    for seed in range(2):
        batch = make_batch(block_size, dtype, heads=heads, head_dim=head_dim, seed=seed, row_pad=seed * 8)
        got = concat_kvcache_with_prefix_ref(**batch.args)
        want = naive_concat(**batch.args)
        for g, w in zip(got, want):
            assert_bitwise(g, w)
        assert got[0].shape[0] == batch.total_k


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_concat_wrapper_on_cpu_equals_reference(index_dtype):
    batch = make_batch(16, torch.float16, index_dtype=index_dtype, seed=3)
    want = naive_concat(**batch.args)
    for total_k in (None, batch.total_k):
        got = concat_kvcache_with_prefix(**batch.args, total_k=total_k)
        for g, w in zip(got, want):
            assert_bitwise(g, w)


@pytest.mark.parametrize("prefix_lens", [[], [0, 0], [5, 0]])
def test_concat_degenerate_batches(prefix_lens):
    batch = make_batch(4, torch.float32, prefix_lens=prefix_lens)
    if prefix_lens:  # no new tokens at all
        batch.args["cu_seqlens_q"].zero_()
        batch.args["k_new"] = batch.args["k_new"][:0]
        batch.args["v_new"] = batch.args["v_new"][:0]
    got = concat_kvcache_with_prefix(**batch.args)
    want = naive_concat(**batch.args)
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    assert got[0].shape[0] == sum(prefix_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_reference_matches_naive_and_skips_minus_one(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, head_dim, tokens = 6, 16, 2, 8, 20
    cache = random_values((num_blocks, block_size, heads, head_dim), dtype, gen)
    kv = random_values((tokens, 2, heads, head_dim), dtype, gen)  # [T, 2, H, D]: strided rows
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    slots = slots.to(slot_dtype)
    want_k, want_v = cache.clone(), cache.clone()
    naive_store(k, v, want_k, want_v, slots)
    ref_k, ref_v = cache.clone(), cache.clone()
    store_kvcache_ref(k, v, ref_k, ref_v, slots)
    got_k, got_v = cache.clone(), cache.clone()
    store_kvcache(k, v, got_k, got_v, slots)
    for got in (ref_k, got_k):
        assert_bitwise(got, want_k)
    for got in (ref_v, got_v):
        assert_bitwise(got, want_v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    assert_bitwise(got_k.view(-1, heads, head_dim)[untouched], cache.view(-1, heads, head_dim)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair_dtype", [torch.int64, torch.int32])
def test_copy_blocks_reference_matches_naive(dtype, pair_dtype):
    gen = torch.Generator().manual_seed(2)
    shape = (8, 16, 2, 8)
    k_caches = [random_values(shape, dtype, gen) for _ in range(3)]
    v_caches = [random_values(shape, dtype, gen) for _ in range(3)]
    src_dst = torch.tensor([[1, 5], [2, 6], [0, 7]], dtype=pair_dtype)
    want_k, want_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    naive_copy_blocks(want_k, want_v, src_dst)
    for fn in (copy_blocks_ref, copy_blocks):
        got_k, got_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
        fn(got_k, got_v, src_dst)
        for g, w in zip(got_k + got_v, want_k + want_v):
            assert_bitwise(g, w)
    copy_blocks([], [], src_dst)  # no layers: nothing to do
    copy_blocks(k_caches, v_caches, src_dst[:0])  # no pairs: nothing to do


# ------------------------------------------------------------------------------ CPU: validation


def _noncontiguous(x: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    return wide[..., : x.shape[-1]]


def _heads_last(x: torch.Tensor) -> torch.Tensor:  # same shape, [H, D] rows not dense
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# (argument, its replacement, exception, pattern of the message after "<argument>: expected ")
CONCAT_ERRORS = [
    ("k_new", lambda a: a["k_new"].float(), TypeError, r"dtype torch.float16 \(the cache dtype\), got torch.float32"),
    ("v_cache", lambda a: a["v_cache"].bfloat16(), TypeError, r"dtype torch.float16"),
    ("k_cache", lambda a: a["k_cache"].double(), TypeError, r"dtype float32, float16 or bfloat16, got torch.float64"),
    ("k_cache", lambda a: _noncontiguous(a["k_cache"]), ValueError, r"a contiguous tensor"),
    ("k_cache", lambda a: a["k_cache"][0], ValueError, r"a 4-d tensor"),
    ("v_cache", lambda a: a["v_cache"][:-1], ValueError, r"shape"),
    ("k_new", lambda a: a["k_new"][:, :1], ValueError, r"\[num_tokens, 2, 8\]"),
    ("k_new", lambda a: a["k_new"].tolist(), TypeError, r"a torch.Tensor, got list"),
    ("v_new", lambda a: a["v_new"][1:], ValueError, r"\d+ rows"),
    ("v_new", lambda a: _heads_last(a["v_new"]), ValueError, r"contiguous \[H, D\] rows"),
    ("k_new", lambda a: a["k_new"].to("meta"), ValueError, r"device cpu \(the cache's\), got meta"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:-1], ValueError, r"length 6 \(num_seqs \+ 1\), got 5"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].float(), TypeError, r"dtype int32 or int64"),
    ("block_tables", lambda a: a["block_tables"][:-1], ValueError, r"5 rows"),
    ("block_tables", lambda a: a["block_tables"].to(torch.int16), TypeError, r"dtype int32 or int64, got torch.int16"),
    ("block_tables", lambda a: a["block_tables"][0], ValueError, r"a 2-d tensor"),
    ("prefix_lens", lambda a: a["prefix_lens"].float(), TypeError, r"dtype int32 or int64"),
    ("prefix_lens", lambda a: a["prefix_lens"].to("meta"), ValueError, r"device cpu"),
]


def _ids(table):
    return [f"{row[0]}-{i}" for i, row in enumerate(table)]


@pytest.mark.parametrize("name,mutate,exc,expected", CONCAT_ERRORS, ids=_ids(CONCAT_ERRORS))
def test_concat_validation_errors(name, mutate, exc, expected):
    args = make_batch(16, torch.float16).args
    args[name] = mutate(args)
    with pytest.raises(exc, match=f"{name}: expected {expected}"):
        concat_kvcache_with_prefix(**args)


@pytest.mark.parametrize("total_k,exc,match", [
    (-1, TypeError, r"total_k: expected None or an int >= 0, got -1"),
    (3.0, TypeError, r"total_k: expected None or an int >= 0, got 3.0"),
    (True, TypeError, r"total_k: expected None or an int"),
    ("wrong", ValueError, r"total_k: expected \d+ \(sum\(prefix_lens\) \+ total_q\), got \d+"),
])
def test_concat_total_k_errors(total_k, exc, match):
    batch = make_batch(16, torch.float16)
    if total_k == "wrong":
        total_k = batch.total_k + 1
    with pytest.raises(exc, match=match):
        concat_kvcache_with_prefix(**batch.args, total_k=total_k)


def _store_args():
    gen = torch.Generator().manual_seed(0)
    cache = random_values((4, 16, 2, 8), torch.float16, gen)
    return dict(k=random_values((5, 2, 8), torch.float16, gen), v=random_values((5, 2, 8), torch.float16, gen),
                k_cache=cache, v_cache=cache.clone(), slot_mapping=torch.arange(5))


STORE_ERRORS = [
    ("k", lambda a: a["k"].float(), TypeError, r"dtype torch.float16 \(the cache dtype\), got torch.float32"),
    ("v", lambda a: a["v"][:, :, :4], ValueError, r"\[num_tokens, 2, 8\]"),
    ("v", lambda a: a["v"][:4], ValueError, r"5 rows"),
    ("k", lambda a: _heads_last(a["k"]), ValueError, r"contiguous \[H, D\] rows"),
    ("k", lambda a: a["k"].to("meta"), ValueError, r"device cpu"),
    ("v_cache", lambda a: a["v_cache"].float(), TypeError, r"dtype torch.float16"),
    ("k_cache", lambda a: _noncontiguous(a["k_cache"]), ValueError, r"a contiguous tensor"),
    ("slot_mapping", lambda a: a["slot_mapping"][:4], ValueError, r"length 5 \(one slot per token of k\), got 4"),
    ("slot_mapping", lambda a: a["slot_mapping"].float(), TypeError, r"dtype int32 or int64, got torch.float32"),
    ("slot_mapping", lambda a: a["slot_mapping"].view(5, 1), ValueError, r"a 1-d tensor"),
    ("slot_mapping", lambda a: a["slot_mapping"].to("meta"), ValueError, r"device cpu"),
]


@pytest.mark.parametrize("name,mutate,exc,expected", STORE_ERRORS, ids=_ids(STORE_ERRORS))
def test_store_validation_errors(name, mutate, exc, expected):
    args = _store_args()
    args[name] = mutate(args)
    with pytest.raises(exc, match=f"{name}: expected {expected}"):
        store_kvcache(**args)


def _copy_args():
    caches = [torch.zeros(4, 16, 2, 8) for _ in range(4)]
    return dict(k_caches=caches[:2], v_caches=caches[2:], src_dst=torch.tensor([[0, 1]]))


COPY_ERRORS = [  # (argument to replace, replacement, exception, full message pattern)
    ("v_caches", lambda a: a["v_caches"][:1], ValueError, r"v_caches: expected 2 layers \(as many as k_caches\)"),
    ("k_caches", lambda a: a["k_caches"][0], TypeError, r"k_caches, v_caches: expected lists of tensors"),
    ("k_caches", lambda a: [a["k_caches"][0], a["k_caches"][1][:2]], ValueError,
     r"k_caches\[1\]: expected a contiguous torch.float32 tensor of shape \(4, 16, 2, 8\)"),
    ("v_caches", lambda a: [a["v_caches"][0], a["v_caches"][1].half()], ValueError,
     r"v_caches\[1\]: expected a contiguous torch.float32"),
    ("v_caches", lambda a: [a["v_caches"][0], a["v_caches"][1].to("meta")], ValueError,
     r"v_caches\[1\]: expected device cpu"),
    ("v_caches", lambda a: [a["v_caches"][0].half(), a["v_caches"][1]], TypeError,
     r"v_caches\[0\]: expected dtype torch.float32"),
    ("src_dst", lambda a: torch.tensor([[0, 1, 2]]), ValueError, r"src_dst: expected shape \[num_pairs, 2\], got \(1, 3\)"),
    ("src_dst", lambda a: torch.tensor([[0.0, 1.0]]), TypeError, r"src_dst: expected dtype int32 or int64"),
    ("src_dst", lambda a: torch.tensor([[0, 1]], device="meta"), ValueError, r"src_dst: expected the CPU or cpu"),
]


@pytest.mark.parametrize("name,mutate,exc,match", COPY_ERRORS, ids=_ids(COPY_ERRORS))
def test_copy_blocks_validation_errors(name, mutate, exc, match):
    args = _copy_args()
    args[name] = mutate(args)
    with pytest.raises(exc, match=match):
        copy_blocks(**args)


# ------------------------------------------------------------------------------ CPU: kernel path


class FakeKernels:
    """Stands in for torch.ops.prefix_service_ops; records what the wrappers pass."""

    def __init__(self):
        self.calls = []

    def concat_kvcache_with_prefix(self, *args):
        self.calls.append(("concat", args))
        return "k_out", "v_out", "cu_seqlens_k"

    def store_kvcache(self, *args):
        self.calls.append(("store", args))

    def copy_blocks(self, *args):
        self.calls.append(("copy", args))


@pytest.fixture
def fake_kernels(monkeypatch):
    fake = FakeKernels()
    monkeypatch.setattr(ops_mod, "_kernels", lambda device: fake)
    return fake


@pytest.mark.parametrize("head_dim", [12, 4, 264])
def test_kernel_path_rejects_head_dim(fake_kernels, head_dim):
    batch = make_batch(16, torch.float16, head_dim=head_dim)
    expected = rf"head_dim: expected a multiple of 8 of at most 256 for the CUDA kernels, got {head_dim}"
    with pytest.raises(ValueError, match=expected):
        concat_kvcache_with_prefix(**batch.args)
    a = batch.args
    slots = torch.arange(a["k_new"].shape[0])
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8"):
        store_kvcache(a["k_new"], a["v_new"], a["k_cache"], a["v_cache"], slots)
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8"):
        copy_blocks([a["k_cache"]], [a["v_cache"]], torch.tensor([[0, 1]]))
    assert fake_kernels.calls == []


def test_kernel_path_passes_int32_indices_and_total_k(fake_kernels):
    batch = make_batch(16, torch.bfloat16, index_dtype=torch.int64, head_dim=16)
    assert concat_kvcache_with_prefix(**batch.args) == ("k_out", "v_out", "cu_seqlens_k")
    concat_kvcache_with_prefix(**batch.args, total_k=batch.total_k)
    (_, first), (_, second) = fake_kernels.calls
    assert [first[i].dtype for i in (2, 3, 6)] == [torch.int32] * 3
    assert first[7] == -1 and second[7] == batch.total_k
    copy_blocks([batch.args["k_cache"]], [batch.args["v_cache"]], torch.tensor([[0, 1]], dtype=torch.int32))
    assert fake_kernels.calls[-1][1][2].dtype == torch.int64


# ------------------------------------------------------------------------------ CPU: build


@cpu_only
def test_no_gpu_build_helpers():
    assert cuda_ops_available() is False
    with pytest.raises(RuntimeError, match=r"cuda_ops: (this torch .* is built without CUDA|no CUDA GPU is visible)"):
        load_cuda_ops()


def test_disable_env_turns_kernels_off(monkeypatch):
    monkeypatch.setenv("PREFIX_SERVICE_DISABLE_CUDA_OPS", "1")
    assert cuda_ops_available() is False


@cpu_only
@pytest.mark.parametrize("script", ["bench_cuda_ops.py", "bench_cuda_layers.py"])
def test_bench_script_needs_gpu(script):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr


# ------------------------------------------------------------------------------ CUDA: kernels


def poison_cuda_allocator() -> None:
    """Fill freed memory of both caching-allocator pools with 0xFF (NaN in every float dtype),
    so outputs allocated next start poisoned and an unwritten element fails the comparison."""
    small = [torch.full((256 << 10,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(16)]
    large = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device="cuda")
    del small, large


@needs_cuda
def test_kernels_build_and_load():
    assert cuda_ops_available()
    ops = load_cuda_ops()
    assert hasattr(ops, "concat_kvcache_with_prefix")


@needs_cuda
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,row_pad", [(2, 8, 0), (8, 128, 0), (1, 256, 8), (4, 64, 3)])
def test_concat_kernel_matches_reference(block_size, dtype, heads, head_dim, row_pad):
    batch = make_batch(block_size, dtype, heads=heads, head_dim=head_dim, device="cuda", row_pad=row_pad)
    want = concat_kvcache_with_prefix_ref(**batch.args)
    for total_k in (None, batch.total_k):
        poison_cuda_allocator()
        got = concat_kvcache_with_prefix(**batch.args, total_k=total_k)
        for g, w in zip(got, want):
            assert_bitwise(g, w)


@needs_cuda
def test_concat_kernel_many_sequences_and_extra_rows():
    gen = torch.Generator().manual_seed(5)
    prefix_lens = torch.randint(0, 40, (3000,), generator=gen).tolist()  # scan spans 3 chunks
    batch = make_batch(16, torch.bfloat16, heads=8, head_dim=128, device="cuda", prefix_lens=prefix_lens)
    want = concat_kvcache_with_prefix_ref(**batch.args)
    poison_cuda_allocator()
    k_out, v_out, cu_k = concat_kvcache_with_prefix(**batch.args, total_k=batch.total_k + 7)
    assert_bitwise(cu_k, want[2])
    assert_bitwise(k_out[: batch.total_k], want[0])
    assert_bitwise(v_out[: batch.total_k], want[1])
    assert (k_out[batch.total_k:] == 0).all() and (v_out[batch.total_k:] == 0).all()


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_kernel_misaligned_inputs(dtype):
    batch = make_batch(16, dtype, heads=2, head_dim=64, device="cuda")
    k_new = batch.args["k_new"]
    flat = torch.empty(k_new.numel() + 1, dtype=dtype, device="cuda")
    batch.args["k_new"] = flat[1:].view(k_new.shape).copy_(k_new)  # address not 16-byte aligned
    want = concat_kvcache_with_prefix_ref(**batch.args)
    poison_cuda_allocator()
    for g, w in zip(concat_kvcache_with_prefix(**batch.args), want):
        assert_bitwise(g, w)


@needs_cuda
def test_kernel_rejects_head_dim_not_multiple_of_8():
    batch = make_batch(16, torch.float16, head_dim=12, device="cuda")
    with pytest.raises(ValueError, match=r"head_dim: expected a multiple of 8 of at most 256 for the CUDA kernels"):
        concat_kvcache_with_prefix(**batch.args)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("heads,head_dim,offset", [(8, 128, 0), (2, 8, 0), (2, 64, 1)])
def test_store_kernel_matches_reference(dtype, slot_dtype, heads, head_dim, offset):
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, tokens = 40, 16, 300
    cache = random_values((num_blocks, block_size, heads, head_dim), dtype, gen, "cuda")
    fused = random_values((tokens * 2 * heads * head_dim + offset,), dtype, gen, "cuda")
    kv = fused[offset:].view(tokens, 2, heads, head_dim)  # strided rows, maybe misaligned
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1
    slots = slots.to(slot_dtype).cuda()
    want_k, want_v = cache.clone(), cache.clone()
    store_kvcache_ref(kv[:, 0], kv[:, 1], want_k, want_v, slots)
    got_k, got_v = cache.clone(), cache.clone()
    store_kvcache(kv[:, 0], kv[:, 1], got_k, got_v, slots)
    assert_bitwise(got_k, want_k)
    assert_bitwise(got_v, want_v)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pairs_on", ["cpu", "cuda"])
def test_copy_blocks_kernel_matches_reference(dtype, pairs_on):
    gen = torch.Generator().manual_seed(9)
    shape = (32, 16, 8, 128)
    k_caches = [random_values(shape, dtype, gen, "cuda") for _ in range(4)]
    v_caches = [random_values(shape, dtype, gen, "cuda") for _ in range(4)]
    src_dst = torch.tensor([[1, 20], [3, 21], [30, 22]], dtype=torch.int32, device=pairs_on)
    want_k, want_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    copy_blocks_ref(want_k, want_v, src_dst)
    copy_blocks(k_caches, v_caches, src_dst)
    for g, w in zip(k_caches + v_caches, want_k + want_v):
        assert_bitwise(g, w)


def test_check_false_skips_the_argument_checks_only(fake_kernels):
    """check=False (every layer of a step after the first) dispatches the same call without the
    Python checks: a wrong argument is no longer caught there, and a right one reaches the kernel as
    with the checks."""
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(k, k, kc, vc, torch.tensor([0, 1]))
    store_kvcache(k, k, kc, vc, torch.tensor([0, 1]), check=False)  # reaches the (fake) kernel unchecked
    calls = len(fake_kernels.calls)
    store_kvcache(k, k, kc, vc, torch.tensor([0, 5, -1]), check=False)
    store_kvcache(k, k, kc, vc, torch.tensor([0, 5, -1]))
    assert len(fake_kernels.calls) == calls + 2
