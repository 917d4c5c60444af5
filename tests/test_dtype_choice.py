"""model.dtype: auto on a CPU is bfloat16 where the CPU has bf16 matrix units (AMX-BF16 or
AVX512-BF16) and float32 elsewhere, says why at start-up naming the CPU's units or instruction
sets, and any dtype asked for is kept."""
import logging

import pytest
import torch

from prefix_service import cpuinfo
from prefix_service.model.loader import choose_dtype

SAPPHIRE_RAPIDS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"})
ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
ZEN3 = frozenset({"avx2", "fma"})
SKYLAKE_X = frozenset({"avx2", "fma", "avx512f", "avx512bw"})


@pytest.mark.parametrize("flags,dtype,why", [
    (SAPPHIRE_RAPIDS, torch.bfloat16,
     "bfloat16 (this CPU has bf16 matrix units: AMX-BF16, AVX512-BF16; model.dtype: float32"),
    (ZEN4, torch.bfloat16, "bfloat16 (this CPU has bf16 matrix units: AVX512-BF16;"),
    (ZEN3, torch.float32, "no bf16 matrix units; it has AVX2"),
    (SKYLAKE_X, torch.float32, "it has AVX-512, AVX2"),
])
def test_auto_on_a_cpu_is_bf16_only_with_bf16_units_and_says_why(llama_dir, flags, dtype, why):
    got, reason = choose_dtype("auto", llama_dir, torch.device("cpu"), cpu_flags=flags)
    assert got == dtype and why in reason and reason.startswith("auto")


def test_a_dtype_asked_for_is_kept_whatever_the_cpu(llama_dir):
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        for flags in (SAPPHIRE_RAPIDS, ZEN3):
            assert choose_dtype(name, llama_dir, torch.device("cpu"), cpu_flags=flags) == (dtype,
                                                                                          "asked for (model.dtype)")


def test_auto_on_a_gpu_is_the_checkpoints_dtype_bf16_for_float32(llama_dir):
    dtype, why = choose_dtype("auto", llama_dir, torch.device("cuda"))
    assert dtype == torch.bfloat16 and "GPU" in why  # the tiny checkpoints are float32


def test_isa_names_what_this_cpu_has():
    flags = cpuinfo.cpu_flags()
    names = cpuinfo.isa()
    assert ("AVX2" in names) == ("avx2" in flags) and ("AMX-BF16" in names) == ("amx_bf16" in flags)
    assert cpuinfo.bf16_units() == [n for n in names if n in ("AMX-BF16", "AVX512-BF16")]


def test_the_engine_logs_the_dtype_and_why(make_engine, caplog):
    caplog.set_level(logging.INFO, logger="prefix_service.engine")
    engine = make_engine(dtype="auto")
    want = torch.bfloat16 if cpuinfo.bf16_units() else torch.float32
    name = str(want).replace("torch.", "")
    assert engine._core.dtype == want
    assert f"model dtype {name}: auto, on a CPU: {name} (this CPU has" in caplog.text
    assert all(k.dtype == want for k, _ in engine._core.backend.kv_layers)  # the cache in the compute dtype
