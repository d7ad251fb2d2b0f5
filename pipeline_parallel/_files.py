"""Files written whole or not at all, so a reader (another rank, a resumed run) never sees half of one, and
hashed whole, so a reader can tell one changed since."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path


def temporary_path(path: Path) -> Path:
    """A hidden name beside `path` that no other process uses (host and pid in it), to write into
    before renaming onto `path`."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def temporary_dir(path: Path) -> Path:
    """An empty directory at the `temporary_path` of `path`, to fill before renaming it onto `path`; what a
    killed process of the same host and pid left there is removed, not merged in."""
    tmp = temporary_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` (UTF-8) through a `temporary_path`, then rename it into place: readers
    see the old content or the new, also after a crash."""
    tmp = temporary_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # left only by a failed write
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable (POSIX; elsewhere a rename is as durable as it gets)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_CHUNK = 1 << 20  # bytes hashed at a time: a file of any size is streamed, never held whole


def file_record(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of the file at `path`."""
    digest, size, chunk = hashlib.sha256(), 0, bytearray(_CHUNK)
    with open(path, "rb") as f:
        while count := f.readinto(chunk):
            digest.update(memoryview(chunk)[:count])
            size += count
    return {"bytes": size, "sha256": digest.hexdigest()}
