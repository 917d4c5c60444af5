"""What structured outputs cost: time per output token (TPOT) of 16 concurrent requests on the intent
template, each constrained to a JSON intent record, against the same requests unconstrained; ours
(llguidance) and vLLM's (xgrammar) on the same machine, token ids and schema.

The record (`--constraint record`): {"intent": one of the template's 11 labels, "confidence": a number
in [0, 1], "reason": a string of at most --reason-chars characters}, compact JSON (no whitespace
between tokens: our engine's default, vLLM's `disable_any_whitespace`), greedy. `--constraint labels`:
one of the 11 labels after a space, the intent template's default output in configs/default.yaml
(outputs of 1-4 tokens: its end-to-end time and requests/s say more than TPOT). The 939-token intent template is pinned
(vLLM: cached by an untimed request); every batch sends 100-token messages never sent before.

A pair is one constrained batch, then one unconstrained batch of as many requests (EOS ignored)
in which request i generates exactly as many tokens as constrained request i did: the same decode
work with the same batch composition over time, only the constraint taken away. Per batch, each
request's TPOT is (last token - first token) / (tokens - 1) and the batch's is their median; a
pair's overhead is constrained TPOT / unconstrained TPOT - 1; the table gives medians over pairs.
Decode tok/s: the tokens after each request's first, over the time from the batch's first token to its last.

| system | how it runs |
| --- | --- |
| `engine` | our Engine in --dtype, the requests submitted together from a thread each (Engine.submit); the constraint through llguidance, masked in the sampler; the tokens it forces taken without a step each (`scheduler.jump_forward`, the default) |
| `engine-step-each` | the same with `scheduler.jump_forward: false`: every token sampled in a step of its own |
| `vllm-<dtype>` | vLLM's offline `LLM.generate` over the same token ids, automatic prefix caching on, `structured_outputs_config` backend xgrammar (make bench-peers) |

The two write different tokens for the same record: where the schema forces text (`{"intent":"`)
llguidance allows only its canonical tokens, xgrammar any tokens that spell it, so outputs differ
from the first token on and so do their lengths (tokens/request); each system's overhead is its own
constrained batch against its own unconstrained one.

Ours also times, from this script (wrapping the engine's functions; nothing in the engine
changes), where a step's time goes: the whole step (EngineCore.step), the sampler (sample), the
mask (structured.mask_rows: llguidance filling each constrained row's token bitmask, and the
bitmask applied to the logits), each token's handling (EngineCore._after_token: the matcher fed,
the text detokenized) and each sequence's matcher (structured.start: a copy of the compiled one). vLLM's TPOT comes
from its per-request metrics (engine-core times of the first and last token) where it fills them,
else from the batch's wall time over its longest output (`tpot_source` says which).

Each (system, round) runs in a fresh child process, the systems in turns; a child warms up with
one pair like the timed ones, then runs --pairs pairs. A vLLM child still running after --child-timeout-s is
stopped and that system skipped (its bf16 is emulated, and slow, on a CPU without AVX512-BF16).

    python scripts/bench_structured.py --json bench_out/structured.json
    python scripts/bench_structured.py --vllm-dtypes bfloat16,float32 --json bench_out/structured_vllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.10  # the issue's bound on the constrained TPOT overhead at 16 concurrent requests


def intent_schema(labels: list[str], reason_chars: int) -> dict:
    return {"type": "object",
            "properties": {"intent": {"enum": labels},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "reason": {"type": "string", "maxLength": reason_chars}},
            "required": ["intent", "confidence", "reason"], "additionalProperties": False}


def workload(args: argparse.Namespace) -> dict:
    """Token ids: the template's, and per round the messages of that round only, each batch its own
    (the warm-up pair's first, then each pair's constrained and unconstrained batches)."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from prefix_service.bench.workloads import INTENT_LABELS, Sizes, build_workload
    from prefix_service.prepare_model import prepare_default_model
    model = args.model or str(prepare_default_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    work = build_workload("intent", tok, Sizes(prompt_tokens=args.prompt_tokens,
                                               max_prefix_tokens=args.max_prefix_tokens))
    per_round = 2 * (args.pairs + 1) * args.concurrency
    return {"model": model, "prefix_name": work.prefix_name, "prefix": list(work.prefix_ids),
            "schema": json.dumps(intent_schema(list(INTENT_LABELS), args.reason_chars)),
            "labels": [" " + label for label in INTENT_LABELS],
            "messages": {str(r): [list(work.request(r * 100_000 + i).prompt_ids) for i in range(per_round)]
                         for r in range(args.rounds)}}


def batches(args: argparse.Namespace, ids: dict) -> list[tuple[list[list[int]], list[list[int]]]]:
    """This round's pairs as (constrained messages, unconstrained messages); the warm-up pair first."""
    messages = iter(ids["messages"][str(args.round)])
    n = args.concurrency
    return [([next(messages) for _ in range(n)], [next(messages) for _ in range(n)]) for _ in range(args.pairs + 1)]


def batch_result(tpot_ms: list[float | None], ttft_ms: list[float | None], token_ids: list[list[int]],
                 texts: list[str], finish: list[str], wall_s: float, decode_s: float,
                 e2e_ms: list[float | None] | None = None) -> dict:
    decode_tokens = sum(max(len(t) - 1, 0) for t in token_ids)
    return {"tpot_ms": tpot_ms, "ttft_ms": ttft_ms, "e2e_ms": e2e_ms or [None] * len(token_ids),
            "tokens": [len(t) for t in token_ids], "token_ids": token_ids, "texts": texts, "finish": finish,
            "wall_s": wall_s, "requests_per_s": len(token_ids) / wall_s if wall_s > 0 else None,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None}


def same_work(constrained: dict, unconstrained: dict) -> dict:
    """The pair, once each unconstrained request is seen to have made as many tokens as its constrained one."""
    if unconstrained["tokens"] != constrained["tokens"]:
        raise RuntimeError(f"the unconstrained batch made {unconstrained['tokens']} tokens per request, the "
                           f"constrained one {constrained['tokens']}: not the same work")
    return {"constrained": constrained, "unconstrained": unconstrained}


class EngineTimers:
    """Milliseconds spent in the engine functions named, summed over calls, from the moment they are
    wrapped. The wrappers only read the clock; every call runs on the engine's loop thread."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.mask_rows = 0  # constrained rows masked
        self.active = 0  # wrapped calls running now

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait for the wrapped calls running now to return: a batch's last output reaches its sink
        from inside the step that made it, before that step's time and call are counted."""
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            time.sleep(0.001)

    def wrap(self, owner: Any, attr: str, key: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)
        self.ms[key], self.calls[key] = 0.0, 0

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            self.active += 1
            try:
                return inner(*a, **kw)
            finally:
                self.ms[key] += (time.perf_counter() - t0) * 1e3
                self.calls[key] += 1
                self.active -= 1
                if key == "mask":
                    self.mask_rows += len(a[1])  # mask_rows(logits, rows, matchers)
        setattr(owner, attr, timed)

    def snapshot(self) -> dict:
        return {"ms": dict(self.ms), "calls": dict(self.calls), "mask_rows": self.mask_rows}


def delta(after: dict, before: dict) -> dict:
    return {"ms": {k: after["ms"][k] - before["ms"][k] for k in after["ms"]},
            "calls": {k: after["calls"][k] - before["calls"][k] for k in after["calls"]},
            "mask_rows": after["mask_rows"] - before["mask_rows"]}


def child(args: argparse.Namespace, ids: dict) -> dict:
    from prefix_service import CacheConfig, Engine, EngineConfig, GenerateRequest, ModelConfig, SamplingParams
    from prefix_service import SchedulerConfig
    from prefix_service.bench.metrics import Timing
    from prefix_service.engine import core, sampler
    from prefix_service.engine.sequence import RequestOutput
    from prefix_service.sampling_params import StructuredOutput

    timers = EngineTimers()
    timers.wrap(core.EngineCore, "step", "step")
    timers.wrap(core.EngineCore, "_after_token", "after_token")  # per token: the matcher fed, detokenized
    timers.wrap(core, "sample", "sample")  # the name the core calls
    timers.wrap(sampler, "mask_rows", "mask")  # the name the sampler calls
    timers.wrap(core, "start", "matcher")  # the name the core calls: a sequence's copy of the compiled matcher
    engine = Engine(EngineConfig(ModelConfig(path=ids["model"], dtype=args.dtype, device="cpu"),
                                 CacheConfig(block_size=16, kv_cache_memory=1 << 30),
                                 SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                                                 jump_forward=args.system != "engine-step-each")))
    engine.add_template(ids["prefix_name"], token_ids=ids["prefix"])
    constraint = (StructuredOutput("json_schema", ids["schema"]) if args.constraint == "record"
                  else StructuredOutput("choice", choices=tuple(ids["labels"])))

    def run(messages: list[list[int]], params: list[Any]) -> dict:
        """The requests submitted together, one thread each, as concurrent clients."""
        n = len(messages)
        timings = [Timing(start=0.0) for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts, finish = [""] * n, [""] * n
        logprobs: list[list[float]] = [[] for _ in range(n)]
        left, lock, done, errors = [n], threading.Lock(), threading.Event(), []
        barrier = threading.Barrier(n)

        def sink_for(i: int) -> Callable[[RequestOutput], None]:
            def sink(out: RequestOutput) -> None:  # on the engine's loop thread: keep it short
                t = time.perf_counter()
                timings[i].add_tokens(len(out.token_ids), t)
                tokens[i] += out.token_ids
                texts[i] += out.text
                logprobs[i] += [lp.logprob for lp in out.logprobs or ()]
                if out.finished:
                    timings[i].end, finish[i] = t, out.finish_reason.value if out.finish_reason else ""
                    if out.error is not None:
                        errors.append(out.error)
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            return sink

        def client(i: int) -> None:
            barrier.wait()
            timings[i].start = time.perf_counter()
            try:
                engine.submit(GenerateRequest(prompt_token_ids=messages[i], prefix_name=ids["prefix_name"],
                                              sampling=params[i]), sink_for(i))
            except Exception as e:  # noqa: BLE001 - raised below, on the main thread
                errors.append(e)
                done.set()

        before = timers.snapshot()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done.wait()
        timers.settle()  # the step that sent the last output counted
        if errors:
            raise errors[0]
        firsts = [t.first for t in timings if t.first is not None]
        ends = [t.end for t in timings if t.end is not None]
        out = batch_result([t.tpot_ms for t in timings], [t.ttft_ms for t in timings], tokens, texts, finish,
                           max(ends) - min(t.start for t in timings), max(ends) - min(firsts),
                           [t.e2e_ms for t in timings])
        out["engine_ms"] = delta(timers.snapshot(), before)
        out["logprobs"] = logprobs  # each token's, where the requests asked for them
        return out

    def pair(c_messages: list[list[int]], u_messages: list[list[int]]) -> dict:
        c = run(c_messages, [SamplingParams(max_tokens=args.max_tokens, structured=constraint,
                                            logprobs=args.logprobs)] * len(c_messages))
        u = run(u_messages, [SamplingParams(max_tokens=k, ignore_eos=True) for k in c["tokens"]])
        return same_work(c, u)

    (warm_c, warm_u), *timed = batches(args, ids)
    pair(warm_c, warm_u)  # the kernels' first calls, the grammar compiled, llguidance's tokenizer built
    pairs = [pair(c, u) for c, u in timed]
    engine.shutdown()
    return {"pairs": pairs, "backend": engine.info.backend_description, "tpot_source": "client"}


def vllm_child(args: argparse.Namespace, ids: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    llm = LLM(model=ids["model"], dtype=args.dtype, enable_prefix_caching=True, max_num_seqs=64,
              max_num_batched_tokens=4096, max_model_len=4096, seed=0, gpu_memory_utilization=0.3,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
              disable_log_stats=False)  # per-request metrics (first and last token times)
    prefix, sources = ids["prefix"], set()
    constraint = (StructuredOutputsParams(json=ids["schema"]) if args.constraint == "record"
                  else StructuredOutputsParams(choice=ids["labels"]))

    def run(messages: list[list[int]], params: list[Any]) -> dict:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=prefix + m) for m in messages], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        metrics = [o.metrics for o in outs]
        if all(m is not None and m.first_token_ts > 0 and m.last_token_ts > 0 for m in metrics):
            sources.add("metrics")
            tpot = [(m.last_token_ts - m.first_token_ts) * 1e3 / (len(t) - 1) if len(t) > 1 else None
                    for m, t in zip(metrics, token_ids)]
            ttft = [m.first_token_latency * 1e3 for m in metrics]
            decode_s = max(m.last_token_ts for m in metrics) - min(m.first_token_ts for m in metrics)
        else:  # no metrics: the batch's wall time per step of its longest output
            sources.add("batch")
            longest = max(len(t) for t in token_ids)
            tpot, ttft, decode_s = [wall * 1e3 / longest] * len(outs), [None] * len(outs), wall
        return batch_result(tpot, ttft, token_ids, [o.outputs[0].text for o in outs],
                            [str(o.outputs[0].finish_reason) for o in outs], wall, decode_s)

    def pair(c_messages: list[list[int]], u_messages: list[list[int]]) -> dict:
        c = run(c_messages, [SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=args.logprobs,
                                            structured_outputs=constraint)] * len(c_messages))
        u = run(u_messages, [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in c["tokens"]])
        return same_work(c, u)

    (warm_c, warm_u), *timed = batches(args, ids)
    llm.generate([TokensPrompt(prompt_token_ids=prefix + warm_c[0])], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # the template's blocks cached
    pair(warm_c, warm_u)
    pairs = [pair(c, u) for c, u in timed]
    backend = llm.llm_engine.vllm_config.structured_outputs_config.backend
    return {"pairs": pairs, "backend": f"vllm {args.dtype}, structured outputs {backend}",
            "tpot_source": "+".join(sorted(sources))}


def valid_record(text: str, labels: set[str], reason_chars: int, constraint: str = "record") -> bool:
    if constraint == "labels":
        return text.startswith(" ") and text[1:] in labels
    try:
        record = json.loads(text)
    except ValueError:
        return False
    return (isinstance(record, dict) and set(record) == {"intent", "confidence", "reason"}
            and record["intent"] in labels and isinstance(record["confidence"], (int, float))
            and 0 <= record["confidence"] <= 1 and isinstance(record["reason"], str)
            and len(record["reason"]) <= reason_chars)


def median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict], labels: set[str], reason_chars: int, constraint: str = "record") -> dict:
    """A system's medians over its pairs (of every round), and for ours where the constrained steps'
    time went."""
    pairs = [p for run in runs for p in run["pairs"]]
    per_pair = []
    for p in pairs:
        c, u = p["constrained"], p["unconstrained"]
        tc, tu = median(c["tpot_ms"]), median(u["tpot_ms"])
        per_pair.append({"tpot_constrained_ms": tc, "tpot_unconstrained_ms": tu,
                         "overhead": tc / tu - 1 if tc and tu else None,
                         "e2e_constrained_ms": median(c["e2e_ms"]),
                         "requests_per_s_constrained": c["requests_per_s"],
                         "decode_tok_s_constrained": c["decode_tok_s"],
                         "decode_tok_s_unconstrained": u["decode_tok_s"]})
    out: dict[str, Any] = {k: median([q[k] for q in per_pair]) for k in per_pair[0]}
    constrained = [p["constrained"] for p in pairs]
    texts = [t for c in constrained for t in c["texts"]]
    out.update(pairs=len(pairs), tokens_per_request=statistics.mean(n for c in constrained for n in c["tokens"]),
               valid_records=sum(valid_record(t, labels, reason_chars, constraint) for t in texts) / len(texts),
               ttft_constrained_ms=median([x for c in constrained for x in c["ttft_ms"]]),
               ttft_unconstrained_ms=median([x for p in pairs for x in p["unconstrained"]["ttft_ms"]]),
               per_pair=per_pair)
    if all("engine_ms" in p["constrained"] for p in pairs):  # ours: where each mode's steps went
        out["steps_per_batch_constrained"] = median([p["constrained"]["engine_ms"]["calls"]["step"] for p in pairs])
        out["step_ms"] = {mode: step_split([p[mode]["engine_ms"] for p in pairs])
                          for mode in ("constrained", "unconstrained")}
        masked = sum(p["constrained"]["engine_ms"]["mask_rows"] for p in pairs)
        made = sum(len(c["tokens"]) for c in constrained)
        out.update(mask_ms_per_step=out["step_ms"]["constrained"]["mask"],
                   mask_share_of_step=out["step_ms"]["constrained"]["mask"] / out["step_ms"]["constrained"]["step"],
                   mask_ms_per_row=sum(p["constrained"]["engine_ms"]["ms"]["mask"] for p in pairs) / max(masked, 1),
                   matcher_ms_per_request=sum(p["constrained"]["engine_ms"]["ms"]["matcher"] for p in pairs) / made)
    return out


def step_split(timed: list[dict]) -> dict:
    """Milliseconds per step: the whole step, the sampler (the mask within it), the tokens' handling,
    and the rest (the forward and the scheduler)."""
    steps = sum(t["calls"]["step"] for t in timed)
    ms = {k: sum(t["ms"][k] for t in timed) / steps for k in ("step", "sample", "mask", "after_token")}
    ms["forward_and_schedule"] = ms["step"] - ms["sample"] - ms["after_token"]
    return ms


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(table: dict, info: dict, args: argparse.Namespace) -> None:
    from prefix_service.bench.main import isa_label
    print(f"{info['cpu']} ({isa_label(info)}), {info['cpu_count']} CPUs; {args.concurrency} concurrent "
          f"requests, medians of {args.rounds} rounds x {args.pairs} pairs")
    print(f"constraint: {args.constraint}")
    print("| system | TPOT constrained ms | TPOT unconstrained ms | overhead | decode tok/s constrained | "
          "unconstrained | e2e constrained ms | requests/s constrained | steps/batch | tokens/request | "
          "valid records | mask ms/step (share of step) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in table.items():
        if "skipped" in s:
            print(f"| {name} | skipped: {s['skipped']} |")
            continue
        mask = (f"{s['mask_ms_per_step']:.2f} ({s['mask_share_of_step']:.1%})" if "mask_ms_per_step" in s else "-")
        print(f"| {name} | {fmt(s['tpot_constrained_ms'])} | {fmt(s['tpot_unconstrained_ms'])} | "
              f"{fmt(s['overhead'], '+.1%')} | {fmt(s['decode_tok_s_constrained'])} | "
              f"{fmt(s['decode_tok_s_unconstrained'])} | {fmt(s['e2e_constrained_ms'])} | "
              f"{fmt(s['requests_per_s_constrained'], '.2f')} | {fmt(s.get('steps_per_batch_constrained'), '.0f')} | "
              f"{s['tokens_per_request']:.1f} | {s['valid_records']:.0%} | {mask} |")
    for name in ("engine", "engine-step-each") if args.constraint == "record" else ():  # the target's workload
        overhead = table.get(name, {}).get("overhead")
        if overhead is not None:
            met = "met" if overhead <= TARGET else "not met"
            print(f"target: constrained TPOT <= {1 + TARGET:.2f}x unconstrained at {args.concurrency} requests, "
                  f"{name}: {met} ({overhead:+.1%})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the default model, prepared if missing)")
    ap.add_argument("--dtype", default="float32", help="our engine's model.dtype")
    ap.add_argument("--concurrency", type=int, default=16, help="requests per batch, submitted together")
    ap.add_argument("--rounds", type=int, default=2, help="child processes per system, the systems in turns")
    ap.add_argument("--pairs", type=int, default=2, help="timed (constrained, unconstrained) pairs per round")
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on a constrained output")
    ap.add_argument("--reason-chars", type=int, default=80, help="the record's reason: at most this many chars")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="tokens of each message after the template")
    ap.add_argument("--max-prefix-tokens", type=int, help="cut the template to at most this many tokens")
    ap.add_argument("--constraint", choices=("record", "labels"), default="record",
                    help="record: the JSON intent record; labels: one of the template's labels (default: %(default)s)")
    ap.add_argument("--logprobs", type=int, help="the constrained requests ask for each token's logprob and "
                    "this many alternatives (default: none)")
    ap.add_argument("--systems", default="engine,engine-step-each",
                    help="ours: engine (jump-forward on, the default) and/or engine-step-each (default: %(default)s)")
    ap.add_argument("--vllm-dtypes", default="", help="vLLM systems, e.g. bfloat16,float32 (make bench-peers)")
    ap.add_argument("--child-timeout-s", type=float, default=1800,
                    help="a vLLM child still running after this long is stopped and that system skipped")
    ap.add_argument("--json", default="bench_out/structured.json", help="default: %(default)s")
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ours = [name for name in args.systems.split(",") if name]
    if not args.system and (not ours or set(ours) - {"engine", "engine-step-each"}):
        ap.error(f"--systems: engine and/or engine-step-each, got {args.systems!r}")
    for flag in ("concurrency", "rounds", "pairs", "max_tokens", "reason_chars", "prompt_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.system:
        ids = json.loads(Path(args.ids).read_text())
        sys.path.insert(0, str(REPO))
        result = vllm_child(args, ids) if args.system == "vllm" else child(args, ids)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    from prefix_service.bench.main import child_result, git_commit, machine_info
    from prefix_service.bench.workloads import INTENT_LABELS
    started = time.monotonic()
    ids_dir = tempfile.TemporaryDirectory(prefix="bench-structured-")  # removed at the end, or at exit on an error
    ids_file = Path(ids_dir.name) / "ids.json"
    ids = workload(args)
    ids_file.write_text(json.dumps(ids))
    systems: list[tuple[str, str, str, str, dict[str, str] | None]] = [
        (name, sys.executable, name, args.dtype, None) for name in ours]
    if args.vllm_dtypes:
        from prefix_service.bench.systems.vllm import child_systems
        systems += child_systems(args.vllm_dtypes)
    info = machine_info()
    runs: dict[str, list[dict]] = {name: [] for name, *_ in systems}
    skipped: dict[str, str] = {}
    for r in range(args.rounds):
        for name, python, system, dtype, env in systems:
            if name in skipped:
                continue
            cmd = [python, __file__, "--system", system, "--dtype", dtype, "--ids", str(ids_file), "--round", str(r),
                   "--concurrency", str(args.concurrency), "--pairs", str(args.pairs),
                   "--max-tokens", str(args.max_tokens), "--constraint", args.constraint]
            if args.logprobs is not None:
                cmd += ["--logprobs", str(args.logprobs)]
            t0 = time.monotonic()
            try:
                run = child_result(cmd, env, f"{name} (round {r})",
                                   timeout_s=args.child_timeout_s if system == "vllm" else None)
            except TimeoutError as e:
                skipped[name] = str(e)
                continue
            runs[name].append({**run, "child_s": round(time.monotonic() - t0, 1)})  # start-up included
            print(f"round {r} {name}: {runs[name][-1]['backend']}", file=sys.stderr)
    ids_dir.cleanup()
    labels = set(INTENT_LABELS)
    table: dict[str, dict] = {}
    for name, rs in runs.items():
        if name in skipped and not rs:
            table[name] = {"skipped": skipped[name]}
            continue
        table[name] = summarize(rs, labels, args.reason_chars, args.constraint)
        table[name]["tpot_source"] = rs[0]["tpot_source"]
        if name in skipped:
            table[name]["stopped_early"] = skipped[name]
    info["load_average_end"] = list(os.getloadavg())
    print_table(table, info, args)
    if runs.get("engine") and runs.get("engine-step-each"):  # the same messages, round by round
        def written(name: str) -> list[tuple[list[int], list[float]]]:  # each request's tokens and logprobs
            return [(ids, lps) for run in runs[name] for p in run["pairs"]
                    for ids, lps in zip(p["constrained"]["token_ids"], p["constrained"]["logprobs"])]
        pairs = list(zip(written("engine"), written("engine-step-each")))
        table["engine"]["same_tokens_as_step_each"] = sum(a == b for a, b in pairs) / len(pairs)
        print(f"engine wrote the tokens (and logprobs) engine-step-each did for "
              f"{table['engine']['same_tokens_as_step_each']:.0%} of {len(pairs)} constrained requests")
    duration = round(time.monotonic() - started, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "machine": info, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
        "command": " ".join(["python scripts/bench_structured.py", *(argv if argv is not None else sys.argv[1:])]),
        "duration_s": duration, "args": vars(args), "schema": json.loads(ids["schema"]),
        "workload": {"prefix_tokens": len(ids["prefix"]), "prompt_tokens": args.prompt_tokens},
        "target_overhead": TARGET, "medians": {k: {kk: vv for kk, vv in v.items() if kk != "per_pair"}
                                               for k, v in table.items()},
        "per_pair": {k: v.get("per_pair", []) for k, v in table.items()}, "runs": runs}, indent=2))
    print(f"JSON: {args.json}\ntook {duration:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
