"""The cpu backend's attention kernel (csrc/cpu_attention.cpp, called through native_harness.py; its
template layout: backends/cpu/attention.py): it builds wherever a compiler and AVX-512 are present;
prefill and decode equal attention computed in float64, for templates, context and causal new tokens
of any length and layout, and paged caches in any block order; the result does not depend on the
thread count; it shares torch's OpenMP runtime; bad input gets a clear error (the library's build:
test_cpu_linear.py); a prefill step through it equals the torch backend's attention; the cpu backend
decodes a shared template batch through it with the torch backend's tokens."""
import pytest
import torch

from helpers import cpu_simd, greedy
from native_harness import decode_attention, prefill_attention
from prefix_service import GenerateRequest
from prefix_service.backends.base import StepTensors
from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.backends.cpu import native
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.backends.cpu.packed_template import PackedTemplate
from prefix_service.backends.cpu.plan import StackPlan
from prefix_service.backends.torch.attention import PagedAttention, PagedMetadata
from prefix_service.engine.step import ScheduledRow, StepBatch

REASON = cpu_attention.available()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU attention here: {REASON}")


def test_kernel_is_available_wherever_the_native_library_is():
    """The kernel is in the native library, which must build wherever it can (test_cpu_linear.py)."""
    assert REASON == native.load()[1]
    if native.compiler() is not None and cpu_simd():
        assert REASON is None


def reference(q, k, v, scale, kt=None, vt=None):
    """float64 softmax attention: query i of M sees the template's keys and the first C - M + i + 1 of k."""
    m, hq, _ = q.shape
    g = hq // k.shape[1]
    if kt is not None:
        k, v = torch.cat([kt, k]), torch.cat([vt, v])
    n = k.shape[0]
    scores = torch.einsum("mhd,nhd->hmn", q.double(), k.repeat_interleave(g, 1).double()) * scale
    scores = scores.masked_fill(~torch.ones(m, n, dtype=torch.bool).tril(n - m), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v.repeat_interleave(g, 1).double())


def make_case(m, r, rest, hq, hkv, d, seed=0, magnitude=1.0):
    """q, k, v as views of one fused projection (strided rows), `rest` context keys in front of the
    new ones, and a template of r keys."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(m, hq + 2 * hkv, d, generator=g) * magnitude
    q, k_new, v_new = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    k = torch.cat([torch.randn(rest, hkv, d, generator=g), k_new]) if rest else k_new
    v = torch.cat([torch.randn(rest, hkv, d, generator=g), v_new]) if rest else v_new
    kt, vt = torch.randn(r, hkv, d, generator=g) * magnitude, torch.randn(r, hkv, d, generator=g)
    return q, k, v, kt, vt


@needs_native
@pytest.mark.parametrize("m,r,rest,hq,hkv,d", [
    (100, 896, 4, 9, 3, 64),  # the benchmark's shape: a template's full blocks, its tail, the prompt
    (1, 64, 0, 4, 2, 64),  # one new token
    (7, 0, 0, 4, 2, 64),  # no context: plain causal
    (300, 0, 0, 9, 3, 64),  # causal over several chunks of keys
    (33, 50, 3, 8, 8, 128),  # no grouping, a template not a multiple of 16, head size 128
    (5, 17, 21, 6, 3, 32),
    (13, 0, 70, 4, 1, 16),  # one KV head, context without a template
    (2, 5, 0, 12, 4, 80),  # head size not a multiple of 64
])
def test_matches_float64_attention(m, r, rest, hq, hkv, d):
    q, k, v, kt, vt = make_case(m, r, rest, hq, hkv, d, seed=m + r)
    template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r) if r else None
    got = prefill_attention(q, k, v, d ** -0.5, template=template)
    want = reference(q, k, v, d ** -0.5, kt if r else None, vt if r else None)
    assert got.shape == (m, hq, d) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 2e-6


@needs_native
def test_peaked_and_flat_scores():
    """Large scores (a softmax close to one-hot, the polynomial exp's range clamped far below the
    maximum) and zero scores (uniform weights) both match."""
    for magnitude in (12.0, 0.0):
        q, k, v, kt, vt = make_case(20, 40, 5, 4, 2, 64, seed=3, magnitude=magnitude)
        template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), 40)
        got = prefill_attention(q, k, v, 64 ** -0.5, template=template)
        want = reference(q, k, v, 64 ** -0.5, kt, vt)
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max().item() < 2e-5 * max(1.0, want.abs().max().item())


@needs_native
def test_result_does_not_depend_on_the_thread_count():
    q, k, v, kt, vt = make_case(50, 64, 9, 6, 2, 64, seed=5)
    template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention(q, k, v, 0.125, template=template)
        torch.set_num_threads(max(2, threads))
        many = prefill_attention(q, k, v, 0.125, template=template)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each query tile is one thread's work, in one order


@needs_native
def test_shares_torchs_openmp_runtime():
    """The library runs on the OpenMP runtime torch loaded, not a second one with its own threads."""
    prefill_attention(*make_case(4, 0, 0, 2, 1, 16)[:3], 0.25)
    with open("/proc/self/maps") as fh:
        gomp = {line.split()[-1] for line in fh if "libgomp" in line}
    assert len(gomp) <= 1, gomp


@needs_native
def test_writes_into_a_given_output_and_leaves_the_rest():
    q, k, v, _, _ = make_case(6, 0, 2, 4, 2, 32, seed=8)
    out = torch.full((10, 4, 32), 7.0)
    got = prefill_attention(q, k, v, 0.2, out=out[2:8])
    assert got.data_ptr() == out[2:8].data_ptr()
    assert (out[2:8].double() - reference(q, k, v, 0.2)).abs().max().item() < 2e-6
    assert (out[:2] == 7).all() and (out[8:] == 7).all()


@needs_native
def test_bad_input_is_refused_with_a_clear_error():
    q, k, v, kt, vt = make_case(4, 16, 0, 4, 2, 16)
    with pytest.raises(NativeKernelError, match="float32"):
        prefill_attention(q.double(), k, v, 0.25)
    with pytest.raises(NativeKernelError, match="dense"):
        prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 0.25)
    with pytest.raises(NativeKernelError, match="shapes"):
        prefill_attention(q, k[:3], v[:3], 0.25)  # fewer keys than queries
    with pytest.raises(NativeKernelError, match="template layout"):
        prefill_attention(q, k, v, 0.25, template=(kt, vt, 16))  # not packed
    q8, k8, v8, _, _ = make_case(3, 0, 0, 2, 1, 8)
    with pytest.raises(NativeKernelError, match="head size"):
        prefill_attention(q8, k8, v8, 0.3)


def prefill_step(seqs) -> StepBatch:
    """A step of prefills only: (block table, cached context, new tokens) per sequence."""
    return StepBatch(tuple(ScheduledRow(f"r{i}", False, (1,) * n, ctx, tuple(table))
                           for i, (table, ctx, n) in enumerate(seqs)))


@needs_native
def test_prefill_step_through_the_kernel_equals_torch():
    """One step, six prefills, through the kernel as the cpu backend calls it (the new K/V stored and
    each context read through its block table by the kernel; the template packed in its layout for
    the sequences that continue it) equals the torch backend's attention, in its output and in the
    cache it leaves."""
    g = torch.Generator().manual_seed(4)
    bs, hq, hkv, d = 4, 6, 2, 16
    kc, vc = torch.randn(80, bs, hkv, d, generator=g), torch.randn(80, bs, hkv, d, generator=g)
    template = [10, 11, 12]
    contexts = [(template + [30], 3 * bs + 2, 5), (template + [31, 32], 4 * bs + 1, 3), ([40, 41], bs + 1, 4),
                (template, 3 * bs, 2), ([50], 0, 6), (template + [33], 3 * bs + 3, 1)]
    fresh = iter(range(60, 80))  # each sequence's own blocks for its new tokens
    seqs = [(t + [next(fresh) for _ in range(-(-(c + n) // bs) - len(t))], c, n) for t, c, n in contexts]
    step = prefill_step(seqs)
    host = StepTensors.build(step, bs)
    slots = host.slots
    tq = sum(n for _, _, n in seqs)
    qkv = torch.randn(tq, hq + 2 * hkv, d, generator=g)  # strided rows, as the model's projection gives
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    scale = d ** -0.5

    want_k, want_v = kc.clone(), vc.clone()
    meta = PagedMetadata.build(step, host, bs, torch.device("cpu"))
    want = PagedAttention([(want_k, want_v)], meta)(0, q, k, v, scale)

    for packed in (False, True):
        got_k, got_v = kc.clone(), vc.clone()
        template_kv = PackedTemplate([(got_k, got_v)], template) if packed else None
        plan = StackPlan.build(step, host, 1, lambda row: template_kv if list(row.block_ids[:3]) == template else None)
        got = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx, first) in enumerate(plan.prefill_info.tolist()):
            end = start + q_len
            prefill_attention(q[start:end], k[start:end], v[start:end], scale, out=got[start:end],
                              template=template_kv.layer(0) if first else None, cache=(got_k, got_v),
                              block_table=plan.prefill_tables[i], cached=(first, ctx - first),
                              slots=slots[start:end])
            start = end
        assert sum(f > 0 for _, _, f in plan.prefill_info.tolist()) == (4 if packed else 0)
        assert (got - want).abs().max().item() < 1e-5
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@needs_native
@pytest.mark.parametrize("r,cached,m", [(0, 0, 7), (32, 9, 20), (0, 70, 5), (16, 0, 1), (48, 16, 64)])
def test_prefill_reads_context_through_its_block_table_and_stores_new_kv(r, cached, m):
    """The cached part of segment B comes from a paged cache in shuffled blocks, starting after the
    template's tokens; the new tokens' K/V go into their slots (bitwise) in the same call, and
    nothing else of the cache changes."""
    bs, hq, hkv, d = 4, 6, 2, 32
    g = torch.Generator().manual_seed(r + cached + m)
    n_blocks = -(-(r + cached + m) // bs)
    kc, vc = torch.randn(n_blocks + 5, bs, hkv, d, generator=g), torch.randn(n_blocks + 5, bs, hkv, d, generator=g)
    table = torch.randperm(n_blocks + 5, generator=g)[:n_blocks].to(torch.int32)
    positions = range(r, r + cached)  # the context after the template
    ctx_k = torch.stack([kc[table[p // bs], p % bs] for p in positions]) if cached else kc.new_zeros(0, hkv, d)
    ctx_v = torch.stack([vc[table[p // bs], p % bs] for p in positions]) if cached else vc.new_zeros(0, hkv, d)
    qkv = torch.randn(m, hq + 2 * hkv, d, generator=g)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    kt, vt = torch.randn(r, hkv, d, generator=g), torch.randn(r, hkv, d, generator=g)
    template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r) if r else None
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(r + cached, r + cached + m)])
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, hkv, d)[slots], want_v.view(-1, hkv, d)[slots] = k, v
    got = prefill_attention(q, k, v, d ** -0.5, template=template, cache=(kc, vc), block_table=table,
                            cached=(r, cached), slots=slots)
    want = reference(q, torch.cat([ctx_k, k]), torch.cat([ctx_v, v]), d ** -0.5, kt if r else None, vt if r else None)
    assert (got.double() - want).abs().max().item() < 2e-6
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@needs_native
def test_decode_stores_the_new_tokens_before_it_reads():
    """new_kv: the kernel writes each sequence's new K/V into its slot (the last of its context)
    and attends over it; the same as storing first and calling without it."""
    bs, hq, hkv, d = 4, 6, 2, 32
    lens = [1, 6, 13]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=21)
    g = torch.Generator().manual_seed(22)
    k, v = torch.randn(3, hkv, d, generator=g), torch.randn(3, hkv, d, generator=g)
    slots = torch.tensor([rows[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)])
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, hkv, d)[slots], want_v.view(-1, hkv, d)[slots] = k, v
    want = decode_attention(q, want_k, want_v, tables, ctx, 0.2)
    got = decode_attention(q, kc, vc, tables, ctx, 0.2, new_kv=(k, v, slots))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(got, want)


@needs_native
def test_stores_and_block_tables_outside_the_cache_are_refused():
    """A slot or block id past the cache is an error before anything is written."""
    bs, hkv, d = 4, 2, 16
    kc, vc = torch.zeros(3, bs, hkv, d), torch.zeros(3, bs, hkv, d)
    q, k, v = torch.randn(2, 4, d), torch.randn(2, hkv, d), torch.randn(2, hkv, d)
    with pytest.raises(NativeKernelError, match="outside the cache"):
        prefill_attention(q, k, v, 0.25, cache=(kc, vc), slots=torch.tensor([0, 12]))
    with pytest.raises(NativeKernelError, match="outside the cache"):
        prefill_attention(q, k, v, 0.25, cache=(kc, vc), block_table=torch.tensor([1, 3], dtype=torch.int32),
                          cached=(0, 6))
    with pytest.raises(NativeKernelError, match="outside the cache"):  # past the table's end
        prefill_attention(q, k, v, 0.25, cache=(kc, vc), block_table=torch.tensor([1], dtype=torch.int32),
                          cached=(2, 4))
    with pytest.raises(NativeKernelError, match="block table"):
        prefill_attention(q, k, v, 0.25, cache=(kc, vc), cached=(0, 3))
    with pytest.raises(NativeKernelError, match="slots: int64"):
        prefill_attention(q, k, v, 0.25, cache=(kc, vc), slots=torch.tensor([0, 1], dtype=torch.int32))
    tables, ctx = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(NativeKernelError, match="outside the cache"):
        decode_attention(q, kc, vc, tables, ctx, 0.25, new_kv=(k, v, torch.tensor([-1, 4])))
    assert not kc.any() and not vc.any()


def paged_case(lens, bs, hq, hkv, d, seed=0):
    """A cache in shuffled blocks, each sequence's table, and its keys/values in order."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // bs) for n in lens]
    num_blocks = sum(widths) + 3
    kc, vc = torch.randn(num_blocks, bs, hkv, d, generator=g), torch.randn(num_blocks, bs, hkv, d, generator=g)
    order = torch.randperm(num_blocks, generator=g)[:sum(widths)].tolist()
    tables = torch.full((len(lens), max(widths) + 1), -1, dtype=torch.int32)
    rows = []
    for i, w in enumerate(widths):
        blocks, order = order[:w], order[w:]
        tables[i, :w] = torch.tensor(blocks, dtype=torch.int32)
        rows.append(blocks)
    q = torch.randn(len(lens), hq + 2 * hkv, d, generator=g)[:, :hq]  # strided rows
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), rows


def template_batch(r, which, lens, bs, hq, hkv, d, seed, case_seed, kv="float32"):
    """paged_case (its seed case_seed) with a random template of r keys (its seed `seed`), packed, before
    every sequence i where which[i]; the cache in `kv`. Returns paged_case's tuple, each sequence's
    template (None where it has none) and the template's keys and values as they were made."""
    g = torch.Generator().manual_seed(seed)
    kt, vt = torch.randn(r, hkv, d, generator=g), torch.randn(r, hkv, d, generator=g)
    packed = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r)
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=case_seed)
    if kv == "bfloat16":
        kc, vc = kc.bfloat16(), vc.bfloat16()
    return q, kc, vc, tables, ctx, rows, [packed if on else None for on in which], (kt, vt)


@needs_native
@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 9, 3, 64), (4, 8, 1, 16), (5, 16, 2, 128), (16, 4, 4, 32)])
def test_decode_matches_float64_attention(bs, hq, hkv, d):
    lens = [1, bs, 3 * bs + 1, 70, 129]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=bs + d)
    got = decode_attention(q, kc, vc, tables, ctx, d ** -0.5)
    for i, n in enumerate(lens):  # the one new token sees every key of its context
        k = kc[rows[i]].flatten(0, 1)[:n]
        v = vc[rows[i]].flatten(0, 1)[:n]
        want = reference(q[i:i + 1], k, v, d ** -0.5)
        assert (got[i:i + 1].double() - want).abs().max().item() < 2e-6, i


@needs_native
def test_decode_over_packed_templates():
    """Sequences whose first blocks are a packed template read those from the packed copy (here a
    copy of different values, so reading the cache instead would show), the rest in place."""
    bs, hq, hkv, d = 4, 6, 2, 32
    lens = [3 * bs + 2, 2 * bs, 9]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=11)
    g = torch.Generator().manual_seed(12)
    kt, vt = torch.randn(2 * bs, hkv, d, generator=g), torch.randn(2 * bs, hkv, d, generator=g)
    template = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), 2 * bs)
    got = decode_attention(q, kc, vc, tables, ctx, 0.2, templates=[template, template, None])
    for i, n in enumerate(lens):
        k, v = kc[rows[i]].flatten(0, 1)[:n], vc[rows[i]].flatten(0, 1)[:n]
        if i < 2:
            k, v = torch.cat([kt, k[2 * bs:]]), torch.cat([vt, v[2 * bs:]])
        assert (got[i:i + 1].double() - reference(q[i:i + 1], k, v, 0.2)).abs().max().item() < 2e-6, i


@needs_native
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4)])
def test_decode_groups_sequences_on_a_template_without_changing_a_row(hq, hkv):
    """Twenty decodes, most on one of two packed templates (read once per group of tiles), some on
    none: each equals attention in float64, and bit for bit the same sequence decoded alone."""
    bs, d = 4, 32
    g = torch.Generator().manual_seed(hq)
    templates = []
    for blocks in (3, 5):
        kt, vt = torch.randn(blocks * bs, hkv, d, generator=g), torch.randn(blocks * bs, hkv, d, generator=g)
        templates.append((kt, vt, (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), blocks * bs)))
    which = [0, 1, None, 0, 0, 1, 0, None, 1, 0, 0, 0, 1, 0, 0, None, 0, 1, 0, 0]
    lens = [(3 if w == 0 else 5) * bs + 1 + i % 7 if w is not None else 2 + i for i, w in enumerate(which)]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=hq + 1)
    packed = [templates[w][2] if w is not None else None for w in which]
    got = decode_attention(q, kc, vc, tables, ctx, 0.3, templates=packed)
    for i, (w, n) in enumerate(zip(which, lens)):
        k, v = kc[rows[i]].flatten(0, 1)[:n], vc[rows[i]].flatten(0, 1)[:n]
        if w is not None:
            kt, vt, packed_w = templates[w]
            r = packed_w[2]
            k, v = torch.cat([kt, k[r:]]), torch.cat([vt, v[r:]])
        assert (got[i:i + 1].double() - reference(q[i:i + 1], k, v, 0.3)).abs().max().item() < 2e-6, i
        alone = decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], ctx[i:i + 1], 0.3,
                                 templates=[packed[i]] if w is not None else None)
        assert torch.equal(alone, got[i:i + 1]), i


@needs_native
def test_decode_groups_by_template_and_length_read():
    """Two sequences read the same packed copy to different lengths (the second its first 32 keys: a
    view from the same address): each is its own group, and each equals attention in float64."""
    bs, hq, hkv, d = 16, 4, 1, 16
    g = torch.Generator().manual_seed(5)
    kt, vt = torch.randn(4 * bs, hkv, d, generator=g), torch.randn(4 * bs, hkv, d, generator=g)
    pk, pv = cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt)
    short = (pk[:, :2], pv[:, :2 * bs], 2 * bs)
    assert short[0].data_ptr() == pk.data_ptr() and short[1].data_ptr() == pv.data_ptr()
    lens = [4 * bs + 3, 4 * bs + 3, 4 * bs + 5]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=6)
    got = decode_attention(q, kc, vc, tables, ctx, 0.3, templates=[(pk, pv, 4 * bs), short, (pk, pv, 4 * bs)])
    for i, r in enumerate((4 * bs, 2 * bs, 4 * bs)):
        k, v = kc[rows[i]].flatten(0, 1)[:lens[i]], vc[rows[i]].flatten(0, 1)[:lens[i]]
        k, v = torch.cat([kt[:r], k[r:]]), torch.cat([vt[:r], v[r:]])
        assert (got[i:i + 1].double() - reference(q[i:i + 1], k, v, 0.3)).abs().max().item() < 2e-6, i


@needs_native
@pytest.mark.parametrize("r", [512, 528, 1040, 4400])
def test_decode_over_a_long_template_merges_its_ranges_of_keys(r):
    """A template of more than 512 keys is attended in ranges of keys, each range's softmax state made
    on its own and the states merged in order (512 keys: one range; 528: 512 + 16; 1,040: 512, 512
    and 16; 4,400: eight of 576 or less). The ranges' scores peak in different places, so
    a range dropped or merged without its rescaling shows against float64; and since the ranges
    depend on the template alone, a sequence decoded alone, in a batch, or on 1 or 3 threads gives
    the same bits."""
    bs, hq, hkv, d = 16, 9, 3, 32
    g = torch.Generator().manual_seed(r)
    kt, vt = torch.randn(r, hkv, d, generator=g), torch.randn(r, hkv, d, generator=g)
    kt += torch.linspace(-2.0, 2.0, r)[:, None, None] * torch.randn(1, hkv, d, generator=g)  # the peak moves
    packed = (cpu_attention.pack_keys(kt), cpu_attention.pack_values(vt), r)
    which = [True, True, False, True, True, True, True, True, False, True]
    lens = [r + 1 + 9 * i if on else 3 + 5 * i for i, on in enumerate(which)]
    q, kc, vc, tables, ctx, rows = paged_case(lens, bs, hq, hkv, d, seed=r + 1)
    q = q * 2.0
    templates = [packed if on else None for on in which]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, kc, vc, tables, ctx, 0.3, templates=templates)
        torch.set_num_threads(3)
        three = decode_attention(q, kc, vc, tables, ctx, 0.3, templates=templates)
    finally:
        torch.set_num_threads(threads)
    got = decode_attention(q, kc, vc, tables, ctx, 0.3, templates=templates)
    assert torch.equal(got, one) and torch.equal(got, three)
    for i, (on, n) in enumerate(zip(which, lens)):
        k, v = kc[rows[i]].flatten(0, 1)[:n], vc[rows[i]].flatten(0, 1)[:n]
        if on:
            k, v = torch.cat([kt, k[r:]]), torch.cat([vt, v[r:]])
        # scores spread wider than the other tests' (up to ~20): float32's error grows with them
        assert (got[i:i + 1].double() - reference(q[i:i + 1], k, v, 0.3)).abs().max().item() < 1e-5, i
        alone = decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], ctx[i:i + 1], 0.3,
                                 templates=[templates[i]] if on else None)
        assert torch.equal(alone, got[i:i + 1]), i


@needs_native
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_decode_does_not_depend_on_the_thread_count(kv):
    """Decodes on a template and without one, as one batch: the same bits on 1, 2 and 3 threads,
    though the thread count decides how the rest of each context is split into tasks (per KV head
    for few sequences a thread, all of a sequence's heads together for more)."""
    bs, hq, hkv, d = 4, 9, 3, 32
    which = [True, False, True, True, False, True, True]
    lens = [2 * bs + 3 + 5 * i if on else 4 + 3 * i for i, on in enumerate(which)]
    q, kc, vc, tables, ctx, _, templates, _ = template_batch(2 * bs, which, lens, bs, hq, hkv, d, 3, 4, kv)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            # 7 sequences: 2 a thread or more on 1, 2 and 3 threads; the first 3 alone: fewer on 2 and 3
            outs.append((decode_attention(q, kc, vc, tables, ctx, 0.2, templates=templates),
                         decode_attention(q[:3], kc, vc, tables[:3], ctx[:3], 0.2, templates=templates[:3])))
    finally:
        torch.set_num_threads(threads)
    for batch, few in outs[1:]:
        assert torch.equal(batch, outs[0][0]) and torch.equal(few, outs[0][1])
    assert torch.equal(outs[0][1], outs[0][0][:3])


@needs_native
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_decode_asks_for_its_rows_either_way_with_the_same_bits(kv):
    """How the pass over each sequence's own rows asks for them ahead of reading them (native.decode_prefetch:
    a task's rows at once into L2, or each key's and value's row a few keys ahead) changes no bit: a batch
    with and without a template, own contexts of one to three chunks of 64 keys over shuffled blocks,
    on enough sequences that a task covers all KV heads of one, and on one sequence (a task per KV head)."""
    bs, hq, hkv, d = 16, 9, 3, 64
    which = [True, False, True, True, False, True]
    lens = [3 * bs + 1 + 37 * i if on else 5 + 41 * i for i, on in enumerate(which)]
    q, kc, vc, tables, ctx, rows, templates, (kt, vt) = template_batch(3 * bs, which, lens, bs, hq, hkv, d, 21, 22,
                                                                       kv)
    lib = native.require()
    chosen = lib.ps_decode_prefetch(-1)
    assert chosen == native.DECODE_PREFETCHES[native.decode_prefetch()]
    outs = {}
    try:
        for way, mode in native.DECODE_PREFETCHES.items():
            assert lib.ps_decode_prefetch(mode) in native.DECODE_PREFETCHES.values()
            assert lib.ps_decode_prefetch(-1) == mode
            outs[way] = (decode_attention(q, kc, vc, tables, ctx, 0.2, templates=templates),
                         decode_attention(q[:1], kc, vc, tables[:1], ctx[:1], 0.2, templates=templates[:1]))
    finally:
        lib.ps_decode_prefetch(chosen)
    assert lib.ps_decode_prefetch(-1) == chosen
    (batch, one), (batch_paced, one_paced) = outs["task"], outs["paced"]
    assert torch.equal(batch, batch_paced) and torch.equal(one, one_paced)
    for i, (on, n) in enumerate(zip(which, lens)):
        k, v = kc[rows[i]].flatten(0, 1)[:n].float(), vc[rows[i]].flatten(0, 1)[:n].float()
        if on:
            k, v = torch.cat([kt, k[3 * bs:]]), torch.cat([vt, v[3 * bs:]])
        assert (batch[i:i + 1].double() - reference(q[i:i + 1], k, v, 0.2)).abs().max().item() < 2e-6, i


def test_decode_prefetch_follows_the_cpu_maker_unless_the_environment_names_a_way(monkeypatch):
    """Paced on Intel, whose cores stall on a task's hundreds of prefetches at once; the task's rows at
    once elsewhere (faster on a Zen 3); $PREFIX_SERVICE_DECODE_PREFETCH overrides, and a value it does
    not know is refused with the variable named. The library, where it loads, runs the chosen way, and
    a way it does not know leaves its own as it is."""
    lib = native.load()[0]
    expected = native.decode_prefetch()  # the way the library took at load, from the same environment
    monkeypatch.delenv(native.DECODE_PREFETCH_ENV, raising=False)
    assert native.decode_prefetch("GenuineIntel") == "paced"
    assert native.decode_prefetch("AuthenticAMD") == "task"
    assert native.decode_prefetch("") == "task"
    monkeypatch.setenv(native.DECODE_PREFETCH_ENV, "task")
    assert native.decode_prefetch("GenuineIntel") == "task"
    monkeypatch.setenv(native.DECODE_PREFETCH_ENV, "paced")
    assert native.decode_prefetch("AuthenticAMD") == "paced"
    monkeypatch.setenv(native.DECODE_PREFETCH_ENV, "eager")
    with pytest.raises(native.NativeSettingError,
                       match="PREFIX_SERVICE_DECODE_PREFETCH='eager': one of task, paced"):
        native.decode_prefetch()
    if lib is not None:
        mode = lib.ps_decode_prefetch(-1)
        assert mode == native.DECODE_PREFETCHES[expected]
        assert lib.ps_decode_prefetch(7) == mode and lib.ps_decode_prefetch(-1) == mode


@needs_native
def test_decode_bad_input_is_refused():
    q, kc, vc, tables, ctx, _ = paged_case([5, 9], 4, 4, 2, 16)
    with pytest.raises(NativeKernelError, match="contiguous float32"):
        decode_attention(q, kc.double(), vc, tables, ctx, 0.25)
    with pytest.raises(NativeKernelError, match="int32"):
        decode_attention(q, kc, vc, tables.long(), ctx, 0.25)
    kt = cpu_attention.pack_keys(torch.randn(6, 2, 16))
    with pytest.raises(NativeKernelError, match="template layout"):  # 6 keys: not whole blocks
        decode_attention(q, kc, vc, tables, ctx, 0.25,
                         templates=[(kt, cpu_attention.pack_values(torch.randn(6, 2, 16)), 6), None])


@needs_native
def test_engine_decodes_a_shared_template_batch_through_the_kernel(make_engine, monkeypatch):
    """Requests on one packed template decode on the cpu backend each over the packed copy (no
    cascade grouping), with the tokens of the torch backend, which groups them."""
    import prefix_service.backends.torch.attention as torch_attention
    cascades, templated = [], []
    real_cascade, real_build = torch_attention.cascade_decode, StackPlan.build

    def counting_cascade(q, *args):
        cascades.append(q.shape[0])
        return real_cascade(q, *args)

    def counting_build(step, *args):
        plan = real_build(step, *args)
        if plan.num_decodes:
            templated.append(int((plan.decode_skip > 0).sum()) if plan.decode_skip is not None else 0)
        return plan
    monkeypatch.setattr(torch_attention, "cascade_decode", counting_cascade)
    monkeypatch.setattr(StackPlan, "build", staticmethod(counting_build))
    prefix = [(3 * i + 7) % 500 + 3 for i in range(23)]
    users = [[(5 * i + k) % 500 + 3 for i in range(2 + k)] for k in range(5)]
    torch_engine = make_engine(block_size=4, backend="torch")
    torch_engine.add_template("p", token_ids=prefix)
    batch = [GenerateRequest(prompt_token_ids=u, prefix_name="p", sampling=greedy(12)) for u in users]
    want = [o.token_ids for o in torch_engine.generate(batch)]
    assert cascades and not templated  # the torch backend groups them
    cascades.clear()
    engine = make_engine(block_size=4)
    assert engine.info.backend == "cpu"
    engine.add_template("p", token_ids=prefix)
    assert [o.token_ids for o in engine.generate(batch)] == want
    assert not cascades and max(templated) == len(users)
