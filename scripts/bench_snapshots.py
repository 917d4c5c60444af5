"""Start to serving with many templates: prefilling them against loading their KV snapshots.

Each (system, round) is a fresh child process that builds an Engine (the model loaded), pins N
templates of about T tokens each (different documents: a header naming the template, then the
departures table of configs/prompts/lisbon_departures.md), then times a first request on one of
them (one token after a question, the TTFT), the systems in turns:

| system | the templates' K/V |
| --- | --- |
| `off` | prefilled, snapshots off (`cache.snapshot_dir: ""`): the start as it was |
| `prefill` | prefilled into an empty snapshot folder: the first start, which also writes the snapshots (off the engine's thread; the write's end is timed apart) |
| `restore` | loaded from the snapshots the round's `prefill` wrote: every later start |

Then the disk: the snapshot folder read back sequentially (cold when the page cache can be
dropped, which needs root; the JSON says which), against the restore's own throughput (bytes of
K/V pinned per second of restore). The first token of every request is compared: restored
templates must answer as prefilled ones.

    python scripts/bench_snapshots.py --json bench_out/snapshots.json
    python scripts/bench_snapshots.py --model-config path/to/config.json --load-format dummy   # another model size
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["\nQ: Which gate does TP 1045 leave from?\nA:", "\nQ: When does LX 575 leave?\nA:",
             "\nQ: Which flight to Newark was cancelled?\nA:"]


def workload(model: str | None, n: int, tokens: int) -> dict:
    """Token ids of the N templates (each exactly `tokens` long) and of the questions."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    if model is None:
        from prefix_service.prepare_model import prepare_default_model
        model = str(prepare_default_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    doc = tok.encode((REPO / "configs" / "prompts" / "lisbon_departures.md").read_text(), add_special_tokens=False)
    templates = {}
    for i in range(n):
        head = tok.encode(f"Departures board {i} of {n}. Answer from this table only.\n", add_special_tokens=False)
        ids = head + (doc * (tokens // max(len(doc), 1) + 1))
        templates[f"board_{i:02d}"] = ids[:tokens]
    return {"model": model, "templates": templates,
            "questions": [tok.encode(q, add_special_tokens=False) for q in QUESTIONS]}


def child(args: argparse.Namespace, ids: dict, snapshot_dir: str) -> dict:
    from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
    from prefix_service import SchedulerConfig
    from prefix_service.backends.kv_cache import block_bytes
    import torch
    block = 16
    pinned_blocks = sum(-(-len(t) // block) for t in ids["templates"].values())
    start = time.perf_counter()
    engine = Engine(EngineConfig(
        ModelConfig(path=ids["model"], dtype=args.dtype, device="cpu", load_format=args.load_format),
        CacheConfig(block_size=block, num_blocks=pinned_blocks + 256, prefix_budget_blocks=pinned_blocks,
                    snapshot_dir=snapshot_dir),
        SchedulerConfig(max_num_batched_tokens=4096)))
    loaded = time.perf_counter()
    per_template, sources = [], []
    for name, tokens in ids["templates"].items():
        t = time.perf_counter()
        info = engine.add_template(name, token_ids=tokens)
        per_template.append((time.perf_counter() - t) * 1000)
        sources.append(info.kv_source)
    pinned = time.perf_counter()
    first = next(iter(ids["templates"]))
    ttft, firsts = [], []
    for q in ids["questions"]:
        t = time.perf_counter()
        out = engine.generate(GenerateRequest(prompt_token_ids=q, prefix_name=first,
                                              sampling=SamplingParams(max_tokens=1)))[0]
        ttft.append((time.perf_counter() - t) * 1000)
        firsts.append(out.token_ids[0])
    t = time.perf_counter()
    engine.flush_snapshots()
    flush_ms = (time.perf_counter() - t) * 1000
    kv_bytes = engine.kv_stats()["pinned"] * block_bytes(engine.info.arch, block, getattr(torch, engine.info.dtype))
    engine.shutdown()
    return {"backend": engine.info.backend_description, "load_ms": (loaded - start) * 1000,
            "templates_ms": (pinned - loaded) * 1000, "to_serving_ms": (pinned - start) * 1000,
            "per_template_ms": per_template, "kv_sources": sources, "ttft_ms": ttft, "first_tokens": firsts,
            "snapshot_flush_ms": flush_ms, "pinned_kv_bytes": kv_bytes}


def read_speed(folder: Path) -> dict:
    """Sequential read of every file in folder, 8 MiB at a time: cold when the page cache could be
    dropped first."""
    cold = False
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        cold = True
    except OSError:
        pass
    total, start = 0, time.perf_counter()
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "mb_s": total / seconds / 1e6, "cold_cache": cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates", type=int, default=20)
    ap.add_argument("--template-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", help="a model directory (default: the prepared default model)")
    ap.add_argument("--model-config", help="a config.json: a model of that shape with random weights "
                                           "(with --load-format dummy; the default model's tokenizer)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--json")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--snapshot-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.system:
        ids = json.loads(Path(args.ids).read_text())
        sys.path.insert(0, str(REPO))
        print("RESULT " + json.dumps(child(args, ids, args.snapshot_dir)), flush=True)
        return

    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, git_commit, isa_label, machine_info
    from prefix_service.bench.report import write_json
    work = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    ids = workload(args.model, args.templates, args.template_tokens)
    if args.model_config:  # the default model's tokenizer files beside another config: random weights
        shaped = work / "model"
        shaped.mkdir()
        for f in Path(ids["model"]).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy(f, shaped / f.name)
        shutil.copy(args.model_config, shaped / "config.json")
        ids["model"] = str(shaped)
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps(ids))
    info = machine_info()
    runs: dict[str, list[dict]] = {"off": [], "prefill": [], "restore": []}
    disk = []
    try:
        for r in range(args.rounds):
            folder = work / f"snapshots-{r}"
            for system, snapshot_dir in (("off", ""), ("prefill", str(folder)), ("restore", str(folder))):
                cmd = [sys.executable, __file__, "--system", system, "--ids", str(ids_file), "--dtype", args.dtype,
                       "--load-format", args.load_format, "--snapshot-dir", snapshot_dir]
                runs[system].append(child_result(cmd, None, f"{system} (round {r})"))
                print(f"round {r} {system}: {runs[system][-1]['templates_ms'] / 1000:.1f} s for the templates",
                      file=sys.stderr)
            disk.append(read_speed(folder))
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["load_average_end"] = list(os.getloadavg())

    def med(system: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[system])
    table = {s: {"load_ms": med(s, "load_ms"), "templates_ms": med(s, "templates_ms"),
                 "to_serving_ms": med(s, "to_serving_ms"),
                 "ttft_ms": statistics.median(t for run in runs[s] for t in run["ttft_ms"]),
                 "snapshot_flush_ms": med(s, "snapshot_flush_ms")} for s in runs}
    kv_bytes = runs["restore"][0]["pinned_kv_bytes"]
    restore_mb_s = kv_bytes / (table["restore"]["templates_ms"] / 1000) / 1e6
    disk_mb_s = statistics.median(d["mb_s"] for d in disk)
    sources_ok = all(set(run["kv_sources"]) == {"snapshot"} for run in runs["restore"]) and \
        all(set(run["kv_sources"]) == {"prefill"} for s in ("off", "prefill") for run in runs[s])
    same_tokens = len({tuple(run["first_tokens"]) for s in runs for run in runs[s]}) == 1
    speedup = table["prefill"]["templates_ms"] / table["restore"]["templates_ms"]
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs; {args.templates} templates of "
          f"{args.template_tokens} tokens ({kv_bytes / 2**20:.0f} MiB of K/V), medians of {args.rounds} rounds")
    print("| system | model load s | templates s | start to serving s | first request TTFT ms | snapshot writes "
          "done after s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for s, row in table.items():
        print(f"| {s} | {row['load_ms'] / 1000:.1f} | {row['templates_ms'] / 1000:.2f} | "
              f"{row['to_serving_ms'] / 1000:.1f} | {row['ttft_ms']:.0f} | {row['snapshot_flush_ms'] / 1000:.2f} |")
    print(f"templates from snapshots: {speedup:.1f}x faster than prefilling them; restore {restore_mb_s:.0f} MB/s "
          f"against a sequential read of {disk_mb_s:.0f} MB/s ({'cold' if disk[0]['cold_cache'] else 'page'} cache); "
          f"kv sources as expected: {sources_ok}; first tokens equal: {same_tokens}")
    if args.json:
        write_json(args.json, {
            "machine": info, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
            "command": " ".join(["python scripts/bench_snapshots.py", *sys.argv[1:]]), "args": vars(args),
            "medians": table, "speedup_templates": speedup, "restore_mb_s": restore_mb_s, "disk_read": disk,
            "kv_bytes": kv_bytes, "kv_sources_ok": sources_ok, "first_tokens_equal": same_tokens, "runs": runs})
    if not (sources_ok and same_tokens):
        sys.exit("restored templates did not come from snapshots, or answered otherwise than prefilled ones")


if __name__ == "__main__":
    main()
