"""Schedules as data: generated GPipe/1F1B lists are valid and bounded; broken lists are caught. No processes."""

import random
from collections import defaultdict

import pytest
import torch.distributed as dist
from _schedules import looped

from pipeline_parallel import ScheduleError, build_schedule
from pipeline_parallel.schedules import (B, F, Kind, backward_next, choose_split, estimated_duration, gpipe, lower,
                                         makespan, one_f_one_b, recomputed, send_releases, simulate, split_backwards,
                                         validate)
from pipeline_parallel.schedules.actions import Action, I, W

STAGES = range(1, 7)
MICROBATCHES = range(1, 10)
SEND = {Kind.SEND_F, Kind.SEND_B}
RECV = {Kind.RECV_F, Kind.RECV_B}
GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _compute(actions):
    """The F/B order of a rank's list: a split backward (I, later W) counts as one B at its I."""
    return [B(a.stage, a.mb) if a.kind == Kind.I else a for a in actions if a.kind in (Kind.F, Kind.B, Kind.I)]


def _in_flight(actions):
    """Microbatches a rank holds after each of its actions."""
    live, counts = 0, []
    for a in actions:
        live += a.kind == Kind.F
        live -= a.kind in (Kind.B, Kind.W)  # a split backward holds its activations until W
        counts.append(live)
    return counts


def _peak_in_flight(actions):
    return max(_in_flight(actions), default=0)


def _message(a):
    """(direction, sending stage, mb) of a comm action; written here independently of the engine."""
    if a.kind == Kind.SEND_F:
        return ("F", a.stage, a.mb), a.stage, a.stage + 1
    if a.kind == Kind.RECV_F:
        return ("F", a.stage - 1, a.mb), a.stage - 1, a.stage
    if a.kind == Kind.SEND_B:
        return ("B", a.stage, a.mb), a.stage, a.stage - 1
    return ("B", a.stage + 1, a.mb), a.stage + 1, a.stage


def _independent_check(schedule, p, m):
    """Our own check of a lowered one-stage-per-rank schedule: coverage, order, matching, progress."""
    assert len(schedule) == p
    for rank, actions in enumerate(schedule):
        compute = _compute(actions)
        assert sorted(compute) == sorted([F(rank, mb) for mb in range(m)] + [B(rank, mb) for mb in range(m)])
        for mb in range(m):
            assert compute.index(F(rank, mb)) < compute.index(B(rank, mb)), (rank, mb)
        # sends follow the compute that produced them; receives precede the compute that needs them
        for i, a in enumerate(actions):
            if a.kind == Kind.SEND_F:
                assert F(a.stage, a.mb) in actions[:i]
            if a.kind == Kind.SEND_B:
                assert B(a.stage, a.mb) in actions[:i] or I(a.stage, a.mb) in actions[:i]
            if a.kind == Kind.RECV_F:
                assert F(a.stage, a.mb) in actions[i:]
            if a.kind == Kind.RECV_B:
                assert B(a.stage, a.mb) in actions[i:] or I(a.stage, a.mb) in actions[i:]
        if rank == 0:
            assert not any(a.kind in (Kind.RECV_F, Kind.SEND_B) for a in actions)
        if rank == p - 1:
            assert not any(a.kind in (Kind.SEND_F, Kind.RECV_B) for a in actions)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind in SEND or a.kind in RECV:
                msg, src, dst = _message(a)
                (sent if a.kind in SEND else received)[(src, dst)].append(msg)
    assert dict(sent) == dict(received), "every send is a receive, in the same order per pair of ranks"
    # Replay: comm posts never block; a compute waits for its input (posted send + posted receive).
    done, posted = set(), set()
    pcs = [0] * p
    while any(pc < len(a) for pc, a in zip(pcs, schedule)):
        moved = False
        for rank, actions in enumerate(schedule):
            while pcs[rank] < len(actions):
                a = actions[pcs[rank]]
                if a.kind in SEND or a.kind in RECV:
                    posted.add((a.kind in SEND, _message(a)[0]))
                elif a.kind == Kind.W:  # weight gradients: after the I of the same microbatch
                    if (Kind.I, a.stage, a.mb) not in done:
                        break
                    done.add((a.kind, a.stage, a.mb))
                else:
                    kind = Kind.F if a.kind == Kind.F else Kind.B  # an I makes the gradient a B would
                    src = a.stage - 1 if kind == Kind.F else a.stage + 1
                    msg = (kind.value, src, a.mb)
                    needs = 0 <= src < p
                    if needs and not ((True, msg) in posted and (False, msg) in posted and (kind, src, a.mb) in done):
                        break
                    if kind == Kind.B and (Kind.F, a.stage, a.mb) not in done:
                        break
                    done.update({(kind, a.stage, a.mb), (a.kind, a.stage, a.mb)})
                pcs[rank] += 1
                moved = True
        assert moved, f"deadlock at {pcs}"


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "afab", "GPipe", "1F1B"])
def test_generated_schedules_are_valid(name):
    for p in STAGES:
        for m in MICROBATCHES:
            schedule = build_schedule(name, p, m)
            _independent_check(schedule, p, m)
            validate(schedule, p, m)
            for split in sorted({0, 1, 3, m}):  # also replayed with in-order (NCCL) transfers
                _independent_check(build_schedule(name, p, m, split=split), p, m)
                _independent_check(build_schedule(name, p, m, split=split, prefetch=False), p, m)
            # without prefetching the receives too
            _independent_check(build_schedule(name, p, m, prefetch=False), p, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_forward_only_schedules(name):
    for p in STAGES:
        for m in MICROBATCHES:
            schedule = build_schedule(name, p, m, forward_only=True)
            for rank, actions in enumerate(schedule):
                assert _compute(actions) == [F(rank, mb) for mb in range(m)]
                assert not any(a.kind in (Kind.SEND_B, Kind.RECV_B) for a in actions)


def test_peak_in_flight_microbatches():
    for p in STAGES:
        for m in MICROBATCHES:
            ofob, gp = build_schedule("1f1b", p, m), build_schedule("gpipe", p, m)
            for rank in range(p):
                peak = _peak_in_flight(ofob[rank])
                assert peak <= p - rank, (p, m, rank, peak)
                assert peak == min(p - rank, m), (p, m, rank, peak)
                assert _peak_in_flight(gp[rank]) == m


def _cost(costs):
    """Forward c, backward 2c, each half of a split backward c * 1.1, per stage."""
    return lambda a: costs[a.stage] * {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.1, Kind.W: 1.1}[a.kind]


def test_split_backwards_are_each_ranks_last_and_send_their_gradient_first():
    for name in ("gpipe", "1f1b"):
        for p in STAGES:
            for m in MICROBATCHES:
                whole = build_schedule(name, p, m, split=0)
                assert not any(a.kind in (Kind.I, Kind.W) for acts in whole for a in acts)
                for k in range(m + 3):  # beyond m: every backward is split
                    for rank, actions in enumerate(build_schedule(name, p, m, split=k)):
                        compute = [a for a in actions if not a.kind.is_comm]
                        backwards = [a for a in _compute(actions) if a.kind == Kind.B]
                        inputs = [a for a in compute if a.kind == Kind.I]
                        expected = backwards[max(m - k, 0):] if rank > 0 else []  # the first stage has no input gradient
                        assert [B(a.stage, a.mb) for a in inputs] == expected, (name, p, m, k, rank)
                        for a in inputs:
                            at = actions.index(a)  # the gradient leaves before the weight gradients are made
                            assert rank == 0 or actions[at + 1] == Action(Kind.SEND_B, rank, a.mb)
                            assert actions.index(W(rank, a.mb)) > at
                        assert sum(a.kind == Kind.W for a in compute) == len(inputs)
                        # Deferred weight passes never hold more microbatches than the schedule does.
                        assert _peak_in_flight(actions) == _peak_in_flight(whole[rank]), (name, p, m, k, rank)
    for bad in ("all", -1, 1.5, True):
        with pytest.raises(ValueError, match=r"split must be an integer >= 0 .* or None"):
            build_schedule("1f1b", 2, 4, split=bad)


def test_weight_passes_fill_the_waits():
    """Replayed with the costs they were placed with, no rank idles while a W it could run waits."""
    from pipeline_parallel.schedules import simulate

    for costs in ([1.0] * 3, [1.0, 1.0, 3.0], [2.0, 1.0, 1.0, 1.5]):
        p = len(costs)
        for name in ("gpipe", "1f1b"):
            for m in (2, 5, 8):
                for k in (1, 2, m, None):  # None: the chosen split, which may split where a rank waits
                    schedule = build_schedule(name, p, m, split=k, stage_costs=costs)
                    times = simulate(schedule, p, _cost(costs))
                    for rank, actions in enumerate(schedule):
                        compute = [a for a in actions if not a.kind.is_comm]
                        whole_peak = _peak_in_flight(build_schedule(name, p, m, split=0)[rank])
                        held = _in_flight(compute)
                        for i, (before, after) in enumerate(zip(compute, compute[1:])):
                            if times[after][0] - times[before][1] < 1e-9:
                                continue  # no wait here
                            later = [a for a in compute[i + 2:] if a.kind == Kind.W]
                            runnable = [w for w in later if times[I(w.stage, w.mb)][1] <= times[before][1]]
                            # A W may stay behind only for a forward that would exceed the memory bound.
                            assert not runnable or (after.kind == Kind.F and held[i] >= whole_peak), \
                                (costs, name, m, k, rank, before, after, runnable)


def test_the_chosen_split_is_the_fastest_under_its_cost_model():
    """Every number of split backwards, and splitting where a rank waits: the default is the fastest."""
    from pipeline_parallel.schedules import makespan, simulate

    for costs in ([1.0] * 4, [5.0, 5.5], [1.0, 1.0, 1.0, 2.5], [2.0, 1.0, 1.0]):
        p = len(costs)
        for name in ("gpipe", "1f1b"):
            for m in (1, 2, 4, 8, 16):
                times = [makespan(simulate(build_schedule(name, p, m, split=k, stage_costs=costs), p, _cost(costs)))
                         for k in range(m + 1)]
                whole = lower(GENERATORS[name](p, m), p)
                waited = makespan(simulate(whole, p, _cost(costs), split_waited=True))
                chosen = build_schedule(name, p, m, stage_costs=costs)
                best = min(times + [waited])
                assert makespan(simulate(chosen, p, _cost(costs))) == pytest.approx(best), (costs, name, m)
                fewest = times.index(min(times))
                if min(times) <= best * (1 + 1e-9):  # ties go to the last k, the fewest of them
                    assert chosen == build_schedule(name, p, m, split=fewest, stage_costs=costs)
    # At two stages with a heavier last one, 1F1B splits its last backward; GPipe splits where the
    # first stage would wait, which beats every last k.
    assert build_schedule("1f1b", 2, 8, stage_costs=[5.0, 5.5]) == build_schedule("1f1b", 2, 8, split=1, stage_costs=[5.0, 5.5])
    gpipe_times = [makespan(simulate(build_schedule("gpipe", 2, 8, split=k, stage_costs=[5.0, 5.5]), 2, _cost([5.0, 5.5])))
                   for k in range(9)]
    chosen = build_schedule("gpipe", 2, 8, stage_costs=[5.0, 5.5])
    assert makespan(simulate(chosen, 2, _cost([5.0, 5.5]))) < min(gpipe_times) * 0.99
    # Only the ratios count: costs near the float range's end plan as their scaled-down equals.
    assert build_schedule("1f1b", 2, 4, stage_costs=[1e308, 1.1e308]) == build_schedule("1f1b", 2, 4, stage_costs=[1, 1.1])


def test_the_chosen_split_is_near_the_fastest_where_the_search_skips_some_counts():
    """Past max(num_stages + 1, 16) split backwards only 16 counts are tried (planning 32 stages x 256
    microbatches took 17 s with every count up to 4 * num_stages); over random stage costs none does better."""
    rng = random.Random(3)
    for _ in range(4):
        p, m = rng.choice([(3, 40), (4, 48), (6, 36), (2, 64)])
        costs = [rng.uniform(0.5, 1.0) for _ in range(p)]
        for name in ("gpipe", "1f1b"):
            chosen = makespan(simulate(build_schedule(name, p, m, stage_costs=costs), p, _cost(costs)))
            every = min(makespan(simulate(build_schedule(name, p, m, split=k, stage_costs=costs), p, _cost(costs)))
                        for k in range(m + 1))
            assert chosen <= every * (1 + 1e-9), (name, p, m, costs)


def test_split_where_waited_gives_the_first_stage_its_first_gradient_sooner():
    """GPipe on two stages whose first has the slower backward: the first stage idles until its first
    gradient and is busy from then on, so only the last stage's first backward is split."""
    from pipeline_parallel.schedules import makespan, simulate

    f, b, i1, w1 = {0: 1.0, 1: 1.0}, {0: 2.2, 1: 2.0}, 1.1, 1.0
    cost = lambda a: {Kind.F: f[a.stage], Kind.B: b[a.stage], Kind.I: i1, Kind.W: w1}[a.kind]
    for m in MICROBATCHES:
        times = simulate(lower(gpipe(2, m), 2), 2, cost, split_waited=True)
        assert [a for a in times if a.kind in (Kind.I, Kind.W)] == [I(1, m - 1), W(1, m - 1)], m
        assert makespan(times) == pytest.approx(f[0] + m * f[1] + i1 + m * b[0]), m
        unsplit = makespan(simulate(lower(gpipe(2, m), 2), 2, cost))
        assert makespan(times) == pytest.approx(unsplit - (b[1] - i1)), m


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_a_send_is_let_go_only_after_its_receiver_took_it(name):
    """`send_releases` lets each send go once at most, after it was posted, and only where its receiver
    has started the compute action taking it (else the runtime's wait would hang on another rank); under
    1F1B a rank holds at most p sends at once, whatever m."""
    rng = random.Random(0)
    for p in (2, 3, 4):
        for m in (p, 2 * p + 1):
            for split in (0, None):
                lowered = build_schedule(name, p, m, split=split)
                releases = send_releases(lowered, p)
                for rank, (actions, released) in enumerate(zip(lowered, releases)):
                    peak, held = _holding(actions, released)
                    if name == "1f1b":
                        assert peak <= p, (p, m, split, rank, peak)
                    else:  # an activation is known taken when its gradient comes back; after GPipe's
                        # backwards no message comes back to say the same of the gradients sent
                        assert held == {a for a in actions if a.kind == Kind.SEND_B}, (p, m, split, rank)
                _assert_taken_before_let_go(lowered, p, releases, rng)


def test_sends_of_a_looped_schedule_are_let_go_only_after_their_receivers_took_them():
    """Several stages per rank (an activation may come back to the rank that sent the one before it)."""
    rng = random.Random(1)
    for num_ranks, num_stages in ((2, 4), (3, 6), (2, 6)):
        for m in (1, 3):
            lowered = lower(looped(num_ranks, num_stages, m), num_stages)
            releases = send_releases(lowered, num_stages)
            assert any(releases), (num_ranks, num_stages, m)
            _assert_taken_before_let_go(lowered, num_stages, releases, rng)


@pytest.mark.parametrize("forward_only", [False, True])
def test_a_send_never_proven_taken_is_let_go_where_waiting_for_it_cannot_deadlock(forward_only):
    """With estimated times, `send_releases` also lets go of the sends nothing proves taken (all of a
    forward-only step's, GPipe's last gradients), at a wait that may block but must not close a cycle:
    a replay where each such wait holds its rank until the receiver takes the send runs to the end,
    under any stage costs, also with several stages per rank, where sends go both ways between ranks.
    The proven releases stay; over stages of equal cost a forward-only step holds at most 3 sends at once,
    whatever m."""
    rng = random.Random(2)
    cases = [(build_schedule(name, p, m, forward_only=forward_only), p)
             for name in GENERATORS for p in (2, 3, 4) for m in (p, 2 * p + 1, 16)]
    for num_ranks, num_stages in ((2, 4), (3, 6), (2, 6)):
        for m in (1, 3, 5):
            compute = looped(num_ranks, num_stages, m)
            if forward_only:
                compute = [[a for a in actions if a.kind == Kind.F] for actions in compute]
            cases.append((lower(compute, num_stages), num_stages))
    for lowered, num_stages in cases:
        proven = send_releases(lowered, num_stages)
        for costs in [[1.0] * num_stages] + [[rng.uniform(0.2, 2.0) for _ in range(num_stages)] for _ in range(3)]:
            releases = send_releases(lowered, num_stages, estimated_duration(costs))
            times = simulate(lowered, num_stages, estimated_duration(costs))
            for known, ours in zip(proven, releases):
                assert all(set(sends) <= set(ours[at]) for at, sends in known.items())
                for at, sends in ours.items():  # the others wait where the simulated step has them taken
                    for send in set(sends) - set(known.get(at, ())):
                        assert times[_taker(send, times)][1] <= times[at][0], (send, at)
            peaks = [_holding(actions, released)[0] for actions, released in zip(lowered, releases)]
            _assert_runs_to_the_end(lowered, num_stages, releases)
            if forward_only and num_stages == len(lowered) and costs == [1.0] * num_stages:
                assert max(peaks) <= 3, (num_stages, costs, peaks)


def _holding(actions, released) -> tuple[int, set]:
    """The most sends a rank holds at once (posted, not let go of yet), and those it holds at the end."""
    held, peak = set(), 0
    for a in actions:
        if a.kind in SEND:
            held.add(a)
        for send in released.get(a, ()):
            held.remove(send)  # posted before, and let go of once
        peak = max(peak, len(held))
    return peak, held


def _assert_runs_to_the_end(lowered, num_stages, releases):
    """Replay all ranks: a compute action starts once its input was sent and each send released there
    was taken by its receiver (started the compute action consuming it). No rank may be left stuck."""
    num_ranks = len(lowered)
    computes = [a for actions in lowered for a in actions if not a.kind.is_comm]

    def input_sent(a):
        source = a.stage - 1 if a.kind == Kind.F else a.stage + 1
        if a.kind == Kind.W or not 0 <= source < num_stages or source % num_ranks == a.stage % num_ranks:
            return True  # no input from another rank (the program order keeps a local one)
        return ("F" if a.kind == Kind.F else "B", source, a.mb) in sent

    pcs, sent, started = [0] * num_ranks, set(), set()
    while any(pc < len(actions) for pc, actions in zip(pcs, lowered)):
        moved = False
        for rank, actions in enumerate(lowered):
            while pcs[rank] < len(actions):
                a = actions[pcs[rank]]
                if a.kind in SEND:
                    sent.add(_message(a)[0])
                elif not a.kind.is_comm:
                    waits_for = [_taker(send, computes) for send in releases[rank].get(a, ())]
                    if not input_sent(a) or any(taker not in started for taker in waits_for):
                        break
                    started.add(a)
                pcs[rank] += 1
                moved = True
        assert moved, [actions[pc] for pc, actions in zip(pcs, lowered) if pc < len(actions)]


def _assert_taken_before_let_go(lowered, num_stages, releases, rng):
    """Under random compute and transfer times, each release comes after its send's receiver started
    the compute action taking it: a release that had not waited for it would, in some run, come first."""
    for _ in range(4):
        costs = {a: rng.uniform(0.2, 2.0) for actions in lowered for a in actions if not a.kind.is_comm}
        times = simulate(lowered, num_stages, costs.__getitem__, transfer=rng.uniform(0.0, 1.0))
        for released in releases:
            for at, sends in released.items():
                for send in sends:
                    assert times[_taker(send, times)][0] < times[at][0], (send, at)


def _taker(send, computes):
    """The compute action among `computes` that takes the data `send` sends."""
    (direction, _, mb), _, receiver = _message(send)
    kinds = (Kind.F,) if direction == "F" else (Kind.B, Kind.I)
    return next(a for a in computes if a.kind in kinds and (a.stage, a.mb) == (receiver, mb))


def test_gpipe_runs_all_forwards_first_and_1f1b_interleaves():
    gp = gpipe(4, 6)
    for rank, actions in enumerate(gp):
        assert [a.kind for a in actions] == [Kind.F] * 6 + [Kind.B] * 6
    ofob = one_f_one_b(4, 6)
    assert [a.kind.value for a in ofob[3]] == ["F", "B"] * 6
    assert [a.kind.value for a in ofob[0][:4]] == ["F"] * 4


def test_unknown_schedule_and_bad_microbatch_counts():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'.*choose one of"):
        build_schedule("zigzag", 2, 2)
    for bad in (0, -1, 1.5, None, True):
        with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1"):
            build_schedule("1f1b", 2, bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_stages=0), r"num_stages must be an integer >= 1, got 0"),
    (dict(num_stages=-1), r"num_stages must be an integer >= 1, got -1"),
    (dict(stage_costs=[1.0]), r"stage_costs has 1 entries but there are 2 stages; give one relative cost per stage"),
    (dict(stage_costs=[1.0, 1.0, 1.0]), r"stage_costs has 3 entries but there are 2 stages; give one relative cost "
                                        r"per stage"),  # one too many was taken, its last entry ignored
    (dict(stage_costs=[1.0, float("nan")]), r"stage_costs\[1\] must be a finite number > 0, got nan"),
    (dict(stage_costs=[-1.0, 1.0]), r"stage_costs\[0\] must be a finite number > 0, got -1.0"),
    (dict(stage_costs=[0, 0]), r"stage_costs\[0\] must be a finite number > 0, got 0"),
    # A dict's keys and a set's members in any order were taken as the costs.
    (dict(stage_costs={1: 5.0, 2: 1.0}), r"stage_costs must be a list of one relative cost per stage, got \{1: 5.0"),
    (dict(stage_costs={3.0, 1.0}), r"stage_costs must be a list of one relative cost per stage, got \{"),
])
def test_bad_stage_counts_and_costs_are_clear_errors(kwargs, message):
    args = {"name": "1f1b", "num_stages": 2, "num_microbatches": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_schedule(**args)


def test_simulate_refuses_a_negative_or_unknown_duration():
    schedule = one_f_one_b(2, 2)
    assert makespan(simulate(schedule, 2, lambda a: 1.0)) > 0
    for bad in (-1.0, float("nan"), float("inf"), True):  # True is an int to Python, but no time
        with pytest.raises(ValueError, match=r"the duration of F0\.0 must be a finite number >= 0, got "):
            simulate(schedule, 2, lambda a: bad)
    # A number where the function of an action goes was Python's "'float' object is not callable".
    for tool in (simulate, lambda *args: split_backwards(*args[:2], 1, args[2])):
        with pytest.raises(TypeError, match=r"duration must be a function that gives a compute action's time, .* "
                                            r"got 1\.0"):
            tool(schedule, 2, 1.0)


# Hand-made broken schedules --------------------------------------------------------------------------------------

def _lowered(compute):
    return lower(compute, len(compute))


def test_validator_catches_missing_backward():
    compute = gpipe(2, 2)
    compute[1].remove(B(1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1 must run F and B \(or I and W\) of stage 1, microbatch 0; it runs \['F'\]"):
        validate(_lowered(compute), 2, 2)


@pytest.mark.parametrize("backward, error", [
    ([I(1, 0)], r"must run F and B \(or I and W\) of stage 1, microbatch 0; it runs \['F', 'I'\]"),
    ([I(1, 0), W(1, 0), B(1, 0)], r"rank 1 runs B1\.0, but that input gradient is made already: run one B, or an I"),
    ([W(1, 0), I(1, 0)], r"rank 1 runs W1\.0 before the I"),
    ([I(1, 0), W(1, 0), W(1, 3)], r"rank 1 runs W1\.3 before the I of that stage and microbatch"),
    ([I(1, 0), W(1, 0), F(1, 3)], r"rank 1 runs \[F1\.3\], but the microbatches are 0\.\.1"),
])
def test_validator_checks_split_backwards(backward, error):
    compute = gpipe(2, 2)
    compute[1].remove(B(1, 0))
    compute[1] += backward
    with pytest.raises(ScheduleError, match=error):
        validate(_lowered(compute), 2, 2)


def test_validator_refuses_a_split_backward_on_the_first_stage():
    """The first stage has no input gradient to send: the runtime cannot run its backward as I and W."""
    compute = one_f_one_b(2, 3)
    compute[0] = [a for b in compute[0] for a in ([I(0, b.mb), W(0, b.mb)] if b.kind == Kind.B else [b])]
    with pytest.raises(ScheduleError, match=r"rank 0 runs I0\.0, but the first stage has no input gradient to send early: run B"):
        validate(_lowered(compute), 2, 3)


def test_validator_catches_duplicate_action():
    compute = gpipe(2, 2)
    compute[0].append(B(0, 1))
    with pytest.raises(ScheduleError, match="more than once"):
        validate(_lowered(compute), 2, 2)


def test_validator_catches_a_transfer_posted_twice():
    lowered = [list(actions) for actions in lower(gpipe(2, 2), 2)]
    lowered[0].append(Action(Kind.SEND_F, 0, 0))
    lowered[1].append(Action(Kind.RECV_F, 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 0 runs SEND_F0\.0 more than once"):
        validate(lowered, 2, 2)


@pytest.mark.parametrize("rank, send", [(0, Action(Kind.SEND_F, 0, 0)), (1, Action(Kind.SEND_B, 1, 1))])
def test_validator_catches_a_send_before_the_compute_that_makes_it(rank, send):
    """The runtime would have nothing to send yet."""
    lowered = [list(actions) for actions in lower(gpipe(2, 2), 2)]
    lowered[rank].remove(send)
    lowered[rank].insert(0, send)
    with pytest.raises(ScheduleError, match=rf"rank {rank} posts {send!r} before it computes what that sends"):
        validate(lowered, 2, 2)


def test_validator_catches_backward_before_forward():
    compute = [[F(0, 0), B(0, 1), F(0, 1), B(0, 0)], [F(1, 0), F(1, 1), B(1, 1), B(1, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0 runs B0\.1 before the forward"):
        validate(_lowered(compute), 2, 2)


def test_validator_catches_swapped_send_order():
    schedule = build_schedule("gpipe", 2, 3)
    program = schedule[0]  # the first activation sent after the second, both once computed
    program.remove(Action(Kind.SEND_F, 0, 0))
    program.insert(program.index(Action(Kind.SEND_F, 0, 1)) + 1, Action(Kind.SEND_F, 0, 0))
    with pytest.raises(ScheduleError, match=r"message 0 from rank 0 to rank 1.*microbatch 1.*microbatch 0.*in order"):
        validate(schedule, 2, 3)


def test_validator_catches_swapped_receive_order():
    schedule = build_schedule("1f1b", 3, 4)
    program = schedule[1]
    # Both gradients are received before either is used, but in the other order than rank 2 sends them.
    program.remove(Action(Kind.RECV_B, 1, 2))
    program.insert(program.index(Action(Kind.RECV_B, 1, 1)), Action(Kind.RECV_B, 1, 2))
    with pytest.raises(ScheduleError, match="from rank 2 to rank 1.*matched in order"):
        validate(schedule, 3, 4)


@pytest.mark.parametrize("name, rank, removed, error", [
    ("1f1b", 1, Action(Kind.RECV_F, 1, 1), r"rank 1 runs F1\.1 without receiving its input first \(RECV_F1\.1 must come "
     r"before it\); lower\(schedule, num_stages\) adds"),
    ("gpipe", 0, Action(Kind.SEND_F, 0, 0), r"rank 0 runs F0\.0 but never sends its result \(SEND_F0\.0 must follow it\)"),
], ids=["missing-receive", "receive-never-sent"])
def test_validator_catches_an_unmatched_message(name, rank, removed, error):
    schedule = build_schedule(name, 2, 2)
    schedule[rank].remove(removed)
    with pytest.raises(ScheduleError, match=error):
        validate(schedule, 2, 2)


def test_validator_catches_deadlock():
    # Rank 0 waits for the gradient of mb 0 before it sends the activation of mb 1, while rank 1 waits
    # for that activation before it computes (and sends) the gradient of mb 0: each waits on the other.
    schedule = [
        [F(0, 0), Action(Kind.SEND_F, 0, 0), Action(Kind.RECV_B, 0, 0), B(0, 0),
         F(0, 1), Action(Kind.SEND_F, 0, 1), Action(Kind.RECV_B, 0, 1), B(0, 1)],
        [Action(Kind.RECV_F, 1, 0), F(1, 0), Action(Kind.RECV_F, 1, 1), F(1, 1),
         B(1, 0), Action(Kind.SEND_B, 1, 0), B(1, 1), Action(Kind.SEND_B, 1, 1)],
    ]
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 waits at B0\.0, rank 1 waits at F1\.1"):
        validate(schedule, 2, 2)
    with pytest.raises(AssertionError, match="deadlock"):
        _independent_check(schedule, 2, 2)


def test_no_process_group_needed():
    assert not dist.is_initialized()
    build_schedule("1f1b", 4, 8)
    validate(build_schedule("gpipe", 3, 5), 3, 5)
    assert not dist.is_initialized()


# --- simulate: step time of a schedule from compute times, checked against closed forms ---


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_step_time_of_balanced_stages_is_the_bubble_bound(name):
    from pipeline_parallel.schedules import makespan, simulate

    cost = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.25, Kind.W: 0.75}
    for p in STAGES:
        for m in MICROBATCHES:
            whole = makespan(simulate(lower(GENERATORS[name](p, m), p), p, lambda a: cost[a.kind]))
            assert whole == pytest.approx((m + p - 1) * 3.0), (p, m)
            # Sending the last gradient before the weight gradients never costs time when I + W = B,
            # and in 1F1B it saves time whenever there is a pipeline.
            split = makespan(simulate(build_schedule(name, p, m, split=1), p, lambda a: cost[a.kind]))
            assert split <= whole
            if name == "1f1b" and p > 1:
                assert split < whole


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_step_time_with_a_heavier_last_stage_and_transfers(name):
    """Two stages, the last one slower: it works without pause once its first input arrives.
    1F1B splits its last backward, whose W overlaps the first stage's last backward; GPipe splits
    all, so the last stage sends every gradient first and makes the weight gradients after."""
    from pipeline_parallel.schedules import makespan, simulate

    f, b, i1, w1 = {0: 1.0, 1: 1.5}, {0: 2.0, 1: 3.0}, 1.75, 1.25
    cost = lambda a: {Kind.F: f[a.stage], Kind.B: b[a.stage], Kind.I: i1, Kind.W: w1}[a.kind]
    for m in MICROBATCHES:
        for transfer in (0.0, 0.25):
            schedule = build_schedule(name, 2, m, split=1 if name == "1f1b" else m, stage_costs=[1.0, 1.5])
            times = simulate(schedule, 2, cost, transfer=transfer)
            last_stage_done = f[0] + transfer + m * (f[1] + b[1])
            expected = last_stage_done - w1 + transfer + b[0]
            if name == "gpipe":  # the first stage runs its backwards as gradients arrive, one after another
                arrival = [f[0] + 2 * transfer + m * f[1] + (k + 1) * i1 for k in range(m)]
                expected = max([last_stage_done] + [arrival[k] + (m - k) * b[0] for k in range(m)])
            assert makespan(times) == pytest.approx(expected), (m, transfer)
            for rank in range(2):  # a rank runs one action at a time, in its list order
                spans = [times[a] for a in schedule[rank] if not a.kind.is_comm]
                assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_times_equal_an_in_order_replay_with_uneven_integer_costs(name):
    """Each action starts when its rank is free and its input exists, also when ranks are free at the same
    time (integer costs make such ties): a rank that waits must not skip the time a tied rank makes its input."""
    from pipeline_parallel.schedules.actions import input_of, result_of

    rng = random.Random(0)
    for _ in range(300):
        p, m = rng.randint(3, 5), rng.randint(1, 6)
        costs = [rng.randint(1, 4) for _ in range(p)]
        duration = lambda a: costs[a.stage] * (1 if a.kind == Kind.F else 2)  # noqa: E731
        schedule = GENERATORS[name](p, m)
        ends, made, free, pcs = {}, {}, [0] * p, [0] * p
        while any(pc < len(actions) for pc, actions in zip(pcs, schedule)):
            for rank, actions in enumerate(schedule):  # run each rank's next actions whose inputs exist
                while pcs[rank] < len(actions):
                    action, source = actions[pcs[rank]], input_of(actions[pcs[rank]], p)
                    if source is not None and source not in made:
                        break
                    start = max(free[rank], made[source] if source is not None else 0)
                    free[rank] = ends[action] = start + duration(action)
                    made[result_of(action)] = ends[action]
                    pcs[rank] += 1
        times = simulate(schedule, p, duration)
        assert {a: end for a, (_, end) in times.items()} == ends, (p, m, costs)


def test_simulate_reports_a_deadlock():
    from pipeline_parallel.schedules import simulate

    with pytest.raises(ScheduleError, match="deadlocks"):
        # rank 1 waits for F0.1, which rank 0 runs after B0.0, whose gradient rank 1 makes after F1.1
        simulate([[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), F(1, 0), B(1, 0), B(1, 1)]], 2, lambda a: 1.0)


# Hand-written lists given to the tools: each tool refuses what no rank could run, saying what to change ----------

SEND_F, RECV_F = (lambda s, mb: Action(Kind.SEND_F, s, mb)), (lambda s, mb: Action(Kind.RECV_F, s, mb))


@pytest.mark.parametrize("schedule, num_stages, error", [
    ([[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]], 2, r"rank 1 runs B1\.0 before the forward"),
    ([[F(0, 0), B(0, 0)], [F(1, 0), W(1, 0), I(1, 0)]], 2, r"rank 1 runs W1\.0 before the I"),
    ([[F(0, 0), F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 2, r"rank 0 runs F0\.0 more than once"),
    ([[F(0, 0), F(1, 0), B(1, 0), B(0, 0)], [F(1, 1)]], 2, r"rank 0 runs F1\.0, but stage 1 belongs to rank 1"),
    ([[F(0, 0), B(0, 0)], [F(5, 0), B(5, 0)]], 2, r"rank 1 runs F5\.0, but the stages are 0\.\.1"),
    ([[F(0, 0), I(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]], 2, r"rank 0 runs I0\.0, but the first stage has no input"),
    ([[F(0, -1), B(0, -1)], [F(1, -1), B(1, -1)]], 2, r"microbatches count from 0"),
    (one_f_one_b(2, 1), 1, r"lists for 2 ranks but num_stages is 1; every rank runs at least one stage: is num_stages right\?"),
    (one_f_one_b(2, 1), 3, r"no rank runs an action of stage 2 of 3: is num_stages right\?"),
    ([[("F", 0, 0)], [F(1, 0)]], 2, r"item 0 of rank 0's list is \('F', 0, 0\), not an Action; build actions with F"),
    ([["F0.0"], [F(1, 0)]], 2, r"item 0 of rank 0's list is 'F0\.0', not an Action"),
    ([[Action("F", 0, 0)], [F(1, 0)]], 2, r"item 0 of rank 0's list is F0\.0, not an Action"),
    ([], 2, r"a schedule is a list holding one list of actions per rank"),
    ([[F(0, 0)], F(1, 0)], 2, r"a schedule is a list holding one list of actions per rank"),
])
def test_every_tool_refuses_a_list_no_rank_could_run(schedule, num_stages, error):
    """simulate replayed these with times that broke its own rule (a B before its F, a W before its I,
    a duplicate overwriting a time), lower added transfers to a stage that does not exist, and items that
    are not Actions gave AttributeErrors."""
    compute_only = all(not getattr(a, "kind", None) or not getattr(a.kind, "is_comm", False)
                       for actions in schedule if isinstance(actions, list) for a in actions)
    with pytest.raises(ScheduleError, match=error):
        simulate(schedule, num_stages, lambda a: 1.0)
    with pytest.raises(ScheduleError, match=error):
        validate(schedule, num_stages, 1)
    with pytest.raises(ScheduleError, match=error):
        send_releases(schedule, num_stages)
    if compute_only:
        with pytest.raises(ScheduleError, match=error):
            lower(schedule, num_stages)


def test_a_transfer_between_stages_on_one_rank_is_refused():
    """One rank running stages 0 and 1 hands the activation over in memory; a SEND/RECV pair between them
    passed the checks, and gloo then failed in the runtime ("Pair is not connected")."""
    compute = [[F(0, 0), F(1, 0), B(1, 0), B(0, 0)]]
    validate(lower(compute, 2), 2, 1)
    assert lower(compute, 2) == compute  # nothing to transfer
    with pytest.raises(ScheduleError, match=r"rank 0 runs SEND_F0\.0, but stage 1 is on the same rank, which hands "
                                            r"the data over in memory: drop it"):
        validate([[F(0, 0), SEND_F(0, 0), RECV_F(1, 0), F(1, 0), B(1, 0), B(0, 0)]], 2, 1)


def test_a_transfer_with_a_stage_that_does_not_exist_is_refused():
    """RECV_F on the first stage spoke of "the activation of stage -1"."""
    schedule = lower(one_f_one_b(2, 1), 2)
    schedule[0].insert(0, RECV_F(0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0 runs RECV_F0\.0, but stage 0 has no previous stage"):
        validate(schedule, 2, 1)


def test_a_list_of_compute_actions_given_to_validate_is_told_to_be_lowered():
    with pytest.raises(ScheduleError, match=r"rank 0 runs F0\.0 but never sends its result \(SEND_F0\.0 must follow "
                                            r"it\); lower\(schedule, num_stages\) adds the sends and receives"):
        validate(one_f_one_b(2, 2), 2, 2)
    with pytest.raises(ScheduleError, match=r"never sends its result .*; lower\(schedule, num_stages\) adds"):
        send_releases(one_f_one_b(2, 2), 2)
    with pytest.raises(ScheduleError, match=r"lower\(\) takes compute actions only, but the schedule holds SEND_F0\.0: it is lowered already"):
        lower(lower(one_f_one_b(2, 2), 2), 2)


@pytest.mark.parametrize("call, error", [
    (lambda: gpipe(0, 4), r"num_stages must be an integer >= 1, got 0"),
    (lambda: gpipe(-1, 4), r"num_stages must be an integer >= 1, got -1"),
    (lambda: one_f_one_b(2, -3), r"num_microbatches must be an integer >= 1, got -3"),
    (lambda: one_f_one_b(2, 1.0), r"num_microbatches must be an integer >= 1, got 1\.0"),
    (lambda: validate(lower(one_f_one_b(2, 1), 2), 2, 0), r"num_microbatches must be an integer >= 1, got 0"),
    (lambda: validate(lower(one_f_one_b(2, 1), 2), 2, 1.0), r"num_microbatches must be an integer >= 1, got 1\.0"),
    (lambda: validate([[F(0, 0)]], 0, 1), r"num_stages must be an integer >= 1, got 0"),
    (lambda: simulate(one_f_one_b(2, 1), 2, lambda a: 1.0, transfer=-1.0), r"transfer must be a finite number >= 0"),
    (lambda: simulate(one_f_one_b(2, 1), 2, lambda a: 1.0, transfer=float("nan")), r"transfer must be a finite"),
    (lambda: simulate(one_f_one_b(2, 1), 2, lambda a: 1.0, transfer=float("inf")), r"transfer must be a finite"),
    (lambda: build_schedule("1f1b", 2, 4, prefetch="no"), r"prefetch must be True or False, got 'no'"),
    (lambda: build_schedule("1f1b", 2, 4, recompute=1), r"recompute must be True or False, got 1"),
    (lambda: build_schedule("1f1b", 2, 4, forward_only=True, split=3),
     r"split=3 with forward_only=True: a forward-only schedule has no backwards to split"),
    (lambda: choose_split(one_f_one_b(3, 4), 3, [1.0, 1.0]), r"stage_costs has 2 entries but there are 3 stages"),
])
def test_bad_arguments_of_the_schedule_tools_are_clear_errors(call, error):
    with pytest.raises(ValueError, match=error):
        call()


def test_numpy_integers_are_sizes():
    np = pytest.importorskip("numpy")
    assert build_schedule("1f1b", np.int64(2), np.int64(4)) == build_schedule("1f1b", 2, 4)


def test_choose_split_checks_the_schedule_it_is_given():
    """It handed a list straight to the simulator: a stage on the wrong rank was moved, a duplicate dropped."""
    with pytest.raises(ScheduleError, match=r"rank 0 runs F1\.0, but stage 1 belongs to rank 1"):
        choose_split([[F(0, 0), F(1, 0), B(1, 0), B(0, 0)], []], 2, [1.0, 1.0])
    with pytest.raises(ScheduleError, match=r"rank 1 runs B1\.0 more than once"):
        choose_split([[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0), B(1, 0)]], 2, [1.0, 1.0])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_choose_split_of_a_lowered_list_is_that_of_its_compute_actions(name):
    """Forking the unsplit replay went by indices of the list with its transfers: it raised KeyError."""
    compute, costs = GENERATORS[name](3, 6), [1.0, 0.5, 0.8]
    assert choose_split(lower(compute, 3), 3, costs) == choose_split(compute, 3, costs)


def test_estimated_duration_takes_the_costs_as_given():
    duration = estimated_duration([0.0, 4.0])
    assert duration(F(1, 0)) == 4.0 and duration(B(1, 0)) == 8.0 and duration(B(0, 0)) == 0.0
    with pytest.raises(ValueError, match=r"stage_costs\[1\] must be a finite number >= 0, got -1\.0"):
        estimated_duration([1.0, -1.0])


def test_what_a_stage_that_recomputes_runs_again():
    """A forward whose backward is the rank's next compute action (transfers between them or not) keeps its graph;
    every other one runs again: 1F1B's first stage all of them, its last none, GPipe's all but the last
    microbatch's (its backwards run last first). The planner counts the forward again in their backward."""
    assert recomputed(one_f_one_b(2, 4)) == {(0, mb) for mb in range(4)}
    assert recomputed(gpipe(2, 4)) == {(stage, mb) for stage in (0, 1) for mb in range(3)}
    assert recomputed(lower(one_f_one_b(2, 4), 2)) == recomputed(one_f_one_b(2, 4))
    assert backward_next([F(1, 0), I(1, 0), F(1, 1), W(1, 0), B(1, 1), F(1, 2), B(1, 1)]) == {F(1, 0)}
    duration = estimated_duration([1.0, 2.0], recomputed={(1, 0)})
    assert [duration(a) for a in (F(1, 0), B(1, 0), I(1, 0), W(1, 0), B(1, 1), I(1, 1))] == pytest.approx(
        [2.0, 6.0, 4.2, 2.2, 4.0, 2.2])
    for name in ("gpipe", "1f1b"):  # planned for it, the split suits it better (2 stages, 8 microbatches)
        plain, planned = (build_schedule(name, 2, 8, recompute=recompute) for recompute in (False, True))
        duration = estimated_duration([1.0, 1.0], recomputed(planned))
        assert makespan(simulate(planned, 2, duration)) < makespan(simulate(plain, 2, duration)) - 0.5


def test_times_given_as_zero_dim_tensors_are_numbers():
    torch = pytest.importorskip("torch")
    times = simulate(one_f_one_b(2, 1), 2, lambda a: torch.tensor(1.0), transfer=torch.tensor(0.5))
    assert makespan(times) == pytest.approx(4 * 1.0 + 2 * 0.5)  # F0, F1, B1, B0 and two transfers


@pytest.mark.parametrize("options", [{}, {"split": 2}, {"forward_only": True}, {"prefetch": False}])
def test_build_schedule_checks_the_list_once(monkeypatch, options):
    """Each pass checked its input again: a build walked the whole list three times for one check."""
    import importlib

    actions = importlib.import_module("pipeline_parallel.schedules.actions")
    checked = []

    def counted(schedule, num_stages):
        checked.append(schedule)
        return actions.check_well_formed(schedule, num_stages)

    for name in ("lowering", "simulate", "split", "validate"):
        monkeypatch.setattr(importlib.import_module(f"pipeline_parallel.schedules.{name}"), "check_well_formed", counted)
    built = build_schedule("1f1b", 3, 5, **options)
    assert checked == [built]


def test_a_split_forked_from_the_unsplit_replay_replays_as_from_the_start():
    """choose_split replays each split only from where it first differs from no split."""
    from pipeline_parallel.schedules.simulate import Replay
    from pipeline_parallel.schedules.split import _with_last_split

    rng = random.Random(0)
    for name, p, m in [("gpipe", 2, 4), ("1f1b", 4, 8), ("gpipe", 5, 7), ("1f1b", 3, 2)]:
        duration = estimated_duration([rng.uniform(0.2, 1.0) for _ in range(p)])
        compute = GENERATORS[name](p, m)
        for split in (1, 2, m):
            body = _with_last_split(compute, split)
            first_i = [next((i for i, a in enumerate(actions) if a.kind == Kind.I), len(actions)) for actions in body]
            forked = []

            def fork_at_the_first_i(rank, index):
                if not forked and index >= first_i[rank]:
                    forked.append(unsplit.fork(body).run())

            unsplit = Replay(compute, p, duration)
            unsplit.run(fork_at_the_first_i)
            assert list(forked[0].items()) == list(Replay(body, p, duration).run().items()), (name, p, m, split)


def test_validate_refuses_a_microbatch_numbered_num_microbatches_on_a_single_rank():
    """A rank that also runs microbatch m (0..m-1 exist) on one rank, where no transfer betrays it."""
    with pytest.raises(ScheduleError, match=r"rank 0 runs \[B0\.2, F0\.2\], but the microbatches are 0\.\.1"):
        validate(gpipe(1, 3), 1, 2)


def test_validate_refuses_a_stage_that_runs_before_the_stage_it_takes_its_input_from_on_the_same_rank():
    """Two stages on one rank hand data over in memory: stage 1's forward before stage 0's has no input."""
    with pytest.raises(ScheduleError, match=r"schedule deadlocks: rank 0 waits at F1\.0"):
        validate([[F(1, 0), F(0, 0), B(1, 0), B(0, 0)]], 2, 1)


def test_a_missing_backward_of_the_first_stage_asks_for_b_only():
    """The first stage cannot split its backward: the error asks for F and B, not "(or I and W)"."""
    compute = gpipe(2, 2)
    compute[0].remove(B(0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0 must run F and B of stage 0, microbatch 0; it runs \['F'\]$"):
        validate(lower(compute, 2), 2, 2)


def test_a_mismatched_message_says_whether_it_is_an_activation_or_a_gradient():
    """The channel error names what is sent: an activation forward, a gradient backward."""
    for moved, behind, what, sent, expected in (
            (Action(Kind.SEND_F, 0, 0), Action(Kind.SEND_F, 0, 1), "activation", 1, 0),
            (Action(Kind.SEND_B, 1, 2), Action(Kind.SEND_B, 1, 1), "gradient", 1, 2)):
        schedule = build_schedule("gpipe", 2, 3)
        rank = moved.stage  # one stage per rank
        schedule[rank].remove(moved)
        schedule[rank].insert(schedule[rank].index(behind) + 1, moved)
        with pytest.raises(ScheduleError, match=rf"rank {rank} sends the {what} of stage {rank}, microbatch {sent} but "
                                                rf"rank {1 - rank} expects the {what} of stage {rank}, microbatch {expected}"):
            validate(schedule, 2, 3)


def test_a_weight_pass_waits_while_a_forward_keeps_the_rank_below_its_peak():
    """An unlisted W goes before a forward only if that forward would make the rank hold more microbatches
    than its list ever does; here F1.2 keeps rank 1 at one, below its peak of two, and its input is there: the W
    goes at the end, where nothing else is left to run."""
    schedule = [[F(0, 0), F(0, 1), F(0, 2), B(0, 1), B(0, 0), B(0, 2)],
                [F(1, 0), F(1, 1), B(1, 1), I(1, 0), F(1, 2), B(1, 2)]]
    times = simulate(schedule, 2, lambda action: 1.0)
    assert [a for a in times if a.stage == 1] == [F(1, 0), F(1, 1), B(1, 1), I(1, 0), F(1, 2), B(1, 2), W(1, 0)]


def test_a_send_is_let_go_at_the_action_that_starts_just_as_its_taker_ends():
    """GPipe on 2 stages, the last backward split, unit times: rank 0's B0.1 takes B1.1's gradient from t=4
    to t=5, and rank 1's W1.0 starts at t=5: nothing proves the send taken, but waiting for it there cannot block.
    Released only where the taker ended strictly before, it was held to the end of the step."""
    lowered = build_schedule("gpipe", 2, 2, split=1)
    assert send_releases(lowered, 2, lambda action: 1.0) == [
        {B(0, 1): (Action(Kind.SEND_F, 0, 0), Action(Kind.SEND_F, 0, 1))}, {W(1, 0): (Action(Kind.SEND_B, 1, 1),)}]


def test_the_split_is_searched_past_sixteen_backwards_in_a_longer_pipeline():
    """Each k up to num_stages + 1 is tried: with 20 stages, a cheap last one, 17 of the last backwards
    split are faster than 16."""
    costs = [1.0] * 19 + [0.5]
    chosen = build_schedule("1f1b", 20, 40, stage_costs=costs)
    assert [sum(a.kind == Kind.I for a in actions) for actions in chosen[1:]] == [17] * 19
