"""The training program's configuration: dataclasses, TOML file, command-line overrides, TOML out.

config_checks.py judges a configuration as a whole; this module only reads and writes one."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from ._checks import is_utf8


class ConfigError(ValueError):
    """An invalid configuration; raised identically on every rank before any rank waits on another."""


@contextlib.contextmanager
def as_config_error(setting: str, *errors: type[Exception]):
    """Turn `errors` (default ValueError) raised inside into a ConfigError that names `setting`."""
    try:
        yield
    except errors or ValueError as e:
        raise ConfigError(f"{setting}: {e}") from None


CONFIG_FILE = "config.toml"  # in run_dir: the resolved settings of its latest start

@dataclass
class ModelConfig:
    preset: str = "tiny"  # a named size (tiny, small, medium, 1b, 8b); the fields below override it
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool | None = None
    initializer_range: float | None = None


@dataclass
class DataConfig:
    path: list[str] = field(default_factory=list)  # files, directories or hf:NAME; empty: the Python stdlib
    tokenizer: str = ""  # tokenizer.json or directory; empty: train a BPE (or use --hf-model's)
    vocab_size: int = 4096  # of the BPE trained when no tokenizer is given
    tokenizer_train_chars: int = 20_000_000
    text_field: str = "text"  # JSONL / Parquet / datasets column
    seq_len: int = 128
    max_tokens: int = 0  # cap on the token stream; 0: no cap
    eval_fraction: float = 0.01


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"  # 1f1b or gpipe
    num_microbatches: int = 4  # per pipeline step; batch_size must be a multiple
    layer_counts: list[int] = field(default_factory=list)  # decoder layers per stage; empty: cost-balanced
    recompute: bool = False  # keep only each microbatch's stage input and run its forward again before the backward


@dataclass
class TrainConfig:
    batch_size: int = 16  # sequences per pipeline step
    grad_accum_steps: int = 1  # pipeline steps per optimizer step
    max_steps: int = 300  # optimizer steps
    dtype: str = "fp32"  # fp32, or bf16 (autocast; fp32 weights and optimizer state)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4  # the cosine decays to this
    warmup_steps: int = 20
    lr_decay_steps: int = 0  # step at which the cosine reaches min_lr; 0: max_steps
    weight_decay: float = 0.1  # not applied to norms and biases
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0: no clipping


@dataclass
class EvalConfig:
    interval: int = 50  # optimizer steps between held-out evaluations (and one at the end); 0: never
    max_batches: int = 8  # 0: the whole held-out set


@dataclass
class CheckpointConfig:
    interval: int = 100  # optimizer steps between checkpoints (and one at the end); 0: only at the end
    keep_last: int = 2  # 0: keep all


@dataclass
class LogConfig:
    interval: int = 1  # optimizer steps per metrics line
    tensorboard: bool = True  # also write TensorBoard events when it is installed
    plot: bool = True  # write loss.png at the end
    progress: bool = True  # tqdm progress bar


@dataclass
class ExportConfig:
    at_end: bool = True  # write a Hugging Face model to run_dir/export at the end
    dtype: str = "fp32"  # fp32 or bf16
    prompt: str = ""  # text the sample continues; empty: a new document
    sample_tokens: int = 200  # tokens sampled and printed at the end; 0: none
    temperature: float = 0.8
    top_k: int = 50


@dataclass
class Config:
    run_dir: str = "runs/tiny"
    resume: str = "auto"  # auto (latest checkpoint if any), latest (required), never, or a checkpoint path
    hf_model: str = ""  # a local Hugging Face model directory to start from, instead of our Llama
    seed: int = 0
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    num_threads: int = 0  # CPU threads per rank; 0: cores / local ranks
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def _keys(cls=Config, prefix: str = "") -> dict[str, type]:
    """Every settable dotted key ("optim.lr") with its type."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out |= _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out[prefix + f.name] = hints[f.name]
    return out


KEYS = _keys()


def settings(cfg: Config) -> dict[str, object]:
    """Every dotted key's value, e.g. {"optim.lr": 3e-4, ...}: what two configs are compared by."""
    return {key: _get(cfg, key) for key in KEYS}


def _unknown(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, KEYS, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; valid keys: {', '.join(KEYS)}"
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def _kind(key: str) -> tuple[type, bool]:
    """The type of `key`'s values, and whether it may be None (`int | None`)."""
    kind = KEYS[key]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(t for t in typing.get_args(kind) if t is not type(None)), True
    return kind, False


def _convert(key: str, value, from_text: bool):
    """`value` (TOML-typed, or command-line text) as the type of `key`."""
    kind, optional = _kind(key)
    if optional and (value is None or from_text and value.lower() in ("none", "null")):
        return None
    try:
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            if from_text:  # an empty path is kept for `check_config` to refuse ("" is `.`); no number is ""
                return [item(v.strip()) for v in value.split(",") if v.strip() or item is str]
            items = [value] if isinstance(value, str) else value  # a single path may be given as a string
            return [_exact(item, v) for v in items]
        if from_text and kind is bool:
            if value.lower() not in ("true", "1", "yes", "false", "0", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        if from_text:
            converted = kind(value)
        elif kind is float and type(value) is int:
            converted = float(value)
        else:
            converted = _exact(kind, value)
    except (TypeError, ValueError):
        name = "a list" if typing.get_origin(kind) is list else kind.__name__
        raise ConfigError(f"config key {key!r} must be {name}, got {value!r}") from None
    if kind is float and not abs(converted) <= FLOAT32_MAX:  # also false for nan
        raise ConfigError(f"config key {key!r} must be a finite number of float32's range (|x| <= 3.4e38, "
                          f"what the optimizer and sampler compute in), got {value!r}")
    return converted


FLOAT32_MAX = 3.4028234663852886e38


def _exact(kind: type, value):
    if type(value) is not kind:
        raise TypeError
    return value


def _owner(cfg: Config, key: str) -> tuple[object, str]:
    """The section object holding dotted `key`, and the field name in it."""
    *path, name = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return cfg, name


def _get(cfg: Config, key: str):
    return getattr(*_owner(cfg, key))


def apply(cfg: Config, changes: dict[str, object], where: str, from_text: bool = False) -> Config:
    """Set dotted keys of `cfg` in place, from typed values (TOML) or text (the command line).

    A key may be spelled with `-` for `_`; one file giving a key under both spellings is an error, as
    TOML makes a key given twice (on the command line the later one wins, as any repeated option)."""
    spelled: dict[str, str] = {}
    for given, value in changes.items():
        key = given.replace("-", "_")
        if key not in KEYS:
            raise _unknown(key, where)
        if not from_text and key in spelled:
            raise ConfigError(f"{where} sets {key} twice, as {spelled[key]} and as {given}: keep one")
        spelled[key] = given
        setattr(*_owner(cfg, key), _convert(key, value, from_text))
    return cfg


def with_overrides(cfg: Config, **changes) -> Config:
    """A copy of `cfg` with dotted-key changes, e.g. with_overrides(cfg, **{"train.max_steps": 6})."""
    return apply(copy.deepcopy(cfg), changes, "with_overrides")


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Defaults, then the TOML file, then `overrides` ({dotted key: text}); unknown keys are errors."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except OSError as e:  # a directory, no permission, ...
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        flat = {}
        for name, value in table.items():  # [section] tables hold one level of keys
            flat |= {f"{name}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {name: value}
        apply(cfg, flat, str(path))
    return apply(cfg, overrides or {}, "the command line", from_text=True)


def parse_args(argv: list[str] | None = None) -> Config:
    """`--config FILE`, then `--section.key VALUE` overrides (`--run-dir`, `--hf-model`, `--resume [PATH]`...).

    A key takes the next argument as its value whatever it looks like, so a prompt such as "-h" is text;
    only a boolean key, or --resume (then "latest"), may stand bare before the next --key or the end."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path, overrides, taken = None, {}, ""
    while argv:
        arg = argv.pop(0)
        if arg in ("-h", "--help"):
            _usage().print_help()
            raise SystemExit(0)
        if not arg.startswith("--"):
            hint = (f"; a config file is given as --config {arg}" if arg.endswith(".toml") and not taken else
                    f"; overrides look like --optim.lr 1e-3{taken}")
            raise ConfigError(f"unexpected argument {arg!r}{hint}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key != "config" and key not in KEYS:
            raise _unknown(key, "the command line")
        if not eq:
            bare = not argv or argv[0].startswith("--")
            if bare and key == "resume":
                value = "latest"
            elif bare and key != "config" and _kind(key)[0] is bool:
                value = "true"
            elif argv:
                value = argv.pop(0)
            else:
                raise ConfigError(f"--{key.replace('_', '-')} needs a value")
        taken = (f" (--{key.replace('_', '-')} took {value!r} as its value: give it one)"
                 if not eq and value.startswith("--") else "")
        if key == "config":
            path = value
        else:
            overrides[key] = value
    return load_config(path, overrides)


def _usage() -> argparse.ArgumentParser:
    """The --help text: the two special options, then every key with its default."""
    defaults = settings(Config())
    keys = "\n".join(f"  --{key} {'(unset)' if value is None else repr(value)}" for key, value in defaults.items())
    parser = argparse.ArgumentParser(
        prog="pipeline_parallel.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline-parallel pretraining of a Llama-style model; launch one process per stage with\n"
                    "torchrun. Every config key can be overridden: --optim.lr 1e-3 --train.max_steps 50 ...",
        epilog="config keys and their defaults (--section.key VALUE, or key = VALUE under [section] in a --config "
               f"file; README.md says what each does):\n{keys}")
    parser.add_argument("--config", help="TOML config file (see configs/)")
    parser.add_argument("--resume", nargs="?", const="latest",
                        help="continue from the latest checkpoint (which must exist), or from the one given")
    return parser


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values omitted), to print and to keep in the run directory."""
    def value(v, key: str) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x, key) for x in v) + "]"
        if not isinstance(v, str):
            return repr(v)
        if not is_utf8(v):  # undecodable bytes (a file name or a prompt in another encoding): no TOML text holds them
            remedy = "give it in UTF-8" if key == "export.prompt" else "rename it"
            raise ConfigError(f"{key}: {v!r} is not valid UTF-8 text (in another encoding?); {remedy}")
        # Non-ASCII stays readable (TOML has no surrogate-pair escapes); DEL, which JSON leaves bare, is escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")

    top, sections = [], []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if is_dataclass(v):
            body = [f"{g.name} = {value(getattr(v, g.name), f'{f.name}.{g.name}')}" for g in fields(v)
                    if getattr(v, g.name) is not None]
            sections.append(f"[{f.name}]\n" + "\n".join(body))
        else:
            top.append(f"{f.name} = {value(v, f.name)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"
