"""cache.kv_cache_dtype: the KV cache in another dtype than the model's (bfloat16 under a float32 model).

The cache then holds bf16 tensors and twice the blocks in the same kv_cache_memory; the new K and V
are rounded to bf16 before any query reads them, so a template's K/V read from the cache and the same
tokens' K/V computed in a prompt's own prefill are the same numbers: prefix and no prefix give the
same greedy ids and the same logits, and the cpu backend gives the torch backend's greedy ids, as
with a float32 cache. Against a float32 cache the logits move by bf16's rounding of K and V, within
a stated bound, and are not equal (the option takes effect). A backend that cannot hold the dtype
refuses it at start with a ConfigError naming the key, before the weights load; a snapshot of a bf16
cache under a float32 model is keyed apart from a float32 cache's and a bf16 model's."""
from __future__ import annotations

import pytest
import torch

from helpers import engine_last_logits, mixed_generate, run_ids
from prefix_service import Engine, GenerateRequest, SamplingParams
from prefix_service.backends.cpu import native
from prefix_service.backends.kv_cache import KVCache
from prefix_service.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, config_from_dict
from prefix_service.engine.snapshots import snapshot_key
from prefix_service.model.loader import read_arch

REASON = native.load()[1]
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(REASON is not None,
                                                                 reason=f"no native CPU kernels here: {REASON}"))]
# the largest change of a last-position logit (of magnitude up to ~6) that bf16's rounding of K and V
# makes on the tiny models here: measured 0.008-0.047 over llama, qwen2 and qwen3 and three prompts
BF16_KV_LOGITS = 0.1


def ids_of(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * salt + 5) % 500 + 3 for i in range(n)]


def cache_dtypes(engine) -> set[torch.dtype]:
    return engine._run(lambda core: {t.dtype for layer in core.backend.kv_layers for t in layer})


def test_the_option_is_checked_and_read_from_yaml():
    assert CacheConfig().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype: 'fp8' is not one of auto, float32, bfloat16"):
        CacheConfig(kv_cache_dtype="fp8")
    cfg = config_from_dict({"model": {"path": "m"}, "cache": {"kv_cache_dtype": "bfloat16"}})
    assert cfg.engine.cache.kv_cache_dtype == "bfloat16"


def test_a_bf16_cache_holds_twice_the_blocks_in_the_same_memory(llama_dir):
    arch = read_arch(llama_dir)
    budget = CacheConfig(kv_cache_memory=1 << 20)
    f32, bf16 = KVCache(arch, budget, torch.float32, torch.device("cpu")), KVCache(arch, budget, torch.bfloat16,
                                                                                   torch.device("cpu"))
    assert bf16.num_blocks == 2 * f32.num_blocks
    assert bf16.bytes_per_block * 2 == f32.bytes_per_block
    assert {t.dtype for t in bf16.k + bf16.v} == {torch.bfloat16}


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_and_no_prefix_agree_on_a_bf16_cache(make_engine, backend):
    engine = make_engine(backend=backend, kv_cache_dtype="bfloat16")
    assert cache_dtypes(engine) == {torch.bfloat16}
    assert engine.info.backend == backend
    assert (engine.info.dtype, engine.info.kv_cache_dtype) == ("float32", "bfloat16")  # as reported (metrics)
    for prefix_len in (3, 8, 17):
        full = ids_of(prefix_len + 9, salt=prefix_len)
        expected = run_ids(engine, full)
        engine.add_template("p", token_ids=full[:prefix_len])
        assert run_ids(engine, full[prefix_len:], prefix="p") == expected
        with_prefix = engine_last_logits(engine, full[prefix_len:], prefix="p")
        alone = engine_last_logits(engine, full)
        assert (with_prefix - alone).abs().max().item() <= 1e-4
        assert engine.remove_template("p")


@pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
def test_cpu_backend_generates_the_torch_backends_tokens_on_a_bf16_cache(make_engine):
    ref = make_engine(num_blocks=160, max_num_batched_tokens=16, backend="torch", kv_cache_dtype="bfloat16")
    cpu = make_engine(num_blocks=160, max_num_batched_tokens=16, backend="cpu", kv_cache_dtype="bfloat16")
    want = mixed_generate(ref)
    assert mixed_generate(cpu) == want
    ids = ids_of(37, salt=1)
    assert (engine_last_logits(cpu, ids) - engine_last_logits(ref, ids)).abs().max().item() <= 1e-3


@pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
@pytest.mark.parametrize("int8", [False, True])
def test_the_cpu_backends_start_up_line_names_a_bf16_cache_under_a_float32_model(make_engine, int8):
    quantization = "int8" if int8 else "none"
    plain = make_engine(backend="cpu", quantization=quantization).info.backend_description
    bf16 = make_engine(backend="cpu", quantization=quantization, kv_cache_dtype="bfloat16").info.backend_description
    assert "bf16 KV cache" not in plain and bf16.endswith(", bf16 KV cache)")
    assert bf16.replace(", bf16 KV cache)", ")") == plain


@pytest.mark.skipif(REASON is not None, reason=f"no native CPU kernels here: {REASON}")
def test_a_float32_model_keeps_float32_attention_where_bf16_products_are_asked_for(make_engine, monkeypatch):
    """The bf16 matrix products a bf16 model's template attention may take (rounding q and P to bf16)
    are never a float32 model's, though its cache holds bf16: asked for by name here, as the CPUs with
    AVX512-BF16 choose them by default, the template and its plain prompt still agree to 1e-4."""
    monkeypatch.setenv("PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION", "matrix")
    engine = make_engine(backend="cpu", kv_cache_dtype="bfloat16")
    stack = engine._run(lambda core: core.backend.stack)
    assert not stack.template_matrix and not stack.prompt_dot
    full = ids_of(26, salt=4)
    engine.add_template("p", token_ids=full[:17])
    with_prefix = engine_last_logits(engine, full[17:], prefix="p")
    assert (with_prefix - engine_last_logits(engine, full)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_cache_moves_the_logits_by_its_rounding_only(make_engine, backend):
    f32 = make_engine(backend=backend)
    bf16 = make_engine(backend=backend, kv_cache_dtype="bfloat16")
    assert cache_dtypes(f32) == {torch.float32}
    worst = 0.0
    for salt in range(3):
        ids = ids_of(30, salt=salt)
        diff = (engine_last_logits(bf16, ids) - engine_last_logits(f32, ids)).abs().max().item()
        worst = max(worst, diff)
        assert diff <= BF16_KV_LOGITS
    assert worst > 1e-6  # the cache's dtype took effect


def test_a_backend_that_cannot_hold_the_dtype_refuses_it_before_loading(llama_dir, monkeypatch):
    from prefix_service.backends.cpu.backend import CpuBackend
    from prefix_service.backends.cuda.backend import CudaBackend
    from prefix_service.backends.torch.backend import TorchBackend
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype: float32: the cuda backend holds the KV cache in "
                                          r"the model's dtype \(bfloat16\); use auto"):
        CudaBackend.cache_dtype(CacheConfig(kv_cache_dtype="float32"), torch.bfloat16)
    assert CudaBackend.cache_dtype(CacheConfig(), torch.bfloat16) == torch.bfloat16
    assert CudaBackend.cache_dtype(CacheConfig(kv_cache_dtype="bfloat16"), torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype: float16: the cpu backend's KV cache holds the "
                                          r"model's dtype, or bfloat16 under a float32 model; not float16 under float32"):
        CpuBackend.cache_dtype(CacheConfig(kv_cache_dtype="float16"), torch.float32)
    with pytest.raises(ConfigError, match=r"not float32 under bfloat16"):
        CpuBackend.cache_dtype(CacheConfig(kv_cache_dtype="float32"), torch.bfloat16)
    assert CpuBackend.cache_dtype(CacheConfig(kv_cache_dtype="bfloat16"), torch.float32) == torch.bfloat16
    assert TorchBackend.cache_dtype(CacheConfig(kv_cache_dtype="float16"), torch.float32) == torch.float16
    if REASON is None:  # the engine refuses it before it reads the weights
        from prefix_service.engine import core
        monkeypatch.setattr(core, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
        cfg = EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu", backend="cpu"),
                           CacheConfig(num_blocks=32, kv_cache_dtype="float16"))
        with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype: float16"):
            Engine(cfg)


def test_snapshots_of_a_bf16_cache_under_a_float32_model_are_keyed_apart(llama_dir):
    cpu = torch.device("cpu")

    def key(model_dtype, kv):
        cfg = EngineConfig(ModelConfig(path=str(llama_dir)), CacheConfig(kv_cache_dtype=kv))
        return snapshot_key(cfg, cpu, model_dtype)
    f32, mixed, bf16 = key(torch.float32, "auto"), key(torch.float32, "bfloat16"), key(torch.bfloat16, "auto")
    assert (f32.dtype, mixed.dtype, bf16.dtype) == ("float32", "bfloat16", "bfloat16")
    assert f32.fingerprint == bf16.fingerprint != mixed.fingerprint
    assert key(torch.float32, "float32") == f32 and key(torch.bfloat16, "bfloat16") == bf16


def test_a_bf16_cache_template_restores_from_its_snapshot(make_engine, tmp_path):
    folder = str(tmp_path / "snapshots")
    template = ids_of(18)
    reqs = [GenerateRequest(prompt_token_ids=ids_of(5, salt=s), prefix_name="doc",
                            sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for s in range(2)]
    first = make_engine(snapshot_dir=folder, kv_cache_dtype="bfloat16")
    first.add_template("doc", token_ids=template)
    first.flush_snapshots()
    want = [o.token_ids for o in first.generate(reqs)]
    second = make_engine(snapshot_dir=folder, kv_cache_dtype="bfloat16")
    assert second.add_template("doc", token_ids=template).kv_source == "snapshot"
    assert [o.token_ids for o in second.generate(reqs)] == want
    other = make_engine(snapshot_dir=folder)  # a float32 cache: not this snapshot
    assert other.add_template("doc", token_ids=template).kv_source == "prefill"
