"""Model runner: the only place that turns a SchedulerOutput into device tensors and runs the model."""
from __future__ import annotations

import torch

import cuda_ops
from prefix_service.backends.torch.attention import AttentionMetadata
from prefix_service.backends.torch.cascade import CascadeDecode, PrefixGroup
from prefix_service.backends.kv_cache import KVCache
from prefix_service.model.llama import LlamaForCausalLM
from prefix_service.backends.cpu.packed_prefix import PackedPrefixKV
from prefix_service.engine.prefix_cache import PrefixHandle
from prefix_service.engine.scheduler import SchedulerOutput
from prefix_service.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.kv_layers = kv_cache.layers()  # per layer (k, v): the same tensors for the engine's life
        self.packed_prefixes: dict[PrefixHandle, PackedPrefixKV] = {}  # CPU: templates' K/V packed (pack_prefix)

    def pack_prefix(self, handle: PrefixHandle) -> PackedPrefixKV | None:
        """Hold a pinned template's full blocks a second time, packed for CPU attention
        (packed_prefix.py); requests that continue it read them there. None if it has no full block."""
        full = handle.num_tokens // self.block_size
        if not full:
            return None
        packed = self.packed_prefixes[handle] = PackedPrefixKV(self.kv_layers, list(handle.block_table[:full]),
                                                               native=getattr(self.backend, "native", False))
        return packed

    def drop_prefix(self, handle: PrefixHandle) -> None:
        """Forget a template's packed copy: before its blocks are freed."""
        self.packed_prefixes.pop(handle, None)

    def _packed_for(self, seq: Sequence) -> PackedPrefixKV | None:
        # only when the sequence shares all of the packed blocks (a prompt that adds nothing shares one
        # block fewer: its last template token is computed again, in its own block)
        packed = self.packed_prefixes.get(seq.prefix) if seq.prefix is not None else None
        return packed if packed is not None and seq.num_shared_blocks == packed.num_blocks else None

    def _tensor(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device="cpu").to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        return self._tensor(rows, torch.int32).view(len(seqs), width)

    def _cascade(self, seqs: list[Sequence], ctx: list[int]) -> CascadeDecode | None:
        """Group decoding sequences by the pinned prefix blocks they share. A group pays off with
        two or more sequences (one read of the prefix instead of several; read in place when the
        blocks are consecutive). A lone sequence gathers its whole context instead: one attention
        over it costs less than two and a merge (measured on CPU: 26.7 vs 28.6 ms a step)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, seq in enumerate(seqs):
            if seq.prefix is not None and seq.num_shared_blocks > 0:
                groups.setdefault((id(seq.prefix), seq.num_shared_blocks), []).append(i)
        chosen = []
        for rows in groups.values():
            if len(rows) < 2:
                continue
            seq = seqs[rows[0]]
            blocks = seq.block_table[:seq.num_shared_blocks]
            consecutive = blocks == list(range(blocks[0], blocks[0] + len(blocks)))
            chosen.append((rows, blocks, blocks[0] if consecutive else None))
        if not chosen:
            return None
        shared = [0] * len(seqs)
        for rows, blocks, _ in chosen:
            for i in rows:
                shared[i] = len(blocks)
        suffix_lens = [c - n * self.block_size for c, n in zip(ctx, shared)]
        width = max(len(seq.block_table) - n for seq, n in zip(seqs, shared))
        tables = [seq.block_table[n:] + [-1] * (width - len(seq.block_table) + n) for seq, n in zip(seqs, shared)]
        return CascadeDecode(
            groups=[PrefixGroup(self._tensor(blocks, torch.int64), self._tensor(rows, torch.int64), first)
                    for rows, blocks, first in chosen],
            suffix_block_tables=self._tensor(tables, torch.int32).view(len(seqs), width),
            suffix_lens=self._tensor(suffix_lens, torch.int32),
            max_suffix=max(suffix_lens))

    @staticmethod
    def _leading_run(block_table: list[int], full_blocks: int) -> tuple[int, int]:
        """(first block, length) of the consecutive run that starts the first `full_blocks` blocks."""
        if not full_blocks:
            return 0, 0
        first, n = block_table[0], 1
        while n < full_blocks and block_table[n] == first + n:
            n += 1
        return first, n

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Run one step. Returns logits [N, vocab] (float32) for the sequences whose chunk reaches
        their last token (prefill-only warmups excluded), and those sequences in order."""
        if out.copies:  # copy-on-write of partial prefix tail blocks, before anything is written
            stack = self.model.stack
            if stack is not None and stack.serves(self.kv_layers):  # one native call for all layers
                stack.copy_blocks(out.copies)
            else:
                cuda_ops.copy_blocks(self.kv_cache.k, self.kv_cache.v, self._tensor(out.copies, torch.int64))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes, prefills = [], []
        logit_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        B = self.block_size
        for s in out.scheduled:  # decodes come first in the scheduler's order
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[p // B] * B + p % B for p in range(start, end)]
            (decodes if s.num_new_tokens == 1 and start > 0 and not prefills else prefills).append(s)
            if s.completes_prompt and not seq.prefill_only:
                logit_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        q_lens = [s.num_new_tokens for s in prefills]
        ctx = [s.seq.num_computed_tokens for s in prefills]
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        dec_ctx = [s.seq.num_computed_tokens + 1 for s in decodes]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=len(decodes),
            decode_block_tables=self._block_tables([s.seq for s in decodes]),
            decode_context_lens=self._tensor(dec_ctx, torch.int32),
            decode_max_context=max(dec_ctx, default=0),
            prefill_block_tables=self._block_tables([s.seq for s in prefills]),
            prefill_prefix_lens=self._tensor(ctx, torch.int32),
            prefill_cu_seqlens_q=self._tensor(cu_q, torch.int32),
            prefill_q_lens=q_lens,
            prefill_prefix_lens_list=ctx,
            prefill_max_q=max(q_lens, default=0),
            prefill_max_k=max((a + b for a, b in zip(q_lens, ctx)), default=0),
            prefill_total_k=sum(q_lens) + sum(ctx),
        )
        if not getattr(self.backend, "native", False):  # the native kernel reads each context in place
            # (faster than cascade grouping at 4-64 sequences) and takes no leading runs
            meta.decode_cascade = self._cascade([s.seq for s in decodes], dec_ctx)
            meta.prefill_ctx_runs = [self._leading_run(s.seq.block_table, c // B) for s, c in zip(prefills, ctx)]
        if self.packed_prefixes:
            meta.prefill_packed = [self._packed_for(s.seq) for s in prefills]
            meta.decode_packed = [self._packed_for(s.seq) for s in decodes]
        hidden = self.model(self._tensor(ids, torch.int64), self._tensor(positions, torch.int64),
                            self.backend, self.kv_layers, meta)  # [T, hidden]
        if not logit_rows:
            return None, []
        return self.model.compute_logits(hidden[self._tensor(logit_rows, torch.int64)]), sample_seqs
