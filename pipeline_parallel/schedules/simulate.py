"""Replay a schedule in time: when each compute action starts and ends, given how long each takes."""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from collections import deque
from typing import Callable

from .._checks import check_bool, check_nonnegative
from .actions import Action, Kind, Schedule, ScheduleError, W, check_well_formed, input_of, result_of, stage_to_rank

_HELD = {Kind.F: 1, Kind.B: -1, Kind.W: -1}  # microbatches whose activations a rank holds


def simulate(
    schedule: Schedule, num_stages: int, duration: Callable[[Action], float], transfer: float = 0.0,
    split_waited: bool = False,
) -> dict[Action, tuple[float, float]]:
    """Start and end time of every compute action when each rank runs its list in order.

    An action starts once its rank is free and its input exists: the previous stage's forward
    for F, the next stage's input gradient for B and I, plus `transfer` when that stage is on
    another rank. Comm actions of a lowered list are skipped (transfers cost `transfer`). The
    largest end time is the step time this schedule allows with these compute times: with times
    measured in a real run and `transfer=0`, no engine can run the schedule faster.

    An I whose W is not in the list has its W placed here, the way `split_backwards` places it:
    when the rank would otherwise wait for an input, before a forward that would make the rank
    hold more microbatches than the list ever does, or at the end. The result is in execution
    order on each rank, so it also says where each W went.

    With `split_waited`, a B whose input gradient another rank would otherwise wait for runs as
    I (its W placed as above): the gradient is handed on a weight pass sooner exactly where that
    shortens someone's wait. A list no rank could run as given raises ScheduleError (see
    `check_well_formed`); `validate` checks the rest (every microbatch, matching transfers).
    """
    num_stages = check_well_formed(schedule, num_stages)
    transfer = check_nonnegative("transfer", transfer, hint=" (the time a transfer between ranks takes)")
    check_bool("split_waited", split_waited)
    return Replay(schedule, num_stages, checked_duration(duration), transfer, split_waited).run()


class Replay:
    """A replay in progress, of arguments `simulate` checked or the package made itself: `run` takes
    it to the end, `fork` to another schedule from where it is."""

    def __init__(self, schedule: Schedule, num_stages: int, duration: Callable[[Action], float],
                 transfer: float = 0.0, split_waited: bool = False):
        self.num_stages, self.duration, self.transfer = num_stages, duration, transfer
        num_ranks = len(schedule)
        self.programs = [[a for a in actions if not a.kind.is_comm] for actions in schedule]
        self.listed = {a for program in self.programs for a in program if a.kind == Kind.W}
        self.limits = [_peak_held(program, self.listed) for program in self.programs]
        self.times: dict[Action, tuple[float, float]] = {}
        self.results: dict[Action, float] = {}  # when each result (see `result_of`) was made
        self.clocks, self.pcs, self.held = [0.0] * num_ranks, [0] * num_ranks, [0] * num_ranks
        self.unplaced: list[deque[Action]] = [deque() for _ in range(num_ranks)]  # W's waiting for a slot
        self.awaited: dict[Action, int] = {}  # a result no action has made yet -> the rank waiting for it
        self.free = [(0.0, r) for r in range(num_ranks) if self.programs[r]]  # a heap: (clock, rank) able to move
        self.forecast = _Forecast(self.programs, num_stages, duration) if split_waited else None

    def fork(self, programs: list[list[Action]]) -> Replay:
        """This replay, to go on with `programs`: its compute actions, with B's that have not run yet
        as I's whose W's are not listed (see `split_backwards`); without `split_waited`."""
        fork = copy.copy(self)
        fork.programs = programs
        fork.times, fork.results, fork.awaited = dict(self.times), dict(self.results), dict(self.awaited)
        fork.clocks, fork.pcs, fork.held, fork.free = [*self.clocks], [*self.pcs], [*self.held], [*self.free]
        fork.unplaced = [deque(waiting) for waiting in self.unplaced]
        return fork

    def run(self, before: Callable[[int, int], None] | None = None) -> dict[Action, tuple[float, float]]:
        """Run to the end; returns each compute action's (start, end), in execution order on each rank.
        `before(rank, index)` is called before `rank` moves on at that index of its list."""
        programs, pcs, clocks, held, free = self.programs, self.pcs, self.clocks, self.held, self.free
        times, results, awaited, unplaced = self.times, self.results, self.awaited, self.unplaced
        num_stages, num_ranks, duration, transfer = self.num_stages, len(programs), self.duration, self.transfer
        listed, limits, forecast = self.listed, self.limits, self.forecast

        def ready_time(rank: int, action: Action) -> float | None:
            source = input_of(action, num_stages)
            if source is None:
                return 0.0
            made = results.get(source)
            if made is None or stage_to_rank(source.stage, num_ranks) == rank:
                return made
            return made + transfer

        def run(rank: int, action: Action, start: float) -> None:
            clocks[rank] = end = start + duration(action)
            times[action] = (start, end)
            result = result_of(action)
            if result is not None:
                results[result] = end
                user = awaited.pop(result, None)
                if user is not None:  # it may go on
                    heapq.heappush(free, (clocks[user], user))
            held[rank] += _HELD.get(action.kind, 0)
            if action.kind == Kind.I and (weights := W(action.stage, action.mb)) not in listed:
                unplaced[rank].append(weights)

        while free:
            if before is not None:
                before(free[0][1], pcs[free[0][1]])
            now, rank = heapq.heappop(free)  # the earliest free rank moves next
            program, pc = programs[rank], pcs[rank]
            action = program[pc] if pc < len(program) else None
            ready = None if action is None else ready_time(rank, action)
            over_limit = action is not None and action.kind == Kind.F and held[rank] >= limits[rank]
            # A waiting W goes first where the rank would sit idle, or hold one microbatch more than its list ever does.
            if unplaced[rank] and (ready is None or ready > now or over_limit):
                run(rank, unplaced[rank].popleft(), now)
            elif ready is not None:
                start = max(now, ready)
                if forecast is not None and forecast.waited(rank, action, start + duration(action), clocks, pcs):
                    action = Action(Kind.I, action.stage, action.mb)
                run(rank, action, start)
                pcs[rank] = pc = pc + 1
            else:  # idle until its input is made (see `run`); then it is ready at max(now, ready)
                awaited[input_of(action, num_stages)] = rank
                continue
            if pc < len(program) or unplaced[rank]:
                heapq.heappush(free, (clocks[rank], rank))
        if awaited:
            stuck = [f"rank {r} at {programs[r][pcs[r]]!r}" for r in sorted(awaited.values())]
            raise ScheduleError(f"schedule deadlocks: {', '.join(stuck)}")
        return times


class _Forecast:
    """For `split_waited`: when each rank will need each input, if it runs its list without waiting."""

    def __init__(self, programs: list[list[Action]], num_stages: int, duration: Callable[[Action], float]):
        self.users: dict[Action, tuple[int, int]] = {}  # a result -> (rank, index in its list) of its user
        for rank, program in enumerate(programs):
            for index, action in enumerate(program):
                if input_of(action, num_stages) is not None:
                    self.users[input_of(action, num_stages)] = (rank, index)
        # busy[r][i]: the compute time of rank r's first i listed actions
        self.busy = [list(itertools.accumulate(map(duration, program), initial=0.0)) for program in programs]

    def waited(self, rank: int, action: Action, end: float, clocks: list[float], pcs: list[int]) -> bool:
        """Whether the rank that uses this B's input gradient would be idle if a whole B made it by `end`."""
        if action.kind != Kind.B or result_of(action) not in self.users:
            return False  # the first stage's input gradient has no user
        user, needed_by = self.users[result_of(action)]
        if user == rank:
            return False
        return clocks[user] + self.busy[user][needed_by] - self.busy[user][pcs[user]] < end


def _peak_held(program: list[Action], listed: set[Action]) -> int:
    """The most microbatches a rank's list holds at once, counting an I without a listed W as a B."""
    held = peak = 0
    for a in program:
        held += -1 if a.kind == Kind.I and W(a.stage, a.mb) not in listed else _HELD.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def makespan(times: dict[Action, tuple[float, float]]) -> float:
    """The step time of a simulated schedule: when its last action ends."""
    return max((end for _, end in times.values()), default=0.0)


def checked_duration(duration: Callable[[Action], float]) -> Callable[[Action], float]:
    """`duration`, raising a clear error for a time that is negative, infinite or not a number."""
    if not callable(duration):
        raise TypeError(f"duration must be a function that gives a compute action's time, such as "
                        f"`lambda action: 1.0`, got {duration!r:.200}")

    def checked(action: Action) -> float:
        seconds = duration(action)
        if isinstance(seconds, float) and 0 <= seconds < math.inf:  # the usual case, without building a name
            return seconds
        return check_nonnegative(f"the duration of {action!r}", seconds)

    return checked
