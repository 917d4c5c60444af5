"""The fleet joining a Ray cluster it did not start (ray.address), as on a real cluster: two Ray
nodes on this machine (ray.cluster_utils.Cluster: a head and a worker, one CPU each), the server
a `prefix-service serve` process of its own. Its two replicas run on different nodes and answer as
one process does; SIGTERM deletes the application and leaves the cluster running.
Deselect with -m "not ray"."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable

import pytest
import yaml

ray = pytest.importorskip("ray", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve", reason="the fleet needs ray[serve] (pip install -e '.[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

from prefix_service import Engine  # noqa: E402
from prefix_service.bench.systems.grpc import wait_serving  # noqa: E402
from prefix_service.engine.sequence import GenerateRequest  # noqa: E402
from prefix_service.fleet.launcher import (CONTROLLER_DEPLOYMENT, RAY_GCS_PORT_WAIT_ENV,  # noqa: E402
                                           RAY_GCS_PORT_WAIT_S, RAY_LOCAL_START_ATTEMPTS, start_timed_out)
from prefix_service.sampling_params import SamplingParams  # noqa: E402
from server_fixtures import (DOCUMENT, TOKEN_ENV, Clients, collect, greedy_request, make_config,  # noqa: E402
                             wait_until)

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]

TEMPLATES = {f"t{i}": f"{DOCUMENT} and note {i} of the table" for i in range(4)}
APP = "prefix-service-cluster"


def started(make: Callable[[], Cluster], add_node: Callable[[Cluster], object],
            attempts: int = RAY_LOCAL_START_ATTEMPTS) -> Cluster:
    """make() with add_node(it) done: Ray gives a node's start fixed windows (its GCS server writing
    its port, the raylet registering), which a machine busy with the rest of the suite can miss; a
    start that misses one is shut down and tried again whole, as the fleet's own local start does
    (init_ray)."""
    for attempt in range(1, attempts + 1):
        c = make()
        try:
            add_node(c)
            return c
        except Exception as e:  # Ray's start-up timeouts: a bare Exception or a RuntimeError
            c.shutdown()
            if attempt == attempts or not start_timed_out(e):
                raise
    raise AssertionError("unreachable")


def start_head() -> Cluster:
    """A Cluster with its head node up, the GCS server's window widened."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RAY_GCS_PORT_WAIT_ENV, str(RAY_GCS_PORT_WAIT_S))
        return started(lambda: Cluster(initialize_head=False),
                       lambda c: c.add_node(num_cpus=1, include_dashboard=False))


def start_cluster() -> Cluster:
    """A Cluster of the head and a second node, whose start has a window of its own (its raylet
    registering): a cluster whose second node misses it is started again whole."""
    return started(start_head, lambda c: c.add_node(num_cpus=1))


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "a Ray session from another test is still up"
    c = start_cluster()
    c.wait_for_nodes()
    c.connect()
    try:
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def test_a_fleet_on_a_cluster_it_joined(cluster, model_dir, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "device": "cpu", "dtype": "float32"},
        "cache": {"block_size": 4, "num_blocks": 1024},
        "server": {"address": address, "http_address": "", "admin_token_env": TOKEN_ENV,
                   "state_file": str(tmp_path / "state.json")},
        "ray": {"address": cluster.address, "num_replicas": 2, "num_cpus_per_replica": 1, "template_replication": 1,
                "app_name": APP},
        "prefixes": [{"name": n, "content": c} for n, c in TEMPLATES.items()],
    }))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefix_service", "serve", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    clients = None
    try:
        wait_serving(address, proc, 240, lambda: log.read_text()[-3000:])
        reports = serve.get_deployment_handle(CONTROLLER_DEPLOYMENT, app_name=APP).reports.remote().result(
            timeout_s=30)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(reports) == 2 and {r["node"] for r in reports.values()} == nodes  # one replica on each node

        engine = Engine(make_config(model_dir, num_blocks=1024).engine)
        clients = Clients(address)
        sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for name, text in TEMPLATES.items():
            engine.add_template(name, text)
            want = engine.generate(GenerateRequest(prompt="the order", prefix_name=name, sampling=sampling))[0]
            _, ids, _ = collect(clients.generation.Generate(greedy_request("the order", name, 8), timeout=60))
            assert ids == want.token_ids, name
        engine.shutdown()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if clients is not None:
            clients.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert f"deleting the Ray Serve application '{APP}'" in text and "Traceback" not in text, text[-3000:]
    wait_until(lambda: APP not in serve.status().applications, 60, f"Ray Serve deleting the application '{APP}'")
    assert APP not in serve.status().applications  # the application is gone...
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # ...the cluster it joined is not
