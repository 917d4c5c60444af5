"""scripts/soak_test.py against a server on 127.0.0.1 (gRPC, HTTP and /metrics): every kind of
request runs and passes; a probe whose tokens changed, or KV blocks left in use, fail the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_fixtures import DOCUMENT, Clients, ServerThread, make_config

from helpers import load_script
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.sampling_params import StructuredOutput

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak_test.py"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(model_dir):
    soak = load_script("soak_test")
    labels = StructuredOutput("choice", choices=tuple(soak.LABELS))
    st = ServerThread(make_config(model_dir, prefixes=(TemplateSpec("intent", content=DOCUMENT, structured_output=labels),
                                                       TemplateSpec("qa", content=DOCUMENT)),
                                  num_blocks=512, max_num_seqs=16, http_address="127.0.0.1:0",
                                  metrics_address="127.0.0.1:0")).start()
    yield st
    st.check_clean()
    st.stop()


def addresses(st: ServerThread) -> list[str]:
    return ["--grpc", st.address, "--http", f"127.0.0.1:{st.server.http_port}",
            "--metrics", f"127.0.0.1:{st.server.metrics_port}", "--template", "intent", "--qa-template", "qa"]


def args_for(st: ServerThread):
    return load_script("soak_test").parse_args([*addresses(st), "--duration", "2", "--concurrency", "3", "--probes", "4",
                                                "--sample-every", "1", "--max-rss-growth-mib", "1024"])


def test_every_kind_runs_and_every_check_passes(server, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *addresses(server), "--duration", "6", "--concurrency", "4",
                           "--probes", "4", "--sample-every", "1", "--max-rss-growth-mib", "1024", "--json", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and all(report["checks"].values()) and report["failures"] == {}
    soak = load_script("soak_test")
    assert set(report["done"]) == set(soak.KINDS), report["done"]  # each kind ran and met its expectation
    assert report["after"]["kv_used"] == report["before"]["kv_used"] == report["before"]["kv_pinned"]
    assert len(report["samples"]) >= 3 and report["samples"][-1]["requests"] > 0
    for needle in ("probe", "chat_json", "ok   no unexpected outcome", "ok   KV blocks in use back"):
        assert needle in proc.stdout
    server.check_clean()


def test_a_probe_that_changed_fails_the_run(server):
    soak = load_script("soak_test")

    class Drifted(soak.Soak):
        def make_probes(self, count):
            super().make_probes(count)
            self.probes = [(req, ids[:-1] + [ids[-1] + 1]) for req, ids in self.probes]  # as if the model had changed

    report = Drifted(args_for(server)).run()
    probes = report["done"].get("probe", 0) + report["probes_drifted"]
    assert report["probes_drifted"] > 0 and report["done"].get("probe", 0) == 0 and not report["passed"]
    assert report["failures"] == {} and report["checks"]["no unexpected outcome"]  # a drift is no error
    assert report["checks"][f"every probe reproduced (0 of {probes})"] is False
    assert any("tokens differ from its run alone at position" in e for e in report["examples"])
    allowed = Drifted(load_script("soak_test").parse_args([*addresses(server), "--duration", "1", "--probes", "2",
                                                           "--allow-drift", "--max-rss-growth-mib", "1024"])).run()
    assert allowed["probes_drifted"] > 0 and allowed["passed"]
    server.check_clean()


def test_blocks_left_in_use_fail_the_run(server):
    """A template pinned during the load holds blocks after it: the KV check names it."""
    soak = load_script("soak_test")
    admin = Clients(server.address).admin

    class Pinning(soak.Soak):
        def make_probes(self, count):
            super().make_probes(count)
            admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="added_during_soak", content=DOCUMENT * 2))

    try:
        report = Pinning(args_for(server)).run()
        assert report["failures"] == {}
        assert report["after"]["kv_used"] > report["before"]["kv_used"]
        assert not report["checks"]["KV blocks in use back to before the load"] and not report["passed"]
    finally:
        admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="added_during_soak"))
    server.check_clean()


def test_refuses_runs_without_bounds():
    for extra in (["--duration", "0"], ["--concurrency", "0"], ["--probes", "0"]):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--metrics", "127.0.0.1:1", *extra], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)})
        assert proc.returncode == 2 and "must be positive" in proc.stderr


def test_memory_growth_is_measured_from_the_second_quarters_median_not_one_trough():
    """Under load the resident set swings as allocators take and return memory: a trough sampled just after
    the first quarter is not a baseline (a 64-worker soak failed on one, 70.6 MiB under an end that sat in
    the plateau); a steady climb through the run still counts in full."""
    soak = load_script("soak_test")
    mib = 2 ** 20
    plateau = [{"t": t, "rss": (2080 + (9 if t % 20 else 0)) * mib} for t in range(0, 100, 5)]
    plateau[5]["rss"] = 2015 * mib  # t = 25: the first sample of the second quarter, a trough
    assert soak.rss_growth_mib(plateau, 2086 * mib, 100) < 10
    climb = [{"t": t, "rss": (2000 + 2 * t) * mib} for t in range(0, 100, 5)]
    assert soak.rss_growth_mib(climb, 2200 * mib, 100) == 2200 - 2070  # the second quarter's median: t = 35
    assert soak.rss_growth_mib(climb[:2], 2100 * mib, 100) == 2100 - 2005  # a short run: the samples there are
