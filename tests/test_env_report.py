"""`prefix-service env` (prefix_service/env_report.py): the dtype and backend it reports are the ones an
engine gets from the same config; a failing probe is reported in its place, the others still run,
and the command exits 1; a secret's value never shows."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from prefix_service import env_report, envs
from prefix_service.backends import select_backend
from prefix_service.cli import main
from prefix_service.engine.core import resolve_device
from prefix_service.errors import ConfigError
from prefix_service.model.loader import choose_dtype, read_arch


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


def config_file(tmp_path, model_dir, **model) -> str:
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(model_dir), "device": "cpu", **model},
                                    "cache": {"block_size": 4, "num_blocks": 64}}))
    return str(path)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_the_report_names_what_an_engine_gets(tmp_path, model_dir, capsys, dtype):
    path = config_file(tmp_path, model_dir, dtype=dtype)
    assert main(["env", "--config", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    device = resolve_device("cpu")
    chosen, why = choose_dtype(dtype, model_dir, device)
    model = report["model"]
    assert (model["dtype"], model["dtype_why"]) == (str(chosen).removeprefix("torch."), why)
    backend = select_backend("auto", device, chosen, read_arch(model_dir)).name
    assert model["backend"].split(" ")[0] == backend, model["backend"]
    assert report["machine"]["isa"] == __import__("prefix_service").cpuinfo.isa()
    assert report["environment"] == {"set": {}, "check": "every value is taken"}
    if backend == "cpu" and chosen == torch.float32:
        assert report["cpu_kernels"]["float32_panels"] == "auto"
        assert "bf16_linears" not in report["cpu_kernels"]


def test_a_setting_not_taken_is_reported_where_it_is_read_and_fails_the_command(tmp_path, model_dir, capsys,
                                                                                  monkeypatch):
    from prefix_service.backends.cpu import native
    if native.load()[0] is None:
        pytest.skip(f"no native CPU kernels here to read the setting: {native.load()[1]}")
    monkeypatch.setenv("PREFIX_SERVICE_F32_PANELS", "bf16")
    monkeypatch.setenv("PREFIX_SERVICE_ADMIN_TOKEN", "tok-s3cret")
    assert main(["env", "--config", config_file(tmp_path, model_dir, dtype="float32")]) == 1
    out = capsys.readouterr().out
    says = "error: PREFIX_SERVICE_F32_PANELS='bf16': one of auto, float32 is needed"
    for key in ("float32_panels", "check"):  # the kernels' probe, and the environment's check
        assert any(line.split()[:1] == [key] and line.endswith(says) for line in out.splitlines()), (key, out)
    assert "dtype_why" in out and "decode_prefetch" in out  # the other probes ran
    assert "tok-s3cret" not in out and "PREFIX_SERVICE_ADMIN_TOKEN=(set)" in out


@pytest.mark.parametrize("var,value", [("PREFIX_SERVICE_DECODE_PREFETCH", "bogus"),
                                       ("PREFIX_SERVICE_CPU_MARCH", "bogus")])
def test_a_setting_the_native_librarys_load_reads_is_reported_in_its_place(tmp_path, model_dir, var, value):
    """Read while the native library loads: a fresh process (this one's library is loaded already)
    prints the whole report with the error in the library's place, and exits 1."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from prefix_service.backends.cpu import native
    if native.load()[0] is None:
        pytest.skip(f"no native CPU kernels here to read the setting: {native.load()[1]}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFIX_SERVICE_") or k == "PREFIX_SERVICE_CACHE_DIR"}
    run = subprocess.run([sys.executable, "-m", "prefix_service", "env", "--config",
                          config_file(tmp_path, model_dir, dtype="float32")], capture_output=True, text=True,
                         env={**env, var: value}, cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    library = [line for line in run.stdout.splitlines() if line.split()[:1] == ["native_library"]]
    assert library and f"error: {var}={value!r}"[:len(var) + 8] in library[0], run.stdout
    assert "dtype_why" in run.stdout and "onednn_library" in run.stdout  # the rest of the report


def test_a_model_path_without_a_model_is_an_error_in_its_place(tmp_path, capsys):
    assert main(["env", "--config", config_file(tmp_path, tmp_path / "none"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "holds no config.json" in report["model"]["error"]
    assert report["machine"]["cores_usable"] >= 1 and "cpu_kernels" in report
    assert env_report.failed(report) == [f"model.error: {report['model']['error']}"]


def test_without_a_model_the_kernel_report_gives_both_dtypes_choices(tmp_path, capsys):
    """The model's dtype and head size unknown: the cpu kernels' choices for a float32 model and for a
    bfloat16 one, and none of the attention's (they depend on the head size)."""
    from prefix_service.backends.cpu import native, onednn
    if native.load()[0] is None:
        pytest.skip(f"no native CPU kernels here: {native.load()[1]}")
    main(["env", "--config", config_file(tmp_path, tmp_path / "none"), "--json"])
    kernels = json.loads(capsys.readouterr().out)["cpu_kernels"]
    assert {"float32_linears", "float32_panels"} <= set(kernels)
    if onednn.load()[0] is not None:
        assert {"bf16_linears", "bf16_dot_products", "onednn_multiplies_bf16", "amx_brgemm"} <= set(kernels)
        assert kernels["bf16_dot_products"] == onednn.few_rows_choice()
    assert not [k for k in kernels if "attention" in k or "template" in k]


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
def test_a_model_the_cpu_backend_cannot_run(tmp_path, model_dir, capsys, backend):
    """float16 on a CPU: auto stands the torch backend in and says why, cpu asked for is the config
    error serve would stop with (reported in its place, exit 1), torch is taken as asked."""
    path = config_file(tmp_path, model_dir, dtype="float16", backend=backend)
    code = main(["env", "--config", path, "--json"])
    said = json.loads(capsys.readouterr().out)["model"]["backend"]
    arch, device = read_arch(model_dir), torch.device("cpu")
    try:
        picked = select_backend(backend, device, torch.float16, arch).name
    except ConfigError as e:
        assert (code, said) == (1, f"{env_report.ERROR}{e}")
    else:
        assert code == 0 and said.split(" ")[0] == picked
        assert ("cannot run here" in said) == (backend == "auto"), said


def test_a_probe_that_raises_a_runtime_error_is_reported_in_its_place_and_fails_the_command(monkeypatch, capsys):
    """A RuntimeError from a probe (here the environment's check) is that probe's "error: ..." line,
    not a traceback: the rest of the report still prints and the command exits 1."""
    def broken_check():
        raise RuntimeError("the check broke")
    monkeypatch.setattr(envs, "check", broken_check)
    assert main(["env", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["environment"]["check"] == f"{env_report.ERROR}the check broke"
    assert "machine" in report and "cpu_kernels" in report
    assert env_report.failed(report) == ["environment.check: error: the check broke"]


def _kernel_libraries():
    from prefix_service.backends.cpu import native, onednn
    if native.load()[0] is None or onednn.load()[0] is None:
        pytest.skip(f"no native CPU kernels or no oneDNN library here: {native.load()[1] or onednn.load()[1]}")
    return native, onednn


def test_the_kernel_report_for_a_bf16_model_gives_the_attention_choices_for_its_head_size(monkeypatch):
    """A bfloat16 model with heads of 64: each attention choice is the one the library's function
    gives for that head size (stood in for, each saying what it was asked), the bf16 units' flags
    each their own, the native library's line names what it is built for, and none of a float32
    model's choices; a float16 model (which the cpu backend does not run) gets the libraries alone."""
    from prefix_service.backends import cpu_kernel_choices
    native, onednn = _kernel_libraries()
    monkeypatch.setattr(onednn, "template_attention", lambda head_size: f"template attention for {head_size}")
    monkeypatch.setattr(onednn, "template_kernel", lambda head_size, products=None: f"{head_size} within {products}")
    monkeypatch.setattr(onednn, "prompt_attention", lambda head_size: f"prompt attention for {head_size}")
    monkeypatch.setattr(onednn, "bf16_native", lambda: True)
    monkeypatch.setattr(onednn, "brgemm_vnni", lambda: False)
    kernels = cpu_kernel_choices(torch.bfloat16, 64, env_report._probe)
    assert kernels["bf16_template_attention"] == "template attention for 64"
    assert kernels["bf16_template_products"] == "64 within None"  # the cap the settings give, not one of its own
    assert kernels["bf16_prompt_attention"] == "prompt attention for 64"
    assert (kernels["onednn_multiplies_bf16"], kernels["amx_brgemm"]) == (True, False)
    assert kernels["native_library"] == f"loads ({native.isa()})" and kernels["onednn_library"] == "loads"
    assert not {"float32_linears", "float32_panels"} & set(kernels)
    assert set(cpu_kernel_choices(torch.float16, 64, env_report._probe)) == {
        "native_library", "native_built_for", "onednn_library", "decode_prefetch"}


@pytest.mark.parametrize("setting,rows", [("native", "64"), ("inner_product", "64"), ("inner_product", "0"),
                                          ("measure", "64")])
def test_the_kernel_report_says_what_a_float32_models_linears_run_under_each_setting(monkeypatch, setting, rows):
    """PREFIX_SERVICE_F32_LINEAR and PREFIX_SERVICE_F32_NATIVE_ROWS: the native kernel alone (the row
    count not read), the native kernel up to that many rows with oneDNN's inner product above (0:
    the inner product for every call), or timed when the model is built; and no bf16 choices."""
    from prefix_service.backends import cpu_kernel_choices
    from prefix_service.backends.cpu import linear
    _kernel_libraries()
    monkeypatch.setenv(linear.FLOAT32_ENV, setting)
    monkeypatch.setenv(linear.FLOAT32_ROWS_ENV, rows)
    kernels = cpu_kernel_choices(torch.float32, 64, env_report._probe)
    want = {"native": linear.float32_choice(None), "inner_product": linear.float32_choice(int(rows)),
            "measure": "timed when the model is built (measure)"}[setting]
    assert kernels["float32_linears"] == want
    assert not [k for k in kernels if "bf16" in k or k == "amx_brgemm" or "attention" in k]


def test_without_a_library_the_kernel_report_leaves_out_the_choices_that_need_it(monkeypatch):
    """The native library not loading: the libraries' lines alone, the reason in the native one's place
    (and the build target, where none is set, the CPU it runs on). oneDNN's not loading: the native
    kernels' choices for both dtypes, none of bf16's, and the reason in oneDNN's place."""
    from prefix_service import cpuinfo
    from prefix_service.backends import cpu_kernel_choices
    native, onednn = _kernel_libraries()
    with monkeypatch.context() as m:
        m.setattr(native, "load", lambda: (None, "no C++ compiler found (set CXX)"))
        m.setattr(cpuinfo, "target", lambda: None)
        kernels = cpu_kernel_choices(None, 64, env_report._probe)
        assert kernels == {"native_library": "no C++ compiler found (set CXX)", "native_built_for": "native (this CPU)",
                           "onednn_library": "loads"}
        m.setattr(cpuinfo, "target", lambda: "x86-64-v3")
        assert cpu_kernel_choices(None, 64, env_report._probe)["native_built_for"] == "x86-64-v3"
    monkeypatch.setattr(onednn, "load", lambda: (None, "no oneDNN library here: not built"))
    kernels = cpu_kernel_choices(None, 64, env_report._probe)
    assert kernels["onednn_library"] == "no oneDNN library here: not built"
    assert {"decode_prefetch", "float32_linears", "float32_panels"} <= set(kernels)
    assert not [k for k in kernels if "bf16" in k or k == "amx_brgemm" or "attention" in k]
