"""Llama decoder-only LM with Hugging Face's exact module layout and parameter names."""

import zlib
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int, check_nonnegative, check_positive


@dataclass
class LlamaConfig:
    """Model shape; field names match `transformers.LlamaConfig` so configs convert 1:1."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = 2  # None means num_attention_heads (plain multi-head attention)
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_int(f"LlamaConfig.{name}", getattr(self, name))
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            check_positive(f"LlamaConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}): make hidden_size a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_key_value_heads "
                f"({self.num_key_value_heads}): set num_key_value_heads to a divisor of num_attention_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = hidden_size / num_attention_heads = {self.head_dim} must be even "
                             "for rotary embeddings: change hidden_size or num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LlamaConfig":
        """Config of a named size from PRESETS, with some fields overridden (e.g. vocab_size)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid fields: {', '.join(sorted(valid))}")
        return cls(**{**PRESETS[name], **overrides})

    def to_hf_config(self):
        """The equivalent `transformers.LlamaConfig`, for loading our weights into Hugging Face."""
        import transformers  # imported lazily: it is slow to import and only needed here

        return transformers.LlamaConfig(**asdict(self), head_dim=self.head_dim, attn_implementation="sdpa",
                                        architectures=["LlamaForCausalLM"])

    @classmethod
    def from_hf_config(cls, hf_config) -> "LlamaConfig":
        """Our config from a `transformers.LlamaConfig`; rejects features this model does not implement."""
        # transformers 5 keeps rope_theta and the rope type in rope_parameters; 4.x has rope_theta and rope_scaling.
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        head_dim = getattr(hf_config, "head_dim", None)
        unsupported = {
            # Other families add to Llama (Mistral's sliding window, Qwen2's biases) what the fields below miss.
            f"model_type {getattr(hf_config, 'model_type', None)!r} (Llama's is 'llama'; the Pipeline runs the "
            "others in their transformers classes)": getattr(hf_config, "model_type", "llama") != "llama",
            "rope scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
            "hidden_act other than silu": getattr(hf_config, "hidden_act", "silu") != "silu",
            "attention_bias": getattr(hf_config, "attention_bias", False),
            "mlp_bias": getattr(hf_config, "mlp_bias", False),
            "head_dim != hidden_size / num_attention_heads":
                head_dim not in (None, hf_config.hidden_size // hf_config.num_attention_heads),
        }
        if any(unsupported.values()):
            raise ValueError(f"unsupported Hugging Face Llama features: {[k for k, v in unsupported.items() if v]}")
        kwargs = {f.name: getattr(hf_config, f.name) for f in fields(cls) if f.name != "rope_theta"}
        return cls(**kwargs, rope_theta=rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))

# Named sizes. vocab_size is only a default: override it to match the tokenizer.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "medium": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
    # Llama-3.2-1B shapes (without its "llama3" rope scaling).
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               rope_theta=500000.0, tie_word_embeddings=True),
    # Llama-3-8B shapes.
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
               rope_theta=500000.0),
}


class LlamaRMSNorm(nn.Module):
    """RMS normalisation computed in fp32 (like HF) so bf16 activations keep their precision."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """Default RoPE: turns position ids into the (cos, sin) tables every layer applies to q and k."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / (self.rope_theta ** exponents)

    def reset_inv_freq(self, device=None):
        """Recompute inv_freq (fp32), e.g. after a meta-device build was materialised with `to_empty`."""
        self.inv_freq = self._inv_freq(device if device is not None else self.inv_freq.device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q and k (batch, heads, seq, head_dim) by the per-position angles in cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention: several query heads share each key/value head."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.enable_gqa = config.num_key_value_heads != config.num_attention_heads
        h, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.enable_gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block, called like HF's so a pipeline stage can run either kind."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        """hidden_states (batch, seq, hidden) -> same shape. position_ids and other HF kwargs are ignored."""
        if attention_mask is not None:
            raise ValueError("LlamaDecoderLayer is always causal and supports no attention_mask: pass None")
        if position_embeddings is None:
            raise ValueError("pass position_embeddings=(cos, sin), computed once per step by "
                             "model.model.rotary_emb(hidden_states, position_ids)")
        x = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: the body HF calls `model.model`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.norm(x)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # (batch, seq, vocab)


class LlamaForCausalLM(nn.Module):
    """Llama LM whose state_dict loads with strict=True into `transformers.LlamaForCausalLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Make lm_head share the embedding Parameter if the config says so (`to_empty` unties them)."""
        embed = getattr(self.model, "embed_tokens", None)
        if self.config.tie_word_embeddings and embed is not None and self.lm_head is not None:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        """Single-process forward: token ids (batch, seq) -> logits (batch, seq, vocab)."""
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids, position_ids)))

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Initialise each parameter from (seed, its full name) alone, so any pipeline split gets the same weights.

        Works on a partial model (removed submodules, layers in a ModuleDict keyed by original index).
        A tied lm_head is drawn under the embedding's name, so it matches the first stage's embedding.
        """
        self.tie_weights()
        for name, p in self.named_parameters():
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                name = "model.embed_tokens.weight"
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # CPU generator (it keeps only 32 seed bits), fp32: values independent of device and dtype
                gen = torch.Generator().manual_seed(seed_for_name(seed, name))
                p.copy_(torch.empty(p.shape).normal_(0.0, self.config.initializer_range, generator=gen))
        rotary = getattr(getattr(self, "model", None), "rotary_emb", None)
        if rotary is not None:
            rotary.reset_inv_freq()


def seed_for_name(seed: int, name: str) -> int:
    """The random seed of one parameter or module, from the run's seed and its full name alone."""
    return zlib.crc32(f"{seed}:{name}".encode())


def num_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (a tied embedding counts once); works on meta-device models."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def generate(model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             vocab_size: int | None = None, eos_id: int | None = None) -> torch.Tensor:
    """Sample max_new_tokens after input_ids (batch, seq) by re-running the whole context each step.

    temperature=0 picks the most likely token; top_k keeps only the k most likely tokens;
    `vocab_size` (the tokenizer's) leaves out the rows of an embedding padded beyond it, which
    no text decodes to. A sequence that samples `eos_id` (end of text) ends there, as Hugging Face's
    `generate` ends it: it is filled with `eos_id` until every sequence has ended, which ends the
    sampling. Returns (batch, seq + at most max_new_tokens) token ids.
    """
    # A negative temperature would silently prefer the least likely tokens; inf samples all alike.
    temperature = check_nonnegative("temperature", temperature, allow_inf=True, hint=" (0 picks the most likely token)")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    if top_k is not None:
        top_k = check_int("top_k", top_k, hint=" (or None to sample among all tokens)")
    ended = torch.zeros(len(input_ids), 1, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        context = input_ids[:, -model.config.max_position_embeddings:]
        logits = model(context).logits[:, -1, :vocab_size].float()
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:  # from the largest logit down, so a tiny temperature does not overflow to inf
            logits = logits - logits.amax(dim=-1, keepdim=True)
            scaled = logits / temperature
            if top_k is not None:  # the top k of the logits before the temperature divides them (an infinite one makes
                # every logit 0, all of them the top k), masked after it (-inf / inf is nan)
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                scaled = scaled.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator)
        if eos_id is not None:
            next_id = next_id.masked_fill(ended, eos_id)  # a sequence that has ended stays so
            ended |= next_id == eos_id
        input_ids = torch.cat((input_ids, next_id), dim=1)
        if eos_id is not None and ended.all():
            break
    return input_ids
