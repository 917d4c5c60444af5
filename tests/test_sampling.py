"""Sampling and stop conditions: seeds, top-k/top-p, max_tokens, EOS, stop ids and stop strings."""

import time

from helpers import greedy, run_ids
from prefix_service import FinishReason, GenerateRequest, SamplingParams

PROMPT = [9, 40, 77, 120, 301, 17]


def sampled(seed=None, **kw):
    return SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_output_whatever_else_is_in_the_batch(make_engine):
    engine = make_engine()
    alone = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(1234))])[0].token_ids
    others = [GenerateRequest(prompt_token_ids=[5 + k] * (3 + k), sampling=sampled(k)) for k in range(5)]
    batch = engine.generate(others[:2] + [GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(1234))]
                            + others[2:])
    assert batch[2].token_ids == alone
    different = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(4321))])[0].token_ids
    assert different != alone  # 20 draws at temperature 1 over 512 tokens


def test_every_bit_of_a_seed_counts(make_engine):
    """Seeds that differ only above their low 32 bits draw differently (a generator seeded from 32
    bits drew the same tokens for 7, 7 + 2^32 and 7 + 2^63)."""
    engine = make_engine()
    outs = [engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(seed))])[0].token_ids
            for seed in (7, 7 + 2**32, 7 + 2**63, 7)]
    assert outs[0] == outs[3]
    assert len({tuple(o) for o in outs[:3]}) == 3


def test_seeded_output_survives_preemption(make_engine):
    """A preempted request recomputes its KV but keeps its generator: same draws."""
    calm = make_engine(num_blocks=256)
    ref = calm.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(7))])[0].token_ids
    tight = make_engine(num_blocks=14, block_size=4)
    reqs = [GenerateRequest(prompt_token_ids=PROMPT, sampling=sampled(7))] + [
        GenerateRequest(prompt_token_ids=[5 + k] * 6, sampling=sampled(k)) for k in range(4)]
    outs = tight.generate(reqs)
    assert tight.kv_stats()["preemptions"] > 0
    assert outs[0].token_ids == ref


def test_top_k_1_and_tiny_top_p_are_greedy(make_engine):
    engine = make_engine()
    expected = run_ids(engine, PROMPT, max_tokens=20)
    for params in (sampled(3, top_k=1), sampled(3, top_p=1e-6)):
        assert engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=params)])[0].token_ids == expected


def test_a_temperature_too_small_for_float32_is_greedy_and_fails_nothing_beside_it(make_engine):
    """Below 1e-5 a temperature is greedy (vLLM's bound): 1e-46 rounds to 0 in float32 and 1e-40
    overflows the logits over it, which failed the step, and with it every request in flight, or drew
    garbage under top-k/top-p. A request beside them in the batch is untouched."""
    engine = make_engine()
    expected = run_ids(engine, PROMPT, max_tokens=12)
    other = GenerateRequest(prompt_token_ids=[5, 6, 7, 8],
                            sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True))
    other_alone = engine.generate([other])[0].token_ids
    for temperature in (1e-46, 1e-40, 1e-30, 9e-6):
        for extra in ({}, {"top_p": 0.5}, {"top_k": 5}):
            tiny = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True, **extra)
            outs = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=tiny), other])
            assert outs[0].token_ids == expected, (temperature, extra)
            assert outs[1].token_ids == other_alone, (temperature, extra)


def test_top_k_restricts_to_k_most_likely(make_engine):
    from helpers import engine_last_logits
    engine = make_engine()
    logits = engine_last_logits(engine, PROMPT)
    top3 = set(logits.topk(3).indices.tolist())
    firsts = {engine.generate([GenerateRequest(prompt_token_ids=PROMPT,
                                               sampling=SamplingParams(max_tokens=1, temperature=5.0, top_k=3,
                                                                       seed=s))])[0].token_ids[0]
              for s in range(30)}
    assert firsts <= top3 and len(firsts) > 1


def test_max_tokens_is_length(make_engine):
    engine = make_engine()
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(7))])[0]
    assert (len(out.token_ids), out.completion_tokens, out.finish_reason) == (7, 7, FinishReason.LENGTH)


def test_stop_token_ids_and_eos(make_engine):
    engine = make_engine()
    expected = run_ids(engine, PROMPT, max_tokens=20)
    stop_at = next(i for i in range(3, 20) if expected[i] not in expected[:i])
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT,
                                           sampling=greedy(20, stop_token_ids=(expected[stop_at],)))])[0]
    assert out.token_ids == expected[:stop_at + 1] and out.finish_reason == FinishReason.STOP
    # the same token as the model's EOS: stops unless ignore_eos
    engine._run(lambda core: core.eos_token_ids.add(expected[stop_at]))
    eos = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=20))])[0]
    assert eos.token_ids == expected[:stop_at + 1] and eos.finish_reason == FinishReason.STOP
    assert run_ids(engine, PROMPT, max_tokens=20) == expected  # ignore_eos=True runs on


def test_stop_string_cuts_text(make_engine):
    engine = make_engine()
    full = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(30))])[0].text
    assert len(full) > 12
    stop = full[8:11]
    cut = full.index(stop)
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(30, stop=(stop, "never-seen")))])[0]
    assert out.text == full[:cut] and out.finish_reason == FinishReason.STOP


def test_the_text_is_whole_when_a_stop_string_never_comes(make_engine):
    """Text held back while it might begin a stop string is given out when the request ends
    another way (length here): the output's text is the text without the stop strings."""
    engine = make_engine()
    full = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(20))])[0]
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT,
                                           sampling=greedy(20, stop=("never-seen-stop-string",)))])[0]
    assert out.finish_reason == FinishReason.LENGTH and out.token_ids == full.token_ids
    assert out.text == full.text and len(full.text) > 5


def test_generation_ends_at_the_models_context(make_engine):
    engine = make_engine(max_model_len=24)
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(ignore_eos=True))])[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert out.prompt_tokens + out.completion_tokens == 24


def test_ttft_counts_the_wait_for_the_step_the_engine_is_running(make_engine):
    """A request handed to the engine while it runs a step waits for that step before the core takes
    it (under load, a long prefill): its ttft_ms counts from the hand-over, so it is the time the
    caller saw to its first token, not that less the wait."""
    import threading
    engine = make_engine()
    backend = engine._core.backend
    execute = backend.execute
    running = threading.Event()

    def slow(step):
        running.set()
        time.sleep(0.3)
        return execute(step)
    backend.execute = slow
    first: dict[str, float] = {}
    done = {name: threading.Event() for name in ("a", "b")}
    finished: dict[str, object] = {}

    def sink(name):
        def put(out):
            if out.token_ids and name not in first:
                first[name] = time.perf_counter()
            if out.finished:
                finished[name] = out
                done[name].set()
        return put
    engine.submit(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(4)), sink("a"))
    assert running.wait(30)  # a's first step runs now
    handed = time.perf_counter()
    engine.submit(GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(2)), sink("b"))
    assert done["a"].wait(60) and done["b"].wait(60)
    seen_ms = (first["b"] - handed) * 1000
    ttft = finished["b"].ttft_ms
    assert seen_ms > 400  # the rest of a's step, then b's own
    assert ttft is not None and seen_ms - 100 < ttft <= seen_ms, (ttft, seen_ms)


def test_ttft_is_the_first_tokens_time_not_the_last(make_engine):
    """ttft_ms is when the first token came: with steps of 50 ms and 16 tokens, well under the
    request's whole time (it was the last token's time once)."""
    engine = make_engine()
    backend = engine._core.backend
    execute = backend.execute
    backend.execute = lambda step: time.sleep(0.05) or execute(step)
    start = time.perf_counter()
    out = engine.generate([GenerateRequest(prompt_token_ids=PROMPT, sampling=greedy(16))])[0]
    total_ms = (time.perf_counter() - start) * 1000
    assert out.completion_tokens == 16 and total_ms > 16 * 50
    assert out.ttft_ms is not None and out.ttft_ms < total_ms / 3, (out.ttft_ms, total_ms)
