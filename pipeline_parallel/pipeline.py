"""`Pipeline`: this rank's stage of a model, trained with a schedule over the pipeline ranks."""

from __future__ import annotations

import functools
import secrets
import time

import torch
from torch import nn

from ._checks import check_bool, check_int, check_positive, check_seed
from .batch import agree_on_batch, agree_on_settings, fingerprint, mode_setting
from .comm import PipeComm, bits_checksum, default_device, usable_device
from .loss import IGNORE_INDEX
from .models.decoder import (DecoderParts, check_shared_parameters, end_weight, is_tied, model_settings,
                             tied_weight_end)
from .models.families import check_layout
from .models.materialize import keep_local_part, materialize, weights_on_meta
from .partition import balanced_layer_counts, check_layer_counts, estimate_costs, layer_ranges, stage_costs
from .runtime import StepData, attempt, run_step
from .schedules import build_schedule, schedule_name, send_releases
from .schedules.split import planned_duration
from .stage import PipelineStage, inference_mode_error


def planning_costs(config, layer_counts: list[int], seq_len: int) -> tuple[float, ...]:
    """Each stage's estimated cost at this sequence length (attention's share grows with it, the head's
    does not), relative to the costliest and rounded to two significant digits: about the precision of
    the estimate, and the key plans are kept under, so a run with thousands of sequence lengths plans a
    few dozen times."""
    costs = stage_costs(layer_counts, estimate_costs(config, seq_len))
    return tuple(float(f"{cost / max(costs):.2g}") for cost in costs)


def rank_program(schedule: str, comm: PipeComm, num_microbatches: int, costs: tuple[float, ...],
                 forward_only: bool = False, split: int | None = None, recompute: bool = False) -> tuple[list, dict]:
    """This rank's validated action list of `schedule`, planned with these relative stage costs (for stages
    that recompute, with `recompute`), and when it may let go of each send before the step's end (see
    `send_releases`).

    Plans are kept (`_planned`): planning the split of backwards takes time (seconds at 32 stages),
    and a Pipeline whose sequence lengths vary, or the classic API, asks again and again.
    """
    args = (schedule, comm.pp_size, num_microbatches, comm.prefetch_receives, tuple(costs), forward_only, split,
            recompute)
    try:
        hash(args)
    except TypeError:  # an unhashable, so bad, argument: build_schedule says what is wrong with it
        programs, releases = _planned.__wrapped__(*args)
    else:
        programs, releases = _planned(*args)
    return list(programs[comm.pp_rank]), releases[comm.pp_rank]


# Typed: 2.0 == 2 and True == 1 hash alike, and a hit must not hand back a plan build_schedule would refuse them.
@functools.lru_cache(maxsize=256, typed=True)
def _planned(schedule, num_stages, num_microbatches, prefetch, costs, forward_only, split, recompute) -> tuple:
    lowered = build_schedule(schedule, num_stages, num_microbatches, prefetch=prefetch, forward_only=forward_only,
                             stage_costs=list(costs), split=split, recompute=recompute)
    duration = planned_duration(list(costs), num_stages, lowered, recompute)  # the one build_schedule planned with
    return tuple(map(tuple, lowered)), tuple(send_releases(lowered, num_stages, duration))


class Pipeline:
    """Keeps this rank's stage of `model` and trains it with a pipeline schedule.

    ```
    pipe = Pipeline(model, schedule="1f1b", num_microbatches=8)
    optimizer = torch.optim.AdamW(pipe.parameters())   # after the Pipeline: this rank's parameters
    loss = pipe.step(input_ids, labels)      # forward + backward of the whole batch
    pipe.clip_grad_norm_(1.0); optimizer.step(); pipe.zero_grad()
    ```
    Every rank of `group` (default: all) constructs it with the same arguments and calls
    `step` together. The loss is the token mean of cross-entropy over the whole batch (labels
    of -100 ignored), so gradients equal those of one process on the full batch; `labels` are the
    targets, already shifted (`labels[:, t]` follows `input_ids[:, t]`). The first
    rank's `input_ids` and the last rank's `labels` are used; other ranks may pass None.
    `num_microbatches` defaults to twice the number of stages. The kept layers stay under their
    original indices (`model.model.layers` becomes a ModuleDict keyed "0", "1", ...).
    `split` is how many of each rank's last backwards send their input gradient before making
    their weight gradients (see `schedules.split_backwards`); by default the simulator chooses
    which backwards to split with the estimated stage costs (see `schedules.choose_split`).
    `seq_len` is the sequence length the default split of layers is balanced for: attention's
    share of a layer's cost grows with it, the head's does not.
    `autocast_dtype=torch.bfloat16` computes under autocast, the weights and gradients keeping their dtype.
    `recompute` (activation recomputation) trades compute for memory: a microbatch keeps only its
    stage input from its forward until its backward, which runs the forward again first (with the
    random state it had, so dropout draws alike), so a stage holds one microbatch's activations at a
    time (and those whose weight pass waits) however many microbatches are in flight. A forward whose
    backward comes next on its rank keeps its graph (the last stage's in 1F1B). Forward hooks on the
    model fire again in each recomputed forward, as under any activation checkpointing.
    After each step, `last_timeline` holds this rank's (action, start, end) compute times in
    `time.perf_counter()` seconds (on a GPU, when the device ran the action, by CUDA events), for
    timelines and `schedules.simulate`, and `last_step_seconds` how long its schedule ran (the rank
    was idle for the rest, waiting on other ranks).
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: str = "1f1b",
        num_microbatches: int | None = None,
        *,
        layer_counts: list[int] | None = None,
        device: torch.device | str | None = None,
        group=None,
        autocast_dtype: torch.dtype | None = None,
        seed: int = 0,
        split: int | None = None,
        seq_len: int = 2048,
        recompute: bool = False,
    ):
        self.device, device_error = usable_device(device if device is not None else default_device())
        self.comm = PipeComm(group, self.device)
        self.comm.check_transfers(device_error)
        self.pp_rank, self.pp_size = self.comm.pp_rank, self.comm.pp_size
        self.stage_idx = self.pp_rank
        self.is_first, self.is_last = self.stage_idx == 0, self.stage_idx == self.pp_size - 1
        num_microbatches = 2 * self.pp_size if num_microbatches is None else num_microbatches
        self.num_microbatches, self.schedule, self.split, self.recompute = num_microbatches, schedule, split, recompute
        model_config = model_settings(getattr(model, "config", None))
        given = dict(schedule=schedule_name(schedule), num_microbatches=num_microbatches, layer_counts=layer_counts,
                     autocast_dtype=str(autocast_dtype), split=split, seq_len=seq_len, seed=seed, recompute=recompute)
        self._settings = fingerprint(**given, model_config=model_config)
        on_meta = dtypes = tied = None
        try:  # plan locally; any rank's mistake is raised on every rank by the agreement below
            if device_error:
                raise ValueError(device_error)
            _check_autocast_dtype(autocast_dtype)
            check_bool("recompute", recompute)
            seed = check_seed("seed", seed, hint=" (weights a model on meta gets are drawn from it)")
            self.layer_counts, (self.program, self._releases), self._eval_plan = self._plan(model, layer_counts, seq_len)
            _check_as_one_process(model)
            on_meta, error = weights_on_meta(model), None
            dtypes, tied = _parameter_dtypes(model), is_tied(model)
            # The residual stream between stages keeps the embedding's dtype (autocast computes in
            # lower precision but adds in it), whatever dtype the stage's own layers hold.
            self.activation_dtype = model.model.embed_tokens.weight.dtype
        except Exception as e:  # any, out of memory too: raised here alone, it would leave the others waiting
            error = e
        # Agree before touching the model, so a bad or mismatched launch fails here and not in a hang. The ranks
        # take the first one's random number as the Pipeline's: each step checks they call the one they built.
        local = fingerprint(weights_on_meta=on_meta, parameter_dtypes=dtypes, tied_embedding=tied)
        by_rank = agree_on_settings(
            self.comm, {**self._settings, **local}, call="Pipeline()", local_error=error, facts=[secrets.randbits(31)],
            details={"model_config": model_config, "parameter_dtypes": dict(dtypes or ()),
                     **{name: {name: value} for name, value in given.items()}})
        self._settings.update(fingerprint(pipeline=by_rank[0][0]))
        self.config = model.config

        holds_tied_end = tied_weight_end(model, self.pp_size, self.is_first, self.is_last) is not None
        self.layer_indices = layer_ranges(self.layer_counts)[self.stage_idx]
        error, self._tied_weight = None, None
        try:  # a buffer the model cannot make, or no memory for the stage, shows on one rank: every rank raises
            keep_local_part(model, self.layer_indices, self.is_first, self.is_last)
            materialize(model, self.device, seed)
            self.model = model.to(self.device)
            parts = DecoderParts.of(model, self.layer_indices, self.is_first, self.is_last)
            self.stage = PipelineStage(parts, self.stage_idx, self.pp_size, autocast_dtype, recompute)
            if holds_tied_end:  # fetched after materialising, which may have replaced the Parameter
                self._tied_weight = end_weight(model, self.is_first)
                tied_checksum = bits_checksum(self._tied_weight)  # before the ends compare them
        except Exception as e:
            error = e
        agree_on_settings(self.comm, {}, call="Pipeline()", local_error=error)
        if holds_tied_end:
            # The ends may hold different values (initialised apart, on meta or by the caller): as
            # tying does in one process, the head takes the embedding, the first stage's copy.
            self.comm.share_from_first_(self._tied_weight.data, self.is_first, tied_checksum)
        self._dtypes = _parameter_dtypes(self.model)  # what `_changed` compares with, as the stage's parts
        self.last_timeline: list = []
        self.last_step_seconds = 0.0
        self._step_unfinished = False  # a step failed after it began: its gradients are partial until zero_grad

    def _plan(self, model: nn.Module, layer_counts, seq_len: int):
        """Layers per stage and this rank's train and eval plans (see `rank_program`); raises on bad arguments
        (`build_schedule` checks the schedule, microbatch count and split)."""
        check_layout(model)
        check_int("seq_len", seq_len, hint=" (the sequence length to balance the stages for)")
        num_layers = len(model.model.layers)
        if layer_counts is None:
            layer_counts = balanced_layer_counts(num_layers, self.pp_size, estimate_costs(model.config, seq_len))
        layer_counts = check_layer_counts(layer_counts, num_layers, self.pp_size)
        check_shared_parameters(model, layer_ranges(layer_counts),
                                hint="pass layer_counts that keep the layers sharing it on one stage")
        train = self._program(model.config, layer_counts, seq_len)
        return layer_counts, train, self._program(model.config, layer_counts, seq_len, forward_only=True)

    def _program(self, config, layer_counts, seq_len: int, forward_only: bool = False):
        """This rank's action list for batches of `seq_len` (one plan serves lengths of near costs), and
        its sends to let go of early."""
        return rank_program(self.schedule, self.comm, self.num_microbatches,
                            planning_costs(config, layer_counts, seq_len), forward_only=forward_only,
                            split=None if forward_only else self.split, recompute=self.recompute and not forward_only)

    def step(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> float:
        """Forward and backward of one batch (`labels` already shifted: the token that follows each input); gradients
        accumulate. Returns the loss on every rank."""
        return self._run(input_ids, labels, training=True)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> float:
        """The loss of one batch in eval mode (no dropout), forward only (no graph kept, gradients untouched), on
        every rank."""
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            return self._run(input_ids, labels, training=False)
        finally:  # each module as it was: a user may keep some in eval mode while training
            for module, training in modes:
                module.training = training

    def _run(self, input_ids, labels, training: bool) -> float:
        mode, details = mode_setting(self.model)
        # The checksum of this rank's end of a tied embedding, for the ends to compare: without memory, all raise
        checksum, failure = (None, None) if self._tied_weight is None else attempt(
            lambda: bits_checksum(self._tied_weight).tolist())
        info = agree_on_batch(
            self.comm, input_ids if self.is_first else None, labels if self.is_last else None,
            call="step()" if training else "evaluate()", vocab_size=self.config.vocab_size,
            num_microbatches=self.num_microbatches, settings={**self._settings, **mode}, details=details,
            local_error=self._changed() or (self._training_error() if training else None) or failure,
            facts=checksum or [-1] * 3,
        )
        first_end, last_end = info.facts[0], info.facts[-1]  # checksums of a tied embedding's ends, where there are two
        if first_end[0] >= 0 and first_end != last_end:
            self._tie_ends_again("step()" if training else "evaluate()")
        if info.num_target_tokens == 0:
            raise ValueError(f"every label of the batch is {IGNORE_INDEX} (ignored): there is nothing to "
                             f"{'train on' if training else 'evaluate'}; give a batch with at least one target token")
        m = self.num_microbatches
        step = StepData(
            activation_shape=(info.batch_size // m, info.seq_len, self.config.hidden_size),
            activation_dtype=self.activation_dtype,
            training=training,
        )

        def batch_on_device():
            if self.is_first:
                step.inputs = input_ids.to(self.device, torch.long).chunk(m)
            if self.is_last:
                step.labels = labels.to(self.device, torch.long).chunk(m)

        _, step.failure = attempt(batch_on_device)  # past the ranks' agreement: a failure fails the step everywhere
        if self.is_last:
            step.loss_scales = [1.0 / info.num_target_tokens] * m
        if training:  # the same on every rank: they agreed on the sequence length
            self.program, self._releases = self._program(self.config, self.layer_counts, info.seq_len)
        program, releases = (self.program, self._releases) if training else self._eval_plan
        start = time.perf_counter()
        self._step_unfinished |= training  # until the step ends: one that fails leaves part of its gradients
        loss = run_step(program, {self.stage_idx: self.stage}, self.comm, step, self._tied_weight, releases)
        self._step_unfinished &= not training  # an evaluation leaves a failed step's mark
        self.last_timeline, self.last_step_seconds = step.timeline, time.perf_counter() - start
        return loss

    def _tie_ends_again(self, call: str) -> None:
        """Make the tied embedding's two ends, which differ, one matrix again, as one process holds it: the head takes
        the embedding where they differ by rounding (an optimizer's arithmetic otherwise ordered on each end, its
        stochastic rounding); where by more, something changed one end alone, and every rank raises."""
        difference, other, error = -1.0, None, None
        if self._tied_weight is not None:
            mine = self._tied_weight.detach()
            other, error = attempt(lambda: torch.empty_like(mine))
        # each end has room for the other's copy before they swap, or every rank raises: none waits for it
        agree_on_settings(self.comm, {}, call=call, local_error=error)
        if self._tied_weight is not None:
            self.comm.other_end(mine, self.is_first, into=other)
            difference, error = attempt(lambda: float(
                torch.linalg.vector_norm((mine - other).float())
                / torch.linalg.vector_norm(mine.float()).clamp_min(torch.finfo(torch.float32).tiny)))
        measured = _bits(torch.tensor(-1.0 if error else difference, dtype=torch.float64))
        by_rank = agree_on_settings(self.comm, {}, call=call, local_error=error, facts=[measured])
        difference = max(_floats([bits for bits, in by_rank]).tolist())
        rounding = max(4 * torch.finfo(self.activation_dtype).eps, 1e-5)
        if difference > rounding:
            raise ValueError(
                f"the tied embedding's two ends (model.embed_tokens.weight on the first stage, lm_head.weight on the "
                f"last), one matrix in one process, differ by {difference:.2g} of its norm, more than rounding: "
                "something changed one end and not the other since the Pipeline was built, such as an optimizer that "
                "treats them otherwise (parameter groups chosen by name must put lm_head.weight, the last rank's end, "
                "with model.embed_tokens.weight) or weights set on one rank; change both ends alike")
        if other is not None and not self.is_first:
            self._tied_weight.data.copy_(other)

    def _training_error(self) -> str | None:
        """Why no training step can run now, or None: inside inference mode, or after a failed step whose gradients
        were not cleared (a loop that catches the error and goes on would add the next step's to them)."""
        if self._step_unfinished:
            return ("the previous step failed, and the gradients may hold part of it: call zero_grad() before the "
                    "next step")
        return inference_mode_error()

    def _changed(self) -> str | None:
        """Why this rank's model no longer is the one the Pipeline was built on, if it changed: a stage
        runs the modules it found then, and transfers activations in the dtype it agreed on then."""
        try:
            modules = DecoderParts.of(self.model, self.layer_indices, self.is_first, self.is_last).named_modules()
            tied_now = end_weight(self.model, self.is_first) if self._tied_weight is not None else None
        except Exception as e:  # any: raised here, before the ranks agree, it would leave the others waiting
            return (f"the model lost a part its stage runs after the Pipeline was built ({e}); change the whole "
                    "model before building the Pipeline from it")
        # By name: a part set to None drops out of `modules`, which would shift every later name.
        now = dict(modules)
        replaced = [name for name, was in self.stage.parts.named_modules() if now.get(name) is not was]
        if replaced:
            return (f"{', '.join(replaced)} of the model was replaced after the Pipeline was built, and the stage "
                    "would go on running the old one; change the whole model before building the Pipeline from it")
        hooked = _wrapper_hook(self.model)
        if hooked:
            return hooked
        if tied_now is not self._tied_weight:
            return ("the tied embedding's Parameter was replaced after the Pipeline was built (say, by "
                    "load_state_dict(assign=True)), and the step would go on adding the two ends' gradients into "
                    "the old one; load the weights in place, or before building the Pipeline")
        # Parameters added inside a layer (adapters) are run as the layer runs them; a changed dtype is not
        # what the stages agreed to transfer.
        then, now = dict(self._dtypes), dict(_parameter_dtypes(self.model))
        changed = next((f"{n}: {then[n]} -> {now[n]}" for n in now if n in then and now[n] != then[n]), None)
        if changed:
            return (f"the model's parameter dtypes changed after the Pipeline was built ({changed}), but its stages "
                    "agreed on the dtypes they transfer then; convert the model before building the Pipeline")
        return None

    def parameters(self):
        """This rank's parameters (its stage only)."""
        return self.model.parameters()

    def named_parameters(self):
        """This rank's parameters under their names in the full model (the last rank's end of a tied embedding is
        lm_head.weight, the first rank's model.embed_tokens.weight)."""
        return self.model.named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this rank's stage (as `nn.Module.zero_grad`), before the next step."""
        self.model.zero_grad(set_to_none=set_to_none)
        self._step_unfinished = False

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all stages' gradients so their global norm is at most `max_norm`; returns that norm.

        The norm is taken over the whole model, as one process would (in the gradients' dtype, the
        ranks' parts combined in float64, so no sum of squares overflows): each rank reduces its own
        gradients, the ranks combine the results, and the tied LM head is counted once. Every rank
        must pass the same arguments; a bad or differing one is an error on every rank.
        """
        given, error = {"max_norm": max_norm, "norm_type": norm_type}, None
        try:  # as floats, so that 1 and 1.0 agree
            given = {"max_norm": check_positive("max_norm", max_norm, allow_inf=True,
                                                hint=" (inf: measure the norm, clip nothing)"),
                     "norm_type": check_positive("norm_type", norm_type, allow_inf=True,
                                                 hint=" (2.0: the usual Euclidean norm; inf: the largest entry)")}
        except ValueError as e:
            error = e
        norm_type = given["norm_type"]
        grads = [p.grad for p in self._unique_parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64, device=self.device)  # also where the arguments are wrong
        dtype = -1  # this rank's gradients' dtype, by its index in _FLOAT_DTYPES (-1: no gradient)
        if grads and error is None:
            try:  # a failure here is every rank's error below, not this rank's alone while the others wait
                norms = [torch.linalg.vector_norm(_values(g), norm_type).double() for g in grads]
                local = torch.linalg.vector_norm(torch.stack(norms), norm_type)
                dtype = _FLOAT_DTYPES.index(_common_dtype([g.dtype for g in grads]))
            except Exception as e:
                error = e
        # One collective: the ranks' norms (as int64 bits) and gradient dtypes travel with their agreement on the
        # arguments, so that every rank returns the same norm in the same dtype (a rank may hold no gradient).
        by_rank = agree_on_settings(self.comm, {**fingerprint(**given), "pipeline": self._settings["pipeline"]},
                                    call="clip_grad_norm_()", local_error=error,
                                    facts=[_bits(local), dtype], details={name: {name: v} for name, v in given.items()})
        norms = _floats([bits for bits, _ in by_rank], self.device)
        dtypes = [_FLOAT_DTYPES[index] for _, index in by_rank if index >= 0]
        total = torch.linalg.vector_norm(norms, norm_type).to(_common_dtype(dtypes))
        torch.nn.utils.clip_grads_with_norm_(list(self.parameters()), max_norm, total)
        return total

    def _unique_parameters(self):
        """Parameters counted once across the pipeline (the last rank's tied LM head is not)."""
        skip = self._tied_weight if self.is_last else None
        return [p for p in self.parameters() if p is not skip]


def _values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's entries as a dense tensor: a sparse one's (an `nn.Embedding(sparse=True)`'s), which
    `vector_norm` does not take, are the values of its coalesced form, where repeated rows are summed."""
    return grad.coalesce().values() if grad.is_sparse else grad


def _bits(value: torch.Tensor) -> int:
    """The bits of a float64 scalar as an int64, which `_floats` turns back into it."""
    return value.view(torch.int64).item()


def _floats(bits: list[int], device=None) -> torch.Tensor:
    """The float64 values whose bits `_bits` gave."""
    return torch.tensor(bits, dtype=torch.int64, device=device).view(torch.float64)


_FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]  # of gradients, by index


def _common_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype torch's own clip_grad_norm_ returns for gradients of these dtypes (float32 if none)."""
    common = dtypes[0] if dtypes else torch.float32
    for dtype in dtypes[1:]:
        common = torch.promote_types(common, dtype)
    return common


_HOOK_KINDS = {"forward pre-hook": "_forward_pre_hooks", "forward hook": "_forward_hooks",
               "backward pre-hook": "_backward_pre_hooks", "backward hook": "_backward_hooks"}


def _wrapper_hook(model: nn.Module) -> str | None:
    """Why the model or model.model holds a hook or a forward of its own, which would never run: a stage runs their
    parts (embedding, layers, norm, head), never their forward; a hook that changes the logits would train another
    function silently."""
    for name, module in (("the model", model), ("model.model", model.model)):
        kind = next((kind for kind, attr in _HOOK_KINDS.items() if getattr(module, attr, None)), None)
        if kind:
            return (f"{name} has a {kind}, which a pipeline never fires: a stage runs the model's parts (the embedding, "
                    "layers, norm and head), never the forward of the model or model.model; register the hook on "
                    "those parts, or remove it (handle.remove())")
        if "forward" in vars(module):
            return (f"{name} has a forward of its own, set on it (as accelerate's hooks do), which a pipeline never "
                    "calls: a stage runs the model's parts (the embedding, layers, norm and head), never the forward "
                    "of the model or model.model; change those parts instead, or delete the attribute")
    return None


def _check_as_one_process(model: nn.Module) -> None:
    """Raise where the pipeline would compute otherwise than one process running `model`: a hook on a wrapper
    (`_wrapper_hook`), or an embedding scaling its gradient by each token's frequency in the batch (a stage sees
    one microbatch at a time)."""
    hooked = _wrapper_hook(model)
    if hooked:
        raise ValueError(hooked)
    if getattr(model.model.embed_tokens, "scale_grad_by_freq", False):
        raise ValueError("the embedding has scale_grad_by_freq = True, which scales its gradient by each token's "
                         "count in the batch, and a pipeline stage sees one microbatch at a time; set "
                         "model.model.embed_tokens.scale_grad_by_freq = False")


def _check_autocast_dtype(dtype) -> None:
    if dtype == torch.float16:  # a logit's gradient is about 1 / (vocabulary x tokens): 1e-9 at 32k each, under 6e-8
        raise ValueError("autocast_dtype=torch.float16 needs its loss scaled up, or its gradients, below float16's "
                         "smallest number, come out zero, and a Pipeline does not scale its loss: use torch.bfloat16, "
                         "which has float32's range, or None (float32)")
    if dtype is not None and dtype != torch.bfloat16:
        raise TypeError(f"autocast_dtype must be torch.bfloat16 or None (no autocast), got {dtype!r}")


def _parameter_dtypes(model: nn.Module) -> list[tuple[str, str]]:
    """Each parameter's dtype under every name it has (a tied LM head is listed, as untied it would be)."""
    return [(name, str(p.dtype)) for name, p in model.named_parameters(remove_duplicate=False)]

