"""The sampler's cost per step: `engine.sampler.sample` on N rows of next-token logits, per sampling
option (greedy, its log-probabilities, temperature, top-p, top-k, the penalties over each row's
1,039 prompt and 30 generated tokens), with the cpu backend's passes over its logits
(`CpuBackend.sampler_ops`), milliseconds a call, with glibc malloc set as the engine sets it on a
CPU (backends/hostmem.py: without it a call's fresh 12 MB temporaries fault on every page). A step samples every row at once
after the model's forward, so on a CPU this time is added to each decode step of N sequences.

The logits are the default model's own (SmolLM2-135M-Instruct through transformers, float32, the
last position of a few short prompts, a few tokens into their greedy continuation, cycled to N
rows), whose nuclei are what top-p meets in use; `--logits random` draws Gaussian ones instead.
`--baseline PATH` times another checkout's sampler as well (the same logits, in a child process
per checkout and round, the checkouts in turns). Prints a table; `--json` writes it with the
machine.

    python scripts/bench_sampler.py --rows 1,16,64 --json bench_out/sampler.json
    python scripts/bench_sampler.py --baseline /tmp/before
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# name: SamplingParams keywords
OPTIONS = {
    "greedy": {},
    "greedy logprobs5": {"logprobs": 5},
    "t1.0": {"temperature": 1.0},
    "t0.7 top_p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t1.0 top_p0.95": {"temperature": 1.0, "top_p": 0.95},
    "t0.7 top_k50": {"temperature": 0.7, "top_k": 50},
    "repetition1.1": {"repetition_penalty": 1.1},
    "presence0.5 frequency0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
}
# the penalties read each row's tokens: the intent workload's (a 1,039-token prompt, 30 generated)
HISTORY = (1039, 30)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there", "I want to cancel my order",
           "The weather today is", "In 1492, Columbus", "My favourite food is", "The best way to learn Python is"]


def make_logits(kind: str, rows: int, path: Path) -> None:
    import torch
    if kind == "random":
        torch.manual_seed(0)
        torch.save(torch.randn(rows, 49152) * 3, path)
        return
    sys.path.insert(0, str(REPO))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prefix_service.prepare_model import prepare_default_model
    model_dir = prepare_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for i in range(min(rows, 40)):
            x = tok(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
            for _ in range(i // len(PROMPTS)):  # a few tokens into the continuation, for variety
                x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
            out.append(model(x).logits[0, -1])
    logits = torch.stack(out)
    torch.save(logits.repeat((rows + len(out) - 1) // len(out), 1)[:rows].contiguous(), path)


def child(args: argparse.Namespace) -> None:
    """One checkout: ms a call per (option, rows), printed as one JSON line."""
    import numpy as np
    import torch
    sys.path.insert(0, str(Path(args.repo).resolve()))
    from prefix_service.backends import hostmem
    from prefix_service.engine import sampler
    from prefix_service.engine.sequence import Sequence
    hostmem.keep_freed_memory()  # malloc as an engine on a CPU sets it: no page faults for a step's temporaries

    def generator(seed: int) -> Any:
        """A row's generator as this checkout's sampler draws from it: numpy's PCG64, or torch's
        before the sampler took every bit of a 64-bit seed."""
        if "torch.rand(" in inspect.getsource(sampler.draw):
            return torch.Generator().manual_seed(seed)
        return np.random.Generator(np.random.PCG64(seed))
    from prefix_service.sampling_params import SamplingParams
    try:  # the cpu backend's passes over its logits (Backend.sampler_ops), as its engine samples; older checkouts: none
        from prefix_service.backends.cpu.backend import CpuBackend
        ops: tuple = (CpuBackend.sampler_ops,)
    except (ImportError, AttributeError):
        ops = ()
    logits = torch.load(args.logits_file)
    result = {}
    ids = torch.Generator().manual_seed(0)
    for name, kw in OPTIONS.items():
        for n in args.rows:
            params = SamplingParams(max_tokens=1, **kw)
            seqs: list = []
            for i in range(n):
                if params.adjusts_logits:  # a real sequence: the penalties read its tokens
                    prompt, generated = (torch.randint(0, logits.shape[1], (k,), generator=ids).tolist()
                                         for k in HISTORY)
                    seq = Sequence(f"r{i}", prompt, params, HISTORY[1] + 1, None, generator(i))
                    seq.token_ids += generated
                    seqs.append(seq)
                else:
                    seqs.append(SimpleNamespace(sampling=params, matcher=None,
                                                generator=generator(i)))
            rows = logits[:n]
            sampler.sample(rows, seqs, (), *ops)
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                sampler.sample(rows, seqs, (), *ops)
                times.append((time.perf_counter() - t) * 1e3)
            result[f"{name}|{n}"] = statistics.median(times)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64", help="rows a step samples, comma-separated")
    ap.add_argument("--logits", choices=["model", "random"], default="model")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per (option, rows)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="another checkout of this repository: its sampler as the system 'base'")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--logits-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rows = [int(r) for r in str(args.rows).split(",")]
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, isa_label, machine_info
    systems = ([("base", args.baseline)] if args.baseline else []) + [("ours", str(REPO))]
    runs: dict[str, list[dict]] = {name: [] for name, _ in systems}
    with tempfile.TemporaryDirectory() as tmp:  # the logits every child reads, removed at the end
        logits_file = Path(tmp) / "logits.pt"
        make_logits(args.logits, max(args.rows), logits_file)
        for r in range(args.rounds):
            for name, repo in systems:
                cmd = [sys.executable, __file__, "--child", "--repo", repo, "--logits-file", str(logits_file),
                       "--rows", ",".join(map(str, args.rows)), "--calls", str(args.calls)]
                runs[name].append(child_result(cmd, {**os.environ, "PYTHONPATH": repo}, f"{name} (round {r})"))
    info = machine_info()
    table = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs, {args.logits} logits, "
          f"ms a call, medians of {args.rounds} rounds")
    print("| option | rows | " + " | ".join(name for name, _ in systems) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in systems) + " |")
    for key in table["ours"]:
        option, n = key.split("|")
        print(f"| {option} | {n} | " + " | ".join(f"{table[name][key]:.2f}" for name, _ in systems) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "medians": table, "runs": runs,
                                               "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
