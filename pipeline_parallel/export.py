"""Export a checkpoint as one Hugging Face model (`hf_weights.py` starts a stage from one).

    python -m pipeline_parallel.export runs/tiny [--out DIR] [--dtype bf16]

The input is a run directory (its latest checkpoint) or one checkpoint directory, saved at any
pipeline size. The output is `model.safetensors`, `config.json` and the tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import stat
import tempfile
from pathlib import Path

import torch
from torch import nn

from ._checkpoint_dirs import refuse_incomplete
from ._files import replace_dir, temporary_dir
from .checkpoint import (DamagedCheckpointError, is_checkpoint, latest_checkpoint, load_checkpoint, read_extra,
                         save_identity)
from .models.families import hf_config, with_rope_keys_of_transformers_4
from .models.materialize import hf_model_on_meta, materialize
from .tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer
from .tokenizer_identity import loads_differently, tokenizer_differences, tokenizer_record

EXPORT_DIR = "export"  # in the run directory
TOKENIZER_DIR = "tokenizer"  # a user-given tokenizer, copied into the run directory
WEIGHTS_FILE = "model.safetensors"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' errors name the OS's
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_EXPORT_MARK = {"exported_by": "pipeline_parallel"}  # in the weights' metadata: an export may be replaced
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config_dict(model: nn.Module, eos_id: int, bos_id: int | None = None) -> dict:
    """The model's Hugging Face config as a JSON-able dict, with the tokenizer's special ids.

    A Hugging Face model whose end-of-text ids include the tokenizer's keeps its own special
    tokens (BOS, a list of EOS ids); otherwise, and for our own Llama, they are the tokenizer's
    end-of-text and BOS (`bos_id`, by default end-of-text too).
    """
    own = hasattr(model.config, "to_hf_config")
    config = model.config.to_hf_config() if own else model.config
    config = type(config).from_dict(config.to_dict())  # a copy: the ids below must not leak into the model
    eos = config.eos_token_id
    if own or not (eos == eos_id or (isinstance(eos, list) and eos_id in eos)):
        config.eos_token_id, config.bos_token_id = eos_id, eos_id if bos_id is None else bos_id
    return json.loads(config.to_json_string())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory: `path` itself, or the latest checkpoint of the run directory `path`."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    refuse_incomplete(path)  # a checkpoint named that lacks a part is damaged, and the error names an earlier one
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return found


def _run_tokenizer(checkpoint: Path) -> Tokenizer:
    """The tokenizer `checkpoint` was trained with, from its run directory: the user's copy in
    run_dir/tokenizer, else the one trained there. One that is not what the checkpoint recorded is refused."""
    run_dir = checkpoint.parent.parent
    path = run_dir / TOKENIZER_DIR if (run_dir / TOKENIZER_DIR).is_dir() else run_dir / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{run_dir.resolve()} holds no tokenizer ({TOKENIZER_DIR}/ or {TOKENIZER_FILE}); a checkpoint is "
            f"read with the tokenizer of its run directory, so give it where it lies there "
            f"(RUN_DIR/checkpoints/step_NNNNNN) or copy that tokenizer beside its checkpoints/ directory")
    return _checked(load_tokenizer(path), read_extra(checkpoint), str(path), f"{checkpoint} was trained with",
                    "the checkpoint's", f"it was replaced after the checkpoint was saved, and the model would read and "
                    f"write another tokenizer's ids. Put back the one it was trained with (the files of its data.tokenizer "
                    f"or --hf-model in {run_dir / TOKENIZER_DIR}; one the run trained as {run_dir / TOKENIZER_FILE}, with no "
                    f"{TOKENIZER_DIR}/ beside it), or give a checkpoint trained with this one")


def export_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the export at `path`; one that is not the one the export recorded is refused. An export
    of an earlier version, or of another program, recorded none."""
    record = json.loads((_export_metadata(Path(path)) or {}).get("tokenizer", "{}"))
    return _checked(load_tokenizer(path), record, f"the tokenizer of {path}", "its model was exported with",
                    "the export's", "its files were replaced after the export was written, and the model would read and "
                    "write another tokenizer's ids. Put back the tokenizer files the export wrote, or export the "
                    "checkpoint again")


def _checked(tokenizer: Tokenizer, record: dict, what: str, made: str, whose: str, replaced: str) -> Tokenizer:
    """`tokenizer` (`what`) if it is the one `record` names (see `tokenizer_differences`), the tokenizer the model
    `made` (was trained with, was exported with); else a ValueError that says how it differs: `replaced` by
    another, or loaded otherwise."""
    differences = tokenizer_differences(tokenizer, record)
    if "vocabulary" in differences:
        raise ValueError(f"{what} is not the tokenizer {made} (fingerprint {tokenizer.fingerprint()[:12]}, "
                         f"{tokenizer.vocab_size:,} tokens; {whose} is {record['tokenizer'][:12]}): {replaced}")
    if differences:
        raise ValueError(f"{what} has the vocabulary of the tokenizer {made}, {loads_differently(differences, record)}")
    return tokenizer


def keep_run_tokenizer(run_dir: str | Path, given: Tokenizer | None) -> None:
    """Make the `_run_tokenizer` of run_dir's checkpoints this run's: a copy of the `given` tokenizer, or
    (None) the one trained there.

    A copy an earlier start kept is replaced, not left to be exported in place of this run's
    tokenizer, and not merged with: a tokenizer's files differ from one kind to another.
    """
    copy = Path(run_dir) / TOKENIZER_DIR
    fresh = temporary_dir(copy)
    try:
        if given is not None:
            given.save(fresh)
            replace_dir(fresh, copy)
        elif copy.is_dir():
            shutil.rmtree(copy)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # left only by a failed save


def load_full_model(path: str | Path, group=None) -> tuple[nn.Module, Tokenizer]:
    """The whole model of a checkpoint (any pipeline size) on this one process, and its tokenizer.

    Built as the matching `transformers` class (our Llama's parameter names are Hugging Face's).
    Under torch.distributed, pass a process group holding only this rank.
    """
    checkpoint = resolve_checkpoint(path)
    tokenizer = _run_tokenizer(checkpoint)  # found missing or replaced now, not after loading the model
    config = hf_config(read_extra(checkpoint)["model_config"])
    model = hf_model_on_meta(config)
    materialize(model, torch.device("cpu"), init_weights=False)  # the buffers no checkpoint holds
    logger = logging.getLogger("pipeline_parallel.checkpoint")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its "RNG not restored" note means nothing here
    try:
        load_checkpoint(checkpoint, model, None, group=group)
    finally:
        logger.setLevel(level)
    return model.eval(), tokenizer


def save_hf_model(model: nn.Module, tokenizer: Tokenizer, out_dir: str | Path, dtype: str = "fp32",
                  source: str | Path | None = None, checkpoint: str | None = None) -> Path:
    """Write `model` (a full transformers model) as safetensors + config.json + tokenizer into `out_dir`,
    with the `generation_config.json` of `source` (the Hugging Face model it was trained from) if it has one,
    and the `save_identity` of the `checkpoint` it comes from, if any (see `exported_checkpoint`).

    Written into a temporary directory and renamed, so `out_dir` is never half written (and a
    failure leaves nothing behind). An existing `out_dir` is replaced only if it is empty or a
    Hugging Face model (an earlier export); a link to a directory is followed, so it stays a link.
    """
    _check_dtype(dtype)
    check_replaceable(Path(out_dir), source)  # again, as the directory may have changed during a long load
    out_dir = Path(os.path.abspath(out_dir))  # named, where the user's was '..'
    if out_dir.is_symlink() and out_dir.is_dir():
        out_dir = out_dir.resolve()
    tmp = temporary_dir(out_dir)
    try:
        _write_hf_model(model, tokenizer, tmp, dtype, source, checkpoint)
        replace_dir(tmp, out_dir)
    except KeyboardInterrupt as stop:
        if not tmp.exists():  # renamed onto out_dir: only the removal of what it held before was cut short
            stop.exported = out_dir
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only by a failure
    return out_dir


def _write_hf_model(model: nn.Module, tokenizer: Tokenizer, tmp: Path, dtype: str, source, checkpoint) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    config = type(model.config).from_dict(model.config.to_dict())
    config.dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    config.save_pretrained(tmp)
    written = json.loads((tmp / HF_CONFIG).read_text())  # readable by transformers 4 too, and the tools that read it
    (tmp / HF_CONFIG).write_text(json.dumps(with_rope_keys_of_transformers_4(written), indent=2, sort_keys=True) + "\n")
    tokenizer.save(tmp, getattr(config, "max_position_embeddings", None))
    if source and _keeps_special_tokens(config, Path(source)):  # its sampling defaults and stop tokens
        shutil.copyfile(Path(source) / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
    state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # Hugging Face re-ties it on load
    state = _as_transformers_saves(model, state)
    # Written last, the weights name every file of the export: a later export replaces only those.
    files = sorted([entry.name for entry in tmp.iterdir()] + [WEIGHTS_FILE])
    # The tokenizer it was exported with, which `export_tokenizer` checks: in the metadata, where transformers ignores it.
    metadata = {"format": "pt", **_EXPORT_MARK, "files": json.dumps(files),
                "tokenizer": json.dumps(tokenizer_record(tokenizer)), **({"checkpoint": checkpoint} if checkpoint else {})}
    try:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata=metadata)
    except SafetensorError as e:  # its I/O errors (a full disk) are no OSError, which the callers say what to do about
        code = _OS_ERROR.search(str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1]))) from e
    # safetensors creates its file owner-only (0600); give it the permissions the other files got
    os.chmod(tmp / WEIGHTS_FILE, stat.S_IMODE((tmp / HF_CONFIG).stat().st_mode))


def _as_transformers_saves(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in the layout `save_pretrained` writes: transformers 5 fuses some weights in memory (the experts of
    a MoE) that it saves, and other tools and transformers 4 read, one by one."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 holds them as it saves them
        return state
    return {name: tensor.contiguous() for name, tensor in revert_weight_conversion(model, state).items()}


def _keeps_special_tokens(config, source: Path) -> bool:
    """Whether `source` has a generation config and `config` kept its BOS and EOS ids (see
    `hf_config_dict`), so that generation config still names this model's special tokens."""
    try:
        saved = json.loads((source / HF_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return (source / GENERATION_CONFIG).is_file() and all(
        saved.get(key) == getattr(config, key, None) for key in ("bos_token_id", "eos_token_id"))


def _check_dtype(dtype: str) -> None:
    """Refuse a dtype the export has no name for: it would fail as a KeyError once the model is loaded."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, sorted(DTYPES)))}, got {dtype!r}")


def check_replaceable(out_dir: Path, source: str | Path | None = None) -> None:
    """Refuse to replace a directory that is not an earlier export, or is `source` (the Hugging Face
    model a run started from, perhaps itself an export): it would be deleted. Also refuse a place
    where no export can be written (see `_check_creatable`)."""
    _check_creatable(out_dir)
    if not out_dir.exists():
        return
    if out_dir.resolve() in (cwd := Path.cwd().resolve(), *cwd.parents):
        raise FileExistsError(f"{out_dir} is or holds the current directory, which exporting would replace as a "
                              f"whole; give a directory of its own, such as {out_dir / 'export'}")
    if source and out_dir.resolve() == Path(source).resolve():
        raise FileExistsError(f"{out_dir} is the Hugging Face model the run started from (--hf-model); "
                              "exporting would replace it, so give another directory")
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file; give a directory to export into")
    entries = sorted(entry.name for entry in out_dir.iterdir())
    if not entries:
        return
    written = _exported_files(out_dir)
    if written is None or not all((out_dir / name).is_file() for name in entries):
        raise FileExistsError(
            f"{out_dir} exists and is not an earlier export (it holds {', '.join(entries[:5])}"
            f"{', ...' if len(entries) > 5 else ''}); exporting replaces the whole directory, so give a new or empty one")
    added = [name for name in entries if name not in written]
    if added:
        raise FileExistsError(f"{out_dir} is an earlier export, but it also holds {', '.join(added)}, which no export "
                              "wrote and exporting would delete: move them out, or export into another directory")


def _check_creatable(out_dir: Path) -> None:
    """Fail now, not after the long load, where no export can be written: it is made in a new directory beside
    `out_dir`, so the nearest existing directory above must take one (tried and removed at once)."""
    parent = Path(os.path.abspath(out_dir)).parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot export into {out_dir}: {existing} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".export-check-"))
    except OSError as e:
        raise OSError(f"cannot export into {out_dir}: no directory can be made in {existing} ({e.strerror})") from None


def _exported_files(out_dir: Path) -> set[str] | None:
    """The files `save_hf_model` wrote into `out_dir` (its weights carry our mark and name them), or
    None if it is not an export. An export made before the weights named the files: those of its names
    an export writes (a file of another name is someone's)."""
    metadata = _export_metadata(out_dir)
    if metadata is None:
        return None
    if "files" in metadata:
        return set(json.loads(metadata["files"]))
    return {e.name for e in out_dir.iterdir()} & _EXPORT_NAMES


# What an export writes: the weights, the config, the generation config and the files of a tokenizer.
_EXPORT_NAMES = frozenset({WEIGHTS_FILE, HF_CONFIG, GENERATION_CONFIG, TOKENIZER_FILE, "tokenizer_config.json",
                           "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                           "merges.txt", "chat_template.jinja", "chat_template.json"})


def _export_metadata(out_dir: Path) -> dict | None:
    """The metadata `save_hf_model` gave the weights in `out_dir`, or None if it is not an export."""
    from safetensors import safe_open

    try:
        with safe_open(str(out_dir / WEIGHTS_FILE), "pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # missing or not safetensors
        return None
    return None if any(metadata.get(key) != value for key, value in _EXPORT_MARK.items()) else metadata


def export(path: str | Path, out_dir: str | Path | None = None, dtype: str = "fp32", group=None):
    """Export a run's latest checkpoint (or a given one) as a Hugging Face model; returns (dir, model, tokenizer)."""
    _check_dtype(dtype)  # before the (long) load, not after it
    checkpoint = resolve_checkpoint(path)
    out_dir = Path(out_dir) if out_dir is not None else checkpoint.parent.parent / EXPORT_DIR
    source = read_extra(checkpoint).get("hf_model")
    check_replaceable(out_dir, source)  # before the (long) load, not after it
    identity = save_identity(checkpoint)
    model, tokenizer = load_full_model(checkpoint, group)
    return save_hf_model(model, tokenizer, out_dir, dtype, source, identity), model, tokenizer


def exported_checkpoint(out_dir: str | Path) -> str | None:
    """The `save_identity` of the checkpoint the export in `out_dir` was made of; None where there is no export,
    or one made otherwise (`save_hf_model` without a checkpoint, an earlier version)."""
    return (_export_metadata(Path(out_dir)) or {}).get("checkpoint")


def export_command(checkpoint: str | Path, out: str | Path | None = None, dtype: str = "fp32") -> str:
    """The command that exports `checkpoint` (into `out`, in `dtype`), quoted for a shell, for a message to give."""
    options = (["--out", str(out)] if out else []) + (["--dtype", dtype] if dtype != "fp32" else [])
    return shlex.join(["python", "-m", "pipeline_parallel.export", str(checkpoint), *options])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline_parallel.export",
                                     description="Export a training checkpoint as one Hugging Face model (safetensors, "
                                                 "config.json and the tokenizer's files).")
    parser.add_argument("path", help="run directory (uses its latest checkpoint) or checkpoint directory")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/export)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the saved weights (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        out_dir, model, _ = export(args.path, args.out, args.dtype)
    except DamagedCheckpointError as e:  # with the command that exports the intact checkpoint it names
        again = e.advising(lambda earlier: f"export an earlier one with: {export_command(earlier, args.out, args.dtype)}")
        parser.exit(2, f"error: {again}\n")
    except (OSError, ValueError) as e:  # no checkpoint there, --out not replaceable
        parser.exit(2, f"error: {e}\n")
    except KeyboardInterrupt as stop:  # the output is written aside and renamed in whole (see save_hf_model)
        if hasattr(stop, "exported"):
            parser.exit(130, f"interrupted after the export was in place: {stop.exported} holds the new one\n")
        parser.exit(130, "interrupted: nothing was exported; the output directory holds what it held before\n")
    print(f"exported {sum(p.numel() for p in model.parameters()):,} parameters to {out_dir}")


if __name__ == "__main__":
    main()
