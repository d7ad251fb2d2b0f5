"""The token stream of a run, cached in run_dir: tokenised once, memory-mapped, checked for damage."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ._files import atomic_write, file_record, fsync_dir, json_hash, temporary_path
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_PATTERN = "tokens-*.bin"  # the token caches in a run directory; what marks a directory as a run's
CACHE_VERSION = 2  # bump when what a token file holds changes (2: the tokenizer's own BOS, markers as text)
# What this program makes of a text: a new version when the same text and tokenizer give other tokens, with what
# changed (sources.PIECE_CHARS is the million). It is recorded with each cache and checkpoint, so that a resume tells a
# stream tokenized otherwise from other data, and unlike CACHE_VERSION it leaves cache names alone: a run keeps the
# stream its checkpoints were trained on.
STREAM_CHANGES = {3: "cuts a document over a million characters between words and puts no space before its later pieces",
                  4: "cuts such a document, where a stretch has no space between words, before the whitespace ahead "
                     "of a word, where it cut after a newline"}
STREAM_VERSION = max(STREAM_CHANGES)


def stream_record(tokens: np.memmap) -> tuple[str, int | None]:
    """SHA-256 of a cached token stream's contents, recorded beside its file when it was written, and the
    STREAM_VERSION that wrote it (None: a version that recorded none).

    Unlike the cache's name (which knows paths and modification times), the hash names what a run
    trains on, so a resume can tell the data of its checkpoint from other data.
    """
    path = Path(tokens.filename)
    digest, _, version = _read_record(path) or _record(path, file_record(path)["sha256"], len(tokens))
    return digest, version


# "sha256 count version"; earlier versions wrote the hash alone, then with the count
_RECORD = re.compile(r"([0-9a-f]{64})(?: ([0-9]+)(?: ([0-9]+))?)?")


def _read_record(path: Path) -> tuple[str, int | None, int | None] | None:
    """The (sha256, token count, STREAM_VERSION) recorded for the token cache `path` (a cache of an earlier
    version recorded no count or version), or None; a ValueError if the record is no such line (cut short, edited)."""
    kept = path.with_suffix(".sha256")
    if not kept.is_file():
        return None
    record = _RECORD.fullmatch(kept.read_text(errors="replace").strip())
    if record is None:
        raise ValueError(f"{kept} is not a record of a token cache")
    digest, count, version = record.groups()
    return digest, int(count) if count else None, int(version) if version else None


def _record(path: Path, digest: str, count: int, version: int | None = None) -> tuple[str, int, int | None]:
    atomic_write(path.with_suffix(".sha256"), f"{digest} {count}" + (f" {version}" if version else "") + "\n")
    return digest, count, version


def _damage(path: Path, dtype) -> str | None:
    """What is wrong with the token cache `path`, judged by its record (a file cut short by hand, or
    by a crash of the machine); None if nothing. A cache whose record holds no count is hashed once
    instead, and its record completed."""
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    try:
        recorded = _read_record(path)
    except ValueError:
        return f"its record {path.with_suffix('.sha256').name} cannot be read"
    if recorded is not None and recorded[1] is not None:
        written = recorded[1] * itemsize
        return None if size == written else f"it holds {size:,} bytes of the {written:,} written"
    if size == 0 or size % itemsize:
        return f"it holds {size:,} bytes, not a whole number of {itemsize}-byte tokens"
    digest = file_record(path)["sha256"]
    if recorded is not None and digest != recorded[0]:
        return "its contents are not those hashed when it was written"
    _record(path, digest, size // itemsize)
    return None


@contextlib.contextmanager
def _writing(path: Path, file):
    """Name the token cache `path` in an OSError of writing `file` for it (a full disk), which names no
    file; `file` is closed then, since closing it later would fail again, with the bare error."""
    try:
        yield
    except OSError as e:
        with contextlib.suppress(OSError):
            file.close()
        raise OSError(f"the token cache {path} cannot be written: {e.strerror or e}; free space there, "
                      "or give a run_dir on another disk") from e


def _batched(pieces: Iterable[tuple[str, bool]], max_chars: int = 1 << 22) -> Iterator[list]:
    """Batches for parallel encoding; they start small so a small max_tokens reads little."""
    batch, chars, limit = [], 0, 1 << 15
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= limit or len(batch) >= 256:
            yield batch
            batch, chars, limit = [], 0, min(2 * limit, max_chars)
    if batch:
        yield batch


def write_tokens(pieces: Iterable[tuple[str, bool]], tokenizer: Tokenizer, path: Path,
                 max_tokens: int | None = None) -> int:
    """Tokenise (text, ends_document) `pieces` into a flat binary file; returns the token count.

    Each document is put between the ids its tokenizer adds around a text (`document_ends`, a
    BOS say) and followed by EOS, which a tokenizer may already add.

    Written to a temporary file first and synced, so a crash never leaves a truncated cache, and
    recorded (hash and token count) beside it, so a cache cut short since is found; the temporary
    files of killed runs on this host are removed (they can be gigabytes).
    """
    dtype = _token_dtype(tokenizer)
    _remove_killed_partials(path.parent)
    tmp = temporary_path(path)
    before, after = tokenizer.document_ends
    after = after if after[-1:] == [tokenizer.eos_id] else after + [tokenizer.eos_id]
    count, starts, digest = 0, True, hashlib.sha256()  # starts: whether the next piece starts a document
    try:
        with open(tmp, "wb") as f:
            for batch in _batched(pieces):
                firsts = [starts] + [ends for _, ends in batch[:-1]]  # which pieces start a document
                starts = batch[-1][1]
                encoded = tokenizer.encode_data([text for text, _ in batch], [not first for first in firsts])
                flat = []
                for piece, first, (_, ends) in zip(encoded, firsts, batch):
                    flat += (before if first else []) + piece + (after if ends else [])
                if max_tokens is not None:
                    flat = flat[: max_tokens - count]
                data = np.asarray(flat, dtype=dtype).tobytes()
                with _writing(path, f):
                    f.write(data)
                digest.update(data)
                count += len(flat)
                if max_tokens is not None and count >= max_tokens:
                    break
            with _writing(path, f):
                f.flush()
                os.fsync(f.fileno())
    except BaseException:  # an error or Ctrl-C: no partial file left behind
        tmp.unlink(missing_ok=True)
        raise
    if count == 0:
        tmp.unlink()
        raise ValueError("no text to tokenise: every document of the data is empty; give other data")
    _record(path, digest.hexdigest(), count, STREAM_VERSION)  # first: a cache never lacks its record
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return count


def _remove_killed_partials(directory: Path) -> None:
    """Delete token caches half-written by processes of this host that no longer run (killed, so
    they could not clean up); another host's, or a live process's, are left alone."""
    host = socket.gethostname()
    for partial in directory.glob(f".tokens-*.{host}.*.tmp"):
        pid = partial.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid we can ask about: keep its file
    return True


def _token_dtype(tokenizer: Tokenizer) -> type:
    """uint16 when every id fits (vocab <= 65536), else uint32: halves the cache size."""
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


def cached_tokens(
    run_dir: str | Path, tokenizer: Tokenizer, pieces: Iterable[tuple[str, bool]], source_key: dict,
    max_tokens: int | None = None,
) -> np.ndarray:
    """The token stream of the documents' (text, ends_document) `pieces`, memory-mapped from
    run_dir; tokenised only on first use.

    The file name is a hash of source_key (what the documents are), max_tokens and the
    full tokenizer, so changing any of them tokenises again. `pieces` is only read then.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive or None (no cap), got {max_tokens}")
    key = {"version": CACHE_VERSION, "source": source_key, "max_tokens": max_tokens, "tokenizer": tokenizer.fingerprint()}
    digest = json_hash(key)[:16]
    dtype = _token_dtype(tokenizer)
    path = Path(run_dir) / CACHE_PATTERN.replace("*", f"{digest}.{np.dtype(dtype).name}")
    damage = _damage(path, dtype) if path.is_file() else None
    if damage:
        logger.warning("token cache %s is damaged (%s): tokenizing the data again", path, damage)
        path.unlink()
    if not path.is_file():
        write_tokens(pieces, tokenizer, path, max_tokens)
    return np.memmap(path, dtype=dtype, mode="r")
