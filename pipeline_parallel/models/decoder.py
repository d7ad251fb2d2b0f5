"""The parts of a decoder-only causal LM one pipeline stage runs, for HF models and our own Llama."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .families import (ForwardScales, attention_kind, causal_mask, layer_rotary, norms_embeddings,
                       rotary_takes_layer_type)


@dataclass
class DecoderParts:
    """A stage's view of a model laid out as `model.{embed_tokens, layers, norm, rotary_emb}` + `lm_head`.

    Calls the model's own modules, so forward/backward hooks on them fire exactly as in an
    unpipelined run, and registers none of its own, and does between them what the family's forward
    does (`scales`, per-layer masks and rotary tables). `embed_tokens` is set on the first stage only,
    `norm` and `lm_head` on the last only; `embedding_norm`, the same norm, on the first stage of a family
    whose forward also norms the embeddings (`norms_embeddings`). `layer_rotaries` names, layer by layer, the
    rotary embedding whose tables the layer takes (`layer_rotary`): `model.rotary_emb` but in families with one
    per RoPE base, None for a layer without positions.
    """

    config: object
    layers: list[tuple[int, nn.Module]]
    layer_rotaries: list[tuple[str, nn.Module] | None]
    embed_tokens: nn.Module | None = None
    norm: nn.Module | None = None
    lm_head: nn.Module | None = None
    embedding_norm: nn.Module | None = None
    decoder: nn.Module | None = None  # `model.model` on the first stage: its mode decides embedding dropout
    scales: ForwardScales = ForwardScales()

    @classmethod
    def of(cls, model: nn.Module, layer_indices: range, first: bool, last: bool) -> DecoderParts:
        """The parts of `model` (whole, or cut to the stage by `keep_local_part`) a stage owning
        `layer_indices` runs; the model itself is left as it is."""
        layers = model.model.layers
        owned = [(i, layers[i] if isinstance(layers, nn.ModuleList) else layers[str(i)]) for i in layer_indices]
        return cls(
            config=model.config,
            layers=owned,
            layer_rotaries=[layer_rotary(model, i) for i in layer_indices],
            embed_tokens=model.model.embed_tokens if first else None,
            norm=model.model.norm if last else None,
            lm_head=model.lm_head if last else None,
            embedding_norm=model.model.norm if first and norms_embeddings(model) else None,
            decoder=model.model if first else None,
            scales=ForwardScales.of(model),
        )

    def named_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules this stage runs, under their names in the model."""
        parts = [("model.embed_tokens", self.embed_tokens), *self.rotaries(),
                 *((f"model.layers.{i}", layer) for i, layer in self.layers),
                 ("model.norm", self.norm if self.norm is not None else self.embedding_norm),
                 ("lm_head", self.lm_head)]
        return [(name, module) for name, module in parts if module is not None]

    def modules(self) -> list[nn.Module]:
        """The modules with parameters this stage owns."""
        rotaries = dict(self.rotaries())
        return [module for name, module in self.named_modules() if name not in rotaries]

    def rotaries(self) -> list[tuple[str, nn.Module]]:
        """The rotary embeddings the stage runs, by name: tables of no weights, computed in float32."""
        return list(dict(filter(None, self.layer_rotaries)).items())

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of `modules()`, each once (a tied embedding and head are one)."""
        unique = {id(p): p for module in self.modules() for p in module.parameters()}
        return list(unique.values())

    def forward(self, x: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Input IDs (first stage) or hidden states in; hidden states or logits (last stage) out.

        With `head=False` the last stage stops after the final norm, before `lm_head`.
        """
        hidden = x
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(x)
            if self.scales.embedding != 1.0:
                hidden = hidden * self.scales.embedding
            dropout = getattr(self.config, "embedding_dropout", 0.0)  # StarCoder2's, applied in its forward
            if dropout:
                hidden = nn.functional.dropout(hidden, p=dropout, training=self.decoder.training)
            if self.embedding_norm is not None:
                hidden = self.embedding_norm(hidden)
        seq_len = hidden.shape[1]
        position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        masks: dict[str, object] = {}  # for each attention kind the stage's layers use
        tables: dict[tuple, object] = {}  # for each rotary embedding they use, and kind where its tables differ by kind
        for (index, layer), rotary in zip(self.layers, self.layer_rotaries):
            kind = attention_kind(self.config, index)
            if kind not in masks:
                masks[kind] = causal_mask(self.config, hidden, position_ids, sliding=kind == "sliding_attention")
            position_embeddings = None  # for a layer without positions
            if rotary is not None:
                name, module = rotary
                per_kind = rotary_takes_layer_type(type(module))  # tables of each kind's own (Gemma 3)
                key = (name, kind if per_kind else None)
                if key not in tables:
                    tables[key] = module(hidden, position_ids, kind) if per_kind else module(hidden, position_ids)
                position_embeddings = tables[key]
            hidden = layer(
                hidden, attention_mask=masks[kind], position_ids=position_ids, position_embeddings=position_embeddings
            )
            if isinstance(hidden, tuple):  # older transformers return (hidden_states, ...)
                hidden = hidden[0]
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.scales.scale_logits(self.lm_head(hidden)) if head and self.lm_head is not None else hidden


def check_shared_parameters(model: nn.Module, stage_layers: list[range], hint: str) -> None:
    """Raise unless every parameter the model uses in several places runs on one stage, or is the
    tied embedding and LM head (the runtime adds up the gradients of its two ends).

    Each stage computes only its own part of a weight's gradient: a weight shared by layers on two
    stages would be updated differently at each end and drift apart. Two Parameters that are views
    of the same values are one weight too, which `load_state_dict(..., assign=True)` makes of a
    tied embedding and head. `hint` says how to split instead.
    """
    num_stages = len(stage_layers)
    owners: dict[tuple, dict[int, tuple[str, nn.Parameter]]] = {}  # weight -> {stage: (its first name, Parameter)}
    for stage, indices in enumerate(stage_layers):
        for prefix, module in DecoderParts.of(model, indices, stage == 0, stage == num_stages - 1).named_modules():
            for name, param in module.named_parameters(prefix, remove_duplicate=False):
                owners.setdefault(_weight_identity(param), {}).setdefault(stage, (name, param))
    embedding = model.model.embed_tokens.weight
    tied = _weight_identity(embedding) if is_tied(model) else None  # its two ends are allowed
    for key, stages in owners.items():
        if len(stages) == 1 or (key == tied and set(stages) == {0, num_stages - 1}):
            continue
        where = " and ".join(f"{name} (stage {stage})" for stage, (name, _) in stages.items())
        params = [param for _, param in stages.values()]
        if any(param is not params[0] for param in params) and any(param is embedding for param in params):
            raise ValueError(
                f"{where} are two Parameters holding the same values, as load_state_dict(..., assign=True) "
                "leaves a tied embedding and LM head: call model.tie_weights() to make them one Parameter again "
                "(the pipeline keeps its two ends equal), or clone one to untie them")
        raise ValueError(f"{where} are one parameter, shared across pipeline stages: each stage would compute "
                         f"only its own part of its gradient; {hint}, or give each layer its own copy")


def is_tied(model: nn.Module) -> bool:
    """Whether the model's input embedding and LM head are one Parameter."""
    return model.lm_head.weight is model.model.embed_tokens.weight


def _weight_identity(param: torch.Tensor) -> tuple:
    """What makes two parameters one weight: being one Parameter, or views of the same values."""
    if param.is_meta or param.data_ptr() == 0:  # no values to share
        return ("parameter", id(param))
    return ("values", str(param.device), param.data_ptr(), tuple(param.shape), param.stride())


# Config entries that say how a rank loaded or runs its model, not what the model computes.
_RUN_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
                              "use_cache", "return_dict", "output_attentions", "output_hidden_states", "_commit_hash"})


def model_settings(config) -> dict[str, object]:
    """Every setting of the model's config: each rank's must be the same (a different rope_theta on
    one rank trains a model that exists nowhere). Dtypes are agreed per parameter instead."""
    if hasattr(config, "to_dict"):  # Hugging Face's (a dataclass too in transformers 5, minus model_type)
        values = config.to_dict()
    elif dataclasses.is_dataclass(config):
        values = dataclasses.asdict(config)
    else:  # any other object: its public attributes
        values = {key: value for key, value in vars(config).items() if not key.startswith("_")} \
            if hasattr(config, "__dict__") else {}
    return {key: value for key, value in values.items() if key not in _RUN_CONFIG_KEYS}


def tied_weight_end(model: nn.Module, num_stages: int, first: bool, last: bool) -> nn.Parameter | None:
    """The embedding matrix this stage holds as one end of a tied embedding/LM head, if any.

    When input and output embeddings are one matrix and the first and last stages differ, each
    end computes part of its gradient; the runtime adds the two parts together.
    """
    if num_stages == 1 or not (first or last) or not is_tied(model):
        return None
    return end_weight(model, first)


def end_weight(model: nn.Module, first: bool) -> nn.Parameter:
    """The end of a tied embedding/LM head a first or last stage holds: the embedding's weight on the first stage,
    the head's on the last (one Parameter until the model is split)."""
    return model.model.embed_tokens.weight if first else model.lm_head.weight
