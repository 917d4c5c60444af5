"""Int8 weights (model.quantization: int8): each decoder layer's linear weights held as int8 with one
float32 scale per output row, W[i][j] = q[i][j] scale[i], scale[i] = max_j |W[i][j]| / 127 and q the
weight over it rounded to nearest, in -127 .. 127 (symmetric, per channel, weight-only: activations
stay in the compute dtype).

`quantize_model` makes that the model every backend runs: each quantized linear's weight is replaced
by q diag(scale) in the compute dtype (exact in float32; in bfloat16 each product q scale is rounded
once). Where the model lives on a CPU, each such linear also keeps (q, scale) (`int8_weight`) until
the engine's backend is built: the cpu backend packs q for its kernels (float32: every call,
csrc/cpu_linear.cpp's ps_linear_int8; bf16: the few-row calls, csrc/onednn_linear.cpp's
ps_onednn_pack), and the engine then drops them (`release_int8`). The output head and the
embeddings stay as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from prefix_service.config import QUANTIZATIONS
from prefix_service.errors import ModelLoadError

INT8_MAX = 127
_ATTR = "int8_weight"  # a quantized linear's (q, scale), a plain attribute (not a parameter or buffer)
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the decoder linears quantized
# the same linears as a Hugging Face checkpoint names them (ours fuse q/k/v and gate/up; per output
# row, quantizing the parts apart is quantizing the fused weight)
_HF_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q int8 [N, K], scale float32 [N]) with W ~ q diag(scale): per output row, the
    largest magnitude maps to 127 (a row of zeros gets scale 0 and q 0)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8: a floating-point [N, K] weight is needed, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("quantize_int8: the weight holds inf or NaN")
    scale = w.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q diag(scale) in `dtype` (computed in float32, rounded once)."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def int8_problem(pair: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, ...]) -> str | None:
    """None where pair is the (q, scale) of a weight of `shape` as the cpu backend's kernels take them
    (q int8 [N, K], scale float32 [N]), else what is wrong."""
    q, scale = pair
    if q.dtype == torch.int8 and q.shape == shape and scale.dtype == torch.float32 and scale.shape == shape[:1]:
        return None
    return (f"int8: q int8 {tuple(shape)} and scale float32 [{shape[0]}] are needed, got {q.dtype} "
            f"{tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}")


def dequantized_checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors (names as its safetensors or state dict give them) with
    each weight quantize_model quantizes replaced by q diag(scale) in float32: how a model with
    model.quantization int8 reads to transformers (the references of tests/ and scripts/eval_int8.py)."""
    return {name: dequantize(*quantize_int8(t), torch.float32)
            if name.endswith(".weight") and any(f".{part}." in name for part in _HF_QUANTIZED) else t
            for name, t in tensors.items()}


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linears quantize_model quantizes: each decoder layer's q/k/v, o, gate/up and down."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in _LINEARS]


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize the model's decoder linears in place (module docstring); returns how many. `method`:
    one of QUANTIZATIONS ("none" changes nothing). A weight holding inf or NaN raises ModelLoadError
    naming it."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization {method!r}: one of {', '.join(QUANTIZATIONS)} is needed")
    if method == "none":
        return 0
    linears = quantized_linears(model)
    for name, m in linears:
        try:
            q, scale = quantize_int8(m.weight)
        except ValueError as exc:
            raise ModelLoadError(f"model.quantization {method}: cannot quantize {name}.weight: {exc}") from exc
        m.weight.data = dequantize(q, scale, m.weight.dtype)
        setattr(m, _ATTR, (q, scale) if m.weight.device.type == "cpu" else None)
    return len(linears)


def int8_weight(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A quantized linear's (q, scale) where quantize_model kept them, else None."""
    pair = getattr(m, _ATTR, None)
    return pair if isinstance(pair, tuple) else None


def release_int8(model: nn.Module) -> None:
    """Drop every quantized linear's (q, scale): the engine's call once the backend has copied what
    it packs (the cpu backend's few-row kernel), so a backend that reads none holds none."""
    for _, m in quantized_linears(model):
        if hasattr(m, _ATTR):
            setattr(m, _ATTR, None)
