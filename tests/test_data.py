"""Tests for tokenizers, packing, the held-out split and the resumable loader (sources: test_sources.py)."""

import hashlib
import json
import multiprocessing
import os
import random
import re
import socket
import types

import numpy as np
import pytest
import torch
from _tokenizers import put_around_each_text

from pipeline_parallel import data as D
from pipeline_parallel import sources as S
from pipeline_parallel import token_cache
from pipeline_parallel import tokenizer as T
from pipeline_parallel.bpe import get_tokenizer, train_bpe
from pipeline_parallel.tokenizer import EOS_TOKEN, load_tokenizer
from pipeline_parallel.tokenizer_identity import tokenizer_differences, tokenizer_record

WORDS = "the quick brown fox jumps over a lazy dog while pipeline stages pass tensors along".split()


def make_docs(n=40, words=60, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" doc{i}.\n" for i in range(n)]


def write_texts(dir_, docs):
    dir_.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (dir_ / f"doc{i:03d}.txt").write_text(doc)
    return dir_


# --- tokenizer -----------------------------------------------------------------------------------


def test_trained_tokenizer_reloads_identically(tmp_path):
    docs = make_docs()
    tok = get_tokenizer(tmp_path, None, docs, vocab_size=300)
    assert (tmp_path / "tokenizer.json").is_file()
    assert tok.vocab_size <= 300 and tok.eos_id == tok.backend.token_to_id(EOS_TOKEN)
    # A second call must reuse the saved file, not train again on the texts.
    again = get_tokenizer(tmp_path, None, iter(lambda: 1 / 0, None), vocab_size=300)
    text = docs[0] + "ünïcödé 🙂"
    assert again.encode(text) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text  # byte-level: lossless
    assert again.fingerprint() == tok.fingerprint()


def test_tokenizer_training_is_fed_no_word_longer_than_1024_characters(monkeypatch):
    """A run without whitespace is one word to the pre-tokenizer, and the BPE trainer's time grows with a
    word's length squared (a million letters took over 9 minutes): the trainer gets such runs in pieces."""
    import tokenizers

    from pipeline_parallel.bpe import _short_words

    rng = random.Random(0)
    text = "".join(rng.choice(WORDS) for _ in range(50_000)) + " a b\n" + " " * 3000 + "end"
    words = list(_short_words(text))
    assert "".join(words) == text
    assert max(len(run) for word in words for run in re.findall(r"\S+|\s+", word)) == 1024
    tok = train_bpe([text], vocab_size=1024)
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text) / 4

    fed, raw_tokenizer = [], tokenizers.Tokenizer

    class Recording:
        """A tokenizers.Tokenizer that keeps what its trainer is fed."""

        def __init__(self, model):
            object.__setattr__(self, "raw", raw_tokenizer(model))

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def __setattr__(self, name, value):
            setattr(self.raw, name, value)

        def train_from_iterator(self, texts, trainer):
            fed.extend(texts)
            self.raw.train_from_iterator(fed, trainer)

    monkeypatch.setattr(tokenizers, "Tokenizer", Recording)
    text = "x" * 5000 + " a b\n" + " " * 3000 + "end"
    train_bpe([text], vocab_size=300)
    assert "".join(fed) == text and max(len(run) for piece in fed for run in re.findall(r"\S+|\s+", piece)) == 1024


def test_a_given_tokenizers_truncation_and_padding_do_not_cut_or_pad_the_data(tmp_path):
    docs = make_docs()
    tok = get_tokenizer(tmp_path, None, docs, vocab_size=300)
    full = tok.encode(docs[0])
    tok.backend.enable_truncation(max_length=4)
    tok.backend.enable_padding(length=4096)
    tok.backend.save(str(tmp_path / "cutting.json"))
    given = get_tokenizer(tmp_path, str(tmp_path / "cutting.json"), [], vocab_size=300)
    assert given.encode(docs[0]) == full and given.encode_data([docs[0]]) == [full]


def test_the_vocabulary_size_covers_tokens_added_to_a_tokenizer():
    """Special tokens added to a tokenizer.json after its training (a BOS, a chat marker) have ids past its model's
    vocabulary: the model's embedding, sized by vocab_size, must cover them too, or their ids index past its end."""
    backend = train_bpe(make_docs(), vocab_size=300).backend
    backend.add_special_tokens(["<s>", "<|im_start|>"])
    tok = T.Tokenizer(backend, backend.token_to_id(EOS_TOKEN))
    assert tok.vocab_size == max(backend.token_to_id(name) for name in ("<s>", "<|im_start|>")) + 1


def test_decoding_shows_the_special_tokens_among_the_ids():
    """Decoded ids read as the model sees them: the end-of-text between two documents (or a BOS a model samples
    in the middle of a text) is shown, not dropped, so that the texts do not run together."""
    tok = train_bpe(make_docs(), vocab_size=300)
    assert tok.decode(tok.encode("the end.") + [tok.eos_id] + tok.encode("A new one")) == f"the end.{EOS_TOKEN}A new one"


def test_encoding_data_as_text_leaves_the_tokenizer_reading_special_tokens_elsewhere():
    """Data quoting "<|endoftext|>" is text (encode_data), but only there: a prompt encoded with the same tokenizer
    afterwards still means end-of-text by it, as it does with a tokenizer that encoded no data."""
    tok = train_bpe(make_docs(), vocab_size=300)
    assert tok.eos_id not in tok.encode_data([f"quoting {EOS_TOKEN}"])[0]
    assert tok.encode(EOS_TOKEN) == [tok.eos_id]


def test_a_tokenizer_with_another_decoder_differs_in_its_decoder():
    """A checkpoint's refusal of another tokenizer names the parts that differ; a tokenizer.json whose decoder alone
    was changed (it reads the same ids back into other text) differs in that part, and in no other."""
    from tokenizers import decoders

    tok = train_bpe(make_docs(), vocab_size=300)
    backend = train_bpe(make_docs(), vocab_size=300).backend
    backend.decoder = decoders.Metaspace()
    other = T.Tokenizer(backend, tok.eos_id)
    assert other.fingerprint() != tok.fingerprint()
    assert tokenizer_differences(other, tokenizer_record(tok)) == ["decoder"]


def test_a_message_on_a_tokenizer_that_loads_differently_says_what_differs_and_how_to_load_it():
    """One part "differs", several "differ"; the transformers version to load it with is named only where it is
    not the one running (else the advice would be to load it with the very version that loads it differently)."""
    from pipeline_parallel.tokenizer_identity import _transformers_version, loads_differently

    now = _transformers_version()
    assert loads_differently(["pre-tokenizer"], {"transformers_version": "4.46.3"}).startswith(
        "but tokenizes text differently as loaded now: its pre-tokenizer differs, so the model would be given other "
        f"ids for the same text; load it with transformers 4.46.3, which it was recorded under (this is {now})")
    same = loads_differently(["model", "normalizer", "decoder"], {"transformers_version": now})
    assert "its model, normalizer and decoder differ, so" in same and "load it as it was loaded then" in same
    assert same.endswith("or, if its files were edited since, put them back as they were")  # same version: edited?
    assert f"load it with transformers {now}" not in same


def test_a_vocabulary_smaller_than_the_bytes_and_end_of_text_is_refused():
    """A byte-level BPE needs a token for each of the 256 bytes and one for end-of-text: 257 at the least."""
    with pytest.raises(ValueError, match="vocab_size must be at least 257 .*got 256"):
        train_bpe(make_docs(), vocab_size=256)
    assert train_bpe(make_docs(), vocab_size=257).vocab_size == 257


def test_the_tokenizer_of_an_older_run_that_recorded_no_settings_is_reused(tmp_path):
    """Runs before tokenizer-trained-with.json kept their tokenizer.json alone: a start there reuses it (it cannot
    tell what it was trained with), rather than refusing every setting."""
    trained = get_tokenizer(tmp_path, None, make_docs(), vocab_size=300)
    (tmp_path / "tokenizer-trained-with.json").unlink()
    again = get_tokenizer(tmp_path, None, iter(lambda: 1 / 0, None), vocab_size=280, tokenizer_train_chars=1000)
    assert again.fingerprint() == trained.fingerprint()


def test_a_trained_tokenizer_whose_settings_cannot_be_recorded_is_not_kept(tmp_path, monkeypatch):
    """A tokenizer.json with no record of its settings passes for an older run's, reused whatever is asked: so the
    record is written first, and a start that cannot write it (a full disk) leaves no tokenizer.json; the next start
    trains the one it asks for."""
    from pipeline_parallel import bpe

    write = bpe.atomic_write

    def full_for_the_record(path, text):
        if path.name == bpe.TRAINED_WITH_FILE:
            raise OSError(28, "No space left on device")
        write(path, text)

    monkeypatch.setattr(bpe, "atomic_write", full_for_the_record)
    with pytest.raises(OSError, match="No space left"):
        get_tokenizer(tmp_path, None, make_docs(), vocab_size=300)
    monkeypatch.undo()
    assert get_tokenizer(tmp_path, None, make_docs(), vocab_size=280).vocab_size == 280


def test_a_file_that_is_no_tokenizer_json_is_a_clear_error(tmp_path):
    """Such as a tokenizer_config.json, a SentencePiece model or a cut-off tokenizer.json given as data.tokenizer."""
    good = train_bpe(make_docs(), vocab_size=300).backend.to_str()
    files = {"tokenizer_config.json": '{"eos_token": "</s>"}', "tokenizer.model": b"\x0a\x0b\xff\xfe",
             "cut/tokenizer.json": good[: len(good) // 2]}
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ValueError, match=rf"tokenizer file {re.escape(str(path))} is not a tokenizer.json"):
            load_tokenizer(path)
    with pytest.raises(ValueError, match="is not a tokenizer.json"):  # a directory holding only a cut-off one
        load_tokenizer(tmp_path / "cut")


def test_transformers_tokenizer_directory(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(make_docs(), vocab_size=300)
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=EOS_TOKEN).save_pretrained(tmp_path / "hf")
    loaded = load_tokenizer(tmp_path / "hf")
    assert loaded.hf is not None and loaded.eos_id == tok.eos_id
    loaded.save(tmp_path / "exported", model_max_length=64)  # it had none: the model's is written
    assert load_tokenizer(tmp_path / "exported").hf.model_max_length == 64 and loaded.hf.model_max_length > 1e29
    load_tokenizer(tmp_path / "exported").save(tmp_path / "again", model_max_length=32)  # it has its own: kept
    assert load_tokenizer(tmp_path / "again").hf.model_max_length == 64
    tok.save(tmp_path / "ours", model_max_length=64)  # one trained here: a tokenizer.json and a config naming it
    assert load_tokenizer(tmp_path / "ours").hf.model_max_length == 64
    assert loaded.encode("the lazy dog") == tok.encode("the lazy dog")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "model").mkdir()  # a model saved without its tokenizer: transformers 5 loads an empty one
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="holds no tokenizer .*copy the tokenizer.s files into it, or in training give data.tokenizer"):
        load_tokenizer(tmp_path / "model")


def test_a_tokenizer_directory_whose_config_names_no_eos_token_ends_documents_with_its_end_of_text_token(tmp_path):
    """transformers loads a directory whose tokenizer_config.json sets no eos_token with none: its end-of-text token
    is then found by name, as in a bare tokenizer.json, and a copy saved of it (as the export writes) names it."""
    tok = train_bpe(make_docs(), vocab_size=300)
    (tmp_path / "hf").mkdir()
    tok.backend.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    loaded = load_tokenizer(tmp_path / "hf")
    assert loaded.hf is not None and loaded.hf.eos_token_id is None and loaded.eos_id == tok.eos_id
    loaded.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").hf.eos_token_id == tok.eos_id


def test_a_wordpiece_tokenizer_directory_of_a_vocab_txt_alone_is_loaded(tmp_path):
    """A BERT-style tokenizer directory holds vocab.txt and no tokenizer.json: it is a tokenizer transformers loads,
    not a directory that holds none."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "lazy", "dog", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "eos_token": "[SEP]"}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("the lazy dogs") == [5, 6, 7, 8] and tok.eos_id == 3 and tok.document_ends == ([2], [3])


def test_documents_get_the_special_tokens_the_tokenizer_adds_and_markers_in_the_text_stay_text(tmp_path):
    """Training used to drop a tokenizer's BOS that its export then added for every user, so the model
    never saw the inputs it is given; and a document quoting "<|endoftext|>" got a false end."""
    from transformers import AutoTokenizer

    ours = train_bpe(make_docs(), vocab_size=300)
    assert ours.document_ends == ([], []) and ours.bos_id == ours.eos_id  # a tokenizer trained here adds none
    backend = train_bpe(make_docs(), vocab_size=300).backend
    bos = put_around_each_text(backend, "<s> $A")["<s>"]
    tok = T.Tokenizer(backend, backend.token_to_id(EOS_TOKEN))
    assert tok.document_ends == ([bos], []) and tok.bos_id == bos
    pieces = [("the lazy ", False), ("dog", True), (f"quoting {EOS_TOKEN} here", True)]
    path = tmp_path / "tokens.uint16.bin"
    token_cache.write_tokens(pieces, tok, path)
    as_text = tok.encode_data(["quoting "])[0] + tok.encode_data([EOS_TOKEN])[0] + tok.encode_data([" here"])[0]
    assert tok.eos_id not in as_text
    assert np.fromfile(path, dtype=np.uint16).tolist() == (
        [bos] + tok.encode("the lazy ") + tok.encode("dog") + [tok.eos_id] + [bos] + as_text + [tok.eos_id])
    tok.save(tmp_path / "saved")  # as the export writes it: transformers adds the same BOS, and names it
    auto = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert auto.bos_token_id == bos and auto("dog").input_ids == [bos] + tok.encode("dog")


def _llama_directory(path, legacy: bool = False):
    """A small Llama-style tokenizer directory as Hugging Face saves one: tokenizer.json (BPE with byte fallback, a
    Metaspace pre-tokenizer, or with `legacy` Llama 2's first Prepend("▁") normalizer) and tokenizer_config.json
    naming LlamaTokenizer, which transformers 5 rebuilds from the vocabulary as Metaspace."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    raw.train_from_iterator(make_docs(), trainers.BpeTrainer(vocab_size=300, show_progress=False))
    spec = json.loads(raw.to_str())  # Llama's vocabulary: <unk> <s> </s>, a token for each byte, then the rest
    learned = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + learned
    spec["model"].update(vocab={token: i for i, token in enumerate(vocab)}, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    spec["added_tokens"] = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, token in enumerate(vocab[:3])]
    raw = Tokenizer.from_str(json.dumps(spec))
    if legacy:
        raw.pre_tokenizer = None
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    path.mkdir(parents=True)
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False, "legacy": False}))
    return path


_PROBES = ["the lazy dog", "  two spaces first", "tabs\tand\nlines  ", "ünïcödé 🙂 {x}"]


def _tokenizes(tok) -> list:
    """What `tok` makes of a few texts, as training and sampling take it."""
    return [tok.encode_data(_PROBES), tok.encode_data(_PROBES, [True] * len(_PROBES)), tok.document_ends,
            [tok.decode(tok.encode(text)) for text in _PROBES]]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_llama_tokenizer_has_one_fingerprint_as_a_directory_and_as_its_tokenizer_json(tmp_path, legacy):
    """transformers 5 rebuilds a Llama tokenizer directory from its vocabulary: without the unknown token a byte
    fallback never uses, which gave the same tokenizer another fingerprint than its tokenizer.json alone (and than
    under transformers 4), and so refused its checkpoints as trained with another tokenizer. Llama 2's first
    tokenizer.json, whose normalizer puts "▁" before every text, comes back with a Metaspace pre-tokenizer that
    puts none before one that starts with a space: there the two tokenize differently, and differ in those parts."""
    directory = load_tokenizer(_llama_directory(tmp_path / "llama", legacy))
    alone = load_tokenizer(tmp_path / "llama" / "tokenizer.json")
    same = _tokenizes(directory) == _tokenizes(alone)
    assert same == (directory.fingerprint() == alone.fingerprint())
    assert same or not legacy or tokenizer_differences(directory, tokenizer_record(alone)) == ["normalizer", "pre-tokenizer"]
    if not legacy:
        assert same and directory.vocab_size == alone.vocab_size and directory.document_ends == ([1], [])


def _rebuilt(directory) -> T.Tokenizer:
    """The tokenizer of a `_llama_directory` as transformers 5 loads it: rebuilt from its vocabulary, with no
    unknown token and a Metaspace pre-tokenizer in place of any normalizer (whichever transformers is installed)."""
    from tokenizers import Tokenizer, pre_tokenizers

    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["model"]["unk_token"] = None
    raw = Tokenizer.from_str(json.dumps(spec))
    raw.normalizer = None
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    return T.Tokenizer(raw, raw.token_to_id("</s>"), source=directory)


def _fingerprint_before(tok) -> str:
    """The fingerprint the version before this one recorded: the tokenizer.json as loaded, without its post-processor."""
    spec = json.loads(tok.backend.to_str())
    spec.pop("post_processor")
    canonical = {"definition": spec, "document_ends": tok.document_ends, "eos_id": tok.eos_id}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def test_a_tokenizer_that_tokenizes_differently_as_loaded_now_is_told_from_another(tmp_path):
    """A checkpoint of a Llama 2 tokenizer trained under transformers 4 was refused under 5 as trained with
    'another tokenizer': its vocabulary is the same, and what differs is how transformers 5 loads it. Checkpoints
    record each part's hash and the transformers version, so the refusal names the parts and the version; one
    recorded before holds a fingerprint of the tokenizer.json as written, which tells the same."""
    from pipeline_parallel.config import ConfigError
    from pipeline_parallel.resume import check_resumable

    for legacy in (False, True):
        directory = _llama_directory(tmp_path / f"legacy-{legacy}", legacy)
        as_written, rebuilt = load_tokenizer(directory / "tokenizer.json"), _rebuilt(directory)
        record = {**tokenizer_record(as_written), "transformers_version": "4.46.3"}
        differences = ["normalizer", "pre-tokenizer"] if legacy else []
        assert tokenizer_differences(rebuilt, record) == differences
        assert tokenizer_differences(rebuilt, {"tokenizer": _fingerprint_before(as_written)}) == differences
        assert (rebuilt.fingerprint() == as_written.fingerprint()) == (not legacy)
    assert tokenizer_differences(rebuilt, tokenizer_record(train_bpe(make_docs(), vocab_size=300)))[0] == "vocabulary"
    assert tokenizer_differences(rebuilt, {"tokenizer": "0" * 64}) == list(rebuilt.fingerprint_parts)  # names none
    extra, data = {"model_config": {}, **record}, types.SimpleNamespace(tokenizer=rebuilt, digest="", version=None)
    check_resumable(tmp_path / "step_000001", {**extra, **tokenizer_record(rebuilt)}, {}, data)
    with pytest.raises(ConfigError, match=r"^data.tokenizer has the vocabulary of the tokenizer .*step_000001 was trained "
                       r"with, but tokenizes text differently as loaded now: its normalizer and pre-tokenizer differ, "
                       r"so the model would be given other ids for the same text; load it with transformers 4.46.3, "
                       r"which it was recorded under \(this is .*\); or start a new run_dir$"):
        check_resumable(tmp_path / "step_000001", extra, {}, data)


def test_settings_that_make_no_id_leave_the_fingerprint_alone():
    """An unknown token that byte fallback never reaches, and empty subword affixes, are left out when transformers
    5 rebuilds a tokenizer; where bytes lack tokens (all, or only some) the unknown token makes ids, and counts."""
    from tokenizers import Tokenizer

    def variant(tok, **model):
        spec = json.loads(tok.backend.to_str())
        spec["model"].update(model)
        return T.Tokenizer(Tokenizer.from_str(json.dumps(spec)), tok.eos_id)

    bpe = train_bpe(make_docs(), vocab_size=300)
    assert variant(bpe, continuing_subword_prefix="", end_of_word_suffix="").fingerprint() == bpe.fingerprint()
    llama = _sentencepiece_like("metaspace-first")  # no byte tokens: "ü" is unknown
    with_unk = variant(llama, unk_token="</s>", byte_fallback=True)
    assert variant(llama, byte_fallback=True).fingerprint() != with_unk.fingerprint()
    assert tokenizer_differences(variant(llama, byte_fallback=True), tokenizer_record(with_unk)) == ["model"]
    vocab = json.loads(llama.backend.to_str())["model"]["vocab"]
    some_bytes = {**vocab, **{f"<0x{byte:02X}>": len(vocab) + byte for byte in range(128)}}  # ASCII only: "ü" is unknown
    assert (variant(llama, vocab=some_bytes, byte_fallback=True).fingerprint()
            != variant(llama, vocab=some_bytes, unk_token="</s>", byte_fallback=True).fingerprint())


def _sentencepiece_like(kind: str) -> T.Tokenizer:
    """A small tokenizer that puts "▁" before a text as Llama's and Mistral's do: by a Metaspace pre-tokenizer,
    or (Llama 2's older tokenizer.json) by a normalizer; or before each word, as T5's does."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always" if kind == "metaspace-always" else "first")
    if kind == "t5":  # a "▁" before each word the first part split off, not before the text
        raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Metaspace(prepend_scheme="always")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False)
    raw.train_from_iterator(make_docs(), trainer)
    if kind == "prepend-normalizer":
        raw.pre_tokenizer = None
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return T.Tokenizer(raw, raw.token_to_id("</s>"))


@pytest.mark.parametrize("kind", ["byte-level", "metaspace-first", "metaspace-always", "prepend-normalizer", "t5"])
def test_a_long_document_read_in_pieces_gives_the_tokens_of_the_whole(tmp_path, kind):
    """A SentencePiece-style tokenizer put a "▁" token before every piece (a million characters) of a long document,
    and a byte-level BPE joined differently a line's end and the next line's indentation where a piece was cut;
    a T5-style one, whose "▁" goes before each word, lost it from every word of a piece but the first."""
    tok = train_bpe(make_docs(), vocab_size=300) if kind == "byte-level" else _sentencepiece_like(kind)
    text = "".join("    " * (i % 3) + doc for i, doc in enumerate(make_docs(20)))
    (tmp_path / "long.txt").write_text(text)
    token_cache.write_tokens(S.iter_pieces([tmp_path / "long.txt"], max_chars=64), tok, tmp_path / "tokens.uint16.bin")
    assert np.fromfile(tmp_path / "tokens.uint16.bin", dtype=np.uint16).tolist() == tok.encode(text) + [tok.eos_id]
    if kind == "byte-level":  # no space between words anywhere: cut before the whitespace ahead of a word
        numbers = "".join(f"{n:>10d}\n\n" for n in range(200))
        tok = train_bpe([numbers], vocab_size=300)  # with merges of line ends and indentation
        (tmp_path / "numbers.txt").write_text(numbers)
        token_cache.write_tokens(S.iter_pieces([tmp_path / "numbers.txt"], max_chars=64), tok, tmp_path / "n.bin")
        assert np.fromfile(tmp_path / "n.bin", dtype=np.uint16).tolist() == tok.encode(numbers) + [tok.eos_id]


# --- packing, caching, split ---------------------------------------------------------------------


def test_packing_shapes_and_shifted_labels(tmp_path):
    docs = make_docs()
    prepared = D.prepare_data(tmp_path / "run", write_texts(tmp_path / "txt", docs), seq_len=16, vocab_size=300)
    tok = prepared.tokenizer
    (cache,) = (tmp_path / "run").glob("tokens-*.uint16.bin")
    stream = np.fromfile(cache, dtype=np.uint16)
    assert (stream == tok.eos_id).sum() == len(docs) and stream[-1] == tok.eos_id  # EOS after each doc
    assert stream[: len(tok.encode(docs[0])) + 1].tolist() == tok.encode(docs[0]) + [tok.eos_id]
    assert len(prepared.train) + len(prepared.eval) == prepared.num_tokens // 17
    x, y = next(D.TokenBatches(prepared.train, 4, seed=0))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    seq = prepared.train[0]
    assert seq.shape == (17,) and seq.tolist() == stream[prepared.train.rows[0] * 17 :][:17].tolist()


def test_cache_is_reused_and_max_tokens_caps(tmp_path, monkeypatch):
    src = write_texts(tmp_path / "txt", make_docs())
    first = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
    monkeypatch.setattr(token_cache, "write_tokens", lambda *a, **k: pytest.fail("tokenised again"))
    second = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
    assert second.num_tokens == first.num_tokens and torch.equal(second.train[np.arange(3)], first.train[np.arange(3)])
    monkeypatch.undo()
    capped = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300, max_tokens=100)
    assert capped.num_tokens == 100
    # The hash of the stream's contents, kept beside its cache, tells the data apart for a resume.
    assert second.digest == first.digest != capped.digest and len(list((tmp_path / "run").glob("*.sha256"))) == 2


def test_a_data_file_edited_to_the_same_size_is_tokenized_again(tmp_path, corpus):
    """A file's path and size do not tell an edit apart (a word fixed for one as long): the cache of its old text
    would be trained on. The stream is the one a fresh run directory makes of the new text."""
    src = tmp_path / "data.txt"
    src.write_text("the cat sat on the mat\n" * 50)
    prepare = lambda run_dir: D.prepare_data(run_dir, src, seq_len=8, tokenizer=corpus[1], eval_fraction=0)
    before = prepare(tmp_path / "run")
    src.write_text("the dog sat on the log\n" * 50)
    stat = src.stat()
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later write, on any file system's clock
    after = prepare(tmp_path / "run")
    assert after.digest != before.digest and after.digest == prepare(tmp_path / "fresh").digest


def test_another_text_field_gives_the_documents_of_that_field(tmp_path):
    """data.text_field names what of each JSON line is the document: a run_dir that tokenized one field must not
    hand back that stream (its cache) when another is asked for, and its tokenizer is trained on the field named."""
    rows = [{"title": f"title {i}", "body": doc} for i, doc in enumerate(make_docs(20))]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for field in ("title", "body"):
        prepared = D.prepare_data(tmp_path / "run", tmp_path / "docs.jsonl", seq_len=4, vocab_size=300,
                                  text_field=field, eval_fraction=0)
        tok = prepared.tokenizer
        stream = [token for row in rows for token in tok.encode(row[field]) + [tok.eos_id]]
        assert prepared.num_tokens == len(stream) and prepared.train[np.arange(2)].flatten().tolist() == stream[:10]


def test_a_document_longer_than_a_batch_of_pieces_gives_the_tokens_of_the_whole(tmp_path):
    """Pieces are encoded in batches (of 256 at most): where a document goes on into the next batch, its piece there
    must get neither the BOS of a document's start nor the "▁" a SentencePiece-style tokenizer puts before a text.
    (The documents of the long-document test fit in one batch.)"""
    backend = _sentencepiece_like("metaspace-first").backend
    bos = put_around_each_text(backend, "<s> $A")["<s>"]
    tok = T.Tokenizer(backend, backend.token_to_id("</s>"))
    text = "".join(make_docs(60))
    (tmp_path / "long.txt").write_text(text)
    pieces = list(S.iter_pieces([tmp_path / "long.txt"], max_chars=64))
    assert len(pieces) > 256
    token_cache.write_tokens(pieces, tok, tmp_path / "tokens.uint16.bin")
    assert np.fromfile(tmp_path / "tokens.uint16.bin", dtype=np.uint16).tolist() == [bos] + tok.encode(text) + [tok.eos_id]


def _word_level(vocab: dict[str, int]) -> T.Tokenizer:
    """A tokenizer of whole words with the ids of `vocab`, which holds "<unk>" and the end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([EOS_TOKEN])
    return T.Tokenizer(backend, vocab[EOS_TOKEN])


def test_ids_past_65535_are_kept_whole_in_the_token_cache(tmp_path):
    """A tokenizer of more than 65,536 tokens (Llama 3 has 128,256) needs 32-bit ids in the cache: in 16 bits its
    higher ids would wrap around to other tokens."""
    tok = _word_level({**{f"w{i}": i for i in range(70_000)}, "<unk>": 70_000, EOS_TOKEN: 70_001})
    tokens = token_cache.cached_tokens(tmp_path, tok, [("w1 w65536 w69999", True)], {"sources": ["words"]})
    assert tokens.tolist() == [1, 65_536, 69_999, 70_001]


def test_no_partial_token_cache_is_left_behind(tmp_path, monkeypatch):
    """Interrupted tokenising leaves no temporary file, and one left by a killed run on this host is removed;
    those of running processes, another user's among them, and of other hosts stay."""
    tok = train_bpe(make_docs(), vocab_size=300)
    host = socket.gethostname()
    killed = tmp_path / f".tokens-0123.uint16.bin.{host}.{2**31 - 2}.tmp"  # no such process
    running = tmp_path / f".tokens-0123.uint16.bin.{host}.{os.getpid()}.tmp"
    another_user = tmp_path / f".tokens-0123.uint16.bin.{host}.4242.tmp"
    other_host = tmp_path / f".tokens-0123.uint16.bin.not-{host}.{2**31 - 2}.tmp"
    for partial in (killed, running, another_user, other_host):
        partial.write_bytes(b"\0" * 64)
    real_kill = os.kill

    def kill(pid, signum):  # what asking about another user's process gives
        if pid == 4242:
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, signum)

    monkeypatch.setattr(os, "kill", kill)

    def interrupted():
        yield from ((doc, True) for doc in make_docs())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        token_cache.write_tokens(interrupted(), tok, tmp_path / "tokens-4567.uint16.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, another_user.name, other_host.name])
    with pytest.raises(ValueError, match="no text to tokenise"):  # nothing to write: no file either
        token_cache.write_tokens([], tok, tmp_path / "tokens-4567.uint16.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, another_user.name, other_host.name])


def test_the_partial_token_cache_of_a_killed_process_is_removed_by_the_next_write(tmp_path):
    """A process killed (kill -9) while tokenising leaves its temporary file, gigabytes on a large corpus: the
    next write on the host removes it, which it tells from a live process's file by the pid in its name."""
    tok = train_bpe(make_docs(), vocab_size=300)

    def killed():
        def pieces():
            yield from ((doc, True) for doc in make_docs(400))
            os._exit(9)  # as if killed: no clean-up runs
        token_cache.write_tokens(pieces(), tok, tmp_path / "tokens-1.uint16.bin")

    child = multiprocessing.get_context("fork").Process(target=killed)
    child.start()
    child.join(60)
    assert [p.name.startswith(".tokens-1.uint16.bin.") for p in tmp_path.iterdir()] == [True]  # its partial file
    token_cache.write_tokens([("the lazy dog", True)], tok, tmp_path / "tokens-2.uint16.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens-2.uint16.bin", "tokens-2.uint16.sha256"]


def test_a_damaged_token_cache_is_tokenized_again(tmp_path, caplog):
    """A cache cut short (by hand, or by a crash of the machine) was used silently, or failed to map with a
    message naming no file; a record of its size, kept beside it, finds it now, and one grown since."""
    src = write_texts(tmp_path / "txt", make_docs())
    first = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
    (cache,) = (tmp_path / "run").glob("tokens-*.bin")
    record = cache.with_suffix(".sha256")
    as_before = record.read_text().split()[0] + "\n"  # what earlier versions recorded: the hash alone
    grown = cache.stat().st_size + 2  # a copy gone wrong: a token too many
    for size, recorded in ((cache.stat().st_size - 1, None), (grown, None), (100, None), (0, None), (100, as_before)):
        os.truncate(cache, size)
        if recorded:
            record.write_text(recorded)
        caplog.clear()
        again = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
        assert (again.num_tokens, again.digest) == (first.num_tokens, first.digest)
        assert f"token cache {cache} is damaged" in caplog.text and "tokenizing the data again" in caplog.text
    record.write_text(as_before)  # an intact cache of a version that recorded its hash alone: hashed once, record completed
    assert D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300).digest == first.digest
    assert record.read_text() == f"{first.digest} {first.num_tokens}\n"
    record.unlink()  # of a version that recorded nothing, emptied: no tokens is no cache
    os.truncate(cache, 0)
    caplog.clear()
    assert D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300).digest == first.digest
    assert f"token cache {cache} is damaged (it holds 0 bytes" in caplog.text


def test_a_token_cache_whose_record_is_damaged_is_tokenized_again(tmp_path, caplog):
    """A record cut short or edited stopped the run with "not enough values to unpack" or "invalid literal for
    int()", naming no file; it is a damaged cache like one cut short, tokenized again."""
    src = write_texts(tmp_path / "txt", make_docs())
    first = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
    (record,) = (tmp_path / "run").glob("tokens-*.sha256")
    for damaged in ("", f"{first.digest} many\n", "\xff\xfe"):
        record.write_text(damaged, errors="surrogateescape")
        caplog.clear()
        again = D.prepare_data(tmp_path / "run", src, seq_len=8, vocab_size=300)
        assert (again.num_tokens, again.digest) == (first.num_tokens, first.digest)
        assert f"its record {record.name} cannot be read" in caplog.text and "tokenizing the data again" in caplog.text
        assert record.read_text() == f"{first.digest} {first.num_tokens} {token_cache.STREAM_VERSION}\n"


def test_a_token_cache_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """A full disk stopped the run with "[Errno 28] No space left on device", naming no file."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    (tmp_path / "full").symlink_to("/dev/full")  # the temporary file written before the rename, on a full disk
    monkeypatch.setattr(token_cache, "temporary_path", lambda path: tmp_path / "full")
    with pytest.raises(OSError, match=r"token cache .*tokens-4567.uint16.bin cannot be written: No space left on "
                                      r"device; free space there, or give a run_dir on another disk"):
        token_cache.write_tokens([("text", True)], train_bpe(make_docs(), vocab_size=300), tmp_path / "tokens-4567.uint16.bin")
    assert list(tmp_path.iterdir()) == []


def test_held_out_split_is_disjoint_and_deterministic():
    seqs = D.Sequences(np.arange(1000, dtype=np.uint16), seq_len=9)  # 100 sequences
    train, held = D.split_sequences(seqs, 0.05)
    assert len(held) == 5 and len(train) == 95
    assert not set(train.rows) & set(held.rows) and set(train.rows) | set(held.rows) == set(range(100))
    assert not set(train[np.arange(95)].flatten().tolist()) & set(held[np.arange(5)].flatten().tolist())
    assert np.array_equal(D.split_sequences(seqs, 0.05)[1].rows, held.rows)
    assert len(D.split_sequences(D.Sequences(np.arange(30), seq_len=9), 0.01)[1]) == 1  # at least one


def test_errors_for_empty_and_too_little_data(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="empty"):
        D.prepare_data(tmp_path / "run1", tmp_path / "empty", seq_len=8, vocab_size=300)
    assert not (tmp_path / "run1" / "tokenizer.json").exists()  # nothing half-made is kept
    train_bpe(make_docs(), vocab_size=300).backend.save(str(tmp_path / "given.json"))  # none to train: the data's turn
    with pytest.raises(ValueError, match="no text to tokenise: every document of the data is empty; give other data"):
        D.prepare_data(tmp_path / "run1", tmp_path / "empty", seq_len=8, tokenizer=tmp_path / "given.json")
    assert not list((tmp_path / "run1").glob("tokens-*"))
    (tmp_path / "tiny.txt").write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len\\+1 = 65; add data or lower seq_len$"):
        D.prepare_data(tmp_path / "run2", tmp_path / "tiny.txt", seq_len=64, vocab_size=300, max_tokens=100)
    with pytest.raises(ValueError, match=r"gives only 8 tokens, fewer than one sequence of seq_len\+1 = 9; add data, "
                                         r"raise max_tokens or lower seq_len$"):
        D.prepare_data(tmp_path / "run3", write_texts(tmp_path / "txt", make_docs()), seq_len=8, vocab_size=300,
                       max_tokens=8)  # a token short of a sequence
    with pytest.raises(ValueError, match="set eval_fraction=0"):
        D.split_sequences(D.Sequences(np.arange(10), seq_len=9), 0.01)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        D.TokenBatches(torch.zeros(3, 9, dtype=torch.long), batch_size=4)


# --- loader --------------------------------------------------------------------------------------


def test_loader_resumes_exactly():
    table = torch.arange(23 * 5).reshape(23, 5)
    ref = D.TokenBatches(table, batch_size=4, seed=7)
    expected = [next(ref) for _ in range(15)]  # 5 batches per epoch: crosses epochs twice
    run = D.TokenBatches(table, batch_size=4, seed=7)
    for _ in range(3):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))
    assert state == {"epoch": 0, "index": 12, "seed": 7, "num_sequences": 23, "seq_len": 4}
    resumed = D.TokenBatches(table, batch_size=4, seed=7)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="resume with the same data, tokenizer, max_tokens, seq_len, eval_fraction and seed"):
        D.TokenBatches(table, batch_size=4, seed=8).load_state_dict(state)  # the message names every setting it takes
    # As many sequences of another length (23 of 3 + 1 tokens) hold other tokens: refused too
    with pytest.raises(ValueError, match=r"for 23 sequences of 4 tokens with seed 7, but this loader has 23 of 3 "):
        D.TokenBatches(D.Sequences(np.arange(23 * 4 + 1), seq_len=3), batch_size=4, seed=7).load_state_dict(state)
    older = {key: value for key, value in state.items() if key != "seq_len"}  # a state saved before it held seq_len
    D.TokenBatches(table, batch_size=4, seed=7).load_state_dict(older)
    with pytest.raises(ValueError, match=r"for 23 sequences with seed 7, but this loader has 22 with seed 7: "):
        D.TokenBatches(table[:22], batch_size=4, seed=7).load_state_dict(older)  # no length it cannot know


def test_accumulated_batches_are_the_big_batch_split_even_across_epochs():
    """batch_size 4 with accum_steps 2 (grad_accum_steps 2) yields what batch_size 8 does."""
    table = torch.arange(23 * 5).reshape(23, 5)  # 2 steps of 8 per epoch, 7 sequences left over
    big, small = D.TokenBatches(table, batch_size=8, seed=3), D.TokenBatches(table, batch_size=4, seed=3, accum_steps=2)
    for _ in range(9):  # four epoch boundaries
        x, y = next(big)
        halves = [next(small), next(small)]
        assert torch.equal(x, torch.cat([h[0] for h in halves])) and torch.equal(y, torch.cat([h[1] for h in halves]))
    with pytest.raises(ValueError, match=r"fewer than batch_size 16 x 2 accumulated batches; .* or lower batch_size, "
                                         r"the accumulated batches or seq_len$"):
        D.TokenBatches(table, batch_size=16, accum_steps=2)


def test_a_resume_with_other_accum_steps_keeps_each_optimizer_step_in_one_epoch():
    """Saved with grad_accum_steps 1, resumed with 2: every pair of batches comes from one epoch."""
    table = torch.arange(23 * 5).reshape(23, 5)
    first = D.TokenBatches(table, batch_size=4, seed=3)
    for _ in range(3):
        next(first)
    resumed = D.TokenBatches(table, batch_size=4, seed=3, accum_steps=2)
    resumed.load_state_dict(first.state_dict())
    for _ in range(8):
        epochs = [(next(resumed), resumed.epoch)[1] for _ in range(2)]
        assert epochs[0] == epochs[1]


def test_loader_reshuffles_each_epoch_and_depends_only_on_seed():
    table = torch.arange(16 * 3).reshape(16, 3)
    firsts = lambda b, n: [next(b)[0][:, 0].tolist() for _ in range(n)]  # noqa: E731
    epochs = firsts(D.TokenBatches(table, 4, seed=1), 8)
    assert sorted(sum(epochs[:4], [])) == sorted(sum(epochs[4:], [])) == list(range(0, 48, 3))
    assert epochs[:4] != epochs[4:]
    assert firsts(D.TokenBatches(table, 4, seed=1), 8) == epochs
    assert firsts(D.TokenBatches(table, 4, seed=2), 8) != epochs


def test_pipeline_ranks_get_only_what_they_need_and_stay_in_sync():
    table = torch.arange(10 * 5).reshape(10, 5)
    full, first, middle, last = (
        D.TokenBatches(table, 2, seed=3, need_inputs=i, need_labels=l)
        for i, l in [(True, True), (True, False), (False, False), (False, True)]
    )
    for _ in range(7):
        x, y = next(full)
        ix, iy = next(first)
        assert torch.equal(ix, x) and iy is None
        fx, fy = next(middle)
        assert fx is None and fy is None
        lx, ly = next(last)
        assert lx is None and torch.equal(ly, y)
    assert full.state_dict() == first.state_dict() == middle.state_dict() == last.state_dict()


def test_eval_batches_cover_held_out_in_order():
    table = torch.arange(7 * 4).reshape(7, 4)
    seqs = D.Sequences.from_table(table)
    batches = list(D.eval_batches(seqs, 3))
    assert [(x.shape[0], n) for x, _, n in batches] == [(3, 3), (3, 3), (1, 1)]
    assert torch.equal(torch.cat([y for _, y, _ in batches]), table[:, 1:])
    assert list(D.eval_batches(seqs, 3, need_inputs=False, need_labels=False))[0] == (None, None, 3)
    # The last batch is padded to a multiple of pad_to rows that repeat its last sequence, ignored.
    *_, (x, y, n) = D.eval_batches(seqs, 4, pad_to=2)
    assert n == 3 and torch.equal(x, table[[4, 5, 6, 6], :-1])
    assert torch.equal(y[:3], table[4:, 1:]) and (y[3] == -100).all()


# --- the offline default -------------------------------------------------------------------------


def test_stdlib_default(tmp_path):
    files = S.stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    prepared = D.prepare_data(tmp_path, seq_len=32, vocab_size=512, max_tokens=5000, tokenizer_train_chars=300_000)
    assert prepared.num_tokens == 5000 and len(prepared.train) + len(prepared.eval) == 5000 // 33
    assert "import" in prepared.tokenizer.decode(prepared.train[np.arange(len(prepared.train))].flatten().tolist())


def test_held_out_sequences_are_spread_evenly_through_the_data():
    """The held-out sequences sample every part of the data (split_sequences says so): held out from its start
    alone, the eval loss measured one file (the first of a sorted directory) and trained on none of it."""
    seqs = D.Sequences(np.arange(1000, dtype=np.uint16), seq_len=9)  # 100 sequences
    assert D.split_sequences(seqs, 0.05)[1].rows.tolist() == [0, 20, 40, 60, 80]
    held = D.split_sequences(D.Sequences(np.arange(10 * 1003), seq_len=9), 0.03)[1].rows  # 1003 sequences, 30 held
    assert len(held) == 30 and held[0] == 0 and set(np.diff(held).tolist()) == {33, 34}  # 1003 / 30 apart


@pytest.mark.parametrize("template, starts, ends", [
    ("<s> $A " + EOS_TOKEN, ["<s>"], [EOS_TOKEN]),  # its own EOS ends the document: no second one
    ("$A <sep>", [], ["<sep>", EOS_TOKEN]),  # its separator stays, then EOS
], ids=["adds-eos", "adds-a-separator"])
def test_a_document_ends_with_what_the_tokenizer_puts_after_a_text_and_one_eos(tmp_path, template, starts, ends):
    """The special-tokens test covers a tokenizer that adds a BOS only. Each document is put in the stream as the
    exported tokenizer hands a text to the model, then ends with one end-of-text."""
    backend = train_bpe(make_docs(), vocab_size=300).backend
    ids = {EOS_TOKEN: backend.token_to_id(EOS_TOKEN), **put_around_each_text(backend, template)}
    tok = T.Tokenizer(backend, ids[EOS_TOKEN])
    before, after = [ids[name] for name in starts], [ids[name] for name in ends]
    path = tmp_path / "tokens.uint16.bin"
    token_cache.write_tokens([("the lazy dog", True), ("a fox", True)], tok, path)
    assert np.fromfile(path, dtype=np.uint16).tolist() == (before + tok.encode("the lazy dog") + after
                                                            + before + tok.encode("a fox") + after)


def test_the_tokenizer_is_trained_on_the_first_max_chars_characters_exactly():
    """data.tokenizer_train_chars is recorded with the run's tokenizer and checked on every start, but the
    document that crossed it was taken whole: the cap is the first max_chars characters, cut inside a document."""
    docs = make_docs(n=6, words=200)
    cap = len(docs[0]) + len(docs[1]) // 2
    capped = train_bpe(docs, vocab_size=300, max_chars=cap)
    assert capped.fingerprint() == train_bpe([docs[0], docs[1][: len(docs[1]) // 2]], vocab_size=300,
                                             max_chars=None).fingerprint()
    assert capped.fingerprint() != train_bpe(docs[:2], vocab_size=300, max_chars=None).fingerprint()


def test_a_tokenizer_whose_ids_leave_a_gap_covers_its_largest_id(tmp_path):
    """A tokenizer.json with a token numbered past a gap (70,000 among 1,002 others): its vocab_size counted the
    tokens, 1,003, so a run built an embedding too small for that id and chose a token cache of uint16, which
    cannot hold it. It is the largest id + 1, as the model's embedding must cover."""
    tok = _word_level({**{f"w{i}": i for i in range(1000)}, "<unk>": 1000, EOS_TOKEN: 1001, "rare": 70_000})
    assert tok.vocab_size == 70_001
    stream = token_cache.cached_tokens(tmp_path, tok, [("w1 rare w2", True)], {"sources": ["gap"]})
    assert stream.tolist() == [1, 70_000, 2, 1001]


@pytest.mark.parametrize("kind", ["metaspace-first", "metaspace-always"])
def test_a_long_document_cut_where_no_space_is_gives_the_tokens_of_the_whole_with_a_metaspace_tokenizer(tmp_path, kind):
    """Pieces cut before a newline, or at max_chars inside a run of letters, start with no space: a Metaspace
    pre-tokenizer must put no "▁" before them (the long-document test cuts only before spaces)."""
    tok = _sentencepiece_like(kind)
    text = "".join(f"{n:>10d}\n\n" for n in range(50)) + "x" * 300 + "\nend"
    (tmp_path / "long.txt").write_text(text)
    token_cache.write_tokens(S.iter_pieces([tmp_path / "long.txt"], max_chars=64), tok, tmp_path / "t.bin")
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == tok.encode(text) + [tok.eos_id]


def test_a_tokenizer_that_ends_documents_with_another_token_differs_in_its_document_ends():
    """The same tokenizer.json with another end-of-text id (a tokenizer_config.json naming another eos_token) puts
    other ids between documents: a checkpoint's check names the difference, not passes it as the same tokenizer."""
    tok = train_bpe(make_docs(), vocab_size=300)
    other = T.Tokenizer(tok.backend, tok.eos_id + 1)
    assert other.fingerprint() != tok.fingerprint()
    assert tokenizer_differences(other, tokenizer_record(tok)) == ["document ends"]


def test_a_tokenizer_record_names_the_transformers_version_it_was_made_under():
    """A tokenizer that loads differently later is met with advice to load it with the recorded version."""
    from importlib.metadata import version

    assert tokenizer_record(train_bpe(make_docs(), vocab_size=300))["transformers_version"] == version("transformers")


def test_a_record_of_this_tokenizer_s_fingerprint_alone_names_no_difference():
    """A record holding the fingerprint and no parts is this tokenizer when the fingerprint is its own, also
    where the earlier forms of the fingerprint differ from it (empty subword affixes, as GPT-2's)."""
    from tokenizers import Tokenizer

    spec = json.loads(train_bpe(make_docs(), vocab_size=300).backend.to_str())
    spec["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
    tok = T.Tokenizer(Tokenizer.from_str(json.dumps(spec)), 0)
    assert tokenizer_differences(tok, {"tokenizer": tok.fingerprint()}) == []


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_a_cap_of_no_tokens_is_refused(tmp_path, max_tokens):
    """0 was taken as a cap and then failed with "every document is empty"."""
    tok = train_bpe(make_docs(), vocab_size=300)
    with pytest.raises(ValueError, match=rf"max_tokens must be positive or None \(no cap\), got {max_tokens}"):
        token_cache.cached_tokens(tmp_path, tok, [("the lazy dog", True)], {"sources": ["x"]}, max_tokens=max_tokens)


def test_a_token_cache_reaches_the_disk_with_its_record_before_its_rename(tmp_path, monkeypatch, disk_events):
    """As atomic_write (test_checkpoint): the tokens are synced, then renamed into place, then their directory
    synced; a record that cannot be written keeps the cache from its place, so no cache lacks its record."""
    tok, path = train_bpe(make_docs(), vocab_size=300), tmp_path / "tokens-1.uint16.bin"
    token_cache.write_tokens([("the lazy dog", True)], tok, path)
    tmp, real = os.path.realpath(token_cache.temporary_path(path)), os.path.realpath(path)
    assert [e for e in disk_events if e[1] in (tmp, real)] == [("fsync", tmp), ("replace", real)]
    assert disk_events[-1] == ("fsync", os.path.realpath(tmp_path))

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_cache, "atomic_write", full)
    with pytest.raises(OSError, match="No space left"):
        token_cache.write_tokens([("the lazy dog", True)], tok, tmp_path / "tokens-2.uint16.bin")
    assert not (tmp_path / "tokens-2.uint16.bin").exists()


def test_prepare_data_refuses_a_sequence_length_or_held_out_fraction_out_of_range(tmp_path):
    """Called directly, not through the config's checks: seq_len 0 built 1-token sequences, and a fraction of 1
    said "too few sequences"."""
    src = write_texts(tmp_path / "txt", make_docs())
    with pytest.raises(ValueError, match="seq_len must be at least 1, got 0"):
        D.prepare_data(tmp_path / "run", src, seq_len=0, vocab_size=300)
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\), got 1"):
        D.split_sequences(D.Sequences(np.arange(1000), seq_len=9), 1)


def test_a_tokenizer_that_puts_two_tokens_before_a_text_has_no_one_bos():
    """bos_id, which the export writes as bos_token_id, is the one token a tokenizer puts before a text, else
    end-of-text."""
    backend = train_bpe(make_docs(), vocab_size=300).backend
    ids = put_around_each_text(backend, "<s> <sys> $A")
    tok = T.Tokenizer(backend, backend.token_to_id(EOS_TOKEN))
    assert tok.document_ends == ([ids["<s>"], ids["<sys>"]], []) and tok.bos_id == tok.eos_id


def test_a_stream_made_one_version_before_names_only_the_change_since(tmp_path):
    """A checkpoint of a stream of version 3 resumed by version 4: only what version 4 changed tells why the
    streams differ, not what version 3 changed already (which both streams have)."""
    from pipeline_parallel.config import ConfigError
    from pipeline_parallel.resume import check_resumable
    from pipeline_parallel.token_cache import STREAM_CHANGES

    tok = train_bpe(make_docs(), vocab_size=300)
    data = types.SimpleNamespace(tokenizer=tok, digest="1" * 64, version=4)
    extra = {"model_config": {}, **tokenizer_record(tok), "data_digest": "0" * 64, "data_version": 3}
    with pytest.raises(ConfigError) as raised:
        check_resumable(tmp_path / "step_000001", extra, {}, data)
    assert f"tokenized differently (version 4 {STREAM_CHANGES[4]})" in str(raised.value), str(raised.value)


def test_the_held_out_count_is_eval_fraction_of_the_sequences_rounded_to_the_nearest():
    """Every split tried came out whole (100 x 0.05, 1003 x 0.03 ~ 30.09) or at the minimum of one: one that
    truncated, holding out 1 of 38 sequences at 0.05 (1.9), went unseen."""
    assert len(D.split_sequences(D.Sequences(np.arange(10 * 38), seq_len=9), 0.05)[1]) == 2
    assert len(D.split_sequences(D.Sequences(np.arange(10 * 38), seq_len=9), 0.03)[1]) == 1  # 1.14
