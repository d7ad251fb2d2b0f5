"""The runtime keeps only the activations its schedule promises: 1F1B's memory does not grow with m."""

from __future__ import annotations

import types

import pytest
import torch
from _dist import run_distributed
from _models import build, make_batch

import pipeline_parallel as pp
from pipeline_parallel.stage import PipelineStage


def _peak_saved(rank: int, world_size: int, schedule: str, num_microbatches: int) -> int:
    """The most microbatches whose activations this rank's stage held at once during a step."""
    peak = 0
    forward = PipelineStage.forward

    def counting_forward(self, *args, **kwargs):
        nonlocal peak
        out = forward(self, *args, **kwargs)
        peak = max(peak, self.num_saved)
        return out

    PipelineStage.forward = counting_forward  # this forked rank's own copy of the class
    pipe = pp.Pipeline(build("llama", 4), schedule=schedule, num_microbatches=num_microbatches, device="cpu")
    x, y = make_batch(num_microbatches, 6, num_microbatches=num_microbatches)
    pipe.step(x, y)
    assert pipe.stage.num_saved == 0, "a finished step must hold no activations"
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_peak_activations_per_rank(schedule):
    world_size, num_microbatches = 4, 8
    peaks = run_distributed(_peak_saved, world_size, schedule, num_microbatches, timeout=120)
    if schedule == "1f1b":
        assert peaks == [world_size - rank for rank in range(world_size)]
    else:
        assert peaks == [num_microbatches] * world_size


def _peak_held_by_transfers(rank: int, world_size: int, num_microbatches: int, evaluate: bool = False) -> int:
    """The most tensors this rank's transfers held at once during a 1F1B step (or an evaluation): sends
    not known complete yet, and receives not yet taken."""
    from pipeline_parallel import runtime

    peak = 0
    post = runtime._Mailbox.post

    def counting_post(self):
        nonlocal peak
        post(self)
        peak = max(peak, sum(len(transfers.tensors) for transfers in self.in_flight))

    runtime._Mailbox.post = counting_post  # this forked rank's own copy of the class
    pipe = pp.Pipeline(build("llama", 4), schedule="1f1b", num_microbatches=num_microbatches, device="cpu")
    x, y = make_batch(num_microbatches, 6, num_microbatches=num_microbatches)
    (pipe.evaluate if evaluate else pipe.step)(x, y)
    return peak


@pytest.mark.parametrize("evaluate", [False, True], ids=["1f1b", "evaluate"])
def test_sent_tensors_do_not_pile_up(evaluate):
    """gloo's send handles report completion only once waited; the runtime waits for a send when the
    schedule proves its receiver has taken it (`send_releases`), or where nothing ever proves it (an
    evaluation sends activations only) once waiting for it cannot deadlock, so the tensors held for
    transfers, like 1F1B's activations, do not grow with the number of microbatches."""
    few, many = (run_distributed(_peak_held_by_transfers, 2, m, evaluate, timeout=120) for m in (4, 12))
    assert few == many, (few, many)


class _Held:
    """A tensor autograd saved for the backward, counted while the graph keeps it (see `_peak_activation_bytes`)."""

    def __init__(self, tensor):
        self.tensor = tensor


def _peak_activation_bytes(rank: int, world_size: int, schedule: str, num_microbatches: int, recompute: bool,
                           seq: int = 32) -> tuple[int, int]:
    """The most bytes of activations (tensors autograd saved for the backward, not parameters) this rank's graphs
    held at once during a step, counted as each is saved until autograd lets go of it; and how many forwards of its
    stage ran."""
    import weakref

    pipe = pp.Pipeline(build("llama", 4), schedule=schedule, num_microbatches=num_microbatches, device="cpu",
                       recompute=recompute)
    weights = {p.untyped_storage().data_ptr() for p in pipe.parameters()}
    live = peak = 0

    def release(nbytes):
        nonlocal live
        live -= nbytes

    def pack(tensor):
        nonlocal live, peak
        if tensor.untyped_storage().data_ptr() in weights:
            return tensor
        held, nbytes = _Held(tensor), tensor.untyped_storage().nbytes()
        live += nbytes
        peak = max(peak, live)
        weakref.finalize(held, release, nbytes)
        return held

    forwards, parts_forward = 0, pipe.stage.parts.forward

    def counted_forward(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return parts_forward(*args, **kwargs)

    pipe.stage.parts.forward = counted_forward
    x, y = make_batch(2 * num_microbatches, seq, num_microbatches=num_microbatches)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: getattr(held, "tensor", held)):
        pipe.step(x, y)
    assert live == 0, "a finished step must hold no activations"
    return peak, forwards


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_holds_one_microbatchs_activations(schedule):
    """With `recompute` a stage keeps only each microbatch's input between its forward and its backward, which
    runs the forward again first: its graphs hold one microbatch's activations at a time, where without it GPipe's
    hold all of them and 1F1B's as many as are in flight (the first stage's two of 2). A forward whose backward
    comes next keeps its graph and runs once: the last microbatch's in GPipe (whose backwards run last first),
    every one on 1F1B's last stage."""
    m = 4
    (kept, kept_forwards), (recomputed, forwards) = (
        zip(*run_distributed(_peak_activation_bytes, 2, schedule, m, recompute, timeout=120))
        for recompute in (False, True))
    assert kept_forwards == (m, m) and forwards == ((2 * m - 1,) * 2 if schedule == "gpipe" else (2 * m, m))
    in_flight = [m, m] if schedule == "gpipe" else [2, 1]
    for rank, held in enumerate(in_flight):
        one = kept[rank] / held
        assert recomputed[rank] == pytest.approx(one, rel=0.02), (schedule, rank, kept, recomputed)


class _Work:
    """A transfer's handle that never completes by itself and counts the waits on it."""

    def __init__(self, waits: list):
        self.waits = waits

    def wait(self):
        self.waits.append(self)

    def is_completed(self):
        return False


@pytest.mark.parametrize("device, waits", [("cpu", 1), ("cuda", 0)])
def test_a_send_let_go_is_waited_for_on_the_cpu_only(device, waits):
    """A schedule lets a send go at a given point (`send_releases`). On the CPU (gloo, whose handles report
    completion only once waited) that waits for it. On a GPU the backend holds the tensor until the send is done,
    and a wait there would make the compute stream wait for the peer's receive: it does not wait."""
    from pipeline_parallel import runtime
    from pipeline_parallel.schedules import Action, Kind

    waited = []
    comm = types.SimpleNamespace(device=torch.device(device), pp_size=2, post=lambda ops: [_Work(waited) for _ in ops])
    mailbox = runtime._Mailbox(comm, runtime.StepData((1, 2, 3), torch.float32), stages={})
    send = Action(Kind.SEND_F, 0, 0)
    mailbox.hand_on(Action(Kind.F, 0, 0), torch.ones(1, 2, 3))
    mailbox.queue(send)
    mailbox.post()
    mailbox.release((send,))
    assert len(waited) == waits
