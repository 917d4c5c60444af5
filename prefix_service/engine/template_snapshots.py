"""TemplateSnapshots: the engine's side of template KV snapshots (the file format and its checks
are engine/snapshots.py's).

A template the engine pins after a prefill is saved: the engine's thread copies its blocks' K/V
(Backend.read_blocks, a memory copy) and one writer thread writes the file, so neither a step nor a
caller waits on the disk. Saves and removals run in order on that thread, so a template removed
right after its pin leaves no file; a template added while the removal of one of its name waits
there waits for it, so it neither pins from the file being removed nor is left without one. Loads
start on the caller's thread (Engine.add_template: the header checked, the data read and its
checksum verified), and on a CPU the engine's thread then reads the data straight into the
template's blocks (the file is in the page cache by then): a snapshot that does not match (other
weights, dtype, block size, layout, token ids) or does not read back whole (checksum) is one warning
naming the template and the reason, then the template is prefilled as if there were none. A save
that fails (a read-only or full folder) turns saving off with one warning; serving goes on.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Sequence

import torch

from prefix_service.engine.snapshots import SnapshotMismatch, SnapshotReader, SnapshotStore

log = logging.getLogger("prefix_service.engine")


class TemplateSnapshots:
    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.saving = True  # False once a save failed: the folder cannot be written
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefix-service-snapshots")
        self._removing: collections.Counter[str] = collections.Counter()  # removals queued, per name
        self._lock = threading.Lock()
        removed = store.stale_temp_files_removed()
        if removed:
            log.warning("removed %d temp file(s) of interrupted snapshot writes in %s", removed, store.folder)

    def open(self, name: str, token_ids: Sequence[int]) -> SnapshotReader | None:
        """The template's snapshot, open, its header checked (SnapshotStore.open); None when there
        is none or it must not be used (one warning). Waits for a queued removal of a template of
        this name first: its file is the one removed."""
        with self._lock:
            removing = self._removing[name] > 0
        if removing:
            self.flush()
        try:
            return self.store.open(name, token_ids)
        except (SnapshotMismatch, OSError) as e:
            self.not_used(name, e)
            return None

    def not_used(self, name: str, reason: object) -> None:
        """The one warning of a snapshot that is not used: the template is prefilled instead."""
        log.warning("prefix template %r: its snapshot %s is not used (%s); prefilling it instead",
                    name, self.store.path(name), reason)

    def save(self, name: str, token_ids: Sequence[int], kv: dict[str, torch.Tensor]) -> None:
        """Write the snapshot on the writer thread (kv: a copy the engine no longer touches)."""
        if self.saving:
            self._writer.submit(self._save, name, list(token_ids), kv)

    def _save(self, name: str, token_ids: list[int], kv: dict[str, torch.Tensor]) -> None:
        if not self.saving:
            return
        start = time.perf_counter()
        try:
            self.store.save(name, token_ids, kv)
        except OSError as e:
            self.saving = False
            log.warning("template snapshots are off: cannot write %s (%s); templates are prefilled at each "
                        "start until the folder can be written", self.store.path(name), e)
            return
        except Exception:  # noqa: BLE001 - a snapshot is an optimisation: serving goes on
            log.exception("prefix template %r: writing its snapshot failed", name)
            return
        size = sum(t.numel() * t.element_size() for t in kv.values())
        log.info("prefix template %r: snapshot written to %s (%.1f MiB, %.0f ms)", name, self.store.path(name),
                 size / 2**20, (time.perf_counter() - start) * 1000)

    def remove(self, name: str) -> None:
        with self._lock:
            self._removing[name] += 1
        self._writer.submit(self._remove, name)

    def _remove(self, name: str) -> None:
        try:
            self.store.remove(name)
        except OSError as e:
            log.warning("prefix template %r: removing its snapshot %s failed (%s)", name, self.store.path(name), e)
        finally:
            with self._lock:
                self._removing[name] -= 1
                if self._removing[name] <= 0:
                    del self._removing[name]

    def flush(self) -> None:
        """Wait until every save and removal asked for so far is done."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the pending writes, then stop the writer."""
        self._writer.shutdown(wait=True)
