"""Start a model, or one stage of it, from the weights of a Hugging Face model's `*.safetensors` files.

Each rank reads only the tensors its stage owns. They are found by name, or, for the weights that
transformers 5 makes from several tensors of the files (the experts of a MoE, fused in memory and
saved one by one), through transformers' own conversion of those tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .models.materialize import replace_by_name


@dataclass
class _Sources:
    """Where in the files each of a model's tensors is."""

    by_name: dict[str, tuple[str, object]]  # name -> (name in the files, open file)
    converted: dict[str, list[str]] = field(default_factory=dict)  # name -> the files' tensors it is made of
    where: dict[str, object] = field(default_factory=dict)  # name in the files -> open file
    mapping: list = field(default_factory=list)  # transformers' conversion of them


def check_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Raise unless the files at `path` hold every weight of `model`, under its name and in its shape or as
    the tensors transformers makes it of (reads headers only)."""
    _sources(model, path)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Copy the weights of the local HF model at `path` into `model` (a full model or one stage).

    Reads only the tensors this stage owns, so no rank holds the whole model. A tied LM head takes
    the embedding (`save_pretrained` leaves it out of the files); an untied one missing is refused.
    """
    sources = _sources(model, path)
    state = model.state_dict()
    for name, (source, handle) in sources.by_name.items():
        state[name].copy_(handle.get_tensor(source))
    if sources.converted:
        _load_converted(model, sources, path)


@torch.no_grad()
def load_hf_buffers(model: nn.Module, path: str | Path) -> None:
    """Fill the buffers on meta of a model built there with the values the files at `path` hold (a router's
    correction bias, say), for `Pipeline` to keep where the model's `_init_weights` cannot make them (DeepSeek V3's
    on transformers 4). Buffers are small: every rank reads them all, before the model is split."""
    where = _tensors_in_files(path)
    for name, buffer in model.named_buffers():
        if buffer.is_meta and name in where:
            replace_by_name(model, name, where[name].get_tensor(name).to(buffer.dtype))


def _sources(model: nn.Module, path: str | Path) -> _Sources:
    """Where in the `*.safetensors` files at `path` each of `model`'s tensors is. Raises if any is missing or,
    found by name, of another shape than the model's (read from the files' headers)."""
    where, state = _tensors_in_files(path), model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    by_name, missing = {}, []
    for name in state:
        # A tied head is the embedding, also where the files hold a head of their own: it loads alike on any split.
        source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
        if source in where:
            by_name[name] = (source, where[source])
        else:
            missing.append(name)
    converted, mapping = _converted(model, state, where, missing)
    missing = [name for name in missing if name not in converted]
    if missing:
        used = {s for s, _ in by_name.values()} | {s for names in converted.values() for s in names}
        unused = sorted(set(where) - used)[:2]
        instead = f" (they hold e.g. {unused} instead)" if unused else ""
        raise ValueError(f"{path} lacks {len(missing)} of the {type(model).__name__} weights, e.g. {missing[:2]}: its "
                         f"files neither name them nor hold what transformers makes them of{instead}; give the files "
                         "saved with this model's config.json")
    for name, (source, handle) in by_name.items():
        shape, want = tuple(handle.get_slice(source).get_shape()), tuple(state[name].shape)
        if shape != want:
            raise ValueError(f"{path}: {source} has shape {shape}, the model {want} (from config.json): "
                             "give the config.json saved with these weights")
    return _Sources(by_name, converted, where, mapping)


def _tensors_in_files(path: str | Path) -> dict[str, object]:
    """Each tensor of the `*.safetensors` files at `path`, by name: the open file that holds it (read lazily)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files; save the model with "
                                "save_pretrained(safe_serialization=True)")
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in files]
    return {name: h for h in handles for name in h.keys()}


def _converted(model: nn.Module, state: dict, where: dict, missing: list[str]) -> tuple[dict[str, list[str]], list]:
    """Of the `missing` tensors, those transformers makes from tensors of the files while loading, each with
    their names there; and its conversion. Nothing before transformers 5, which names every tensor alike."""
    if not missing:
        return {}, []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        wanted = set(missing)
        converted: dict[str, list[str]] = {}
        for source in where:
            target, pattern = rename_source_key(source, renamings, converters, model.base_model_prefix, state)
            for name in [target, *_split_siblings(target, pattern, converters)]:
                if name in wanted:
                    converted.setdefault(name, []).append(source)
    except (ImportError, AttributeError, TypeError):  # transformers 4, or a model it converts nothing of
        return {}, []
    return converted, mapping


def _split_siblings(target: str, pattern: str | None, converters: list) -> list[str]:
    """The other tensors a converter splits one of the files' into (a fused qkv into q, k and v), which transformers
    names after the first only: `target` with its first target pattern replaced by each other one."""
    for converter in converters:
        if pattern is not None and pattern in converter.source_patterns and len(converter.target_patterns) > 1:
            first, *others = converter.target_patterns
            head, found, tail = target.rpartition(first)
            return [head + other + tail for other in others] if found else []
    return []


def _load_converted(model: nn.Module, sources: _Sources, path) -> None:
    """Load the tensors of `model` that transformers makes from others of the files, by its own conversion."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    # transformers sets new tensors in the modules: the model's own (which an optimizer may hold) take their values
    state = model.state_dict(keep_vars=True)
    own = {name: state[name] for name in sources.converted}
    for tensor in own.values():  # NaN until loaded, so one transformers leaves out is caught
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
    tensors = {s: sources.where[s].get_tensor(s) for names in sources.converted.values() for s in names}
    with _no_progress_bars():
        convert_and_load_state_dict_in_model(model, tensors, LoadStateDictConfig(weight_mapping=sources.mapping))
    made = model.state_dict()
    for name, tensor in own.items():
        tensor.copy_(made[name])
        replace_by_name(model, name, tensor)
    unmade = [name for name, tensor in own.items() if tensor.isnan().any()]
    if unmade:
        raise ValueError(f"{path}: transformers did not make {unmade[0]} of the files' {sources.converted[unmade[0]][:2]}"
                         "...: are their shapes those config.json gives? Give the files saved with this config.json")


@contextlib.contextmanager
def _no_progress_bars():
    """Without transformers' "Loading weights" bar, which would break into the run's own output."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
