"""The action IR: a schedule is, for every rank, a list of actions on (stage, microbatch)."""

from __future__ import annotations

import functools
from enum import Enum
from typing import NamedTuple


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


_COMM = {Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B}


class Action(NamedTuple):
    """One step of a rank's program, e.g. `F(stage=2, mb=5)` or `RECV_B(stage=1, mb=0)`."""

    kind: Kind
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.mb}"


def F(stage: int, mb: int) -> Action:
    return Action(Kind.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Kind.B, stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743
    return Action(Kind.I, stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action(Kind.W, stage, mb)


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


def stage_to_rank(stage: int, num_ranks: int) -> int:
    """Stages are dealt to ranks round-robin: one stage per rank, or several (interleaved) in a loop."""
    return stage % num_ranks


def stages_of_rank(rank: int, num_stages: int, num_ranks: int) -> list[int]:
    """The stages a rank runs, in order."""
    return list(range(rank, num_stages, num_ranks))


Schedule = list[list[Action]]  # one action list per rank
