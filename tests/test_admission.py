"""Admission control over gRPC: the queue bound, the prompt-length and max_tokens caps, deadlines
while queued and while running, and what a request that the KV cache cannot hold gets."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from server_fixtures import DOCUMENT, Clients, collect, greedy_request, slow_steps, started_servers

from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=(TemplateSpec("doc", content=DOCUMENT),)) as f:
        yield f


def status_of(stream) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        collect(stream)
    return info.value.code(), info.value.details()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_prompt_cap_counts_the_request_tokens_not_the_template(make_server):
    st = make_server(max_prompt_tokens=8)
    c = Clients(st.address)
    code, details = status_of(c.generation.Generate(greedy_request(" the table row" * 5, "doc")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 8" in details and "scheduler.max_prompt_tokens" in details
    # the template's ~80 tokens do not count
    last = collect(c.generation.Generate(greedy_request(" the order", "doc", max_tokens=2)))[2]
    assert last.usage.prompt_tokens > 8 and last.usage.completion_tokens == 2
    chat = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="the price " * 10)])
    assert status_of(c.generation.Generate(chat))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_max_tokens_cap_from_config(make_server):
    st = make_server(max_tokens_cap=6)
    c = Clients(st.address)
    code, details = status_of(c.generation.Generate(greedy_request(" the", "doc", max_tokens=7)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the configured cap 6" in details
    assert collect(c.generation.Generate(greedy_request(" the", "doc", max_tokens=6)))[2].usage.completion_tokens == 6
    # a request that gives none gets scheduler.default_max_tokens (256 here), bounded by the cap too:
    # the default ran past it
    assert collect(c.generation.Generate(greedy_request(" the", "doc", max_tokens=0)))[2].usage.completion_tokens == 6


def test_queue_full_message_names_the_setting(make_server):
    st = make_server(max_num_seqs=1, max_queue=2)
    c = Clients(st.address)
    undo = slow_steps(st.engine, 0.01)
    try:
        running = c.generation.Generate(greedy_request(" the", "doc", max_tokens=300))
        next(running)
        waiting = [c.generation.Generate(greedy_request(" the", "doc", max_tokens=2)) for _ in range(2)]
        wait_until(lambda: st.engine.kv_stats()["waiting"] == 2)
        code, details = status_of(c.generation.Generate(greedy_request(" the", "doc", max_tokens=2)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in details and "scheduler.max_queue" in details and "retry" in details
        running.cancel()
    finally:
        undo()
    for call in waiting:
        assert collect(call)[2].usage.completion_tokens == 2


def test_deadline_while_queued_removes_the_request(make_server):
    st = make_server(max_num_seqs=1)
    c = Clients(st.address)
    undo = slow_steps(st.engine, 0.01)
    try:
        running = c.generation.Generate(greedy_request(" the", "doc", max_tokens=300))
        next(running)
        t0 = time.monotonic()
        code, _ = status_of(c.generation.Generate(greedy_request(" the", "doc", max_tokens=5), timeout=0.4))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 3
        # it never ran, and it leaves the queue without waiting for the running request
        wait_until(lambda: st.engine.kv_stats()["waiting"] == 0, timeout=2)
        stats = st.engine.kv_stats()
        assert stats["running"] == 1
        assert next(running).token_ids  # the running request is untouched
        running.cancel()
    finally:
        undo()


def test_deadline_while_running_frees_blocks(make_server):
    st = make_server()
    c = Clients(st.address)
    undo = slow_steps(st.engine, 0.01)
    try:
        call = c.generation.Generate(greedy_request(" the", "doc", max_tokens=350), timeout=0.5)
        assert next(call).token_ids
        assert st.engine.kv_stats()["used"] > st.engine.kv_stats()["pinned"]
        assert status_of(call)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        st.check_clean()
    finally:
        undo()


# --- the KV cache ---------------------------------------------------------------------------

def test_prompt_the_cache_can_never_hold_is_resource_exhausted(make_server):
    st = make_server(num_blocks=40, prefixes=())  # 160 tokens of KV
    c = Clients(st.address)
    code, details = status_of(c.generation.Generate(greedy_request(" the table row" * 60)))  # < context, > cache
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "room for 160 tokens" in details and "kv_cache_memory" in details
    code, details = status_of(c.generation.Generate(greedy_request(" the table row" * 200)))  # > context
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in details


def test_request_that_outgrows_the_cache_alone_finishes_with_length(make_server):
    st = make_server(num_blocks=24, prefixes=())  # 96 tokens of KV
    c = Clients(st.address)
    text, ids, last = collect(c.generation.Generate(greedy_request(" the table row" * 5, max_tokens=200)))
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert 0 < last.usage.completion_tokens < 200
    # every token's KV was cached but the last sampled one's: the cache is full to the last slot
    assert last.usage.prompt_tokens + last.usage.completion_tokens == 96 + 1


def test_engine_ends_a_lone_request_at_the_cache_wall_instead_of_recomputing_it(make_engine):
    """A decode that needs a block while no other sequence can yield one, and the sequence alone
    already fills the cache: preempting it would recompute it into the same wall forever."""
    from prefix_service import GenerateRequest, SamplingParams
    engine = make_engine(block_size=4, num_blocks=8)
    req = GenerateRequest(prompt_token_ids=list(range(3, 13)), sampling=SamplingParams(max_tokens=100, ignore_eos=True))
    result = engine.generate(req)[0]
    assert result.finish_reason.value == "length" and len(result.token_ids) == 32 + 1 - 10
    assert engine.kv_stats()["preemptions"] == 0


def test_request_squeezed_out_by_a_new_template_is_resource_exhausted(make_server):
    """Admitted while a template's warmup still ran; once the template is pinned the request can no
    longer fit even alone: it ends with RESOURCE_EXHAUSTED instead of waiting forever."""
    st = make_server(num_blocks=128, prefixes=(), prefix_budget_blocks=100, max_num_batched_tokens=64)
    c = Clients(st.address)
    undo = slow_steps(st.engine, 0.05)
    try:
        added = {}
        adder = threading.Thread(target=lambda: added.setdefault("t", c.admin.AddPrefixTemplate(
            pb.AddPrefixTemplateRequest(name="big", content=" the table row" * 100))))
        adder.start()
        wait_until(lambda: st.engine.kv_stats()["running"] == 1)  # the template's prefill runs in chunks
        code, details = status_of(c.generation.Generate(greedy_request(" the table row" * 90, max_tokens=2)))
        adder.join(30)
    finally:
        undo()
    assert added["t"].num_blocks > 60
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "kv_cache_memory" in details
    # a template larger than the room left beside it still serves: its shared blocks take no own block
    assert collect(c.generation.Generate(greedy_request(" the", "big", max_tokens=2)))[2].usage.completion_tokens == 2
