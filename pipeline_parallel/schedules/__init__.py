"""Pipeline schedules as data: generators, lowering to communication, and validation."""

from __future__ import annotations

from .actions import Action, B, F, I, Kind, Schedule, W, stage_to_rank, stages_of_rank
from .gpipe import gpipe
from .lowering import lower
from .one_f_one_b import one_f_one_b
from .simulate import makespan, simulate
from .split import choose_split, estimated_duration, split_backwards
from .validate import ScheduleError, validate

SCHEDULES = {"gpipe": gpipe, "afab": gpipe, "1f1b": one_f_one_b}


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, prefetch: bool = True, forward_only: bool = False,
    stage_costs: list[float] | None = None, split: int | None = None,
) -> Schedule:
    """The validated, lowered per-rank action lists of a named schedule (`forward_only`: its forwards).

    Each rank's last `split` backwards are split into I and W (see `split_backwards`) or, by
    default, whichever split the simulator finds fastest for these relative forward costs per
    stage (equal if None; see `choose_split`); the costs also decide where each W goes.
    """
    key = name.lower() if isinstance(name, str) else None
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    compute = SCHEDULES[key](num_stages, num_microbatches)
    if forward_only:
        compute = [[a for a in actions if a.kind == Kind.F] for actions in compute]
    elif split is not None:
        compute = split_backwards(compute, num_stages, split, estimated_duration(stage_costs or [1.0] * num_stages))
    else:
        compute = choose_split(compute, num_stages, stage_costs or [1.0] * num_stages)
    lowered = lower(compute, num_stages, prefetch=prefetch)
    # Without prefetch the list is meant for NCCL too, whose in-order transfers are checked as well.
    validate(lowered, num_stages, num_microbatches, forward_only=forward_only, in_order=not prefetch)
    return lowered


__all__ = [
    "Action", "B", "F", "I", "Kind", "SCHEDULES", "Schedule", "ScheduleError", "W", "build_schedule",
    "choose_split", "estimated_duration", "gpipe", "lower", "makespan", "one_f_one_b", "simulate", "split_backwards", "stage_to_rank",
    "stages_of_rank", "validate",
]
