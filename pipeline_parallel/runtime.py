"""Executes one rank's action list: compute on its stages, sends and receives between them."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch

from .comm import PipeComm
from .schedules import Action, Kind
from .schedules.actions import backward_next, input_of, peer_rank, recv_of, result_of, sent_by, user_of
from .stage import PipelineStage


@dataclass
class StepData:
    """What one step needs: microbatches for the first stage, labels and loss scales for the last.

    `activation_shape` and `activation_dtype` describe every tensor that crosses a stage boundary
    this step (hidden states forward, their gradients backward), so receive buffers can be made
    before the data arrives. Ranks agree on them before the step starts.
    """

    activation_shape: tuple[int, ...]
    activation_dtype: torch.dtype
    inputs: list[torch.Tensor] | None = None
    labels: list[torch.Tensor] | None = None
    loss_scales: list[float] | None = None
    training: bool = True  # False: forward only, no graph kept (evaluation)
    # What failed on this rank as it made the step ready (out of memory moving its batch to the device): the step
    # then makes its transfers with zeros and fails on every rank, as after an error inside it
    failure: Exception | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    # (action, start, end) of each compute action once its input was there, in time.perf_counter() seconds (on a
    # GPU, when the device ran it)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


def _run_program(program: list[Action], stages: dict[int, PipelineStage], comm: PipeComm, step: StepData,
                send_releases: dict[Action, tuple[Action, ...]] | None = None) -> Exception | None:
    """Run `program` (this rank's lowered actions) for one step.

    Consecutive comm actions are posted as one batch when the next compute action comes up
    (or at the end); a compute action waits only for the receive it consumes (see `_Mailbox`),
    then for the sends `send_releases` names there, so their tensors go: those the peers have
    provably taken by then, and those nothing proves taken, where waiting cannot deadlock (see
    `schedules.send_releases`).

    If a compute action raises, or the device has no memory for a tensor to transfer (or the step
    failed as it was made ready: `StepData.failure`), the rest of the program still makes every
    transfer, handing on zeros in place of results, so no other rank is left waiting for this one;
    the error is returned for `run_step` to raise on every rank.
    """
    mailbox, clock = _Mailbox(comm, step, stages), _Clock(comm.device)
    if step.failure is not None:
        mailbox.fail(step.failure)
    send_releases = send_releases or {}
    kept_graph = backward_next(program)  # forwards a stage that recomputes keeps the graph of
    for action in program:
        if action.kind.is_comm:
            mailbox.queue(action)
            continue
        mailbox.post()
        stage = stages[action.stage]
        data = mailbox.take(action, stage.num_stages)
        mailbox.release(send_releases.get(action, ()))
        result = None
        if mailbox.error is None:
            start = clock.now()
            try:
                result = _compute(action, stage, data, step, action in kept_graph)
                result = None if result is None else result.contiguous()  # a layer may not make it so; sends need it
            except Exception as e:
                result = None
                mailbox.fail(e)
            else:
                step.timeline.append((action, start, clock.now()))
        if user_of(action, stage.num_stages) is not None:
            mailbox.hand_on(action, result)
    mailbox.post()
    mailbox.finish()
    step.timeline[:] = [(action, clock.seconds(start), clock.seconds(end)) for action, start, end in step.timeline]
    return mailbox.error


class _Clock:
    """When compute actions ran, in `time.perf_counter()` seconds. On a GPU the host only queues an action's
    kernels, so there the times are events on the device's stream, read once the step is done."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.origin, self.host_origin = self.now(), time.perf_counter()

    def now(self):
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def seconds(self, mark) -> float:
        if self.stream is None:
            return mark
        mark.synchronize()
        return self.host_origin + self.origin.elapsed_time(mark) / 1000


class _Mailbox:
    """A step's data between stages: results waiting for their send (or for the next stage on
    this rank), comm actions waiting to be posted, and receives on their way.

    Sends are kept until they complete (or `release` finds them taken), so their tensors stay
    alive, and all transfers are waited for by `finish`. Once the step has failed (`fail`), the
    transfers go on with zeros in place of results.
    """

    def __init__(self, comm: PipeComm, step: StepData, stages: dict[int, PipelineStage]):
        self.comm, self.step, self.stages = comm, step, stages
        self.error: Exception | None = None  # the step's first failure on this rank
        self.queued: list[Action] = []  # comm actions not posted yet
        self.produced: dict[Action, torch.Tensor] = {}  # results for neighbours, by `result_of`
        self.received: dict[Action, tuple[torch.Tensor, _Transfers]] = {}  # by RECV action
        self.in_flight: list[_Transfers] = []
        self.sending: dict[Action, _Transfers] = {}  # by SEND action, where each has a handle of its own

    def queue(self, action: Action) -> None:
        self.queued.append(action)

    def fail(self, error: Exception) -> None:
        """Mark the step failed (its first error is kept) and free its activations: nothing of a failed step may
        leak into the next one, and the transfers still to come may need their memory."""
        self.error = self.error or error
        _free_frames(error)
        for stage in self.stages.values():
            stage.clear()

    def hand_on(self, action: Action, result: torch.Tensor | None) -> None:
        """Keep a compute action's result for its SEND, or for the neighbouring stage on this rank; zeros in place
        of one a failed step did not compute, as the neighbour still waits for a tensor."""
        self.produced[result_of(action)] = result if result is not None else self._allocated(self._zeros)

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.step.activation_shape, dtype=self.step.activation_dtype, device=self.comm.device)

    def _allocated(self, make):
        """`make()`'s new tensor. Should the device have no memory for it, the step fails (`fail` frees the
        activations) and `make` is tried again: the transfer must still be made, or a peer would wait for it
        until the backend's timeout."""
        tensor, error = attempt(make)
        if error is not None:
            self.fail(error)
            tensor = make()
        return tensor

    def post(self) -> None:
        """Start the queued sends and receives as one batch."""
        queued, self.queued = self.queued, []
        ops = []
        for action in queued:
            peer = peer_rank(action, self.comm.pp_size)
            if action.kind.is_send:
                ops.append(("send", self.produced.pop(sent_by(action)), peer))
            else:
                buffer = self._allocated(lambda: torch.empty(self.step.activation_shape,
                                                             dtype=self.step.activation_dtype, device=self.comm.device))
                ops.append(("recv", buffer, peer))
        if not ops:
            return
        works = self.comm.post(ops)
        own_handles = len(works) == len(ops)
        if own_handles:  # one handle per op (gloo): a receive waits for itself only
            handles = [_Transfers([work], [tensor]) for work, (_, tensor, _) in zip(works, ops)]
        else:  # one handle for the coalesced batch (nccl): waiting only orders the GPU stream
            handles = [_Transfers(works, [tensor for _, tensor, _ in ops])] * len(ops)
        for action, (_, tensor, _), handle in zip(queued, ops, handles):
            if action.kind.is_recv:
                self.received[action] = (tensor, handle)
            # A batch's handle may cover receives still to come: not one to `release`. Nor is a GPU's: its backend
            # holds the tensor until the send is done, and a wait would make the compute stream wait for the peer.
            elif own_handles and self.comm.device.type == "cpu":
                self.sending[action] = handle
        # Forget transfers that have finished, so sent activations are not held to the end of the step.
        # (gloo's handles report completion only once waited: there `release` waits for the sends.)
        self.in_flight = [transfers for transfers in self.in_flight if not transfers.finished()]
        self.in_flight.extend(handles)

    def release(self, sends: tuple[Action, ...]) -> None:
        """Wait for `sends` and let go of their tensors. Their receivers have taken them already (this
        returns at once), or, for a send nothing proves taken, they will without this rank going on
        (see `schedules.send_releases`). Sends on a GPU (nccl) are not held here: their handle reports
        its completion without a wait (see `post`)."""
        for send in sends:
            transfers = self.sending.pop(send, None)
            if transfers is not None:
                transfers.wait()

    def take(self, action: Action, num_stages: int):
        """A compute action's input: the microbatch, the neighbouring stage's result on this rank, or
        the received tensor (waiting for its receive only); None for the last stage's backward, which
        starts from its loss, and for W."""
        source = input_of(action, num_stages)
        if source is None:  # (no inputs where the step failed before it began: see `StepData.failure`)
            return self.step.inputs[action.mb] if action.kind == Kind.F and self.step.inputs is not None else None
        if source in self.produced:
            return self.produced.pop(source)
        buffer, transfers = self.received.pop(recv_of(action))
        transfers.wait()
        return buffer

    def finish(self) -> None:
        """Wait for every transfer of the step; the schedule must have used all its data."""
        for transfers in self.in_flight:
            transfers.wait()
        assert not self.received and not self.produced, \
            f"schedule left data unused: {list(self.received) + list(self.produced)}"


def _compute(action: Action, stage: PipelineStage, data, step: StepData, backward_next: bool
             ) -> torch.Tensor | None:
    """Run one compute action; returns what it hands to a neighbouring stage (see `user_of`). `backward_next`: this
    forward's backward is the rank's next compute action."""
    if action.kind == Kind.F:
        if stage.is_last:
            labels, scale = step.labels[action.mb], step.loss_scales[action.mb]
            step.losses.append(stage.forward(action.mb, data, labels, scale, step.training, backward_next))
            return None
        out = stage.forward(action.mb, data, training=step.training, backward_next=backward_next)
        _check_activation(out, step, action)
        return out
    if action.kind == Kind.B:
        return stage.backward(action.mb, data)
    if action.kind == Kind.I:
        return stage.backward_input(action.mb, data)
    if action.kind == Kind.W:
        stage.backward_weight(action.mb)
        return None
    raise NotImplementedError(f"the runtime cannot execute {action!r}")


class _Transfers:
    """Work handles of posted transfers, keeping the tensors they read or fill alive until done.

    Waiting is idempotent: gloo hangs if a finished receive is waited on a second time.
    """

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.tensors = [], []

    def finished(self) -> bool:
        """True once every transfer has completed (then released); never blocks."""
        if all(work.is_completed() for work in self.works):
            self.wait()  # returns at once; surfaces a failed transfer's error
            return True
        return False


def _check_activation(out: torch.Tensor, step: StepData, action: Action) -> None:
    if tuple(out.shape) != step.activation_shape or out.dtype != step.activation_dtype:
        raise RuntimeError(
            f"stage {action.stage} produced {tuple(out.shape)} {out.dtype} for microbatch {action.mb}, but the "
            f"pipeline transfers {step.activation_shape} {step.activation_dtype}; run the model in the pipeline's "
            "dtype (or use autocast, which keeps the residual stream in the parameter dtype)"
        )


def run_step(
    program: list[Action], stages: dict[int, PipelineStage], comm: PipeComm, step: StepData, tied_weight=None,
    send_releases: dict[Action, tuple[Action, ...]] | None = None,
) -> float:
    """One step on this rank: run the program on its stages (by stage_idx; several where a schedule deals
    more than one stage to a rank), finish the gradients of tied weights, and agree on the outcome.

    `tied_weight` is the embedding/LM-head matrix when the model ties them and they live on
    different ranks (first and last): each end adds the other's gradient of this step, so both
    hold the gradient of the single shared weight (plus what earlier steps accumulated).

    `send_releases` (see `schedules.send_releases`) lets sent tensors go once their receivers have
    taken them, where the backend's handles would not say so by themselves (gloo).

    Returns the summed scaled loss on every rank. If a compute action failed on any rank, every
    rank raises (the failing one its own error) once all transfers of the step are done, so none
    is left waiting and the next step starts clean.
    """
    holds_first = any(stage.is_first for stage in stages.values())
    holds_last = any(stage.is_last for stage in stages.values())
    tied = tied_weight is not None and step.training
    frozen = tied and not tied_weight.requires_grad  # then, as on one process, its .grad stays as it was
    accumulated = tied_weight.grad if tied else None
    if tied:
        tied_weight.grad = None  # this step's part alone is exchanged
    try:
        error = _run_program(program, stages, comm, step, send_releases)
        if tied:  # its memory is taken before the ranks agree, so that a device without it fails the step clearly
            this_step, other_end, error = _tied_exchange_buffers(tied_weight, error)
        # [loss, failed ranks, frozen ends of a tied weight, ranks with a parameter to train], summed
        outcome = torch.zeros(4, dtype=torch.float64, device=comm.device)
        if error is not None:
            outcome[1] = 1
        elif holds_last:
            outcome[0] = torch.stack(step.losses).sum().detach()
        outcome[2] = frozen
        outcome[3] = any(p.requires_grad for stage in stages.values() for p in stage.parts.parameters())
        loss, failed, frozen_ends, training_ranks = comm.all_reduce(outcome).tolist()
        if tied:
            if not failed:
                comm.exchange_add_(this_step, holds_first, other_end)
            if frozen or this_step is None:  # frozen: as on one process; None: a failed step without its part
                tied_weight.grad = accumulated
            else:
                tied_weight.grad = this_step if accumulated is None else accumulated.add_(this_step)
    except BaseException as e:  # a transfer failed (or an interrupt): the pipeline cannot finish the step
        for stage in stages.values():
            stage.clear()
        if comm.pp_size > 1:  # transfers of this step may still be posted: no later one can be trusted
            comm.broken_by = f"{type(e).__name__}: {e}".rstrip(": ")
        raise
    if failed:
        _raise_step_failure(comm, error)
    if step.training and not training_ranks:  # as one process's backward fails, not a step that trains nothing
        raise RuntimeError(
            "no parameter of the model requires grad, so a training step has nothing to compute: set requires_grad "
            "on the parameters to train, or compute the loss alone (Pipeline.evaluate)"
        )
    if frozen_ends == 1:
        raise ValueError(
            "the tied embedding is frozen at one end only: set requires_grad alike on model.embed_tokens.weight "
            "(first rank) and lm_head.weight (last rank), which are one weight; this step's gradients of it differ "
            "between the ends, so call zero_grad() before the next step"
        )
    return loss


def _tied_exchange_buffers(tied_weight: torch.Tensor, error: Exception | None):
    """This step's gradient of a tied weight (dense) and a buffer for the other end's, or, where the device has no
    memory for them, None and the step's error (its first one kept)."""
    def make():
        this_step = tied_weight.grad if tied_weight.grad is not None else torch.zeros_like(tied_weight)
        if this_step.is_sparse:  # an embedding made sparse: sent, and added to the head's, dense
            this_step = this_step.to_dense()
        return this_step, torch.empty_like(this_step)

    buffers, failure = attempt(make)
    return *(buffers or (None, None)), error or failure


def attempt(make):
    """(`make()`, None), or (None, the error it raised; see `_free_frames`): for memory a rank must take before its
    peers go on, so that a device without it fails every rank clearly rather than leaving them waiting for this one."""
    try:
        return make(), None
    except Exception as e:  # torch.OutOfMemoryError, mostly
        _free_frames(e)
        return None, e


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` says a device or the host ran out of memory: torch's error for a GPU, the CPU allocator's
    RuntimeError, or Python's MemoryError."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(error)


def _free_frames(error: BaseException) -> None:
    """Clear the variables of the frames an out-of-memory error passed through, so that the memory they held is
    free for what must still be made (its traceback stays readable; another error keeps them, for debugging)."""
    if out_of_memory(error):
        traceback.clear_frames(error.__traceback__)


def _raise_step_failure(comm: PipeComm, error: Exception | None) -> None:
    """Raise `error` where it happened and, on every other rank, an error that names the failing rank."""
    reports = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        if hasattr(error, "add_note"):
            others = "the other ranks finished this step's transfers and raised too; " if comm.pp_size > 1 else ""
            error.add_note(f"pipeline_parallel: {others}this step's gradients are incomplete: call zero_grad() before "
                           "the next step")
        raise error
    rank, message = next((r, m) for r, m in enumerate(reports) if m is not None)
    raise RuntimeError(
        f"pipeline rank {rank} failed during the step ({message}); the other ranks finished its transfers with "
        "zeros, so this step's gradients are incomplete: call zero_grad() before the next step"
    )
