"""PrefixServer: the process around the servicers. Start order:

    check admin exposure, read the state file  (fail fast, before anything heavy)
    bind and start gRPC; health NOT_SERVING   (probes answer during startup)
    load the engine, warm up every template   (YAML first, then the state file's)
    health SERVING

Stop (SIGTERM/SIGINT, or stop()): health NOT_SERVING, refuse new calls, give in-flight calls
server.grace_period_s to finish, cancel the rest (which aborts their requests and frees their
blocks), then shut the engine down. A second signal cuts the grace short.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefix_service.config import ServiceConfig
from prefix_service.engine import Engine
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.server.admin import PrefixAdminServicer
from prefix_service.server.auth import AdminAuth, check_admin_exposure, read_token
from prefix_service.server.generation import GenerationServicer
from prefix_service.server.runtime import Runtime
from prefix_service.server.store import TemplateSource, TemplateStore
from prefix_service.server.templates import TemplateRegistry
from prefix_service.server.warmup import WarmupHook, warm_up

log = logging.getLogger("prefix_service.server")

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["PrefixAdmin"].full_name


def state_path(config: ServiceConfig) -> Path | None:
    """server.state_file, else <config stem>.state.json next to the config file, else None."""
    if config.server.state_file:
        return Path(config.server.state_file)
    if config.source:
        src = Path(config.source)
        return src.with_name(f"{src.stem}.state.json")
    return None


class PrefixServer:
    def __init__(self, config: ServiceConfig, *, engine_factory: Callable[[ServiceConfig], Engine] = Engine,
                 warmup_hook: WarmupHook | None = None) -> None:
        self.config = config
        self.runtime = Runtime()
        self._engine_factory = engine_factory
        self._warmup_hook = warmup_hook
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._generation = GenerationServicer(self.runtime)
        self._stopped = asyncio.Event()
        self._stopping = False
        self.port: int | None = None

    @property
    def engine(self) -> Engine | None:
        return self.runtime.engine

    @property
    def services(self) -> list[str]:
        return [GENERATION_SERVICE] + ([ADMIN_SERVICE] if self.config.server.enable_admin else [])

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.services]:
            await self._health.set(name, status)

    async def start(self) -> int:
        """Bind, load, warm up; returns the bound port once health reports SERVING."""
        cfg = self.config.server
        token = read_token(cfg)
        check_admin_exposure(cfg, token)
        path = state_path(self.config)
        store = TemplateStore(path) if path is not None else None
        restored = store.load() if store is not None else []
        if store is None:
            log.warning("no state file (server.state_file is unset and the config has no file): templates "
                        "added at run time will not survive a restart")

        self._grpc = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self._generation, self._grpc)
        if cfg.enable_admin:
            pb_grpc.add_PrefixAdminServicer_to_server(PrefixAdminServicer(self.runtime, AdminAuth(token)), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        if cfg.enable_reflection:
            reflection.enable_server_reflection(
                [*self.services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME], self._grpc)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self.port = self._grpc.add_insecure_port(cfg.address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {cfg.address}: {e} (is another server using the port?)") from None
        await self._grpc.start()
        log.info("listening on %s:%d (health NOT_SERVING until warmup ends); admin %s", cfg.host, self.port,
                 "disabled" if not cfg.enable_admin else "needs a bearer token" if token else "open on loopback")
        try:
            pinned = await self._load_and_warm(store, restored)
        except BaseException:
            await self.stop(grace=0)
            raise
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.runtime.ready = True
        log.info("SERVING on %s:%d: %d prefix templates pinned", cfg.host, self.port, pinned)
        return self.port

    async def _load_and_warm(self, store: TemplateStore | None, restored: list[TemplateSource]) -> int:
        loop = asyncio.get_running_loop()
        self.runtime.phase = "loading the model"
        self.runtime.engine = await loop.run_in_executor(self.runtime.executor, self._engine_factory, self.config)
        self.runtime.registry = TemplateRegistry(self.runtime.engine, store)
        configured = [TemplateSource(p.name, content=None if p.system_prompt is not None else p.read_text(),
                                     system_prompt=p.system_prompt, origin="config")
                      for p in self.config.prefixes]
        self.runtime.phase = "warming up its prefix templates"
        return await loop.run_in_executor(self.runtime.executor, warm_up, self.runtime.registry, configured,
                                          restored, self._warmup_hook)

    async def stop(self, grace: float | None = None) -> None:
        """Drain (grace seconds, default server.grace_period_s), cancel what is left, stop the engine."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        grace = self.config.server.grace_period_s if grace is None else grace
        self.runtime.phase = "shutting down"
        try:
            await self._health.enter_graceful_shutdown()
            if self._grpc is not None:
                await self._grpc.stop(grace)
            await self._generation.drain_aborts()
        finally:
            engine = self.runtime.engine
            self.runtime.ready = False
            if engine is not None:
                await asyncio.get_running_loop().run_in_executor(self.runtime.executor, engine.shutdown)
            self.runtime.executor.shutdown(wait=False)
            self._stopped.set()
            log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: ServiceConfig, **kwargs) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    server = PrefixServer(config, **kwargs)
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
            return
        waiter.cancel()
        start.result()  # startup errors propagate
        example = f"--prefix {config.prefixes[0].name} " if config.prefixes else ""
        log.info("try: prefix-service generate --address %s:%d %s'Hello'", config.server.host, server.port, example)
        await signalled.wait()
        await server.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
