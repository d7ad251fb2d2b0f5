"""Plans: which backwards are split, measured or estimated, never changes a bit of the gradients.

One process group per world size. Every plan of a schedule (no split, some, all, and the default,
which plans again from the times its first step measured) trains the same model on the same batch
for two steps. The gradients of every plan must be equal bit for bit, and the default's second step
must run the program planned from all ranks' measured times.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest
import torch
from _dist import run_distributed
from _models import build, make_batch

import pipeline_parallel as pp
from pipeline_parallel.partition import stage_costs
from pipeline_parallel.schedules import Kind, build_schedule

M = 6
SPLITS = (0, 1, M // 2, M, None)  # None: the simulator's choice, measured after the first step
MODELS = {2: ("qwen2", 4, None), 4: ("llama", 6, (1, 2, 2, 1))}  # kind (qwen2 has biases), layers, layer counts


def _worker(rank: int, world_size: int) -> dict:
    kind, layers, counts = MODELS[world_size]
    x, y = make_batch(12, 8, seed=3, num_microbatches=M)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for split in SPLITS:
            pipe = pp.Pipeline(build(kind, layers, tie=True, seed=5), schedule=schedule, num_microbatches=M,
                               layer_counts=list(counts) if counts else None, device="cpu", split=split)
            pipe.step(x, y)
            first_program, first_timeline = pipe.program, pipe.last_timeline
            pipe.zero_grad()
            pipe.step(x, y)
            out[schedule, split] = {
                "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
                "programs": [first_program, pipe.program],
                "timeline": first_timeline,
            }
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def ranks(request):
    return run_distributed(_worker, request.param, timeout=120)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_plan_gives_the_same_gradients_bit_for_bit(ranks, schedule):
    for rank, got in enumerate(ranks):
        unsplit = got[schedule, 0]["grads"]
        for split in SPLITS:
            grads = got[schedule, split]["grads"]
            assert grads.keys() == unsplit.keys()
            assert [n for n in grads if not torch.equal(grads[n], unsplit[n])] == [], (rank, split)
    last_rank_programs = {tuple(program) for split in SPLITS for program in ranks[-1][schedule, split]["programs"]}
    assert len(last_rank_programs) >= 4, "the plans must differ for this to show anything"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_second_step_runs_the_plan_from_the_first_steps_times(ranks, schedule):
    spans = defaultdict(lambda: defaultdict(list))  # stage -> kind -> durations
    for got in ranks:
        for action, start, end in got[schedule, None]["timeline"]:
            spans[action.stage][action.kind].append(end - start)
    stage_times = [{kind: statistics.median(d) for kind, d in spans[stage].items()} for stage in range(len(ranks))]
    expected = build_schedule(schedule, len(ranks), M, stage_times=stage_times)
    for rank, got in enumerate(ranks):
        first, second = got[schedule, None]["programs"]
        assert first == build_schedule(schedule, len(ranks), M, stage_costs=_costs(len(ranks)))[rank]
        assert second == expected[rank], rank
        for split in SPLITS[:-1]:  # a split the user chose is kept
            assert got[schedule, split]["programs"][0] == got[schedule, split]["programs"][1]


def _costs(world_size: int) -> list[float]:
    kind, layers, counts = MODELS[world_size]
    config = build(kind, layers, tie=True, meta=True).config
    counts = list(counts) if counts else pp.balanced_layer_counts(layers, world_size, pp.estimate_costs(config))
    return stage_costs(counts, pp.estimate_costs(config, 8))
