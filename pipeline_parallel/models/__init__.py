"""Model definitions owned by the package."""

from .llama import (
    PRESETS,
    CausalLMOutput,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    generate,
    num_parameters,
)

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaModel",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "generate",
    "num_parameters",
]
