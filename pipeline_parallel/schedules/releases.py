"""When a rank may let go of what it sent: as soon as the schedule proves the peer has received it,
or, for a send nothing ever proves taken, once waiting for it can no longer deadlock."""

from __future__ import annotations

import heapq
from typing import Callable

from .actions import Action, Schedule, check_well_formed
from .lowering import message, recv_for
from .simulate import simulate
from .validate import _check_transfers_listed, replay_order


def send_releases(lowered: Schedule, num_stages: int, duration: Callable[[Action], float] | None = None,
                  ) -> list[dict[Action, tuple[Action, ...]]]:
    """For each rank, the SENDs it may wait for (and then let go of) when each of its compute actions
    has taken its input: those the receiving rank has provably taken by then, so waiting on them
    returns at once, never on another rank's progress; with `duration`, also those nothing proves.

    The runtime needs this where a backend's send handles report completion only once waited
    (gloo): there every sent tensor would otherwise stay held until the step's end, one per
    microbatch and direction, which under 1F1B grows with the number of microbatches while its
    activations do not.

    "Provably" is happens-before: a rank knows what the messages it has waited for tell it, and
    each message tells what its sender knew when sending it, as a vector clock counting the
    compute actions each rank has started. A send is known taken once the clock shows its
    receiver started the compute action that consumes it.

    Some sends no message ever proves taken: all of a forward-only step's, and the gradients a
    rank sends after the last message it receives (GPipe's). With `duration` (each compute
    action's estimated time, as `simulate` takes it) those are let go of too, at the first compute
    action of their rank that starts after the consuming action ended in the simulated step. That
    wait blocks if the receiver runs late, but it cannot deadlock: the simulation ran every action
    after those it depends on, and each such wait's consuming action before the waiting one, so
    one order meets every dependency and every wait at once.

    `lowered` is a list with its transfers (see `lower`); one no rank could run raises ScheduleError.
    """
    num_stages = check_well_formed(lowered, num_stages)
    _check_transfers_listed(lowered, num_stages)
    num_ranks = len(lowered)
    # message -> the compute action taking it: (rank, its position among the rank's compute actions, action)
    taker: dict[tuple, tuple[int, int, Action]] = {}
    for rank, actions in enumerate(lowered):
        for index, action in enumerate(a for a in actions if not a.kind.is_comm):
            for recv in recv_for(action, num_stages, num_ranks):
                taker[message(recv)] = (rank, index, action)
    clocks = [[0] * num_ranks for _ in range(num_ranks)]
    carried: dict[tuple, list[int]] = {}  # message -> its sender's clock when posting it
    # Each rank's sends not yet known taken, by receiving rank: heaps of (the taker's position, the
    # order posted, send), so a compute action looks only at the next send each receiver will take.
    unreleased: list[dict[int, list[tuple[int, int, Action]]]] = [{} for _ in range(num_ranks)]
    releases: list[dict[Action, tuple[Action, ...]]] = [{} for _ in range(num_ranks)]
    for order, (rank, action) in enumerate(replay_order(lowered, num_stages)):
        clock = clocks[rank]
        if action.kind.is_send:
            carried[message(action)] = clock.copy()
            receiver, position, _ = taker[message(action)]
            heapq.heappush(unreleased[rank].setdefault(receiver, []), (position, order, action))
            continue
        if action.kind.is_comm:
            continue
        for recv in recv_for(action, num_stages, num_ranks):  # what the sender knew comes with its data
            clock[:] = map(max, clock, carried[message(recv)])
        clock[rank] += 1  # the replay yields a rank's actions in its program's order
        taken = []
        for receiver, waiting in unreleased[rank].items():
            while waiting and clock[receiver] > waiting[0][0]:
                taken.append(heapq.heappop(waiting))
        if taken:
            releases[rank][action] = tuple(send for _, _, send in sorted(taken, key=lambda entry: entry[1]))
    if duration is not None:
        never_proven = [{send for waiting in by_receiver.values() for _, _, send in waiting}
                        for by_receiver in unreleased]
        _add_safe_waits(lowered, num_stages, duration, never_proven, taker, releases)
    return releases


def _add_safe_waits(lowered: Schedule, num_stages: int, duration: Callable[[Action], float],
                    never_proven: list[set[Action]], taker: dict[tuple, tuple[int, int, Action]],
                    releases: list[dict[Action, tuple[Action, ...]]]) -> None:
    """Release each rank's sends of `never_proven` where waiting for them cannot deadlock (see `send_releases`)."""
    times = simulate(lowered, num_stages, duration)
    ran = {action: index for index, action in enumerate(times)}  # the order the simulation ran them in
    for rank, actions in enumerate(lowered):
        posted = []  # (send, the compute action taking it)
        for action in actions:
            if action in never_proven[rank]:
                posted.append((action, taker[message(action)][2]))
            elif not action.kind.is_comm and posted:
                start = times[action][0]
                due = [send for send, took in posted if ran[took] < ran[action] and times[took][1] <= start]
                if due:
                    releases[rank][action] = releases[rank].get(action, ()) + tuple(due)
                    posted = [(send, took) for send, took in posted if send not in due]
