"""A stage's own part of a model: the rest released, and what is still on the `meta` device made."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderParts
from .families import check_layout, hf_float32, is_hf_config
from .llama import seed_for_name


def keep_local_part(model: nn.Module, layer_indices: range, first: bool, last: bool) -> None:
    """Release every part of `model` a stage does not own, keeping original parameter names.

    `model.layers` becomes a ModuleDict keyed by the original indices, so the stage's state dict
    still says `model.layers.5.mlp.up_proj.weight` and checkpoints map 1:1 onto the full model.
    """
    check_layout(model)
    parts = DecoderParts.of(model, layer_indices, first, last)  # what the stage runs: the rest goes
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): layer for i, layer in parts.layers})
    if parts.embed_tokens is None:
        inner.embed_tokens = None
    if parts.norm is None and parts.embedding_norm is None:
        inner.norm = None
    if parts.lm_head is None:
        model.lm_head = None


def weights_on_meta(model: nn.Module) -> bool:
    """Whether `model`'s weights are yet to be made: True if every parameter is on the `meta` device.

    Raises if only some are (the rest would be silently re-initialised), or if a buffer other than
    the rotary tables, which are recomputed from the config, is on meta while the weights are not
    (a Hugging Face model on meta has its buffers made by its `_init_weights`, as Gemma's scale).
    """
    params = list(model.named_parameters())
    on_meta = [name for name, p in params if p.is_meta]
    if on_meta and len(on_meta) < len(params):
        held = next(name for name, p in params if not p.is_meta)
        raise ValueError(
            f"{len(on_meta)} of the model's {len(params)} parameters are on the meta device (e.g. {on_meta[0]}) "
            f"but the rest hold values (e.g. {held}); load every weight (load_state_dict(..., assign=True) with a "
            "full state dict) or have every parameter on meta, and the pipeline initialises its own part (some "
            "families make a few outside `with torch.device('meta')`, such as DiffLlama's lambdas: then call "
            "model.to('meta') too)"
        )
    buffers = _meta_buffers(model)
    if buffers and not (on_meta and is_hf_config(model.config)):
        raise ValueError(f"buffer {buffers[0]} is on the meta device while the weights hold values, and only a "
                         "Hugging Face model wholly on meta has its buffers made; give the model with its buffers "
                         "(say from from_pretrained, or built off the meta device)")
    return bool(on_meta)


def hf_model_on_meta(config) -> nn.Module:
    """The Hugging Face model of `config` on the meta device, in float32, every parameter there: some families
    make some outside it (DiffLlama's lambdas, drawn by `torch.normal`), which would pass for loaded weights."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **hf_float32())
    moved: dict[int, nn.Parameter] = {}  # shared parameters stay shared
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                setattr(module, name, moved[id(param)])
    return model


def replace_by_name(model: nn.Module, name: str, value) -> None:
    """Put `value` (a parameter, buffer or module) where the dotted `name` of `model` is."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, value)


def _meta_buffers(model: nn.Module) -> list[str]:
    """The names of the model's buffers on the meta device, other than the rotary tables."""
    return [name for name, b in _non_rotary_buffers(model) if b.is_meta]


def _given_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the buffers the caller gave values (a router's bias read from a checkpoint, say), other than the
    rotary tables: `to_empty` would discard them and `_init_weights` overwrite them."""
    return {name: b.detach().clone() for name, b in _non_rotary_buffers(model) if not b.is_meta}


def _non_rotary_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    rotary = {id(b) for _, module in _rotaries(model) for b in module.buffers()}
    return [(name, b) for name, b in model.named_buffers() if id(b) not in rotary]


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules use (a tied embedding and head, a weight two layers share)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _rotaries(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's rotary embedding, and the other modules of its type: GraniteSWA's, one for each RoPE base its
    layers take, and the copies some families give each attention before transformers 5 (StableLM, Qwen2-MoE),
    which their forward does not call. Tables no checkpoint holds, computed from each one's config."""
    kind = type(model.model.rotary_emb)
    return [(name, module) for name, module in model.named_modules() if type(module) is kind]


def _random_state_kept():
    """Restores the global random state afterwards: Hugging Face's `_init_weights` draws from it, seeded per
    module here, and the caller's seed must still decide what comes after (dropout, shuffling, sampling)."""
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else [])


def _to_empty_keeping_parameters(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)`, keeping its Parameter objects, their contents swapped in: an optimizer made
    of a model on meta before its Pipeline then holds the parameters the stage trains, where it would hold meta ones
    no step gives a gradient, and train nothing without a word. Where torch cannot swap (a parameter something else
    holds a weak reference or a view of), every parameter is made anew, as `to_empty` does by itself: the ones swapped
    by then too, lest an optimizer made before train some of them only."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    except RuntimeError:  # "_apply(): Couldn't swap ..."
        torch.__future__.set_swap_module_params_on_conversion(before)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))
        model.to_empty(device=device)  # the buffers
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def materialize(model: nn.Module, device: torch.device, seed: int = 0, init_weights: bool = True) -> None:
    """Allocate and initialise what of a model (or the stage part of one) is on the `meta` device.

    With every parameter on meta (see `weights_on_meta`), all are made: our own Llama initialises
    each parameter from (seed, name) and Hugging Face models each module with their own
    `_init_weights` seeded from (seed, name), so weights do not depend on the pipeline split; tied
    input/output embeddings stay one matrix. With `init_weights=False` (a checkpoint will fill the
    weights and the buffers it holds) only the modules holding a buffer on meta that no checkpoint
    holds are initialised, for that buffer. Buffers given values keep them; rotary tables on meta
    are recomputed (buffers no checkpoint holds).
    """
    inner = model.model
    weights_made = weights_on_meta(model)
    if weights_made:
        tied = inner.embed_tokens is not None and model.lm_head is not None and \
            model.lm_head.weight is inner.embed_tokens.weight
        buffers, given, shared = _meta_buffers(model), _given_buffers(model), shared_parameters(model)
        loaded = set() if init_weights else set(model.state_dict())  # the checkpoint's, such as a router's bias
        _to_empty_keeping_parameters(model, device)
        for first, *others in shared:  # where they were made anew, each use of a shared parameter is one of its own
            for name in others:
                replace_by_name(model, name, model.get_parameter(first))
        with torch.no_grad(), _random_state_kept():
            for name in buffers:  # NaN until `_init_weights` computes it, so a buffer it skips is caught
                if model.get_buffer(name).is_floating_point():
                    model.get_buffer(name).fill_(float("nan"))
            if not init_weights:  # only what computes a buffer no checkpoint holds, such as Gemma's scale
                owners = {name.rpartition(".")[0] for name in buffers if name not in loaded}
                for name, module in model.named_modules():
                    if name in owners and hasattr(model, "_init_weights"):
                        model._init_weights(module)
            elif hasattr(model, "init_weights") and not is_hf_config(model.config):
                model.init_weights(seed)
            else:  # each module from (seed, its name): the layers differ, whatever the split
                skip = (inner.rotary_emb, model.lm_head if tied else None)  # a tied head is the embedding
                for name, module in model.named_modules():
                    if not any(module is m for m in skip):
                        torch.manual_seed(seed_for_name(seed, name))
                        model._init_weights(module)
            for name, value in given.items():
                model.get_buffer(name).copy_(value)
        missed = [name for name in buffers if name not in loaded and model.get_buffer(name).isnan().any()]
        if missed:
            raise ValueError(f"buffer {missed[0]} was on the meta device and the model's _init_weights does not "
                             "compute it; give the model with its buffers allocated")
    for name, rotary in _rotaries(model):
        if not any(b.is_meta for b in rotary.buffers()) and not weights_made:
            continue
        if hasattr(rotary, "reset_inv_freq"):
            rotary.reset_inv_freq(device)
        else:
            with torch.device(device):  # HF rotary tables are computed in __init__
                # From its own config: GraniteSWA's each hold another RoPE base
                replace_by_name(model, name, type(rotary)(config=getattr(rotary, "config", None) or model.config))
