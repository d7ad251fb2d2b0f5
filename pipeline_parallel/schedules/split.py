"""A pass over compute schedules: each rank's last backward sends its input gradient first."""

from __future__ import annotations

from .actions import Kind, Schedule, I, W


def split_last_backward(schedule: Schedule) -> Schedule:
    """Turn each rank's last B into I then W, except on the first stage (it has no input gradient).

    The step ends when the last microbatch's gradient has travelled back to the first stage.
    With the split, each stage hands it on as soon as it is computed and makes its weight
    gradients while the earlier stages work, so every hop of that final chain is shorter by
    one weight-gradient pass. Earlier backwards stay whole: there the split only adds the cost
    of walking the autograd graph.
    """
    result = []
    for actions in schedule:
        actions = list(actions)
        last = max((i for i, a in enumerate(actions) if a.kind == Kind.B), default=None)
        if last is not None and actions[last].stage > 0:
            b = actions[last]
            actions[last:last + 1] = [I(b.stage, b.mb), W(b.stage, b.mb)]
        result.append(actions)
    return result
