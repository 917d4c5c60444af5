"""scripts/bench_cpu_linear.py on a tiny model's shapes: every way that runs here runs, the table and JSON agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import head_commit_or_skip, native_sources_unchanged
from prefix_service import cpuinfo
from prefix_service.backends.cpu import linear as cpu_linear

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_cpu_linear.py"


def onednn_linear_available(dtype):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_cpu_linear
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_cpu_linear.onednn_available(dtype)


def run_script(llama_dir, tmp_path, *extra):
    out = tmp_path / "linear.json"
    reference = [] if "--reference-size" in extra else ["--reference-size", "64"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--rows", "1,5",
                           "--passes", "2", "--threads", "1", "--json", str(out), *reference, *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def check_results(data, want):
    assert [r["rows"] for r in data["results"]] == [1, 5]
    assert data["ways"] == want and data["baseline"] == want[0]
    for r in data["results"]:
        for way in want:
            assert r[f"{way}_ms"] > 0
            assert r[f"{way}_gb_s"] == pytest.approx(data["weight_bytes"][way] / r[f"{way}_ms"] / 1e6, rel=0.02,
                                                     abs=0.06)
        for way in want[1:]:
            assert r[f"{way}_speedup"] == pytest.approx(r[f"{want[0]}_ms"] / r[f"{way}_ms"], rel=0.02, abs=0.006)
    assert data["threads"] == 1 and data["machine"]["isa"] is not None


def test_bench_cpu_linear_script(llama_dir, tmp_path):
    want = ["blas"] + [way for way, check in (("onednn", onednn_linear_available), ("native", cpu_linear.available))
                       if check(torch.float32) is None]
    want += ["native_bf16_panels"] if "native" in want else []
    proc, data = run_script(llama_dir, tmp_path)
    check_results(data, want)
    assert data["dtype"] == "float32"
    assert all(data["weight_bytes"][way] == (2 if way == "native_bf16_panels" else 4) * data["parameters"]
               for way in want)
    assert "blas ms" in proc.stdout and "JSON:" in proc.stdout
    # the machine's reference GEMM rate in both dtypes (64 at most: fast enough for one product each),
    # printed as recorded
    ref = data["reference"]
    assert set(ref) == {"float32", "bfloat16"} and all(r["size"] == 64 and r["gflop_s"] > 0 for r in ref.values())
    assert (f"reference: torch.mm on n-square matrices, float32 {ref['float32']['gflop_s']:.1f} GFLOP/s (n = 64), "
            f"bfloat16 {ref['bfloat16']['gflop_s']:.1f} GFLOP/s (n = 64)") in proc.stdout


@pytest.mark.skipif(cpu_linear.available(torch.bfloat16) is not None,
                    reason=f"no bf16 linears here: {cpu_linear.available(torch.bfloat16)}")
def test_bench_cpu_linear_script_in_bfloat16(llama_dir, tmp_path):
    """bf16 weights: the float32 kernel as the baseline, torch's bf16 F.linear, oneDNN's operator where
    it takes bf16, and the service's kernels (brgemm, and inner_product or emulated, and oneDNN's
    inner product alone where inner_product runs its small calls on the few-row kernel)."""
    from prefix_service.backends.cpu import onednn
    want = ["native", "blas"] + (["onednn"] if onednn_linear_available(torch.bfloat16) is None else [])
    want += ["brgemm", "inner_product" if onednn.bf16_native() else "emulated"]
    few_rows = onednn.bf16_native() and onednn.OneDnnLinear(torch.ones(8, 8).bfloat16(), None,
                                                             kernel="inner_product").few_rows > 0
    want += ["inner_product_onednn", "inner_product_dot"] if few_rows else []
    proc, data = run_script(llama_dir, tmp_path, "--dtype", "bfloat16")
    check_results(data, want)
    assert data["dtype"] == "bfloat16" and data["brgemm_vnni"] == onednn.brgemm_vnni()
    assert data["weight_bytes"]["native"] == 4 * data["parameters"]
    assert data["weight_bytes"]["blas"] == data["weight_bytes"]["brgemm"] == 2 * data["parameters"]
    if few_rows:
        assert data["weight_bytes"]["inner_product_onednn"] == data["weight_bytes"]["inner_product_dot"] \
            == 2 * data["parameters"]
    assert "brgemm vs native" in proc.stdout


@pytest.mark.skipif(cpu_linear.available(torch.float32) is not None,
                    reason=f"no native kernels here: {cpu_linear.available(torch.float32)}")
def test_bench_cpu_linear_script_in_int8(llama_dir, tmp_path):
    """int8 weights: the float32 kernel over them, the bf16 few-row kernel over bf16 and int8 blocks
    where the CPU has AVX512-BF16, and torch's kernel on bf16 and float32 rows, against the float32
    kernel."""
    from prefix_service.backends.cpu import onednn
    proc, data = run_script(llama_dir, tmp_path, "--dtype", "int8", "--reference-size", "0")
    assert data["reference"] == {} and "reference:" not in proc.stdout
    few = "avx512_bf16" in cpuinfo.kernel_flags() and onednn.bf16_native()
    check_results(data, ["native", "native_int8", *(["inner_product", "inner_product_int8"] if few else []),
                         "int8_bf16", "int8_f32"])
    assert data["weight_bytes"]["int8_bf16"] == data["weight_bytes"]["native_int8"] == data["parameters"]
    assert data["dtype"] == "int8" and "native_int8 vs native" in proc.stdout


CALL_SCRIPT = SCRIPT.parent / "bench_cpu_linear_call.py"


@pytest.mark.skipif(cpu_linear.available(torch.bfloat16) is not None,
                    reason=f"no bf16 linears here: {cpu_linear.available(torch.bfloat16)}")
def test_bench_cpu_linear_call_script(tmp_path):
    """scripts/bench_cpu_linear_call.py: a row per (threads, shape, rows), a time for every way this
    CPU runs (the native kernel, torch's bf16 F.linear, every service kernel that packs here, oneDNN's
    inner product alone where the few-row kernel takes its small calls, and the brgemm kernel at
    each block width asked for)."""
    from prefix_service.backends.cpu import onednn
    out = tmp_path / "call.json"
    proc = subprocess.run([sys.executable, str(CALL_SCRIPT), "--shapes", "40x24,24x56", "--rows", "1,5",
                           "--threads", "1,2", "--calls", "3", "--brgemm-columns", "16,64", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [(r["threads"], r["out"], r["in"], r["rows"]) for r in data["results"]] == [
        (t, n, k, m) for t in (1, 2) for n, k in ((40, 24), (24, 56)) for m in (1, 5)]
    want = ["native_f32", "F.linear_bf16", "emulated", "brgemm", "brgemm_c16", "brgemm_c64"]
    # with it, what timing the shape keeps (AMX's default), its choice said
    want += ["inner_product", "onednn_bf16_rows", "measure"] if onednn.bf16_native() else []
    # oneDNN's inner product alone beside it where inner_product packs the few-row kernel
    few_rows = onednn.bf16_native() and onednn.OneDnnLinear(torch.ones(8, 8).bfloat16(), None,
                                                             kernel="inner_product").few_rows > 0
    want += ["inner_product_onednn"] if few_rows else []
    for r in data["results"]:
        assert all(r[f"{way}_us"] > 0 for way in want), r
        assert ("inner_product_onednn_us" in r) == few_rows, r
    if not onednn.bf16_native():
        assert "inner_product: not available here" in proc.stderr
    else:
        assert "measure, 40 x 24: OneDnnLinear(in_features=24, out_features=40, bf16 " in proc.stderr
    assert data["isa"] and "JSON:" in proc.stdout


@pytest.mark.skipif(cpu_linear.available(torch.float32) is not None,
                    reason=f"no native kernel here: {cpu_linear.available(torch.float32)}")
def test_bench_cpu_linear_against_a_revision(llama_dir, tmp_path):
    """--against REV: REV's native kernel (built from its sources in git) and the working tree's in turns,
    over float32 and bf16 panels, a row per panels and row count with both sides' times, the rounds'
    ratios and whether the bits agree; HEAD's kernel is the working tree's wherever the native sources
    are unchanged, so its bits are the same."""
    head = head_commit_or_skip()
    out = tmp_path / "against.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--rows", "1,30", "--passes", "1",
                           "--against", "HEAD", "--rounds", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr
    data = json.loads(out.read_text())
    # exit 1 exactly where some output's bits differ
    assert proc.returncode == (0 if all(r["same_bits"] for r in data["results"]) else 1), proc.stderr
    assert data["against_commit"] == head and data["rounds"] == 3
    assert [(r["panels"], r["rows"]) for r in data["results"]] == [("float32", 1), ("float32", 30), ("bf16", 1),
                                                                    ("bf16", 30)]
    for r in data["results"]:
        assert r["theirs_ms"] > 0 and r["ours_ms"] > 0
        assert 0 < r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
    if native_sources_unchanged():
        assert all(r["same_bits"] for r in data["results"])
    assert "HEAD's native kernel and the working tree's in turns, 3 rounds" in proc.stdout

    bad = subprocess.run([sys.executable, str(SCRIPT), "--model", str(llama_dir), "--rows", "1",
                          "--against", "no-such-revision"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no library of no-such-revision" in bad.stderr
    wrong = subprocess.run([sys.executable, str(SCRIPT), "--dtype", "bfloat16", "--against", "HEAD"],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and "--against times the native float32 kernel" in wrong.stderr
