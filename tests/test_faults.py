"""Faults against a real server on 127.0.0.1, each bounded in count and time: clients that vanish
mid-stream, templates added and removed under streaming requests, and a KV cache far too small
for the load. After each: check_integrity(), no request or block left behind, and greedy outputs
equal to references taken before the fault."""
from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

import grpc
import pytest

from server_fixtures import DOCUMENT, SYSTEM_PROMPT, Clients, collect, greedy_request, slow_steps, started_servers

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.config import TemplateSpec
from prefix_service.proto import prefix_service_pb2 as pb
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc


TEMPLATES = (TemplateSpec("doc", content=DOCUMENT), TemplateSpec("sys", system_prompt=SYSTEM_PROMPT))
WORDS = "the order price refund shipping account table row value music weather".split()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_server(model_dir, tmp_path, monkeypatch):
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=TEMPLATES) as factory:
        yield factory


def run_streams(address: str, requests: list[pb.GenerateRequest], timeout: float = 120,
                channels: int = 4) -> list[tuple]:
    """All requests at once (grpc.aio, one event loop): per request ("OK", token ids, last
    message) or (status code, details)."""
    async def main() -> list[tuple]:
        chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        try:
            stubs = [pb_grpc.GenerationStub(ch) for ch in chans]

            async def one(i: int, req: pb.GenerateRequest) -> tuple:
                ids, last = [], None
                try:
                    async for msg in stubs[i % channels].Generate(req, timeout=timeout):
                        ids.extend(msg.token_ids)
                        last = msg
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()
                return "OK", ids, last

            return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finally:
            await asyncio.gather(*(ch.close() for ch in chans))

    return asyncio.run(main())


# --- 100 clients vanish in the middle of their streams ----------------------------------------

def test_100_disconnects_mid_stream(make_server):
    st = make_server()
    c = Clients(st.address)
    probe = greedy_request(" the order price", "doc", max_tokens=12)
    reference = collect(c.generation.Generate(probe))[1]
    engine_ref = st.engine.generate(GenerateRequest(prompt=" the order price", prefix_name="doc",
                                                    sampling=SamplingParams(max_tokens=12, ignore_eos=True)))[0]
    assert reference == engine_ref.token_ids
    ok_before = collect(c.generation.Generate(greedy_request(" the order", "", max_tokens=8)))[1]

    def vanish(i: int) -> None:
        # a local subchannel pool: this channel gets a TCP connection of its own, which close() drops
        channel = grpc.insecure_channel(st.address, options=[("grpc.use_local_subchannel_pool", 1)])
        call = pb_grpc.GenerationStub(channel).Generate(
            greedy_request(" " + " ".join(WORDS[i % 7:i % 7 + 3]), ["doc", "sys", ""][i % 3], max_tokens=300))
        for _ in range(1 + i % 3):
            assert next(call).token_ids  # the request is running
        if i % 2:
            call.cancel()  # odd: the client cancels, then goes away
        channel.close()  # even: the connection just drops under the stream

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(vanish, range(100)))
    st.check_clean()  # every one of the 100 was aborted and its blocks freed
    assert collect(c.generation.Generate(probe))[1] == reference
    assert collect(c.generation.Generate(greedy_request(" the order", "", max_tokens=8)))[1] == ok_before


# --- templates come and go while requests stream on them ---------------------------------------

def test_templates_added_and_removed_while_streaming(make_server):
    st = make_server()
    c = Clients(st.address)
    hot = "the weather music price order refund account table row " * 2
    admin = c.admin
    admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="hot", content=hot))
    probe = greedy_request(" the order", "hot", max_tokens=16)
    reference = collect(c.generation.Generate(probe))[1]
    stop = threading.Event()
    counts = {"cycles": 0, "deferred": 0}

    def churn() -> None:  # remove and re-add "hot" (same text, so outputs stay the same); churn others
        rng = random.Random(7)
        while not stop.is_set():
            deferred = admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="hot")).deferred
            counts["deferred"] += deferred
            time.sleep(rng.uniform(0, 0.02))
            admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="hot", content=hot))
            name = f"other{counts['cycles'] % 3}"
            try:
                admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name=name, content=" ".join(WORDS)))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.ALREADY_EXISTS
                admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name=name))
            counts["cycles"] += 1
            time.sleep(rng.uniform(0, 0.03))

    undo = slow_steps(st.engine, 0.004)
    churner = threading.Thread(target=churn, daemon=True)
    churner.start()
    results = []
    try:  # waves of streams until enough removals hit running requests (bounded: 30 waves)
        for _ in range(30):
            results += run_streams(st.address, [probe] * 24)
            if counts["deferred"] >= 3 and counts["cycles"] >= 10:
                break
    finally:
        stop.set()
        churner.join(30)
        undo()
    assert not churner.is_alive()
    ok = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] != "OK"]
    for r in ok:
        assert r[1] == reference and r[2].finish_reason == pb.FINISH_REASON_LENGTH
    for code, details in refused:  # submitted while "hot" was removed: a clear NOT_FOUND
        assert code == grpc.StatusCode.NOT_FOUND and "'hot'" in details, (code, details)
    assert len(ok) > 0 and counts["cycles"] >= 10
    assert counts["deferred"] >= 3  # removals happened under running requests
    st.check_clean()  # deferred frees all happened; no block leaked
    names = {t.name for t in admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
    assert {"doc", "sys", "hot"} <= names
    assert collect(c.generation.Generate(probe))[1] == reference


# --- 200 concurrent long requests against a small KV cache -----------------------------------

def test_kv_exhaustion_200_concurrent(make_server):
    small = "You classify the intent of the user and answer with one label"
    # 48 blocks of 4 tokens; the template pins a few; requests need far more than the rest together
    st = make_server(num_blocks=48, max_num_seqs=16, max_queue=32, max_num_batched_tokens=128,
                     prefixes=(TemplateSpec("small", content=small),), metrics_address="127.0.0.1:0")
    c = Clients(st.address)
    capacity = (48 - st.engine.kv_stats()["pinned"]) * 4
    prompts = [" " + " ".join(WORDS[j % 11] for j in range(i, i + 4 + i % 9)) for i in range(12)]
    never_fits = greedy_request(" the table row" * 80, max_tokens=4)  # more prompt than the cache holds
    outgrows = greedy_request(" the table row" * 50, max_tokens=40)  # fits, then outgrows the whole cache
    requests = [outgrows if i % 10 == 0 else never_fits if i % 20 == 3 else
                greedy_request(prompts[i % 12], "small", max_tokens=8) for i in range(200)]
    # the outgrowing ones go out first, so that some of them are admitted before the queue fills
    # (arrival order across channels is not the send order; sent last, all could be refused)
    requests.sort(key=lambda r: r is not outgrows)
    distinct = {r.SerializeToString(): r for r in requests if r is not never_fits}
    references = {key: collect(c.generation.Generate(r)) for key, r in distinct.items()}
    template_reference = collect(c.generation.Generate(greedy_request(" the order", "small", max_tokens=12)))[1]

    t0 = time.monotonic()
    results = run_streams(st.address, requests, timeout=180)
    elapsed = time.monotonic() - t0
    outcomes = {"finished": 0, "truncated": 0, "queue_full": 0, "never_fits": 0}
    for req, result in zip(requests, results):
        if result[0] == "OK":
            ref_text, ref_ids, ref_last = references[req.SerializeToString()]
            _, ids, last = result
            assert ids == ref_ids  # preempted and recomputed, still the greedy reference
            assert last.finish_reason == pb.FINISH_REASON_LENGTH
            if last.usage.completion_tokens < req.sampling.max_tokens:  # stopped at the cache wall
                assert last.usage.prompt_tokens + last.usage.completion_tokens == capacity + 1
                outcomes["truncated"] += 1
            else:
                outcomes["finished"] += 1
            continue
        code, details = result
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        if "queue is full" in details:
            outcomes["queue_full"] += 1
        else:
            assert "could never run" in details and "kv_cache_memory" in details
            outcomes["never_fits"] += 1
    assert sum(outcomes.values()) == 200
    assert outcomes["never_fits"] == 10 and outcomes["finished"] > 0 and outcomes["truncated"] > 0, outcomes
    stats = st.engine.kv_stats()
    assert stats["preemptions"] > 0, "the cache was never short: the test did not exhaust it"
    st.check_clean()
    assert collect(c.generation.Generate(greedy_request(" the order", "small", max_tokens=12)))[1] == \
        template_reference
    assert elapsed < 120, elapsed
