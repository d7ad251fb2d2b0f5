"""Tests for checkpoint save/load: resharding, crash safety, RNG/extra, safe loading."""

from __future__ import annotations

import builtins
import hashlib
import io
import logging
import json
import os
import pickle
import re
import signal
import time
import zlib
from pathlib import Path
from typing import Callable

import pytest
import torch
from _dist import run_distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline_parallel import _checkpoint_dirs as ckpt_dirs
from pipeline_parallel import checkpoint as ckpt
from pipeline_parallel.launch import Interrupted
from pipeline_parallel.checkpoint import (
    UnsafeCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_extra,
    save_checkpoint,
)

CONFIG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                     max_position_embeddings=64)
TIED = LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
EXTRA = {"step": 2, "scheduler": {"last_epoch": 2}, "data": {"position": 1234}, "note": None}


def unrecord(path: Path) -> None:
    """Make checkpoint `path` one saved before meta.json recorded its files (or one whose record was taken away),
    and so before it was sealed."""
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"], meta["sha256"]
    (path / "meta.json").write_text(json.dumps(meta))


def make_stage(rank: int, world_size: int, seed: int = 0, config=CONFIG) -> LlamaForCausalLM:
    """Full tiny Llama stripped to the layers `rank` owns, keeping original FQNs."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    n = CONFIG.num_hidden_layers
    owned = range(rank * n // world_size, (rank + 1) * n // world_size)
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in owned})
    if rank != 0:
        model.model.embed_tokens = None
    if rank != world_size - 1:
        model.model.norm = None
        model.lm_head = None
    return model


def fake_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """An optimizer step on gradients that depend only on parameter name and step."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + step)
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def train(model: nn.Module, steps: int = 2) -> torch.optim.AdamW:
    """A couple of AdamW steps, so the optimizer state is non-trivial."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        fake_step(model, opt, step)
    return opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Model and FQN-keyed optimizer state as plain cloned values."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=options)
    state = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
    state |= {f"optim.{k}": v for k, v in optim.items()}
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# ---------------------------------------------------------------- workers (run in children)


def _save_worker(rank, world_size, run_dir):
    model = make_stage(rank, world_size)
    opt = train(model)
    save_checkpoint(run_dir, 2, model, opt, EXTRA, keep_last=3)
    return snapshot(model, opt)


def _load_worker(rank, world_size, run_dir):
    model = make_stage(rank, world_size, seed=1)  # different weights than the saved ones
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)  # different hyperparameters too
    torch.manual_seed(1234)
    extra = load_checkpoint(latest_checkpoint(run_dir), model, opt)
    after_load = torch.rand(4)
    torch.manual_seed(1234)
    rng_kept = torch.equal(after_load, torch.rand(4))
    return snapshot(model, opt), extra, rng_kept


def _round_trip_worker(rank, world_size, run_dir):
    original = make_stage(rank, world_size)
    original_opt = train(original)
    torch.manual_seed(100 + rank)
    torch.rand(3)
    save_checkpoint(run_dir, 7, original, original_opt, EXTRA, keep_last=1)
    want_rand = torch.rand(5)

    model = make_stage(rank, world_size, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)
    torch.manual_seed(999)
    extra = load_checkpoint(latest_checkpoint(run_dir), model, opt)
    assert extra == EXTRA
    assert torch.equal(torch.rand(5), want_rand), "RNG not restored"
    assert_same(snapshot(model, opt), snapshot(original, original_opt))
    # the restored optimizer keeps training exactly like the original
    fake_step(model, opt, 2)
    fake_step(original, original_opt, 2)
    assert_same(snapshot(model, opt), snapshot(original, original_opt))
    return True


def _crash_worker(rank, world_size, run_dir):
    run_dir = Path(run_dir)
    model = make_stage(rank, world_size)
    opt = train(model)
    first = save_checkpoint(run_dir, 1, model, opt, {"step": 1}, keep_last=5)

    def crash(tmp, final):
        raise OSError("simulated crash before publishing")

    if rank == 0:
        ckpt.commit = crash  # rank 0 dies between the writes and the rename
    with pytest.raises((OSError, RuntimeError), match="simulated crash|rank 0 failed"):
        save_checkpoint(run_dir, 2, model, opt, {"step": 2}, keep_last=5)
    assert not (run_dir / "checkpoints" / "step_000002.tmp").exists()  # an error (not a kill) leaves nothing of it
    assert not (run_dir / "checkpoints" / "step_000002").exists()
    assert latest_checkpoint(run_dir) == first
    fresh = make_stage(rank, world_size, seed=1)
    assert load_checkpoint(first, fresh, torch.optim.AdamW(fresh.parameters())) == {"step": 1}

    # a rank failing while writing its shards also leaves `latest` alone
    if rank == 1:
        ckpt.dcp.FileSystemWriter.write_data = lambda *a, **k: 1 / 0
    with pytest.raises(BaseException, match="ZeroDivisionError|division by zero"):
        save_checkpoint(run_dir, 3, model, opt, {"step": 3}, keep_last=5)
    assert latest_checkpoint(run_dir) == first
    assert rank != 0 or not (run_dir / "checkpoints" / "step_000003.tmp").exists()  # rank 0 removes what was written
    return True


def _tied_load_worker(rank, world_size, path):
    model = make_stage(rank, world_size, seed=1, config=TIED)
    opt = torch.optim.AdamW(model.parameters())
    load_checkpoint(path, model, opt)
    return snapshot(model, opt)


def _fail_or_hang(rank, world_size):
    if rank == 1:
        raise ValueError("bad value on rank 1")
    time.sleep(60)


# ---------------------------------------------------------------- tests


def test_run_distributed_reports_errors_and_timeouts():
    results = run_distributed(lambda rank, world_size, x: (rank, world_size, x), 3, "hi")
    assert results == [(0, 3, "hi"), (1, 3, "hi"), (2, 3, "hi")]
    with pytest.raises(ValueError, match="bad value on rank 1"):
        run_distributed(_fail_or_hang, 2)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 did not finish within 1s"):
        run_distributed(lambda rank, ws: time.sleep(60), 1, timeout=1)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    """A checkpoint written by a 2-stage pipeline, plus the state it holds."""
    run_dir = tmp_path_factory.mktemp("run")
    states = run_distributed(_save_worker, 2, str(run_dir))
    assert not set(states[0]) & {k for k in states[1] if k.startswith("model.")}  # disjoint
    return run_dir, states[0] | states[1]


def test_stages_partition_the_full_model(saved_on_two):
    _, saved = saved_on_two
    full = make_stage(0, 1)
    assert_same(saved, snapshot(full, train(full)))


@pytest.mark.parametrize("world_size", [1, 4])
def test_load_at_other_pipeline_size(saved_on_two, world_size):
    run_dir, saved = saved_on_two
    results = run_distributed(_load_worker, world_size, str(run_dir))
    loaded = {}
    for state, extra, rng_kept in results:
        assert extra == EXTRA
        assert rng_kept, "RNG must not be restored when the number of ranks changed"
        loaded |= state
    assert_same(loaded, saved)


def test_round_trip_restores_rng_and_extra(tmp_path):
    assert run_distributed(_round_trip_worker, 2, str(tmp_path)) == [True, True]


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    assert run_distributed(_crash_worker, 2, str(tmp_path)) == [True, True]
    # the next save (single process, no torch.distributed) clears the leftovers of a save killed midway
    (tmp_path / "checkpoints" / "step_000003.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_000003.tmp" / "__0_0.distcp").write_bytes(b"half")
    model = make_stage(0, 1)
    save_checkpoint(tmp_path, 4, model, train(model), {"step": 4}, keep_last=5)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001", "step_000004"]


def test_keep_last_and_latest_pointer(tmp_path, recwarn):
    model = make_stage(0, 1)
    opt = train(model)
    assert latest_checkpoint(tmp_path) is None
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=2)
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000003", "step_000004"]
    assert (ckpt_dir / "latest").read_text().strip() == "step_000004"
    assert latest_checkpoint(tmp_path) == ckpt_dir / "step_000004"
    (ckpt_dir / "latest").unlink()  # e.g. a crash right after the rename
    assert latest_checkpoint(tmp_path) == ckpt_dir / "step_000004"
    # re-saving an existing step (after resuming from an older one) replaces it
    save_checkpoint(tmp_path, 4, model, opt, {"step": "again"}, keep_last=2)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000003", "step_000004"]
    assert load_checkpoint(latest_checkpoint(tmp_path), model, opt) == {"step": "again"}
    assert not [str(w.message) for w in recwarn], "a single process saves and loads without warnings"


def test_rotation_and_fallback_go_by_when_saved_after_resuming_an_older_step(tmp_path):
    """Steps 3 and 6 saved, then the run resumed from step 3 (say, with another lr) and saved 4 and 5:
    the abandoned step 6 is the oldest save, so it goes, and the branch's own step 4 stays."""
    model = make_stage(0, 1)
    opt = train(model)
    for step in (3, 6, 4, 5):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=2)
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000004", "step_000005"]
    save_checkpoint(tmp_path, 7, model, opt, {"step": 7}, keep_last=0)
    save_checkpoint(tmp_path, 6, model, opt, {"step": 6}, keep_last=0)  # resumed from 5 again
    (ckpt_dir / "latest").unlink()  # a crash before the pointer moved: the fallback is the last save
    assert latest_checkpoint(tmp_path) == ckpt_dir / "step_000006"


def test_rotation_drops_the_abandoned_run_before_the_step_resumed_from(tmp_path):
    """Steps 20 and 30 saved, then resumed from 20 and saved 25: step 30 belongs to the abandoned
    run and goes, not step 20, from which this run continues (though saved before 30)."""
    model = make_stage(0, 1)
    opt = train(model)
    for step in (20, 30, 25):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000020", "step_000025"]


def test_crash_while_resaving_a_step_keeps_that_step(tmp_path, monkeypatch):
    model = make_stage(0, 1)
    opt = train(model)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=2)
    real_replace = os.replace

    def crash_on_rename_into_place(src, dst):  # step 2 is already moved aside to step_000002.old, and a crash
        if str(src).endswith(("step_000002.tmp", "step_000002.old")):  # leaves it there: no putting it back
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_rename_into_place)
    with pytest.raises(OSError, match="simulated crash"):  # e.g. re-saving step 2 after resuming from step 1
        save_checkpoint(tmp_path, 2, model, opt, {"step": "again"}, keep_last=2)
    monkeypatch.undo()
    ckpt_dir = tmp_path / "checkpoints"
    assert (ckpt_dir / "step_000002.old").is_dir() and not (ckpt_dir / "step_000002").exists()
    assert read_extra(latest_checkpoint(tmp_path)) == {"step": 2}  # not step 1
    save_checkpoint(tmp_path, 3, model, opt, {"step": 3}, keep_last=2)  # must not drop step 2
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert load_checkpoint(ckpt_dir / "step_000002", model, opt) == {"step": 2}


def test_a_crashed_resave_is_named_where_the_next_save_put_it_back(tmp_path, monkeypatch):
    """Resumed from step_N.old (a re-save crashed between its renames), a run's next save puts it back at step_N: the
    messages that name the checkpoint to resume from named the .old directory, which was gone."""
    model, opt = make_stage(0, 1), None
    save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep_last=0)
    ckpt_dir = tmp_path / "checkpoints"
    os.replace(ckpt_dir / "step_000002", ckpt_dir / "step_000002.old")
    resumed = latest_checkpoint(tmp_path)
    assert resumed == ckpt_dir / "step_000002.old" and ckpt_dirs.published(resumed) == resumed
    save_checkpoint(tmp_path, 3, model, opt, {"step": 3}, keep_last=0)  # its preparation puts step 2 back
    assert ckpt_dirs.published(resumed) == ckpt_dir / "step_000002"


@pytest.mark.parametrize("fails", ["writing", "publishing"])
def test_a_failed_save_leaves_nothing_of_itself(tmp_path, monkeypatch, fails):
    """On a full disk the half-written save stayed, and a restart (whose first write is the run's settings) failed for
    want of the room it took."""
    model = make_stage(0, 1)
    opt = train(model)
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, keep_last=0)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fails == "writing":
        monkeypatch.setattr(ckpt.RecordingWriter, "write_data", full)
    else:
        monkeypatch.setattr(ckpt, "atomic_write", full)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, keep_last=0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_file_written_whole_reaches_the_disk_before_its_rename_and_the_rename_after(tmp_path, disk_events):
    """After a power loss, a rename that reached the disk before the data names an empty file (meta.json, the
    latest pointer, the run's metrics); a rename not made durable can be undone. The file is flushed to disk
    before it is renamed into place, then its directory."""
    from pipeline_parallel._files import atomic_write, temporary_path

    path = tmp_path / "meta.json"
    atomic_write(path, "{}")
    assert path.read_text() == "{}"
    assert disk_events == [("fsync", os.path.realpath(temporary_path(path))), ("replace", os.path.realpath(path)),
                           ("fsync", os.path.realpath(tmp_path))]


def test_a_file_that_cannot_be_written_whole_leaves_the_old_one_and_nothing_beside_it(tmp_path, monkeypatch):
    """A full disk: the old content stays, and the half-written temporary file goes (left, it takes room, and
    a run directory fills with them at every save the disk refuses)."""
    from pipeline_parallel._files import atomic_write

    def full(fd):
        raise OSError(28, "No space left on device")

    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(path, "new\n")
    assert path.read_text() == "old\n" and list(tmp_path.iterdir()) == [path]


def test_a_failed_write_says_how_much_room_its_disk_has(tmp_path, monkeypatch):
    """The note a message on a failed write ends with: the free room in GB, or MB below one GB; nothing where it
    cannot be told."""
    import shutil
    from collections import namedtuple

    from pipeline_parallel._files import room_note

    usage = namedtuple("usage", "total used free")
    for free, said in ((3 * 2**30 + 2**29, "; 3.5 GB free on its disk"), (2**30, "; 1.0 GB free on its disk"),
                       (2**30 - 2**20, "; 1,023.0 MB free on its disk"), (0, "; 0.0 MB free on its disk")):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(2**40, 2**40 - free, free))
        assert room_note(tmp_path) == said

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(shutil, "disk_usage", gone)
    assert room_note(tmp_path / "gone") == ""


def test_a_damaged_checkpoint_names_none_of_the_run_it_went_on_from_an_older_step_of(tmp_path):
    """Steps 2, 4 and 6 saved, then resumed from step 2 and saved 3, which is damaged: the advice named step 6, of
    the run abandoned, where step 2 is the one this run went on from."""
    model = make_stage(0, 1)
    for step in (2, 4, 6, 3):
        save_checkpoint(tmp_path, step, model, None, {"step": step}, keep_last=0)
    path = tmp_path / "checkpoints" / "step_000003"
    (path / "meta.json").write_text((path / "meta.json").read_text().replace('"step": 3', '"step": 5'))
    with pytest.raises(ValueError, match=r"step_000003 is damaged .*; use an earlier one, such as .*step_000002$"):
        read_extra(path)


@pytest.mark.parametrize("meta", ["{}", "[]", "null", '{"step": 1}'])
def test_a_meta_json_that_is_json_but_no_checkpoints_is_damage(tmp_path, meta):
    """Taken for one saved before the seal, it stopped with a KeyError or TypeError and a traceback."""
    model = make_stage(0, 1)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, None, {"step": step}, keep_last=0)
    path = tmp_path / "checkpoints" / "step_000002"
    (path / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=r"step_000002 is damaged \(its meta.json is not a checkpoint's \(it holds no "
                                         r"format_version, step and extra\)\); use an earlier one, such as .*step_000001"):
        read_extra(path)


def _interrupted_on_one_rank_worker(rank, world_size, run_dir):
    """Step 1 saved; then Ctrl-C lands inside DCP on rank 1, while it saves step 2 and while it loads step 1
    (DCP catches it as that rank's failure and gathers it to all): what each rank raised, and whether step 1
    then loads the state it saved."""
    model = make_stage(rank, world_size)
    opt = train(model)
    save_checkpoint(run_dir, 1, model, opt, {"step": 1}, keep_last=0)
    want = snapshot(model, opt)
    raised = {}
    for name, cls, method in (("save", ckpt.RecordingWriter, "write_data"),
                              ("load", ckpt.SafeFileSystemReader, "read_data")):
        real = getattr(cls, method)

        def stopped(self, *args, real=real):
            if rank == 1:
                raise Interrupted(signal.SIGINT)
            return real(self, *args)

        setattr(cls, method, stopped)
        try:
            if name == "save":
                save_checkpoint(run_dir, 2, model, opt, {"step": 2}, keep_last=0)
            else:
                load_checkpoint(latest_checkpoint(run_dir), model, opt)
        except BaseException as e:
            raised[name] = (type(e).__name__, getattr(e, "signum", None))
        finally:
            setattr(cls, method, real)
    fake_step(model, opt, 7)
    assert load_checkpoint(latest_checkpoint(run_dir), model, opt) == {"step": 1}
    got = snapshot(model, opt)
    same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
    return raised, same, sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


def test_a_stop_signal_inside_a_save_or_load_is_the_stop_on_every_rank(tmp_path):
    """DCP catches everything, Ctrl-C too: a save interrupted on one rank ended every rank with "could not write
    ...; the previous checkpoint is untouched", a load with "checkpoint ... is damaged", and Interrupted did not
    survive the way between ranks (it did not unpickle)."""
    for raised, same, names in run_distributed(_interrupted_on_one_rank_worker, 2, str(tmp_path)):
        assert raised == {"save": ("Interrupted", signal.SIGINT), "load": ("Interrupted", signal.SIGINT)}
        assert same and names == ["latest", "step_000001"]  # nothing of the stopped save is left


def test_tied_embeddings_load_untied(tmp_path):
    """A tied model saved whole loads into a split where each end holds its own copy."""
    model = make_stage(0, 1, config=TIED)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = train(model)
    path = save_checkpoint(tmp_path, 1, model, opt, {}, keep_last=1)
    first, last = run_distributed(_tied_load_worker, 2, str(path))
    assert_same(first, {k: v for k, v in snapshot(model, opt).items() if k in first})
    for key, value in first.items():
        if "embed_tokens" in key:  # lm_head on the last stage got the same values
            other = last[key.replace("model.embed_tokens", "lm_head")]
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_metadata_is_refused(tmp_path):
    model = make_stage(0, 1)
    path = save_checkpoint(tmp_path, 1, model, train(model), {}, keep_last=1)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(ValueError, match=r"its file .metadata has \d+ bytes where [\d,]+ were saved"):
        load_checkpoint(path, model, None)  # found before it is read
    unrecord(path)  # as by someone who could also edit meta.json
    with pytest.raises(UnsafeCheckpointError, match="system.*not a DCP metadata type"):
        load_checkpoint(path, model, None)
    assert not marker.exists()


def test_malicious_optimizer_value_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    model = make_stage(0, 1)
    opt = train(model)
    opt.param_groups[0]["evil"] = _Evil(marker)  # stored as a pickled non-tensor value
    path = save_checkpoint(tmp_path, 1, model, opt, {}, keep_last=1)
    opt.param_groups[0]["evil"] = "placeholder"
    with pytest.raises(BaseException, match="[Ww]eights.only"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()


def test_clear_errors(tmp_path):
    model = make_stage(0, 1)
    opt = train(model)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, 1, model, opt, {"lr": torch.tensor(1.0)}, keep_last=1)
    with pytest.raises(FileNotFoundError, match=r"not a complete checkpoint \(it lacks .metadata and meta.json\)"):
        load_checkpoint(tmp_path, model, opt)
    with pytest.raises(FileNotFoundError, match="step_000009 does not exist; pass a directory returned by"):
        read_extra(tmp_path / "step_000009")
    path = save_checkpoint(tmp_path, 1, model, None, {}, keep_last=1)
    with pytest.raises(ValueError, match="without optimizer state"):
        load_checkpoint(path, model, opt)
    bigger = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 5}))
    with pytest.raises(ValueError, match="model.model.layers.4"):
        load_checkpoint(path, bigger, None)


def _load_into_five_layers(rank, world_size, path):
    """Stages of a 5-layer model: the last stage's layer 4 is in no checkpoint of the 4-layer one."""
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 5}))
    model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in ([0, 1] if rank == 0 else [2, 3, 4])})
    try:
        load_checkpoint(path, model, None)
    except ValueError as e:
        return str(e)


def test_entries_one_rank_lacks_are_one_error_on_every_rank(saved_on_two):
    """The other ranks said only that another rank lacks entries (see its error)."""
    path = latest_checkpoint(saved_on_two[0])
    first, second = run_distributed(_load_into_five_layers, 2, str(path))
    assert first == second
    assert first.startswith(f"{path} lacks 9 entries rank 1 needs, e.g. ['model.model.layers.4."), first


def _damage_and_load(rank, world_size, run_dir, damage):
    """A checkpoint saved on these ranks, `damage(step_dir, rank)` done to the newest, then loaded."""
    model = make_stage(rank, world_size)
    opt = train(model)
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, opt, {"step": step}, keep_last=3)
    torch.distributed.barrier()
    damage(Path(run_dir) / "checkpoints" / "step_000002", rank)
    torch.distributed.barrier()
    try:
        load_checkpoint(latest_checkpoint(run_dir), model, opt)
    except ValueError as e:
        return str(e)


def _truncate_own_shard_saved_unrecorded(step_dir, rank):
    """Rank 1 cuts its shard short in a checkpoint saved before meta.json recorded its files, which DCP then fails on."""
    if rank == 0:
        unrecord(step_dir)
    if rank == 1:
        os.truncate(step_dir / "__1_0.distcp", 100)


def test_a_damaged_shard_fails_every_rank_with_the_checkpoint_named(tmp_path):
    messages = run_distributed(_damage_and_load, 2, str(tmp_path), _truncate_own_shard_saved_unrecorded)
    step_dir, earlier = tmp_path / "checkpoints" / "step_000002", tmp_path / "checkpoints" / "step_000001"
    for message in messages:
        assert message.startswith(f"checkpoint {step_dir} is damaged (its tensors cannot be read, or it was saved "
                                  "from another model: ") and \
            message.endswith(f"); use an earlier one, such as {earlier}"), message
        # torch's explanation is cut at the end of a sentence (it read "was transferred ; or it was saved ...")
        reason = message[message.index("another model: ") + len("another model: "):message.rindex(");")]
        assert len(reason) <= 310 and (reason.endswith(".") or "." not in reason[:300]), reason


def _out_of_memory_in_load(rank, world_size, run_dir):
    """A checkpoint saved on these ranks, loaded where rank 1's device has no memory for the tensors it reads."""
    model = make_stage(rank, world_size)
    opt = train(model)
    path = save_checkpoint(run_dir, 1, model, opt, {"step": 1}, keep_last=1)

    def read_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a test)")

    if rank == 1:
        ckpt.SafeFileSystemReader.read_data = read_out_of_memory  # this forked rank's own copy of the class
    try:
        load_checkpoint(path, model, opt)
    except Exception as e:
        return type(e).__name__, str(e)


def test_running_out_of_memory_in_a_load_is_not_called_damage(tmp_path):
    """DCP gathers a rank's failure to every rank; out of memory as it read the tensors, it was reported as a damaged
    checkpoint, which would send the user to an older one, or to delete this one."""
    path = tmp_path / "checkpoints" / "step_000001"
    for said in run_distributed(_out_of_memory_in_load, 2, str(tmp_path)):
        assert said == ("RuntimeError", f"loading {path} ran out of memory on rank 1 (OutOfMemoryError: CUDA out of "
                                        "memory (a test)); the checkpoint is not damaged: free memory there and load "
                                        "it again"), said


@pytest.mark.parametrize("damage, why", [
    (lambda d: os.truncate(d / ".metadata", 50), r"its file .metadata has 50 bytes where [\d,]+ were saved"),
    (lambda d: os.truncate(d / "meta.json", 10), r"its meta.json cannot be read: Unterminated string"),
    (lambda d: (d / "meta.json").unlink(), r"it lacks meta.json"),  # was skipped: the run went on from step 1
])
def test_a_damaged_newest_checkpoint_is_named_not_skipped(tmp_path, damage, why):
    model = make_stage(0, 1)
    opt = train(model)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=3)
    damage(tmp_path / "checkpoints" / "step_000002")
    with pytest.raises(ValueError, match=rf"checkpoint .*step_000002 is damaged \({why}.*\); use an earlier one, "
                                         rf"such as .*step_000001$"):
        load_checkpoint(latest_checkpoint(tmp_path), model, opt)


def test_a_damaged_checkpoint_chosen_over_later_ones_is_met_with_one_saved_before_it(tmp_path):
    """A resume from step 2 of three chose it over step 3 (which came after a divergence, say): its error named
    step 3 as "an earlier one"."""
    model = make_stage(0, 1)
    opt = train(model)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=0)
    os.truncate(tmp_path / "checkpoints" / "step_000002" / ".metadata", 50)
    with pytest.raises(ValueError, match=r"step_000002 is damaged \(its file .metadata has 50 bytes .*\); use an "
                                         r"earlier one, such as .*step_000001$"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000002", model, opt)


def test_two_checkpoints_whose_meta_json_cannot_be_read_are_named_not_recursed_into(tmp_path):
    """Naming an earlier checkpoint than one whose meta.json cannot be read read the others', and the error of one that
    could not be read named an earlier one than it: a RecursionError. Step 2, when saved unknown, counts as older."""
    model = make_stage(0, 1)
    opt = train(model)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"step": step}, keep_last=0)
    for step in (2, 3):
        os.truncate(tmp_path / "checkpoints" / f"step_00000{step}" / "meta.json", 10)
    with pytest.raises(ValueError, match=r"step_000003 is damaged \(its meta.json cannot be read: .*\); use an earlier "
                                         r"one, such as .*step_000001$"):
        load_checkpoint(latest_checkpoint(tmp_path), model, opt)


# ---------------------------------------------------------------- files damaged after a save


def _flip_a_byte(path: Path) -> None:
    """Invert the middle byte of `path` (of a shard: inside a tensor's bytes, or the pickle around them)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def _copy_from_step_2(path: Path) -> None:
    """Replace `path` by the file of the same name in step 2: the same size, other weights."""
    other = path.parent.with_name("step_000002") / path.name
    assert other.stat().st_size == path.stat().st_size
    path.write_bytes(other.read_bytes())


CHANGED = r"has changed since it was saved \(its SHA-256 is not the one recorded\)"
# What is done to a file of the newest checkpoint, and what the error then says about it (every rank alike).
FILE_DAMAGES = {
    "a byte flipped": ("__1_0.distcp", _flip_a_byte, rf"its file __1_0.distcp {CHANGED}"),
    "a byte of .metadata flipped": (".metadata", _flip_a_byte, rf"its file .metadata {CHANGED}"),
    "cut short": ("__1_0.distcp", lambda f: os.truncate(f, 100), r"its file __1_0.distcp has 100 bytes where "
                                                                 r"[\d,]+ were saved"),
    "replaced": ("__0_0.distcp", _copy_from_step_2, rf"its file __0_0.distcp {CHANGED}"),
    "deleted": ("__0_0.distcp", Path.unlink, r"it lacks __0_0.distcp"),
}


def _load_outcome(run_dir: str, rank: int, world_size: int, want: dict) -> str:
    """Load `run_dir`'s latest checkpoint into fresh stages: its error, or whether the state saved came back."""
    model = make_stage(rank, world_size, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    try:
        load_checkpoint(latest_checkpoint(run_dir), model, opt)
    except ValueError as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    got = snapshot(model, opt)
    same = all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
    return "loaded the state saved" if same else "loaded other values, silently"


def _damaged_files_worker(rank, world_size, run_dir):
    """Steps 1-3 saved (each with other weights); each of FILE_DAMAGES done in turn to step 3 and undone, then two
    checkpoints damaged at once, each time loading the latest on every rank: what each load did."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    model = make_stage(rank, world_size)
    opt = train(model)
    for step in (1, 2, 3):
        fake_step(model, opt, 10 + step)
        save_checkpoint(run_dir, step, model, opt, {"step": step}, keep_last=0)
    want = snapshot(model, opt)

    def after(damages: dict[Path, Callable]) -> str:
        torch.distributed.barrier()
        if rank == 0:  # read and damaged by one rank: another reading them could meet a file being damaged
            kept = {path: path.read_bytes() if path.exists() else None for path in damages}
            for path, damage in damages.items():
                damage(path)
        torch.distributed.barrier()
        outcome = _load_outcome(run_dir, rank, world_size, want)
        torch.distributed.barrier()
        if rank == 0:  # undone
            for path, data in kept.items():
                path.write_bytes(data) if data is not None else path.unlink()
        return outcome

    outcomes = {name: after({ckpt_dir / "step_000003" / file: damage})
                for name, (file, damage, _) in FILE_DAMAGES.items()}
    outcomes["newest two flipped"] = after({ckpt_dir / f"step_00000{step}" / "__1_0.distcp": _flip_a_byte
                                            for step in (3, 2)})
    outcomes["all flipped"] = after({ckpt_dir / f"step_00000{step}" / "__0_0.distcp": _flip_a_byte
                                     for step in (3, 2, 1)})
    outcomes["a file added"] = after({ckpt_dir / "step_000003" / "notes.txt": lambda f: f.write_text("lr 3e-4")})
    outcomes["undone"] = _load_outcome(run_dir, rank, world_size, want)
    return outcomes


def test_a_damaged_file_is_named_on_every_rank_with_the_newest_intact_checkpoint(tmp_path):
    """Before meta.json recorded the files: a byte flipped in one shard failed with torch's advice to load with
    weights_only=False, and in another shard, as a shard replaced, loaded other weights silently; one flipped in
    .metadata raised MemoryError; a shard cut short an EOFError naming no file. A file added beside them is no damage."""
    first, second = run_distributed(_damaged_files_worker, 2, str(tmp_path))
    assert first == second  # every rank stops alike
    ckpt_dir = tmp_path / "checkpoints"
    for name, (_, _, why) in FILE_DAMAGES.items():
        assert re.fullmatch(rf"checkpoint {ckpt_dir / 'step_000003'} is damaged \({why}\); use an earlier one, such "
                            rf"as {ckpt_dir / 'step_000002'}", first[name]), (name, first[name])
    # not the newest earlier one, step 2, which is damaged too: the newest intact one
    assert re.fullmatch(rf"checkpoint .*step_000003 is damaged \(its file __1_0.distcp {CHANGED}\); use an earlier "
                        rf"one, such as {ckpt_dir / 'step_000001'}", first["newest two flipped"])
    assert first["all flipped"].endswith("); no earlier one is left")
    assert first["a file added"] == first["undone"] == "loaded the state saved"


def test_a_checkpoint_records_the_size_and_sha256_of_every_file_it_was_saved_with(saved_on_two):
    run_dir, _ = saved_on_two
    path = latest_checkpoint(run_dir)
    record = json.loads((path / "meta.json").read_text())["files"]
    assert sorted(record) == sorted(p.name for p in path.iterdir() if p.name != "meta.json")
    assert sorted(record) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in record.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_checkpoint_saved_before_checksums_still_loads_quietly(tmp_path, caplog, recwarn):
    model = make_stage(0, 1)
    opt = train(model)
    path = save_checkpoint(tmp_path, 1, model, opt, EXTRA, keep_last=1)
    unrecord(path)
    fresh = make_stage(0, 1, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    assert load_checkpoint(path, fresh, fresh_opt) == EXTRA
    assert_same(snapshot(fresh, fresh_opt), snapshot(model, opt))
    # no warning (torch's own debug records of DCP may be there, as logging was set up by earlier tests)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING] and not recwarn.list


# ---------------------------------------------------------------- ranks that find different files


def _unreadable_on_rank_1(rank, world_size, run_dir, name):
    """Save steps 1 and 2; then load step 2 where its file `name` cannot be read on rank 1 alone (another node's view
    of the files): each rank's error."""
    model = make_stage(rank, world_size)
    opt = train(model)
    for step in (1, 2):
        save_checkpoint(run_dir, step, model, opt, {"step": step}, keep_last=0)
    path = Path(run_dir) / "checkpoints" / "step_000002"
    if rank == 1:
        opened = builtins.open

        def refusing(file, *args, **kwargs):
            if Path(file) == path / name:
                raise PermissionError(13, "Permission denied", str(file))
            return opened(file, *args, **kwargs)

        builtins.open = io.open = refusing
    try:
        load_checkpoint(path, make_stage(rank, world_size, seed=1), None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.parametrize("name", ["meta.json", ".metadata"])
def test_a_file_one_rank_cannot_read_fails_every_rank_alike(tmp_path, name):
    """Rank 1 raised PermissionError (or, for .metadata, went on to name an earlier checkpoint) while rank 0 went on
    to the next step of the load, waiting for rank 1 (until the group's timeout, 30 minutes by default)."""
    first, second = run_distributed(_unreadable_on_rank_1, 2, str(tmp_path), name, timeout=30)
    assert first == second and "Permission denied" in first and name in first, (first, second)


def _malformed_record(rank, world_size, run_dir):
    """Save a checkpoint, then load it after a key of its meta.json's record of one file changed (a bit flipped)."""
    model = make_stage(rank, world_size)
    path = save_checkpoint(run_dir, 1, model, train(model), {"step": 1}, keep_last=0)
    torch.distributed.barrier()
    if rank == 0:
        meta = json.loads((path / "meta.json").read_text())
        meta["files"]["__1_0.distcp"]["sha2w6"] = meta["files"]["__1_0.distcp"].pop("sha256")
        del meta["sha256"]  # as before meta.json was sealed, which finds the flip itself
        (path / "meta.json").write_text(json.dumps(meta))
    torch.distributed.barrier()
    try:
        load_checkpoint(path, make_stage(rank, world_size, seed=1), None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_malformed_record_of_files_is_damage_on_every_rank(tmp_path):
    """The rank whose share held the file raised KeyError: 'sha256' while the other waited for it."""
    first, second = run_distributed(_malformed_record, 2, str(tmp_path), timeout=30)
    assert first == second, (first, second)
    assert re.fullmatch(r"DamagedCheckpointError: checkpoint .*step_000001 is damaged \(its meta.json cannot be read: "
                        r".*\); no earlier one is left", first), first


def test_a_bit_flipped_in_meta_json_is_damage(tmp_path):
    """meta.json was the one file of a checkpoint without a checksum: a step or data position changed by a flipped
    bit still parsed, and the run resumed from the wrong place; a checkpoint saved before the seal still loads."""
    model = make_stage(0, 1)
    opt = train(model)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"step": step, "data": {"position": 1234}}, keep_last=0)
    path = tmp_path / "checkpoints" / "step_000002"
    text = (path / "meta.json").read_text()
    (path / "meta.json").write_text(text.replace('"position": 1234', '"position": 1235'))
    with pytest.raises(ValueError, match=r"step_000002 is damaged \(its meta.json changed since it was saved \(its "
                                         r"sha256 is not that of its content\)\); use an earlier one, such as "
                                         r".*step_000001"):
        read_extra(path)
    with pytest.raises(ValueError, match=r"its meta.json changed since it was saved"):
        load_checkpoint(path, model, opt)
    (path / "meta.json").write_text(text)
    unrecord(path)
    assert read_extra(path) == {"step": 2, "data": {"position": 1234}}
    assert load_checkpoint(path, model, opt) == {"step": 2, "data": {"position": 1234}}


def _meta_lacking_a_key_on_rank_1(rank, world_size, run_dir):
    """Save a checkpoint with optimizer state; rank 1 alone reads its meta.json without "has_optimizer" (another
    node's view, half-written by hand): the error each rank raises on loading it with an optimizer."""
    model = make_stage(rank, world_size)
    opt = train(model)
    path = save_checkpoint(run_dir, 1, model, opt, {"step": 1}, keep_last=0)
    if rank == 1:
        read_meta = ckpt.read_meta
        ckpt.read_meta = lambda p: {k: v for k, v in read_meta(p).items() if k != "has_optimizer"}
    fresh = make_stage(rank, world_size, seed=1)
    try:
        load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_any_error_of_one_rank_in_a_loads_checks_stops_every_rank(tmp_path):
    """Only file errors were passed on: rank 1's KeyError left rank 0 waiting for it in the next collective."""
    first, second = run_distributed(_meta_lacking_a_key_on_rank_1, 2, str(tmp_path), timeout=30)
    assert first == second == "KeyError: 'has_optimizer'", (first, second)


def _older_incomplete_on_rank_1(rank, world_size, run_dir):
    """Steps 1 and 2 saved before records, step 3 with a byte flipped; rank 1 alone sees step 2 lacking its .metadata
    (another node's view): the error each rank raises on loading step 3."""
    model = make_stage(rank, world_size)
    opt = train(model)
    paths = [save_checkpoint(run_dir, step, model, opt, {"step": step}, keep_last=0) for step in (1, 2, 3)]
    torch.distributed.barrier()
    if rank == 0:
        for path in paths[:2]:
            unrecord(path)
        _flip_a_byte(paths[2] / "__1_0.distcp")
    if rank == 1:
        missing_parts = ckpt_dirs._missing_parts
        ckpt_dirs._missing_parts = lambda path: [".metadata"] if path == paths[1] else missing_parts(path)
    torch.distributed.barrier()
    try:
        load_checkpoint(paths[2], make_stage(rank, world_size, seed=1), None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_ranks_that_see_an_older_checkpoint_otherwise_name_the_same_one(tmp_path):
    """Rank 0 named step 2, which it found complete, while rank 1 went on to check step 1 and waited for rank 0."""
    first, second = run_distributed(_older_incomplete_on_rank_1, 2, str(tmp_path), timeout=30)
    earlier = tmp_path / "checkpoints" / "step_000001"
    assert first == second and first.endswith(f"use an earlier one, such as {earlier}"), (first, second)


def test_the_checkpoint_a_damage_error_names_is_quoted_for_a_shell_where_it_must_be(tmp_path):
    """The advice may be a command to copy (--resume PATH, the export command): a path with a space broke it."""
    from pipeline_parallel.checkpoint import DamagedCheckpointError
    from pipeline_parallel.config import ConfigError
    from pipeline_parallel.export import export_command
    from pipeline_parallel.resume import as_resume_error

    def resume_advice(run: Path) -> str:
        with pytest.raises(ConfigError) as raised, as_resume_error():
            raise DamagedCheckpointError(run / "step_2", "its file x has changed", run / "step_1")
        return str(raised.value)

    assert resume_advice(tmp_path).endswith(f"resume from an earlier one with --resume {tmp_path / 'step_1'}")
    assert resume_advice(tmp_path / "my run").endswith(f"resume from an earlier one with --resume "
                                                      f"'{tmp_path / 'my run' / 'step_1'}'")
    assert export_command(tmp_path / "my run" / "step_1", "DIR") == (f"python -m pipeline_parallel.export "
                                                                     f"'{tmp_path / 'my run' / 'step_1'}' --out DIR")


def test_a_checkpoint_of_another_format_is_refused_before_any_tensor_is_loaded(tmp_path):
    """A checkpoint written in another format (by a later version) was loaded as if it were this one's, its files read
    by today's layout. It is refused, by its format, and the model is left as it was."""
    model = make_stage(0, 1)
    path = save_checkpoint(tmp_path, 1, model, train(model), {"step": 1}, keep_last=0)
    meta = ckpt_dirs.read_meta(path)
    (path / "meta.json").write_text(ckpt_dirs.meta_text({**meta, "format_version": 2}))  # sealed as a save seals it
    fresh = make_stage(0, 1, seed=1)
    before = {name: p.clone() for name, p in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"has checkpoint format 2; this version of pipeline_parallel reads format 1"):
        load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(p, before[name]) for name, p in fresh.state_dict().items())


def test_a_load_into_a_model_with_pending_gradients_restores_the_optimizer_state(tmp_path):
    """Every load in the tests goes into a fresh model. One that has gradients (a notebook that trained a step, then
    loads) kept them: AdamW's state was not created to load into, and the next step added the stale gradients."""
    model = make_stage(0, 1)
    opt = train(model)
    path = save_checkpoint(tmp_path, 1, model, opt, {}, keep_last=0)
    other = make_stage(0, 1, seed=1)
    for p in other.parameters():  # pending gradients, and no optimizer state yet
        p.grad = torch.ones_like(p)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    load_checkpoint(path, other, other_opt)
    assert all(p.grad is None for p in other.parameters())
    assert_same(snapshot(other, other_opt), snapshot(model, opt))


def test_a_negative_step_or_keep_last_is_refused_before_anything_is_written(tmp_path):
    """A negative step was saved as step_-00001, which no later lookup finds; a negative keep_last
    silently kept every checkpoint."""
    model = make_stage(0, 1)
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got -1"):
        save_checkpoint(tmp_path, -1, model, None, {}, keep_last=1)
    with pytest.raises(ValueError, match=r"keep_last must be >= 0 \(0 keeps every checkpoint\), got -1"):
        save_checkpoint(tmp_path, 1, model, None, {}, keep_last=-1)
    assert not (tmp_path / "checkpoints").exists()


def test_a_load_on_another_number_of_ranks_says_the_rng_is_not_restored(saved_on_two, caplog):
    """The note that the RNG states were not restored is what tells a resharded run why its dropout
    differs."""
    run_dir, _ = saved_on_two
    with caplog.at_level(logging.WARNING, logger="pipeline_parallel.checkpoint"):
        load_checkpoint(latest_checkpoint(run_dir), make_stage(0, 1, seed=1), None)
    assert "was saved on 2 rank(s), loading on 1: RNG states not restored" in caplog.text


@pytest.mark.parametrize("listed", ["sorted", "reversed"])
def test_a_step_beside_the_old_copy_a_killed_resave_left_is_the_step(tmp_path, monkeypatch, listed):
    """A kill after a re-save renamed step_N into place, before it removed the old one at step_N.old, leaves
    both: step_N is the checkpoint, whatever order the directory lists them in, and the next save drops the old."""
    model = make_stage(0, 1)
    ckpt_dir = tmp_path / "checkpoints"
    save_checkpoint(tmp_path / "before", 2, model, None, {"step": "old"}, keep_last=0)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, None, {"step": step}, keep_last=0)
    os.replace(tmp_path / "before" / "checkpoints" / "step_000002", ckpt_dir / "step_000002.old")
    iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(iterdir(self), reverse=listed == "reversed")))
    assert ckpt.saved_checkpoints(tmp_path) == [ckpt_dir / "step_000001", ckpt_dir / "step_000002"]
    (ckpt_dir / "latest").unlink()  # the fallback, too
    assert latest_checkpoint(tmp_path) == ckpt_dir / "step_000002"
    save_checkpoint(tmp_path, 3, model, None, {"step": 3}, keep_last=0)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000001", "step_000002", "step_000003"]
    assert read_extra(ckpt_dir / "step_000002") == {"step": 2}


def test_the_latest_pointer_is_renamed_into_place_whole(tmp_path, disk_events):
    """Written in place, a crash mid-write leaves `latest` empty or cut short; renamed into place, it names
    the old checkpoint or the new."""
    model = make_stage(0, 1)
    save_checkpoint(tmp_path, 1, model, None, {}, keep_last=0)
    save_checkpoint(tmp_path, 2, model, None, {}, keep_last=0)
    latest = tmp_path / "checkpoints" / "latest"
    assert ("replace", os.path.realpath(latest)) in disk_events and latest.read_text() == "step_000002\n"


def test_a_long_reason_from_torch_is_cut_at_the_end_of_a_sentence():
    """The reason a damaged checkpoint's tensors cannot be read comes from torch, which can run to pages."""
    assert ckpt._shortened("short") == "short"
    assert ckpt._shortened("The file is cut short. " + "x" * 400) == "The file is cut short."
    assert ckpt._shortened("y" * 400) == "y" * 300 + "..."


def test_a_metadata_file_that_unpickles_to_no_metadata_is_refused(tmp_path):
    """A .metadata of plain values (no class to refuse) stopped with an AttributeError from inside the load."""
    model = make_stage(0, 1)
    path = save_checkpoint(tmp_path, 1, model, None, {}, keep_last=1)
    (path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    unrecord(path)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata holds a dict, not Metadata"):
        load_checkpoint(path, model, None)
