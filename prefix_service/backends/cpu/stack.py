"""The decoder stack: every layer of a forward in one native call (csrc/cpu_layer.cpp).

At load the stack packs each layer's linear weights for the kernel of the model's dtype (linear.py:
the native float32 kernel, or oneDNN for bfloat16) and keeps a table of pointers to them and to the
layer's KV cache; a forward then hands the library one
plan of the step (`StackPlan`: slots, decodes, then prefills, their block tables and packed
templates), and the C++ loop runs, layer by layer: the first norm (with the residual add), the
q/k/v projection, the q and k heads' own norms where the model has them (Qwen3) and the
rotation; one decode attention call for every decode and one prefill attention call per prefill
sequence (each also storing its new K/V); then the output projection, the second norm and the
MLP. What Python would pay per kernel (argument checks, output allocations, a ctypes call) is
paid once per step. Activations are float32 in either dtype; the KV cache holds the model's dtype.
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import torch

from prefix_service.backends.cpu import native, onednn
from prefix_service.backends.cpu.native import NativeKernelError
from prefix_service.backends.cpu.attention import HEAD_SIZES, KV_DTYPES
from prefix_service.backends.cpu.linear import (CpuLinear, available, float32_choice, float32_kernel,
                                                 float32_native_rows, make_linear)
from prefix_service.backends.cpu.plan import StackPlan
from prefix_service.backends.cpu.tuning import (TIMED_LAYERS, Float32Timing, PromptTiming, TemplateTiming,
                                                 measure_float32_linears, measure_prompt_attention,
                                                 measure_template_attention)
from prefix_service.model.llama import LlamaForCausalLM, ModelArch
from prefix_service.model.quantize import int8_weight

log = logging.getLogger("prefix_service.engine")


def unsupported(arch: ModelArch, dtype: torch.dtype) -> str | None:
    """None when the stack can run a model of this architecture and dtype here, else why not."""
    why = available(dtype)
    if why is None and arch.head_dim not in HEAD_SIZES:
        why = f"head size {arch.head_dim} is not a multiple of 16 up to 256"
    return why


def _pointers(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights as the kernels take them: norms as float32 vectors, linear layers packed
    (linear.make_linear)."""
    input_norm: torch.Tensor  # [hidden]
    input_eps: float
    qkv: CpuLinear  # [q + 2 kv, hidden]: rows [q | k | v], with the q/k/v bias (Qwen2)
    post_norm: torch.Tensor  # [hidden]
    post_eps: float
    o: CpuLinear  # [hidden, q]
    gate_up: CpuLinear  # [2 inter, hidden]: rows [gate | up]
    down: CpuLinear  # [hidden, inter]
    q_norm: torch.Tensor | None = None  # [head_dim]: each q head's RMSNorm (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]: each k head's
    qk_eps: float = 0.0

    @property
    def linears(self) -> tuple[CpuLinear, CpuLinear, CpuLinear, CpuLinear]:
        """The layer's four linear layers, in the order a forward calls them."""
        return self.qkv, self.o, self.gate_up, self.down

    def pointers(self) -> list[int]:
        """The layer's row of the stack's weight table, in ps_decoder_stack's order: norm weights by their
        data, linear layers by their PsLinear (CpuLinear.call)."""
        def vec(t: torch.Tensor | None) -> int:
            return t.data_ptr() if t is not None else 0

        def lin(m: CpuLinear) -> int:
            return ctypes.addressof(m.call)
        return [vec(self.input_norm), lin(self.qkv), vec(self.post_norm), lin(self.o), lin(self.gate_up),
                lin(self.down), vec(self.q_norm), vec(self.k_norm)]


class DecoderStack:
    """Every DecoderLayer of `model`, its weights packed for the native kernels, bound to the KV
    caches `kv_layers` (per layer (k_cache, v_cache), contiguous [blocks, block_size, Hkv, D] of the
    model's dtype, float32 or bfloat16). The layers' linear weights are released from the model as
    they are packed (so a large model is not held twice): the model cannot run its own forward
    afterwards. batch_invariant: every linear layer runs one kernel whatever a call's rows
    (linear.make_linear's invariant) and a bf16 prompt's own keys the native kernels, so that no row's
    output depends on the other rows of its step (model.batch_invariant)."""

    def __init__(self, model: LlamaForCausalLM, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 batch_invariant: bool = False) -> None:
        why = unsupported(model.arch, model.embed_tokens.weight.dtype)
        if why is not None:
            raise NativeKernelError(f"the native decoder stack cannot run this model: {why}")
        arch = model.arch
        layers = model.decoder_layers
        if len(kv_layers) != len(layers):
            raise NativeKernelError(f"{len(kv_layers)} KV caches for {len(layers)} layers")
        self.hq, self.hkv, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.hidden, self.inter = arch.hidden_size, arch.intermediate_size
        self.scale = layers[0].self_attn.scale
        shape, kv_dtype = kv_layers[0][0].shape, kv_layers[0][0].dtype
        for k, v in kv_layers:
            for c in (k, v):
                if (c.shape != shape or c.dim() != 4 or c.shape[2:] != (self.hkv, self.head_dim)
                        or c.dtype != kv_dtype or kv_dtype not in KV_DTYPES or not c.is_contiguous()
                        or c.device.type != "cpu"):
                    raise NativeKernelError(f"the KV cache: contiguous float32 or bfloat16 CPU [blocks, block_size, "
                                            f"{self.hkv}, {self.head_dim}] tensors alike are needed, got {c.dtype} "
                                            f"{tuple(c.shape)}")
        self.kv_bf16 = int(kv_dtype == torch.bfloat16)
        # the bf16 products below round q (and P) to bf16: a bf16 model's arithmetic, not a float32
        # model's over a bf16 cache (cache.kv_cache_dtype), which keeps float32 arithmetic throughout
        bf16_model = self.kv_bf16 and model.embed_tokens.weight.dtype == torch.bfloat16
        # a bf16 model's rows over a template: matrix products where chosen (the templates then
        # carry their handles), else the native kernels; "measure": chosen below, once the layers are packed
        template_attention = onednn.template_attention(self.head_dim) if bf16_model else "native"
        self.template_matrix = template_attention == "matrix"
        self.template_fn = onednn.template_attend_fn() if self.template_matrix else 0
        self.template_timing: TemplateTiming | None = None  # what timing each way found, where it was timed
        self.template_products: int | None = None  # the matrix products' kernel cap (None: the environment's)
        # a bf16 prompt with nothing before it: its own keys on the dot products where chosen
        # (not under batch invariance: which of a prompt's rows take them depends on how its prefill was chunked)
        prompt_attention = onednn.prompt_attention(self.head_dim) if bf16_model and not batch_invariant else "native"
        self.prompt_dot = prompt_attention == "dot"
        self.causal_fn = onednn.causal_attend_fn() if self.prompt_dot else 0
        self.prompt_timing: PromptTiming | None = None  # what timing both ways found, where it was timed
        self.num_layers = len(layers)
        self.kv_layers = [(k, v) for k, v in kv_layers]
        self.num_blocks, self.block_size = shape[0], shape[1]

        def vector(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(torch.float32).contiguous()

        # a float32 model's linears: the native kernel, oneDNN's inner product, or the two split by row
        # count (linear.make_linear's native_rows), where "measure" timed on the first layers' own weights
        self.float32_timing: Float32Timing | None = None
        native_rows: int | None = None
        first = layers[0].self_attn.qkv_proj
        if first.weight.dtype == torch.float32 and int8_weight(first) is None and not batch_invariant:
            kernel = float32_kernel()
            rows = float32_native_rows()  # read everywhere: a value it refuses stops the start even unsplit
            if kernel == "inner_product":
                native_rows = rows
            elif kernel == "measure":
                start = time.perf_counter()
                self.float32_timing = measure_float32_linears(
                    [[m.weight for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                         layer.mlp.down_proj)] for layer in layers[:TIMED_LAYERS]])
                native_rows = self.float32_timing.native_rows
                log.info("float32 linears timed in %.0f ms: %s", (time.perf_counter() - start) * 1e3,
                         self.float32_timing.summary())
        self.float32_native_rows = native_rows

        def packed(m: torch.nn.Linear, bias: torch.Tensor | None = None) -> CpuLinear:
            return make_linear(m.weight, bias, int8_weight(m), native_rows, batch_invariant)

        self.layers: list[LayerWeights] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if any(m.bias is not None for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                raise NativeKernelError("only the q/k/v projection may have a bias")
            q_norm, k_norm = attn.q_norm, attn.k_norm
            self.layers.append(LayerWeights(
                vector(layer.input_layernorm.weight), layer.input_layernorm.eps,
                packed(attn.qkv_proj, attn.qkv_proj.bias),
                vector(layer.post_attention_layernorm.weight), layer.post_attention_layernorm.eps,
                packed(attn.o_proj), packed(mlp.gate_up_proj), packed(mlp.down_proj),
                vector(q_norm.weight) if q_norm is not None else None,
                vector(k_norm.weight) if k_norm is not None else None, q_norm.eps if q_norm is not None else 0.0))
            # packed above: released (the q/k/v bias is kept as it is); nn.Module takes None for a
            # parameter, which torch's annotations do not say
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                m.weight = None  # type: ignore[assignment]
        # linears that read int8 weights (model.quantization: int8): every float32 one, a bf16 one's
        # few-row calls where the CPU has AVX512-BF16
        self.int8_linears = sum(m.int8 for w in self.layers for m in w.linears)
        # float32 linears whose native kernel holds the weight in bf16 (every value a bf16 one: a bf16
        # checkpoint served in float32), the same products from half the bytes
        natives = [getattr(m, "few", m) for w in self.layers for m in w.linears]
        self.bf16_panel_linears = sum(getattr(m, "bf16_panels", False) for m in natives)
        if self.bf16_panel_linears:
            log.info("float32 linears: %d of %d weights held in bf16 for the native kernel (every value a bf16 "
                     "one: the same products, half the bytes)", self.bf16_panel_linears, len(natives))
        if native_rows:
            held = sum(4 * m.in_features * m.out_features for w in self.layers for m in w.linears)  # oneDNN's copy
            log.info("float32 linears: %s; every layer's weights packed for both (%.0f MiB more)",
                     float32_choice(native_rows), held / 2 ** 20)
        self.weights = _pointers([w.pointers() for w in self.layers])  # [layers, 8]
        self.eps = torch.tensor([[w.input_eps, w.post_eps, w.qk_eps] for w in self.layers], dtype=torch.float32)
        self.caches = _pointers([[k.data_ptr(), v.data_ptr()] for k, v in kv_layers])  # [layers, 2]
        self.cos, self.sin = (t.contiguous() for t in model.rotary.tables(torch.device("cpu")))  # [P, D]
        # every intermediate of a step, kept from step to step (grown for a larger step, never shrunk):
        # a step allocates no activation memory, so memory a long prefill freed is never handed back
        # to the system and faulted in again by the next one (malloc's arenas of threads other than
        # the main one give whole free heaps back, whatever its trim threshold)
        self.workspace = torch.empty(0, dtype=torch.float32)
        if template_attention == "measure":
            log.info("timing the template attention each way, once: the native kernels and bf16 matrix products")
            start = time.perf_counter()
            self.template_timing = measure_template_attention(self)
            self.template_matrix = self.template_timing.choice == "matrix"
            self.template_products = self.template_timing.products
            self.template_fn = onednn.template_attend_fn() if self.template_matrix else 0
            log.info("template attention timed in %.0f ms: %s", (time.perf_counter() - start) * 1e3,
                     self.template_timing.summary())
        if prompt_attention == "measure":
            start = time.perf_counter()
            self.prompt_timing = measure_prompt_attention(self)
            self.prompt_dot = self.prompt_timing.choice == "dot"
            self.causal_fn = onednn.causal_attend_fn() if self.prompt_dot else 0
            log.info("a prompt's own attention timed in %.0f ms: %s (%s); a %d-token prompt took %s",
                     (time.perf_counter() - start) * 1e3, self.prompt_timing.choice, self.prompt_timing.why,
                     self.prompt_timing.tokens,
                     ", ".join(f"{w} {t:.1f} ms" for w, t in self.prompt_timing.ms.items()) or "nothing")
        self.workspace = torch.empty(0, dtype=torch.float32)  # not what the timed steps grew it to

    def forward(self, x: torch.Tensor, plan: StackPlan) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens, contiguous float32) is the residual stream, updated in
        place; returns the last layer's MLP output [T, hidden], which the final norm adds to x (a view
        of the workspace: read it before the next forward)."""
        t = x.shape[0]
        if x.shape != (t, self.hidden) or x.dtype != torch.float32 or not x.is_contiguous():
            raise NativeKernelError(f"x: contiguous float32 [T, {self.hidden}] is needed, got {x.dtype} {tuple(x.shape)}")
        nd, n_pre = plan.num_decodes, plan.prefill_info.shape[0]
        if plan.slots.shape != (t,) or plan.positions.shape != (t,) or nd + int(plan.prefill_info[:, 0].sum()) != t:
            raise NativeKernelError(f"the plan has {nd} decodes and prefills of {plan.prefill_info[:, 0].tolist()} "
                                    f"tokens for {t} rows")
        if t and (int(plan.positions.min()) < 0 or int(plan.positions.max()) >= self.cos.shape[0]):
            raise NativeKernelError(f"positions outside the rotary tables' range [0, {self.cos.shape[0]})")
        dec_tables, pre_tables = plan.decode_tables, plan.prefill_tables
        lib = native.require()
        # the most keys a prefill attends over after its packed template: its cached context after it and its own
        max_keys = int((plan.prefill_info[:, 0] + plan.prefill_info[:, 1] - plan.prefill_info[:, 2]).max()) if n_pre else 0
        pending_floats = -(-t * self.hidden // 16) * 16
        need = pending_floats + lib.ps_stack_scratch_floats(t, self.hidden, self.hq, self.hkv, self.head_dim, self.inter,
                                                            nd, max_keys)
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need, dtype=torch.float32)
        pending = self.workspace[:t * self.hidden].view(t, self.hidden)
        scratch = self.workspace[pending_floats:]
        native.check(lib.ps_decoder_stack(
            x.data_ptr(), t, self.hidden, self.num_layers, self.weights.data_ptr(), self.eps.data_ptr(),
            self.caches.data_ptr(), self.num_blocks, self.block_size, self.hq, self.hkv, self.head_dim, self.inter,
            self.scale, plan.positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), plan.slots.data_ptr(),
            nd, dec_tables.data_ptr() if nd else None, dec_tables.stride(0) if nd else 0,
            plan.decode_context.data_ptr() if nd else None,
            plan.decode_skip.data_ptr() if plan.decode_skip is not None else None,
            n_pre, plan.prefill_info.data_ptr(), pre_tables.data_ptr() if n_pre else None,
            pre_tables.stride(0) if n_pre else 0, pre_tables.shape[1] if n_pre else 0,
            plan.templates.data_ptr() if plan.templates is not None else None, pending.data_ptr(), scratch.data_ptr(),
            torch.get_num_threads(), self.kv_bf16, self.template_fn, self.causal_fn), "ps_decoder_stack",
            onednn.last_error)
        return pending

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst = block src in every layer's K and V cache, for each (src, dst) pair: the
        copy-on-write of a template's partial last block, one native call for all layers. The
        destinations must be distinct from each other and from every source."""
        dst = [d for _, d in pairs]
        if len(set(dst)) != len(dst) or set(dst) & {s for s, _ in pairs}:
            raise NativeKernelError(f"copy_blocks: the destinations must be distinct from each other and from the "
                                    f"sources, got {pairs}")
        k = self.kv_layers[0][0]
        flat = torch.tensor(pairs, dtype=torch.int64).view(-1)
        native.check(native.require().ps_copy_blocks(
            self.caches.data_ptr(), self.num_layers, self.num_blocks, k[0].numel() * k.element_size(), flat.data_ptr(),
            len(pairs)),
            "ps_copy_blocks")


def kernel_timers(on: bool) -> dict[str, float]:
    """Turn the native kernels' timers (csrc/timers.h) on or off; returns the milliseconds each
    kind took since the last call: linear, attention, elementwise."""
    totals = (ctypes.c_int64 * 3)()
    native.require().ps_timers(int(on), totals)
    return {"linear": totals[0] / 1e6, "attention": totals[1] / 1e6, "elementwise": totals[2] / 1e6}
