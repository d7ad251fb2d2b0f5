"""The one-call training step on a full Hugging Face model: `train_step_pipeline_afab` / `_1f1b`."""

from __future__ import annotations

import torch
from torch import nn

from .batch import agree_on_batch, fingerprint, mode_setting
from .comm import PipeComm, usable_device
from .loss import IGNORE_INDEX
from .models.decoder import DecoderParts, check_shared_parameters, is_tied, model_settings, tied_weight_end
from .models.families import check_layout
from .models.materialize import weights_on_meta
from .partition import balanced_layer_counts, layer_ranges
from .pipeline import planning_costs, rank_program
from .runtime import StepData, attempt, run_step
from .stage import PipelineStage, inference_mode_error


def train_step_pipeline_afab(model, inputs, targets, device, dtype) -> float | None:
    """Forward and backward of a batch given as microbatches, all forwards first (GPipe/AFAB).

    `model` is a whole `LlamaForCausalLM` on every rank (process group already initialised); each
    rank runs only its contiguous share of the decoder layers, the first also the embedding and
    the last the final norm and `lm_head`. `inputs` and `targets` are lists of [microbatch,
    seq_len] token IDs (targets already shifted, -100 ignored). Each microbatch's loss is its
    mean cross-entropy divided by the number of microbatches; gradients accumulate in the
    model's parameters, whose modules this rank runs are moved and cast to `device` and `dtype`
    in place. Returns the summed loss on the last rank and None on the others.
    """
    return _train_step(model, inputs, targets, device, dtype, "gpipe", call="train_step_pipeline_afab()")


def train_step_pipeline_1f1b(model, inputs, targets, device, dtype) -> float | None:
    """As `train_step_pipeline_afab`, with the one-forward-one-backward schedule (less memory)."""
    return _train_step(model, inputs, targets, device, dtype, "1f1b", call="train_step_pipeline_1f1b()")


def _train_step(model: nn.Module, inputs, targets, device, dtype, schedule: str, call: str) -> float | None:
    device, error = usable_device(device)
    comm = PipeComm(None, device)
    comm.check_transfers(error)
    stage_idx, num_stages = comm.pp_rank, comm.pp_size
    first, last = stage_idx == 0, stage_idx == num_stages - 1

    # Every local check feeds the shared agreement below, so a rank that fails alone fails them all.
    input_ids = labels = tied = layer_counts = None  # what a failed check leaves unset
    num_layers, vocab_size, model_config = 0, 0, {}
    try:
        check_layout(model)
        num_layers, vocab_size, tied = len(model.model.layers), model.config.vocab_size, is_tied(model)
        model_config = model_settings(model.config)
        if weights_on_meta(model):
            raise ValueError("the model's weights are on the meta device, without values: the classic API trains "
                             "the model as given, so load or initialise its weights first (pp.Pipeline "
                             "initialises a model built on meta)")
        layer_counts = balanced_layer_counts(num_layers, num_stages)  # even split, as the classic API promises
        check_shared_parameters(model, layer_ranges(layer_counts), hint="the classic API splits the layers evenly; "
                                "Pipeline(..., layer_counts=...) can keep the layers sharing it on one stage")
        error = error or _dtype_error(dtype) or _microbatches_error(inputs, targets) or inference_mode_error()
        if error is None:
            input_ids, labels = torch.cat(list(inputs)), torch.cat(list(targets))
    except Exception as e:  # any: raised here alone, it would leave the other ranks waiting
        error = e
    num_microbatches = len(inputs) if isinstance(inputs, (list, tuple)) else 0
    mode, mode_details = mode_setting(model)
    settings = fingerprint(schedule=schedule, num_microbatches=num_microbatches, dtype=str(dtype),
                           num_layers=num_layers, model_config=model_config, tied_embedding=tied)
    info = agree_on_batch(comm, input_ids if first else None, labels if last else None, call=call,
                          vocab_size=vocab_size, num_microbatches=max(num_microbatches, 1), settings={**settings, **mode},
                          local_error=error, details={"model_config": model_config, **mode_details})

    parts = DecoderParts.of(model, layer_ranges(layer_counts)[stage_idx], first, last)
    step = StepData(activation_shape=(info.batch_size // num_microbatches, info.seq_len, model.config.hidden_size),
                    activation_dtype=dtype)

    def on_device():  # past the ranks' agreement: a failure (out of memory) fails the step on every rank
        for module in parts.modules():
            module.to(device=device, dtype=dtype)
        for _, rotary in parts.rotaries():  # their tables stay in float32; left behind, copied there each forward
            rotary.to(device)
        if first:
            step.inputs = [x.to(device, torch.long) for x in inputs]
        if last:
            step.labels = [y.to(device, torch.long) for y in targets]

    _, step.failure = attempt(on_device)
    stage = PipelineStage(parts, stage_idx, num_stages)
    if last:  # mean over each microbatch's own targets, then over microbatches (as a loop of loss.backward())
        step.loss_scales = [1.0 / (num_microbatches * int((y != IGNORE_INDEX).sum())) for y in targets]
    costs = planning_costs(model.config, layer_counts, info.seq_len)
    program, releases = rank_program(schedule, comm, num_microbatches, costs)
    tied_weight = tied_weight_end(model, num_stages, first, last)
    if tied_weight is not None:  # the ranks' models may have been initialised apart: the head takes the embedding
        comm.share_from_first_(tied_weight.data, first)
    loss = run_step(program, {stage.stage_idx: stage}, comm, step, tied_weight, releases)
    return loss if last else None


def _dtype_error(dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return (f"dtype must be a torch.dtype the model can compute in, for the hidden states and gradients: "
                f"torch.float32, torch.bfloat16, torch.float16 or torch.float64, got {dtype!r}")
    return None


def _microbatches_error(inputs, targets) -> str | None:
    """Why `inputs`/`targets` are not matching lists of equally shaped microbatches, or None."""
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, (list, tuple)) or not value:
            return f"{name} must be a non-empty list of [microbatch, seq_len] token-ID tensors, got {type(value).__name__}"
        if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta for t in value):
            return f"every element of {name} must be a dense torch.Tensor of token IDs, holding its values"
        shapes = [tuple(t.shape) for t in value if t.dim() != 2]
        if shapes:
            return f"every element of {name} must be shaped [microbatch, seq_len], got one shaped {shapes[0]}"
    if len(inputs) != len(targets):
        return f"got {len(inputs)} input microbatches but {len(targets)} target microbatches; give one target per input"
    for i, (x, y) in enumerate(zip(inputs, targets)):
        if x.shape != y.shape:
            return (f"microbatch {i}: inputs are shaped {tuple(x.shape)} but targets {tuple(y.shape)}; "
                    "targets must hold one (shifted) target per input token")
        if x.shape != inputs[0].shape:
            return (f"microbatch {i} is shaped {tuple(x.shape)} but microbatch 0 {tuple(inputs[0].shape)}; "
                    "all microbatches of a batch must have the same shape")
        if y.numel() and y.dtype.is_signed and bool((y == IGNORE_INDEX).all()):  # unsigned: refused as such
            return (f"microbatch {i}: every target is {IGNORE_INDEX} (ignored), so its mean loss is undefined (a "
                    "single process gets NaN); leave that microbatch out or give it a target to train on")
    return None
