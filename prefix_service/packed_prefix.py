"""Pinned templates' K and V held a second time in oneDNN's blocked layout, for CPU prefill attention.

A request that continues a template attends, at every layer, over the template's keys and values,
which do not change while the template is pinned. The two products of that attention, scores =
Q K^T and out = P V, are matrix products against fixed operands: held in oneDNN's layout, as the
linear layers' weights are (packed_linear.py), they run without the per-call packing that BLAS and
the fused flash kernel do on their small blocks. The rest of the context (the template's partial
tail block, earlier chunks) and the new tokens are attended as before (flash, causal), and the two
parts merged by their log-sum-exp.

Cost: each packed template's K/V once more in host memory, outside cache.kv_cache_memory, and the
packing when the template is pinned (SmolLM2-135M, 2,224 tokens: 98 MiB in 54 ms). CPU, float32.
"""
from __future__ import annotations

import torch

from prefix_service.model.packed_linear import onednn_linear_available


PROFILE_SCOPE = "prefix_service::attend_packed"


def packed_prefix_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when templates' K/V can be packed for this cache, else the reason."""
    if device.type != "cpu":
        return f"the KV cache is on {device}, not the CPU"
    if dtype != torch.float32:
        return f"the KV cache is {str(dtype).replace('torch.', '')}, not float32"
    return onednn_linear_available(dtype)


def _product(x: torch.Tensor, packed) -> torch.Tensor:
    """x [M, K] @ W.T for W [N, K] held packed -> [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PackedPrefixKV:
    """The first `num_blocks` (full) blocks of a template, per layer and KV head: K_h [R, D] and
    V_h^T [D, R] (R = num_blocks * block_size tokens), each packed as a linear layer's weight."""

    def __init__(self, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> None:
        if not block_ids:
            raise ValueError("a packed prefix needs at least one full block")
        self.num_blocks = len(block_ids)
        self.num_tokens = self.num_blocks * kv_layers[0][0].shape[1]  # full blocks of block_size tokens
        idx = torch.tensor(block_ids, dtype=torch.int64)
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self._layers: dict[int, tuple[list, list]] = {}
        self.nbytes = 0
        for k_cache, v_cache in kv_layers:
            k = k_cache.index_select(0, idx).flatten(0, 1)  # [R, Hkv, D]
            v = v_cache.index_select(0, idx).flatten(0, 1)
            ks = [reorder(k[:, h].contiguous()) for h in range(k.shape[1])]
            vs = [reorder(v[:, h].t().contiguous()) for h in range(v.shape[1])]
            self._layers[k_cache.data_ptr()] = (ks, vs)
            self.nbytes += 2 * k.numel() * k.element_size()

    def layer(self, k_cache: torch.Tensor) -> tuple[list, list]:
        """The packed (K heads, V^T heads) of the layer whose cache is `k_cache`."""
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
