"""A template's K/V from another engine instead of a prefill (what a fleet replica does through
Engine.peer_kv and export_template_kv, here without Ray): bit for bit the holder's blocks and the
same greedy outputs, on each CPU backend, with or without a snapshot folder; a local snapshot comes
first; bytes from another model shape or block size, damaged bytes and a failing fetch are one
warning naming the template, then a prefill; no holder is a quiet prefill."""
from __future__ import annotations

import logging

import pytest

from prefix_service.errors import TemplateNotFound
from test_template_snapshots import TEMPLATE, greedy, kv_source, template_kv


def peer_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "another replica" in r.getMessage()]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_template_from_a_peer_equals_the_holders(make_engine, backend):
    holder = make_engine(backend=backend)
    holder.add_template("doc", token_ids=TEMPLATE)
    want, kv = greedy(holder), template_kv(holder)
    asked: list[tuple[str, list[int]]] = []

    def from_holder(name: str, ids: list[int]) -> bytes:
        asked.append((name, ids))
        return holder.export_template_kv(name)

    joiner = make_engine(backend=backend)
    joiner.peer_kv = from_holder
    info = joiner.add_template("doc", token_ids=TEMPLATE)
    assert asked == [("doc", TEMPLATE)]
    assert info.kv_source == "peer" == kv_source(joiner)
    got = template_kv(joiner)
    assert got.keys() == kv.keys() and all(got[k].equal(kv[k]) for k in kv)  # bit for bit
    assert greedy(joiner) == want
    with pytest.raises(TemplateNotFound):
        holder.export_template_kv("nope")


def test_a_local_snapshot_comes_before_a_peer_and_a_peer_before_a_prefill(make_engine, tmp_path):
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend="torch")
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    asked: list[str] = []
    second = make_engine(snapshot_dir=folder, backend="torch")
    second.peer_kv = lambda name, ids: asked.append(name) or first.export_template_kv(name)
    assert second.add_template("doc", token_ids=TEMPLATE).kv_source == "snapshot" and asked == []
    assert second.add_template("other", token_ids=TEMPLATE[:7]).kv_source == "prefill" and asked == ["other"]
    # "other" is pinned on no holder: export raised TemplateNotFound, which is a failed fetch (warned)


def test_no_holder_is_a_quiet_prefill(make_engine, caplog):
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    engine = make_engine(backend="torch")
    engine.peer_kv = lambda name, ids: None
    assert engine.add_template("doc", token_ids=TEMPLATE).kv_source == "prefill"
    assert peer_warnings(caplog) == []


@pytest.mark.parametrize("fault, reason", [
    ("block size", "block_size"),
    ("tokens", "the template's tokens changed"),
    ("flipped bit", "checksum mismatch"),
    ("truncated", "unreadable"),
    ("fetch fails", "fetching it failed: TimeoutError"),
])
def test_bytes_that_must_not_be_used_are_one_warning_and_a_prefill(make_engine, caplog, fault, reason):
    holder = make_engine(backend="torch", block_size=8 if fault == "block size" else 4)
    holder.add_template("doc", token_ids=TEMPLATE[:-1] + [99] if fault == "tokens" else TEMPLATE)
    data = bytearray(holder.export_template_kv("doc"))
    if fault == "flipped bit":
        data[-3] ^= 0x10
    elif fault == "truncated":
        data = data[:len(data) // 2]

    def fetch(name: str, ids: list[int]) -> bytes:
        if fault == "fetch fails":
            raise TimeoutError("the holder did not answer")
        return bytes(data)

    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    plain = make_engine(backend="torch")
    plain.add_template("doc", token_ids=TEMPLATE)
    joiner = make_engine(backend="torch")
    joiner.peer_kv = fetch
    free = joiner.kv_stats()["free"]
    info = joiner.add_template("doc", token_ids=TEMPLATE)
    assert info.kv_source == "prefill"
    [warning] = peer_warnings(caplog)
    assert "'doc'" in warning and reason in warning and "prefilling" in warning, warning
    assert joiner.kv_stats()["free"] == free - info.num_blocks  # nothing else held
    assert greedy(joiner) == greedy(plain)


def test_a_template_that_would_be_refused_reads_no_snapshot_and_asks_no_peer(make_engine, tmp_path, monkeypatch):
    """The name taken, the budget exceeded or the context exceeded: the same error as without
    snapshots, before a snapshot file is opened or a holder is asked (a fetch can be a network copy)."""
    from prefix_service.engine import snapshots
    from prefix_service.errors import TemplateBudgetExceeded, TemplateExists, PromptTooLong
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend="torch")
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    engine = make_engine(snapshot_dir=folder, backend="torch", prefix_budget_blocks=6, max_model_len=64)
    engine.add_template("doc", token_ids=TEMPLATE)  # from its snapshot: 5 of the 6 budget blocks
    opened: list[str] = []
    open_snapshot = snapshots.SnapshotStore.open
    monkeypatch.setattr(snapshots.SnapshotStore, "open",
                        lambda self, name, ids: opened.append(name) or open_snapshot(self, name, ids))
    asked: list[str] = []
    engine.peer_kv = lambda name, ids: asked.append(name)
    with pytest.raises(TemplateExists):
        engine.add_template("doc", token_ids=TEMPLATE)
    with pytest.raises(TemplateBudgetExceeded):
        engine.add_template("big", token_ids=list(range(30, 50)))
    with pytest.raises(PromptTooLong):
        engine.add_template("long", token_ids=list(range(100, 170)))
    assert opened == [] and asked == []
    assert engine.add_template("small", token_ids=[5, 6, 7]).kv_source == "prefill"  # fits: looked for, then prefilled
    assert opened == ["small"] and asked == ["small"]
