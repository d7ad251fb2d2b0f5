"""Checks of a whole training configuration, against the world size and the files it names, and the
model shape it describes."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from ._checks import check_seed
from ._checkpoint_dirs import refuse_incomplete
from .checkpoint import is_checkpoint
from .config import FLOAT32_MAX, Config, ConfigError, ModelConfig, as_config_error, settings
from .export import HF_CONFIG
from .models import PRESETS, LlamaConfig
from .partition import balanced_layer_counts, check_layer_counts
from .resume import as_resume_error
from .schedules import build_schedule

_MAX_THREADS = 2**31 - 1  # torch.set_num_threads takes a C int


def _num_layers(cfg: Config) -> int:
    """Decoder layers of the model the config describes (read from --hf-model's config.json)."""
    if cfg.hf_model:
        layers = _hf_config(cfg).get("num_hidden_layers")
        if type(layers) is not int or layers < 1:
            raise ConfigError(
                f"hf_model {cfg.hf_model}: its config.json gives num_hidden_layers {layers!r}, where a decoder-only "
                "model laid out as the pipeline splits it (model.layers, as Llama's) gives its number of layers; "
                "give a model of a supported family")
        return layers
    return llama_config(cfg, vocab_size=cfg.model.vocab_size or 256).num_hidden_layers


def _hf_config(cfg: Config) -> dict:
    config_file = Path(cfg.hf_model) / HF_CONFIG
    if not config_file.is_file():
        raise ConfigError(f"hf_model {cfg.hf_model} has no config.json: give a local Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"hf_model {cfg.hf_model}: its config.json is not JSON ({error}); give a Hugging Face "
                          "model directory as save_pretrained writes it") from None
    if not isinstance(config, dict):
        raise ConfigError(f"hf_model {cfg.hf_model}: its config.json holds a {type(config).__name__}, not the "
                          "settings of a model; give a Hugging Face model directory as save_pretrained writes it")
    return config


def llama_config(cfg: Config, vocab_size: int) -> LlamaConfig:
    """Our Llama's shape: the preset with every field the config sets."""
    overrides = {f.name: getattr(cfg.model, f.name) for f in fields(ModelConfig)
                 if f.name != "preset" and getattr(cfg.model, f.name) is not None}
    overrides["vocab_size"] = cfg.model.vocab_size or vocab_size
    with as_config_error("model"):
        return LlamaConfig.from_preset(cfg.model.preset, **overrides)


def check_config(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for any invalid setting or combination. Reads only the config and the
    files it names (resume, hf_model), which a node may see differently: the training program
    runs it on every rank and raises the first failure everywhere."""
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    t, o, d, p, values = cfg.train, cfg.optim, cfg.data, cfg.pipeline, settings(cfg)
    check(cfg.run_dir.strip() != "", "run_dir is empty (an unset variable?): give the directory the run writes to, "
                                     "such as runs/mine")
    check(all(path.strip() for path in d.path), f"data.path {d.path} has an empty entry (an unset variable?), which "
          "would read the current directory: give files, directories or hf:NAME, or leave data.path out to train on "
          "the Python standard library")
    check(cfg.model.preset in PRESETS, f"model.preset {cfg.model.preset!r} is not one of {', '.join(PRESETS)}")
    try:
        check_seed("seed", cfg.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check(cfg.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {cfg.device!r}")
    check(t.dtype in ("fp32", "bf16"), f"train.dtype must be fp32 or bf16, got {t.dtype!r}")
    check(cfg.export.dtype in ("fp32", "bf16"), f"export.dtype must be fp32 or bf16, got {cfg.export.dtype!r}")
    if cfg.resume not in ("auto", "latest", "never"):
        with as_resume_error():  # a checkpoint that lacks a part is damaged, and the error names an earlier one
            refuse_incomplete(Path(cfg.resume))
        hint = (f"; {cfg.resume} is a run directory: give it as run_dir with resume = latest, or name one of "
                "its checkpoints/step_* directories" if (Path(cfg.resume) / "checkpoints").is_dir() else
                f"; there is no {cfg.resume}" if not Path(cfg.resume).exists() else "")
        check(is_checkpoint(cfg.resume), "resume must be auto, latest, never or a complete checkpoint directory "
                                         f"(run_dir/checkpoints/step_NNNNNN), got {cfg.resume!r}{hint}")
    for key in ("train.batch_size", "train.grad_accum_steps", "train.max_steps", "pipeline.num_microbatches",
                "data.seq_len", "log.interval"):
        check(values[key] >= 1, f"{key} must be >= 1, got {values[key]}")
    for key in ("optim.warmup_steps", "optim.lr_decay_steps", "optim.weight_decay", "optim.grad_clip",
                "optim.min_lr", "eval.interval", "eval.max_batches", "checkpoint.interval",
                "checkpoint.keep_last", "data.max_tokens", "export.sample_tokens", "export.temperature",
                "export.top_k", "num_threads"):
        check(values[key] >= 0, f"{key} must be >= 0, got {values[key]}")
    check(cfg.num_threads <= _MAX_THREADS, f"num_threads {cfg.num_threads} is more than torch can set "
          f"(at most {_MAX_THREADS}; 0 gives each rank the node's cores / its ranks)")
    check(o.lr > 0 and o.min_lr <= o.lr, f"need 0 < optim.lr and optim.min_lr <= optim.lr, got {o.lr}, {o.min_lr}")
    check(o.lr_decay_steps == 0 or o.lr_decay_steps > o.warmup_steps,
          f"optim.lr_decay_steps {o.lr_decay_steps} must come after optim.warmup_steps {o.warmup_steps} "
          "(the cosine decays from the end of the warmup), or be 0 to decay until train.max_steps")
    check(o.lr_decay_steps > 0 or t.max_steps > o.warmup_steps,
          f"train.max_steps {t.max_steps} ends within optim.warmup_steps {o.warmup_steps}: the learning rate would "
          f"reach optim.lr at the last step at best and never decay to optim.min_lr; set optim.warmup_steps below "
          f"{t.max_steps} (0: none)")
    check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1 and o.eps > 0, "need 0 <= optim.beta1, beta2 < 1 and optim.eps > 0")
    check(o.lr <= FLOAT32_MAX * (1 - o.beta1), f"optim.lr {o.lr} is too large: AdamW's first step moves by up to "
          f"lr / (1 - optim.beta1) = {o.lr / (1 - o.beta1):.3g}, beyond float32's range")
    check(d.vocab_size >= 257, f"data.vocab_size must be at least 257 (256 bytes + end-of-text), got {d.vocab_size}")
    check(bool(cfg.hf_model or d.tokenizer) or not cfg.model.vocab_size or cfg.model.vocab_size >= d.vocab_size,
          f"model.vocab_size {cfg.model.vocab_size} is below data.vocab_size {d.vocab_size}, the size of the tokenizer "
          "trained for the run, so some token IDs would have no embedding row: raise model.vocab_size, lower "
          "data.vocab_size, or leave model.vocab_size unset to take the tokenizer's")
    check(d.tokenizer_train_chars >= 1, f"data.tokenizer_train_chars must be >= 1, got {d.tokenizer_train_chars}")
    check(0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    check(d.eval_fraction > 0 or not cfg.eval.interval, "eval.interval: data.eval_fraction = 0 holds out no "
          "sequences, so there is nothing to evaluate; raise data.eval_fraction, or set eval.interval = 0")
    check(t.batch_size % p.num_microbatches == 0,
          f"train.batch_size {t.batch_size} is not divisible by pipeline.num_microbatches {p.num_microbatches}: "
          "each pipeline step splits the batch into equal microbatches")
    with as_config_error("pipeline.schedule"):
        build_schedule(p.schedule, world_size, p.num_microbatches)
    if cfg.hf_model:
        check(Path(cfg.hf_model).is_dir(), f"hf_model {cfg.hf_model} is not a directory")
        named = [f"model.{f.name}" for f in fields(ModelConfig) if getattr(cfg.model, f.name) != f.default]
        check(not named, f"{', '.join(named)} cannot be set with hf_model: its shape comes from its config.json")
        seq_max = _hf_config(cfg).get("max_position_embeddings")
        check(seq_max is None or d.seq_len <= seq_max,
              f"data.seq_len {d.seq_len} exceeds the max_position_embeddings {seq_max} of hf_model {cfg.hf_model}")
    else:
        seq_max = llama_config(cfg, vocab_size=cfg.model.vocab_size or 256).max_position_embeddings
        check(d.seq_len <= seq_max, f"data.seq_len {d.seq_len} exceeds model.max_position_embeddings {seq_max}")
    layers = _num_layers(cfg)
    with as_config_error("pipeline.layer_counts" if p.layer_counts else "the number of ranks"):
        if p.layer_counts:
            check_layer_counts(p.layer_counts, layers, world_size)
        else:  # the even split, which refuses more stages than layers as the balanced one does
            balanced_layer_counts(layers, world_size)
