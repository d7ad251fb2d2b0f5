"""A checkpoint's files as DCP writes and reads them: read without unpickling arbitrary code, and each one's size
and SHA-256 recorded when it is saved and compared before it is loaded, so that a file damaged since (bits
flipped, cut short, replaced or lost) is named instead of loaded. A file added beside them is no damage: a load
reads only the files .metadata names, and .metadata is checked."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._files import file_record


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's `.metadata` references something other than DCP metadata types."""


_ALLOWED_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("collections", "OrderedDict"),
    *((mod, cls) for mod in ("pathlib", "pathlib._local")
      for cls in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}
_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the classes DCP writes into `.metadata`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(torch.__dict__.get(name), _TORCH_ENUMS)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata references {module}.{name}, which is not a DCP metadata "
            "type; refusing to unpickle it. The .metadata file is corrupt or was tampered "
            "with: only load checkpoints written by save_checkpoint."
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` unpickling cannot run arbitrary code.

    DCP's own reader calls `pickle.load` on it; this one accepts only DCP metadata
    classes. Tensor data is read by DCP with `torch.load(weights_only=True)`.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RecordingWriter(dcp.FileSystemWriter):
    """FileSystemWriter that records the size and SHA-256 of each file it writes, right after writing it (so from the
    page cache), for meta.json. A failure to record is one of the save's, which DCP raises on every rank."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.files: dict[str, dict] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # done: FileSystemWriter writes before it returns
        self._record(result.storage_data.relative_path for result in future.wait())
        return future

    def finish(self, metadata: Metadata, results: Any) -> None:  # on the coordinator, which writes .metadata
        super().finish(metadata, results)
        self._record([".metadata"])

    def _record(self, names) -> None:
        self.files |= {name: file_record(Path(self.path) / name) for name in sorted(set(names))}


class SafeLoadPlanner(DefaultLoadPlanner):
    """Load planner that decodes non-tensor values (lr, betas, ...) with weights_only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # The parent uses torch.load(weights_only=False): decode safely here, then
        # hand it a fresh encoding of the now known-plain value.
        clean = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def file_differences(directory: Path, record: dict[str, dict] | None, share: tuple[int, int] = (0, 1)) -> list[str]:
    """How checkpoint `directory` differs from the `record` of its files (name -> `file_record`) taken when it was
    saved; empty if it does not, or if there is no record (None) to compare with; a ValueError if `record` is no such
    record.

    Files lost or of another size are found from the listing, alike by every caller.
    Only if there are none are the files read: the `share` (rank, world_size) of them this caller hashes, the largest
    dealt out first, so that the ranks of a group read every file once between them.
    """
    if record is None:
        return []
    if not _well_formed(record):  # else a KeyError on the rank that hashes the file, while the others wait for it
        raise ValueError("its record of the files is not one that save_checkpoint writes")
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


def _well_formed(record: Any) -> bool:
    """Whether `record` is a record of files as `RecordingWriter` takes it (meta.json, edited or with a bit flipped,
    can hold anything)."""
    return isinstance(record, dict) and all(
        isinstance(saved, dict) and type(saved.get("bytes")) is int and isinstance(saved.get("sha256"), str)
        for saved in record.values())
