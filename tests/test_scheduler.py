"""Scheduler and block accounting on plain CPU data: exact block ids, reference counts, copies."""
import dataclasses
import threading

import pytest

from helpers import greedy, run_ids
from prefix_service import GenerateRequest
from prefix_service.engine.block_allocator import BlockAllocator
from prefix_service.config import SchedulerConfig
from prefix_service.engine.template_pins import TemplatePins
from prefix_service.errors import CacheExhausted, TemplateBudgetExceeded, TemplateExists
from prefix_service.sampling_params import SamplingParams
from prefix_service.engine.scheduler import Scheduler
from prefix_service.engine.sequence import FinishReason, Sequence, SeqStatus
from prefix_service.engine.step import ScheduledRow, StepBatch

B = 4


def setup(num_blocks=16, budget=2048, max_seqs=8):
    alloc = BlockAllocator(num_blocks)
    pins = TemplatePins(alloc, B, budget_blocks=8)
    return alloc, pins, Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                                  alloc, pins, B)


def seq(rid, ids, prefix=None, **kw):
    return Sequence(rid, ids, SamplingParams(max_tokens=4), 4, prefix, None, **kw)


def pin(alloc, pins, name, n_tokens):
    pins.reserve(name, n_tokens)
    blocks = alloc.allocate(-(-n_tokens // B))
    handle = pins.pin(name, list(range(n_tokens)), blocks, {})
    alloc.free(blocks)  # the warmup sequence lets go; the pin keeps one reference
    return handle


def test_prefix_attach_shares_full_blocks_and_copies_the_tail():
    alloc, pins, sched = setup()
    handle = pin(alloc, pins, "p", 10)  # blocks [0, 1, 2]: 2 full + a tail of 2 tokens
    assert handle.block_table == (0, 1, 2)
    s = seq("a", list(range(10)) + [7, 8, 9], handle)
    pins.acquire(handle)
    sched.add(s)
    out = sched.schedule()
    # [ 0 1 | shared, pinned ]  [ 3: own copy of block 2, tokens 8..11 ] [ 4: token 12 ]
    assert s.block_table == [0, 1, 3, 4] and s.num_shared_blocks == 2
    assert out.copies == [(2, 3)]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3)]
    assert s.num_computed_tokens == 10 and s.cached_tokens == 10
    assert [alloc.ref_count(b) for b in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 1]
    sched.finish(s, FinishReason.STOP)
    assert [alloc.ref_count(b) for b in (0, 1, 2, 3, 4)] == [1, 1, 1, 0, 0]
    assert handle.active_requests == 0 and handle.requests_served == 1


def test_block_aligned_prefix_needs_no_copy():
    alloc, pins, sched = setup()
    handle = pin(alloc, pins, "p", 8)
    s = seq("a", list(range(8)) + [1], handle)
    pins.acquire(handle)
    sched.add(s)
    out = sched.schedule()
    assert out.copies == [] and s.block_table == [0, 1, 2] and s.num_shared_blocks == 2


def test_decodes_first_then_chunked_prefill_then_fcfs():
    alloc, pins, sched = setup(num_blocks=64, budget=6)
    a, b, c = seq("a", [1] * 5), seq("b", [2] * 9), seq("c", [3] * 2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()  # a: 5 tokens, b: first 1 token of 9
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 5), ("b", 1)]
    sched.postprocess(out, [a], [42])  # a sampled its first token: now a decode
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]


def test_step_is_plain_data_per_row():
    """The step a backend gets: frozen rows in the scheduler's order (decodes first, each flagged),
    their new tokens, cached context, block ids as they stand after allocation, the template shared
    and its block count, and which rows are sampled; later scheduling does not change a step."""
    alloc, pins, sched = setup(num_blocks=64, budget=6)
    handle = pin(alloc, pins, "p", 10)  # blocks [0, 1, 2]
    a = seq("a", [1] * 5)
    b = seq("b", list(range(10)) + [7, 8, 9], handle)
    pins.acquire(handle)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: its 5 tokens; b: 1 of its 3 own tokens (budget 6)
    assert out.step.rows == (
        ScheduledRow("a", False, (1,) * 5, 0, (3, 4), None, 0, num_logits=1),
        ScheduledRow("b", False, (7,), 10, (0, 1, 5), handle.template_id, 2, num_logits=0))
    assert out.step.copies == ((2, 5),) and out.step.num_decodes == 0 and out.step.num_logits == 1
    assert [s.seq for s in out.with_logits] == [a]
    first = out.step
    sched.postprocess(out, [a], [42])
    out = sched.schedule()
    assert [(r.request_id, r.is_decode, r.token_ids, r.num_computed, r.context_len) for r in out.step.rows] == [
        ("a", True, (42,), 5, 6), ("b", False, (8, 9), 11, 13)]
    assert out.step.decodes == out.step.rows[:1] and out.step.prefills == out.step.rows[1:]
    assert out.step.num_logits == 2 and [s.seq for s in out.with_logits] == [a, b]
    assert first.rows[1].block_ids == (0, 1, 5) and first.rows[1].num_computed == 10  # a step is a snapshot
    assert out.step.rows[1].slots(B) == [5 * B + 3, 6 * B]  # positions 11, 12 in blocks 5 and 6
    for s in (a, b):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_a_forced_run_is_a_decode_row_per_token_within_the_budget():
    """A running sequence's tokens after its prompt that are not computed yet (a structured output's
    forced run, appended without a step each) run as decode rows at consecutive positions, each with
    the blocks up to its own token and only the last with logits, before the prefills; within the
    budget (the rest next step); a run over MAX_DECODE_RUN, and a prompt's chunk, as prefill rows."""
    from prefix_service.engine.scheduler import MAX_DECODE_RUN
    alloc, pins, sched = setup(num_blocks=64, budget=8)
    a, b = seq("a", [1] * 6), seq("b", [2] * 2)
    sched.add(a)
    sched.postprocess(sched.schedule(), [a], [40])  # a's prompt in, its first token sampled
    for token in (41, 42, 43, 44):
        sched.append_token(a, token)
    sched.add(b)
    out = sched.schedule()
    assert [(r.request_id, r.is_decode, r.token_ids, r.num_computed, r.block_ids, r.num_logits)
            for r in out.step.rows] == [
        ("a", True, (40,), 6, (0, 1), 0), ("a", True, (41,), 7, (0, 1), 0), ("a", True, (42,), 8, (0, 1, 2), 0),
        ("a", True, (43,), 9, (0, 1, 2), 0), ("a", True, (44,), 10, (0, 1, 2), 1),
        ("b", False, (2, 2), 0, (3,), 1)]
    assert out.step.num_decodes == 5 and [s.seq for s in out.with_logits] == [a, b]
    sched.postprocess(out, [a, b], [45, 50])
    assert a.num_computed_tokens == 11 and a.num_uncomputed == 1
    for token in range(60, 68):  # a run of 9 after a's sampled token 45: over the budget of 8
        sched.append_token(a, token)
    out = sched.schedule()
    assert [(r.request_id, r.num_computed, r.num_logits) for r in out.step.rows] == [
        ("a", p, 0) for p in range(11, 19)]  # b's decode waits: the budget went to a, the oldest
    sched.postprocess(out, [], [])
    out = sched.schedule()
    assert [(r.request_id, r.is_decode, r.num_computed, r.num_logits) for r in out.step.rows] == [
        ("a", True, 19, 1), ("b", True, 2, 1)]
    sched.postprocess(out, [a, b], [70, 71])
    for token in range(MAX_DECODE_RUN):  # a run of MAX_DECODE_RUN + 1: one prefill chunk
        sched.append_token(a, 100 + token)
    out = sched.schedule()
    assert [(r.request_id, r.is_decode, r.num_new_tokens) for r in out.step.rows] == [
        ("b", True, 1), ("a", False, 7)]
    for s in (a, b):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_step_tensors_pad_block_tables_once():
    """StepTensors flattens a step for every backend: ids, positions and slots per token (decode
    rows first), one -1 padded block table per row, context lengths, and the tokens whose logits
    are returned (each row's last num_logits)."""
    from prefix_service.backends.base import StepTensors
    step = StepBatch((ScheduledRow("d", True, (9,), 6, (4, 2), 1, 1, num_logits=1),
                      ScheduledRow("p", False, (5, 6, 7), 2, (8, 9, 3), None, 0, num_logits=2),
                      ScheduledRow("w", False, (1, 1), 0, (7,), None, 0, num_logits=0)))
    host = StepTensors.build(step, B)
    assert host.token_ids.tolist() == [9, 5, 6, 7, 1, 1]
    assert host.positions.tolist() == [6, 2, 3, 4, 0, 1]
    assert host.slots.tolist() == [2 * B + 2, 8 * B + 2, 8 * B + 3, 9 * B, 7 * B, 7 * B + 1]
    assert host.block_tables.tolist() == [[4, 2, -1], [8, 9, 3], [7, -1, -1]]
    assert host.context_lens.tolist() == [7, 5, 2]
    assert host.logit_rows.tolist() == [0, 2, 3]  # d's token, p's last two
    with pytest.raises(ValueError, match="decode rows first"):
        StepBatch((step.rows[1], step.rows[0]))


def test_preemption_takes_the_newest_and_spares_pinned_blocks():
    alloc, pins, sched = setup(num_blocks=6)
    handle = pin(alloc, pins, "p", 4)  # block 0, pinned
    old, new = seq("old", [1] * 4), seq("new", list(range(4)) + [5, 6, 7, 8], handle)
    pins.acquire(handle)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    sched.postprocess(out, [x.seq for x in out.scheduled], [9] * len(out.scheduled))
    # old: [1] (4 tokens + 1 sampled), new: [0 | 2] ... fill the cache so old's next block is missing
    hog = alloc.allocate(alloc.num_free)
    out = sched.schedule()
    assert out.preempted == [new] and new.status is SeqStatus.WAITING and new.block_table == []
    assert alloc.ref_count(0) == 1  # the pin survives
    assert [x.seq.request_id for x in out.scheduled] == ["old"]
    alloc.free(hog)
    for s in (old, new):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_max_num_seqs_bounds_running_requests(make_engine):
    engine = make_engine(max_num_seqs=2)
    peak = []

    def watch(core):
        peak.append(len(core.scheduler.running))

    reqs = [GenerateRequest(prompt_token_ids=[5 + k, 6, 7], sampling=greedy(8)) for k in range(5)]
    done = threading.Event()

    def poll():
        while not done.is_set():
            engine._run(watch)

    t = threading.Thread(target=poll)
    t.start()
    outs = engine.generate(reqs)
    done.set()
    t.join()
    assert max(peak) == 2
    assert [o.token_ids for o in outs] == [run_ids(engine, r.prompt_token_ids, max_tokens=8) for r in reqs]


def test_abort_a_waiting_request(make_engine):
    engine = make_engine(max_num_seqs=1)
    got = {}
    long = engine.submit(GenerateRequest(prompt_token_ids=[5, 6], sampling=greedy(200)), lambda o: None)
    waiting = engine.submit(GenerateRequest(prompt_token_ids=[7, 8], sampling=greedy(5)),
                            lambda o: got.setdefault("last", o))
    assert engine.kv_stats()["waiting"] == 1
    assert engine.abort(waiting) is True
    assert got["last"].finished and got["last"].finish_reason == FinishReason.ABORT
    assert got["last"].completion_tokens == 0
    assert engine.abort(long) and engine.abort("no-such-request") is False


def test_cache_size_follows_the_memory_budget(llama_dir):
    import torch
    from prefix_service.config import CacheConfig
    from prefix_service.backends.kv_cache import KVCache, block_bytes
    from prefix_service.model.loader import read_arch
    arch = read_arch(llama_dir)
    per_block = block_bytes(arch, 4, torch.float32)
    assert per_block == 2 * arch.num_layers * 4 * arch.num_kv_heads * arch.head_dim * 4
    cache = KVCache(arch, CacheConfig(block_size=4, kv_cache_memory=per_block * 37 + 5), torch.float32, torch.device("cpu"))
    assert cache.num_blocks == 37 and tuple(cache.k[0].shape) == (37, 4, arch.num_kv_heads, arch.head_dim)
    from prefix_service.errors import ConfigError
    with pytest.raises(ConfigError, match="holds 1 blocks"):
        KVCache(arch, CacheConfig(block_size=4, kv_cache_memory=per_block), torch.float32, torch.device("cpu"))


def test_missing_weight_is_named(llama_dir, tmp_path):
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    from prefix_service.errors import ModelLoadError
    from prefix_service.model.loader import load_model
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (f,) = broken.glob("*.safetensors")
    state = load_file(str(f))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(f))
    with pytest.raises(ModelLoadError, match=r"layers.1.mlp.gate_up_proj.weight is missing parts \['up_proj'\]"):
        load_model(broken, torch.float32, torch.device("cpu"), 64)


def test_a_preempted_sequence_goes_back_to_the_front_of_the_queue():
    """First come, first served survives a preemption: the preempted request runs again before
    one that arrived after it."""
    alloc, pins, sched = setup(num_blocks=6)
    handle = pin(alloc, pins, "p", 4)
    old, new = seq("old", [1] * 4), seq("new", list(range(4)) + [5, 6, 7, 8], handle)
    pins.acquire(handle)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    sched.postprocess(out, [x.seq for x in out.scheduled], [9] * len(out.scheduled))
    late = seq("late", [3] * 4)
    sched.add(late)
    hog = alloc.allocate(alloc.num_free)
    out = sched.schedule()
    assert out.preempted == [new]
    assert list(sched.waiting) == [new, late]
    alloc.free(hog)
    for s in (old, new, late):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_a_chunk_fills_the_room_left_in_its_own_last_block_when_no_block_is_free():
    """A prefill chunk that fits in the free slots of the blocks its sequence holds runs with no new
    block: nothing is preempted for it and it is not unschedulable."""
    alloc, pins, sched = setup(num_blocks=8, budget=2)
    a = seq("a", [1] * 6)
    sched.add(a)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 2)]
    sched.postprocess(out, [], [])
    hog = alloc.allocate(alloc.num_free)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 2)]
    assert out.preempted == [] and out.unschedulable == []
    alloc.free(hog)
    sched.finish(a, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def forked(max_seqs):
    """A running request r and a computed parent of 6 tokens whose samples will wait (max_num_seqs)."""
    alloc, pins, sched = setup(num_blocks=16, max_seqs=2)
    r, parent = seq("r", [1] * 4), seq("p", [2] * 6, fork_point=True)
    sched.add(r)
    sched.add(parent)
    out = sched.schedule()
    sched.postprocess(out, [r], [9])
    sched.config = dataclasses.replace(sched.config, max_num_seqs=max_seqs)
    return alloc, pins, sched, r, parent


def test_forked_samples_wait_at_the_front_of_the_queue():
    """A request's samples, forked holding their blocks, run before a request that came after it."""
    alloc, pins, sched, r, parent = forked(max_seqs=2)
    late = seq("late", [3] * 4)
    sched.add(late)
    kids = [seq(f"c{i}", list(parent.token_ids)) for i in range(2)]
    sched.fork(parent, kids)
    sched.finish(parent, FinishReason.STOP)
    assert list(sched.waiting) == kids + [late]
    for s in (r, late, *kids):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_the_newest_waiting_hold_is_released_first_and_counted_as_a_preemption():
    """No free block for a running decode: the newest waiting sample gives up its blocks (the one
    next in line keeps them), and the stats count it as a preemption."""
    alloc, pins, sched, r, parent = forked(max_seqs=1)
    kids = [seq(f"c{i}", list(parent.token_ids)) for i in range(2)]
    sched.fork(parent, kids)
    sched.finish(parent, FinishReason.STOP)
    assert all(k.block_table for k in kids)
    hog = alloc.allocate(alloc.num_free)
    out = sched.schedule()
    assert out.preempted == [kids[1]] and kids[1].block_table == [] and kids[0].block_table != []
    assert [x.seq for x in out.scheduled] == [r]
    assert sched.num_preemptions == 1 and kids[1].num_preemptions == 1
    alloc.free(hog)
    for s in (r, *kids):
        sched.finish(s, FinishReason.ABORT)
    alloc.check_integrity(pins.held_refs())


def test_a_pin_whose_backend_hook_fails_leaves_no_reference_behind():
    """The backend's on_pin failing (out of memory for a packed copy) raises, registers nothing,
    leaves the blocks as the warmup held them, and tells the backend to drop whatever of the
    template it made before it failed (on_unpin)."""
    class Failing:
        def __init__(self):
            self.unpinned = []

        def on_pin(self, handle):
            raise MemoryError("no room for a packed copy")

        def on_unpin(self, handle):
            self.unpinned.append(handle.name)

    alloc = BlockAllocator(8)
    hooks = Failing()
    pins = TemplatePins(alloc, B, 8, hooks=hooks)
    pins.reserve("t", 8)
    blocks = alloc.allocate(2)
    with pytest.raises(MemoryError):
        pins.pin("t", list(range(8)), blocks, {})
    assert [alloc.ref_count(b) for b in blocks] == [1, 1] and "t" not in pins
    assert hooks.unpinned == ["t"]
    alloc.free(blocks)
    assert alloc.num_free == 8
    alloc.check_integrity(pins.held_refs())


def test_warmups_still_running_count_against_the_prefix_budget():
    alloc = BlockAllocator(32)
    pins = TemplatePins(alloc, B, 8)
    pins.reserve("a", 20)  # 5 blocks, its warmup still running
    with pytest.raises(TemplateBudgetExceeded):
        pins.reserve("b", 16)  # 4 more: 9 > 8
    pins.reserve("c", 12)  # 3 more: exactly 8


def test_a_name_is_taken_from_its_reserve_until_its_warmup_is_cancelled():
    """A template whose warmup still runs holds its name: a second reserve (or check) of it is
    refused; cancel (the warmup failed) gives back the name and the budget; a pin needs a reserve."""
    alloc = BlockAllocator(32)
    pins = TemplatePins(alloc, B, 8)
    pins.reserve("a", 16)
    with pytest.raises(TemplateExists):
        pins.reserve("a", 4)
    with pytest.raises(TemplateExists):
        pins.check("a", 4)
    pins.cancel("a")
    one = alloc.allocate(1)
    with pytest.raises(RuntimeError, match="without reserve"):
        pins.pin("a", list(range(4)), one, {})
    assert alloc.ref_count(one[0]) == 1  # no reference taken
    alloc.free(one)
    pins.reserve("a", 32)  # the whole budget: the cancelled reserve holds none of it
    blocks = alloc.allocate(8)
    pins.pin("a", list(range(32)), blocks, {})
    alloc.free(blocks)
    assert [h.name for h in pins.pinned_handles()] == ["a"] and pins.num_pinned_blocks == 8
    alloc.check_integrity(pins.held_refs())


def test_a_template_removed_under_its_one_request_is_freed_when_that_request_ends():
    """remove() with one request still on the template defers the free (its blocks stay pinned
    and counted); the request's release frees them and tells the backend (on_unpin) once."""
    class Hooks:
        def __init__(self):
            self.unpinned = []

        def on_pin(self, handle):
            pass

        def on_unpin(self, handle):
            self.unpinned.append(handle.name)

    alloc = BlockAllocator(16)
    hooks = Hooks()
    pins = TemplatePins(alloc, B, 8, hooks=hooks)
    handle = pin(alloc, pins, "t", 10)
    pins.acquire(handle)
    assert pins.remove("t") is False and "t" not in pins and pins.list() == []
    assert pins.num_pinned_blocks == 3 and hooks.unpinned == []
    alloc.check_integrity(pins.held_refs())
    pins.release(handle)
    assert pins.num_pinned_blocks == 0 and hooks.unpinned == ["t"] and alloc.num_free == 16
    alloc.check_integrity(pins.held_refs())


def test_templates_are_listed_in_the_order_they_were_pinned():
    """list(): oldest first; a name removed and added again comes last."""
    alloc = BlockAllocator(16)
    pins = TemplatePins(alloc, B, 8)
    for name in ("a", "b", "c"):
        pin(alloc, pins, name, 4)
    assert pins.remove("b") is True
    pin(alloc, pins, "b", 4)
    assert [t.name for t in pins.list()] == ["a", "c", "b"]
    alloc.check_integrity(pins.held_refs())


def test_template_groups_are_the_rows_sharing_a_template_and_its_block_count():
    """The cascade's groups: two or more rows on one template that share as many of its blocks."""
    def row(rid, template_id, blocks):
        return ScheduledRow(rid, True, (1,), 9, tuple(range(3)), template_id, blocks, num_logits=1)

    step = StepBatch((row("a", 1, 2), row("b", 1, 2), row("c", 2, 2), row("d", 1, 1), row("e", None, 0)))
    assert step.template_groups() == [[0, 1]]
    step = StepBatch((row("a", 1, 2), row("d", 1, 1), row("b", 1, 2)))
    assert step.template_groups() == [[0, 2]]


def test_a_prompt_that_fills_the_cache_exactly_is_refused(make_engine):
    """A request needs room for its prompt and its first token: 32 tokens in a cache of 32 is
    refused up front (RESOURCE_EXHAUSTED at the API), 31 runs."""
    engine = make_engine(block_size=4, num_blocks=8)
    with pytest.raises(CacheExhausted):
        engine.generate([GenerateRequest(prompt_token_ids=list(range(3, 35)), sampling=greedy(4))])
    out = engine.generate([GenerateRequest(prompt_token_ids=list(range(3, 34)), sampling=greedy(4))])[0]
    assert out.completion_tokens >= 1


def test_a_request_larger_than_the_cache_beside_the_pinned_templates_is_refused(make_engine):
    """The pinned templates' blocks are not the requests': 16 blocks of 4 with 6 pinned leave 40
    tokens, so a 50-token prompt is refused at once (it waited forever for blocks the pins keep)."""
    engine = make_engine(block_size=4, num_blocks=16)
    engine.add_template("t", token_ids=list(range(3, 27)))  # 24 tokens: 6 blocks
    with pytest.raises(CacheExhausted, match="beside the pinned templates"):
        engine.submit(GenerateRequest(prompt_token_ids=list(range(100, 150)), sampling=greedy(4)), lambda out: None)
    out = engine.generate([GenerateRequest(prompt_token_ids=list(range(100, 135)), sampling=greedy(4))])[0]
    assert out.completion_tokens == 4


def test_a_failed_steps_sequences_each_run_a_step_alone_oldest_first():
    """quarantine: the failed step's sequences go back to the queue with their blocks freed, then
    each runs one step alone, oldest first (the others wait, a sampled token included); the one that
    fails alone is handed back to be ended; then the usual steps."""
    alloc, pins, sched = setup()
    a, b, c = seq("a", list(range(8))), seq("b", [1, 2, 3]), seq("c", [4, 5, 6, 7, 8])
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [x.seq.request_id for x in out.scheduled] == ["a", "b", "c"]
    assert sched.quarantine(out) == [] and sched.num_failed_steps == 1
    assert alloc.num_free == 16 and list(sched.waiting) == [a, b, c] and sched.running == []
    assert all(s.status is SeqStatus.WAITING and s.num_computed_tokens == 0 for s in (a, b, c))
    assert sched.num_preemptions == 0  # not preempted for blocks

    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 8)]
    sched.postprocess(out, [a], [9])
    out = sched.schedule()  # a has a token to compute, but b's step is alone
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 3)]
    assert sched.quarantine(out) == [b] and sched.num_failed_steps == 2
    sched.finish(b, FinishReason.ABORT)
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("c", 5)]
    sched.postprocess(out, [c], [9])
    out = sched.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("c", 1)]


def test_a_sequence_in_its_third_failed_step_is_handed_back_whether_or_not_it_failed_alone():
    from prefix_service.engine.scheduler import MAX_FAILED_STEPS
    alloc, pins, sched = setup()
    a, b = seq("a", [1, 2, 3]), seq("b", [4, 5])
    sched.add(a)
    sched.add(b)
    for k in range(1, MAX_FAILED_STEPS + 1):
        out = sched.schedule()
        while len(out.scheduled) == 1:  # each alone: ok
            sched.postprocess(out, [out.scheduled[0].seq], [9])
            out = sched.schedule()
        assert [x.seq.request_id for x in out.scheduled] == ["a", "b"]
        guilty = sched.quarantine(out)
        assert guilty == ([] if k < MAX_FAILED_STEPS else [a, b]), k
    assert a.num_failed_steps == b.num_failed_steps == MAX_FAILED_STEPS


def test_a_suspect_that_does_not_fit_alone_rejoins_the_queue_as_any_sequence():
    """After the failed step a waiting fork took every free block: the suspect's step alone cannot
    start (the fork's hold is not its to free), so it takes its turn in the usual step, which frees the
    hold first."""
    alloc, pins, sched = setup(num_blocks=4)
    a = seq("a", list(range(8)))
    sched.add(a)
    out = sched.schedule()
    assert sched.quarantine(out) == [] and alloc.num_free == 4
    fork = seq("fork", [1, 2, 3])
    fork.block_table = alloc.allocate(4)  # a forked sample waiting its turn with its blocks
    sched.waiting.append(fork)
    out = sched.schedule()
    assert out.preempted == [fork]  # its hold freed (it computes its prompt again)
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 8), ("fork", 3)]
