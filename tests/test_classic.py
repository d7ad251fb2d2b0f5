"""The one-call classic API (train_step_pipeline_afab / _1f1b) on a full HF Llama, against a microbatch loop.

Also checks the no-hooks rule: the engine registers no hooks, and hooks the user puts on the model's
modules see, on each rank, exactly what they see in a single-process run, microbatch by microbatch.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_distributed
from _models import assert_grads_close, build, grads, layer_ranges, make_batch, stage_names

import pipeline_parallel as pp

TIMEOUT = 120
API = {"afab": pp.train_step_pipeline_afab, "1f1b": pp.train_step_pipeline_1f1b}
SCHEDULE = {"afab": "gpipe", "1f1b": "1f1b"}
# Full backward hooks on the embedding (integer inputs) fire with respect to outputs only, and torch says so.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


@dataclass(frozen=True)
class Case:
    name: str
    api: str
    m: int
    mb_size: int = 2
    seq: int = 8
    layers: int = 4
    tie: bool = False
    hooks: bool = True
    freq: bool = False  # the embedding scales its gradient by each token's count (in a microbatch, here)

    def __repr__(self):
        return self.name


CASES = {
    1: [Case("w1-afab-m3", "afab", 3), Case("w1-1f1b-m2", "1f1b", 2, tie=True)],
    2: [Case("w2-afab-m2", "afab", 2), Case("w2-afab-m3", "afab", 3, mb_size=1),
        Case("w2-1f1b-m4", "1f1b", 4), Case("w2-1f1b-m3-tied", "1f1b", 3, tie=True),
        Case("w2-afab-m2-scale-grad-by-freq", "afab", 2, freq=True)],  # failed: no sparse backward for it
    4: [Case("w4-afab-m4", "afab", 4), Case("w4-1f1b-m6", "1f1b", 6, layers=8, mb_size=1),
        Case("w4-1f1b-m4-tied", "1f1b", 4, tie=True, hooks=False)],
}

HOOKED = ["model.embed_tokens", "model.norm", "lm_head"]


def _hooked_names(layers):
    return HOOKED + [f"model.layers.{i}" for i in range(layers)]


def _microbatches(case: Case, index: int):
    x, y = make_batch(case.mb_size * case.m, case.seq, seed=50 + index, num_microbatches=case.m)
    return list(x.chunk(case.m)), list(y.chunk(case.m))


def _model(case: Case):
    model = build("llama", case.layers, tie=case.tie, seed=3)
    model.model.embed_tokens.scale_grad_by_freq = case.freq
    return model


def _first_tensor(value):
    return value[0] if isinstance(value, tuple) else value


def _add_hooks(model, names):
    """Forward hooks and full backward hooks recording (detached) outputs and grad_outputs per module."""
    record = {name: {"out": [], "grad_out": []} for name in names}
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module.register_forward_hook(lambda m, args, out, n=name: record[n]["out"].append(
            _first_tensor(out).detach().clone()))
        module.register_full_backward_hook(lambda m, gin, gout, n=name: record[n]["grad_out"].append(
            gout[0].detach().clone()))
    return record


def _hook_state(model):
    """Every hook dict of every module (and the global ones): the keys, to compare before and after."""
    attrs = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
             "_load_state_dict_pre_hooks", "_state_dict_pre_hooks", "_load_state_dict_post_hooks")
    state = {name: tuple(tuple(getattr(m, a, {}).keys()) for a in attrs) for name, m in model.named_modules()}
    mod = torch.nn.modules.module
    state["<global>"] = tuple(len(getattr(mod, g)) for g in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))
    state["<params>"] = tuple(len(p._backward_hooks or {}) for p in model.parameters())
    return state


def _run_case(rank, world_size, case: Case, index: int) -> dict:
    model = _model(case)
    record = _add_hooks(model, _hooked_names(case.layers)) if case.hooks else None
    before = _hook_state(model)
    inputs, targets = _microbatches(case, index)
    loss = API[case.api](model, inputs, targets, torch.device("cpu"), torch.float32)
    return {
        "loss": loss,
        "grads": grads(model),
        "no_grad": sorted(n for n, p in model.named_parameters() if p.grad is None),
        "hooks_unchanged": _hook_state(model) == before,
        "record": record,
    }


def _worker(rank, world_size, cases):
    results = {}
    for index, case in enumerate(cases):
        if world_size > 1:  # re-synchronise between cases, even after a failure on some rank
            dist.barrier()
        try:
            results[case.name] = _run_case(rank, world_size, case, index)
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
    return results


def _microbatch_loop(ref, inputs, targets) -> float:
    """What the classic API computes, in one process: each microbatch's mean cross-entropy over the number of
    microbatches, backward one by one; returns their sum."""
    total = 0.0
    for x, y in zip(inputs, targets):
        loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100) / len(inputs)
        loss.backward()
        total += loss.item()
    return total


def _reference(case: Case, index: int):
    ref = copy.deepcopy(_model(case))
    record = _add_hooks(ref, _hooked_names(case.layers))
    total = _microbatch_loop(ref, *_microbatches(case, index))
    return total, grads(ref), record, [n for n, _ in ref.named_parameters(remove_duplicate=False)]


@pytest.fixture(scope="module")
def results():
    build("llama", 1)  # import the model classes once in the parent, not in every forked rank
    cache = {}

    def get(world_size):
        if world_size not in cache:
            if world_size == 1:  # no process group: one rank, no communication at all
                assert not dist.is_initialized()
                cache[1] = [_worker(0, 1, CASES[1])]
            else:
                cache[world_size] = run_distributed(_worker, world_size, CASES[world_size], timeout=TIMEOUT)
        return cache[world_size]

    return get


def _params():
    return [pytest.param(ws, i, case, id=case.name) for ws, cases in CASES.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("world_size, index, case", _params())
def test_classic_step_matches_microbatch_loop(results, world_size, index, case):
    per_rank = [r[case.name] for r in results(world_size)]
    for rank, got in enumerate(per_rank):
        assert "error" not in got, f"rank {rank} failed:\n{got['error']}"
    ref_loss, ref_grads, ref_record, full_names = _reference(case, index)
    counts = [case.layers // world_size] * world_size  # the classic API splits the layers evenly
    schedule = pp.build_schedule(SCHEDULE[case.api], world_size, case.m)
    for rank, (got, layers) in enumerate(zip(per_rank, layer_ranges(counts))):
        first, last = rank == 0, rank == world_size - 1
        what = f"{case.name} rank {rank}"
        owned = stage_names(full_names, layers, first, last)
        if case.tie and (first or last):  # the full model is kept: the tied matrix has both names on both ends
            owned |= {"lm_head.weight", "model.embed_tokens.weight"}
        assert set(got["grads"]) == owned, f"{what}: gradients only on (and on all of) what the rank runs"
        assert_grads_close(got["grads"], ref_grads, owned, what=what)
        if last:
            assert got["loss"] == pytest.approx(ref_loss, abs=1e-5), what
        else:
            assert got["loss"] is None, what
        assert got["hooks_unchanged"], f"{what}: the engine added or removed hooks"
        if not case.hooks:
            continue
        # Hooks fire on the modules this rank runs, once per microbatch, with the reference's tensors.
        modules = [n for n in _hooked_names(case.layers) if (
            n.startswith("model.layers.") and int(n.split(".")[2]) in layers
            or n == "model.embed_tokens" and first or n in ("model.norm", "lm_head") and last)]
        # The schedule's backward order on this rank (GPipe runs the microbatches' backwards in reverse).
        backward_order = [a.mb for a in schedule[rank] if a.kind.value == "B"]
        for name in _hooked_names(case.layers):
            rec = got["record"][name]
            if name not in modules:
                assert rec == {"out": [], "grad_out": []}, f"{what}: {name} ran on a rank that does not own it"
                continue
            assert len(rec["out"]) == case.m and len(rec["grad_out"]) == case.m, f"{what}: {name}"
            for mb in range(case.m):
                torch.testing.assert_close(rec["out"][mb], ref_record[name]["out"][mb], atol=1e-5, rtol=0,
                                           msg=lambda m: f"{what} {name} output of microbatch {mb}: {m}")
            for i, mb in enumerate(backward_order):
                torch.testing.assert_close(rec["grad_out"][i], ref_record[name]["grad_out"][mb], atol=1e-5, rtol=0,
                                           msg=lambda m: f"{what} {name} grad_output of microbatch {mb}: {m}")


def test_classic_world_one_needs_no_process_group():
    assert not dist.is_initialized()
    case = Case("w1", "1f1b", 2, hooks=False)
    inputs, targets = _microbatches(case, 0)
    model = _model(case)
    loss = pp.train_step_pipeline_1f1b(model, inputs, targets, "cpu", torch.float32)
    ref_loss, ref_grads, _, names = _reference(case, 0)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert_grads_close(grads(model), ref_grads, names)
    assert not dist.is_initialized()


def test_classic_steps_plan_their_schedule_once(monkeypatch):
    """Each call planned the schedule again: 0.1-0.4 s of a 1 s step at 4 ranks and 32 microbatches."""
    from pipeline_parallel import pipeline as pipeline_module

    calls = []
    planned = pipeline_module.build_schedule
    monkeypatch.setattr(pipeline_module, "build_schedule", lambda *args, **kwargs: calls.append(args) or
                        planned(*args, **kwargs))
    pipeline_module._planned.cache_clear()  # plans other tests made
    case = Case("w1", "1f1b", 2, hooks=False)
    inputs, targets = _microbatches(case, 0)
    model = _model(case)
    for _ in range(3):
        pp.train_step_pipeline_1f1b(model, inputs, targets, "cpu", torch.float32)
    assert len(calls) == 1


def test_classic_float64_keeps_float64_loss_and_gradients():
    """dtype=float64 means the loss too: cross-entropy is not taken in float32 (a 1e-7 error before)."""
    case = Case("f64", "afab", 2, hooks=False)
    inputs, targets = _microbatches(case, 0)
    model, ref = _model(case), _model(case).double()
    loss = pp.train_step_pipeline_afab(model, inputs, targets, "cpu", torch.float64)
    assert loss == pytest.approx(_microbatch_loop(ref, inputs, targets), abs=1e-12)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-12, rtol=0, msg=name)


def _tied_apart_worker(rank, world_size):
    """Each rank initialised its own copy of the tied matrix (no shared seed), so the ends differ."""
    case = Case("tied-apart", "1f1b", 2, tie=True, hooks=False)
    inputs, targets = _microbatches(case, 0)
    model = _model(case)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.1 * rank)
    loss = pp.train_step_pipeline_1f1b(model, inputs, targets, "cpu", torch.float32)
    return loss, model.model.embed_tokens.weight.detach().clone(), grads(model)


def test_classic_tied_ends_initialised_apart_take_the_first_ranks_embedding():
    """As tying does in one process and as Pipeline does: the last rank's LM head becomes rank 0's embedding
    (it stayed its own, so the step trained a head that was not the embedding)."""
    (_, first_weight, first_grads), (loss, last_weight, last_grads) = run_distributed(_tied_apart_worker, 2,
                                                                                       timeout=TIMEOUT)
    case = Case("tied-apart", "1f1b", 2, tie=True, hooks=False)
    ref_loss, ref_grads, _, names = _reference(case, 0)  # rank 0's model, in one process
    assert torch.equal(first_weight, last_weight)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for got in (first_grads, last_grads):
        torch.testing.assert_close(got["model.embed_tokens.weight"], ref_grads["model.embed_tokens.weight"],
                                   atol=1e-5, rtol=0)


def _float64_worker(rank, world_size):
    case = Case("f64", "1f1b", 2, hooks=False)
    inputs, targets = _microbatches(case, 0)
    model = _model(case)
    loss = pp.train_step_pipeline_1f1b(model, inputs, targets, "cpu", torch.float64)
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_classic_float64_across_ranks_hands_on_float64():
    """dtype sets what crosses between the ranks too: a float64 step on two ranks equals one float64 process."""
    case = Case("f64", "1f1b", 2, hooks=False)
    inputs, targets = _microbatches(case, 0)
    ref = _model(case).double()
    ref_loss = _microbatch_loop(ref, inputs, targets)
    ref_grads = dict(ref.named_parameters())
    (first_loss, first_grads), (loss, last_grads) = run_distributed(_float64_worker, 2, timeout=TIMEOUT)
    assert first_loss is None and loss == pytest.approx(ref_loss, abs=1e-12)
    for got in (first_grads, last_grads):
        for name, grad in got.items():
            assert grad.dtype == torch.float64, name
            torch.testing.assert_close(grad, ref_grads[name].grad, atol=1e-12, rtol=0, msg=name)
    assert len(first_grads) + len(last_grads) == len(ref_grads)
