"""Template KV snapshots under faults: a process saving snapshots is SIGKILLed at random points 20
times and the file always loads as the last snapshot saved or the one in flight, bit for bit, with
its temp files removed at the next start; through the engine, a full folder (ENOSPC), a folder that
cannot be written and a snapshot that cannot be read each leave serving as without snapshots, with
one warning; a restore gives the greedy outputs of a prefill on each tiny architecture and CPU
backend; a restore whose blocks are not free falls back to a queued prefill."""
from __future__ import annotations

import concurrent.futures
import builtins
import errno
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from prefix_service import GenerateRequest, RequestOutput, SamplingParams
from prefix_service.engine.template_pins import TemplateInfo
from prefix_service.engine import snapshots
from prefix_service.engine.snapshots import SnapshotKey, SnapshotStore
from test_template_snapshots import TEMPLATE, greedy, template_kv

REPO = Path(__file__).resolve().parent.parent
KILLS = 20
KEY = SnapshotKey("f" * 16, "float32", 4)
TOKENS = list(range(100, 140))

# Imports torch once, then forks one writer per round (a fresh process to kill each time, without
# paying torch's import each time). A writer saves the two versions alternately, forever, and writes
# "writing <version>" before each save and "saved" after it to the round's log, so the test knows
# which two snapshots a kill may leave on disk. The zygote answers each round with the writer's pid,
# then with its exit status once the test has killed it.
ZYGOTE = r"""
import os, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
from test_snapshot_faults import KEY, TOKENS, version
from prefix_service.engine.snapshots import SnapshotStore
store = SnapshotStore(sys.argv[1], KEY)
versions = [version(0), version(1)]
print("ready", flush=True)
for line in sys.stdin:
    log_path, first = line.split()
    pid = os.fork()
    if pid == 0:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        n = int(first)
        while True:
            os.write(log, b"writing %d\n" % (n % 2))
            store.save("doc", TOKENS, versions[n % 2])
            os.write(log, b"saved\n")
            n += 1
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
"""


def version(which: int) -> dict[str, torch.Tensor]:
    """One of the two snapshots the writer alternates: 4 MiB of K/V in 4 tensors (about 20 ms a save)."""
    g = torch.Generator().manual_seed(which)
    # each: [blocks, block_size, num_kv_heads, head_dim]
    return {f"{kind}.{i}": torch.randn(1024, 4, 4, 16, generator=g) for i in range(2) for kind in "kv"}


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].shape == want[k].shape and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def which_version(loaded: dict[str, torch.Tensor] | None, versions: list[dict[str, torch.Tensor]]) -> int | None:
    """0 or 1 for a snapshot equal bit for bit to that version, None for no snapshot; fails on anything else."""
    if loaded is None:
        return None
    matches = [i for i, v in enumerate(versions) if same(loaded, v)]
    assert len(matches) == 1, "a snapshot that is neither version loaded"
    return matches[0]


def test_snapshot_survives_20_kills_mid_write(tmp_path, monkeypatch):
    folder = tmp_path / "snapshots"
    folder.mkdir()  # (a kill before the first save's mkdir would leave none to list)
    store = SnapshotStore(folder, KEY)
    versions = [version(0), version(1)]
    assert not same(versions[0], versions[1])
    monkeypatch.setattr(snapshots, "STALE_TEMP_AGE_S", 0.0)  # every temp file left is a killed writer's
    rng = random.Random(2024)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(folder), str(Path(__file__).parent)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert zygote.stdin is not None and zygote.stdout is not None
    killed_mid_write = temp_files_removed = 0
    previous: int | None = None  # the version on disk before this round (None: no snapshot yet)
    pid = None
    try:
        assert zygote.stdout.readline().strip() == "ready"
        for round_ in range(KILLS):
            log = tmp_path / f"writer-{round_}.log"
            zygote.stdin.write(f"{log} {rng.randrange(2)}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            time.sleep(rng.uniform(0.005, 0.1))
            os.kill(pid, signal.SIGKILL)
            status = int(zygote.stdout.readline())
            pid = None
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the writer died by itself: {status}"
            lines = log.read_text().splitlines()
            writes = [int(line.split()[1]) for line in lines if line.startswith("writing ")]
            saved = lines.count("saved")
            assert writes, "killed before the first save began: raise the sleep"
            # the last snapshot acknowledged (or what was there before this round), and the one in flight
            acknowledged = writes[saved - 1] if saved else previous
            in_flight = writes[-1] if lines[-1] != "saved" else None
            killed_mid_write += in_flight is not None
            loaded = which_version(store.load("doc", TOKENS), versions)  # never a SnapshotMismatch
            assert loaded in (acknowledged, in_flight), (round_, loaded, acknowledged, in_flight)
            temps = [p for p in folder.iterdir() if ".tmp-" in p.name]
            removed = store.stale_temp_files_removed()  # what the next start does
            assert removed == len(temps) <= 1
            temp_files_removed += removed
            assert sorted(p.name for p in folder.iterdir()) == (["doc.kv.safetensors"] if loaded is not None else [])
            assert which_version(store.load("doc", TOKENS), versions) == loaded  # the clean-up left the snapshot
            previous = loaded
    finally:
        if pid is not None:  # a failure left a writer running: it is the zygote's child, not ours to reap
            os.kill(pid, signal.SIGKILL)
        zygote.stdin.close()
        zygote.kill()
        zygote.wait(30)
    assert killed_mid_write > 0 and temp_files_removed > 0


# --- through the engine ------------------------------------------------------------------------



def snapshot_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "snapshot" in r.getMessage()]


@pytest.mark.parametrize("fault", ["disk full mid-write", "read-only at the rename", "folder under a file"])
def test_a_folder_that_cannot_be_written_is_one_warning_and_serving_goes_on(make_engine, tmp_path, caplog,
                                                                            monkeypatch, fault):
    folder = tmp_path / "snapshots"
    tries: list[str] = []
    if fault == "disk full mid-write":
        def fill_disk(tensors, filename, metadata=None):
            tries.append(filename)
            Path(filename).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(snapshots, "save_file", fill_disk)
        reason = "No space left"
    elif fault == "read-only at the rename":
        real_replace = os.replace

        def read_only(src, dst):
            if str(dst).endswith(snapshots.SUFFIX):
                tries.append(str(dst))
                raise OSError(errno.EROFS, "Read-only file system")
            real_replace(src, dst)

        monkeypatch.setattr(snapshots.os, "replace", read_only)
        reason = "Read-only"
    else:
        (tmp_path / "a-file").write_text("not a folder")
        folder = tmp_path / "a-file" / "snapshots"
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self == folder:
                tries.append(str(self))
            real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        reason = "Not a directory"
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    engine = make_engine(snapshot_dir=str(folder), backend="torch")
    copies: list[int] = []
    read_blocks = engine._core.backend.read_blocks

    def counted_read_blocks(block_table):
        copies.append(len(block_table))
        return read_blocks(block_table)

    monkeypatch.setattr(engine._core.backend, "read_blocks", counted_read_blocks)
    engine.add_template("doc", token_ids=TEMPLATE)
    engine.flush_snapshots()
    engine.add_template("other", token_ids=TEMPLATE[:6])
    engine.remove_template("other")
    engine.add_template("other", token_ids=TEMPLATE[:6])
    engine.flush_snapshots()
    assert len(tries) == 1 and len(copies) == 1  # later pins neither copy their K/V nor try to write it
    [off] = snapshot_warnings(caplog)
    assert "snapshots are off" in off and reason in off, off
    if folder.exists():
        assert list(folder.iterdir()) == []  # no temp file left behind
    plain = make_engine(backend="torch")  # no snapshots: the reference
    plain.add_template("doc", token_ids=TEMPLATE)
    assert greedy(engine) == greedy(plain)
    assert {i.name: i.kv_source for i in engine.list_templates()} == {"doc": "prefill", "other": "prefill"}


def test_a_snapshot_that_cannot_be_read_is_one_warning_and_a_prefill(make_engine, tmp_path, caplog, monkeypatch):
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend="torch")
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    want = greedy(first)

    # a snapshot file cannot be opened to read; other files can, and so can the new file the second
    # engine's save of its prefill writes and opens to fsync ("r+b"): one warning, not a second one
    # from the save's thread whenever it logs before the check (a race)
    def denied(file, mode="r", *args, **kwargs):
        if str(file).endswith(snapshots.SUFFIX) and mode == "rb":
            raise PermissionError(errno.EACCES, "Permission denied", file)
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(snapshots, "open", denied, raising=False)
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    second = make_engine(snapshot_dir=folder, backend="torch")
    assert second.add_template("doc", token_ids=TEMPLATE).kv_source == "prefill"
    [warning] = snapshot_warnings(caplog)
    assert "'doc'" in warning and "Permission denied" in warning and "prefilling" in warning, warning
    assert greedy(second) == want
    second.flush_snapshots()  # the prefill saved the template again
    monkeypatch.undo()
    third = make_engine(snapshot_dir=folder, backend="torch")
    assert third.add_template("doc", token_ids=TEMPLATE).kv_source == "snapshot"
    assert greedy(third) == want


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_snapshot_damaged_while_it_is_read_into_the_cache_is_one_warning_and_a_prefill(
        make_engine, tmp_path, caplog, monkeypatch, backend):
    """On a CPU the engine's thread reads the snapshot straight into the template's blocks after the
    caller's thread checked it: bytes that changed in between (a copy over the file in place) fail
    that read's own checksum, the blocks go back to the free list (the fixture checks the allocator
    at the end) and the template is prefilled."""
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend=backend)
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    want = greedy(first)
    check = snapshots.SnapshotReader.check

    def check_then_damage(reader: snapshots.SnapshotReader) -> None:
        check(reader)
        with open(reader.path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\x00\x01\x02")

    monkeypatch.setattr(snapshots.SnapshotReader, "check", check_then_damage)
    caplog.set_level(logging.WARNING, logger="prefix_service.engine")
    second = make_engine(snapshot_dir=folder, backend=backend)
    free = second.kv_stats()["free"]
    info = second.add_template("doc", token_ids=TEMPLATE)
    assert info.kv_source == "prefill"
    [warning] = snapshot_warnings(caplog)
    assert "'doc'" in warning and "checksum mismatch" in warning, warning
    second.check_integrity()
    assert second.kv_stats()["free"] == free - info.num_blocks  # the restore's blocks were given back
    assert greedy(second) == want


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])  # conftest's other archs; llama: test_template_snapshots.py
def test_greedy_outputs_after_a_restore_equal_those_after_a_prefill(make_engine, model_dirs, tmp_path, arch, backend):
    folder = str(tmp_path / "snapshots")
    first = make_engine(model_dirs[arch], snapshot_dir=folder, backend=backend)
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    kv = template_kv(first)
    second = make_engine(model_dirs[arch], snapshot_dir=folder, backend=backend)
    assert second.add_template("doc", token_ids=TEMPLATE).kv_source == "snapshot"
    restored = template_kv(second)
    assert restored.keys() == kv.keys() and all(restored[k].equal(kv[k]) for k in kv)  # bit for bit
    assert greedy(second) == greedy(first)


def test_a_restore_into_a_full_cache_falls_back_to_a_queued_prefill(make_engine, tmp_path, monkeypatch):
    """The template's 5 blocks are not free when its restore runs (a request holds 9 of 12), so it is
    prefilled once the request has left them, and pinned correctly."""
    folder = str(tmp_path / "snapshots")
    first = make_engine(snapshot_dir=folder, backend="torch")
    first.add_template("doc", token_ids=TEMPLATE)
    first.flush_snapshots()
    want = greedy(first)
    engine = make_engine(snapshot_dir=folder, backend="torch", num_blocks=12, prefix_budget_blocks=6)
    restores: list[object] = []
    restore_template = engine._core.restore_template

    def spied_restore_template(*args, **kwargs):
        restores.append(restore_template(*args, **kwargs))
        return restores[-1]

    monkeypatch.setattr(engine._core, "restore_template", spied_restore_template)
    # The engine's thread is held in the request's first output until add_template has queued its
    # restore, which then runs while the request holds its blocks.
    first_output, restore_queued = threading.Event(), threading.Event()
    outputs: list[RequestOutput] = []

    def sink(out: RequestOutput) -> None:
        outputs.append(out)
        if not first_output.is_set():
            first_output.set()
            assert restore_queued.wait(30)

    engine.submit(GenerateRequest(prompt_token_ids=list(range(60, 92)),  # 32 tokens: 8 blocks, then 9
                                  sampling=SamplingParams(max_tokens=16, ignore_eos=True)), sink)
    assert first_output.wait(30)
    added: concurrent.futures.Future[TemplateInfo] = concurrent.futures.Future()
    threading.Thread(target=lambda: added.set_result(engine.add_template("doc", token_ids=TEMPLATE)), daemon=True).start()
    deadline = time.monotonic() + 30
    while not engine._commands:  # add_template read the snapshot and queued the restore
        assert time.monotonic() < deadline and not added.done()
        time.sleep(0.001)
    restore_queued.set()
    info = added.result(60)
    assert restores == [None] and info.kv_source == "prefill"
    assert outputs[-1].finished and sum(len(o.token_ids) for o in outputs) == 16  # the request was not cut short
    assert greedy(engine) == want
