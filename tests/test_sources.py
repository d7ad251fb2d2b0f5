"""Tests for data sources: files, directories, JSONL, Parquet and `datasets` records, long documents in pieces."""

import json
import os
import re
import sys
import types

import pytest

from pipeline_parallel import data as D
from pipeline_parallel import sources as S


def documents(sources, **kwargs):
    """The documents iter_pieces yields, each joined from its pieces."""
    docs, text = [], ""
    for piece, ends in S.iter_pieces(sources, **kwargs):
        text += piece
        if ends:
            docs, text = docs + [text], ""
    assert text == "", "the last piece must end its document"
    return docs


def test_text_files_are_one_document_each(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld\n")
    (tmp_path / "b.md").write_text("# title\n")
    (tmp_path / "c.weird").write_text("named directly, so read as text")
    sources = S.expand_sources([tmp_path / "a.txt", str(tmp_path / "b.md"), tmp_path / "c.weird"])
    assert documents(sources) == ["hello\nworld\n", "# title\n", "named directly, so read as text"]


def test_jsonl_with_custom_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": "first", "id": 1}) + "\n\n" + json.dumps({"body": "second"}) + "\n")
    assert documents(S.expand_sources(path), text_field="body") == ["first", "second"]
    with pytest.raises(ValueError, match="set text_field to one of"):
        documents(S.expand_sources(path))  # default field "text" is missing
    path.write_text('{"text": "caf\xe9"}\n"just a string"\n'.encode("latin-1").decode("utf-8", "surrogateescape"),
                    errors="surrogateescape")  # a latin-1 byte, as in text files: replaced, not fatal
    with pytest.raises(ValueError, match=r'd.jsonl:2: "just a string" is not an object with a \'text\' field; each '
                                         r'record must be one, such as \{"text": "..."\}'):
        documents(S.expand_sources(path))
    path.write_text('{"text": "caf\xe9"}\n'.encode("latin-1").decode("utf-8", "surrogateescape"), errors="surrogateescape")
    assert documents(S.expand_sources(path)) == ["caf\ufffd"]
    # An unpaired surrogate escape, JSON's undecodable byte, is replaced too: it stopped the tokenizer with a TypeError.
    path.write_text('{"text": "abc \\ud800 def \\ud83d\\ude00"}\n')
    assert documents(S.expand_sources(path)) == ["abc \ufffd def \U0001F600"]
    assert D.prepare_data(tmp_path / "run", path, seq_len=2, vocab_size=300, eval_fraction=0).num_tokens > 3
    # A file saved with a byte-order mark (Windows tools, utf-8-sig): the JSONL was refused, the text kept U+FEFF.
    path.write_bytes(b'\xef\xbb\xbf{"text": "x"}\n')
    text = tmp_path / "bom.txt"
    text.write_bytes(b"\xef\xbb\xbfy")
    assert documents([path, text]) == ["x", "y"]


def test_directory_is_recursive_sorted_and_skips_hidden_and_unknown(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("B")
    (tmp_path / "a.py").write_text("A")
    (tmp_path / "c.jsonl").write_text('{"text": "C"}\n')
    (tmp_path / ".hidden.txt").write_text("no")
    (tmp_path / ".git" / "x.txt").write_text("no")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    assert documents(S.expand_sources(tmp_path)) == ["A", "C", "B"]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "d.txt").write_text("D")
    (tmp_path / "sub" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "sub" / "loop").symlink_to(tmp_path, target_is_directory=True)  # read once, not forever
    assert documents(S.expand_sources(tmp_path / "sub")) == ["B", "D", "A", "C"]


def test_a_directory_gives_each_file_once_and_regular_files_only(tmp_path):
    """A file linked under a second name is one document, not two (which could land in training and in the
    held-out set); a FIFO, which would block the read forever, and a dangling link are no files to read."""
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    (tmp_path / "c.txt").symlink_to(tmp_path / "gone.txt")
    os.mkfifo(tmp_path / "d.txt")
    (tmp_path / "e.txt").write_text("E")
    assert S.expand_sources(tmp_path) == [tmp_path / "a.txt", tmp_path / "e.txt"]


def test_a_run_directory_inside_the_data_directory_is_not_data(tmp_path):
    """`--data.path .` with runs/ in the project: the run's metrics and config are not read as text."""
    (tmp_path / "notes.txt").write_text("the text to learn. " * 40)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # no "text" field
    (run_dir / "config.toml").write_text('run_dir = "runs/r"\n')
    assert S.expand_sources(tmp_path, skip=run_dir) == [tmp_path / "notes.txt"]
    for _ in range(2):  # the second time from the caches, with the run directory's files grown
        data = D.prepare_data(run_dir, [str(tmp_path)], seq_len=8, vocab_size=260, eval_fraction=0.1)
        (run_dir / "config.toml").write_text('run_dir = "runs/r"\nseed = 1\n')
    assert data.num_tokens == len(data.tokenizer.encode("the text to learn. " * 40)) + 1



def test_other_runs_directories_inside_the_data_directory_are_not_data(tmp_path):
    """Only this run's directory was left out: a second run on the same directory read the first run's config as
    text, and its metrics.jsonl stopped the data preparation ("no field 'text'")."""
    (tmp_path / "notes.txt").write_text("the text to learn. " * 40)
    first = tmp_path / "runs" / "first"
    D.prepare_data(first, [str(tmp_path)], seq_len=8, vocab_size=260, eval_fraction=0.1)
    (first / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # what the first run went on to write
    (first / "config.toml").write_text('run_dir = "runs/first"\n')
    assert S.expand_sources(tmp_path) == [tmp_path / "notes.txt"]
    second = D.prepare_data(tmp_path / "runs" / "second", [str(tmp_path)], seq_len=8, vocab_size=260,
                            eval_fraction=0.1)
    assert second.num_tokens == len(second.tokenizer.encode("the text to learn. " * 40)) + 1
    (tmp_path / "runs" / "more.txt").write_text("beside the runs")  # runs/ itself holds no token caches: read
    assert S.expand_sources(tmp_path) == [tmp_path / "notes.txt", tmp_path / "runs" / "more.txt"]

def test_a_run_directory_named_as_the_data_is_refused(tmp_path):
    """`--data.path` naming the run directory itself: its config and metrics were read as data (the resume then
    stopped on metrics.jsonl's missing 'text', suggesting another text_field)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the text to learn. " * 10)
    for named, skip in ((run_dir, run_dir), (tmp_path / "other", None)):
        if skip is None:
            D.prepare_data(named, [str(run_dir)], seq_len=2, vocab_size=260, eval_fraction=0)  # a run: its caches
        with pytest.raises(ValueError, match=f"data path {named} is a training run's directory: its config, metrics "
                                             "and token caches are what training wrote, not data"):
            S.expand_sources(named, skip=skip)


def test_a_jsonl_file_with_an_upper_case_suffix_is_json_lines(tmp_path):
    """Files from Windows tools come as DATA.JSONL: named or found in a directory, its records are the documents,
    not its JSON text."""
    (tmp_path / "DATA.JSONL").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert documents(S.expand_sources(tmp_path / "DATA.JSONL")) == ["one", "two"]
    assert documents(S.expand_sources(tmp_path)) == ["one", "two"]


def test_a_named_json_file_is_json_lines_and_a_binary_file_is_refused(tmp_path):
    """A .json file named directly (`datasets`' to_json writes JSON Lines under that name) was trained on as text,
    its syntax and escapes included, and a compressed file as the garbage its bytes decode to."""
    path = tmp_path / "d.json"
    path.write_text('{"text": "first\\nline"}\n{"text": "second"}\n')
    assert documents(S.expand_sources(path)) == ["first\nline", "second"]
    (tmp_path / "array.json").write_text('[\n{"text": "x"}\n]\n')
    with pytest.raises(ValueError, match=r"array.json:1: not valid JSON .*; a JSON data file holds one object per "
                                         r"line \(JSON Lines\)"):
        documents(S.expand_sources(tmp_path / "array.json"))
    with pytest.raises(ValueError, match="no data files under directory"):  # a directory's .json files are not data
        S.expand_sources(tmp_path)
    import gzip

    packed = tmp_path / "d.txt.gz"
    packed.write_bytes(gzip.compress(b"some text " * 100, mtime=0))
    with pytest.raises(ValueError, match=r"d.txt.gz holds binary data, not UTF-8 text \(a NUL byte in its first "
                                         r"[\d,]+ characters\): decompress or convert it"):
        documents([packed])


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["one", "", "two"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    assert documents(S.expand_sources(tmp_path), text_field="content") == ["one", "two"]
    with pytest.raises(ValueError, match="no column 'text'"):
        documents(S.expand_sources(tmp_path))


def test_a_damaged_parquet_file_is_named(tmp_path):
    """A partial download (cut short) or a file damaged inside stops the run with an error naming the file."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document {i} " * 50 for i in range(200)]}), tmp_path / "a.parquet",
                   compression="snappy")
    whole = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(whole[:3000])
    damaged = bytearray(whole)
    damaged[100:400] = bytes(300)
    (tmp_path / "c.parquet").write_bytes(bytes(damaged))
    assert len(documents([tmp_path / "a.parquet"])) == 200
    for name in ("b.parquet", "c.parquet"):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / name))} is no readable Parquet file \(.+\); "
                                             "download or write it again, or leave it out of data.path$"):
            documents([tmp_path / name])


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        documents(S.expand_sources(tmp_path))


def test_hf_dataset_spec(monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split))
        return [{"text": "from hub"}, {"text": "again"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert documents(S.expand_sources("hf:org/name:cfg")) == ["from hub", "again"]
    assert calls == [("org/name", "cfg", "train")]
    documents(["hf:org/name::test"])  # an empty config is datasets' default, None, not a config named ""
    assert calls[-1] == ("org/name", None, "test")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        documents(["hf:org/name"])


def test_long_documents_come_in_pieces_cut_between_words(tmp_path):
    text = "".join(f"line {i}\n" for i in range(30)) + "x" * 45 + "\nend\n" + "two\n" * 20
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "blank.txt").write_text(" \n" * 40)  # blank, and longer than a piece: skipped
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": text}) + "\n")
    sources = S.expand_sources([tmp_path / "long.txt", tmp_path / "blank.txt", tmp_path / "d.jsonl"])
    pieces = list(S.iter_pieces(sources, max_chars=20))
    assert documents(sources, max_chars=20) == [text, text]
    assert all(len(piece) <= 20 for piece, _ in pieces)
    first = [piece for piece, _ in pieces[: len(pieces) // 2]]
    assert first[:3] == ["line 0\nline 1\nline", " 2\nline 3\nline", " 4\nline 5\nline"]  # before a word's space
    assert "x" * 20 in first  # no whitespace to cut at: cut at the limit
    assert "\ntwo" * 4 in first  # no space between words: before the last whitespace ahead of a word
    assert [ends for _, ends in pieces].count(True) == 2


def test_whitespace_longer_than_a_piece_inside_a_document_is_kept(tmp_path):
    """A piece that is all whitespace is left out only at a document's start (a blank document yields nothing):
    inside one, dropping it joins the words around it."""
    text = "first words" + " " * 50 + "\n" * 30 + "last words\n"
    (tmp_path / "gap.txt").write_text(text)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": text}) + "\n")
    assert documents([tmp_path / "gap.txt", tmp_path / "d.jsonl"], max_chars=20) == [text, text]


def test_a_nul_character_past_the_start_of_a_text_file_is_text(tmp_path):
    """Only a file that starts as no text does (compressed, binary, UTF-16) is refused: a NUL further on (one
    stray byte in a log) is read as the rest of the file is."""
    text = "plain words " * 5 + "\x00" + " and more words"
    (tmp_path / "log.txt").write_text(text)
    assert documents([tmp_path / "log.txt"], max_chars=20) == [text]


def test_a_huge_text_file_is_read_a_piece_at_a_time(tmp_path):
    """Preparing data from one 64 MiB text file never holds the whole of it in memory."""
    import tracemalloc

    line = "the quick brown fox jumps over the lazy dog while pipeline stages pass tensors\n"
    with open(tmp_path / "huge.txt", "w") as f:
        for _ in range(64 * 2**20 // len(line)):
            f.write(line)
    tracemalloc.start()
    try:
        prepared = D.prepare_data(tmp_path / "run", tmp_path / "huge.txt", seq_len=16, vocab_size=300,
                                  max_tokens=20_000, tokenizer_train_chars=100_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert prepared.num_tokens == 20_000
    assert peak < 32 * 2**20, f"peak {peak / 2**20:.1f} MiB while reading a 64 MiB file"


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        S.expand_sources(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="no data files"):
        S.expand_sources(tmp_path)


def test_a_record_or_row_whose_text_is_no_string_is_named(tmp_path):
    """{"text": 5} stopped the run with a TypeError naming no file or line."""
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'text' is int, not text"):
        documents([tmp_path / "d.jsonl"])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet: column 'text' holds int, not text"):
        documents([tmp_path / "d.parquet"])


def test_an_empty_list_of_sources_is_refused():
    """It said every document of the data was empty."""
    with pytest.raises(ValueError, match="no data sources given"):
        S.expand_sources([])
