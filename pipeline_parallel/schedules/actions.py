"""The action IR: a schedule is, for every rank, a list of actions on (stage, microbatch)."""

from __future__ import annotations

import functools
from enum import Enum
from typing import NamedTuple

from .._checks import check_int, is_int


class Kind(str, Enum):
    """What an action does. Compute kinds come from a schedule; comm kinds from `lower`."""

    F = "F"  # forward of one microbatch through one stage
    B = "B"  # full backward (input and weight gradients) of one microbatch
    I = "I"  # noqa: E741 - backward for the input gradient only; its weight gradients wait for W
    W = "W"  # weight gradients of a microbatch whose I has run
    SEND_F = "SEND_F"  # send this stage's forward output to the next stage
    RECV_F = "RECV_F"  # receive this stage's forward input from the previous stage
    SEND_B = "SEND_B"  # send this stage's input gradient to the previous stage
    RECV_B = "RECV_B"  # receive this stage's output gradient from the next stage

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS


_SENDS, _RECVS = {Kind.SEND_F, Kind.SEND_B}, {Kind.RECV_F, Kind.RECV_B}
_COMM = _SENDS | _RECVS


class Action(NamedTuple):
    """One step of a rank's program: `F(2, 5)` (stage 2's forward of microbatch 5, shown F2.5), or a transfer
    the lowering adds, such as `Action(Kind.RECV_B, 1, 0)` (RECV_B1.0)."""

    kind: Kind
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{getattr(self.kind, 'value', self.kind)}{self.stage}.{self.mb}"


def F(stage: int, mb: int) -> Action:
    return Action(Kind.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Kind.B, stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743
    return Action(Kind.I, stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action(Kind.W, stage, mb)


def backward_next(actions: list[Action]) -> set[Action]:
    """The forwards of a rank's list whose backward (B or I) is its next compute action: a stage that recomputes
    (`PipelineStage.recompute`) keeps their graph, as nothing would be held beside it (1F1B's last stage)."""
    compute = [a for a in actions if not a.kind.is_comm]
    return {forward for forward, after in zip(compute, compute[1:])
            if forward.kind == Kind.F and after.kind in (Kind.B, Kind.I) and after[1:] == forward[1:]}


def recomputed(schedule: Schedule) -> set[tuple[int, int]]:
    """The (stage, mb) whose forward a stage that recomputes runs again before its backward: all but `backward_next`."""
    return {(a.stage, a.mb) for actions in schedule for a in set(actions) - backward_next(actions)
            if a.kind == Kind.F}


@functools.lru_cache(maxsize=1 << 16)
def result_of(action: Action) -> Action | None:
    """What a compute action hands to a neighbouring stage: the activation `F(stage, mb)` or the
    input gradient, named `B(stage, mb)` whether a B or an I made it; W hands on nothing."""
    if action.kind == Kind.W:
        return None
    return Action(Kind.F if action.kind == Kind.F else Kind.B, action.stage, action.mb)


def user_of(action: Action, num_stages: int) -> int | None:
    """The stage that takes a compute action's result (see `result_of`): the next one for a
    forward, the previous one for an input gradient; None if there is no such stage or result."""
    if result_of(action) is None:
        return None
    user = action.stage + 1 if action.kind == Kind.F else action.stage - 1
    return user if 0 <= user < num_stages else None


@functools.lru_cache(maxsize=1 << 16)
def input_of(action: Action, num_stages: int) -> Action | None:
    """The neighbour's result (see `result_of`) that `action` consumes: the previous stage's
    activation for F, the next stage's input gradient for B and I; None where the input comes
    from the data (first F, last B or I) or from this stage itself (W, after its I)."""
    if action.kind == Kind.W:
        return None
    source = action.stage - 1 if action.kind == Kind.F else action.stage + 1
    return result_of(action._replace(stage=source)) if 0 <= source < num_stages else None


def peer_stage(action: Action) -> int:
    """The stage at the other end of a comm action's transfer: the next one for SEND_F and RECV_B,
    the previous one for RECV_F and SEND_B."""
    return action.stage + (1 if action.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


def sent_by(send: Action) -> Action:
    """The result a SEND hands on (see `result_of`): F(stage, mb), or B(stage, mb) whether a B or an I made it."""
    return Action(Kind.F if send.kind == Kind.SEND_F else Kind.B, send.stage, send.mb)


def recv_of(action: Action) -> Action:
    """The RECV that brings a compute action its input from another rank."""
    return Action(Kind.RECV_F if action.kind == Kind.F else Kind.RECV_B, action.stage, action.mb)


def stage_to_rank(stage: int, num_ranks: int) -> int:
    """Stages are dealt to ranks round-robin: one stage per rank, or several (interleaved) in a loop."""
    return stage % num_ranks


def peer_rank(action: Action, num_ranks: int) -> int:
    """The rank at the other end of a comm action's transfer (see `peer_stage`)."""
    return stage_to_rank(peer_stage(action), num_ranks)


def stages_of_rank(rank: int, num_stages: int, num_ranks: int) -> list[int]:
    """The stages a rank runs, in order."""
    return list(range(rank, num_stages, num_ranks))


Schedule = list[list[Action]]  # one action list per rank


class ScheduleError(ValueError):
    """A schedule that would compute wrongly, mismatch messages or hang."""


def check_well_formed(schedule: Schedule, num_stages: int) -> int:
    """Raise ScheduleError unless `schedule` is something every tool can replay; returns `num_stages`.

    That is: one list of Actions per rank, each on an existing stage that rank owns (see
    `stage_to_rank`), every stage with some action, none listed twice, a B or I after the F of
    its stage and microbatch and a W after its I, no I or W on the first stage (it has no input
    gradient), one B or one I per stage and microbatch, and transfers only with a stage on another rank.
    """
    num_stages = check_int("num_stages", num_stages)
    if (not isinstance(schedule, (list, tuple)) or not schedule
            or not all(isinstance(actions, (list, tuple)) and not isinstance(actions, Action) for actions in schedule)):
        raise ScheduleError(f"a schedule is a list holding one list of actions per rank, such as "
                            f"[[F(0, 0), B(0, 0)]]; got {schedule!r:.200}")
    num_ranks = len(schedule)
    if num_ranks > num_stages:
        raise ScheduleError(f"the schedule has lists for {num_ranks} ranks but num_stages is {num_stages}; every "
                            "rank runs at least one stage: is num_stages right?")
    present = set()
    for rank, actions in enumerate(schedule):
        seen = set()
        for index, a in enumerate(actions):
            if not (isinstance(a, Action) and isinstance(a.kind, Kind) and is_int(a.stage) and is_int(a.mb)):
                raise ScheduleError(f"item {index} of rank {rank}'s list is {a!r:.100}, not an Action; build actions "
                                    "with F(stage, mb), B, I, W, or Action(Kind.SEND_F, stage, mb) and the like")
            problem = _problem(a, rank, num_ranks, num_stages, seen)
            if problem:
                raise ScheduleError(f"rank {rank} runs {a!r}{problem}")
            seen.add(a)
            present.add(a.stage)
    absent = sorted(set(range(num_stages)) - present)
    if absent:
        raise ScheduleError(f"no rank runs an action of stage {absent[0]} of {num_stages}: is num_stages right?")
    return num_stages


def _problem(a: Action, rank: int, num_ranks: int, num_stages: int, seen: set) -> str | None:
    """What is wrong with running `a` next on `rank` after the actions `seen` (see `check_well_formed`)."""
    if not 0 <= a.stage < num_stages or a.mb < 0:
        return f", but the stages are 0..{num_stages - 1} and microbatches count from 0"
    if stage_to_rank(a.stage, num_ranks) != rank:
        return (f", but stage {a.stage} belongs to rank {stage_to_rank(a.stage, num_ranks)}: stages are dealt to the "
                "ranks round-robin, stage s to rank s % (number of ranks)")
    if a in seen:
        return " more than once"
    if a.kind.is_comm:
        peer = peer_stage(a)
        if not 0 <= peer < num_stages:
            return f", but stage {a.stage} has no {'next' if peer > a.stage else 'previous'} stage to exchange data with"
        if stage_to_rank(peer, num_ranks) == rank:
            return (f", but stage {peer} is on the same rank, which hands the data over in memory: drop it (lower() "
                    "adds transfers between ranks only)")
    elif a.kind in (Kind.I, Kind.W) and a.stage == 0:
        return ", but the first stage has no input gradient to send early: run B"
    elif a.kind in (Kind.B, Kind.I) and F(a.stage, a.mb) not in seen:
        return " before the forward of that stage and microbatch"
    elif a.kind == Kind.W and I(a.stage, a.mb) not in seen:
        return " before the I of that stage and microbatch"
    elif a.kind in (Kind.B, Kind.I) and (B(a.stage, a.mb) in seen or I(a.stage, a.mb) in seen):
        return ", but that input gradient is made already: run one B, or an I and its W"
    return None
