"""Block allocator: exact ids, reference counts and the integrity check."""
import pytest

from prefix_service.engine.block_allocator import BlockAllocator, OutOfBlocks


def test_allocate_free_exact_ids_and_counts():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    assert (a.ref_count(0), a.ref_count(1), a.num_free) == (1, 1, 2)
    a.incref([1])
    assert a.ref_count(1) == 2
    a.free([0, 1])
    # block 0 is free again; block 1 still held once
    assert (a.ref_count(0), a.ref_count(1), a.num_free) == (0, 1, 3)
    assert a.allocate(2) == [2, 3]  # FIFO free list: freed blocks are reused last
    assert a.allocate(1) == [0]
    a.check_integrity({1: 1, 2: 1, 3: 1, 0: 1})


def test_free_in_reverse_order_reuses_tail_last():
    a = BlockAllocator(3)
    blocks = a.allocate(3)
    a.free(blocks)
    assert a.allocate(3) == [2, 1, 0]


def test_errors_and_integrity_violations():
    a = BlockAllocator(2)
    with pytest.raises(OutOfBlocks):
        a.allocate(3)
    (b,) = a.allocate(1)
    a.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        a.free([b])
    with pytest.raises(RuntimeError, match="incref of free block"):
        a.incref([b])
    a.check_integrity()
    a.allocate(1)
    with pytest.raises(AssertionError, match="disagree"):
        a.check_integrity({})  # a referenced block that no holder claims
    a._free.append(a._free[0])  # corrupt: a block listed twice
    with pytest.raises(AssertionError, match="twice"):
        a.check_integrity()


def test_allocate_contiguous_takes_the_lowest_free_run():
    a = BlockAllocator(10)
    held = a.allocate(10)
    a.free([held[i] for i in (1, 2, 4, 5, 6, 8)])  # free: 1 2 | 4 5 6 | 8
    assert a.allocate_contiguous(4) is None
    assert a.allocate_contiguous(3) == [4, 5, 6]
    assert a.allocate_contiguous(2) == [1, 2]
    assert a.num_free == 1 and a.ref_count(5) == 1
    a.check_integrity()


def test_peak_used_is_the_high_water_mark_since_reset():
    a = BlockAllocator(8)
    assert a.peak_used == 0
    first = a.allocate(3)
    a.free(first[:2])
    assert (a.num_used, a.peak_used) == (1, 3)  # freeing never lowers the mark
    a.incref(first[2:])  # sharing a block uses no new one
    assert a.peak_used == 3
    a.reset_peak()
    assert a.peak_used == 1  # starts again from the blocks in use now
    run = a.allocate_contiguous(4)
    assert run is not None and a.peak_used == 5
    a.free(run)
    a.allocate(2)
    assert (a.num_used, a.peak_used) == (3, 5)
    with pytest.raises(OutOfBlocks):
        a.allocate(6)
    assert a.peak_used == 5  # a refused allocation takes nothing


def test_allocate_contiguous_of_no_blocks_takes_none():
    a = BlockAllocator(6)
    assert a.allocate_contiguous(0) is None
    assert a.allocate_contiguous(-2) is None  # never a slice counted from the end of the free list
    assert (a.num_free, a.peak_used) == (6, 0)
    a.check_integrity()
