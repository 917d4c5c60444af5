"""Shared fixtures: tiny random models (built once per session) and an engine factory whose
engines are integrity-checked and shut down after every test."""
from __future__ import annotations

import os
import sys
from typing import Any
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefix_service import synthetic as models  # noqa: E402
from prefix_service.fleet import use_serve_env  # noqa: E402

use_serve_env()  # the fleet tests run Ray Serve as `serve --ray` does: set before ray.serve loads
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU tensors; the variable must be set before
    # triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402

ARCH_SEEDS = {"llama": 1, "qwen2": 2, "mistral": 3, "qwen3": 4}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return models.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: models.build_model(root / arch, arch, tokenizer_dir, seed=seed)
            for arch, seed in ARCH_SEEDS.items()}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model the server tests serve (server_fixtures.build_tiny_model), built once."""
    from server_fixtures import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("server-model"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """A server test module on one intra-op thread (server_fixtures.torch_threads says why); such a
    module says `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    from server_fixtures import torch_threads
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


@pytest.fixture
def make_engine(llama_dir):
    """make_engine(block_size=4, num_blocks=64, max_num_batched_tokens=..., model_dir=..., backend=...,
    batch_invariant=..., **other SchedulerConfig fields) -> Engine
    on the CPU (backend auto: the cpu backend where its native kernels run the model, else torch).
    After the test: check_integrity() must hold, then the engine is shut down."""
    engines: list[Engine] = []

    def factory(model_dir: Path | None = None, *, block_size: int = 4, num_blocks: int = 128,
                prefix_budget_blocks: int | None = None, max_num_seqs: int = 64,
                max_num_batched_tokens: int = 2048, max_queue: int = 1024, enable_prefix: bool = True,
                dtype: str = "float32", max_model_len: int | None = None, backend: str = "auto",
                pack_prefix_kv: bool = True, snapshot_dir: str | None = None, cuda_fused_layers: bool = True,
                quantization: str = "none", kv_cache_dtype: str = "auto", batch_invariant: bool = False,
                **scheduler: Any) -> Engine:
        cfg = EngineConfig(
            ModelConfig(path=str(model_dir or llama_dir), dtype=dtype, device="cpu", max_model_len=max_model_len,
                        backend=backend, cuda_fused_layers=cuda_fused_layers, quantization=quantization,
                        batch_invariant=batch_invariant),
            CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_budget_blocks=prefix_budget_blocks,
                        enable_prefix=enable_prefix, pack_prefix_kv=pack_prefix_kv, snapshot_dir=snapshot_dir,
                        kv_cache_dtype=kv_cache_dtype),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_queue=max_queue, **scheduler),
        )
        engine = Engine(cfg)
        engines.append(engine)
        return engine

    yield factory
    try:
        for engine in engines:
            engine.check_integrity()
            stats = engine.kv_stats()
            assert stats["running"] == 0 and stats["waiting"] == 0, f"requests left behind: {stats}"
            assert stats["used"] == stats["pinned"], f"blocks leaked: {stats}"
    finally:
        for engine in engines:
            engine.shutdown()
