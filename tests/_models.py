"""Tiny decoder-only models, batches and single-process references shared by the engine tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 32, 64, 4, 2, 64
IGNORE = -100


def _hf_config(cls_name: str, num_layers: int, vocab: int, tie: bool, **extra):
    import transformers

    cfg_cls = getattr(transformers, cls_name)
    return cfg_cls(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=num_layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        tie_word_embeddings=tie, **extra,
    )


def build(kind: str = "llama", num_layers: int = 4, vocab: int = VOCAB, tie: bool = False, seed: int = 0,
          meta: bool = False, **extra):
    """A tiny model, fp32, with weights fixed by `seed` (equal on every rank that builds it).

    kind: "llama" / "qwen2" / "mistral" / "gemma" (Hugging Face) or "own" (pipeline_parallel's Llama).
    With `meta`, the model is built on the meta device (no weights yet).
    """
    import transformers

    if kind == "own":
        from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                          num_hidden_layers=num_layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          max_position_embeddings=64, tie_word_embeddings=tie, **extra)
        if meta:
            with torch.device("meta"):
                return LlamaForCausalLM(cfg)
        model = LlamaForCausalLM(cfg)
        model.init_weights(seed)
        return model
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM")}
    cfg_name, model_name = names[kind]
    if kind == "gemma":
        extra.setdefault("head_dim", HIDDEN // HEADS)
    cfg = _hf_config(cfg_name, num_layers, vocab, tie, **extra)
    model_cls = getattr(transformers, model_name)
    if meta:
        with torch.device("meta"):
            return model_cls(cfg)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    # HF's default init is N(0, 0.02): scale up a little so gradients are far from zero everywhere.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def own_reference(num_layers: int, vocab: int, tie: bool, seed: int):
    """The full own-Llama a meta-device pipeline with this `seed` materialises (init is per name)."""
    return build("own", num_layers, vocab, tie, seed)


def make_batch(batch: int, seq: int, vocab: int = VOCAB, seed: int = 0, num_microbatches: int = 1):
    """input_ids and labels; -100 spread unevenly: the first microbatch is almost all ignored."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randint(0, vocab, (batch, seq), generator=gen)
    y = torch.randint(0, vocab, (batch, seq), generator=gen)
    mb = batch // num_microbatches
    y[:mb, 1:] = IGNORE  # microbatch 0: one target per sequence
    y[-1, seq // 2:] = IGNORE  # the last microbatch loses half of one sequence
    drop = torch.rand((batch, seq), generator=gen) < 0.15  # and a sprinkle everywhere
    drop[:, 0] = False
    y[drop] = IGNORE
    return x, y


def full_loss(model, x, y):
    """The reference loss: token mean of cross-entropy over the whole batch, -100 ignored."""
    logits = model(x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def grads(model) -> dict[str, torch.Tensor]:
    """Gradient of every parameter by name (tied weights appear under both names)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def reference_step(model, x, y):
    """(loss, grads) of one process on the full batch, on a deepcopy of `model`."""
    ref = copy.deepcopy(model)
    loss = full_loss(ref, x, y)
    loss.backward()
    return loss.item(), grads(ref), ref


def stage_names(full_names, layers, first: bool, last: bool, tie: bool = False) -> set[str]:
    """The parameter names a stage owning decoder `layers` must expose (the subset of the full model)."""
    keep = set()
    for name in full_names:
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) in layers:
                keep.add(name)
        elif name.startswith("model.embed_tokens."):
            if first:
                keep.add(name)
        elif name.startswith("model.norm.") or name.startswith("lm_head."):
            if last and not (tie and first and name.startswith("lm_head.")):
                keep.add(name)
        else:
            raise AssertionError(f"unexpected parameter {name}")
    return keep


def layer_ranges(counts):
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def assert_grads_close(got: dict, expected: dict, names, atol=1e-5, what=""):
    """Every name in `names` has a gradient in `got` equal to `expected`'s."""
    missing = sorted(set(names) - set(got))
    assert not missing, f"{what}: no gradient for {missing}"
    for name in sorted(names):
        torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=0, msg=lambda m: f"{what} {name}: {m}")


def enable_checkpointing(model, reentrant: bool) -> None:
    """A Hugging Face model's activation checkpointing, by the name of the installed transformers (renamed in 5.24)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
