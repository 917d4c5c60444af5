"""scripts/load_test.py against a server on 127.0.0.1: bounded in time, reports completed calls,
failures by status code and latency percentiles."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_fixtures import DOCUMENT, ServerThread, make_config

from prefix_service.config import TemplateSpec
from helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "load_test.py"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(model_dir):
    st = ServerThread(make_config(model_dir, prefixes=(TemplateSpec("doc", content=DOCUMENT),), max_queue=4,
                                  max_num_seqs=2)).start()
    yield st
    st.check_clean()
    st.stop()


def run_script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)})


def test_load_test_reports_completed_and_percentiles(server, tmp_path):
    out = tmp_path / "report.json"
    proc = run_script("--address", server.address, "--template", "doc", "--prompt", " the order", "--max-tokens", "4",
                      "--ignore-eos", "--concurrency", "4", "--duration", "1.5", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] > 0 and report["failed"] == {}
    assert report["requests"] == report["completed"]
    assert 1.5 <= report["duration_s"] < 30
    lat, ttft = report["latency_s"], report["ttft_s"]
    assert 0 < ttft["p50"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert report["completion_tokens_per_s"] == pytest.approx(4 * report["completed"] / report["duration_s"])
    for needle in ("completed", "failed     0", "latency", "ttft", "p99"):
        assert needle in proc.stdout


def test_load_test_counts_failures_by_code(server, tmp_path):
    out = tmp_path / "report.json"
    proc = run_script("--address", server.address, "--template", "nope", "--concurrency", "2", "--duration", "5",
                      "--max-requests", "6", "--json", str(out))
    assert proc.returncode == 1  # nothing completed
    report = json.loads(out.read_text())
    assert report["failed"] == {"NOT_FOUND": 6} and report["completed"] == 0
    assert "NOT_FOUND 6" in proc.stdout
    # overload: more streams than running slots plus queue -> some RESOURCE_EXHAUSTED, the rest complete
    proc = run_script("--address", server.address, "--prefix", "doc", "--max-tokens", "24", "--ignore-eos",
                      "--concurrency", "16", "--duration", "1", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["completed"] > 0
    assert set(report["failed"]) <= {"RESOURCE_EXHAUSTED"}


def test_load_test_refuses_unbounded_runs():
    for args in (["--duration", "0"], ["--duration", "999999"], ["--concurrency", "0"], ["--max-requests", "0"]):
        proc = run_script(*args)
        assert proc.returncode == 2 and "must be" in proc.stderr


def test_percentile():
    mod = load_script("load_test")
    values = [float(v) for v in range(1, 101)]
    assert (mod.percentile(values, 50), mod.percentile(values, 99), mod.percentile(values, 100)) == (50, 99, 100)
    assert mod.percentile([], 50) is None and mod.percentile([7.0], 90) == 7.0
