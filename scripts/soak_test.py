#!/usr/bin/env python
"""Soak a running prefix_service server: every kind of request at once, then check that nothing leaked or drifted.

--concurrency workers send requests back to back for --duration seconds, each drawing one kind:

    probe         gRPC Generate of one of a few fixed prompts on a template, greedy or seeded, free text
                  or a JSON record (the tokens its schema forces taken without a step each): its
                  tokens must equal the ones the same request gave alone before the load
    stream        gRPC Generate, streamed: n 1-3, logprobs, penalties, temperature, stop strings
    completion    HTTP POST /v1/completions (streamed or not, n, logprobs, penalties)
    chat_json     HTTP POST /v1/chat/completions with a json_schema response_format: the output parses
                  and conforms
    score         gRPC Score or HTTP POST /v1/scores over the template's labels
    cancel        a stream dropped after its first message (HTTP: the socket closed; gRPC: cancelled)
    bad           a request the server must refuse with a named status (unknown template, n out of range,
                  malformed JSON, a schema it cannot compile), and, over HTTP, OpenAI's error body

It starts once the server is ready (prefix_service_ready: its templates pinned). Every
--sample-every seconds it reads the server's /metrics (server.metrics_address): resident memory,
open files, KV blocks in use, requests running and waiting. When the load ends it waits for the
engine to go idle and checks: no unexpected status, every probe reproduced (a probe that changed is
a failure unless --allow-drift: only a batch-invariant server promises it, model.batch_invariant),
the KV blocks in use back to where they were before the load (the pinned templates'), open files
back within a few, and resident memory grown by at most --max-rss-growth-mib after the first quarter
of the run (caches warm by then): the idle figure after the load against the median of the second
quarter's samples. Prints a table, writes JSON with --json and exits 1 when a check fails.

    prefix-service serve --config CONFIG      # with server.metrics_address set, e.g. 127.0.0.1:9090
    python scripts/soak_test.py --grpc 127.0.0.1:50051 --http 127.0.0.1:8000 --metrics 127.0.0.1:9090 \\
        --duration 600 --concurrency 16 --json bench_out/soak.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefix_service.bench.main import machine_info  # noqa: E402
from prefix_service.proto import prefix_service_pb2 as pb  # noqa: E402
from prefix_service.proto import prefix_service_pb2_grpc as pb_grpc  # noqa: E402

LABELS = [" order_status", " order_change", " cancel_order", " return_refund", " billing", " product_question",
          " damaged_item", " account", " warranty_repair", " feedback", " other"]
SUBJECTS = ["my order", "the tent I bought", "a refund", "my invoice", "the rain jacket", "my password", "the boots",
            "a parcel", "the sleeping bag", "your shop", "a discount code", "the delivery"]
VERBS = ["I want to cancel", "Where is", "Can I return", "Why was I charged twice for", "How do I change",
         "Something is wrong with", "Is there a warranty on", "I love", "Please help me with"]
SCHEMA = {"type": "object", "properties": {"intent": {"enum": [label.strip() for label in LABELS]},
                                           "urgent": {"type": "boolean"}},
          "required": ["intent", "urgent"], "additionalProperties": False}
KINDS = {"probe": 3, "stream": 4, "completion": 4, "chat_json": 2, "score": 2, "cancel": 2, "bad": 1}


def message(rng: random.Random) -> str:
    return f'Message: "{rng.choice(VERBS)} {rng.choice(SUBJECTS)} (ref {rng.randrange(10 ** 6)})"\nIntent:'


def question(rng: random.Random) -> str:
    return f"\n\nQuestion: {rng.choice(['When', 'From which platform', 'How often'])} does the train to " \
           f"{rng.choice(['Porto', 'Sintra', 'Cascais', 'Faro', 'Braga'])} leave after {rng.randrange(6, 23)}:00?\nAnswer:"


def rss_growth_mib(samples: list[dict], after_rss: float, duration: float) -> float:
    """Resident memory after the load (idle) against the median of the samples taken in the run's second
    quarter, under load with the allocators warm, in MiB. The median, not one sample: under load the
    resident set swings by tens of MiB as the allocators take and return memory, so a single sample may
    be a trough; a leak grows through the second half and still shows."""
    second = [s["rss"] for s in samples if duration / 4 <= s["t"] < duration / 2]
    warm = second or [s["rss"] for s in samples if s["t"] >= duration / 4] or [s["rss"] for s in samples]
    return (after_rss - statistics.median(warm)) / 2 ** 20


class Failure(Exception):
    """A request whose outcome was not the one its kind expects."""


class Drift(Failure):
    """A probe whose tokens differ from its run alone."""


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.channel = grpc.insecure_channel(args.grpc)
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.lock = threading.Lock()
        self.done: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.drifted = 0  # probes whose tokens changed (not among the failures)
        self.examples: list[str] = []
        self.latency: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.probes: list[tuple[pb.GenerateRequest, list[int]]] = []
        self.samples: list[dict[str, float]] = []

    # --- the server's metrics --------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection(self.args.metrics, timeout=10)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        wanted = {"process_resident_memory_bytes": "rss", "process_open_fds": "fds",
                  "prefix_service_kv_blocks_used": "kv_used", "prefix_service_kv_blocks_pinned": "kv_pinned",
                  "prefix_service_running_requests": "running", "prefix_service_queue_length": "waiting",
                  "prefix_service_ready": "ready"}
        out = {wanted[sample.name]: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name in wanted}
        if out.get("ready") == 1:
            missing = set(wanted.values()) - set(out)
            if missing:
                raise SystemExit(f"{self.args.metrics}/metrics lacks {sorted(missing)}: is it the server's "
                                 f"metrics_address?")
        return out

    def idle(self, timeout_s: float = 120.0) -> dict[str, float]:
        """The metrics once the server is ready (its templates pinned) and runs nothing (or at the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                m = self.metrics()
            except OSError:  # not listening yet
                m = {"ready": 0.0}
            if m.get("ready") == 1 and m["running"] == 0 and m["waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise SystemExit(f"the server at {self.args.metrics} did not become ready and idle in {timeout_s:.0f} s")
            time.sleep(0.5)

    # --- gRPC ------------------------------------------------------------------------------------
    def generate(self, request: pb.GenerateRequest) -> dict[int, dict[str, Any]]:
        """Per sample index: token ids, text, finish reason, usage and logprob count; checks the stream's shape."""
        out: dict[int, dict[str, Any]] = {}
        for msg in self.gen.Generate(request, timeout=self.args.timeout):
            s = out.setdefault(msg.index, {"ids": [], "text": "", "finish": 0, "usage": None, "logprobs": 0})
            if s["finish"]:
                raise Failure(f"a message after sample {msg.index}'s last one")
            s["ids"] += list(msg.token_ids)
            s["text"] += msg.text
            s["logprobs"] += len(msg.logprobs)
            if msg.finish_reason:
                s["finish"], s["usage"] = msg.finish_reason, msg.usage
        n = request.sampling.n or 1
        if sorted(out) != list(range(n)):
            raise Failure(f"samples {sorted(out)} for n={n}")
        for i, s in out.items():
            if not s["finish"] or s["usage"] is None:
                raise Failure(f"sample {i} ended without a finish reason")
            if s["usage"].completion_tokens != len(s["ids"]):
                raise Failure(f"sample {i}: usage says {s['usage'].completion_tokens} tokens, {len(s['ids'])} came")
            if request.sampling.HasField("logprobs") and s["logprobs"] != len(s["ids"]):
                raise Failure(f"sample {i}: {s['logprobs']} logprobs for {len(s['ids'])} tokens")
            if len(s["ids"]) > (request.sampling.max_tokens or 1 << 30):
                raise Failure(f"sample {i}: {len(s['ids'])} tokens over max_tokens {request.sampling.max_tokens}")
        return out

    def make_probes(self, count: int) -> None:
        """The probes' tokens, each request sent alone (nothing else runs yet)."""
        rng = random.Random(1234)
        for i in range(count):
            if i % 3 == 0:
                req = pb.GenerateRequest(prefix_name=self.args.template, prompt=message(rng),
                                         sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True,
                                                                    structured_output=pb.StructuredOutput(text=True)))
            elif i % 3 == 2:  # a record: its forced runs are computed as chunks, with whatever else runs
                record = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
                req = pb.GenerateRequest(prefix_name=self.args.template, prompt=message(rng),
                                         sampling=pb.SamplingParams(max_tokens=32, temperature=0.7, seed=i,
                                                                    structured_output=record))
            else:
                req = pb.GenerateRequest(prefix_name=self.args.qa_template, prompt=question(rng),
                                         sampling=pb.SamplingParams(max_tokens=16, temperature=0.8, seed=i,
                                                                    ignore_eos=True))
            self.probes.append((req, self.generate(req)[0]["ids"]))

    # --- HTTP ------------------------------------------------------------------------------------
    def post(self, path: str, body: bytes | dict, stream_events: int | None = None) -> tuple[int, Any]:
        """Status and parsed body (streamed: the list of data events). stream_events: read that many events
        and drop the connection (a client going away)."""
        conn = http.client.HTTPConnection(self.args.http, timeout=self.args.timeout)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, data, {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200 or not resp.getheader("content-type", "").startswith("text/event-stream"):
                return resp.status, json.loads(resp.read() or b"null")
            events = []
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    events.append(json.loads(payload))
                    if stream_events is not None and len(events) >= stream_events:
                        if conn.sock:
                            conn.sock.close()  # gone without reading the rest
                        return 200, events
            return 200, events
        finally:
            conn.close()

    # --- the kinds -------------------------------------------------------------------------------
    def probe(self, rng: random.Random) -> None:
        req, want = rng.choice(self.probes)
        got = self.generate(req)[0]["ids"]
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise Drift(f"probe {req.prompt!r}: tokens differ from its run alone at position {first}")

    def stream(self, rng: random.Random) -> None:
        sp = pb.SamplingParams(max_tokens=rng.randint(1, 32), n=rng.randint(1, 3),
                               temperature=rng.choice([0.0, 0.7, 1.0]), presence_penalty=rng.choice([0.0, 0.5]),
                               frequency_penalty=rng.choice([0.0, 0.3]), stop=rng.choice([[], ["\n"]]))
        if rng.random() < 0.5:
            sp.logprobs = rng.randint(0, 5)
        if rng.random() < 0.5:
            req = pb.GenerateRequest(prefix_name=self.args.qa_template, prompt=question(rng), sampling=sp)
        else:
            req = pb.GenerateRequest(prefix_name=self.args.template, prompt=message(rng), sampling=sp)
        out = self.generate(req)
        if req.prefix_name == self.args.template and not sp.HasField("structured_output"):
            for s in out.values():  # the template's default output: one of its labels, or a prefix of one cut short
                if s["finish"] == pb.FINISH_REASON_STOP and s["text"] not in LABELS:
                    raise Failure(f"{s['text']!r} is none of the template's labels")

    def completion(self, rng: random.Random) -> None:
        n, streamed = rng.randint(1, 3), rng.random() < 0.5
        body = {"prefix_name": self.args.qa_template, "prompt": question(rng), "max_tokens": rng.randint(1, 24),
                "n": n, "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000), "stream": streamed,
                "logprobs": rng.choice([None, 0, 3]), "presence_penalty": rng.choice([0.0, 0.4])}
        status, out = self.post("/v1/completions", body)
        if status != 200:
            raise Failure(f"/v1/completions: {status} {out}")
        if streamed:
            finished = {c["index"] for event in out for c in event.get("choices", []) if c.get("finish_reason")}
        else:
            finished = {c["index"] for c in out["choices"] if c.get("finish_reason")}
        if finished != set(range(n)):
            raise Failure(f"/v1/completions: finished choices {sorted(finished)} for n={n}")

    def chat_json(self, rng: random.Random) -> None:
        body = {"messages": [{"role": "user", "content": f"Classify: {rng.choice(VERBS)} {rng.choice(SUBJECTS)}."}],
                "max_tokens": 48, "temperature": rng.choice([0.0, 0.9]),
                "response_format": {"type": "json_schema", "json_schema": {"name": "intent", "schema": SCHEMA}}}
        status, out = self.post("/v1/chat/completions", body)
        if status != 200:
            raise Failure(f"/v1/chat/completions: {status} {out}")
        choice = out["choices"][0]
        if choice["finish_reason"] == "length":
            return  # cut short by max_tokens: not a whole object
        value = json.loads(choice["message"]["content"])
        if set(value) != {"intent", "urgent"} or value["intent"] not in SCHEMA["properties"]["intent"]["enum"] \
                or not isinstance(value["urgent"], bool):
            raise Failure(f"the output does not conform to the schema: {value}")

    def score(self, rng: random.Random) -> None:
        prompt = message(rng)
        if rng.random() < 0.5:
            resp = self.gen.Score(pb.ScoreRequest(prefix_name=self.args.template, prompt=prompt, candidates=LABELS),
                                  timeout=self.args.timeout)
            logprobs = [c.logprob for c in resp.candidates]
        else:
            status, out = self.post("/v1/scores", {"prefix_name": self.args.template, "prompt": prompt,
                                                   "candidates": LABELS})
            if status != 200:
                raise Failure(f"/v1/scores: {status} {out}")
            logprobs = [c["logprob"] for c in out["data"]]
        if len(logprobs) != len(LABELS) or not all(lp <= 0 for lp in logprobs):
            raise Failure(f"scores {logprobs}")

    def cancel(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            body = {"prefix_name": self.args.qa_template, "prompt": question(rng), "max_tokens": 64, "stream": True,
                    "ignore_eos": True}
            status, _ = self.post("/v1/completions", body, stream_events=rng.randint(1, 3))
            if status != 200:
                raise Failure(f"/v1/completions (to be dropped): {status}")
        else:
            call = self.gen.Generate(pb.GenerateRequest(prefix_name=self.args.qa_template, prompt=question(rng),
                                                        sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True)),
                                     timeout=self.args.timeout)
            next(call)
            call.cancel()

    def bad(self, rng: random.Random) -> None:
        case = rng.randrange(5)
        if case == 0:
            try:
                self.generate(pb.GenerateRequest(prefix_name="no_such_template", prompt="x"))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise Failure(f"unknown template over gRPC: {e.code()}")
                return
            raise Failure("unknown template over gRPC: accepted")
        expect = {1: ({"prefix_name": "no_such_template", "prompt": "x"}, 404),
                  2: ({"prompt": "x", "n": 1000}, 400),
                  3: (b'{"prompt": "x", "max_tokens": ', 400),
                  4: ({"prompt": "x", "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}},
                      400)}
        body, want = expect[case]
        status, out = self.post("/v1/completions", body)
        if status != want or not isinstance(out, dict) or not out.get("error", {}).get("message"):
            raise Failure(f"bad request {case}: {status} {out} (expected {want} with an error body)")

    # --- the run ---------------------------------------------------------------------------------
    def worker(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                getattr(self, kind)(rng)
                with self.lock:
                    self.done[kind] += 1
                    self.latency[kind].append(time.monotonic() - start)
            except (Failure, grpc.RpcError, OSError, ValueError, KeyError) as e:
                detail = f"{e.code()} {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
                with self.lock:
                    if isinstance(e, Drift):
                        self.drifted += 1
                    else:
                        self.failures[kind] += 1
                    if len(self.examples) < 20:
                        self.examples.append(f"{kind}: {detail}")

    def run(self) -> dict:
        args = self.args
        before = self.idle(timeout_s=600.0)
        self.make_probes(args.probes)
        start = time.monotonic()
        until = start + args.duration
        threads = [threading.Thread(target=self.worker, args=(i, until), daemon=True) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            sample = self.metrics()
            sample["t"] = round(time.monotonic() - start, 1)
            with self.lock:
                sample["requests"] = sum(self.done.values()) + sum(self.failures.values())
            self.samples.append(sample)
            print(f"  {sample['t']:7.1f} s  {sample['requests']:6.0f} requests  rss {sample['rss'] / 2 ** 20:7.1f} MiB  "
                  f"fds {sample['fds']:4.0f}  kv used {sample['kv_used']:5.0f}  running {sample['running']:3.0f}  "
                  f"waiting {sample['waiting']:3.0f}", flush=True)
            for t in threads:
                t.join(timeout=args.sample_every / len(threads))
        after = self.idle()
        growth_mib = rss_growth_mib(self.samples, after["rss"], args.duration)
        probes = self.done["probe"] + self.failures["probe"] + self.drifted
        checks = {
            "no unexpected outcome": sum(self.failures.values()) == 0,
            f"every probe reproduced ({probes - self.drifted} of {probes})": self.drifted == 0 or args.allow_drift,
            "KV blocks in use back to before the load": after["kv_used"] == before["kv_used"],
            "open files back within 8": after["fds"] <= before["fds"] + 8,
            f"resident memory grew <= {args.max_rss_growth_mib} MiB after the first quarter": growth_mib
            <= args.max_rss_growth_mib,
        }
        return {"args": vars(args), "machine": machine_info(), "duration_s": round(time.monotonic() - start, 1),
                "done": dict(self.done), "failures": dict(self.failures), "probes_drifted": self.drifted,
                "examples": self.examples,
                "latency_p50_s": {k: round(statistics.median(v), 4) for k, v in self.latency.items() if v},
                "before": before, "after": after, "rss_growth_after_warmup_mib": round(growth_mib, 1),
                "samples": self.samples, "checks": checks, "passed": all(checks.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc", default="127.0.0.1:50051", help="the gRPC address (default 127.0.0.1:50051)")
    p.add_argument("--http", default="127.0.0.1:8000", help="the HTTP API's address (default 127.0.0.1:8000)")
    p.add_argument("--metrics", required=True, help="server.metrics_address, host:port")
    p.add_argument("--template", default="intent_classifier", help="a template with a choice output over LABELS")
    p.add_argument("--qa-template", default="table_qa", help="a template for free text")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--concurrency", type=int, default=16, help="workers (default 16)")
    p.add_argument("--probes", type=int, default=6, help="fixed requests whose tokens must not change under load")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between /metrics reads (default 10)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each request in seconds (default 120)")
    p.add_argument("--allow-drift", action="store_true",
                   help="report probes whose tokens changed under load without failing the run (a server that is "
                        "not batch invariant: model.batch_invariant)")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="most resident memory growth after the first quarter of the run (default 64)")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or args.probes < 1:
        p.error("--duration, --concurrency and --probes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Soak(args).run()
    print(f"\n{'kind':<12} {'done':>7} {'failed':>7} {'p50 s':>8}")
    for kind in KINDS:
        failed = report['failures'].get(kind, 0) + (report["probes_drifted"] if kind == "probe" else 0)
        print(f"{kind:<12} {report['done'].get(kind, 0):7d} {failed:7d} "
              f"{report['latency_p50_s'].get(kind, float('nan')):8.3f}")
    for line in report["examples"]:
        print(f"  {line}")
    b, a = report["before"], report["after"]
    print(f"\nbefore: rss {b['rss'] / 2 ** 20:.1f} MiB, fds {b['fds']:.0f}, KV blocks used {b['kv_used']:.0f}; "
          f"after: rss {a['rss'] / 2 ** 20:.1f} MiB, fds {a['fds']:.0f}, KV blocks used {a['kv_used']:.0f}; "
          f"rss growth after the first quarter {report['rss_growth_after_warmup_mib']} MiB")
    for name, ok in report["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"JSON: {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
