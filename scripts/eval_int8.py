"""What int8 weights (model.quantization: int8) cost a model's answers. The reference is transformers
in float32 on the checkpoint: its greedy continuation of each of a fixed set of chat prompts. Each
system is then measured against it:

- `top1`: teacher-forced next-token agreement: at every position of the reference's continuation,
  does the system's most likely next token equal the reference's? (transformers: one forward per
  prompt; our engine: one single-token greedy request per position, submitted together);
- `same`: the share of prompts whose greedy continuation equals the reference's, and `prefix`: the
  mean length the two continuations share.

Systems: transformers on the checkpoint in bf16; transformers on the dequantized weights (each
decoder linear as q diag(scale), model/quantize.py) in float32 and bf16; our engine (cpu backend
where it runs, else torch) in bf16, in bf16 with int8 weights, and in float32 with int8 weights (which
must match transformers on the dequantized weights in float32). The JSON records the machine.

    python scripts/eval_int8.py --json bench_out/int8_eval.json
    python scripts/eval_int8.py --model DIR --prompts 4 --max-tokens 16
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefix_service.bench.main import git_commit, machine_info  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea.",
           "How many legs does a spider have?", "Explain photosynthesis briefly.", "Give me a haiku about autumn.",
           "What is 17 times 3?", "List two uses of copper.", "Who wrote Hamlet?", "Describe a cat in one sentence.",
           "Translate 'good morning' to Spanish.", "What causes rain?"]


def prompt_ids(tok, n: int) -> list[list[int]]:
    """The first n prompts as the chat template renders them (plain text where the tokenizer has none)."""
    out = []
    for text in PROMPTS[:n]:
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def hf_model(model_dir: str, dtype: torch.dtype, int8: bool):
    from transformers import AutoModelForCausalLM

    from prefix_service.model.quantize import dequantized_checkpoint_tensors
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if int8:
        with torch.no_grad():
            model.load_state_dict(dequantized_checkpoint_tensors(model.state_dict()))
    return model.to(dtype)


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_next_tokens(model, ids: list[int], cont: list[int]) -> list[int]:
    """The model's most likely token after ids + cont[:j], for each j."""
    logits = model(torch.tensor([ids + cont])).logits[0, len(ids) - 1:len(ids) + len(cont) - 1]
    return logits.argmax(-1).tolist()


def engine_answers(model_dir: str, dtype: str, quantization: str, prompts: list[list[int]],
                   refs: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]], str]:
    """Our engine's greedy continuations and, on the reference's, its next tokens; its backend."""
    from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
    engine = Engine(EngineConfig(ModelConfig(path=model_dir, dtype=dtype, device="cpu", quantization=quantization),
                                 CacheConfig(block_size=16, kv_cache_memory=1 << 28)))
    try:
        greedy = SamplingParams(max_tokens=n, ignore_eos=True)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        conts = [o.token_ids for o in engine.generate([GenerateRequest(prompt_token_ids=ids, sampling=greedy)
                                                        for ids in prompts])]
        forced = [GenerateRequest(prompt_token_ids=ids + ref[:j], sampling=one)
                  for ids, ref in zip(prompts, refs) for j in range(len(ref))]
        flat = [o.token_ids[0] for o in engine.generate(forced)]
        nexts, at = [], 0
        for ref in refs:
            nexts.append(flat[at:at + len(ref)])
            at += len(ref)
        return [list(c) for c in conts], nexts, engine.info.backend_description
    finally:
        engine.shutdown()


def score(refs: list[list[int]], conts: list[list[int]], nexts: list[list[int]]) -> dict:
    agree = sum(a == b for ref, nx in zip(refs, nexts) for a, b in zip(ref, nx))
    total = sum(len(r) for r in refs)
    common = [next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), len(r)) for c, r in zip(conts, refs)]
    return {"top1": agree / total, "same": sum(c == r for c, r in zip(conts, refs)) / len(refs),
            "prefix": sum(common) / len(common), "positions": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (default: the default model, prepare-model)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--max-tokens", type=int, default=30, help="the reference's greedy tokens per prompt")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS) or args.max_tokens < 1:
        sys.exit(f"--prompts: 1 to {len(PROMPTS)}; --max-tokens: at least 1")
    from transformers import AutoTokenizer

    from prefix_service.prepare_model import prepare_default_model
    model_dir = str(args.model or prepare_default_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(tok, args.prompts)
    n = args.max_tokens
    reference = hf_model(model_dir, torch.float32, int8=False)
    refs = [hf_greedy(reference, ids, n) for ids in prompts]
    results: dict[str, dict] = {}
    for name, dtype, int8 in (("transformers float32 (reference)", torch.float32, False),
                              ("transformers bf16", torch.bfloat16, False),
                              ("transformers float32, int8 weights", torch.float32, True),
                              ("transformers bf16, int8 weights", torch.bfloat16, True)):
        model = reference if name.endswith("(reference)") else hf_model(model_dir, dtype, int8)
        conts = [hf_greedy(model, ids, n) for ids in prompts]
        nexts = [hf_next_tokens(model, ids, ref) for ids, ref in zip(prompts, refs)]
        results[name] = score(refs, conts, nexts)
        print(f"{name}: {results[name]}", flush=True)
    for name, dtype, quantization in (("ours bf16", "bfloat16", "none"), ("ours bf16, int8 weights", "bfloat16", "int8"),
                                      ("ours float32, int8 weights", "float32", "int8")):
        conts, nexts, backend = engine_answers(model_dir, dtype, quantization, prompts, refs, n)
        results[name] = {**score(refs, conts, nexts), "backend": backend}
        print(f"{name}: {results[name]}", flush=True)
    print(f"\n{len(prompts)} prompts, {n} greedy tokens each; against transformers in float32 on the checkpoint")
    print("| system | next token agrees (teacher-forced) | continuation equal | mean common prefix |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {100 * r['top1']:.1f}% of {r['positions']} | {100 * r['same']:.0f}% | {r['prefix']:.1f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": machine_info(), "git_commit": git_commit(REPO), "model": model_dir,
            "command": " ".join(sys.argv), "prompts": len(prompts), "max_tokens": n, "results": results}, indent=1))


if __name__ == "__main__":
    main()
