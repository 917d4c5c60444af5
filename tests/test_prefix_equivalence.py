"""Prefix vs no prefix on the same token ids: identical greedy outputs, across the block-boundary
cases, an empty user prompt, mixed batches, forced chunked prefill and forced preemption."""
import pytest

from helpers import greedy, run_ids
from prefix_service import GenerateRequest

BLOCK = 4


def ids_of(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * salt + 5) % 500 + 3 for i in range(n)]


@pytest.mark.parametrize("prefix_len", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_prefix_lengths_around_block_boundaries(prefix_len, make_engine):
    engine = make_engine(block_size=BLOCK)
    full = ids_of(prefix_len + 9)
    expected = run_ids(engine, full)
    engine.add_template("p", token_ids=full[:prefix_len])
    assert run_ids(engine, full[prefix_len:], prefix="p") == expected
    info = engine.list_templates()[0]
    assert (info.num_tokens, info.num_blocks) == (prefix_len, -(-prefix_len // BLOCK))


@pytest.mark.parametrize("prefix_len", [1, BLOCK, BLOCK + 1])
def test_empty_user_prompt(prefix_len, make_engine):
    engine = make_engine(block_size=BLOCK)
    full = ids_of(prefix_len)
    expected = run_ids(engine, full)
    engine.add_template("p", token_ids=full)
    out = engine.generate([GenerateRequest(prompt_token_ids=[], prefix_name="p", sampling=greedy(32))])[0]
    assert out.token_ids == expected
    assert out.cached_tokens == prefix_len - 1  # the last prefix token is recomputed for its logits


def _mixed_requests(prefixes):
    reqs, full = [], []
    for k in range(9):
        name = [None, "a", "b", "c"][k % 4]
        user = ids_of(3 + 2 * k, salt=k + 1)
        pre = list(prefixes[name]) if name else []
        reqs.append(GenerateRequest(prompt_token_ids=user, prefix_name=name, sampling=greedy(24)))
        full.append(pre + user)
    return reqs, full


@pytest.mark.parametrize("budget,num_blocks", [(2048, 256), (3, 256), (2048, 40)],
                         ids=["batched", "chunked-prefill", "preemption"])
def test_mixed_batch_of_prefixes_and_no_prefix(budget, num_blocks, make_engine):
    prefixes = {"a": ids_of(9, 100), "b": ids_of(4, 200), "c": ids_of(14, 300)}
    reference_engine = make_engine(block_size=BLOCK)
    reqs, full = _mixed_requests(prefixes)
    expected = [run_ids(reference_engine, f, max_tokens=24) for f in full]

    engine = make_engine(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=budget,
                         prefix_budget_blocks=10)
    for name, toks in prefixes.items():
        engine.add_template(name, token_ids=toks)
    steps = []
    backend = engine._core.backend
    execute = backend.execute
    backend.execute = lambda step: steps.append(step.num_tokens) or execute(step)
    outs = engine.generate(reqs)
    assert [o.token_ids for o in outs] == expected
    stats = engine.kv_stats()
    if budget == 3:
        assert max(steps) <= 3 and len(steps) > sum(len(f) for f in full) // 3  # prompts really were chunked
    if num_blocks == 40:
        assert stats["preemptions"] > 0, stats


def test_prefix_disabled_gives_same_outputs(make_engine):
    """enable_prefix: false prefills the template's tokens per request: same output, no reuse; the
    request still counts as one served on the template, and holds it no longer than it runs."""
    engine = make_engine(block_size=BLOCK, enable_prefix=False)
    full = ids_of(21)
    engine.add_template("p", token_ids=full[:13])
    out = engine.generate([GenerateRequest(prompt_token_ids=full[13:], prefix_name="p", sampling=greedy(16))])[0]
    assert out.cached_tokens == 0
    assert [(t.requests_served, t.active_requests) for t in engine.list_templates()] == [(1, 0)]
    assert out.token_ids == run_ids(engine, full, max_tokens=16)


def test_text_prompt_on_prefix_equals_concatenated_ids(make_engine):
    """request ids = prefix ids + prompt ids (prompt tokenized without special tokens)."""
    engine = make_engine(block_size=BLOCK)
    text, prompt = "system: classify the user intent label.", " user: refund my order"
    engine.add_template("p", text)
    tok = engine.tokenizer
    ids = tok.encode(text, add_special_tokens=True) + tok.encode(prompt, add_special_tokens=False)
    out = engine.generate([GenerateRequest(prompt=prompt, prefix_name="p", sampling=greedy(16))])[0]
    assert out.prompt_tokens == len(ids)
    assert out.token_ids == run_ids(engine, ids, max_tokens=16)
