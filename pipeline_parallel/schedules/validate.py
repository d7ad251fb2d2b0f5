"""Check a lowered schedule without any process: every action once, sends match receives, no deadlock."""

from __future__ import annotations

from collections import defaultdict

from .._checks import check_bool, check_int
from .actions import (Kind, Schedule, ScheduleError, check_well_formed, input_of, peer_rank, result_of, sent_by,
                      stage_to_rank, stages_of_rank)
from .lowering import message, recv_for, send_for

_LOWER_HINT = "; lower(schedule, num_stages) adds the sends and receives of a list of compute actions"


def validate(
    lowered: Schedule, num_stages: int, num_microbatches: int, forward_only: bool = False, in_order: bool = False
) -> None:
    """Raise ScheduleError unless `lowered` runs to completion and computes every gradient once.

    The check replays all ranks together under the runtime's semantics: sends and receives are
    posted without blocking, and a compute action waits until its input exists (a matched,
    posted send or a local result). Between each pair of ranks the k-th send must be the k-th
    receive: peers match point-to-point messages by order, and a mix-up would go unnoticed
    because all activations of a step have the same shape. With `in_order`, the replay also
    follows NCCL: each rank's batches of transfers run one after another, and a batch ends only
    when all of its transfers have met their peers.
    """
    num_stages = check_well_formed(lowered, num_stages)
    num_microbatches = check_int("num_microbatches", num_microbatches)
    check_bool("forward_only", forward_only)
    check_bool("in_order", in_order)
    num_ranks = len(lowered)
    _check_compute_coverage(lowered, num_stages, num_microbatches, forward_only)
    _check_transfers_listed(lowered, num_stages)
    _check_channels(lowered, num_ranks)
    for _ in replay_order(lowered, num_stages):  # raises ScheduleError on a deadlock
        pass
    if in_order:
        _check_in_order_batches(lowered, num_stages, num_ranks)


def _check_compute_coverage(lowered: Schedule, num_stages: int, num_microbatches: int, forward_only: bool) -> None:
    """Each (stage, mb) of a rank: one F, then one B or an I and later its W (nothing more when forward only)."""
    num_ranks = len(lowered)
    for rank, actions in enumerate(lowered):
        stages = stages_of_rank(rank, num_stages, num_ranks)
        seen = [a for a in actions if not a.kind.is_comm]
        unexpected = sorted(a for a in seen if a.mb >= num_microbatches or (forward_only and a.kind != Kind.F))
        if unexpected:
            raise ScheduleError(f"rank {rank} runs {unexpected}, but the microbatches are 0..{num_microbatches - 1}"
                                + (" and it runs forwards only" if forward_only else ""))
        kinds = defaultdict(set)
        for a in seen:
            kinds[(a.stage, a.mb)].add(a.kind)
        for stage in stages:
            for mb in range(num_microbatches):
                got = kinds[(stage, mb)]
                ok = got == {Kind.F} if forward_only else got in ({Kind.F, Kind.B}, {Kind.F, Kind.I, Kind.W})
                if not ok:
                    need = "F" if forward_only else "F and B" + ("" if stage == 0 else " (or I and W)")
                    raise ScheduleError(f"rank {rank} must run {need} of stage {stage}, microbatch {mb}; "
                                        f"it runs {sorted(k.value for k in got) or 'nothing'}")


def _check_transfers_listed(lowered: Schedule, num_stages: int) -> None:
    """Each compute action receives its input from another rank before it and sends its result to
    another rank after it, as `lower` lays them out, and no send comes before what it sends."""
    num_ranks = len(lowered)
    for rank, actions in enumerate(lowered):
        listed, done = set(actions), set()  # done: compute actions run so far, their results, and receives posted
        for a in actions:
            if a.kind.is_send:
                if sent_by(a) not in done:
                    raise ScheduleError(f"rank {rank} posts {a!r} before it computes what that sends")
            elif not a.kind.is_comm:
                for recv in recv_for(a, num_stages, num_ranks):
                    if recv not in done:
                        raise ScheduleError(f"rank {rank} runs {a!r} without receiving its input first ({recv!r} "
                                            f"must come before it){_LOWER_HINT}")
                for send in send_for(a, num_stages, num_ranks):
                    if send not in listed:
                        raise ScheduleError(f"rank {rank} runs {a!r} but never sends its result ({send!r} must follow "
                                            f"it){_LOWER_HINT}")
                done.add(result_of(a))
            done.add(a)


def _check_channels(lowered: Schedule, num_ranks: int) -> None:
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(lowered):
        for a in actions:
            if a.kind.is_send:
                sent[(rank, peer_rank(a, num_ranks))].append(message(a))
            elif a.kind.is_recv:
                received[(peer_rank(a, num_ranks), rank)].append(message(a))
    for channel in sorted(set(sent) | set(received)):
        src, dst = channel
        sends, recvs = sent[channel], received[channel]
        for k in range(max(len(sends), len(recvs))):
            s = sends[k] if k < len(sends) else None
            r = recvs[k] if k < len(recvs) else None
            if s != r:
                raise ScheduleError(
                    f"message {k} from rank {src} to rank {dst}: rank {src} sends {_describe(s)} but rank {dst} "
                    f"expects {_describe(r)}; point-to-point messages are matched in order"
                )


def _describe(msg) -> str:
    if msg is None:
        return "nothing"
    direction, stage, mb = msg
    what = "activation" if direction == "F" else "gradient"
    return f"the {what} of stage {stage}, microbatch {mb}"


def _compute_ready(rank: int, a, done: set, arrived, num_stages: int, num_ranks: int) -> bool:
    """Whether compute action `a` on `rank` has the data it consumes (its own F, or I for a W, ran
    earlier in the same list: `check_well_formed` made sure of that).

    `done` holds finished actions and their results (`result_of`). The data is the neighbouring
    stage's result: local if that stage is on the same rank, otherwise a message for which
    `arrived(message)` says whether it has been received.
    """
    source = input_of(a, num_stages)
    if source is None:
        return True
    if stage_to_rank(source.stage, num_ranks) == rank:
        return source in done
    return arrived((source.kind.value, source.stage, source.mb))


def replay_order(lowered: Schedule, num_stages: int):
    """Yield (rank, action) for every action of `lowered` in an order the runtime could run them:
    sends and receives post without blocking, and a compute action comes after the send of the data
    it takes. Raises ScheduleError where no rank can go on (a deadlock)."""
    num_ranks = len(lowered)
    posted_sends: set = set()
    posted_recvs: set = set()  # (rank, message)
    done: set = set()  # (kind, stage, mb) compute actions finished
    pcs = [0] * num_ranks

    def ready(rank: int, a) -> bool:
        def arrived(msg) -> bool:  # both ends posted: the transfer can happen
            return (rank, msg) in posted_recvs and msg in posted_sends

        return a.kind.is_comm or _compute_ready(rank, a, done, arrived, num_stages, num_ranks)

    while any(pc < len(actions) for pc, actions in zip(pcs, lowered)):
        progressed = False
        for rank, actions in enumerate(lowered):
            while pcs[rank] < len(actions) and ready(rank, actions[pcs[rank]]):
                a = actions[pcs[rank]]
                if a.kind.is_send:
                    posted_sends.add(message(a))
                elif a.kind.is_recv:
                    posted_recvs.add((rank, message(a)))
                else:
                    done.update({a, result_of(a)})
                yield rank, a
                pcs[rank] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {r} waits at {actions[pc]!r}" for r, (pc, actions) in enumerate(zip(pcs, lowered))
                if pc < len(actions)
            )
            raise ScheduleError(f"schedule deadlocks: {stuck}")


def _check_in_order_batches(lowered: Schedule, num_stages: int, num_ranks: int) -> None:
    """Deadlock check under in-order batch semantics (NCCL): a transfer waits for all before it.

    A rank's consecutive comm actions form one batch, as the runtime posts them. Batches of a
    rank complete strictly in order (conservatively, one stream per rank); a transfer completes
    when the peer's current batch holds its counterpart; a compute action waits for the whole
    batch holding the receive it consumes.
    """
    programs = []  # per rank: list of ("compute", action) or ("batch", [its comm actions])
    for actions in lowered:
        items: list = []
        for a in actions:
            if a.kind.is_comm:
                if not items or items[-1][0] != "batch":
                    items.append(("batch", []))
                items[-1][1].append(a)
            else:
                items.append(("compute", a))
        programs.append(items)
    pcs = [0] * num_ranks
    posted: list[list[list]] = [[] for _ in range(num_ranks)]  # per rank: its posted batches
    heads = [0] * num_ranks  # index of each rank's first unfinished batch
    done_compute: set = set()
    finished_recvs: set = set()  # (rank, message) of completed receives

    matched: set = set()  # (rank, is_send, message) of transfers that met their peer

    def ops(rank: int, batch) -> list:
        return [(rank, a.kind.is_send, message(a), peer_rank(a, num_ranks)) for a in batch]

    def advance_streams() -> bool:
        moved = False
        for rank in range(num_ranks):  # transfers in two current batches meet
            if heads[rank] < len(posted[rank]):
                for _, is_send, msg, peer in ops(rank, posted[rank][heads[rank]]):
                    peer_head = posted[peer][heads[peer]] if heads[peer] < len(posted[peer]) else []
                    if any((not s, m) == (is_send, msg) for _, s, m, _ in ops(peer, peer_head)):
                        matched.update({(rank, is_send, msg), (peer, not is_send, msg)})
        for rank in range(num_ranks):
            while heads[rank] < len(posted[rank]):
                batch = ops(rank, posted[rank][heads[rank]])
                if not all(op[:3] in matched for op in batch):
                    break
                finished_recvs.update((rank, msg) for _, is_send, msg, _ in batch if not is_send)
                heads[rank] += 1
                moved = True
        return moved

    def ready(rank: int, a) -> bool:
        def arrived(msg) -> bool:  # the whole batch holding the receive has finished
            return (rank, msg) in finished_recvs

        return _compute_ready(rank, a, done_compute, arrived, num_stages, num_ranks)

    while True:
        progressed = advance_streams()
        for rank, items in enumerate(programs):
            while pcs[rank] < len(items):
                kind, item = items[pcs[rank]]
                if kind == "batch":
                    posted[rank].append(item)
                elif ready(rank, item):
                    done_compute.update({item, result_of(item)})
                else:
                    break
                pcs[rank] += 1
                progressed = True
        if all(pc == len(items) for pc, items in zip(pcs, programs)) and all(
            head == len(batches) for head, batches in zip(heads, posted)
        ):
            return
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {items[pc][1]!r}" if pc < len(items) else f"rank {r} waiting on {posted[r][heads[r]]}"
                for r, (pc, items) in enumerate(zip(pcs, programs))
                if pc < len(items) or heads[r] < len(posted[r])
            )
            raise ScheduleError(f"schedule deadlocks when transfers run in order (NCCL): {stuck}")
