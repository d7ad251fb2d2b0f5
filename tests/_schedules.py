"""Test helper: schedules written by hand for the tests of more than one file."""

from __future__ import annotations

from pipeline_parallel.schedules import B, F, stages_of_rank


def looped(num_ranks: int, num_stages: int, num_microbatches: int):
    """Each rank runs the forwards of its stages in order, then their backwards in reverse order."""
    schedule = []
    for rank in range(num_ranks):
        stages = stages_of_rank(rank, num_stages, num_ranks)
        schedule.append([F(stage, mb) for stage in stages for mb in range(num_microbatches)]
                        + [B(stage, mb) for stage in reversed(stages) for mb in range(num_microbatches)])
    return schedule
