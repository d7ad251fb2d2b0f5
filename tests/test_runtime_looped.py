"""The runtime runs several stages per rank, dealt round-robin as interleaved schedules place them:
a looped schedule written by hand gives the single-process loss (on every rank) and gradients."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from _models import HIDDEN, IGNORE, assert_grads_close, build, grads, layer_ranges, make_batch, reference_step
from _schedules import looped

from pipeline_parallel.comm import PipeComm
from pipeline_parallel.models.decoder import DecoderParts
from pipeline_parallel.runtime import StepData, run_step
from pipeline_parallel.schedules import lower, send_releases, simulate, stages_of_rank, validate


def _step(rank: int, world_size: int, num_stages: int, num_microbatches: int):
    from pipeline_parallel.stage import PipelineStage

    model = build("llama", num_layers=4, seed=2)
    x, y = make_batch(8, 6, num_microbatches=num_microbatches)
    expected_loss, expected, _ = reference_step(model, x, y)
    comm = PipeComm(None, "cpu")
    compute = looped(world_size, num_stages, num_microbatches)
    simulate(compute, num_stages, lambda action: 1.0)  # the simulator replays it too (raises on a deadlock)
    program = lower(compute, num_stages, prefetch=comm.prefetch_receives)
    validate(program, num_stages, num_microbatches)
    ranges = layer_ranges([4 // num_stages] * num_stages)
    stages = {stage: PipelineStage(DecoderParts.of(model, ranges[stage], stage == 0, stage == num_stages - 1),
                                   stage, num_stages)
              for stage in stages_of_rank(rank, num_stages, world_size)}
    step = StepData(activation_shape=(8 // num_microbatches, 6, HIDDEN), activation_dtype=torch.float32,
                    inputs=list(x.chunk(num_microbatches)), labels=list(y.chunk(num_microbatches)),
                    loss_scales=[1.0 / int((y != IGNORE).sum())] * num_microbatches)
    loss = run_step(program[rank], stages, comm, step, send_releases=send_releases(program, num_stages)[rank])
    assert all(stage.num_saved == 0 for stage in stages.values())
    owned = {f"{name}.{param}" for stage in stages.values() for name, module in stage.parts.named_modules()
             for param, _ in module.named_parameters()}
    got = grads(model)
    assert set(got) == owned, "a rank computes the gradients of its own stages' parameters, and only those"
    assert_grads_close(got, expected, owned, what=f"rank {rank}")
    assert bool(step.losses) == (num_stages - 1 in stages)  # computed where the last stage is
    return loss, expected_loss


@pytest.mark.parametrize("world_size, num_stages", [(1, 2), (2, 4)], ids=["1-rank-2-stages", "2-ranks-4-stages"])
def test_several_stages_per_rank_match_one_process(world_size, num_stages):
    results = run_distributed(_step, world_size, num_stages, 2, timeout=120)
    for loss, expected_loss in results:
        assert loss == pytest.approx(expected_loss, abs=1e-5)
