"""What speculative decoding by prompt lookup (scheduler.speculative_tokens) gives: output tok/s of
requests submitted together, with drafts of --tokens each and without, on the same engine config
and the same new requests, engine to engine.

Tasks, each on a pinned template (the benchmark's own, configs/prompts/):

| task | template | request | output |
| --- | --- | --- | --- |
| `doc_qa` | the departures board (doc_qa workload) | a question about one flight | greedy, EOS ends it, at most --max-tokens |
| `quote` | the departures board | "copy the row of the flight to X as written" | greedy, EOS ends it, at most --max-tokens |
| `intent` | the intent classifier (intent workload) | a 100-token customer message | greedy free text, EOS ignored, 30 tokens |

`doc_qa` answers partly from the table, `quote` copies it, `intent` writes text the template seldom
holds (its drafts are mostly rejected: what they cost). Each (task, concurrency) batch is that many
requests submitted together (Engine.generate), each never sent before. Every engine is built
before the first round; in each round each engine runs every batch, the engines in turns (the
order rotating by round). Per batch: the output tokens over the wall time, the draft tokens the
steps checked and those kept (kv_stats), and each request's tokens, which must be the same for
every engine (greedy; `same_tokens` in the JSON, per task).

    python scripts/bench_speculative.py --json bench_out/speculative.json
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

from prefix_service.bench.main import git_commit, machine_info  # noqa: E402

TASKS = ("doc_qa", "quote", "intent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "default.yaml"), help="service YAML (its engine part)")
    p.add_argument("--tokens", default="0,8", help="scheduler.speculative_tokens of each engine (0: none)")
    p.add_argument("--max-running", type=int, default=8, help="scheduler.speculative_max_running")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--concurrency", default="1,4,8", help="requests submitted together per batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="doc_qa and quote: most output tokens")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def engine_config(path: str, tokens: int, max_running: int):
    from prefix_service.config import load_config
    ec = load_config(path).engine
    return dataclasses.replace(ec, scheduler=dataclasses.replace(
        ec.scheduler, speculative_tokens=tokens, speculative_max_running=max_running))


def tasks(tokenizer, names: list[str], max_tokens: int) -> dict:
    """name -> (template name, template ids, index -> (prompt ids, SamplingParams))."""
    from prefix_service import SamplingParams
    from prefix_service.bench import corpus
    from prefix_service.bench.workloads import build_workload
    out = {}
    for name in names:
        work = build_workload("intent" if name == "intent" else "doc_qa", tokenizer)
        if name == "intent":
            params = SamplingParams(max_tokens=work.output_tokens, ignore_eos=True)
            make = (lambda w: lambda i: list(w.request(i).prompt_ids))(work)
        else:
            params = SamplingParams(max_tokens=max_tokens)
            dests = corpus.destinations(work.prefix_text)
            if name == "doc_qa":
                make = (lambda w: lambda i: list(w.request(i).prompt_ids))(work)
            else:
                make = (lambda w, d: lambda i: w.encode(
                    f"\nQ: Copy the table's row of the flight to {d[i % len(d)]}, exactly as written.\nA:", False))(
                        work, dests)
        out[name] = (work.prefix_name, list(work.prefix_ids), make, params)
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
    from prefix_service import Engine
    token_counts = [int(x) for x in args.tokens.split(",")]
    names = [t for t in args.tasks.split(",") if t]
    unknown = set(names) - set(TASKS)
    if unknown:
        raise SystemExit(f"unknown tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
    levels = [int(x) for x in args.concurrency.split(",")]
    engines = {}
    for k in token_counts:
        engines[k] = Engine(engine_config(args.config, k, args.max_running))
    work = tasks(next(iter(engines.values())).tokenizer, names, args.max_tokens)
    for engine in engines.values():
        for template, ids, _, _ in {w[0]: w for w in work.values()}.values():
            engine.add_template(template, token_ids=ids)
    runs: dict[str, list[dict]] = {}
    index = 0
    warm = {name: [make(10_000 + i) for i in range(2)] for name, (_, _, make, _) in work.items()}
    for k, engine in engines.items():  # warm each engine's paths, untimed
        for name, (template, _, _, params) in work.items():
            run_batch(engine, template, warm[name], params)
    for rnd in range(args.rounds):
        order = token_counts[rnd % len(token_counts):] + token_counts[:rnd % len(token_counts)]
        for name, (template, _, make, params) in work.items():
            for c in levels:
                prompts = [make(index + i) for i in range(c)]
                index += c
                for k in order:
                    r = run_batch(engines[k], template, prompts, params)
                    runs.setdefault(f"{name}/{c}/{k}", []).append(r)
                    print(f"round {rnd + 1} {name:7s} c={c:<3d} tokens={k:<2d} {r['tok_s']:7.1f} tok/s "
                          f"kept {r['accepted_draft_tokens']}/{r['draft_tokens']}", flush=True)
    for engine in engines.values():
        engine.shutdown()
    table = []
    same = {}
    for name in work:
        same[name] = all(runs[f"{name}/{c}/{k}"][i]["token_ids"] == runs[f"{name}/{c}/{token_counts[0]}"][i]["token_ids"]
                         for c in levels for k in token_counts for i in range(args.rounds))
        for c in levels:
            base = median([r["tok_s"] for r in runs[f"{name}/{c}/{token_counts[0]}"]])
            for k in token_counts:
                rs = runs[f"{name}/{c}/{k}"]
                tok_s = median([r["tok_s"] for r in rs])
                drafted = sum(r["draft_tokens"] for r in rs)
                kept = sum(r["accepted_draft_tokens"] for r in rs)
                table.append({"task": name, "concurrency": c, "speculative_tokens": k, "tok_s": tok_s,
                              "tok_s_each": [r["tok_s"] for r in rs], "ratio": tok_s / base if base else None,
                              "draft_tokens": drafted, "accepted_draft_tokens": kept,
                              "kept_share": kept / drafted if drafted else None,
                              "output_tokens": sum(r["output_tokens"] for r in rs)})
    print(f"\n{'task':8s} {'clients':>7s} {'drafts':>6s} {'tok/s':>8s} {'vs 0':>6s} {'kept':>12s}")
    for row in table:
        kept = f"{row['accepted_draft_tokens']}/{row['draft_tokens']}" if row["draft_tokens"] else "-"
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        print(f"{row['task']:8s} {row['concurrency']:7d} {row['speculative_tokens']:6d} {row['tok_s']:8.1f} "
              f"{ratio:>6s} {kept:>12s}")
    print("same tokens per task:", same)
    if args.json:
        doc = {"commit": git_commit(), "machine": machine_info(), "args": vars(args), "table": table,
               "same_tokens": same, "load_average": os.getloadavg(),
               "runs": {key: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for key, rs in runs.items()}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print("JSON:", args.json)
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
