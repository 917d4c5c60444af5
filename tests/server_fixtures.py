"""Helpers for the server tests: a tiny random model, a PrefixServer running in a background
thread on 127.0.0.1 (random free port), sync gRPC clients for it, and HTTP calls to its OpenAI API
(the official client, plain requests, the error body's checks)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefix_service import synthetic  # noqa: E402
from prefix_service.config import (CacheConfig, EngineConfig, ModelConfig, TemplateSpec, SchedulerConfig,  # noqa: E402
                                   ServerConfig, ServiceConfig)
from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc  # noqa: E402
from prefix_service.server import PrefixServer  # noqa: E402
from prefix_service.server.parts import LocalEngineProvider  # noqa: E402

TOKEN_ENV = "PREFIX_SERVICE_TEST_ADMIN_TOKEN"  # the servers under test read their token from here

# A system prompt and a document for the test templates (words the tiny tokenizer knows).
SYSTEM_PROMPT = "You classify the intent of the user. Answer with one label: order, refund, shipping or account."
DOCUMENT = " ".join(["the table has a row for each order with price and shipping value"] * 6)


def build_tiny_model(root: Path) -> Path:
    tok = synthetic.build_tokenizer(root / "tokenizer")
    return synthetic.build_model(root / "llama", "llama", tok, seed=11)


def make_config(model_dir: Path, *, prefixes: tuple[TemplateSpec, ...] = (), state_file: Path | None = None,
                num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 64, max_queue: int = 1024,
                prefix_budget_blocks: int | None = None, grace_period_s: float = 5.0,
                source: str | None = None, max_num_batched_tokens: int = 512, max_tokens_cap: int = 4096,
                default_max_tokens: int = 256, max_prompt_tokens: int | None = None,
                **server: Any) -> ServiceConfig:
    return ServiceConfig(
        EngineConfig(ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 prefix_budget_blocks=prefix_budget_blocks),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_queue=max_queue,
                                     max_num_batched_tokens=max_num_batched_tokens, max_tokens_cap=max_tokens_cap,
                                     default_max_tokens=default_max_tokens, max_prompt_tokens=max_prompt_tokens)),
        ServerConfig(**{"address": "127.0.0.1:0", "admin_token_env": TOKEN_ENV, "http_address": "",
                        "state_file": str(state_file) if state_file else None, "grace_period_s": grace_period_s,
                        **server}),
        prefixes, source)


class ServerThread:
    """A PrefixServer on its own event loop in a daemon thread: make_server(config) builds it (by
    default a one-process PrefixServer whose warm-up calls warmup_hook before each template)."""

    def __init__(self, config: ServiceConfig, make_server: Callable[[ServiceConfig], PrefixServer] | None = None,
                 warmup_hook: Any = None) -> None:
        self.config = config
        self.make_server = make_server or (lambda cfg: PrefixServer(
            cfg, engine_provider=LocalEngineProvider(warmup_hook=warmup_hook)))
        self.server: PrefixServer | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop_grace: float | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-server")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.server.engine

    def start(self, wait: bool = True) -> ServerThread:
        self._thread.start()
        if wait:
            self.wait_started()
        return self

    def wait_started(self, timeout: float = 60) -> None:
        if not self._started.wait(timeout):
            raise TimeoutError("server did not start")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.server = self.make_server(self.config)
        try:
            self.port = await self.server.start()
        except BaseException as e:  # handed to the test thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        await self.server.stop(self._stop_grace)

    def stop(self, grace: float | None = 0.0, wait: bool = True) -> None:
        """Stop as SIGTERM would (grace None: the configured grace period)."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive() and self._error is None:
            self._stop_grace = grace
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed after the check: the thread is already ending
                pass
        if wait:
            self._thread.join(60)

    def check_clean(self) -> None:
        """check_integrity, and no request left holding blocks (waits briefly for pending aborts).
        After the engine has stopped, its core is checked directly (its thread is gone)."""
        from prefix_service.errors import EngineStopped
        engine = self.engine
        deadline = time.monotonic() + 5
        while True:
            try:
                engine.check_integrity()
                stats = engine.kv_stats()
            except EngineStopped:
                engine.shutdown()  # joins the loop thread; the core is ours to read now
                engine._core.check_integrity()
                stats = engine._core.kv_stats()
            if stats["running"] == 0 and stats["waiting"] == 0 and stats["used"] == stats["pinned"]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"requests or blocks left behind: {stats}")
            time.sleep(0.02)


@contextlib.contextmanager
def running_fleet(config: ServiceConfig, root_certificates: bytes | None = None,
                  env: dict[str, str] | None = None) -> Iterator[tuple[ServerThread, Clients]]:
    """A fleet_server (config.ray) on a local Ray cluster of this process, started here unless one is
    up, and clients for it. Ray Serve is shut down before Ray: its handles left in this process would
    otherwise start a new cluster to report their metrics to. env: variables set in this process once
    Ray has started (its workers do not inherit them, as on another node), until the fleet stops."""
    import ray
    from ray import serve

    from prefix_service.fleet.launcher import fleet_server, init_ray
    started_ray = not ray.is_initialized()
    if started_ray:
        init_ray(None, num_cpus=4, log_to_driver=False)
    before = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        server = ServerThread(config, make_server=fleet_server)
        server.start(wait=False)
        server.wait_started(timeout=240)
        clients = Clients(server.address, root_certificates)
        try:
            yield server, clients
        finally:
            clients.close()
            server.stop(grace=0)
            if started_ray:
                serve.shutdown()
                ray.shutdown()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "the fleet",
               interval: float = 0.05) -> Any:
    """predicate()'s first true value, asked every `interval` seconds: a test waits for what it
    needs rather than for a fixed time. AssertionError naming `what` (and the last value seen,
    when it says more than false) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = "" if value is None or isinstance(value, bool) else f" (last seen: {value!r})"
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(interval)


def fresh_reports(server: ServerThread) -> dict[str, dict]:
    """Every replica's report (FleetEngine.replica_reports), each made after this call began, so a
    test reads counters that include what it did before, without waiting out a poll period.

    A command reaches a replica as the answer to one of its polls, and the replica makes its next
    report only after that poll returned; the controller keeps the report a poll brings before it
    hands that poll its commands. So once a second command has run on every replica, the report the
    controller holds for each comes from a poll after the one that took the first command. The
    command is check_integrity, the one a replica runs with no arguments (it changes nothing)."""
    controller = server.engine.controller
    for _ in range(2):
        controller.fan_out.remote("check_integrity").result(timeout_s=60)
    return server.engine.replica_reports()


class Clients:
    """Sync stubs on one channel (TLS when given the server's certificate)."""

    def __init__(self, address: str, root_certificates: bytes | None = None) -> None:
        if root_certificates is None:
            self.channel = grpc.insecure_channel(address)
        else:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.PrefixAdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def openai_client(st: ServerThread, api_key: str = "unused") -> Any:
    """The official client (openai.OpenAI) on a server's HTTP API, no retries."""
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{st.server.http_port}/v1", api_key=api_key, max_retries=0,
                         timeout=60)


def raw(st: ServerThread, method: str, path: str, body: bytes | str | dict | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
    """(status, parsed JSON body or text) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http_port, timeout=60)
    try:
        data = json.dumps(body) if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    finally:
        conn.close()


def assert_error(status_body: tuple[int, object], status: int, code: str, param: str | None = None) -> dict:
    """The `error` object of an HTTP answer in OpenAI's shape, checked: this status, code and param."""
    got_status, body = status_body
    assert got_status == status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def greedy_request(prompt: str = "", prefix: str = "", max_tokens: int = 12, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prefix_name=prefix, prompt=prompt,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def collect(stream) -> tuple[str, list[int], pb.GenerateResponse]:
    """(text, token ids, last message) of a Generate stream."""
    text, ids, last = [], [], None
    for msg in stream:
        text.append(msg.text)
        ids.extend(msg.token_ids)
        last = msg
    return "".join(text), ids, last


def slow_steps(engine, seconds: float) -> Callable[[], None]:
    """Make every engine step take at least `seconds` (so a stream is surely mid-flight); returns undo."""
    core = engine._core
    step = core.step

    def slow() -> None:
        time.sleep(seconds)
        step()

    core.step = slow
    return lambda: setattr(core, "step", step) if core.step is slow else None


def with_server(config: ServiceConfig, **changes: Any) -> ServiceConfig:
    return dataclasses.replace(config, server=dataclasses.replace(config.server, **changes))


@contextlib.contextmanager
def started_servers(model_dir: Path, tmp_path: Path, monkeypatch, *,
                    prefixes: tuple[TemplateSpec, ...] = ()) -> Iterator[Callable[..., ServerThread]]:
    """The body of a `make_server` fixture: make_server(token=None, warmup_hook=None, **config)
    starts a ServerThread (make_config's keys; `prefixes` by default); after the test each one is
    checked (check_clean: integrity, no request or block left) and stopped."""
    started: list[ServerThread] = []

    def factory(token: str | None = None, warmup_hook: Any = None, **kwargs: Any) -> ServerThread:
        if token is None:
            monkeypatch.delenv(TOKEN_ENV, raising=False)
        else:
            monkeypatch.setenv(TOKEN_ENV, token)
        kwargs.setdefault("prefixes", prefixes)
        kwargs.setdefault("state_file", tmp_path / f"state{len(started)}.json")
        st = ServerThread(make_config(kwargs.pop("model", model_dir), **kwargs), warmup_hook=warmup_hook)
        started.append(st)
        return st.start()

    try:
        yield factory
    finally:
        try:
            for st in started:
                if st.engine is not None:
                    st.check_clean()
        finally:
            for st in started:
                st.stop()


def self_signed_cert(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> tuple[Path, Path]:
    """A fresh self-signed certificate (EC P-256) for these names and IPs: (cert.pem, key.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run what starts inside (engine threads included: each thread takes the count when it first
    runs an op) on n intra-op threads. The server tests put a server, its gRPC threads and many
    clients in one process on a 2-core machine; a second intra-op thread for a tiny model then
    mostly spins (OpenMP waits actively) and slows every engine step many times over."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
