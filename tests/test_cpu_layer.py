"""Layer blocks (cpu_layer.py): a layer's work before and after attention as two native calls gives
the kernel-by-kernel forward's hidden states and cache bit for bit, for Llama, Qwen2 (a q/k/v
bias) and Mistral; the engine binds them only where they apply (native linear layers and
element-wise work, no q/k norms); a profiled forward runs kernel by kernel; bad input is refused
clearly."""
import pytest
import torch

from prefix_service import cpu_layer, native
from prefix_service.attention import TorchAttentionBackend
from prefix_service.model.loader import load_model

from test_cpu_fast_paths import _generate, _prefill_meta

REASON = native.load()[1]
needs_native = pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
BS = 4


def native_model(model_dir):
    model = load_model(model_dir, torch.float32, torch.device("cpu"), max_positions=256)
    model.pack_for_cpu("native")
    model.fused_elementwise = True
    return model


def prefill(model, ids: torch.Tensor, use_blocks: bool):
    """One forward of a prefill of `ids` from position 0 into fresh caches: (hidden, caches)."""
    arch, n = model.arch, ids.shape[0]
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

    def unbind(core):
        for layer in core.model.layers:
            layer.blocks = None
    plain = make_engine()
    plain._run(unbind)
    assert _generate(plain) == want
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
    from prefix_service.cpu_elementwise import Rotation
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
