"""model.dtype: auto on a CPU is bfloat16 where bf16 outruns float32 (AMX-BF16, or AVX512-BF16 on
an AMD CPU) and float32 elsewhere (no bf16 units, or Intel's AVX512-BF16 without AMX), says why at
start-up naming the CPU's units or instruction sets, and any dtype asked for is kept."""
import json
import logging
import os
import platform

import pytest
import torch

from prefix_service import cpuinfo
from prefix_service.model.loader import choose_dtype

SAPPHIRE_RAPIDS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
COOPER_LAKE = ZEN4
ZEN3 = frozenset({"avx2", "fma"})
SKYLAKE_X = frozenset({"avx2", "fma", "avx512f", "avx512bw"})


INTEL, AMD = "GenuineIntel", "AuthenticAMD"


@pytest.mark.parametrize("flags,vendor,dtype,why", [
    (SAPPHIRE_RAPIDS, INTEL, torch.bfloat16,
     "bfloat16 (this CPU has bf16 matrix units: AMX-BF16, AVX512-BF16; model.dtype: float32"),
    (ZEN4, AMD, torch.bfloat16, "bfloat16 (this CPU has bf16 matrix units: AVX512-BF16;"),
    # Cooper Lake, or a Sapphire Rapids whose kernel or hypervisor keeps AMX from processes
    (COOPER_LAKE, INTEL, torch.float32,
     "float32 (this Intel CPU has AVX512-BF16, AVX-512, AVX2 but no AMX: its bf16 dot products run at half"),
    (ZEN3, AMD, torch.float32, "no bf16 matrix units; it has AVX2"),
    (SKYLAKE_X, INTEL, torch.float32, "no bf16 matrix units; it has AVX-512, AVX2"),
])
def test_auto_on_a_cpu_is_bf16_only_where_it_outruns_float32_and_says_why(llama_dir, flags, vendor, dtype, why):
    got, reason = choose_dtype("auto", llama_dir, torch.device("cpu"), cpu_flags=flags, cpu_vendor=vendor)
    assert got == dtype and why in reason and reason.startswith("auto")
    assert cpuinfo.bf16_is_faster(flags, vendor) == (dtype == torch.bfloat16)


def test_the_vendor_is_read_from_the_cpu(llama_dir, monkeypatch):
    """Without a vendor given, the host's decides: the same AVX512-BF16 flags are bf16 on AMD, float32 on Intel."""
    for vendor, dtype in ((AMD, torch.bfloat16), (INTEL, torch.float32)):
        monkeypatch.setattr(cpuinfo, "cpu_vendor", lambda v=vendor: v)
        assert choose_dtype("auto", llama_dir, torch.device("cpu"), cpu_flags=ZEN4)[0] == dtype


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"),
                    reason="reads an x86 Linux CPU's /proc/cpuinfo")
def test_cpu_vendor_names_this_x86_cpu():
    assert cpuinfo.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls", "Shanghai")


def test_a_dtype_asked_for_is_kept_whatever_the_cpu(llama_dir):
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        for flags in (SAPPHIRE_RAPIDS, ZEN3):
            assert choose_dtype(name, llama_dir, torch.device("cpu"), cpu_flags=flags) == (dtype,
                                                                                          "asked for (model.dtype)")


def test_auto_on_a_gpu_is_the_checkpoints_dtype_bf16_for_float32(llama_dir):
    dtype, why = choose_dtype("auto", llama_dir, torch.device("cuda"))
    assert dtype == torch.bfloat16 and "GPU" in why  # the tiny checkpoints are float32


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])  # transformers 5 writes dtype, older ones torch_dtype
@pytest.mark.parametrize("saved,dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                         ("float32", torch.bfloat16), ("torch.float16", torch.float16)])
def test_auto_on_a_gpu_keeps_a_half_precision_checkpoints_dtype_under_either_key(llama_dir, tmp_path, key, saved,
                                                                                 dtype):
    cfg = {k: v for k, v in json.loads((llama_dir / "config.json").read_text()).items()
           if k not in ("dtype", "torch_dtype")}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: saved}))
    got, why = choose_dtype("auto", tmp_path, torch.device("cuda"))
    assert got == dtype
    assert why == ("auto, on a GPU: bfloat16 for a float32 checkpoint" if saved == "float32"
                   else "auto, on a GPU: the checkpoint's dtype")


def test_isa_names_what_this_cpu_has():
    flags = cpuinfo.cpu_flags()
    names = cpuinfo.isa()
    assert ("AVX2" in names) == ("avx2" in flags) and ("AMX-BF16" in names) == ("amx_bf16" in flags)
    assert cpuinfo.bf16_units() == [n for n in names if n in ("AMX-BF16", "AVX512-BF16")]


def test_the_engine_logs_the_dtype_and_why(make_engine, caplog):
    caplog.set_level(logging.INFO, logger="prefix_service.engine")
    engine = make_engine(dtype="auto")
    want = torch.bfloat16 if cpuinfo.bf16_is_faster() else torch.float32
    name = str(want).replace("torch.", "")
    assert engine._core.dtype == want
    assert f"model dtype {name}: auto, on a CPU: {name} (this CPU has" in caplog.text
    assert all(k.dtype == want for k, _ in engine._core.backend.kv_layers)  # the cache in the compute dtype
