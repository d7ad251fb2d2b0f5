"""A pass over compute schedules: which backwards send their input gradient before their weight gradients."""

from __future__ import annotations

from .actions import I, Kind, Schedule, W
from .simulate import makespan, simulate

SPLITS = ("none", "last", "cooldown")
SPLIT_OVERHEAD = 0.1  # a split backward's extra cost, as a share of the whole one (graph walk, two passes)


def split_backwards(schedule: Schedule, which: str) -> Schedule:
    """Turn chosen B actions into I then W (never on the first stage, which has no input gradient).

    `which`: "none"; "last", each rank's last backward, which ends the step; or "cooldown",
    every backward after the rank's last forward, where the earlier stages only wait for
    gradients. A split backward hands its input gradient on as soon as it is computed and
    makes its weight gradients while the earlier stages work, at the cost of a graph walk.
    """
    if which not in SPLITS:
        raise ValueError(f"unknown split {which!r}; choose one of {SPLITS}")
    result = []
    for actions in schedule:
        backwards = [i for i, a in enumerate(actions) if a.kind == Kind.B and a.stage > 0]
        last_forward = max((i for i, a in enumerate(actions) if a.kind == Kind.F), default=-1)
        chosen = {"none": set(), "last": set(backwards[-1:]),
                  "cooldown": {i for i in backwards if i > last_forward}}[which]
        split = []
        for i, a in enumerate(actions):
            split += [I(a.stage, a.mb), W(a.stage, a.mb)] if i in chosen else [a]
        result.append(split)
    return result


def choose_split(schedule: Schedule, num_stages: int, stage_costs: list[float]) -> Schedule:
    """The split (see `split_backwards`) under which the simulator finds the shortest step.

    A stage's forward costs `stage_costs[stage]`, its backward twice that, and each half of a
    split backward half of that plus SPLIT_OVERHEAD / 2. A split is kept only if it is strictly
    faster than the one with fewer split backwards before it.
    """
    def cost(action) -> float:
        forward = stage_costs[action.stage]
        return {Kind.F: forward, Kind.B: 2 * forward}.get(action.kind, forward * (1 + SPLIT_OVERHEAD))

    best, best_time = schedule, makespan(simulate(schedule, num_stages, cost))
    for which in SPLITS[1:]:
        candidate = split_backwards(schedule, which)
        time = makespan(simulate(candidate, num_stages, cost))
        if time < best_time - 1e-9 * best_time:
            best, best_time = candidate, time
    return best
