"""The parts a PrefixServer is built from, and the one-process ones it uses by default.

    PrefixServer(config, engine_provider=..., http_front=...)

    EngineProvider   loads the engine client and the template registry, attaches them to the
                     Runtime, pins the templates; releases what it started when the server stops
    HttpFront        serves the OpenAI HTTP API on server.http_address

| part | one process (the defaults) | a fleet on Ray Serve (fleet/launcher.py) |
| --- | --- | --- |
| engine provider | `LocalEngineProvider` | `FleetEngineProvider` |
| HTTP front | `UvicornHttpFront` | `ServeProxyHttpFront` |

PrefixServer owns the rest (gRPC, health, admin, metrics, the state file, the stop sequence) and
hands each part a ServerContext when it starts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from prefix_service.config import ServiceConfig
from prefix_service.engine import Engine
from prefix_service.errors import EngineStopped
from prefix_service.server.auth import ApiKeyAuth
from prefix_service.server.http import HttpServer
from prefix_service.server.metrics import ServiceMetrics
from prefix_service.server.runtime import Runtime
from prefix_service.server.store import TemplateSource, TemplateStore, snapshot_dir
from prefix_service.server.templates import TemplateRegistry
from prefix_service.server.tls import TlsFiles
from prefix_service.server.warmup import WarmupHook, warm_up

# After the grace period the front ends answer what is still in flight (gRPC and HTTP alike); their
# servers wait this much longer for those answers to go out before they cancel what still runs
CUT_OFF_S = 1.0


@dataclass(frozen=True)
class ServerContext:
    """What a PrefixServer shares with its parts."""
    config: ServiceConfig
    runtime: Runtime  # where the engine client and registry go (Runtime.attach)
    metrics: ServiceMetrics
    served_name: str  # the base model's id over HTTP
    stopping: threading.Event  # set when the server's stop begins (any thread may look)


class EngineProvider(Protocol):
    """Brings up the engine client and template registry a PrefixServer serves."""

    async def load(self, ctx: ServerContext, store: TemplateStore | None, restored: Sequence[TemplateSource]) -> int:
        """Load the engine client and registry and attach them to ctx.runtime as soon as they exist
        (a stop during the warm-up then shuts the engine down), then pin the templates: the
        config's, then `restored` (read from `store`, the state file, which admin adds keep
        writing). Returns how many templates are pinned. Runs on the server's event loop: blocking
        work goes to a worker thread. Raising fails the server's start."""
        ...

    async def close(self) -> None:
        """Release what load started, once the server has stopped (front ends drained, the engine
        client shut down). Called once per server, also when load failed or never ran."""


class HttpFront(Protocol):
    """Serves the OpenAI-compatible HTTP API (server.http_address)."""

    async def start(self, ctx: ServerContext, address: str, tls: TlsFiles | None, api_key: str | None) -> int:
        """Listen on address (port 0: any free one) with TLS when given and the API key when set;
        returns the port. Runs before the engine is loaded: until ctx.runtime is ready the API
        answers 503."""
        ...

    async def stop(self, grace: float) -> None:
        """Refuse new calls, give those in flight `grace` seconds, then cancel them (which aborts
        their requests). Called once when the server stops, also when start never ran."""


def with_snapshot_dir(config: ServiceConfig, store: TemplateStore | None) -> ServiceConfig:
    """cache.snapshot_dir unset: a folder next to the state file (store.snapshot_dir: state.json:
    state.snapshots/); without a state file, none."""
    cache = config.engine.cache
    if cache.snapshot_dir is not None or store is None:
        return config
    folder = snapshot_dir(config, store.path)
    return dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, cache=dataclasses.replace(cache, snapshot_dir=str(folder))))


class LocalEngineProvider:
    """The engine in this process: engine_factory builds it (on a worker thread), a
    TemplateRegistry over it keeps the admin templates in the state file, and warm_up pins the
    templates (warmup_hook, for tests, runs before each one)."""

    def __init__(self, engine_factory: Callable[[ServiceConfig], Engine] = Engine,
                 warmup_hook: WarmupHook | None = None) -> None:
        self.engine_factory = engine_factory
        self.warmup_hook = warmup_hook

    async def load(self, ctx: ServerContext, store: TemplateStore | None, restored: Sequence[TemplateSource]) -> int:
        loop = asyncio.get_running_loop()
        runtime, config = ctx.runtime, ctx.config
        runtime.phase = "loading the model"
        engine = await loop.run_in_executor(runtime.executor, self._build, ctx, with_snapshot_dir(config, store))
        registry = TemplateRegistry(engine, store, config.server.max_template_bytes)
        runtime.attach(engine, registry)
        configured = [TemplateSource(p.name, content=None if p.system_prompt is not None else p.read_text(),
                                     system_prompt=p.system_prompt, origin="config",
                                     structured=p.structured_output)
                      for p in config.prefixes]
        runtime.phase = "warming up its prefix templates"
        return await loop.run_in_executor(runtime.executor, warm_up, registry, configured, restored,
                                          self.warmup_hook)

    def _build(self, ctx: ServerContext, config: ServiceConfig) -> Engine:
        """engine_factory, on a worker thread that a stop cannot interrupt: runtime.loading says it runs,
        and an engine that arrives after the server's stop began is shut down here, not left running."""
        ctx.runtime.loading = True
        try:
            engine = self.engine_factory(config)
        finally:
            ctx.runtime.loading = False
        if ctx.stopping.is_set():
            engine.shutdown()
            raise EngineStopped("the server stopped while the model loaded")
        return engine

    async def close(self) -> None:
        """Nothing beyond the engine, which the server has shut down."""


class UvicornHttpFront:
    """The OpenAI API over the server's Runtime, on uvicorn on the server's own event loop."""

    def __init__(self) -> None:
        self._server: HttpServer | None = None
        self._api: Any = None  # the OpenAIApi

    async def start(self, ctx: ServerContext, address: str, tls: TlsFiles | None, api_key: str | None) -> int:
        from prefix_service.server.openai_api import OpenAIApi  # fastapi loads only when HTTP is on
        self._api = OpenAIApi(ctx.runtime, ctx.metrics, ApiKeyAuth(api_key), ctx.served_name)
        self._server = HttpServer(self._api.app, address, certfile=tls.cert_file if tls else None,
                                  keyfile=tls.key_file if tls else None)
        return await self._server.start(ctx.config.server.grace_period_s + CUT_OFF_S)

    async def stop(self, grace: float) -> None:
        """In-flight responses get `grace` seconds; then the API answers what is left (an error event
        ends a stream, a 503 any other response), which uvicorn gets CUT_OFF_S more seconds to
        send before it cancels what still runs (a client that does not read)."""
        if self._server is not None:
            cut = asyncio.get_running_loop().call_later(grace, self._api.cut_off)
            try:
                await self._server.stop(grace + CUT_OFF_S)
            finally:
                cut.cancel()
