"""The cuda backend (backends/cuda/). On CPU: the Triton paged-decode kernel under TRITON_INTERPRET=1
against gather + SDPA, the choice of prefill by dtype, and the backend's glue (store, concat,
varlen prefill, paged decode, copy-on-write) inside a real engine against the torch backend. On
a GPU: the real kernels, prefix vs no prefix, and HF."""
import os

import pytest
import torch

from cuda_ops.paged_decode import paged_decode_attention, paged_decode_attention_ref, triton_available
from helpers import greedy, run_ids
from prefix_service import GenerateRequest

needs_triton = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs triton with TRITON_INTERPRET=1 (set by conftest without a GPU; "
                                         "on a GPU the kernel runs natively in the GPU tests)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _paged_case(hq, hkv, d, bs, dtype, ctx_lens, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-c // bs) for c in ctx_lens) + 3
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    width = max(-(-c // bs) for c in ctx_lens) + 1
    bt = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    k = 0
    for i, c in enumerate(ctx_lens):
        need = -(-c // bs)
        bt[i, :need] = perm[k:k + need]
        k += need
    q = torch.randn(len(ctx_lens), hq, d, generator=g).to(dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, bt, ctx)]


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CASES = [(4, 2, 16, 4, torch.float32), (9, 3, 64, 16, torch.float32), (8, 8, 24, 5, torch.bfloat16),
         (32, 8, 128, 16, torch.float16), (4, 1, 256, 1, torch.float32)]


@needs_triton
@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_paged_decode_interpreted(hq, hkv, d, bs, dtype, splits):
    ctx_lens = [1, bs, bs + 1, 3 * bs + 2]
    q, kc, vc, bt, ctx = _paged_case(hq, hkv, d, bs, dtype, ctx_lens)
    ref = paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), d ** -0.5)
    out = paged_decode_attention(q, kc, vc, bt, ctx, max(ctx_lens), d ** -0.5, num_splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype]


def test_prefill_is_chosen_by_dtype():
    """FlashAttention takes only float16 and bfloat16: a float32 model prefills with SDPA."""
    from prefix_service.backends.cuda.attention import pick_prefill
    assert pick_prefill(torch.float32)[0] == "sdpa_loop"
    assert pick_prefill(torch.bfloat16)[0] in ("flash_attn", "torch_varlen", "sdpa_loop")


@needs_triton
def test_backend_glue_in_engine_on_cpu(make_engine, monkeypatch):
    """store -> concat -> varlen prefill and the Triton paged decode, inside the engine on CPU tensors
    (cuda_ops' torch references, Triton's interpreter): same greedy tokens as the torch backend,
    with and without a prefix (a partial tail block: copy-on-write), chunked and batched."""
    import functools

    import prefix_service.engine.core as core_mod
    from prefix_service.backends.cuda.attention import decode_triton, prefill_sdpa_loop
    from prefix_service.backends.cuda.backend import CudaBackend
    ref_engine = make_engine(block_size=4, backend="torch")
    monkeypatch.setattr(core_mod, "select_backend", lambda *args: functools.partial(
        CudaBackend, prefill=("sdpa_loop", prefill_sdpa_loop), decode=("triton_paged", decode_triton)))
    engine = make_engine(block_size=4, max_num_batched_tokens=7)
    assert engine.info.backend_description == "cuda (prefill sdpa_loop, decode triton_paged)"
    prefix = [(7 * i + 5) % 500 + 3 for i in range(10)]
    users = [[(11 * i + k) % 500 + 3 for i in range(3 + 2 * k)] for k in range(3)]
    expected = [run_ids(ref_engine, prefix + u, max_tokens=6) for u in users]
    engine.add_template("p", token_ids=prefix)
    outs = engine.generate([GenerateRequest(prompt_token_ids=u, prefix_name="p", sampling=greedy(6)) for u in users])
    assert [o.token_ids for o in outs] == expected


# --- on a GPU ------------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
def test_triton_paged_decode_on_gpu(hq, hkv, d, bs, dtype):
    ctx_lens = [1, bs, bs + 1, 3 * bs + 2, 900]
    q, kc, vc, bt, ctx = _paged_case(hq, hkv, d, bs, dtype, ctx_lens, device="cuda")
    ref = paged_decode_attention_ref(q, kc, vc, bt, ctx, max(ctx_lens), d ** -0.5)
    out = paged_decode_attention(q, kc, vc, bt, ctx, max(ctx_lens), d ** -0.5)
    assert (out.float() - ref.float()).abs().max() <= TOL[dtype]


@needs_gpu
def test_gpu_varlen_prefill_matches_sdpa_loop():
    from prefix_service.backends.cuda.attention import VarlenMetadata, pick_prefill, prefill_sdpa_loop
    name, fn = pick_prefill(torch.bfloat16)
    q_lens, ctx = [5, 1, 37], [0, 16, 21]
    hq, hkv, d = 8, 2, 64
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(sum(q_lens), hq, d, device=dev, dtype=dt)
    k = torch.randn(sum(q_lens) + sum(ctx), hkv, d, device=dev, dtype=dt)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 5, 6, 43], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 5, 22, 80], dtype=torch.int32, device=dev)
    empty = torch.empty(0, dtype=torch.int32, device=dev)
    meta = VarlenMetadata(empty.long(), 0, empty.view(0, 0), empty, 0, empty.view(0, 0),
                          torch.tensor(ctx, dtype=torch.int32, device=dev), cu_q, q_lens, ctx, max(q_lens),
                          max(a + b for a, b in zip(q_lens, ctx)), k.shape[0])
    ref = prefill_sdpa_loop(q, k, v, cu_k, meta, d ** -0.5)
    out = fn(q, k, v, cu_k, meta, d ** -0.5)
    assert (out.float() - ref.float()).abs().max() <= 2e-2, name


@needs_gpu
@pytest.mark.parametrize("prefix_len", [1, 15, 16, 17, 53])
def test_gpu_engine_prefix_vs_no_prefix(prefix_len, llama_dir, tmp_path):
    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig
    cfg = EngineConfig(ModelConfig(path=str(llama_dir), device="cuda", dtype="bfloat16", backend="cuda"),
                       CacheConfig(block_size=16, num_blocks=256))
    full = [(13 * i + 5) % 500 + 3 for i in range(prefix_len + 20)]
    with Engine(cfg) as engine:
        assert engine.info.backend == "cuda"
        expected = run_ids(engine, full)
        engine.add_template("p", token_ids=full[:prefix_len])
        assert run_ids(engine, full[prefix_len:], prefix="p") == expected
        engine.check_integrity()


@needs_gpu
def test_gpu_smollm2_float32_matches_transformers():
    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig
    from prefix_service.prepare_model import prepare_default_model
    model_dir = prepare_default_model(progress=False)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                             add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        ref = hf.generate(x, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(x))[0, len(ids):].tolist()
    cfg = EngineConfig(ModelConfig(path=str(model_dir), device="cuda", dtype="float32", backend="cuda"),
                       CacheConfig(block_size=16, num_blocks=256))
    with Engine(cfg) as engine:
        assert run_ids(engine, ids, max_tokens=32) == ref


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_snapshot_and_peer_restore_equal_a_prefill(dtype, llama_dir, tmp_path):
    """On the cuda backend a snapshot (its file) and a peer's bytes restore through host memory
    (SnapshotReader.read, Backend.write_blocks): the K/V bit for bit the prefill's, the same greedy ids."""
    from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig

    def config(snapshot_dir):
        return EngineConfig(ModelConfig(path=str(llama_dir), device="cuda", dtype=dtype, backend="cuda"),
                            CacheConfig(block_size=16, num_blocks=256, snapshot_dir=snapshot_dir))
    template = [(7 * i + 3) % 500 + 3 for i in range(45)]
    prompt = [(11 * i + 1) % 500 + 3 for i in range(9)]
    folder = str(tmp_path / "snapshots")

    def template_kv(engine):
        return engine._run(lambda core: core.backend.read_blocks(core.templates.get("doc").block_table))

    with Engine(config(folder)) as first:
        assert first.add_template("doc", token_ids=template).kv_source == "prefill"
        first.flush_snapshots()
        want, kv = run_ids(first, prompt, prefix="doc"), template_kv(first)
        with Engine(config(folder)) as restored:
            assert restored.add_template("doc", token_ids=template).kv_source == "snapshot"
            got = template_kv(restored)
            assert all(torch.equal(got[k], kv[k]) for k in kv)
            assert run_ids(restored, prompt, prefix="doc") == want
            restored.check_integrity()
        with Engine(config(None)) as joiner:
            joiner.peer_kv = lambda name, ids: first.export_template_kv(name)
            assert joiner.add_template("doc", token_ids=template).kv_source == "peer"
            assert run_ids(joiner, prompt, prefix="doc") == want
            joiner.check_integrity()
