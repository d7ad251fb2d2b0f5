"""Bad arguments and bad data: every rank raises the same clear error, and none is left waiting.

Each distributed case runs on its own process group with a short timeout: a rank left waiting on a peer
that gave up shows up as a gloo timeout in that case's result instead of hanging the whole run.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import sys
import types
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _models import HIDDEN, VOCAB, build, enable_checkpointing, full_loss, grads, layer_ranges, make_batch
from torch import nn

import pipeline_parallel as pp
from pipeline_parallel.models.decoder import check_shared_parameters

TIMEOUT = 120
CASE_TIMEOUT = 8  # a healthy case takes milliseconds; a rank stuck on a peer times out after this


def _gpt2():
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _without_rotary():
    model = build("llama", 2)
    model.model.rotary_emb = None
    return model


def _vocab_beyond_embedding():
    """A Hugging Face Llama whose config claims more tokens than its embedding and head hold."""
    model = build("llama", 4)
    model.config.vocab_size += 8
    return model


def _pipe(group, layers=4, **kwargs):
    kwargs.setdefault("num_microbatches", 2)
    kwargs.setdefault("device", "cpu")
    return pp.Pipeline(build("llama", layers), group=group, **kwargs)


def _data(batch=4, seq=6, seed=0):
    return make_batch(batch, seq, seed=seed, num_microbatches=2)


def _step_with(group, x=None, y=None, evaluate=False, **kwargs):
    pipe = _pipe(group, **kwargs)
    good_x, good_y = _data()
    x = good_x if x is None else x
    y = good_y if y is None else y
    return (pipe.evaluate if evaluate else pipe.step)(x, y)


def _reentrant_checkpointing_after_a_frozen_embedding(group):
    """Reentrant activation checkpointing after a frozen embedding, as transformers 4 leaves it: in one process no
    layer gets a gradient (each one's input does not require grad); the second stage, whose input does, would train
    its layers."""
    model = build("llama", 4)
    model.model.embed_tokens.weight.requires_grad_(False)
    enable_checkpointing(model, reentrant=True)
    if hasattr(model, "_require_grads_hook"):  # transformers 5 makes the embedding's output require grad, 4 does not
        model.disable_input_require_grads()
    return pp.Pipeline(model, num_microbatches=2, device="cpu", group=group).step(*_data())


def _eval_mode_on_rank_0(rank, group):
    """A model put in eval mode on one rank (to look at it, say) and stepped in train mode on another: the step, with
    dropout on some stages only, would be no one process's."""
    pipe = _pipe(group)
    pipe.model.train(rank != 0)
    return pipe.step(*_data())


def _frozen_at_first_end(group):
    """A tied model whose user froze the embedding by its name, which only the first rank holds."""
    pipe = pp.Pipeline(build("llama", 4, tie=True), device="cpu", group=group, num_microbatches=2)
    for name, param in pipe.named_parameters():
        param.requires_grad_(name != "model.embed_tokens.weight")
    return pipe


def _hooked(where: str, after: bool, group):
    """A Pipeline of a model with a forward hook on `where` ("model" or "model.model"), registered before the
    Pipeline is built or (`after`) before its step; the hook doubles what it sees, which no stage would do."""
    model = build("llama", 4)
    double = (lambda module, args, out: out * 2) if where == "model.model" else (
        lambda module, args, out: type(out)(logits=out.logits * 2))
    wrapper = model if where == "model" else model.model
    if not after:
        wrapper.register_forward_hook(double)
    pipe = pp.Pipeline(model, device="cpu", group=group, num_microbatches=2)
    if after:
        wrapper.register_forward_hook(double)
    return pipe.step(X, Y)


def _two_pipelines_called_apart(rank, group):
    """Two Pipelines the ranks built together, stepped in another order on each rank: rank 0 steps the first, rank 1
    the second. Each rank's stage ran with the other model's activations, silently."""
    first, second = (pp.Pipeline(build("llama", 4, seed=seed), device="cpu", group=group, num_microbatches=2)
                     for seed in (0, 1))
    return (first if rank == 0 else second).step(X, Y)


def _two_pipelines_clipped_apart(rank, group):
    """As above, in clip_grad_norm_: each rank clipped with a norm of both models' gradients."""
    first, second = (pp.Pipeline(build("llama", 4, seed=seed), device="cpu", group=group, num_microbatches=2)
                     for seed in (0, 1))
    first.step(X, Y), second.step(X, Y)
    return (first if rank == 0 else second).clip_grad_norm_(1.0)


def _forward_set_on_the_model(group):
    """A forward replaced on the instance, as accelerate's hooks do: no stage calls it."""
    model = build("llama", 4)
    model.forward = lambda *args, **kwargs: type(model).forward(model, *args, **kwargs)
    return pp.Pipeline(model, device="cpu", group=group, num_microbatches=2)


def _tied_end_changed_on_one_rank(rank, world_size, group):
    """A tied model whose head end on the last rank was changed after the Pipeline was built: the ends are one matrix
    in one process, and the step would train two."""
    pipe = pp.Pipeline(build("llama", 4, tie=True), device="cpu", group=group, num_microbatches=2)
    pipe.step(X, Y)
    if rank == world_size - 1:
        with torch.no_grad():
            pipe.model.lm_head.weight.mul_(0.999)
    return pipe.evaluate(X, Y)


def _model_with(change):
    model = build("llama", 4)
    change(model)
    return model


class _EmbeddingWrapper(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.inner = embedding

    def forward(self, ids):
        return self.inner(ids)


def _out_of_memory_in(step: str, rank, group, *failing_ranks):
    """A stage that cannot be made on some ranks, its memory run out in `step` (a name in pipeline.py): the others
    waited out the group's timeout."""
    import pipeline_parallel.pipeline as pipeline_module

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate 9999 bytes on rank "
                           f"{rank}")

    real = getattr(pipeline_module, step)
    if rank in failing_ranks:
        setattr(pipeline_module, step, out_of_memory)
    try:
        return pp.Pipeline(build("llama", 4, meta=True), device="cpu", group=group, num_microbatches=2)
    finally:
        setattr(pipeline_module, step, real)


def _all_frozen(group):
    pipe = _pipe(group)
    for param in pipe.parameters():
        param.requires_grad_(False)
    return pipe


def _partly_on_meta():
    model = build("llama", 4)
    model.model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.empty(1, device="meta"))
    return model


def _unmade_buffer_in_the_last_layer():
    """On meta, with a buffer `_init_weights` does not make in the last layer: only the last rank finds it."""
    with torch.device("meta"):
        model = build("llama", 4, meta=True)
        model.model.layers[3].mlp.register_buffer("scale", torch.ones(4), persistent=False)
    return model


def _replaced_head(group, replace: bool):
    pipe = _pipe(group)
    if replace:
        pipe.model.lm_head = nn.Linear(pipe.config.hidden_size, pipe.config.vocab_size, bias=False)
    return pipe


def _removed_after(group, remove: bool, path: str):
    """A Pipeline whose model had the module at `path` (e.g. "model.rotary_emb") set to None since."""
    pipe = _pipe(group)
    if remove:
        owner, _, name = path.rpartition(".")
        setattr(pipe.model.get_submodule(owner), name, None)
    return pipe


def _plain_config_model(vocab: int):
    """Our Llama whose config is a plain object (not a Hugging Face config, not a dataclass)."""
    model = build("own", 4, vocab=vocab)
    model.config = types.SimpleNamespace(**vars(model.config))
    return model


def _converted_after(group):
    pipe = _pipe(group)
    pipe.model.to(torch.bfloat16)
    return pipe


def shared_mlp(first: int, second: int):
    """A Llama whose layers `first` and `second` share one MLP up-projection (one Parameter)."""
    model = build("llama", 4)
    model.model.layers[second].mlp.up_proj = model.model.layers[first].mlp.up_proj
    return model


def _tied_loaded_with_assign():
    """A tied Llama built on meta and loaded as the README says: load_state_dict(assign=True) leaves its
    embedding and LM head two Parameters on one storage (trained apart on two ranks, they drifted)."""
    model = build("llama", 4, tie=True, meta=True)
    model.load_state_dict(build("llama", 4, tie=True).state_dict(), assign=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def _untied_on_last_rank(rank, world_size):
    """A tied Llama, except that on the last rank the LM head got a Parameter of its own."""
    model = build("llama", 4, tie=True)
    if rank == world_size - 1:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _in_inference_mode(fn):
    with torch.inference_mode():
        return fn()


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


X, Y = _data()
OK_OR_VALUE_ERROR = "ok, or ValueError on every rank"

# name -> (what every rank runs: fn(rank, world_size, group), expected exception type(s), message regex)
PIPELINE_CASES = {
    # construction
    "tied-on-some-ranks": (lambda r, w, g: pp.Pipeline(_untied_on_last_rank(r, w), group=g, device="cpu"),
                           ValueError, r"the pipeline ranks disagree on 'tied_embedding': model.lm_head.weight is "
                           r"model.model.embed_tokens.weight on some ranks only; tie them on every rank"),
    # with a hint for one difference, the others still say what to change
    "tied-on-some-ranks-and-microbatches-differ": (
        lambda r, w, g: pp.Pipeline(_untied_on_last_rank(r, w), group=g, device="cpu", num_microbatches=2 + r),
        ValueError, r"disagree on 'num_microbatches' \(num_microbatches: 2 on rank 0, 3 on rank 1\), 'tied_embedding': "
        r"model.lm_head.weight .* or on none; every rank must construct the pipeline and call the step with the same "
        r"num_microbatches$"),
    "tied-loaded-with-assign": (lambda r, w, g: pp.Pipeline(_tied_loaded_with_assign(), group=g, device="cpu"),
                                ValueError, r"model.embed_tokens.weight \(stage 0\) and lm_head.weight \(stage 1\) "
                                r"are two Parameters holding the same values.*call model.tie_weights\(\)"),
    "evaluate-every-label-ignored": (lambda r, w, g: _step_with(g, y=torch.full_like(Y, -100), evaluate=True),
                                     ValueError, r"every label of the batch is -100 \(ignored\): there is nothing "
                                     r"to evaluate"),
    "unknown-schedule": (lambda r, w, g: _pipe(g, schedule="zigzag"), ValueError,
                         r"unknown schedule 'zigzag'.*choose one of \['1f1b', 'afab', 'gpipe'\]"),
    "bad-split": (lambda r, w, g: _pipe(g, split="all"), ValueError,
                  r"split must be an integer >= 0 \(how many of each rank's last backwards .*got 'all'"),
    "seq-len-zero": (lambda r, w, g: _pipe(g, seq_len=0), ValueError,
                     r"seq_len must be an integer >= 1 \(the sequence length to balance the stages for\), got 0"),
    "seed-none": (lambda r, w, g: _pipe(g, seed=None), ValueError,
                  r"seed must be an integer from 0 to 2\*\*63 - 1 \(weights a model on meta gets are drawn from it\), got None"),
    "schedule-none": (lambda r, w, g: _pipe(g, schedule=None), ValueError,
                      r"unknown schedule None; choose one of \['1f1b', 'afab', 'gpipe'\]"),
    "autocast-dtype-string": (lambda r, w, g: _pipe(g, autocast_dtype="bf16"), TypeError,
                              r"autocast_dtype must be torch.bfloat16 or None \(no autocast\), "
                              r"got 'bf16'"),
    "recompute-string": (lambda r, w, g: _pipe(g, recompute="yes"), ValueError,
                         r"recompute must be True or False, got 'yes'"),
    "recompute-on-rank-1-only": (lambda r, w, g: _pipe(g, recompute=r == 1), ValueError,
                                 r"the pipeline ranks disagree on 'recompute' \(recompute: False on rank 0, True on rank "
                                 r"1\): every rank must construct the pipeline .* with the same recompute"),
    "autocast-float16": (lambda r, w, g: _pipe(g, autocast_dtype=torch.float16), ValueError,
                         r"autocast_dtype=torch.float16 needs its loss scaled up, or its gradients, below float16's "
                         r"smallest number, come out zero, and a Pipeline does not scale its loss: use "
                         r"torch.bfloat16"),
    "autocast-dtype-on-rank-1-only": (lambda r, w, g: _pipe(g, autocast_dtype=torch.float64 if r == 1 else None),
                                      TypeError, r"pipeline rank 1: autocast_dtype must be .* got torch.float64"),
    "partly-on-meta": (lambda r, w, g: pp.Pipeline(_partly_on_meta(), device="cpu", group=g, num_microbatches=2),
                       ValueError, r"1 of the model's \d+ parameters are on the meta device \(e.g. "
                       r"model.layers.1.mlp.up_proj.weight\) but the rest hold values"),
    # found while the last rank made its part, after the others had agreed and gone on to wait for it
    "unmade-buffer-on-the-last-rank": (lambda r, w, g: pp.Pipeline(_unmade_buffer_in_the_last_layer(), device="cpu",
                                                                   group=g, num_microbatches=2), ValueError,
                                       r"pipeline rank 1: buffer model.layers.3.mlp.scale was on the meta device"),
    "meta-on-rank-0-only": (lambda r, w, g: pp.Pipeline(build("llama", 4, meta=r == 0), device="cpu", group=g,
                                                        num_microbatches=2), ValueError,
                            r"ranks disagree on 'weights_on_meta'"),
    "microbatches-zero": (lambda r, w, g: _pipe(g, num_microbatches=0), ValueError,
                          r"num_microbatches must be an integer >= 1, got 0"),
    "microbatches-negative": (lambda r, w, g: _pipe(g, num_microbatches=-1), ValueError,
                              r"num_microbatches must be an integer >= 1, got -1"),
    # a value equal to one planned before (2.0 == 2, True == 1) took that plan from the cache unchecked
    "microbatches-float-after-a-plan": (lambda r, w, g: (_pipe(g), _pipe(g, num_microbatches=2.0)), ValueError,
                                        r"num_microbatches must be an integer >= 1, got 2.0"),
    "split-bool-after-a-plan": (lambda r, w, g: (_pipe(g, split=1), _pipe(g, split=True)), ValueError,
                                r"split must be an integer >= 0 .*got True"),
    "layout-linear": (lambda r, w, g: pp.Pipeline(nn.Linear(4, 4), device="cpu", group=g), (TypeError, ValueError),
                      r"Linear is not a supported decoder-only causal LM.*LlamaForCausalLM"),
    "layout-gpt2": (lambda r, w, g: pp.Pipeline(_gpt2(), device="cpu", group=g), (TypeError, ValueError),
                    r"GPT2LMHeadModel is not a supported decoder-only causal LM: missing .*model\.embed_tokens"),
    # Granite-MoE before transformers 5 without rope positions ("nope") holds rotary_emb = None
    "layout-rotary-none": (lambda r, w, g: pp.Pipeline(_without_rotary(), device="cpu", group=g), TypeError,
                           r"LlamaForCausalLM is not a supported decoder-only causal LM: missing \['model.rotary_emb'\]"),
    "vocab-beyond-embedding": (lambda r, w, g: pp.Pipeline(_vocab_beyond_embedding(), device="cpu", group=g),
                               ValueError, r"config.vocab_size is \d+ but model.embed_tokens has \d+ rows, so token "
                               r"IDs .* set config.vocab_size = \d+ or resize the embeddings"),
    "layer-counts-sum": (lambda r, w, g: _pipe(g, layer_counts=[3, 3]), ValueError,
                         r"layer_counts \[3, 3\] sum to 6 but the model has 4 decoder layers"),
    "layer-counts-length": (lambda r, w, g: _pipe(g, layer_counts=[4]), ValueError,
                            r"layer_counts \[4\] gives 1 layer count but the pipeline has 2 stages; give one layer count per stage"),
    "mismatch-microbatches": (lambda r, w, g: _pipe(g, num_microbatches=2 if r == 0 else 4), ValueError,
                              r"ranks disagree on 'num_microbatches'.*same num_microbatches"),
    "mismatch-schedule": (lambda r, w, g: _pipe(g, schedule="1f1b" if r == 0 else "gpipe"), ValueError,
                          r"ranks disagree on 'schedule' \(schedule: '1f1b' on rank 0, 'gpipe' on rank 1\)"),
    "mismatch-layer-counts": (lambda r, w, g: _pipe(g, layer_counts=[2, 2] if r == 0 else [3, 1]), ValueError,
                              r"ranks disagree on 'layer_counts'"),
    "mismatch-seq-len": (lambda r, w, g: _pipe(g, seq_len=8 if r == 0 else 2048), ValueError,
                         r"ranks disagree on 'seq_len' \(seq_len: 8 on rank 0, 2048 on rank 1\)"),
    "mismatch-model": (lambda r, w, g: pp.Pipeline(build("llama", 4, vocab=64 if r == 0 else 128), device="cpu",
                                                   group=g, num_microbatches=2), ValueError,
                       r"ranks disagree on 'model_config' \(vocab_size: 64 on rank 0, 128 on rank 1\): every rank "
                       r"must construct the pipeline and call the step with the same model_config"),
    "mismatch-rope-theta": (lambda r, w, g: pp.Pipeline(build("llama", 4, rope_theta=1e4 if r == 0 else 1e6),
                                                        device="cpu", group=g, num_microbatches=2), ValueError,
                            r"ranks disagree on 'model_config' \(rope_(theta|parameters): .*10000.0.* on rank 0, "
                            r".*1000000.0.* on rank 1\)"),
    "mismatch-model-type": (lambda r, w, g: pp.Pipeline(build("llama" if r == 0 else "qwen2", 4), device="cpu",
                                                        group=g, num_microbatches=2), ValueError,
                            r"ranks disagree on 'model_config' \(.*model_type: 'llama' on rank 0, 'qwen2' on "
                            r"rank 1.*\), 'parameter_dtypes' \(.*q_proj.bias: None on rank 0, 'torch.float32' on rank 1.*\): every rank must construct the pipeline and call the "
                            r"step with the same model_config and parameter_dtypes"),
    "module-replaced-after-construction": (lambda r, w, g: _replaced_head(g, r == w - 1).step(X, Y), ValueError,
                                           r"pipeline rank \d: lm_head of the model was replaced after the Pipeline "
                                           r"was built, and the stage would go on running the old one"),
    # a part set to None went unnoticed at the end of the stage's list, and shifted the names of the rest
    "head-removed-after-construction": (lambda r, w, g: _removed_after(g, r == w - 1, "lm_head").step(X, Y), ValueError,
                                        r"pipeline rank \d: lm_head of the model was replaced after the Pipeline"),
    "rotary-removed-after-construction": (lambda r, w, g: _removed_after(g, r == w - 1, "model.rotary_emb").step(X, Y),
                                          ValueError, r"pipeline rank \d: model.rotary_emb of the model was replaced "
                                          r"after the Pipeline"),
    # a TypeError (layers[...] of None) escaped before the agreement and left rank 0 there until its timeout
    "layers-removed-after-construction": (lambda r, w, g: _removed_after(g, r == w - 1, "model.layers").step(X, Y),
                                          ValueError, r"pipeline rank \d: the model lost a part its stage runs after "
                                          r"the Pipeline was built \(.*\); change the whole model before building"),
    "dtype-changed-after-construction": (lambda r, w, g: _converted_after(g).step(X, Y), ValueError,
                                         r"pipeline rank 0: the model's parameter dtypes changed after the Pipeline "
                                         r"was built \(model.embed_tokens.weight: torch.float32 -> torch.bfloat16\)"),
    "mismatch-config-of-another-kind": (lambda r, w, g: pp.Pipeline(_plain_config_model(vocab=64 + 64 * min(r, 1)),
                                                                    device="cpu", group=g, num_microbatches=2),
                                        ValueError, r"ranks disagree on 'model_config' \(vocab_size: 64 on "
                                        r"rank 0, 128 on rank 1"),
    "mismatch-parameter-dtypes": (lambda r, w, g: pp.Pipeline(build("llama", 4).to(torch.bfloat16 if r == 0 else
                                                                               torch.float32), device="cpu",
                                                               group=g, num_microbatches=2), ValueError,
                                  r"ranks disagree on 'parameter_dtypes'"),
    "mismatch-seed": (lambda r, w, g: _pipe(g, seed=r), ValueError, r"ranks disagree on 'seed'"),
    # torch's own error, at the ranks' first agreement, said only "No backend type associated with device type cpu"
    "group-without-a-backend-for-the-device": (lambda r, w, g: _pipe(dist.new_group(backend="cuda:gloo")), ValueError,
                                               r"the process group has no backend for cpu tensors \(only gloo for "
                                               r"cuda\), so the stages on cpu cannot send them: initialise it with "
                                               r"'gloo' \(or 'cpu:gloo,cuda:nccl'\), or pass a device it carries"),
    "device-unusable-on-the-last-rank": (lambda r, w, g: _pipe(g, device="cuda:99" if r == w - 1 else "cpu"),
                                         ValueError, r"device 'cuda:99' cannot be used on this machine"),
    # meta tensors hold no values: the model was moved there (its weights lost), then the step failed in torch
    "device-meta": (lambda r, w, g: _pipe(g, device="meta").step(X, Y), ValueError,
                    r"device 'meta' cannot be used: .*holds no values.*pass a device such as 'cpu'"),
    "step-on-rank-0-evaluate-on-rank-1": (lambda r, w, g: (lambda p: (p.evaluate if r else p.step)(X, Y))(_pipe(g)),
                                          ValueError, r"the pipeline ranks are in different calls: step\(\) on rank 0, "
                                          r"evaluate\(\) on rank 1.*; every rank must make the same calls in the "
                                          r"same order"),
    # gloo aborted the process where the ranks' agreements differed in length
    "clip-on-rank-0-step-on-rank-1": (lambda r, w, g: (lambda p: p.clip_grad_norm_(1.0) if r == 0 else p.step(X, Y))(
                                          _pipe(g)), ValueError, r"the pipeline ranks are in different calls: "
                                      r"clip_grad_norm_\(\) on rank 0, step\(\) on rank 1"),
    "pipeline-on-rank-0-step-on-rank-1": (lambda r, w, g: (lambda p: _pipe(g) if r == 0 else p.step(X, Y))(_pipe(g)),
                                          ValueError, r"different calls: Pipeline\(\) on rank 0, step\(\) on rank 1"),
    "tied-weight-frozen-at-one-end": (lambda r, w, g: _frozen_at_first_end(g).step(X, Y), ValueError,
                                      r"the tied embedding is frozen at one end only: set requires_grad alike on "
                                      r"model.embed_tokens.weight \(first rank\) and lm_head.weight"),
    # Trained nothing and returned the loss, where one process's backward fails: "does not require grad".
    "every-parameter-frozen": (lambda r, w, g: _all_frozen(g).step(X, Y), RuntimeError,
                               r"no parameter of the model requires grad, so a training step has nothing to compute"),
    "weight-shared-across-stages": (lambda r, w, g: pp.Pipeline(shared_mlp(1, 2), device="cpu", group=g,
                                                                num_microbatches=2), ValueError,
                                    r"model.layers.1.mlp.up_proj.weight \(stage 0\) and model.layers.2.mlp.up_proj."
                                    r"weight \(stage 1\) are one parameter, shared across pipeline stages: each "
                                    r"stage would compute only its own part of its gradient; pass layer_counts"),
    "step-in-inference-mode": (lambda r, w, g: (lambda p: _in_inference_mode(lambda: p.step(X, Y)))(_pipe(g)),
                               ValueError, r"a training step cannot run inside torch.inference_mode\(\)"),
    "invalid-on-rank-1-only": (lambda r, w, g: _pipe(g, num_microbatches=2 if r == 0 else 0), ValueError,
                               r"pipeline rank 1: num_microbatches must be an integer >= 1"),
    "unknown-schedule-on-rank-1-only": (lambda r, w, g: _pipe(g, schedule="1f1b" if r == 0 else "zigzag"),
                                        ValueError, r"pipeline rank 1: unknown schedule 'zigzag'"),
    # step data
    "inputs-not-tensor": (lambda r, w, g: _step_with(g, x=X.tolist()), ValueError,
                          r"input_ids must be a torch.Tensor of token IDs shaped \[batch, seq_len\], got list"),
    "inputs-on-meta": (lambda r, w, g: _step_with(g, x=X.to("meta")), ValueError,
                       r"input_ids must be a dense tensor holding its values, got one on the meta device"),
    "labels-sparse": (lambda r, w, g: _step_with(g, y=Y.to_sparse()), ValueError,
                      r"labels must be a dense tensor holding its values, got one torch.sparse_coo"),
    "inputs-float": (lambda r, w, g: _step_with(g, x=X.float()), ValueError,
                     r"input_ids must hold integer token IDs \(torch.long\), got dtype torch.float32"),
    "inputs-1d": (lambda r, w, g: _step_with(g, x=X[0]), ValueError,
                  r"input_ids must be shaped \[batch, seq_len\].*got shape \(6,\)"),
    "inputs-too-big": (lambda r, w, g: _step_with(g, x=_set(X, (1, 2), VOCAB)), ValueError,
                       r"input_ids holds token IDs from \d+ to 64, but the model's vocabulary allows 0..63; "
                       r"check the tokenizer"),
    "inputs-negative": (lambda r, w, g: _step_with(g, x=_set(X, (3, 0), -1)), ValueError,
                        r"input_ids holds token IDs from -1 .*allows 0..63"),
    "inputs-ignore-index": (lambda r, w, g: _step_with(g, x=_set(X, (0, 0), -100)), ValueError,
                            r"input_ids holds token IDs from -100 .*allows 0..63;"),
    "labels-shape": (lambda r, w, g: _step_with(g, y=Y[:, :-1]), ValueError,
                     r"labels are shaped \[4, 5\] but input_ids \[4, 6\]; give one \(already shifted\) target"),
    "labels-too-big": (lambda r, w, g: _step_with(g, y=_set(Y, (2, 1), 70)), ValueError,
                       r"labels holds token IDs from .* to 70.*allows 0..63 or -100 \(ignored\)"),
    "labels-negative": (lambda r, w, g: _step_with(g, y=_set(Y, (2, 1), -5)), ValueError,
                        r"labels holds token IDs from -5 .*allows 0..63 or -100"),
    "labels-float": (lambda r, w, g: _step_with(g, y=Y.float()), ValueError,
                     r"labels must hold integer token IDs"),
    "labels-uint8": (lambda r, w, g: _step_with(g, y=Y.to(torch.uint8)), ValueError,  # -100 wrapped to a target, 156
                     r"labels must hold signed integers, as -100 marks a token to ignore, got dtype torch.uint8; "
                     r"pass labels.long\(\)"),
    "labels-missing-on-last": (lambda r, w, g: _pipe(g).step(X, Y if r == 0 and w > 1 else None), ValueError,
                               r"the first pipeline rank must pass input_ids and the last must pass labels"),
    "all-labels-ignored": (lambda r, w, g: _step_with(g, y=torch.full_like(Y, -100)), ValueError,
                           r"every label of the batch is -100"),
    "batch-not-divisible": (lambda r, w, g: _step_with(g, *_data(batch=5)), ValueError,
                            r"a batch of 5 sequences does not split into 2 equal microbatches; use a batch size "
                            r"that is a multiple of num_microbatches"),
    "batch-not-divisible-3": (lambda r, w, g: _step_with(g, *_data(batch=4), num_microbatches=3), ValueError,
                              r"a batch of 4 sequences does not split into 3"),
    "evaluate-bad-ids": (lambda r, w, g: _step_with(g, x=_set(X, (0, 0), 1000), evaluate=True), ValueError,
                         r"input_ids holds token IDs .* to 1000"),
    "clip-norm-type-zero": (lambda r, w, g: _pipe(g).clip_grad_norm_(1.0, norm_type=0), ValueError,
                            r"norm_type must be a number > 0 .*got 0"),
    "clip-max-norm-negative": (lambda r, w, g: _pipe(g).clip_grad_norm_(-1.0), ValueError,
                               r"max_norm must be a number > 0 .*got -1.0"),
    # clip_grad_norm_'s arguments on one rank only: the others waited in its all_reduce (or clipped apart)
    "clip-max-norm-nan-on-rank-1-only": (lambda r, w, g: _pipe(g).clip_grad_norm_(1.0 if r == 0 else math.nan),
                                         ValueError, r"pipeline rank 1: max_norm must be a number > 0 .*got nan"),
    "clip-norm-type-differs": (lambda r, w, g: _pipe(g).clip_grad_norm_(1.0, norm_type=2.0 if r == 0 else math.inf),
                               ValueError, r"ranks disagree on 'norm_type' \(norm_type: 2.0 on rank 0, inf on rank 1\): "
                               r"every rank must call clip_grad_norm_ with the same norm_type"),
    # only one rank holds bad data: the others (which never look at it) must still raise
    "bad-ids-on-first-rank-only": (lambda r, w, g: _step_with(g, x=_set(X, (0, 0), 999) if r == 0 else X),
                                   ValueError, r"pipeline rank 0: input_ids holds token IDs .* to 999"),
    "bad-labels-on-last-rank-only": (lambda r, w, g: _step_with(g, y=_set(Y, (0, 0), 99) if r == w - 1 else Y),
                                     ValueError, r"pipeline rank \d: labels holds token IDs .* to 99"),
    "first-rank-shape-differs": (lambda r, w, g: _step_with(g, *(_data(seq=7) if r == 0 else _data())),
                                 ValueError, r"labels are shaped \[4, 6\] but input_ids \[4, 7\]"),
    # what a stage would compute otherwise than one process, silently
    "hook-on-the-model": (lambda r, w, g: _hooked("model", False, g), ValueError,
                          r"the model has a forward hook, which a pipeline never fires: a stage runs the model's parts "
                          r"\(the embedding, layers, norm and head\), never the forward of the model or model.model; "
                          r"register the hook on those parts, or remove it"),
    "hook-on-model.model-after-the-pipeline": (lambda r, w, g: _hooked("model.model", True, g), ValueError,
                                               r"model.model has a forward hook, which a pipeline never fires"),
    "two-pipelines-called-apart": (lambda r, w, g: _two_pipelines_called_apart(r, g), ValueError,
                                   r"the pipeline ranks disagree on 'pipeline': the ranks called different Pipelines; "
                                   r"every rank must call the Pipeline it built with the others"),
    "two-pipelines-clipped-apart": (lambda r, w, g: _two_pipelines_clipped_apart(r, g), ValueError,
                                    r"the pipeline ranks disagree on 'pipeline': the ranks called different Pipelines"),
    "eval-mode-on-one-rank": (lambda r, w, g: _eval_mode_on_rank_0(r, g), ValueError,
                              r"ranks disagree on 'mode' \(model.training: False on rank 0, True on rank 1\): the "
                              r"model is in train mode on some ranks and in eval mode on others, so dropout would act "
                              r"on some stages only: call model.train\(\) or model.eval\(\) on every rank alike"),
    "reentrant-checkpointing-after-a-frozen-embedding": (
        lambda r, w, g: _reentrant_checkpointing_after_a_frozen_embedding(g), (ValueError, RuntimeError),
        r"the output of stage 0 does not require grad although its layers hold parameters that do: its forward cut "
        r"the autograd graph, as activation checkpointing with use_reentrant=True does .*call "
        r"model.enable_input_require_grads\(\)"),
    "forward-set-on-the-model": (lambda r, w, g: _forward_set_on_the_model(g), ValueError,
                                 r"the model has a forward of its own, set on it \(as accelerate's hooks do\), which a "
                                 r"pipeline never calls"),
    "tied-end-changed-on-one-rank": (lambda r, w, g: _tied_end_changed_on_one_rank(r, w, g), ValueError,
                                     r"the tied embedding's two ends \(model.embed_tokens.weight on the first stage, "
                                     r"lm_head.weight on the last\), one matrix in one process, differ by 0.001 of its "
                                     r"norm, more than rounding: .*parameter groups chosen by name must put "
                                     r"lm_head.weight, the last rank's end, with model.embed_tokens.weight.*change both "
                                     r"ends alike"),
    "embedding-scale-grad-by-freq": (lambda r, w, g: pp.Pipeline(_model_with(
                                         lambda m: setattr(m.model.embed_tokens, "scale_grad_by_freq", True)),
                                         device="cpu", group=g), ValueError,
                                     r"the embedding has scale_grad_by_freq = True, which scales its gradient by each "
                                     r"token's count in the batch, and a pipeline stage sees one microbatch at a time"),
    "tied-embedding-max-norm": (lambda r, w, g: pp.Pipeline(
                                    (lambda m: (setattr(m.model.embed_tokens, "max_norm", 1.0), m)[1])(
                                        build("llama", 4, tie=True)), device="cpu", group=g), ValueError,
                                r"the tied embedding has max_norm = 1.0: its lookups renormalise rows of the matrix in "
                                r"place on the first stage, which the LM head's copy on the last stage would not see"),
    "hidden-size-not-the-weights'": (lambda r, w, g: pp.Pipeline(_model_with(
                                         lambda m: setattr(m.config, "hidden_size", 48)), device="cpu", group=g),
                                     ValueError, r"config.hidden_size is 48 but model.embed_tokens.weight is shaped "
                                     r"\(64, 32\), and the stages hand on hidden states as wide as config.hidden_size; "
                                     r"give the config the weights were made with \(hidden_size = 32\)"),
    "layers-in-a-sequential": (lambda r, w, g: pp.Pipeline(_model_with(
                                   lambda m: setattr(m.model, "layers", nn.Sequential(*m.model.layers))),
                                   device="cpu", group=g), TypeError,
                               r"model.model.layers is a Sequential; a pipeline splits an nn.ModuleList"),
    "embedding-in-a-wrapper": (lambda r, w, g: pp.Pipeline(_model_with(
                                   lambda m: setattr(m.model, "embed_tokens", _EmbeddingWrapper(m.model.embed_tokens))),
                                   device="cpu", group=g), TypeError,
                               r"model.embed_tokens \(_EmbeddingWrapper\) holds no weight matrix"),
    "layer-counts-an-int": (lambda r, w, g: _pipe(g, layer_counts=4), ValueError,
                            r"layer_counts must be a list of decoder layers per stage, such as \[3, 3, 2\], got 4"),
    # any error building a stage on one rank, not only a check's: the others waited out the group's timeout
    "out-of-memory-making-rank-0's-stage": (lambda r, w, g: _out_of_memory_in("materialize", r, g, 0), RuntimeError,
                                            r"^(pipeline rank 0: RuntimeError: )?DefaultCPUAllocator: can't allocate"),
    "out-of-memory-in-rank-1's-stage": (lambda r, w, g: _out_of_memory_in("PipelineStage", r, g, 1), RuntimeError,
                                        r"^(pipeline rank 1: RuntimeError: )?DefaultCPUAllocator: can't allocate"),
    # dtypes the checks accept but the model does not take: either every rank trains, or every rank raises
    "labels-int32": (lambda r, w, g: _step_with(g, y=Y.int()), OK_OR_VALUE_ERROR, r"labels.*dtype"),
    "inputs-int16": (lambda r, w, g: _step_with(g, x=X.short()), OK_OR_VALUE_ERROR, r"input_ids.*dtype"),
}

PIPELINE_BUGS = {}

WORLD4_CASES = {
    "more-stages-than-layers": (lambda r, w, g: _pipe(g, layers=2), ValueError,
                                r"cannot split 2 decoder layers into 4 pipeline stages.*use at most 2 ranks"),
    "bad-ids-on-first-rank-only": PIPELINE_CASES["bad-ids-on-first-rank-only"],
    "bad-labels-on-last-rank-only": PIPELINE_CASES["bad-labels-on-last-rank-only"],
    "mismatch-microbatches": (lambda r, w, g: _pipe(g, num_microbatches=4 if r != 2 else 8), ValueError,
                              r"ranks disagree on 'num_microbatches'"),
    "invalid-on-rank-2-only": (lambda r, w, g: _pipe(g, num_microbatches=2 if r != 2 else -1), ValueError,
                               r"pipeline rank 2: num_microbatches must be an integer >= 1"),
}


# the classic API -------------------------------------------------------------------------------------------------

def _classic(inputs=None, targets=None, layers=4, api=pp.train_step_pipeline_1f1b, model=None, device="cpu",
             dtype=torch.float32):
    x, y = _data()
    inputs = list(x.chunk(2)) if inputs is None else inputs
    targets = list(y.chunk(2)) if targets is None else targets
    return api(model if model is not None else build("llama", layers), inputs, targets, device, dtype)


def _classic_keeps_weights(**kwargs):
    """`_classic`, and an AssertionError if the call raised after moving the model's weights off their values."""
    model = build("llama", 4)
    try:
        return _classic(model=model, **kwargs)
    finally:
        assert not any(p.is_meta for p in model.parameters()), "the model's weights were lost to the meta device"


def _one_layer_less(model):
    model.model.layers = model.model.layers[:-1]
    return model


XS, YS = list(X.chunk(2)), list(Y.chunk(2))

CLASSIC_CASES = {
    "classic-tied-on-some-ranks": (lambda r, w, g: _classic(model=_untied_on_last_rank(r, w)), ValueError,
                                   r"ranks disagree on 'tied_embedding'.*some ranks only; tie them on every rank"),
    "classic-eval-mode-on-one-rank": (lambda r, w, g: _classic(model=build("llama", 4).train(r != 0)), ValueError,
                                      r"ranks disagree on 'mode' \(model.training: False on rank 0, True on rank 1\): "
                                      r"the model is in train mode on some ranks and in eval mode on others"),
    "classic-tied-loaded-with-assign": (lambda r, w, g: _classic(model=_tied_loaded_with_assign()), ValueError,
                                        r"model.embed_tokens.weight \(stage 0\) and lm_head.weight \(stage 1\) are two "
                                        r"Parameters holding the same values.*call model.tie_weights\(\)"),
    # one rank's model on meta: it failed in module.to() after the others had gone on to wait for it (a hang)
    "classic-model-on-meta-on-the-last-rank": (lambda r, w, g: _classic(model=build("llama", 4, meta=r == w - 1)),
                                               ValueError, r"pipeline rank 1: the model's weights are on the meta "
                                               r"device, without values: .* load or initialise its weights first"),
    "classic-list-lengths": (lambda r, w, g: _classic(XS, YS + [YS[0]]), ValueError,
                             r"got 2 input microbatches but 3 target microbatches; give one target per input"),
    "classic-target-shape": (lambda r, w, g: _classic(XS, [YS[0], YS[1][:, :-1]]), ValueError,
                             r"microbatch 1: inputs are shaped \(2, 6\) but targets \(2, 5\)"),
    "classic-microbatch-shapes": (lambda r, w, g: _classic([XS[0], XS[1][:, :4]], [YS[0], YS[1][:, :4]]),
                                  ValueError, r"microbatch 1 is shaped \(2, 4\) but microbatch 0 \(2, 6\).*same shape"),
    "classic-not-a-list": (lambda r, w, g: _classic(X, YS, api=pp.train_step_pipeline_afab), ValueError,
                           r"inputs must be a non-empty list of \[microbatch, seq_len\] token-ID tensors, got Tensor"),
    "classic-empty": (lambda r, w, g: _classic([], []), ValueError, r"inputs must be a non-empty list"),
    "classic-meta-microbatch": (lambda r, w, g: _classic([XS[0], XS[1].to("meta")]), ValueError,
                                r"every element of inputs must be a dense torch.Tensor of token IDs, holding its values"),
    "classic-mismatch-rope-theta": (lambda r, w, g: _classic(model=build("llama", 4, rope_theta=1e4 * (1 + r))),
                                    ValueError, r"ranks disagree on 'model_config' \(rope_(theta|parameters): "),
    "classic-bad-ids-on-first-rank-only": (lambda r, w, g: _classic([_set(XS[0], (0, 0), 500), XS[1]] if r == 0
                                                                    else XS), ValueError,
                                           r"pipeline rank 0: input_ids holds token IDs .* to 500"),
    "classic-bad-targets": (lambda r, w, g: _classic(XS, [YS[0], _set(YS[1], (1, 1), 64)]), ValueError,
                            r"labels holds token IDs .* to 64.*or -100"),
    "classic-lengths-differ-across-ranks": (lambda r, w, g: _classic(XS if r == 0 else list(X.chunk(4)),
                                                                     YS if r == 0 else list(Y.chunk(4))),
                                            ValueError, r"ranks disagree on 'num_microbatches'"),
    "classic-targets-uint8": (lambda r, w, g: _classic(XS, [y.to(torch.uint8) for y in YS]), ValueError,
                              r"labels must hold signed integers, as -100 marks a token to ignore"),
    # uint8 targets of 156 equal -100 as uint8 compares: they are refused as unsigned, not as all ignored
    "classic-targets-uint8-all-156": (lambda r, w, g: _classic(XS, [YS[0].to(torch.uint8),
                                                                    torch.full_like(YS[1], 156, dtype=torch.uint8)]),
                                      ValueError, r"labels must hold signed integers, as -100 marks a token to ignore"),
    "classic-microbatch-all-ignored": (lambda r, w, g: _classic(XS, [YS[0], torch.full_like(YS[1], -100)]),
                                       ValueError, r"microbatch 1: every target is -100 \(ignored\), so its mean "
                                       r"loss is undefined.*leave that microbatch out"),
    "classic-vocab-beyond-embedding": (lambda r, w, g: _classic(model=_vocab_beyond_embedding()), ValueError,
                                       r"config.vocab_size is \d+ but model.embed_tokens has \d+ rows"),
    "classic-gpt2": (lambda r, w, g: _classic(model=_gpt2()), (TypeError, ValueError),
                     r"GPT2LMHeadModel is not a supported decoder-only causal LM"),
    # Checks that fail on one rank alone: every rank raises, none waits for the others.
    "classic-layers-differ-across-ranks": (lambda r, w, g: _classic(model=_one_layer_less(build("llama", 4))
                                                                    if r == w - 1 else None),
                                           ValueError, r"ranks disagree on 'num_layers'"),
    "classic-gpt2-on-the-last-rank-only": (lambda r, w, g: _classic(model=_gpt2() if r == w - 1 else None),
                                           (TypeError, ValueError), r"GPT2LMHeadModel is not a supported decoder-only"),
    "classic-device-unusable-on-the-last-rank": (lambda r, w, g: _classic(device="cuda:99" if r == w - 1 else "cpu"),
                                                 ValueError, r"device .*cuda:99.* cannot be used on this machine"),
    "classic-device-meta-on-the-last-rank": (lambda r, w, g: _classic_keeps_weights(device="meta" if r == w - 1
                                                                             else "cpu"), ValueError,
                                             r"device 'meta' cannot be used: .*holds no values"),
    "classic-zero-dim-microbatch": (lambda r, w, g: _classic([XS[0], torch.tensor(3)], [YS[0], torch.tensor(3)]),
                                    ValueError, r"every element of inputs must be shaped \[microbatch, seq_len\], "
                                    r"got one shaped \(\)"),
    "classic-weight-shared-across-stages": (lambda r, w, g: _classic(model=shared_mlp(1, 2)), ValueError,
                                            r"are one parameter, shared across pipeline stages.*the classic API "
                                            r"splits the layers evenly"),
    "classic-in-inference-mode": (lambda r, w, g: _in_inference_mode(_classic), ValueError,
                                  r"a training step cannot run inside torch.inference_mode\(\)"),
    # one rank calling the AFAB step and another the 1F1B one: named as two calls, not as two schedules
    "classic-afab-on-rank-0-1f1b-on-rank-1": (lambda r, w, g: _classic(api=pp.train_step_pipeline_1f1b if r
                                                                       else pp.train_step_pipeline_afab),
                                              ValueError, r"the pipeline ranks are in different calls: "
                                              r"train_step_pipeline_afab\(\) on rank 0, train_step_pipeline_1f1b\(\) "
                                              r"on rank 1"),
    "classic-integer-dtype": (lambda r, w, g: _classic(dtype=torch.int64), ValueError,
                              r"dtype must be a torch.dtype the model can compute in, .* got torch.int64"),
    # a float8 passed a check for floating-point dtypes, then failed inside the model
    "classic-float8-dtype": (lambda r, w, g: _classic(dtype=torch.float8_e4m3fn), ValueError,
                             r"torch.float32, torch.bfloat16, torch.float16 or torch.float64, got torch.float8_e4m3fn"),
}

CLASSIC_WORLD4_CASES = {
    "classic-more-stages-than-layers": (lambda r, w, g: _classic(layers=2), ValueError,
                                        r"cannot split 2 decoder layers into 4 pipeline stages"),
}


def _worker(rank, world_size, names, table):
    results = {}
    for name in names:
        fn = table[name][0]
        # should the whole run time out, the last such line per rank names the case its stack dump is in
        print(f"rank {rank}: case {name}", file=sys.stderr, flush=True)
        dist.barrier()  # on the default group (long timeout): wait for ranks still timing out in the last case
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT))
        try:
            fn(rank, world_size, group)
            results[name] = None
        except Exception as e:
            results[name] = (type(e).__name__, str(e))
    return results


def _clean_step(pipe, ref, x, y):
    """One pipeline step and the same on `ref` in one process: (loss, reference loss, largest gradient
    difference, microbatches the stage still holds)."""
    loss = pipe.step(x, y)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    diff = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    return loss, ref_loss.item(), diff, pipe.stage.num_saved


def _recovery_worker(rank, world_size):
    """After rejected steps, the same Pipeline still trains exactly (nothing half-done leaks into the step)."""
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    x, y = _data()
    errors = []
    for bad_x, bad_y in [(_set(x, (0, 0), 999), y), (x, y[:, :-1]), (x[:3], y[:3])]:
        try:
            pipe.step(bad_x, bad_y)
        except ValueError as e:
            errors.append(str(e))
    return errors, *_clean_step(pipe, ref, x, y)


def _shared_within_stage_worker(rank, world_size):
    """Layers 0 and 1 share a weight and both run on stage 0: the Pipeline accepts it and is exact."""
    model = shared_mlp(0, 1)
    ref = copy.deepcopy(model)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu", layer_counts=[2, 2])
    return _clean_step(pipe, ref, *_data())


def test_a_weight_shared_within_one_stage_trains_exactly():
    for loss, ref_loss, diff, saved in run_distributed(_shared_within_stage_worker, 2, timeout=TIMEOUT):
        assert loss == pytest.approx(ref_loss, abs=1e-6) and diff < 1e-5 and saved == 0


def _outside_group_worker(rank, world_size):
    """A pipeline on a group of rank 0 alone: rank 0 trains on it, rank 1 is told it is not a member."""
    group = dist.new_group([0])
    try:
        pipe = pp.Pipeline(build("llama", 2), num_microbatches=2, device="cpu", group=group)
        return "ok", pipe.step(*_data())
    except ValueError as e:
        return "ValueError", str(e)


def test_a_rank_outside_the_group_gets_a_clear_error():
    (outcome_0, loss), (outcome_1, message) = run_distributed(_outside_group_worker, 2, timeout=TIMEOUT)
    assert outcome_0 == "ok" and loss > 0
    assert outcome_1 == "ValueError" and re.search(
        r"this process \(global rank 1\) is not a member of the given group, so it has no stage in that pipeline; "
        r"build the Pipeline only on the group's ranks", message), message


@pytest.mark.parametrize("device, backends, said", [
    ("cuda:1", {"cpu": "gloo", "cuda": "gloo"}, "the process group sends cuda tensors with gloo, whose point-to-point "
     "transfers take CPU tensors only: initialise it with 'nccl' (or 'cpu:gloo,cuda:nccl'), or pass device='cpu'"),
    ("cpu", {"cuda": "nccl"}, "the process group has no backend for cpu tensors (only nccl for cuda), so the stages "
     "on cpu cannot send them: initialise it with 'gloo' (or 'cpu:gloo,cuda:nccl'), or pass a device it carries"),
    ("cuda:0", {"cpu": "gloo"}, "the process group has no backend for cuda tensors (only gloo for cpu), so the stages "
     "on cuda:0 cannot send them: initialise it with 'nccl' (or 'cpu:gloo,cuda:nccl'), or pass a device it carries"),
    ("cuda:0", {"cpu": "gloo", "cuda": "nccl"}, None),
    ("cpu", {"cpu": "gloo", "cuda": "nccl"}, None),
])
def test_a_group_that_cannot_carry_the_stages_transfers_is_named(device, backends, said):
    """Which groups can carry a device's transfers, without a GPU: NCCL's cases are those of a GPU node. gloo's own
    point-to-point transfers take CPU tensors only."""
    from pipeline_parallel.comm import _transfer_error
    assert _transfer_error(torch.device(device), backends) == said


def _all_tables():
    return {**PIPELINE_CASES, **CLASSIC_CASES}


@pytest.fixture(scope="module")
def results():
    build("llama", 1)  # import model classes once in the parent
    _gpt2()
    cache = {}

    def get(world_size):
        if world_size not in cache:
            if world_size == 2:
                table = _all_tables()
                # the cases that hang a rank on a peer go last: a timed-out group is left behind
                names = sorted(table, key=lambda n: n in PIPELINE_BUGS)
            else:
                table = {**WORLD4_CASES, **CLASSIC_WORLD4_CASES}
                names = list(table)
            cache[world_size] = run_distributed(_worker, world_size, names, table, timeout=TIMEOUT)
        return cache[world_size]

    return get


def _check(per_rank, name, expected_type, pattern):
    if expected_type == OK_OR_VALUE_ERROR:
        if all(got[name] is None for got in per_rank):
            return
        expected_type = ValueError
    for rank, got in enumerate(per_rank):
        outcome = got[name]
        assert outcome is not None, f"rank {rank} raised nothing for {name}"
        type_name, message = outcome
        types = expected_type if isinstance(expected_type, tuple) else (expected_type,)
        assert type_name in {t.__name__ for t in types}, f"rank {rank}: {type_name}: {message}"
        assert re.search(pattern, message, re.S), f"rank {rank}: {message!r} does not match {pattern!r}"


def _params(table, bugs=None):
    bugs = bugs or {}
    return [pytest.param(name, id=name, marks=bugs.get(name, ())) for name in table]


@pytest.mark.parametrize("name", _params(_all_tables(), PIPELINE_BUGS))
def test_every_rank_raises_the_same_clear_error_2_ranks(results, name):
    _, expected_type, pattern = _all_tables()[name]
    _check(results(2), name, expected_type, pattern)


@pytest.mark.parametrize("name", _params({**WORLD4_CASES, **CLASSIC_WORLD4_CASES}))
def test_every_rank_raises_the_same_clear_error_4_ranks(results, name):
    _, expected_type, pattern = {**WORLD4_CASES, **CLASSIC_WORLD4_CASES}[name]
    _check(results(4), name, expected_type, pattern)


def test_pipeline_still_exact_after_rejected_steps():
    build("llama", 1)
    for errors, loss, ref_loss, diff, saved in run_distributed(_recovery_worker, 2, timeout=TIMEOUT):
        assert len(errors) == 3, errors
        assert loss == pytest.approx(ref_loss, abs=1e-5) and diff < 1e-5 and saved == 0


def _first_layer_raising(pipe, error_at: Callable[[int], BaseException | None]):
    """Make the first decoder layer of `pipe`'s stage raise `error_at(n)` in its n-th forward (from 1) where that is
    not None; returns the layer, whose `del layer.forward` undoes it."""
    layer, calls = next(iter(pipe.model.model.layers.values())), []

    def forward(*args, **kwargs):
        calls.append(1)
        error = error_at(len(calls))
        if error is not None:
            raise error
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = forward
    return layer


def _fails_mid_step_worker(rank, world_size):
    """Rank 0's second forward raises while rank 1 waits for that microbatch; then a clean step follows.

    The pipeline runs on a group whose short timeout would turn a rank left waiting into a "Timed out" error.
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    pipe = pp.Pipeline(model, num_microbatches=4, device="cpu", group=group)
    x, y = make_batch(8, 6, num_microbatches=4)
    layer = _first_layer_raising(pipe, lambda n: RuntimeError("boom in microbatch 1") if rank == 0 and n == 2 else None)
    try:
        pipe.step(x, y)
        failure = None
    except Exception as e:
        failure = type(e).__name__, str(e), getattr(e, "__notes__", [])
    finite = all(p.grad.isfinite().all() for p in pipe.parameters() if p.grad is not None)  # zeros handed on
    del layer.forward
    with pytest.raises(ValueError) as unfinished:  # a loop that caught the error would add onto partial gradients
        pipe.step(x, y)
    pipe.zero_grad()
    return failure, finite, str(unfinished.value), *_clean_step(pipe, ref, x, y)


def test_a_rank_failing_mid_step_fails_every_rank_and_the_next_step_is_exact():
    """The other ranks cannot finish the step: the failing rank still makes the step's transfers (with zeros),
    every rank raises, none waits for a timeout, and after zero_grad the pipeline trains exactly again."""
    build("llama", 1)
    (first, finite_0, unfinished_0, *results_0), (second, finite_1, unfinished_1, *results_1) = run_distributed(
        _fails_mid_step_worker, 2, timeout=TIMEOUT)
    assert finite_0 and finite_1, "the failing rank hands on zeros, which leave the other ranks' gradients finite"
    assert unfinished_0 == unfinished_1 == ("pipeline rank 0: the previous step failed, and the gradients may hold "
                                            "part of it: call zero_grad() before the next step")
    assert first[:2] == ("RuntimeError", "boom in microbatch 1"), first
    assert any("call zero_grad() before the next step" in note for note in first[2]), first
    assert second[0] == "RuntimeError" and re.search(
        r"pipeline rank 0 failed during the step \(RuntimeError: boom in microbatch 1\); .*call zero_grad\(\)",
        second[1]), second
    for loss, ref_loss, diff, saved in (results_0, results_1):
        assert loss == pytest.approx(ref_loss, abs=1e-5) and diff < 1e-5 and saved == 0


@contextlib.contextmanager
def _out_of_memory(function: str, shape: tuple[int, ...], nth: int):
    """`torch.<function>`'s `nth` call making a tensor of `shape` (or like one: `empty_like`, `Tensor.to`) raises
    torch.OutOfMemoryError, as a full GPU would; yields the list of such calls."""
    owner, _, function = f"torch.{function}".rpartition(".")
    owner = torch.Tensor if owner == "torch.Tensor" else torch
    real, calls = getattr(owner, function), []

    def fake(*args, **kwargs):
        made = (args[0].shape if isinstance(args[0], torch.Tensor) else
                args[0] if not isinstance(args[0], int) else args)  # torch.empty((2, 3)) or (2, 3)
        if tuple(made) == shape:
            calls.append(shape)
            if len(calls) == nth:
                raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return real(*args, **kwargs)

    setattr(owner, function, fake)
    try:
        yield calls
    finally:
        setattr(owner, function, real)


_BATCH, _ACTIVATION, _EMBEDDING = (8, 6), (2, 6, HIDDEN), (VOCAB, HIDDEN)
_OUT_OF_MEMORY = {  # where the memory runs out: (rank, torch function, shape, its nth call there)
    "the inputs moved to the device": (0, "Tensor.to", _BATCH, 1),
    "the labels moved to the device": (1, "Tensor.to", _BATCH, 1),
    "a receive buffer for an activation": (1, "empty", _ACTIVATION, 2),
    "a receive buffer for a gradient": (0, "empty", _ACTIVATION, 1),
    "the buffer of the tied gradient's exchange": (1, "empty_like", _EMBEDDING, 1),
    "the buffer of the tied ends' comparison": (0, "empty_like", _EMBEDDING, 1),
}


def _out_of_memory_worker(rank, world_size):
    """Each case of `_OUT_OF_MEMORY` in one step, then a clean step. For the last, the ends of the tied embedding
    differ by rounding, which the step mends first. The group's short timeout would turn a rank left waiting into a
    "Timed out" error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    model = build("llama", 4, tie=True)
    ref = copy.deepcopy(model)
    pipe = pp.Pipeline(model, num_microbatches=4, device="cpu", group=group)
    x, y = make_batch(8, 6, num_microbatches=4)
    results = {}
    for case, (failing_rank, function, shape, nth) in _OUT_OF_MEMORY.items():
        if "comparison" in case and rank == 1:
            with torch.no_grad():
                pipe.model.lm_head.weight.mul_(1 + 1e-7)
        with _out_of_memory(function, shape, nth if rank == failing_rank else 0) as calls:
            try:
                pipe.step(x, y)
                failure = None
            except Exception as e:
                failure = type(e).__name__, str(e)
        pipe.zero_grad(), ref.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = full_loss(ref, x, y)
        ref_loss.backward()
        expected = grads(ref)
        diff = max((p.grad - expected[n]).abs().max().item() for n, p in pipe.named_parameters())
        results[case] = failure, len(calls), loss - ref_loss.item(), diff, pipe.stage.num_saved
        pipe.zero_grad()
    return results


def test_a_device_out_of_memory_for_a_transfer_fails_every_rank_and_the_next_step_is_exact():
    """Where a rank has no memory for a tensor it sends or receives (on a GPU, a receive buffer or the tied
    embedding's gradient from the other end), every rank raises at once, naming it, rather than waiting for that
    rank until the backend's timeout; after zero_grad the pipeline trains exactly again."""
    by_rank = run_distributed(_out_of_memory_worker, 2, timeout=TIMEOUT)
    for case, (failing_rank, *_, nth) in _OUT_OF_MEMORY.items():
        failures = [results[case][0] for results in by_rank]
        assert by_rank[failing_rank][case][1] >= nth, (case, "the memory did not run out")
        assert failures[failing_rank] == ("OutOfMemoryError", "CUDA out of memory (a test)"), (case, failures)
        other = failures[1 - failing_rank]
        said = ("pipeline rank {}: OutOfMemoryError: " if "comparison" in case else
                "pipeline rank {} failed during the step \\(OutOfMemoryError: ").format(failing_rank)
        assert other[0] == "RuntimeError" and re.match(said + "CUDA out of memory \\(a test\\)", other[1]), (
            case, failures)
        for results in by_rank:
            _, _, loss_diff, diff, saved = results[case]
            assert abs(loss_diff) < 1e-5 and diff < 1e-5 and saved == 0, (case, results[case])


def _checksum_out_of_memory_worker(rank, world_size):
    """Rank 1 has no memory to checksum its end of a tied embedding (for the ends to compare) as the Pipeline is
    built, then as a step starts; after each, a clean step."""
    import pipeline_parallel.pipeline as pipeline_module

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    checksum, said = pipeline_module.bits_checksum, []

    def out_of_memory(tensor):
        raise torch.OutOfMemoryError("CUDA out of memory (a test)")

    def make():
        return pp.Pipeline(build("llama", 4, tie=True), num_microbatches=2, device="cpu", group=group)

    for when in ("building", "stepping"):
        pipe = make() if when == "stepping" else None
        if rank == 1:
            pipeline_module.bits_checksum = out_of_memory
        try:
            (pipe or make()).step(X, Y)
        except Exception as e:
            said.append((type(e).__name__, str(e)))
        pipeline_module.bits_checksum = checksum
        said.append(math.isfinite((pipe or make()).step(X, Y)))
    return said


def test_no_memory_to_checksum_a_tied_end_fails_every_rank():
    """The ends of a tied embedding compare checksums as a Pipeline is built and as each step starts. A rank without
    the memory to take its own raised alone, the other end waiting for it until the backend's timeout."""
    oom = ("OutOfMemoryError", "CUDA out of memory (a test)")
    named = ("RuntimeError", "pipeline rank 1: OutOfMemoryError: CUDA out of memory (a test)")
    assert run_distributed(_checksum_out_of_memory_worker, 2, timeout=TIMEOUT) == [[named, True, named, True],
                                                                                     [oom, True, oom, True]]


def _interrupted_mid_step_worker(rank, world_size):
    """Ctrl-C lands in both ranks' forwards (rank 0's third, rank 1's second), in the middle of GPipe's transfers;
    then the program goes on: another step, and a clip."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT))
    pipe = pp.Pipeline(build("llama", 4), schedule="gpipe", num_microbatches=4, device="cpu", group=group)
    x, y = make_batch(8, 6, num_microbatches=4)
    layer = _first_layer_raising(pipe, lambda n: KeyboardInterrupt() if n == 3 - rank else None)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y)
    del layer.forward
    pipe.zero_grad()
    said = []
    for after in (lambda: pipe.step(x, y), lambda: pipe.clip_grad_norm_(1.0)):
        with pytest.raises(RuntimeError) as raised:
            after()
        said.append(str(raised.value))
    return said


def test_after_a_step_stopped_mid_transfer_the_pipeline_refuses_to_communicate():
    """The interrupted step's transfers still posted paired with the next step's, which hung (or could have
    carried another microbatch's activations)."""
    build("llama", 1)
    for said in run_distributed(_interrupted_mid_step_worker, 2, timeout=TIMEOUT):
        for message in said:
            assert message == ("an earlier pipeline step stopped in the middle of its transfers (KeyboardInterrupt), "
                               "so the ranks' transfers are out of step: a further step would hang or mix up "
                               "microbatches. Start the processes again (from a checkpoint, to go on training)")


# one process, no process group ------------------------------------------------------------------------------------

SINGLE = [
    "vocab-beyond-embedding", "classic-vocab-beyond-embedding",
    "unknown-schedule", "schedule-none", "seed-none", "autocast-dtype-string", "recompute-string", "partly-on-meta", "microbatches-zero", "microbatches-negative", "microbatches-float-after-a-plan",
    "split-bool-after-a-plan", "layout-linear", "layout-gpt2", "layout-rotary-none",
    "inputs-not-tensor", "labels-missing-on-last", "inputs-on-meta", "labels-sparse", "inputs-float", "inputs-1d", "inputs-too-big", "inputs-negative",
    "labels-shape", "labels-too-big", "labels-negative", "all-labels-ignored", "batch-not-divisible",
    "batch-not-divisible-3", "evaluate-bad-ids", "classic-list-lengths", "classic-target-shape",
    "classic-microbatch-shapes", "classic-not-a-list", "classic-bad-targets", "classic-microbatch-all-ignored",
    "classic-gpt2", "classic-device-unusable-on-the-last-rank", "classic-device-meta-on-the-last-rank", "device-meta", "classic-zero-dim-microbatch", "classic-integer-dtype",
]


@pytest.mark.parametrize("name", SINGLE)
def test_single_process_errors(name):
    assert not dist.is_initialized()
    fn, expected_type, pattern = _all_tables()[name]
    with pytest.raises(expected_type) as info:
        fn(0, 1, None)
    assert re.search(pattern.replace("2 pipeline stages", "1 pipeline stages"), str(info.value), re.S), \
        str(info.value)


def test_single_process_more_stages_than_layers_in_layer_counts():
    with pytest.raises(ValueError, match=r"layer_counts \[2, 2\] gives 2 layer counts but the pipeline has 1 stage;"):
        _pipe(None, layer_counts=[2, 2])


def test_settings_that_differ_only_in_dict_order_agree():
    """A rope dict loaded from one file lists its keys in another order than one built in code."""
    from pipeline_parallel.batch import fingerprint

    one = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}, "vocab_size": 64}
    other = {"vocab_size": 64, "rope_parameters": {"rope_theta": 5e5, "factor": 8.0, "rope_type": "llama3"}}
    assert fingerprint(model_config=one) == fingerprint(model_config=other)
    assert fingerprint(model_config=one) != fingerprint(model_config={**one, "vocab_size": 65})


def test_differences_names_four_keys_and_counts_the_rest():
    from pipeline_parallel.batch import differences

    ranks = [{key: 0 for key in "abcdef"}, {key: 1 for key in "abcdef"} | {"f": 0}]
    assert differences(ranks) == "a: 0 on rank 0, 1 on rank 1; b: 0 on rank 0, 1 on rank 1; " \
                                 "c: 0 on rank 0, 1 on rank 1; d: 0 on rank 0, 1 on rank 1; 1 more"
    assert differences(ranks[:1] * 2) == ""


@pytest.mark.parametrize("short", [1, 8])
def test_a_head_with_fewer_rows_than_the_vocabulary_is_refused(short):
    """The embedding holds every token but the LM head fewer: labels beyond its rows pass the input checks and
    then fail inside the cross-entropy, so the pipeline names the head, whichever of the two is short (by one
    row too: the last token's label is as valid as any)."""
    model = build("llama", 2)
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size - short, bias=False)
    with pytest.raises(ValueError, match=rf"config.vocab_size is 64 but lm_head has {64 - short} rows"):
        pp.Pipeline(model, num_microbatches=2, device="cpu")


def test_a_tied_embedding_also_used_by_a_middle_stage_is_refused():
    """A tied embedding and head may sit on the first and last stages (their gradients are added up), but a
    layer of a middle stage holding the same matrix would update its own copy apart from the two ends."""
    model = build("llama", 4, tie=True)
    extra = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    extra.weight = model.model.embed_tokens.weight
    model.model.layers[1].extra = extra  # layer 1: stage 1 of 3
    check_shared_parameters(model, layer_ranges([1, 3]), hint="split otherwise")  # two stages: the ends only, allowed
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight \(stage 0\) and model.layers.1.extra.weight "
                                         r"\(stage 1\) and lm_head.weight \(stage 2\) are one parameter, shared"):
        check_shared_parameters(model, layer_ranges([1, 2, 1]), hint="split otherwise")


_OUTPUT_CHANGES = {"dtype": lambda out: out.to(torch.bfloat16), "shape": lambda out: out[:, :-1]}


def _wrong_output_worker(rank, world_size, change):
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    pipe = pp.Pipeline(build("llama", 4), num_microbatches=2, device="cpu", group=group)
    if rank == 0:  # the last layer of stage 0 hands on something else than the residual stream it got
        last_layer = list(pipe.model.model.layers.values())[-1]
        last_layer.register_forward_hook(
            lambda module, args, out: (_OUTPUT_CHANGES[change](out[0]), *out[1:]) if isinstance(out, tuple)
            else _OUTPUT_CHANGES[change](out))
    x, y = make_batch(4, 6, num_microbatches=2)
    try:
        pipe.step(x, y)
        return None
    except Exception as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("change", list(_OUTPUT_CHANGES))
def test_a_stage_handing_on_another_dtype_or_shape_fails_every_rank_clearly(change):
    """A stage whose output is not what the pipeline transfers (another dtype or shape): the step fails on every rank
    with the runtime's clear error, before any transfer of the wrong tensor, and no rank hangs."""
    said_0, said_1 = run_distributed(_wrong_output_worker, 2, change, timeout=120)
    shape, dtype = ("6", "bfloat16") if change == "dtype" else ("5", "float32")
    produced = (rf"stage 0 produced \(2, {shape}, 32\) torch\.{dtype} for microbatch 0, but the pipeline transfers "
                r"\(2, 6, 32\) torch\.float32")
    assert said_0 is not None and said_0[0] == "RuntimeError" and re.search(produced, said_0[1]), said_0
    assert said_1 is not None and said_1[0] == "RuntimeError" and re.search(
        r"pipeline rank 0 failed during the step \(RuntimeError: " + produced, said_1[1]), said_1


def _fails_in_a_weight_pass_worker(rank, world_size):
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    # GPipe with every backward of the last stage split: it runs I1.1, I1.0, then W1.1, W1.0
    pipe = pp.Pipeline(model, schedule="gpipe", num_microbatches=2, device="cpu", group=group, split=2)
    program = [a for a in pipe.program if not a.kind.is_comm]
    weight = next(p for n, p in pipe.named_parameters() if n.endswith("mlp.down_proj.weight"))

    def fail_once(param):
        handle.remove()
        raise RuntimeError("boom in a weight pass")

    handle = weight.register_post_accumulate_grad_hook(fail_once) if rank == world_size - 1 else None
    x, y = make_batch(4, 6, num_microbatches=2)
    with pytest.raises(RuntimeError) as raised:
        pipe.step(x, y)
    held_after_failure = pipe.stage.num_saved
    pipe.zero_grad()
    return program, str(raised.value), held_after_failure, *_clean_step(pipe, ref, x, y)


def test_a_step_failing_in_a_weight_pass_keeps_no_microbatch():
    """A step that fails in a weight pass (W) of a split backward on a later stage: every rank raises, and no rank
    keeps a microbatch's activations (its saved graph, or a weight pass still pending) past the failed step."""
    results = run_distributed(_fails_in_a_weight_pass_worker, 2, timeout=120)
    (_, said_0, *_), (program_1, said_1, *_) = results
    assert [a.kind.value for a in program_1][-2:] == ["W", "W"], program_1  # the failure leaves one W pending
    assert said_1 == "boom in a weight pass"
    assert re.search(r"pipeline rank 1 failed during the step \(RuntimeError: boom in a weight pass\)", said_0), said_0
    for rank, (_, _, held, loss, ref_loss, diff, held_after) in enumerate(results):
        assert held == 0, f"rank {rank} still holds {held} microbatches after the failed step"
        assert loss == pytest.approx(ref_loss, abs=1e-5) and diff < 1e-5 and held_after == 0


def test_a_failed_step_notes_on_its_error_what_to_do():
    """The failing rank's own error carries the note, whole; one process has no other ranks to speak of. Until
    zero_grad, a training step is then refused, as it would add to the failed step's partial gradients."""
    pipe = _pipe(None)
    layer = _first_layer_raising(pipe, lambda n: RuntimeError("boom"))
    with pytest.raises(RuntimeError) as raised:
        pipe.step(X, Y)
    assert str(raised.value) == "boom" and raised.value.__notes__ == [
        "pipeline_parallel: this step's gradients are incomplete: call zero_grad() before the next step"]
    del layer.forward
    pipe.evaluate(X, Y)  # touches no gradient, and leaves the mark of the failed step
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^the previous step failed, .*call zero_grad\(\) before the next"):
            pipe.step(X, Y)
    pipe.zero_grad(set_to_none=False)
    assert math.isfinite(pipe.step(X, Y))


def _two_fail_worker(rank, world_size):
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    pipe = pp.Pipeline(build("llama", 3), num_microbatches=2, device="cpu", group=group)
    _first_layer_raising(pipe, lambda n: RuntimeError("boom") if rank > 0 else None)
    try:
        pipe.step(X, Y)
    except Exception as e:
        return type(e).__name__, str(e), getattr(e, "__notes__", [])


def test_where_several_ranks_fail_the_others_name_the_first():
    """Ranks 1 and 2 fail: each raises its own error with the note, and rank 0 names rank 1, the first."""
    first, *failing = run_distributed(_two_fail_worker, 3, timeout=TIMEOUT)
    assert failing == [("RuntimeError", "boom", [
        "pipeline_parallel: the other ranks finished this step's transfers and raised too; this step's gradients "
        "are incomplete: call zero_grad() before the next step"])] * 2
    assert first[0] == "RuntimeError" and first[1].startswith("pipeline rank 1 failed during the step (RuntimeError: "
                                                              "boom)"), first


def _out_of_memory_on_two_ranks_worker(rank, world_size):
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    try:
        _out_of_memory_in("PipelineStage", rank, group, 1, 2)
    except Exception as e:
        return type(e).__name__, str(e)


def test_where_several_ranks_fail_to_make_their_stages_each_raises_its_own_error():
    """Out of memory on ranks 1 and 2 while they make their stages: each raises its own error, as a failed step's
    ranks do, and rank 0 one that names rank 1, the first."""
    said = run_distributed(_out_of_memory_on_two_ranks_worker, 3, timeout=TIMEOUT)
    allocator = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9999 bytes on rank {}"
    assert said == [("RuntimeError", "pipeline rank 1: RuntimeError: " + allocator.format(1)),
                    ("RuntimeError", allocator.format(1)), ("RuntimeError", allocator.format(2))], said


def test_a_single_process_error_names_no_pipeline_rank():
    """One process has no ranks to tell apart: its messages start with what is wrong."""
    with pytest.raises(ValueError) as raised:
        _pipe(None, num_microbatches=0)
    assert str(raised.value).startswith("num_microbatches must be an integer >= 1"), str(raised.value)


def test_an_unhashable_split_gets_the_schedules_own_message():
    with pytest.raises(ValueError, match=r"split must be an integer >= 0 .*got \[1\]"):
        _pipe(None, split=[1])
