"""Training data: the documents of sources.py tokenised once (cached), packed into sequences, batched resumably."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .bpe import get_tokenizer
from .loss import IGNORE_INDEX
from .sources import expand_sources, iter_pieces, source_key
from .token_cache import cached_tokens, stream_record
from .tokenizer import Tokenizer


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
                "max_tokens, or lower eval_fraction, if they cap it), or lower batch_size"
                f"{', the accumulated batches' if accum_steps > 1 else ''} or seq_len"
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
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_sequences": len(self.seqs),
                "seq_len": self.seqs.seq_len}

    def load_state_dict(self, state: dict) -> None:
        # seq_len too: another length may make as many sequences of other tokens
        seq_len = state.get("seq_len")  # None: a state saved before it was recorded
        same_length = seq_len in (None, self.seqs.seq_len)
        if not same_length or (state["num_sequences"], state["seed"]) != (len(self.seqs), self.seed):
            then, now = (f" of {seq_len} tokens", f" of {self.seqs.seq_len}") if seq_len is not None else ("", "")
            raise ValueError(
                f"the data position saved is for {state['num_sequences']} sequences{then} with seed {state['seed']}, "
                "but this "
                f"loader has {len(self.seqs)}{now} with seed {self.seed}: resume with the same data, tokenizer, "
                "max_tokens, seq_len, eval_fraction and seed"
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
            f"{seq_len + 1}; add data{', raise max_tokens' if max_tokens and len(tokens) >= max_tokens else ''} or lower "
            "seq_len"
        )
    train, held = split_sequences(Sequences(tokens, seq_len), eval_fraction)
    return Data(tok, train, held, len(tokens), *stream_record(tokens))
