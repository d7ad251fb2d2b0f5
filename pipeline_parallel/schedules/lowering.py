"""Lowering: add the sends and receives that a compute-only schedule implies."""

from __future__ import annotations

from .actions import (Action, Kind, Schedule, ScheduleError, check_well_formed, input_of, peer_stage, recv_of,
                      stage_to_rank, user_of)


def lower(schedule: Schedule, num_stages: int, prefetch: bool = True) -> Schedule:
    """Insert SEND/RECV actions around each rank's compute actions.

    A forward output goes to the next stage and an input gradient to the previous one, unless
    that stage lives on the same rank (then the runtime hands it over in memory). With
    `prefetch`, the receive a compute action needs is posted one compute action earlier, so
    the transfer overlaps the work in between instead of sitting on the critical path.
    """
    check_well_formed(schedule, num_stages)
    lowered_already = next((a for actions in schedule for a in actions if a.kind.is_comm), None)
    if lowered_already is not None:
        raise ScheduleError(f"lower() takes compute actions only, but the schedule holds {lowered_already!r}: "
                            "it is lowered already")
    return add_transfers(schedule, num_stages, prefetch)


def add_transfers(schedule: Schedule, num_stages: int, prefetch: bool = True) -> Schedule:
    """`lower` without checking the schedule: for `build_schedule`, which validates the result."""
    num_ranks = len(schedule)
    lowered: Schedule = []
    for rank, actions in enumerate(schedule):
        recvs = [recv_for(a, num_stages, num_ranks) for a in actions]
        program: list[Action] = []
        if prefetch and recvs:
            program += recvs[0]
        for i, action in enumerate(actions):
            if prefetch:
                program += recvs[i + 1] if i + 1 < len(actions) else []
            else:
                program += recvs[i]
            program.append(action)
            program += send_for(action, num_stages, num_ranks)
        lowered.append(program)
    return lowered


def _remote(stage: int, peer: int | None, num_ranks: int) -> bool:
    return peer is not None and stage_to_rank(peer, num_ranks) != stage_to_rank(stage, num_ranks)


def send_for(action: Action, num_stages: int, num_ranks: int) -> list[Action]:
    """The SEND a compute action's result needs ([] if its user is on the same rank or there is none)."""
    if not _remote(action.stage, user_of(action, num_stages), num_ranks):
        return []
    kind = Kind.SEND_F if action.kind == Kind.F else Kind.SEND_B
    return [Action(kind, action.stage, action.mb)]


def recv_for(action: Action, num_stages: int, num_ranks: int) -> list[Action]:
    """The RECV a compute action's input needs ([] if it comes from the data or from this rank)."""
    source = input_of(action, num_stages)
    if source is None or not _remote(action.stage, source.stage, num_ranks):
        return []
    return [recv_of(action)]


def message(action: Action) -> tuple[str, int, int]:
    """The identity of the transfer a comm action takes part in: (direction, sender stage, mb).

    SEND_F(s, mb) and RECV_F(s + 1, mb) are the same message; so are SEND_B(s, mb) and
    RECV_B(s - 1, mb). Matching on this is how the checker pairs sends with receives.
    """
    if not action.kind.is_comm:
        raise ValueError(f"{action!r} is not a communication action")
    direction = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    sender = action.stage if action.kind.is_send else peer_stage(action)
    return (direction, sender, action.mb)
