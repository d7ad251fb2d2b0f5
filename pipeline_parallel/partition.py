"""Cost-balanced split of a decoder's layers (plus embedding and LM head) into pipeline stages."""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass

from ._checks import check_int, check_nonnegative, check_positive, is_int, plural


@dataclass(frozen=True)
class ModelCosts:
    """Estimated cost of each piece of the model, in the same unit (multiply-adds per token); `stage_costs` sums
    them per stage."""

    layer: float
    embedding: float = 0.0
    head: float = 0.0

    def __post_init__(self):
        check_positive("ModelCosts.layer", self.layer)
        check_nonnegative("ModelCosts.embedding", self.embedding)
        check_nonnegative("ModelCosts.head", self.head)


def estimate_costs(config, seq_len: int = 2048) -> ModelCosts:
    """Multiply-adds per token of a decoder layer, the embedding and the LM head.

    A layer costs its matmul weights plus attention over `seq_len` positions; the head costs
    hidden * vocab (for a 32k vocabulary and a small hidden size that is several layers). The
    embedding is a lookup: nearly free, but not zero, so ties put it with fewer layers.
    """
    check_int("seq_len", seq_len)
    hidden, heads = _size(config, "hidden_size"), _size(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention_weights = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
    mlp_weights = 3 * hidden * _size(config, "intermediate_size")  # gate, up, down
    attention_scores = 2 * heads * head_dim * seq_len // 2  # QK^T and AV, causal half
    layer = attention_weights + mlp_weights + attention_scores
    return ModelCosts(layer=float(layer), embedding=float(hidden), head=float(hidden * _size(config, "vocab_size")))


def _size(config, name: str) -> int:
    """A size of the model config, checked here: a missing, zero or negative one would fail in the
    arithmetic, far from its name, or give a cost silently wrong."""
    return check_int(f"config.{name}", getattr(config, name, None),
                     hint=" (the model config's sizes set the cost of each stage)")


def balanced_layer_counts(num_layers: int, num_stages: int, costs: ModelCosts | None = None) -> list[int]:
    """Layers per stage, contiguous, each stage >= 1 layer, minimising the costliest stage.

    Stage 0 also pays `costs.embedding` and the last stage `costs.head`; without costs, the even
    split (earlier stages take the remainder). Among splits with the same costliest stage, the one
    whose next costliest stage is cheapest, and so on (7 equal layers on 3 stages: [3, 2, 2], not
    [3, 3, 1]); then earlier stages take the extra layers, as in the even split. An exact dynamic
    programme over split points, each stage's layers bounded first by the least costliest stage a split
    can have: a fraction of a second at hundreds of stages.
    """
    num_layers, num_stages = _check_stage_count(num_layers, num_stages)
    if costs is not None and not isinstance(costs, ModelCosts):
        raise TypeError(f"costs must be a ModelCosts (see estimate_costs), got {costs!r:.100}")
    if costs is None:  # the even split: earlier stages take the remainder
        return [num_layers // num_stages + (stage < num_layers % num_stages) for stage in range(num_stages)]

    # In units of the largest cost, so that sums of costs near the float maximum do not overflow to inf; a power
    # of two, so that every division is exact and the split is the one the costs themselves give.
    unit = 2.0 ** (math.frexp(max(costs.layer, costs.embedding, costs.head))[1] - 1)

    # Every stage of the best split costs at most the least costliest stage any split can have: each takes at
    # most the layers that keep it within that (`caps`), which leaves the programme below few splits to compare.
    caps = _caps(_least_costliest_stage(num_layers, num_stages, costs, unit), num_layers, num_stages, costs, unit)
    # best[n]: the best split of the first n layers over the stages placed so far, as (stage costs costliest
    # first, counts). Splits compare by those costs (leximax), then by counts with earlier stages larger. Adding
    # the same later stages to two splits keeps their order, so keeping only the best of each n is exact.
    best: dict[int, tuple[tuple[float, ...], tuple[int, ...]]] = {0: ((), ())}
    for stage in range(num_stages):
        placed: dict[int, tuple[tuple, tuple[int, ...]]] = {}
        later = sum(caps[stage + 1:])  # the most layers the later stages can take
        for k, (prev_costs, prev_counts) in best.items():
            for n in range(max(k + 1, num_layers - later), min(k + caps[stage], num_layers) + 1):
                stage_costs_desc = list(prev_costs)  # this stage takes layers k..n-1
                bisect.insort(stage_costs_desc, _stage_cost(n - k, stage, num_stages, costs, unit), key=operator.neg)
                counts = prev_counts + (n - k,)
                key = (tuple(stage_costs_desc), tuple(-c for c in counts))
                if n not in placed or key < placed[n][0]:
                    placed[n] = (key, counts)
        best = {n: (key[0], counts) for n, (key, counts) in placed.items()}
    return list(best[num_layers][1])


def _least_costliest_stage(num_layers: int, num_stages: int, costs: ModelCosts, unit: float) -> float:
    """The smallest cost of a split's costliest stage: the least stage cost at which the stages, each taking
    as many layers as keep it within it (at least one), hold them all. Binary search over the stage costs."""
    candidates = sorted({_stage_cost(n, stage, num_stages, costs, unit)
                         for stage in {0, num_stages - 1, min(1, num_stages - 1)} for n in range(1, num_layers + 1)})
    low, high = 0, len(candidates) - 1  # the largest candidate, a stage of every layer, always suffices
    while low < high:
        middle = (low + high) // 2
        if sum(_caps(candidates[middle], num_layers, num_stages, costs, unit)) >= num_layers:
            high = middle
        else:
            low = middle + 1
    return candidates[low]


def _caps(limit: float, num_layers: int, num_stages: int, costs: ModelCosts, unit: float) -> list[int]:
    """The most layers each stage can take at a cost of at most `limit` (at least one, so that every stage has
    one), from its cost by `_stage_cost` itself, so the bounds are exactly those of the costs compared."""
    caps = []
    for stage in range(num_stages):
        low, high = 1, num_layers  # the largest count within the limit, or 1
        while low < high:
            middle = (low + high + 1) // 2
            if _stage_cost(middle, stage, num_stages, costs, unit) <= limit:
                low = middle
            else:
                high = middle - 1
        caps.append(low)
    return caps


def stage_costs(layer_counts: list[int], costs: ModelCosts) -> list[float]:
    """The estimated cost of each stage of a split (its layers, plus the embedding or head it holds)."""
    return [_stage_cost(count, stage, len(layer_counts), costs) for stage, count in enumerate(layer_counts)]


def _stage_cost(num_layers: int, stage: int, num_stages: int, costs: ModelCosts, unit: float = 1.0) -> float:
    cost = num_layers * (costs.layer / unit)
    if stage == 0:
        cost += costs.embedding / unit
    if stage == num_stages - 1:
        cost += costs.head / unit
    return cost


def check_layer_counts(layer_counts: list[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate user-given layers per stage; returns them as a list of ints."""
    num_layers, num_stages = _check_stage_count(num_layers, num_stages)
    if isinstance(layer_counts, (str, bytes)) or not hasattr(layer_counts, "__iter__"):
        raise ValueError(f"layer_counts must be a list of decoder layers per stage, such as [3, 3, 2], got "
                         f"{layer_counts!r:.100}")
    counts = list(layer_counts)
    if len(counts) != num_stages:
        raise ValueError(
            f"layer_counts {counts} gives {plural(len(counts), 'layer count')} but the pipeline has "
            f"{plural(num_stages, 'stage')}; give one layer count per stage"
        )
    if any(not is_int(c) or c < 1 for c in counts):
        raise ValueError(f"layer_counts {counts}: every stage needs a whole number >= 1 of decoder layers")
    counts = [int(c) for c in counts]
    if sum(counts) != num_layers:
        raise ValueError(f"layer_counts {counts} sum to {sum(counts)} but the model has {num_layers} decoder layers")
    return counts


def layer_ranges(layer_counts: list[int]) -> list[range]:
    """The decoder-layer indices each stage owns, from layers-per-stage."""
    ranges, start = [], 0
    for count in layer_counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _check_stage_count(num_layers: int, num_stages: int) -> tuple[int, int]:
    num_layers, num_stages = check_int("num_layers", num_layers), check_int("num_stages", num_stages)
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {plural(num_layers, 'decoder layer')} into {num_stages} pipeline stages: every stage "
            f"needs at least one layer; use at most {plural(num_layers, 'rank')} or a model with more layers"
        )
    return num_layers, num_stages
