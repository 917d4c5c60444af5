"""scripts/bench_cpu_decode_call.py on small shapes: a row per sequence count, in each template way
this machine runs, from memory and in cache; the JSON the table prints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_service.backends.cpu import native, onednn

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_decode_call.py"
WAYS = ["native", "none"] + (["matrix"] if onednn.load()[0] is not None else [])


@pytest.mark.skipif(native.load()[1] is not None, reason=f"no native library here: {native.load()[1]}")
@pytest.mark.parametrize("template", WAYS)
@pytest.mark.parametrize("hot", [False, True], ids=["from-memory", "in-cache"])
def test_bench_cpu_decode_call_script(tmp_path, template, hot):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seqs", "2,5", "--own-tokens", "9", "--template-tokens",
                           "20", "--layers", "3", "--query-heads", "4", "--kv-heads", "2", "--head-size", "32",
                           "--repeats", "2", "--template", template, "--json", str(out)] + (["--hot"] if hot else []),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["seqs"] for r in data["results"]] == [2, 5]
    assert all(0 < r["min_ms"] <= r["p50_ms"] for r in data["results"])
    # the own rows: sequences x tokens x KV heads x head size x (K, V) x 2 bytes x layers
    assert [r["own_mb"] for r in data["results"]] == [round(n * 9 * 2 * 32 * 2 * 2 * 3 / 1e6, 1) for n in (2, 5)]
    assert (data["args"]["template"], data["args"]["hot"]) == (template, hot)
    assert f"template {template}" in proc.stdout and "JSON:" in proc.stdout
