"""The sampler's passes over a step's logits in the native CPU library (csrc/cpu_sampling.cpp):
each row's k largest logits, sorted (the candidates of top-k and top-p), each row's
log-normaliser, and a draw from a row's whole softmax (temperature alone). The cpu backend hands
them to the sampler (engine/sampler.py) as its `sampler_ops` (NativeSamplerOps): float32 logits on
the CPU where the library loads (`usable`) take them, anything else torch's passes.

On a CPU, torch's topk was most of a sampled step's time once many requests asked for a top-p
(docs/benchmarks.md, "Sampling"). Here a row's k largest are the values that reach a bar (the k-th
largest of the maxima of at least k blocks of the row), ranked by a stable radix sort; a whole
softmax's draw is a pass for the blocks' sums and one within the block picked. Equal logits rank in
index order, and a NaN counts as -inf, throughout.
"""
from __future__ import annotations

import torch

from prefix_service.backends.base import SamplerOps
from prefix_service.backends.cpu import native
from prefix_service.backends.cpu.native import NativeKernelError


def usable(x: torch.Tensor) -> bool:
    """Whether the passes below take x: float32 rows on the CPU, the library loaded."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and native.load()[0] is not None


def _rows(x: torch.Tensor, name: str) -> int:
    """x's row stride, after checking it is a float32 CPU matrix with dense rows."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise NativeKernelError(f"{name}: float32 CPU rows [R, V] with dense rows are needed, got {x.dtype} "
                                f"{tuple(x.shape)} on {x.device}, strides {x.stride()}")
    if x.shape[1] == 0:
        raise NativeKernelError(f"{name}: rows of at least one value are needed, got {tuple(x.shape)}")
    return x.stride(0)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, k], indices [R, k] int64): each row's k largest (1 <= k <= V), largest first, equal
    values in index order; x.topk(k) but for the order of ties and NaN (here -inf)."""
    stride = _rows(x, "top_k")
    rows, vocab = x.shape
    if not 0 < k <= vocab:
        raise NativeKernelError(f"top_k: k must be in [1, {vocab}], got {k}")
    values = torch.empty(rows, k, dtype=torch.float32)
    index = torch.empty(rows, k, dtype=torch.int64)
    if rows:
        native.check(native.require().ps_top_k_rows(x.data_ptr(), stride, rows, vocab, k, values.data_ptr(),
                                                    index.data_ptr(), torch.get_num_threads()), "ps_top_k_rows")
    return values, index


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[R]: each row's log of the sum of its exponentials (x.logsumexp(-1), a NaN counted as -inf)."""
    stride = _rows(x, "logsumexp")
    out = torch.empty(x.shape[0], dtype=torch.float32)
    if x.shape[0]:
        native.check(native.require().ps_logsumexp_rows(x.data_ptr(), stride, x.shape[0], x.shape[1], out.data_ptr(),
                                                        torch.get_num_threads()), "ps_logsumexp_rows")
    return out


def softmax_draw(x: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's token drawn from the softmax of x[r] / temperature[r] (float32, > 0) by
    uniform[r] (float64 in [0, 1)): the first index whose cumulative sum of exponentials passes
    uniform times the row's total (over blocks of 256 in float32, summed in float64, then in float64
    within the block picked); a pick of a token of probability 0 (a rounding at a block's end), or a
    row with no finite logit, gives the row's first largest."""
    stride = _rows(x, "softmax_draw")
    rows = x.shape[0]
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float64).contiguous()
    if temperature.shape != (rows,) or uniform.shape != (rows,):
        raise NativeKernelError(f"softmax_draw: a temperature and a uniform per row are needed, got "
                                f"{tuple(temperature.shape)} and {tuple(uniform.shape)} for {rows} rows")
    if rows and not bool((temperature > 0).all()):
        raise NativeKernelError(f"softmax_draw: temperatures must be positive, got {temperature.min().item()}")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        code = native.require().ps_softmax_draw_rows(x.data_ptr(), stride, rows, x.shape[1], temperature.data_ptr(),
                                                     uniform.data_ptr(), out.data_ptr(), torch.get_num_threads())
        native.check(code, "ps_softmax_draw_rows")
    return out


class NativeSamplerOps(SamplerOps):
    """The sampler's passes through top_k, logsumexp and softmax_draw above where they take the logits
    (`usable`), else torch's."""

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k(x.contiguous(), k) if usable(x) else super().top_k(x, k)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return logsumexp(x.contiguous()) if usable(x) else super().logsumexp(x)

    def softmax_draw(self, x: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor | None:
        return softmax_draw(x.contiguous(), temperature, uniform) if usable(x) else None


NATIVE_SAMPLER_OPS = NativeSamplerOps()
