"""GPipe / all-forward-all-backward (AFAB): every forward first, then every backward.

Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", 2019. p = 4 stages, m = 4 microbatches, unit-time F (number) and B (bN):

    rank 0:  0  1  2  3  .  .  .  .  .  . b3 b2 b1 b0
    rank 1:  .  0  1  2  3  .  .  .  . b3 b2 b1 b0
    rank 2:  .  .  0  1  2  3  .  . b3 b2 b1 b0
    rank 3:  .  .  .  0  1  2  3 b3 b2 b1 b0

Bubble fraction (p - 1) / (m + p - 1); every rank holds the activations of all m
microbatches at the peak, which is what 1F1B improves on.
"""

from __future__ import annotations

from .._checks import check_int
from .actions import B, F, Schedule


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """Per-rank compute actions: F of all microbatches, then B in reverse order."""
    num_stages, num_microbatches = check_int("num_stages", num_stages), check_int("num_microbatches", num_microbatches)
    schedule = []
    for stage in range(num_stages):
        forwards = [F(stage, mb) for mb in range(num_microbatches)]
        # Backwards in reverse order: the last microbatch's activations are the freshest.
        backwards = [B(stage, mb) for mb in reversed(range(num_microbatches))]
        schedule.append(forwards + backwards)
    return schedule
