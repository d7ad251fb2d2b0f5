"""1F1B: a short warm-up of forwards, then alternate one forward and one backward.

Narayanan et al., "PipeDream" (2019) and "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (2021), non-interleaved schedule. p = 4, m = 6:

    rank 0: 0 1 2 3 . . . 0 4 1 5 2 . 3 . 4 . 5
    rank 1: . 0 1 2 . . 0 3 1 4 2 5 3 . 4 . 5 .
    rank 2: . . 0 1 . 0 2 1 3 2 4 3 5 4 . 5 . .
    rank 3: . . . 0 0 1 1 2 2 3 3 4 4 5 5 . . .
            (F and B numbered by microbatch; each rank's backwards start as soon as possible)

Same bubble as GPipe, (p - 1) / (m + p - 1), but rank r holds at most p - r microbatches'
activations instead of m: memory no longer grows with the number of microbatches.
"""

from __future__ import annotations

from .actions import B, F, Schedule


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Per-rank compute actions of the non-interleaved 1F1B schedule."""
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [F(stage, mb) for mb in range(warmup)]
        for i in range(num_microbatches - warmup):  # steady state: one forward, one backward
            actions += [F(stage, warmup + i), B(stage, i)]
        actions += [B(stage, mb) for mb in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule
