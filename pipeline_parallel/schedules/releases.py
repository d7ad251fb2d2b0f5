"""When a rank may let go of what it sent: as soon as the schedule proves the peer has received it."""

from __future__ import annotations

from .actions import Action, Schedule, check_well_formed
from .lowering import message, recv_for
from .validate import _check_transfers_listed, replay_order


def send_releases(lowered: Schedule, num_stages: int) -> list[dict[Action, tuple[Action, ...]]]:
    """For each rank, the SENDs it may wait for when each of its compute actions has taken its
    input, because by then the receiving rank has provably taken them: waiting on them returns at
    once, never on another rank's progress.

    The runtime needs this where a backend's send handles report completion only once waited
    (gloo): there every sent tensor would otherwise stay held until the step's end, one per
    microbatch and direction, which under 1F1B grows with the number of microbatches while its
    activations do not.

    "Provably" is happens-before: a rank knows what the messages it has waited for tell it, and
    each message tells what its sender knew when sending it, as a vector clock counting the
    compute actions each rank has started. A send is known taken once the clock shows its
    receiver started the compute action that consumes it.

    `lowered` is a list with its transfers (see `lower`); one no rank could run raises ScheduleError.
    """
    num_stages = check_well_formed(lowered, num_stages)
    _check_transfers_listed(lowered, num_stages)
    num_ranks = len(lowered)
    consumer: dict[tuple, tuple[int, int]] = {}  # message -> (rank, position) of the compute action taking it
    for rank, actions in enumerate(lowered):
        for index, action in enumerate(a for a in actions if not a.kind.is_comm):
            for recv in recv_for(action, num_stages, num_ranks):
                consumer[message(recv)] = (rank, index)
    clocks = [[0] * num_ranks for _ in range(num_ranks)]
    carried: dict[tuple, list[int]] = {}  # message -> its sender's clock when posting it
    unreleased: list[list[Action]] = [[] for _ in range(num_ranks)]
    releases: list[dict[Action, tuple[Action, ...]]] = [{} for _ in range(num_ranks)]
    for rank, action in replay_order(lowered, num_stages):
        clock = clocks[rank]
        if action.kind.is_send:
            carried[message(action)] = clock.copy()
            unreleased[rank].append(action)
            continue
        if action.kind.is_comm:
            continue
        for recv in recv_for(action, num_stages, num_ranks):  # what the sender knew comes with its data
            clock[:] = map(max, clock, carried[message(recv)])
        clock[rank] += 1  # the replay yields a rank's actions in its program's order
        taken = [send for send in unreleased[rank] if _started(clock, consumer[message(send)])]
        if taken:
            releases[rank][action] = tuple(taken)
            unreleased[rank] = [send for send in unreleased[rank] if send not in taken]
    return releases


def _started(clock: list[int], at: tuple[int, int]) -> bool:
    """Whether `clock` shows that the compute action at (rank, position) has started."""
    rank, index = at
    return clock[rank] > index
