"""A decoder layer's work before and after attention, one native call each (csrc/cpu_layer.cpp).

With the linear layers (cpu_linear.py) and the element-wise work (cpu_elementwise.py) both in the
native library, a layer is nine kernel calls from Python, and each costs its argument checks, an
output allocation and a ctypes call: on a 100-token prefill after a template that was most of
the time spent outside the kernels, and it does not shrink with the prompt. `LayerBlocks` checks
a layer's weights once, when it is bound, then runs the first norm, the q/k/v projection and the
rotation as one call, and the output projection, the second norm and the MLP as another. The
kernels, their order and their arguments are the layer's own, so the results are the same bit
for bit as calling them one by one.
"""
from __future__ import annotations

import torch

from prefix_service import native
from prefix_service.cpu_linear import NativeLinear

PROFILE_SCOPE = "prefix_service::cpu_layer"


class NativeLayerError(RuntimeError):
    pass


def _status(code: int, name: str) -> None:
    if code:
        raise NativeLayerError(f"{name} failed with status {code} (1: no AVX-512 in this build, 2: odd head size, "
                               f"3: out of memory)")


def unsupported(layer) -> str | None:
    """None when `layer` (a DecoderLayer) can run on LayerBlocks, else why not."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(m, NativeLinear) for m in linears):
        return "its linear layers are not on the native kernel"
    if attn.q_norm is not None:
        return "q/k norms (Qwen3) are not part of the blocks"
    if any(m.bias is not None for m in linears[1:]):
        return "only the q/k/v projection may have a bias"
    return None


class LayerBlocks:
    """The calls of one DecoderLayer whose linear layers are NativeLinear (see unsupported())."""

    def __init__(self, layer) -> None:
        why = unsupported(layer)
        if why is not None:
            raise NativeLayerError(f"this layer cannot run on native blocks: {why}")
        self.layer = layer
        attn = layer.self_attn
        self.hidden = attn.qkv_proj.in_features
        self.n_qkv = attn.qkv_proj.out_features
        self.q_size = attn.q_size
        self.rot_heads = attn.num_heads + attn.num_kv_heads  # the q and k heads lead each qkv row
        self.head_dim = attn.head_dim
        self.inter = layer.mlp.inter
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = norm.weight
            if w.dtype != torch.float32 or w.shape != (self.hidden,) or not w.is_contiguous():
                raise NativeLayerError(f"norm weight: float32 [{self.hidden}] is needed, got {w.dtype} {tuple(w.shape)}")

    def _check_stream(self, x: torch.Tensor, pending: torch.Tensor | None) -> int:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.hidden or x.stride(1) != 1:
            raise NativeLayerError(f"x: float32 [T, {self.hidden}] with dense rows is needed, got {x.dtype} "
                                   f"{tuple(x.shape)}")
        if pending is not None and (pending.shape != x.shape or not pending.is_contiguous()
                                    or pending.dtype != torch.float32):
            raise NativeLayerError(f"pending: a contiguous float32 {tuple(x.shape)} is needed, got "
                                   f"{pending.dtype} {tuple(pending.shape)}")
        return x.shape[0]

    def qkv(self, x: torch.Tensor, pending: torch.Tensor | None, rotate) -> torch.Tensor:
        """x [T, hidden] += pending (in place); returns the q/k/v projection [T, q + 2 kv] of its
        norm, q and k rotated by `rotate` (a cpu_elementwise.Rotation of the forward's T positions)."""
        t = self._check_stream(x, pending)
        if rotate.positions.shape[0] != t or rotate.cos.shape[1] != self.head_dim:
            raise NativeLayerError(f"the rotation is for {rotate.positions.shape[0]} positions of head size "
                                   f"{rotate.cos.shape[1]}, the layer has {t} rows of head size {self.head_dim}")
        layer = self.layer
        norm, proj = layer.input_layernorm, layer.self_attn.qkv_proj
        out = torch.empty(t, self.n_qkv, dtype=torch.float32)
        lib = native.require(NativeLayerError)
        _status(native.call(
            lib.ps_layer_qkv, PROFILE_SCOPE, x.data_ptr(), x.stride(0),
            pending.data_ptr() if pending is not None else None, t, self.hidden, norm.weight.data_ptr(), norm.eps,
            proj.packed.data_ptr(), self.n_qkv, proj.bias.data_ptr() if proj.bias is not None else None,
            self.rot_heads, self.head_dim, rotate.positions.data_ptr(), rotate.cos.data_ptr(), rotate.sin.data_ptr(),
            out.data_ptr(), torch.get_num_threads()), "ps_layer_qkv")
        return out

    def mlp(self, attn_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """attn_out [T, q] (the heads' outputs, dense rows): x += its output projection (in place);
        returns the MLP output of x's norm [T, hidden], which the next layer adds to x."""
        t = self._check_stream(x, None)
        if attn_out.dtype != torch.float32 or attn_out.shape != (t, self.q_size) or attn_out.stride(1) != 1:
            raise NativeLayerError(f"attn_out: float32 [{t}, {self.q_size}] with dense rows is needed, got "
                                   f"{attn_out.dtype} {tuple(attn_out.shape)}")
        layer = self.layer
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        lib = native.require(NativeLayerError)
        _status(native.call(
            lib.ps_layer_mlp, PROFILE_SCOPE, attn_out.data_ptr(), attn_out.stride(0), t, self.q_size,
            layer.self_attn.o_proj.packed.data_ptr(), x.data_ptr(), x.stride(0), self.hidden, norm.weight.data_ptr(),
            norm.eps, mlp.gate_up_proj.packed.data_ptr(), self.inter, mlp.down_proj.packed.data_ptr(), out.data_ptr(),
            torch.get_num_threads()), "ps_layer_mlp")
        return out
