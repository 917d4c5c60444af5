"""Results out: the records table, the targets check, the JSON file and the latency-vs-load plot.
The JSON schema is documented in docs/benchmarks.md."""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from prefix_service.bench.systems import base_system

RECORD_KEYS = ("system", "workload", "mode", "concurrency", "ttft_p50_ms", "ttft_p99_ms", "engine_ttft_p50_ms",
               "ttft_outside_engine_p50_ms", "tpot_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tok_s", "req_s",
               "max_qps_under_slo", "peak_kv_blocks")
MODES = ("single", "closed_loop", "open_loop")
_COLUMNS = (("system", "system"), ("workload", "workload"), ("mode", "mode"), ("conc", "concurrency"),
            ("n", "num_requests"), ("ttft p50", "ttft_p50_ms"), ("ttft p99", "ttft_p99_ms"),
            ("outside engine", "ttft_outside_engine_p50_ms"), ("tpot p50", "tpot_p50_ms"), ("e2e p50", "e2e_p50_ms"),
            ("e2e p99", "e2e_p99_ms"), ("out tok/s", "output_tok_s"), ("req/s", "req_s"),
            ("max qps", "max_qps_under_slo"), ("peak kv", "peak_kv_blocks"))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict], columns, left: int = 3) -> str:
    """Plain-text table; the first `left` columns are left-aligned, the rest right-aligned."""
    cells = [[title for title, _ in columns]] + [[_cell(r.get(key)) for _, key in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def records_table(records: list[dict]) -> str:
    order = {m: i for i, m in enumerate(MODES)}
    rows = sorted(records, key=lambda r: (r["workload"], order[r["mode"]], r["concurrency"] or 0))
    return format_table(rows, _COLUMNS)


def open_loop_table(records: list[dict]) -> str:
    rows = [{"system": r["system"], "workload": r["workload"], **p}
            for r in records if r["mode"] == "open_loop" for p in r["points"]]
    cols = (("system", "system"), ("workload", "workload"), ("offered qps", "offered_qps"),
            ("n", "num_requests"), ("failed", "num_failed"), ("ttft p50", "ttft_p50_ms"), ("e2e p50", "e2e_p50_ms"),
            ("e2e p99", "e2e_p99_ms"), ("req/s", "req_s"), ("under slo", "under_slo"))
    return format_table(rows, cols, left=2)


def find(records: list[dict], system: str, workload: str, mode: str, concurrency: int | None = None) -> dict | None:
    for r in records:
        if (r["system"], r["workload"], r["mode"]) == (system, workload, mode) and \
                (concurrency is None or r["concurrency"] == concurrency):
            return r
    return None


def ratio(a, b) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def evaluate_targets(records: list[dict]) -> list[dict]:
    """The issue's targets, each with the figures it was judged on; met is None when a figure is missing."""
    def rec(system, workload, mode, c=None):
        return find(records, system, workload, mode, c) or {}

    def target(name, value, threshold, met, detail):
        return {"target": name, "value": None if value is None else round(value, 3), "threshold": threshold,
                "met": met, "detail": detail}

    out = []
    p, n = rec("engine_prefix", "intent", "single"), rec("engine_no_prefix", "intent", "single")
    speedup = ratio(n.get("ttft_p50_ms"), p.get("ttft_p50_ms"))
    out.append(target("intent TTFT speed-up, prefix vs no prefix (p50, single)", speedup, ">= 8 (ideal 10)",
                      None if speedup is None else speedup >= 8,
                      f"{p.get('ttft_p50_ms')} ms vs {n.get('ttft_p50_ms')} ms"))
    h = rec("hf_prompt_cache", "intent", "single")
    vs_cache = ratio(h.get("ttft_p50_ms"), p.get("ttft_p50_ms"))
    out.append(target("intent TTFT, prefix vs deep-copied HF prompt cache (p50, single)", vs_cache, "> 1",
                      None if vs_cache is None else vs_cache > 1,
                      f"{p.get('ttft_p50_ms')} ms vs {h.get('ttft_p50_ms')} ms"))
    gp, gn = rec("grpc_prefix", "intent", "open_loop"), rec("grpc_no_prefix", "intent", "open_loop")
    qp, qn = gp.get("max_qps_under_slo"), gn.get("max_qps_under_slo")
    q_ratio = ratio(qp, qn)
    met = None if qp is None or qn is None else (qp > 0 and (qn == 0 or qp >= 5 * qn))
    out.append(target("max QPS under the SLO, prefix vs no prefix (gRPC, intent)", q_ratio, ">= 5", met,
                      f"{qp} vs {qn} QPS" + (" (neither meets the SLO at any rate tried)" if qp == 0 and qn == 0 else "")))
    tpot = ratio(p.get("tpot_p50_ms"), n.get("tpot_p50_ms"))
    out.append(target("decode TPOT, prefix / no prefix (p50, single, intent)", tpot, "<= 1.05",
                      None if tpot is None else tpot <= 1.05, f"{p.get('tpot_p50_ms')} ms vs {n.get('tpot_p50_ms')} ms"))
    dp, dn = rec("engine_prefix", "no_shared", "single"), rec("engine_no_prefix", "no_shared", "single")
    slow = ratio(dp.get("e2e_p50_ms"), dn.get("e2e_p50_ms"))
    out.append(target("no_shared slowdown with prefix support on: e2e p50 on / off (single)", slow, "<= 1.05",
                      None if slow is None else slow <= 1.05,
                      f"{dp.get('e2e_p50_ms')} ms (on) vs {dn.get('e2e_p50_ms')} ms (off)"))
    cp = [r for r in records if r["system"] == "engine_prefix" and r["workload"] == "no_shared" and r["mode"] == "closed_loop"]
    for r in cp:
        other = rec("engine_no_prefix", "no_shared", "closed_loop", r["concurrency"])
        tput = ratio(other.get("output_tok_s"), r.get("output_tok_s"))
        out.append(target(f"no_shared slowdown with prefix support on: tok/s off / on (closed loop, c={r['concurrency']})", tput,
                          "<= 1.05", None if tput is None else tput <= 1.05,
                          f"{r.get('output_tok_s')} (on) vs {other.get('output_tok_s')} (off) tok/s"))
    ep, hb = rec("engine_prefix", "intent", "closed_loop", 16), rec("hf_generate_batch", "intent", "closed_loop", 16)
    ahead = ratio(ep.get("output_tok_s"), hb.get("output_tok_s"))
    out.append(target("closed-loop throughput c=16, engine_prefix / hf_generate_batch (intent)", ahead, "> 1",
                      None if ahead is None else ahead > 1, f"{ep.get('output_tok_s')} vs {hb.get('output_tok_s')} tok/s"))
    # the peer: vLLM's server beside ours, both called over the network with the same token ids; each
    # vllm_apc measured (in our engine's dtype, or a stated one: vllm_apc_bf16, vllm_apc_f32) is judged
    peers = sorted({r["system"] for r in records if base_system(r["system"]) == "vllm_apc"}) or ["vllm_apc"]
    for peer in peers:
        for c in (16, 64):
            g, v = rec("grpc_prefix", "intent", "closed_loop", c), rec(peer, "intent", "closed_loop", c)
            lead = ratio(g.get("output_tok_s"), v.get("output_tok_s"))
            out.append(target(f"closed-loop throughput c={c}, grpc_prefix / {peer} (intent)", lead, ">= 1.2",
                              None if lead is None else lead >= 1.2,
                              f"{g.get('output_tok_s')} vs {v.get('output_tok_s')} tok/s"))
        g, v = rec("grpc_prefix", "intent", "single"), rec(peer, "intent", "single")
        lead = ratio(v.get("ttft_p50_ms"), g.get("ttft_p50_ms"))
        out.append(target(f"intent TTFT, template cached: {peer} / grpc_prefix (p50, single)", lead, ">= 1.5",
                          None if lead is None else lead >= 1.5,
                          f"{g.get('ttft_p50_ms')} ms vs {v.get('ttft_p50_ms')} ms"))
        # no_shared names no template: grpc_no_prefix is the same server (prefix support on) sending the whole prompt
        g, v = rec("grpc_no_prefix", "no_shared", "single"), rec(peer, "no_shared", "single")
        slower = ratio(g.get("ttft_p50_ms"), v.get("ttft_p50_ms"))
        out.append(target(f"no_shared TTFT (a full prefill): grpc_no_prefix / {peer} (p50, single)", slower, "<= 1",
                          None if slower is None else slower <= 1,
                          f"{g.get('ttft_p50_ms')} ms vs {v.get('ttft_p50_ms')} ms"))
    return out


def targets_table(targets: list[dict]) -> str:
    rows = [{**t, "met": {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]} for t in targets]
    return format_table(rows, (("target", "target"), ("value", "value"), ("threshold", "threshold"),
                               ("result", "met"), ("figures", "detail")), left=1)


def write_json(path: str | Path, report: dict) -> None:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(report), indent=2) + "\n", encoding="utf-8")


def plot_open_loop(path: str | Path, records: list[dict], slo_ms: float, title: str) -> bool:
    """p99 latency vs offered QPS, one panel per workload, one line per system. A rate with no p99
    (1% or more of its requests missed their deadline: modes.open_loop_summary) is drawn as an x at
    the top. False when there is no open-loop record."""
    rows = [r for r in records if r["mode"] == "open_loop" and r.get("points")]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        own = [r for r in rows if r["workload"] == workload]  # the panel's scale is its own
        top = max([slo_ms * 1.5] + [p["e2e_p99_ms"] for r in own for p in r["points"] if p["e2e_p99_ms"]]) * 1.1
        for r in own:
            label = "with prefix" if "no_prefix" not in r["system"] else "without prefix"
            pts = r["points"]
            line, = ax.plot([p["offered_qps"] for p in pts if p["e2e_p99_ms"] is not None],
                            [p["e2e_p99_ms"] for p in pts if p["e2e_p99_ms"] is not None],
                            marker="o", label=f"{r['system']} ({label})")
            missed = [p["offered_qps"] for p in pts if p["e2e_p99_ms"] is None]
            if missed:
                ax.plot(missed, [top] * len(missed), marker="x", linestyle="none", color=line.get_color())
        ax.axhline(slo_ms, color="grey", linestyle="--", label=f"SLO {slo_ms:.0f} ms")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xticks(sorted({p["offered_qps"] for r in own for p in r["points"]}))
        ax.set_xlabel("offered load (requests/s, Poisson arrivals)")
        ax.set_ylabel("p99 end-to-end latency (ms)\nx: 1% or more missed the deadline")
        ax.set_title(textwrap.fill(f"{workload}: {title}", 70), fontsize=10)  # the machine's name can be long
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_concurrency(path: str | Path, records: list[dict], title: str, workload: str = "intent") -> bool:
    """Closed loop on a workload: output tok/s and TTFT p50 against concurrency, one line per system
    (a constrained workload: requests/s and e2e p50, each answer one label or record). False when there are
    fewer than two concurrencies to draw."""
    rows = [r for r in records if r["mode"] == "closed_loop" and r["workload"] == workload]
    if len({r["concurrency"] for r in rows}) < 2:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    measures = ((("req_s", "requests/s (closed loop)"), ("e2e_p50_ms", "end to end p50 (ms)"))
                if any("answers_not_labels" in r or "answers_not_records" in r for r in rows)
                else (("output_tok_s", "output tokens/s (closed loop)"), ("ttft_p50_ms", "TTFT p50 (ms)")))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = sorted(((r["concurrency"], r) for r in rows if r["system"] == system), key=lambda p: p[0])
        style = "--" if system.startswith("vllm") else "-"
        for ax, (key, _) in zip(axes, measures):
            xy = [(c, r[key]) for c, r in pts if r.get(key) is not None]
            ax.plot([c for c, _ in xy], [y for _, y in xy], style, marker="o", label=system)
    for ax, (_, label) in zip(axes, measures):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(f"{workload}: {title}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown(report: dict) -> str:
    """The tables of docs/benchmarks.md from a JSON report: one per mode, then the targets."""
    records = report["records"]

    def table(rows: list[dict], columns, left: int = 2) -> str:
        head = "| " + " | ".join(t for t, _ in columns) + " |\n|" + "|".join(
            " --- " if i < left else " ---: " for i in range(len(columns))) + "|\n"
        return head + "".join("| " + " | ".join(_cell(r.get(k)) for _, k in columns) + " |\n" for r in rows)

    order = {m: i for i, m in enumerate(MODES)}
    rows = sorted(records, key=lambda r: (order[r["mode"]], r["workload"], r["concurrency"] or 0))
    out = []
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode]
        if sel:
            cols = [c for c in _COLUMNS if mode == "open_loop" or c[1] != "max_qps_under_slo"]
            cols = [c for c in cols if c[1] != "mode"]
            out.append(f"#### {mode}\n\n" + table(sel, cols))
    if any(r["mode"] == "open_loop" for r in records):
        pts = [{"system": r["system"], "workload": r["workload"], **p}
               for r in records if r["mode"] == "open_loop" for p in r["points"]]
        out.append("#### open loop, every rate\n\n" + table(pts, (
            ("system", "system"), ("workload", "workload"), ("offered qps", "offered_qps"), ("n", "num_requests"),
            ("missed deadline", "num_failed"), ("ttft p50", "ttft_p50_ms"), ("e2e p50", "e2e_p50_ms"),
            ("e2e p99", "e2e_p99_ms"), ("req/s", "req_s"), ("p99 under SLO", "under_slo"))))
    targets = [{**t, "met": {True: "met", False: "**missed**", None: "n/a"}[t["met"]]} for t in report["targets"]]
    out.append("#### targets\n\n" + table(targets, (("target", "target"), ("threshold", "threshold"),
                                                    ("value", "value"), ("result", "met"), ("figures", "detail")), left=5))
    return "\n".join(out)
