"""scripts/profile_decode.py on a tiny model, on the backend auto picks and on the torch backend:
every batch decodes together, the backend's kernel timing finds the linear and attention work,
and the table and JSON agree; bad values are rejected. The script's main() runs in this process
(torch and the engine are imported here already: a process of its own would spend most of its time
importing them again), its one torch thread (--threads 1) undone after it."""
from __future__ import annotations

import json

import pytest

from server_fixtures import torch_threads
from helpers import load_script



@pytest.fixture(scope="module")
def script():
    return load_script("profile_decode")


@pytest.mark.parametrize("backend, kv", [("auto", "auto"), ("torch", "auto"), ("auto", "bfloat16")])
def test_profile_decode_script(script, llama_dir, tmp_path, capsys, backend, kv):
    out = tmp_path / "decode.json"
    with torch_threads(1):  # what --threads sets, process-wide; restored after
        assert script.main(["--model", str(llama_dir), "--prefix-tokens", "40", "--prompt-tokens", "6",
                            "--batches", "1,5", "--steps", "3", "--threads", "1", "--backend", backend,
                            "--kv-cache-dtype", kv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    from prefix_service.backends.cpu import native
    assert data["backend"] == ("cpu" if backend == "auto" and native.load()[1] is None else "torch")
    assert [r["batch"] for r in data["results"]] == [1, 5]
    for r in data["results"]:
        assert 0 < r["step_min_ms"] <= r["step_p50_ms"]
        assert r["tok_s"] == pytest.approx(r["batch"] / r["step_p50_ms"] * 1e3, rel=0.01)
        assert r["kernels_ms"]["linear"] > 0 and r["kernels_ms"]["attention"] > 0
        assert r["other_ms"] == pytest.approx(r["profiled_step_ms"] - sum(r["kernels_ms"].values()), abs=0.01)
    assert data["steps"] == 3 and data["prefix_tokens"] == 40 and data["git_commit"]
    from prefix_service import cpuinfo
    model = "bfloat16" if cpuinfo.bf16_is_faster() else "float32"  # what the script's model.dtype: auto picks
    assert (data["dtype"], data["kv_cache_dtype"]) == (model, model if kv == "auto" else kv)
    assert "step p50 ms" in printed and "JSON:" in printed


def test_profile_decode_script_rejects_bad_values(script, llama_dir, capsys):
    for bad in (["--batches", "1,x"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--model", str(llama_dir), *bad])
        assert exit_info.value.code == 2 and bad[0] in capsys.readouterr().err
