"""Fixtures the test modules share."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from pipeline_parallel.bpe import train_bpe


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A small text file (a few stdlib modules) and a BPE tokenizer trained on it once."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in ("textwrap.py", "json/decoder.py", "json/encoder.py"))
    (root / "data.txt").write_text(text)
    train_bpe([text], vocab_size=320).save(root)
    return root / "data.txt", root / "tokenizer.json"
