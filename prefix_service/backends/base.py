"""The backend protocol: what the engine asks of a platform, and the step it hands over.

The engine (prefix_service/engine/) keeps every decision on plain CPU data: which sequences run,
which blocks they own, which templates are pinned. A backend does everything that touches a
device: it holds the model's weights in the form its kernels want and the KV cache tensors,
turns a step's `SchedulerOutput` into device tensors, runs the forward pass, copies blocks
(copy-on-write of a template's partial last block), and hears when a template is pinned and
unpinned. One is chosen at start (`select_backend` in backends/__init__.py) and never changes.

    SchedulerOutput --StepInputs.build--> StepInputs (CPU lists, the same for every backend)
                    --Backend.forward--> logits of the sequences to sample
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Collection, Iterator

import torch

from prefix_service.backends.kv_cache import KVCache
from prefix_service.config import CacheConfig
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.prefix_cache import PrefixHandle
    from prefix_service.engine.scheduler import SchedulerOutput
    from prefix_service.engine.sequence import Sequence


@dataclass
class StepInputs:
    """One step, flattened on the CPU. Rows: decodes first (one token each), then prefill chunks.

    decodes[i] attends over decode_context[i] tokens, its new one included; prefills[j] adds
    prefill_new[j] tokens after prefill_context[j] tokens already in the cache (a template's
    shared blocks, earlier chunks), so its token k sits at position prefill_context[j] + k.
    """
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each row's cache slot: block_id * block_size + offset
    decodes: list[Sequence] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)
    prefill_new: list[int] = field(default_factory=list)
    prefill_context: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    sample: list[Sequence] = field(default_factory=list)  # the sequences of those rows, in order

    @classmethod
    def build(cls, out: SchedulerOutput, block_size: int) -> StepInputs:
        step = cls()
        for s in out.scheduled:  # the scheduler puts the decodes first
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            step.token_ids += seq.token_ids[start:end]
            step.positions += range(start, end)
            table = seq.block_table
            step.slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            if s.num_new_tokens == 1 and start > 0 and not step.prefills:
                step.decodes.append(seq)
                step.decode_context.append(end)
            else:
                step.prefills.append(seq)
                step.prefill_new.append(s.num_new_tokens)
                step.prefill_context.append(start)
            if s.completes_prompt and not seq.prefill_only:  # a template's warmup samples nothing
                step.logit_rows.append(len(step.token_ids) - 1)
                step.sample.append(seq)
        return step

    @property
    def num_decodes(self) -> int:
        return len(self.decodes)


class Backend(abc.ABC):
    """A platform: the model's weights, the KV cache and the forward pass on it.

    The engine calls, on its one loop thread: `execute` once per step, `on_pin`/`on_unpin` as
    templates come and go (through the PrefixCacheManager), and the introspection methods.
    A backend that cannot serve a model says so once, in `select_backend`, before it is built.
    """
    name: ClassVar[str]

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig) -> None:
        param = model.embed_tokens.weight
        self.arch = model.arch
        self.device, self.dtype = param.device, param.dtype
        self.block_size = cache.block_size
        self.kv_cache = KVCache(self.arch, cache, self.dtype, self.device)
        self.kv_layers = self.kv_cache.layers()  # per layer (k, v): the same tensors for the engine's life

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def describe(self) -> str:
        """What runs, for the engine's start-up log line."""
        return self.name

    # --- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run one step: the copy-on-write copies first, then the forward. Returns the logits
        [N, vocab] (float32) of the sequences whose chunk reaches their last token (a template's
        warmup excluded), and those sequences in order; (None, []) when there are none."""
        if out.copies:  # before anything is written: a copy's source is a pinned block
            self.copy_blocks(out.copies)
        step = StepInputs.build(out, self.block_size)
        logits = self.forward(step)
        return (logits, step.sample) if step.sample else (None, [])

    @abc.abstractmethod
    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """Store every row's K/V in its slot, attend, and return the logits of step.logit_rows
        ([len(logit_rows), vocab] float32; None when there are none)."""

    @abc.abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst = block src in every layer's K and V cache, for each (src, dst) pair."""

    # --- templates (TemplateHooks of the PrefixCacheManager) ------------------------------------
    def on_pin(self, handle: PrefixHandle) -> None:
        """A template's blocks were just pinned: they hold its K/V and never change until on_unpin."""

    def on_unpin(self, handle: PrefixHandle) -> None:
        """A template's blocks are about to be freed: drop anything derived from them."""

    # --- introspection --------------------------------------------------------------------------
    def packed_template_bytes(self) -> int:
        """Host memory held for pinned templates beside the KV cache (kv_stats, metrics)."""
        return 0

    def check_integrity(self, pinned: Collection[PrefixHandle]) -> None:
        """Raise AssertionError if the backend holds anything for a template that is not pinned."""

    @contextlib.contextmanager
    def kernel_times(self) -> Iterator[dict[str, float]]:
        """Time the forwards run inside, by kind of work, without changing what runs: yields a dict
        that holds, on exit, milliseconds in 'linear' (the linear layers, the output head
        included) and 'attention' (K/V store and attention). This default reads torch's profiler
        over the torch operators the backend runs."""
        times: dict[str, float] = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield times
        times.update(linear=0.0, attention=0.0)
        for event in prof.events():
            kind = _torch_op_kind(event.name)
            if kind is not None:
                times[kind] += event.self_cpu_time_total / 1e3


_LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear")
_ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::logsumexp", "aten::index_copy_")  # the math path, the store


def _torch_op_kind(name: str) -> str | None:
    if name in _LINEAR_OPS:
        return "linear"
    if "attention" in name or name in _ATTENTION_OPS:
        return "attention"
    return None
