"""A pass over compute schedules: in the cooldown, gradients are sent before weight gradients are made."""

from __future__ import annotations

from .actions import I, Kind, Schedule, W


def split_cooldown_backwards(schedule: Schedule) -> Schedule:
    """Turn every B that comes after its rank's last F into I then W, except on the first stage.

    Once a rank has no forwards left, the earlier stages can only wait for its gradients, and
    the step ends when the last one reaches the first stage. Split, each backward hands its
    input gradient on as soon as it is computed and makes its weight gradients while the earlier
    stages work. Backwards between forwards stay whole: there the next forward waits either way,
    and the split costs an autograd graph walk. The first stage has no input gradient to send.
    """
    result = []
    for actions in schedule:
        last_forward = max((i for i, a in enumerate(actions) if a.kind == Kind.F), default=-1)
        split = []
        for i, a in enumerate(actions):
            if a.kind == Kind.B and i > last_forward and a.stage > 0:
                split += [I(a.stage, a.mb), W(a.stage, a.mb)]
            else:
                split.append(a)
        result.append(split)
    return result
