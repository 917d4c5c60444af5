"""CUDA graphs of the decode step: one captured forward per batch size, replayed instead of
launching its few thousand kernels one by one from Python.

A decode step of a Llama-8B-shaped model launches about 40 kernels per layer; on an H100 the host
takes longer to launch them than the GPU to run them (batch 1: 25 ms a step, 8 ms of it GPU work).
So pure-decode steps of up to `max_batch` rows replay a graph captured at start for the smallest
size that holds them (1, 2, 4, 8, then multiples of 16). Everything a graph reads lives in static
device buffers filled before each replay: token ids, positions, K/V slots, block tables as wide as
max_model_len allows, context lengths. The rows past the step's are padding: their slot is -1 (the
store kernel skips it) and their context is one token of block 0, so they read valid memory, and
their outputs are dropped. The Triton decode kernel is captured with the split count of the full
table width, and each row spreads its own blocks over those splits. The cascade's groups (rows on the
same template) are static buffers too, half as many groups as rows at most (a group has two rows or
more); unused ones have no rows.

Steps with a prefill chunk, more rows than the largest graph, or anything else run as before.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from cuda_ops.paged_decode import UNUSED_ITEM, CascadeGroups, cascade_supported, rows_per_chunk, work_items
from prefix_service.backends.base import StepTensors
from prefix_service.backends.cuda.attention import (DecodeFn, PrefillFn, VarlenAttention, VarlenMetadata, cascade_rows,
                                                    decode_triton)
from prefix_service.backends.cuda.staging import Staging
from prefix_service.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from prefix_service.engine.step import StepBatch

log = logging.getLogger("prefix_service.engine")


class GraphedBackend(Protocol):
    """What the graphs use of the cuda backend (backend.py), which owns them."""
    model: LlamaForCausalLM
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    prefill: PrefillFn
    decode: DecodeFn
    block_size: int
    device: torch.device
    run_model: Callable[..., torch.Tensor]  # the forward: the model's, or its fused layers'
    staging: Staging  # a step's host tensors to the device in one copy


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to max_batch (and
    max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if max_batch >= 1 and max_batch not in sizes:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """The captured decode forwards of one backend; `run` replays the one that fits a step."""

    def __init__(self, backend: GraphedBackend, max_batch: int, max_model_len: int) -> None:
        self.backend = backend
        device = backend.device
        self.sizes = graph_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // backend.block_size)  # block-table columns
        b = self.max_batch
        self.ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros((b, self.width), dtype=torch.int32, device=device)
        self.lens = torch.ones(b, dtype=torch.int32, device=device)
        # the cascade's groups (cuda_ops.paged_decode.CascadeGroups): half as many as rows at most (_groups)
        self.cascade = cascade_supported(backend.block_size) and backend.decode is decode_triton
        self.first = torch.zeros(b, dtype=torch.int32, device=device)
        self.group_rows = torch.zeros((b, b), dtype=torch.int32, device=device)
        self.group_sizes = torch.zeros(b, dtype=torch.int32, device=device)
        self.group_blocks = torch.zeros(b, dtype=torch.int32, device=device)
        arch = backend.model.arch
        self.rows_per_chunk = rows_per_chunk(arch.num_heads, arch.num_kv_heads)
        # work items: at most one per chunk of rows plus one per group (a partial last chunk)
        self.work = torch.tensor([UNUSED_ITEM] * self._items(b), dtype=torch.int32, device=device)
        self.replays = 0  # steps served by a graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        pool = None
        for n in sorted(self.sizes, reverse=True):  # the largest first: the smaller ones fit in its pool
            graph, self.logits[n] = self._capture(n, pool)
            pool = graph.pool()
            self.graphs[n] = graph
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log.info("CUDA graphs: decode steps of up to %d rows (%d sizes) captured in %.1f s",
                 self.max_batch, len(self.sizes), time.perf_counter() - start)

    @staticmethod
    def _groups(n: int) -> int:
        """Template groups a graph of n rows has room for: a group has two rows or more."""
        return max(1, n // 2)

    def _items(self, n: int) -> int:
        """Work items a graph of n rows has room for: their chunks, and a partial one per group."""
        return -(-n // self.rows_per_chunk) + self._groups(n)

    def _forward(self, n: int) -> torch.Tensor:
        backend = self.backend
        groups = self._groups(n)
        empty = self.tables[:0]
        meta = VarlenMetadata(
            slots=self.slots[:n], num_decodes=n, decode_tables=self.tables[:n], decode_lens=self.lens[:n],
            decode_max=self.width * backend.block_size, prefill_tables=empty, prefill_context=self.lens[:0],
            cu_seqlens_q=self.lens[:1], prefill_new_list=[], prefill_context_list=[], max_q=0, max_k=0, total_k=0,
            cascade=CascadeGroups(self.first[:n], self.group_rows[:groups, :n], self.group_sizes[:groups],
                                  self.group_blocks[:groups], self.work[:self._items(n)]) if self.cascade else None,
            decode_own_max=self.width * backend.block_size)
        attention = VarlenAttention(backend.kv_layers, meta, backend.prefill, backend.decode)
        hidden = backend.run_model(self.ids[:n], self.positions[:n], attention)
        return backend.model.compute_logits(hidden)

    def _capture(self, n: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.backend.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels and sets the libraries' workspaces up
            for _ in range(2):
                self._forward(n)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(n)
        return graph, logits

    def fits(self, step: StepBatch) -> bool:
        n = len(step.rows)
        return 0 < n <= self.max_batch and step.num_decodes == n and step.num_logits == n

    def _groups_of(self, step: StepBatch, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's template groups as (static cascade buffer, host tensor) pairs (no group: every
        size 0; the padding rows start at block 0)."""
        first, groups = cascade_rows(step)
        first += [0] * (size - len(first))  # the padding rows
        slots = self._groups(size)
        assert len(groups) <= slots
        sizes = [len(rows) for _, rows in groups] + [0] * (slots - len(groups))
        blocks = [b for b, _ in groups] + [0] * (slots - len(groups))
        width = max((len(rows) for _, rows in groups), default=0)
        capacity = self._items(size)
        items = work_items(sizes, self.rows_per_chunk)
        assert len(items) <= capacity
        items += [UNUSED_ITEM] * (capacity - len(items))

        def ints(data) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int32)
        return [(self.first[:size], ints(first)), (self.group_sizes[:slots], ints(sizes)),
                (self.group_blocks[:slots], ints(blocks)),
                (self.group_rows[:len(groups), :width],
                 ints([rows + [0] * (width - len(rows)) for _, rows in groups]).view(len(groups), width)),
                (self.work[:capacity], ints(items))]

    def run(self, step: StepBatch, host: StepTensors) -> torch.Tensor:
        """The logits [n, vocab] of a step that `fits`, by replaying the smallest graph that holds it.
        The step's inputs reach the device in one copy (staging), then into the graph's buffers."""
        n = len(step.rows)
        size = next(s for s in self.sizes if s >= n)
        fills = [(self.ids[:n], host.token_ids), (self.positions[:n], host.positions), (self.slots[:n], host.slots),
                 (self.tables[:n, :host.block_tables.shape[1]], host.block_tables), (self.lens[:n], host.context_lens)]
        if self.cascade:
            fills += self._groups_of(step, size)
        for buffer, moved in zip((b for b, _ in fills), self.backend.staging.to_device([t for _, t in fills])):
            buffer.copy_(moved)
        if size > n:  # the padding rows: no K/V written, one token of context
            self.slots[n:size].fill_(-1)
            self.lens[n:size].fill_(1)
            self.tables[n:size, 0].fill_(0)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n].clone()  # the next replay overwrites the graph's own output
