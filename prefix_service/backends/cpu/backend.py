"""The cpu backend: the native library's kernels (AVX-512 or AVX2), one forward path for float32
and bfloat16 models.

    embedding (torch index_select) -> decoder stack, all layers in one native call (stack.py)
    -> final norm (elementwise.py) -> output head (linear.py), for the rows that are sampled

The model's dtype decides only what the weights and the KV cache hold and which library runs the
linear layers (linear.make_linear: the native float32 kernel, or oneDNN for bfloat16, which uses
AMX or AVX512-BF16 where the CPU has them); activations are float32 throughout.

Pinned templates' K/V are packed once more when they are pinned (cache.pack_prefix_kv), and the
attention of every request on them reads the packed copy (packed_template.py). The library is built
on first use with the system C++ compiler (native.py); `unsupported` says when it cannot serve.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Collection

import torch

from prefix_service.backends.base import Backend, StepTensors
from prefix_service.backends.cpu import elementwise, linear
from prefix_service.backends.cpu.packed_template import PackedTemplate
from prefix_service.backends.cpu.sampling import NATIVE_SAMPLER_OPS
from prefix_service.backends.cpu.plan import StackPlan
from prefix_service.backends.cpu.stack import DecoderStack
from prefix_service.backends.cpu.stack import unsupported as stack_unsupported
from prefix_service.config import CacheConfig
from prefix_service.model.llama import LlamaForCausalLM, ModelArch

if TYPE_CHECKING:
    from prefix_service.engine.template_pins import TemplateHandle
    from prefix_service.engine.step import ScheduledRow, StepBatch

log = logging.getLogger("prefix_service.engine")


class CpuBackend(Backend):
    name = "cpu"
    sampler_ops = NATIVE_SAMPLER_OPS

    @staticmethod
    def unsupported(arch: ModelArch, dtype: torch.dtype) -> str | None:
        """None when this backend can serve the model here, else why not."""
        return stack_unsupported(arch, dtype)

    @classmethod
    def kv_dtype_unsupported(cls, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
        """The model's dtype, or bf16 under a float32 model: the kernels read a bf16 cache with float32
        arithmetic and round its new K and V before anything reads them, as for a bf16 model."""
        if kv_dtype == model_dtype or (model_dtype, kv_dtype) == (torch.float32, torch.bfloat16):
            return None
        return (f"the cpu backend's KV cache holds the model's dtype, or bfloat16 under a float32 model; not "
                f"{str(kv_dtype).removeprefix('torch.')} under {str(model_dtype).removeprefix('torch.')}")

    @classmethod
    def batch_invariance_unsupported(cls, model_dtype: torch.dtype) -> str | None:
        """float32: none (the native kernels' rows never depend on each other); bfloat16: where one kernel
        serves every call size (onednn.invariant_kernel)."""
        if model_dtype != torch.bfloat16:
            return None
        from prefix_service.backends.cpu import onednn
        kernel, why = onednn.invariant_kernel()
        return None if kernel is not None else f"{why}; use model.dtype: float32"

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, batch_invariant: bool = False) -> None:
        """Takes the model's weights into the kernels' layouts; the model is not usable afterwards
        (its linear weights are released as they are packed). batch_invariant: every kernel's output
        for a row independent of the other rows of its step (DecoderStack's), the head's too."""
        super().__init__(model, cache, batch_invariant)
        self.stack = DecoderStack(model, self.kv_layers, batch_invariant)
        self.embed = model.embed_tokens.weight.detach()  # [vocab, hidden], the model's dtype
        self.norm_weight, self.norm_eps = model.norm.weight.detach().float().contiguous(), model.norm.eps
        head = model.lm_head if model.lm_head is not None else model.embed_tokens  # tied: the embedding
        # [vocab, hidden]; a float32 head on the native kernel (make_linear's default), not timed as the
        # layers are: its calls take a row per sampled sequence (more only for a prompt's logprobs)
        self.head = linear.make_linear(head.weight, invariant=batch_invariant)
        if linear.held_in_bf16(self.embed):
            # a bf16 checkpoint served in float32: the table held in bf16 (half its bytes), each looked-up
            # row widened exactly (forward), as the linears hold such weights (linear.NativeLinear)
            self.embed = self.embed.to(torch.bfloat16)
        if model.lm_head is not None:
            model.lm_head.weight = None  # type: ignore[assignment]  # released; nn.Module takes None
        self.pack_templates = cache.pack_prefix_kv
        self.templates: dict[int, PackedTemplate] = {}  # by TemplateHandle.template_id

    @property
    def int8_linears(self) -> int:
        return self.stack.int8_linears

    def describe(self) -> str:
        if self.dtype == torch.bfloat16:
            from prefix_service.backends.cpu import onednn
            how = self.bf16_linears()
            timed = f"; timed each way: {t.why}" if (t := self.stack.template_timing) is not None else ""
            kernel = onednn.template_kernel(self.stack.head_dim, self.stack.template_products)
            matrix = (f", template attention as bf16 matrix products ({kernel}{timed})"
                      if self.stack.template_matrix else
                      f", template attention on the native kernels ({timed[2:]})" if timed else "")
            timed = f" (timed both ways: {p.why})" if (p := self.stack.prompt_timing) is not None else ""
            if self.stack.prompt_dot:
                matrix += f", a prompt's own attention as AVX512-BF16 dot products{timed}"
            elif timed:
                matrix += f", a prompt's own attention on the native kernels{timed}"
            if self.stack.int8_linears:
                matrix += f", int8 weights in {self.stack.int8_linears} linears' few-row calls"
            return f"cpu (native kernels, decoder stack, {how}, bf16 KV cache{matrix})"
        kv = ", bf16 KV cache" if self.kv_dtype != self.dtype else ""  # the one other pairing: kv_dtype_unsupported
        if self.stack.int8_linears:
            return f"cpu (native kernels, decoder stack, int8 weights in {self.stack.int8_linears} linears{kv})"
        timed = f"; timed: {f.why}" if (f := self.stack.float32_timing) is not None else ""
        linears = linear.float32_choice(self.stack.float32_native_rows)
        if self.batch_invariant:
            linears += " (batch invariant)"
        if self.stack.bf16_panel_linears:
            linears += ", float32 weights of bf16 values held in bf16 for the native kernel"
        return f"cpu (native kernels, decoder stack, linears on {linears}{timed}{kv})"

    def bf16_linears(self) -> str:
        """What a bf16 model's linear layers run, in words (describe)."""
        from prefix_service.backends.cpu import onednn
        if self.batch_invariant:  # one kernel for every call size
            return f"batch invariant: {onednn.invariant_kernel()[1]}"
        kernel = onednn.default_kernel()
        brgemm = "AMX" if onednn.brgemm_vnni() else "unpacked, torch's fallback GEMM"
        if kernel == "brgemm" and (columns := onednn.brgemm_columns()) != onednn.DEFAULT_BRGEMM_COLUMNS:
            brgemm += f", {columns}-column blocks"
        how = {"brgemm": f"oneDNN brgemm bf16 linears ({brgemm})", "inner_product": "oneDNN bf16 linears",
               "emulated": "oneDNN linears, bf16 emulated in float32",
               "measure": "oneDNN bf16 linears, each shape timed on brgemm and the inner product"}[kernel]
        notes = ["AMX"] if kernel in ("inner_product", "measure") and onednn.brgemm_vnni() else []
        if kernel == "measure":
            notes.append(self.linear_choices())
        elif (rows := getattr(self.head, "brgemm_rows", 0)) and kernel == "inner_product":
            notes.append(f"brgemm up to {rows} rows")
        if few_rows := getattr(self.head, "few_rows", 0):
            notes.append(f"AVX512-BF16 dot products {onednn.few_rows_words(few_rows)}")
        return how + (f" ({'; '.join(notes)})" if notes else "")

    def named_linears(self) -> dict[str, linear.CpuLinear]:
        """The first layer's linears and the output head, by name (every layer's are of the same shapes)."""
        layer = self.stack.layers[0]
        return {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": self.head}

    def linear_choices(self) -> str:
        """What each bf16 linear of a layer, and the output head, runs: "qkv, o: brgemm up to 16 rows,
        the inner product above; gate_up, down: brgemm; head: ...", shapes with the same choice together."""
        from prefix_service.backends.cpu import onednn
        groups: dict[str, list[str]] = {}
        for name, m in self.named_linears().items():
            kernel, rows, few = getattr(m, "kernel", "float32"), getattr(m, "brgemm_rows", 0), getattr(m, "few_rows", 0)
            above = "" if few == onednn.FEW_ROWS_EVERY_CALL else ", the inner product above"
            what = (f"brgemm up to {rows} rows, the inner product above" if rows
                    else f"AVX512-BF16 dot products {onednn.few_rows_words(few)}{above}" if few
                    else kernel.replace("_", " "))
            groups.setdefault(what, []).append(name)
        return "; ".join(f"{', '.join(names)}: {what}" for what, names in groups.items())

    # --- one step ------------------------------------------------------------------------------
    def forward(self, step: StepBatch, host: StepTensors) -> torch.Tensor | None:
        plan = StackPlan.build(step, host, self.stack.num_layers, self.template_of)
        x = self.embed.index_select(0, host.token_ids)  # [T, hidden]
        if x.dtype != torch.float32:  # the residual stream is float32
            x = x.float()
        pending = self.stack.forward(x, plan)  # x is the residual stream, pending the last MLP's output
        if not host.logit_rows.numel():
            return None
        rows = host.logit_rows
        h = elementwise.add_rms_norm(x.index_select(0, rows), pending.index_select(0, rows), self.norm_weight,
                                     self.norm_eps)
        return self.head(h)

    def template_of(self, row: ScheduledRow) -> PackedTemplate | None:
        """The packed copy a row's attention reads: only when the row shares all of its template's
        packed blocks (a prompt that adds nothing shares one block fewer: its last template token is
        computed again, in its own block)."""
        packed = self.templates.get(row.template_id) if row.template_id is not None else None
        return packed if packed is not None and row.num_template_blocks == packed.num_blocks else None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.stack.copy_blocks(pairs)

    # --- templates ---------------------------------------------------------------------------
    def on_pin(self, handle: TemplateHandle) -> None:
        full = handle.num_tokens // self.block_size
        if not self.pack_templates or not full:
            return
        start = time.perf_counter()
        packed = self.templates[handle.template_id] = PackedTemplate(self.kv_layers, list(handle.block_table[:full]),
                                                                     matrix=self.stack.template_matrix,
                                                                     products=self.stack.template_products)
        log.info("prefix template %r: K/V of its %d full blocks packed for CPU attention (%.1f MiB, %.0f ms)",
                 handle.name, packed.num_blocks, packed.nbytes / 2**20, (time.perf_counter() - start) * 1e3)

    def on_unpin(self, handle: TemplateHandle) -> None:
        self.templates.pop(handle.template_id, None)

    # --- introspection -------------------------------------------------------------------------
    def packed_template_bytes(self) -> int:
        return sum(p.nbytes for p in self.templates.values())

    def check_integrity(self, pinned: Collection[TemplateHandle]) -> None:
        if not set(self.templates) <= {h.template_id for h in pinned}:
            raise AssertionError("a packed template copy outlived its template's blocks")
