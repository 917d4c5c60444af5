"""Our engine against Hugging Face transformers on the same token ids: greedy ids identical over
48 new tokens, last-position logits within float32 tolerance (max abs diff <= 1e-4), on the torch
backend (the oracle) and on the one `auto` picks here; a bf16 checkpoint in float32 with its weights held
in bf16 for the cpu backend's linear kernel, bit for bit the float32-held weights' logits."""
import pytest
import torch

from helpers import bf16_checkpoint, engine_last_logits, hf_greedy, run_ids

LOGITS_ATOL = 1e-4  # float32 on CPU; observed differences are ~1e-6


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_and_logits_match_transformers(arch, backend, model_dirs, make_engine):
    ids = [(7 * i + 3) % 500 + 3 for i in range(37)]
    ref_ids, ref_logits = hf_greedy(model_dirs[arch], ids, 48)
    engine = make_engine(model_dirs[arch], block_size=8, backend=backend)
    assert run_ids(engine, ids, max_tokens=48) == ref_ids
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()


def test_batched_requests_match_transformers_one_by_one(model_dirs, make_engine):
    """Several different prompts in one batch each equal their solo HF reference."""
    prompts = [[(11 * i + k) % 500 + 3 for i in range(n)] for k, n in ((1, 5), (2, 19), (3, 33), (4, 2))]
    refs = [hf_greedy(model_dirs["qwen2"], p, 32)[0] for p in prompts]
    engine = make_engine(model_dirs["qwen2"], block_size=4)
    from prefix_service import GenerateRequest
    from helpers import greedy
    outs = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy(32)) for p in prompts])
    assert [o.token_ids for o in outs] == refs


def test_bfloat16_close_to_transformers(model_dirs, make_engine):
    """bf16 weights and cache: logits within a bf16 tolerance of HF run in bf16."""
    ids = [(5 * i + 1) % 500 + 3 for i in range(20)]
    _, ref_logits = hf_greedy(model_dirs["llama"], ids, 1, dtype=torch.bfloat16)
    engine = make_engine(model_dirs["llama"], dtype="bfloat16")
    logits = engine_last_logits(engine, ids)
    assert (logits - ref_logits).abs().max() <= 0.05 * ref_logits.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a q/k/v bias
def test_a_bf16_checkpoint_in_float32_matches_transformers_from_bf16_held_weights(arch, model_dirs, make_engine,
                                                                                 monkeypatch, tmp_path):
    """Served in float32, a bf16 checkpoint's weights are bf16 values: the cpu backend holds every
    linear's and the embedding table in bf16 (half the bytes), and gives the same logits, bit for bit, as with them held
    in float32 (PREFIX_SERVICE_F32_PANELS=float32), on and off a template; both match transformers in float32."""
    model = bf16_checkpoint(model_dirs[arch], tmp_path / arch)
    ids = [(7 * i + 3) % 500 + 3 for i in range(37)]
    ref_ids, ref_logits = hf_greedy(model, ids, 48)
    held = make_engine(model, block_size=8)
    backend = held._core.backend
    if backend.name != "cpu":
        pytest.skip(f"the cpu backend does not serve here ({backend.name} does)")
    layers = backend.stack.num_layers
    assert backend.stack.bf16_panel_linears == 4 * layers and backend.head.bf16_panels
    assert backend.embed.dtype == torch.bfloat16  # the embedding table too, its rows widened as looked up
    assert "held in bf16" in backend.describe()
    monkeypatch.setenv("PREFIX_SERVICE_F32_PANELS", "float32")
    plain = make_engine(model, block_size=8)
    assert plain._core.backend.stack.bf16_panel_linears == 0 and not plain._core.backend.head.bf16_panels
    assert plain._core.backend.embed.dtype == torch.float32
    assert run_ids(held, ids, max_tokens=48) == ref_ids == run_ids(plain, ids, max_tokens=48)
    logits = engine_last_logits(held, ids)
    assert torch.equal(logits, engine_last_logits(plain, ids))
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()
    for engine in (held, plain):
        engine.add_template("doc", token_ids=ids[:24])
    on_template = engine_last_logits(held, ids[24:], prefix="doc")
    assert torch.equal(on_template, engine_last_logits(plain, ids[24:], prefix="doc"))
    assert torch.allclose(on_template, ref_logits, atol=LOGITS_ATOL, rtol=0)


def _rope_in_parameters(path):
    """The directory's config.json with its rope settings only under rope_parameters, as transformers
    5 writes them (no top-level rope_theta or rope_scaling)."""
    import json
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    rope = dict(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.update(cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", "default")
    cfg["rope_parameters"] = rope
    cfg.pop("rope_theta", None)
    cfg.pop("rope_scaling", None)
    cfg_file.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}},
], ids=["theta", "linear", "llama3"])
def test_rope_settings_under_rope_parameters_match_transformers(rope, tokenizer_dir, tmp_path, make_engine):
    """A config whose rope base or scaling is given only under rope_parameters (transformers 5's
    format): the engine's positions rotate as transformers' do, so its greedy ids and logits match."""
    from prefix_service import synthetic
    model = _rope_in_parameters(synthetic.build_model(tmp_path / "m", "llama", tokenizer_dir, seed=6, **rope))
    ids = [(7 * i + 3) % 500 + 3 for i in range(37)]
    ref_ids, ref_logits = hf_greedy(model, ids, 24)
    engine = make_engine(model, block_size=8, backend="torch")
    assert run_ids(engine, ids, max_tokens=24) == ref_ids
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_mistral_sliding_window_caps_the_context_and_matches_transformers_inside_it(backend, tokenizer_dir,
                                                                                     tmp_path, make_engine):
    """Mistral's config names a sliding_window with no use_sliding_window key: the window applies. The
    engine attends fully inside it, so its context is capped to the window (a longer prompt is refused,
    not served with attention the model was not trained for), and inside it matches transformers."""
    from prefix_service import PromptTooLong, synthetic
    model = synthetic.build_model(tmp_path / "m", "mistral", tokenizer_dir, seed=7, sliding_window=16)
    engine = make_engine(model, block_size=8, backend=backend)
    assert engine.info.max_model_len == 16
    with pytest.raises(PromptTooLong, match="the model's context is 16 tokens"):
        run_ids(engine, [(7 * i + 3) % 500 + 3 for i in range(37)], max_tokens=4)
    ids = [(7 * i + 3) % 500 + 3 for i in range(11)]
    ref_ids, ref_logits = hf_greedy(model, ids, 5)
    assert run_ids(engine, ids, max_tokens=5) == ref_ids
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()
