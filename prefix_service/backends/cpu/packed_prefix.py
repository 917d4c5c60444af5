"""Pinned templates' K and V held a second time in a layout made for CPU attention.

A request that continues a template attends, at every layer, over the template's keys and values,
which do not change while the template is pinned. Held once more, reordered at pin time, they are
read by each request without per-call packing. Two layouts, one per CPU attention:

* native (cpu_attention.py, model.cpu_attention): K as panels of 16 keys, V as rows, per KV head;
  the kernel attends over them and the rest of the context in one pass, in prefill and decode.
* oneDNN (torch attention): K_h and V_h^T per KV head, each packed as a linear layer's weight is
  (packed_linear.py); `attend_packed` computes scores = Q K^T and out = P V with them, and the
  rest of the context and the new tokens are attended as before (flash, causal), the two parts
  merged by their log-sum-exp.

Cost: each packed template's K/V once more in host memory, outside cache.kv_cache_memory (reported
as kv_stats()["packed_prefix_bytes"] and the metric prefix_service_packed_template_bytes), and the
packing when the template is pinned (SmolLM2-135M, 2,224 tokens: 98 MiB in 54 ms). CPU, float32.
"""
from __future__ import annotations

import torch

from prefix_service.backends.cpu import attention as cpu_attention
from prefix_service.model.packed_linear import onednn_linear_available


PROFILE_SCOPE = "prefix_service::attend_packed"


def packed_prefix_available(device: torch.device, dtype: torch.dtype, native: bool) -> str | None:
    """None when templates' K/V can be packed for this cache and CPU attention (native: the
    native kernel's layout, else oneDNN's), else the reason."""
    if device.type != "cpu":
        return f"the KV cache is on {device}, not the CPU"
    if dtype != torch.float32:
        return f"the KV cache is {str(dtype).replace('torch.', '')}, not float32"
    return None if native else onednn_linear_available(dtype)


def _product(x: torch.Tensor, packed) -> torch.Tensor:
    """x [M, K] @ W.T for W [N, K] held packed -> [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PackedPrefixKV:
    """The first `num_blocks` (full) blocks of a template (R = num_blocks * block_size tokens), per
    layer: native, (K panels [Hkv, R/16, D, 16], V [Hkv, R, D], R) as cpu_attention reads them;
    else per KV head K_h [R, D] and V_h^T [D, R], each packed as a linear layer's weight."""

    def __init__(self, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 native: bool = False) -> None:
        if not block_ids:
            raise ValueError("a packed prefix needs at least one full block")
        self.num_blocks = len(block_ids)
        self.num_tokens = self.num_blocks * kv_layers[0][0].shape[1]  # full blocks of block_size tokens
        idx = torch.tensor(block_ids, dtype=torch.int64)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.native = native
        self._layers: dict[int, tuple] = {}
        self.nbytes = 0
        for k_cache, v_cache in kv_layers:
            k = k_cache.index_select(0, idx).flatten(0, 1)  # [R, Hkv, D]
            v = v_cache.index_select(0, idx).flatten(0, 1)
            if native:
                entry = (cpu_attention.pack_keys(k), cpu_attention.pack_values(v), self.num_tokens)
            else:
                entry = ([reorder(k[:, h].contiguous()) for h in range(k.shape[1])],
                         [reorder(v[:, h].t().contiguous()) for h in range(v.shape[1])])
            self._layers[k_cache.data_ptr()] = entry
            self.nbytes += 2 * k.numel() * k.element_size()

    def layer(self, k_cache: torch.Tensor) -> tuple:
        """The packed template of the layer whose cache is `k_cache`: native, the kernel's
        (K panels, V, R); else oneDNN's (K heads, V^T heads)."""
        return self._layers[k_cache.data_ptr()]


def attend_packed(q: torch.Tensor, packed_k: list, packed_v: list, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a packed prefix, every key visible, with its log-sum-exp (to merge with
    the attention over the rest of the context, cascade.merge).

    q: [1, Hkv, M, D], the query rows of KV head h in q[0, h] (the query heads of one KV head
    stacked); packed_k[h] / packed_v[h]: KV head h's K and V^T (PackedPrefixKV.layer)
    -> (out [1, Hkv, M, D], lse [1, Hkv, M] float32), as cascade.attend returns them."""
    with torch.profiler.record_function(PROFILE_SCOPE):  # so a profile counts its products as attention
        return _attend_packed(q, packed_k, packed_v, scale)


def _attend_packed(q, packed_k, packed_v, scale):
    _, hkv, m, d = q.shape
    out = q.new_empty(1, hkv, m, d)
    lse = torch.empty(1, hkv, m, dtype=torch.float32, device=q.device)
    qs = q[0] * scale
    for h in range(hkv):
        s = _product(qs[h], packed_k[h])  # [M, R]
        top = s.amax(-1, keepdim=True)
        s.sub_(top).exp_()
        total = s.sum(-1, keepdim=True)
        torch.div(_product(s, packed_v[h]), total, out=out[0, h])
        lse[0, h] = (total.log_() + top)[:, 0]
    return out, lse
