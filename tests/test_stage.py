"""PipelineStage: a backward split into input gradient and weight gradients equals the full backward. No processes."""

import contextlib
import copy

import pytest
import torch
from _models import build, enable_checkpointing, make_batch
from _tensors_made import RowsMade

from pipeline_parallel.models.decoder import DecoderParts
from pipeline_parallel.models.materialize import keep_local_part
from pipeline_parallel.stage import PipelineStage


def _stage(model, layers, stage_idx, num_stages, autocast_dtype=None):
    model = copy.deepcopy(model)
    first, last = stage_idx == 0, stage_idx == num_stages - 1
    keep_local_part(model, layers, first, last)
    return model, PipelineStage(DecoderParts.of(model, layers, first, last), stage_idx, num_stages, autocast_dtype)


@pytest.mark.parametrize("kind, autocast_dtype", [("own", None), ("llama", None), ("qwen2", None), ("mistral", None),
                                                   ("own", torch.bfloat16)], ids=["own", "llama", "qwen2", "mistral",
                                                                                   "own-bf16-autocast"])
@pytest.mark.parametrize("stage_idx", [1, 2], ids=["middle", "last"])
def test_split_backward_equals_full_backward(kind, autocast_dtype, stage_idx):
    torch.manual_seed(0)
    full_model = build(kind, num_layers=3, seed=3)
    x, y = make_batch(4, 8, seed=1, num_microbatches=2)
    hidden = [torch.randn(2, 8, full_model.config.hidden_size) for _ in range(2)]
    grads_out = [torch.randn(2, 8, full_model.config.hidden_size) for _ in range(2)]
    last = stage_idx == 2
    results = []
    for split in (False, True):
        model, stage = _stage(full_model, range(stage_idx, stage_idx + 1), stage_idx, 3, autocast_dtype)
        for mb in range(2):  # two microbatches: the weight pass must accumulate onto existing grads
            stage.forward(mb, hidden[mb], y.chunk(2)[mb] if last else None, loss_scale=0.5)
        input_grads = []
        for mb in (1, 0):
            grad = None if last else grads_out[mb]
            if split:
                input_grads.append(stage.backward_input(mb, grad))
                assert all(p.grad is None for p in model.parameters()) or mb == 0, "weights wait for the weight pass"
                assert stage.num_saved == 2 - (mb == 0)  # still held until its weight pass
                stage.backward_weight(mb)
            else:
                input_grads.append(stage.backward(mb, grad))
        assert stage.num_saved == 0
        results.append((input_grads, {n: p.grad for n, p in model.named_parameters()}))
    (full_inputs, full_weights), (split_inputs, split_weights) = results
    for a, b in zip(full_inputs, split_inputs):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert full_weights.keys() == split_weights.keys() and all(g is not None for g in split_weights.values())
    for name, grad in full_weights.items():
        torch.testing.assert_close(split_weights[name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["own", "llama"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_last_stage_runs_its_head_backward_by_hand_unless_a_hook_watches(kind, split):
    """Unwatched, the last stage stops autograd before its head (`loss.HeadLoss`); a forward hook on
    the head puts it back under autograd, and fires. Both give the same loss and gradients."""
    full_model = build(kind, num_layers=2, seed=3)
    _, y = make_batch(4, 8, seed=1, num_microbatches=2)
    hidden = [torch.randn(2, 8, full_model.config.hidden_size) for _ in range(2)]
    results = []
    for watched in (False, True):
        model, stage = _stage(full_model, range(1, 2), 1, 2)
        calls = []
        if watched:
            model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
        losses = [stage.forward(mb, hidden[mb], y.chunk(2)[mb], loss_scale=0.5) for mb in range(2)]
        assert (stage._saved[0].head is None) == watched
        input_grads = []
        for mb in range(2):
            if split:
                input_grads.append(stage.backward_input(mb, None))
                stage.backward_weight(mb)
            else:
                input_grads.append(stage.backward(mb, None))
        assert len(calls) == (2 if watched else 0)
        results.append((losses, input_grads, {n: p.grad for n, p in model.named_parameters()}))
    (by_hand, by_hand_inputs, by_hand_weights), (autograd, autograd_inputs, autograd_weights) = results
    torch.testing.assert_close(by_hand, autograd, atol=1e-6, rtol=0)
    torch.testing.assert_close(by_hand_inputs, autograd_inputs, atol=1e-6, rtol=0)
    assert by_hand_weights.keys() == autograd_weights.keys()
    for name, grad in autograd_weights.items():
        torch.testing.assert_close(by_hand_weights[name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["own", "llama"])
def test_last_stage_evaluates_its_head_in_chunks_unless_a_hook_watches_its_call(kind, monkeypatch):
    """An evaluation's loss comes from `HeadLoss` without gradients (the head's logits a chunk at a time),
    for a frozen head too; a forward hook on the head gets the head called, and fires. Same loss; nothing kept."""
    from pipeline_parallel import loss as loss_module

    full_model = build(kind, num_layers=2, seed=3, vocab=70)  # no other tensor 70 wide
    _, y = make_batch(4, 8, seed=1, num_microbatches=2)
    hidden = torch.randn(2, 8, full_model.config.hidden_size)
    monkeypatch.setattr(loss_module, "_CHUNK_BYTES", 3 * 4 * full_model.config.vocab_size)  # 3 tokens a chunk
    losses = []
    for watched in (False, True):
        model, stage = _stage(full_model, range(1, 2), 1, 2)
        model.lm_head.weight.requires_grad_(False)
        calls = []
        if watched:
            model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
        with torch.no_grad(), RowsMade(full_model.config.vocab_size) as made:
            losses.append(stage.forward(0, hidden, y.chunk(2)[0], loss_scale=0.5, training=False))
        assert len(calls) == watched and not stage._saved
        assert max(made.rows) == (16 if watched else 3)  # the head's logits whole when its call is watched
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=0)


def test_first_stage_has_no_input_gradient_to_split():
    model, stage = _stage(build("own", num_layers=2), range(0, 1), 0, 2)
    x, _ = make_batch(2, 8)
    stage.forward(0, x)
    with pytest.raises(ValueError, match="first stage"):
        stage.backward_input(0, torch.zeros(2, 8, 32))


def _split_or_whole(out_of, params, split):
    """(input grad, parameter grads, .grad set before the weight pass?, hook calls) of one backward
    of `out_of(x)`, whole or split by `_WeightPass`; a hook on the first use's output counts its calls."""
    from pipeline_parallel.stage import _WeightPass

    torch.manual_seed(0)
    x0, grad_out = torch.randn(3, 6), torch.randn(3, 6)
    for p in params:
        p.grad = None
    calls = []
    x = x0.clone().requires_grad_()
    out = out_of(x, lambda t: t.register_hook(lambda g: calls.append(g.norm().item())))
    if not split:
        out.backward(grad_out)
        return x.grad, [p.grad.clone() for p in params], True, calls
    weight_pass = _WeightPass(params)
    grad_input = weight_pass.input_grad(out, x, grad_out)
    early = any(p.grad is not None for p in params)
    weight_pass.run()
    return grad_input, [p.grad.clone() for p in params], early, calls


def test_split_backward_with_a_weight_used_twice_in_a_row_runs_whole():
    """One weight at two places along the path (layers sharing it): a weight pass from its later use
    would run the activation gradients back to the earlier one again, and their hooks: not split."""
    torch.manual_seed(0)
    weight, bias, scale = (torch.nn.Parameter(torch.randn(*shape)) for shape in ((6, 6), (6,), (6,)))

    def out_of(x, hook):
        hidden = torch.tanh(torch.nn.functional.linear(x, weight, bias))
        hook(hidden)
        return torch.nn.functional.linear(hidden, weight) * scale

    whole = _split_or_whole(out_of, [weight, bias, scale], split=False)
    split = _split_or_whole(out_of, [weight, bias, scale], split=True)
    torch.testing.assert_close(split[0], whole[0])
    for a, b in zip(split[1], whole[1]):
        torch.testing.assert_close(a, b)
    assert split[2], "the whole backward ran in the first pass"
    assert split[3] == whole[3] and len(whole[3]) == 1, "the hook between the uses ran once, with the full gradient"


def test_split_backward_with_a_weight_used_side_by_side_splits():
    """One weight used in two branches that do not feed each other (as the experts of a fused MoE
    weight): split, each use's gradient counted once."""
    torch.manual_seed(0)
    weight, scale = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6))

    def out_of(x, hook):
        hook(x * 1.0)
        return torch.nn.functional.linear(torch.tanh(x), weight) * scale + torch.nn.functional.linear(x * x, weight)

    whole = _split_or_whole(out_of, [weight, scale], split=False)
    split = _split_or_whole(out_of, [weight, scale], split=True)
    torch.testing.assert_close(split[0], whole[0])
    for a, b in zip(split[1], whole[1]):
        torch.testing.assert_close(a, b)
    assert not split[2], "no weight gradient before the weight pass"
    assert split[3] == whole[3]


@pytest.mark.parametrize("watch", ["hook", "retain_grad"])
def test_split_backward_with_a_gradient_hook_where_a_weight_meets_the_activations_runs_whole(watch):
    """A gradient hook (or retain_grad) on a norm's output, whose autograd node is where the norm's weight
    meets the activations: the weight pass restarted autograd there and ran the hook again, on what it had
    changed, so the weight's gradient took its change twice (and the retained .grad doubled)."""
    full_model = build("llama", num_layers=3, seed=3)
    hidden, grad_out = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    results = []
    for split in (False, True):
        model, stage = _stage(full_model, range(1, 2), 1, 3)
        seen = []

        def watch_output(module, args, out):
            if watch == "hook":
                out.register_hook(lambda grad: (seen.append(grad.clone()), grad * 2)[1])
            else:
                out.retain_grad()
                seen.append(out)

        model.model.layers["1"].input_layernorm.register_forward_hook(watch_output)
        stage.forward(0, hidden)
        if split:
            input_grad = stage.backward_input(0, grad_out)
            stage.backward_weight(0)
        else:
            input_grad = stage.backward(0, grad_out)
        watched = seen if watch == "hook" else [out.grad for out in seen]
        results.append((input_grad, {n: p.grad for n, p in model.named_parameters()}, watched))
    (whole_input, whole_weights, whole_seen), (split_input, split_weights, split_seen) = results
    torch.testing.assert_close(split_input, whole_input, atol=1e-6, rtol=0)
    for name, grad in whole_weights.items():
        torch.testing.assert_close(split_weights[name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert len(split_seen) == len(whole_seen) == 1
    torch.testing.assert_close(split_seen[0], whole_seen[0])
    assert torch.Tensor.register_hook.__qualname__ == "Tensor.register_hook", "the methods are put back"
    assert "retain_grad" not in torch.Tensor.__dict__


@pytest.mark.parametrize("saving", ["checkpointing", "offloading"])
def test_split_backward_with_saved_tensor_hooks_runs_whole(saving):
    """Non-reentrant activation checkpointing recomputes a layer's forward in every backward call: the
    weight pass, one call per weight group, recomputed it (and fired its hooks) about ten times per
    microbatch. Saved-tensor hooks around the forward (offloading to the CPU) run again in every call too.
    Either way the backward runs whole, with the gradients and hook calls of a whole one."""
    full_model = build("llama", num_layers=3, seed=3)
    hidden, grad_out = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    results = []
    for split in (False, True):
        model, stage = _stage(full_model, range(1, 2), 1, 3)
        model.train()
        if saving == "checkpointing":
            enable_checkpointing(model, reentrant=False)
        calls = []
        model.model.layers["1"].mlp.up_proj.register_forward_hook(lambda module, args, out: calls.append(1))
        around = torch.autograd.graph.save_on_cpu() if saving == "offloading" else contextlib.nullcontext()
        with around:
            stage.forward(0, hidden)
        if split:
            input_grad = stage.backward_input(0, grad_out)
            assert all(p.grad is not None for p in model.parameters()), "the whole backward ran in the first pass"
            stage.backward_weight(0)
        else:
            input_grad = stage.backward(0, grad_out)
        results.append((input_grad, {n: p.grad for n, p in model.named_parameters()}, len(calls)))
    (whole_input, whole_weights, whole_calls), (split_input, split_weights, split_calls) = results
    torch.testing.assert_close(split_input, whole_input, atol=1e-6, rtol=0)
    for name, grad in whole_weights.items():
        torch.testing.assert_close(split_weights[name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    assert split_calls == whole_calls == (2 if saving == "checkpointing" else 1)
    assert torch.autograd.graph.saved_tensors_hooks.__enter__.__qualname__ == "saved_tensors_hooks.__enter__"


def test_split_backward_accumulates_through_the_parameters_hooks():
    """Weight gradients go through each parameter's accumulator, so its hooks fire as in a whole backward."""
    model, stage = _stage(build("own", num_layers=2, seed=1), range(1, 2), 1, 2)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    _, y = make_batch(2, 8)
    stage.forward(0, torch.randn(2, 8, 32), y, loss_scale=1.0)
    stage.backward_input(0, None)
    assert not fired
    stage.backward_weight(0)
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())


def _first_stage_embedding_grad(model, x, grads_out, prepare=lambda embedding: None):
    """The first stage's embedding after the forward and backward of each microbatch of `x`
    (`prepare` gets it first)."""
    model, stage = _stage(model, range(0, 1), 0, 2)
    prepare(model.model.embed_tokens)
    for mb, (ids, grad) in enumerate(zip(x.chunk(len(grads_out)), grads_out)):
        stage.forward(mb, ids)
        stage.backward(mb, grad)
    return model.model.embed_tokens


@pytest.mark.parametrize("padding_idx", [None, 3], ids=["plain", "padding-row"])
def test_first_stage_embedding_gradient_equals_the_dense_one(padding_idx):
    """The first stage adds each microbatch's embedding gradient sparsely into one dense .grad: the
    same values as autograd's dense backward (the padding row's gradient stays zero), dense, and
    the module left as it was."""
    model = build("own", num_layers=2, seed=2)
    model.model.embed_tokens.padding_idx = padding_idx
    x, _ = make_batch(4, 8, num_microbatches=2)
    x[0, :3] = 3  # repeated tokens, and the padding row's
    grads_out = [torch.randn(2, 8, model.config.hidden_size) for _ in range(2)]
    reference = copy.deepcopy(model)
    parts = DecoderParts.of(reference, range(0, 1), True, False)
    for ids, grad in zip(x.chunk(2), grads_out):
        parts.forward(ids).backward(grad)
    expected = reference.model.embed_tokens.weight.grad

    embedding = _first_stage_embedding_grad(model, x, grads_out)
    assert embedding.weight.grad.layout == torch.strided and not embedding.sparse
    torch.testing.assert_close(embedding.weight.grad, expected, atol=1e-6, rtol=0)
    if padding_idx is not None:
        assert not embedding.weight.grad[padding_idx].any()


def test_first_stage_embedding_gradient_stays_as_a_hook_or_the_model_asks():
    """A hook on the embedding's weight gets the dense gradient it gets on one process; an embedding
    the model made sparse keeps its sparse gradient."""
    x, _ = make_batch(4, 8, num_microbatches=2)
    model = build("own", num_layers=2, seed=2)
    grads_out = [torch.randn(2, 8, model.config.hidden_size) for _ in range(2)]
    seen = []
    _first_stage_embedding_grad(model, x, grads_out, lambda e: e.weight.register_hook(lambda g: seen.append(g.layout)))
    assert seen == [torch.strided, torch.strided]

    embedding = _first_stage_embedding_grad(model, x, grads_out, lambda e: setattr(e, "sparse", True))
    assert embedding.sparse and embedding.weight.grad.layout == torch.sparse_coo


class _GradientStop(torch.autograd.Function):
    """An op whose backward gives its input no gradient (None: zero, as torch reads it)."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_split_backward_where_a_weight_gets_no_gradient_still_makes_the_later_weights_gradients():
    """A weight whose use receives no gradient (its branch passes through an op whose backward returns None)
    leaves its own .grad as it was; the weight pass still makes the gradients of the weights after it."""
    from pipeline_parallel.stage import _WeightPass

    torch.manual_seed(0)
    stopped, used = torch.nn.Parameter(torch.randn(6, 6)), torch.nn.Parameter(torch.randn(6, 6))
    x0, grad_out = torch.randn(3, 6), torch.randn(3, 6)

    def out_of(x):
        return (_GradientStop.apply(torch.nn.functional.linear(x, stopped))
                + torch.nn.functional.linear(torch.tanh(x), used))

    x = x0.clone().requires_grad_()
    out_of(x).backward(grad_out)
    want_input, want_used = x.grad, used.grad.clone()
    assert stopped.grad is None
    used.grad = None
    x = x0.clone().requires_grad_()
    weight_pass = _WeightPass([stopped, used])
    got_input = weight_pass.input_grad(out_of(x), x, grad_out)
    assert weight_pass.groups, "the backward is split"
    assert used.grad is None, "no weight gradient before the weight pass"
    weight_pass.run()
    torch.testing.assert_close(got_input, want_input)
    assert stopped.grad is None
    assert used.grad is not None, "the weight after one without gradient got none"
    torch.testing.assert_close(used.grad, want_used)
