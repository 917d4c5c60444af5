"""Template KV snapshots (prefix_service/engine/snapshots.py): a saved snapshot loads back bit for
bit; every snapshot that must not be loaded (other weights, dtype, block size, layout, tokens or
format; damaged or foreign bytes) raises SnapshotMismatch naming why, never returns tensors; saves
are atomic and leave no temp file behind; the model fingerprint follows the weights it samples.
No model is needed: the fingerprint tests write a tiny checkpoint directory of their own."""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prefix_service.engine import snapshots
from prefix_service.engine.snapshots import (KV_LAYOUT, SnapshotKey, SnapshotMismatch, SnapshotStore,
                                             model_fingerprint, read_snapshot_file, snapshot_key)
from prefix_service.errors import ConfigError

BLOCK_SIZE = 4
TOKENS = list(range(100, 110))  # 10 tokens: 3 blocks, the last partial


def make_kv(dtype: torch.dtype = torch.float32, layers: int = 2, blocks: int = 3,
            seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # each: [blocks, block_size, num_kv_heads, head_dim]
    return {f"{kind}.{i}": torch.randn(blocks, BLOCK_SIZE, 2, 8, generator=g).to(dtype)
            for i in range(layers) for kind in "kv"}


def make_store(folder: Path, dtype: str = "float32", fingerprint: str = "f" * 16,
               block_size: int = BLOCK_SIZE, layout: str = KV_LAYOUT) -> SnapshotStore:
    return SnapshotStore(folder, SnapshotKey(fingerprint, dtype, block_size, layout))


def assert_same(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor]) -> None:
    assert got is not None
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert got[k].device.type == "cpu" and got[k].is_contiguous()
        # bit for bit: compare the raw bytes, not the values (NaN-safe, -0.0 vs 0.0)
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


def data_offset(path: Path) -> int:
    """Where a safetensors file's tensor bytes begin: after the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# --- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_for_bit(tmp_path, dtype):
    store = make_store(tmp_path / "snaps", dtype=str(dtype).removeprefix("torch."))
    kv = make_kv(dtype)
    kv["k.0"][0, 0, 0, 0] = float("nan")
    kv["v.1"][1, 1, 1, 1] = -0.0
    store.save("faq", TOKENS, kv)  # creates the folder
    assert store.path("faq") == tmp_path / "snaps" / "faq.kv.safetensors"
    assert_same(store.load("faq", TOKENS), kv)
    assert temp_files(tmp_path / "snaps") == []


def test_loaded_tensors_own_their_memory(tmp_path):
    """The file changed in place after a load (as a careless copy over it would) must not change
    the tensors handed out, nor crash the reader: they are not mapped from the file."""
    store = make_store(tmp_path)
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    got = store.load("faq", TOKENS)
    with open(store.path("faq"), "r+b") as f:
        f.seek(data_offset(store.path("faq")))
        f.write(b"\xff" * 64)
    assert_same(got, kv)


def host_cache(kv: dict[str, torch.Tensor], num_blocks: int = 10) -> dict[str, torch.Tensor]:
    """A host KV cache as Backend.host_cache gives it (per tensor key: [num_blocks, ...]), filled with a sentinel."""
    return {k: torch.full((num_blocks, *t.shape[1:]), 7.0, dtype=t.dtype) for k, t in kv.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", [[4, 5, 6], [9, 0, 5], [1, 2, 6]])  # a run of blocks, scattered ones, both
def test_read_into_fills_the_blocks_bit_for_bit(tmp_path, dtype, ids):
    store = make_store(tmp_path, dtype=str(dtype).removeprefix("torch."))
    kv = make_kv(dtype)
    store.save("faq", TOKENS, kv)
    caches = host_cache(kv)
    with store.open("faq", TOKENS) as reader:
        assert reader.num_blocks == 3 and reader.nbytes == sum(t.numel() * t.element_size() for t in kv.values())
        reader.check()
        reader.read_into(caches, ids)
    others = [b for b in range(10) if b not in ids]
    for k, t in kv.items():
        assert torch.equal(caches[k][ids].view(torch.uint8), t.view(torch.uint8)), k
        assert (caches[k][others] == 7.0).all(), f"{k}: a block that was not given was written"


def test_read_into_refuses_blocks_that_do_not_fit(tmp_path):
    store = make_store(tmp_path)
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    caches = host_cache(kv)
    with store.open("faq", TOKENS) as reader:
        with pytest.raises(ValueError, match="3 blocks in the snapshot, 2 given"):
            reader.read_into(caches, [1, 2])
        with pytest.raises(ValueError, match="3 blocks in the snapshot, 4 given"):  # not the first 3 of them
            reader.read_into(caches, [1, 2, 3, 4])
        with pytest.raises(ValueError, match="block ids outside the cache's 10 blocks"):
            reader.read_into(caches, [8, 9, 10])
        with pytest.raises(ValueError, match="the cache has no such tensor"):
            reader.read_into({k: c for k, c in caches.items() if k != "v.1"}, [1, 2, 3])
        with pytest.raises(ValueError, match="the cache's are \\(4, 2, 8\\) bfloat16"):
            reader.read_into(host_cache({k: t.to(torch.bfloat16) for k, t in kv.items()}), [1, 2, 3])
        with pytest.raises(ValueError, match="the cache's are \\(4, 1, 8\\) float32"):
            reader.read_into(host_cache({k: t[:, :, :1] for k, t in kv.items()}), [1, 2, 3])
        assert all((c == 7.0).all() for c in caches.values())  # the refusals wrote nothing
        reader.read_into(caches, [1, 2, 3])  # and read nothing: the reader still works
    assert all(torch.equal(caches[k][1:4], t) for k, t in kv.items())


def test_read_into_checks_the_bytes_it_reads(tmp_path):
    """A file damaged after check() (another writer copying over it in place) fails read_into's own checksum."""
    store = make_store(tmp_path)
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    with store.open("faq", TOKENS) as reader:
        reader.check()
        with open(store.path("faq"), "r+b") as f:
            f.seek(data_offset(store.path("faq")) + 5)
            f.write(b"\x01")
        with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
            reader.read_into(host_cache(kv), [0, 1, 2])
        with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
            reader.check()


def test_reads_survive_short_reads(tmp_path, monkeypatch):
    """preadv may return fewer bytes than asked (a signal, a network filesystem): the reader goes on
    where it stopped, inside a buffer or between two."""
    store = make_store(tmp_path)
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    preadv = os.preadv

    def short_preadv(fd, buffers, offset):  # at most 100 bytes a call
        first = memoryview(buffers[0])[:100]
        return preadv(fd, [first], offset)

    monkeypatch.setattr(snapshots.os, "preadv", short_preadv)
    assert_same(store.load("faq", TOKENS), kv)
    caches = host_cache(kv)
    with store.open("faq", TOKENS) as reader:
        reader.check()
        reader.read_into(caches, [3, 1, 8])
    for k, t in kv.items():
        assert torch.equal(caches[k][[3, 1, 8]], t), k


def test_a_read_error_is_an_unreadable_snapshot(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())

    def failing_preadv(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(snapshots.os, "preadv", failing_preadv)
    with pytest.raises(SnapshotMismatch, match="unreadable: .*Input/output error"):
        store.load("faq", TOKENS)


def test_missing_snapshot_is_none(tmp_path):
    assert make_store(tmp_path / "absent").load("faq", TOKENS) is None
    store = make_store(tmp_path)
    store.save("other", TOKENS, make_kv())
    assert store.load("faq", TOKENS) is None


def test_save_replaces_the_previous_snapshot(tmp_path):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv(seed=0))
    new = make_kv(seed=1)
    store.save("faq", TOKENS + [7], new)
    assert_same(store.load("faq", TOKENS + [7]), new)


def test_metadata_is_readable_strings(tmp_path):
    """The header is what an operator inspects (safetensors' own tools print it)."""
    from safetensors import safe_open
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    with safe_open(str(store.path("faq")), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "2" and meta["name"] == "faq" and meta["num_tokens"] == "10"
    assert meta["dtype"] == "float32" and meta["block_size"] == "4" and meta["layout"] == KV_LAYOUT
    assert len(meta["tokens_sha256"]) == 64 and len(meta["data_xxh3"]) == 32


# --- mismatches --------------------------------------------------------------------------------


@pytest.mark.parametrize("change, reason", [
    ({"fingerprint": "0" * 16}, "made by other weights"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"block_size": 8}, "block_size"),
    ({"layout": "paged-v2"}, "layout"),
])
def test_key_mismatch_is_refused(tmp_path, change, reason):
    make_store(tmp_path).save("faq", TOKENS, make_kv())
    with pytest.raises(SnapshotMismatch, match=reason):
        make_store(tmp_path, **change).load("faq", TOKENS)


@pytest.mark.parametrize("tokens", [TOKENS[:-1], TOKENS + [1], TOKENS[:-1] + [999], [], list(reversed(TOKENS))])
def test_changed_tokens_are_refused(tmp_path, tokens):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    with pytest.raises(SnapshotMismatch, match="the template's tokens changed"):
        store.load("faq", tokens)


def test_other_format_version_is_refused(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    monkeypatch.setattr(snapshots, "FORMAT_VERSION", 3)
    store.save("faq", TOKENS, make_kv())
    monkeypatch.undo()
    with pytest.raises(SnapshotMismatch, match="format version '3', expected '2'"):
        store.load("faq", TOKENS)


def test_safetensors_file_without_our_metadata_is_refused(tmp_path):
    store = make_store(tmp_path)
    save_file(make_kv(), store.path("faq"))
    with pytest.raises(SnapshotMismatch, match="format version None"):
        store.load("faq", TOKENS)


def test_checks_run_in_order(tmp_path):
    """With several things wrong, the first in the documented order is the reason given."""
    make_store(tmp_path).save("faq", TOKENS, make_kv())
    with pytest.raises(SnapshotMismatch, match="made by other weights"):
        make_store(tmp_path, fingerprint="0" * 16, dtype="bfloat16", block_size=8).load("faq", [1])
    with pytest.raises(SnapshotMismatch, match="dtype"):
        make_store(tmp_path, dtype="bfloat16", block_size=8).load("faq", [1])


def test_tensors_that_are_not_contiguous_are_saved_as_the_values_they_show(tmp_path):
    """K/V handed over as views (a transposed copy, a slice of a larger cache) are saved, and sent to
    another replica, bit for bit as the values they show."""
    store = make_store(tmp_path)
    kv = {k: t.transpose(2, 3).contiguous().transpose(2, 3) for k, t in make_kv().items()}
    assert not any(t.is_contiguous() for t in kv.values())
    want = {k: t.contiguous() for k, t in kv.items()}
    store.save("faq", TOKENS, kv)
    assert_same(store.load("faq", TOKENS), want)
    with store.decode(store.encode("faq", TOKENS, kv), TOKENS) as reader:
        assert_same(reader.read(), want)


@pytest.mark.parametrize("fields", [("", "float32", 4), ("f" * 16, "", 4), ("f" * 16, "float32", 4, ""),
                                    ("f" * 16, "float32", 0)])
def test_a_snapshot_key_needs_a_fingerprint_a_dtype_a_layout_and_a_block_size(fields):
    with pytest.raises(ValueError, match="SnapshotKey"):
        SnapshotKey(*fields)


# --- damaged or foreign files ---------------------------------------------------------------


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    start = data_offset(path)
    if how == "zero-length":
        data = bytearray()
    elif how == "truncated-half":
        data = data[:len(data) // 2]
    elif how == "truncated-1":
        data = data[:-1]
    elif how == "truncated-header":
        data = data[:start - 5]
    elif how == "extra-byte":
        data += b"\0"
    elif how == "not-safetensors":
        data = bytearray(b"PK\x03\x04 this is a zip file, or a pickle, or anything else" * 4)
    elif how == "huge-header-length":
        data[:8] = struct.pack("<Q", 1 << 62)
    elif how == "header-not-json":
        data[8] = ord("[")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["zero-length", "truncated-half", "truncated-1", "truncated-header", "extra-byte",
                                 "not-safetensors", "huge-header-length", "header-not-json"])
def test_unreadable_file_is_refused(tmp_path, how):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    damage(store.path("faq"), how)
    with pytest.raises(SnapshotMismatch, match="^unreadable: "):
        store.load("faq", TOKENS)


@pytest.mark.parametrize("where", [0, 1, 0.5, -1])  # first byte, second, middle, last byte of the data
@pytest.mark.parametrize("bit", [0, 7])
def test_flipped_data_bit_is_refused(tmp_path, where, bit):
    store = make_store(tmp_path, dtype="bfloat16")
    store.save("faq", TOKENS, make_kv(torch.bfloat16))
    path = store.path("faq")
    data = bytearray(path.read_bytes())
    start = data_offset(path)
    offset = {0: start, 1: start + 1, 0.5: (start + len(data)) // 2, -1: len(data) - 1}[where]
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
        store.load("faq", TOKENS)


@pytest.mark.parametrize("old, new", [
    (b'"v.1"', b'"x.1"'),  # a renamed tensor: the data, in the same order, would match
    (b"[3,4,2,8]", b"[3,4,8,2]"),  # a reshaped tensor: the same bytes, read as the wrong heads
])
def test_damaged_header_that_still_parses_is_refused(tmp_path, old, new):
    """The checksum covers each tensor's name, dtype and shape, not just its bytes."""
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    path = store.path("faq")
    data = path.read_bytes()
    header = data[8:data_offset(path)]
    assert old in header
    path.write_bytes(data[:8] + header.replace(old, new, 1) + data[8 + len(header):])
    with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
        store.load("faq", TOKENS)


def test_a_header_whose_shape_does_not_fill_its_data_offsets_is_refused(tmp_path):
    """Each tensor's data_offsets must span exactly its shape's bytes: a header damaged to a smaller
    shape (its offsets and the data as they were) is unreadable, not read into a view that fails."""
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    path = store.path("faq")
    data = path.read_bytes()
    header = data[8:data_offset(path)]
    assert b"[3,4,2,8]" in header
    path.write_bytes(data[:8] + header.replace(b"[3,4,2,8]", b"[3,4,2,4]", 1) + data[8 + len(header):])
    with pytest.raises(SnapshotMismatch, match=r"^unreadable: tensor \S+: data_offsets .* do not hold \[3, 4, 2, 4\]"):
        store.load("faq", TOKENS)
    with pytest.raises(SnapshotMismatch, match="^unreadable: "):
        store.verify(path)


def test_wrong_tensor_dtype_or_shape_is_refused_at_save(tmp_path):
    """A caller's bug is caught when saving, not at every later start."""
    store = make_store(tmp_path)
    with pytest.raises(ValueError, match="bfloat16, expected float32"):
        store.save("faq", TOKENS, make_kv(torch.bfloat16))
    kv = make_kv()
    kv["v.1"] = kv["v.1"][:2]
    with pytest.raises(ValueError, match="different block counts"):
        store.save("faq", TOKENS, kv)
    with pytest.raises(ValueError, match="expected \\[blocks, 4, heads, head_dim\\]"):
        store.save("faq", TOKENS, {"k.0": torch.zeros(3, 8, 2, 8)})
    with pytest.raises(ValueError, match="no tensors"):
        store.save("faq", TOKENS, {})
    assert list(tmp_path.iterdir()) == []


def test_wrong_tensor_dtype_in_file_is_refused(tmp_path, monkeypatch):
    """A file whose metadata says float32 but holds bfloat16 (written by a buggy writer) is refused."""
    store = make_store(tmp_path)
    monkeypatch.setattr(SnapshotStore, "_check_tensors", lambda *args: None)
    store.save("faq", TOKENS, make_kv(torch.bfloat16))
    monkeypatch.undo()
    with pytest.raises(SnapshotMismatch, match="tensor k.0 is bfloat16, expected float32"):
        store.load("faq", TOKENS)


def test_name_must_be_a_template_name(tmp_path):
    store = make_store(tmp_path / "snaps")
    for bad in ["../escape", "a/b", "", ".hidden", "x" * 129]:
        with pytest.raises(ConfigError):
            store.path(bad)
    assert not (tmp_path / "escape.kv.safetensors").exists()


# --- I/O failures and atomicity ---------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions, so a read-only folder does "
                    "not make the save fail; test_save_write_failure_raises_oserror_and_keeps_the_old_snapshot "
                    "covers the clean-up after a failed write")
def test_save_into_read_only_folder_raises_oserror(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(OSError):
            make_store(folder).save("faq", TOKENS, make_kv())
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


def test_save_write_failure_raises_oserror_and_keeps_the_old_snapshot(tmp_path, monkeypatch):
    """Disk full mid-write: the partly written temp file is removed, the old snapshot still loads."""
    store = make_store(tmp_path)
    old = make_kv(seed=0)
    store.save("faq", TOKENS, old)

    def fill_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshots, "save_file", fill_disk)
    with pytest.raises(OSError, match="No space left"):
        store.save("faq", TOKENS, make_kv(seed=1))
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert_same(store.load("faq", TOKENS), old)


def test_save_is_atomic_when_the_rename_fails(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    old = make_kv(seed=0)
    store.save("faq", TOKENS, old)

    def fail(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="simulated crash"):
        store.save("faq", TOKENS, make_kv(seed=1))
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert_same(store.load("faq", TOKENS), old)


def test_save_fsyncs_the_new_file_before_renaming_it_over_the_snapshot(tmp_path, monkeypatch):
    """The folder's fsync makes the new name durable, not the file's bytes: without the file's own
    fsync first, a power loss after the rename can leave the name on a file whose data never reached
    the disk."""
    events: list[tuple[str, tuple[int, int]]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        fsync(fd)

    def recorded_replace(src, dst):
        st = os.stat(src)
        events.append(("replace", (st.st_dev, st.st_ino)))
        replace(src, dst)

    monkeypatch.setattr(snapshots.os, "fsync", recorded_fsync)
    monkeypatch.setattr(snapshots.os, "replace", recorded_replace)
    store = make_store(tmp_path)
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    [renamed] = [file for what, file in events if what == "replace"]
    assert ("fsync", renamed) in events[:events.index(("replace", renamed))]
    monkeypatch.undo()
    assert_same(store.load("faq", TOKENS), kv)


def test_save_and_remove_fsync_the_folder(tmp_path, monkeypatch):
    """The rename (and the unlink) is durable only once the folder is fsynced: after a power loss the
    folder must not name the old snapshot, or none."""
    synced: list[Path] = []
    monkeypatch.setattr(snapshots, "fsync_dir", lambda folder: synced.append(Path(folder)))
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    assert synced == [tmp_path]
    store.remove("faq")
    assert synced == [tmp_path, tmp_path]


def test_remove(tmp_path):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    store.save("bot", TOKENS, make_kv())
    store.remove("faq")
    assert not store.path("faq").exists() and store.load("faq", TOKENS) is None
    store.remove("faq")  # missing is fine
    make_store(tmp_path / "absent").remove("faq")  # so is a missing folder
    assert store.load("bot", TOKENS) is not None


def test_a_full_disk_is_an_oserror_though_safetensors_says_otherwise(tmp_path, monkeypatch):
    """safetensors reports a failed write (ENOSPC, EFBIG) as a SafetensorError: save raises the OSError
    it is, which turns a server's snapshots off (TemplateSnapshots) instead of failing each template."""
    from safetensors import SafetensorError
    store = make_store(tmp_path)

    def disk_full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(snapshots, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        store.save("faq", TOKENS, make_kv())

    def bad(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: some other complaint")

    monkeypatch.setattr(snapshots, "save_file", bad)
    with pytest.raises(SafetensorError):  # not an I/O failure: the caller's bug, not a full disk
        store.save("faq", TOKENS, make_kv())
    assert temp_files(tmp_path) == []


def test_stale_temp_files_a_folder_will_not_let_go_of_are_left(tmp_path, monkeypatch, caplog):
    """A read-only snapshot folder (or one another account owns) holding a stale temp folder: it is
    left with a warning, and what the folder holds still loads (the start used to fail)."""
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    stale = tmp_path / ".faq.kv.safetensors.tmp-abc123"
    stale.mkdir()
    (stale / "faq.kv.safetensors").write_bytes(b"partial")
    old = time.time() - snapshots.STALE_TEMP_AGE_S - 60
    for p in (stale / "faq.kv.safetensors", stale):
        os.utime(p, (old, old))

    def read_only(path, *_, **__):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(snapshots.shutil, "rmtree", read_only)
    with caplog.at_level(logging.WARNING, logger="prefix_service.engine"):
        assert store.stale_temp_files_removed() == 0
    assert stale.exists() and any("cannot remove" in r.getMessage() and "Read-only" in r.getMessage()
                                  for r in caplog.records)
    assert store.load("faq", TOKENS) is not None


def test_stale_temp_files_removed(tmp_path):
    store = make_store(tmp_path)
    assert make_store(tmp_path / "absent").stale_temp_files_removed() == 0
    store.save("faq", TOKENS, make_kv())
    old = time.time() - snapshots.STALE_TEMP_AGE_S - 60
    stale = [tmp_path / ".faq.kv.safetensors.tmp-abc123", tmp_path / ".bot.kv.safetensors.tmp-x"]
    for p in stale:
        p.write_bytes(b"partial")
        os.utime(p, (old, old))
    live = tmp_path / ".faq.kv.safetensors.tmp-live"  # another process's save in progress
    live.write_bytes(b"partial")
    other = tmp_path / ".templates.json.tmp-abc"  # the template store's, not ours
    other.write_bytes(b"{}")
    os.utime(other, (old, old))
    # a save's temp folder, holding its file and safetensors' own temp file: stale, or still written to
    stale_dir, live_dir = tmp_path / ".faq.kv.safetensors.tmp-dead", tmp_path / ".bot.kv.safetensors.tmp-busy"
    for folder in (stale_dir, live_dir):
        folder.mkdir()
        for p in (folder / "faq.kv.safetensors", folder / ".tmpAb3dEf"):
            p.write_bytes(b"partial")
            os.utime(p, (old, old))
    (live_dir / ".tmpAb3dEf").touch()  # being written now
    os.utime(stale_dir, (old, old))
    os.utime(live_dir, (old, old))
    assert store.stale_temp_files_removed() == 3
    assert not any(p.exists() for p in stale) and not stale_dir.exists()
    assert live.exists() and other.exists() and live_dir.exists()
    assert store.load("faq", TOKENS) is not None


# --- offline: verify, install, export ---------------------------------------------------------


def test_read_snapshot_file_needs_no_key(tmp_path):
    store = make_store(tmp_path, fingerprint="a" * 16)
    store.save("faq", TOKENS, make_kv())
    info = read_snapshot_file(store.path("faq"))
    assert info.path == store.path("faq") and info.size == store.path("faq").stat().st_size
    assert info.num_tokens == 10 and info.metadata["fingerprint"] == "a" * 16 and info.metadata["name"] == "faq"
    (tmp_path / "junk.kv.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(SnapshotMismatch, match="unreadable"):
        read_snapshot_file(tmp_path / "junk.kv.safetensors")
    with pytest.raises(FileNotFoundError):
        read_snapshot_file(tmp_path / "absent.kv.safetensors")


def test_read_snapshot_file_without_a_token_count_says_none(tmp_path):
    """A file that records no (or no numeric) num_tokens holds an unknown count, not 0 tokens."""
    for value in (None, "", "ten"):
        meta = {"format": "2"} if value is None else {"format": "2", "num_tokens": value}
        save_file(make_kv(), str(tmp_path / "x.kv.safetensors"), metadata=meta)
        assert read_snapshot_file(tmp_path / "x.kv.safetensors").num_tokens is None, value


@pytest.mark.parametrize("change, reason", [
    ({"fingerprint": "0" * 16}, "made by other weights"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"block_size": 8}, "block_size"),
    ({"layout": "paged-v2"}, "layout"),
])
def test_verify_checks_the_key_but_not_the_tokens(tmp_path, change, reason):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    assert store.verify(store.path("faq")).num_tokens == len(TOKENS)  # no token ids asked for
    with pytest.raises(SnapshotMismatch, match=reason):
        make_store(tmp_path, **change).verify(store.path("faq"))


def test_verify_reads_the_whole_file(tmp_path):
    store = make_store(tmp_path)
    store.save("faq", TOKENS, make_kv())
    patch_byte(store.path("faq"), store.path("faq").stat().st_size - 1)  # the last data byte
    with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
        store.verify(store.path("faq"))


def test_install_copies_a_verified_file_under_a_name(tmp_path):
    source = make_store(tmp_path / "a")
    kv = make_kv()
    source.save("faq", TOKENS, kv)
    target = make_store(tmp_path / "b" / "new")  # created by install
    assert target.install(source.path("faq"), "help") == tmp_path / "b" / "new" / "help.kv.safetensors"
    assert_same(target.load("help", TOKENS), kv)
    assert temp_files(tmp_path / "b" / "new") == []
    with pytest.raises(ConfigError):
        target.install(source.path("faq"), "../escape")


@pytest.mark.parametrize("damage", ["key", "bit"])
def test_install_refuses_a_mismatch_and_keeps_the_previous_snapshot(tmp_path, damage):
    target = make_store(tmp_path / "b")
    old = make_kv(seed=0)
    target.save("faq", TOKENS, old)
    other = make_store(tmp_path / "a", block_size=8) if damage == "key" else make_store(tmp_path / "a")
    other.save("faq", TOKENS, {k: torch.zeros(3, other.key.block_size, 2, 8) for k in make_kv()})
    if damage == "bit":
        patch_byte(other.path("faq"), data_offset(other.path("faq")))
    with pytest.raises(SnapshotMismatch, match="block_size" if damage == "key" else "corrupt"):
        target.install(other.path("faq"), "faq")
    assert_same(target.load("faq", TOKENS), old)
    assert temp_files(tmp_path / "b") == []


def test_install_and_export_verify_the_copy_they_made_not_only_the_source(tmp_path, monkeypatch):
    """A copy damaged on its way (a failing disk, a source changed while it is copied) is refused and
    nothing lands under the name, though the source itself passes verify."""
    source = make_store(tmp_path / "a")
    source.save("faq", TOKENS, make_kv())
    copyfile = shutil.copyfile

    def damaging_copyfile(src, dst, **kwargs):
        copyfile(src, dst, **kwargs)
        patch_byte(Path(dst), Path(dst).stat().st_size - 1)  # the last data byte
        return dst

    monkeypatch.setattr(snapshots.shutil, "copyfile", damaging_copyfile)
    target = make_store(tmp_path / "b")
    with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
        target.install(source.path("faq"), "faq")
    assert not (tmp_path / "b").exists()
    (tmp_path / "out").mkdir()
    with pytest.raises(SnapshotMismatch, match="corrupt: checksum mismatch"):
        source.export("faq", tmp_path / "out" / "faq.kv.safetensors")
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.undo()
    assert source.verify(source.path("faq")).num_tokens == len(TOKENS)  # the source was whole all along


def test_export_copies_a_verified_snapshot_out(tmp_path):
    store = make_store(tmp_path / "snaps")
    kv = make_kv()
    store.save("faq", TOKENS, kv)
    out = tmp_path / "out" / "faq-copy.safetensors"
    out.parent.mkdir()
    assert store.export("faq", out).num_tokens == len(TOKENS)
    assert out.read_bytes() == store.path("faq").read_bytes() and temp_files(out.parent) == []
    with pytest.raises(FileNotFoundError, match="'bot' has no snapshot"):
        store.export("bot", tmp_path / "out" / "bot.safetensors")
    with pytest.raises(SnapshotMismatch, match="made by other weights"):
        make_store(tmp_path / "snaps", fingerprint="0" * 16).export("faq", tmp_path / "out" / "x.safetensors")
    assert sorted(p.name for p in out.parent.iterdir()) == ["faq-copy.safetensors"]


def test_snapshot_key_of_a_config(tmp_path):
    from prefix_service.config import CacheConfig, EngineConfig, ModelConfig
    model = make_model_dir(tmp_path / "m")
    config = EngineConfig(ModelConfig(path=str(model)), CacheConfig(block_size=8))
    key = snapshot_key(config, torch.device("cpu"), torch.bfloat16)
    assert key == SnapshotKey(model_fingerprint(model), "bfloat16", 8)
    dummy = EngineConfig(ModelConfig(path=str(model), load_format="dummy"), CacheConfig(block_size=8))
    on_cpu = snapshot_key(dummy, torch.device("cpu"), torch.float32)
    assert on_cpu.fingerprint != model_fingerprint(model, "dummy")  # it names the device type
    assert snapshot_key(dummy, torch.device("cuda", 1), torch.float32).fingerprint != on_cpu.fingerprint


# --- model fingerprint ---------------------------------------------------------------------------


def make_model_dir(folder: Path) -> Path:
    """config.json and one safetensors file with 4 MiB of data: samples at [0, 1), [1.5, 2.5) and
    [3, 4) MiB of the data region, so [1, 1.5) and [2.5, 3) MiB are not read."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    weight = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    save_file({"model.embed_tokens.weight": weight}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def patch_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_fingerprint_is_stable(tmp_path):
    model = make_model_dir(tmp_path / "m")
    fp = model_fingerprint(model)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert model_fingerprint(str(model)) == fp
    copy = tmp_path / "copy"  # the path is not part of it
    copy.mkdir()
    for p in model.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "tokenizer.json").write_text("{}")  # nor files other than config.json and the weights
    assert model_fingerprint(copy) == fp


MiB = 1 << 20


@pytest.mark.parametrize("where", [0, MiB - 1, 2 * MiB, 4 * MiB - 1])
def test_fingerprint_follows_sampled_weight_bytes(tmp_path, where):
    model = make_model_dir(tmp_path / "m")
    fp = model_fingerprint(model)
    weights = model / "model.safetensors"
    patch_byte(weights, data_offset(weights) + where)
    assert model_fingerprint(model) != fp


@pytest.mark.parametrize("where", [MiB + MiB // 4, 2 * MiB + 3 * MiB // 4])
def test_fingerprint_skips_unsampled_weight_bytes(tmp_path, where):
    """The trade-off for a cheap start: bytes between the samples are not read."""
    model = make_model_dir(tmp_path / "m")
    fp = model_fingerprint(model)
    weights = model / "model.safetensors"
    patch_byte(weights, data_offset(weights) + where)
    assert model_fingerprint(model) == fp


def test_fingerprint_follows_config_header_and_files(tmp_path):
    model = make_model_dir(tmp_path / "m")
    fp = model_fingerprint(model)
    config = model / "config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b"64", b"65"))
    assert model_fingerprint(model) != fp
    config.write_bytes(original)
    assert model_fingerprint(model) == fp
    weights = model / "model.safetensors"
    patch_byte(weights, 8 + 2)  # inside the JSON header
    assert model_fingerprint(model) != fp
    patch_byte(weights, 8 + 2)
    assert model_fingerprint(model) == fp
    save_file({"lm_head.weight": torch.zeros(4)}, model / "model-2.safetensors")  # another shard
    assert model_fingerprint(model) != fp
    (model / "model-2.safetensors").unlink()
    weights.rename(model / "renamed.safetensors")
    assert model_fingerprint(model) != fp


def test_fingerprint_of_small_or_damaged_weight_files(tmp_path):
    """Data shorter than a sample, or a header length past the end, still fingerprints (the loader
    reports a damaged file; the fingerprint only has to differ)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.ones(3)}, model / "model.safetensors")
    fp = model_fingerprint(model)
    patch_byte(model / "model.safetensors", data_offset(model / "model.safetensors"))
    assert model_fingerprint(model) != fp
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    model_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"abc")
    model_fingerprint(model)


def test_fingerprint_needs_weights_and_a_known_format(tmp_path):
    model = make_model_dir(tmp_path / "m")
    (model / "model.safetensors").unlink()
    with pytest.raises(Exception, match="no \\*.safetensors"):
        model_fingerprint(model)
    with pytest.raises(ValueError, match="load_format"):
        model_fingerprint(model, "gguf")
    with pytest.raises(FileNotFoundError):
        model_fingerprint(tmp_path / "absent")


def test_dummy_fingerprint(tmp_path):
    model = make_model_dir(tmp_path / "m")
    fp = model_fingerprint(model, "dummy", seed=0)
    assert fp == model_fingerprint(model, "dummy")
    assert model_fingerprint(model, "dummy", seed=1) != fp
    assert fp != model_fingerprint(model)
    patch_byte(model / "model.safetensors", data_offset(model / "model.safetensors"))  # files are not read
    assert model_fingerprint(model, "dummy", seed=0) == fp
    (model / "config.json").write_text("{}")
    assert model_fingerprint(model, "dummy", seed=0) != fp


def test_fsync_dir_fsyncs_the_folder_itself_and_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """What save and remove rely on: fsync_dir fsyncs a descriptor of the folder (its device and
    inode), then closes it."""
    from prefix_service import fsutil
    synced: list[tuple[int, int]] = []
    fsync = os.fsync

    def recorded_fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        fsync(fd)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))

    monkeypatch.setattr(fsutil.os, "fsync", recorded_fsync)
    before = open_fds()
    fsutil.fsync_dir(tmp_path)
    assert open_fds() == before
    assert synced == [(tmp_path.stat().st_dev, tmp_path.stat().st_ino)]
