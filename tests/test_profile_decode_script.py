"""scripts/profile_decode.py on a tiny model, on the backend auto picks and on the torch backend:
every batch decodes together, the backend's kernel timing finds the linear and attention work,
and the table and JSON agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_decode.py"


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_profile_decode_script(llama_dir, tmp_path, backend):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--prefix-tokens", "40",
                           "--prompt-tokens", "6", "--batches", "1,5", "--steps", "3", "--threads", "1",
                           "--backend", backend, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
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
    assert "step p50 ms" in proc.stdout and "JSON:" in proc.stdout


def test_profile_decode_script_rejects_bad_values(llama_dir):
    for bad in (["--batches", "1,x"], ["--steps", "0"]):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), *bad],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and bad[0] in proc.stderr
