"""Template KV snapshots: a pinned template's KV blocks on disk, so the next start loads them
instead of prefilling the template again.

One safetensors file per template, `{folder}/{name}.kv.safetensors`, holding per layer K and V
(`k.0`, `v.0`, ...: [blocks, block_size, num_kv_heads, head_dim]) and string metadata that says
what the blocks are valid for. A snapshot is loaded only when all of it matches this start: the
format, the weights (a fingerprint of the checkpoint), the KV dtype, the block size and layout,
and the template's token ids; and when its bytes match the checksum written with them. Anything
else raises SnapshotMismatch, and the caller prefills as if there were no snapshot: a wrong
snapshot would silently change every answer on the template, a missing one costs one prefill.

Files are written as TemplateStore writes its state file (temp file, fsync, rename, fsync the
folder), so a crash leaves the old snapshot or the new one, never a torn file under the name.
Nothing here unpickles: safetensors holds raw tensor bytes and a JSON header.

Offline, without an engine (`prefix-service snapshot verify/export/import`): snapshot_key gives
the key an engine on a config would use, SnapshotStore.verify checks any file against it (all but
the token ids, which only a template names) and install/export copy a file in or out of a folder,
verified and atomically.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefix_service.config import EngineConfig, validate_prefix_name
from prefix_service.errors import ModelLoadError
from prefix_service.fsutil import fsync_dir

log = logging.getLogger("prefix_service.engine")

FORMAT_VERSION = 1
KV_LAYOUT = "paged-v1"  # per layer K and V: [blocks, block_size, num_kv_heads, head_dim]

SUFFIX = ".kv.safetensors"
# A temp file younger than this may be another process's save in progress (replicas sharing the
# folder), so stale_temp_files_removed leaves it; a save rewrites its temp file continuously
# and renames it within seconds of the last write.
STALE_TEMP_AGE_S = 600.0
_SAMPLE_BYTES = 1 << 20  # model_fingerprint reads three samples of this size per weight file


class SnapshotMismatch(Exception):
    """A snapshot that exists but must not be loaded; str(e) is the reason (for a warning naming it)."""


def model_fingerprint(model_dir: str | os.PathLike[str], load_format: str = "auto", seed: int = 0) -> str:
    """A short hex digest binding a snapshot to the weights that made it, cheap even for a 16 GB
    checkpoint: sha256 over config.json's bytes and, for each *.safetensors file in sorted order,
    its name, its size, its safetensors header (the first 8 bytes give the header length; hash the
    header JSON bytes) and three 1 MiB samples of its data (start, middle, end). load_format
    "dummy" (random weights from config.json, seeded): config.json's bytes, "dummy", the seed and
    torch.__version__ instead of the files.

    Sampling, not hashing every byte, keeps a start fast; the header (every tensor's name, dtype,
    shape and offsets) and the size catch a re-exported or re-quantized checkpoint, the samples a
    retrained or fine-tuned one. Every field is hashed after its length, so fields cannot run into
    each other. A dummy model's weights come from the device's generator as well as the seed: a
    snapshot folder is not meant to be shared between a CPU and a GPU run of the same dummy model."""
    path = Path(model_dir)
    digest = hashlib.sha256()

    def field(data: bytes) -> None:
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)

    field((path / "config.json").read_bytes())
    if load_format == "dummy":
        for part in ("dummy", str(seed), torch.__version__):
            field(part.encode())
    elif load_format == "auto":
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has no *.safetensors weights to fingerprint")
        for file in files:
            field(file.name.encode())
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                field(struct.pack("<Q", size))
                head = f.read(8)
                header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
                header_len = min(header_len, max(size - 8, 0))  # a damaged length reads what is there
                field(f.read(header_len))
                # data region: [start, size) | samples at its start, middle and end (they overlap when it is short)
                start = 8 + header_len
                length = size - start
                for offset in (start, start + max(length // 2 - _SAMPLE_BYTES // 2, 0),
                               max(size - _SAMPLE_BYTES, start)):
                    f.seek(offset)
                    field(f.read(_SAMPLE_BYTES))
    else:
        raise ValueError(f"unknown load_format {load_format!r}: expected 'auto' or 'dummy'")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class SnapshotKey:
    """What must match for a snapshot to be loaded."""
    fingerprint: str  # model_fingerprint(...)
    dtype: str  # e.g. "float32", "bfloat16" (str(torch_dtype).removeprefix("torch."))
    block_size: int
    layout: str = KV_LAYOUT

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"SnapshotKey.block_size must be a positive int, got {self.block_size!r}")
        if not self.fingerprint or not self.dtype or not self.layout:
            raise ValueError(f"SnapshotKey needs a fingerprint, dtype and layout: {self!r}")


def snapshot_key(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> SnapshotKey:
    """The key of the snapshots an engine on `config` makes and loads, given the device and dtype it
    runs on (EngineCore's: resolve_device, choose_dtype). Reads config.json and samples of the
    weight files (model_fingerprint), never loads the weights. A dummy model's fingerprint also
    names the device type: its random weights come from that device's generator."""
    mc = config.model
    fingerprint = model_fingerprint(mc.path, mc.load_format, mc.seed)
    if mc.load_format == "dummy":
        fingerprint = hashlib.sha256(f"{fingerprint}:{device.type}".encode()).hexdigest()[:16]
    return SnapshotKey(fingerprint, str(dtype).removeprefix("torch."), config.cache.block_size)


@dataclass(frozen=True)
class SnapshotFile:
    """A snapshot file as it describes itself (its metadata), whatever it was made for."""
    path: Path
    size: int  # bytes on disk
    metadata: Mapping[str, str]

    @property
    def num_tokens(self) -> int | None:
        """The template's token count the file says it holds (None if it says none)."""
        value = self.metadata.get("num_tokens", "")
        return int(value) if value.isdigit() else None


def read_snapshot_file(path: str | os.PathLike[str]) -> SnapshotFile:
    """A snapshot file's size and metadata, without its tensors and without a key. Raises
    SnapshotMismatch ("unreadable: ...") for a file that is not safetensors; OSError passes."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:  # SafetensorError: a zero-length, truncated or foreign file
        raise SnapshotMismatch(f"unreadable: {e}") from e
    return SnapshotFile(path, size, meta)


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Make `path` by write(temp file name), fsync it, rename it over path and fsync the folder: a
    crash leaves the old file or the new one, never a torn one. The temp file is in a temp folder
    of its own in path's folder ('.{name}.tmp-*'), not beside path: a writer may put temp files of
    its own next to the file it is given (safetensors does, renaming one over it when done), and a
    kill mid-write must leave only what stale_temp_files_removed recognises. If write raises, the
    temp folder is removed and path is left as it was."""
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp = tmp_dir / path.name
    try:
        write(str(tmp))
        with open(tmp, "r+b") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    fsync_dir(path.parent)


def tokens_sha256(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int64: the same on every platform."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def data_sha256(kv: Mapping[str, torch.Tensor]) -> str:
    """sha256 over, in sorted key order, each tensor's name, dtype, shape and bytes. The header
    fields are in it too, so a damaged header that safetensors still parses (a renamed key, two
    dimensions swapped) fails the check as damaged data does."""
    digest = hashlib.sha256()
    for key in sorted(kv):
        t = kv[key]
        if t.device.type != "cpu" or not t.is_contiguous():  # its memory is read directly below
            raise ValueError(f"data_sha256 takes contiguous CPU tensors; {key} is not")
        digest.update(json.dumps([key, str(t.dtype), list(t.shape)]).encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:  # the tensor's memory, read in place (no copy)
            digest.update(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))
    return digest.hexdigest()


class SnapshotStore:
    """The snapshots of one engine: a folder, and the key every snapshot in it must match."""

    def __init__(self, folder: str | os.PathLike[str], key: SnapshotKey) -> None:
        self.folder = Path(folder)
        self.key = key

    def path(self, name: str) -> Path:
        """The file of template `name`. Template names are safe file names ([A-Za-z0-9_.-],
        starting alphanumeric); any other name raises ConfigError, so none escapes the folder."""
        return self.folder / f"{validate_prefix_name(name)}{SUFFIX}"

    def save(self, name: str, token_ids: Sequence[int], kv: dict[str, torch.Tensor]) -> None:
        """Atomically write `kv` (keys "k.0", "v.0", ...: CPU tensors [blocks, block_size, heads,
        head_dim] of key.dtype) as name's snapshot for these token ids. Creates the folder.
        Raises OSError on I/O failure (read-only folder, disk full): the caller turns snapshots
        off; the previous snapshot, if any, is left as it was. Raises ValueError on tensors this
        key could never load (a caller's bug, caught here rather than at every later start)."""
        path = self.path(name)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in kv.items()}
        self._check_tensors(tensors, ValueError)
        metadata = {
            "format": str(FORMAT_VERSION), "fingerprint": self.key.fingerprint, "dtype": self.key.dtype,
            "block_size": str(self.key.block_size), "layout": self.key.layout, "name": name,
            "num_tokens": str(len(token_ids)), "tokens_sha256": tokens_sha256(token_ids),
            "data_sha256": data_sha256(tensors),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    def load(self, name: str, token_ids: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """name's snapshot for these token ids: CPU, contiguous tensors in memory of their own
        (not mapped from the file, which may be replaced later), or None if there is no file.
        Raises SnapshotMismatch, with the reason, for a file that must not be loaded; the checks
        run in this order: readable safetensors, format version, fingerprint, dtype, block size,
        layout, the token ids, the data checksum, each tensor's dtype and shape."""
        path = self.path(name)
        if not path.exists():
            return None
        return self._read(path, token_ids)

    def verify(self, path: str | os.PathLike[str]) -> SnapshotFile:
        """Check any snapshot file against this key as load does, all but the template's token ids
        (which only a template names): readable, format, fingerprint, dtype, block size, layout, the
        data checksum, the tensors (the whole file is read). Returns what the file says of itself;
        raises SnapshotMismatch with the reason, OSError when it cannot be opened."""
        self._read(Path(path), None)
        return read_snapshot_file(path)

    def install(self, source: str | os.PathLike[str], name: str) -> Path:
        """Copy a snapshot file in as template name's snapshot, atomically (a temp file in the
        folder, fsync, rename), and only if the copy passes verify: else SnapshotMismatch, and
        name's previous snapshot, if any, is left as it was. Creates the folder. Returns the path."""
        path = self.path(name)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: self._copy_verified(source, tmp))
        return path

    def export(self, name: str, dest: str | os.PathLike[str]) -> SnapshotFile:
        """Copy name's snapshot to dest (atomically, in dest's folder) if it passes verify; raises
        SnapshotMismatch, or FileNotFoundError when name has none. Returns what the copy says."""
        source = self.path(name)
        if not source.exists():
            raise FileNotFoundError(f"template {name!r} has no snapshot in {self.folder} ({source.name})")
        dest = Path(dest)
        write_atomically(dest, lambda tmp: self._copy_verified(source, tmp))
        return read_snapshot_file(dest)

    def _copy_verified(self, source: str | os.PathLike[str], tmp: str) -> None:
        shutil.copyfile(source, tmp)
        self.verify(tmp)  # the copy is checked, not the source: what lands is what was verified

    def _read(self, path: Path, token_ids: Sequence[int] | None) -> dict[str, torch.Tensor]:
        """The file's tensors, every check of load passed (token ids None: those not checked)."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                self._check_metadata(meta, token_ids)
                tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        except SnapshotMismatch:
            raise
        except Exception as e:  # SafetensorError, OSError: a zero-length, truncated or foreign file
            raise SnapshotMismatch(f"unreadable: {e}") from e
        if data_sha256(tensors) != meta.get("data_sha256"):
            raise SnapshotMismatch("corrupt: checksum mismatch")
        self._check_tensors(tensors, SnapshotMismatch)
        return tensors

    def remove(self, name: str) -> None:
        """Delete name's snapshot if any (missing is fine, as is a folder under a regular file,
        which holds none), durably."""
        try:
            self.path(name).unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        fsync_dir(self.folder)

    def stale_temp_files_removed(self) -> int:
        """Remove the temp folders (and files) of saves that never finished (a crash or a kill
        mid-write) and return how many; called at start. Only those of snapshots
        ('.{name}.kv.safetensors.tmp-*') last written more than STALE_TEMP_AGE_S ago: a younger one
        may be a live save of another process."""
        removed = 0
        now = time.time()
        for stale in self.folder.glob(f".*{SUFFIX}.tmp-*"):
            try:
                if stale.is_dir():  # a save's folder: its age is that of the newest file in it
                    if now - max(p.stat().st_mtime for p in (stale, *stale.iterdir())) < STALE_TEMP_AGE_S:
                        continue
                    shutil.rmtree(stale)
                else:
                    if now - stale.stat().st_mtime < STALE_TEMP_AGE_S:
                        continue
                    stale.unlink()
            except FileNotFoundError:  # another process removed or renamed it
                continue
            log.info("removed %s, left by an interrupted snapshot save", stale)
            removed += 1
        return removed

    def _check_metadata(self, meta: Mapping[str, str], token_ids: Sequence[int] | None) -> None:
        def differs(field: str, expected: str, what: str) -> None:
            got = meta.get(field)
            if got != expected:
                raise SnapshotMismatch(f"{what} {got!r}, expected {expected!r}")

        differs("format", str(FORMAT_VERSION), "format version")
        if meta.get("fingerprint") != self.key.fingerprint:
            raise SnapshotMismatch(f"made by other weights (fingerprint {meta.get('fingerprint')!r}, "
                                   f"this model's {self.key.fingerprint!r})")
        differs("dtype", self.key.dtype, "dtype")
        differs("block_size", str(self.key.block_size), "block_size")
        differs("layout", self.key.layout, "layout")
        if token_ids is None:
            return
        if meta.get("num_tokens") != str(len(token_ids)) or meta.get("tokens_sha256") != tokens_sha256(token_ids):
            raise SnapshotMismatch(f"the template's tokens changed ({meta.get('num_tokens')} tokens saved, "
                                   f"{len(token_ids)} now)")

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], error: type[Exception]) -> None:
        """Every tensor [blocks, block_size, heads, head_dim] of key.dtype, all with the same blocks."""
        if not tensors:
            raise error("holds no tensors")
        for k, t in sorted(tensors.items()):
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != self.key.dtype:
                raise error(f"tensor {k} is {dtype}, expected {self.key.dtype}")
            if t.dim() != 4 or t.shape[1] != self.key.block_size:
                raise error(f"tensor {k} has shape {tuple(t.shape)}, expected "
                            f"[blocks, {self.key.block_size}, heads, head_dim]")
        blocks = sorted({t.shape[0] for t in tensors.values()})
        if len(blocks) != 1:
            raise error(f"tensors of different block counts {blocks}")
