"""Helpers for the server tests: a tiny random model, a PrefixServer running in a background
thread on 127.0.0.1 (random free port), and sync gRPC clients for it."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefix_service import synthetic  # noqa: E402
from prefix_service.config import (CacheConfig, EngineConfig, ModelConfig, PrefixSpec, SchedulerConfig,  # noqa: E402
                                   ServerConfig, ServiceConfig)
from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc  # noqa: E402
from prefix_service.server import PrefixServer  # noqa: E402

TOKEN_ENV = "PREFIX_SERVICE_TEST_ADMIN_TOKEN"  # the servers under test read their token from here

# A system prompt and a document for the test templates (words the tiny tokenizer knows).
SYSTEM_PROMPT = "You classify the intent of the user. Answer with one label: order, refund, shipping or account."
DOCUMENT = " ".join(["the table has a row for each order with price and shipping value"] * 6)


def build_tiny_model(root: Path) -> Path:
    tok = synthetic.build_tokenizer(root / "tokenizer")
    return synthetic.build_model(root / "llama", "llama", tok, seed=11)


def make_config(model_dir: Path, *, prefixes: tuple[PrefixSpec, ...] = (), state_file: Path | None = None,
                num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 64, max_queue: int = 1024,
                prefix_budget_blocks: int | None = None, grace_period_s: float = 5.0,
                source: str | None = None, **server: Any) -> ServiceConfig:
    return ServiceConfig(
        EngineConfig(ModelConfig(path=str(model_dir), dtype="float32", device="cpu"),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 prefix_budget_blocks=prefix_budget_blocks),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_queue=max_queue, max_num_batched_tokens=512)),
        ServerConfig(**{"address": "127.0.0.1:0", "admin_token_env": TOKEN_ENV,
                        "state_file": str(state_file) if state_file else None, "grace_period_s": grace_period_s,
                        **server}),
        prefixes, source)


class ServerThread:
    """A PrefixServer on its own event loop in a daemon thread."""

    def __init__(self, config: ServiceConfig, **kwargs: Any) -> None:
        self.config = config
        self.kwargs = kwargs
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
        self.server = PrefixServer(self.config, **self.kwargs)
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
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._stop_grace = grace
            self._loop.call_soon_threadsafe(self._stop.set)
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
                engine.core.check_integrity()
                stats = engine.core.kv_stats()
            if stats["running"] == 0 and stats["waiting"] == 0 and stats["used"] == stats["pinned"]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"requests or blocks left behind: {stats}")
            time.sleep(0.02)


class Clients:
    """Sync stubs on one channel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.PrefixAdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()


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
    core = engine.core
    step = core.step

    def slow() -> None:
        time.sleep(seconds)
        step()

    core.step = slow
    return lambda: setattr(core, "step", step) if core.step is slow else None


def with_server(config: ServiceConfig, **changes: Any) -> ServiceConfig:
    return dataclasses.replace(config, server=dataclasses.replace(config.server, **changes))
