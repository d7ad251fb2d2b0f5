"""Tests for Hugging Face interchange: export loads in transformers, generate, training from an HF model."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from _dist import run_distributed
from _tokenizers import put_around_each_text
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_train import _fit, _losses, make_cfg

from pipeline_parallel import export as export_module
from pipeline_parallel import generate as generate_module
from pipeline_parallel._files import temporary_path
from pipeline_parallel.bpe import train_bpe
from pipeline_parallel.checkpoint import latest_checkpoint, load_checkpoint
from pipeline_parallel.config import ConfigError, with_overrides
from pipeline_parallel.data import TokenBatches, prepare_data
from pipeline_parallel.export import export, keep_run_tokenizer, load_full_model, main as export_main, save_hf_model
from pipeline_parallel.generate import load_model, main as generate_main, sample
from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM
from pipeline_parallel.run_end import report_run_end
from pipeline_parallel.tokenizer import EOS_TOKEN, Tokenizer, load_tokenizer
from pipeline_parallel.trainer import Trainer


def hf_cfg(run_dir, corpus, hf_dir, **overrides):
    """`make_cfg` for a run from the Hugging Face model in `hf_dir`: no model.* keys, its config.json gives the shape."""
    cfg = make_cfg(run_dir, corpus, hf_model=str(hf_dir), **overrides)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"):
        setattr(cfg.model, key, None)
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 2-rank run of 4 steps with tied embeddings (so export must drop and re-tie the LM head)."""
    run_dir = tmp_path_factory.mktemp("trained")
    cfg = make_cfg(run_dir, corpus, **{"train.max_steps": 4, "eval.interval": 4, "eval.max_batches": 0,
                                       "model.tie_word_embeddings": True})
    run_distributed(_fit, 2, cfg)
    return run_dir, cfg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    run_dir, cfg = trained
    out, _, _ = export(run_dir, tmp_path / "hf")
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # others may read it where they may read the rest
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight

    ours = LlamaForCausalLM(LlamaConfig.from_hf_config(hf.config))
    load_checkpoint(latest_checkpoint(run_dir), ours, None)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)

    # The pipelined held-out loss logged at step 4 (eval.max_batches = 0: all of it) is the exported
    # model's token-mean loss over every held-out sequence, the last smaller batch included.
    data = prepare_data(tmp_path / "data", cfg.data.path, seq_len=cfg.data.seq_len, tokenizer=cfg.data.tokenizer,
                        eval_fraction=cfg.data.eval_fraction)
    assert len(data.eval) % cfg.train.batch_size % cfg.pipeline.num_microbatches, "the last batch must need padding"
    held_out = data.eval[np.arange(len(data.eval))]
    with torch.no_grad():
        loss = F.cross_entropy(hf(held_out[:, :-1]).logits.flatten(0, 1), held_out[:, 1:].flatten()).item()
    assert loss == pytest.approx(_losses(run_dir, "eval_loss")[4], abs=1e-5)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def answer(self):\n    return 42\n"
    assert tokenizer.encode(text, add_special_tokens=False) == load_tokenizer(cfg.data.tokenizer).encode(text)
    assert tokenizer.eos_token_id == hf.config.eos_token_id
    copy = transformers.AutoTokenizer.from_pretrained(run_dir / "tokenizer")  # the run's copy of the bare file
    assert copy.eos_token_id == hf.config.eos_token_id and copy.encode(text, add_special_tokens=False) == \
        tokenizer.encode(text, add_special_tokens=False)


def test_generate_from_run_and_from_export(trained, tmp_path, capsys):
    run_dir, _ = trained
    out, _, _ = export(run_dir, tmp_path / "hf", dtype="fp32")
    texts = [sample(*load_model(path), prompt="def ", max_new_tokens=12, temperature=0) for path in (run_dir, out)]
    assert texts[0] == texts[1] and texts[0].startswith("def ") and len(texts[0]) > 4
    generate_main([str(out), "--prompt", "import ", "--max-new-tokens", "8", "--num-samples", "2", "--seed", "5"])
    model, tokenizer = load_model(out)
    assert capsys.readouterr().out == "".join(  # sample i is drawn with seed + i, at the default settings
        f"--- sample {i + 1}\n{sample(model, tokenizer, 'import ', 8, 0.8, 50, seed)}\n" for i, seed in enumerate((5, 6)))
    with pytest.raises(SystemExit):  # before loading anything
        generate_main([str(out), "--temperature", "-1"])
    assert "--temperature must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate_main([str(out), "--seed", str(2**64)])
    assert "--seed must be below 2**63" in capsys.readouterr().err
    generate_main([str(out), "--prompt", "import ", "--max-new-tokens", "2", "--seed", str(2**63 - 1)])  # the largest
    assert capsys.readouterr().out == f"{sample(model, tokenizer, 'import ', 2, 0.8, 50, 2**63 - 1)}\n"
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(tmp_path / "nothing-here")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("error: "), "one line, no traceback"


@pytest.mark.parametrize("dtype", ["fp16", "BF16", None, torch.bfloat16])
def test_export_refuses_an_unknown_dtype_before_the_model_loads(trained, tmp_path, monkeypatch, dtype):
    """export(dtype="fp16") loaded the whole model, then failed with KeyError: 'fp16'."""
    run_dir, _ = trained
    model, tokenizer = load_model(run_dir)
    monkeypatch.setattr(export_module, "load_full_model", lambda *args: pytest.fail("the model was loaded"))
    for call in (lambda: export(run_dir, tmp_path / "hf", dtype=dtype),
                 lambda: save_hf_model(model, tokenizer, tmp_path / "hf", dtype=dtype)):
        with pytest.raises(ValueError, match=r"dtype must be one of 'bf16', 'fp32', got "):
            call()
        assert not (tmp_path / "hf").exists()


def test_sample_keeps_top_k_at_an_infinite_temperature(trained):
    """At temperature inf every logit became 0, so top_k kept every token: top_k=1 sampled among all
    of them instead of taking the most likely."""
    model, tokenizer = load_model(trained[0])
    greedy = sample(model, tokenizer, "def ", max_new_tokens=12, temperature=0)
    assert sample(model, tokenizer, "def ", max_new_tokens=12, temperature=float("inf"), top_k=1) == greedy


@pytest.mark.parametrize("bad, error", [
    (dict(max_new_tokens=-1), r"max_new_tokens must be an integer >= 0, got -1"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer >= 0, got 2\.5"),
    (dict(top_k=2.5), r"top_k must be an integer >= 0 .*, got 2\.5"),
    (dict(top_k=True), r"top_k must be an integer >= 0 .*, got True"),
    (dict(seed=2**64), r"seed must be an integer from 0 to 2\*\*63 - 1, got 18446744073709551616"),
    (dict(seed=1.5), r"seed must be an integer from 0 to 2\*\*63 - 1, got 1\.5"),
])
def test_sample_checks_its_arguments(trained, bad, error):
    """A negative max_new_tokens gave the prompt alone, a float top_k failed in torch.topk, a seed of
    2**64 in manual_seed."""
    model, tokenizer = load_model(trained[0])
    with pytest.raises(ValueError, match=error):
        sample(model, tokenizer, "def ", **{"max_new_tokens": 2, **bad})


def test_a_sample_starts_as_a_document_does_and_leaves_out_the_end_of_text(monkeypatch):
    """What sample gives the model: the start a document has in training (the BOS the tokenizer puts before a text;
    an empty prompt without one is the end-of-text that precedes a document), and top_k 0 as every token; what it
    shows: the new tokens, not the end-of-text that ends them. `generate` is replaced by one that records its input
    and answers " world" and the end of the text."""
    texts = ["hello world, the quick brown fox"] * 20
    bare = train_bpe(texts, vocab_size=280)
    backend = train_bpe(texts, vocab_size=280).backend
    bos = put_around_each_text(backend, "<s> $A")["<s>"]
    with_bos = Tokenizer(backend, backend.token_to_id(EOS_TOKEN))
    asked = {}

    def answer(model, input_ids, max_new_tokens, **options):
        asked.update(input_ids=input_ids[0].tolist(), **options)
        return torch.cat([input_ids, torch.tensor([tokenizer.encode(" world") + [tokenizer.eos_id]])], dim=1)

    monkeypatch.setattr(generate_module, "generate", answer)
    model = torch.nn.Linear(1, 1)  # sample reads only the device of its parameters
    for tokenizer, start, empty in ((with_bos, [bos], [bos]), (bare, [], [bare.eos_id])):
        assert sample(model, tokenizer, "hello", max_new_tokens=3, top_k=0) == "hello world"
        assert asked["input_ids"] == [*start, *tokenizer.encode("hello")]
        assert (asked["top_k"], asked["eos_id"]) == (None, tokenizer.eos_id)
        assert sample(model, tokenizer, "", max_new_tokens=3, top_k=5) == " world"
        assert asked["input_ids"] == empty and asked["top_k"] == 5


def test_generate_refuses_a_prompt_that_is_not_utf8(tmp_path, capsys):
    """Bytes in another encoding (argv "caf\\xe9" reaches Python as "caf\\udce9") stopped the tokenizer, a TypeError."""
    with pytest.raises(SystemExit) as exit_info:  # before loading anything
        generate_main([str(tmp_path), "--prompt", os.fsdecode(b"caf\xe9")])
    assert exit_info.value.code == 2 and "--prompt is not valid UTF-8 text" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"prompt is not valid UTF-8 text \(typed in another encoding\?\); give it"):
        sample(None, None, os.fsdecode(b"caf\xe9"))  # the library function too, before it touches model or tokenizer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sample_keeps_the_space_a_sentencepiece_decoder_strips_from_a_text_start(tmp_path):
    """Llama 2, Mistral and Gemma tokenizers decode "▁world" alone as "world", after "Hello" as " world"."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "</s>": 1, "▁": 2, "H": 3, "e": 4, "l": 5, "o": 6, "▁world": 7}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}))
    tokenizer = load_tokenizer(tmp_path)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():  # a model whose every next token is "▁world": a constant final hidden state picks it
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[vocab["▁world"], 0] = 1.0
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
    assert tokenizer.decode(tokenizer.encode("Hello") + [vocab["▁world"]]) == "Hello world"
    assert sample(model, tokenizer, "Hello", max_new_tokens=2, temperature=0) == "Hello world world"
    assert sample(model, tokenizer, "", max_new_tokens=2, temperature=0) == "world world"  # a document's start
    with torch.no_grad():  # now every next token is the end of text: the sample ends there, without showing it
        model.lm_head.weight.zero_()
        model.lm_head.weight[vocab["</s>"], 0] = 1.0
    assert sample(model, tokenizer, "Hello", max_new_tokens=5, temperature=0) == "Hello"


def test_export_replaces_only_an_earlier_export(trained, tmp_path, capsys):
    run_dir, _ = trained
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export(run_dir, run_dir)  # would have deleted the run's checkpoints
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="todo.txt"):
        export(run_dir, notes)
    assert (notes / "todo.txt").read_text() == "mine"
    (tmp_path / "hf.tmp").mkdir()  # someone's directory that happens to bear the name
    (tmp_path / "hf.tmp" / "todo.txt").write_text("mine")
    out, model, _ = export(run_dir, tmp_path / "hf")
    assert export(run_dir, out)[0] == out  # an earlier export is replaced
    (out / "notes.md").write_text("mine")  # but not with files of the user's that it would delete
    with pytest.raises(FileExistsError, match=r"is an earlier export, but it also holds notes.md, which no export wrote"):
        export(run_dir, out)
    assert (out / "notes.md").read_text() == "mine" and (out / "config.json").is_file()
    (out / "notes.md").unlink()
    assert export(run_dir, out)[0] == out
    # An export from before the weights named their files: its notes were taken for its own, and deleted.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(out / "model.safetensors"), {k: v for k, v in metadata.items() if k != "files"})
    (out / "notes.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is an earlier export, but it also holds notes.md, which no export wrote"):
        export(run_dir, out)
    (out / "notes.md").unlink()
    assert export(run_dir, out)[0] == out
    assert (tmp_path / "hf.tmp" / "todo.txt").read_text() == "mine"
    # A link to an earlier export is followed and stays a link; it used to fail and leave a full temporary copy.
    (tmp_path / "link").symlink_to(out)
    assert export(run_dir, tmp_path / "link")[0] == out and (tmp_path / "link").is_symlink()
    assert (tmp_path / "link" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], "no temporary left"
    assert (out / "config.json").is_file()
    model.save_pretrained(tmp_path / "source-model")  # say, the model the run started from
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export(run_dir, tmp_path / "source-model")
    assert (tmp_path / "source-model" / "model.safetensors").is_file()
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run_dir), "--out", str(tmp_path / "source-model")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith("error: "), "one line, no traceback"


def test_ctrl_c_ends_export_and_generate_with_one_line(trained, tmp_path, monkeypatch, capsys):
    """Both ended with a traceback; an interrupted export leaves the earlier one in place."""
    run_dir, _ = trained
    out = export(run_dir, tmp_path / "hf")[0]
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "_write_hf_model", stopped)
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run_dir), "--out", str(out)])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "interrupted: nothing was exported; the output directory holds what it held before\n"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf"]
    monkeypatch.undo()

    def stopped_once_in_place(tmp, path):  # as in the removal of what `path` held before
        real_replace_dir(tmp, path)
        raise KeyboardInterrupt

    real_replace_dir = export_module.replace_dir
    monkeypatch.setattr(export_module, "replace_dir", stopped_once_in_place)
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run_dir), "--out", str(out), "--dtype", "bf16"])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == f"interrupted after the export was in place: {out} holds the new one\n"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    monkeypatch.setattr(generate_module, "sample", stopped)
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(out)])
    assert exit_info.value.code == 130 and capsys.readouterr().err.splitlines()[-1] == "interrupted"  # after any
    # progress bar transformers shows while loading


def test_export_refuses_the_directory_it_is_run_in(trained, tmp_path, monkeypatch, capsys):
    """`--out .` (or a directory above) failed with "PosixPath('.') has an empty name"; replacing it
    would leave the shell in a deleted directory."""
    run_dir, _ = trained
    here = tmp_path / "empty" / "inner"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for out in (".", "..", str(here)):
        with pytest.raises(SystemExit) as exit_info:
            export_main([str(run_dir), "--out", out])
        assert exit_info.value.code == 2
        assert re.fullmatch(r"error: .* is or holds the current directory, .*give a directory of its own, such as "
                            r".*export\n", capsys.readouterr().err)
    assert here.is_dir() and not any(here.iterdir())
    assert export(run_dir, "sub")[0] == here / "sub"  # a relative path is taken from the current directory


def test_an_output_no_directory_can_be_made_in_is_refused_before_the_model_loads(trained, tmp_path, monkeypatch, capsys):
    """--out under a file (or in /proc) failed after the long load, naming the temporary path, not the one given."""
    run_dir, _ = trained
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(export_module, "load_full_model", lambda *a: pytest.fail("the model was loaded"))
    for out, error in ((tmp_path / "notes.txt" / "hf", re.escape(f"{tmp_path / 'notes.txt'} is a file, not a directory")),
                       (Path("/proc/hf"), r"no directory can be made in /proc \(")):
        with pytest.raises(SystemExit) as exit_info:
            export_main([str(run_dir), "--out", str(out)])
        assert exit_info.value.code == 2
        assert re.fullmatch(rf"error: cannot export into {re.escape(str(out))}: {error}.*\n", capsys.readouterr().err)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"], "the check leaves nothing behind"


def test_a_checkpoint_moved_out_of_its_run_directory_is_refused_before_the_model_loads(trained, tmp_path, capsys):
    run_dir, _ = trained
    moved = tmp_path / "elsewhere" / "step"
    shutil.copytree(latest_checkpoint(run_dir), moved)
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer \(tokenizer/ or tokenizer.json\); a checkpoint "
                                                r"is read with the tokenizer of its run directory"):
        export(moved, tmp_path / "hf")
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(moved), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(f"error: {tmp_path.resolve()}")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_refuses_a_checkpoint_whose_file_changed_with_the_command_for_an_intact_one(trained, tmp_path, capsys):
    """A flipped byte was exported: a model of other weights, or an error from inside torch naming no file."""
    run = shutil.copytree(trained[0], tmp_path / "run")
    newest = latest_checkpoint(run)
    earlier = shutil.copytree(newest, newest.with_name("step_000002"))  # a copy, standing for an earlier save
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    damaged = (f"checkpoint {newest} is damaged (its file __0_0.distcp has changed since it was saved (its SHA-256 is "
               f"not the one recorded)); ")
    with pytest.raises(ValueError, match=re.escape(f"{damaged}use an earlier one, such as {earlier}")):
        export(run, tmp_path / "hf")
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run), "--out", str(tmp_path / "hf"), "--dtype", "bf16"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"error: {damaged}export an earlier one with: python -m pipeline_parallel.export {earlier} --out "
        f"{tmp_path / 'hf'} --dtype bf16\n")
    assert not (tmp_path / "hf").exists()
    export_main([str(earlier), "--out", str(tmp_path / "hf"), "--dtype", "bf16"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_tokenizer_has_one_fingerprint_in_memory_saved_and_reloaded(tmp_path):
    """A checkpoint records its tokenizer's fingerprint, which export compares with the run's saved copy:
    transformers gave the copy a no-op post-processor, so the fingerprints of one tokenizer differed."""
    text = "def answer(self):\n    return 42\n" * 20
    ours = train_bpe([text], vocab_size=300)
    ours.save(tmp_path / "saved")
    copy = load_tokenizer(tmp_path / "saved")
    copy.save(tmp_path / "resaved")
    assert {tok.fingerprint() for tok in (ours, copy, load_tokenizer(tmp_path / "saved" / "tokenizer.json"),
                                          load_tokenizer(tmp_path / "resaved"))} == {ours.fingerprint()}

    backend = train_bpe([text], vocab_size=300).backend  # a Llama-like one: BOS before each text, EOS </s>
    backend.add_special_tokens(["</s>"])
    put_around_each_text(backend, "<s> $A")
    (tmp_path / "llama").mkdir()
    backend.save(str(tmp_path / "llama" / "tokenizer.json"))
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "<s>"}))
    llama = load_tokenizer(tmp_path / "llama")
    llama.save(tmp_path / "llama-copy")
    assert load_tokenizer(tmp_path / "llama-copy").fingerprint() == llama.fingerprint() != ours.fingerprint()
    bare = load_tokenizer(tmp_path / "llama" / "tokenizer.json")  # the same JSON, another end-of-text token
    assert bare.eos_id != llama.eos_id and bare.fingerprint() != llama.fingerprint()


def _replace_run_tokenizer(run, cfg, tokenizer_dir=None):
    """Put another tokenizer of the same size in place of the tokenizer of the run in `run` (or in `tokenizer_dir`)."""
    tokenizer_dir = tokenizer_dir or run / "tokenizer"
    text = Path(cfg.data.path[0]).read_text()
    other = train_bpe([text[len(text) // 2:] + text[: len(text) // 2].upper()], vocab_size=320)
    assert other.vocab_size == load_tokenizer(tokenizer_dir).vocab_size  # only the fingerprint tells them apart
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).unlink(missing_ok=True)
    other.save(tokenizer_dir)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_and_generate_refuse_a_tokenizer_the_checkpoint_was_not_trained_with(trained, tmp_path, capsys):
    run_dir, cfg = trained
    run = shutil.copytree(run_dir, tmp_path / "run")
    _replace_run_tokenizer(run, cfg)
    refused = (r"run/tokenizer is not the tokenizer .*step_000004 was trained with \(fingerprint \w{12}, 320 tokens; "
               r"the checkpoint's is \w{12}\): it was replaced after the checkpoint was saved, .* Put back the one it "
               r"was trained with \(the files of its data.tokenizer or --hf-model in .*run/tokenizer; one the run "
               r"trained as .*run/tokenizer.json, with no tokenizer/ beside it\), or give a checkpoint trained with "
               r"this one")
    with pytest.raises(ValueError, match=refused):
        export(run, tmp_path / "hf")
    for main, args in ((export_main, [str(run), "--out", str(tmp_path / "hf")]), (generate_main, [str(run)])):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2 and re.fullmatch(f"error: .*{refused}\n", capsys.readouterr().err)
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_generate_refuses_an_export_whose_tokenizer_is_not_the_one_it_was_exported_with(trained, tmp_path, capsys):
    """An export recorded no tokenizer, so generate sampled with whatever tokenizer files lay in it. It records the
    tokenizer in its weights' metadata, which transformers does not read: one replaced since is refused, one
    with the same vocabulary that tokenizes otherwise is told so, and an export that recorded none is taken."""
    run_dir, cfg = trained
    out, _, tokenizer = export(run_dir, tmp_path / "hf")
    assert load_model(out)[1].fingerprint() == tokenizer.fingerprint()
    assert transformers.AutoTokenizer.from_pretrained(out).vocab_size == tokenizer.vocab_size
    _replace_run_tokenizer(out, cfg, tokenizer_dir=out)
    refused = (r"the tokenizer of .*hf is not the tokenizer its model was exported with \(fingerprint \w{12}, 320 tokens; "
               r"the export's is \w{12}\): its files were replaced after the export was written, .* Put back the "
               r"tokenizer files the export wrote, or export the checkpoint again")
    with pytest.raises(ValueError, match=refused):
        load_model(out)
    capsys.readouterr()  # what loading the model printed before
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(out)])
    assert exit_info.value.code == 2 and re.fullmatch(f"error: {refused}\n", capsys.readouterr().err)

    spec = json.loads(tokenizer.backend.to_str())  # the same vocabulary, lower-casing the text first
    spec["normalizer"] = {"type": "Lowercase"}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"the tokenizer of .*hf has the vocabulary of the tokenizer its model was "
                                         r"exported with, but tokenizes text differently as loaded now: its normalizer differs"):
        load_model(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # as an earlier version exported it
        metadata = {key: value for key, value in f.metadata().items() if key != "tokenizer"}
    save_file(load_file(out / "model.safetensors"), str(out / "model.safetensors"), metadata=metadata)
    assert load_model(out)[1].vocab_size == tokenizer.vocab_size


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_the_fingerprint_of_earlier_versions_still_exports_and_resumes(trained, tmp_path):
    """Checkpoints saved before fingerprints were canonical hold the hash of the tokenizer's JSON as
    training loaded it; the run's copy of a tokenizer.json is loaded by transformers, which changes it."""
    run_dir, cfg = trained
    run = shutil.copytree(run_dir, tmp_path / "run")
    meta = latest_checkpoint(run) / "meta.json"
    saved = json.loads(meta.read_text())
    saved["extra"]["tokenizer"] = hashlib.sha256(load_tokenizer(cfg.data.tokenizer).backend.to_str().encode()).hexdigest()
    for key in ("tokenizer_parts", "transformers_version"):  # which they did not record
        del saved["extra"][key]
    del saved["sha256"]  # nor was their meta.json sealed
    meta.write_text(json.dumps(saved))
    assert export(run, tmp_path / "hf")[0] == tmp_path / "hf"
    assert Trainer(with_overrides(cfg, run_dir=str(run), **{"train.max_steps": 5})).step == 4
    _replace_run_tokenizer(run, cfg)
    with pytest.raises(ValueError, match="is not the tokenizer"):
        export(run, tmp_path / "hf")


def test_the_source_generation_config_is_kept_only_with_its_special_tokens(tmp_path):
    """A model whose BOS/EOS the run replaced (another tokenizer) must not carry the source's
    generation config, which names the old ones."""
    tok = train_bpe(["hello world, the pipeline says hello"], vocab_size=300)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, bos_token_id=1, eos_token_id=7)
    source = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "source")
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=7, do_sample=True, temperature=0.6).save_pretrained(source)
    kept = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "kept", source=source)
    assert (kept / "generation_config.json").is_file()
    config.bos_token_id = config.eos_token_id = tok.eos_id  # what hf_config_dict does for another tokenizer
    replaced = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "replaced", source=source)
    assert not (replaced / "generation_config.json").exists()
    # Saving over the source (itself an export, so replaceable as such) would delete the model it reads.
    with pytest.raises(FileExistsError, match="the Hugging Face model the run started from"):
        save_hf_model(transformers.LlamaForCausalLM(config), tok, source, source=source)
    assert (source / "generation_config.json").is_file()


def _tiny_model_and_tokenizer():
    """A one-layer Hugging Face Llama and a BPE to save with it, for what export does with files."""
    tok = train_bpe(["hello world, the pipeline says hello"], vocab_size=300)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)), tok


def test_export_writes_through_the_temporary_path_of_its_output(tmp_path, monkeypatch):
    """Export's temporary directories are named as the other files' are (`_files.temporary_path`: host and
    pid); what a killed process of the same host and pid left there is not merged in, and a failure leaves none."""
    model, tok = _tiny_model_and_tokenizer()
    for left in (temporary_path(tmp_path / "hf"), temporary_path(tmp_path / "run" / "tokenizer")):
        left.mkdir(parents=True)
        (left / "tokenizer.model").write_text("left by a killed process")
    out = save_hf_model(model, tok, tmp_path / "hf")
    keep_run_tokenizer(tmp_path / "run", tok)
    for written in (out, tmp_path / "run" / "tokenizer"):
        assert not (written / "tokenizer.model").exists() and not temporary_path(written).exists()

    def fail(model, tokenizer, tmp, *args):
        assert tmp == temporary_path(tmp_path / "failed") and tmp.is_dir()
        raise OSError("No space left on device")

    monkeypatch.setattr(export_module, "_write_hf_model", fail)
    with pytest.raises(OSError, match="No space left"):
        save_hf_model(model, tok, tmp_path / "failed")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "run"]


@pytest.mark.parametrize("renamed", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("rename", [1, 2], ids=["moving-the-old-aside", "renaming-the-new-in"])
def test_an_interrupted_export_leaves_a_whole_one_in_place(tmp_path, monkeypatch, rename, renamed):
    """Ctrl-C raises where it lands: just before or after either rename that replaces an earlier export, the
    directory holds a whole export, the old or the new, and nothing else is left (it used to delete the old
    one first, so an interruption there lost both)."""
    model, tok = _tiny_model_and_tokenizer()
    out = save_hf_model(model, tok, tmp_path / "hf")
    old = (out / "model.safetensors").read_bytes()
    (tmp_path / "hf.old").mkdir()  # someone's directory that happens to bear the name
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        if out in (Path(src), Path(dst)):  # not the writes of files inside
            calls.append((src, dst))
        if len(calls) == rename and renamed:
            real_replace(src, dst)
        if len(calls) == rename:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt) as stop:
        save_hf_model(model, tok, out)
    monkeypatch.undo()
    new = rename == 2 and renamed
    assert getattr(stop.value, "exported", None) == (out if new else None)  # what export's main tells
    assert ((out / "model.safetensors").read_bytes() == old) != new
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight) == new
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "hf.old"] and len(calls) >= rename


def test_an_hf_model_of_an_unsupported_family_is_refused_before_the_data(corpus, tmp_path):
    """Doge's layers add their own to a mask its forward always builds in full, where a stage would let sdpa
    skip it: the run stops at once."""
    config = transformers.DogeConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    transformers.DogeForCausalLM(config).save_pretrained(tmp_path / "doge")
    cfg = hf_cfg(tmp_path / "run", corpus, tmp_path / "doge")
    with pytest.raises(ConfigError, match=r"hf_model: DogeForCausalLM \(model_type 'doge'\) is not supported"):
        Trainer(cfg)
    assert not list((tmp_path / "run").glob("tokens-*")), "refused before preparing the data"


def test_an_hf_model_whose_files_name_weights_otherwise_is_refused_before_the_data(corpus, tmp_path):
    """Files that hold a weight under a name neither the model nor transformers' conversion knows (here one
    renamed after saving): the run stops at once, naming the weight and what the files hold instead."""
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    weights = tmp_path / "llama" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.gate.weight"] = tensors.pop("model.layers.1.mlp.gate_proj.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = hf_cfg(tmp_path / "run", corpus, tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"hf_model: .*llama lacks 1 of the LlamaForCausalLM weights, e.g. "
                                          r"\['model.layers.1.mlp.gate_proj.weight'\]: its files neither name them "
                                          r"nor hold what transformers makes them of \(they hold e.g. "
                                          r"\['model.layers.1.mlp.gate.weight'\] instead\); give the files saved"):
        Trainer(cfg)
    assert not list((tmp_path / "run").glob("tokens-*")), "refused before preparing the data"


def test_an_hf_model_whose_weights_do_not_fit_its_config_is_refused_before_the_data(corpus, tmp_path):
    """A config.json edited or mixed up after the weights were saved: found when the weights were loaded,
    after the data was prepared, with a traceback on every rank."""
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    config.intermediate_size = 96
    config.save_pretrained(tmp_path / "llama")
    cfg = hf_cfg(tmp_path / "run", corpus, tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"hf_model: .*llama: model.layers.0.mlp.gate_proj.weight has shape "
                                          r"\(64, 32\), the model \(96, 32\) \(from config.json\): give the "
                                          r"config.json saved with these weights"):
        Trainer(cfg)
    assert not list((tmp_path / "run").glob("tokens-*")), "refused before preparing the data"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}],
                         ids=["default", "llama3-scaling"])
def test_a_model_config_recorded_under_transformers_5_reads_alike_under_4(scaling):
    """Transformers 5 records the rotary base (and scaling) in rope_parameters only, which 4.x ignored: a
    checkpoint trained under 5 exported or sampled under 4.55 got a base of 10,000 (logits 10 apart)."""
    from pipeline_parallel.models.families import hf_config

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=64)
    recorded = {"model_type": "llama", **shape,  # as transformers 5 records it
                "rope_parameters": {"rope_theta": 50.0, "rope_type": "default", **(scaling or {})}}
    native = transformers.LlamaConfig(**shape, rope_theta=50.0, rope_scaling=scaling)  # as this version writes it
    tables = [transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=config).inv_freq
              for config in (hf_config(recorded), native)]
    torch.testing.assert_close(tables[0], tables[1], rtol=0, atol=0)
    assert not torch.equal(tables[1], transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        config=transformers.LlamaConfig(**shape)).inv_freq), "the base matters here"


def test_an_export_names_its_rotary_base_where_transformers_4_reads_it(corpus, tmp_path):
    """Written under transformers 5, config.json held the base in rope_parameters only: transformers 4 (and
    tools that read rope_theta) loaded a base of 10,000, another function (argmax agreeing on 21% of tokens)."""
    tok = load_tokenizer(corpus[1])
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, rope_theta=50.0)
    out = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == 50.0 and written.get("rope_scaling") is None
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (getattr(loaded, "rope_parameters", None) or {"rope_theta": loaded.rope_theta})["rope_theta"] == 50.0


def _first_loss(rank, world_size, cfg):
    return _fit(rank, world_size, cfg)[0]["loss"]


def _saved_by_transformers(model, tok, out):
    """`model` in `out` with `tok`, its weights as `save_pretrained` writes them: each expert of a MoE a tensor
    of its own, where transformers 5 holds them fused (and an export of ours writes them so)."""
    save_hf_model(model, tok, out)
    model.save_pretrained(out)
    return out


def _run_from(hf_dir, corpus, tmp_path, **overrides):
    """A run from the model files in `hf_dir` with their own tokenizer, on 2 ranks (one step unless `overrides`
    say otherwise): its first loss, and the batch that loss is of."""
    cfg = hf_cfg(tmp_path / "run", corpus, hf_dir, **{"train.max_steps": 1, "eval.interval": 0, **overrides})
    cfg.data.tokenizer = ""  # the model directory's own tokenizer
    first_loss = run_distributed(_first_loss, 2, cfg)[0]
    data = prepare_data(tmp_path / "data", cfg.data.path, seq_len=cfg.data.seq_len, tokenizer=hf_dir,
                        eval_fraction=cfg.data.eval_fraction)
    return first_loss, next(TokenBatches(data.train, cfg.train.batch_size, cfg.seed))


def test_train_from_hf_model(corpus, tmp_path):
    """--hf-model: a Qwen2 (attention biases) starts from its weights on 2 ranks and exports back,
    keeping its own special tokens and generation config."""
    tok = load_tokenizer(corpus[1])
    config = transformers.Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=5, eos_token_id=[tok.eos_id, 9], pad_token_id=7)
    torch.manual_seed(0)
    original = transformers.Qwen2ForCausalLM(config).eval()
    hf_dir = save_hf_model(original, tok, tmp_path / "qwen")
    transformers.GenerationConfig(bos_token_id=5, eos_token_id=[tok.eos_id, 9], temperature=0.6,
                                  do_sample=True).save_pretrained(hf_dir)
    first_loss, (inputs, labels) = _run_from(hf_dir, corpus, tmp_path, **{
        "train.max_steps": 2, "eval.interval": 3, "export.at_end": True, "export.sample_tokens": 0})
    with torch.no_grad():
        want = F.cross_entropy(original(inputs).logits.flatten(0, 1), labels.flatten()).item()
    assert first_loss == pytest.approx(want, abs=1e-5)

    source = hf_dir.joinpath("model.safetensors").read_bytes()  # an export itself, yet not to be replaced
    with pytest.raises(FileExistsError, match="is the Hugging Face model the run started from"):
        export(tmp_path / "run", hf_dir)
    assert hf_dir.joinpath("model.safetensors").read_bytes() == source

    exported, tokenizer = load_model(tmp_path / "run" / "export")
    assert (exported.config.bos_token_id, exported.config.eos_token_id, exported.config.pad_token_id) == \
        (5, [tok.eos_id, 9], 7)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "run" / "export")
    assert generation.temperature == 0.6 and generation.eos_token_id == [tok.eos_id, 9]
    trained_model, _ = load_full_model(tmp_path / "run")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    for name, value in trained_model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, atol=0, rtol=0)
    assert not torch.equal(exported.model.layers[0].self_attn.q_proj.bias, original.model.layers[0].self_attn.q_proj.bias)


def test_a_run_from_a_family_that_scales_in_forward_starts_from_that_forward_s_loss(corpus, tmp_path):
    """Granite multiplies its embeddings and divides its logits in its forward, outside the modules a
    stage runs: a run from its files on 2 ranks starts from the loss of that forward."""
    tok = load_tokenizer(corpus[1])
    config = transformers.GraniteConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, embedding_multiplier=3.0, logits_scaling=2.5,
                                        bos_token_id=1, eos_token_id=tok.eos_id, pad_token_id=0)
    torch.manual_seed(0)
    original = transformers.GraniteForCausalLM(config).eval()
    first_loss, (inputs, labels) = _run_from(save_hf_model(original, tok, tmp_path / "granite"), corpus, tmp_path)
    with torch.no_grad():
        logits = original(inputs).logits
        want = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
        unscaled = F.cross_entropy((logits * config.logits_scaling).flatten(0, 1), labels.flatten()).item()
    assert first_loss == pytest.approx(want, abs=1e-5) and abs(want - unscaled) > 1e-3


_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, bos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize("family", ["mixtral", "diffllama", "nanochat", "granite_swa"])
def test_a_run_from_the_files_of_starts_from_the_loss_of_the_model_s_forward(family, corpus, tmp_path):
    """Mixtral's experts: transformers 5 fuses them in memory into one tensor per layer and kind, but saves them
    one by one (as transformers 4 holds them), so they cannot be read by name. DiffLlama draws weights in its
    __init__ outside the meta device the run builds the model on (its lambdas), which made the run take it for a
    model partly loaded. NanoChat's forward norms the embeddings with its final norm, which the first stage holds
    too. GraniteSWA rotates each layer at a RoPE base of its own, or not at all (here layer 1 of 2 at 100, not the
    config's 10,000): its tables are made as the run builds the model. A run from the files on 2 ranks starts
    from the loss of the model's own forward."""
    tok = load_tokenizer(corpus[1])
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, num_local_experts=4,
                                            num_experts_per_tok=2, **_SMALL)
        original = transformers.MixtralForCausalLM(config).eval()
    elif family == "nanochat":
        if not hasattr(transformers, "NanoChatForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no NanoChat")
        config = transformers.NanoChatConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **_SMALL)
        original = transformers.NanoChatForCausalLM(config).eval()
    elif family == "granite_swa":
        if not hasattr(transformers, "GraniteSWAForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no GraniteSWA")
        config = transformers.GraniteSWAConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                                               layer_rope_theta=[0.0, 100.0], **_SMALL)
        original = transformers.GraniteSWAForCausalLM(config).eval()
    else:
        config = transformers.DiffLlamaConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **_SMALL)
        original = transformers.DiffLlamaForCausalLM(config).eval()
    hf_dir = _saved_by_transformers(original, tok, tmp_path / family)
    if family == "mixtral":
        with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
            assert any(".experts.0." in name for name in f.keys()), "each expert in a tensor of its own"
    first_loss, (inputs, labels) = _run_from(hf_dir, corpus, tmp_path, **{"export.at_end": True,
                                                                         "export.sample_tokens": 0})
    with torch.no_grad():
        want = F.cross_entropy(original(inputs).logits.flatten(0, 1), labels.flatten()).item()
    assert first_loss == pytest.approx(want, abs=1e-5)
    # the export writes the weights as transformers saves them (each expert on its own), and loads as trained
    with safe_open(str(tmp_path / "run" / "export" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(load_file(hf_dir / "model.safetensors"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export").eval()
    trained, _ = load_full_model(tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(exported(inputs).logits, trained(inputs).logits, atol=0, rtol=0)


def test_a_deepseek_v3_run_starts_with_the_router_bias_of_its_files(corpus, tmp_path):
    """DeepSeek V3's router picks experts by their scores plus a correction bias, a buffer its files hold and
    transformers 4's `_init_weights` does not make (the run was refused as holding one it cannot make): a run
    from its files on 2 ranks reads it there (and its experts, which transformers 5 fuses) and starts from the
    loss of its own forward, bias and all, and its checkpoint loads with the bias for export."""
    tok = load_tokenizer(corpus[1])
    config = transformers.DeepseekV3Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16,
        first_k_dense_replace=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=tok.eos_id, pad_token_id=0)
    torch.manual_seed(0)
    original = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in original.named_parameters():  # large enough for the choice of experts to matter
            if "norm" not in name:
                p.normal_(0, 0.2)
        bias = torch.tensor([1.0, -1.0, 0.0, 0.5])
        original.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
    first_loss, (inputs, labels) = _run_from(_saved_by_transformers(original, tok, tmp_path / "deepseek"), corpus, tmp_path)
    with torch.no_grad():
        want = F.cross_entropy(original(inputs).logits.flatten(0, 1), labels.flatten()).item()
        original.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
        unbiased = F.cross_entropy(original(inputs).logits.flatten(0, 1), labels.flatten()).item()
    assert first_loss == pytest.approx(want, abs=1e-5) and abs(want - unbiased) > 1e-3, (first_loss, want, unbiased)
    trained, _ = load_full_model(tmp_path / "run")  # as export and sampling load it, the bias from the checkpoint
    assert torch.equal(trained.model.layers[1].mlp.gate.e_score_correction_bias, bias)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="Gemma trains on transformers 5, whose embedding module scales")
def test_a_gemma_run_loads_with_its_embedding_scale(corpus, tmp_path):
    """Gemma scales its embeddings by a buffer no checkpoint holds: a run loaded for sampling or
    export computes it, so its logits are those of the export loaded by transformers."""
    tok = load_tokenizer(corpus[1])
    config = transformers.GemmaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=tok.eos_id,
                                      pad_token_id=0)
    torch.manual_seed(0)
    hf_dir = save_hf_model(transformers.GemmaForCausalLM(config), tok, tmp_path / "gemma")
    cfg = hf_cfg(tmp_path / "run", corpus, hf_dir, **{"train.max_steps": 1, "eval.interval": 0})
    cfg.data.tokenizer = ""
    run_distributed(_fit, 2, cfg)
    model, _ = load_full_model(tmp_path / "run")
    exported = transformers.AutoModelForCausalLM.from_pretrained(export(tmp_path / "run", tmp_path / "hf")[0])
    torch.testing.assert_close(model.model.embed_tokens.embed_scale, exported.model.embed_tokens.embed_scale)
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, exported.eval()(ids).logits, atol=1e-5, rtol=0)


def test_files_put_into_the_export_during_training_skip_the_export_at_the_end(corpus, tmp_path, capsys):
    cfg = make_cfg(tmp_path / "run", corpus, **{"train.max_steps": 1, "eval.interval": 0, "export.at_end": True,
                                                 "export.sample_tokens": 0})
    trainer = Trainer(cfg)  # checks run_dir/export at start: none yet
    (tmp_path / "run" / "export").mkdir()
    (tmp_path / "run" / "export" / "notes.md").write_text("mine")
    trainer.fit()  # trains and saves; the export says why it did not run, instead of a traceback at the end
    out = capsys.readouterr().out
    assert "export skipped: " in out and "python -m pipeline_parallel.export " in out
    assert (tmp_path / "run" / "export" / "notes.md").read_text() == "mine"
    assert latest_checkpoint(tmp_path / "run").name == "step_000001"


def test_an_export_at_the_end_that_cannot_be_written_says_how_to_export_later(corpus, tmp_path, capsys, monkeypatch):
    """A full disk while drawing the loss curve or exporting ended the finished, saved run with a traceback on the
    last rank (safetensors' error is no OSError). The command it gives exports in the run's export.dtype (it gave
    float32's)."""
    import safetensors.torch

    import pipeline_parallel.run_end as run_end

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def weights_full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", weights_full)
    monkeypatch.setattr(run_end, "plot_loss", full)
    cfg = make_cfg(tmp_path / "run", corpus, **{"train.max_steps": 1, "eval.interval": 0, "export.at_end": True,
                                                 "export.sample_tokens": 0, "log.plot": True, "export.dtype": "bf16"})
    Trainer(cfg).fit()
    last = tmp_path / "run" / "checkpoints" / "step_000001"
    said = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"loss curve not drawn: \[Errno 28\] No space left on device; [\d,]+\.\d [MG]B free on its disk",
                        said[-3]), said
    assert said[-1] == (
        "export failed: [Errno 28] No space left on device; the training is saved: make room or fix the directory, "
        f"then export the checkpoint with: python -m pipeline_parallel.export {last} --dtype bf16")
    assert latest_checkpoint(tmp_path / "run") == last
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(("export", ".export"))) == []


def test_the_end_of_a_run_exports_and_samples_as_its_settings_say(corpus, tmp_path, capsys):
    """The end of a run was tested only where its export failed: nothing looked at the sample it prints (prompt,
    seed, length), at the dtype of the export, or at loss.png being left out when log.plot is off."""
    cfg = make_cfg(tmp_path / "run", corpus, **{
        "train.max_steps": 1, "eval.interval": 0, "export.at_end": True, "export.dtype": "bf16", "log.plot": False,
        "export.prompt": "def ", "export.sample_tokens": 6, "export.temperature": 1.0, "export.top_k": 0, "seed": 7})
    Trainer(cfg).fit()
    model, tokenizer = load_model(tmp_path / "run")  # the checkpoint, in float32
    want = sample(model, tokenizer, "def ", max_new_tokens=6, temperature=1.0, top_k=0, seed=7)
    assert want != sample(model, tokenizer, "def ", max_new_tokens=6, temperature=1.0, top_k=0, seed=0)
    out = capsys.readouterr().out
    assert out.endswith(f"Hugging Face model: {tmp_path / 'run' / 'export'}\nsample:\n{want}\n"), out
    exported = load_file(tmp_path / "run" / "export" / "model.safetensors")
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
    assert not model.config.tie_word_embeddings  # so the export keeps the LM head, which the tied test drops
    assert torch.equal(exported["lm_head.weight"], model.lm_head.weight.to(torch.bfloat16))
    assert not (tmp_path / "run" / "loss.png").exists()
    # export.temperature = 0: the greedy sample, not one drawn (which differs from it after one step).
    greedy = sample(model, tokenizer, "def ", max_new_tokens=6, temperature=0)
    assert greedy != want
    report_run_end(with_overrides(cfg, **{"export.temperature": 0.0}), tmp_path / "run" / "metrics.jsonl",
                   latest_checkpoint(tmp_path / "run"), None)
    assert capsys.readouterr().out.endswith(f"sample:\n{greedy}\n")
    # export.sample_tokens = 0: the export, and no sample.
    last = latest_checkpoint(tmp_path / "run")
    report_run_end(with_overrides(cfg, **{"export.sample_tokens": 0}), tmp_path / "run" / "metrics.jsonl", last, None)
    assert capsys.readouterr().out == f"checkpoint: {last}\nHugging Face model: {tmp_path / 'run' / 'export'}\n"


def test_a_tokenizer_replaced_during_training_skips_the_export_at_the_end(corpus, tmp_path, capsys):
    """The export refuses it (see above); that ended the finished run with a traceback on the last rank."""
    cfg = make_cfg(tmp_path / "run", corpus, **{"train.max_steps": 1, "eval.interval": 0, "export.at_end": True,
                                                 "export.sample_tokens": 0})
    trainer = Trainer(cfg)
    _replace_run_tokenizer(tmp_path / "run", cfg)
    trainer.fit()
    out = capsys.readouterr().out
    assert "export skipped: " in out and "is not the tokenizer" in out and "python -m pipeline_parallel.export " in out
    assert not (tmp_path / "run" / "export").exists() and latest_checkpoint(tmp_path / "run").name == "step_000001"


def test_a_checkpoint_damaged_before_the_export_at_the_end_names_the_intact_one_to_export(corpus, tmp_path, capsys,
                                                                                          monkeypatch):
    """The skip's advice named the damaged checkpoint itself as the one to export."""
    cfg = make_cfg(tmp_path / "run", corpus, **{"train.max_steps": 2, "eval.interval": 0, "checkpoint.interval": 1,
                                                 "export.at_end": True, "export.sample_tokens": 0})
    import pipeline_parallel.run_end as run_end

    def damaging_export(checkpoint, *args, **kwargs):
        shard = next(checkpoint.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
        return export(checkpoint, *args, **kwargs)

    monkeypatch.setattr(run_end, "export", damaging_export)
    Trainer(cfg).fit()
    out = capsys.readouterr().out
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (f"export skipped: checkpoint {ckpt_dir / 'step_000002'} is damaged (its file " in out
            and f"export an earlier one with: python -m pipeline_parallel.export {ckpt_dir / 'step_000001'} --out DIR"
            in out), out
    assert not (tmp_path / "run" / "export").exists()


def test_a_bf16_export_holds_the_checkpoint_s_weights_rounded_to_bf16(trained, tmp_path):
    """--dtype bf16 is checked only for its messages: an export that wrote float32 weights under a config.json that
    says bfloat16 took twice the room asked for. Each tensor is the checkpoint's, rounded to bf16, and the tied LM
    head is left to be tied again."""
    run_dir, _ = trained
    out, model, _ = export(run_dir, tmp_path / "hf", dtype="bf16")
    saved, full = load_file(str(out / "model.safetensors")), model.state_dict()
    assert set(saved) == set(full) - {"lm_head.weight"}
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_our_llama_s_config_names_the_run_tokenizer_s_special_ids_whatever_they_are():
    """Our Llama's config comes with transformers' defaults (BOS 1, EOS 2). Only a tokenizer whose end-of-text is
    another id was tested: one whose end-of-text is id 2 kept BOS 1, a token the model never saw start a document."""
    from pipeline_parallel.export import hf_config_dict

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=300, num_hidden_layers=2))
    for eos, bos, want in ((2, None, (2, 2)), (2, 7, (2, 7)), (0, None, (0, 0))):
        config = hf_config_dict(model, eos, bos)
        assert (config["eos_token_id"], config["bos_token_id"]) == want


def test_generate_refuses_no_samples_before_loading_anything(tmp_path, capsys):
    """--num-samples 0 printed nothing and exited 0."""
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(tmp_path / "nothing-here"), "--num-samples", "0"])
    assert exit_info.value.code == 2 and "--num-samples must be >= 1, got 0" in capsys.readouterr().err


def test_an_export_s_tokenizer_knows_the_model_s_context_length(tmp_path):
    """The export hands its tokenizer the model's max_position_embeddings, which no test read back: without it
    transformers warns of no over-long input."""
    model, tok = _tiny_model_and_tokenizer()
    out = save_hf_model(model, tok, tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(out).model_max_length == model.config.max_position_embeddings


def test_the_source_generation_config_is_left_out_when_only_its_bos_is_kept(tmp_path):
    """The test above replaces both ids: a run keeping the source's BOS id (Llama tokenizers share 1) but with
    another end-of-text must not carry a generation config whose eos_token_id stops at the old one."""
    tok = train_bpe(["hello world, the pipeline says hello"], vocab_size=300)
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, bos_token_id=1, eos_token_id=7)
    source = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "source")
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=7).save_pretrained(source)
    assert tok.eos_id not in (1, 7)
    config.eos_token_id = tok.eos_id
    out = save_hf_model(transformers.LlamaForCausalLM(config), tok, tmp_path / "out", source=source)
    assert not (out / "generation_config.json").exists()


def test_hf_config_dict_leaves_the_model_s_own_config_as_it_was():
    """It gives a Hugging Face model of another end-of-text the tokenizer's ids in a copy: the model's config,
    which other code reads, keeps its own."""
    from pipeline_parallel.export import hf_config_dict

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            bos_token_id=1, eos_token_id=7))
    config = hf_config_dict(model, eos_id=3, bos_id=5)
    assert (config["eos_token_id"], config["bos_token_id"]) == (3, 5)
    assert (model.config.eos_token_id, model.config.bos_token_id) == (7, 1)
