"""Pinned prefixes: counted once however many requests share them, byte-identical through a
preemption storm, and removed only when the last request using them ends."""
import threading

import pytest
import torch

from helpers import greedy, pinned_handle, run_ids
from prefix_service import GenerateRequest, TemplateBudgetExceeded, TemplateNotFound

BLOCK = 4


def ids_of(n, salt=0):
    return [(17 * i + 11 * salt + 2) % 500 + 3 for i in range(n)]


def _pinned_bytes(engine, name):
    def snap(core):
        blocks = torch.tensor(core.templates.get(name).block_table)
        return [t[blocks].clone() for t in core.backend.kv_cache.k + core.backend.kv_cache.v]
    return engine._run(snap)


class Gate:
    """A sink that lets each request produce `n` outputs, then records the engine state once."""

    def __init__(self, n_requests):
        self.outputs = {}
        self.lock = threading.Lock()
        self.all_started = threading.Event()
        self.n = n_requests

    def sink_for(self, rid):
        def sink(out):
            with self.lock:
                self.outputs.setdefault(rid, []).append(out)
                if len(self.outputs) == self.n:
                    self.all_started.set()
        return sink


@pytest.mark.parametrize("prefix_len", [12, 14])  # 3 full blocks; 3 full blocks + a partial tail
def test_prefix_blocks_counted_once(prefix_len, make_engine):
    engine = make_engine(block_size=BLOCK, num_blocks=128)
    engine.add_template("p", token_ids=ids_of(prefix_len))
    handle = pinned_handle(engine, "p")
    n = 6
    gate = Gate(n)
    rids = [engine.submit(GenerateRequest(prompt_token_ids=ids_of(3 + k, k + 1), prefix_name="p",
                                          sampling=greedy(40)), gate.sink_for(k)) for k in range(n)]
    assert gate.all_started.wait(30)

    def snapshot(core):
        running = core.scheduler.running
        return core.allocator.num_used, sum(len(s.own_blocks) for s in running), [list(s.block_table) for s in running]

    used, own, tables = engine._run(snapshot)  # taken between two steps: a consistent state
    full = prefix_len // BLOCK
    assert len(tables) == n
    assert used == handle.num_blocks + own  # the prefix counted once
    for table in tables:
        assert table[:full] == list(handle.block_table[:full])  # shared, zero copy
        assert not set(table[full:]) & set(handle.block_table)  # never the pinned tail itself
    assert all(engine.abort(rid) for rid in rids)
    assert engine.kv_stats()["used"] == handle.num_blocks
    assert all(gate.outputs[k][-1].finish_reason.value == "abort" for k in range(n))


def test_pinned_blocks_survive_preemption_storm(make_engine):
    engine = make_engine(block_size=BLOCK, num_blocks=36, prefix_budget_blocks=8, max_num_batched_tokens=64)
    prefix = ids_of(10)  # 2 full blocks + a partial tail that every request copies
    engine.add_template("p", token_ids=prefix)
    before = _pinned_bytes(engine, "p")
    reqs = [GenerateRequest(prompt_token_ids=ids_of(6 + k, k + 1), prefix_name="p", sampling=greedy(30))
            for k in range(10)]
    outs = engine.generate(reqs)
    assert engine.kv_stats()["preemptions"] > 0
    after = _pinned_bytes(engine, "p")
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # and the outputs are still right
    ref = make_engine(block_size=BLOCK)
    for req, out in zip(reqs, outs):
        assert out.token_ids == run_ids(ref, prefix + req.prompt_token_ids, max_tokens=30)


def test_remove_while_in_use_is_deferred(make_engine):
    engine = make_engine(block_size=BLOCK)
    prefix = ids_of(9)
    engine.add_template("p", token_ids=prefix)
    pinned = engine.kv_stats()["pinned"]
    gate = Gate(2)
    for k in range(2):
        engine.submit(GenerateRequest(prompt_token_ids=ids_of(5, k), prefix_name="p", sampling=greedy(30)),
                      gate.sink_for(k))
    assert gate.all_started.wait(30)
    assert engine.remove_template("p") is False  # deferred: two requests still use it
    assert engine.list_templates() == []
    with pytest.raises(TemplateNotFound):
        engine.generate([GenerateRequest(prompt_token_ids=[5], prefix_name="p", sampling=greedy(2))])
    stats = engine.kv_stats()
    assert stats["pinned"] == pinned and stats["used"] >= pinned
    # the running requests finish with their full, correct output
    for k in range(2):
        while not gate.outputs[k][-1].finished:
            threading.Event().wait(0.01)
    ref = make_engine(block_size=BLOCK)
    for k in range(2):
        got = [t for o in gate.outputs[k] for t in o.token_ids]
        assert got == run_ids(ref, prefix + ids_of(5, k), max_tokens=30)
    assert engine.kv_stats()["pinned"] == 0 and engine.kv_stats()["used"] == 0


def test_remove_unused_frees_at_once_and_name_can_be_reused(make_engine):
    engine = make_engine(block_size=BLOCK)
    engine.add_template("p", token_ids=ids_of(9))
    assert engine.remove_template("p") is True
    assert engine.kv_stats()["used"] == 0
    info = engine.add_template("p", token_ids=ids_of(5))
    assert info.num_tokens == 5


def test_a_budget_as_large_as_the_cache_leaves_requests_a_block(make_engine, caplog):
    """cache.prefix_budget_blocks at or past the cache's size: the start warns, and templates may pin all
    but one block, so a request can still run beside them (pinning every block would starve them all)."""
    with caplog.at_level("WARNING", logger="prefix_service.engine"):
        engine = make_engine(block_size=BLOCK, num_blocks=12, prefix_budget_blocks=50)
    assert "prefix_budget_blocks 50 is not below the KV cache's 12 blocks" in caplog.text
    with pytest.raises(TemplateBudgetExceeded, match="prefix_budget_blocks"):
        engine.add_template("all", token_ids=ids_of(12 * BLOCK - 1))  # 12 blocks, short of the context
    engine.add_template("most", token_ids=ids_of(11 * BLOCK))
    assert engine.kv_stats()["pinned"] == 11
    ref = make_engine(block_size=BLOCK)
    out = engine.generate([GenerateRequest(prompt_token_ids=[7, 8], prefix_name="most", sampling=greedy(2))])
    assert out[0].token_ids == run_ids(ref, ids_of(11 * BLOCK) + [7, 8], max_tokens=2)


def test_a_pinned_warmup_is_no_longer_tracked(make_engine):
    """A template's warmup ends with its pin: the engine tracks nothing of it (a shutdown would
    report its pin as failed)."""
    engine = make_engine()
    engine.add_template("t", token_ids=list(range(3, 14)))
    assert engine._run(lambda core: list(core._tracked)) == []
