"""Pinned templates' K and V held a second time, in the layout the native attention reads fastest.

A request that continues a template attends, at every layer, over the template's keys and values,
which do not change while the template is pinned. Packed once when it is pinned (K as panels of
16 keys, V as rows, per KV head: attention.pack_keys / pack_values), they are read by every
prefill and decode on it without gathering them through the block table.

A bfloat16 model may instead attend over it with matrix products in bf16 (onednn.template_attention()
"matrix": oneDNN's micro-kernel on AMX tiles where the CPU has them, else AVX512-BF16 dot products); the
template's K/V are then packed once in bf16 for that, half the float32 copy's bytes.

Cost: each packed template's K/V once more in host memory, outside cache.kv_cache_memory (reported
as kv_stats()["packed_template_bytes"] and the metric prefix_service_packed_template_bytes), and the
packing when the template is pinned (SmolLM2-135M, 2,224 tokens: 98 MiB in 54 ms).
"""
from __future__ import annotations

import torch

from prefix_service.backends.cpu.attention import pack_keys, pack_values
from prefix_service.backends.cpu.onednn import OneDnnTemplate


class PackedTemplate:
    """The first `num_blocks` (full) blocks of a template, R = num_blocks * block_size tokens, per
    layer: K panels [Hkv, R/16, D, 16] and V rows [Hkv, R, D], float32 whatever the cache holds;
    with `matrix` (a bfloat16 cache), instead each layer's K/V packed in bf16 for the
    matrix-product template attention (onednn.OneDnnTemplate), the only copy the attention then
    reads. `pointers` [layers, 3] int64, as the decoder stack reads them: the K panels', the V
    rows' and 0; with `matrix`, the OneDnnTemplate's handle three times (the first two only name
    the template, which the decode kernel groups its rows by). `products`: OneDnnTemplate's."""

    def __init__(self, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 matrix: bool = False, products: int | None = None) -> None:
        if not block_ids:
            raise ValueError("a packed template needs at least one full block")
        self.num_blocks = len(block_ids)
        self.num_tokens = self.num_blocks * kv_layers[0][0].shape[1]  # full blocks of block_size tokens
        idx = torch.tensor(block_ids, dtype=torch.int64)
        first = block_ids[0]
        # blocks in one run (as a template's fresh blocks mostly are) are read in place: one copy
        # into the packed layout instead of a gather, then that copy
        run = block_ids == list(range(first, first + self.num_blocks))
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.matrix: list[OneDnnTemplate] = []
        self.nbytes = 0
        if matrix and kv_layers[0][0].dtype != torch.bfloat16:
            raise ValueError(f"the matrix-product template attention reads a bfloat16 cache, not {kv_layers[0][0].dtype}")
        for k_cache, v_cache in kv_layers:
            if matrix:  # [R, Hkv, D] bf16, as the cache holds it
                kb = k_cache[first:first + self.num_blocks] if run else k_cache.index_select(0, idx)
                vb = v_cache[first:first + self.num_blocks] if run else v_cache.index_select(0, idx)
                self.matrix.append(OneDnnTemplate(kb.flatten(0, 1), vb.flatten(0, 1),
                                                  products=products))
                self.nbytes += self.matrix[-1].nbytes
                continue
            # [R, Hkv, D] as float32, which the kernels read (a bfloat16 cache widens exactly)
            if run:
                k = k_cache[first:first + self.num_blocks].flatten(0, 1).float()
                v = v_cache[first:first + self.num_blocks].flatten(0, 1).float()
            else:
                k = k_cache.index_select(0, idx).flatten(0, 1).float()
                v = v_cache.index_select(0, idx).flatten(0, 1).float()
            self.layers.append((pack_keys(k), pack_values(v)))
            self.nbytes += 2 * k.numel() * k.element_size()
        rows = ([[m.handle] * 3 for m in self.matrix] if matrix
                else [[kp.data_ptr(), vp.data_ptr(), 0] for kp, vp in self.layers])
        self.pointers = torch.tensor(rows, dtype=torch.int64)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer `index`'s (K panels, V rows, R): a template as the attention kernels take it, called one at a
        time (tests/native_harness.py); the decoder stack reads `pointers` instead."""
        if self.matrix:
            raise ValueError("this template is packed for the matrix-product attention only (OneDnnTemplate)")
        k, v = self.layers[index]
        return k, v, self.num_tokens
