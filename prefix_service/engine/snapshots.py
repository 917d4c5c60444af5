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

import contextlib
import ctypes
import hashlib
import io
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save as safetensors_save
from safetensors.torch import save_file

from prefix_service.backends.kv_cache import kv_dtype
from prefix_service.config import EngineConfig, validate_template_name
from prefix_service.errors import ModelLoadError
from prefix_service.fsutil import fsync_dir

log = logging.getLogger("prefix_service.engine")

FORMAT_VERSION = 2  # 2: the data checksum is XXH3-128 (data_xxh3); 1 had sha256
KV_LAYOUT = "paged-v1"  # per layer K and V: [blocks, block_size, num_kv_heads, head_dim]

SUFFIX = ".kv.safetensors"
# A temp file younger than this may be another process's save in progress (replicas sharing the
# folder), so stale_temp_files_removed leaves it; a save rewrites its temp file continuously
# and renames it within seconds of the last write.
STALE_TEMP_AGE_S = 600.0
_SAMPLE_BYTES = 1 << 20  # model_fingerprint reads three samples of this size per weight file
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
_READ_CHUNK = 4 << 20  # bytes read (and hashed while in cache) at a time
_thread_buffers = threading.local()  # each reading thread's chunk buffer (SnapshotReader._chunks)
# safetensors' dtype names of the K/V dtypes a cache may hold
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


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
    names the device type: its random weights come from that device's generator; a quantized
    model's names its model.quantization. The key's dtype is the cache's (cache.kv_cache_dtype); a
    cache held in other than the model's dtype also names the model's in the fingerprint."""
    mc = config.model
    fingerprint = model_fingerprint(mc.path, mc.load_format, mc.seed)
    if mc.load_format == "dummy":
        fingerprint = hashlib.sha256(f"{fingerprint}:{device.type}".encode()).hexdigest()[:16]
    if mc.quantization != "none":  # other weights, other K/V
        fingerprint = hashlib.sha256(f"{fingerprint}:quantization={mc.quantization}".encode()).hexdigest()[:16]
    cache_dtype = kv_dtype(config.cache.kv_cache_dtype, dtype)
    if cache_dtype != dtype:  # K/V computed in the model's dtype, held in another: not a cache of either alone
        fingerprint = hashlib.sha256(f"{fingerprint}:model_dtype={dtype}".encode()).hexdigest()[:16]
    return SnapshotKey(fingerprint, str(cache_dtype).removeprefix("torch."), config.cache.block_size)


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


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, in place (no copy), as bytes: to hash."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a snapshot's tensors are contiguous CPU tensors")
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B") if nbytes else memoryview(b"")


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Block ids as runs of consecutive ids: (first id, count) each, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _entry_id(key: str, dtype: str, shape: Sequence[int]) -> bytes:
    return json.dumps([key, dtype, list(shape)]).encode()


def data_digest(kv: Mapping[str, torch.Tensor]) -> str:
    """The checksum of a snapshot's data: XXH3-128 over, in sorted key order, each tensor's name,
    dtype and shape, then its bytes. The header fields are in it too, so a damaged header that
    still parses (a renamed key, two dimensions swapped) fails the check as damaged data does.
    A checksum against damage (a torn write, a flipped bit), not a signature: XXH3 reads several
    GB/s, so checking a snapshot costs a small part of reading it."""
    digest = xxhash.xxh3_128()
    for key in sorted(kv):
        t = kv[key]
        digest.update(_entry_id(key, str(t.dtype).removeprefix("torch."), t.shape))
        digest.update(_bytes_of(t))
    return digest.hexdigest()


@dataclass(frozen=True)
class _Entry:
    """One tensor of a snapshot file as its header describes it."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _parse_header(raw: bytes, data_bytes: int, data_start: int) -> tuple[dict[str, str], dict[str, _Entry]]:
    """A safetensors header (JSON: tensor entries and an optional __metadata__ of strings): the
    metadata and the tensors, each of a K/V dtype and lying inside the data, which they cover.
    Raises ValueError naming what is wrong."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("__metadata__ is not an object of strings")
    entries: dict[str, _Entry] = {}
    covered = 0
    for key, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {key}: not a tensor entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {key}: dtype {dtype!r} is not one a KV cache holds")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {key}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"tensor {key}: bad data_offsets {offsets!r}")
        begin, end = offsets
        torch_dtype = _DTYPES[dtype]
        if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(shape) * torch_dtype.itemsize:
            raise ValueError(f"tensor {key}: data_offsets {offsets} do not hold {shape} {dtype} "
                             f"in {data_bytes} bytes of data")
        entries[key] = _Entry(torch_dtype, tuple(shape), data_start + begin, end - begin)
        covered += end - begin
    if covered != data_bytes:
        raise ValueError(f"its tensors cover {covered} of its {data_bytes} bytes of data")
    return meta, entries


class SnapshotReader:
    """An open snapshot (a file, or a snapshot's bytes sent by another replica) whose header passed
    every check of its store (format, weights, dtype, block size, layout, token ids, tensors) and
    whose data is not read yet: read() reads it into tensors of its own, read_into() straight into
    the KV blocks given. Both verify the checksum over the bytes they read and raise
    SnapshotMismatch if it differs. A file stays open until close(): a snapshot saved again
    meanwhile is a new file, and this one reads the old one whole."""

    def __init__(self, source: io.RawIOBase | memoryview, path: Path | None, meta: Mapping[str, str],
                 entries: Mapping[str, _Entry]) -> None:
        self._source = source
        self.path = path  # None: bytes in memory
        self.metadata = dict(meta)
        self.entries = dict(entries)
        self.num_blocks = next(iter(entries.values())).shape[0]
        self.nbytes = sum(e.nbytes for e in entries.values())

    def __enter__(self) -> "SnapshotReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not isinstance(self._source, memoryview):
            self._source.close()

    def _pread_into(self, buffer: memoryview, offset: int) -> None:
        """Fill buffer from the file at offset, going on after a short read. A read error or an
        early end of the file raises SnapshotMismatch ("unreadable: ...")."""
        assert not isinstance(self._source, memoryview)
        fd = self._source.fileno()
        while len(buffer):
            try:
                n = os.preadv(fd, [buffer], offset)
            except OSError as e:  # EIO, a network filesystem gone: the snapshot cannot be used
                raise SnapshotMismatch(f"unreadable: {e}") from e
            if n == 0:
                raise SnapshotMismatch(f"unreadable: the file ends before byte {offset + len(buffer)}")
            buffer, offset = buffer[n:], offset + n

    def _check(self, digest: "xxhash.xxh3_128") -> None:
        if digest.hexdigest() != self.metadata.get("data_xxh3"):
            raise SnapshotMismatch("corrupt: checksum mismatch")

    def _chunks(self, e: _Entry) -> Iterator[memoryview]:
        """A tensor's bytes, in order, a few MiB at a time: from a file through a buffer this
        thread reuses (each chunk valid until the next; the kernel copies into memory it already
        knows, the copy out to the destination is a plain memory copy), from bytes in memory as
        slices of them."""
        if isinstance(self._source, memoryview):  # its header's offsets were checked against its length
            for start in range(0, e.nbytes, _READ_CHUNK):
                yield self._source[e.offset + start:e.offset + min(start + _READ_CHUNK, e.nbytes)]
            return
        buffer = getattr(_thread_buffers, "buffer", None)
        if buffer is None:
            buffer = _thread_buffers.buffer = memoryview(bytearray(_READ_CHUNK))
        for start in range(0, e.nbytes, _READ_CHUNK):
            part = buffer[:min(_READ_CHUNK, e.nbytes - start)]
            self._pread_into(part, e.offset + start)
            yield part

    def check(self) -> None:
        """Read the data and verify the checksum, keeping nothing: a damaged file is refused
        before anything is allocated for it, and the file is in the page cache for the read_into
        that follows (which checks what it reads again)."""
        digest = xxhash.xxh3_128()
        for key in sorted(self.entries):
            e = self.entries[key]
            digest.update(_entry_id(key, e.dtype_name, e.shape))
            for chunk in self._chunks(e):
                digest.update(chunk)
        self._check(digest)

    def read(self) -> dict[str, torch.Tensor]:
        """The tensors (keys "k.0", "v.0", ...), read into memory of their own: views of one buffer."""
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        tensors: dict[str, torch.Tensor] = {}
        digest = xxhash.xxh3_128()
        start = 0
        for key in sorted(self.entries):
            e = self.entries[key]
            flat = data[start:start + e.nbytes]
            _fill([flat], self._chunks(e), digest, _entry_id(key, e.dtype_name, e.shape))
            tensors[key] = flat.view(e.dtype).view(e.shape)
            start += e.nbytes
        self._check(digest)
        return tensors

    def read_into(self, caches: Mapping[str, torch.Tensor], block_ids: Sequence[int]) -> None:
        """Read each tensor into its blocks of a host KV cache: caches[key] is the cache tensor of
        "k.0", "v.0", ... ([num_blocks, block_size, heads, head_dim], contiguous, on the CPU:
        Backend.host_cache) and block i of each tensor goes to block block_ids[i]. Raises
        ValueError when the cache does not fit the snapshot (nothing read then), SnapshotMismatch
        when the bytes read fail the checksum (the blocks hold garbage then: the caller frees them)."""
        for key, e in self.entries.items():
            cache = caches.get(key)
            if cache is None:
                raise ValueError(f"{key}: the cache has no such tensor")
            if len(block_ids) != e.shape[0]:
                raise ValueError(f"{key}: {e.shape[0]} blocks in the snapshot, {len(block_ids)} given")
            if tuple(cache.shape[1:]) != e.shape[1:] or cache.dtype != e.dtype or not cache.is_contiguous() \
                    or cache.device.type != "cpu":
                raise ValueError(f"{key}: blocks of {e.shape[1:]} {e.dtype_name} in the snapshot, the cache's "
                                 f"are {tuple(cache.shape[1:])} {str(cache.dtype).removeprefix('torch.')}")
            if block_ids and not 0 <= min(block_ids) <= max(block_ids) < cache.shape[0]:
                raise ValueError(f"{key}: block ids outside the cache's {cache.shape[0]} blocks")
        runs = _runs(block_ids)
        digest = xxhash.xxh3_128()
        for key in sorted(self.entries):
            e = self.entries[key]
            dest = [caches[key][first:first + count].view(torch.uint8).reshape(-1) for first, count in runs]
            _fill(dest, self._chunks(e), digest, _entry_id(key, e.dtype_name, e.shape))
        self._check(digest)


def _fill(dest: Sequence[torch.Tensor], chunks: Iterator[memoryview], digest: "xxhash.xxh3_128", entry_id: bytes) -> None:
    """Copy chunks, in order, into the dest tensors (flat uint8) one after another, hashing
    entry_id and then each chunk. The copies are torch's (memcpy speed; a memoryview slice
    assignment copies far slower)."""
    digest.update(entry_id)
    i, at = 0, 0
    for chunk in chunks:
        digest.update(chunk)
        with warnings.catch_warnings():  # a read-only chunk (bytes from another replica) is only read
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(chunk, dtype=torch.uint8) if len(chunk) else torch.empty(0, dtype=torch.uint8)
        pos = 0
        while pos < len(chunk):
            target = dest[i]
            n = min(len(chunk) - pos, target.numel() - at)
            target[at:at + n].copy_(source[pos:pos + n])
            pos, at = pos + n, at + n
            if at == target.numel():
                i, at = i + 1, 0


def _save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, its I/O failures (a full disk, a file size limit) raised as the
    OSError they are: safetensors reports them as a SafetensorError."""
    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as e:  # noqa: BLE001 - SafetensorError has no class of its own to import
        if type(e).__name__ == "SafetensorError" and "I/O error" in str(e):
            raise OSError(str(e)) from e
        raise


class SnapshotStore:
    """The snapshots of one engine: a folder, and the key every snapshot in it must match. Without
    a folder (None) it encodes and decodes snapshots in memory only (another replica's)."""

    def __init__(self, folder: str | os.PathLike[str] | None, key: SnapshotKey) -> None:
        self._folder = Path(folder) if folder is not None else None  # None: encode and decode only
        self.key = key

    @property
    def folder(self) -> Path:
        if self._folder is None:
            raise ValueError("this snapshot store has no folder: it only encodes and decodes snapshots")
        return self._folder

    def path(self, name: str) -> Path:
        """The file of template `name`. Template names are safe file names ([A-Za-z0-9_.-],
        starting alphanumeric); any other name raises ConfigError, so none escapes the folder."""
        return self.folder / f"{validate_template_name(name)}{SUFFIX}"

    def save(self, name: str, token_ids: Sequence[int], kv: dict[str, torch.Tensor]) -> None:
        """Atomically write `kv` (keys "k.0", "v.0", ...: CPU tensors [blocks, block_size, heads,
        head_dim] of key.dtype) as name's snapshot for these token ids. Creates the folder.
        Raises OSError on I/O failure (read-only folder, disk full): the caller turns snapshots
        off; the previous snapshot, if any, is left as it was. Raises ValueError on tensors this
        key could never load (a caller's bug, caught here rather than at every later start)."""
        path = self.path(name)
        tensors, metadata = self._contents(name, token_ids, kv)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: _save_file(tensors, tmp, metadata))

    def _contents(self, name: str, token_ids: Sequence[int],
                  kv: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A snapshot's tensors (CPU, contiguous) and metadata; ValueError for tensors this key
        could never load."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in kv.items()}
        self._check_tensors({k: (str(t.dtype).removeprefix("torch."), t.shape) for k, t in tensors.items()}, ValueError)
        metadata = {
            "format": str(FORMAT_VERSION), "fingerprint": self.key.fingerprint, "dtype": self.key.dtype,
            "block_size": str(self.key.block_size), "layout": self.key.layout, "name": name,
            "num_tokens": str(len(token_ids)), "tokens_sha256": tokens_sha256(token_ids),
            "data_xxh3": data_digest(tensors),
        }
        return tensors, metadata

    def load(self, name: str, token_ids: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """name's snapshot for these token ids: CPU, contiguous tensors in memory of their own
        (not mapped from the file, which may be replaced later), or None if there is no file.
        Raises SnapshotMismatch, with the reason, for a file that must not be loaded; the checks
        run in this order: readable safetensors, format version, fingerprint, dtype, block size,
        layout, the token ids, each tensor's dtype and shape, the data checksum."""
        reader = self.open(name, token_ids)
        if reader is None:
            return None
        with reader:
            return reader.read()

    def open(self, name: str, token_ids: Sequence[int]) -> SnapshotReader | None:
        """name's snapshot for these token ids, open with every check but the checksum passed (its
        data, and the checksum over it, are read by SnapshotReader.read or read_into), or None if
        there is no file. Raises SnapshotMismatch as load does."""
        path = self.path(name)
        if not path.exists():
            return None
        return self._open(path, token_ids)

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
        made = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(path, lambda tmp: self._copy_verified(source, tmp))
        except BaseException:
            if made:  # a refused import leaves no empty folder behind (rmdir removes only an empty one)
                with contextlib.suppress(OSError):
                    self.folder.rmdir()
            raise
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

    def _open(self, path: Path, token_ids: Sequence[int] | None) -> SnapshotReader:
        """The file, open, its header read and checked (token ids None: those not checked)."""
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise SnapshotMismatch(f"unreadable: {e}") from e
        try:
            fd = f.fileno()
            meta, entries = self._header(lambda offset, n: os.pread(fd, n, offset), os.fstat(fd).st_size, token_ids)
        except OSError as e:
            f.close()
            raise SnapshotMismatch(f"unreadable: {e}") from e
        except BaseException:
            f.close()
            raise
        return SnapshotReader(f, path, meta, entries)

    def _header(self, read: Callable[[int, int], bytes], size: int,
                token_ids: Sequence[int] | None) -> tuple[dict[str, str], dict[str, _Entry]]:
        """A snapshot's header, read(offset, n) from its `size` bytes, parsed and checked."""
        try:
            head = read(0, 8)
            if len(head) != 8:
                raise ValueError(f"{size} bytes: not a safetensors file")
            header_len = int.from_bytes(head, "little")
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"a header of {header_len} bytes in a {size}-byte file")
            raw = read(8, header_len)
            if len(raw) != header_len:
                raise ValueError("the file ends inside its header")
            meta, entries = _parse_header(raw, size - 8 - header_len, 8 + header_len)
        except ValueError as e:  # a zero-length, truncated or foreign file
            raise SnapshotMismatch(f"unreadable: {e}") from e
        self._check_metadata(meta, token_ids)
        self._check_tensors({k: (e.dtype_name, e.shape) for k, e in entries.items()}, SnapshotMismatch)
        return meta, entries

    def encode(self, name: str, token_ids: Sequence[int], kv: dict[str, torch.Tensor]) -> bytes:
        """name's snapshot for these token ids as bytes, what save would write (for another
        replica: decode there). Raises ValueError as save does."""
        tensors, metadata = self._contents(name, token_ids, kv)
        return safetensors_save(tensors, metadata=metadata)

    def decode(self, data: bytes | bytearray | memoryview, token_ids: Sequence[int]) -> SnapshotReader:
        """A snapshot's bytes (encode's, or a file's), its header checked as open checks a file's;
        the reader reads from data, which must outlive it. Raises SnapshotMismatch as load does."""
        view = memoryview(data).cast("B")
        meta, entries = self._header(lambda offset, n: bytes(view[offset:offset + n]), len(view), token_ids)
        return SnapshotReader(view, None, meta, entries)

    def _read(self, path: Path, token_ids: Sequence[int] | None) -> dict[str, torch.Tensor]:
        """The file's tensors, every check of load passed (token ids None: those not checked)."""
        with self._open(path, token_ids) as reader:
            return reader.read()

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
            except OSError as e:  # a folder this process cannot change (read-only, another account's): loads go on
                log.warning("cannot remove %s, left by an interrupted snapshot save: %s", stale, e)
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

    def _check_tensors(self, tensors: Mapping[str, tuple[str, Sequence[int]]], error: type[Exception]) -> None:
        """Every tensor (its dtype name and shape) [blocks, block_size, heads, head_dim] of
        key.dtype, all with the same blocks."""
        if not tensors:
            raise error("holds no tensors")
        for k, (dtype, shape) in sorted(tensors.items()):
            if dtype != self.key.dtype:
                raise error(f"tensor {k} is {dtype}, expected {self.key.dtype}")
            if len(shape) != 4 or shape[1] != self.key.block_size:
                raise error(f"tensor {k} has shape {tuple(shape)}, expected "
                            f"[blocks, {self.key.block_size}, heads, head_dim]")
        blocks = sorted({shape[0] for _, shape in tensors.values()})
        if len(blocks) != 1:
            raise error(f"tensors of different block counts {blocks}")
