"""Plans: which backwards are split never changes a bit of the gradients.

One process group per world size. Every plan of a schedule (no split, some, all, and the one the
simulator chooses) trains the same model on the same batch; the gradients of every plan must be
equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from _models import build, make_batch

import pipeline_parallel as pp

M = 6
SPLITS = (0, 1, M // 2, M, None)  # None: the simulator's choice
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
            out[schedule, split] = {"grads": {n: p.grad for n, p in pipe.named_parameters()}, "program": pipe.program}
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
    last_rank_programs = {tuple(ranks[-1][schedule, split]["program"]) for split in SPLITS}
    assert len(last_rank_programs) >= 4, "the plans must differ for this to show anything"
