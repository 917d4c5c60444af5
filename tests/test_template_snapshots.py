"""Template KV snapshots in the engine (cache.snapshot_dir): a template pinned after a prefill is
saved; the next engine pins it from the file instead of prefilling, with K/V bit for bit the
prefill's and the same greedy outputs, on each CPU backend; a snapshot of another block size, of
changed token ids or with a flipped byte is not used (one warning naming the template and the
reason, then a prefill); removing a template removes its snapshot; a folder that cannot be
written turns saving off and serving goes on."""
from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest

from prefix_service import GenerateRequest, SamplingParams
from prefix_service.engine import snapshots
from prefix_service.engine.snapshots import SnapshotKey, SnapshotStore
from prefix_service.engine.template_snapshots import TemplateSnapshots

TEMPLATE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]  # 4 full blocks of 4, and 2
PROMPTS = [[40, 41, 42], [50, 51, 52, 53, 54]]


def greedy(engine, prefix="doc"):
    reqs = [GenerateRequest(prompt_token_ids=p, prefix_name=prefix,
                            sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS]
    return [o.token_ids for o in engine.generate(reqs)]


def template_kv(engine, name="doc"):
    return engine._run(lambda core: core.backend.read_blocks(core.templates.get(name).block_table))


def kv_source(engine, name="doc"):
    return {i.name: i.kv_source for i in engine.list_templates()}[name]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_restored_template_equals_the_prefilled_one(make_engine, tmp_path, backend):
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend=backend)
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    assert kv_source(first) == "prefill" and len(list((tmp_path / "snapshots").glob("doc*"))) == 1
    want, kv = greedy(first), template_kv(first)

    second = make_engine(snapshot_dir=folder, backend=backend)
    info = second.add_template("doc", token_ids=TEMPLATE)
    assert info.kv_source == "snapshot" == kv_source(second)
    restored = template_kv(second)
    assert restored.keys() == kv.keys() and all(restored[k].equal(kv[k]) for k in kv)  # bit for bit
    table = list(second._run(lambda core: core.templates.get("doc").block_table))
    assert table == list(range(table[0], table[0] + len(table)))  # one run of blocks, as a prefill gets
    assert greedy(second) == want
    plain = make_engine(backend=backend)  # no snapshots: a prefill, the reference
    plain.add_template("doc", token_ids=TEMPLATE)
    assert greedy(plain) == want


def test_a_snapshot_that_does_not_match_is_not_used(make_engine, tmp_path, caplog):
    folder = tmp_path / "snapshots"
    first = make_engine(snapshot_dir=str(folder), backend="torch")
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    [snapshot] = folder.iterdir()
    good = snapshot.read_bytes()
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")

    other = make_engine(snapshot_dir=str(folder), backend="torch", block_size=8)  # another block size
    assert other.add_template("doc", token_ids=TEMPLATE).kv_source == "prefill"
    other.flush_snapshots()
    snapshot.write_bytes(good)  # the prefill above saved its own: put the first one back
    changed = make_engine(snapshot_dir=str(folder), backend="torch")  # the template's tokens changed
    assert changed.add_template("doc", token_ids=TEMPLATE[:-1] + [99]).kv_source == "prefill"
    changed.flush_snapshots()
    flipped = bytearray(good)
    flipped[-5] ^= 0x40
    snapshot.write_bytes(bytes(flipped))  # a bit flipped in the K/V
    corrupt = make_engine(snapshot_dir=str(folder), backend="torch")
    assert corrupt.add_template("doc", token_ids=TEMPLATE).kv_source == "prefill"
    warnings = [r.getMessage() for r in caplog.records if "snapshot" in r.getMessage()]
    assert len(warnings) == 3 and all("'doc'" in w and "prefilling" in w for w in warnings), warnings
    assert "block" in warnings[0] and "token" in warnings[1] and "checksum" in warnings[2]


def test_removing_a_template_removes_its_snapshot(make_engine, tmp_path):
    folder = tmp_path / "snapshots"
    engine = make_engine(snapshot_dir=str(folder), backend="torch")
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.add_template("other", token_ids=TEMPLATE[:6])
    engine.flush_snapshots()
    assert len(list(folder.iterdir())) == 2
    engine.remove_template("doc")
    engine.flush_snapshots()
    assert [p.name.split(".")[0] for p in folder.iterdir()] == ["other"]


def test_a_template_added_again_while_its_removal_waits_is_saved_again(make_engine, tmp_path):
    """Remove a template and add it again while the writer is busy (a large save before): the add
    waits for the removal, so it does not pin from the file about to go, and its new snapshot is
    written. (It pinned from the old file, which the removal then deleted: listed as from a
    snapshot, with none on disk.)"""
    folder = tmp_path / "snapshots"
    engine = make_engine(snapshot_dir=str(folder), backend="torch")
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.flush_snapshots()
    busy = threading.Event()
    engine._snapshots._writer.submit(busy.wait, 30)  # the writer busy, as with a large save
    engine.remove_template("doc")
    threading.Timer(0.5, busy.set).start()
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.flush_snapshots()
    assert kv_source(engine) == "prefill"
    assert [p.name.split(".")[0] for p in folder.iterdir()] == ["doc"]
    restarted = make_engine(snapshot_dir=str(folder), backend="torch")
    restarted.add_template("doc", token_ids=TEMPLATE)
    assert kv_source(restarted) == "snapshot"


def test_a_folder_that_cannot_be_written_turns_saving_off(make_engine, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    engine = make_engine(snapshot_dir=str(blocker / "snapshots"), backend="torch")
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.flush_snapshots()
    engine.add_template("other", token_ids=TEMPLATE[:6])
    engine.flush_snapshots()
    plain = make_engine(backend="torch")
    plain.add_template("doc", token_ids=TEMPLATE)
    assert greedy(engine) == greedy(plain)  # serving goes on, as without snapshots
    offs = [r.getMessage() for r in caplog.records if "snapshots are off" in r.getMessage()]
    assert len(offs) == 1  # one warning, then no more tries


def test_saves_queued_behind_a_failed_one_are_not_tried(tmp_path, caplog, monkeypatch):
    """Templates pinned together at a start queue their saves: the first that fails turns saving off
    for those already waiting too, so a full disk is one try and one warning, not one per template."""
    store = SnapshotStore(tmp_path / "snapshots", SnapshotKey("f" * 16, "float32", 4))
    tries: list[str] = []

    def disk_full(name, token_ids, kv):
        tries.append(name)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "save", disk_full)
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    saver = TemplateSnapshots(store)
    try:
        busy = threading.Event()
        saver._writer.submit(busy.wait, 30)  # the writer busy: the three saves wait behind it
        for name in ("a", "b", "c"):
            saver.save(name, [1, 2, 3], {})
        busy.set()
        saver.flush()
    finally:
        saver.close()
    assert tries == ["a"] and not saver.saving
    assert len([r for r in caplog.records if "snapshots are off" in r.getMessage()]) == 1


def test_a_snapshot_the_store_cannot_open_is_one_warning_and_none(tmp_path, caplog, monkeypatch):
    """An OSError from the store (a folder this process may not search) means the snapshot is not
    used: the template is prefilled, its pin does not fail."""
    store = SnapshotStore(tmp_path / "snapshots", SnapshotKey("f" * 16, "float32", 4))

    def denied(name, token_ids):
        raise PermissionError(errno.EACCES, "Permission denied", str(store.path(name)))

    monkeypatch.setattr(store, "open", denied)
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    saver = TemplateSnapshots(store)
    try:
        assert saver.open("doc", TEMPLATE) is None
    finally:
        saver.close()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "'doc'" in warning and "Permission denied" in warning and "prefilling" in warning, warning


def test_an_engine_start_removes_the_temp_folders_of_interrupted_saves(make_engine, tmp_path, caplog):
    folder = tmp_path / "snapshots"
    stale = folder / ".doc.kv.safetensors.tmp-dead"  # a save killed mid-write, long ago
    stale.mkdir(parents=True)
    (stale / "doc.kv.safetensors").write_bytes(b"partial")
    old = time.time() - snapshots.STALE_TEMP_AGE_S - 60
    for p in (stale / "doc.kv.safetensors", stale):
        os.utime(p, (old, old))
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    engine = make_engine(snapshot_dir=str(folder), backend="torch")
    assert not stale.exists()
    assert any("removed 1 temp file(s) of interrupted snapshot writes" in r.getMessage() for r in caplog.records)
    assert engine.add_template("doc", token_ids=TEMPLATE).kv_source == "prefill"


def test_a_restarted_server_pins_its_templates_from_snapshots(model_dir, tmp_path, monkeypatch):
    """The server's default folder is next to its state file; ListPrefixTemplates says where each
    template's K/V came from; snapshot_dir "" turns snapshots off."""
    import dataclasses

    from server_fixtures import DOCUMENT, TOKEN_ENV, Clients, ServerThread, collect, greedy_request, make_config

    from prefix_service.config import TemplateSpec
    from prefix_service.proto import prefix_service_pb2 as pb
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = make_config(model_dir, prefixes=(TemplateSpec("doc", content=DOCUMENT),), state_file=tmp_path / "state.json")

    def run(cfg) -> tuple[dict[str, str], list[int]]:
        st = ServerThread(cfg).start()
        try:
            c = Clients(st.address)
            c.admin.AddPrefixTemplate(pb.AddPrefixTemplateRequest(name="faq", content=DOCUMENT[:200]))
            sources = {t.name: t.kv_source for t in c.admin.ListPrefixTemplates(pb.ListPrefixTemplatesRequest()).templates}
            _, ids, _ = collect(c.generation.Generate(greedy_request(" the order", "doc", 10)))
            c.admin.RemovePrefixTemplate(pb.RemovePrefixTemplateRequest(name="faq"))
            st.engine.flush_snapshots()
            st.check_clean()
        finally:
            st.stop()
        return sources, ids

    first, want = run(config)
    assert first == {"doc": "prefill", "faq": "prefill"}
    assert sorted(p.name for p in (tmp_path / "state.snapshots").iterdir()) == ["doc.kv.safetensors"]  # faq removed
    again, ids = run(config)
    assert again == {"doc": "snapshot", "faq": "prefill"} and ids == want
    off = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, cache=dataclasses.replace(config.engine.cache, snapshot_dir="")))
    assert run(off)[0] == {"doc": "prefill", "faq": "prefill"}
