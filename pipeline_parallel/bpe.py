"""The run's tokenizer: the user's, or a byte-level BPE trained on the data once and kept in the run directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Iterator

from ._files import atomic_write
from .tokenizer import EOS_TOKEN, TOKENIZER_FILE, Tokenizer, load_tokenizer

TRAINED_WITH_FILE = "tokenizer-trained-with.json"  # beside a tokenizer trained in run_dir: the settings it took

_LONG_RUN = re.compile(r"\S{1024}|\s{1024}")  # a stretch of a run of non-space, or of space, characters


def _short_words(text: str) -> Iterator[str]:
    """`text` cut after every 1024 characters of a run without whitespace (or of whitespace alone),
    which the pre-tokenizer would keep as one word: the BPE trainer takes time quadratic in a word's
    length (a million letters took over 9 minutes, where 12 MB of prose take 3 s)."""
    start = 0
    for run in _LONG_RUN.finditer(text):
        yield text[start:run.end()]
        start = run.end()
    yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, max_chars: int | None = 20_000_000) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) with an end-of-text token on `texts`.

    Only the first `max_chars` characters are used: BPE merges settle long before
    that on any real corpus, and it bounds the time (about 3 s for 12 MB on 2 cores).
    """
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    seen = 0

    def capped():
        nonlocal seen
        for text in texts:
            if max_chars is not None and seen >= max_chars:
                return
            text = text if max_chars is None else text[: max_chars - seen]
            seen += len(text)
            yield from _short_words(text)

    tok.train_from_iterator(capped(), trainer)
    if seen == 0:
        raise ValueError("no text to train the tokenizer on: every document of the data is empty")
    return Tokenizer(tok, tok.token_to_id(EOS_TOKEN))


def get_tokenizer(
    run_dir: str | Path,
    path: str | Path | None,
    texts: Iterable[str],
    vocab_size: int = 4096,
    tokenizer_train_chars: int | None = 20_000_000,
) -> Tokenizer:
    """The user's tokenizer if `path` is given, else run_dir/tokenizer.json (trained once).

    Reloading the saved file means a resumed run always uses the very same tokenizer. Asking for
    another `vocab_size` or `tokenizer_train_chars` than it was trained with is an error, not ignored.
    """
    if path is not None:
        return load_tokenizer(path)
    saved, record = Path(run_dir) / TOKENIZER_FILE, Path(run_dir) / TRAINED_WITH_FILE
    asked = {"vocab_size": vocab_size, "tokenizer_train_chars": tokenizer_train_chars}
    if saved.is_file():
        trained = _trained_with(record) if record.is_file() else asked  # older runs kept no record
        changed = [key for key in asked if trained.get(key) != asked[key]]
        if changed:
            raise ValueError(
                f"{saved} was trained with {', '.join(f'{k} = {trained.get(k)}' for k in changed)}, and a run "
                f"there reuses it, but {', '.join(f'{k} = {asked[k]}' for k in changed)} is asked for: ask for "
                f"what it was trained with, or use a new run directory for a new tokenizer")
        return load_tokenizer(saved)
    tok = train_bpe(texts, vocab_size, tokenizer_train_chars)
    atomic_write(record, json.dumps(asked) + "\n")  # first: a tokenizer.json never lacks its record
    atomic_write(saved, tok.backend.to_str())  # one self-contained file (its eos is found by name)
    return tok


def _trained_with(record: Path) -> dict:
    """The settings `record` (tokenizer-trained-with.json) says the run's tokenizer was trained with."""
    try:
        trained = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        trained = e
    if not isinstance(trained, dict):
        raise ValueError(f"{record} is damaged ({trained if isinstance(trained, Exception) else 'not a JSON object'}): "
                         f"it records what {record.parent / TOKENIZER_FILE} was trained with; write it again as "
                         '{"vocab_size": N, "tokenizer_train_chars": N} with the values the run was started with, '
                         "or use a new run directory")
    return trained
