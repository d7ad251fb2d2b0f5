"""Pipeline schedules as data: generators, the split of backwards into I and W, lowering to communication,
validation, the simulator, and when each send may be let go of."""

from __future__ import annotations

from .._checks import check_bool, check_int
from .actions import Action, B, F, I, Kind, Schedule, W, backward_next, recomputed, stage_to_rank, stages_of_rank
from .gpipe import gpipe
from .lowering import add_transfers, lower
from .one_f_one_b import one_f_one_b
from .releases import send_releases
from .simulate import makespan, simulate
from .split import choose_split, estimated_duration, planned_duration, planned_split, split_backwards
from .validate import ScheduleError, validate

SCHEDULES = {"gpipe": gpipe, "afab": gpipe, "1f1b": one_f_one_b}


def schedule_name(name) -> str:
    """The name a schedule goes by, for ranks to compare: "gpipe" for "afab" too, as written otherwise."""
    key = str(name).lower()
    return next((each for each, generator in SCHEDULES.items() if generator is SCHEDULES.get(key)), key)


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, prefetch: bool = True, forward_only: bool = False,
    stage_costs: list[float] | None = None, split: int | None = None, recompute: bool = False,
) -> Schedule:
    """The validated, lowered per-rank action lists of a named schedule (`forward_only`: its forwards).

    Each rank's last `split` backwards are split into I and W (see `split_backwards`) or, by
    default, whichever split the simulator finds fastest for these relative forward costs per
    stage (equal if None; see `choose_split`); the costs also decide where each W goes. With
    `prefetch` each receive is posted one compute action before the action that needs it (see
    `lower`); without, right before it, in the order NCCL needs, which is checked too. With
    `recompute` the split is planned for stages that run a forward again before its backward
    (`actions.recomputed`).
    """
    key = name.lower() if isinstance(name, str) else None
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    num_stages, num_microbatches = check_int("num_stages", num_stages), check_int("num_microbatches", num_microbatches)
    check_bool("prefetch", prefetch)
    check_bool("forward_only", forward_only)
    check_bool("recompute", recompute)
    if forward_only and split is not None:
        raise ValueError(f"split={split!r} with forward_only=True: a forward-only schedule has no backwards to split")
    compute = SCHEDULES[key](num_stages, num_microbatches)
    duration = planned_duration(stage_costs, num_stages, compute, recompute)
    if forward_only:
        compute = [[a for a in actions if a.kind == Kind.F] for actions in compute]
    else:
        compute = planned_split(compute, num_stages, split, duration)
    # The passes take the generator's list unchecked: `validate` checks what they make, once.
    lowered = add_transfers(compute, num_stages, prefetch=prefetch)
    # Without prefetch the list is meant for NCCL too, whose in-order transfers are checked as well.
    validate(lowered, num_stages, num_microbatches, forward_only=forward_only, in_order=not prefetch)
    return lowered


__all__ = [
    "Action", "B", "F", "I", "Kind", "SCHEDULES", "Schedule", "ScheduleError", "W", "backward_next", "build_schedule",
    "choose_split", "estimated_duration", "gpipe", "lower", "makespan", "one_f_one_b", "recomputed", "schedule_name",
    "send_releases", "simulate", "split_backwards", "stage_to_rank", "stages_of_rank", "validate",
]
