"""Replay a schedule in time: when each compute action starts and ends, given how long each takes."""

from __future__ import annotations

from typing import Callable

from .actions import Action, Schedule, input_of, result_of, stage_to_rank
from .validate import ScheduleError


def simulate(
    schedule: Schedule, num_stages: int, duration: Callable[[Action], float], transfer: float = 0.0
) -> dict[Action, tuple[float, float]]:
    """Start and end time of every compute action when each rank runs its list in order.

    An action starts once its rank is free and its input exists: the previous stage's forward
    for F, the next stage's input gradient for B and I, plus `transfer` when that stage is on
    another rank (a W follows its I on the same rank).
    Comm actions of a lowered list are skipped (transfers cost `transfer`). The largest end
    time is the step time this schedule allows with these compute times: with times measured in
    a real run and `transfer=0`, no engine can run the schedule faster.
    """
    num_ranks = len(schedule)
    programs = [[a for a in actions if not a.kind.is_comm] for actions in schedule]
    times: dict[Action, tuple[float, float]] = {}
    results: dict[Action, float] = {}  # when each result (see `result_of`) was made
    clocks, pcs = [0.0] * num_ranks, [0] * num_ranks
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            while pcs[rank] < len(program):
                action = program[pcs[rank]]
                source = input_of(action, num_stages)
                if source is not None and source not in results:
                    break
                ready = 0.0
                if source is not None:
                    remote = stage_to_rank(source.stage, num_ranks) != rank
                    ready = results[source] + (transfer if remote else 0.0)
                start = max(clocks[rank], ready)
                clocks[rank] = start + duration(action)
                times[action] = (start, clocks[rank])
                results[result_of(action)] = clocks[rank]
                pcs[rank] += 1
                progressed = True
    stuck = [f"rank {r} at {p[pc]!r}" for r, (pc, p) in enumerate(zip(pcs, programs)) if pc < len(p)]
    if stuck:
        raise ScheduleError(f"schedule deadlocks: {', '.join(stuck)}")
    return times


def makespan(times: dict[Action, tuple[float, float]]) -> float:
    """The step time of a simulated schedule: when its last action ends."""
    return max((end for _, end in times.values()), default=0.0)
