"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened varlen batch: the
architecture and its reference layers, in plain torch.

The model sees no padding and no batch axis: `input_ids`/`positions` are `[T]` for all tokens
of all sequences in the step. Attention is the caller's: `forward` is given a step's attention,
`attention(layer, q, k, v, scale) -> [T, Hq, D]`, which stores the new K/V and attends over the
paged cache; the model never touches block tables. Backends (prefix_service/backends/) run this
forward as it is (torch, cuda) or take the weights into their own kernels (cpu).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from prefix_service.errors import ModelLoadError


@dataclass(frozen=True)
class ModelArch:
    """The architecture numbers we need, read from a Hugging Face config."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    sliding_window: int | None  # Mistral; we cap the context to it (full attention inside)

    @property
    def layer_linear_params(self) -> int:
        """Weights of one decoder layer's linear layers (q, k, v, o, gate, up, down), biases aside."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size * self.intermediate_size

    def forward_flops(self, new_tokens: int, context: int) -> tuple[int, int]:
        """(linear, attention) FLOPs of one forward of `new_tokens` tokens after `context` cached ones,
        with logits for one row: 2 x tokens x weights, and QK^T plus PV for the keys each query sees
        (query i sees context + i + 1 of them)."""
        linear = 2 * new_tokens * self.num_layers * self.layer_linear_params + 2 * self.hidden_size * self.vocab_size
        keys_seen = new_tokens * context + new_tokens * (new_tokens + 1) // 2
        return linear, 4 * self.num_layers * self.num_heads * self.head_dim * keys_seen


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope_inv_freq(arch: ModelArch) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling of the rope type, computed on
    the CPU whatever the default device (on the meta device torch._refs would import dynamo)."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position (a user token after a prefix of length P
    sits at position P + i: positions come from the runner, never from 0 per chunk)."""
    inv_freq: torch.Tensor  # a buffer (nn.Module's attribute lookup types it loosely)

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        inv_freq, self.scaling = _rope_inv_freq(arch)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = max_positions
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_positions, head_dim] float32, the attention scaling applied."""
        if self._cache is None or self._cache[0].device != device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            self._cache = (emb.cos() * self.scaling, emb.sin() * self.scaling)
        return self._cache

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions.device)
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]  # [T, 1, D]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        # q, k, v projections fused into one matmul: rows [q | k | v]
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = arch.head_dim ** -0.5

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused projection [T, q + 2 kv] as q and k heads [T, Hq + Hkv, D] and v heads
        [T, Hkv, D]: views, rows strided."""
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        return (qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def forward(self, x, rotate, attention) -> torch.Tensor:
        # x: [T, hidden]; rotate: the forward's rotary embedding, applied to [T, heads, D]
        qk, v = self.heads(self.qkv_proj(x))  # [T, Hq + Hkv, D], [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: q and k norms, before the rotation
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        # one rotation for the q and k heads together (the same positions): half the small operations
        qk = rotate(qk)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, Hq, D], [T, Hkv, D] (row-strided views)
        out = attention(self.layer_idx, q, k, v, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)  # [gate | up]
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, rotate, attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotate, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        # made on the meta device (the loader's, weights assigned afterwards), the embedding skips
        # its random init: normal_ on a meta tensor runs through torch._refs, whose first use
        # imports torch._dynamo (about 2 s of every start)
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(arch, max_positions)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """self.layers as what they are (iterating an nn.ModuleList yields plain Modules)."""
        return cast("list[DecoderLayer]", list(self.layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]. attention(layer, q, k, v, scale)
        stores the layer's new K/V and returns its heads' outputs [T, Hq, D]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        rotate = functools.partial(apply_rope, cos=cos, sin=sin)
        for layer in self.layers:
            x = layer(x, rotate, attention)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] in float32
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()
