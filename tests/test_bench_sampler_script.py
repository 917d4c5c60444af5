"""scripts/bench_sampler.py: each checkout's sampler timed per option and row count, in children,
the table and the JSON agreeing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_sampler.py"


def test_the_sampler_is_timed_per_option_and_rows_for_each_checkout(tmp_path):
    out = tmp_path / "sampler.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--logits", "random", "--rows", "1,3", "--calls", "2",
                           "--rounds", "1", "--baseline", str(SCRIPT.parent.parent), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["medians"]) == {"base", "ours"}
    keys = {f"{option}|{n}" for option in ("greedy", "greedy logprobs5", "t1.0", "t0.7 top_p0.9", "t1.0 top_p0.95",
                                          "t0.7 top_k50", "repetition1.1", "presence0.5 frequency0.5")
            for n in (1, 3)}
    for name, row in data["medians"].items():
        assert set(row) == keys and all(ms > 0 for ms in row.values())
    ours = data["medians"]["ours"]
    assert f"| t1.0 top_p0.95 | 3 | {data['medians']['base']['t1.0 top_p0.95|3']:.2f} | {ours['t1.0 top_p0.95|3']:.2f} |" \
        in proc.stdout
