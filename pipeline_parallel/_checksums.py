"""The size and SHA-256 of each file of a checkpoint, recorded when it is saved and compared before it is loaded, so
that a file damaged since (bits flipped, cut short, replaced or lost) is named instead of loaded. A file added
beside them is no damage: a load reads only the files .metadata names, and .metadata is checked."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20  # bytes hashed at a time: a file of any size is streamed, never held whole


def file_record(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of the file at `path`."""
    digest, size, chunk = hashlib.sha256(), 0, bytearray(_CHUNK)
    with open(path, "rb") as f:
        while count := f.readinto(chunk):
            digest.update(memoryview(chunk)[:count])
            size += count
    return {"bytes": size, "sha256": digest.hexdigest()}


def differences(directory: Path, record: dict[str, dict] | None, share: tuple[int, int] = (0, 1)) -> list[str]:
    """How checkpoint `directory` differs from the `record` of its files (name -> `file_record`) taken when it was
    saved; empty if it does not, or if there is no record (None) to compare with.

    Files lost or of another size are found from the listing, alike by every caller.
    Only if there are none are the files read: the `share` (rank, world_size) of them this caller hashes, the largest
    dealt out first, so that the ranks of a group read every file once between them.
    """
    if record is None:
        return []
    try:
        sizes = {entry.name: entry.stat().st_size for entry in os.scandir(directory)}
    except OSError as e:
        return [f"its files cannot be listed: {e}"]
    problems = [f"it lacks {name}" for name in sorted(record.keys() - sizes.keys())]
    problems += [f"its file {name} has {sizes[name]:,} bytes where {saved['bytes']:,} were saved"
                 for name, saved in sorted(record.items()) if name in sizes and sizes[name] != saved["bytes"]]
    if problems:
        return problems
    rank, world_size = share
    for name in sorted(record, key=lambda name: (-record[name]["bytes"], name))[rank::world_size]:
        try:
            changed = file_record(directory / name)["sha256"] != record[name]["sha256"]
        except OSError as e:
            problems.append(f"its file {name} cannot be read: {e}")
            continue
        if changed:
            problems.append(f"its file {name} has changed since it was saved (its SHA-256 is not the one recorded)")
    return problems
