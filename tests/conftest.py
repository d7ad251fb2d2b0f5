"""Fixtures the test modules share."""

from __future__ import annotations

import os
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


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple[str, str]]:
    """The fsyncs and renames made during the test, in order: ("fsync", the synced path) and ("replace", the
    destination), as real paths."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events
