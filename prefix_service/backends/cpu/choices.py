"""What the cpu backend's kernels would run here, without building a model: the libraries, and each
choice the decoder stack makes as it packs a model of a dtype under the PREFIX_SERVICE_* variables
set (`prefix-service env`, through backends.cpu_kernel_choices)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from prefix_service import cpuinfo
from prefix_service.backends.cpu import linear, native, onednn


def _float32_linears() -> str:
    kernel = linear.float32_kernel()
    if kernel == "measure":
        return "timed when the model is built (measure)"
    return linear.float32_choice(linear.float32_native_rows() if kernel == "inner_product" else None)


def kernel_choices(dtype: torch.dtype | None, head_size: int | None,
                   probe: Callable[[Callable[[], Any]], Any]) -> dict[str, Any]:
    """The libraries (whether each loads, and what it is built for) and the choices for a model of
    `dtype` (None: both dtypes') with heads of `head_size` (None: the attention choices, which depend
    on it, are left out), each through `probe`."""
    out: dict[str, Any] = {"native_library": probe(lambda: native.load()[1] or f"loads ({native.isa()})"),
                           "native_built_for": cpuinfo.target() or "native (this CPU)",
                           "onednn_library": probe(lambda: onednn.load()[1] or "loads")}
    try:
        if native.load()[0] is None:
            return out
    except Exception:  # noqa: BLE001 - a setting the library's load reads: reported above, in native_library
        return out
    out["decode_prefetch"] = probe(native.decode_prefetch)
    if dtype is None or dtype == torch.float32:
        out["float32_linears"] = probe(_float32_linears)
        out["float32_panels"] = probe(linear.float32_panels)
    if (dtype is None or dtype == torch.bfloat16) and onednn.load()[0] is not None:
        out["bf16_linears"] = probe(onednn.default_kernel)
        out["bf16_dot_products"] = probe(onednn.few_rows_choice)
        out["onednn_multiplies_bf16"] = onednn.bf16_native()
        out["amx_brgemm"] = onednn.brgemm_vnni()
        if head_size is not None:
            out["bf16_template_attention"] = probe(lambda: onednn.template_attention(head_size))
            out["bf16_template_products"] = probe(lambda: onednn.template_kernel(head_size))
            out["bf16_prompt_attention"] = probe(lambda: onednn.prompt_attention(head_size))
    return out
