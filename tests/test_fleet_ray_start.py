"""The fleet's start of Ray (fleet/launcher.py's init_ray): a local cluster whose node misses Ray's
own start-up window (a fixed 30 s, which a loaded machine can miss) is started again, after what
the failed try left is shut down, up to RAY_LOCAL_START_ATTEMPTS times; any other failure, and a
failure to join a running cluster, is raised as it comes."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")

from prefix_service.fleet import launcher  # noqa: E402

TIMEOUT = "The current node timed out during startup. This could happen because some of the raylet failed"
PORT_TIMEOUT = "Timed out waiting for file /tmp/ray/session_1/gcs_server_port_ab29"  # the GCS's port, 30 s too


class FakeRay:
    """ray.init and ray.shutdown, raising the given failures on the first calls of init."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.inits: list[dict] = []
        self.gcs_waits: list[str | None] = []  # the GCS server's window each init saw
        self.shutdowns = 0

    def init(self, **kwargs) -> None:
        self.inits.append(kwargs)
        self.gcs_waits.append(os.environ.get(launcher.RAY_GCS_PORT_WAIT_ENV))
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(launcher.RAY_GCS_PORT_WAIT_ENV, "")  # restored after the test, whatever init_ray sets
    monkeypatch.delenv(launcher.RAY_GCS_PORT_WAIT_ENV)

    def install(failures: list[Exception]) -> FakeRay:
        fake = FakeRay(failures)
        monkeypatch.setattr(launcher, "ray", fake)
        return fake
    return install


def test_a_local_start_that_times_out_is_started_again(fake_ray, caplog):
    fake = fake_ray([Exception(TIMEOUT), Exception(TIMEOUT)])
    assert launcher.init_ray(None) is False  # started a local cluster
    assert len(fake.inits) == 3 and fake.shutdowns == 2
    # a new instance, not the cluster `ray start` left on this machine
    assert all(kw["address"] == "local" and kw["include_dashboard"] is False for kw in fake.inits)
    assert sum("did not start in time" in r.getMessage() for r in caplog.records) == 2
    fake = fake_ray([RuntimeError(PORT_TIMEOUT), Exception(TIMEOUT)])  # the GCS's window, then the node's
    assert launcher.init_ray(None) is False
    assert len(fake.inits) == 3 and fake.shutdowns == 2
    fake = fake_ray([Exception(TIMEOUT)])
    launcher.init_ray(None, num_cpus=4, log_to_driver=False)  # the caller's options on every try
    assert [(kw["num_cpus"], kw["log_to_driver"]) for kw in fake.inits] == [(4, False), (4, False)]


def test_the_last_tries_timeout_is_raised(fake_ray):
    fake = fake_ray([Exception(TIMEOUT)] * launcher.RAY_LOCAL_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray(None)
    assert len(fake.inits) == launcher.RAY_LOCAL_START_ATTEMPTS
    assert fake.shutdowns == launcher.RAY_LOCAL_START_ATTEMPTS - 1


def test_other_failures_and_joining_a_cluster_are_raised_at_once(fake_ray, monkeypatch):
    fake = fake_ray([RuntimeError("no room for the object store")])
    with pytest.raises(RuntimeError, match="object store"):
        launcher.init_ray(None)
    assert len(fake.inits) == 1 and fake.shutdowns == 0
    fake = fake_ray([Exception(TIMEOUT)])
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray("10.0.0.7:6379")
    assert len(fake.inits) == 1 and fake.inits[0]["address"] == "10.0.0.7:6379" and fake.shutdowns == 0
    fake = fake_ray([])
    assert launcher.init_ray("10.0.0.7:6379") is True  # joined it
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    fake = fake_ray([])
    assert launcher.init_ray(None) is True
    assert fake.inits[0]["address"] is None  # Ray reads $RAY_ADDRESS itself
    fake = fake_ray([Exception(TIMEOUT)])
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray(None)
    assert len(fake.inits) == 1 and fake.shutdowns == 0


def test_a_local_start_gives_the_gcs_server_a_wider_window_unless_the_environment_sets_one(fake_ray, monkeypatch):
    """Ray's GCS server has 30 s to write its port by default, which a busy machine can miss: a local
    start sets $RAY_gcs_server_port_wait_time_s to RAY_GCS_PORT_WAIT_S for every try; an operator's
    own value is kept, and joining a cluster sets nothing."""
    fake = fake_ray([RuntimeError(PORT_TIMEOUT)])
    launcher.init_ray(None)
    assert fake.gcs_waits == [str(launcher.RAY_GCS_PORT_WAIT_S)] * 2 and launcher.RAY_GCS_PORT_WAIT_S > 30
    monkeypatch.setenv(launcher.RAY_GCS_PORT_WAIT_ENV, "45")
    fake = fake_ray([])
    launcher.init_ray(None)
    assert fake.gcs_waits == ["45"]
    monkeypatch.delenv(launcher.RAY_GCS_PORT_WAIT_ENV)
    fake = fake_ray([])
    launcher.init_ray("10.0.0.7:6379")
    assert fake.gcs_waits == [None]
