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

import weakref

import torch

from prefix_service.backends.cpu import native
from prefix_service.backends.cpu.linear import NativeLinear

PROFILE_SCOPE = "prefix_service::cpu_layer"


class NativeLayerError(RuntimeError):
    pass


def _status(code: int, name: str) -> None:
    if code:
        raise NativeLayerError(f"{name} failed with status {code} (1: no AVX-512 in this build, 2: odd head size, "
                               f"3: out of memory, 4: a slot or block id outside the cache)")


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


def _pointers(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


class DecoderStack:
    """All DecoderLayers of a model, each bound to LayerBlocks, with their KV caches (`kv_layers`,
    per layer (k_cache, v_cache)) and attention on the native kernel: one native call per forward
    (csrc/cpu_layer.cpp, ps_decoder_stack), running for each layer the calls the per-layer path
    makes (LayerBlocks.qkv, the attention of TorchAttentionBackend's native path, LayerBlocks.mlp)
    in their order, with their arguments: the same results bit for bit."""

    def __init__(self, layers, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not layers or any(layer.blocks is None for layer in layers):
            raise NativeLayerError("every layer needs its LayerBlocks bound (LlamaForCausalLM.use_layer_blocks)")
        if len(kv_layers) != len(layers):
            raise NativeLayerError(f"{len(kv_layers)} KV caches for {len(layers)} layers")
        first = layers[0].self_attn
        self.hq, self.hkv, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.scale
        self.hidden, self.inter = layers[0].blocks.hidden, layers[0].blocks.inter
        shape = kv_layers[0][0].shape
        for layer, (k, v) in zip(layers, kv_layers):
            attn = layer.self_attn
            if ((attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) != (self.hq, self.hkv, self.head_dim, self.scale)
                    or (layer.blocks.hidden, layer.blocks.inter) != (self.hidden, self.inter)):
                raise NativeLayerError("the layers differ in their sizes")
            for c in (k, v):
                if (c.shape != shape or c.dim() != 4 or c.shape[2:] != (self.hkv, self.head_dim)
                        or c.dtype != torch.float32 or not c.is_contiguous() or c.device.type != "cpu"):
                    raise NativeLayerError(f"the KV cache: contiguous float32 CPU [blocks, block_size, {self.hkv}, "
                                           f"{self.head_dim}] tensors alike are needed, got {c.dtype} {tuple(c.shape)}")
        self.layers = list(layers)
        self.kv_layers = [(k, v) for k, v in kv_layers]
        self.num_blocks, self.block_size = shape[0], shape[1]
        self.weights = _pointers([[
            layer.input_layernorm.weight.data_ptr(), layer.self_attn.qkv_proj.packed.data_ptr(),
            layer.self_attn.qkv_proj.bias.data_ptr() if layer.self_attn.qkv_proj.bias is not None else 0,
            layer.post_attention_layernorm.weight.data_ptr(), layer.self_attn.o_proj.packed.data_ptr(),
            layer.mlp.gate_up_proj.packed.data_ptr(), layer.mlp.down_proj.packed.data_ptr()] for layer in layers])
        self.eps = torch.tensor([[layer.input_layernorm.eps, layer.post_attention_layernorm.eps] for layer in layers],
                                dtype=torch.float32)
        self.caches = _pointers([[k.data_ptr(), v.data_ptr()] for k, v in kv_layers])
        self._no_template = torch.zeros(len(layers), 2, dtype=torch.int64)
        self._template_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PackedPrefixKV: its pointers

    def serves(self, kv_layers) -> bool:
        """Whether `kv_layers` are the caches this stack was bound to."""
        return len(kv_layers) == len(self.kv_layers) and all(
            k is bk and v is bv for (k, v), (bk, bv) in zip(kv_layers, self.kv_layers))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst = block src in every layer's K and V cache, for each (src, dst) pair: the
        copy-on-write of a template's partial last block, one native call for all layers. The
        destinations must be distinct from each other and from every source."""
        dst = [d for _, d in pairs]
        if len(set(dst)) != len(dst) or set(dst) & {s for s, _ in pairs}:
            raise NativeLayerError(f"copy_blocks: the destinations must be distinct from each other and from the "
                                   f"sources, got {pairs}")
        k = self.kv_layers[0][0]
        flat = torch.tensor(pairs, dtype=torch.int64).view(-1)
        _status(native.require(NativeLayerError).ps_copy_blocks(
            self.caches.data_ptr(), len(self.layers), self.num_blocks, k[0].numel(), flat.data_ptr(), len(pairs)),
            "ps_copy_blocks")

    def template_pointers(self, packed) -> torch.Tensor:
        """[layers, 2]: a PackedPrefixKV's K panels and V rows per layer, as this stack reads them."""
        if not packed.native:
            raise NativeLayerError("the template is packed for oneDNN attention, not the native kernel")
        entries = [packed.layer(k) for k, _ in self.kv_layers]
        return _pointers([[kt.data_ptr(), vt.data_ptr()] for kt, vt, _ in entries])

    def _templates(self, packed: list) -> torch.Tensor | None:
        if not any(p is not None for p in packed):
            return None
        rows = []
        for p in packed:
            if p is None:
                rows.append(self._no_template)
                continue
            table = self._template_tables.get(p)
            if table is None:
                table = self._template_tables[p] = self.template_pointers(p)
            rows.append(table)
        return torch.stack(rows)

    def forward(self, x: torch.Tensor, rotate, meta) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens, dense) is the residual stream, updated in place; returns
        the last layer's MLP output, which the final norm adds to x. `rotate`: the forward's
        cpu_elementwise.Rotation; meta: the step's AttentionMetadata (decodes first, then prefills)."""
        t = x.shape[0]
        if (x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.hidden or not x.is_contiguous()):
            raise NativeLayerError(f"x: contiguous float32 [T, {self.hidden}] is needed, got {x.dtype} {tuple(x.shape)}")
        if rotate.positions.shape[0] != t or rotate.cos.shape[1] != self.head_dim:
            raise NativeLayerError(f"the rotation is for {rotate.positions.shape[0]} positions of head size "
                                   f"{rotate.cos.shape[1]}, the step has {t} rows of head size {self.head_dim}")
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or slots.shape != (t,) or not slots.is_contiguous():
            raise NativeLayerError(f"slot_mapping: int64 [{t}] is needed, got {slots.dtype} {tuple(slots.shape)}")
        nd, q_lens, ctx = meta.num_decode_tokens, meta.prefill_q_lens, meta.prefill_prefix_lens_list
        if nd + sum(q_lens) != t or len(ctx) != len(q_lens):
            raise NativeLayerError(f"the step plans {nd} decodes and prefills of {q_lens} tokens for {t} rows")
        dec_tables, dec_ctx = meta.decode_block_tables, meta.decode_context_lens
        if nd and (dec_tables.dtype != torch.int32 or dec_tables.dim() != 2 or dec_tables.shape[0] != nd
                   or dec_tables.stride(1) != 1 or dec_ctx.dtype != torch.int32 or dec_ctx.shape != (nd,)
                   or not dec_ctx.is_contiguous()):
            raise NativeLayerError(f"decode_block_tables int32 [{nd}, W] and decode_context_lens int32 [{nd}] are needed")
        pre_tables = meta.prefill_block_tables
        if q_lens and (pre_tables.dtype != torch.int32 or pre_tables.dim() != 2 or pre_tables.shape[0] != len(q_lens)
                       or pre_tables.stride(1) != 1):
            raise NativeLayerError(f"prefill_block_tables: int32 [{len(q_lens)}, W] is needed")
        dec_packed = meta.decode_packed if nd and meta.decode_packed else [None] * nd
        pre_packed = meta.prefill_packed or [None] * len(q_lens)
        bs = self.block_size
        skip = None
        if any(p is not None for p in dec_packed):
            skip = torch.tensor([p.num_blocks if p is not None else 0 for p in dec_packed], dtype=torch.int32)
        firsts = [p.num_blocks * bs if p is not None else 0 for p in pre_packed]
        info = torch.tensor([[q, c, f] for q, c, f in zip(q_lens, ctx, firsts)], dtype=torch.int32).view(-1, 3)
        templates = self._templates(list(dec_packed) + list(pre_packed))
        pending = torch.empty(t, self.hidden, dtype=torch.float32)
        lib = native.require(NativeLayerError)
        _status(lib.ps_decoder_stack(
            x.data_ptr(), t, self.hidden, len(self.layers), self.weights.data_ptr(), self.eps.data_ptr(),
            self.caches.data_ptr(), self.num_blocks, bs, self.hq, self.hkv, self.head_dim, self.inter, self.scale,
            rotate.positions.data_ptr(), rotate.cos.data_ptr(), rotate.sin.data_ptr(), slots.data_ptr(),
            nd, dec_tables.data_ptr() if nd else None, dec_tables.stride(0) if nd else 0,
            dec_ctx.data_ptr() if nd else None, skip.data_ptr() if skip is not None else None,
            len(q_lens), info.data_ptr(), pre_tables.data_ptr() if q_lens else None,
            pre_tables.stride(0) if q_lens else 0, pre_tables.shape[1] if q_lens else 0,
            templates.data_ptr() if templates is not None else None, pending.data_ptr(), torch.get_num_threads()),
            "ps_decoder_stack")
        return pending
