"""Runtime: what the servicers share. The gRPC server starts before the model is loaded (so
health checks answer NOT_SERVING during startup); the engine and registry appear when loaded,
and `ready` turns true once every configured template is pinned. The engine and registry are the
declared interfaces (interfaces.py): one process's Engine and TemplateRegistry, or the fleet's
clients."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from prefix_service.engine.threads import compute_executor
from prefix_service.server.interfaces import EngineClient, TemplateRegistryClient
from prefix_service.server.status import ServerNotReady


def rpc_executor(nice: int = 0) -> concurrent.futures.ThreadPoolExecutor:
    """The servicers' pool; nice: its threads' place below the process, the engine's (threads.py):
    they tokenize and compile grammars, compute that shares the cores with a step."""
    return compute_executor(32, nice, "prefix-service-rpc")


@dataclass
class Runtime:
    engine: EngineClient | None = None
    registry: TemplateRegistryClient | None = None
    ready: bool = False
    # stopping, its calls in flight draining: health and the ready gauge say not ready at once (as
    # gRPC health's NOT_SERVING), while a call that got through the transports still runs
    draining: bool = False
    phase: str = "starting"  # what the server is doing while not ready: for error messages
    loading: bool = False  # a worker thread is loading the model (a stop cannot interrupt it)
    # Blocking calls of the servicers (tokenize + submit, abort, template admin) run here, apart
    # from asyncio's small default pool, so a few long template adds cannot hold up generation.
    executor: concurrent.futures.ThreadPoolExecutor = field(default_factory=rpc_executor)

    def attach(self, engine: EngineClient, registry: TemplateRegistryClient) -> None:
        """The engine client and registry, once loaded (before the warm-up: a stop during it then
        shuts the engine down); `ready` stays false until the server has pinned its templates."""
        self.engine, self.registry = engine, registry

    def require_ready(self) -> tuple[EngineClient, TemplateRegistryClient]:
        if not (self.ready or self.draining) or self.engine is None or self.registry is None:
            raise ServerNotReady(f"the server is {self.phase}; retry when its health service reports SERVING")
        return self.engine, self.registry
