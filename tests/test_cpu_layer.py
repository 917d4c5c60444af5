"""Layer blocks (cpu_layer.py): a layer's work before and after attention as two native calls gives
the kernel-by-kernel forward's hidden states and cache bit for bit, for Llama, Qwen2 (a q/k/v
bias) and Mistral; the engine binds them only where they apply (native linear layers and
element-wise work, no q/k norms); a profiled forward runs kernel by kernel; bad input is refused
clearly. The decoder stack (all layers in one native call) gives the layer-by-layer forward bit
for bit on every step of an engine's mixed work: decodes and prefills, on a packed template or
not, chunked, in one step."""
import pytest
import torch

from prefix_service.backends.cpu import layer as cpu_layer
from prefix_service.backends.cpu import native
from prefix_service.backends.torch.attention import TorchAttentionBackend
from prefix_service.model.loader import load_model

from helpers import greedy
from prefix_service import GenerateRequest
from test_cpu_fast_paths import _generate, _prefill_meta

REASON = native.load()[1]
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
BS = 4


def native_model(model_dir):
    model = load_model(model_dir, torch.float32, torch.device("cpu"), max_positions=256)
    model.pack_for_cpu("native")
    model.fused_elementwise = True
    return model


def prefill(model, ids: torch.Tensor, use_blocks: bool, caches=None):
    """One forward of a prefill of `ids` from position 0 into `caches` (default: fresh ones, two
    blocks to spare): (hidden, caches)."""
    arch, n = model.arch, ids.shape[0]
    if caches is None:
        caches = [(torch.zeros(-(-n // BS) + 2, BS, arch.num_kv_heads, arch.head_dim),
                   torch.zeros(-(-n // BS) + 2, BS, arch.num_kv_heads, arch.head_dim)) for _ in model.layers]
    meta = _prefill_meta([(list(range(-(-n // BS))), 0, n)], BS)
    meta.slot_mapping = torch.arange(n)
    bound = [layer.blocks for layer in model.layers]
    if not use_blocks:
        for layer in model.layers:
            layer.blocks = None
    try:
        hidden = model(ids, torch.arange(n), TorchAttentionBackend(native=True), caches, meta)
    finally:
        for layer, blocks in zip(model.layers, bound):
            layer.blocks = blocks
    return hidden, caches


@needs_native
@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral"])
def test_blocks_give_the_kernel_by_kernel_forward_bit_for_bit(model_dirs, which, monkeypatch):
    model = native_model(model_dirs[which])
    assert model.use_layer_blocks() is None
    calls = []
    real_qkv, real_mlp = cpu_layer.LayerBlocks.qkv, cpu_layer.LayerBlocks.mlp
    monkeypatch.setattr(cpu_layer.LayerBlocks, "qkv", lambda self, *a: calls.append("qkv") or real_qkv(self, *a))
    monkeypatch.setattr(cpu_layer.LayerBlocks, "mlp", lambda self, *a: calls.append("mlp") or real_mlp(self, *a))
    ids = torch.randint(3, model.arch.vocab_size, (37,), generator=torch.Generator().manual_seed(7))
    got, got_caches = prefill(model, ids, use_blocks=True)
    assert calls == ["qkv", "mlp"] * model.arch.num_layers
    calls.clear()
    want, want_caches = prefill(model, ids, use_blocks=False)
    assert not calls
    assert torch.equal(got, want)
    for (k1, v1), (k0, v0) in zip(got_caches, want_caches):
        assert torch.equal(k1, k0) and torch.equal(v1, v0)


@needs_native
def test_engine_binds_blocks_where_they_apply(make_engine, model_dirs):
    engine = make_engine()
    assert engine._run(lambda core: core.layer_blocks) is True
    want = _generate(engine)  # prefills, a template, decodes, all through the blocks

    assert engine._run(lambda core: core.decoder_stack and core.model.stack is not None)

    def unbind(core):
        core.model.stack = None
        for layer in core.model.layers:
            layer.blocks = None
    plain = make_engine()
    plain._run(unbind)
    assert _generate(plain) == want
    assert make_engine(cpu_attention="torch")._run(lambda core: (core.layer_blocks, core.decoder_stack)) == (True, False)
    assert make_engine(cpu_linear="blas")._run(lambda core: core.layer_blocks) is False
    assert make_engine(cpu_elementwise="torch")._run(lambda core: core.layer_blocks) is False
    qwen3 = make_engine(model_dirs["qwen3"], num_blocks=160)  # q/k norms: kernel by kernel
    assert qwen3._run(lambda core: (core.cpu_linear, core.layer_blocks)) == ("native", False)


@needs_native
def test_a_profiled_forward_runs_kernel_by_kernel(llama_dir):
    """Under torch's profiler each kernel is timed on its own (scripts/profile_prefill.py splits
    a forward's time by kernel), with the same result."""
    model = native_model(llama_dir)
    assert model.use_layer_blocks() is None
    ids = torch.arange(3, 20)
    want, _ = prefill(model, ids, use_blocks=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got, _ = prefill(model, ids, use_blocks=True)
    names = {event.name for event in prof.events()}
    assert "prefix_service::cpu_linear" in names and cpu_layer.PROFILE_SCOPE not in names
    assert torch.equal(got, want)


@needs_native
def test_bad_input_is_refused_with_a_clear_error(llama_dir):
    model = native_model(llama_dir)
    model.use_layer_blocks()
    blocks = model.layers[0].blocks
    hidden, q_size = blocks.hidden, blocks.q_size
    from prefix_service.backends.cpu.elementwise import Rotation
    cos, sin = model.rotary.tables(torch.device("cpu"))
    x = torch.randn(5, hidden)
    with pytest.raises(cpu_layer.NativeLayerError, match=r"x: float32 \[T, "):
        blocks.qkv(torch.randn(5, hidden + 1), None, Rotation(torch.arange(5), cos, sin))
    with pytest.raises(cpu_layer.NativeLayerError, match="pending"):
        blocks.qkv(x, torch.randn(4, hidden), Rotation(torch.arange(5), cos, sin))
    with pytest.raises(cpu_layer.NativeLayerError, match="rotation is for 4 positions"):
        blocks.qkv(x, None, Rotation(torch.arange(4), cos, sin))
    with pytest.raises(cpu_layer.NativeLayerError, match="attn_out"):
        blocks.mlp(torch.randn(5, q_size + 2), x)
    plain = load_model(llama_dir, torch.float32, torch.device("cpu"), max_positions=64)  # F.linear layers
    assert "not on the native kernel" in cpu_layer.unsupported(plain.layers[0])
    with pytest.raises(cpu_layer.NativeLayerError, match="cannot run on native blocks"):
        cpu_layer.LayerBlocks(plain.layers[0])
    plain.fused_elementwise = True
    assert plain.use_layer_blocks() == "its linear layers are not on the native kernel"
    assert all(layer.blocks is None for layer in plain.layers)


@needs_native
@pytest.mark.parametrize("which", ["llama", "qwen2", "mistral"])
def test_decoder_stack_gives_the_layer_by_layer_forward_bit_for_bit(make_engine, model_dirs, which, monkeypatch):
    """Every step of a mixed workload (a pinned template with a packed copy, requests on it and
    plain ones, prefills chunked beside decodes) runs layer by layer first, from a copy of the
    cache, then through the stack: the same hidden states and cache, bit for bit."""
    from prefix_service.backends.torch.attention import TorchAttentionBackend
    seen = []
    real = cpu_layer.DecoderStack.forward

    def checked(self, x, rotate, meta):
        before = [(k.clone(), v.clone()) for k, v in self.kv_layers]
        x_ref, pending = x.clone(), None
        backend = TorchAttentionBackend(native=True)
        for layer, kv in zip(self.layers, self.kv_layers):
            pending = layer.forward_fused(x_ref, pending, rotate, backend, kv, meta)
        after = [(k.clone(), v.clone()) for k, v in self.kv_layers]
        for (k, v), (k0, v0) in zip(self.kv_layers, before):
            k.copy_(k0)
            v.copy_(v0)
        got = real(self, x, rotate, meta)
        assert torch.equal(got, pending) and torch.equal(x, x_ref)
        for (k, v), (k1, v1) in zip(self.kv_layers, after):
            assert torch.equal(k, k1) and torch.equal(v, v1)
        nd = meta.num_decode_tokens
        seen.append((nd, sum(p is not None for p in meta.decode_packed[:nd]) if meta.decode_packed else 0,
                     [(q, c, p is not None) for q, c, p in zip(meta.prefill_q_lens, meta.prefill_prefix_lens_list,
                                                              meta.prefill_packed or [None] * len(meta.prefill_q_lens))]))
        return got
    monkeypatch.setattr(cpu_layer.DecoderStack, "forward", checked)
    engine = make_engine(model_dirs[which], num_blocks=160, max_num_batched_tokens=24)
    assert engine._run(lambda core: core.decoder_stack)
    engine.add_prefix("tpl", token_ids=[(3 * i + 7) % 500 + 3 for i in range(22)])  # 5 full blocks + 2
    prompts = [[(5 * i + k) % 500 + 3 for i in range(2 + 7 * k)] for k in range(4)]
    batch = [GenerateRequest(prompt_token_ids=p, prefix_name="tpl" if k % 2 == 0 else None, sampling=greedy(6))
             for k, p in enumerate(prompts)] + [GenerateRequest(prompt_token_ids=p, prefix_name="tpl",
                                                                sampling=greedy(5)) for p in prompts[1::2]]
    outs = engine.generate(batch)
    assert all(len(o.token_ids) in (5, 6) for o in outs)
    assert any(nd and pre for nd, _, pre in seen)  # decodes and prefills in one step
    assert any(t for _, t, _ in seen)  # decodes on the packed template
    assert any(p for _, _, pre in seen for _, _, p in pre)  # prefills on it
    assert any(c > 0 and not p for _, _, pre in seen for _, c, p in pre)  # a chunk after cached context


@needs_native
def test_decoder_stack_serves_only_its_caches_and_not_under_the_profiler(llama_dir, monkeypatch):
    model = native_model(llama_dir)
    assert model.use_layer_blocks() is None
    ids = torch.arange(3, 40)
    want, want_caches = prefill(model, ids, use_blocks=True)  # no stack bound: layer by layer
    calls = []
    real = cpu_layer.DecoderStack.forward
    monkeypatch.setattr(cpu_layer.DecoderStack, "forward", lambda self, *a: calls.append(1) or real(self, *a))
    caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in want_caches]
    model.use_decoder_stack(caches)
    got, _ = prefill(model, ids, use_blocks=True)  # fresh caches: not the stack's
    assert not calls and torch.equal(got, want)
    got, got_caches = prefill(model, ids, use_blocks=True, caches=caches)
    assert calls == [1] and got_caches is caches and torch.equal(got, want)
    for (k, v), (k0, v0) in zip(caches, want_caches):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got, _ = prefill(model, ids, use_blocks=True, caches=caches)
    assert calls == [1] and torch.equal(got, want)
    assert "prefix_service::cpu_linear" in {event.name for event in prof.events()}


@needs_native
def test_decoder_stack_refuses_bad_input_and_leaves_the_cache(llama_dir):
    model = native_model(llama_dir)
    arch = model.arch
    caches = [(torch.zeros(6, BS, arch.num_kv_heads, arch.head_dim), torch.zeros(6, BS, arch.num_kv_heads, arch.head_dim))
              for _ in model.layers]
    with pytest.raises(cpu_layer.NativeLayerError, match="LayerBlocks bound"):
        model.use_decoder_stack(caches)
    assert model.use_layer_blocks() is None
    with pytest.raises(cpu_layer.NativeLayerError, match="KV caches for"):
        model.use_decoder_stack(caches[1:])
    with pytest.raises(cpu_layer.NativeLayerError, match="the KV cache"):
        model.use_decoder_stack([(k.double(), v) for k, v in caches])
    model.use_decoder_stack(caches)
    stack = model.stack
    from prefix_service.backends.cpu.elementwise import Rotation
    cos, sin = model.rotary.tables(torch.device("cpu"))
    n = 9
    meta = _prefill_meta([([0, 1, 2], 0, n)], BS)
    meta.slot_mapping = torch.arange(n)
    x = model.embed_tokens(torch.arange(3, 3 + n)).detach()
    with pytest.raises(cpu_layer.NativeLayerError, match="slot_mapping"):
        stack.forward(x.clone(), Rotation(torch.arange(n), cos, sin), _with(meta, slot_mapping=torch.arange(n - 1)))
    with pytest.raises(cpu_layer.NativeLayerError, match="rotation is for"):
        stack.forward(x.clone(), Rotation(torch.arange(n - 1), cos, sin), meta)
    with pytest.raises(cpu_layer.NativeLayerError, match="plans 0 decodes"):
        stack.forward(x[:-1].clone(), Rotation(torch.arange(n - 1), cos, sin),
                      _with(meta, slot_mapping=torch.arange(n - 1)))
    with pytest.raises(cpu_layer.NativeLayerError, match="x: contiguous float32"):
        stack.forward(x.double(), Rotation(torch.arange(n), cos, sin), meta)
    outside = torch.arange(n)
    outside[4] = 6 * BS  # one past the cache
    with pytest.raises(cpu_layer.NativeLayerError, match="status 4"):
        stack.forward(x.clone(), Rotation(torch.arange(n), cos, sin), _with(meta, slot_mapping=outside))
    assert all(not k.any() and not v.any() for k, v in caches)  # nothing written
    good = stack.forward(x.clone(), Rotation(torch.arange(n), cos, sin), meta)
    assert good.shape == (n, arch.hidden_size) and all(k.any() and v.any() for k, v in caches)


def _with(meta, **changes):
    import dataclasses
    return dataclasses.replace(meta, **changes)


@needs_native
def test_decoder_stack_copies_blocks_in_every_layer(llama_dir):
    """The copy-on-write of a template's partial last block: one native call for all layers, the
    same as copying block by block; bad pairs are refused with nothing copied."""
    model = native_model(llama_dir)
    assert model.use_layer_blocks() is None
    arch = model.arch
    caches = [(torch.randn(7, BS, arch.num_kv_heads, arch.head_dim), torch.randn(7, BS, arch.num_kv_heads, arch.head_dim))
              for _ in model.layers]
    model.use_decoder_stack(caches)
    want = [(k.clone(), v.clone()) for k, v in caches]
    for k, v in want:
        for src, dst in ((2, 5), (3, 0)):
            k[dst], v[dst] = k[src], v[src]
    model.stack.copy_blocks([(2, 5), (3, 0)])
    for (k, v), (k0, v0) in zip(caches, want):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(cpu_layer.NativeLayerError, match="status 4"):
        model.stack.copy_blocks([(1, 6), (2, 7)])  # block 7: outside the cache
    with pytest.raises(cpu_layer.NativeLayerError, match="distinct"):
        model.stack.copy_blocks([(1, 4), (2, 4)])
    with pytest.raises(cpu_layer.NativeLayerError, match="distinct"):
        model.stack.copy_blocks([(1, 4), (4, 6)])
    for (k, v), (k0, v0) in zip(caches, want):
        assert torch.equal(k, k0) and torch.equal(v, v0)
