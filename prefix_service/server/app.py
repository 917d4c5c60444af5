"""PrefixServer: the process around the servicers, built from two parts (parts.py): an engine
provider, which brings up the engine client and template registry, and an HTTP front. The
defaults run the engine in this process and the HTTP API on uvicorn; a fleet passes its own
(fleet/launcher.py, `fleet_server`). Start order:

    check admin exposure, TLS files, the state file   (fail fast, before anything heavy)
    bind and start gRPC (and server.admin_address, the metrics endpoint, the HTTP front on
    server.http_address); health NOT_SERVING (HTTP: /health answers 503)
    the engine provider: load the engine, warm up every template   (YAML first, then the state file's)
    health SERVING

Stop (SIGTERM/SIGINT, or stop()): health NOT_SERVING, refuse new calls, give in-flight calls
(gRPC and HTTP alike) server.grace_period_s to finish, cancel the rest (which aborts their
requests and frees their blocks), then shut the engine down and close the engine provider. A
second signal cuts the grace short.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefix_service.config import ConfigError, ServiceConfig, split_address
from prefix_service.engine.api import Engine
from prefix_service.engine.threads import thread_nice
from prefix_service.heap import freeze_startup_objects
from prefix_service.server.admin import PrefixAdminServicer
from prefix_service.server.auth import AdminAuth, check_admin_exposure, read_api_key, read_token, warn_cleartext_token
from prefix_service.server.generation import GenerationServicer
from prefix_service.server.interfaces import EngineClient
from prefix_service.server.metrics import ServiceMetrics
from prefix_service.server.parts import (CUT_OFF_S, EngineProvider, HttpFront, LocalEngineProvider, ServerContext,
                                         UvicornHttpFront)
from prefix_service.server.runtime import Runtime, rpc_executor
from prefix_service.server.store import TemplateStore, state_path
from prefix_service.server.templates import template_bytes
from prefix_service.server.tls import TlsFiles, load_tls
from prefix_service.server.wire import ADMIN_SERVICE, GENERATION_SERVICE, add_admin, add_generation

log = logging.getLogger("prefix_service.server")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The exit status after a device error that broke the engine (its GPU context is unusable): the
# process ends so that its supervisor (systemd, Kubernetes, the fleet) starts a fresh one.
EXIT_DEVICE_ERROR = 70


class PrefixServer:
    """engine_provider: brings up the engine and its templates (default: LocalEngineProvider, an
    Engine in this process); http_front: serves the HTTP API when server.http_address is set
    (default: UvicornHttpFront, on this server's event loop)."""

    def __init__(self, config: ServiceConfig, *, engine_provider: EngineProvider | None = None,
                 http_front: HttpFront | None = None) -> None:
        self.config = config
        self.runtime = Runtime(executor=rpc_executor(thread_nice(config.engine.model)))
        self.metrics = ServiceMetrics(self.runtime)
        self.engine_provider: EngineProvider = engine_provider or LocalEngineProvider()
        self.http_front: HttpFront = http_front or UvicornHttpFront()
        self._grpc: grpc.aio.Server | None = None
        self._admin_grpc: grpc.aio.Server | None = None  # only with server.admin_address
        self._health = health.aio.HealthServicer()
        self._stopped = asyncio.Event()
        self._stopping = threading.Event()
        self.port: int | None = None  # generation (and admin without server.admin_address)
        self.admin_port: int | None = None  # where PrefixAdmin listens; None when disabled
        self.metrics_port: int | None = None  # the Prometheus endpoint; None when off
        self.http_port: int | None = None  # the OpenAI-compatible HTTP API; None when off
        model = config.engine.model
        self.served_name = model.served_name or Path(model.path).name  # the base model's id over HTTP
        self._generation = GenerationServicer(self.runtime, self.metrics, self.served_name)
        self.context = ServerContext(config, self.runtime, self.metrics, self.served_name, self._stopping)
        # after a device error, or a signal during the model load; tests record it instead
        self._exit: Callable[[int], Any] = os._exit
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine(self) -> EngineClient | None:
        return self.runtime.engine

    @property
    def services(self) -> list[str]:
        return [GENERATION_SERVICE] + ([ADMIN_SERVICE] if self.config.server.enable_admin else [])

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.services]:
            await self._health.set(name, status)

    def _grpc_server(self, services: list[str]) -> grpc.aio.Server:
        """A grpc.aio server with health (one servicer shared by every address) and reflection.
        Without port sharing: gRPC turns SO_REUSEPORT on by default, so a second server started on
        a port another gRPC server holds bound it too, and the kernel split the calls between them."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.config.server.enable_reflection:
            reflection.enable_server_reflection([*services, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
        return server

    @staticmethod
    def _bind(server: grpc.aio.Server, address: str, tls: TlsFiles | None, key: str) -> int:
        _check_free(address, key)  # gRPC's own refusal comes with a C-core log line and a vague message
        try:
            port: int = (server.add_insecure_port(address) if tls is None
                         else server.add_secure_port(address, tls.grpc_credentials()))
            return port
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address} ({key}): {e} (is another server using the port?)") from None

    async def start(self) -> int:
        """Bind, load, warm up; returns the bound port once health reports SERVING."""
        cfg = self.config.server
        token = read_token(cfg)
        check_admin_exposure(cfg, token)
        warn_cleartext_token(cfg, token)
        tls = load_tls(cfg)
        check_template_files(self.config)
        path = state_path(self.config)
        store = TemplateStore(path) if path is not None else None
        restored = store.load() if store is not None else []
        if store is None:
            log.warning("no state file (server.state_file is unset and the config has no file): templates "
                        "added at run time will not survive a restart")

        separate_admin = cfg.enable_admin and cfg.admin_address is not None
        self._grpc = self._grpc_server([GENERATION_SERVICE] if separate_admin else self.services)
        add_generation(self._generation, self._grpc)
        if cfg.enable_admin:
            if separate_admin:
                self._admin_grpc = self._grpc_server([ADMIN_SERVICE])
                self._admin_grpc.add_generic_rpc_handlers([_ServedElsewhere(GENERATION_SERVICE, lambda: (
                    f"the Generation service is served on server.address (port {self.port}), not on "
                    f"server.admin_address"))])
            add_admin(PrefixAdminServicer(self.runtime, AdminAuth(token)), self._admin_grpc or self._grpc)
        if separate_admin or not cfg.enable_admin:
            self._grpc.add_generic_rpc_handlers([_ServedElsewhere(ADMIN_SERVICE, lambda: (
                f"the PrefixAdmin service is served on server.admin_address (port {self.admin_port}), not on "
                f"server.address" if separate_admin else "the PrefixAdmin service is off on this server "
                "(server.enable_admin: false)"))])
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._bind(self._grpc, cfg.address, tls, "server.address")
        if self._admin_grpc is not None:
            self.admin_port = self._bind(self._admin_grpc, cfg.admin_bind_address, tls, "server.admin_address")
        elif cfg.enable_admin:
            self.admin_port = self.port
        try:
            await self._grpc.start()
            if self._admin_grpc is not None:
                await self._admin_grpc.start()
            if cfg.metrics_address:
                self.metrics_port = self.metrics.serve(cfg.metrics_address, tls.cert_file if tls else None,
                                                       tls.key_file if tls else None)
            api_key = read_api_key(cfg)
            if cfg.http_address:
                self.http_port = await self.http_front.start(self.context, cfg.http_address, tls, api_key)
            admin = "disabled" if not cfg.enable_admin else (
                f"on port {self.admin_port}, " + ("needs a bearer token" if token else "open on loopback"))
            metrics = "off" if self.metrics_port is None else f"on port {self.metrics_port} (/metrics)"
            http = "off" if self.http_port is None else (
                f"on port {self.http_port} (OpenAI API, " + ("needs an API key)" if api_key else "no API key)"))
            log.info("listening on %s:%d (%s; health NOT_SERVING until warmup ends); admin %s; metrics %s; HTTP %s",
                     cfg.host, self.port, "TLS" if tls else "plaintext", admin, metrics, http)
            self._loop = asyncio.get_running_loop()
            pinned = await self.engine_provider.load(self.context, store, restored)
            engine = self.runtime.engine
            if isinstance(engine, Engine):  # in this process (a fleet's replicas handle their own)
                engine.on_fatal = self._engine_failed
        except BaseException:
            await self.stop(grace=0)
            raise
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.runtime.ready = True
        log.info("SERVING on %s:%d: %d prefix templates pinned", cfg.host, self.port, pinned)
        return self.port

    def _engine_failed(self, error: BaseException) -> None:
        """Engine.on_fatal, on the engine's thread: health NOT_SERVING, then the process ends."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._end_after_device_error(error)))

    async def _end_after_device_error(self, error: BaseException) -> None:
        self.runtime.ready = self.runtime.draining = False
        self.runtime.phase = f"stopped after a device error ({error})"
        try:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            log.critical("the engine stopped after a device error; health NOT_SERVING; exiting with status %d so "
                         "that the process is restarted: %s", EXIT_DEVICE_ERROR, error)
            for handler in logging.getLogger().handlers:
                handler.flush()
            # no graceful stop: the engine's CUDA context is broken, and a shutdown could block in it
            self._exit(EXIT_DEVICE_ERROR)

    def _cut_off(self) -> None:
        """The grace period is over: what is still in flight ends now, counted UNAVAILABLE."""
        self.metrics.cutting_off = True
        self._generation.cut_off()

    async def stop(self, grace: float | None = None) -> None:
        """Drain (grace seconds, default server.grace_period_s), cancel what is left, stop the
        engine, close the engine provider."""
        if self._stopping.is_set():
            await self._stopped.wait()
            return
        self._stopping.set()
        grace = self.config.server.grace_period_s if grace is None else grace
        self.runtime.phase = "shutting down"
        self.runtime.draining, self.runtime.ready = self.runtime.ready, False
        cut_off = asyncio.get_running_loop().call_later(grace, self._cut_off)
        try:
            await self._health.enter_graceful_shutdown()
            servers = [s for s in (self._grpc, self._admin_grpc) if s is not None]
            # gRPC's own cancel comes CUT_OFF_S after the service's, which answers in its own words
            await asyncio.gather(*(s.stop(grace + CUT_OFF_S) for s in servers), self.http_front.stop(grace))
            await self._generation.drain_aborts()
        finally:
            cut_off.cancel()
            try:
                engine = self.runtime.engine
                self.runtime.ready = self.runtime.draining = False
                if engine is not None:
                    await asyncio.get_running_loop().run_in_executor(self.runtime.executor, engine.shutdown)
                self.runtime.executor.shutdown(wait=False)
                self.metrics.stop()
                log.info("stopped")
            finally:
                try:
                    await self.engine_provider.close()
                finally:
                    self._stopped.set()



class _ServedElsewhere(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Every method of `service` on a server that does not serve it: UNIMPLEMENTED with `message()`,
    which says where it is served (gRPC's own answer is a bare "Method not found!")."""

    def __init__(self, service: str, message: Callable[[], str]) -> None:
        self._prefix, self._message = f"/{service}/", message

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not details.method.startswith(self._prefix):
            return None

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, self._message())
        return grpc.unary_unary_rpc_method_handler(refuse)


def _check_free(address: str, key: str) -> None:
    """OSError naming `key` when another socket holds the address's port (as gRPC binds it: address
    reuse for a port in TIME_WAIT, no port sharing). Port 0, or a host that does not resolve: gRPC's
    bind decides."""
    host, port = split_address(address, key)
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, where in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(f"cannot listen on {address} ({key}): {e.strerror} (is another server using the "
                                  f"port?)") from None
                return  # not a port clash (an address not on this machine, say): gRPC's bind reports it


def check_template_files(config: ServiceConfig) -> None:
    """Read the config's template files before anything heavy: a missing, unreadable, empty or
    oversized file is a ConfigError naming its template now, not after the model has loaded (which
    on a large model takes minutes)."""
    for spec in config.prefixes:
        if spec.file is None:
            continue
        text = spec.read_text()  # ConfigError naming prefixes[name].file
        if not text:
            raise ConfigError(f"prefixes[{spec.name}].file: {spec.file} is empty")
        size = template_bytes(text)
        if size > config.server.max_template_bytes:
            raise ConfigError(f"prefixes[{spec.name}].file: {spec.file} has {size} bytes; templates may have at "
                              f"most {config.server.max_template_bytes} (server.max_template_bytes)")


async def serve(config: ServiceConfig, make_server: Callable[..., PrefixServer] = PrefixServer,
                **kwargs: Any) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully. make_server(config, **kwargs) builds the
    server: PrefixServer, or the fleet's fleet_server (prefix_service/fleet/launcher.py), which
    the CLI picks for a config with ray."""
    server = make_server(config, **kwargs)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if not signalled.is_set():
            log.info("%s: draining in-flight requests (up to %.0f s; signal again to cancel them now)",
                     sig.name, config.server.grace_period_s)
            signalled.set()
        elif server.engine is not None:
            log.info("%s again: cancelling in-flight requests now", sig.name)
            # ends every request at once (their calls get UNAVAILABLE), so the drain finishes
            loop.run_in_executor(None, server.engine.shutdown)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        start = asyncio.ensure_future(server.start())
        waiter = asyncio.ensure_future(signalled.wait())
        await asyncio.wait([start, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # signalled during startup
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            await server.stop(grace=0)
            if server.runtime.loading:  # the process would wait for the load's worker thread at its exit
                log.info("stopped during the model load: exiting now, without waiting for the load to end")
                for handler in logging.getLogger().handlers:
                    handler.flush()
                server._exit(0)
            return
        waiter.cancel()
        start.result()  # startup errors propagate
        freeze_startup_objects()  # later collections walk only what serving allocates (prefix_service/heap.py)
        example = f"--template {config.prefixes[0].name} " if config.prefixes else ""
        tls = "--tls-ca CERT.pem " if config.server.tls else ""
        log.info("try: prefix-service generate --address %s:%d %s%s'Hello'", config.server.host, server.port, tls,
                 example)
        if server.http_port is not None:
            scheme = "https" if config.server.tls else "http"
            host = split_address(config.server.http_address, "server.http_address")[0]
            log.info("or: curl %s://%s:%d/v1/completions -H 'Content-Type: application/json' -d '{\"model\": %s, "
                     "\"prompt\": \"Hello\", \"max_tokens\": 16}'", scheme, host, server.http_port,
                     json.dumps(config.prefixes[0].name if config.prefixes else server.served_name))
        await signalled.wait()
        await server.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
