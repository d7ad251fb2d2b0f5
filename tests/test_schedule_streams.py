"""NCCL runs a rank's batches of transfers in order: just-in-time receives are safe there, early ones are not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _models import build, make_batch, reference_step

import pipeline_parallel as pp
from pipeline_parallel.schedules import ScheduleError, build_schedule, gpipe, lower, one_f_one_b, validate


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_just_in_time_receives_are_nccl_safe(generator):
    for num_stages in range(1, 7):
        for num_microbatches in range(1, 10):
            lowered = lower(generator(num_stages, num_microbatches), num_stages, prefetch=False)
            validate(lowered, num_stages, num_microbatches, in_order=True)


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_early_receives_deadlock_under_in_order_transfers(generator):
    """Why the runtime prefetches receives on gloo only: on NCCL the early receive blocks the sends behind it."""
    lowered = lower(generator(2, 4), 2, prefetch=True)
    validate(lowered, 2, 4)  # fine where transfers are independent (gloo)
    with pytest.raises(ScheduleError, match="in order"):
        validate(lowered, 2, 4, in_order=True)


class _OneHandle:
    """The one Work handle NCCL gives a batch of transfers: waiting for it waits for all of them."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()

    def is_completed(self):
        return all(work.is_completed() for work in self.works)


def _just_in_time_step(rank: int, world_size: int, schedule: str) -> dict:
    model = build("llama", 4)
    x, y = make_batch(6, 5, num_microbatches=3)
    _, expected, _ = reference_step(model, x, y)
    pipe = pp.Pipeline(model, schedule=schedule, num_microbatches=3, device="cpu", split=3)
    assert pipe.comm.prefetch_receives  # gloo
    pipe.comm.prefetch_receives = False  # as on NCCL: the step plans the in-order program
    post = pipe.comm.post
    pipe.comm.post = lambda ops: [_OneHandle(post(ops))]  # and the runtime gets one handle per batch
    pipe.step(x, y)
    assert pipe.program == build_schedule(schedule, world_size, 3, prefetch=False, split=3)[rank]
    return {name: torch.allclose(p.grad, expected[name], atol=1e-5, rtol=0) for name, p in pipe.named_parameters()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_just_in_time_program_gives_exact_gradients(schedule):
    """As NCCL runs it: receives posted just in time, one handle for each batch of transfers (the runtime's path for
    a backend that gives no handle per transfer, which gloo's tests would not take otherwise)."""
    for per_rank in run_distributed(_just_in_time_step, 2, schedule, timeout=120):
        assert per_rank and all(per_rank.values()), per_rank


def _prefetches(rank: int, world_size: int) -> tuple[bool, str]:
    return pp.Pipeline(build("llama", 4), num_microbatches=2, device="cpu").comm.prefetch_receives, dist.get_backend()


@pytest.mark.parametrize("backend", [None, "gloo", "cpu:gloo"])
def test_receives_are_prefetched_whenever_gloo_carries_the_transfers(backend):
    """Also when the group was made without naming a backend, which torch reports as "undefined"."""
    for prefetches, reported in run_distributed(_prefetches, 2, backend=backend):
        assert prefetches, reported
