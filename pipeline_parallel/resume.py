"""Where a start of the training program resumes from, and whether that checkpoint fits the run:
the same model, tokenizer and data, and steps left to train."""

from __future__ import annotations

import contextlib
import shlex
from dataclasses import asdict
from pathlib import Path

from .checkpoint import DamagedCheckpointError, latest_checkpoint, read_extra, saved_checkpoints
from .config import CONFIG_FILE, Config, ConfigError, as_config_error, load_config, settings
from .data import Data
from .export import export_command
from .models import LlamaConfig
from .models.decoder import model_settings
from .models.families import hf_config
from .token_cache import STREAM_CHANGES
from .tokenizer_identity import loads_differently, tokenizer_differences

# Model settings a resume may change: the initialisation's scale (already done) and the special ids
# (the tokenizer is checked itself).
_RESUME_MAY_CHANGE = frozenset({"initializer_range", "bos_token_id", "eos_token_id", "pad_token_id"})


class RunComplete(Exception):
    """The checkpoint to resume from already reached train.max_steps: nothing to train, and nothing is done
    (no data prepared, no export made again); raised at start, on every rank."""


@contextlib.contextmanager
def as_resume_error():
    """`as_config_error("resume")`, where the error of a damaged checkpoint says how to resume from the intact one it
    names instead."""
    with as_config_error("resume"):
        try:
            yield
        except DamagedCheckpointError as e:
            again = e.advising(lambda earlier: f"resume from an earlier one with --resume {shlex.quote(str(earlier))}")
            raise ValueError(again) from None


def checkpoint_to_resume(cfg: Config) -> Path | None:
    """The checkpoint `resume` asks for (None: start from step 0); RunComplete if it has no step left."""
    run_dir = Path(cfg.run_dir)
    if cfg.resume in ("auto", "latest", "never"):
        with as_resume_error():  # a damaged newest checkpoint is named, not skipped
            latest = latest_checkpoint(run_dir)
        if cfg.resume == "latest" and latest is None:
            raise ConfigError(f"resume = latest, but {run_dir / 'checkpoints'} holds no checkpoint")
        if cfg.resume == "never" and latest is not None:  # its later saves would mix with and rotate out ours
            raise ConfigError(
                f"resume = never, but {run_dir} already holds a run (checkpoint {latest.name}); starting "
                f"over there would replace its checkpoints and metrics: give a new run_dir, or delete "
                f"{run_dir / 'checkpoints'} first")
        path = None if cfg.resume == "never" else latest
    else:  # a checkpoint named, which the newest being damaged must not keep from resuming
        path = Path(cfg.resume)
        own = saved_checkpoints(run_dir)
        if own and path.resolve().parent != (run_dir / "checkpoints").resolve():
            raise ConfigError(
                f"resume = {path} is a checkpoint of another run directory, but {run_dir} holds a run of its own "
                f"(checkpoint {own[-1].name}), whose checkpoints and metrics its saves would replace: give a new "
                f"run_dir to go on from {path} there, or resume from one of {run_dir / 'checkpoints'}")
    if path is not None:
        with as_resume_error():
            step = read_extra(path)["step"]
        if step >= cfg.train.max_steps:  # starting would only repeat the run's end
            _refuse_another_run(cfg, path)
            raise RunComplete(f"the run is complete: {path} is at step {step} and train.max_steps is "
                              f"{cfg.train.max_steps}, so there is nothing to train (nothing was changed). To train "
                              "further, raise train.max_steps (the cosine then stretches to the new end unless "
                              "optim.lr_decay_steps pins it); to export that checkpoint again: "
                              f"{export_command(path, dtype=cfg.export.dtype)}")
    return path


def _refuse_another_run(cfg: Config, path: Path) -> None:
    """Raise if the complete run of checkpoint `path` was started with another model, data or seed than `cfg`
    asks for, as it was recorded in its run_dir/config.toml: the start is meant as a new run (say in the
    default run_dir, which the quick start used), not to finish that one."""
    recorded = path.parent.parent / CONFIG_FILE
    try:
        then = settings(load_config(recorded))
    except (OSError, ConfigError):  # no record (an older run), or one this version cannot read: not compared
        return
    then, now = _as_built(then), _as_built(settings(cfg))
    defines_run = [key for key in now if key.startswith(("model.", "data.")) or key in ("hf_model", "seed")]
    differ = [f"{key} {then[key]!r} there, {now[key]!r} now" for key in defines_run if then[key] != now[key]]
    if differ:
        raise ConfigError(f"the run in {cfg.run_dir} is complete ({path.name}, train.max_steps {cfg.train.max_steps}), "
                          f"and it was started with other settings ({'; '.join(differ)}): nothing was changed. "
                          "Give a new run_dir for a new run, or its own settings to train it further or export it")


def _as_built(values: dict[str, object]) -> dict[str, object]:
    """`values` (a config's settings) with each model.* key left unset as its preset has it, and no preset: a key
    set to its preset's value, or another preset of the same shape, builds the same model. An unset vocab_size stays
    unset (the tokenizer's, which the data.* keys decide)."""
    try:
        shape = asdict(LlamaConfig.from_preset(values["model.preset"]))
    except ValueError:  # a preset this version does not have: compared as written
        return values
    built = {key: value for key, value in values.items() if key != "model.preset"}
    for name, value in shape.items():
        if built.get(f"model.{name}", 0) is None and name != "vocab_size":
            built[f"model.{name}"] = value
    return built


def check_resumable(path: Path, extra: dict, model_config: dict, data: Data) -> None:
    """Refuse checkpoint `path` (its `extra`) unless it was trained on this model, tokenizer and data."""
    saved, current = _settings_of(extra["model_config"]), _settings_of(model_config)
    differ = [f"{key} {saved.get(key)!r} there, {current.get(key)!r} now" for key in sorted({*saved, *current})
              if key not in _RESUME_MAY_CHANGE and saved.get(key) != current.get(key)]
    if differ:
        raise ConfigError(f"{path} holds another model than configured ({'; '.join(differ)}): resume with the "
                          "model settings it was trained with, or start a new run_dir")
    differences = tokenizer_differences(data.tokenizer, extra)
    if "vocabulary" in differences:
        raise ConfigError(f"{path} was trained with another tokenizer than the run has now (data.tokenizer, or where "
                          "that is empty the run directory's own tokenizer.json): resume with the tokenizer it was "
                          "trained with, or start a new run_dir")
    if differences:
        raise ConfigError(f"data.tokenizer has the vocabulary of the tokenizer {path} was trained with, "
                          f"{loads_differently(differences, extra)}; or start a new run_dir")
    if extra.get("data_digest", data.digest) == data.digest:
        return
    then = extra.get("data_version")
    if then != data.version:  # the same text may give another stream
        changes = "; ".join(f"version {version} {what}" for version, what in STREAM_CHANGES.items()
                            if min(then or 0, data.version or 0) < version <= max(then or 0, data.version or 0))
        raise ConfigError(
            f"{path} was trained on a token stream that another version of this program made ({_stream(then)}), and "
            f"data.path gives another now ({_stream(data.version)}): the data may be unchanged, only tokenized "
            f"differently ({changes}), but the run's place in one stream means nothing in the other. Resume with the "
            "version of pipeline_parallel that trained it, or start a new run_dir (to go on training this model with "
            "this version, start from its export with --hf-model)")
    raise ConfigError(f"{path} was trained on other data than data.path and data.max_tokens give now (its token "
                      "stream differs): resume with the data it was trained on, or start a new run_dir (to train "
                      "this model on new data, start from its export with --hf-model)")


def _stream(version: int | None) -> str:
    """A token stream's STREAM_VERSION, in words."""
    return f"version {version}" if version else "which recorded no version"


def _settings_of(model_config: dict) -> dict:
    """The settings (see `model_settings`) of a checkpoint's Hugging Face config dict as this transformers
    version reads it (4.55 wrote `rope_theta` where 5 writes `rope_parameters`): only real changes differ."""
    import transformers

    if model_config.get("model_type") not in transformers.CONFIG_MAPPING:
        return model_config
    return model_settings(hf_config(model_config))
