"""The Tokenizer the program uses whatever it was given, its fingerprint, and loading a user's tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ._files import atomic_write, json_hash

EOS_TOKEN = "<|endoftext|>"
# End-of-text tokens we recognise in a bare tokenizer.json, most usual first.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """One interface over a `tokenizers.Tokenizer` or a transformers tokenizer.

    The rest of the program uses only its methods and `vocab_size`/`eos_id`, so it does
    not care whether the tokenizer was trained here or given by the user.
    """

    def __init__(self, backend, eos_id: int, hf=None, source: str | Path | None = None):
        self.backend = backend  # tokenizers.Tokenizer, or None for slow HF tokenizers
        if backend is not None:  # a file's truncation or padding would cut or pad every document silently
            backend.no_truncation()
            backend.no_padding()
        self.hf = hf  # the transformers tokenizer, if that is what was loaded
        self.eos_id = int(eos_id)
        self.source = Path(source) if source is not None else None  # the file or directory it was loaded from

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover (added tokens included): the largest id + 1, which is
        more than the number of tokens where the ids leave a gap (an added token numbered past one)."""
        if self.hf is not None:
            return max(len(self.hf), max(self.hf.get_vocab().values(), default=-1) + 1)
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(len(vocab), max(vocab.values(), default=-1) + 1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, with the BOS (and so on) the tokenizer adds
        of its own accord (see `document_ends`)."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_data(self, texts: list[str], continued: list[bool] | None = None) -> list[list[int]]:
        """Token ids of pieces of training text; parallel (and much faster) with `tokenizers`. A
        special token's text in the data, such as a file quoting "<|endoftext|>", is text: it must
        not end a document where none ends. A text marked `continued` goes on from the one before
        it in a long document, so it is encoded without a space put before it (`_continuing`)."""
        if self.backend is None:
            return [self.hf.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]
        continued = continued or [False] * len(texts)
        ids: list = [None] * len(texts)
        for backend, goes_on in ((self.backend, False), (self._continuing, True)):
            at = [i for i, flag in enumerate(continued) if flag == goes_on]
            for i, encoded in zip(at, _encode_as_text(backend, [texts[i] for i in at])):
                ids[i] = encoded
        return ids

    @functools.cached_property
    def _continuing(self):
        """The backend for a text that goes on from another: without what puts a space before a text
        (SentencePiece-style Metaspace or Prepend "▁", byte-level add_prefix_space), which would add
        one at each piece boundary of a long document."""
        from tokenizers import Tokenizer as RawTokenizer

        spec = json.loads(self.backend.to_str())
        dropped = [_drop_prepends(spec.get("normalizer"), every_part=True),
                   _drop_prepends(spec.get("pre_tokenizer"), every_part=False)]
        if not any(dropped):
            return self.backend
        return RawTokenizer.from_str(json.dumps(spec))

    @functools.cached_property
    def document_ends(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text of its own accord, such as Llama's BOS.

        Training puts them around each document (and EOS after it), so a model sees its texts as
        the exported tokenizer will hand them to it; a tokenizer trained here adds none."""
        plain, full = self.encode("a"), self.encode("a", add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return [], []

    @property
    def bos_id(self) -> int:
        """The token that starts a document: the one the tokenizer puts before a text, else end-of-text
        (which ends the document before)."""
        before = self.document_ends[0]
        return before[0] if len(before) == 1 else self.eos_id

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.hf.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        """Hash of what makes this tokenizer's ids, to key caches of tokenised data and to tell the
        tokenizer a checkpoint was trained with from another; the same however the tokenizer is given.

        It hashes the tokenizer.json in one form (`_canonical`), whether transformers 5 rebuilt it from its
        vocabulary or not. The post-processor counts by the ids it puts around a text (`document_ends`), all
        that training takes of it: transformers gives a tokenizer.json it loads a no-op one in place of
        none, so its JSON differed between a tokenizer and its saved copy. The end-of-text id counts too."""
        return self._fingerprint

    @functools.cached_property
    def _description(self) -> dict:
        """What `fingerprint` hashes (a slow tokenizer, with no tokenizer.json, by its vocabulary)."""
        definition = (sorted(self.hf.get_vocab().items()) if self.backend is None
                      else _canonical(json.loads(self.backend.to_str())))
        return {"definition": definition, "document_ends": self.document_ends, "eos_id": self.eos_id}

    @functools.cached_property
    def _fingerprint(self) -> str:
        """`fingerprint`, taken once (it reads the whole vocabulary; every checkpoint records it)."""
        return json_hash(self._description)

    @functools.cached_property
    def fingerprint_parts(self) -> dict[str, str]:
        """A hash of each part of what `fingerprint` hashes, vocabulary first, under the name a message gives it.
        A checkpoint records them, so that a tokenizer with the vocabulary it was trained with that tokenizes
        differently as loaded now is told from another tokenizer (`tokenizer_differences`)."""
        described = self._description
        definition = described["definition"]
        if isinstance(definition, list):  # a slow tokenizer's vocabulary
            parts = {"vocabulary": definition}
        else:
            model = dict(definition["model"])
            vocabulary = [model.pop("vocab", None), [(token["id"], token["content"]) for token in definition["added_tokens"]]]
            parts = {"vocabulary": vocabulary, "model": model, "added tokens": definition["added_tokens"],
                     "normalizer": definition["normalizer"], "pre-tokenizer": definition["pre_tokenizer"],
                     "decoder": definition["decoder"]}
        parts["document ends"] = [described["document_ends"], described["eos_id"]]
        return {name: json_hash(part) for name, part in parts.items()}

    def save(self, directory: str | Path, model_max_length: int | None = None) -> None:
        """Write files that both `load_tokenizer(directory)` and `transformers.AutoTokenizer`
        (4.x and 5.x) load as this tokenizer, its end-of-text token included, with
        `model_max_length` unless the tokenizer already has its own."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.hf is not None and self.hf.eos_token_id == self.eos_id:  # a complete HF tokenizer
            own = self.hf.model_max_length
            if model_max_length and own >= 1e29:  # transformers' stand-in for none: users would not be warned
                self.hf.model_max_length = model_max_length
            try:
                self.hf.save_pretrained(directory)
            finally:
                self.hf.model_max_length = own
            return
        atomic_write(directory / TOKENIZER_FILE, self.backend.to_str())
        eos, bos = self.backend.id_to_token(self.eos_id), self.backend.id_to_token(self.bos_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos}
        if model_max_length:
            config["model_max_length"] = model_max_length
        atomic_write(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def _canonical(spec: dict) -> dict:
    """A tokenizer.json's `spec` without what makes no ids, so that equal tokenizers hash alike: its post-processor
    (see `Tokenizer.fingerprint`), and model settings that cannot change an id, which transformers 5 leaves out
    where it rebuilds a tokenizer from its vocabulary: an unknown token where every byte has a token to fall back
    on (a Llama tokenizer's "<unk>"), and empty subword affixes (a GPT-2 tokenizer's)."""
    spec = {key: value for key, value in spec.items() if key != "post_processor"}
    model = spec["model"] = dict(spec["model"])
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) == "":
            model[key] = None
    vocab = model.get("vocab")
    tokens = vocab if isinstance(vocab, dict) else {entry[0] for entry in vocab or []}  # Unigram: [token, score]
    if model.get("byte_fallback") and all(f"<0x{byte:02X}>" in tokens for byte in range(256)):
        model.pop("unk_token", None)
        model.pop("fuse_unk", None)
    return spec


def _encode_as_text(backend, texts: list[str]) -> list[list[int]]:
    """`backend`'s ids of `texts` with no special tokens added, nor read from the text."""
    fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
    as_text = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        return [e.ids for e in fast(texts, add_special_tokens=False)]
    finally:
        backend.encode_special_tokens = as_text


# The tokenizer.json parts that put a space before a text, and the setting that stops them.
_PREPENDS = {"Metaspace": ("prepend_scheme", "never"), "ByteLevel": ("add_prefix_space", False),
             "Prepend": ("prepend", "")}


def _drop_prepends(node, every_part: bool) -> bool:
    """Stop the parts of a tokenizer.json's normalizer or pre-tokenizer `node` that see a text whole from
    putting a space before it (in place); whether any did. Every part of a normalizer Sequence sees the
    whole text (`every_part`); of a pre-tokenizer Sequence only the first: the parts after it see the words
    it split (T5's Metaspace after WhitespaceSplit), and put "▁" before each word, as in the whole document."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == "Sequence":
        parts = node.get("normalizers") or node.get("pretokenizers") or []
        return any([_drop_prepends(part, every_part) for part in (parts if every_part else parts[:1])])
    key, off = _PREPENDS.get(node.get("type"), (None, None))
    if key is None or node.get(key, off) == off:
        return False
    node[key] = off
    return True


def _from_tokenizers(backend, source) -> Tokenizer:
    for name in _EOS_CANDIDATES:
        eos_id = backend.token_to_id(name)
        if eos_id is not None:
            return Tokenizer(backend, eos_id, source=source)
    raise ValueError(
        f"tokenizer {source} has no end-of-text token (looked for {', '.join(_EOS_CANDIDATES)}); "
        "give a tokenizer directory whose tokenizer_config.json sets eos_token, or omit the "
        "tokenizer to train one on the data"
    )


# The files a tokenizer directory is loaded from: fast, SentencePiece, byte-level BPE, WordPiece.
_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json` file, or a directory `AutoTokenizer` can load offline."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer path {path} does not exist; give a tokenizer.json file or a local "
            "tokenizer directory (hub names cannot be downloaded here), or omit it to train one"
        )
    if path.is_file():
        return _from_tokenizers(read_tokenizer_json(path), path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):  # transformers 5 would give an empty one
        raise ValueError(
            f"directory {path} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); a model saved "
            "without its tokenizer needs one: copy the tokenizer's files into it, or in training give data.tokenizer")
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        if (path / TOKENIZER_FILE).is_file():  # a bare tokenizer.json with no config
            return _from_tokenizers(read_tokenizer_json(path / TOKENIZER_FILE), path)
        raise ValueError(f"could not load a tokenizer from directory {path}: {e}") from e
    backend = getattr(hf, "backend_tokenizer", None)
    eos_id = hf.eos_token_id
    if eos_id is None and backend is not None:
        eos_id = _from_tokenizers(backend, path).eos_id
    if eos_id is None:
        raise ValueError(f"tokenizer {path} has no eos_token; set one in its tokenizer_config.json")
    return Tokenizer(backend, eos_id, hf=hf, source=path)


def read_tokenizer_json(path: Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json file, or a ValueError that says what the file is not."""
    from tokenizers import Tokenizer as RawTokenizer

    try:
        return RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(
            f"tokenizer file {path} is not a tokenizer.json that the tokenizers library reads ({e}); give a "
            "tokenizer.json, or the directory of a Hugging Face tokenizer (tokenizer_config.json with "
            "tokenizer.model, vocab.json, ...)") from e
