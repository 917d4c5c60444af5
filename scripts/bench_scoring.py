"""Label scoring on the intent template: the log-probability of each of 20 intent labels after a
user message, engine to engine. The 939-token intent template is pinned (or, for vLLM, cached by
an untimed request); each timed call scores the labels after a 100-token message never sent
before.

| system | how the 20 scores are computed |
| --- | --- |
| `score` | one `Engine.score` call: the message computed once on the template's KV, every label continuing it in one step |
| `requests` | as separate requests submitted together (`Engine.generate`): per label and token k, the message and the label's first k tokens, one forced token (`logit_bias` +100) whose log-probability (`logprobs`, the model's, before the bias) is the score |
| `vllm-<dtype>` | vLLM's offline `LLM.generate` over the 20 prompts (template, message, label) with automatic prefix caching and `prompt_logprobs`, one new token each (make bench-peers) |

Each (system, round) runs in a fresh child process, the systems in turns; the table gives the
median milliseconds per call over rounds and calls, and how far each system's scores are from
`score`'s (max absolute difference of a label's total log-probability).

    python scripts/bench_scoring.py --json bench_out/scoring.json
    python scripts/bench_scoring.py --vllm-dtypes bfloat16,float32 --json bench_out/scoring_vllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LABELS = [" account", " billing", " cancel_order", " damaged_item", " feedback", " order_change", " order_status",
          " other", " product_question", " return_refund", " warranty_repair", " shipping", " delivery", " refund",
          " complaint", " payment", " discount", " subscription", " invoice", " technical_issue"]


def workload(rounds: int, calls: int) -> dict:
    """Token ids: the template's, each label's (alone, no special tokens), and per round `calls`
    messages of that round only."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from prefix_service.bench.workloads import Sizes, build_workload
    from prefix_service.prepare_model import prepare_default_model
    model = prepare_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(str(model))
    work = build_workload("intent", tok, Sizes())
    return {"model": str(model), "prefix_name": work.prefix_name, "prefix": list(work.prefix_ids),
            "labels": [tok.encode(label, add_special_tokens=False) for label in LABELS],
            "messages": {str(r): [list(work.request(r * 100_000 + i).prompt_ids) for i in range(calls + 1)]
                         for r in range(rounds)}}


def child(args: argparse.Namespace, ids: dict) -> dict:
    from prefix_service import (CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams,
                                SchedulerConfig, ScoreRequest)
    engine = Engine(EngineConfig(ModelConfig(path=ids["model"], dtype=args.dtype, device="cpu"),
                                 CacheConfig(block_size=16, kv_cache_memory=1 << 30),
                                 SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)))
    engine.add_template(ids["prefix_name"], token_ids=ids["prefix"])
    labels = ids["labels"]

    def by_score(message: list[int]) -> list[float]:
        out = engine.score(ScoreRequest(labels, prompt_token_ids=message, prefix_name=ids["prefix_name"]))
        return [c.logprob for c in out.candidates]

    def by_requests(message: list[int]) -> list[float]:
        reqs, owner = [], []
        for i, label in enumerate(labels):
            for k, token in enumerate(label):
                reqs.append(GenerateRequest(prompt_token_ids=message + label[:k], prefix_name=ids["prefix_name"],
                                            sampling=SamplingParams(max_tokens=1, logprobs=0,
                                                                    logit_bias=((token, 100.0),))))
                owner.append(i)
        totals = [0.0] * len(labels)
        for i, out in zip(owner, engine.generate(reqs)):
            totals[i] += out.logprobs[0].logprob
        return totals

    run = by_score if args.system == "score" else by_requests
    messages = ids["messages"][str(args.round)]
    run(messages[0])  # warm: the kernels' first calls
    times, scores = [], []
    for message in messages[1:]:
        t0 = time.perf_counter()
        scores.append(run(message))
        times.append((time.perf_counter() - t0) * 1e3)
    engine.shutdown()
    return {"ms": times, "scores": scores, "backend": engine.info.backend_description}


def vllm_child(args: argparse.Namespace, ids: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    llm = LLM(model=ids["model"], dtype=args.dtype, enable_prefix_caching=True, max_num_seqs=64,
              max_num_batched_tokens=4096, max_model_len=4096, seed=0, gpu_memory_utilization=0.3)
    prefix, labels = ids["prefix"], ids["labels"]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)

    def run(message: list[int]) -> list[float]:
        base = prefix + message
        outs = llm.generate([TokensPrompt(prompt_token_ids=base + label) for label in labels], params, use_tqdm=False)
        totals = []
        for out, label in zip(outs, labels):
            plp = out.prompt_logprobs  # per prompt position: {token id: Logprob} holding the prompt's token
            totals.append(sum(plp[len(base) + k][t].logprob for k, t in enumerate(label)))
        return totals

    messages = ids["messages"][str(args.round)]
    llm.generate([TokensPrompt(prompt_token_ids=prefix + messages[0])], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # the template's blocks cached
    run(messages[0])
    times, scores = [], []
    for message in messages[1:]:
        t0 = time.perf_counter()
        scores.append(run(message))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": times, "scores": scores, "backend": f"vllm {args.dtype}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", help="our engine's model.dtype")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per round (each a new message)")
    ap.add_argument("--vllm-dtypes", default="", help="vLLM systems, e.g. bfloat16,float32 (make bench-peers)")
    ap.add_argument("--json")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.system:
        ids = json.loads(Path(args.ids).read_text())
        sys.path.insert(0, str(REPO))
        result = vllm_child(args, ids) if args.system == "vllm" else child(args, ids)
        print("RESULT " + json.dumps(result), flush=True)
        return

    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, isa_label, machine_info
    ids_file = Path(tempfile.mkdtemp()) / "ids.json"
    ids_file.write_text(json.dumps(workload(args.rounds, args.calls)))
    systems = [("score", sys.executable, "score", args.dtype, None), ("requests", sys.executable, "requests",
                                                                       args.dtype, None)]
    if args.vllm_dtypes:
        from prefix_service.bench.systems.vllm import child_systems
        systems += child_systems(args.vllm_dtypes)
    info = machine_info()
    runs: dict[str, list[dict]] = {name: [] for name, *_ in systems}
    for r in range(args.rounds):
        for name, python, system, dtype, env in systems:
            cmd = [python, __file__, "--system", system, "--dtype", dtype, "--ids", str(ids_file), "--round", str(r)]
            runs[name].append(child_result(cmd, env, f"{name} (round {r})"))
            print(f"round {r} {name}: {runs[name][-1]['backend']}", file=sys.stderr)
    ref = [s for run in runs["score"] for s in run["scores"]]
    table = {}
    for name, rs in runs.items():
        scores = [s for run in rs for s in run["scores"]]
        table[name] = {"ms_per_call": statistics.median(t for run in rs for t in run["ms"]),
                       "max_score_diff": max(abs(a - b) for x, y in zip(scores, ref) for a, b in zip(x, y))}
    base = table["score"]["ms_per_call"]
    info["load_average_end"] = list(os.getloadavg())
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs; {len(LABELS)} labels, medians of "
          f"{args.rounds} rounds x {args.calls} calls")
    print("| system | ms per call | x score's time | max |score - score's| |")
    print("| --- | --- | --- | --- |")
    for name, row in table.items():
        print(f"| {name} | {row['ms_per_call']:.1f} | {row['ms_per_call'] / base:.2f} | {row['max_score_diff']:.4f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "labels": LABELS,
                                               "medians": table, "runs": runs, "date": time.strftime("%Y-%m-%d")},
                                              indent=2))


if __name__ == "__main__":
    main()
