"""model.thread_nice: the engine's compute threads (its loop thread, the OpenMP workers it starts, the
servers' executor that prepares requests) sit below the rest of the process (engine/threads.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from prefix_service import CacheConfig, Engine, EngineConfig, ModelConfig
from prefix_service.config import ServiceConfig
from prefix_service.engine.threads import CPU_THREAD_NICE, compute_executor, thread_nice

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)  # Linux: one thread's nice value


def _thread_nices() -> dict[int, int]:
    """This process's threads' nice values, by thread id."""
    nices = {}
    for t in map(int, os.listdir("/proc/self/task")):
        try:
            nices[t] = _nice(t)
        except ProcessLookupError:  # ended since the listing
            pass
    return nices


def _base_and(n: int) -> tuple[int, int]:
    """The process's nice value and the one n above it; skips where there is no room."""
    base = _nice(os.getpid())
    if base + n > 19:
        pytest.skip(f"this process runs at nice {base}: no room for {n} more")
    return base, base + n


def test_defaults():
    assert CPU_THREAD_NICE == 10
    assert thread_nice(ModelConfig(path="m", device="cpu")) == 10
    assert thread_nice(ModelConfig(path="m", device="cuda")) == 0  # a GPU's loop thread only launches kernels
    assert thread_nice(ModelConfig(path="m")) == (0 if torch.cuda.is_available() else 10)  # auto
    assert thread_nice(ModelConfig(path="m", device="cuda", thread_nice=3)) == 3
    assert thread_nice(ModelConfig(path="m", device="cpu", thread_nice=0)) == 0


def test_the_loop_thread_and_its_workers_alone(llama_dir):
    """The loop thread and the OpenMP workers it starts run at the process's nice + model.thread_nice;
    the threads that were there before keep theirs; 0 leaves the loop thread at the process's."""
    from helpers import run_ids
    base, want = _base_and(7)  # 7: no other engine of the suite runs at it (the default is 10)
    before = _thread_nices()
    threads = torch.get_num_threads()
    try:
        with Engine(EngineConfig(ModelConfig(path=str(llama_dir), device="cpu", num_threads=2, thread_nice=7),
                                 CacheConfig(num_blocks=32))) as engine:
            run_ids(engine, list(range(5, 40)), max_tokens=3)  # parallel regions: the workers are started
            assert _nice(engine._thread.native_id) == want
            now = _thread_nices()
            # the loop thread and the OpenMP workers it started
            lowered = {t for t, nice in now.items() if nice == want and t not in before}
            assert engine._thread.native_id in lowered and len(lowered) >= 2, lowered
            assert all(now[t] == before[t] for t in before if t in now)  # the threads that were there keep theirs
    finally:
        torch.set_num_threads(threads)
    with Engine(EngineConfig(ModelConfig(path=str(llama_dir), device="cpu", thread_nice=0),
                             CacheConfig(num_blocks=32))) as engine:
        assert _nice(engine._thread.native_id) == base


def test_an_engine_built_on_a_lowered_thread_is_not_lowered_twice(llama_dir):
    """The server builds its engine on its executor, whose threads are lowered already: the loop
    thread ends at the process's nice + thread_nice, not twice that."""
    base, want = _base_and(6)
    with compute_executor(1, 6, "test-lowered") as pool:
        assert pool.submit(lambda: _nice(threading.get_native_id())).result() == want
        engine = pool.submit(Engine, EngineConfig(ModelConfig(path=str(llama_dir), device="cpu", thread_nice=6),
                                                  CacheConfig(num_blocks=32))).result()
    try:
        assert _nice(engine._thread.native_id) == want
    finally:
        engine.shutdown()


def test_the_servers_executor_runs_at_the_engines_priority(model_dir):
    """Tokenizing and compiling grammars for a request share the cores with a step (the servers'
    executor is lowered like the engine), while the asyncio loop's thread keeps the process's."""
    from prefix_service.server.app import PrefixServer
    base, want = _base_and(5)
    for nice, expected in ((5, want), (0, base)):
        cfg = ServiceConfig(EngineConfig(ModelConfig(path=str(model_dir), device="cpu", thread_nice=nice)))
        server = PrefixServer(cfg)
        try:
            assert server.runtime.executor.submit(lambda: _nice(threading.get_native_id())).result() == expected
            assert _nice(threading.get_native_id()) == base
        finally:
            server.runtime.executor.shutdown()


def test_the_engines_own_pool_runs_at_its_priority_and_stops_with_it(llama_dir, monkeypatch):
    """A caller of the async API that names no executor (a fleet replica, a script) submits, scores
    and aborts on the engine's own pool, lowered like the servers' executor; once the engine is shut
    down its pool is too, and the async API says EngineStopped rather than the pool's RuntimeError."""
    import asyncio
    from prefix_service import GenerateRequest, ScoreRequest
    from prefix_service.errors import EngineStopped
    from helpers import greedy
    base, want = _base_and(4)
    engine = Engine(EngineConfig(ModelConfig(path=str(llama_dir), device="cpu", thread_nice=4),
                                 CacheConfig(num_blocks=32)))
    seen: dict[str, int] = {}
    for name in ("submit", "submit_score", "abort"):
        def recorded(*args, _fn=getattr(engine, name), _name=name):
            seen[_name] = _nice(threading.get_native_id())
            return _fn(*args)
        monkeypatch.setattr(engine, name, recorded)

    async def serve() -> None:
        outs = [o async for o in engine.generate_stream(GenerateRequest(prompt_token_ids=list(range(5, 20)),
                                                                        sampling=greedy(3)))]
        assert outs[-1].finished
        scored = await engine.score_async(ScoreRequest(prompt_token_ids=list(range(5, 20)), candidates=[[7], [8, 9]]))
        assert len(scored.candidates) == 2
        stream = engine.generate_stream(GenerateRequest(prompt_token_ids=list(range(5, 20)), sampling=greedy(50)))
        await stream.__anext__()
        await stream.aclose()  # ends early: aborted on the pool
        await engine.drain_aborts()

    try:
        asyncio.run(serve())
        assert seen == {"submit": want, "submit_score": want, "abort": want}
        assert _nice(threading.get_native_id()) == base
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert engine._submits is not None and engine._submits._shutdown

    async def after_shutdown() -> None:
        with pytest.raises(EngineStopped):
            async for _ in engine.generate_stream(GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=greedy(2))):
                pass
        with pytest.raises(EngineStopped):
            await engine.score_async(ScoreRequest(prompt_token_ids=[5, 6, 7], candidates=[[8]]))
    asyncio.run(after_shutdown())
