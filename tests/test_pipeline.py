"""Pipeline: gradients, loss, clipping, evaluation and names against a single-process run of the same model.

One process group per world size runs every case (a module fixture); each test then checks one case's
results against the reference computed here in the parent on a copy of the same model and batch.
"""

from __future__ import annotations

import copy
import math
import re
import dataclasses
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from _dist import run_distributed
from _models import (assert_grads_close, build, enable_checkpointing, full_loss, grads, layer_ranges, make_batch,
                     reference_step, stage_names)

import pipeline_parallel as pp
from pipeline_parallel.models.decoder import DecoderParts
from pipeline_parallel.models.families import SUPPORTED_MODEL_TYPES, ForwardScales
from pipeline_parallel.models.materialize import keep_local_part, materialize
from pipeline_parallel.schedules.actions import input_of, result_of

MAX_NORM = 0.05
TIMEOUT = 120
CASE_TIMEOUT = 20  # seconds a rank waits on a peer within one case

TRANSFORMERS_VERSION = __import__("transformers").__version__
TRANSFORMERS_MAJOR = int(TRANSFORMERS_VERSION.split(".")[0])


@dataclass(frozen=True)
class Case:
    name: str
    kind: str = "llama"
    layers: int = 4
    schedule: str = "1f1b"
    m: int = 2
    batch: int = 4
    seq: int = 8
    seq2: int = 5  # the second step's sequence length: shapes may change between steps
    layer_counts: tuple | None = None
    tie: bool = False
    meta: bool = False
    vocab: int = 64
    only_owners: bool = False  # ranks other than first/last pass None for input_ids/labels
    split: int | None = None  # how many of each rank's last backwards run as I then W (None: the simulator's choice)
    accumulate: bool = False  # the second step adds to the first's (clipped) gradients: no zero_grad between
    frozen: tuple = ()  # names of parameters with requires_grad=False
    reentrant_checkpointing: bool = False  # HF gradient checkpointing with use_reentrant=True
    seq_len: int | None = None  # the sequence length the default split is balanced for (None: Pipeline's default)
    sparse_embedding: bool = False  # nn.Embedding(sparse=True): its backward makes a sparse gradient
    recompute: bool = False  # activation recomputation: forwards keep their input, run again before their backward
    extra: dict = field(default_factory=dict)

    def __repr__(self):
        return self.name


CASES = {
    1: [
        Case("w1-gpipe-m1", schedule="gpipe", m=1, batch=2),
        Case("w1-1f1b-m3", m=3, batch=6),
        Case("w1-tied-gpipe-m2", schedule="gpipe", tie=True),
        Case("w1-own-meta-1f1b-m2", kind="own", meta=True, tie=True),
        Case("w1-tied-sparse-embedding-1f1b-m2", tie=True, sparse_embedding=True),
        Case("w1-tied-gpipe-m3-recompute", schedule="gpipe", m=3, batch=6, tie=True, recompute=True),
    ],
    2: [
        Case("w2-gpipe-m2", schedule="gpipe", m=2),
        Case("w2-gpipe-m4", schedule="gpipe", m=4, batch=8),
        Case("w2-gpipe-m3", schedule="gpipe", m=3, batch=6),
        Case("w2-1f1b-m2", m=2, only_owners=True),
        Case("w2-1f1b-m4", m=4, batch=8),
        Case("w2-1f1b-m3", m=3, batch=6, seq2=11),
        Case("w2-uneven-3-1-gpipe", schedule="gpipe", m=3, batch=6, layer_counts=(3, 1)),
        Case("w2-uneven-1-3-1f1b", m=4, batch=4, layer_counts=(1, 3)),
        # At 8 tokens the large head outweighs two layers' attention: [3, 1], where 2048 gives [2, 2].
        Case("w2-balanced-for-seq-8-1f1b", m=2, vocab=1024, seq_len=8),
        Case("w2-tied-1f1b-m3", m=3, batch=6, tie=True, vocab=128),
        Case("w2-tied-gpipe-m2", schedule="gpipe", m=2, tie=True, only_owners=True),
        Case("w2-qwen2-gpipe-m3", kind="qwen2", schedule="gpipe", m=3, batch=6),
        Case("w2-mistral-1f1b-m2", kind="mistral", m=2),
        Case("w2-mistral-sliding-window-1f1b", kind="mistral", m=2, seq=12, extra={"sliding_window": 4}),
        *([Case("w2-gemma-1f1b-m2", kind="gemma", m=2)] if TRANSFORMERS_MAJOR >= 5 else []),
        Case("w2-own-1f1b-m4", kind="own", m=4, batch=8),
        Case("w2-own-meta-gpipe-m2", kind="own", meta=True, schedule="gpipe"),
        Case("w2-own-meta-tied-1f1b-m3", kind="own", meta=True, tie=True, m=3, batch=6),
        Case("w2-gpipe-m3-split-all", schedule="gpipe", m=3, batch=6, split=3),
        Case("w2-qwen2-tied-1f1b-m4-split-3", kind="qwen2", m=4, batch=8, tie=True, split=3),
        Case("w2-1f1b-m3-no-split", m=3, batch=6, split=0),
        Case("w2-tied-gpipe-m2-accumulate", schedule="gpipe", m=2, tie=True, accumulate=True),
        Case("w2-tied-sparse-embedding-1f1b-m3", m=3, batch=6, tie=True, sparse_embedding=True),
        # One weight, named at each end (the last rank holds it as lm_head.weight): no gradient at either.
        Case("w2-frozen-tied-embedding-1f1b", m=2, tie=True, frozen=("model.embed_tokens.weight", "lm_head.weight")),
        Case("w2-frozen-first-stage-1f1b", m=2, layer_counts=(2, 2), frozen=(
            "model.embed_tokens.weight", *(f"model.layers.{i}.{n}" for i in (0, 1) for n in (
                "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")))),
        Case("w2-reentrant-checkpointing-1f1b-split-all", m=2, split=2, reentrant_checkpointing=True),
        Case("w2-gpipe-m4-recompute", schedule="gpipe", m=4, batch=8, recompute=True),
        Case("w2-tied-sparse-embedding-1f1b-m3-recompute-split-all", m=3, batch=6, tie=True, sparse_embedding=True,
             split=3, recompute=True),
        Case("w2-qwen2-1f1b-m4-recompute", kind="qwen2", m=4, batch=8, recompute=True),
    ],
    4: [
        Case("w4-gpipe-m4", schedule="gpipe", m=4, layers=8),
        Case("w4-1f1b-m4", m=4, layers=4, only_owners=True),
        Case("w4-gpipe-m6", schedule="gpipe", m=6, batch=6, layers=8),
        Case("w4-1f1b-m6", m=6, batch=12, layers=8, seq2=3),
        Case("w4-gpipe-m5-split-2", schedule="gpipe", m=5, batch=10, layers=6, split=2),
        Case("w4-1f1b-m4-split-all", m=4, layers=4, split=4),
        Case("w4-uneven-1-2-2-1-1f1b", m=4, layers=6, layer_counts=(1, 2, 2, 1)),
        Case("w4-uneven-1-2-2-1-gpipe", schedule="gpipe", m=6, batch=6, layers=6, layer_counts=(1, 2, 2, 1)),
        Case("w4-tied-1f1b-m4", m=4, tie=True, layers=4),
        Case("w4-own-meta-tied-1f1b-m6", kind="own", meta=True, tie=True, m=6, batch=6, layers=8),
        Case("w4-tied-1f1b-m4-accumulate", m=4, tie=True, layers=4, accumulate=True),
        Case("w4-own-1f1b-m6-recompute", kind="own", m=6, batch=6, layers=8, recompute=True),
    ],
}

BUGS = {}


def _batches(case: Case, index: int):
    x1, y1 = make_batch(case.batch, case.seq, case.vocab, seed=index, num_microbatches=case.m)
    x2, y2 = make_batch(case.batch, case.seq2, case.vocab, seed=100 + index, num_microbatches=case.m)
    return (x1, y1), (x2, y2)


def _build(case: Case, meta: bool):
    model = build(case.kind, case.layers, case.vocab, case.tie, seed=7, meta=meta, **case.extra)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in case.frozen)
    model.model.embed_tokens.sparse = case.sparse_embedding
    return model


def _run_case(rank: int, world_size: int, case: Case, index: int, group=None) -> dict:
    """What one rank observes running `case`: names, losses, gradients, clipping, evaluation."""
    try:
        model = _build(case, case.meta)
        if case.reentrant_checkpointing:
            enable_checkpointing(model, reentrant=True)
        counts = list(case.layer_counts) if case.layer_counts else None
        pipe = pp.Pipeline(model, schedule=case.schedule, num_microbatches=case.m, layer_counts=counts,
                           device="cpu", seed=7, group=group, split=case.split, recompute=case.recompute,
                           **({"seq_len": case.seq_len} if case.seq_len else {}))
        error = None
    except Exception:
        error = traceback.format_exc()
    if group is not None:  # a rank that failed to construct must not leave the others waiting in the step
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
        failed = [f"rank {r}:\n{e}" for r, e in enumerate(errors) if e]
        if failed:
            return {"error": "construction failed on " + "\n".join(failed)}
    elif error:
        return {"error": error}
    first, last = rank == 0, rank == world_size - 1
    (x1, y1), (x2, y2) = _batches(case, index)
    give = lambda x, y: (x if first or not case.only_owners else None, y if last or not case.only_owners else None)
    out = {
        "names": sorted(n for n, _ in pipe.named_parameters()),
        "all_names": sorted(n for n, _ in pipe.model.named_parameters(remove_duplicate=False)),
        "layer_keys": list(pipe.model.model.layers.keys()),
        "meta_left": [n for n, t in [*pipe.model.named_parameters(), *pipe.model.named_buffers()] if t.is_meta],
        "layer_counts": pipe.layer_counts,
    }
    out["eval_before"] = pipe.evaluate(*give(x1, y1))
    out["grads_none_after_eval"] = all(p.grad is None for p in pipe.parameters())
    out["loss1"] = pipe.step(*give(x1, y1))
    out["grads1"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    out["eval_after"] = pipe.evaluate(*give(x1, y1))
    out["grads_kept_by_eval"] = all(p.grad is None if n in case.frozen else torch.equal(p.grad, out["grads1"][n])
                                    for n, p in pipe.named_parameters())
    out["norm"] = float(pipe.clip_grad_norm_(MAX_NORM))
    out["clipped"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    if not case.accumulate:
        pipe.zero_grad()
        out["grads_none_after_zero"] = all(p.grad is None for p in pipe.parameters())
    out["loss2"] = pipe.step(*give(x2, y2))
    out["grads2"] = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    out["timeline"], out["step_seconds"] = pipe.last_timeline, pipe.last_step_seconds
    out["program"] = [a for a in pipe.program if not a.kind.is_comm]
    return out


def _worker(rank: int, world_size: int, cases: list[Case]) -> dict:
    """Every case on its own process group with a short timeout, so one failing case cannot derail the next."""
    results = {}
    for index, case in enumerate(cases):
        group = None
        if world_size > 1:
            dist.barrier()  # default group, long timeout: wait for ranks still timing out in the last case
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CASE_TIMEOUT))
        try:
            results[case.name] = _run_case(rank, world_size, case, index, group)
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
    return results


def _reference(case: Case, index: int) -> dict:
    model = _build(case, meta=False)  # own Llama: name-seeded init equals what the meta pipeline materialises
    (x1, y1), (x2, y2) = _batches(case, index)
    ref = copy.deepcopy(model)
    out = {"full_names": [n for n, _ in model.named_parameters(remove_duplicate=False)]}
    out["loss1"] = full_loss(ref, x1, y1)
    out["loss1"].backward()
    out["loss1"] = out["loss1"].item()
    out["grads1"] = grads(ref)
    out["norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    out["clipped"] = grads(ref)
    if not case.accumulate:
        ref.zero_grad()
    loss2 = full_loss(ref, x2, y2)
    loss2.backward()
    out["loss2"], out["grads2"] = loss2.item(), grads(ref)
    return out


def _warm_up():
    """Import every model class in the parent once, so forked ranks do not each pay for it."""
    for kind in ("llama", "qwen2", "mistral", "gemma", "own"):
        build(kind, 1)


@pytest.fixture(scope="module")
def results():
    _warm_up()
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cases = CASES[world_size]
            if world_size == 1:  # no process group at all: a one-rank pipeline never communicates
                assert not dist.is_initialized()
                cache[1] = [_worker(0, 1, cases)]
            else:
                cache[world_size] = run_distributed(_worker, world_size, cases, timeout=TIMEOUT)
        return cache[world_size]

    return get


def _params():
    return [pytest.param(ws, i, case, id=case.name, marks=BUGS.get(case.name, ()))
            for ws, cases in CASES.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("world_size, index, case", _params())
def test_pipeline_matches_single_process(results, world_size, index, case):
    per_rank = [r[case.name] for r in results(world_size)]
    for rank, got in enumerate(per_rank):
        assert "error" not in got, f"rank {rank} failed:\n{got['error']}"
    ref = _reference(case, index)
    counts = list(case.layer_counts) if case.layer_counts else None
    if counts is None:
        costs = pp.estimate_costs(_build(case, True).config, case.seq_len or 2048)
        counts = pp.balanced_layer_counts(case.layers, world_size, costs)
    assert per_rank[0]["layer_counts"] == counts
    assert ref["norm"] > MAX_NORM, "the case must exercise clipping"
    seen = set()
    for rank, (got, layers) in enumerate(zip(per_rank, layer_ranges(counts))):
        first, last = rank == 0, rank == world_size - 1
        what = f"{case.name} rank {rank}"
        # Names survive the split: exactly the original names of what this rank owns, nothing else.
        expected = stage_names(ref["full_names"], layers, first, last, case.tie)
        assert set(got["names"]) == expected, what
        seen |= expected
        expected -= set(case.frozen)
        assert set(got["all_names"]) <= set(ref["full_names"]), what
        assert got["layer_keys"] == [str(i) for i in layers], what
        assert not got["meta_left"], f"{what}: still on the meta device: {got['meta_left']}"
        # Loss on every rank; gradients of every local parameter, by name.
        assert got["loss1"] == pytest.approx(ref["loss1"], abs=1e-5), what
        assert got["loss2"] == pytest.approx(ref["loss2"], abs=1e-5), what
        assert set(got["grads1"]) == expected, f"{what}: parameters without gradient"
        assert_grads_close(got["grads1"], ref["grads1"], expected, what=f"{what} step 1")
        assert_grads_close(got["grads2"], ref["grads2"], expected, what=f"{what} step 2 (seq {case.seq2})")
        # Global-norm clipping.
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5, abs=1e-6), what
        assert_grads_close(got["clipped"], ref["clipped"], expected, atol=1e-6, what=f"{what} clipped")
        # Evaluation: the same loss, and gradients left exactly as they were.
        assert got["eval_before"] == pytest.approx(ref["loss1"], abs=1e-5), what
        assert got["eval_after"] == pytest.approx(ref["loss1"], abs=1e-5), what
        assert got["grads_none_after_eval"] and got["grads_kept_by_eval"], what
        assert case.accumulate or got["grads_none_after_zero"], what
    full = set(ref["full_names"]) - ({"lm_head.weight"} if case.tie and world_size == 1 else set())
    assert seen == full, "the stages together hold the whole model"
    _check_timelines([got["timeline"] for got in per_rank], [got["program"] for got in per_rank],
                     [got["step_seconds"] for got in per_rank])


def _check_timelines(timelines, programs, step_seconds):
    """Each rank's recorded compute times follow its program and lie within its timed step, and no
    action starts before its input was computed on the neighbouring rank (perf_counter is one
    monotonic clock for all processes)."""
    ends = {}
    for timeline, program, seconds in zip(timelines, programs, step_seconds):
        assert [a for a, _, _ in timeline] == program
        assert timeline[-1][2] - timeline[0][1] <= seconds
        assert all(start <= end for _, start, end in timeline)
        assert all(end <= nxt for (_, _, end), (_, nxt, _) in zip(timeline, timeline[1:]))
        ends.update({result_of(a): end for a, _, end in timeline})
    for timeline in timelines:
        for a, start, _ in timeline:
            source = input_of(a, len(programs))
            assert source is None or ends[source] <= start, (a, source)


# HF model built on the meta device ------------------------------------------------------------------------------

def _hf_meta_worker(rank, world_size):
    model = build("llama", 4, tie=True, meta=True)
    torch.manual_seed(100 + rank)  # the caller's random state, which materialising must leave alone
    pipe = pp.Pipeline(model, schedule="1f1b", num_microbatches=2, device="cpu")
    rng_kept = torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(100 + rank)))
    out = {"rng_kept": rng_kept, "meta_left": [n for n, t in [*pipe.model.named_parameters(), *pipe.model.named_buffers()] if t.is_meta],
           "names": sorted(n for n, _ in pipe.named_parameters())}
    end = pipe.model.model.embed_tokens.weight if rank == 0 else pipe.model.lm_head.weight
    ends = [torch.empty_like(end) for _ in range(world_size)]
    dist.all_gather(ends, end.detach().contiguous())
    out["tied_ends_equal"] = torch.equal(ends[0], ends[-1])
    out["weights"] = {n: p.detach().clone() for n, p in pipe.model.named_parameters()}
    x, y = make_batch(4, 8, num_microbatches=2)
    out["loss"] = pipe.step(x, y)
    return out


def test_hf_model_built_on_meta_device():
    """Each rank initialises its part: every module from (seed, name), so the weights are those one
    process makes, whatever the split (and layers of the same kind on different ranks differ)."""
    _warm_up()
    per_rank = run_distributed(_hf_meta_worker, 2, timeout=TIMEOUT)
    whole = dict(pp.Pipeline(build("llama", 4, tie=True, meta=True), num_microbatches=2).model.named_parameters())
    full = [n for n, _ in build("llama", 4, tie=True).named_parameters(remove_duplicate=False)]
    assert not torch.equal(whole["model.layers.0.mlp.up_proj.weight"], whole["model.layers.2.mlp.up_proj.weight"])
    for rank, got in enumerate(per_rank):
        for name, value in got["weights"].items():
            assert torch.equal(value, whole["model.embed_tokens.weight" if name == "lm_head.weight" else name]), name
        assert set(got["names"]) == stage_names(full, layer_ranges([2, 2])[rank], rank == 0, rank == 1, tie=True)
        assert not got["meta_left"]
        assert got["rng_kept"], "building the pipeline changed the global random state"
        assert got["tied_ends_equal"], "the tied embedding and LM head must hold the same values"
        assert torch.isfinite(torch.tensor(got["loss"]))


def _double_model(sparse: bool):
    model = build("llama", 4).double()
    model.model.embed_tokens.sparse = sparse
    return model


def _clip_worker(rank, world_size, scale, sparse):
    pipe = pp.Pipeline(_double_model(sparse), num_microbatches=2, device="cpu")
    x, y = make_batch(4, 8, num_microbatches=2)
    pipe.step(x, y)
    for p in pipe.parameters():
        p.grad.mul_(scale)
    collectives = []
    for name in ("all_gather", "all_reduce", "all_gather_object"):
        def counted(*args, _call=getattr(dist, name), **kwargs):
            collectives.append(_call)
            return _call(*args, **kwargs)
        setattr(dist, name, counted)
    norm = pipe.clip_grad_norm_(1.0)
    return norm, {n: p.grad.to_dense() for n, p in pipe.named_parameters()}, len(collectives)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-embedding"])
@pytest.mark.parametrize("scale", [1.0, 1e19])
def test_clip_grad_norm_keeps_the_gradients_dtype_and_range(scale, sparse):
    """A float64 model's norm is a float64 one, and a norm whose square exceeds float32's range is not inf
    (clipping by an inf norm would have zeroed every gradient); one collective makes it. Also with an
    embedding made sparse, whose sparse gradient (repeated rows not yet summed) `vector_norm` does not
    take: the first rank raised alone, and the other waited for it until the timeout."""
    ref = _double_model(sparse)
    x, y = make_batch(4, 8, num_microbatches=2)
    logits = ref(x).logits  # float64 throughout (full_loss takes the loss in float32, as Hugging Face does)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    for p in ref.parameters():
        p.grad = p.grad.to_dense() * scale  # torch's clip_grad_norm_ takes no sparse gradient either
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    for norm, got, collectives in run_distributed(_clip_worker, 2, scale, sparse, timeout=TIMEOUT):
        assert collectives == 1, "the ranks' norms travel with their agreement on the arguments"
        assert norm.dtype == torch.float64 and norm.item() == pytest.approx(want.item(), rel=1e-12)
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref.get_parameter(name).grad, rtol=1e-9, atol=1e-12, msg=name)


_NORM_TYPES = (1.0, 3.0, float("inf"))


def _clipped_by_each_norm_type(named_parameters, clip) -> dict:
    """{norm type: (the norm `clip(norm_type)` returns, every gradient by name after it)}, each clipping the same
    gradients, those the parameters hold now."""
    params = list(named_parameters)
    step_grads = {name: p.grad.clone() for name, p in params}
    out = {}
    for norm_type in _NORM_TYPES:
        for name, p in params:
            p.grad = step_grads[name].clone()
        out[norm_type] = clip(norm_type).item(), {name: p.grad.clone() for name, p in params}
    return out


def _clip_by_norm_types_worker(rank, world_size):
    pipe = pp.Pipeline(build("llama", 4, tie=True).double(), num_microbatches=2, device="cpu")
    pipe.step(*make_batch(4, 8, num_microbatches=2))
    return _clipped_by_each_norm_type(pipe.named_parameters(),
                                      lambda norm_type: pipe.clip_grad_norm_(1e-3, norm_type=norm_type))


def test_clip_grad_norm_of_every_norm_type_is_the_single_process_one():
    """Only the 2-norm was compared with one process: a pipeline that took any norm type as 2 within a rank or
    across the ranks passed. The model is tied, so a 1-norm counting its LM head twice shows too."""
    ref = build("llama", 4, tie=True).double()
    x, y = make_batch(4, 8, num_microbatches=2)
    torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    want = _clipped_by_each_norm_type(  # under both names of the tied weight, as the two ends hold it
        ref.named_parameters(remove_duplicate=False),
        lambda norm_type: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=norm_type))
    for out in run_distributed(_clip_by_norm_types_worker, 2, timeout=TIMEOUT):
        for norm_type, (norm, clipped) in out.items():
            want_norm, want_grads = want[norm_type]
            assert norm == pytest.approx(want_norm, rel=1e-9), norm_type
            for name, grad in clipped.items():
                torch.testing.assert_close(grad, want_grads[name], rtol=1e-9, atol=1e-15,
                                           msg=f"{name}, norm type {norm_type}")


def _clip_without_gradients_on_rank_0(rank, world_size):
    pipe = pp.Pipeline(_double_model(False), num_microbatches=2, device="cpu")
    pipe.step(*make_batch(4, 8, num_microbatches=2))
    if rank == 0:
        pipe.zero_grad(set_to_none=True)  # as a stage whose every parameter is frozen
    grads = [p.grad for p in pipe.parameters() if p.grad is not None]
    own = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) if grads else torch.tensor(0.0)
    return pipe.clip_grad_norm_(float("inf")), own


def test_clip_grad_norm_is_the_same_on_every_rank_where_one_holds_no_gradient():
    """A rank without gradients returned the global norm in float32, the others in their gradients' float64."""
    (norm_0, own_0), (norm_1, own_1) = run_distributed(_clip_without_gradients_on_rank_0, 2, timeout=TIMEOUT)
    assert own_0 == 0 and norm_0.dtype == norm_1.dtype == torch.float64
    assert norm_0.item() == norm_1.item() == pytest.approx(own_1.item(), rel=1e-12)


_DIFFERENT_ENDS = {"shifted": lambda w: w + 1, "rows-in-another-order": lambda w: w.flip(0),
                   "entries-in-another-order": lambda w: w.flip(1),
                   # whole 256-byte blocks swapped (float32 rows of 32): every column of the blocks sums alike
                   "blocks-swapped": lambda w: w[[2, 3, 0, 1, *range(4, len(w))]]}


def _tied_apart_worker(rank, world_size, differ):
    model, ref = build("llama", 4, tie=True), build("llama", 4, tie=True)
    with torch.no_grad():  # each rank initialised its own copy of the tied matrix: the ends differ
        if rank:
            model.lm_head.weight.copy_(_DIFFERENT_ENDS[differ](model.lm_head.weight))
    x, y = make_batch(4, 8, num_microbatches=2)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    end = model.model.embed_tokens.weight if pipe.is_first else model.lm_head.weight
    same = torch.equal(end, ref.model.embed_tokens.weight)
    return same, pipe.step(x, y), full_loss(ref, x, y).item()


@pytest.mark.parametrize("differ", list(_DIFFERENT_ENDS))
def test_tied_ends_initialised_apart_take_the_first_stages_embedding(differ):
    """As tying does in one process, the LM head is the embedding: the first rank's copy. Also where the
    ends hold the same values in another order, which a plain sum of them took for equal ends."""
    for same, loss, want in run_distributed(_tied_apart_worker, 2, differ, timeout=TIMEOUT):
        assert same and loss == pytest.approx(want, abs=1e-5)


def test_hf_tied_model_built_on_meta_stays_tied_on_one_rank():
    """One stage holds both ends: materialising must keep the embedding and LM head one matrix."""
    pipe = pp.Pipeline(build("llama", 2, tie=True, meta=True), num_microbatches=2, device="cpu")
    assert pipe.model.lm_head.weight is pipe.model.model.embed_tokens.weight
    ref = build("llama", 2, tie=True, seed=5)
    pipe.model.load_state_dict(ref.state_dict())
    x, y = make_batch(4, 8, num_microbatches=2)
    loss = pipe.step(x, y)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert_grads_close(grads(pipe.model), grads(ref), set(grads(ref)), what="tied on one rank")


def _trained_with_an_optimizer_made_first(kind: str, weakly_held: bool = False):
    """A model built on meta whose AdamW was made before its Pipeline, after one step: the stage's weights, and
    whether the optimizer holds the stage's parameters. `weakly_held`: something holds a weak reference to one
    parameter, which keeps torch from swapping its contents in place."""
    model = build(kind, 4, tie=True, meta=True)
    held = weakref.ref(model.model.norm.weight) if weakly_held else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    pipe.step(*make_batch(4, 8, num_microbatches=2))
    optimizer.step()
    held_by_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    del held
    return ({n: p.detach().clone() for n, p in pipe.named_parameters()},
            all(id(p) in held_by_optimizer for p in pipe.parameters()))


def _optimizer_made_first_worker(rank, world_size, kind):
    return _trained_with_an_optimizer_made_first(kind)


@pytest.mark.parametrize("kind", ["own", "llama"])
def test_an_optimizer_made_before_the_pipeline_of_a_model_on_meta_trains_it(kind):
    """Making a model on meta gives its parameters memory. Made anew, they left an optimizer made before the
    Pipeline (against the README's order, but natural) holding meta parameters no step gives a gradient: it
    trained nothing, without a word. Kept, with their contents swapped in, the stages train as one process does."""
    whole, held = _trained_with_an_optimizer_made_first(kind)
    assert held
    for rank, (weights, held) in enumerate(run_distributed(_optimizer_made_first_worker, 2, kind, timeout=TIMEOUT)):
        assert held, rank
        for name, value in weights.items():  # the tied head is the embedding
            assert (value - whole[name.replace("lm_head", "model.embed_tokens")]).abs().max() < 1e-6, (rank, name)
    untrained = dict(pp.Pipeline(build(kind, 4, tie=True, meta=True), num_microbatches=2).named_parameters())
    assert all(not torch.equal(value, untrained[name]) for name, value in whole.items())
    # Where torch cannot swap in place, the parameters are made anew, as before: the same values, another object.
    weights, held = _trained_with_an_optimizer_made_first(kind, weakly_held=True)
    assert not held and all(torch.equal(value, untrained[name]) for name, value in weights.items())


def test_weights_loaded_into_a_meta_model_are_kept():
    """Built on meta, then loaded with assign=True: only the rotary tables (not in any state dict) are still
    on meta. The pipeline recomputes those and keeps the loaded weights; a model only partly loaded is refused."""
    ref = build("llama", 2, seed=5)
    model = build("llama", 2, meta=True)
    model.load_state_dict(ref.state_dict(), assign=True)
    assert not any(p.is_meta for p in model.parameters()) and any(b.is_meta for b in model.buffers())
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    assert not any(t.is_meta for t in [*pipe.model.parameters(), *pipe.model.buffers()])
    x, y = make_batch(4, 8, num_microbatches=2)
    assert pipe.step(x, y) == pytest.approx(full_loss(ref, x, y).item(), abs=1e-5)

    partly = build("llama", 2, meta=True)
    state = ref.state_dict()
    state.pop("model.norm.weight")
    partly.load_state_dict(state, assign=True, strict=False)
    with pytest.raises(ValueError, match=r"1 of the model's \d+ parameters are on the meta device \(e.g. "
                                         r"model.norm.weight\) but the rest hold values \(e.g. "
                                         r"model.embed_tokens.weight\); load every weight"):
        pp.Pipeline(partly, num_microbatches=2, device="cpu")


def test_a_family_that_makes_parameters_outside_the_meta_device_is_told_what_to_do():
    """DiffLlama draws its lambdas with `torch.normal`, which makes them outside `with torch.device('meta')`: such
    a model looks partly loaded, and its refusal says to call model.to('meta'); then the pipeline makes every
    parameter, the lambdas by the family's own init, and trains as the same weights do in one process."""
    import transformers

    config = _family("diffllama").config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert not model.model.layers[0].self_attn.lambda_q1.is_meta  # what the refusal explains
    with pytest.raises(ValueError, match=r"\(e.g. model.layers.0.self_attn.lambda_q1\);.* such as DiffLlama's "
                                         r"lambdas: then call model.to\('meta'\) too"):
        pp.Pipeline(model, num_microbatches=2, device="cpu")
    pipe = pp.Pipeline(model.to("meta"), num_microbatches=2, device="cpu")
    lambdas = torch.stack([p for name, p in pipe.model.named_parameters() if ".lambda_" in name])
    assert lambdas.isfinite().all() and lambdas.std() > config.lambda_std_dev / 4  # drawn, not zeros or NaN
    _steps_as_the_same_weights(pipe, transformers.AutoModelForCausalLM.from_config(config).float(),
                               what="DiffLlama made by the pipeline")


def _steps_as_the_same_weights(pipe, ref, what: str) -> torch.Tensor:
    """Give `ref`, the whole model built normally, the weights a one-rank `pipe` made, step both on one batch, and
    check the pipeline's loss and gradients against `ref`'s own forward and backward; returns the batch's inputs."""
    ref.load_state_dict(pipe.model.state_dict())
    x, y = make_batch(4, 8, num_microbatches=2, vocab=ref.config.vocab_size)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    assert pipe.step(x, y) == pytest.approx(ref_loss.item(), abs=1e-5)
    assert_grads_close(grads(pipe.model), grads(ref), set(grads(ref)), what=what)
    return x


@pytest.mark.skipif(TRANSFORMERS_MAJOR >= 5, reason="transformers 5 scales Gemma's embeddings in the embedding module")
@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_gemma_before_transformers_5_is_refused(model_type):
    """GemmaModel.forward scales embeddings itself there; a stage would silently skip it."""
    with pytest.raises(TypeError, match="upgrade transformers"):
        pp.Pipeline(_family(model_type), schedule="1f1b", num_microbatches=2, device="cpu")


# Tiny sizes for the families with multi-head latent attention and routed experts (DeepSeek V2/V3's).
_LATENT_ATTENTION = dict(num_key_value_heads=4, head_dim=4, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         kv_lora_rank=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                         topk_group=1, moe_intermediate_size=16)
# Scales that matter for the families whose forward scales embeddings or logits (the defaults are often 1).
_MULTIPLIERS = dict(embedding_multiplier=3.0, logits_scaling=2.5)
_FAMILY_CONFIG = {
    **dict.fromkeys(("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla", "youtu"), _LATENT_ATTENTION),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "hyperclovax"), _MULTIPLIERS),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), dict(final_logit_softcapping=0.5)),
    "afmoe": dict(mup_enabled=True),
    "phimoe": dict(router_jitter_noise=0.0),  # random in training, like the dropouts `_family` zeroes
    "minicpm3": dict(_LATENT_ATTENTION, dim_model_base=8),  # logits_scaling = hidden_size / dim_model_base
    # Layer 0 without positions, layer 1 rotated at a base of its own (the config's global one is 10,000).
    "granite_swa": dict(_MULTIPLIERS, layer_rope_theta=[0.0, 100.0]),
}


def _family(model_type: str, windows: bool = False, **extra):
    """A tiny Hugging Face causal LM of `model_type`, fp32, with weights far from zero; None if this
    transformers version lacks it. With `windows` its config also says that layer 0 of 2 attends over a
    sliding window of 3 tokens (`sliding_window`, `layer_types`), which the family's forward reads its
    own way or not at all (as when a checkpoint's config.json holds keys its family ignores)."""
    import transformers

    settings = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)
    try:
        config = transformers.AutoConfig.for_model(
            model_type, **{**settings, **_FAMILY_CONFIG.get(model_type, {}), **extra})
    except (KeyError, ValueError):
        return None
    for key, value in config.to_dict().items():  # no dropout unless asked (Seed-OSS's default is 0.1)
        if key.endswith(("dropout", "pdrop")) and isinstance(value, float) and key not in extra:
            setattr(config, key, 0.0)
    if windows:
        config.sliding_window, config.layer_types = 3, ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("model_type", ["stablelm", "qwen2_moe"])
def test_a_family_whose_attention_holds_unused_rotary_tables_builds_on_meta(model_type):
    """Before transformers 5, StableLM's and Qwen2-MoE's attention layers hold rotary tables of their own
    that their forward never calls; built on meta they stopped the Pipeline (an --hf-model run too) as a
    buffer it cannot make. They are recomputed from the config, as the model's own."""
    import transformers

    config = _family(model_type).config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    tables = {name: b for name, b in pipe.model.named_buffers() if name.endswith("inv_freq")}
    assert tables and all(torch.equal(b, pipe.model.model.rotary_emb.inv_freq) for b in tables.values()), tables
    x, y = make_batch(4, 8, num_microbatches=2)
    assert math.isfinite(pipe.step(x, y))


@pytest.mark.parametrize("windows", [False, True], ids=["plain", "windows"])
@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_supported_model_families_match_their_own_forward(model_type, windows):
    """A stage runs the model's modules, not its forward: for every supported family the two must agree,
    also where the config speaks of sliding windows (8 tokens, a window of 3), which matter exactly
    where the family's forward reads them, as `SUPPORTED_MODEL_TYPES` says."""
    if model_type in ("gemma", "gemma2") and TRANSFORMERS_MAJOR < 5:
        pytest.skip("Gemma scales its embeddings in forward before transformers 5 (refused, tested above)")
    model = _family(model_type, windows)
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type}")
    if not hasattr(model.model, "rotary_emb"):  # JetMoE before transformers 5 rotates inside each attention
        with pytest.raises(TypeError, match=r"is not a supported decoder-only causal LM: missing \['model.rotary_emb'\]"):
            pp.Pipeline(model, num_microbatches=2, device="cpu")
        return
    if model_type == "gemma3_text" and TRANSFORMERS_MAJOR < 5:  # global and local rotary tables, two arguments
        with pytest.raises(TypeError, match=r"decoder layers \(Gemma3DecoderLayer\) require position_embeddings_global, "
                                            r"position_embeddings_local, which its own forward makes"):
            pp.Pipeline(model, num_microbatches=2, device="cpu")
        return
    if model_type == "phimoe" and TRANSFORMERS_MAJOR < 5:  # its rotary embedding takes a sequence length
        with pytest.raises(TypeError, match=r"rotary embedding \(PhimoeRotaryEmbedding\) takes seq_len, where a "
                                            r"pipeline stage passes position_ids"):
            pp.Pipeline(model, num_microbatches=2, device="cpu")
        return
    if windows and model_type == "qwen2_moe" and TRANSFORMERS_MAJOR < 5:
        with pytest.raises(TypeError, match="before transformers 5, Qwen2-MoE's forward applies its window"):
            pp.Pipeline(model, num_microbatches=2, device="cpu")
        return
    x, y = make_batch(4, 8, num_microbatches=2)
    ref_loss = _steps_as_its_own_forward(model, x, y, what=model_type)
    if windows:
        with torch.no_grad():
            windowless = full_loss(_family(model_type), x, y).item()
        assert (ref_loss != pytest.approx(windowless, abs=1e-4)) == (SUPPORTED_MODEL_TYPES[model_type] != "causal")


def _steps_as_its_own_forward(model, x, y, what: str) -> float:
    """Step `model` in a one-rank Pipeline and check its loss and gradients against the model's own forward and
    backward (on a copy); returns that loss."""
    ref = copy.deepcopy(model)
    loss = pp.Pipeline(model, num_microbatches=2, device="cpu").step(x, y)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert_grads_close(grads(model), grads(ref), set(grads(ref)), what=what)
    return ref_loss.item()


def test_the_readme_names_every_supported_family():
    """The README's count and list of model types are the table's (its count had stayed at 50 when 23 were added)."""
    import pathlib

    docs = " ".join((pathlib.Path(__file__).parents[1] / "README.md").read_text().split())
    assert f"({len(SUPPORTED_MODEL_TYPES)} model types," in docs
    listed = re.search(r"the `model_type`s (.*?) \(`SUPPORTED_MODEL_TYPES`", docs)[1]
    assert set(re.split(r", | and ", listed)) == set(SUPPORTED_MODEL_TYPES)


def _layer_inputs(model, *names):
    """The keyword arguments `names` each decoder layer of a two-layer `model` gets, from the model's own forward
    and from one stage holding the whole model: (own, stage), a tuple per layer in each."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(tuple(kwargs[n] for n in names)),
                                             with_kwargs=True) for layer in model.model.layers]
    x, _ = make_batch(4, 8)
    with torch.no_grad():
        model(x)
        DecoderParts.of(model, range(2), first=True, last=True).forward(x)
    for hook in hooks:
        hook.remove()
    return seen[:2], seen[2:]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_each_layer_gets_the_mask_its_family_forward_gives_it(model_type, attention):
    """The very mask, not only one that computes the same: none where sdpa's is_causal serves (its fast
    kernels take no mask tensor), the same tensor where one is needed (eager, sliding windows)."""
    model = _family(model_type, windows=model_type != "llama", attn_implementation=attention)
    own, stage = _layer_inputs(model, "attention_mask")
    for index, ((expected,), (got,)) in enumerate(zip(own, stage)):
        assert (got is None) == (expected is None), f"layer {index}: mask {got} where the forward gives {expected}"
        if expected is not None:
            assert torch.equal(got, expected), f"layer {index}"


@pytest.mark.parametrize("model_type", ["afmoe", "cohere", "cohere2", "cohere2_moe", "gemma2", "gemma3_text",
                                        "granite", "granitemoe", "granitemoeshared", "granite_swa", "hyperclovax",
                                        "minicpm3", "nanochat", "vaultgemma"])
def test_families_that_scale_in_forward_get_their_scales(model_type):
    """Their forward scales embeddings or logits (or caps the logits) beyond the modules: a stage's logits
    equal the forward's with the scales `ForwardScales.of` reads, and differ without them, so that the
    family test above shows them applied."""
    model = _family(model_type)
    if model is None or (model_type.startswith("gemma") and TRANSFORMERS_MAJOR < 5):
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type} a stage runs")
    parts = DecoderParts.of(model, range(2), first=True, last=True)
    x, _ = make_batch(4, 8)
    with torch.no_grad():
        want = model(x).logits
        torch.testing.assert_close(parts.forward(x), want, atol=1e-5, rtol=1e-5)
        unscaled = dataclasses.replace(parts, scales=ForwardScales()).forward(x)
    assert parts.scales != ForwardScales() and not torch.allclose(unscaled, want, atol=1e-3)


def test_a_layer_reparametrised_after_construction_trains_as_it_runs():
    """Weight norm (or an adapter) added inside a layer after the Pipeline split the model: the
    stage runs the layer as it is, so the step is that of the same change on one process."""
    model, ref = build("llama", 2), build("llama", 2)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    for m in (model, ref):
        layer = m.model.layers["0"] if isinstance(m.model.layers, nn.ModuleDict) else m.model.layers[0]
        nn.utils.parametrizations.weight_norm(layer.mlp.up_proj)
    x, y = make_batch(4, 8, num_microbatches=2)
    assert pipe.step(x, y) == pytest.approx(full_loss(ref, x, y).item(), abs=1e-5)


class _LaidOutBatchSecond(torch.autograd.Function):
    """The identity, whose output and gradient are laid out batch-second, so not contiguous: what a layer
    or an adapter may hand on."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(0, 1).contiguous().transpose(0, 1)


def _non_contiguous_worker(rank, world_size):
    model = build("llama", 4)
    for layer in model.model.layers:  # each layer's output, and its input's gradient, not contiguous
        layer.register_forward_pre_hook(lambda m, args: (_LaidOutBatchSecond.apply(args[0]), *args[1:]))
        layer.register_forward_hook(lambda m, args, out: _LaidOutBatchSecond.apply(out))
    x, y = make_batch(4, 8, num_microbatches=2)
    want_loss, want, _ = reference_step(model, x, y)
    for schedule in ("1f1b", "gpipe"):
        pipe = pp.Pipeline(copy.deepcopy(model), schedule=schedule, num_microbatches=2, device="cpu")
        assert pipe.step(x, y) == pytest.approx(want_loss, abs=1e-5)
        got = grads(pipe.model)
        assert_grads_close(got, want, got, what=f"rank {rank} {schedule}")


def test_stages_hand_on_what_is_not_contiguous():
    """A stage's output or its input's gradient that is not contiguous, which gloo and nccl cannot send:
    rank 0 raised alone, outside the step's error handling, and left rank 1 waiting until the timeout."""
    run_distributed(_non_contiguous_worker, 2)


def test_gemma_built_on_meta_gets_its_embedding_scale():
    """Gemma's embedding scale is a buffer no checkpoint holds; its _init_weights makes it."""
    if TRANSFORMERS_MAJOR < 5:
        pytest.skip("Gemma scales its embeddings in forward before transformers 5 (refused)")
    ref = _family("gemma")
    with torch.device("meta"):
        model = type(ref)(ref.config)
    pipe = pp.Pipeline(model, num_microbatches=1, device="cpu")
    model.load_state_dict(ref.state_dict(), strict=False)  # the weights a --hf-model run loads next
    assert model.model.embed_tokens.embed_scale.item() == pytest.approx(ref.config.hidden_size ** 0.5)
    x, y = make_batch(4, 8)
    assert pipe.step(x, y) == pytest.approx(full_loss(ref, x, y).item(), abs=1e-5)
    # Loaded before, with assign=True: the weights hold values, and the scale, in no state dict, is still on meta.
    with torch.device("meta"):
        loaded = type(ref)(ref.config)
    loaded.load_state_dict(ref.state_dict(), assign=True)
    with pytest.raises(ValueError, match=r"^buffer model.embed_tokens.embed_scale is on the meta device while the "
                                         r"weights hold values, .*give the model with its buffers \(say from "
                                         r"from_pretrained, or built off the meta device\)$"):
        pp.Pipeline(loaded, num_microbatches=1, device="cpu")


def test_starcoder2_embedding_dropout_is_applied_as_its_forward_does():
    model = _family("starcoder2", embedding_dropout=0.5).train()
    ref = copy.deepcopy(model)
    x, y = make_batch(4, 8)
    torch.manual_seed(3)
    loss = pp.Pipeline(model, num_microbatches=1, device="cpu").step(x, y)
    torch.manual_seed(3)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    with torch.no_grad():
        assert full_loss(ref.eval(), x, y).item() != pytest.approx(ref_loss.item(), abs=1e-3)  # dropout matters
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert_grads_close(grads(model), grads(ref), set(grads(ref)), what="starcoder2")


def test_a_layer_kind_without_a_mask_of_ours_is_refused():
    """A layer the forward would mask another way (chunked, linear attention) must not get a causal mask."""
    model = _family("qwen2")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(TypeError, match=r"decoder layers of kind 'chunked_attention' \(config.layer_types\); a "
                                        r"pipeline stage masks 'full_attention' and 'sliding_attention' layers only"):
        pp.Pipeline(model, num_microbatches=2, device="cpu")


@pytest.mark.parametrize("model_type", ["llama", "mistral"])  # a causal family, a window family
def test_a_layer_kind_a_family_s_forward_ignores_is_ignored(model_type):
    """Only families whose forward masks by config.layer_types refuse a kind they do not know; the others' forwards
    never read it, so a stage that refused it would refuse a model that runs (as the README says)."""
    model = _family(model_type)
    model.config.layer_types = ["chunked_attention", "full_attention"]
    model.config.use_cache = False  # transformers' cache would read the kind's settings, which the test leaves out
    _steps_as_its_own_forward(model, *make_batch(4, 8, num_microbatches=2), what=model_type)


@pytest.mark.parametrize("model_type, extra, error, message", [
    # chunks of 4 tokens in 8: its forward masks each chunk's layers by chunk
    ("llama4_text", {"attention_chunk_size": 4}, TypeError, r"model_type 'llama4_text'\) is not supported: .*other "
     r"masks or inputs for some layers"),
    # eager: under sdpa a stage's full-attention mask is None and the layer's own is_causal=False, which agree
    ("gemma3_text", {"use_bidirectional_attention": True, "attn_implementation": "eager"}, TypeError,
     r"Gemma3ForCausalLM with config.use_bidirectional_attention = True: its forward then lets tokens attend "
     r"ahead, beyond the modules a pipeline stage runs, .* set "
     r"config.use_bidirectional_attention = False"),
    ("mixtral", {"output_router_logits": True}, ValueError, r"output_router_logits=True: .*router's auxiliary loss"),
])
def test_families_whose_forward_does_more_are_refused(model_type, extra, error, message):
    model = _family(model_type, **extra)
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type}")
    if not extra.get("output_router_logits"):  # the reason to refuse: forward computes more than the modules
        x, _ = make_batch(4, 8)
        with torch.no_grad():
            try:
                stage_logits = DecoderParts.of(model, range(2), first=True, last=True).forward(x)
                assert not torch.allclose(model(x).logits, stage_logits, atol=1e-4)
            except TypeError:  # Gemma 3's layers before transformers 5 need arguments only its forward makes
                pass
    with pytest.raises(error, match=message):
        pp.Pipeline(model, num_microbatches=2, device="cpu")


def _split_twice_worker(rank, world_size):
    pipe = pp.Pipeline(build("llama", 4), num_microbatches=2, device="cpu")
    with pytest.raises(ValueError, match=r"holds one pipeline stage only \(a Pipeline already split it\); "
                                         r"pass the whole model"):
        pp.Pipeline(pipe.model, num_microbatches=2, device="cpu")


def test_a_model_a_pipeline_already_split_is_refused():
    run_distributed(_split_twice_worker, 2, timeout=TIMEOUT)
    _split_twice_worker(0, 1)  # one stage holds every part, but its layers are keyed by index now


def _eval_with_dropout_worker(rank, world_size):
    model = build("llama", attention_dropout=0.5).train()  # as from_config builds it
    x, y = make_batch(4, 8)
    with torch.no_grad():
        want = full_loss(copy.deepcopy(model).eval(), x, y).item()
    pipe = pp.Pipeline(model, schedule="1f1b", num_microbatches=2)
    kept_in_eval = next(iter(pipe.model.model.layers.values())).eval()  # the user's choice, kept
    losses = [pipe.evaluate(x, y) for _ in range(3)]
    return losses, want, pipe.model.training, kept_in_eval.training


def test_evaluate_runs_without_dropout_and_keeps_the_training_mode():
    for losses, want, training, kept_in_eval_training in run_distributed(_eval_with_dropout_worker, 2):
        assert losses == pytest.approx([want] * 3, abs=1e-5) and training and not kept_in_eval_training


def _mixed_dtype_worker(rank, world_size):
    model = build("llama", 4)
    model.model.layers.to(torch.bfloat16)  # fp32 embedding and residual stream, bf16 layers
    x, y = make_batch(4, 8, num_microbatches=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = full_loss(copy.deepcopy(model), x, y).item()
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu", autocast_dtype=torch.bfloat16)
    return pipe.step(x, y), want


def test_layers_in_another_dtype_than_the_embedding_under_autocast():
    """Stages hand on the embedding's dtype, the residual stream's, whatever their own layers hold."""
    for loss, want in run_distributed(_mixed_dtype_worker, 2, timeout=TIMEOUT):
        assert loss == pytest.approx(want, abs=2e-2)


def test_sequence_lengths_with_near_costs_share_one_plan(monkeypatch):
    """Planning the split of backwards takes seconds at 32 stages; it ran once per sequence length, so a
    run whose lengths vary step to step planned at nearly every step. Plans are kept per relative stage
    costs to two significant digits: 2,048 lengths of the small preset on 4 stages need 53 plans."""
    from pipeline_parallel import pipeline as pipeline_module

    calls = []
    planned = pipeline_module.build_schedule
    monkeypatch.setattr(pipeline_module, "build_schedule", lambda *args, **kwargs: calls.append(args) or
                        planned(*args, **kwargs))
    pipeline_module._planned.cache_clear()  # plans other tests made
    pipe = pp.Pipeline(build("llama", 4), num_microbatches=2, device="cpu")
    calls.clear()
    model = build("llama", 4)
    for seq_len in (6, 7, 8, 9):
        x, y = make_batch(4, seq_len, num_microbatches=2)
        assert pipe.step(x, y) == pytest.approx(full_loss(model, x, y).item(), abs=1e-5)
        pipe.zero_grad()
    keys = {pipeline_module.planning_costs(pipe.config, pipe.layer_counts, seq_len) for seq_len in (6, 7, 8, 9)}
    built_for = pipeline_module.planning_costs(pipe.config, pipe.layer_counts, 2048)  # Pipeline's default seq_len
    assert len(calls) == len(keys - {built_for}) < 4, (calls, keys, built_for)
    config = pp.models.LlamaConfig.from_preset("small")
    counts = pp.balanced_layer_counts(8, 4, pp.estimate_costs(config, 2048))
    keys = {pipeline_module.planning_costs(config, counts, seq_len) for seq_len in range(1, 2049)}
    assert len(keys) == 53


def _planned_for_each_batch_worker(rank, world_size):
    """A 2-rank GPipe Pipeline with the default microbatch count, stepped at one sequence length: its program,
    and those planned for that length and for the length it was built for."""
    from pipeline_parallel import pipeline as pipeline_module

    model = build("llama", 4, vocab=1024)  # a head costly enough that the stages' relative costs follow seq_len
    pipe = pp.Pipeline(copy.deepcopy(model), schedule="gpipe", device="cpu")
    x, y = make_batch(4, 8, vocab=1024, num_microbatches=4)
    loss, want_loss = pipe.step(x, y), full_loss(model, x, y).item()
    planned = {seq_len: pipeline_module.rank_program(
        "gpipe", pipe.comm, 4, pipeline_module.planning_costs(pipe.config, pipe.layer_counts, seq_len))[0]
        for seq_len in (8, 2048)}
    with pytest.raises(ValueError, match="does not split into 4 equal microbatches"):
        pipe.step(*make_batch(2, 8, vocab=1024))
    return pipe.num_microbatches, pipe.program, planned, loss, want_loss


def test_a_step_runs_the_plan_made_for_its_sequence_length_on_twice_as_many_microbatches_as_stages():
    """On one rank every length plans alike, and the test of plans shared across lengths ran there: a pipeline
    that kept the plan made for the length it was built for passed, and so did another default microbatch
    count than the README's twice the stages."""
    per_rank = run_distributed(_planned_for_each_batch_worker, 2, timeout=TIMEOUT)
    for m, program, planned, loss, want_loss in per_rank:
        assert m == 4 and loss == pytest.approx(want_loss, abs=1e-5)
        assert program == planned[8]
    assert any(planned[8] != planned[2048] for _, _, planned, _, _ in per_rank), "the lengths must plan apart"


def _stages_in_turn(model, counts, x):
    """What a pipeline of `counts` stages computes from `x`, in one process: each stage a copy of `model`
    cut as its rank cuts it (`keep_local_part`), run by `DecoderParts` on the previous stage's output."""
    ranges = layer_ranges(counts)
    hidden = x
    for stage, layers in enumerate(ranges):
        first, last = stage == 0, stage == len(ranges) - 1
        part = copy.deepcopy(model)
        keep_local_part(part, layers, first, last)
        hidden = DecoderParts.of(part, layers, first, last).forward(hidden)
    return hidden


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "gemma3_text", "cohere2", "olmo3", "gpt_oss", "granite",
                                        "hyperclovax", "afmoe", "cohere", "minicpm3", "mistral", "nanochat",
                                        "granite_swa"])
def test_stages_in_turn_compute_the_family_forward(model_type):
    """The family tests run every layer on one stage; split in two, the second stage must still give each
    layer the mask and rotary tables of its own kind (config.layer_types[i] of its index in the whole model,
    not in the stage; GraniteSWA's of its own RoPE base), and the first stage the embedding scale (or NanoChat's
    norm) the family's forward applies (the last one the logit scale), or a multi-rank run trains another
    function than the model's."""
    if model_type.startswith("gemma") and TRANSFORMERS_MAJOR < 5:
        pytest.skip("Gemma scales its embeddings in forward before transformers 5 (refused)")
    model = _family(model_type, windows=True)  # layer 0 slides over 3 tokens, layer 1 attends to all
    if model is None or not hasattr(model.model, "rotary_emb"):
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type} a stage runs")
    x, _ = make_batch(4, 8)
    with torch.no_grad():
        want = model(x).logits
        torch.testing.assert_close(_stages_in_turn(model, [1, 1], x), want, atol=1e-5, rtol=1e-5)


def _nanochat_worker(rank, world_size):
    """A NanoChat step on two stages and its own forward and backward on one process (a copy): the loss, this
    stage's gradients, and what a forward hook on the final norm saw, which the forward calls twice, on the
    embeddings and on the last layer's output: the first stage's calls are the first, the last stage's the second,
    microbatch by microbatch."""
    model = _family("nanochat")
    ref = copy.deepcopy(model)
    x, y = make_batch(4, 8, num_microbatches=2)
    seen, ref_seen = [], []
    model.model.norm.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    ref.model.norm.register_forward_hook(lambda module, args, out: ref_seen.append(out.detach().clone()))
    loss = pp.Pipeline(model, num_microbatches=2, device="cpu").step(x, y)
    ref_loss = full_loss(ref, x, y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    assert_grads_close(grads(model), grads(ref), set(grads(model)), what=f"NanoChat, stage {rank}")
    torch.testing.assert_close(torch.cat(seen), ref_seen[rank], atol=1e-5, rtol=1e-5)
    return len(seen), sorted(grads(model))


def test_nanochat_norms_the_embeddings_on_its_first_stage():
    """NanoChat's forward passes the embeddings through its final norm too (parameter-free): its first stage must
    do so as well, holding that norm, and its last stage the norm's usual call."""
    if _family("nanochat") is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no nanochat")
    (calls_0, names_0), (calls_1, names_1) = run_distributed(_nanochat_worker, 2, timeout=TIMEOUT)
    assert calls_0 == calls_1 == 2  # one call per microbatch on each stage
    assert names_0[0].startswith("model.embed_tokens") and "lm_head.weight" in names_1


def test_a_stage_evaluates_without_embedding_dropout():
    """StarCoder2's forward drops embeddings only in training: `evaluate` must give the eval-mode model's
    loss, not a random one (the training test alone cannot tell dropout always on from dropout as asked)."""
    model = _family("starcoder2", embedding_dropout=0.5).train()
    x, y = make_batch(4, 8)
    with torch.no_grad():
        want = full_loss(copy.deepcopy(model).eval(), x, y).item()
    pipe = pp.Pipeline(model, num_microbatches=1, device="cpu")
    assert [pipe.evaluate(x, y) for _ in range(2)] == pytest.approx([want] * 2, abs=1e-5)


@pytest.mark.parametrize("model_type", ["granite", "hyperclovax"])
def test_embedding_multipliers_below_one_are_applied(model_type):
    """The scale tests use multipliers above one; a multiplier below one (which shrinks the embeddings) must
    be applied as well, or the stage trains a model with other embeddings than the family's."""
    model = _family(model_type, embedding_multiplier=0.25)
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type}")
    parts = DecoderParts.of(model, range(2), first=True, last=True)
    x, _ = make_batch(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(parts.forward(x), model(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3", "granite_swa"])
def test_each_layer_gets_the_positions_and_rotary_tables_its_family_forward_gives_it(model_type):
    """The very position ids and (cos, sin) tables, not only ones that compute nearly the same: RoPE depends
    on relative positions only, so positions shifted by one change the loss by rounding alone, yet rotary
    scalings that read the positions (dynamic NTK, longrope) then compute another function. Gemma 3 gives
    each layer the tables of its own kind, GraniteSWA those of its own RoPE base, or none."""
    if model_type.startswith("gemma") and TRANSFORMERS_MAJOR < 5:
        pytest.skip("Gemma's layers take two rotary tables of their own before transformers 5")
    model = _family(model_type, windows=model_type != "llama")
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type}")
    own, stage = _layer_inputs(model, "position_ids", "position_embeddings")
    for index, ((want_ids, want_tables), (ids, tables)) in enumerate(zip(own, stage)):
        assert torch.equal(ids.expand_as(want_ids), want_ids), f"layer {index}: position ids {ids}, not {want_ids}"
        assert (tables is None) == (want_tables is None), f"layer {index}: rotary tables {tables}, not {want_tables}"
        for got, want in zip(tables or (), want_tables or ()):
            assert torch.equal(got.expand_as(want), want), f"layer {index}: other rotary tables"


def test_granite_swa_layers_take_the_rotary_tables_of_their_own_base_on_a_model_built_on_meta():
    """GraniteSWA keeps a rotary embedding for each RoPE base its layers take (0: none) besides the unused global
    one. A Pipeline making it from meta must compute each one's tables at its own base (remade from the model's
    config, all would rotate at the global one), and two stages must each give their layers their own."""
    import transformers

    family = _family("granite_swa", num_hidden_layers=4, layer_rope_theta=[100.0, 0.0, 5000.0, 100.0])
    if family is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no granite_swa")
    config = family.config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    ref = transformers.AutoModelForCausalLM.from_config(config).float()
    assert len(ref.model.rotary_embs) == 2
    for made, want in zip(pipe.model.model.rotary_embs, ref.model.rotary_embs):
        torch.testing.assert_close(made.inv_freq, want.inv_freq, rtol=0, atol=0)
    x = _steps_as_the_same_weights(pipe, ref, what="GraniteSWA made by the pipeline")
    with torch.no_grad():
        torch.testing.assert_close(_stages_in_turn(ref, [2, 2], x), ref(x).logits, atol=1e-5, rtol=1e-5)


def test_a_granite_swa_config_naming_a_base_its_model_has_no_rotary_embedding_for_is_refused():
    """Its forward would fail on the missing tables (a KeyError); a stage must not rotate that layer otherwise."""
    model = _family("granite_swa")
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no granite_swa")
    model.config.layer_rope_theta = [0.0, 200.0]
    with pytest.raises(ValueError, match=r"config.layer_rope_theta\[1\] is 200.0, but model.model.rotary_embs holds "
                                         r"no rotary embedding of that base \(was the config changed"):
        pp.Pipeline(model, num_microbatches=2, device="cpu")


def test_a_buffer_the_models_init_weights_does_not_make_is_refused():
    """A Hugging Face model built on meta whose `_init_weights` leaves one of its buffers unmade: the buffer
    holds whatever memory `to_empty` gave it, so the pipeline must refuse rather than train with it."""
    with torch.device("meta"):
        model = build("llama", 2, meta=True)
        model.model.layers[1].mlp.register_buffer("scale", torch.ones(4), persistent=False)
    with pytest.raises(ValueError, match=r"buffer model.layers.1.mlp.scale was on the meta device and the model's "
                                         r"_init_weights does not compute it"):
        pp.Pipeline(model, num_microbatches=2, device="cpu")



def test_a_weight_two_layers_share_stays_one_on_a_model_built_on_meta():
    """Allocating a model built on meta gave each use of a shared weight a Parameter of its own: two layers of
    one stage that share a weight trained two, silently (only a tied embedding and head were tied again)."""
    model = build("llama", 4, meta=True)
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    layers = pp.Pipeline(model, num_microbatches=2, device="cpu").model.model.layers
    assert layers["0"].mlp.up_proj.weight is layers["1"].mlp.up_proj.weight

@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral", "sarvam_moe"])
def test_a_stage_reads_the_weights_transformers_converts_from_its_files(model_type, tmp_path):
    """Files as `save_pretrained` writes them, which transformers 5 converts while loading: each expert a tensor of
    its own where it holds them fused (Qwen2-MoE, Mixtral), and Sarvam-MoE's attention one fused q, k and v where
    it holds three. Each of two stages of the model built on meta reads its own tensors, converted as transformers
    does, and holds exactly the model's."""
    import transformers

    from pipeline_parallel.hf_weights import check_hf_weights, load_hf_weights

    model = _family(model_type)
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no {model_type}")
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(model.config)
    check_hf_weights(on_meta, tmp_path)
    want = model.state_dict()
    for stage, layers in enumerate(layer_ranges([1, 1])):
        part = copy.deepcopy(on_meta)
        keep_local_part(part, layers, stage == 0, stage == 1)
        materialize(part, torch.device("cpu"))
        load_hf_weights(part, tmp_path)
        for name, tensor in part.state_dict().items():
            assert torch.equal(tensor, want[name]), name


def test_only_a_tied_head_missing_from_the_files_takes_the_embedding(tmp_path):
    """`save_pretrained` leaves a tied head out of the files: the last stage reads it from the embedding, also where
    the files hold a head of their own (one stage took that head for both ends, two stages read two matrices). An
    untied model's files without the head are refused; the head was filled with the embedding, silently."""
    import transformers

    from safetensors.torch import load_file, save_file

    from pipeline_parallel.hf_weights import check_hf_weights, load_hf_weights

    for tie in (True, False):
        model = build("llama", tie=tie)
        model.save_pretrained(tmp_path / str(tie))
        assert tie != ("lm_head.weight" in load_file(tmp_path / str(tie) / "model.safetensors"))
    untied = tmp_path / "False" / "model.safetensors"
    save_file({k: v for k, v in load_file(untied).items() if k != "lm_head.weight"}, untied, metadata={"format": "pt"})
    tied = tmp_path / "True" / "model.safetensors"
    tensors = load_file(tied)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, tied, metadata={"format": "pt"})
    for tie in (True, False):
        with torch.device("meta"):
            on_meta = transformers.AutoModelForCausalLM.from_config(build("llama", tie=tie).config)
        last = copy.deepcopy(on_meta)
        keep_local_part(last, layer_ranges([2, 2])[1], False, True)
        materialize(last, torch.device("cpu"))
        if tie:
            check_hf_weights(on_meta, tmp_path / "True")
            load_hf_weights(last, tmp_path / "True")
            assert torch.equal(last.lm_head.weight, load_file(tmp_path / "True" / "model.safetensors")[
                "model.embed_tokens.weight"])
            continue
        for load in (check_hf_weights, load_hf_weights):
            with pytest.raises(ValueError, match=r"lacks 1 of the LlamaForCausalLM weights, e.g. \['lm_head.weight'\]"):
                load(on_meta if load is check_hf_weights else last, tmp_path / "False")


def test_experts_of_other_shapes_than_the_config_gives_are_refused(tmp_path):
    """Experts saved one by one, for a config.json whose experts are twice as wide: transformers 5 leaves the
    fused tensors unmade (it only logs), so the load must refuse rather than train with what they held (as it
    refuses an expert of another shape read by name under transformers 4)."""
    import transformers

    from pipeline_parallel.hf_weights import load_hf_weights

    model = _family("qwen2_moe")
    model.save_pretrained(tmp_path)
    model.config.moe_intermediate_size *= 2
    with torch.device("meta"):
        wider = transformers.AutoModelForCausalLM.from_config(model.config)
    materialize(wider, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"transformers did not make model.layers.0.mlp.experts.\w+ of the files' "
                                         r"\['model.layers.0.mlp.experts.0.\w+.weight'.*are their shapes those "
                                         r"config.json gives|model.layers.0.mlp.experts.0.\w+.weight has shape "
                                         r"\(\d+, 32\), the model \(\d+, 32\) \(from config.json\)"):
        load_hf_weights(wider, tmp_path)


def test_a_buffer_given_values_on_a_model_built_on_meta_keeps_them():
    """DeepSeek V3 built on meta, its router's correction bias given values (read from a checkpoint, say, as the
    refusal above asks): the Pipeline makes the weights and keeps the bias. Allocating the model discarded it
    (uninitialised memory on transformers 4.55) and transformers 5's `_init_weights` overwrote it with zeros."""
    import transformers

    model = _family("deepseek_v3")
    if model is None:
        pytest.skip(f"transformers {TRANSFORMERS_VERSION} has no deepseek_v3")
    config = model.config
    config.first_k_dense_replace = 1  # layer 1 routes its tokens to experts, with the bias
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    bias = torch.arange(config.n_routed_experts) * 0.5 - 0.25
    model.model.layers[1].mlp.gate.e_score_correction_bias = bias.clone()
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    assert torch.equal(pipe.model.model.layers["1"].mlp.gate.e_score_correction_bias, bias)
    assert math.isfinite(pipe.step(*make_batch(4, 8, num_microbatches=2)))

_REPLICA_GROUPS = ([0, 2], [1, 3])  # pp_rank != global rank in both, and the pipelines interleave


def _replica_worker(rank, world_size):
    groups = [dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=20)) for ranks in _REPLICA_GROUPS]
    replica = next(i for i, ranks in enumerate(_REPLICA_GROUPS) if rank in ranks)
    model = build("llama", 4, tie=True, seed=3)
    # each replica its own batch, so a transfer or agreement crossing replicas shows in the numbers
    x, y = make_batch(4, 6, seed=10 + replica, num_microbatches=2)
    want_loss, want, ref = reference_step(model, x, y)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu", group=groups[replica], split=2)
    loss = pipe.step(x, y)
    got = grads(pipe.model)
    assert_grads_close(got, want, set(got), what=f"replica {replica} rank {rank}")
    norm = float(pipe.clip_grad_norm_(float("inf")))
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    # A bad batch in each replica: each raises its own replica's error, on both of its ranks
    bad_x, bad_y = x.clone(), y.clone()
    if replica == 0:
        bad_y[0, 0] = 99
    else:
        bad_x[0, 0] = -1
    try:
        pipe.step(bad_x, bad_y)
        said = None
    except ValueError as e:
        said = str(e)
    return replica, loss, want_loss, norm, want_norm, said


def test_pipelines_on_sub_groups_train_exactly_and_apart():
    """Two pipelines side by side, each on a sub-group whose ranks are not its global ranks (one pipeline per
    data-parallel replica, as PipeComm promises): each trains exactly on its own batch, and agrees only within
    itself."""
    results = run_distributed(_replica_worker, 4, timeout=120)
    for replica, loss, want_loss, norm, want_norm, said in results:
        assert loss == pytest.approx(want_loss, abs=1e-5), replica
        assert norm == pytest.approx(want_norm, rel=1e-5), replica
        expected = (r"pipeline rank 1: labels holds token IDs .* to 99" if replica == 0
                    else r"pipeline rank 0: input_ids holds token IDs from -1")
        assert said is not None and re.search(expected, said), (replica, said)
    assert results[0][2] != pytest.approx(results[1][2]), "the replicas must train on different batches"


def test_a_frozen_model_evaluates():
    """A step of a model with nothing to train is refused; an evaluation of it is not (a frozen reference model)."""
    model = build("llama", 4)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    for param in pipe.parameters():
        param.requires_grad_(False)
    x, y = make_batch(4, 6, num_microbatches=2)
    with torch.no_grad():
        want = full_loss(build("llama", 4), x, y).item()
    assert pipe.evaluate(x, y) == pytest.approx(want, abs=1e-5)
    with pytest.raises(RuntimeError, match="no parameter of the model requires grad"):
        pipe.step(x, y)


def _without_and_with_recompute(model, run, **options) -> list:
    """`run(pipe)` on a GPipe pipeline of 4 microbatches of a `model()` without recompute, then on one with."""
    return [run(pp.Pipeline(model(), schedule="gpipe", num_microbatches=4, device="cpu", recompute=recompute,
                            **options)) for recompute in (False, True)]


def _recompute_dropout_worker(rank, world_size, split):
    x, y = make_batch(8, 8, num_microbatches=4)

    def run(pipe):
        torch.manual_seed(11 + rank)
        loss = pipe.step(x, y)
        return loss, grads(pipe.model), torch.get_rng_state()

    (loss, kept, state), (recomputed_loss, recomputed, recomputed_state) = _without_and_with_recompute(
        lambda: build("llama", 2 * world_size, seed=3, attention_dropout=0.5), run, split=split)
    return (recomputed_loss == loss, torch.equal(recomputed_state, state), kept.keys() == recomputed.keys(),
            [n for n in kept if not torch.equal(kept[n], recomputed[n])])


@pytest.mark.parametrize("world_size, split", [(1, None), (2, 2)])
def test_recompute_draws_dropout_as_the_forward_did(world_size, split):
    """A recomputed forward runs from the random state its first run had, so its dropout masks, hence the
    gradients, are those of the step without recompute, bit for bit (under the same split: another one adds the
    weight gradients up in another order); and the step leaves the random state where that step leaves it.
    (Which microbatches recompute: GPipe's first three of 4 on each stage; on 2 ranks the last stage's last two
    backwards split, the recomputed graph serving both passes.)"""
    results = (run_distributed(_recompute_dropout_worker, world_size, split) if world_size > 1
               else [_recompute_dropout_worker(0, 1, split)])
    for same_loss, same_state, same_names, differing in results:
        assert same_loss and same_state and same_names and differing == []


@pytest.mark.parametrize("watch", ["hook", "frozen"])
def test_recompute_leaves_a_watched_head_to_autograd(watch):
    """A head whose weight's gradient is watched (a hook) or that is frozen runs under autograd, not `HeadLoss`: so
    too when its forward runs again (GPipe on one stage recomputes the first three of 4 microbatches), where the
    hook fired once, for the microbatch not recomputed."""
    x, y = make_batch(8, 8, num_microbatches=4)

    def run(pipe):
        calls = []
        if watch == "hook":
            pipe.model.lm_head.weight.register_hook(lambda grad: calls.append(grad.clone()))
        else:
            pipe.model.lm_head.weight.requires_grad_(False)
        return pipe.step(x, y), len(calls), grads(pipe.model)

    (loss, calls, kept), (recomputed_loss, recomputed_calls, recomputed) = _without_and_with_recompute(
        lambda: build("llama", 2, seed=3), run)
    assert recomputed_calls == calls == (4 if watch == "hook" else 0)
    assert recomputed_loss == loss and ("lm_head.weight" in kept) == (watch == "hook")
    assert kept.keys() == recomputed.keys() and all(torch.equal(kept[n], recomputed[n]) for n in kept)


def test_recompute_reports_the_loss_a_watched_head_gives(monkeypatch):
    """With a hook on the head's weight the loss comes from autograd's path (one sum over the tokens), and so does
    that of a forward that keeps no graph: `HeadLoss`, a chunk at a time, sums in another order (here one token a
    chunk), which differed in the last bits."""
    from pipeline_parallel import loss as loss_module

    monkeypatch.setattr(loss_module, "_CHUNK_BYTES", 1)
    for seed in (2, 3, 5):
        x, y = make_batch(8, 16, vocab=1000, seed=seed, num_microbatches=4)

        def run(pipe):
            pipe.model.lm_head.weight.register_hook(lambda grad: grad)
            return pipe.step(x, y)

        losses = _without_and_with_recompute(lambda: build("llama", 2, vocab=1000, seed=seed), run)
        assert losses[0] == losses[1], seed


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_recomputing_pipeline_runs_the_plan_made_for_recompute(schedule):
    """Each rank gets the split planned for stages that run forwards again (`build_schedule(recompute=True)`), and
    lets go of its sends where the simulated step with those forwards says, not the plan of a pipeline without."""
    from types import SimpleNamespace

    from pipeline_parallel import pipeline as pipeline_module
    from pipeline_parallel.schedules import estimated_duration, recomputed, send_releases

    pipeline_module._planned.cache_clear()
    costs = (1.0, 1.0)
    want = pp.build_schedule(schedule, 2, 8, stage_costs=list(costs), recompute=True)
    want_releases = send_releases(want, 2, estimated_duration(list(costs), recomputed(want)))
    plain = pp.build_schedule(schedule, 2, 8, stage_costs=list(costs))
    assert want != plain or send_releases(plain, 2, estimated_duration(list(costs))) != want_releases
    for rank in range(2):
        comm = SimpleNamespace(pp_size=2, pp_rank=rank, prefetch_receives=True)
        pipeline_module.rank_program(schedule, comm, 8, costs)  # a plan without recompute first
        program, releases = pipeline_module.rank_program(schedule, comm, 8, costs, recompute=True)
        assert program == want[rank] and releases == want_releases[rank]


def test_zero_grad_without_set_to_none_keeps_zeroed_gradients():
    """As nn.Module.zero_grad(set_to_none=False): every gradient stays, filled with zeros (an optimizer
    holding them, or a later accumulation in place, sees the same tensors)."""
    pipe = pp.Pipeline(build("llama", 2), num_microbatches=2, device="cpu")
    x, y = make_batch(2, 6, num_microbatches=2)
    pipe.step(x, y)
    before = {n: p.grad for n, p in pipe.named_parameters()}
    pipe.zero_grad(set_to_none=False)
    for name, p in pipe.named_parameters():
        assert p.grad is before[name] and not p.grad.any(), name
    pipe.zero_grad()
    assert all(p.grad is None for p in pipe.parameters())


def test_clip_grad_norm_without_any_gradient_is_torchs_float32_zero():
    """Before any step (or after zero_grad) no rank holds a gradient: the norm is torch's, a float32 zero."""
    model = build("llama", 2)
    want = torch.nn.utils.clip_grad_norm_(copy.deepcopy(model).parameters(), 1.0)
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu")
    norm = pipe.clip_grad_norm_(1.0)
    assert norm.dtype == want.dtype == torch.float32 and float(norm) == float(want) == 0.0
    assert all(p.grad is None for p in pipe.parameters())


def _frozen_tied_keeps_its_gradient_worker(rank, world_size):
    pipe = pp.Pipeline(build("llama", 2, tie=True), num_microbatches=2, device="cpu")
    x, y = make_batch(2, 6, num_microbatches=2)
    pipe.step(x, y)
    tied = pipe.model.model.embed_tokens.weight if rank == 0 else pipe.model.lm_head.weight
    before = tied.grad.clone()
    tied.requires_grad_(False)  # at both ends, without zero_grad: as in one process, .grad stays as it was
    pipe.step(x, y)
    return tied.grad is not None and torch.equal(tied.grad, before)


def test_a_tied_weight_frozen_after_a_step_keeps_its_gradient():
    assert run_distributed(_frozen_tied_keeps_its_gradient_worker, 2, timeout=TIMEOUT) == [True, True]


def test_evaluate_runs_inside_inference_mode():
    """Only a training step needs a graph: evaluate gives the loss inside torch.inference_mode() too."""
    x, y = make_batch(2, 6, num_microbatches=2)
    want = full_loss(build("llama", 2), x, y).item()
    pipe = pp.Pipeline(build("llama", 2), num_microbatches=2, device="cpu")
    with torch.inference_mode():
        assert pipe.evaluate(x, y) == pytest.approx(want, abs=1e-5)


def _as_one_process_worker(rank, world_size):
    """What the ranks may do apart and still train as one process: name the schedule by either of its names; round a
    tied weight's ends apart (as an optimizer's stochastic rounding, or its sums ordered otherwise on each end, do);
    choose an optimizer's parameter groups by name, the last rank's end of a tied matrix named lm_head.weight. Last,
    a step after the process group is gone."""
    x, y = make_batch(4, 6, num_microbatches=2)
    afab = pp.Pipeline(build("llama", 4), "afab" if rank == 0 else "gpipe", num_microbatches=2, device="cpu")
    afab_loss = afab.step(x, y)
    ref, pipe = build("llama", 4, tie=True), pp.Pipeline(build("llama", 4, tie=True), num_microbatches=2, device="cpu")

    def adamw(named):
        named = [(n, p) for n, p in named]
        no_decay = [p for n, p in named if "embed_tokens" in n or n == "lm_head.weight"]
        return torch.optim.AdamW([{"params": [p for _, p in named if not any(p is q for q in no_decay)]},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.5)

    optimizer, ref_optimizer = adamw(pipe.named_parameters()), adamw(ref.named_parameters())
    for step in range(3):
        if step == 1 and rank == world_size - 1:  # the head's end a rounding apart, in a few entries
            with torch.no_grad():
                head = pipe.model.lm_head.weight
                head[:3] = torch.nextafter(head[:3], torch.full_like(head[:3], math.inf))
        losses = pipe.step(x, y), full_loss(ref, x, y)
        losses[1].backward()
        optimizer.step(), ref_optimizer.step()
        pipe.zero_grad(), ref_optimizer.zero_grad()
    ref_weights = dict(ref.named_parameters(remove_duplicate=False))
    largest = max((p - ref_weights[name]).abs().max().item() for name, p in pipe.named_parameters())
    end = pipe.model.model.embed_tokens.weight if rank == 0 else pipe.model.lm_head.weight
    dist.destroy_process_group()
    with pytest.raises(RuntimeError) as gone:
        pipe.step(x, y)
    return afab_loss, largest, losses[0] - losses[1].item(), str(gone.value), end.detach().clone()


def test_ranks_may_name_a_schedule_or_round_a_tied_weight_apart_as_one_process_would():
    """"afab" on one rank and "gpipe" on another were refused as two schedules; a tied weight's ends a rounding apart
    are one matrix again at the next step (the head takes the embedding), and an optimizer's groups by name that put
    the last rank's lm_head.weight with the embedding train as one process. A step after destroy_process_group
    blamed an earlier step's transfers."""
    x, y = make_batch(4, 6, num_microbatches=2)
    want = full_loss(build("llama", 4), x, y).item()
    results = run_distributed(_as_one_process_worker, 2, timeout=TIMEOUT)
    assert torch.equal(results[0][-1], results[1][-1]), "the ends were not made one matrix again"
    for rank, (afab_loss, largest, loss_difference, gone, _) in enumerate(results):
        assert afab_loss == pytest.approx(want, abs=1e-5)
        assert largest < 1e-5 and abs(loss_difference) < 1e-5, (rank, largest, loss_difference)
        assert gone == ("the process group this pipeline communicates over was destroyed (destroy_process_group); "
                        "build the Pipeline again after init_process_group")


def _prehook_in_place_worker(rank, world_size):
    model = build("llama", 4)
    model.model.layers[3].register_forward_pre_hook(lambda module, args: args[0].add_(1.0))  # on stage 1's input
    pipe = pp.Pipeline(model, num_microbatches=2, device="cpu", layer_counts=[3, 1])
    try:
        pipe.step(*make_batch(4, 6, num_microbatches=2))
    except RuntimeError as e:
        return str(e), getattr(e, "__notes__", [])
    return None


def test_a_hook_changing_a_stage_input_in_place_is_told_how_to_change_it():
    """A received stage input is a leaf of the stage's graph (in one process it is not): autograd's refusal of an
    in-place change to it said nothing of the pipeline."""
    (message_0, _), (message_1, notes) = run_distributed(_prehook_in_place_worker, 2, timeout=TIMEOUT)
    assert message_0.startswith("pipeline rank 1 failed during the step (RuntimeError: a leaf Variable")
    assert "leaf Variable that requires grad is being used in an in-place operation" in message_1
    assert notes[0].startswith("pipeline_parallel: a stage's input, received from the stage before, is a leaf of the "
                               "stage's graph: a hook (or module) that changes it in place")
