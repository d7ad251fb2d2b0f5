"""Training documents: where they come from (files, directories, datasets), read and cut into pieces."""

from __future__ import annotations

import io
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, Union

from ._checks import SURROGATES
from .token_cache import CACHE_PATTERN

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
# A file named directly with this suffix is read as JSON Lines too (what `datasets`' to_json writes);
# a directory's .json files are left alone (configs, tokenizers).
_NAMED_JSONL_SUFFIXES = JSONL_SUFFIXES | {".json"}
PARQUET_SUFFIXES = {".parquet"}
# Suffixes picked up when scanning a directory; a file named directly is read whatever its suffix.
TEXT_SUFFIXES = {
    ".txt", ".md", ".rst", ".tex", ".html", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp",
    ".rs", ".go", ".java", ".js", ".ts", ".sh", ".toml", ".yaml", ".yml",
}
HF_PREFIX = "hf:"  # "hf:NAME[:CONFIG[:SPLIT]]" is a dataset loaded with the `datasets` library

Source = Union[Path, str]  # a local file, or an "hf:..." dataset spec


def _walk(root: Path, suffixes: set[str], skip_dirs: frozenset = frozenset(), skip: Path | None = None) -> list[Path]:
    """Files under root with one of `suffixes`, sorted by relative path; hidden ones, directories
    named in `skip_dirs`, the directory `skip` and training runs' directories skipped. Linked
    directories are followed, each directory read once (a link back up the tree would loop), and
    each file once (the first of its paths), regular files only (a FIFO would block the read)."""
    found, seen = [], set()
    skip = skip.resolve() if skip is not None else None
    visited = {root.resolve()}
    for parent, dirs, files in os.walk(root, followlinks=True):
        kept = []
        for d in sorted(dirs):  # pruned here, before os.walk goes in, in an order that does not vary
            real = Path(parent, d).resolve()
            if (not d.startswith(".") and d not in skip_dirs and real != skip and real not in visited
                    and not _is_run_dir(real)):
                visited.add(real)
                kept.append(d)
        dirs[:] = kept
        found += [Path(parent, f) for f in files if not f.startswith(".") and Path(f).suffix.lower() in suffixes]
    found.sort(key=lambda f: f.relative_to(root).as_posix())
    kept = []
    for path in found:
        real = path.resolve()
        if real not in seen and real.is_file():
            seen.add(real)
            kept.append(path)
    return kept


def _is_run_dir(path: Path) -> bool:
    """Whether `path` is a training run's directory (it holds token caches): its config, metrics and tokenizer are
    what training wrote, not data."""
    return any(path.glob(CACHE_PATTERN))


def stdlib_files() -> list[Path]:
    """The standard library's own .py files (no site-packages, no tests): offline default data."""
    skip = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
    return _walk(Path(sysconfig.get_paths()["stdlib"]), {".py"}, skip)


def expand_sources(data: str | Path | Sequence[str | Path] | None, skip: Path | None = None) -> list[Source]:
    """Turn the user's data argument into a sorted list of files and dataset specs.

    None means the Python standard library; a directory is scanned recursively
    (hidden files skipped, sorted) for text, JSONL and Parquet files, leaving out the
    directory `skip` (this run's directory, whose metrics and config are not data, before it
    holds token caches) and every directory of a run (one that holds token caches).
    """
    if data is None:
        return stdlib_files()
    items = [data] if isinstance(data, (str, Path)) else list(data)
    if not items:
        raise ValueError("no data sources given; pass a path, hf:NAME, or None for the stdlib default")
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
    sources: list[Source] = []
    for item in items:
        if isinstance(item, str) and item.startswith(HF_PREFIX):
            sources.append(item)
            continue
        path = Path(item).expanduser()
        if path.is_dir() and ((skip is not None and path.resolve() == skip.resolve()) or _is_run_dir(path)):
            raise ValueError(f"data path {path} is a training run's directory: its config, metrics and token caches "
                             "are what training wrote, not data; give the directory or files of your text")
        if path.is_file():
            sources.append(path)
        elif path.is_dir():
            found = _walk(path, known, skip=skip)
            if not found:
                raise ValueError(f"no data files under directory {path}; looked for {sorted(known)}")
            sources.extend(found)
        else:
            raise FileNotFoundError(
                f"data path {path} does not exist; give an existing file or directory, "
                f"or {HF_PREFIX}NAME to load a dataset with the `datasets` library"
            )
    return sources


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        shown = json.dumps(record)
        raise ValueError(f"{where}: {shown[:60]}{'...' if len(shown) > 60 else ''} is not an object with a {field!r} "
                         f"field; each record must be one, such as {json.dumps({field: '...'})}")
    if field not in record:
        raise ValueError(f"{where}: no field {field!r}; set text_field to one of {sorted(record)}")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} is {type(text).__name__}, not text")
    # An unpaired surrogate escape ("\ud800", half an emoji) is JSON's undecodable byte: replaced, as those are.
    return SURROGATES.sub("\ufffd", text) if text else ""


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # as text files: one odd byte cannot stop a run
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); a JSON data file holds one object per "
                                     "line (JSON Lines), such as {\"text\": \"...\"}") from None
                yield _field(record, field, f"{path}:{lineno}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    import pyarrow

    try:  # errors reading the file name it: a partial download, a damaged or foreign file
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            raise ValueError(f"{path}: no column {field!r}; set text_field to one of {names}")
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"{path}: column {field!r} holds {type(text).__name__}, not text")
                yield text or ""
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{path} is no readable Parquet file ({e}); download or write it again, or leave it "
                         "out of data.path") from None


def _hf_documents(spec: str, field: str) -> Iterator[str]:
    name, config, split = (spec[len(HF_PREFIX):].split(":") + [None, None])[:3]
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {spec} needs the `datasets` library: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as e:
        raise OSError(
            f"the `datasets` library could not load {name!r} ({type(e).__name__}: {e}); check the "
            "name and the network, or save the data to local files and give their path"
        ) from e
    for i, record in enumerate(ds):
        yield _field(record, field, f"{spec} row {i}")


PIECE_CHARS = 1 << 20  # documents are handled in pieces of at most this many characters


_BETWEEN_WORDS = re.compile(r"(?<=\S) (?=\S)")  # a space with a word on either side
_BEFORE_WORD = re.compile(r"\s(?=\S)")  # the last whitespace character before a word


def _cut_at(buffer: str, max_chars: int) -> int:
    r"""Where a piece of `buffer` ends, looking in its last 4096 characters: before its last space between
    two words, where byte-level BPE, SentencePiece-style and whitespace pre-tokenizers all end a token, so
    the pieces tokenize as the whole does; else before the last whitespace character ahead of a word (a
    byte-level BPE splits a run of whitespace there, as `\s+(?!\S)` leaves the run's last character to the
    word or to a token of its own); else at `max_chars`."""
    for boundary in (_BETWEEN_WORDS, _BEFORE_WORD):
        found = list(boundary.finditer(buffer, max(1, max_chars - 4096), max_chars + 1))
        if found:
            return found[-1].start()
    return max_chars


def _cut(read: Callable[[int], str], max_chars: int) -> Iterator[tuple[str, bool]]:
    """One document as (text, ends_document) pieces of at most `max_chars`, cut by `_cut_at`;
    `read(n)` gives up to n more characters, "" at the end."""
    buffer = read(max_chars + 1)
    while len(buffer) > max_chars:
        cut = _cut_at(buffer, max_chars)
        yield buffer[:cut], False
        buffer = buffer[cut:]
        buffer += read(max_chars + 1 - len(buffer))
    yield buffer, True


def _text_read(f, path: Path) -> Callable[[int], str]:
    """`f.read`, refusing a file that starts as no text does, with a NUL character (compressed, binary or
    UTF-16 data, which UTF-8 decoding with replacement would turn into garbage to train on)."""
    first = True

    def read(n: int) -> str:
        nonlocal first
        text = f.read(n)
        if first and "\x00" in text:
            raise ValueError(f"{path} holds binary data, not UTF-8 text (a NUL byte in its first {len(text):,} "
                             "characters): decompress or convert it, or give text, JSONL or Parquet files")
        first = False
        return text

    return read


def _without_blank_start(pieces: Iterator[tuple[str, bool]]) -> Iterator[tuple[str, bool]]:
    """A document's pieces from its first non-blank one on: a blank document yields nothing."""
    started = False
    for text, ends in pieces:
        started = started or bool(text.strip())
        if started:
            yield text, ends


def iter_pieces(sources: Iterable[Source], text_field: str = "text",
                max_chars: int = PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """Every non-blank document, in order, as (text, ends_document) pieces of at most `max_chars`
    characters: a whole text file is one document, a JSONL line one, a Parquet row one...

    A text file is read a piece at a time, so memory stays bounded whatever its size. Text files
    are decoded as UTF-8 (a byte-order mark at the start dropped) with undecodable bytes replaced,
    so one odd file cannot stop a long run.
    """
    for src in sources:
        if isinstance(src, str):
            docs = _hf_documents(src, text_field)
        elif src.suffix.lower() in _NAMED_JSONL_SUFFIXES:
            docs = _jsonl_documents(src, text_field)
        elif src.suffix.lower() in PARQUET_SUFFIXES:
            docs = _parquet_documents(src, text_field)
        else:  # a text file: one document, read from the file a piece at a time
            with open(src, encoding="utf-8-sig", errors="replace") as f:  # -sig: a leading BOM is no text
                yield from _without_blank_start(_cut(_text_read(f, src), max_chars))
            continue
        for doc in docs:
            yield from _without_blank_start(_cut(io.StringIO(doc).read, max_chars))


def source_key(sources: list[Source], text_field: str) -> dict:
    """What identifies the data for the token cache: paths with size and mtime, dataset specs."""
    def one(src: Source):
        if isinstance(src, str):
            return src
        stat = src.stat()
        return [str(src.resolve()), stat.st_size, stat.st_mtime_ns]

    return {"sources": [one(s) for s in sources], "text_field": text_field}
