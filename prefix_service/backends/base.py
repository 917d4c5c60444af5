"""The backend protocol: what the engine asks of a platform, and the step it hands over.

The engine (prefix_service/engine/) keeps every decision on plain CPU data: which sequences run,
which blocks they own, which templates are pinned. A backend does everything that touches a
device: it holds the model's weights in the form its kernels want and the KV cache tensors,
turns a step (`StepBatch`, engine/step.py: frozen rows, no live engine objects) into device
tensors, runs the forward pass, copies blocks (copy-on-write of a template's partial last block),
and hears when a template is pinned and unpinned. One is chosen at start (`select_backend` in
backends/__init__.py) and never changes.

    StepBatch --StepTensors.build--> StepTensors (CPU tensors, built once, the same for every backend)
              --Backend.forward--> logits of the rows to sample
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Collection, Sequence

import torch

from prefix_service.backends.kv_cache import KVCache, kv_dtype
from prefix_service.config import CacheConfig, EngineConfig
from prefix_service.errors import ConfigError
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.template_pins import TemplateHandle
    from prefix_service.engine.step import StepBatch


@dataclass(frozen=True)
class StepTensors:
    """A step's rows flattened into CPU tensors, once per step; each backend moves what it needs
    to its device. T: the step's tokens (decode rows' first), N: its rows, S: its sampled rows."""
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: each token's cache slot, block_id * block_size + offset
    block_tables: torch.Tensor  # [N, W] int32: each row's block ids, -1 padded
    context_lens: torch.Tensor  # [N] int32: the tokens each row attends over, its new ones included
    logit_rows: torch.Tensor  # [S] int64: the index in T of each token whose logits are returned

    @classmethod
    def build(cls, step: StepBatch, block_size: int) -> StepTensors:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for row in step.rows:
            ids += row.token_ids
            positions += range(row.num_computed, row.context_len)
            slots += row.slots(block_size)
            logit_rows += range(len(ids) - row.num_logits, len(ids))
        width = max((len(r.block_ids) for r in step.rows), default=0)
        tables = [list(r.block_ids) + [-1] * (width - len(r.block_ids)) for r in step.rows]

        def longs(data: list[int]) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int64)
        return cls(longs(ids), longs(positions), longs(slots),
                   torch.tensor(tables, dtype=torch.int32).view(len(tables), width),
                   torch.tensor([r.context_len for r in step.rows], dtype=torch.int32), longs(logit_rows))


class SamplerOps:
    """The passes over a step's logits that the sampler (engine/sampler.py) takes from the backend
    whose logits they are: each row's k largest, sorted (top-k's and top-p's candidates), each row's
    log-normaliser, and a draw from a row's whole softmax. torch's here (the draw: the sampler's own);
    a backend gives its own where they are faster on its device."""

    def top_k(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [R, k], indices [R, k]) of rows x [R, V]: each row's k largest, largest first."""
        return x.topk(k, dim=-1)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """[R]: each row's log of the sum of its exponentials."""
        return x.logsumexp(-1)

    def softmax_draw(self, x: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor | None:
        """[R] int64: for rows x [R, V] of logits, the token uniform[r] (float64 in [0, 1)) picks by the
        inverse of the cumulative softmax of x[r] / temperature[r]; None where the backend has no pass
        of its own (the sampler then draws with torch's)."""
        return None


TORCH_SAMPLER_OPS = SamplerOps()


class Backend(abc.ABC):
    """A platform: the model's weights, the KV cache and the forward pass on it.

    The engine calls, on its one loop thread: `execute` once per step, `on_pin`/`on_unpin` as
    templates come and go (through the TemplatePins), and the introspection methods.
    A backend that cannot serve a model says so once, in `select_backend`, before it is built.
    """
    name: ClassVar[str]
    sampler_ops: ClassVar[SamplerOps] = TORCH_SAMPLER_OPS  # what the sampler runs on this backend's logits

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig, batch_invariant: bool = False) -> None:
        """batch_invariant (model.batch_invariant): ConfigError where this backend cannot
        (require_batch_invariance); a backend that supports it takes it in its own constructor."""
        param = model.embed_tokens.weight
        self.arch = model.arch
        self.device, self.dtype = param.device, param.dtype
        self.block_size = cache.block_size
        self.kv_dtype = self.cache_dtype(cache, self.dtype)
        self.kv_cache = KVCache(self.arch, cache, self.kv_dtype, self.device)
        self.kv_layers = self.kv_cache.layers()  # per layer (k, v): the same tensors for the engine's life
        if batch_invariant:
            self.require_batch_invariance(self.dtype)
        self.batch_invariant = batch_invariant

    @classmethod
    def cache_dtype(cls, cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype this backend's KV cache holds for cache.kv_cache_dtype under a model of
        `model_dtype`; ConfigError where this backend cannot hold it."""
        dtype = kv_dtype(cache.kv_cache_dtype, model_dtype)
        if (why := cls.kv_dtype_unsupported(model_dtype, dtype)) is not None:
            raise ConfigError(f"cache.kv_cache_dtype: {cache.kv_cache_dtype}: {why}")
        return dtype

    @classmethod
    def kv_dtype_unsupported(cls, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
        """None when this backend can hold a KV cache of `kv_dtype` under a model of `model_dtype`, else
        why not. Default: only the model's dtype."""
        if kv_dtype == model_dtype:
            return None
        return (f"the {cls.name} backend holds the KV cache in the model's dtype "
                f"({str(model_dtype).removeprefix('torch.')}); use auto")

    @classmethod
    def batch_invariance_unsupported(cls, model_dtype: torch.dtype) -> str | None:
        """None when this backend can run a model of `model_dtype` batch-invariant (model.batch_invariant:
        no row's output depends on the other rows of its step; its constructor then takes
        batch_invariant=True), else why not. Default: not, as torch's matrix products choose their kernels
        by the call's shape."""
        return (f"the {cls.name} backend runs torch's matrix products, whose kernels (and so the order of a row's "
                f"sums) change with a call's rows")

    @classmethod
    def require_batch_invariance(cls, model_dtype: torch.dtype) -> None:
        """ConfigError naming model.batch_invariant and why, where batch_invariance_unsupported says
        this backend cannot run a model of `model_dtype` batch-invariant."""
        if (why := cls.batch_invariance_unsupported(model_dtype)) is not None:
            raise ConfigError(f"model.batch_invariant: {why}")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def describe(self) -> str:
        """What runs, for the engine's start-up log line."""
        return self.name

    @property
    def int8_linears(self) -> int:
        """How many linears read int8 weights in some of their calls (model.quantization: int8); the
        others multiply the int8 weights' values in the model's dtype. Default: none."""
        return 0

    def prepare(self, config: EngineConfig, max_model_len: int) -> None:
        """Once, after the engine is built and before its first step: whatever would otherwise stall
        the first requests (compiling kernels, capturing graphs). Default: nothing."""

    # --- one step ------------------------------------------------------------------------------
    def execute(self, step: StepBatch) -> torch.Tensor | None:
        """Run one step: the copy-on-write copies first, then the forward. Returns the logits
        [S, vocab] (float32) of each row's last num_logits tokens, in row order; None when there are
        none."""
        if step.copies:  # before anything is written: a copy's source is a pinned block
            self.copy_blocks(list(step.copies))
        if not step.rows:
            return None
        return self.forward(step, StepTensors.build(step, self.block_size))

    @abc.abstractmethod
    def forward(self, step: StepBatch, host: StepTensors) -> torch.Tensor | None:
        """Store every token's K/V in its slot, attend, and return the logits of host.logit_rows
        ([S, vocab] float32; None when there are none)."""

    @abc.abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst = block src in every layer's K and V cache, for each (src, dst) pair."""

    # --- a template's K/V as data (snapshots) ---------------------------------------------------
    def read_blocks(self, blocks: Sequence[int]) -> dict[str, torch.Tensor]:
        """These blocks' K and V in every layer, copied to the host: {"k.<layer>", "v.<layer>"},
        each [len(blocks), block_size, num_kv_heads, head_dim] in the cache's dtype (KVCache's layout,
        the same on every backend)."""
        index = torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
        out: dict[str, torch.Tensor] = {}
        for layer, (k, v) in enumerate(self.kv_layers):
            out[f"k.{layer}"] = k.index_select(0, index).cpu()
            out[f"v.{layer}"] = v.index_select(0, index).cpu()
        return out

    def host_cache(self) -> dict[str, torch.Tensor] | None:
        """The KV cache tensors when they are in host memory: {"k.<layer>", "v.<layer>"} ->
        [num_blocks, block_size, num_kv_heads, head_dim], for a reader to fill blocks of in place
        (a snapshot read straight into the cache). None when the cache is on a device:
        write_blocks then."""
        if self.device.type != "cpu":
            return None
        out: dict[str, torch.Tensor] = {}
        for layer, (k, v) in enumerate(self.kv_layers):
            out[f"k.{layer}"], out[f"v.{layer}"] = k, v
        return out

    def write_blocks(self, blocks: Sequence[int], kv: dict[str, torch.Tensor]) -> None:
        """Set these blocks' K and V in every layer from read_blocks' form (shapes checked)."""
        index = torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
        for layer, (k, v) in enumerate(self.kv_layers):
            for name, cache in ((f"k.{layer}", k), (f"v.{layer}", v)):
                data = kv[name]
                if data.shape != (len(blocks), *cache.shape[1:]) or data.dtype != cache.dtype:
                    raise ValueError(f"{name}: {tuple(data.shape)} {data.dtype}, the cache takes "
                                     f"{(len(blocks), *cache.shape[1:])} {cache.dtype}")
                cache.index_copy_(0, index, data.to(self.device))

    # --- templates (TemplateHooks of the TemplatePins) ------------------------------------------
    def on_pin(self, handle: TemplateHandle) -> None:
        """A template's blocks were just pinned: they hold its K/V and never change until on_unpin."""

    def on_unpin(self, handle: TemplateHandle) -> None:
        """A template's blocks are about to be freed: drop anything derived from them."""

    # --- introspection --------------------------------------------------------------------------
    def packed_template_bytes(self) -> int:
        """Host memory held for pinned templates beside the KV cache (kv_stats, metrics)."""
        return 0

    def check_integrity(self, pinned: Collection[TemplateHandle]) -> None:
        """Raise AssertionError if the backend holds anything for a template that is not pinned."""


# What builds a backend from the loaded model: a Backend subclass, or a function (e.g. a subclass
# with some of its choices fixed, for a benchmark that compares a backend's kernels).
BackendFactory = Callable[[LlamaForCausalLM, CacheConfig], Backend]
