"""Our real gRPC server, in its own process (`python -m prefix_service serve`), called through
prefix_service.client from this one, so the numbers include protobuf, HTTP/2, the servicer's
asyncio loop and tokenization of the text. http_prefix calls the same server's OpenAI HTTP API
(`/v1/completions`, streamed, the template named as the model) as the vLLM peers are called.

The API takes text, not token ids: a prefix request sends the prompt text, a no-prefix request
sends prefix text + prompt text. The workload checked that these tokenize to exactly the ids the
other systems get, and every answer's usage (prompt and prefix tokens) is checked again here.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import grpc
import yaml

from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import System, now
from prefix_service.bench.systems.openai_http import completion_body, stream_completion
from prefix_service.bench.workloads import BenchRequest, Workload
from prefix_service.client import PrefixServiceClient
from prefix_service.config import EngineConfig


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float, log_tail: Callable[[], str]) -> None:
    """Until the server process at address reports SERVING on its health service; RuntimeError
    (with its log's tail) if it exits first, TimeoutError after timeout_s."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the gRPC server exited with code {proc.returncode}:\n{log_tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the gRPC server did not report SERVING within {timeout_s:.0f} s:\n{log_tail()}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`prefix-service serve` on a config written from the benchmark's engine config, with the
    workloads' prefixes as templates; started, waited on until health reports SERVING, stopped.
    extra: more top-level config sections (e.g. `ray`, to serve as a fleet); env: environment
    variables set for the server beside this process's; http: serve the OpenAI HTTP API too, on
    http_port."""

    def __init__(self, engine_config: EngineConfig, workloads: list[Workload], start_timeout_s: float = 900,
                 extra: dict | None = None, env: dict[str, str] | None = None, http: bool = False) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-grpc-")
        folder = Path(self._dir.name)
        self.address = f"127.0.0.1:{_free_port()}"
        self.http_port = _free_port() if http else None
        config = {
            "model": dataclasses.asdict(engine_config.model),
            "cache": dataclasses.asdict(engine_config.cache),
            "scheduler": dataclasses.asdict(engine_config.scheduler),
            "server": {"address": self.address, "http_address": f"127.0.0.1:{self.http_port}" if http else "",
                       "state_file": str(folder / "state.json"), "grace_period_s": 1},
            # one template per name (intent and intent_labels share the intent template)
            "prefixes": [{"name": name, "content": text}
                         for name, text in {w.prefix_name: w.prefix_text for w in workloads if w.has_prefix}.items()],
            **(extra or {}),
        }
        config_path = folder / "bench.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        self.log_path = folder / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "prefix_service", "serve", "--config", str(config_path),
                                      "--log-level", "WARNING"], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self._wait_serving(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, timeout_s: float) -> None:
        wait_serving(self.address, self.proc, timeout_s, self.log_tail)

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._dir.cleanup()


class HttpSystem(System):
    """http_prefix: the server's OpenAI HTTP API, one streamed /v1/completions call per request with
    the prompt's text and the workload's template as the model (its prefix_name), greedy, EOS
    ignored, token ids returned, the usage checked: the requests vLLM's server gets, by text."""
    name = "http_prefix"
    uses_prefix = True

    def __init__(self, server: ServerProcess) -> None:
        assert server.http_port is not None, "the server was started without its HTTP API"
        self.port = server.http_port
        self.usage_mismatches = 0  # answers whose token counts differ from the ids the others get

    def supports(self, workload: Workload) -> bool:
        return workload.has_prefix

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        assert workload.prefix_name is not None
        body = completion_body(workload.prefix_name, req.prompt_text, workload.output_tokens,
                               workload.structured_outputs())
        timing, mismatch = stream_completion(self.port, body, len(workload.prefix_ids) + len(req.prompt_ids),
                                             workload.constrained, timeout_s)
        self.usage_mismatches += mismatch
        return timing


class GrpcSystem(System):
    def __init__(self, server: ServerProcess, use_prefix: bool) -> None:
        self.server = server
        self.uses_prefix = use_prefix
        self.name = "grpc_prefix" if use_prefix else "grpc_no_prefix"
        self.client = PrefixServiceClient(server.address)  # one channel, shared by all threads
        self.usage_mismatches = 0  # answers whose token counts differ from the ids the others get

    def supports(self, workload: Workload) -> bool:
        return workload.has_prefix or not self.uses_prefix

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        by_name = self.uses_prefix and workload.has_prefix
        text = req.prompt_text if by_name else workload.full_text(req)
        constrained = workload.constrained
        constraint = {"structured_output": workload.structured_output()} if constrained else {"ignore_eos": True}
        timing = Timing(start=now())
        try:
            for msg in self.client.generate(text, workload.prefix_name if by_name else None,
                                            max_tokens=workload.output_tokens, timeout=timeout_s, **constraint):
                t = now()
                timing.add_tokens(len(msg.token_ids), t, msg.text if constrained else "")
                if msg.finish_reason:
                    timing.end = t
                    timing.engine_ttft_ms = msg.usage.ttft_ms or None  # 0: no token was sampled
                    self._check_usage(workload, req, msg.usage, by_name)
        except grpc.RpcError as e:
            timing.error = f"{e.code().name}: {e.details()}"
        return timing

    def _check_usage(self, workload: Workload, req: BenchRequest, usage, by_name: bool) -> None:
        want_prompt = len(workload.prefix_ids) + len(req.prompt_ids)
        if usage.prompt_tokens != want_prompt or (by_name and usage.prefix_tokens != len(workload.prefix_ids)):
            self.usage_mismatches += 1

    def close(self) -> None:
        self.client.close()
