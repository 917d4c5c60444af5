"""Scheduler: continuous batching with a per-step token budget.

Each step: running sequences with one uncomputed token (decodes) first, oldest first, and those
with a short run of tokens after their prompt (a structured output's forced tokens: a decode row
each); then running sequences part-way through their prompt (chunked prefill); then waiting requests in
FCFS order while the budget, `max_num_seqs` and free blocks allow. When a decode needs a block
and none is free, the blocks forked sequences hold while they wait are freed first (newest
first), then the newest running sequence is preempted (its own blocks freed, recomputed later);
pinned template blocks are never touched. The step goes to the backend as plain data
(`StepBatch`, step.py); the backend builds the tensors.

A step the backend fails to compute (quarantine) is isolated: each of its sequences goes back to
the queue, its KV dropped, and then runs one step alone before it shares a step again. One that
fails alone, or in MAX_FAILED_STEPS failed steps, is the one to end; the others go on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from prefix_service.engine.block_allocator import BlockAllocator, BlockId
from prefix_service.config import SchedulerConfig
from prefix_service.engine.template_pins import TemplatePins
from prefix_service.engine.sequence import FinishReason, Sequence, SeqStatus
from prefix_service.engine.step import ScheduledRow, StepBatch


# A running sequence's tokens after its prompt that are not computed yet, when more than one (a
# structured output's forced run, engine/core.py), run as that many decode rows up to this many
# (each row attends the template once with the step's other decodes), else as a prefill chunk.
MAX_DECODE_RUN = 16
# A sequence in this many failed steps ends with the error even where it never failed alone: a fault
# that needs two sequences together would otherwise fail their shared steps again and again.
MAX_FAILED_STEPS = 3


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [num_computed, num_computed + num_new_tokens) run this step
    is_decode: bool = False  # scheduled as decodes: a row per new token, each after the ones before it
    # draft tokens after the sequence's last (speculation.py), the last len(draft) of its decode rows;
    # the engine keeps those its rows' draws confirm (EngineCore._verify_drafts)
    draft: tuple[int, ...] = ()

    def rows(self, block_size: int) -> list[ScheduledRow]:
        """This sequence's part of the step, as the backend reads it: one prefill row, or a decode row
        per new token (a forced run: each reads the cache up to its own token, which the step stores
        before any row attends; those from the sequence's first_logit_position on have logits: the last,
        or every one of a run held for its logprobs)."""
        seq, start = self.seq, self.seq.num_computed_tokens
        template = seq.template
        template_id = template.template_id if template is not None else None
        if not self.is_decode:
            return [ScheduledRow(
                seq.request_id, False, tuple(seq.token_ids[start:start + self.num_new_tokens]), start,
                tuple(seq.block_table), template_id, seq.num_shared_blocks, num_logits=self.num_logits)]
        first = seq.first_logit_position
        ids = seq.token_ids + list(self.draft) if self.draft else seq.token_ids
        return [ScheduledRow(
            seq.request_id, True, (ids[p],), p, tuple(seq.block_table[:p // block_size + 1]),
            template_id, seq.num_shared_blocks, num_logits=int(first is not None and p >= first))
            for p in range(start, start + self.num_new_tokens)]

    @property
    def num_logits(self) -> int:
        """The new tokens whose logits the sequence needs: its last (when this chunk completes it and
        it samples), or those from its score_from on."""
        first = self.seq.first_logit_position
        if first is None:
            return 0
        start = self.seq.num_computed_tokens
        return max(0, start + self.num_new_tokens - max(start, first))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes (1 token) first, then prefills
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)  # copy-on-write, before the step
    preempted: list[Sequence] = field(default_factory=list)
    unschedulable: list[Sequence] = field(default_factory=list)  # cannot fit even alone: the engine ends them
    step: StepBatch = field(default_factory=StepBatch)  # `scheduled` and `copies` as plain data, row for row

    @property
    def with_logits(self) -> list[ScheduledSeq]:
        """The scheduled sequences the step returns logits for (num_logits rows each), in its order."""
        return [s for s in self.scheduled if s.num_logits]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, templates: TemplatePins,
                 block_size: int, draft: Callable[[Sequence, int, int], tuple[int, ...]] | None = None) -> None:
        self.config = config
        # (seq, most tokens, running sequences) -> draft tokens to check after seq's last
        # (speculation.Drafter); None: none
        self.draft = draft
        self.allocator = allocator
        self.templates = templates
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.num_failed_steps = 0  # steps the backend failed to compute (quarantine)
        self._suspects: deque[Sequence] = deque()  # of a failed step, each to run one step alone, oldest first
        self._alone: Sequence | None = None  # the suspect the step just scheduled holds alone

    # --- queue ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def waiting_requests(self) -> int:
        """Requests waiting to run (preempted ones included), each counted once: the samples or
        candidates forked from a request's fork point wait as part of it, not as requests."""
        return sum(1 for seq in self.waiting if not seq.forked)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- blocks -----------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _start_blocks(self, seq: Sequence, copies: list[tuple[BlockId, BlockId]]) -> bool:
        """A waiting sequence's first blocks: the template it continues, or for a template's warmup
        its whole prompt as one run of consecutive blocks when one is free (its pinned KV is then
        a plain slice of the cache, which attention reads without a gather). A forked sequence
        has its blocks already (fork)."""
        if seq.block_table:
            return True
        if seq.prefill_only:
            run = self.allocator.allocate_contiguous(-(-len(seq.token_ids) // self.block_size))
            if run is not None:
                seq.block_table = run
            return True
        return self._attach_template(seq, copies)

    def _attach_template(self, seq: Sequence, copies: list[tuple[BlockId, BlockId]]) -> bool:
        """Start a waiting sequence's block table. On a template of length P, it reuses R tokens
        (R = P, or P - 1 when the prompt adds nothing, so one token is computed for logits):

            block_table: [ shared full blocks: R // B | own copy of block R // B if R % B | own ... ]

        Returns False (nothing changed) if the copy-on-write block cannot be allocated."""
        handle = seq.template
        if handle is None:
            return True
        reuse = handle.reused_tokens(len(seq.token_ids))
        first = seq.first_logit_position
        if first is not None:  # a position whose logits it needs is computed, not taken
            reuse = min(reuse, first)
        num_shared, tail = divmod(reuse, self.block_size)
        if tail and self.allocator.num_free < 1:
            return False
        shared = list(handle.block_table[:num_shared])
        self.allocator.incref(shared)
        seq.block_table = shared
        seq.num_shared_blocks = num_shared
        if tail:
            (own,) = self.allocator.allocate(1)
            copies.append((handle.block_table[num_shared], own))
            seq.block_table.append(own)
        seq.num_computed_tokens = reuse
        seq.cached_tokens = reuse
        return True

    def fork(self, parent: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """Start each child on the parent's KV, to run next (at the front of the queue, in order).
        The parent's prompt is computed; each child's ids begin with the parent's P tokens and it
        takes R = P - 1 of them, so that it computes the last one for its logits (as a prompt that
        adds nothing to a template does):

            child block_table: [ parent's blocks 0 .. R//B - 1 (shared) | own copy of block R//B if R % B | own ... ]

        The template's blocks among them stay counted as the template's (num_shared_blocks). Returns
        the (src, dst) block copies to make now, while the parent still holds its blocks; a child
        no free block is left for starts unattached and computes its prompt itself."""
        reuse = parent.num_computed_tokens - 1
        assert parent.num_uncomputed == 0 and reuse >= 0, "fork of a sequence whose prompt is not computed"
        assert all(c.token_ids[:reuse + 1] == parent.token_ids and c.block_table == [] for c in children)
        num_shared, tail = divmod(reuse, self.block_size)
        copies: list[tuple[int, int]] = []
        for child in children:
            child.forked = True
            if tail and self.allocator.num_free < 1:
                continue
            shared = list(parent.block_table[:num_shared])
            self.allocator.incref(shared)
            child.block_table = shared
            if tail:
                (own,) = self.allocator.allocate(1)
                copies.append((parent.block_table[num_shared], own))
                child.block_table.append(own)
            child.num_shared_blocks = min(parent.num_shared_blocks, num_shared)
            child.num_computed_tokens = reuse
            child.cached_tokens = parent.cached_tokens
        self.waiting.extendleft(reversed(children))
        return copies

    def _release_a_waiting_hold(self, out: SchedulerOutput) -> bool:
        """Free the blocks of the newest waiting sequence that holds some: a forked sample or
        candidate waiting its turn (fork), which computes its prompt again when it starts, as a
        preempted sequence does. Such holds are freed before any running sequence is preempted, and
        before a sequence is called too large for the cache: only running sequences were preempted,
        so forks waiting with their blocks could hold a sequence that fits alone off forever.
        False when no waiting sequence holds a block."""
        for seq in reversed(self.waiting):
            if seq.block_table:
                self._free_blocks(seq)
                seq.num_preemptions += 1
                self.num_preemptions += 1
                out.preempted.append(seq)
                return True
        return False

    def _free_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_shared_blocks = 0
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the sequence's KV; it re-enters the queue at the front."""
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # --- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step: every sequence that fits, or, while a failed step's sequences remain to be
        tried alone (quarantine), the oldest of them alone."""
        self._alone = None
        while self._suspects and self._suspects[0].status is SeqStatus.FINISHED:  # ended while it waited
            self._suspects.popleft()
        if self._suspects:
            return self._schedule_alone(self._suspects[0])
        return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. decodes (a forced run: a decode row per token), oldest first; preempt the newest running
        #    sequence for blocks
        running = list(self.running)
        for i, seq in enumerate(running):
            if budget == 0:
                break
            n = min(self._decode_rows(seq), budget) if seq.status is SeqStatus.RUNNING else 0
            if n == 0:
                continue
            # a draft leaves a token of the budget to each sequence after this one
            draft = self._draft(seq, budget - len(running) + i) if n == 1 else ()
            n += len(draft)
            need = self._blocks_needed(seq, n)
            if need > self.allocator.num_free and len(seq.own_blocks) + need > self.capacity_blocks():
                # Preempting it would only recompute it into the same wall, forever.
                out.unschedulable.append(seq)
                continue
            while need > self.allocator.num_free and self._release_a_waiting_hold(out):
                pass
            while need > self.allocator.num_free:
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled_ids), None)
                assert victim is not None  # seq itself is one: running, not scheduled yet
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.block_table += self.allocator.allocate(need)
            out.scheduled.append(ScheduledSeq(seq, n, is_decode=True, draft=draft))
            scheduled_ids.add(id(seq))
            budget -= n

        # 2. running sequences part-way through their prompt (chunked prefill); newer ones
        #    yield their blocks to older ones
        for seq in list(self.running):
            if budget == 0:
                break
            if (seq.status is not SeqStatus.RUNNING or id(seq) in scheduled_ids or seq.num_uncomputed <= 1
                    or self._decode_rows(seq)):
                continue
            want = min(seq.num_uncomputed, budget)
            n = self._fit_chunk(seq, want)
            while n == 0 and self._release_a_waiting_hold(out):
                n = self._fit_chunk(seq, want)
            while n == 0:
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled_ids and s is not seq), None)
                if victim is None:
                    break
                self._preempt(victim, out)
                n = self._fit_chunk(seq, want)
            if n == 0:
                break
            seq.block_table += self.allocator.allocate(self._blocks_needed(seq, n))
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n

        # 3. waiting requests, FCFS: never skip ahead of one that does not fit
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._start_blocks(seq, out.copies):
                break
            n = self._fit_chunk(seq, min(seq.num_uncomputed, budget))
            if n == 0:
                if seq.block_table:
                    # undo the start; a pending copy into a freed block is dropped with it
                    own = set(seq.own_blocks)
                    out.copies[:] = [c for c in out.copies if c[1] not in own]
                self._free_blocks(seq)
                break
            self.waiting.popleft()
            seq.block_table += self.allocator.allocate(self._blocks_needed(seq, n))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n

        if not out.scheduled and not out.unschedulable and self._release_a_waiting_hold(out):
            # forked sequences waiting their turn held the blocks the next one needs: try again
            # without them (each release frees one for good, so this ends)
            again = self._schedule()
            again.preempted[:0] = out.preempted
            return again
        if not out.scheduled and not out.unschedulable:
            # Nothing could run: the oldest sequence does not fit in the cache even alone.
            stuck = self.running[0] if self.running else (self.waiting[0] if self.waiting else None)
            if stuck is not None:
                out.unschedulable.append(stuck)
        out.step = StepBatch(tuple(r for s in out.scheduled for r in s.rows(self.block_size)), tuple(out.copies))
        return out

    def _schedule_alone(self, seq: Sequence) -> SchedulerOutput:
        """A step of `seq` alone (a suspect, waiting with its KV dropped by quarantine), scheduled as
        if the queue held nothing else. Only suspects run until each has had its step, so the
        running ones are fewer than before the failed step and the blocks its step takes were its
        own then; where it does not fit all the same (blocks a fork took meanwhile), it rejoins the
        queue as any sequence and the next suspect, or the usual step, follows: a fault it brings
        fails its next shared step, which counts too (MAX_FAILED_STEPS)."""
        running, waiting = self.running, self.waiting
        self.running, self.waiting = [], deque([seq])
        try:
            out = self._schedule()
        finally:
            started = self.running  # [seq] where it was scheduled
            self.running = running + started
            self.waiting = deque(s for s in waiting if not (s is seq and started))
        if out.scheduled:
            self._alone = seq
            return out
        self._suspects.popleft()
        return self.schedule()

    def quarantine(self, out: SchedulerOutput) -> list[Sequence]:
        """The backend failed to compute the step `out` (nothing after it ran: no sequence moved on, its
        K/V perhaps part-written) -> the sequences to end with the error: the one that failed in a step
        of its own (schedule ran it alone), and any in its MAX_FAILED_STEPS-th failed step. Each other
        sequence of the step goes back to the queue with its KV dropped, to be computed again (as a
        preempted one), and runs one step alone before it shares one again: a fault one request brings
        ends that request, a fault of the moment ends none."""
        self.num_failed_steps += 1
        alone, self._alone = self._alone, None
        if alone is not None:
            if self._suspects and self._suspects[0] is alone:
                self._suspects.popleft()
            return [alone]
        seqs = [s.seq for s in out.scheduled if s.seq.status is SeqStatus.RUNNING]
        for seq in seqs:
            seq.num_failed_steps += 1
        guilty = [seq for seq in seqs if seq.num_failed_steps >= MAX_FAILED_STEPS]
        retry = [seq for seq in seqs if seq.num_failed_steps < MAX_FAILED_STEPS]
        order = {id(seq): i for i, seq in enumerate(self.running)}
        retry.sort(key=lambda seq: order[id(seq)])  # oldest first
        for seq in reversed(retry):  # the newest first to the queue's front: the oldest ends up first
            self._requeue(seq)
        self._suspects.extend(retry)
        return guilty

    def _draft(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """Draft tokens to run after a decoding sequence's last token, at most `limit`: only while few
        sequences run (scheduler.speculative_max_running; a larger batch is bound by its products,
        where extra rows cost what they could save), each its share of speculative_step_tokens, and
        only into blocks no running sequence may need this step (one each at most): a draft never
        preempts a sequence. The blocks a draft's rejected tokens took are freed after the step
        (trim_blocks)."""
        running = len(self.running)
        if self.draft is None or running > self.config.speculative_max_running:
            return ()
        limit = min(limit, self.config.speculative_step_tokens // running)
        if limit < 1:
            return ()
        draft = self.draft(seq, limit, running)
        if draft and self._blocks_needed(seq, 1 + len(draft)) > self.allocator.num_free - running:
            return ()
        return draft

    @staticmethod
    def _decode_rows(seq: Sequence) -> int:
        """The decode rows a running sequence takes this step: 1 for its next token; its tokens after
        its prompt that are not computed yet, up to MAX_DECODE_RUN; 0: none (a prompt's chunk)."""
        n = seq.num_uncomputed
        if n == 1 or (1 < n <= MAX_DECODE_RUN and seq.num_computed_tokens >= seq.num_prompt_tokens):
            return n
        return 0

    def capacity_blocks(self) -> int:
        """Blocks a sequence could own if it ran alone: every block no template pins."""
        return self.allocator.num_blocks - self.templates.num_pinned_blocks

    def _fit_chunk(self, seq: Sequence, n: int) -> int:
        """The largest chunk <= n whose blocks are free now."""
        free_slots = self.allocator.num_free * self.block_size
        slack = len(seq.block_table) * self.block_size - seq.num_computed_tokens  # room in own blocks
        return max(0, min(n, slack + free_slots))

    # --- after the step ---------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[Sequence], tokens: list[int]) -> None:
        """The step ran: each scheduled chunk's K/V is in the cache now, and each sampled sequence
        gets its new token (the next step computes its K/V)."""
        for s in out.scheduled:  # a draft's rows are computed, but count once their tokens are kept
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft)
        for seq, token in zip(sampled, tokens):
            seq.token_ids.append(token)
        if self._alone is not None:  # a suspect's step alone ran: it shares steps again
            if self._suspects and self._suspects[0] is self._alone:
                self._suspects.popleft()
            self._alone = None

    def take_drafted(self, seq: Sequence, token: int, computed: bool) -> None:
        """A token drawn from a drafted sequence's rows (EngineCore._verify_drafts); computed: it is
        the draft token at its position, whose K/V the step stored, else the next step computes it."""
        assert seq.status is SeqStatus.RUNNING and seq.num_uncomputed == 0
        seq.token_ids.append(token)
        if computed:
            seq.num_computed_tokens += 1

    def trim_blocks(self, seq: Sequence) -> None:
        """Free a running sequence's own blocks past those its tokens fill (a draft's rejected tokens
        took them), so that a draft holds no block another sequence needs."""
        keep = max(-(-len(seq.token_ids) // self.block_size), seq.num_shared_blocks)
        if seq.status is SeqStatus.RUNNING and len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def append_token(self, seq: Sequence, token: int) -> None:
        """A running sequence's next token that was not sampled (a structured output forced it): its
        K/V is computed with the sequence's other uncomputed tokens in its next step (_decode_rows)."""
        assert seq.status is SeqStatus.RUNNING and seq.samples
        seq.token_ids.append(token)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (finished, aborted or failed): free its blocks, release its template."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        else:  # ended already, or never queued (a fork's child where the fork failed): nothing held
            return
        self._free_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.template is not None:
            self.templates.release(seq.template)

    def held_refs(self) -> dict[BlockId, int]:
        refs: dict[BlockId, int] = {}
        for seq in self.running + list(self.waiting):
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        return refs
