"""Block allocator: the one owner of KV block ids, their reference counts and the free list.

A block is free iff its reference count is 0. Holders (a sequence's block table, a pinned
prefix) each hold one reference per block they list; `free` drops one reference per block.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, NewType

BlockId = NewType("BlockId", int)


class OutOfBlocks(RuntimeError):
    """Asked for more blocks than are free. Callers check `num_free` first; this is a bug guard."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # FIFO free list: a freed block goes to the back, so recently freed blocks are
        # reused last (their bytes are easier to inspect when debugging).
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self.peak_used = 0  # the most blocks in use at once since the last reset_peak()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def reset_peak(self) -> None:
        """Start a new high-water mark from the blocks in use now."""
        self.peak_used = self.num_used

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)

    def ref_count(self, block: BlockId) -> int:
        return self._ref_counts[block]

    def allocate(self, n: int) -> list[BlockId]:
        """n fresh blocks, each with reference count 1."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        self._note_peak()
        return blocks

    def allocate_contiguous(self, n: int) -> list[BlockId] | None:
        """n free blocks with consecutive ids (count 1 each), the lowest such run; None if no run
        of n is free. Used for a template's warmup, so its pinned KV is one slice of the cache."""
        if n <= 0 or n > len(self._free):
            return None
        free = sorted(self._free)
        run_start = 0
        for i in range(1, len(free) + 1):
            if i == len(free) or free[i] != free[i - 1] + 1:
                if i - run_start >= n:
                    blocks = free[run_start:run_start + n]
                    taken = set(blocks)
                    self._free = deque(b for b in self._free if b not in taken)
                    for b in blocks:
                        self._ref_counts[b] = 1
                    self._note_peak()
                    return blocks
                run_start = i
        return None

    def incref(self, blocks: Iterable[BlockId]) -> None:
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[BlockId]) -> None:
        """Drop one reference per block; a block whose count reaches 0 returns to the free list.
        Freed in reverse so a sequence's tail blocks are reused last."""
        for b in reversed(list(blocks)):
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self, expected_refs: dict[BlockId, int] | None = None) -> None:
        """Raise AssertionError unless: free + referenced == total, no block is free twice,
        a block is free iff its count is 0, and (when given) every count equals the number of
        references its holders claim."""
        free = list(self._free)
        free_set = set(free)
        if len(free) != len(free_set):
            raise AssertionError("a block is on the free list twice")
        referenced = {b for b, c in enumerate(self._ref_counts) if c > 0}
        if any(c < 0 for c in self._ref_counts):
            raise AssertionError("negative reference count")
        if free_set & referenced:
            raise AssertionError(f"blocks both free and referenced: {sorted(free_set & referenced)[:8]}")
        if len(free_set) + len(referenced) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free_set)}) + referenced ({len(referenced)}) != total ({self.num_blocks})")
        if expected_refs is not None:
            actual = {BlockId(b): c for b, c in enumerate(self._ref_counts) if c > 0}
            if actual != {b: c for b, c in expected_refs.items() if c > 0}:
                diff = sorted(b for b in set(actual) | set(expected_refs)
                              if actual.get(b, 0) != expected_refs.get(b, 0))
                raise AssertionError(
                    "reference counts disagree with their holders at blocks "
                    + ", ".join(f"{b}: counted {actual.get(b, 0)}, held {expected_refs.get(b, 0)}" for b in diff[:8]))
