"""CPU linear layers on oneDNN, with each weight reordered once, at load, into oneDNN's blocked layout.

`F.linear` on a CPU goes to the BLAS torch links (MKL in the x86 wheels), which packs the weight
again on every call; with one to a few hundred rows per call, as in decode and short prefills,
that packing is a large share of the work, and MKL may also take a generic code path on CPUs it
does not tune for. oneDNN's inner product on a pre-reordered weight does neither. The numbers
are float32 (or the model's dtype) throughout; only the summation order differs from BLAS.
What it buys on a given machine: `prefix-service bench` with `model.cpu_linear: blas` vs `onednn`
(docs/benchmarks.md).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("prefix_service.engine")


def _ops_present() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def onednn_linear_available(dtype: torch.dtype) -> str | None:
    """None when packed oneDNN linears work for `dtype` on this build and CPU, else the reason.
    Checked once per dtype on a small random layer against `F.linear`."""
    if not _ops_present():
        return "this torch build has no oneDNN (mkldnn) linear ops"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            got = PackedLinear(weight, bias)(x)
    except RuntimeError as exc:  # an unsupported dtype on this CPU, a build without the kernel
        return f"oneDNN linear failed for {str(dtype).replace('torch.', '')}: {str(exc).splitlines()[0]}"
    want = F.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
    if got.shape != want.shape or (got.float() - want).abs().max().item() > tol:
        return "oneDNN linear disagreed with F.linear on a test layer"
    return None


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held only in oneDNN's layout. x: [N, in] (2-D, any N)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # An opaque oneDNN tensor: kept as a plain attribute, not a parameter or buffer.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, packed_cls: type = PackedLinear) -> int:
    """Replace every nn.Linear in `model` by packed_cls(weight, bias) (in place; PackedLinear, or
    cpu_linear.NativeLinear). Returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, packed_cls(child.weight, child.bias))
                count += 1
    return count
