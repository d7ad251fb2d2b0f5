"""1F1B: a short warm-up of forwards, then alternate one forward and one backward.

Narayanan et al., "PipeDream" (2019) and "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (2021), non-interleaved schedule. p = 4, m = 6, unit-time F
(number) and B (bN):

    rank 0:  0  1  2  3  .  .  . b0  4 b1  5 b2  . b3  . b4  . b5
    rank 1:  .  0  1  2  .  . b0  3 b1  4 b2  5 b3  . b4  . b5
    rank 2:  .  .  0  1  . b0  2 b1  3 b2  4 b3  5 b4  . b5
    rank 3:  .  .  .  0 b0  1 b1  2 b2  3 b3  4 b4  5 b5

Same bubble as GPipe, (p - 1) / (m + p - 1), but rank r holds at most p - r microbatches'
activations instead of m: memory no longer grows with the number of microbatches.
"""

from __future__ import annotations

from .._checks import check_int
from .actions import B, F, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Per-rank compute actions of the non-interleaved 1F1B schedule."""
    num_stages, num_microbatches = check_int("num_stages", num_stages), check_int("num_microbatches", num_microbatches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [F(stage, mb) for mb in range(warmup)]
        for i in range(num_microbatches - warmup):  # steady state: one forward, one backward
            actions += [F(stage, warmup + i), B(stage, i)]
        actions += [B(stage, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule
