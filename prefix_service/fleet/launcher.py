"""fleet_server: a PrefixServer whose parts (server/parts.py) are a fleet of engine replicas on Ray
Serve (FleetEngineProvider) and Ray Serve's HTTP proxy (ServeProxyHttpFront).

    gRPC (Generation, PrefixAdmin, health)   this process: our servicers over FleetEngine, which
                                              calls the replicas' deployment handle
    HTTP (the OpenAI API)                    Ray Serve's proxy -> HttpIngress (OpenAIApi over
                                              FleetEngine, in a replica of its own) -> the handle
    EngineReplica x N                        one Engine each; TemplateRouter picks among them
    FleetController x 1                      members, placement, admin fan-out, the state file

docs/scale-out.md says why gRPC stays on our servicer rather than Ray Serve's gRPC proxy.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Sequence

import ray
from ray import serve

from prefix_service import envs
from prefix_service.config import RayConfig, ServiceConfig, split_address
from prefix_service.errors import EngineStopped
from prefix_service.fleet import SERVE_ENV
from prefix_service.fleet.calls import call_sync
from prefix_service.server.app import PrefixServer
from prefix_service.server.parts import ServerContext
from prefix_service.server.store import TemplateSource, TemplateStore
from prefix_service.server.tls import TlsFiles

log = logging.getLogger("prefix_service.fleet")

REPLICA_DEPLOYMENT = "EngineReplica"
CONTROLLER_DEPLOYMENT = "FleetController"
INGRESS_DEPLOYMENT = "HttpIngress"
ROUTER_CLASS = "prefix_service.fleet.router:TemplateRouter"
# no line per call (the controller answers a poll or a route lookup several times a second)
QUIET = {"enable_access_log": False}
METRICS_TIMEOUT_S = 5.0  # a scrape's wait for the HTTP ingress's series
INGRESS_STOP_MARGIN_S = 10.0  # a stop's wait for the HTTP ingress to drain, beyond the grace period and cut-off


class HttpIngress:
    """The OpenAI HTTP API as a Ray Serve ingress deployment (built by build_app)."""

    # Ray Serve awaits an async constructor, which the type checker's rule for __init__ does not know
    async def __init__(self, config: ServiceConfig, replicas: Any, controller: Any,  # type: ignore[misc]
                       served_name: str) -> None:
        from prefix_service.fleet import log_to_serve
        from prefix_service.fleet.client import FleetEngine, FleetRegistry
        from prefix_service.model.loader import load_tokenizer
        from prefix_service.server.auth import ApiKeyAuth, read_api_key
        from prefix_service.server.metrics import ServiceMetrics
        from prefix_service.server.openai_api import OpenAIApi
        from prefix_service.server.runtime import Runtime

        log_to_serve()  # its request log lines, as a single process writes them, to its Ray Serve log
        engine = FleetEngine(replicas, controller, load_tokenizer(config.engine.model.path))
        await engine.start()
        self.runtime = Runtime(engine, FleetRegistry(engine), ready=True)
        # the per-request series only: the gRPC front end's endpoint reports the fleet and adds these
        self.metrics = ServiceMetrics(self.runtime, requests_only=True)
        # the key is read here, from the environment of the node this replica runs on
        self.api = OpenAIApi(self.runtime, self.metrics, ApiKeyAuth(read_api_key(config.server)), served_name)

    def __serve_build_asgi_app__(self) -> Any:
        return self.api.app

    def metrics_text(self) -> str:
        """The HTTP calls' series (OpenMetrics text), for the front end's /metrics."""
        return self.metrics.text()

    async def begin_stop(self, grace: float) -> None:
        """The server is stopping (ServeProxyHttpFront.stop), as a single process's HTTP server does:
        new calls and /health answer 503, those in flight get `grace` seconds, then the API answers
        what is left (OpenAIApi.cut_off: an error event ends a stream, a 503 any other response),
        which gets CUT_OFF_S more seconds to go out. Returns once nothing is in flight."""
        from prefix_service.server.parts import CUT_OFF_S
        self.runtime.ready = False
        self.runtime.phase = "shutting down"
        await self._until_idle(grace)
        self.api.cut_off()
        await self._until_idle(CUT_OFF_S)

    async def _until_idle(self, seconds: float) -> None:
        """Until no HTTP call is in flight, at most `seconds`."""
        end = asyncio.get_running_loop().time() + seconds
        while self.api.in_flight() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.05)


def build_app(config: ServiceConfig, state_file: str | None, *, http: bool, served_name: str) -> serve.Application:
    """The Ray Serve application: replicas and controller, behind HttpIngress when HTTP is on."""
    from ray.serve.config import RequestRouterConfig

    from prefix_service.fleet.controller import FleetController
    from prefix_service.fleet.replica import EngineReplica

    rc = config.ray or RayConfig()
    controller = serve.deployment(name=CONTROLLER_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000,
                                  logging_config=QUIET,
                                  # its calls in flight are the replicas' polls: nothing to wait for
                                  graceful_shutdown_timeout_s=1.0, graceful_shutdown_wait_loop_s=0.2,
                                  # the state file is on the head node
                                  ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
                                  )(FleetController).bind(config, state_file, in_serve=True)
    scaling: dict[str, Any] = ({"autoscaling_config": {"min_replicas": rc.min_replicas, "max_replicas": rc.max_replicas,
                                             "target_ongoing_requests": rc.target_ongoing_requests,
                                             "upscale_delay_s": rc.upscale_delay_s,
                                             "downscale_delay_s": rc.downscale_delay_s,
                                             "look_back_period_s": rc.look_back_period_s}}
                     if rc.autoscaling else {"num_replicas": rc.num_replicas})
    # RequestRouterConfig takes the router class or its import path; its pydantic signature says a dict
    # (unused-ignore: a Ray whose signature is right)
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS)  # type: ignore[arg-type, unused-ignore]
    actor: dict[str, Any] = {"num_cpus": rc.num_cpus_per_replica}
    if settings := envs.set_values(envs.ENGINE_SCOPES):  # a replica on another node has not the head's environment
        actor["runtime_env"] = {"env_vars": settings}
    replicas = serve.deployment(name=REPLICA_DEPLOYMENT, max_ongoing_requests=rc.max_ongoing_requests,
                                logging_config=QUIET,
                                ray_actor_options=actor,
                                request_router_config=router,
                                health_check_period_s=2.0, health_check_timeout_s=30.0,
                                graceful_shutdown_timeout_s=config.server.grace_period_s,
                                graceful_shutdown_wait_loop_s=0.5, **scaling
                                )(EngineReplica).bind(config, controller)
    if not http:
        return replicas
    ingress = serve.deployment(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0}, logging_config=QUIET
                               )(serve.ingress()(HttpIngress))
    return ingress.bind(config, replicas, controller, served_name)


def restore_signal_handlers() -> None:
    """ray.init installs Ray's own fatal-signal handler (a SIGTERM dumps a stack and ends the
    process at once, leaving the local cluster's processes behind): give SIGTERM and SIGINT back
    to the handlers Python had, so they reach serve()'s graceful stop. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


# Ray gives a local start windows of 30 s, and raises with one of these texts when it misses one
# (a loaded machine, a slow disk): its GCS server writing its port (a RuntimeError from
# wait_for_persisted_port), then the node registering with the GCS (a bare Exception). A local start
# is tried this many times.
RAY_START_TIMEOUT_TEXTS = ("Timed out waiting for file", "timed out during startup")
RAY_LOCAL_START_ATTEMPTS = 3
# The GCS server's window is a setting: a local start widens it where the environment does not set it.
RAY_GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"
RAY_GCS_PORT_WAIT_S = 120


def start_timed_out(error: BaseException) -> bool:
    """Whether a start of Ray failed by running out of one of its start-up windows."""
    return any(t in str(error) for t in RAY_START_TIMEOUT_TEXTS)


def init_ray(address: str | None, **options: Any) -> bool:
    """ray.init for the fleet: join the cluster at `address` (or $RAY_ADDRESS), else start a local one,
    again (after tearing down what the try left) where Ray's own start-up window ran out, up to
    RAY_LOCAL_START_ATTEMPTS times in all, each giving the GCS server RAY_GCS_PORT_WAIT_S (120 s) to
    come up unless $RAY_gcs_server_port_wait_time_s says otherwise. Joining a cluster is not retried:
    its failure is the cluster's to report. options: more of ray.init's arguments, or other values for the fleet's.
    Returns whether it joined a running cluster (False: it started a local one).

    A local start asks Ray for a new instance ("local"): given no address, ray.init joins the cluster
    last started on this machine (Ray records it in /tmp/ray/ray_current_cluster) where one runs, and
    the fleet, taking it for its own, would shut down that cluster's Ray Serve and Ray at its stop."""
    local = address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        os.environ.setdefault(RAY_GCS_PORT_WAIT_ENV, str(RAY_GCS_PORT_WAIT_S))
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
    kwargs |= options
    attempt = 1
    while True:
        try:
            ray.init(address="local" if local else address, **kwargs)
            return not local
        except Exception as e:  # Ray's start-up timeouts: a bare Exception or a RuntimeError
            if not local or not start_timed_out(e) or attempt == RAY_LOCAL_START_ATTEMPTS:
                raise
            log.warning("the local Ray cluster did not start in time (try %d of %d: %s); starting it again",
                        attempt, RAY_LOCAL_START_ATTEMPTS, e)
            ray.shutdown()
            attempt += 1


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class ServeProxyHttpFront:
    """The HTTP front of a fleet: Ray Serve's proxy, in front of HttpIngress, serves the HTTP API.
    It starts with the fleet, so start() only fixes its address (a free port for port 0), which
    FleetEngineProvider reads when it deploys; Ray Serve's shutdown stops it."""

    def __init__(self) -> None:
        self.plan: tuple[str, int, TlsFiles | None] | None = None  # host, port, TLS; None: no HTTP
        self.ingress: Any = None  # HttpIngress's handle, once deployed (FleetEngineProvider)

    async def start(self, ctx: ServerContext, address: str, tls: TlsFiles | None, api_key: str | None) -> int:
        host, port = split_address(address, "server.http_address")
        port = port or _free_port(host)
        self.plan = (host, port, tls)
        return port

    async def stop(self, grace: float) -> None:
        """The ingress drains as one process's HTTP server does (HttpIngress.begin_stop); the proxy then
        stops with the fleet (FleetEngineProvider.close)."""
        if self.ingress is None:
            return
        from prefix_service.fleet.calls import call
        from prefix_service.server.parts import CUT_OFF_S
        try:
            await call(self.ingress.begin_stop.remote(grace), grace + CUT_OFF_S + INGRESS_STOP_MARGIN_S,
                       "the HTTP ingress")
        except Exception as e:  # noqa: BLE001 - the stop goes on: the fleet's shutdown ends what is left
            log.warning("the HTTP ingress did not drain: %s", e)


class FleetEngineProvider:
    """The engine provider of a fleet (config.ray): starts or joins a Ray cluster, deploys the
    replicas and the controller (behind HttpIngress when `http` has a plan), and attaches a
    FleetEngine and FleetRegistry; the replicas pin the templates themselves and the controller
    keeps the state file. close() tears the fleet down."""

    def __init__(self, ray_config: RayConfig, http: ServeProxyHttpFront) -> None:
        self.ray_config = ray_config
        self.http = http
        self._ray_started = False  # ray.init started a local cluster: it stops with the server
        self._ray_joined = False  # ray.init joined a running cluster: disconnect, leave it running
        self._deployed = False
        # Ray's processes of a local cluster die with the thread that started them (they are
        # its children with a parent-death signal): one thread starts the cluster and stops it.
        self._ray_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray-driver")

    async def load(self, ctx: ServerContext, store: TemplateStore | None, restored: Sequence[TemplateSource]) -> int:
        """`restored` is not used: the controller reads the state file itself (on the head node)."""
        from prefix_service.fleet.client import FleetEngine, FleetRegistry
        from prefix_service.model.loader import load_tokenizer

        loop = asyncio.get_running_loop()
        rc = self.ray_config
        ctx.runtime.phase = "starting the fleet on Ray Serve"
        replicas, controller, ingress = await loop.run_in_executor(
            self._ray_thread, self._deploy, ctx, loop, str(store.path) if store is not None else None)
        self.http.ingress = ingress  # its stop drains the HTTP calls
        if ingress is not None:  # the HTTP calls, counted in the ingress, join this endpoint's series
            ctx.metrics.add_source(lambda: call_sync(ingress.metrics_text.remote(), METRICS_TIMEOUT_S,
                                                     "the HTTP ingress"))
        tokenizer = await loop.run_in_executor(ctx.runtime.executor, load_tokenizer, ctx.config.engine.model.path)
        engine = FleetEngine(replicas, controller, tokenizer)
        await engine.start()
        ctx.runtime.attach(engine, FleetRegistry(engine))
        routes = await engine.routes()  # start() has just fetched them
        members, templates = routes.get("", ()), [name for name in routes if name]
        log.info("fleet %r up: %d replicas (%s), %d templates, template_replication %s", rc.app_name, len(members),
                 ", ".join(members), len(templates), rc.template_replication or "all")
        return len(templates)

    def _deploy(self, ctx: ServerContext, loop: asyncio.AbstractEventLoop,
                state_file: str | None) -> tuple[Any, Any, Any]:
        rc = self.ray_config
        if not ray.is_initialized():
            joined = init_ray(rc.address)
            self._ray_started, self._ray_joined = not joined, joined
            loop.call_soon_threadsafe(restore_signal_handlers)
        if ctx.stopping.is_set():  # stopped while Ray started: deploy nothing
            raise EngineStopped("the server stopped while the fleet was starting")
        plan = self.http.plan
        if plan is not None:
            host, port, tls = plan
            http_options: dict[str, Any] = {"host": host, "port": port}
            if tls is not None:
                http_options |= {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            serve.start(proxy_location="HeadOnly", http_options=http_options, logging_config={"enable_access_log": False})
        else:
            serve.start(proxy_location="Disabled", logging_config={"enable_access_log": False})
        app = build_app(ctx.config, state_file, http=plan is not None, served_name=ctx.served_name)
        settings = envs.set_values(envs.ENGINE_SCOPES)
        log.info("deploying %s replicas of %s on Ray Serve (each loads the model and pins its templates; %s%s)",
                 f"{rc.min_replicas}-{rc.max_replicas}" if rc.autoscaling else rc.num_replicas,
                 ctx.config.engine.model.path, " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in SERVE_ENV),
                 "; kernel settings from this environment: " + envs.listed(settings) if settings else "")
        serve.run(app, name=rc.app_name, route_prefix="/" if plan is not None else None)
        self._deployed = True
        return (serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=rc.app_name),
                serve.get_deployment_handle(CONTROLLER_DEPLOYMENT, app_name=rc.app_name),
                serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=rc.app_name)
                if plan is not None else None)

    async def close(self) -> None:
        """On the thread that started the cluster, after a deployment under way has finished."""
        self.http.ingress = None
        await asyncio.get_running_loop().run_in_executor(self._ray_thread, self._teardown)
        self._ray_thread.shutdown(wait=False)

    def _teardown(self) -> None:
        """A local cluster this process started goes with it; on a cluster it joined only the
        application is deleted (in the background: the cluster finishes the replicas' drain), and
        Ray Serve and the cluster keep running."""
        if self._ray_started:  # the front ends have drained: the cluster's processes just stop
            log.info("stopping the local Ray cluster")
            t0 = time.monotonic()
            serve.shutdown()
            ray.shutdown()
            log.info("local Ray cluster stopped in %.1f s", time.monotonic() - t0)
            self._ray_started = self._deployed = False
        elif self._deployed:
            log.info("deleting the Ray Serve application %r", self.ray_config.app_name)
            try:
                serve.delete(self.ray_config.app_name, _blocking=False)
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("deleting the Ray Serve application failed: %s", e)
            self._deployed = False
        if self._ray_joined:  # disconnect this driver only
            ray.shutdown()
            self._ray_joined = False


def fleet_server(config: ServiceConfig) -> PrefixServer:
    """A PrefixServer whose engine is the fleet (config.ray; `prefix-service serve --ray`): gRPC in
    this process over a FleetEngine, HTTP on Ray Serve's proxy."""
    http = ServeProxyHttpFront()
    return PrefixServer(config, engine_provider=FleetEngineProvider(config.ray or RayConfig(), http),
                        http_front=http)
