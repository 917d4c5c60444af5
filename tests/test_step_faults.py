"""A step the backend fails to compute (Scheduler.quarantine, EngineCore._step_failed): its
sequences go back to the queue with their KV dropped and each runs a step alone before it shares
one again. A fault one request brings ends that request alone, with the error; a fault of the moment
ends none; every other request gives what it gives alone. The KV cache's integrity holds after each
test (make_engine checks it) and the engine serves on."""
import threading

import pytest

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.engine.scheduler import MAX_FAILED_STEPS
from prefix_service.engine.sequence import FinishReason
from prefix_service.sampling_params import StructuredOutput

PROMPTS = {"a": [41, 77, 301, 12, 9], "b": [130, 140, 8, 66], "c": [5, 17, 250, 33, 90, 12]}
PARAMS = {"a": dict(max_tokens=10, ignore_eos=True),
          "b": dict(max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
          "c": dict(max_tokens=10, ignore_eos=True)}


class Faulty:
    """core.backend.execute, failing where fails(step) says so."""

    def __init__(self, core, fails):
        self.core, self.fails, self.execute = core, fails, core.backend.execute
        self.calls = self.failed = self.start = 0

    def __call__(self, step):
        self.calls += 1
        if self.fails(step, self):
            self.failed += 1
            self.failed_rows = [row.request_id for row in step.rows]
            raise RuntimeError("the kernel broke")
        return self.execute(step)


@pytest.fixture
def faulty(make_engine):
    """faulty(fails, **engine options) -> (engine, the Faulty); the backend is whole again after the test."""
    made = []

    def make(fails, **options):
        engine = make_engine(**options)
        fault = engine._run(lambda core: Faulty(core, fails))
        engine._run(lambda core: setattr(core.backend, "execute", fault))
        made.append(engine)
        return engine, fault
    yield make
    for engine in made:
        engine._run(lambda core: core.backend.__dict__.pop("execute", None))


def alone(engine, request_id):
    req = GenerateRequest(prompt_token_ids=PROMPTS[request_id], sampling=SamplingParams(**PARAMS[request_id]))
    return engine.generate(req)[0]


def together(engine, requests):
    """{id: [outputs]} of the requests submitted in one command, so that they share steps."""
    got = {r.request_id: [] for r in requests}
    left = [sum(r.sampling.n for r in requests)]  # a finished output per sample
    done = threading.Event()

    def sink(request_id):
        def put(out):
            got[request_id].append(out)
            if out.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return put
    engine.submit_many(requests, [sink(r.request_id) for r in requests])
    assert done.wait(120), {k: [o.finished for o in v] for k, v in got.items()}
    return got


def requests_abc(ids="abc"):
    return [GenerateRequest(prompt_token_ids=PROMPTS[k], request_id=k, sampling=SamplingParams(**PARAMS[k]))
            for k in ids]


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


def breaks_on_c(step, fault):
    """A kernel that breaks on request c's rows (as on an input only it brings)."""
    return any(row.request_id == "c" for row in step.rows)


def test_a_fault_one_request_brings_ends_that_request_alone(faulty):
    engine, fault = faulty(breaks_on_c)
    refs = {k: alone(engine, k) for k in "ab"}
    got = together(engine, requests_abc())
    for k in "ab":  # computed again after the failed step, alone first: what each gives alone
        assert tokens(got[k]) == refs[k].token_ids and got[k][-1].error is None
        assert got[k][-1].finish_reason is FinishReason.LENGTH
    c = got["c"][-1]
    assert c.finish_reason is FinishReason.ABORT and str(c.error) == "the kernel broke" and tokens(got["c"]) == []
    # the shared step failed, then c's step alone; a and b each ran a step alone in between
    assert fault.failed == 2 and engine.kv_stats()["failed_steps"] == 2
    assert engine.kv_stats()["used"] == 0
    assert alone(engine, "a").token_ids == refs["a"].token_ids  # and the engine serves on


@pytest.mark.parametrize("at_call", [1, 3, 6])
def test_a_fault_of_the_moment_ends_no_request(faulty, at_call):
    """One failed step (the first, a prefill; later, decodes): every request is computed again and
    gives its tokens alone, the seeded sample included (no draw was taken for the failed step)."""
    engine, fault = faulty(lambda step, fault: fault.calls == fault.start + at_call and len(step.rows) > 1)
    refs = {k: alone(engine, k) for k in "abc"}
    fault.start = fault.calls
    got = together(engine, requests_abc())
    assert fault.failed == 1 and engine.kv_stats()["failed_steps"] == 1
    for k in "abc":
        assert tokens(got[k]) == refs[k].token_ids and got[k][-1].error is None


@pytest.mark.parametrize("at_call", [1, 2, 3])
def test_every_kind_of_request_is_computed_again_after_a_failed_step(faulty, at_call):
    """A request on a template, n = 2 seeded samples, a structured output with logprobs (its forced
    tokens held), a Score request and a plain one share the step that fails (their prefill, or one
    of the steps after it): each gives what it gives without the fault."""
    engine, fault = faulty(lambda step, fault: fault.armed and fault.calls == fault.start + at_call)
    fault.armed = False
    engine.add_template("t", token_ids=[7, 8, 9, 10, 11, 12, 13])
    choice = StructuredOutput("choice", choices=(" alpha beta gamma delta", " alphabet soup", " gamma rays"))
    reqs = [GenerateRequest(prompt_token_ids=[21, 22, 23], prefix_name="t", request_id="tmpl",
                            sampling=SamplingParams(max_tokens=8, ignore_eos=True)),
            GenerateRequest(prompt_token_ids=[31, 32], request_id="n2",
                            sampling=SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)),
            GenerateRequest(prompt_token_ids=[41, 42, 43], request_id="choice",
                            sampling=SamplingParams(max_tokens=40, structured=choice, logprobs=2)),
            *requests_abc("a")]
    outs = {r.request_id: [] for r in reqs}
    outs["score"] = []
    done = threading.Event()

    def run():
        for got in outs.values():
            got.clear()
        done.clear()
        left = [sum(r.sampling.n for r in reqs) + 1]

        def sink(request_id):
            def put(out):
                outs[request_id].append(out)
                if getattr(out, "finished", True):  # a score's one output ends it
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
            return put

        def add(core):
            fault.start = fault.calls
            for r in reqs:
                core.add_request(r.request_id, r.prompt_token_ids, r.prefix_name, r.sampling, sink(r.request_id))
            core.add_score("score", [51, 52, 53], None, [[17], [250, 3]], sink("score"))
        engine._run(add)
        assert done.wait(120)
        return {k: list(v) for k, v in outs.items()}

    want = run()
    fault.armed = True
    got = run()
    assert fault.failed == 1 and engine.kv_stats()["failed_steps"] == 1
    assert {"tmpl", "a", "choice"} <= set(fault.failed_rows), fault.failed_rows
    for r in reqs:
        for index in range(r.sampling.n):
            mine = [o for o in got[r.request_id] if o.index == index]
            ref = [o for o in want[r.request_id] if o.index == index]
            assert tokens(mine) == tokens(ref) and mine[-1].finished and mine[-1].error is None, r.request_id
            assert "".join(o.text for o in mine) == "".join(o.text for o in ref)
            lps = [lp.logprob for o in mine for lp in (o.logprobs or [])]
            assert lps == pytest.approx([lp.logprob for o in ref for lp in (o.logprobs or [])], abs=1e-4)
    assert "".join(o.text for o in got["choice"]) in choice.choices
    (mine,), (ref,) = got["score"], want["score"]
    assert mine.error is None and len(mine.candidates) == 2
    for a, b in zip(mine.candidates, ref.candidates):
        assert a.token_ids == b.token_ids and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)


def test_a_backend_that_always_fails_ends_every_request_and_the_engine_serves_after(faulty):
    engine, fault = faulty(lambda step, fault: fault.broken)
    fault.broken = False
    refs = {k: alone(engine, k) for k in "abc"}
    fault.broken = True
    got = together(engine, requests_abc())
    for k in "abc":
        assert got[k][-1].finish_reason is FinishReason.ABORT and str(got[k][-1].error) == "the kernel broke"
    assert fault.failed == 4  # the shared step, then each alone
    fault.broken = False
    assert engine.kv_stats()["used"] == 0
    assert {k: alone(engine, k).token_ids for k in "abc"} == {k: r.token_ids for k, r in refs.items()}


def test_a_fault_two_requests_bring_together_ends_the_requests_of_its_steps_without_end(faulty):
    """A step fails whenever a and b share it, never with either alone: each is tried alone and goes
    on, the fault comes back, and at the MAX_FAILED_STEPS-th failed step with them the requests
    still in it end with the error: no endless loop of steps computed again."""
    def fails(step, fault):
        ids = {row.request_id for row in step.rows}
        return {"a", "b"} <= ids
    engine, fault = faulty(fails)
    got = together(engine, requests_abc())
    for k in "ab":
        assert got[k][-1].finish_reason is FinishReason.ABORT and str(got[k][-1].error) == "the kernel broke"
    assert got["c"][-1].finished
    assert fault.failed == MAX_FAILED_STEPS
    assert engine.kv_stats()["used"] == 0


def test_through_the_servers_the_request_a_fault_comes_with_fails_internal_and_the_others_answer(
        model_dir, tmp_path, monkeypatch):
    """On a real server: a gRPC call and an HTTP completion whose rows the backend cannot compute end
    with INTERNAL (500 over HTTP, OpenAI's error body); the calls that shared their steps answer what
    they answer alone."""
    import concurrent.futures

    import grpc

    from server_fixtures import DOCUMENT, Clients, collect, greedy_request, raw, started_servers

    from prefix_service.config import TemplateSpec
    with started_servers(model_dir, tmp_path, monkeypatch, prefixes=(TemplateSpec("doc", content=DOCUMENT),)) as make:
        st = make(http_address="127.0.0.1:0")
        clients = Clients(st.address)
        try:
            def grpc_call(prompt, request_id):
                request = greedy_request(prompt, "doc", max_tokens=8)
                request.request_id = request_id
                try:
                    return collect(clients.generation.Generate(request, timeout=60))[:2]
                except grpc.RpcError as e:
                    return e.code(), e.details()

            def http_call(prompt, request_id):
                return raw(st, "POST", "/v1/completions", {"model": "doc", "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True},
                           headers={"x-request-id": request_id})

            want_grpc, want_http = grpc_call(" the order", "ok-1"), http_call(" the price", "ok-2")
            assert want_http[0] == 200
            core = st.engine._core
            execute = core.backend.execute

            def failing(step):
                if any(row.request_id.startswith("bad") for row in step.rows):
                    raise RuntimeError("the kernel broke on this input")
                return execute(step)
            st.engine._run(lambda core: setattr(core.backend, "execute", failing))
            try:
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    calls = [pool.submit(grpc_call, " the order", "ok-3"), pool.submit(grpc_call, " shipping", "bad-1"),
                             pool.submit(http_call, " the price", "ok-4"), pool.submit(http_call, " refund", "bad-2")]
                    good_grpc, bad_grpc, good_http, bad_http = [c.result(120) for c in calls]
            finally:
                st.engine._run(lambda core: core.backend.__dict__.pop("execute", None))
            assert good_grpc == want_grpc
            # the server names the error's kind and keeps its text to the log
            assert bad_grpc == (grpc.StatusCode.INTERNAL,
                                "internal error (RuntimeError); the server log has the details")
            assert good_http[0] == 200 and good_http[1]["choices"][0]["text"] == want_http[1]["choices"][0]["text"]
            assert bad_http[0] == 500 and bad_http[1]["error"]["code"] == "internal_error", bad_http
            assert st.engine.kv_stats()["failed_steps"] >= 2
        finally:
            clients.close()
