"""Persistence under SIGKILL: a process writing the template state file is killed at random points,
20 times; after each kill the file loads as exactly the last state written or the one in flight,
never a torn mix. Then a server starts from it and restores that registry. Finally a real server
is killed while admin adds are in flight: every add it acknowledged is there after a restart."""
from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from server_fixtures import DOCUMENT, Clients, ServerThread, collect, greedy_request, make_config

from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.server.store import TemplateStore

REPO = Path(__file__).resolve().parent.parent
WORDS = "the order price refund shipping account table row value music weather".split()
KILLS = 20


# Saves template lists through TemplateStore, forever: each state is printed before ("writing")
# and after ("saved") its save, so the test knows which two states a kill may leave on disk.
WRITER = r"""
import json, random, sys
from prefix_service.server.store import TemplateSource, TemplateStore
WORDS = "the order price refund shipping account table row value music weather".split()
store = TemplateStore(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
n = int(sys.argv[2]) * 100000
current = store.load()
print("ready", flush=True)
while True:
    n += 1
    if len(current) >= 6 or (current and rng.random() < 0.3):
        current.pop(rng.randrange(len(current)))
    else:
        current.append(TemplateSource(f"t{n}", content=" ".join(WORDS[(n + i) % 11] for i in range(3 + n % 9))))
    state = [t.to_json() for t in current]
    print("writing " + json.dumps(state), flush=True)
    store.save(current)
    print("saved", flush=True)
"""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def content_for(name: str) -> str:
    n = int(name[1:])
    return " ".join(WORDS[(n + i) % 11] for i in range(3 + n % 9))


def test_state_file_survives_20_kills_mid_write(tmp_path, model_dir):
    state = tmp_path / "state.json"
    rng = random.Random(2024)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed_mid_write = 0
    previous: list[dict] = []  # the file's state before this round (no file yet: no templates)
    for round_ in range(KILLS):
        errors = tmp_path / "writer.err"
        with open(errors, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", WRITER, str(state), str(round_ + 1)], env=env,
                                    stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready", errors.read_text()
            time.sleep(rng.uniform(0.005, 0.15))
        finally:
            proc.send_signal(signal.SIGKILL)
            out = proc.stdout.read()  # (not communicate(): it would skip what readline buffered)
            proc.stdout.close()
            proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, errors.read_text()
        lines = [line for line in out.splitlines() if line]
        writes = [json.loads(line[len("writing "):]) for line in lines if line.startswith("writing ")]
        saved = [i for i, line in enumerate(lines) if line == "saved"]
        assert writes, "killed before the first write: raise the sleep"
        # the last state acknowledged (or what was there before this round), and the one in flight
        acknowledged = writes[len(saved) - 1] if saved else None
        in_flight = writes[-1] if lines[-1] != "saved" else None
        killed_mid_write += in_flight is not None
        loaded = [t.to_json() for t in TemplateStore(state).load()]  # never a StateFileError
        assert not list(tmp_path.glob(".state.json.tmp-*")), "a stale temp file survived the load"
        candidates = [s for s in (acknowledged, in_flight) if s is not None]
        if acknowledged is None:  # nothing saved this round: the previous round's file or the new one
            candidates.append(previous)
        assert loaded in candidates, (round_, loaded, candidates)
        for t in loaded:
            assert t["content"] == content_for(t["name"])  # no torn content
        previous = loaded
    assert killed_mid_write > 0

    # the next start restores exactly that registry, each template usable
    st = ServerThread(make_config(model_dir, prefixes=(TemplateSpec("doc", content=DOCUMENT),),
                                  state_file=state)).start()
    try:
        c = Clients(st.address)
        listed = c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates
        assert [(t.name, t.origin) for t in listed] == [("doc", "config")] + [(t["name"], "admin") for t in previous]
        for t in previous:
            assert collect(c.generation.Generate(greedy_request(" the", t["name"], max_tokens=2)))[2] \
                .usage.prefix_tokens == st.engine.get_template(t["name"]).num_tokens
        st.check_clean()
    finally:
        st.stop()


def test_server_killed_during_admin_adds_keeps_every_acknowledged_template(tmp_path, model_dir):
    cfg_path = tmp_path / "svc.yaml"
    state = tmp_path / "svc.state.json"
    cfg_path.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "cache": {"block_size": 4, "num_blocks": 256, "prefix_budget_blocks": 200},
        "server": {"address": "127.0.0.1:0", "http_address": "", "admin_token_env": "PREFIX_SERVICE_TEST_KILL_TOKEN",
                   "state_file": str(state)},
    }))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PREFIX_SERVICE_TEST_KILL_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "prefix_service", "serve", "--config", str(cfg_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    acknowledged: list[str] = []
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            assert time.monotonic() < deadline, "the server did not report SERVING within 120 s"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "the server exited during startup"
                continue
            m = re.search(r"SERVING on 127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        c = Clients(f"127.0.0.1:{port}")
        stop = threading.Event()

        def add_forever() -> None:
            for n in range(1, 10_000):
                if stop.is_set():
                    return
                try:
                    c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name=f"t{n}", content=content_for(f"t{n}")),
                                              timeout=10)
                except grpc.RpcError:
                    return  # the server died under the call: it may or may not have persisted it
                acknowledged.append(f"t{n}")

        adder = threading.Thread(target=add_forever, daemon=True)
        adder.start()
        deadline = time.monotonic() + 30
        while len(acknowledged) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(random.Random(7).uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        adder.join(15)
        c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert len(acknowledged) >= 5

    stored = [t.name for t in TemplateStore(state).load()]
    assert stored[:len(acknowledged)] == acknowledged  # every acknowledged add is durable, in order
    assert len(stored) <= len(acknowledged) + 1  # at most the one in flight besides
    st = ServerThread(make_config(model_dir, state_file=state, prefix_budget_blocks=200)).start()
    try:
        admin = Clients(st.address).admin
        listed = [t.name for t in admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates]
        assert listed == stored
        st.check_clean()
    finally:
        st.stop()
