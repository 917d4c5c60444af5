"""scripts/profile_prefill.py on a tiny model, on the backend auto picks and on the torch backend:
the paths run, the FLOP counts match the weights, the backend's kernel timing finds the linear and
attention work, and the table and JSON agree; bad counts are rejected. The script's main() runs in
this process (torch and the engine are imported here already: a process of its own would spend most
of its time importing them again), its one torch thread (--threads 1) undone after it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from server_fixtures import torch_threads
from helpers import load_script



@pytest.fixture(scope="module")
def script():
    return load_script("profile_prefill")


def _linear_weights(model_dir: Path) -> tuple[int, int]:
    """(weights of the decoder layers' linear layers, weights of the output head), from the checkpoint."""
    layers = head = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                if ".layers." in name and name.endswith("proj.weight"):
                    layers += shape[0] * shape[1]
                elif name in ("lm_head.weight", "model.embed_tokens.weight") and not head:
                    head = shape[0] * shape[1]  # tied or not, the head has the embedding's shape
    return layers, head


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_profile_prefill_script(script, llama_dir, tmp_path, capsys, backend):
    out = tmp_path / "profile.json"
    prefix, prompt = 40, 8
    with torch_threads(1):  # what --threads sets, process-wide; restored after
        assert script.main(["--model", str(llama_dir), "--prefix-tokens", str(prefix), "--prompt-tokens", str(prompt),
                            "--runs", "2", "--profile-runs", "1", "--threads", "1", "--backend", backend,
                            "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    from prefix_service.backends.cpu import native
    native_runs = native.load()[1] is None
    want_backend = "cpu" if backend == "auto" and native_runs else "torch"
    assert data["backend"] == want_backend
    cfg = json.loads((llama_dir / "config.json").read_text())
    layers_w, head_w = _linear_weights(llama_dir)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rows = {r["path"]: r for r in data["results"]}
    packed = want_backend == "cpu"  # the cpu backend packs the template (default config)
    assert set(rows) == {"prefix", "no_prefix", "alone"} | ({"prefix_unpacked"} if packed else set())
    for path, tokens, context in (("prefix", prompt, prefix), ("no_prefix", prefix + prompt, 0),
                                  ("alone", prompt, 0), ("prefix_unpacked", prompt, prefix)):
        if path not in rows:
            continue
        r = rows[path]
        assert (r["tokens"], r["context"]) == (tokens, context)
        assert r["linear_flop"] == pytest.approx(2 * tokens * layers_w + 2 * head_w, rel=1e-3)
        keys = sum(context + i + 1 for i in range(tokens))
        want_attn = 4 * cfg["num_attention_heads"] * head_dim * keys * cfg["num_hidden_layers"]
        assert r["attention_flop"] == want_attn
        assert 0 < r["ttft_min_ms"] <= r["ttft_p50_ms"]
        assert r["linear_ms"] > 0 and r["attention_ms"] > 0  # the profile saw both kinds of kernel
        assert r["linear_ms"] + r["attention_ms"] < r["profiled_ttft_ms"]  # within the requests they were timed in
    ratio = data["ratio"]

    def to_2_places(x):  # the JSON's ratios are rounded to 2 decimal places (0.227 is 0.23)
        return pytest.approx(x, rel=0.01, abs=0.005)

    assert ratio["flop_bound"] == to_2_places(rows["no_prefix"]["flop"] / rows["prefix"]["flop"])
    assert ratio["ttft_p50"] == to_2_places(rows["no_prefix"]["ttft_p50_ms"] / rows["prefix"]["ttft_p50_ms"])
    assert ratio["alone_flop_bound"] == to_2_places(rows["prefix"]["flop"] / rows["alone"]["flop"])
    assert ratio["alone_flop_bound"] > 1  # the template's keys are attention work the prompt alone does not have
    assert ratio["alone_p50"] == to_2_places(rows["prefix"]["ttft_p50_ms"] / rows["alone"]["ttft_p50_ms"])
    if packed:
        unpacked = rows["prefix_unpacked"]["ttft_p50_ms"]
        assert ratio["packing_p50"] == to_2_places(unpacked / rows["prefix"]["ttft_p50_ms"])
    assert data["threads"] == 1 and data["prefix_tokens"] == prefix and data["git_commit"]
    assert "TTFT ratio no_prefix / prefix" in printed and "TTFT ratio prefix / alone" in printed and "JSON:" in printed


def test_profile_prefill_script_runs_only_the_paths_asked_for(script, llama_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    with torch_threads(1):
        assert script.main(["--model", str(llama_dir), "--prefix-tokens", "40", "--prompt-tokens", "8", "--runs", "1",
                            "--profile-runs", "1", "--threads", "1", "--paths", "prefix", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["path"] for r in data["results"]] == ["prefix"] and data["ratio"] == {}  # no other path to compare
    assert data["results"][0]["attention_ms"] > 0 and "TTFT ratio" not in printed


def test_profile_prefill_script_rejects_bad_counts(script, llama_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", str(llama_dir), "--prompt-tokens", "0"])
    assert exit_info.value.code == 2 and "--prompt-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", str(llama_dir), "--paths", "prefix,full"])
    assert exit_info.value.code == 2
    assert "--paths: names of prefix, no_prefix, alone, prefix_unpacked" in capsys.readouterr().err
