"""One step as plain data: what the scheduler decided, per row, and all a backend reads.

The scheduler owns the live `Sequence` objects; a backend never sees them. Each step it emits a
`StepBatch` of frozen rows, one per scheduled sequence, decodes first:

    row: [0, num_computed) already in the cache | token_ids: the new tokens, at positions
         num_computed, num_computed + 1, ... | block_ids cover all of them
    block_ids[:num_template_blocks] are template_id's pinned full blocks (shared, read-only);
    every later block is the row's own.

A decode row has one new token after a cached context; a prefill row is a prompt chunk (its
context: a template's shared blocks, earlier chunks). `is_decode` says which, explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prefix_service.engine.block_allocator import BlockId


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    is_decode: bool
    token_ids: tuple[int, ...]  # the tokens this step computes
    num_computed: int  # tokens of this sequence already in the cache
    block_ids: tuple[BlockId, ...]  # the block table, covering num_computed + len(token_ids) tokens
    template_id: int | None = None  # the pinned template it continues (TemplateHandle.template_id)
    num_template_blocks: int = 0  # the leading block_ids shared with that template (full blocks)
    num_logits: int = 0  # the logits of this many of its last new tokens are returned (to sample or score)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this row attends over after the step: the cached ones and its new ones."""
        return self.num_computed + len(self.token_ids)

    def slots(self, block_size: int) -> list[int]:
        """Each new token's cache slot: block_id * block_size + offset."""
        table = self.block_ids
        return [table[p // block_size] * block_size + p % block_size
                for p in range(self.num_computed, self.context_len)]


@dataclass(frozen=True)
class StepBatch:
    """A step: rows[:num_decodes] are decodes, the rest prefills; `copies` are the copy-on-write
    block copies (src, dst) to make before anything is written."""
    rows: tuple[ScheduledRow, ...] = ()
    copies: tuple[tuple[BlockId, BlockId], ...] = ()
    num_decodes: int = field(init=False)

    def __post_init__(self) -> None:
        n = 0
        while n < len(self.rows) and self.rows[n].is_decode:
            n += 1
        if any(r.is_decode for r in self.rows[n:]):
            raise ValueError("a step lists its decode rows first")
        object.__setattr__(self, "num_decodes", n)

    @property
    def decodes(self) -> tuple[ScheduledRow, ...]:
        return self.rows[:self.num_decodes]

    @property
    def prefills(self) -> tuple[ScheduledRow, ...]:
        return self.rows[self.num_decodes:]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns: each row's num_logits, in row order."""
        return sum(r.num_logits for r in self.rows)

    def template_groups(self) -> list[list[int]]:
        """The decode rows (indices into `decodes`) that continue the same pinned template's full
        blocks, two or more to a group, in order of first appearance: what a backend's cascade reads
        once per group (one row alone reads the template once either way)."""
        members: dict[tuple[int, int], list[int]] = {}
        for i, row in enumerate(self.decodes):
            if row.template_id is not None and row.num_template_blocks > 0:
                members.setdefault((row.template_id, row.num_template_blocks), []).append(i)
        return [rows for rows in members.values() if len(rows) >= 2]
