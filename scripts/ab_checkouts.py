"""Two checkouts of this repository on this machine, A/B: each runs its own scripts/profile_decode.py
(decode step time at --batches sequences, and on the cpu backend the native kernels' share of the
profiled step: attention, linear, elementwise) and scripts/profile_prefill.py (TTFT of 100 tokens on the
900-token template and of the 1,000 tokens alone), taking turns, --rounds times (the before checkout
first in even rounds). The table and JSON give each checkout's median over the rounds of each run's
p50, and the after / before ratio of each round's pair (median, min, max): on a shared machine the
pairs bound a change better than two medians taken minutes apart.

--before and --after name commits (checked out with `git archive` into --workdir); without --after
the working tree is the after side. --engine-args go to both scripts (e.g. `--backend cpu --device cpu
--dtype float32` where `auto` would pick another dtype). Both run under this Python, and a checkout
shares this one's .cache (the prepared model, the built kernels).

    python scripts/ab_checkouts.py --before 4f5b997 --rounds 6 --json bench_out/ab.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PREFILL_PATHS = ("prefix", "no_prefix")


def checkout(rev: str, workdir: Path) -> Path:
    """The tree of rev under workdir (extracted once; reused when it is there)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    target = workdir / commit[:12]
    if not (target / "scripts").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    cache = REPO / ".cache"  # the prepared model (every checkout's default path) and the built kernels
    if cache.is_dir() and not (target / ".cache").exists():
        (target / ".cache").symlink_to(cache)
    return target


def run_scripts(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One round of one checkout: its decode steps and prefill TTFTs (ms, each run's p50), by measure."""
    extra = shlex.split(args.engine_args)
    decode_json, prefill_json = out / "decode.json", out / "prefill.json"
    decode = [sys.executable, str(tree / "scripts/profile_decode.py"), "--batches", args.batches, "--steps",
              str(args.steps), "--json", str(decode_json), *extra]
    prefill = [sys.executable, str(tree / "scripts/profile_prefill.py"), "--runs", str(args.prefill_runs),
               "--profile-runs", "1", "--json", str(prefill_json), *extra]
    if "--paths" in (tree / "scripts/profile_prefill.py").read_text():  # older checkouts run their fixed paths
        prefill += ["--paths", ",".join(PREFILL_PATHS)]
    for cmd in (decode, prefill):
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=tree, stdout=subprocess.DEVNULL if args.quiet else None)
    return measures_from(json.loads(decode_json.read_text()), json.loads(prefill_json.read_text()))


def measures_from(decode: dict[str, Any], prefill: dict[str, Any]) -> dict[str, float]:
    """The measures of one run of each script's JSON: each batch's step p50, and where the decode
    profile timed the native kernels, each kind's ms in the profiled step (attention, linear, ...);
    each prefill path's TTFT p50."""
    measures: dict[str, float] = {}
    for r in decode["results"]:
        measures[f"decode_step_p50_ms/{r['batch']}"] = r["step_p50_ms"]
        for kind, ms in (r.get("kernels_ms") or {}).items():
            measures[f"decode_{kind}_ms/{r['batch']}"] = ms
    for r in prefill["results"]:
        if r["path"] in PREFILL_PATHS:
            measures[f"prefill_ttft_p50_ms/{r['path']}"] = r["ttft_p50_ms"]
    return measures


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Each side's median per measure over the rounds, and the after / before ratio of each round's pair."""
    common = sorted(set.intersection(*(set(r["before"]) & set(r["after"]) for r in rounds)))
    medians = {side: {m: round(statistics.median(r[side][m] for r in rounds), 2) for m in common}
               for side in ("before", "after")}
    ratios = {}
    for m in common:
        pairs = [r["after"][m] / r["before"][m] for r in rounds]
        ratios[m] = {"median": round(statistics.median(pairs), 3), "min": round(min(pairs), 3),
                     "max": round(max(pairs), 3)}
    return {"medians": medians, "after_over_before_per_round": ratios}


def markdown(before: str, after: str, summary: dict[str, Any]) -> str:
    lines = [f"| measure | before ({before}) | after ({after}) | after / before, median of the pairs (range) |",
             "| --- | --- | --- | --- |"]
    for m, r in summary["after_over_before_per_round"].items():
        lines.append(f"| {m} | {summary['medians']['before'][m]:,.1f} ms | {summary['medians']['after'][m]:,.1f} ms | "
                     f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a commit")
    p.add_argument("--after", help="a commit (default: this working tree)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=8, help="profile_decode.py's timed steps per batch")
    p.add_argument("--prefill-runs", type=int, default=8, help="profile_prefill.py's timed requests per path")
    p.add_argument("--engine-args", default="", help="more arguments for both scripts, e.g. '--dtype float32'")
    p.add_argument("--workdir", help="where the checkouts and each run's JSON go (default: a temporary folder)")
    p.add_argument("--quiet", action="store_true", help="hide the scripts' own tables")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    from prefix_service.bench.main import git_commit, machine_info
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ab-checkouts-"))
    trees = {"before": checkout(args.before, workdir), "after": checkout(args.after, workdir) if args.after else REPO}
    names = {"before": args.before, "after": args.after or git_commit() or "working tree"}
    machine = machine_info()
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        done: dict[str, dict[str, float]] = {}
        for side in order:
            print(f"round {i + 1}/{args.rounds}: {side} ({names[side]})", flush=True)
            out = workdir / f"round-{i + 1}-{side}"
            out.mkdir(parents=True, exist_ok=True)
            done[side] = run_scripts(trees[side], args, out)
        rounds.append(done)
    summary = summarize(rounds)
    print(markdown(names["before"], names["after"], summary))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        machine["load_average_end"] = list(os.getloadavg())
        with open(args.json, "w") as fh:
            json.dump({"what": "A/B of two checkouts, each running its own scripts/profile_decode.py --batches "
                               f"{args.batches} --steps {args.steps} and scripts/profile_prefill.py --runs "
                               f"{args.prefill_runs} --profile-runs 1 {args.engine_args}".rstrip()
                               + f", taking turns (before first in even rounds), {args.rounds} rounds",
                       "date": datetime.date.today().isoformat(), "before": names["before"], "after": names["after"],
                       "machine": machine, "rounds": rounds, **summary}, fh, indent=2)
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
