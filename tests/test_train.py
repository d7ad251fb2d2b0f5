"""Tests for the training program: config errors, exact resume, reshard on load, crash-safe saves, torchrun."""

from __future__ import annotations

import contextlib
import io
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import types
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import _free_port, run_distributed
from _tokenizers import put_around_each_text

from pipeline_parallel import checkpoint as ckpt
from pipeline_parallel._dir_lock import lock_dir, unlock_dir
from pipeline_parallel.bpe import train_bpe
from pipeline_parallel.config import KEYS, ConfigError, OptimConfig, load_config, parse_args, to_toml, with_overrides
from pipeline_parallel.config_checks import check_config
from pipeline_parallel.data import prepare_data
from pipeline_parallel.export import load_full_model
from pipeline_parallel.launch import Interrupted, stop_asked, stop_signals_raise
from pipeline_parallel.metrics import MetricsLogger, bubble_fraction, plot_loss, read_metrics
from pipeline_parallel.optim import build_optimizer, lr_at
from pipeline_parallel.resume import RunComplete
from pipeline_parallel.tokenizer import load_tokenizer
from pipeline_parallel.train import main, run
from pipeline_parallel.trainer import CheckpointNotSaved, Trainer, TrainingDiverged

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """In-process runs set torch's thread count, as the program should; give the session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_stop_left():
    """A stop signal a test raised inside `stop_signals_raise` stays for `stop_asked` after it (main forgets its own as it
    ends): the next test, and the ranks it forks, start without it, as a new process does."""
    from pipeline_parallel import launch

    yield
    launch._stops.clear()


def make_cfg(run_dir: Path, corpus: tuple[Path, Path], **overrides):
    """A 4-layer, 32-wide model on the small corpus: 8 sequences of 32 tokens per step, no frills."""
    data, tokenizer = corpus
    base = {
        "run_dir": str(run_dir), "model.hidden_size": 32, "model.intermediate_size": 64,
        "model.num_hidden_layers": 4, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
        "model.max_position_embeddings": 64, "data.path": [str(data)], "data.tokenizer": str(tokenizer),
        "data.seq_len": 32, "data.eval_fraction": 0.05, "pipeline.num_microbatches": 4, "train.batch_size": 8,
        "train.max_steps": 6, "optim.lr": 1e-2, "optim.warmup_steps": 2, "optim.lr_decay_steps": 6,
        "eval.interval": 3, "eval.max_batches": 2, "checkpoint.interval": 0, "checkpoint.keep_last": 0,
        "log.progress": False, "log.tensorboard": False, "log.plot": False, "export.at_end": False,
        "num_threads": 1,  # forked ranks must not start an OpenMP pool the parent already used
    }
    return with_overrides(load_config(), **{**base, **overrides})


_MORE_STEPS = {"train.max_steps": 8}  # for a resume of the complete 6-step runs to have steps to train


def _fit(rank, world_size, cfg):
    records = run(cfg)
    # The group is run_distributed's, as a user's script may make one: the trainer must leave it to its maker.
    assert dist.is_initialized(), "run() destroyed a process group it did not create"
    return records


def _losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir / "metrics.jsonl") if key in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Two 2-rank runs: 6 uninterrupted steps, and 3 steps then resumed to 6 (checkpoints kept)."""
    root = tmp_path_factory.mktemp("runs")
    whole, split = root / "whole", root / "split"
    run_distributed(_fit, 2, make_cfg(whole, corpus))
    run_distributed(_fit, 2, make_cfg(split, corpus, **{"train.max_steps": 3}))
    resumed = run_distributed(_fit, 2, make_cfg(split, corpus))[-1]  # the last rank's records
    return whole, split, resumed


def test_config_errors(tmp_path, corpus):
    toml = tmp_path / "bad.toml"
    toml.write_text("[optim]\nlr = 1e-3\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        load_config(toml)
    with pytest.raises(ConfigError, match="did you mean optim.lr"):
        parse_args(["--optim.lrr", "1e-3"])
    # A key spelled both ways in one file: TOML takes them for two keys, and the later silently won.
    toml.write_text("[optim]\ngrad_clip = 0.5\ngrad-clip = 2.0\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(toml))} sets optim.grad_clip twice, as optim.grad_clip "
                                          r"and as optim.grad-clip: keep one$"):
        load_config(toml)
    assert parse_args(["--optim.grad_clip", "0.5", "--optim.grad-clip", "2"]).optim.grad_clip == 2.0  # the later
    with pytest.raises(ConfigError, match="must be int"):
        parse_args(["--train.batch_size", "eight"])
    # TOML's true is no count, nor 1 a switch (bool is an int to Python: isinstance would take the one for the other).
    for text, message in (("[train]\nbatch_size = true\n", "'train.batch_size' must be int, got True"),
                          ("[log]\nplot = 1\n", "'log.plot' must be bool, got 1")):
        toml.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(toml)
    # An infinite lr or eps passed the range checks: the first turned the weights to NaN in the first update,
    # the second silently froze training. An lr beyond float32 failed on every rank in the optimizer's first step.
    for args in (["--optim.lr", "inf"], ["--optim.eps", "-inf"], ["--export.temperature", "1e400"],
                 ["--optim.lr", "1e39"], ["--optim.weight_decay", "nan"]):
        with pytest.raises(ConfigError, match=rf"'{args[0][2:]}' must be a finite number of float32's range .*, got '{args[1]}'"):
            parse_args(args)
    toml.write_text("[optim]\nlr = inf\n")
    with pytest.raises(ConfigError, match="'optim.lr' must be a finite number of float32's range .*, got inf"):
        load_config(toml)
    cfg = make_cfg(tmp_path, corpus)
    check_config(cfg, 4)
    # In float32's range but not once AdamW's first step divides it by 1 - beta1: a traceback from the optimizer.
    with pytest.raises(ConfigError, match=r"optim.lr 1e\+38 is too large: AdamW's first step moves by up to "
                                          r"lr / \(1 - optim.beta1\) = 1e\+39, beyond float32's range"):
        check_config(with_overrides(cfg, **{"optim.lr": 1e38, "optim.min_lr": 0.0}), 4)
    with pytest.raises(ConfigError, match="the number of ranks: cannot split 4 decoder layers into 5 pipeline stages"):
        check_config(cfg, 5)
    with pytest.raises(ConfigError, match="batch_size 6 is not divisible by pipeline.num_microbatches 4"):
        check_config(with_overrides(cfg, **{"train.batch_size": 6}), 2)
    with pytest.raises(ConfigError, match="layer_counts"):
        check_config(with_overrides(cfg, **{"pipeline.layer_counts": [3, 2]}), 2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_config(with_overrides(cfg, **{"train.max_steps": 0}), 1)
    # The default decay ends at max_steps: a run shorter than its warmup never reached the lr, nor min_lr.
    with pytest.raises(ConfigError, match=r"train.max_steps 2 ends within optim.warmup_steps 2: the learning rate "
                                          r"would reach optim.lr at the last step at best and never decay to "
                                          r"optim.min_lr; set optim.warmup_steps below 2 \(0: none\)"):
        check_config(with_overrides(cfg, **{"train.max_steps": 2, "optim.lr_decay_steps": 0}), 1)
    check_config(with_overrides(cfg, **{"train.max_steps": 3, "optim.lr_decay_steps": 0}), 1)
    # A model smaller than the tokenizer: up front when the run trains the tokenizer, else once it is read.
    with pytest.raises(ConfigError, match=r"model.vocab_size 300 is below data.vocab_size 320, the size of the "
                                          r"tokenizer trained for the run, .*: raise model.vocab_size"):
        check_config(with_overrides(cfg, **{"data.tokenizer": "", "data.vocab_size": 320, "model.vocab_size": 300}), 1)
    with pytest.raises(ConfigError, match=r"the tokenizer has 320 tokens but model.vocab_size is 300, so some token "
                                          r"IDs would have no embedding row: .* or leave model.vocab_size unset"):
        Trainer(with_overrides(cfg, **{"model.vocab_size": 300}))
    # Checked up front, not after training (the end-of-run sample) or after reading the data.
    for key, value, message in (("export.temperature", -1.0, "export.temperature must be >= 0"),
                                ("export.top_k", -3, "export.top_k must be >= 0"),
                                ("data.vocab_size", 10, "data.vocab_size must be at least 257"),
                                ("data.tokenizer_train_chars", 0, "data.tokenizer_train_chars must be >= 1"),
                                ("data.seq_len", 0, "data.seq_len must be >= 1, got 0"),
                                ("export.sample_tokens", -1, "export.sample_tokens must be >= 0, got -1"),
                                ("optim.lr_decay_steps", 1, "optim.lr_decay_steps 1 must come after"),
                                ("optim.lr_decay_steps", 2, "optim.lr_decay_steps 2 must come after optim.warmup_steps 2"),
                                ("optim.beta1", 1.0, r"need 0 <= optim.beta1, beta2 < 1"),
                                ("data.eval_fraction", 1.0, r"data.eval_fraction must be in \[0, 1\), got 1.0"),
                                ("data.eval_fraction", 0.0, "eval.interval: data.eval_fraction = 0 holds out no"),
                                ("seed", 2**63, r"seed must be an integer from 0 to 2\*\*63 - 1, got 9223372036854775808"),
                                ("log.interval", 0, "log.interval must be >= 1, got 0"),
                                ("data.max_tokens", -1, "data.max_tokens must be >= 0, got -1"),
                                ("train.dtype", "fp16", "train.dtype must be fp32 or bf16, got 'fp16'"),
                                ("export.dtype", "fp16", "export.dtype must be fp32 or bf16, got 'fp16'"),
                                ("device", "gpu", "device must be auto, cpu or cuda, got 'gpu'"),
                                ("resume", "", "resume must be auto, latest, never or a complete checkpoint directory"),
                                ("resume", "runs/none/checkpoints/step_000099", r"resume must be auto, .* got "
                                 r"'runs/none/checkpoints/step_000099'; there is no runs/none/checkpoints/step_000099$"),
                                ("num_threads", 2**31, r"num_threads 2147483648 is more than torch can set \(at most "
                                                       r"2147483647; 0 gives each rank the node's cores / its ranks\)"),
                                ("run_dir", " ", "run_dir is empty"),  # it wrote the run into the current directory
                                # "" read the current directory ("data.path = ''" in TOML) or, on the command line,
                                # the standard library
                                ("data.path", [""], r"data.path \[''\] has an empty entry \(an unset variable\?\)"),
                                ("data.path", ["a.txt", " "], r"data.path .* has an empty entry .* leave data.path out "
                                                             r"to train on the Python standard library")):
        with pytest.raises(ConfigError, match=message):
            check_config(with_overrides(cfg, **{key: value}), 1)
    # The bounds themselves are settings that work: a constant lr, a model exactly the tokenizer's size.
    check_config(with_overrides(cfg, **{"optim.min_lr": cfg.optim.lr}), 1)
    check_config(with_overrides(cfg, **{"data.tokenizer": "", "data.vocab_size": 320, "model.vocab_size": 320}), 1)
    # With hf_model the shape is the model's own: a preset, like any model.* key, would be ignored.
    import transformers

    transformers.LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path / "hf")
    from_hf = with_overrides(load_config(), hf_model=str(tmp_path / "hf"))
    check_config(from_hf, 2)
    for key, value in (("model.preset", "small"), ("model.hidden_size", 64)):
        with pytest.raises(ConfigError, match=rf"{key} cannot be set with hf_model: its shape comes from its config"):
            check_config(with_overrides(from_hf, **{key: value}), 2)
    # Its context bounds the sequence length as our Llama's does (it used to be accepted silently).
    transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=64).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"data.seq_len 128 exceeds the max_position_embeddings 64 of hf_model"):
        check_config(from_hf, 2)
    check_config(with_overrides(from_hf, **{"data.seq_len": 64}), 2)  # the whole context is a sequence it takes
    # A config.json that says no number of layers, or is no JSON object, is named (they raised KeyError and
    # JSONDecodeError): GPT-2's counts its layers as n_layer.
    config_json = tmp_path / "hf" / "config.json"
    for text, message in ((transformers.GPT2Config(n_layer=2).to_json_string(), r"its config.json gives "
                           r"num_hidden_layers None, where a decoder-only model laid out as the pipeline splits it"),
                          ("{oops", r"its config.json is not JSON \(Expecting property name"),
                          ("[1, 2]", r"its config.json holds a list, not the settings of a model"),
                          # a count written as text, as a float or as true is no number of layers to split
                          *((transformers.LlamaConfig(num_hidden_layers=2).to_json_string()
                             .replace('"num_hidden_layers": 2', f'"num_hidden_layers": {layers}'),
                             rf"its config.json gives num_hidden_layers {re.escape(shown)}, where")
                            for layers, shown in (('"2"', "'2'"), ("2.0", "2.0"), ("true", "True")))):
        config_json.write_text(text)
        with pytest.raises(ConfigError, match=message):
            check_config(from_hf, 2)


def test_config_file_overrides_and_round_trip(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('run_dir = "r"\n[optim]\nlr = 1\n[data]\npath = "one.txt"\n[pipeline]\nlayer_counts = [1, 3]\n')
    cfg = parse_args(["--config", str(toml), "--optim.min-lr=0.5", "--log.plot", "false", "--resume"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.data.path, cfg.pipeline.layer_counts) == (1.0, 0.5, ["one.txt"], [1, 3])
    assert (cfg.log.plot, cfg.resume, cfg.run_dir) == (False, "latest", "r")
    # The command line overrides the file, and takes a shell's yes / no and none for a key that may be unset.
    toml.write_text('[optim]\nlr = 1\n[model]\nvocab_size = 512\n[log]\nplot = false\ntensorboard = true\n')
    cfg = parse_args(["--config", str(toml), "--optim.lr", "2", "--model.vocab-size", "none", "--log.plot", "yes",
                      "--log.tensorboard", "no"])
    assert (cfg.optim.lr, cfg.model.vocab_size, cfg.log.plot, cfg.log.tensorboard) == (2.0, None, True, False)
    toml.write_text('run_dir = "r"\n[optim]\nlr = 1\n[data]\npath = "one.txt"\n[pipeline]\nlayer_counts = [1, 3]\n')
    # A bare flag also sets a key that may be None; text outside the BMP survives the saved TOML.
    cfg = parse_args(["--model.tie-word-embeddings", "--export.prompt", "# \U0001F40D\x7f def", "--train.max_steps", "5"])
    assert (cfg.model.tie_word_embeddings, cfg.train.max_steps) == (True, 5)
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(saved).export.prompt == "# \U0001F40D\x7f def"  # DEL, too, which TOML allows escaped only
    (tmp_path / "again.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "again.toml") == cfg
    # A key's value is the next argument whatever it looks like: "-h" used to print the help instead.
    cfg = parse_args(["--export.prompt", "-h", "--resume", "--data.path", "--notes.txt", "--config=" + str(toml)])
    assert (cfg.export.prompt, cfg.resume, cfg.data.path, cfg.run_dir) == ("-h", "latest", ["--notes.txt"], "r")
    # An empty path stays one, for check_config to refuse (an unset $DATA trained on the standard library); an empty list
    # of numbers is the default.
    cfg = parse_args(["--data.path", "", "--pipeline.layer-counts", ""])
    assert (cfg.data.path, cfg.pipeline.layer_counts) == ([""], [])
    assert parse_args(["--data.path", "a.txt,,b.txt"]).data.path == ["a.txt", "", "b.txt"]
    with pytest.raises(ConfigError, match=r"unexpected argument '1e-3'; overrides look like --optim.lr 1e-3 "
                                          r"\(--train.max-steps took '--optim.lr' as its value: give it one\)"):
        parse_args(["--train.max_steps", "--optim.lr", "1e-3"])  # the message named only what was typed right
    with pytest.raises(ConfigError, match=r"^unexpected argument 'configs/tiny.toml'; a config file is given as "
                                          r"--config configs/tiny.toml$"):
        parse_args(["configs/tiny.toml"])


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--optim.lr", "1", "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert "--config CONFIG" in text and "--optim.lr 0.003" in text and "--model.hidden_size (unset)" in text
    assert all(f"--{key} " in text for key in KEYS)


def test_unreadable_settings_are_config_errors_before_the_data(tmp_path, corpus):
    (tmp_path / "latin1.toml").write_bytes("prompt = 'caf\xe9'".encode("latin-1"))
    for path, message in ((tmp_path, "cannot be read: Is a directory"), (tmp_path / "latin1.toml", "is not valid TOML")):
        with pytest.raises(ConfigError, match=f"config file {re.escape(str(path))} {message}"):
            load_config(path)
    undecodable = make_cfg(tmp_path / "r1", corpus, **{"data.path": [os.fsdecode(b"caf\xe9.txt")]})
    with pytest.raises(ConfigError, match="data.path: .* is not valid UTF-8 text .*; rename it"):
        Trainer(undecodable)
    with pytest.raises(ConfigError, match="export.prompt: .* is not valid UTF-8 text .*; give it in UTF-8"):
        Trainer(make_cfg(tmp_path / "r1", corpus, **{"export.prompt": os.fsdecode(b"caf\xe9")}))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="run_dir .*a-file/run cannot be written"):
        Trainer(make_cfg(tmp_path / "a-file" / "run", corpus))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device = cuda, but this torch .* finds no CUDA GPU; use device = cpu"):
            Trainer(make_cfg(tmp_path / "r2", corpus, device="cuda"))
    assert not list(tmp_path.glob("r*/tokens-*")), "all refused before the data was prepared"


def test_more_processes_on_a_node_than_gpus_is_a_config_error(monkeypatch, tmp_path, corpus):
    """The quick start (2 processes, device auto) on a machine with one GPU: rank 1 asked for cuda:1, which
    failed inside torch (as it would with a GPU short on any node)."""
    from pipeline_parallel import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for device in ("auto", "cuda"):
        with pytest.raises(ConfigError, match=f"device = {device} takes a CUDA GPU for each process, but this node runs "
                                              r"2 and has 1: launch at most 1 per node \(torchrun --nproc-per-node 1\), "
                                              "or set device = cpu"):
            launch.join_group(make_cfg(tmp_path, corpus, device=device))  # before any rank waits on another
    # As many GPUs as processes: each takes the one of its local rank.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for device in ("auto", "cuda"):
        assert launch.setup_device(make_cfg(tmp_path, corpus, device=device)) == torch.device("cuda", 1)


def test_a_gpu_rank_makes_its_gpu_current_before_joining_the_group(monkeypatch, tmp_path, corpus):
    """NCCL's object collectives (the settings check right after joining) carry their bytes on the current device: left
    at cuda:0, every process of a node would use GPU 0, and NCCL fails on a device its group is not bound to."""
    from pipeline_parallel import comm, launch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(launch.dist, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init_process_group", backend, kwargs)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch.join_group(make_cfg(tmp_path, corpus, device="cuda"))
    gpu = torch.device("cuda", 1)
    assert calls == [("set_device", gpu), ("init_process_group", "nccl", {"device_id": gpu})]
    # A Pipeline's default device is the local rank's GPU too, not the current one (cuda:0 unless set).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm.default_device() == gpu
    monkeypatch.delenv("LOCAL_RANK")
    assert comm.default_device() == torch.device("cuda", 0)


def test_each_rank_on_the_cpu_takes_its_share_of_the_node_s_cores_unless_num_threads_is_set(monkeypatch, tmp_path,
                                                                                             corpus):
    """Ranks that each take every core of their node slow each other down; more ranks than cores still need one
    thread each (torch refuses 0)."""
    from pipeline_parallel import launch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for local_ranks, num_threads, threads in (("4", 0, 2), ("16", 0, 1), ("4", 3, 3)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        cfg = make_cfg(tmp_path, corpus, device="cpu", num_threads=num_threads)
        assert launch.setup_device(cfg) == torch.device("cpu") and torch.get_num_threads() == threads, local_ranks


def _hold_run_dir(run_dir, held, release):
    lock_dir(run_dir)
    held.set()
    release.wait(60)


def _lock_from_another_process(run_dir) -> str:
    """What lock_dir says in a process of its own (a forked one would inherit this one's locks)."""
    code = ("import sys; from pipeline_parallel._dir_lock import DirectoryInUse, lock_dir\n"
            "try: lock_dir(sys.argv[1]); print('locked')\nexcept DirectoryInUse as e: print(e)")
    return subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_a_run_directory_another_run_holds_is_refused_until_that_run_ends(tmp_path, corpus):
    """Two runs in one run_dir overwrite each other's checkpoints and metrics (one resumed from the other's
    and deleted its half-written save): the second is a config error, until the first's process ends."""
    cfg = make_cfg(tmp_path / "run", corpus)
    (tmp_path / "run").mkdir()
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_run_dir, args=(tmp_path / "run", held, release))
    other.start()
    try:
        assert held.wait(30)
        with pytest.raises(ConfigError, match=rf"run_dir .*run is in use by another run \(pid {other.pid} on .*\): two "
                                              "runs in one directory .*; wait for that run to end"):
            Trainer(cfg)
        assert not list((tmp_path / "run").glob("tokens-*")), "refused before the data was prepared"
    finally:
        release.set()
        other.join(30)
    trainer = Trainer(cfg)  # the lock went with the process
    assert f"is in use by another run (pid {os.getpid()} on" in _lock_from_another_process(tmp_path / "run")
    trainer.fit()
    assert _lock_from_another_process(tmp_path / "run") == "locked"  # let go once the run finished


def test_a_run_directory_locked_again_or_by_a_relative_path_is_let_go(tmp_path, monkeypatch):
    """A run left unfinished in a process (an error in a notebook) does not bar the next one there, and a
    run_dir given relative ("runs/mine") is let go by the name it was locked by."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    lock_dir(Path("run"))
    lock_dir(tmp_path / "run")  # this process holds it already: nothing to do
    unlock_dir(Path("run"))
    assert _lock_from_another_process(tmp_path / "run") == "locked"


def test_a_process_that_let_go_of_its_run_directory_holds_it_again_for_its_next_run(tmp_path):
    """Runs one after another in one process (a notebook): the second must hold the directory as the first did,
    not take it for held still."""
    lock_dir(tmp_path)
    unlock_dir(tmp_path)
    assert _lock_from_another_process(tmp_path) == "locked"
    lock_dir(tmp_path)
    try:
        assert f"is in use by another run (pid {os.getpid()} on" in _lock_from_another_process(tmp_path)
    finally:
        unlock_dir(tmp_path)


def test_configs_and_docs_cover_every_key():
    for toml in sorted((ROOT / "configs").glob("*.toml")):
        check_config(load_config(toml), 2)
    docs = (ROOT / "README.md").read_text()
    assert [key for key in KEYS if f"`{key}`" not in docs] == []


def test_main_reports_config_errors(capsys, tmp_path, monkeypatch):
    """Also in torchrun's failure report, which showed a link to its docs where the error belongs."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # as torchrun gives each rank
    with pytest.raises(SystemExit) as exit_info:
        main(["--train.batch_size", "6"])
    assert exit_info.value.code == 2
    said = capsys.readouterr().err
    assert said.startswith("error: train.batch_size 6 is not divisible"), said
    failure = ProcessFailure(local_rank=1, pid=0, exitcode=2, error_file=str(tmp_path / "error.json"))
    report = ChildFailedError("pipeline_parallel.train", {1: failure}).format_msg()
    assert f"traceback : {said}" in report, report
    # Alone (no WORLD_SIZE), a process speaks whatever RANK a shell left set: it exited 2 saying nothing.
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        main(["--train.batch_size", "6"])
    assert capsys.readouterr().err.startswith("error: train.batch_size 6 is not divisible")


def test_only_rank_0_prints_how_the_run_ended_but_every_rank_tells_torchrun(monkeypatch, capsys, tmp_path):
    """Every rank ends alike, so rank 0 alone prints how (the line once, not once per rank); torchrun's report names
    whichever rank it finds failed first, so every rank writes the error for it. A setting to fix exits 2, any
    other failure 1."""
    import pipeline_parallel.train as train

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(train, "world_size", lambda: 2)
    failures = ((ConfigError("train.batch_size 6 is not divisible by pipeline.num_microbatches 4"), 2),
                (TrainingDiverged("step 3: loss nan, gradient norm nan"), 1))  # 1: no setting to fix

    def raises(error):
        def run(cfg):
            raise error
        return run

    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(train, "run", raises(RunComplete("the run is complete")))
        main([])  # returns: exit code 0
        assert capsys.readouterr().out == ("the run is complete\n" if rank == 0 else "")
        for error, code in failures:
            monkeypatch.setattr(train, "run", raises(error))
            with pytest.raises(SystemExit) as exit_info:
                main([])
            assert exit_info.value.code == code
            assert capsys.readouterr().err == (f"error: {error}\n" if rank == 0 else "")
            assert json.loads(error_file.read_text())["message"]["message"] == f"error: {error}"
            error_file.unlink()


def test_a_stop_signal_while_failing_reports_the_failure(monkeypatch, capsys, terminal_signals):
    """torchrun stops the other ranks with SIGTERM once one exits with the error they all raised: rank 0,
    still leaving its process group, said "interrupted by SIGTERM: ... resume" instead of the error."""
    import pipeline_parallel.train as train

    def run(cfg):
        try:
            raise ConfigError("train.batch_size 6 is not divisible by pipeline.num_microbatches 4")
        finally:
            _stop_by_signal(signal.SIGTERM)

    monkeypatch.setattr(train, "run", run)
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: train.batch_size 6 is not divisible by pipeline.num_microbatches 4\n"


def test_resume_gives_the_same_losses(runs):
    whole, split, resumed = runs
    assert [r["step"] for r in resumed if "loss" in r] == [4, 5, 6]
    assert _losses(split) == _losses(whole)  # exact: fp32 on CPU, same data, optimizer and LR position
    assert _losses(split, "eval_loss") == _losses(whole, "eval_loss")
    assert sorted(_losses(whole)) == [1, 2, 3, 4, 5, 6] and _losses(whole)[6] < _losses(whole)[1]


def test_the_learning_rate_warms_up_to_lr_then_reaches_min_lr_at_the_last_step(runs):
    """Steps are logged and saved counted from 1, but the cosine counted them from 0: lr_decay_steps (here
    max_steps) trained above min_lr, which came a step after it, and the peak lr was taken twice."""
    lr, min_lr, warmup, decay = 1e-2, 3e-4, 2, 6  # make_cfg's

    def cosine(step):  # torchtitan's warmup-cosine in these step numbers
        return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (decay - warmup))) * (lr - min_lr)

    want = {step: lr * step / warmup if step <= warmup else cosine(step) for step in range(1, 7)}
    assert _losses(runs[0], "lr") == pytest.approx(want, rel=1e-12)
    assert want[6] == pytest.approx(min_lr, rel=1e-12)


def test_the_learning_rate_stays_at_min_lr_from_lr_decay_steps_to_the_last_step():
    """Every run decayed to its last step (lr_decay_steps = max_steps), so a cosine that went on past
    lr_decay_steps, back up towards lr, would have gone unseen."""
    cfg = OptimConfig(lr=1e-2, min_lr=3e-4, warmup_steps=2, lr_decay_steps=4)
    lrs = [lr_at(step, cfg, max_steps=8) for step in range(8)]  # steps 1 to 8
    assert lrs[:3] == pytest.approx([5e-3, 1e-2, 3e-4 + 0.5 * (1e-2 - 3e-4)], rel=1e-12)  # step 3: half way down
    assert lrs[3:] == [3e-4] * 5


def test_resume_settings_are_checked_before_the_data(runs, corpus, tmp_path):
    whole = runs[0]
    metrics = (whole / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run .checkpoint step_000006.*new run_dir"):
        run(make_cfg(whole, corpus, resume="never"))  # would have rotated out its checkpoints and wiped its metrics
    assert (whole / "metrics.jsonl").read_text() == metrics
    assert ckpt.latest_checkpoint(whole).name == "step_000006"
    missing = {"data.path": [str(tmp_path / "no-such-file.txt")]}  # never read: the resume error comes first
    with pytest.raises(ConfigError, match="resume = latest, but .* holds no checkpoint"):
        run(make_cfg(tmp_path / "new", corpus, resume="latest", **missing))


def _main_with_rank_settings(rank, world_size, run_dir):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        main(["--run-dir", run_dir, "--train.max_steps", str(4 + rank), "--optim.lr", str(0.01 * (rank + 1))])
    return exit_info.value.code, stderr.getvalue()


def test_ranks_started_with_different_settings_fail_together(tmp_path, monkeypatch):
    (code0, said0), (code1, said1) = run_distributed(_main_with_rank_settings, 2, str(tmp_path), timeout=30)
    assert (code0, code1, said1) == (2, 2, "")  # without the check: a hang (max_steps), or training apart (lr)
    assert said0.startswith("error: the ranks were started with different settings: optim.lr: 0.01 on rank 0, 0.02 "
                            "on rank 1; train.max_steps: 4 on rank 0, 5 on rank 1; launch every rank"), said0
    # A rank that cannot even read its command line has not met the others: it reports itself.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        main(["--config", str(tmp_path / "only-on-rank-0.toml")])
    assert exit_info.value.code == 2
    assert stderr.getvalue().startswith("error: rank 1: config file"), stderr.getvalue()


def _main_where_rank_1_misses_a_file(rank, world_size, run_dir):
    if rank == 1:  # as on a node that does not see the directory: only this rank's checks fail
        import pipeline_parallel.trainer as trainer

        def check_config(cfg, world_size):
            raise ConfigError("hf_model /models/mine is not a directory")
        trainer.check_config = check_config
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        main(["--run-dir", run_dir, "--train.max_steps", "4", "--optim.warmup_steps", "2"])
    return exit_info.value.code, stderr.getvalue(), dist.is_initialized()


def test_a_check_that_fails_on_one_rank_stops_every_rank_and_is_printed(tmp_path):
    """Rank 1 used to stop alone and silently (only rank 0 prints), leaving rank 0 to wait for it. main leaves
    the process group it found (one its caller made) to its caller."""
    (code0, said0, kept0), (code1, said1, kept1) = run_distributed(_main_where_rank_1_misses_a_file, 2, str(tmp_path),
                                                                   timeout=30)
    assert (code0, code1, said1, kept0, kept1) == (2, 2, "", True, True)
    assert said0 == "error: rank 1: hf_model /models/mine is not a directory\n", said0


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM handled as in a terminal (in a job started with `&`, SIGINT is ignored, and stays so)."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def _stop_by_signal(signum):
    os.kill(os.getpid(), signum)
    time.sleep(10)  # the signal's handler raises before this ends


def test_a_stop_signal_after_the_program_ended_is_let_go(terminal_signals, capsys):
    """torchrun's copy of a Ctrl-C the ranks got too can come while a rank's interpreter shuts down, after the run's
    one line: a KeyboardInterrupt there printed a traceback ("Exception ignored in atexit callback")."""
    from pipeline_parallel.train import program

    with pytest.raises(SystemExit) as exit_info:
        program(["--no-such-option"])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # a handler runs between bytecodes: here it would raise, or SIGTERM end the tests


def test_the_first_stop_signal_raises_once_and_a_signal_the_launcher_ignores_stays_ignored(terminal_signals):
    """torchrun hands on the Ctrl-C a rank got, then sends SIGTERM: the second must not cut the clean-up of the
    first short. SIGINT ignored (a job started with `&` or nohup) stays so. A stop an earlier run in the process
    got is not this run's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with stop_signals_raise():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        with pytest.raises(Interrupted):  # and after a stop too, for the processes started later to inherit
            _stop_by_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with stop_signals_raise():
        with pytest.raises(Interrupted) as stop:
            _stop_by_signal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGINT)  # the second signal (its handler runs before this returns)
        except Interrupted:
            pytest.fail("the second stop signal raised again, cutting the clean-up of the first short")
        assert stop.value.signum == signal.SIGTERM and stop_asked() is stop.value
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == \
        (signal.default_int_handler, signal.SIG_DFL)
    with stop_signals_raise():
        assert stop_asked() is None


def _main_waiting_for_a_rank_that_never_joins(run_dir, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    main(["--run-dir", run_dir])


def test_a_stop_signal_ends_a_rank_waiting_for_the_others_to_join(tmp_path):
    """A rank whose command line failed exits before joining; torchrun then sends the others SIGTERM, whose Python
    handler could not run while torch's C++ code waited for that rank to join, until torchrun's SIGKILL 30 s later."""
    port = _free_port()
    rank0 = multiprocessing.get_context("fork").Process(
        target=_main_waiting_for_a_rank_that_never_joins, args=(str(tmp_path), port), daemon=True)
    rank0.start()
    for _ in range(600):  # until its store listens: it waits in the join
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.05)
    os.kill(rank0.pid, signal.SIGTERM)
    rank0.join(timeout=60)  # a guard against the wait the signal used to leave it in (the group's 30 min)
    if rank0.is_alive():
        rank0.kill()
    assert rank0.exitcode == -signal.SIGTERM
    assert not any(tmp_path.iterdir())  # nothing was written before the group existed


def test_an_interrupted_run_ends_with_one_line_that_says_how_to_resume(runs, tmp_path, monkeypatch, capsys,
                                                                       terminal_signals):
    """Ctrl-C or SIGTERM used to end each rank with a traceback (about 100 lines under torchrun)."""
    import pipeline_parallel.train as train

    latest = str(runs[0] / "checkpoints" / "step_000006")
    for run_dir, resume, signum, said in (
            (runs[0], "auto", signal.SIGTERM, r"run the same command to resume from its latest checkpoint, .*step_000006"),
            (runs[0], "latest", signal.SIGTERM, r"run the same command to resume from its latest checkpoint, .*step_000006"),
            # stopped while starting: the same command starts from the checkpoint it names again
            (runs[0], latest, signal.SIGTERM, rf"run the same command to resume from {latest} again"),
            (tmp_path, "auto", signal.SIGINT, "it saved no checkpoint yet")):
        monkeypatch.setattr(train, "run", lambda cfg, signum=signum: _stop_by_signal(signum))
        with pytest.raises(SystemExit) as exit_info:
            main(["--run-dir", str(run_dir), "--resume", resume])
        assert exit_info.value.code == 128 + signum
        err = capsys.readouterr().err
        assert re.fullmatch(rf"interrupted by {signal.Signals(signum).name}: .*{said}.*\n", err), err
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was before
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def _stop_caught_then_a_transfer_broken(signum):
    """The signal's exception caught on the way (DCP's save catches everything), then the error of a transfer
    the peer, stopped by the same signal, broke by leaving."""
    try:
        _stop_by_signal(signum)
    except BaseException:
        pass
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7402")


@pytest.mark.parametrize("stop", [_stop_by_signal, _stop_caught_then_a_transfer_broken], ids=["raised", "caught"])
def test_an_interrupted_resume_of_an_older_checkpoint_names_its_own(runs, corpus, tmp_path, monkeypatch, capsys,
                                                                    terminal_signals, stop):
    """A run started with --resume of an older checkpoint, stopped before it saved one, named run_dir's
    newest, of the run it abandoned: the --resume latest it advised went back to that run. Where the stop's
    exception was caught and a broken transfer followed, the rank ended with that error's traceback."""
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    shutil.copytree(runs[1], run_dir)  # step_000003, and the step_000006 to abandon
    start = run_dir / "checkpoints" / "step_000003"
    real_step = Trainer.train_step
    for interval, stop_at, said in (
            (0, 4, rf"run the same command to resume from {re.escape(str(start))} again \(steps after it are trained "
                   r"again\)"),
            (1, 5, r"run the same command with --resume latest to resume from its latest checkpoint, .*step_000004")):
        def train_step(self, stop_at=stop_at):
            record = real_step(self)
            if self.step == stop_at:
                stop(signal.SIGTERM)
            return record

        monkeypatch.setattr(Trainer, "train_step", train_step)
        config.write_text(to_toml(make_cfg(run_dir, corpus, **{"checkpoint.interval": interval})))
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", str(config), "--resume", str(start)])
        assert exit_info.value.code == 128 + signal.SIGTERM
        err = capsys.readouterr().err
        assert re.fullmatch(rf"interrupted by SIGTERM: {said}\n", err), err


def _file_io_turning_a_stop_into_its_own_error(real, interrupt_at: int):
    """A checkpoint's file write or read (`real`) that a stop signal interrupts in its `interrupt_at`-th call, and that
    then fails with an error of its own, as torch's file writer does ("unexpected pos")."""
    calls = []

    def io(self, *args):
        calls.append(1)
        if len(calls) == interrupt_at:
            try:
                _stop_by_signal(signal.SIGINT)
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 30 vs 0") from None
        return real(self, *args)

    return io


def test_a_stop_signal_a_checkpoint_file_turns_into_its_own_error_ends_the_run_as_a_stop(runs, corpus, tmp_path,
                                                                                          monkeypatch, capsys,
                                                                                          terminal_signals):
    """Ctrl-C while torch wrote a checkpoint's file ended the run with exit 1 and "could not write ...; make room or fix
    the directory", and while it read one on a resume, with "checkpoint ... is damaged; resume from an earlier one",
    where torch turned the interruption into an error of its own."""
    config = tmp_path / "run.toml"
    config.write_text(to_toml(make_cfg(tmp_path / "run", corpus, **{"checkpoint.interval": 1})))
    monkeypatch.setattr(ckpt.RecordingWriter, "write_data",
                        _file_io_turning_a_stop_into_its_own_error(ckpt.RecordingWriter.write_data, 2))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(config)])
    first = tmp_path / "run" / "checkpoints" / "step_000001"
    assert (exit_info.value.code, capsys.readouterr().err) == (
        128 + signal.SIGINT, f"interrupted by SIGINT: run the same command to resume from its latest checkpoint, "
                             f"{first} (steps after it are trained again)\n")
    assert sorted(p.name for p in first.parent.iterdir()) == ["latest", "step_000001"]
    assert stop_asked() is None  # main forgot it as it ended: a Trainer used after it took its failures for the stop's

    run_dir = tmp_path / "resumed"
    shutil.copytree(runs[0], run_dir)
    config.write_text(to_toml(make_cfg(run_dir, corpus, **{"train.max_steps": 8})))
    monkeypatch.setattr(ckpt.SafeFileSystemReader, "read_data",
                        _file_io_turning_a_stop_into_its_own_error(ckpt.SafeFileSystemReader.read_data, 1))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(config)])
    assert (exit_info.value.code, capsys.readouterr().err) == (
        128 + signal.SIGINT, f"interrupted by SIGINT: run the same command to resume from its latest checkpoint, "
                             f"{run_dir / 'checkpoints' / 'step_000006'} (steps after it are trained again)\n")


def test_a_run_interrupted_after_its_last_step_says_how_to_export_it(corpus, tmp_path, monkeypatch, capsys,
                                                                     terminal_signals):
    """Stopped while exporting at the end, it advised to resume; the same command then said the run was complete."""
    import pipeline_parallel.run_end as run_end

    config = tmp_path / "run.toml"
    # Stopped in the sample after the export: it is told the export is in place, not how to make one.
    config.write_text(to_toml(make_cfg(tmp_path / "sampled", corpus, **{"export.at_end": True,
                                                                        "export.sample_tokens": 4})))
    with monkeypatch.context() as patched:
        patched.setattr(run_end, "sample", lambda *args, **kwargs: _stop_by_signal(signal.SIGINT))
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", str(config)])
    last = tmp_path / "sampled" / "checkpoints" / "step_000006"
    assert capsys.readouterr().err == (f"interrupted by SIGINT: training had ended, and {last} holds its last step, "
                                       f"exported to {tmp_path / 'sampled' / 'export'}\n")
    # Stopped while exporting: told how to export.
    config.write_text(to_toml(make_cfg(tmp_path / "run", corpus, **{"export.at_end": True, "export.dtype": "bf16"})))
    monkeypatch.setattr(run_end, "export", lambda *args, **kwargs: _stop_by_signal(signal.SIGINT))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(config)])
    assert exit_info.value.code == 128 + signal.SIGINT
    last = tmp_path / "run" / "checkpoints" / "step_000006"
    assert capsys.readouterr().err == (f"interrupted by SIGINT: training had ended, and {last} holds its last step; "
                                       f"to export it: python -m pipeline_parallel.export {last} --dtype bf16\n")
    # A run that exports nothing at its end (stopped while drawing its loss curve) is not told to export.
    config.write_text(to_toml(make_cfg(tmp_path / "quiet", corpus, **{"log.plot": True})))
    monkeypatch.setattr(run_end, "plot_loss", lambda *args, **kwargs: _stop_by_signal(signal.SIGINT))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(config)])
    last = tmp_path / "quiet" / "checkpoints" / "step_000006"
    assert capsys.readouterr().err == f"interrupted by SIGINT: training had ended, and {last} holds its last step\n"


def _main_in_a_group_of_its_own(rank, world_size, run_dir, port):
    dist.destroy_process_group()  # main joins a group itself, as under torchrun
    os.environ["MASTER_PORT"] = str(port)
    code, _ = _main_with_rank_settings(rank, world_size, run_dir)
    return code, dist.is_initialized()


def test_main_leaves_the_group_it_joined_when_it_fails(tmp_path):
    """A group left to the interpreter's exit made some failed launches abort (SIGABRT, exit 134)
    instead of exiting with the error's code."""
    for code, still_joined in run_distributed(_main_in_a_group_of_its_own, 2, str(tmp_path), _free_port(), timeout=30):
        assert code == 2 and not still_joined


def _start(rank, world_size, cfg):
    with pytest.raises(ConfigError) as error:
        Trainer(cfg)
    return str(error.value)


def test_bad_data_and_resume_paths_are_config_errors_on_every_rank(runs, corpus, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(corpus[0].read_text()[:2000])  # about 40 sequences: fewer than a batch of 64
    for overrides, message in (
            ({"data.path": [str(tmp_path / "missing.txt")]}, "data: .*missing.txt"),
            ({"data.path": [str(small)], "train.batch_size": 64},
             r"train.batch_size: .* fewer than batch_size 64; add data \(or raise max_tokens"),
            ({"data.path": [str(small)], "data.seq_len": 64, "data.max_tokens": 60}, "data: .* only 60 tokens")):
        messages = run_distributed(_start, 2, make_cfg(tmp_path / "new", corpus, **overrides), timeout=30)
        assert messages[0] == messages[1]
        assert re.search(message, messages[0]), messages[0]
    with pytest.raises(ConfigError, match="is a run directory: give it as run_dir with resume = latest"):
        check_config(make_cfg(tmp_path / "new", corpus, resume=str(runs[0])), 2)
    half_written = runs[0] / "checkpoints" / "step_000006.tmp"
    half_written.mkdir()
    with pytest.raises(ConfigError, match="a complete checkpoint directory"):
        check_config(make_cfg(tmp_path / "new", corpus, resume=str(half_written)), 2)
    half_written.rmdir()
    (tmp_path / "new" / "export").mkdir(parents=True)
    (tmp_path / "new" / "export" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="export.at_end: .*export exists and is not an earlier export"):
        Trainer(make_cfg(tmp_path / "new", corpus, **{"export.at_end": True}))


def _layer_counts(rank, world_size, cfg):
    return Trainer(cfg).pipe.layer_counts


def test_stages_are_balanced_for_the_training_sequence_length(corpus, tmp_path):
    """At 8 tokens a layer's attention is cheap, so the 320-token head outweighs a layer: the last
    stage gets fewer layers than at Pipeline's default of 2048 tokens, where [3, 3] balances."""
    cfg = make_cfg(tmp_path / "short", corpus, **{"model.num_hidden_layers": 6, "data.seq_len": 8})
    assert run_distributed(_layer_counts, 2, cfg) == [[4, 2], [4, 2]]


def _slow_rank_worker(rank, world_size, cfg, port):
    """Rank 0 prepares the data and the last rank exports, each for longer than the group's timeout."""
    import pipeline_parallel.run_end as run_end
    import pipeline_parallel.trainer as trainer

    # Again, with a timeout shorter than the slow parts; long enough for the group's own start on a busy machine,
    # where 4 s sometimes ran out while the ranks connected ("Connection closed by peer").
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=6))
    for module, name in ((trainer, "prepare_data"), (run_end, "export")):
        real = getattr(module, name)
        setattr(module, name, lambda *a, real=real, **k: (time.sleep(7), real(*a, **k))[1])
    return len(run(cfg))


def test_ranks_wait_for_long_data_preparation_and_export(corpus, tmp_path):
    """The others wait in a group of their own while one rank works, not in one that times out."""
    cfg = make_cfg(tmp_path / "slow", corpus, **{"train.max_steps": 2, "eval.interval": 0, "export.at_end": True,
                                                  "export.sample_tokens": 0})
    assert run_distributed(_slow_rank_worker, 2, cfg, _free_port(), timeout=120) == [2, 2]
    assert (tmp_path / "slow" / "export" / "model.safetensors").is_file()


def test_weight_decay_takes_matrices_and_leaves_norms_and_biases_of_any_shape():
    """gpt_oss's per-expert biases are matrices by shape ([experts, width]) and were decayed like weights."""
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.ones(4, 8, 16))
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.ones(4, 16))
    model = torch.nn.ModuleDict({"experts": experts, "proj": torch.nn.Linear(8, 8), "norm": torch.nn.LayerNorm(8)})
    model.proj.weight.requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.5))
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [(group["weight_decay"], sorted(names[id(p)] for p in group["params"])) for group in optimizer.param_groups]
    assert groups == [(0.5, ["experts.gate_up_proj"]),
                      (0.0, ["experts.gate_up_proj_bias", "norm.bias", "norm.weight", "proj.bias"])]


def test_resume_uses_the_configured_optimizer_settings(runs, corpus):
    changed = {"optim.weight_decay": 0.0, "optim.beta1": 0.5, "optim.eps": 1e-3}
    trainer = Trainer(make_cfg(runs[0], corpus, **changed, **_MORE_STEPS))  # resumes at step 6 (saved on 2 ranks)
    assert trainer.step == 6
    for group in trainer.optimizer.param_groups:
        assert group["weight_decay"] == 0.0 and group["betas"][0] == 0.5 and group["eps"] == 1e-3
    assert trainer.optimizer.state  # the moments were loaded


def test_starting_a_complete_run_again_does_nothing_and_says_how_to_train_further(runs, corpus, tmp_path,
                                                                                  monkeypatch, capsys):
    """The same command again (a job started twice) prepared the data, loaded the checkpoint, exported and
    sampled again, and rewrote config.toml: the end of the run once more, for nothing."""
    import pipeline_parallel.trainer as trainer

    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    shutil.copytree(runs[0], run_dir)  # complete at step 6
    # The run's files, not .lock, which records who held the directory last (this start too)
    files = lambda: {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file() and path.name != ".lock"}
    before = files()
    monkeypatch.setattr(trainer, "prepare_data", None)  # not called
    last = run_dir / "checkpoints" / "step_000006"
    # A model setting given its preset's value, or another preset whose shape every setting overrides, is the same
    # model: they were refused ("model.rms_norm_eps None there, 1e-05 now").
    for max_steps, same_model in ((6, {}), (4, {}), (6, {"model.rms_norm_eps": 1e-5}), (6, {"model.preset": "small"})):
        config.write_text(to_toml(make_cfg(run_dir, corpus, **{"train.max_steps": max_steps, "export.at_end": True,
                                                                **same_model})))
        main(["--config", str(config)])  # returns: exit code 0
        assert capsys.readouterr().out == (
            f"the run is complete: {last} is at step 6 and train.max_steps is {max_steps}, so there is nothing to "
            "train (nothing was changed). To train further, raise train.max_steps (the cosine then stretches to the "
            "new end unless optim.lr_decay_steps pins it); to export that checkpoint again: "
            f"python -m pipeline_parallel.export {last}\n")
        assert files() == before
    # Another model, data or seed in that run_dir (the default one after the quick start): meant as a new run,
    # which it did not start, and said it trained nothing, exit code 0.
    for change, differs in [({"model.num_hidden_layers": 3}, "model.num_hidden_layers 4 there, 3 now"),
                            ({"model.rope_theta": 5e5}, "model.rope_theta 10000.0 there, 500000.0 now"),
                            ({"data.seq_len": 16}, "data.seq_len 32 there, 16 now"), ({"seed": 1}, "seed 0 there, 1 now")]:
        config.write_text(to_toml(make_cfg(run_dir, corpus, **change)))
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", str(config)])
        assert exit_info.value.code == 2 and files() == before
        assert capsys.readouterr().err == (
            f"error: the run in {run_dir} is complete (step_000006, train.max_steps 6), and it was started with "
            f"other settings ({differs}): nothing was changed. Give a new run_dir for a new run, or its own settings "
            "to train it further or export it\n")


def test_a_damaged_newest_checkpoint_is_a_config_error_naming_an_earlier_one(corpus, tmp_path):
    """Also where the damaged checkpoint is named itself, to resume from or export, which said "resume must be ...
    a complete checkpoint directory" and "is neither a checkpoint nor a run directory with checkpoints"."""
    from pipeline_parallel.export import resolve_checkpoint

    cfg = make_cfg(tmp_path, corpus, **{"train.max_steps": 2, "checkpoint.interval": 1, "checkpoint.keep_last": 2,
                                        "eval.interval": 0, "pipeline.num_microbatches": 1})
    run(cfg)
    damaged = tmp_path / "checkpoints" / "step_000002"
    (damaged / "meta.json").unlink()
    for resume in ("auto", str(damaged)):
        with pytest.raises(ConfigError, match=r"resume: checkpoint .*step_000002 is damaged \(it lacks meta.json\); "
                                              r"resume from an earlier one with --resume .*step_000001$"):
            Trainer(with_overrides(cfg, resume=resume, **{"train.max_steps": 3}))
    for named in (tmp_path, damaged):
        with pytest.raises(ckpt.DamagedCheckpointError, match=r"checkpoint .*step_000002 is damaged \(it lacks "
                                                              r"meta.json\); use an earlier one, such as .*step_000001$"):
            resolve_checkpoint(named)
    earlier = tmp_path / "checkpoints" / "step_000001"  # the advice, followed: once refused for the damaged newest one
    assert Trainer(with_overrides(cfg, resume=str(earlier), **{"train.max_steps": 3})).step == 1


def test_a_checkpoint_of_another_run_does_not_resume_into_a_run_directory_holding_a_run(runs, corpus, tmp_path):
    """It did, and its saves replaced that run's checkpoints and its metrics took over that run's."""
    other = shutil.copytree(runs[1], tmp_path / "other")  # checkpoints at steps 3 and 6
    files = lambda: {path: path.read_bytes() for path in other.rglob("*") if path.is_file() and path.name != ".lock"}
    before = files()
    foreign = runs[0] / "checkpoints" / "step_000006"
    with pytest.raises(ConfigError, match=f"resume = {foreign} is a checkpoint of another run directory, but {other} "
                                          r"holds a run of its own \(checkpoint step_000006\), .*give a new run_dir"):
        Trainer(make_cfg(other, corpus, resume=str(foreign), **_MORE_STEPS))
    assert files() == before
    own = other / "checkpoints" / "step_000003"  # one of its own: going back is the user's to choose
    assert Trainer(make_cfg(other, corpus, resume=str(own), **_MORE_STEPS)).step == 3


def _resumed_step(rank, world_size, cfg):
    return Trainer(cfg).step


def test_a_changed_file_of_the_newest_checkpoint_stops_every_rank_with_the_option_that_resumes_an_intact_one(
        runs, corpus, tmp_path):
    """A flipped byte was loaded: the run went on from other weights, or stopped on an error from inside torch that
    named no file (here "'utf-8' codec can't decode byte 0x9a"), and the checkpoint to resume from without a way to."""
    run_dir = shutil.copytree(runs[1], tmp_path / "run")  # step 3, then step 6
    shard = run_dir / "checkpoints" / "step_000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    cfg = make_cfg(run_dir, corpus, **_MORE_STEPS)
    earlier = run_dir / "checkpoints" / "step_000003"
    for message in run_distributed(_start, 2, cfg):
        assert message == (f"resume: checkpoint {shard.parent} is damaged (its file __1_0.distcp has changed since it "
                           f"was saved (its SHA-256 is not the one recorded)); resume from an earlier one with "
                           f"--resume {earlier}"), message
    assert run_distributed(_resumed_step, 2, with_overrides(cfg, resume=str(earlier))) == [3, 3]


def test_resume_with_another_model_names_what_differs(runs, corpus):
    with pytest.raises(ConfigError, match=r"step_000006 holds another model than configured \(head_dim 8 there, 12 "
                       r"now; hidden_size 32 there, 48 now\): resume with the model settings it was trained with, or "
                       r"start a new run_dir"):
        Trainer(make_cfg(runs[0], corpus, **_MORE_STEPS, **{"model.hidden_size": 48}))
    # Settings that change no shape were taken: the run went on training a model that exists nowhere.
    with pytest.raises(ConfigError, match=r"holds another model than configured \(rms_norm_eps 1e-05 there, 0.5 now; "
                       r"rope_(theta|parameters) .*10000.0.* there, .*500000.0.* now\)"):
        Trainer(make_cfg(runs[0], corpus, **_MORE_STEPS, **{"model.rope_theta": 500000.0, "model.rms_norm_eps": 0.5}))


def test_resume_with_another_tokenizer_is_refused_and_leaves_the_run_as_it_was(runs, corpus, tmp_path):
    whole = runs[0]
    text = corpus[0].read_text()
    other = train_bpe([text[len(text) // 2:] + text[: len(text) // 2].upper()], vocab_size=320)
    other.save(tmp_path)
    assert other.vocab_size == 320  # the same model shape: only the tokenizer tells them apart
    kept = {name: (whole / name).read_bytes() for name in ("config.toml", "tokenizer/tokenizer.json")}
    with pytest.raises(ConfigError, match=r"step_000006 was trained with another tokenizer than the run has now "
                                          r"\(data.tokenizer, or where that is empty the run directory's own "
                                          r"tokenizer.json\): resume with the tokenizer it was trained with"):
        Trainer(make_cfg(whole, corpus, **_MORE_STEPS, **{"data.tokenizer": str(tmp_path / "tokenizer.json")}))
    assert {name: (whole / name).read_bytes() for name in kept} == kept


def test_resume_on_other_data_of_the_same_size_is_refused(corpus, tmp_path):
    """The loader's position means nothing in another token stream, even one of as many sequences."""
    other = tmp_path / "other.txt"
    other.write_text("\n".join(reversed(corpus[0].read_text().splitlines())))
    own = {"data.max_tokens": 20_000, "train.max_steps": 1, "pipeline.num_microbatches": 1, "checkpoint.interval": 1}
    run(make_cfg(tmp_path / "run", corpus, **own))
    config = (tmp_path / "run" / "config.toml").read_bytes()
    with pytest.raises(ConfigError, match=r"step_000001 was trained on other data than data.path and "
                                          r"data.max_tokens give now .*--hf-model"):
        Trainer(make_cfg(tmp_path / "run", corpus, **{**own, "data.path": [str(other)], "train.max_steps": 2}))
    assert (tmp_path / "run" / "config.toml").read_bytes() == config
    Trainer(make_cfg(tmp_path / "run", corpus, **{**own, "train.max_steps": 2}))  # the same data resumes


def test_a_resume_on_a_stream_another_version_made_says_the_data_may_be_unchanged(corpus, tmp_path):
    """A run on documents over a million characters, which this version cuts into pieces otherwise than the one
    that trained it, was refused as trained on other data than data.path gives; its data were the same. The
    cache and checkpoint record the version of the program's tokenization (none before), so that is said."""
    from pipeline_parallel.token_cache import STREAM_VERSION

    own = {"data.max_tokens": 20_000, "train.max_steps": 1, "pipeline.num_microbatches": 1, "checkpoint.interval": 1}
    run(make_cfg(tmp_path / "run", corpus, **own))
    (record,) = (tmp_path / "run").glob("tokens-*.sha256")
    assert record.read_text().split()[2] == str(STREAM_VERSION)
    meta = tmp_path / "run" / "checkpoints" / "step_000001" / "meta.json"
    saved = json.loads(meta.read_text())
    assert saved["extra"]["data_version"] == STREAM_VERSION
    del saved["extra"]["data_version"]  # as an earlier version saved it, on the stream it made of the same text
    saved["extra"]["data_digest"] = "0" * 64
    del saved["sha256"]  # nor was its meta.json sealed
    meta.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=rf"step_000001 was trained on a token stream that another version of this "
                       rf"program made \(which recorded no version\), and data.path gives another now \(version "
                       rf"{STREAM_VERSION}\): the data may be unchanged, only tokenized differently \(version 3 cuts a "
                       rf"document over a million characters between words .*\), but the run's place .*\. Resume with the version of "
                       rf"pipeline_parallel that trained it, or start a new run_dir .*--hf-model"):
        Trainer(make_cfg(tmp_path / "run", corpus, **{**own, "train.max_steps": 2}))


def test_settings_for_another_trained_tokenizer_are_refused_not_ignored(corpus, tmp_path):
    """The BPE trained in a run_dir is reused there, so asking for another vocabulary must be an error,
    also when the start that trained it failed before its settings were saved as config.toml."""
    own = {"data.tokenizer": "", "data.vocab_size": 300, "train.max_steps": 1, "pipeline.num_microbatches": 1}
    with pytest.raises(ConfigError, match="train.batch_size"):  # fails after the tokenizer was trained
        Trainer(make_cfg(tmp_path, corpus, **{**own, "train.batch_size": 10_000}))
    assert (tmp_path / "tokenizer.json").is_file() and not (tmp_path / "config.toml").exists()
    for started in (False, True):
        if started:
            run(make_cfg(tmp_path, corpus, **own))
        for key, value in (("vocab_size", 400), ("tokenizer_train_chars", 1000)):
            with pytest.raises(ConfigError, match=rf"data: .*tokenizer.json was trained with {key} = .*, and a run "
                                                  rf"there reuses it, but {key} = {value} is asked for: .*new run"):
                Trainer(make_cfg(tmp_path, corpus, **{**own, f"data.{key}": value, "train.max_steps": 2}))
    Trainer(make_cfg(tmp_path, corpus, **{**own, "train.max_steps": 2}))  # the same tokenizer settings resume
    record = tmp_path / "tokenizer-trained-with.json"
    for damaged in ('{"vocab_size": 3', "[]"):  # a JSONDecodeError naming no file; an AttributeError's traceback
        record.write_text(damaged)
        with pytest.raises(ConfigError, match=r"data: .*tokenizer-trained-with.json is damaged \(.*\): it records what "
                                              r".*tokenizer.json was trained with; write it again"):
            Trainer(make_cfg(tmp_path, corpus, **{**own, "train.max_steps": 2}))


def test_the_export_carries_the_tokenizer_of_its_run_not_one_an_earlier_start_kept(corpus, tmp_path):
    """A run with a given tokenizer keeps a copy for its export; a later run there that trains its own (after
    its checkpoints were deleted) must export that one, and a given one must replace the old copy whole."""
    text = "def f(x):\n    return {'key': [x, 1.5]}"
    run_dir, copy = tmp_path / "run", tmp_path / "run" / "tokenizer"
    train_bpe([corpus[0].read_text()], vocab_size=280).save(tmp_path / "given")
    for tokenizer in ("", str(tmp_path / "given"), str(corpus[1]), ""):
        if (run_dir / "checkpoints").exists():
            shutil.rmtree(run_dir / "checkpoints")
        if copy.exists():
            (copy / "from-another-kind.json").write_text("{}")  # must not outlive a new copy
        run(make_cfg(run_dir, corpus, **{"data.tokenizer": tokenizer, "data.vocab_size": 300, "train.max_steps": 1,
                                         "pipeline.num_microbatches": 1, "checkpoint.interval": 1}))
        expected = load_tokenizer(tokenizer or run_dir / "tokenizer.json")
        _, exported = load_full_model(run_dir)
        assert exported.encode(text) == expected.encode(text) and exported.vocab_size == expected.vocab_size
        assert copy.is_dir() == bool(tokenizer) and not (copy / "from-another-kind.json").exists()


def test_a_metrics_line_cut_off_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="record 1, is not JSON"):
        read_metrics(path)


def test_a_damaged_metrics_file_stops_every_rank_with_its_line(runs, corpus, tmp_path):
    """Only the last rank reads the file: it used to stop alone, the first rank with gloo's error in its step."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs[0], run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join([lines[0], "garbage\n", *lines[2:]]))
    for message in run_distributed(_start, 2, make_cfg(run_dir, corpus, **{"train.max_steps": 8})):
        assert re.fullmatch(r"rank 1: .*metrics.jsonl, record 2, is not JSON: 'garbage'; "
                                                      r"repair or delete that line", message), message


def _png_rows(path: Path) -> list[list[tuple[int, int, int]]]:
    """The pixels, row by row, of an 8-bit RGB PNG of 800 x 500 whose rows are unfiltered, as the built-in renderer
    writes one, read as the PNG format says: chunks (each with its CRC), IHDR, then the zlib-compressed rows, a
    filter byte each."""
    data, chunks, at = path.read_bytes(), {}, 8
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body, (crc,) = data[at + 8:at + 8 + length], struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind], at = chunks.get(kind, b"") + body, at + 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color_type, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (width, height, depth, color_type) == (800, 500, 8, 2)
    rows = zlib.decompress(chunks[b"IDAT"])
    assert len(rows) == height * (1 + 3 * width) and rows[::1 + 3 * width] == bytes(height)  # filter 0: none
    stride = 1 + 3 * width
    return [[tuple(rows[y * stride + 1 + 3 * x:y * stride + 4 + 3 * x]) for x in range(width)] for y in range(height)]


def _png_colors(path: Path) -> set[tuple[int, int, int]]:
    return {color for row in _png_rows(path) for color in row}


_TRAIN_BLUE, _EVAL_ORANGE = (31, 119, 180), (255, 127, 14)


@pytest.fixture
def no_matplotlib(monkeypatch):
    """The built-in renderer, whether or not matplotlib is installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_the_loss_plot_leaves_out_a_loss_that_is_not_finite(tmp_path, no_matplotlib):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 7.5}\n{"step": 2, "loss": 5.0, "eval_loss": NaN}\n'
                    '{"step": 3, "loss": Infinity}\n{"step": 4, "loss": 4.0, "eval_loss": 4.5}\n')
    assert plot_loss(path, tmp_path / "loss.png") == "built-in"
    assert {_TRAIN_BLUE, _EVAL_ORANGE} <= _png_colors(tmp_path / "loss.png")


def test_the_loss_plot_of_a_single_step_or_an_unchanging_loss_is_drawn(tmp_path, no_matplotlib):
    """A run of one step, or a loss that stays put, gives its points one step, or one loss: the axes still span
    some range (a run of train.max_steps=1 ended with a ZeroDivisionError in the plot)."""
    path = tmp_path / "metrics.jsonl"
    for records in ('{"step": 1, "loss": 7.5, "eval_loss": 7.25}\n', '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 3.0}\n'):
        path.write_text(records)
        plot_loss(path, tmp_path / "loss.png")
        assert (_EVAL_ORANGE if "eval_loss" in records else _TRAIN_BLUE) in _png_colors(tmp_path / "loss.png")


def test_the_bubble_fraction_is_the_share_of_a_step_a_gpipe_schedule_leaves_idle():
    """With p equal stages and m microbatches each stage is busy m of the m + p - 1 slots of a GPipe/1F1B step."""
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


class _TakesPart:
    """A metrics file whose every write takes only the first `size` bytes it is given, as a raw write may."""

    def __init__(self, file, size: int):
        self.file, self.size = file, size

    def write(self, data: bytes) -> int:
        return self.file.write(data[: self.size])

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_each_metrics_record_is_in_the_file_whole_as_soon_as_it_is_logged(tmp_path):
    """metrics.jsonl is read while the run goes on (tail -f, a notebook): a record is in it once logged, not when
    a buffer fills or the run ends; and whole, also where a write takes only part of it."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "loss": 2.5})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}]
    logger.file = _TakesPart(logger.file, size=7)
    logger.log({"step": 2, "loss": 2.25, "lr": 0.01})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25, "lr": 0.01}]
    logger.close()


def test_tensorboard_events_read_as_one_run_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path)
    for step in range(1, 5):  # the run is killed after step 4, its last checkpoint at step 2
        first.log({"step": step, "loss": float(step), "note": "text is not a scalar"})
    first.close()
    resumed = MetricsLogger(tmp_path, start_step=2)
    for step in range(3, 6):
        resumed.log({"step": step, "loss": 10.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    want = [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]  # steps 3-4 of the killed run purged
    assert [(e.step, e.value) for e in events.Scalars("loss")] == want
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == want


def test_measured_idle_share_is_logged(runs):
    """Each logged step carries the ranks' measured idle share of their pipeline steps: 2 stages
    always leave some idle (the last waits for the first forward), and it is a share of the time; beside it the
    schedule's own bubble, and the throughput with that bubble taken out (README: tok/s / (1 - bubble))."""
    whole, _, _ = runs
    idle = [r["measured_idle_fraction"] for r in read_metrics(whole / "metrics.jsonl") if "loss" in r]
    assert len(idle) == 6 and all(0 < share < 1 for share in idle), idle
    for logged in (r for r in read_metrics(whole / "metrics.jsonl") if "loss" in r):  # 2 stages, 4 microbatches
        assert logged["bubble_fraction"] == pytest.approx(1 / 5)  # GPipe/1F1B: idle 1 of the 4 + 2 - 1 slots
        assert logged["effective_tokens_per_s"] == pytest.approx(logged["tokens_per_s"] / (1 - 1 / 5))


def test_a_line_comes_every_log_interval_and_at_the_last_step_with_the_tokens_per_second_since_the_line_before(
        corpus, tmp_path, monkeypatch):
    """Every other run logged every step, one pipeline step each, so a last step off the interval left unlogged, a
    rate averaged since the start, or one that left out grad_accum_steps' batches would have gone unseen. The clock
    is the test's: step k takes k seconds."""
    import pipeline_parallel.trainer as trainer_module

    now = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    train_step = Trainer.train_step

    def timed(self):
        record = train_step(self)
        now[0] += self.step
        return record

    monkeypatch.setattr(Trainer, "train_step", timed)
    trainer = Trainer(make_cfg(tmp_path, corpus, **{"log.interval": 4, "train.grad_accum_steps": 2,
                                                   "eval.interval": 0}))
    lines = [r for r in trainer.fit() if "loss" in r]
    per_step = 2 * 8 * 32  # grad_accum_steps x batch_size x seq_len
    assert [r["step"] for r in lines] == [4, 6]
    want = [4 * per_step / (1 + 2 + 3 + 4), 2 * per_step / (5 + 6)]  # each line's tokens over its steps' seconds
    assert [r["tokens_per_s"] for r in lines] == pytest.approx(want)
    # The idle share is of the pipeline steps' time since the line before, all ranks' together.
    trainer._busy_seconds, trainer._pipeline_seconds = 3.0, 4.0
    assert trainer.measured_idle_fraction() == 0.25 and trainer.measured_idle_fraction() == 0.0


def test_a_run_keeps_only_its_newest_checkpoint_keep_last_checkpoints(corpus, tmp_path):
    """save_checkpoint's rotation is tested alone; every run of the trainer kept all its checkpoints."""
    run(make_cfg(tmp_path, corpus, **{"train.max_steps": 4, "eval.interval": 0, "checkpoint.interval": 1,
                                      "checkpoint.keep_last": 2}))
    assert [path.name for path in ckpt.saved_checkpoints(tmp_path)] == ["step_000003", "step_000004"]


@pytest.mark.parametrize("world_size, tie", [(1, False), (2, True)])
def test_grad_accumulation_equals_one_larger_batch(corpus, tmp_path, world_size, tie):
    """2 pipeline steps of 4 sequences per optimizer step train like 1 step of the same 8 sequences
    (on 2 ranks with tied embeddings too, whose two ends add up each step's gradient), also where
    step 3 starts a new epoch: 21 sequences of 33 tokens, one held out, leave 4 after two steps."""
    steps = {"train.max_steps": 3, "eval.interval": 0, "model.tie_word_embeddings": tie, "data.max_tokens": 21 * 33}
    fit = (lambda cfg: run(cfg)) if world_size == 1 else (lambda cfg: run_distributed(_fit, 2, cfg)[0])
    big = fit(make_cfg(tmp_path / "big", corpus, **steps))
    accum = fit(make_cfg(tmp_path / "accum", corpus, **steps, **{"train.batch_size": 4, "train.grad_accum_steps": 2}))
    for a, b in zip(big, accum, strict=True):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_recompute_trains_as_without_it(corpus, tmp_path):
    """`pipeline.recompute` changes what a step holds, not what it computes: on 2 ranks (the first stage
    recomputes every forward of 1F1B) the losses are those of the run without it, bit for bit."""
    steps = {"train.max_steps": 3, "eval.interval": 0}
    kept, recomputed = (run_distributed(_fit_recomputing, 2, make_cfg(tmp_path / name, corpus, **steps, **extra))
                        for name, extra in (("kept", {}), ("recomputed", {"pipeline.recompute": True})))
    assert [recompute for recompute, _ in kept] == [False, False]
    assert [recompute for recompute, _ in recomputed] == [True, True]
    assert [r["loss"] for r in kept[0][1]] == [r["loss"] for r in recomputed[0][1]] and len(kept[0][1]) == 3


def _fit_recomputing(rank, world_size, cfg):
    """Whether this rank's stage recomputes, and the run's metrics."""
    trainer = Trainer(cfg)
    return trainer.pipe.stage.recompute, trainer.fit()


def test_bf16_autocast(corpus, tmp_path):
    fp32 = run(make_cfg(tmp_path / "fp32", corpus, **{"train.max_steps": 2, "eval.interval": 0}))
    bf16 = run(make_cfg(tmp_path / "bf16", corpus, **{"train.max_steps": 2, "eval.interval": 0, "train.dtype": "bf16"}))
    for a, b in zip(fp32, bf16):
        assert a["loss"] != b["loss"] and a["loss"] == pytest.approx(b["loss"], abs=0.05)


def _resume_on(rank, world_size, cfg, expected):
    trainer = Trainer(cfg)
    for name, value in trainer.pipe.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    return trainer.fit()


@pytest.mark.parametrize("world_size", [1, 4])
def test_reshard_on_load(runs, corpus, tmp_path, world_size):
    whole, split, _ = runs
    step3 = split / "checkpoints" / "step_000003"
    expected, _ = load_full_model(step3)
    cfg = make_cfg(tmp_path, corpus, resume=str(step3))
    records = run_distributed(_resume_on, world_size, cfg, expected.state_dict(), timeout=120)[-1]
    want = _losses(whole)
    for record in records:
        if "loss" in record:
            assert record["loss"] == pytest.approx(want[record["step"]], abs=1e-5)
    assert [r["step"] for r in records if "loss" in r] == [4, 5, 6]


def test_interrupted_save_keeps_the_previous_checkpoint(runs, corpus, tmp_path, monkeypatch):
    whole = runs[0]
    cfg = make_cfg(tmp_path, corpus, **{"checkpoint.interval": 2, "train.max_steps": 4})
    real_commit = ckpt.commit

    def crash_at_step_4(tmp, final):
        if final.name == "step_000004":
            raise KeyboardInterrupt("killed while saving")
        real_commit(tmp, final)

    monkeypatch.setattr(ckpt, "commit", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    monkeypatch.setattr(ckpt, "commit", real_commit)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000002"
    assert (tmp_path / "checkpoints" / "step_000004.tmp").is_dir()  # the half-written one
    records = run(cfg)  # resumes from step 2
    assert [r["step"] for r in records if "loss" in r] == [3, 4]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000004"
    for step, loss in _losses(tmp_path).items():
        assert loss == pytest.approx(_losses(whole)[step], abs=1e-5)


def _diverge_at_step_3(rank, world_size, cfg):
    """Train with the first stage's weights turned to NaN before the third step; returns what was raised."""
    trainer = Trainer(cfg)
    real_step = trainer.pipe.step

    def step(inputs, labels):
        if trainer.step == 2 and rank == 0:
            with torch.no_grad():
                next(trainer.pipe.parameters()).fill_(float("nan"))
        return real_step(inputs, labels)

    trainer.pipe.step = step
    with pytest.raises(TrainingDiverged) as raised:
        trainer.fit()
    last = {name: p.clone() for name, p in trainer.pipe.model.named_parameters()}
    return str(raised.value), last


def test_divergence_stops_every_rank_before_the_update_and_keeps_the_checkpoints(corpus, tmp_path):
    cfg = make_cfg(tmp_path, corpus, **{"checkpoint.interval": 1, "checkpoint.keep_last": 2})
    results = run_distributed(_diverge_at_step_3, 2, cfg)
    for message, _ in results:
        assert message.startswith("step 3: loss nan, gradient norm nan") and "step_000002" in message
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000002"  # no NaN checkpoint rotated a good one out
    last_rank_weights = results[1][1]
    assert all(torch.isfinite(p).all() for p in last_rank_weights.values())  # the update was skipped
    model, _ = load_full_model(tmp_path)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _reading_other_data_on_rank_1(rank, world_size, cfg):
    import dataclasses

    import pipeline_parallel.trainer as trainer

    if rank == 1:  # as if a file changed between the ranks' reads, or another node holds other copies
        prepare = trainer.prepare_data
        trainer.prepare_data = lambda *args, **kwargs: dataclasses.replace(prepare(*args, **kwargs), digest="f" * 64)
    with pytest.raises(ConfigError) as raised:
        Trainer(cfg)
    return str(raised.value)


def test_ranks_that_read_different_data_stop_before_training(corpus, tmp_path):
    """Each rank reads the files itself: the first rank's inputs and the last rank's labels came from two streams."""
    for message in run_distributed(_reading_other_data_on_rank_1, 2, make_cfg(tmp_path, corpus)):
        assert re.fullmatch(r"the ranks read different data \(token streams \w{12} on rank 0, ffffffffffff on rank 1\): "
                            r"a data file changed while it was read, or the nodes' copies differ; give every rank the "
                            r"same files and start again", message), message


def _no_room(*args, **kwargs):
    """A write on a full disk."""
    raise OSError(28, "No space left on device")


def _saves_failing(rank, world_size, cfgs):
    """What each rank raises when rank 1's shards cannot be written, and when rank 0 cannot publish."""
    from pipeline_parallel import checkpoint as checkpoint_module

    class FullDisk(checkpoint_module.RecordingWriter):  # the checkpoint's DCP writer
        write_data = _no_room

    said = []
    for cfg, (replacement, failing) in zip(cfgs, (("RecordingWriter", FullDisk), ("atomic_write", _no_room))):
        saved = getattr(checkpoint_module, replacement)
        if rank == (1 if replacement == "RecordingWriter" else 0):
            setattr(checkpoint_module, replacement, failing)
        try:
            with pytest.raises(CheckpointNotSaved) as raised:
                Trainer(cfg).fit()
            said.append(str(raised.value))
        finally:
            setattr(checkpoint_module, replacement, saved)
    return said


def test_a_checkpoint_that_cannot_be_written_stops_every_rank_with_one_message(corpus, tmp_path):
    """A full disk used to end each rank with its own traceback (and torchrun's)."""
    cfgs = [make_cfg(tmp_path / name, corpus, **{"checkpoint.interval": 1, "train.max_steps": 2})
            for name in ("shards", "publish")]
    (shards0, publish0), (shards1, publish1) = run_distributed(_saves_failing, 2, cfgs)
    assert _but_room(shards0) == _but_room(shards1) and _but_room(publish0) == _but_room(publish1)
    assert re.fullmatch(r"step 1: could not write .*shards/checkpoints/step_000001.tmp \(rank 1: OSError: \[Errno 28\] "
                        rf"No space left on device\); the previous checkpoint is untouched{_ROOM}; make room or fix "
                        r"the directory, then start again", shards0), shards0
    assert re.fullmatch(r"step 1: could not publish .*publish/checkpoints/step_000001 \(OSError: \[Errno 28\] No "
                        rf"space left on device\); the previous checkpoint is untouched{_ROOM}; make room or fix the "
                        r"directory, then start again", publish0), publish0
    assert ckpt.latest_checkpoint(tmp_path / "shards") is None and ckpt.latest_checkpoint(tmp_path / "publish") is None


def _settings_unwritable_on_rank_0(rank, world_size, cfg):
    import pipeline_parallel.trainer as trainer_module

    if rank == 0:  # which writes config.toml
        trainer_module.atomic_write = _no_room
    with pytest.raises(ConfigError) as raised:
        Trainer(cfg)
    return str(raised.value)


def test_a_start_that_cannot_record_its_settings_stops_every_rank_with_one_message(corpus, tmp_path):
    """Rank 0 ended alone with a traceback (and the others with "Connection closed by peer")."""
    said0, said1 = run_distributed(_settings_unwritable_on_rank_0, 2, make_cfg(tmp_path, corpus))
    assert _but_room(said0) == _but_room(said1)
    assert re.fullmatch(rf"could not write the run's settings into {tmp_path} \(No space left on device{_ROOM}\); "
                        "make room or fix the directory", said0), said0


_ROOM = r"; [\d,]+\.\d [MG]B free on its disk"  # a full disk does not always say so: torch's "unexpected pos 704 vs 598"


def _but_room(message: str | None) -> str | None:
    """`message` without its room note: each rank measures the free space itself, and a disk others write to
    (another test, another job) can change by 0.1 GB between the two."""
    return message and re.sub(_ROOM, "", message)


class _FullFrom:
    """A metrics file on a disk that is full for the records of `step` and after, `failures` times (None: for
    good): each time it takes part of the lines, as a real write does, and fails on the rest."""

    def __init__(self, file, step: int, failures: int | None = None):
        self.file, self.step, self.failures = file, step, failures

    def write(self, data: bytes) -> int:
        steps = [json.loads(line)["step"] for line in data.splitlines()]
        if max(steps, default=0) < self.step or self.failures == 0:
            return self.file.write(data)
        if self.failures is not None:
            self.failures -= 1
        self.file.write(data[: len(data) // 2])
        _no_room()

    def __getattr__(self, name):
        return getattr(self.file, name)


def _metrics_failing(rank, world_size, cfgs):
    """An uninterrupted run; then two whose metrics cannot be written (rank 1 writes them): in one the line of step
    4, a checkpoint's step with no eval line, fails once and the disk has room again for the save's retry; in the
    other every line from step 3 on fails until the run stopped, and it is resumed.
    What stopped each run (None: nothing)."""
    whole, *runs = cfgs
    run(whole)
    said = []
    for cfg, (step, failures) in zip(runs, ((4, 1), (3, None))):
        trainer = Trainer(cfg)
        if trainer.metrics is not None:
            trainer.metrics.file = _FullFrom(trainer.metrics.file, step=step, failures=failures)
        try:
            trainer.fit()
            said.append(None)
        except CheckpointNotSaved as e:
            said.append(str(e))
            run(cfg)
    return said


def test_metrics_that_cannot_be_written_stop_every_rank_before_the_next_checkpoint(corpus, tmp_path):
    """The rank writing the metrics ended alone with a traceback, and the others with "Connection closed by peer".
    Lines wait for room until the next checkpoint, which the run stops before if there is none, so that the
    resumed run logs the lost steps again."""
    cfgs = [make_cfg(tmp_path / name, corpus, **{"checkpoint.interval": 2}) for name in ("whole", "room", "full")]
    said0, said1 = run_distributed(_metrics_failing, 2, cfgs)
    assert [_but_room(s) for s in said0] == [_but_room(s) for s in said1] and said0[0] is None, said0
    assert re.fullmatch(r"step 4: rank 1: could not write .*full/metrics.jsonl \(No space left on device\); no "
                        rf"checkpoint was saved{_ROOM}; make room or fix the directory, then resume from "
                        r".*full/checkpoints/step_000002", said0[1]), said0
    whole = tmp_path / "whole"
    for logged in (tmp_path / "room", tmp_path / "full"):
        assert _losses(logged) == _losses(whole) and _losses(logged, "eval_loss") == _losses(whole, "eval_loss")
        assert [r["step"] for r in read_metrics(logged / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
        assert all(line.endswith("}") for line in (logged / "metrics.jsonl").read_text().splitlines()), "no half line"


class _TensorBoardFullFrom:
    """TensorBoard's writer on a disk that is full from `step` on: its writing thread dies, and every call raises."""

    def __init__(self, tb, step: int):
        self.tb, self.step, self.failed = tb, step, False

    def add_scalar(self, key, value, step):
        self.failed |= step >= self.step
        if self.failed:
            _no_room()
        self.tb.add_scalar(key, value, step)

    def close(self):
        self.tb.close()
        if self.failed:
            _no_room()


def _tensorboard_failing(rank, world_size, cfg):
    """A run whose TensorBoard records cannot be written from step 3 on (rank 1 writes them), then resumed: what
    stopped it."""
    trainer = Trainer(cfg)
    if trainer.metrics is not None:
        trainer.metrics.tb = _TensorBoardFullFrom(trainer.metrics.tb, step=3)
    with pytest.raises(CheckpointNotSaved) as raised:
        trainer.fit()
    run(cfg)
    return str(raised.value)


def test_tensorboard_records_that_cannot_be_written_stop_every_rank_before_the_next_checkpoint(corpus, tmp_path):
    """TensorBoard's OSError on a full disk ended the rank writing the metrics alone, with a traceback. Its writer
    cannot take the records again: the run stops before the next checkpoint, and the resumed run logs them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tmp_path, corpus, **{"checkpoint.interval": 2, "log.tensorboard": True})
    said0, said1 = run_distributed(_tensorboard_failing, 2, cfg)
    assert _but_room(said0) == _but_room(said1)
    assert re.fullmatch(r"step 4: rank 1: could not write .*/tensorboard \(No space left on device\); no checkpoint was "
                        rf"saved{_ROOM}; make room or fix the directory, then resume from .*step_000002", said0), said0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = _losses(tmp_path)
    assert list(logged) == [1, 2, 3, 4, 5, 6]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(step, pytest.approx(loss, rel=1e-6))
                                                                   for step, loss in logged.items()]


def _overflow_at_step_2(rank, world_size, cfg):
    """Train with the last stage's update of step 2 turning a weight infinite; returns what was raised."""
    trainer = Trainer(cfg)
    real_update = trainer.optimizer.step

    def update(*args, **kwargs):
        real_update(*args, **kwargs)
        if trainer.step == 1 and rank == world_size - 1:
            with torch.no_grad():
                next(trainer.pipe.parameters())[0] = float("inf")

    trainer.optimizer.step = update
    with pytest.raises(TrainingDiverged) as raised:
        trainer.fit()
    return str(raised.value)


def test_weights_an_update_made_infinite_are_not_saved(corpus, tmp_path):
    """Finite loss and gradients, but an update overflows a weight: the checkpoint of that step is
    refused on every rank, so the one before stays the latest and the message points to it."""
    cfg = make_cfg(tmp_path, corpus, **{"checkpoint.interval": 1, "checkpoint.keep_last": 2})
    for message in run_distributed(_overflow_at_step_2, 2, cfg):
        assert message.startswith("step 2: its update made weights that are not finite"), message
        assert "step_000001" in message and "optim.lr" in message
        assert "train.dtype = fp32" not in message  # the run is fp32 already
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    model, _ = load_full_model(tmp_path)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_torchrun_end_to_end(corpus, tmp_path):
    """The real launcher on 2 ranks: metrics, checkpoint, loss plot, export and a printed sample."""
    cfg = make_cfg(tmp_path / "run", corpus, **{
        "train.max_steps": 4, "eval.interval": 2, "log.plot": True, "log.progress": True,
        "export.at_end": True, "export.sample_tokens": 16})
    (tmp_path / "run.toml").write_text(to_toml(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "pipeline_parallel.train",
         "--config", str(tmp_path / "run.toml")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert sorted(_losses(run_dir)) == [1, 2, 3, 4] and sorted(_losses(run_dir, "eval_loss")) == [2, 4]
    assert ckpt.latest_checkpoint(run_dir).name == "step_000004"
    assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (run_dir / "export" / "model.safetensors").is_file() and (run_dir / "export" / "config.json").is_file()
    assert "resolved config:" in result.stdout and "sample:" in result.stdout
    assert "\npipeline: 2 stages, layers per stage [2, 2], schedule 1f1b, microbatches per step 4\n" in result.stdout


def test_the_optimizer_takes_every_configured_setting():
    """AdamW's betas, eps and weight decay come from the config, in both groups: a beta2 left out trained with other
    second moments than configured, which comparing two runs of the same code (the resume tests) cannot find."""
    optimizer = build_optimizer(torch.nn.Linear(4, 4), OptimConfig(lr=2e-3, beta1=0.8, beta2=0.7, eps=1e-5,
                                                                   weight_decay=0.25))
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (2e-3, (0.8, 0.7), 1e-5, 0.25), (2e-3, (0.8, 0.7), 1e-5, 0.0)]


@pytest.mark.parametrize("clip", [0.05, 0.0])  # 0.05: below the gradients' norm at every step; 0.0: no clipping
def test_each_update_steps_with_the_scheduled_lr_and_gradients_clipped_to_grad_clip(corpus, tmp_path, clip):
    """The logged lr is computed, not read from the optimizer, and the logged gradient norm is the one before
    clipping: an lr that never reached AdamW, or a clip that never happened, trained otherwise than logged, and
    alike in both runs the resume test compares. So watch the optimizer itself at each update: the lr of its
    groups, and the global norm of the gradients it steps with (one rank: the whole model's)."""
    trainer = Trainer(make_cfg(tmp_path, corpus, **{"eval.interval": 0, "optim.grad_clip": clip}))
    seen, real_update = [], trainer.optimizer.step

    def update(*args, **kwargs):
        grads = [p.grad for p in trainer.pipe.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        seen.append(({group["lr"] for group in trainer.optimizer.param_groups}, norm))
        return real_update(*args, **kwargs)

    trainer.optimizer.step = update
    records = [r for r in trainer.fit() if "loss" in r]
    lr, min_lr, warmup, decay = 1e-2, 3e-4, 2, 6  # make_cfg's
    want = [lr * step / warmup if step <= warmup else
            min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (decay - warmup))) * (lr - min_lr)
            for step in range(1, 7)]
    assert len(seen) == len(records) == 6
    for (lrs, norm), record, scheduled in zip(seen, records, want):
        assert lrs == {record["lr"]} and record["lr"] == pytest.approx(scheduled, rel=1e-12)
        if clip:
            assert record["grad_norm"] > clip and norm == pytest.approx(clip, rel=1e-4), (record, norm)
        else:
            assert norm == pytest.approx(record["grad_norm"], rel=1e-4), (record, norm)
    if not clip:  # norms a default clip of 1.0 would have cut
        assert max(record["grad_norm"] for record in records) > 1, records


@pytest.mark.parametrize("max_batches", [0, 2])
def test_the_eval_loss_is_the_token_mean_over_the_held_out_sequences(corpus, tmp_path, max_batches):
    """The eval loss was only ever compared between two runs of the same code. Here it is compared with the
    saved model's own cross-entropy over the held-out sequences it should cover: all 43 (whose last batch of 3,
    padded to 4 for the microbatches, weighs by its 3 sequences and no padding), or the first 2 batches of 8.
    The one step is no multiple of eval.interval: the evaluation is the one at the end of every run."""
    cfg = make_cfg(tmp_path, corpus, **{"train.max_steps": 1, "eval.interval": 2, "eval.max_batches": max_batches,
                                       "optim.warmup_steps": 0, "optim.lr_decay_steps": 0})
    run(cfg)
    model, _ = load_full_model(tmp_path)  # the checkpoint of step 1, after which the eval ran
    held = prepare_data(tmp_path, cfg.data.path, seq_len=cfg.data.seq_len, tokenizer=cfg.data.tokenizer,
                        eval_fraction=cfg.data.eval_fraction).eval  # the cached stream, split as the run split it
    rows = np.arange(len(held) if max_batches == 0 else max_batches * cfg.train.batch_size)
    assert len(held) % cfg.train.batch_size == 3 and (max_batches == 0 or len(rows) < len(held))
    sequences = held[rows]
    with torch.no_grad():
        logits = model(sequences[:, :-1]).logits
    want = F.cross_entropy(logits.flatten(0, 1), sequences[:, 1:].flatten()).item()
    assert _losses(tmp_path, "eval_loss") == {1: pytest.approx(want, rel=1e-5)}


def test_a_resumed_run_goes_on_counting_the_tokens_trained_before_it(runs):
    """The resume test compares losses only: a resume that counted tokens from 0 again logged (and saved) a third of
    the tokens the run had trained on, 8 sequences of 32 tokens a step."""
    whole, split, _ = runs
    assert _losses(split, "tokens") == _losses(whole, "tokens") == {step: step * 8 * 32 for step in range(1, 7)}
    assert ckpt.read_extra(split / "checkpoints" / "step_000006")["tokens"] == 6 * 8 * 32


def test_gradients_that_overflow_under_a_finite_loss_stop_the_run_before_the_update(corpus, tmp_path):
    """The divergence test makes the loss NaN, which makes the gradients NaN too. Gradients can overflow alone (a
    finite loss): clipping by an infinite norm then turns them to 0 or NaN, and AdamW writes NaN into the weights,
    which were found only at the next checkpoint, after training on. The update must be refused at that step."""
    trainer = Trainer(make_cfg(tmp_path, corpus, **{"eval.interval": 0}))
    real_step = trainer.pipe.step

    def step(inputs, labels):
        loss = real_step(inputs, labels)
        if trainer.step == 1:  # the second step's backward overflows one gradient
            with torch.no_grad():
                next(trainer.pipe.parameters()).grad.view(-1)[0] = float("inf")
        return loss

    trainer.pipe.step = step
    with pytest.raises(TrainingDiverged, match=r"^step 2: loss \d+\.\d+, gradient norm inf; the weights were not "
                                               r"updated and nothing was saved"):
        trainer.fit()
    assert all(torch.isfinite(p).all() for p in trainer.pipe.parameters())


@pytest.mark.parametrize("changes, message", [
    ({"optim.min_lr": 2e-2}, r"need 0 < optim.lr and optim.min_lr <= optim.lr, got 0.01, 0.02"),
    ({"optim.min_lr": -1e-4}, r"optim.min_lr must be >= 0, got -0.0001"),
    ({"optim.beta2": 1.0}, r"need 0 <= optim.beta1, beta2 < 1 and optim.eps > 0"),
    ({"optim.beta1": -0.1}, r"need 0 <= optim.beta1, beta2 < 1 and optim.eps > 0"),
    ({"optim.eps": 0.0}, r"need 0 <= optim.beta1, beta2 < 1 and optim.eps > 0"),
], ids=["min_lr-above-lr", "negative-min_lr", "beta2-1", "negative-beta1", "eps-0"])
def test_optimizer_settings_out_of_range_are_config_errors(corpus, tmp_path, changes, message):
    """Each was accepted: a min_lr above lr made the cosine climb, a negative one ended the run ascending the loss
    (a negative lr), and a beta of 1 failed in AdamW's constructor with a traceback on every rank, once the data
    was prepared. They are config errors, before anything is read."""
    with pytest.raises(ConfigError, match=message):
        check_config(make_cfg(tmp_path, corpus, **changes), 2)


def test_a_run_with_export_at_end_off_exports_nothing(runs):
    """make_cfg turns the export off, and no test looked: the run exported anyway, replacing run_dir/export (an
    export the user made of another checkpoint, say) and taking the time and room of a whole model."""
    for run_dir in runs[:2]:
        assert not (run_dir / "export").exists() and ckpt.latest_checkpoint(run_dir).name == "step_000006"


def test_sequences_longer_than_the_model_s_context_are_a_config_error(corpus, tmp_path):
    """Only the --hf-model bound was tested: our Llama trained on sequences past its max_position_embeddings without
    a word, and its export claimed a context shorter than it was trained on."""
    with pytest.raises(ConfigError, match=r"data.seq_len 65 exceeds model.max_position_embeddings 64"):
        check_config(make_cfg(tmp_path, corpus, **{"data.seq_len": 65}), 2)
    check_config(make_cfg(tmp_path, corpus, **{"data.seq_len": 64}), 2)


def test_weight_decay_takes_our_llama_s_linear_and_embedding_matrices_and_leaves_its_norms():
    """The shape test above has no plain 2-D weight that trains (its Linear's is frozen): matrices of two
    dimensions left out of the decay trained every Linear and the embedding without weight decay."""
    from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=64, num_hidden_layers=1))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.5))
    names = {id(p): name for name, p in model.named_parameters()}
    decayed, kept = (sorted(names[id(p)] for p in group["params"]) for group in optimizer.param_groups)
    assert kept == ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                    "model.norm.weight"]
    assert len(decayed) == 9
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= set(decayed)


def test_a_divergence_before_any_checkpoint_says_to_start_again_and_to_clip_an_unclipped_run(corpus, tmp_path):
    """The divergence messages were checked only with a checkpoint to go back to and a grad_clip set."""
    trainer = Trainer(make_cfg(tmp_path, corpus, **{"eval.interval": 0, "optim.grad_clip": 0.0}))
    real_step = trainer.pipe.step
    trainer.pipe.step = lambda inputs, labels: real_step(inputs, labels) * float("nan")
    with pytest.raises(TrainingDiverged) as raised:
        trainer.fit()
    assert re.fullmatch(r"step 1: loss nan, gradient norm [^;]+; the weights were not updated and nothing was saved: "
                        r"start again with a lower optim.lr, more optim.warmup_steps or optim.grad_clip = 1.0",
                        str(raised.value)), str(raised.value)


def test_a_run_that_starts_at_step_0_replaces_the_metrics_an_earlier_start_left(tmp_path):
    """A run stopped before its first checkpoint starts again at step 0: its records must not follow the old ones."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "loss": 7.0})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 7.0}]


def test_the_loss_plot_draws_each_eval_point_and_spans_exactly_its_steps(tmp_path, no_matplotlib):
    """The colour tests are met by the legend alone (it is drawn in both colours): an eval point left undrawn, or an
    x axis reaching past the last step, went unseen. An infinite eval loss is left out as an infinite loss is."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0, "eval_loss": Infinity}\n{"step": 2, "loss": 4.0, "eval_loss": 4.5}\n'
                    '{"step": 3, "loss": 3.0}\n')
    assert plot_loss(path, tmp_path / "loss.png") == "built-in"
    rows = _png_rows(tmp_path / "loss.png")
    plotted = {color: [x for y, row in enumerate(rows) if y > 30 for x, c in enumerate(row) if c == color]
               for color in (_TRAIN_BLUE, _EVAL_ORANGE)}  # below the legend
    assert plotted[_EVAL_ORANGE], "the one eval point is drawn"
    assert min(plotted[_TRAIN_BLUE]) <= 71 and max(plotted[_TRAIN_BLUE]) >= 779  # step 1 at the left, 3 at the right


def test_command_line_values_in_every_spelling_the_config_takes(tmp_path):
    """Only true/false, yes/no and none were tried: 1 read as false, null as no number, a space after a comma
    stayed in the path, any other word silently meant false, and a TOML list of floats became layer counts."""
    cfg = parse_args(["--log.plot", "1", "--log.tensorboard", "0", "--model.vocab-size", "null",
                      "--data.path", "a.txt, b.txt", "--pipeline.layer-counts", "1, 3"])
    assert (cfg.log.plot, cfg.log.tensorboard, cfg.model.vocab_size) == (True, False, None)
    assert (cfg.data.path, cfg.pipeline.layer_counts) == (["a.txt", "b.txt"], [1, 3])
    with pytest.raises(ConfigError, match=r"^config key 'log.plot' must be bool, got 'maybe'$"):
        parse_args(["--log.plot", "maybe"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'zzz' in the command line; valid keys: run_dir, "
                                          r"resume, "):
        parse_args(["--zzz", "1"])
    toml = tmp_path / "c.toml"
    toml.write_text("[pipeline]\nlayer_counts = [1.5, 2.5]\n")
    with pytest.raises(ConfigError, match=r"config key 'pipeline.layer_counts' must be a list, got \[1.5, 2.5\]"):
        load_config(toml)


def test_a_run_that_diverges_or_cannot_save_exits_1_with_its_one_line(monkeypatch, capsys):
    """Only config errors (exit 2) and stops (128 + signal) were checked through main."""
    import pipeline_parallel.train as train

    for error in (TrainingDiverged("step 3: loss nan"), CheckpointNotSaved("step 4: no room")):
        def failing(cfg, error=error):
            raise error

        monkeypatch.setattr(train, "run", failing)
        with pytest.raises(SystemExit) as exit_info:
            main([])
        assert exit_info.value.code == 1
        assert capsys.readouterr().err == f"error: {error}\n"


def test_a_run_records_the_bos_of_its_tokenizer_in_the_model_config(corpus, tmp_path):
    """hf_config_dict was tested alone: the trainer left out the tokenizer's BOS, so a run with a Llama-like
    tokenizer saved (and exported) its end-of-text as BOS."""
    import tokenizers

    from pipeline_parallel.tokenizer import EOS_TOKEN

    backend = tokenizers.Tokenizer.from_file(str(corpus[1]))
    bos = put_around_each_text(backend, "<s> $A")["<s>"]
    (tmp_path / "tok").mkdir()
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": "<s>"}))
    trainer = Trainer(make_cfg(tmp_path / "run", corpus, **{"data.tokenizer": str(tmp_path / "tok")}))
    eos = trainer.data.tokenizer.eos_id
    assert eos != bos and (trainer.model_config["bos_token_id"], trainer.model_config["eos_token_id"]) == (bos, eos)


def test_the_loss_plot_has_a_grid_line_at_each_round_step_up_to_the_last(tmp_path, no_matplotlib):
    """Steps 1 to 10 tick at 2, 4, ..., 10: the tick on the last round value (here the right edge) was left out
    unseen, as no test looked at where the grid lines fall."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {step}, "loss": {10 - step / 2}}}\n' for step in range(1, 11)))
    plot_loss(path, tmp_path / "loss.png")
    rows = _png_rows(tmp_path / "loss.png")
    grey = (225, 225, 225)
    assert sum(row[780] == grey for row in rows[40:451]) > 300  # step 10's vertical grid line, at x = 780
