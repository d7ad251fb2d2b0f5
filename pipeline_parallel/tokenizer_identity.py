"""Whether a tokenizer is the one a checkpoint or an export recorded, and if not, how it differs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json

from ._files import json_hash
from .tokenizer import TOKENIZER_FILE, Tokenizer, read_tokenizer_json


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """What a checkpoint or an export records of the tokenizer it was made with, for `tokenizer_differences`."""
    return {"tokenizer": tokenizer.fingerprint(), "tokenizer_parts": tokenizer.fingerprint_parts,
            "transformers_version": _transformers_version()}


def tokenizer_differences(tokenizer: Tokenizer, record: dict) -> list[str]:
    """The parts of `tokenizer` (see `Tokenizer.fingerprint_parts`) that differ from those of the tokenizer
    `record` (a `tokenizer_record`) names: none if it is that one, or the record names none. "vocabulary" is
    among them for another tokenizer, and is not for one that, as loaded now, tokenizes text differently.

    A record of an earlier version holds the fingerprint alone, of an earlier form (`_old_fingerprints`);
    the parts are those of the form it names, if it names one: the tokenizer as loaded now, or its
    tokenizer.json read as written (which transformers 4 did, and transformers 5 may not)."""
    recorded, now = record.get("tokenizer"), tokenizer.fingerprint_parts
    if recorded is None or recorded == tokenizer.fingerprint():
        return []
    then = record.get("tokenizer_parts") or next(
        (form.fingerprint_parts for form in _forms(tokenizer) if recorded in _old_fingerprints(form)), {})
    return [name for name in now if then.get(name) != now[name]]


def loads_differently(differences: list[str], record: dict) -> str:
    """The end of a message on a tokenizer whose `differences` from the one `record` names leave out its
    vocabulary, after "has the vocabulary of the tokenizer ...": it tokenizes text differently as loaded now, as
    a Llama tokenizer.json does that transformers 5 rebuilds with another pre-tokenizer; and what to do."""
    then, now = record.get("transformers_version"), _transformers_version()
    how = (f"load it with transformers {then}, which it was recorded under (this is {now})" if then and then != now
           else "load it as it was loaded then (transformers 5 can read a tokenizer directory and its tokenizer.json "
                "alone differently), or, if its files were edited since, put them back as they were")
    differ = " and ".join(filter(None, [", ".join(differences[:-1]), differences[-1]]))
    return (f"but tokenizes text differently as loaded now: its {differ} differ{'s' if len(differences) == 1 else ''}, "
            f"so the model would be given other ids for the same text; {how}")


def _forms(tokenizer: Tokenizer) -> list[Tokenizer]:
    """`tokenizer`, and the tokenizer.json of the directory it was loaded from as the tokenizers library reads it."""
    source = tokenizer.source
    if source is None or not (source / TOKENIZER_FILE).is_file():
        return [tokenizer]
    return [tokenizer, Tokenizer(read_tokenizer_json(source / TOKENIZER_FILE), tokenizer.eos_id)]


def _old_fingerprints(form: Tokenizer) -> set[str]:
    """The fingerprints of `form` in checkpoints saved by earlier versions: the hash of its JSON as loaded (before
    fingerprints were canonical), and of that JSON without its post-processor (before equal forms hashed alike)."""
    if form.backend is None:
        return {hashlib.sha256(repr(sorted(form.hf.get_vocab().items())).encode()).hexdigest()}
    spec = json.loads(form.backend.to_str())
    spec.pop("post_processor", None)
    return {hashlib.sha256(form.backend.to_str().encode()).hexdigest(),
            json_hash({"definition": spec, "document_ends": form.document_ends, "eos_id": form.eos_id})}
