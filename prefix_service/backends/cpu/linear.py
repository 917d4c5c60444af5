"""Linear layers in the native CPU kernel (csrc/cpu_linear.cpp), each weight packed once at load.
The decoder stack calls the kernel from C++; `linear` and `NativeLinear` call it from Python (the
output head, tests, scripts/bench_cpu_linear.py).

oneDNN and MKL are tuned for large products with their operands in cache. Serving is the other
case: a forward reads every layer's weights once, from memory (a model is larger than the
caches), against one row (decode) to a few hundred (a request's own tokens after a template).
There both leave the FLOP units waiting on the weights (docs/benchmarks.md). The
kernel streams each weight panel from memory once per call with the next one prefetched, and
multiplies it against all the call's rows from registers. float32; the sums run in a fixed order
per output, so a row's result does not depend on the other rows of the call or the thread count.
"""
from __future__ import annotations

import torch
from torch import nn

from prefix_service.backends.cpu import native

PANEL = 16  # output columns per weight panel: the layout of pack_weight, as the kernel reads it


class NativeLinearError(RuntimeError):
    pass


def available(dtype: torch.dtype) -> str | None:
    """None when linear layers of `dtype` can run in the native kernel here, else the reason."""
    return native.unavailable(dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> the kernel's layout [ceil(N/16), K, 16]: panels of 16 output columns, zero-padded."""
    n, k = weight.shape
    pad = -n % PANEL
    w = weight.detach().to(torch.float32)
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


def _check_x(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise NativeLinearError(f"x: a float32 CPU tensor [M, K] with dense rows is needed, got {x.dtype} "
                                f"{tuple(x.shape)} strides {x.stride()} on {x.device}")


def _check_weight(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> None:
    if packed.shape != (-(-n // PANEL), k, PANEL) or not packed.is_contiguous():
        raise NativeLinearError(f"packed weight {tuple(packed.shape)} does not hold {n} x {k}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise NativeLinearError(f"bias: float32 [{n}] is needed, got {bias.dtype} {tuple(bias.shape)}")


def _run(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The kernel call, its operands checked by the caller."""
    lib = native.require(NativeLinearError)
    args = (x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), n,
            bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if lib.ps_linear(*args):
        raise NativeLinearError("the library was built without AVX-512 or AVX2")
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided) @ W.T + bias, W held as pack_weight(W) -> [M, N] float32."""
    native.require(NativeLinearError)
    _check_x(x)
    m, k = x.shape
    n = out_features
    _check_weight(packed, n, k, bias)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise NativeLinearError(f"out: float32 [{m}, {n}] with dense rows is needed, got {tuple(out.shape)}")
    return _run(x, packed, n, bias, out)


class NativeLinear(nn.Module):
    """y = x @ W.T + b with W held only in the kernel's layout. x: [..., in] float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # buffers, not parameters: they follow the module, and stay out of its state_dict
        self.register_buffer("packed", pack_weight(weight), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous(),
                             persistent=False)
        _check_weight(self.packed, self.out_features, self.in_features, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        _check_x(x2)  # the weight and bias were checked once, when packed
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        return _run(x2, self.packed, self.out_features, self.bias, out).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
