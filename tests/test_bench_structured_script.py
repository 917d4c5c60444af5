"""scripts/bench_structured.py on a tiny model (our engine only): every constrained output that ends is
an intent record of the schema, the unconstrained batch makes exactly as many tokens per request,
only the constrained steps mask, and the table and JSON agree. The script's main() runs in this
process (what it imports is imported here already); its engine child is a process of its own, as
always."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_service.bench.workloads import INTENT_LABELS
from helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_structured.py"


def test_bench_structured_script(llama_dir, tmp_path, capsys):
    script = load_script("bench_structured")
    out = tmp_path / "structured.json"
    assert script.main(["--model", str(llama_dir), "--max-prefix-tokens", "120", "--prompt-tokens", "20",
                        "--concurrency", "3", "--rounds", "1", "--pairs", "1", "--max-tokens", "80",
                        "--reason-chars", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert {"machine", "date", "git_commit", "command", "args", "schema", "medians", "per_pair", "runs"} <= set(data)
    assert data["schema"]["properties"]["intent"]["enum"] == list(INTENT_LABELS)
    assert list(data["medians"]) == ["engine"] and len(data["runs"]["engine"]) == 1
    assert data["runs"]["engine"][0]["child_s"] > 0

    [pair] = data["runs"]["engine"][0]["pairs"]
    c, u = pair["constrained"], pair["unconstrained"]
    assert len(c["tokens"]) == 3 and u["tokens"] == c["tokens"] and all(n <= 80 for n in c["tokens"])
    assert set(u["finish"]) == {"length"} and set(c["finish"]) <= {"stop", "length"}
    for text, finish in zip(c["texts"], c["finish"]):
        assert text.startswith('{"intent":"')
        if finish == "stop":
            record = json.loads(text)
            assert record["intent"] in INTENT_LABELS and 0 <= record["confidence"] <= 1
            assert len(record["reason"]) <= 8
    assert c["engine_ms"]["calls"]["mask"] > 0 and c["engine_ms"]["calls"]["matcher"] == 3
    assert u["engine_ms"]["calls"]["mask"] == 0 and u["engine_ms"]["ms"]["mask"] == 0

    m = data["medians"]["engine"]
    assert m["tpot_constrained_ms"] > 0 and m["tpot_unconstrained_ms"] > 0
    assert m["overhead"] == pytest.approx(m["tpot_constrained_ms"] / m["tpot_unconstrained_ms"] - 1)
    assert m["decode_tok_s_constrained"] > 0 and m["decode_tok_s_unconstrained"] > 0
    assert m["valid_records"] == sum(f == "stop" for f in c["finish"]) / 3
    assert m["step_ms"]["unconstrained"]["mask"] == 0
    assert 0 < m["mask_ms_per_step"] <= m["step_ms"]["constrained"]["step"]
    assert m["tpot_source"] == "client" and m["pairs"] == 1
    assert "TPOT constrained ms" in printed and f"{m['overhead']:+.1%}" in printed and "JSON:" in printed


def test_bench_structured_script_rejects_bad_values():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pairs", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--pairs" in proc.stderr
