"""scripts/bench_cpu_decode_call.py on small shapes: a row per sequence count, in each template way
this machine runs, from memory and in cache, timed in the kernel and with the harness; the JSON the
table prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import head_commit_or_skip, native_sources_unchanged
from prefix_service.backends.cpu import native, onednn

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_decode_call.py"
# the caller's kernel settings left out (PREFIX_SERVICE_CACHE_DIR kept: where the library is built), one set
ENV = {**{k: v for k, v in os.environ.items()
          if not k.startswith("PREFIX_SERVICE_") or k == "PREFIX_SERVICE_CACHE_DIR"},
       "PREFIX_SERVICE_DECODE_PREFETCH": "task"}
WAYS = ["native", "none"] + (["matrix"] if onednn.load()[0] is not None else [])


@pytest.mark.skipif(native.load()[1] is not None, reason=f"no native library here: {native.load()[1]}")
@pytest.mark.parametrize("template", WAYS)
@pytest.mark.parametrize("hot", [False, True], ids=["from-memory", "in-cache"])
def test_bench_cpu_decode_call_script(tmp_path, template, hot):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seqs", "2,5", "--own-tokens", "9", "--template-tokens",
                           "20", "--layers", "3", "--query-heads", "4", "--kv-heads", "2", "--head-size", "32",
                           "--repeats", "2", "--template", template, "--json", str(out)] + (["--hot"] if hot else []),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [r["seqs"] for r in data["results"]] == [2, 5]
    assert all(0 < r["min_ms"] <= r["p50_ms"] for r in data["results"])
    # the kernel's own time (its library's attention timer) lies within the step's, the harness included
    assert all(r["p50_ms"] <= r["p50_with_harness_ms"] for r in data["results"])
    # the own rows: sequences x tokens x KV heads x head size x (K, V) x 2 bytes x layers
    assert [r["own_mb"] for r in data["results"]] == [round(n * 9 * 2 * 32 * 2 * 2 * 3 / 1e6, 1) for n in (2, 5)]
    assert (data["args"]["template"], data["args"]["hot"]) == (template, hot)
    # the machine it ran on, named as every benchmark's JSON names it, with its load before and after
    machine = data["machine"]
    assert machine["isa"] == data["isa"] and machine["cpu_count"] >= 1
    assert len(machine["load_average_start"]) == 3 and len(machine["load_average_end"]) == 3
    # and the kernel settings it ran under: the one set for this run, none of the caller's
    assert machine["kernel_settings"] == {"PREFIX_SERVICE_DECODE_PREFETCH": "task"}
    assert "git_commit" in data
    assert f"template {template}" in proc.stdout and "JSON:" in proc.stdout


@pytest.mark.skipif(native.load()[1] is not None, reason=f"no native library here: {native.load()[1]}")
def test_bench_cpu_decode_call_against_a_revision(tmp_path):
    """--against REV: REV's kernel (built from its sources in git) and the working tree's in turns, a
    row per sequence count with both sides' times, the rounds' ratios and whether the bits agree; HEAD's
    kernel is the working tree's wherever the native sources are unchanged, so its bits are the same."""
    head = head_commit_or_skip()
    out = tmp_path / "against.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seqs", "1,3", "--own-tokens", "9", "--template-tokens",
                           "20", "--layers", "2", "--query-heads", "4", "--kv-heads", "2", "--head-size", "32",
                           "--kv", "float32", "--template", "native", "--against", "HEAD", "--rounds", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["args"]["against_commit"] == head and data["args"]["repeats"] == 3
    assert [r["seqs"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["theirs_ms"] > 0 and r["ours_ms"] > 0
        assert 0 < r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
    if native_sources_unchanged():
        assert all(r["same_bits"] for r in data["results"])
    assert "HEAD's kernel and the working tree's in turns, 3 rounds" in proc.stdout

    bad = subprocess.run([sys.executable, str(SCRIPT), "--seqs", "1", "--layers", "1", "--against", "no-such-revision"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no library of no-such-revision" in bad.stderr
