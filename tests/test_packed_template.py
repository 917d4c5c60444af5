"""Pinned templates' K/V packed for the cpu backend's attention (backends/cpu/packed_template.py): the
packed copy holds the template's full blocks in the kernel's layout; the engine reads it for the
requests that continue the template (prefills and decodes) and gives the same tokens as without
it; a request that shares one block fewer does not read it; the copy lives exactly as long as the
template's blocks; the torch backend holds none."""
import threading

import pytest
import torch

from helpers import greedy, run_ids
from prefix_service import GenerateRequest
from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.backends.cpu.packed_template import PackedTemplate
from prefix_service.backends.cpu.plan import StackPlan
from prefix_service.config import CacheConfig, ConfigError
from prefix_service.engine.step import ScheduledRow

BLOCK = 4
needs_native = pytest.mark.skipif(cpu_attention.available() is not None,
                                  reason=f"no native CPU attention here: {cpu_attention.available()}")


def ids_of(n, salt=0):
    return [(19 * i + 5 * salt + 7) % 500 + 3 for i in range(n)]


@needs_native
@pytest.mark.parametrize("n_blocks", [1, 5])
def test_packed_template_holds_the_blocks_in_the_kernels_layout(n_blocks):
    g = torch.Generator().manual_seed(n_blocks)
    hkv, d, bs = 2, 16, 4
    layers = [(torch.randn(12, bs, hkv, d, generator=g), torch.randn(12, bs, hkv, d, generator=g)) for _ in range(3)]
    blocks = [6, 2, 9, 3, 7][:n_blocks]  # any order: packing gathers them
    packed = PackedTemplate(layers, blocks)
    assert (packed.num_blocks, packed.num_tokens) == (n_blocks, n_blocks * bs)
    assert packed.nbytes == 3 * 2 * n_blocks * bs * hkv * d * 4
    for index, (k_cache, v_cache) in enumerate(layers):
        kt, vt, r = packed.layer(index)
        assert r == n_blocks * bs
        assert torch.equal(kt, cpu_attention.pack_keys(k_cache[blocks].flatten(0, 1)))
        assert torch.equal(vt, cpu_attention.pack_values(v_cache[blocks].flatten(0, 1)))
        assert packed.pointers[index].tolist() == [kt.data_ptr(), vt.data_ptr(), 0]
    with pytest.raises(ValueError, match="at least one full block"):
        PackedTemplate(layers, [])
    with pytest.raises(ValueError, match="reads a bfloat16 cache, not torch.float32"):
        PackedTemplate(layers, blocks, matrix=True)


@needs_native
def test_packed_template_for_matrix_attention_holds_each_layer_in_bf16_only():
    """matrix=True (a bfloat16 cache): each layer's K/V are packed for the matrix-product template
    attention instead of in float32, its handle every pointer, its bytes the only ones counted; it
    attends over exactly the template's blocks (its state equals that of a copy packed from the
    gathered K/V)."""
    from prefix_service.backends.cpu import onednn
    g = torch.Generator().manual_seed(3)
    hkv, d, bs = 2, 16, 4
    layers = [(torch.randn(12, bs, hkv, d, generator=g).bfloat16(), torch.randn(12, bs, hkv, d, generator=g).bfloat16())
              for _ in range(2)]
    blocks = [6, 2, 9]
    packed = PackedTemplate(layers, blocks, matrix=True)
    assert packed.layers == [] and packed.nbytes == sum(m.nbytes for m in packed.matrix)
    assert all(m.nbytes > 0 for m in packed.matrix)
    with pytest.raises(ValueError, match="matrix-product attention only"):
        packed.layer(0)
    q = torch.randn(5, d, generator=g)
    for index, (k_cache, v_cache) in enumerate(layers):
        assert packed.pointers[index].tolist() == [packed.matrix[index].handle] * 3 and packed.matrix[index].handle
        alone = onednn.OneDnnTemplate(k_cache[blocks].flatten(0, 1), v_cache[blocks].flatten(0, 1))
        for h in range(hkv):
            for got, want in zip(packed.matrix[index].attend(h, q), alone.attend(h, q)):
                assert torch.equal(got, want)


@pytest.fixture
def count_packed(monkeypatch):
    """Counts, per step, the prefill rows of the cpu backend's plans that read a packed template."""
    calls = []
    real = StackPlan.build

    def counting(step, *args):
        plan = real(step, *args)
        calls.extend(q for q, _, first in plan.prefill_info.tolist() if first)
        return plan
    monkeypatch.setattr(StackPlan, "build", staticmethod(counting))
    return calls


@needs_native
@pytest.mark.parametrize("prefix_len", [BLOCK, 3 * BLOCK + 2])
def test_engine_tokens_with_packed_template_equal_without(prefix_len, make_engine, count_packed):
    full = ids_of(prefix_len + 11)
    plain = make_engine(block_size=BLOCK, pack_prefix_kv=False)
    plain.add_template("p", token_ids=full[:prefix_len])
    expected = run_ids(plain, full)
    assert run_ids(plain, full[prefix_len:], prefix="p") == expected
    assert count_packed == [] and plain.kv_stats()["packed_template_bytes"] == 0  # packing off: never used

    engine = make_engine(block_size=BLOCK)
    assert engine.info.backend == "cpu"
    engine.add_template("p", token_ids=full[:prefix_len])
    assert engine._run(lambda core: len(core.backend.templates)) == 1
    assert run_ids(engine, full[prefix_len:], prefix="p") == expected
    assert count_packed == [11]  # the prompt's prefill, over the packed template
    # a prompt that adds nothing: its one token (the template's last, computed again for its logits)
    # runs as a decode; when the template ends on a block boundary it shares one block fewer, and the
    # packed copy, which holds that block, must not stand in for its context
    out = engine.generate([GenerateRequest(prompt_token_ids=[], prefix_name="p", sampling=greedy(8))])[0]
    assert out.token_ids == run_ids(engine, full[:prefix_len], max_tokens=8)

    def shares(core, num_shared):
        template_id = next(iter(core.backend.templates))
        row = ScheduledRow("probe", True, (1,), prefix_len, (), template_id, num_shared)
        return core.backend.template_of(row) is not None
    full_blocks = prefix_len // BLOCK
    assert engine._run(lambda core: (shares(core, full_blocks), shares(core, full_blocks - 1))) == (True, False)


@needs_native
def test_packed_copy_dropped_with_the_template_blocks(make_engine):
    engine = make_engine(block_size=BLOCK)
    def packed():
        def names(core):
            return sorted(h.name for h in core.templates.pinned_handles() if h.template_id in core.backend.templates)
        return engine._run(names)
    engine.add_template("a", token_ids=ids_of(9))
    engine.add_template("b", token_ids=ids_of(3, salt=1))  # no full block: nothing to pack
    assert packed() == ["a"]
    arch = engine.info.arch
    # 2 full blocks of 4 tokens, K and V of every layer, float32
    assert engine.kv_stats()["packed_template_bytes"] == 2 * 2 * BLOCK * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    assert engine.remove_template("a") is True  # unused: freed at once, and its packed copy with it
    assert packed() == []

    # removed while requests still read it: the copy stays until the last of them ends
    engine.add_template("c", token_ids=ids_of(10, salt=2))
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
    assert engine.remove_template("c") is False
    assert packed() == ["c"]
    for k in range(2):
        while not outputs[k][-1].finished:
            threading.Event().wait(0.01)
    assert packed() == []
    assert engine.kv_stats()["pinned"] == 1  # "b" alone
    assert engine.kv_stats()["packed_template_bytes"] == 0


def test_the_torch_backend_packs_nothing(make_engine):
    engine = make_engine(block_size=BLOCK, backend="torch")
    engine.add_template("a", token_ids=ids_of(9))
    assert engine.kv_stats()["packed_template_bytes"] == 0


def test_pack_prefix_kv_config_is_checked():
    with pytest.raises(ConfigError, match="cache.pack_prefix_kv"):
        CacheConfig(pack_prefix_kv="yes")
