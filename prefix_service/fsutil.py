"""Filesystem helpers shared by the files the service writes atomically (the template state file,
template KV snapshots). A leaf module: it imports nothing from the package, so the engine and the
server can both use it without importing each other."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename (or unlink) in `folder` durable: on POSIX the new directory entry is on disk
    only once the folder itself is fsynced, not just the file."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)
