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


def run_script(llama_dir, out, capsys, *more):
    """The script's main() on the tiny model, small: 3 requests a batch, 1 round of 1 pair, 20-token
    messages after a 120-token template -> (what it printed, its JSON)."""
    script = load_script("bench_structured")
    assert script.main(["--model", str(llama_dir), "--max-prefix-tokens", "120", "--prompt-tokens", "20",
                        "--concurrency", "3", "--rounds", "1", "--pairs", "1", *more, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_structured_script(llama_dir, tmp_path, capsys):
    printed, data = run_script(llama_dir, tmp_path / "structured.json", capsys,
                               "--max-tokens", "80", "--reason-chars", "8")
    assert {"machine", "date", "git_commit", "command", "args", "schema", "medians", "per_pair", "runs"} <= set(data)
    assert data["schema"]["properties"]["intent"]["enum"] == list(INTENT_LABELS)
    assert list(data["medians"]) == ["engine", "engine-step-each"] and len(data["runs"]["engine"]) == 1
    assert data["runs"]["engine"][0]["child_s"] > 0
    # jump-forward: the same tokens as a step each, in fewer steps
    [step_each] = data["runs"]["engine-step-each"][0]["pairs"]
    assert data["medians"]["engine"]["same_tokens_as_step_each"] == 1.0
    assert step_each["constrained"]["token_ids"] == data["runs"]["engine"][0]["pairs"][0]["constrained"]["token_ids"]
    assert data["medians"]["engine"]["steps_per_batch_constrained"] < \
        data["medians"]["engine-step-each"]["steps_per_batch_constrained"]

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


def test_bench_structured_script_with_the_templates_labels(llama_dir, tmp_path, capsys):
    """--constraint labels: each answer is one of the labels after a space (the intent template's
    default output), with its end-to-end time and the batch's requests/s; with --logprobs, each
    token's logprob, the same from both engines."""
    printed, data = run_script(llama_dir, tmp_path / "labels.json", capsys, "--constraint", "labels", "--logprobs", "1")
    [pair] = data["runs"]["engine"][0]["pairs"]
    c = pair["constrained"]
    assert set(c["finish"]) == {"stop"} and all(t[1:] in INTENT_LABELS and t[0] == " " for t in c["texts"])
    m = data["medians"]["engine"]
    assert m["valid_records"] == 1.0 and list(data["medians"]) == ["engine", "engine-step-each"]
    assert [len(lps) for lps in c["logprobs"]] == c["tokens"] and m["same_tokens_as_step_each"] == 1.0
    assert c["logprobs"] == data["runs"]["engine-step-each"][0]["pairs"][0]["constrained"]["logprobs"]
    assert m["e2e_constrained_ms"] == pytest.approx(sorted(c["e2e_ms"])[1])
    assert m["requests_per_s_constrained"] == pytest.approx(3 / c["wall_s"])
    assert "constraint: labels" in printed and "requests/s constrained" in printed


def test_bench_structured_script_rejects_unknown_systems():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--systems", "engine,vllm"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--systems" in proc.stderr
