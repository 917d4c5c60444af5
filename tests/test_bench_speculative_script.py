"""scripts/bench_speculative.py on a tiny model (our engines only): every task at each concurrency for
each draft length, the same tokens with drafts and without, drafts checked where they are asked for
and never where they are not, and the table and JSON agree. The script's main() runs in this process."""
from __future__ import annotations

import json

from helpers import load_script
from prefix_service.bench.workloads import RECORD_MAX_TOKENS


def test_bench_speculative_script(llama_dir, tmp_path, capsys):
    out = tmp_path / "speculative.json"
    script = load_script("bench_speculative")
    # one-token lookups: the random model's text repeats few pairs of its context
    assert script.main(["--model", str(llama_dir), "--max-prefix-tokens", "120", "--tokens", "0,4", "--min-ngram", "1",
                        "--concurrency", "1,2", "--rounds", "2", "--max-tokens", "12", "--row-costs", "auto,0",
                        "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    tasks = ("doc_qa", "quote", "extract", "intent")
    assert data["same_tokens"] == dict.fromkeys(tasks, True)
    rows = {(r["task"], r["concurrency"], r["system"]): r for r in data["table"]}
    systems = ("ours-0", "ours-4@auto", "ours-4@0")  # a row cost per drafting engine
    assert set(rows) == {(t, c, s) for t in tasks for c in (1, 2) for s in systems}
    assert all(r["draft_tokens"] == 0 for key, r in rows.items() if key[2] == "ours-0")
    assert sum(r["draft_tokens"] for key, r in rows.items() if key[2] == "ours-4@0") > 0
    for (task, c, system), r in rows.items():
        assert len(r["tok_s_each"]) == 2 and r["tok_s"] > 0 and r["accepted_draft_tokens"] <= r["draft_tokens"]
        assert r["ratio"] == (1.0 if system == "ours-0" else r["tok_s"] / rows[(task, c, "ours-0")]["tok_s"])
        assert f"{r['tok_s']:8.1f}" in printed
    # intent: EOS ignored, 30 tokens a request; extract: at most 96 (its record); the rest at most --max-tokens
    most = {"intent": 30, "extract": RECORD_MAX_TOKENS}
    assert all(r["output_tokens"] == 2 * c * 30 for (task, c, _), r in rows.items() if task == "intent")
    assert all(r["output_tokens"] <= 2 * c * most.get(task, 12) for (task, c, _), r in rows.items())
    assert data["machine"]["cpu_count"] > 0 and data["args"]["tokens"] == "0,4"
