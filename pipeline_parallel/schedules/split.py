"""A pass over compute schedules: which backwards send their input gradient before their weight gradients."""

from __future__ import annotations

from collections.abc import Mapping, Set as AbstractSet
from typing import Callable

from .._checks import check_int, check_nonnegative, check_positive
from .actions import Action, I, Kind, Schedule, check_well_formed, recomputed, stage_to_rank
from .simulate import Replay, checked_duration, makespan

SPLIT_OVERHEAD = 0.1  # a split backward's extra cost, as a share of the whole one (graph walk, two passes)


def split_backwards(schedule: Schedule, num_stages: int, split: int, duration: Callable[[Action], float]) -> Schedule:
    """Turn each rank's last `split` backwards into I, and place their W's by simulation.

    An I computes only the input gradient, so the earlier stage gets it a weight-gradient pass
    sooner; its W then fills a time the rank would spend waiting for an input (at the estimated
    `duration`s), or runs before a forward that would make the rank hold more microbatches than
    the schedule ever does, or at the end. The first stage has no input gradient and is not split.
    """
    split = _checked_split(split)
    num_stages = check_well_formed(schedule, num_stages)
    return _placed(schedule, num_stages, split, checked_duration(duration))[0]


def planned_split(schedule: Schedule, num_stages: int, split: int | None, duration: Callable[[Action], float]
                  ) -> Schedule:
    """`split_backwards`, or with `split` None the fastest split (see `choose_split`), without checking
    the schedule: for `build_schedule`, which validates the lowered result of a generator's list."""
    if split is None:
        return _fastest_split(schedule, num_stages, duration)
    return _placed(schedule, num_stages, _checked_split(split), duration)[0]


def _checked_split(split: int) -> int:
    return check_int("split", split, 0, hint=" (how many of each rank's last backwards run as input-gradient then "
                     "weight-gradient passes), or None to let the simulator choose")


def _placed(schedule: Schedule, num_stages: int, split: int, duration, split_waited: bool = False
            ) -> tuple[Schedule, float]:
    """`split_backwards`, and the step time the simulator found for it; with `split_waited` the
    simulator also splits each backward whose gradient another rank would wait for (see `simulate`)."""
    replay = Replay(_with_last_split(schedule, split), num_stages, duration, split_waited=split_waited)
    return _as_schedule(replay.run(), len(schedule))


def _with_last_split(schedule: Schedule, split: int, positions: list[list[int]] | None = None) -> Schedule:
    """Each rank's last `split` backwards as I, their W's left to the simulator (`positions`: see `_splittable`)."""
    body = [list(actions) for actions in schedule]
    for actions, indices in zip(body, positions or _splittable(schedule)):
        for i in _last(indices, split):
            actions[i] = I(actions[i].stage, actions[i].mb)
    return body


def _splittable(schedule: Schedule) -> list[list[int]]:
    """Where in each rank's list its backwards are, but the first stage's (which has no input gradient)."""
    return [[i for i, a in enumerate(actions) if a.kind == Kind.B and a.stage > 0] for actions in schedule]


def _last(indices: list[int], split: int) -> list[int]:
    return indices[max(len(indices) - split, 0):]


def _as_schedule(times: dict[Action, tuple[float, float]], num_ranks: int) -> tuple[Schedule, float]:
    """The per-rank lists a replay ran (in execution order on each rank, W's included), and its step time."""
    result: Schedule = [[] for _ in range(num_ranks)]
    for action in times:
        result[stage_to_rank(action.stage, num_ranks)].append(action)
    return result, makespan(times)


def relative_costs(stage_costs: list[float] | None, num_stages: int) -> list[float]:
    """Checked relative forward costs per stage, the largest 1 (large ones must not overflow); all 1 if None."""
    if stage_costs is None:
        return [1.0] * num_stages
    # A mapping's keys or a set's members, in any order, are no costs by stage.
    if isinstance(stage_costs, (str, bytes, Mapping, AbstractSet)) or not hasattr(stage_costs, "__len__"):
        raise ValueError(f"stage_costs must be a list of one relative cost per stage, got {stage_costs!r:.200}")
    if len(stage_costs) != num_stages:
        raise ValueError(f"stage_costs has {len(stage_costs)} entries but there are {num_stages} stages; "
                         "give one relative cost per stage")
    costs = [check_positive(f"stage_costs[{stage}]", cost) for stage, cost in enumerate(stage_costs)]
    return [cost / max(costs) for cost in costs]


def estimated_duration(stage_costs: list[float], recomputed: AbstractSet[tuple[int, int]] = frozenset()
                       ) -> Callable[[Action], float]:
    """The cost model the split is chosen with: a stage's forward costs `stage_costs[stage]`, its
    backward twice that, and each half of a split backward half of that plus SPLIT_OVERHEAD / 2; the
    backward (B or I) of a (stage, mb) in `recomputed` (see `actions.recomputed`) runs its forward again first."""
    share = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0 + SPLIT_OVERHEAD, Kind.W: 1.0 + SPLIT_OVERHEAD}
    costs = [check_nonnegative(f"stage_costs[{stage}]", cost) for stage, cost in enumerate(stage_costs)]

    def duration(action: Action) -> float:
        again = action.kind in (Kind.B, Kind.I) and (action.stage, action.mb) in recomputed
        return costs[action.stage] * (share[action.kind] + again)

    return duration


def planned_duration(stage_costs: list[float] | None, num_stages: int, schedule: Schedule, recompute: bool
                     ) -> Callable[[Action], float]:
    """The cost model a plan of `schedule` is made with (`estimated_duration`) for these relative forward costs per
    stage (see `relative_costs`); with `recompute`, the forwards whose backward does not come next on their rank run
    again (`actions.recomputed`), as the runtime does. `schedule` may be the compute list or its lowered form."""
    again = recomputed(schedule) if recompute else frozenset()
    return estimated_duration(relative_costs(stage_costs, num_stages), again)


def choose_split(schedule: Schedule, num_stages: int, stage_costs: list[float]) -> Schedule:
    """The split of backwards under which the simulator finds the shortest step with these costs.

    The candidates: each rank's last `k` backwards (`split_backwards`) for every `k` from none
    up to max(num_stages + 1, 16), then 16 more evenly spaced up to all of them (a search that
    stays quick with hundreds of microbatches and stages; over random stage costs its plan was
    within 0.02% of the best `k`); and splitting just the backwards whose gradient
    another rank would otherwise wait for, wherever they fall (GPipe's first ones, when the
    earlier stage idles until its first gradient). A candidate is kept only if strictly faster
    than every one before it, so a tie goes to the plan tried first (fewer last backwards).
    """
    num_stages = check_well_formed(schedule, num_stages)
    return _fastest_split(schedule, num_stages, estimated_duration(relative_costs(stage_costs, num_stages)))


def _fastest_split(schedule: Schedule, num_stages: int, duration: Callable[[Action], float]) -> Schedule:
    """`choose_split` with a checked schedule and cost model.

    A split of the last backwards replays as no split does until a rank reaches its first I, so
    each one is forked from the replay of no split there and replayed from that point on only.
    """
    # The indices below must be those of the replay's lists, which hold no transfers.
    schedule = [[a for a in actions if not a.kind.is_comm] for actions in schedule]
    most = max(sum(a.kind == Kind.B for a in actions) for actions in schedule)
    dense = min(most, max(num_stages + 1, 16))
    step = max(1, -(-(most - dense) // 16))
    splits = sorted({*range(1, dense + 1), *range(dense + step, most + 1, step), most} - {0})
    positions = _splittable(schedule)
    first_i = {split: [(_last(indices, split) or [len(actions)])[0] for actions, indices in zip(schedule, positions)]
               for split in splits}
    unforked = list(splits)  # the more backwards split, the sooner a replay differs from none: the last first
    step_times = {}

    def fork_where_they_differ(rank: int, index: int) -> None:
        while unforked and index >= first_i[unforked[-1]][rank]:
            split = unforked.pop()
            step_times[split] = makespan(unsplit.fork(_with_last_split(schedule, split, positions)).run())

    unsplit = Replay(schedule, num_stages, duration)
    step_times[0] = makespan(unsplit.run(fork_where_they_differ))
    step_times.update((split, step_times[0]) for split in unforked)  # no I anywhere: the same replay
    best = 0
    for split in splits:  # in this order, so a tie goes to the plan tried first (fewer last backwards)
        if _faster(step_times[split], step_times[best]):
            best = split
    waited, waited_time = _placed(schedule, num_stages, 0, duration, split_waited=True)
    return waited if _faster(waited_time, step_times[best]) else _placed(schedule, num_stages, best, duration)[0]


def _faster(time: float, than: float) -> bool:
    """Faster by more than rounding."""
    return time < than - 1e-9 * than
