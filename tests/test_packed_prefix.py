"""Pinned templates' K/V packed for CPU prefill attention (packed_prefix.py): the packed attention
(and its log-sum-exp) equals plain attention over the template's blocks, a prefill step with it
equals the step without, the engine uses it for requests that continue a template and gives the
same tokens as without it, and the packed copy lives exactly as long as the template's blocks."""
import threading

import pytest
import torch

from helpers import greedy, run_ids
from prefix_service import GenerateRequest
from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.backends.cpu import layer as cpu_layer
from prefix_service.backends.torch.attention import TorchAttentionBackend
from prefix_service.config import CacheConfig, ConfigError
from prefix_service.backends.cpu.packed_prefix import PackedPrefixKV, attend_packed, packed_prefix_available

from test_cpu_fast_paths import _prefill_meta

BLOCK = 4
needs_packing = pytest.mark.skipif(packed_prefix_available(torch.device("cpu"), torch.float32, native=False) is not None,
                                   reason="this torch build cannot run oneDNN linears on this CPU")
needs_native = pytest.mark.skipif(cpu_attention.available() is not None,
                                  reason=f"no native CPU attention here: {cpu_attention.available()}")


def ids_of(n, salt=0):
    return [(19 * i + 5 * salt + 7) % 500 + 3 for i in range(n)]


@needs_packing
@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("n_blocks", [1, 5])
def test_attend_packed_equals_attention_over_the_blocks(m, n_blocks):
    g = torch.Generator().manual_seed(10 * m + n_blocks)
    hkv, d, bs = 2, 16, 4
    k_cache = torch.randn(12, bs, hkv, d, generator=g)
    v_cache = torch.randn(12, bs, hkv, d, generator=g)
    blocks = [6, 2, 9, 3, 7][:n_blocks]  # any order: packing gathers them
    packed = PackedPrefixKV([(k_cache, v_cache)], blocks)
    assert (packed.num_blocks, packed.num_tokens) == (n_blocks, n_blocks * bs)
    assert packed.nbytes == 2 * n_blocks * bs * hkv * d * 4
    q = torch.randn(1, hkv, m, d, generator=g)
    k = k_cache[blocks].flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, R, D]
    v = v_cache[blocks].flatten(0, 1).transpose(0, 1)[None]
    got, got_lse = attend_packed(q, *packed.layer(k_cache), d ** -0.5)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    want = torch.softmax(scores, -1) @ v
    assert got.shape == want.shape and got_lse.shape == (1, hkv, m) and got_lse.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5
    assert (got_lse - torch.logsumexp(scores, -1)).abs().max().item() < 1e-5


@needs_packing
def test_prefill_split_with_a_packed_template_equals_without(count_packed):
    """One step, six prefills; those that continue the template read it from the packed copy. The
    result equals the step without packing, sequence by sequence."""
    g = torch.Generator().manual_seed(3)
    bs, hq, hkv, d = 4, 6, 2, 16
    kc, vc = torch.randn(80, bs, hkv, d, generator=g), torch.randn(80, bs, hkv, d, generator=g)
    template = [10, 11, 12]  # its full blocks
    seqs = [  # (block table, context tokens, new tokens)
        (template + [30], 3 * bs + 2, 5),  # the template, a partial tail copy, then the prompt
        (template + [31, 32], 3 * bs + bs + 1, 3),  # a later chunk: more context after the template
        ([40, 41], bs + 1, 4),  # another sequence, no template
        (template, 3 * bs, 2),  # the template's exact end: no context after it
        ([50], 0, 6),  # no context at all
        (template + [33], 3 * bs + 3, 1),
    ]
    tq = sum(n for _, _, n in seqs)
    q = torch.randn(tq, hq, d, generator=g)
    k, v = torch.randn(tq, hkv, d, generator=g), torch.randn(tq, hkv, d, generator=g)
    want = TorchAttentionBackend._prefill_split(q, k, v, kc, vc, _prefill_meta(seqs, bs), d ** -0.5)

    packed = PackedPrefixKV([(kc, vc)], template)
    meta = _prefill_meta(seqs, bs)
    meta.prefill_packed = [packed if t[:3] == template else None for t, _, _ in seqs]
    got = TorchAttentionBackend._prefill_split(q, k, v, kc, vc, meta, d ** -0.5)
    assert count_packed == [15, 9, 6, 3]  # the four template sequences, in order (3 query heads a KV head)
    assert (got - want).abs().max().item() < 1e-5


@pytest.fixture
def count_packed(monkeypatch):
    """Counts the prefill attentions that read a packed template (oneDNN's layout or the native
    kernel's), by their query rows: new tokens x query heads per KV head."""
    import prefix_service.backends.torch.attention as attention_mod
    calls = []
    real, real_native = attention_mod.attend_packed, cpu_attention.prefill_attention

    def counting(q, *args):
        calls.append(q.shape[2])
        return real(q, *args)

    def counting_native(q, k, v, scale, template=None, **kw):
        if template is not None:
            calls.append(q.shape[0] * q.shape[1] // k.shape[1])
        return real_native(q, k, v, scale, template=template, **kw)
    def counting_stack(self, x, rotate, meta):  # the decoder stack calls the native kernel from C++, every layer
        for q_len, packed in zip(meta.prefill_q_lens, meta.prefill_packed or []):
            if packed is not None:
                calls.extend([q_len * self.hq // self.hkv] * len(self.layers))
        return real_stack(self, x, rotate, meta)
    real_stack = cpu_layer.DecoderStack.forward
    monkeypatch.setattr(attention_mod, "attend_packed", counting)
    monkeypatch.setattr(cpu_attention, "prefill_attention", counting_native)
    monkeypatch.setattr(cpu_layer.DecoderStack, "forward", counting_stack)
    return calls


@needs_packing
@pytest.mark.parametrize("attention", ["torch", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("prefix_len", [BLOCK, 3 * BLOCK + 2])
def test_engine_tokens_with_packed_template_equal_without(prefix_len, attention, make_engine, count_packed):
    full = ids_of(prefix_len + 11)
    plain = make_engine(block_size=BLOCK, pack_prefix_kv=False, cpu_attention=attention)
    plain.add_prefix("p", token_ids=full[:prefix_len])
    expected = run_ids(plain, full)
    assert run_ids(plain, full[prefix_len:], prefix="p") == expected
    assert count_packed == []  # packing off: never used

    engine = make_engine(block_size=BLOCK, cpu_attention=attention)
    engine.add_prefix("p", token_ids=full[:prefix_len])
    assert engine._run(lambda core: [p.native for p in core.runner.packed_prefixes.values()]) == [attention == "native"]
    assert run_ids(engine, full[prefix_len:], prefix="p") == expected
    arch = engine._run(lambda core: core.arch)
    assert count_packed == [11 * arch.num_heads // arch.num_kv_heads] * arch.num_layers  # the prompt, every layer
    # a prompt that adds nothing: its one token (the template's last, computed again for its logits)
    # runs as a decode; when the template ends on a block boundary it shares one block fewer, and the
    # packed copy, which holds that block, must not stand in for its context
    out = engine.generate([GenerateRequest(prompt_token_ids=[], prefix_name="p", sampling=greedy(8))])[0]
    assert out.token_ids == run_ids(engine, full[:prefix_len], max_tokens=8)

    def shares(core, num_shared):
        handle = next(iter(core.runner.packed_prefixes))
        seq = type("Seq", (), {"prefix": handle, "num_shared_blocks": num_shared})()
        return core.runner._packed_for(seq) is not None
    full_blocks = prefix_len // BLOCK
    assert engine._run(lambda core: (shares(core, full_blocks), shares(core, full_blocks - 1))) == (True, False)


@needs_packing
@pytest.mark.parametrize("attention", ["torch", pytest.param("native", marks=needs_native)])
def test_packed_copy_dropped_with_the_template_blocks(attention, make_engine):
    engine = make_engine(block_size=BLOCK, cpu_attention=attention)
    packed = lambda: engine._run(lambda core: sorted(h.name for h in core.runner.packed_prefixes))  # noqa: E731
    engine.add_prefix("a", token_ids=ids_of(9))
    engine.add_prefix("b", token_ids=ids_of(3, salt=1))  # no full block: nothing to pack
    assert packed() == ["a"]
    arch = engine._run(lambda core: core.arch)
    # 2 full blocks of 4 tokens, K and V of every layer, float32
    assert engine.kv_stats()["packed_prefix_bytes"] == 2 * 2 * BLOCK * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    assert engine.remove_prefix("a") is True  # unused: freed at once, and its packed copy with it
    assert packed() == []

    # removed while requests still read it: the copy stays until the last of them ends
    engine.add_prefix("c", token_ids=ids_of(10, salt=2))
    outputs = {0: [], 1: []}
    started = [threading.Event(), threading.Event()]

    def sink_for(k):
        def sink(out):
            outputs[k].append(out)
            started[k].set()
        return sink
    for k in range(2):
        engine.submit(GenerateRequest(prompt_token_ids=ids_of(4, salt=3 + k), prefix_name="c", sampling=greedy(40)),
                      sink_for(k))
    assert all(e.wait(30) for e in started)
    assert engine.remove_prefix("c") is False
    assert packed() == ["c"]
    for k in range(2):
        while not outputs[k][-1].finished:
            threading.Event().wait(0.01)
    assert packed() == []
    assert engine.kv_stats()["pinned"] == 1  # "b" alone
    assert engine.kv_stats()["packed_prefix_bytes"] == 0


def test_pack_prefix_kv_config_is_checked():
    with pytest.raises(ConfigError, match="cache.pack_prefix_kv"):
        CacheConfig(pack_prefix_kv="yes")


def test_packing_applies_to_float32_cpu_caches_only():
    assert "not the CPU" in packed_prefix_available(torch.device("meta"), torch.float32, native=False)
    assert "bfloat16" in packed_prefix_available(torch.device("cpu"), torch.bfloat16, native=False)
