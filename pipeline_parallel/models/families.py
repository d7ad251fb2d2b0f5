"""Which Hugging Face families a pipeline stage can run, and what their forwards do beyond the modules
a stage calls: scales and caps on the embeddings and logits, each layer's mask and rotary tables."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ForwardScales:
    """What a family's forward does around its modules: the embeddings times `embedding`, the logits times
    `logits` and then capped at `softcap` (c * tanh(logits / c)): Granite's multipliers, Cohere's logit
    scale, Gemma 2's cap. Nothing for most families."""

    embedding: float = 1.0
    logits: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ForwardScales:
        """The scales the family's forward applies, read where it reads them (`_FORWARD_SCALES`)."""
        model_type = _model_type(model.config)
        return _FORWARD_SCALES[model_type](model) if model_type in _FORWARD_SCALES else cls()

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the family's forward returns, from those of its head, computed as it computes them."""
        if self.logits != 1.0:
            logits = logits * self.logits
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_grad_(self, grad: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        """The gradient of the head's logits from that of `scaled = scale_logits(...)`, in place of both."""
        if self.softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh(x / c)^2
            grad.mul_(scaled.div_(self.softcap).square_().neg_().add_(1))
        if self.logits != 1.0:
            grad.mul_(self.logits)
        return grad


# Hugging Face model types whose `*ForCausalLM.forward` computes nothing beyond the modules a stage runs
# (embedding, layers, norm, head) but what `_FORWARD_SCALES` says, checked against the unpipelined model by
# the tests, each with how that forward picks a layer's attention mask: "causal" (every layer, whatever the
# config says of windows), "window" (every layer sliding-window when config.sliding_window is set) or
# "layer_types" (layer i as config.layer_types[i] says; the rotary tables too where they differ by kind, and by
# each layer's RoPE base in GraniteSWA, `layer_rotary`).
# Others do more in forward: other masks or inputs for some layers (Llama 4's chunks, hybrids of attention and
# linear attention).
SUPPORTED_MODEL_TYPES = {
    **dict.fromkeys(("llama", "olmo", "olmo2", "stablelm", "gemma", "apertus", "apertus1p5_text", "arcee", "aria_text",
                     "axk1", "bitnet", "cohere", "deepseek_v2", "deepseek_v3", "diffllama", "ernie4_5", "ernie4_5_moe",
                     "exaone", "flex_olmo", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "granite", "granitemoe",
                     "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
                     "internlm3", "iquestcoder", "jais2", "jetmoe", "minicpm3", "minimax_m2", "minimax_m3_vl_text",
                     "nanochat", "nemotron", "olmoe", "sarvam_mla", "sarvam_moe", "seed_oss", "solar_open", "youtu"),
                    "causal"),
    **dict.fromkeys(("mistral", "mixtral", "qwen3_moe", "starcoder2", "ministral3", "phi3", "phimoe"), "window"),
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen3", "afmoe", "cohere2", "cohere2_moe", "cwm", "exaone4", "exaone_moe",
                     "flint", "gemma2", "gemma3_text", "gpt_oss", "kolibri1", "laguna", "mellum", "mimo_v2_flash",
                     "granite_swa", "ministral", "olmo3", "smollm3", "vaultgemma"), "layer_types"),
}
# What some of them do in forward to the embeddings or logits, read where their forward reads it.
# (A divisor is taken as a multiplier: the logits may differ from the forward's in their last bit.)
_FORWARD_SCALES = {
    "afmoe": lambda model: ForwardScales(embedding=model.config.hidden_size ** 0.5 if model.config.mup_enabled
                                         else 1.0),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda model: ForwardScales(logits=model.logit_scale)),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"),
                    lambda model: ForwardScales(softcap=model.config.final_logit_softcapping)),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granite_swa"), lambda model: ForwardScales(
        embedding=model.model.embedding_multiplier, logits=1 / model.config.logits_scaling)),
    "hyperclovax": lambda model: ForwardScales(embedding=model.model.embedding_multiplier,
                                               logits=model.config.logits_scaling),
    "minicpm3": lambda model: ForwardScales(logits=1 / model.config.logits_scaling),  # divides the head's input
    "nanochat": lambda model: ForwardScales(softcap=model.config.final_logit_softcapping),
}
# Families whose forward also passes the embeddings through `model.norm` before the first layer (parameter-free
# there; one with weights would be shared by the first and last stages, which `check_shared_parameters` refuses).
_NORMED_EMBEDDINGS = {"nanochat"}
# Config switches a family's forward reads beyond its modules: a stage trains the family only while they are
# off (None or False), as in the released checkpoints.
_FORWARD_SWITCHES = {"gemma3_text": {"use_bidirectional_attention": "lets tokens attend ahead"}}
_MASKED_KINDS = ("full_attention", "sliding_attention")


def check_layout(model: nn.Module) -> None:
    """Raise a clear error unless `model` has the decoder layout the pipeline splits."""
    inner = getattr(model, "model", None)
    missing = [
        name
        for name, owner, attr in [
            ("model.embed_tokens", inner, "embed_tokens"),
            ("model.layers", inner, "layers"),
            ("model.norm", inner, "norm"),
            ("model.rotary_emb", inner, "rotary_emb"),
            ("lm_head", model, "lm_head"),
        ]
        if owner is None or not hasattr(owner, attr) or (attr == "rotary_emb" and owner.rotary_emb is None)
    ]
    if missing or not hasattr(model, "config"):
        raise TypeError(
            f"{type(model).__name__} is not a supported decoder-only causal LM: missing {missing or ['config']}. "
            "Pass a Hugging Face model laid out as model.{embed_tokens, layers, norm, rotary_emb} + lm_head "
            "(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, ...) or pipeline_parallel's own Llama"
        )
    if isinstance(inner.layers, nn.ModuleDict) or None in (inner.embed_tokens, inner.norm, model.lm_head):
        raise ValueError(
            f"this {type(model).__name__} holds one pipeline stage only (a Pipeline already split it); "
            "pass the whole model, built anew or loaded from a checkpoint"
        )
    _check_ends(model)
    _check_vocab_rows(model)
    if not is_hf_config(model.config):
        _check_call_arguments(model)
        return
    model_type = _model_type(model.config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"{type(model).__name__} (model_type {model_type!r}) is not supported: a pipeline stage runs the "
            "model's modules, and some families' forwards do more (other masks or inputs for some layers), "
            f"which would silently train another function. Supported model types: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    for name, what in _FORWARD_SWITCHES.get(model_type, {}).items():
        value = getattr(model.config, name, None)
        if value not in (None, False):
            raise TypeError(
                f"{type(model).__name__} with config.{name} = {value!r}: its forward then {what}, beyond the modules "
                f"a pipeline stage runs, which would silently train another function; set config.{name} = "
                f"{False if isinstance(value, bool) else None}"
            )
    _check_call_arguments(model)
    layer_types = getattr(model.config, "layer_types", None) or ()
    if model_type == "qwen2_moe" and _transformers_version() < (5, 0) and (
            getattr(model.config, "sliding_window", None) is not None or "sliding_attention" in layer_types):
        raise TypeError(
            f"{type(model).__name__} with a sliding window: before transformers 5, Qwen2-MoE's forward applies its "
            "window in a way of its own for each attention implementation, which a pipeline stage does not follow; "
            "upgrade transformers to 5.x, or set config.use_sliding_window = False and config.sliding_window = None, "
            "with no 'sliding_attention' left in config.layer_types"
        )
    unknown = sorted(set(layer_types) - set(_MASKED_KINDS))
    if unknown and SUPPORTED_MODEL_TYPES[model_type] == "layer_types":  # the other families' forwards ignore them
        raise TypeError(
            f"{type(model).__name__} has decoder layers of kind {', '.join(map(repr, unknown))} (config.layer_types); "
            f"a pipeline stage masks {' and '.join(map(repr, _MASKED_KINDS))} layers only"
        )
    if _scales_embeddings_outside(model):
        raise TypeError(
            f"{type(model).__name__} scales its embeddings inside the model's forward in this transformers "
            "version, which a pipeline stage cannot reproduce; upgrade transformers to 5.x, where the "
            "scaling lives in the embedding module"
        )
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} has output_router_logits=True: its forward adds the router's auxiliary "
            "loss, which the pipeline's cross-entropy leaves out; set config.output_router_logits = False"
        )


_LAYER_ARGUMENTS = frozenset({"attention_mask", "position_ids", "position_embeddings"})  # what a stage passes


def _check_call_arguments(model: nn.Module) -> None:
    """Raise if the rotary embedding or a decoder layer takes other arguments than a stage passes: its
    model's forward makes something for it the stage does not know how to (before transformers 5, Gemma 3's
    layers take global and local rotary tables as two arguments of their own, and Phi-MoE's rotary
    embedding a sequence length)."""
    hint = "; a newer transformers may lay the family out as a stage runs it" if is_hf_config(model.config) else ""
    rotary = list(inspect.signature(type(model.model.rotary_emb).forward).parameters.values())[2:]  # after self, x
    if not rotary or rotary[0].name != "position_ids" or _required(rotary[1:], {"layer_type"}):
        raise TypeError(
            f"{type(model).__name__}'s rotary embedding ({type(model.model.rotary_emb).__name__}) takes "
            f"{', '.join(p.name for p in rotary) or 'no positions'}, where a pipeline stage passes position_ids "
            f"(and the layer kind, to one that takes layer_type){hint}")
    layers = model.model.layers
    for layer_type in {type(layer) for layer in (layers.values() if isinstance(layers, nn.ModuleDict) else layers)}:
        required = _required(list(inspect.signature(layer_type.forward).parameters.values())[2:], _LAYER_ARGUMENTS)
        if required:
            raise TypeError(
                f"{type(model).__name__}'s decoder layers ({layer_type.__name__}) require {', '.join(required)}, "
                f"which its own forward makes and a pipeline stage does not: a stage passes each layer "
                f"{', '.join(sorted(_LAYER_ARGUMENTS))} only{hint}")


def _required(params: list[inspect.Parameter], given) -> list[str]:
    """The names of `params` a call must give that are not among `given`."""
    return [p.name for p in params if p.default is p.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _scales_embeddings_outside(model: nn.Module) -> bool:
    """Gemma-family models before transformers 5 multiply embeddings by sqrt(hidden) in forward."""
    model_type = _model_type(model.config)
    return model_type.startswith(("gemma", "recurrent_gemma")) and type(model.model.embed_tokens) is nn.Embedding


def norms_embeddings(model: nn.Module) -> bool:
    """Whether the family's forward passes the embeddings through the final norm too (NanoChat's)."""
    return _model_type(model.config) in _NORMED_EMBEDDINGS


def layer_rotary(model: nn.Module, layer_idx: int) -> tuple[str, nn.Module] | None:
    """The rotary embedding (its name in the model, itself) whose tables decoder layer `layer_idx` takes, as the
    family's forward picks it: `model.rotary_emb`, but for GraniteSWA, whose forward keeps one in
    `model.rotary_embs` for each RoPE base in config.layer_rope_theta and gives a layer whose base is 0 none."""
    if _model_type(model.config) != "granite_swa":
        return "model.rotary_emb", model.model.rotary_emb
    theta = model.config.layer_rope_theta[layer_idx]
    if not theta:
        return None
    for j, rotary in enumerate(model.model.rotary_embs):  # by the base its config holds, as the forward keys them
        if rotary.config.rope_parameters["rope_theta"] == theta:
            return f"model.rotary_embs.{j}", rotary
    raise ValueError(f"config.layer_rope_theta[{layer_idx}] is {theta}, but model.model.rotary_embs holds no rotary "
                     "embedding of that base (was the config changed after the model was built?): build the model "
                     "from the config it is to train with")


def attention_kind(config, layer_idx: int) -> str:
    """"full_attention" or "sliding_attention" for a decoder layer, decided as the model's own forward
    does (see SUPPORTED_MODEL_TYPES): a stray `sliding_window` or `layer_types` in a config whose forward
    never reads it changes nothing there, so it must change nothing here. Our own Llama's are all full."""
    rule = SUPPORTED_MODEL_TYPES.get(_model_type(config)) if is_hf_config(config) else "causal"
    layer_types = getattr(config, "layer_types", None) if rule == "layer_types" else None
    if layer_types:
        return layer_types[layer_idx]
    # A "layer_types" family in a transformers version whose config lists none slides as "window" does.
    if rule != "causal" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def causal_mask(config, hidden: torch.Tensor, position_ids: torch.Tensor, sliding: bool = False):
    """The attention mask a Hugging Face decoder layer expects for plain causal attention.

    Built by transformers' own `create_causal_mask` (or its sliding-window twin), so every
    attention implementation (sdpa, eager, flex) gets the mask it would get in the unpipelined
    model; `None` for our own Llama, whose attention is causal by construction.
    """
    if not is_hf_config(config):
        return None
    from transformers import masking_utils

    create = masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
    kwargs = dict(config=config, attention_mask=None, position_ids=position_ids)
    params = _mask_params()
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    kwargs["cache" if "cache" in params else "past_key_values"] = None  # renamed in transformers 5.24
    if "cache_position" in params:  # transformers < 5, which takes a mask with position_ids and no cache for packed
        kwargs["cache_position"] = position_ids[0]  # sequences: a [batch, 1, seq, seq] tensor where sdpa needs none
        kwargs["position_ids"] = None
    return create(**kwargs)


def _check_ends(model: nn.Module) -> None:
    """Raise unless the layers are a ModuleList and the embedding and head hold the matrices the stages run: as
    wide as config.hidden_size, the width of the hidden states the stages hand on; and a tied embedding that
    leaves its matrix as it is (`max_norm` renormalises the rows it looks up in place, which one process's head
    would see and the last stage's copy does not)."""
    if not isinstance(model.model.layers, nn.ModuleList):
        raise TypeError(f"model.model.layers is a {type(model.model.layers).__name__}; a pipeline splits an "
                        "nn.ModuleList of decoder layers, as Hugging Face models hold them")
    hidden_size = getattr(model.config, "hidden_size", None)
    for name, module in (("model.embed_tokens", model.model.embed_tokens), ("lm_head", model.lm_head)):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"{name} ({type(module).__name__}) holds no weight matrix (.weight); a pipeline stage "
                            "runs an embedding and an LM head that hold theirs, as nn.Embedding and nn.Linear do")
        if isinstance(hidden_size, int) and weight.shape[1] != hidden_size:
            raise ValueError(f"config.hidden_size is {hidden_size} but {name}.weight is shaped {tuple(weight.shape)}, "
                             f"and the stages hand on hidden states as wide as config.hidden_size; give the config "
                             f"the weights were made with (hidden_size = {weight.shape[1]})")
    embedding = model.model.embed_tokens
    if getattr(embedding, "max_norm", None) is not None and model.lm_head.weight is embedding.weight:
        raise ValueError(f"the tied embedding has max_norm = {embedding.max_norm}: its lookups renormalise rows of the "
                         "matrix in place on the first stage, which the LM head's copy on the last stage would not "
                         "see, unlike in one process; set max_norm = None, or untie the head")


def _check_vocab_rows(model: nn.Module) -> None:
    """Token IDs are checked against config.vocab_size, so the embedding and the head must hold that many rows."""
    vocab_size = model.config.vocab_size
    rows = {"model.embed_tokens": getattr(model.model.embed_tokens, "num_embeddings", vocab_size),
            "lm_head": getattr(model.lm_head, "out_features", vocab_size)}
    name = min(rows, key=rows.get)  # the first of the two on a tie
    if rows[name] < vocab_size:
        raise ValueError(
            f"config.vocab_size is {vocab_size} but {name} has {rows[name]} rows, so token IDs "
            f"{rows[name]}..{vocab_size - 1} pass the input checks and then fail inside the model; set "
            f"config.vocab_size = {rows[name]} or resize the embeddings (model.resize_token_embeddings)"
        )


def is_hf_config(config) -> bool:
    """Whether `config` is a Hugging Face one (else our own Llama's)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return False
    return isinstance(config, PretrainedConfig)


def _model_type(config) -> str:
    """A Hugging Face config's model type ("" for our own Llama's), which decides what its family's forward does."""
    return str(getattr(config, "model_type", "")) if is_hf_config(config) else ""


def hf_float32() -> dict[str, torch.dtype]:
    """The keyword argument that makes transformers build or load a model in float32: `dtype` from
    4.56 on, `torch_dtype` before (4.55 hands an unknown `dtype` on to the model's __init__)."""
    return {"dtype" if _transformers_version() >= (4, 56) else "torch_dtype": torch.float32}


def with_rope_keys_of_transformers_4(config: dict) -> dict:
    """`config` (a model config as a dict) with the rotary settings also where transformers 4 reads them.

    Transformers 5 keeps the rotary base and scaling in `rope_parameters` only, which 4.x ignores,
    falling back to a base of 10,000: a config recorded or exported under 5 would load there as another
    function. So `rope_theta`, and `rope_scaling` unless the scaling is the default, are added at the top
    level from a `rope_parameters` that holds one set for every layer (5.x reads `rope_parameters` first).
    """
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:  # none, or one set per layer kind (Gemma 3)
        return config
    config = {**config, "rope_theta": config.get("rope_theta", rope["rope_theta"])}
    if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    return config


def hf_config(model_config: dict):
    """The Hugging Face config of a model config recorded as a dict (in a checkpoint), as this
    transformers version reads it, whichever version recorded it."""
    import transformers

    model_config = dict(model_config)
    if _transformers_version() < (5, 0):
        rope = model_config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" not in rope:
            raise ValueError("the model's config was recorded under transformers 5 with rotary settings per layer "
                             "kind, which transformers 4 cannot read: use transformers 5")
        model_config = with_rope_keys_of_transformers_4(model_config)
    return transformers.AutoConfig.for_model(model_config.pop("model_type"), **model_config)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return major, minor


@functools.cache
def rotary_takes_layer_type(rotary_type: type) -> bool:
    """Whether the rotary embedding makes tables per layer kind, `rotary_emb(x, position_ids, layer_type)`
    (Gemma 3, OLMo 3, ...), which the family's forward calls once for each kind in config.layer_types."""
    return "layer_type" in inspect.signature(rotary_type.forward).parameters


@functools.cache
def _mask_params() -> frozenset[str]:
    """`create_causal_mask`'s argument names, which differ between transformers versions."""
    from transformers.masking_utils import create_causal_mask

    return frozenset(inspect.signature(create_causal_mask).parameters)
