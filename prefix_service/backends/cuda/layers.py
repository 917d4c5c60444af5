"""The model's forward on the cuda backend, with each layer's element-wise work fused.

`LlamaForCausalLM.forward` (model/llama.py) is the reference: per layer about 25 small torch
kernels besides the matrix products and attention. `FusedForward` walks the same weights with
cuda_ops.fused's kernels instead: the residual add and the next RMSNorm in one kernel, the rotary
embedding of q and k in place in one, SiLU and the gate's mul in one; the matrix products are the
same `F.linear` calls and attention the step's own. Eight kernels a layer plus attention, where
the reference launches about thirty.

    x = embed(ids); h = norm_in_0(x)
    for each layer i:  a = o_proj(attention(rope(qkv_proj(h))))
                       h, x = norm_post_i(x + a)          # one kernel: x += a, then the norm
                       m = down(silu_mul(gate_up(h)))
                       h, x = norm_in_{i+1}(x + m)         # the last layer: the final norm
    return h

The results are the reference's but for the order of a norm's sum (tests/test_cuda_fused.py).
Qwen3's per-head q and k norms run as the reference's modules.
"""
from __future__ import annotations

import torch

from cuda_ops import fused
from prefix_service.model.llama import LlamaForCausalLM


def fused_layers_fit(model: LlamaForCausalLM) -> bool:
    """Whether this model's shapes fit the fused kernels (cuda_ops.fused.fits)."""
    arch = model.arch
    return fused.fits(arch.hidden_size, arch.head_dim, arch.num_heads + arch.num_kv_heads)


class FusedForward:
    """Called as the model is: (input_ids [T], positions [T], attention) -> hidden states [T, hidden],
    after the final norm."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.eps = model.arch.rms_norm_eps

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        model, eps = self.model, self.eps
        cos, sin = model.rotary.tables(input_ids.device)
        layers = model.decoder_layers
        x = model.embed_tokens(input_ids)
        h, _ = fused.rms_norm(x, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            qk, v = attn.heads(attn.qkv_proj(h))  # views of one [T, q + 2 kv] product
            if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3
                qk = torch.cat([attn.q_norm(qk[:, :attn.num_heads]), attn.k_norm(qk[:, attn.num_heads:])], dim=1)
            fused.rope_(qk, cos, sin, positions)
            out = attention(attn.layer_idx, qk[:, :attn.num_heads], qk[:, attn.num_heads:], v, attn.scale)
            a = attn.o_proj(out.reshape(-1, attn.q_size))
            h, x = fused.rms_norm(a, layer.post_attention_layernorm.weight, eps, residual=x)
            m = layer.mlp.down_proj(fused.silu_mul(layer.mlp.gate_up_proj(h)))
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            h, x = fused.rms_norm(m, following.weight, eps, residual=x)
        return h

    def warm_up(self, device: torch.device) -> None:
        """Compile the kernels for this model's shapes on a tiny input (a build error shows here)."""
        arch = self.model.arch
        dtype = self.model.embed_tokens.weight.dtype
        x = torch.zeros((2, arch.hidden_size), dtype=dtype, device=device)
        fused.rms_norm(x, self.model.norm.weight, self.eps, residual=x.clone())
        fused.rms_norm(x, self.model.norm.weight, self.eps)
        qk = torch.zeros((2, arch.num_heads + arch.num_kv_heads, arch.head_dim), dtype=dtype, device=device)
        cos, sin = self.model.rotary.tables(device)
        fused.rope_(qk, cos, sin, torch.zeros(2, dtype=torch.int64, device=device))
        fused.silu_mul(torch.zeros((2, 2 * arch.intermediate_size), dtype=dtype, device=device))
