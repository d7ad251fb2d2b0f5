"""Training data: read text, tokenise once (cached), pack into sequences, batch resumably."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, Union

import numpy as np
import torch

from ._checks import SURROGATES
from .loss import IGNORE_INDEX
from .bpe import get_tokenizer
from .token_cache import cached_tokens, stream_record
from .tokenizer import Tokenizer

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
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
    named in `skip_dirs` and the directory `skip` skipped. Linked directories are followed, each
    directory read once (a link back up the tree would loop)."""
    found = []
    skip = skip.resolve() if skip is not None else None
    visited = {root.resolve()}
    for parent, dirs, files in os.walk(root, followlinks=True):
        kept = []
        for d in sorted(dirs):  # pruned here, before os.walk goes in, in an order that does not vary
            real = Path(parent, d).resolve()
            if not d.startswith(".") and d not in skip_dirs and real != skip and real not in visited:
                visited.add(real)
                kept.append(d)
        dirs[:] = kept
        found += [Path(parent, f) for f in files if not f.startswith(".") and Path(f).suffix.lower() in suffixes]
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def stdlib_files() -> list[Path]:
    """The standard library's own .py files (no site-packages, no tests): offline default data."""
    skip = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
    return _walk(Path(sysconfig.get_paths()["stdlib"]), {".py"}, skip)


def expand_sources(data: str | Path | Sequence[str | Path] | None, skip: Path | None = None) -> list[Source]:
    """Turn the user's data argument into a sorted list of files and dataset specs.

    None means the Python standard library; a directory is scanned recursively
    (hidden files skipped, sorted) for text, JSONL and Parquet files, leaving out the
    directory `skip` (the run directory, whose metrics and config are not data).
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
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                yield _field(record, field, f"{path}:{lineno}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {field!r}; set text_field to one of {pf.schema_arrow.names}")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path}: column {field!r} holds {type(text).__name__}, not text")
            yield text or ""


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


def _cut_at(buffer: str, max_chars: int) -> int:
    """Where a piece of `buffer` ends: before its last space between two words (in its last 4096
    characters), where byte-level BPE, SentencePiece-style and whitespace pre-tokenizers all end a
    token, so the pieces tokenize as the whole does; else after its last newline; else at `max_chars`."""
    spaces = list(_BETWEEN_WORDS.finditer(buffer, max(1, max_chars - 4096), max_chars + 1))
    if spaces:
        return spaces[-1].start()
    return buffer.rfind("\n", 0, max_chars) + 1 or max_chars


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


def _reader(text: str) -> Callable[[int], str]:
    position = 0

    def read(n: int) -> str:
        nonlocal position
        piece = text[position : position + n]
        position += len(piece)
        return piece

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
        elif src.suffix.lower() in JSONL_SUFFIXES:
            docs = _jsonl_documents(src, text_field)
        elif src.suffix.lower() in PARQUET_SUFFIXES:
            docs = _parquet_documents(src, text_field)
        else:  # a text file: one document, read from the file a piece at a time
            with open(src, encoding="utf-8-sig", errors="replace") as f:  # -sig: a leading BOM is no text
                yield from _without_blank_start(_cut(f.read, max_chars))
            continue
        for doc in docs:
            yield from _without_blank_start(_cut(_reader(doc), max_chars))


def source_key(sources: list[Source], text_field: str) -> dict:
    """What identifies the data for the token cache: paths with size and mtime, dataset specs."""
    def one(src: Source):
        if isinstance(src, str):
            return src
        stat = src.stat()
        return [str(src.resolve()), stat.st_size, stat.st_mtime_ns]

    return {"sources": [one(s) for s in sources], "text_field": text_field}


class Sequences:
    """Sequences of seq_len+1 tokens cut back to back from a (memory-mapped) token stream;
    `rows` selects those of this set (train or held-out)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, rows: np.ndarray | None = None):
        self.seq_len = seq_len
        n = len(tokens) // (seq_len + 1)
        self.table = tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)
        self.rows = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)

    @classmethod
    def from_table(cls, table: torch.Tensor | np.ndarray) -> "Sequences":
        """Wrap a ready [num_sequences, seq_len+1] tensor or array."""
        table = table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
        return cls(table.reshape(-1), table.shape[1] - 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> torch.Tensor:
        """An int gives one [seq_len+1] sequence; an array of ints a [k, seq_len+1] batch (int64)."""
        return torch.from_numpy(self.table[self.rows[index]].astype(np.int64))


def split_sequences(seqs: Sequences, eval_fraction: float = 0.01) -> tuple[Sequences, Sequences]:
    """Hold out `eval_fraction` of the sequences (at least one) for evaluation.

    The held-out ones are evenly spaced through the data, so they sample every part
    of it; the choice depends only on the number of sequences (no randomness).
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(seqs)
    n_eval = 0 if eval_fraction == 0 else max(1, round(n * eval_fraction))
    if n - n_eval < 1:
        raise ValueError(
            f"only {n} sequence(s) of seq_len+1 = {seqs.seq_len + 1} tokens: too few to hold "
            f"{n_eval} out for evaluation and train on the rest; add data, lower seq_len, "
            "raise max_tokens, or set eval_fraction=0"
        )
    held = np.arange(n_eval) * n // n_eval
    mask = np.ones(n, dtype=bool)
    mask[held] = False
    stream = seqs.table.reshape(-1)
    return Sequences(stream, seqs.seq_len, seqs.rows[mask]), Sequences(stream, seqs.seq_len, seqs.rows[held])


def _make_batch(batch: torch.Tensor | None, need_inputs: bool, need_labels: bool):
    inputs = batch[:, :-1].contiguous() if need_inputs else None
    labels = batch[:, 1:].contiguous() if need_labels else None
    return inputs, labels


class TokenBatches:
    """Endless (input_ids, labels) batches [batch_size, seq_len], reshuffled every epoch.

    The order depends only on (seed, epoch), and state_dict() is the exact position,
    so a resumed run sees the batches an uninterrupted one would. Each run of `accum_steps`
    consecutive batches (the pipeline steps of one optimizer step) comes from one epoch, so
    batch_size b with accum_steps a yields the sequences batch_size b * a does. In a pipeline,
    the first stage sets need_labels=False and the last need_inputs=False (None comes
    back instead; a middle stage reads nothing), but every rank must call next() the
    same number of times so their positions stay equal.
    """

    def __init__(self, sequences: Sequences | torch.Tensor | np.ndarray, batch_size: int, seed: int = 0,
                 *, need_inputs: bool = True, need_labels: bool = True, accum_steps: int = 1):
        self.seqs = sequences if isinstance(sequences, Sequences) else Sequences.from_table(sequences)
        if batch_size < 1 or accum_steps < 1:
            raise ValueError(f"batch_size and accum_steps must be at least 1, got {batch_size} and {accum_steps}")
        if len(self.seqs) < batch_size * accum_steps:
            per_step = f"batch_size {batch_size}" + (f" x {accum_steps} accumulated batches" if accum_steps > 1 else "")
            raise ValueError(
                f"{len(self.seqs)} training sequences are fewer than {per_step}; add data (or raise "
                "max_tokens, or lower eval_fraction, if they cap it), or lower batch_size or seq_len"
            )
        self.batch_size, self.accum_steps, self.seed = batch_size, accum_steps, int(seed)
        self.need_inputs, self.need_labels = need_inputs, need_labels
        self.epoch, self.index = 0, 0  # index: sequences of this epoch's order already used
        self._drawn = 0  # batches drawn since the start or a loaded position (where an optimizer step starts)
        self._order_epoch, self._order = None, None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            digest = hashlib.sha256(f"{self.seed}:{self.epoch}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            self._order = torch.randperm(len(self.seqs), generator=gen).numpy()
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        starts_run, left = self._drawn % self.accum_steps == 0, len(self.seqs) - self.index
        if (starts_run and left < self.batch_size * self.accum_steps) or left < self.batch_size:  # the epoch's rest is short
            self.epoch, self.index = self.epoch + 1, 0
        self._drawn += 1
        start, self.index = self.index, self.index + self.batch_size
        if not (self.need_inputs or self.need_labels):
            return None, None
        return _make_batch(self.seqs[self._epoch_order()[start : self.index]], self.need_inputs, self.need_labels)

    def state_dict(self) -> dict[str, int]:
        """Plain ints (JSON-friendly): the position, and what it is only valid for. Take it between
        optimizer steps: a loaded position starts one, whatever `accum_steps` was."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_sequences": len(self.seqs)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_sequences"] != len(self.seqs) or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['num_sequences']} sequences with seed {state['seed']}, but this "
                f"loader has {len(self.seqs)} with seed {self.seed}: resume with the same data, "
                "tokenizer, max_tokens, seq_len, eval_fraction and seed"
            )
        self.epoch, self.index, self._drawn = int(state["epoch"]), int(state["index"]), 0


def eval_batches(sequences: Sequences, batch_size: int, *, need_inputs: bool = True,
                 need_labels: bool = True, pad_to: int = 1) -> Iterator[tuple]:
    """The held-out sequences in a fixed order, the same on every rank, as (inputs, labels,
    num_sequences) batches of batch_size.

    The last batch may hold fewer sequences; it is padded up to a multiple of `pad_to` rows
    (a schedule splits a batch into that many equal microbatches) that repeat its last
    sequence with every label IGNORE_INDEX (-100), so the padding adds nothing to the token-mean loss.
    """
    for start in range(0, len(sequences), batch_size):
        rows = np.arange(start, min(start + batch_size, len(sequences)))
        padded = np.pad(rows, (0, -len(rows) % pad_to), mode="edge")
        batch = sequences[padded] if (need_inputs or need_labels) else None
        inputs, labels = _make_batch(batch, need_inputs, need_labels)
        if labels is not None:
            labels[len(rows):] = IGNORE_INDEX  # the padding rows, if any
        yield inputs, labels, len(rows)


@dataclass
class Data:
    """What a run trains and evaluates on; num_tokens counts the whole stream, digest hashes its contents,
    version is the `STREAM_VERSION` that made it (None: one that recorded none)."""

    tokenizer: Tokenizer
    train: Sequences
    eval: Sequences
    num_tokens: int
    digest: str
    version: int | None


def prepare_data(
    run_dir: str | Path,
    data: str | Path | Sequence[str | Path] | None = None,
    *,
    seq_len: int,
    tokenizer: str | Path | None = None,
    vocab_size: int = 4096,
    text_field: str = "text",
    max_tokens: int | None = None,
    eval_fraction: float = 0.01,
    tokenizer_train_chars: int | None = 20_000_000,
) -> Data:
    """Tokenizer, train and held-out sequences for a run, cached in run_dir.

    data: None (the Python stdlib's .py files), paths to files/directories, or
    hf:NAME[:CONFIG[:SPLIT]]. tokenizer: a tokenizer.json or tokenizer directory; if
    None a byte-level BPE of vocab_size is trained on the first tokenizer_train_chars
    characters and kept as run_dir/tokenizer.json (reused from then on; asking for other
    settings there is an error). max_tokens caps the token stream (train + held-out);
    use it with big datasets. Under torchrun, call this on rank 0 first, barrier, then
    on the other ranks, which then only read the caches rank 0 wrote (files are written
    atomically, so concurrent calls are safe too, merely wasteful).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sources = expand_sources(data, skip=run_dir)  # a run directory inside the data is not data
    texts = (text for text, _ in iter_pieces(sources, text_field))
    tok = get_tokenizer(run_dir, tokenizer, texts, vocab_size, tokenizer_train_chars)
    pieces = iter_pieces(sources, text_field)  # lazy: only read if not cached yet
    tokens = cached_tokens(run_dir, tok, pieces, source_key(sources, text_field), max_tokens)
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the data gives only {len(tokens)} tokens, fewer than one sequence of seq_len+1 = "
            f"{seq_len + 1}; add data, lower seq_len, or raise max_tokens"
        )
    train, held = split_sequences(Sequences(tokens, seq_len), eval_fraction)
    return Data(tok, train, held, len(tokens), *stream_record(tokens))
