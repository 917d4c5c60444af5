"""Test helpers that drive the engine and Hugging Face transformers on the same token ids."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import torch

from prefix_service import GenerateRequest, SamplingParams


def counting(engine) -> list[list[tuple[str, int, int, bool]]]:
    """Each step's rows as (request id, new tokens, tokens already computed, decode), appended as the
    engine runs them."""
    steps: list[list[tuple[str, int, int, bool]]] = []
    backend = engine._core.backend
    execute = backend.execute
    backend.execute = lambda step: steps.append(
        [(r.request_id, r.num_new_tokens, r.num_computed, r.is_decode) for r in step.rows]) or execute(step)
    return steps


def streamed(engine, request: GenerateRequest, timeout_s: float = 60) -> list:
    """The outputs a request's sink gets (Engine.submit), in order, the last the finished one."""
    import threading
    got, done = [], threading.Event()

    def sink(out):
        got.append(out)
        if out.finished:
            done.set()
    engine.submit(request, sink)
    assert done.wait(timeout_s)
    return got


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def run_ids(engine, ids, prefix=None, max_tokens=32, **kw) -> list[int]:
    req = GenerateRequest(prompt_token_ids=list(ids), prefix_name=prefix, sampling=greedy(max_tokens, **kw))
    return engine.generate([req])[0].token_ids


def pinned_handle(engine, name: str):
    """The engine's live TemplateHandle of a template (block table, counters), white-box: get_template
    hands out a TemplateView without them."""
    return engine._run(lambda core: core.templates.get(name))


def engine_last_logits(engine, ids: list[int], prefix: str | None = None) -> torch.Tensor:
    """Last-position logits [vocab] through the engine's own scheduler and backend."""
    def probe(core):
        core.add_request("logits-probe", list(ids), prefix, SamplingParams(max_tokens=1), lambda out: None)
        try:
            logits = None
            while logits is None:
                out = core.scheduler.schedule()
                logits = core.backend.execute(out.step)
                core.scheduler.postprocess(out, [], [])
            return logits[0].clone()
        finally:
            core.abort("logits-probe")
    return engine._run(probe)


def hf_greedy(model_dir, ids: list[int], max_new_tokens: int, dtype=torch.float32) -> tuple[list[int], torch.Tensor]:
    """HF generate (greedy, no EOS stop) -> (new token ids, last prompt position logits)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = hf(x).logits[0, -1].float()
        out = hf.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist(), logits


def model_copy(src, dst, tensors=None, config=None):
    """A copy of the model directory with each safetensors file's tensors passed through `tensors` and
    its config.json through `config` (each a function of the dict, returning the new one; None: as is)."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    if tensors is not None:
        for f in sorted(dst.glob("*.safetensors")):
            save_file(tensors(load_file(str(f))), str(f), metadata={"format": "pt"})
    return dst


def dequantized_checkpoint(src, dst):
    """A copy of the model directory whose decoder linears hold q diag(scale) in float32
    (model/quantize.py's dequantized_checkpoint_tensors): what an engine with model.quantization int8
    runs, as transformers reads it."""
    from prefix_service.model.quantize import dequantized_checkpoint_tensors
    return model_copy(src, dst, dequantized_checkpoint_tensors)


def bf16_checkpoint(src, dst):
    """A copy of the model directory with its floating tensors saved in bfloat16 (as SmolLM2's are)."""
    return model_copy(src, dst, lambda tensors: {
        name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()})


def cpu_simd() -> str:
    """The vector instructions the CPU reports that the native CPU kernels can use: "avx512"
    (AVX-512 Foundation), "avx2" (AVX2 with FMA) or "" (neither), as the library is built for them."""
    from prefix_service.cpuinfo import kernel_flags
    flags = kernel_flags()
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else ""


PREFIX = [(3 * i + 7) % 500 + 3 for i in range(22)]  # 5 full blocks of 4 + 2
PROMPTS = [[(5 * i + k) % 500 + 3 for i in range(2 + 3 * k)] for k in range(4)]


def mixed_generate(engine, max_tokens: int = 24) -> list[list[int]]:
    """Plain prompts (batched prefill + decode), then the same prompts on a pinned template
    (prefills over its blocks, decodes that share them): every sequence's greedy ids."""
    plain = engine.generate([GenerateRequest(prompt_token_ids=p, sampling=greedy(max_tokens)) for p in PROMPTS])
    engine.add_template("tpl", token_ids=PREFIX)
    on_tpl = engine.generate([GenerateRequest(prompt_token_ids=p, prefix_name="tpl", sampling=greedy(max_tokens))
                              for p in PROMPTS])
    assert engine.remove_template("tpl")
    return [o.token_ids for o in plain + on_tpl]


def generate_together(engine, requests) -> list[list[int]]:
    """Greedy ids of `requests` (GenerateRequest with prompt_token_ids), all entering the engine in
    one command, before its next step: the schedule then does not depend on thread timing."""
    import threading
    done = [threading.Event() for _ in requests]
    ids: list[list[int]] = [[] for _ in requests]

    def sink_for(i):
        def sink(out):
            ids[i].extend(out.token_ids)
            if out.finished:
                assert out.error is None, out.error
                done[i].set()
        return sink

    def add_all(core):
        for i, req in enumerate(requests):
            core.add_request(f"together-{i}", list(req.prompt_token_ids), req.prefix_name, req.sampling, sink_for(i))
    engine._run(add_all)
    for event in done:
        event.wait()
    return ids


def load_script(name: str, monkeypatch=None) -> types.ModuleType:
    """scripts/<name>.py imported as a module, for a test to call its functions (main) in this process.
    With monkeypatch it is also in sys.modules for the test's length (a script whose dataclasses
    look their module up while it loads)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


TOKENIZER_SAMPLES = ("hello world", " the order", 'Message: "I was charged twice"\nIntent:', "ünïcödé 漢字 🎉 ",
                     "  two  spaces\tand a tab", "")


def assert_same_tokenizer(got, want) -> None:
    """Two tokenizers of one model act alike: class, special tokens, vocabulary, ids with and without
    special tokens, decoding, and the chat template's rendering."""
    assert type(got) is type(want)
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id, list(got.all_special_ids), len(got)) == \
        (want.bos_token_id, want.eos_token_id, want.pad_token_id, list(want.all_special_ids), len(want))
    for text in TOKENIZER_SAMPLES:
        for special in (True, False):
            ids = want.encode(text, add_special_tokens=special)
            assert got.encode(text, add_special_tokens=special) == ids, (text, special)
            assert got.decode(ids) == want.decode(ids)
    assert got.chat_template == want.chat_template
    if want.chat_template:
        messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
        for prompt in (True, False):
            assert got.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                want.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


REPO = Path(__file__).resolve().parent.parent


def head_commit_or_skip() -> str:
    """The commit HEAD names in this repository; the test is skipped where there is no git or checkout."""
    import pytest
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        pytest.skip("no git here")
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    return head.stdout.strip()


def native_sources_unchanged() -> bool:
    """Whether the working tree's native sources are HEAD's (a kernel A/B against HEAD then agrees to the bit)."""
    return subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--",
                           "prefix_service/backends/cpu/csrc"]).returncode == 0
