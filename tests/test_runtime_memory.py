"""The runtime keeps only the activations its schedule promises: 1F1B's memory does not grow with m."""

from __future__ import annotations

import pytest
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
