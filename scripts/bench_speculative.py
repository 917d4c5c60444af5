"""What speculative decoding by prompt lookup (scheduler.speculative_tokens) gives: output tok/s of
requests submitted together, with drafts of --tokens each and without, on the same engine config
and the same new requests, engine to engine.

Tasks, each on a pinned template (the benchmark's own, configs/prompts/):

| task | template | request | output (greedy) |
| --- | --- | --- | --- |
| `doc_qa` | the departures board (doc_qa workload) | a question about one flight | EOS ends it, <= --max-tokens |
| `quote` | the departures board | "copy the row of the flight to X as written" | EOS ends it, <= --max-tokens |
| `extract` | the departures board | "give the row of the flight to X as a JSON record" (doc_records workload) | a JSON schema of 6 of the columns (structured output), <= 96 |
| `intent` | the intent classifier (intent workload) | a 100-token customer message | free text, EOS ignored, 30 tokens |

`doc_qa` answers partly from the table, `quote` copies it, `extract` copies its fields into a
record whose keys and punctuation the schema forces (jump-forward), `intent` writes text the
template seldom holds (its drafts are mostly rejected: what they cost). Each (task, concurrency) batch is that many
requests submitted together (Engine.generate), each never sent before. Every engine of ours is
built before the first round; in each round each engine runs every batch, the engines in turns (the
order rotating by round). Per batch: the output tokens over the wall time, the draft tokens the
steps checked and those kept (kv_stats), and each request's tokens, which must be the same for
every engine of ours (greedy; `same_tokens` in the JSON, per task).

With --vllm-tokens, vLLM (make bench-peers) runs the same batches in each round after ours, one
child process per setting and round: its offline `LLM.generate` over the same token ids in
--vllm-dtype, automatic prefix caching on (the templates cached by an untimed request), and for a
setting K > 0 its n-gram speculative decoding (`speculative_config` method "ngram", K tokens, the
same lookup lengths as ours); 0 is without. Its tokens are compared with ours
(`same_tokens_as_ours`: the share of requests; its bf16 arithmetic is not ours).

    python scripts/bench_speculative.py --json bench_out/speculative.json
    python scripts/bench_speculative.py --tokens 0,8 --vllm-tokens 0,8 --json bench_out/speculative-vllm.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TASKS = ("doc_qa", "quote", "extract", "intent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "default.yaml"), help="service YAML (its engine part)")
    p.add_argument("--model", help="a model directory instead of the config's (default engine settings)")
    p.add_argument("--max-prefix-tokens", type=int, help="cut the templates to at most this many tokens")
    p.add_argument("--tokens", default="0,8", help="scheduler.speculative_tokens of each engine (0: none)")
    p.add_argument("--min-ngram", type=int, help="scheduler.speculative_min_ngram (default: the config's)")
    p.add_argument("--row-costs", default="", help="scheduler.speculative_row_cost of each drafting engine, e.g. "
                   "auto,0 (auto: measured; 0: every draft worth its rows); one engine per value and draft length "
                   "above 0, named ours-K@VALUE (default: the config's, ours-K)")
    p.add_argument("--max-running", type=int, default=8,
                   help="scheduler.speculative_max_running (8: drafts at every --concurrency below 9)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--concurrency", default="1,4,8", help="requests submitted together per batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="doc_qa and quote: most output tokens")
    p.add_argument("--vllm-tokens", default="", help="vLLM's n-gram speculative tokens per child (0: none; "
                   "empty: no vLLM)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--child-timeout-s", type=float, default=1800)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--vllm-child", help=argparse.SUPPRESS)  # the batches' file: run them in vLLM, print RESULT
    p.add_argument("--vllm-round", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace, tokens: int, row_cost: str | None = None):
    """The config's engine (or --model's with default settings) drafting `tokens`; row_cost: its
    speculative_row_cost ("auto": measured), None: the config's."""
    from prefix_service.config import CacheConfig, EngineConfig, ModelConfig, load_config
    ec = EngineConfig(ModelConfig(path=args.model), CacheConfig()) if args.model else load_config(args.config).engine
    lookup: dict = {"speculative_min_ngram": args.min_ngram} if args.min_ngram else {}
    if row_cost is not None:
        lookup["speculative_row_cost"] = None if row_cost == "auto" else float(row_cost)
    return dataclasses.replace(ec, scheduler=dataclasses.replace(
        ec.scheduler, speculative_tokens=tokens, speculative_max_running=args.max_running, **lookup))


def our_engines(args: argparse.Namespace) -> dict[str, tuple[int, str | None]]:
    """Our systems: name -> (draft tokens, row cost or None for the config's)."""
    costs = [c for c in args.row_costs.split(",") if c]
    out: dict[str, tuple[int, str | None]] = {}
    for k in (int(x) for x in args.tokens.split(",")):
        for cost in (costs if k and costs else [None]):
            out[f"ours-{k}" + (f"@{cost}" if cost is not None else "")] = (k, cost)
    return out


def tasks(tokenizer, names: list[str], max_tokens: int, max_prefix_tokens: int | None) -> dict:
    """name -> (template name, template ids, request index -> prompt ids, SamplingParams)."""
    from prefix_service import SamplingParams
    from prefix_service.bench import corpus
    from prefix_service.bench.workloads import Sizes, build_workload
    from prefix_service.sampling_params import StructuredOutput
    out = {}
    for name in names:
        work = build_workload({"intent": "intent", "extract": "doc_records"}.get(name, "doc_qa"), tokenizer,
                              Sizes(max_prefix_tokens=max_prefix_tokens))
        if name == "intent":
            params = SamplingParams(max_tokens=work.output_tokens, ignore_eos=True)
            make = (lambda w: lambda i: list(w.request(i).prompt_ids))(work)
        else:
            params = SamplingParams(max_tokens=max_tokens)
            dests = corpus.destinations(work.prefix_text)
            if name == "quote":
                make = (lambda w, d: lambda i: w.encode(
                    f"\nQ: Copy the table's row of the flight to {d[i % len(d)]}, exactly as written.\nA:", False))(
                        work, dests)
            else:
                make = (lambda w: lambda i: list(w.request(i).prompt_ids))(work)
            if name == "extract":
                params = SamplingParams(max_tokens=work.output_tokens,
                                        structured=StructuredOutput.from_dict(work.structured_output()))
        out[name] = (work.prefix_name, list(work.prefix_ids), make, params)
    return out


def vllm_child(args: argparse.Namespace) -> dict:
    """One vLLM setting, one round: the round's batches in the plan's order -> {key: batch result}."""
    from vllm import LLM, SamplingParams, TokensPrompt
    plan = json.loads(Path(args.vllm_child).read_text())
    k = int(args.vllm_tokens)
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": plan["max_ngram"],
             "prompt_lookup_min": plan["min_ngram"]}
    spec = {"speculative_config": ngram} if k else {}
    llm = LLM(model=plan["model"], dtype=args.vllm_dtype, enable_prefix_caching=True, max_num_seqs=64,
              max_num_batched_tokens=4096, max_model_len=4096, seed=0, gpu_memory_utilization=0.3, **spec)

    def params(p: dict) -> SamplingParams:
        structured = {}
        if p.get("json_schema"):  # compact JSON, as ours writes it
            from vllm.sampling_params import StructuredOutputsParams
            structured["structured_outputs"] = StructuredOutputsParams(json=p["json_schema"],
                                                                       disable_any_whitespace=True)
        return SamplingParams(max_tokens=p["max_tokens"], temperature=0, ignore_eos=p["ignore_eos"], **structured)

    for name, task in plan["tasks"].items():  # the templates cached, and the paths warmed, untimed
        llm.generate([TokensPrompt(prompt_token_ids=task["template_ids"] + w) for w in task["warm"]],
                     params(task["params"]), use_tqdm=False)
    out = {}
    for batch in plan["rounds"][args.vllm_round]:
        task = plan["tasks"][batch["task"]]
        prompts = [TokensPrompt(prompt_token_ids=task["template_ids"] + p) for p in batch["prompts"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params(task["params"]), use_tqdm=False)
        wall = time.perf_counter() - start
        ids = [list(r.outputs[0].token_ids) for r in results]
        tokens = sum(len(t) for t in ids)
        out[batch["key"]] = {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "token_ids": ids}
    return out


def run_batch(engine, template: str, prompts: list[list[int]], params) -> dict:
    from prefix_service import GenerateRequest
    before = engine.kv_stats()
    requests = [GenerateRequest(prompt_token_ids=p, prefix_name=template, sampling=params) for p in prompts]
    start = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - start
    after = engine.kv_stats()
    tokens = sum(len(r.token_ids) for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted_draft_tokens": after["accepted_draft_tokens"] - before["accepted_draft_tokens"],
            "token_ids": [r.token_ids for r in results]}


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vllm_child:
        print("RESULT " + json.dumps(vllm_child(args)), flush=True)
        return 0
    import tempfile

    from prefix_service import Engine
    from prefix_service.bench.main import child_result, git_commit, machine_info
    ours = our_engines(args)
    vllm_counts = [int(x) for x in args.vllm_tokens.split(",") if x]
    names = [t for t in args.tasks.split(",") if t]
    unknown = set(names) - set(TASKS)
    if unknown:
        raise SystemExit(f"unknown tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
    levels = [int(x) for x in args.concurrency.split(",")]
    vllm_python, vllm_env = None, None
    if vllm_counts:
        from prefix_service.bench.systems.vllm import server_env, vllm_python as find_vllm
        vllm_python, why = find_vllm()
        if vllm_python is None:
            raise SystemExit(why)
        vllm_env = server_env(vllm_python)
    engines = {system: Engine(engine_config(args, k, cost)) for system, (k, cost) in ours.items()}
    first = next(iter(engines.values()))
    work = tasks(first.tokenizer, names, args.max_tokens, args.max_prefix_tokens)
    sched = engine_config(args, 0).scheduler
    # every batch of every round, fixed before the first: each request's prompt never sent before
    plan_rounds, index = [], 0
    for rnd in range(args.rounds):
        batches = []
        for name, (_, _, make, _) in work.items():
            for c in levels:
                batches.append({"key": f"{name}/{c}", "task": name, "prompts": [make(index + i) for i in range(c)]})
                index += c
        plan_rounds.append(batches)
    warm = {name: [make(10_000 + i) for i in range(2)] for name, (_, _, make, _) in work.items()}
    plan = {"model": engine_config(args, 0).model.path, "rounds": plan_rounds,
            "max_ngram": sched.speculative_max_ngram, "min_ngram": sched.speculative_min_ngram,
            "tasks": {name: {"template_ids": ids, "warm": warm[name],
                             "params": {"max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos,
                                        "json_schema": params.structured.spec if params.structured else None}}
                      for name, (_, ids, _, params) in work.items()}}
    plan_dir = tempfile.TemporaryDirectory(prefix="bench-speculative-")
    plan_file = Path(plan_dir.name) / "plan.json"
    plan_file.write_text(json.dumps(plan))
    for engine in engines.values():
        for template, ids, _, _ in {w[0]: w for w in work.values()}.values():
            engine.add_template(template, token_ids=ids)
    for engine in engines.values():  # warm each engine's paths, untimed
        for name, (template, _, _, params) in work.items():
            run_batch(engine, template, warm[name], params)
    our_systems = list(ours)
    systems = our_systems + [f"vllm-{k}" for k in vllm_counts]
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for rnd, batches in enumerate(plan_rounds):
        order = our_systems[rnd % len(our_systems):] + our_systems[:rnd % len(our_systems)]
        for batch in batches:
            template, _, _, params = work[batch["task"]]
            for system in order:
                r = run_batch(engines[system], template, batch["prompts"], params)
                runs.setdefault(f"{batch['key']}/{system}", []).append(r)
                print(f"round {rnd + 1} {batch['key']:10s} {system:10s} {r['tok_s']:7.1f} tok/s "
                      f"kept {r['accepted_draft_tokens']}/{r['draft_tokens']}", flush=True)
        for k in vllm_counts:
            if f"vllm-{k}" in skipped:
                continue
            assert vllm_python is not None
            cmd = [vllm_python, __file__, "--vllm-child", str(plan_file), "--vllm-round", str(rnd),
                   "--vllm-tokens", str(k), "--vllm-dtype", args.vllm_dtype]
            try:
                got = child_result(cmd, vllm_env, f"vllm-{k} (round {rnd + 1})", timeout_s=args.child_timeout_s)
            except TimeoutError as e:
                skipped[f"vllm-{k}"] = str(e)
                continue
            for key, r in got.items():
                runs.setdefault(f"{key}/vllm-{k}", []).append(r)
                print(f"round {rnd + 1} {key:10s} vllm-{k:<2d} {r['tok_s']:7.1f} tok/s", flush=True)
    for engine in engines.values():
        engine.shutdown()
    plan_dir.cleanup()
    base_name = next(iter(ours))
    table = []
    same, same_vllm = {}, {}
    for name in work:
        def ids_of(system: str) -> list[list[int]]:
            return [ids for c in levels for r in runs.get(f"{name}/{c}/{system}", []) for ids in r["token_ids"]]
        base_ids = ids_of(base_name)
        same[name] = all(ids_of(system) == base_ids for system in ours)
        for k in vllm_counts:
            got = ids_of(f"vllm-{k}")
            if got:
                same_vllm[f"{name}/vllm-{k}"] = sum(a == b for a, b in zip(got, base_ids)) / len(got)
        for c in levels:
            base = median([r["tok_s"] for r in runs[f"{name}/{c}/{base_name}"]])
            for system in systems:
                rs = runs.get(f"{name}/{c}/{system}", [])
                if not rs:
                    continue
                tok_s = median([r["tok_s"] for r in rs])
                drafted = sum(r.get("draft_tokens", 0) for r in rs)
                kept = sum(r.get("accepted_draft_tokens", 0) for r in rs)
                table.append({"task": name, "concurrency": c, "system": system, "tok_s": tok_s,
                              "tok_s_each": [r["tok_s"] for r in rs], "ratio": tok_s / base if base else None,
                              "draft_tokens": drafted, "accepted_draft_tokens": kept,
                              "kept_share": kept / drafted if drafted else None,
                              "output_tokens": sum(r["output_tokens"] for r in rs)})
    print(f"\n{'task':8s} {'clients':>7s} {'system':>12s} {'tok/s':>8s} {'vs ' + base_name:>10s} {'kept':>12s}")
    for row in table:
        kept = f"{row['accepted_draft_tokens']}/{row['draft_tokens']}" if row["draft_tokens"] else "-"
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        print(f"{row['task']:8s} {row['concurrency']:7d} {row['system']:>12s} {row['tok_s']:8.1f} {ratio:>10s} "
              f"{kept:>12s}")
    print("same tokens per task (ours):", same)
    if same_vllm:
        print("vLLM's requests with our tokens:", {k: round(v, 2) for k, v in same_vllm.items()})
    if skipped:
        print("skipped:", skipped)
    if args.json:
        doc = {"commit": git_commit(), "machine": machine_info(), "args": vars(args), "table": table,
               "same_tokens": same, "same_tokens_as_ours": same_vllm, "skipped": skipped,
               "load_average": os.getloadavg(),
               "runs": {key: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                        for key, rs in runs.items()}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print("JSON:", args.json)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
