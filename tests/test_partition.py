"""Partition: even and cost-balanced layer splits, checked against brute force; no processes."""

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline_parallel import ModelCosts, balanced_layer_counts, estimate_costs
from pipeline_parallel.models import LlamaConfig
from pipeline_parallel.partition import check_layer_counts


def _compositions(n, k):
    """Every way to give n layers to k stages, each >= 1."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _costs_desc(counts, costs):
    """The split's stage costs, costliest first."""
    last = len(counts) - 1
    return sorted((c * costs.layer + (costs.embedding if s == 0 else 0) + (costs.head if s == last else 0)
                   for s, c in enumerate(counts)), reverse=True)


def _max_cost(counts, costs):
    return _costs_desc(counts, costs)[0]


def _even(layers, stages):
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


@pytest.mark.parametrize("layers, stages, expected", [
    (8, 2, [4, 4]), (8, 4, [2, 2, 2, 2]), (6, 4, [2, 2, 1, 1]), (5, 5, [1] * 5), (4, 1, [4]), (9, 2, [5, 4]),
    (6, 1, [6]), (4, 4, [1, 1, 1, 1]), (5, 2, [3, 2]),
    (7, 3, [3, 2, 2]), (10, 4, [3, 3, 2, 2]),
])
def test_even_split_without_costs(layers, stages, expected):
    assert balanced_layer_counts(layers, stages) == expected


@pytest.mark.parametrize("layers", range(1, 13))
def test_split_without_costs_is_contiguous_and_minimax(layers):
    for stages in range(1, layers + 1):
        counts = balanced_layer_counts(layers, stages)
        assert len(counts) == stages and sum(counts) == layers and min(counts) >= 1, (layers, stages, counts)
        assert max(counts) == -(-layers // stages), (layers, stages, counts)


def test_split_without_costs_is_the_even_split_for_every_stage_count():
    wrong = [(n, s, balanced_layer_counts(n, s)) for n in range(1, 13) for s in range(1, n + 1)
             if balanced_layer_counts(n, s) != _even(n, s)]
    assert not wrong, f"(layers, stages, counts) not evenly split: {wrong}"


def test_big_vocab_head_gives_last_stage_fewer_layers():
    config = SimpleNamespace(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4,
                             vocab_size=32000)
    costs = estimate_costs(config)
    assert costs.head == 256 * 32000 and costs.layer > 0 and 0 < costs.embedding < costs.layer
    counts = balanced_layer_counts(8, 2, costs)
    assert sum(counts) == 8 and min(counts) >= 1
    assert counts[-1] < counts[0], counts
    best = min(_max_cost(c, costs) for c in _compositions(8, 2))
    assert _max_cost(counts, costs) == best


def test_estimate_costs_on_hf_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=32000, num_hidden_layers=8)
    counts = balanced_layer_counts(8, 2, estimate_costs(config))
    assert counts[-1] < counts[0] and sum(counts) == 8
    small_vocab = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                           num_key_value_heads=2, vocab_size=64, num_hidden_layers=8)
    assert balanced_layer_counts(8, 2, estimate_costs(small_vocab)) == [4, 4]


@pytest.mark.parametrize("costs", [
    ModelCosts(layer=1.0, embedding=0.1, head=3.0),
    ModelCosts(layer=2.0, embedding=5.0, head=0.0),
    ModelCosts(layer=1.0, embedding=0.0, head=100.0),
    ModelCosts(layer=3.0, embedding=1.0, head=7.5),
])
def test_cost_aware_split_minimises_the_costliest_stage_then_the_next(costs):
    """Brute force over every split: the costliest stage as cheap as can be, then the next costliest, and so on."""
    for layers in range(1, 10):
        for stages in range(1, layers + 1):
            counts = balanced_layer_counts(layers, stages, costs)
            assert len(counts) == stages and sum(counts) == layers and min(counts) >= 1, (layers, stages, counts)
            best = min(_costs_desc(c, costs) for c in _compositions(layers, stages))
            assert _costs_desc(counts, costs) == pytest.approx(best), (layers, stages, counts)


@pytest.mark.parametrize("costs, expected", [
    (ModelCosts(layer=1.0, head=1e9), [3, 2, 1]), (ModelCosts(layer=1.0, head=1e300), [3, 2, 1]),
    (ModelCosts(layer=1.0, embedding=1e300), [1, 3, 2]), (ModelCosts(layer=1.0, embedding=1e300, head=1e300), [1, 4, 1]),
])
def test_huge_ends_still_leave_one_layer_per_stage(costs, expected):
    """Also where a layer more or less on the head's (or embedding's) stage is lost in rounding (1e300 + 1 ==
    1e300): that split took every layer it could, the others one each ([1, 1, 4]), as if they were free."""
    assert balanced_layer_counts(6, 3, costs) == expected


@pytest.mark.parametrize("costs", [
    ModelCosts(layer=1e308, embedding=1e308, head=1e308), ModelCosts(layer=1e308), ModelCosts(layer=1e308, head=1e308),
])
def test_costs_whose_sums_overflow_still_give_the_balanced_split(costs):
    """Costs near the float maximum summed to inf: every split looked equally unreachable, and the
    result was [] (no stage) or an arbitrary split instead of the one of the same costs scaled down."""
    scaled = ModelCosts(layer=costs.layer / 1e300, embedding=costs.embedding / 1e300, head=costs.head / 1e300)
    assert balanced_layer_counts(8, 4, costs) == balanced_layer_counts(8, 4, scaled)


@pytest.mark.parametrize("layers, stages", [(2, 4), (1, 2), (7, 8)])
def test_more_stages_than_layers_is_a_clear_error(layers, stages):
    with pytest.raises(ValueError, match=rf"cannot split {layers} decoder layers? into {stages}.*at most {layers} ranks?"):
        balanced_layer_counts(layers, stages)
    with pytest.raises(ValueError, match="at least one layer"):
        balanced_layer_counts(layers, stages, ModelCosts(layer=1.0, head=5.0))


def test_zero_stages_is_an_error():
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        balanced_layer_counts(4, 0)


def test_a_sequence_length_below_one_is_an_error():
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match=f"seq_len must be an integer >= 1, got {bad}"):
            estimate_costs(config, seq_len=bad)


@pytest.mark.parametrize("field, value", [
    ("num_attention_heads", None), ("num_attention_heads", 0), ("hidden_size", "64"), ("vocab_size", None),
    ("intermediate_size", -128),
])
def test_a_config_lacking_a_size_is_a_clear_error(field, value):
    """A missing field was an AttributeError, zero heads a ZeroDivisionError, a string size a TypeError, and
    a negative one a smaller cost, taken silently."""
    fields = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    config = SimpleNamespace(**{**fields, field: value})
    if value is None:
        delattr(config, field)
    with pytest.raises(ValueError, match=rf"config\.{field} must be an integer >= 1 .*, got {value!r}"):
        estimate_costs(config)


def test_check_layer_counts_accepts_valid_counts():
    assert check_layer_counts([3, 1], 4, 2) == [3, 1]
    assert check_layer_counts((1, 2, 2, 1), 6, 4) == [1, 2, 2, 1]


@pytest.mark.parametrize("counts, layers, stages, message", [
    ([2, 2, 2], 6, 2, "layer_counts [2, 2, 2] gives 3 layer counts but the pipeline has 2 stages"),
    ([6], 6, 2, "layer_counts [6] gives 1 layer count but the pipeline has 2 stages; give one layer count per stage"),
    ([1, 1], 1, 2, "cannot split 1 decoder layer into 2 pipeline stages: every stage needs at least one layer; use at "
                   "most 1 rank or a model with more layers"),
    ([3, 0, 3], 6, 3, ">= 1"),
    ([4, -1, 3], 6, 3, ">= 1"),
    ([1.5, 4.5], 6, 2, "whole number"),
    ([2, 2], 6, 2, "sum to 4 but the model has 6"),
    ([4, 4], 6, 2, "sum to 8 but the model has 6"),
    ([1, 1, 1], 2, 3, "cannot split 2 decoder layers into 3"),
])
def test_check_layer_counts_errors(counts, layers, stages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_layer_counts(counts, layers, stages)


@pytest.mark.parametrize("call, error", [
    (lambda: balanced_layer_counts(8.5, 2), r"num_layers must be an integer >= 1, got 8\.5"),
    (lambda: balanced_layer_counts(0, 1), r"num_layers must be an integer >= 1, got 0"),
    (lambda: ModelCosts(layer=float("inf")), r"ModelCosts\.layer must be a finite number > 0, got inf"),
    (lambda: ModelCosts(layer=float("nan")), r"ModelCosts\.layer must be a finite number > 0, got nan"),
    (lambda: ModelCosts(layer=-1.0), r"ModelCosts\.layer must be a finite number > 0, got -1\.0"),
    (lambda: ModelCosts(layer=1.0, head=-2.0), r"ModelCosts\.head must be a finite number >= 0, got -2\.0"),
    (lambda: balanced_layer_counts(8, 2, [1.0, 0.0, 0.0]), r"costs must be a ModelCosts \(see estimate_costs\)"),
])
def test_bad_arguments_of_the_split_are_clear_errors(call, error):
    """A float layer count gave float counts that summed to more layers; an infinite layer cost gave no split."""
    with pytest.raises((ValueError, TypeError), match=error):
        call()


def test_numpy_integers_are_layer_counts():
    np = pytest.importorskip("numpy")
    assert check_layer_counts([np.int64(5), np.int64(3)], 8, 2) == [5, 3]
    assert balanced_layer_counts(np.int64(8), np.int64(2)) == [4, 4]


def test_estimate_costs_counts_each_matmul_of_a_layer():
    """The multiply-adds per token the split balances, worked out by hand for a layer with grouped key/value
    heads and a head size of its own (not hidden / heads, as Gemma's and Qwen 3's): q and o take every head,
    k and v the key/value heads only, and attention over `seq_len` positions costs half of the full square
    (causal). A term dropped or mistaken moves layers between stages without any test noticing otherwise."""
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             intermediate_size=128, vocab_size=100)
    costs = estimate_costs(config, seq_len=16)
    attention_weights = 64 * 32 * (4 + 4 + 2 + 2)  # q, o: 4 heads of 32; k, v: 2 heads of 32
    mlp_weights = 3 * 64 * 128  # gate, up, down
    attention_scores = (4 * 32 * 16 + 4 * 32 * 16) // 2  # QK^T and AV over 16 positions, the causal half
    assert costs == ModelCosts(layer=attention_weights + mlp_weights + attention_scores, embedding=64, head=64 * 100)
    longer = estimate_costs(config, seq_len=48)  # attention scores grow with the length, the weights do not
    assert longer == ModelCosts(layer=costs.layer + 3 * attention_scores - attention_scores, embedding=64, head=6400)


@pytest.mark.parametrize("layers, stages, expected", [
    (5, 2, [3, 2]), (7, 2, [4, 3]), (3, 2, [2, 1]), (7, 3, [3, 2, 2]), (10, 4, [3, 3, 2, 2]), (11, 3, [4, 4, 3]),
    (256, 128, [2] * 128), (257, 128, [3] + [2] * 127),
])
def test_cost_balanced_ties_go_to_the_larger_earlier_stages(layers, stages, expected):
    """Equal layers and free ends give the even split: of the splits with the same costliest stage, the one whose
    next costliest is cheapest ([3, 2, 2], not [3, 3, 1]), then the earlier stages take the extra layers, so the
    head's stage keeps the fewest."""
    assert balanced_layer_counts(layers, stages, ModelCosts(layer=1.0)) == expected



def test_a_deep_model_on_many_stages_is_split_evenly_around_its_ends():
    """The README's example: the `8b` preset (32 layers, a 128k-vocabulary head) on 8 stages. Splits with the
    same costliest stage of 5 layers differ elsewhere: [4, 5, 5, 5, 5, 5, 2, 1] held it as well, leaving the
    head's stage one layer and five stages the most; the stages after the costliest now share the rest."""
    costs = estimate_costs(LlamaConfig.from_preset("8b"))
    assert balanced_layer_counts(32, 8, costs) == [4, 5, 5, 4, 4, 4, 4, 2]
    assert "32 layers on 8 stages: [4, 5, 5, 4, 4, 4, 4, 2]" in (Path(__file__).parents[1] / "README.md").read_text()
