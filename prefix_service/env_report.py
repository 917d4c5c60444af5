"""`prefix-service env`: what this machine would serve a config with, without loading weights or
listening: the CPU and its instruction sets, the software, the dtype and backend `auto` picks and why,
each kernel choice of the cpu backend (building its libraries where they are not built yet), and the
PREFIX_SERVICE_* variables set. For a bug report, or to check a machine before serving on it; `--json`
gives the same as one object.

A probe that fails (a setting the machine cannot take, a library that does not build) is reported as
"error: ..." in its place and the command exits 1; the others still run.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

from prefix_service import backends, cpuinfo, envs
from prefix_service.errors import PrefixServiceError
from prefix_service.versions import dist_version

Report = dict[str, dict[str, Any]]
ERROR = "error: "


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (PrefixServiceError, OSError, RuntimeError) as e:  # the kernels' errors are PrefixServiceErrors
        return f"{ERROR}{e}"


def _versions() -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {"prefix_service": dist_version("prefix_service"), "python": platform.python_version(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for name in ("transformers", "grpc", "llguidance"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            out[name] = None
    return out


def _machine() -> dict[str, Any]:
    import torch
    return {"cpu": cpuinfo.first_field("model name") or platform.processor() or "?",
            "vendor": cpuinfo.cpu_vendor(), "isa": cpuinfo.isa(), "bf16_units": cpuinfo.bf16_units(),
            "cores_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "platform": platform.platform()}


def _model(config_path: str) -> tuple[dict[str, Any], Any, Any]:
    """The config's model part: (its report, the dtype and the architecture the kernels' part is for;
    None for both where the model directory holds no model)."""
    from prefix_service.config import load_config
    from prefix_service.engine.core import resolve_device
    from prefix_service.model.loader import checkpoint_dtype, choose_dtype, read_arch

    mc = load_config(config_path).engine.model
    out: dict[str, Any] = {"path": str(mc.path), "device_asked": mc.device, "dtype_asked": mc.dtype,
                           "backend_asked": mc.backend}
    if not (Path(mc.path) / "config.json").is_file():
        out["error"] = f"{mc.path} holds no config.json (prefix-service prepare-model makes the default model)"
        return out, None, None
    device = resolve_device(mc.device)
    dtype, why = choose_dtype(mc.dtype, mc.path, device)
    arch = read_arch(mc.path)
    out.update(device=str(device), checkpoint_dtype=str(checkpoint_dtype(mc.path)).removeprefix("torch."),
               dtype=str(dtype).removeprefix("torch."), dtype_why=why,
               arch=f"{arch.num_layers} layers, {arch.num_heads} query heads, {arch.num_kv_heads} KV heads of "
                    f"{arch.head_dim}, vocabulary {arch.vocab_size}")
    out["backend"] = _probe(lambda: "{} ({})".format(*backends.pick_backend(mc.backend, device, dtype, arch)[:2]))
    return out, dtype, arch


def _check_all() -> str:
    envs.check()
    return "every value is taken"


def collect(config_path: str | None) -> Report:
    report: Report = {"machine": _machine(), "software": _versions()}
    dtype = arch = None
    if config_path is not None:
        try:
            report["model"], dtype, arch = _model(config_path)
        except (PrefixServiceError, OSError) as e:
            report["model"] = {"config": config_path, "error": str(e)}
    report["cpu_kernels"] = backends.cpu_kernel_choices(dtype, None if arch is None else arch.head_dim, _probe)
    settings = envs.set_values(("kernels", "cuda", "build", "client", "tools"))
    settings |= {v.name: "(set)" for v in envs.VARIABLES if v.secret and envs.value(v.name) is not None}
    report["environment"] = {"set": settings, "check": _probe(_check_all)}
    return report


def failed(report: Report) -> list[str]:
    """The report's errors, as "section.key: message"."""
    return [f"{section}.{key}: {value}" for section, part in report.items() if isinstance(part, dict)
            for key, value in part.items()
            if (isinstance(value, str) and value.startswith(ERROR)) or key == "error"]


def render(report: Report) -> str:
    lines = []
    for section, part in report.items():
        lines.append(f"{section}:")
        width = max((len(k) for k in part), default=0)
        for key, value in part.items():
            if isinstance(value, (list, tuple)):
                value = ", ".join(map(str, value)) or "-"
            elif isinstance(value, dict):
                value = envs.listed(value) or "-"
            lines.append(f"  {key:<{width}}  {value}")
    return "\n".join(lines)


def main(config_path: str | None, as_json: bool) -> int:
    report = collect(config_path)
    print(json.dumps(report, indent=2, default=str) if as_json else render(report))
    return 1 if failed(report) else 0
