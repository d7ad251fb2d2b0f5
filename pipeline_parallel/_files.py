"""Files written whole or not at all, so a reader (another rank, a resumed run) never sees half of one, and
hashed whole, so a reader can tell one changed since."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path


def json_hash(value) -> str:
    """The SHA-256 (hex) of `value` as JSON with sorted keys: equal for equal values, whatever their keys' order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


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


def replace_dir(tmp: Path, path: Path, aside: Path | None = None) -> None:
    """Rename the filled directory `tmp` onto `path`. What `path` held is moved `aside` first (default: a
    hidden name of this host and process beside `path`, so no one's directory) and removed last, so an
    interruption at any moment leaves a whole directory at `path`, the old or the new; a crash between the
    two renames leaves the old one at `aside`."""
    aside = aside or path.with_name(temporary_path(path).name.removesuffix(".tmp") + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        if path.exists():
            os.replace(path, aside)
        os.replace(tmp, path)
    finally:
        if aside.exists() and not path.exists():  # interrupted between the renames: the old one goes back
            os.replace(aside, path)
        fsync_dir(path.parent)
        shutil.rmtree(aside, ignore_errors=True)


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


def room_note(path: Path) -> str:
    """"; N GB free on its disk" for `path`, to add to a message on a failed write: a full disk often fails with
    words that do not say so (torch's "unexpected pos 704 vs 598"); "" where that cannot be told."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f"; {free / 2**30:,.1f} GB free on its disk" if free >= 2**30 else f"; {free / 2**20:,.1f} MB free on its disk"


_CHUNK = 1 << 20  # bytes hashed at a time: a file of any size is streamed, never held whole


def file_record(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of the file at `path`."""
    digest, size, chunk = hashlib.sha256(), 0, bytearray(_CHUNK)
    with open(path, "rb") as f:
        while count := f.readinto(chunk):
            digest.update(memoryview(chunk)[:count])
            size += count
    return {"bytes": size, "sha256": digest.hexdigest()}
