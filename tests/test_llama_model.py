"""Tests for the package's Llama: HF parity, deterministic init, meta-device builds, config, sampling."""

import pytest
import torch
from torch import nn

from pipeline_parallel.models import PRESETS, LlamaConfig, LlamaForCausalLM, generate, num_parameters


def tiny(**overrides) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", **{"vocab_size": 256, "num_hidden_layers": 2, **overrides})


@pytest.mark.parametrize("tie, kv_heads", [(True, 2), (False, 4), (False, 1)])
def test_state_dict_loads_strictly_into_hf_with_same_logits(tie, kv_heads):
    transformers = pytest.importorskip("transformers")
    cfg = tiny(tie_word_embeddings=tie, num_key_value_heads=kv_heads, rope_theta=500000.0)
    model = LlamaForCausalLM(cfg)
    model.init_weights(seed=1)
    hf = transformers.LlamaForCausalLM(cfg.to_hf_config()).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    assert set(hf.state_dict()) == set(model.state_dict())
    input_ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(input_ids).logits, hf(input_ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_hf_config_round_trip():
    pytest.importorskip("transformers")
    cfg = tiny(tie_word_embeddings=True, rope_theta=123.0, rms_norm_eps=1e-6, initializer_range=0.01)
    hf_cfg = cfg.to_hf_config()
    assert hf_cfg.architectures == ["LlamaForCausalLM"] and hf_cfg._attn_implementation == "sdpa"
    assert LlamaConfig.from_hf_config(hf_cfg) == cfg


def test_from_hf_config_rejects_unsupported_features():
    transformers = pytest.importorskip("transformers")
    hf_cfg = tiny().to_hf_config()
    hf_cfg.mlp_bias = True
    with pytest.raises(ValueError, match="mlp_bias"):
        LlamaConfig.from_hf_config(hf_cfg)
    scaled = transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling"):
        LlamaConfig.from_hf_config(scaled)
    # Llama's fields, but a sliding window this model lacks: it would give other logits.
    mistral = transformers.MistralConfig(**{k: getattr(hf_cfg, k) for k in ("vocab_size", "hidden_size",
                                            "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                            "num_key_value_heads")}, sliding_window=4)
    with pytest.raises(ValueError, match="model_type 'mistral' \\(Llama's is 'llama'"):
        LlamaConfig.from_hf_config(mistral)


@pytest.mark.parametrize("tie", [True, False])
def test_init_weights_independent_of_removed_submodules(tie):
    cfg = tiny(num_hidden_layers=4, tie_word_embeddings=tie)
    full = LlamaForCausalLM(cfg)
    full.init_weights(seed=7)
    full_params = dict(full.named_parameters(remove_duplicate=False))

    last_stage = LlamaForCausalLM(cfg)  # what a last pipeline stage keeps: layers 2-3, norm, lm_head
    last_stage.model.embed_tokens = None
    last_stage.model.layers = nn.ModuleDict({str(i): last_stage.model.layers[i] for i in (2, 3)})
    last_stage.init_weights(seed=7)
    first_stage = LlamaForCausalLM(cfg)  # embedding and layer 0 only
    first_stage.lm_head = None
    first_stage.model.norm = None
    first_stage.model.layers = nn.ModuleDict({"0": first_stage.model.layers[0]})
    first_stage.init_weights(seed=7)

    for stage in (first_stage, last_stage):
        names = [name for name, _ in stage.named_parameters()]
        assert names
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p, full_params[name], atol=0, rtol=0)
    # A tied lm_head on the last stage starts equal to the embedding on the first stage.
    same = torch.equal(last_stage.lm_head.weight, first_stage.model.embed_tokens.weight)
    assert same == tie

    other_seed = LlamaForCausalLM(cfg)
    other_seed.init_weights(seed=8)
    assert not torch.equal(other_seed.model.layers[0].mlp.up_proj.weight, full.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(full.model.norm.weight, torch.ones(cfg.hidden_size))


@pytest.mark.parametrize("tie", [True, False])
def test_meta_build_to_empty_init_matches_normal_build(tie):
    cfg = tiny(tie_word_embeddings=tie)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    assert all(p.is_meta for p in meta.parameters()) and meta.model.rotary_emb.inv_freq.is_meta
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    normal = LlamaForCausalLM(cfg)
    normal.init_weights(seed=3)

    assert (meta.lm_head.weight is meta.model.embed_tokens.weight) == tie
    meta_state, normal_state = meta.state_dict(), normal.state_dict()
    assert meta_state.keys() == normal_state.keys()
    for name in normal_state:
        assert torch.equal(meta_state[name], normal_state[name]), name
    assert torch.equal(meta.model.rotary_emb.inv_freq, normal.model.rotary_emb.inv_freq)
    input_ids = torch.randint(0, cfg.vocab_size, (1, 16))
    torch.testing.assert_close(meta(input_ids).logits, normal(input_ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_on_meta_device(name):
    cfg = LlamaConfig.from_preset(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    expected = {"1b": 1_235_814_400, "8b": 8_030_261_248}  # published Llama-3.2-1B / Llama-3-8B sizes
    if name in expected:
        assert num_parameters(model) == expected[name]


def test_from_preset_overrides_and_errors():
    cfg = LlamaConfig.from_preset("1b", vocab_size=1000)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.tie_word_embeddings) == (1000, 2048, 64, True)
    with pytest.raises(ValueError, match="tiny, small, medium, 1b, 8b"):
        LlamaConfig.from_preset("huge")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig field\(s\) \['hidden_dim'\]"):
        LlamaConfig.from_preset("tiny", hidden_dim=64)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=130), "hidden_size \\(130\\) must be divisible by num_attention_heads \\(4\\)"),
    (dict(num_key_value_heads=3), "num_attention_heads \\(4\\) must be divisible by num_key_value_heads \\(3\\)"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1, got 0"),
    (dict(vocab_size=-5), "vocab_size must be an integer >= 1, got -5"),
    (dict(intermediate_size=1.5), "intermediate_size must be an integer >= 1, got 1.5"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a finite number > 0, got 0.0"),
    (dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=4), "head_dim .* must be even"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**overrides)


def test_kv_heads_default_to_attention_heads():
    assert LlamaConfig(num_attention_heads=8, num_key_value_heads=None).num_key_value_heads == 8


def test_decoder_layer_call_convention():
    model = LlamaForCausalLM(tiny())
    layer, x = model.model.layers[0], torch.randn(2, 5, model.config.hidden_size)
    position_ids = torch.arange(5).unsqueeze(0)
    cos_sin = model.model.rotary_emb(x, position_ids)
    assert cos_sin[0].shape == (1, 5, model.config.head_dim) and cos_sin[0].dtype == x.dtype
    out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin, use_cache=False)
    assert out.shape == x.shape
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(2, 5), position_embeddings=cos_sin)
    with pytest.raises(ValueError, match="position_embeddings"):
        layer(x)


def test_generate_shape_and_reproducibility():
    model = LlamaForCausalLM(tiny(max_position_embeddings=8))
    model.init_weights()
    prompt = torch.randint(0, 256, (3, 5))
    out = generate(model, prompt, max_new_tokens=6, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 11) and torch.equal(out[:, :5], prompt)
    assert int(out.max()) < 256
    again = generate(model, prompt, max_new_tokens=6, top_k=10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    greedy = generate(model, prompt, max_new_tokens=2, temperature=0)
    assert torch.equal(greedy[:, 5], model(prompt).logits[:, -1].argmax(-1))
    # A tiny temperature is all but greedy; it used to overflow to inf and stop with a traceback.
    assert torch.equal(generate(model, prompt, max_new_tokens=2, temperature=1e-39), greedy)
    # An embedding padded beyond the tokenizer: its extra rows decode to nothing and are never drawn.
    padded = generate(model, prompt, max_new_tokens=20, temperature=5.0, generator=torch.Generator().manual_seed(1),
                      vocab_size=7)
    assert int(padded[:, 5:].max()) < 7
    # A sequence that samples the end of text ends there (it went on into a new document), as in Hugging Face's
    # generate: filled with it until every sequence has ended, which ends the sampling.
    greedy = generate(model, prompt, max_new_tokens=4, temperature=0)
    eos = int(greedy[0, 6])  # the first sequence's second token
    ended = generate(model, prompt, max_new_tokens=4, temperature=0, eos_id=eos)
    assert torch.equal(ended[0, :7], greedy[0, :7]) and bool((ended[0, 7:] == eos).all())
    stops = [int((row[5:] == eos).nonzero()[0]) + 6 if (row[5:] == eos).any() else 9 for row in greedy]
    assert ended.shape == (3, max(stops))
    for row, stop, want in zip(ended, stops, greedy):
        assert torch.equal(row[:stop], want[:stop]) and bool((row[stop:] == eos).all())
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0 \(0 picks the most likely token\), got -1.0"):
        generate(model, prompt, max_new_tokens=1, temperature=-1.0)
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0 .*, got None"):  # was a TypeError
        generate(model, prompt, max_new_tokens=1, temperature=None)
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 1 \(or None to sample among all tokens\), got -3"):
        generate(model, prompt, max_new_tokens=1, top_k=-3)


def test_config_takes_numpy_floats():
    import numpy as np

    assert LlamaConfig(rms_norm_eps=np.float32(1e-5)).rms_norm_eps == np.float32(1e-5)


@pytest.mark.parametrize("feature, value, message", [
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act other than silu"),
    ("head_dim", 64, r"head_dim != hidden_size / num_attention_heads"),
])
def test_from_hf_config_rejects_each_feature_this_llama_lacks(feature, value, message):
    """A Hugging Face Llama config with biases in attention, another activation or a head size of its own
    describes another function than our Llama computes: converting it must fail, not build a model whose
    weights load into another architecture (or fail to load far from the cause)."""
    pytest.importorskip("transformers")
    hf_cfg = tiny().to_hf_config()
    setattr(hf_cfg, feature, value)
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config(hf_cfg)


def test_generate_reads_the_last_max_position_embeddings_tokens():
    """Past max_position_embeddings the context is cut to its last max_position_embeddings tokens, no fewer:
    each greedy token is the argmax of the model on exactly those."""
    model = LlamaForCausalLM(tiny(max_position_embeddings=8))
    model.init_weights(seed=2)
    ids = torch.randint(0, 256, (4, 11), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, max_new_tokens=4, temperature=0)
    want = ids
    with torch.no_grad():
        for _ in range(4):
            next_id = model(want[:, -8:]).logits[:, -1].argmax(-1, keepdim=True)
            want = torch.cat((want, next_id), dim=1)
    assert torch.equal(out, want)


@pytest.mark.parametrize("eps", [{}, {"rms_norm_eps": 0.5}], ids=["default-eps", "eps-0.5"])
def test_hf_parity_holds_with_trained_norms(eps):
    """Every norm weight starts at one, so the parity test above cannot tell the input norm of a layer from its
    post-attention norm, nor either from none: after training they differ, and an exported checkpoint must
    still compute in transformers what it computed here. With the default eps, which each norm also takes as
    its own default, a norm that left out config.rms_norm_eps computed as transformers does."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny(**eps)
    model = LlamaForCausalLM(cfg)
    model.init_weights(seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    hf = transformers.LlamaForCausalLM(cfg.to_hf_config()).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, hf(input_ids).logits, atol=1e-5, rtol=0)


def test_top_k_beyond_the_vocabulary_samples_among_every_token():
    """A top_k above the vocabulary (or above a tokenizer's vocab_size cut) failed in torch.topk."""
    model = LlamaForCausalLM(tiny())
    model.init_weights()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    for vocab_size, top_k in ((None, 1000), (7, 8)):
        wide = generate(model, prompt, 4, top_k=top_k, vocab_size=vocab_size, generator=torch.Generator().manual_seed(3))
        every = generate(model, prompt, 4, vocab_size=vocab_size, generator=torch.Generator().manual_seed(3))
        assert torch.equal(wide, every)


def test_rms_norm_of_a_bf16_input_is_transformers_bit_for_bit():
    """The bf16 path was compared with fp32 runs only (approximately): the norm rounds its input to bf16 before the
    weight multiplies it in fp32, as transformers' does."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFRMSNorm

    from pipeline_parallel.models.llama import LlamaRMSNorm

    ours, theirs = LlamaRMSNorm(64, eps=1e-5), HFRMSNorm(64, eps=1e-5)
    weight = 1 + 0.5 * torch.randn(64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    a, b = ours(x), theirs(x)
    assert a.dtype == b.dtype and torch.equal(a, b)


def test_init_weights_draws_with_the_configured_initializer_range():
    """initializer_range was only round-tripped through the config: weights drawn at 0.02 whatever it said."""
    model = LlamaForCausalLM(tiny(initializer_range=0.5))
    model.init_weights(seed=0)
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.5, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
