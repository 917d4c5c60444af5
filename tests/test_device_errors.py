"""A device error that breaks the GPU context (an illegal address, a device-side assert) ends the
engine, not just the step: every later step would fail too. The engine fails what is in flight and
queued and stops; the server turns its health NOT_SERVING and ends the process with status 70, so
that its supervisor starts a fresh one. Other step errors fail the step's requests and the engine
goes on serving. The errors are raised on the CPU the way torch raises CUDA's."""
from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import run_ids
from server_fixtures import ServerThread, greedy_request, make_config, raw
from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig
from prefix_service.engine.api import is_fatal_device_error
from prefix_service.errors import EngineStopped
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc
from prefix_service.server.app import EXIT_DEVICE_ERROR

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA`"


def test_which_errors_are_fatal():
    assert is_fatal_device_error(RuntimeError(ILLEGAL_ADDRESS))
    assert is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_fatal_device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    if hasattr(torch, "AcceleratorError"):
        assert is_fatal_device_error(torch.AcceleratorError("CUDA error: unspecified launch failure"))
    assert not is_fatal_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal_device_error(RuntimeError("CUDA error: out of memory"))  # a workspace, not a broken context
    assert not is_fatal_device_error(RuntimeError("shape '[2, 3]' is invalid for input of size 7"))
    assert not is_fatal_device_error(ValueError("CUDA error"))  # only the runtime's own errors


def _break_the_device(engine: Engine, message: str = ILLEGAL_ADDRESS) -> None:
    """The next forward raises as torch does after a kernel faults."""
    def fail(*args, **kwargs):
        raise RuntimeError(message)
    engine._run(lambda core: setattr(core.backend, "forward", fail))


def test_a_fatal_device_error_stops_the_engine(llama_dir):
    cfg = EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu", backend="torch"),
                       CacheConfig(block_size=4, num_blocks=64))
    engine = Engine(cfg)
    try:
        called: list[BaseException] = []
        engine.on_fatal = called.append
        prompt = [5, 9, 13, 21]
        assert len(run_ids(engine, prompt, max_tokens=3)) == 3
        _break_the_device(engine)
        with pytest.raises(EngineStopped, match="device error: CUDA error: an illegal memory access"):
            run_ids(engine, prompt, max_tokens=3)
        assert [str(e) for e in called] == [ILLEGAL_ADDRESS] and engine.fatal_error is called[0]
        assert not engine.running
        with pytest.raises(EngineStopped, match="device error"):  # nothing new is taken
            engine.generate([GenerateRequest(prompt_token_ids=prompt)])
    finally:
        engine.shutdown()
    engine._core.check_integrity()  # the failed request's blocks were freed
    assert engine._core.kv_stats()["used"] == 0


def test_another_step_error_fails_the_step_and_the_engine_serves_on(llama_dir):
    cfg = EngineConfig(ModelConfig(path=str(llama_dir), dtype="float32", device="cpu", backend="torch"),
                       CacheConfig(block_size=4, num_blocks=64))
    with Engine(cfg) as engine:
        expected = run_ids(engine, [5, 9, 13, 21], max_tokens=3)
        forward = engine._run(lambda core: core.backend.forward)
        _break_the_device(engine, "shape '[2, 3]' is invalid for input of size 7")
        with pytest.raises(RuntimeError, match="is invalid for input"):
            run_ids(engine, [5, 9, 13, 21], max_tokens=3)
        engine._run(lambda core: setattr(core.backend, "forward", forward))
        assert engine.running and engine.fatal_error is None
        assert run_ids(engine, [5, 9, 13, 21], max_tokens=3) == expected
        engine.check_integrity()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_server_goes_not_serving_and_exits_after_a_device_error(model_dir, tmp_path):
    st = ServerThread(make_config(model_dir, http_address="127.0.0.1:0", state_file=tmp_path / "state.json")).start()
    exited: list[int] = []
    done = threading.Event()
    st.server._exit = lambda code: (exited.append(code), done.set())
    channel = grpc.insecure_channel(st.address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        _break_the_device(st.engine)
        with pytest.raises(grpc.RpcError) as failed:
            list(pb_grpc.GenerationStub(channel).Generate(greedy_request("hello")))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "device error" in failed.value.details()
        assert done.wait(30) and exited == [EXIT_DEVICE_ERROR]
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        status, body = raw(st, "GET", "/health")
        assert status == 503 and "device error" in str(body)
    finally:
        channel.close()
        st.stop()
