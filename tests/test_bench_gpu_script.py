"""scripts/bench_gpu.py runs end to end (tiny shape on CPU) and writes the JSON it documents."""
import json

from helpers import load_script


def test_bench_gpu_smoke_on_cpu(tmp_path):
    bench = load_script("bench_gpu")
    out = tmp_path / "gpu.json"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--requests", "2", "--decode-batches", "1,3",
                       "--decode-tokens", "6", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"machine", "date", "git_commit", "ceilings", "ttft", "decode"} <= set(r)
    assert [t["system"] for t in r["ttft"]] == ["engine_prefix", "engine_no_prefix"]
    assert all(t["ttft_p50_ms"] > 0 and t["roofline_ms"] > 0 for t in r["ttft"])
    assert {(d["batch"], d["with_prefix"]) for d in r["decode"]} == {(1, True), (1, False), (3, True), (3, False)}
    assert all(d["decode_tok_s"] > 0 for d in r["decode"])


def test_bench_gpu_traces_each_ways_first_batch(tmp_path):
    """--trace: each way to decode writes a Chrome trace of its first timed batch, with the
    engine's operators in it."""
    bench = load_script("bench_gpu")
    traces = tmp_path / "traces"
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--requests", "1", "--decode-batches", "1",
                       "--decode-tokens", "4", "--trace", str(traces)]) == 0
    files = sorted(traces.glob("trace_*.json"))
    assert files
    for f in files:
        events = json.loads(f.read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)
