"""loss_sum: value and gradient equal F.cross_entropy's in every dtype, with ignored rows and extreme logits;
HeadLoss: the head and loss with their backward by hand equal autograd's, and stand aside for hooks."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from _tensors_made import RowsMade
from torch import nn

from pipeline_parallel import loss as loss_module
from pipeline_parallel.loss import IGNORE_INDEX, HeadLoss, loss_sum
from pipeline_parallel.models.families import ForwardScales
from pipeline_parallel.stage import head_loss_applies

VOCAB = 50


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a single process computes: F.cross_entropy in at least float32, summed over the tokens."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _logits_and_labels(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, VOCAB, generator=g) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 7), generator=g)
    labels[0, ::2] = IGNORE_INDEX  # ignored tokens, unevenly spread
    labels[2] = IGNORE_INDEX
    return logits, labels


def _loss_and_grad(fn, logits, labels, grad_loss):
    logits = logits.clone().requires_grad_()
    loss = fn(logits, labels)
    loss.backward(torch.tensor(grad_loss, dtype=loss.dtype))
    return loss, logits.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5), (torch.float64, 1e-12)],
                         ids=["float32", "bfloat16", "float64"])
def test_loss_and_gradient_equal_cross_entropy(dtype, tol):
    logits, labels = _logits_and_labels(dtype)
    logits[1, 3, 5] = -float("inf")  # a token the model rules out
    got_loss, got_grad = _loss_and_grad(loss_sum, logits, labels, grad_loss=0.3)
    want_loss, want_grad = _loss_and_grad(_reference, logits, labels, grad_loss=0.3)
    assert got_loss.dtype == want_loss.dtype == torch.promote_types(dtype, torch.float32)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_loss, want_loss, atol=tol * labels.numel(), rtol=tol)
    torch.testing.assert_close(got_grad.double(), want_grad.double(), atol=tol, rtol=0)
    assert not got_grad[labels == IGNORE_INDEX].any(), "ignored tokens give no gradient"


def test_a_target_far_below_the_largest_logit_keeps_a_finite_exact_loss():
    """A probability that underflows float32 (e^-200) must not make the loss infinite."""
    logits = torch.zeros(1, 2, VOCAB)
    logits[0, :, 0] = 100.0
    labels = torch.tensor([[1, 0]])
    logits[0, 0, 1] = -100.0
    got_loss, got_grad = _loss_and_grad(loss_sum, logits, labels, grad_loss=1.0)
    want_loss, want_grad = _loss_and_grad(_reference, logits, labels, grad_loss=1.0)
    assert torch.isfinite(got_loss) and got_loss.item() == pytest.approx(200.0, abs=1e-4)
    torch.testing.assert_close(got_loss, want_loss)
    torch.testing.assert_close(got_grad, want_grad)


def test_every_token_ignored_gives_zero_loss_and_gradient():
    logits, labels = _logits_and_labels(torch.float32)
    labels.fill_(IGNORE_INDEX)
    loss, grad = _loss_and_grad(loss_sum, logits, labels, grad_loss=1.0)
    assert loss.item() == 0.0 and not grad.any()


def test_without_grad_it_keeps_nothing_and_gives_the_same_loss():
    logits, labels = _logits_and_labels(torch.float32)
    with torch.no_grad():
        loss = loss_sum(logits, labels)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _reference(logits, labels))


def test_a_second_backward_through_the_same_loss_is_refused():
    """The saved gradient is scaled in place, so a retained graph must not run twice silently."""
    logits, labels = _logits_and_labels(torch.float32)
    logits.requires_grad_()
    loss = loss_sum(logits, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _head_by_autograd(hidden, head, labels, scale, scales):
    hidden = hidden.clone().requires_grad_()
    loss = loss_sum(scales.scale_logits(head(hidden)), labels) * scale
    loss.backward()
    return loss.detach(), hidden.grad


@pytest.mark.parametrize("dtype, autocast, tol", [(torch.float32, None, 1e-6), (torch.bfloat16, None, 1e-2),
                                                  (torch.float32, torch.bfloat16, 1e-6)],
                         ids=["float32", "bfloat16", "autocast-bfloat16"])
@pytest.mark.parametrize("grad_before", [False, True], ids=["no-grad-yet", "accumulating"])
@pytest.mark.parametrize("scales", [ForwardScales(), ForwardScales(logits=0.3), ForwardScales(softcap=0.5),
                                    ForwardScales(logits=2.5, softcap=0.5)], ids=["plain", "scaled", "capped", "both"])
@pytest.mark.parametrize("chunk_rows", [None, 4], ids=["all-tokens-at-once", "4-token-chunks"])
def test_head_loss_equals_the_head_and_loss_under_autograd(dtype, autocast, tol, grad_before, scales, chunk_rows,
                                                           monkeypatch):
    """Loss, the hidden states' gradient and the head's accumulated weight gradient, with ignored
    rows; under autocast the matmuls take its dtype and the gradients come back in the tensors' own.
    Also of logits scaled and capped as some families' forwards do (a cap near the logits' size), whose
    chain rule HeadLoss takes in float32 where autograd takes it in autocast's dtype: they agree to its rounding.
    Also with the 21 tokens taken in chunks of 4 (the last of 1)."""
    if chunk_rows:
        monkeypatch.setattr(loss_module, "_CHUNK_BYTES", chunk_rows * 4 * VOCAB)
    if autocast and scales != ForwardScales():
        tol = 1e-2  # as bfloat16's own
    torch.manual_seed(0)
    head = nn.Linear(16, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(3, 7, 16, dtype=dtype)
    _, labels = _logits_and_labels(torch.float32)
    before = torch.randn_like(head.weight) if grad_before else None
    context = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext

    head.weight.grad = None if before is None else before.clone()
    with context():
        want_loss, want_hidden_grad = _head_by_autograd(hidden, head, labels, 0.25, scales)
    want_weight_grad = head.weight.grad

    head.weight.grad = None if before is None else before.clone()
    with context():
        got = HeadLoss(hidden, head, labels, 0.25, scales)
    hidden_grad = got.input_grad()
    got.add_weight_grad()
    assert hidden_grad.dtype == hidden.dtype and head.weight.grad.dtype == head.weight.dtype
    torch.testing.assert_close(got.loss, want_loss, atol=tol, rtol=tol)
    torch.testing.assert_close(hidden_grad, want_hidden_grad, atol=tol, rtol=tol)
    torch.testing.assert_close(head.weight.grad, want_weight_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("need_grad", [True, False], ids=["training", "evaluation"])
def test_head_loss_makes_the_logits_a_chunk_at_a_time(need_grad, monkeypatch):
    """Of the tokens x vocab tensors only the kept gradient is made whole: no other tensor the forward
    makes holds more than a chunk's rows, so its peak memory is not several times the logits'.
    Evaluation keeps none."""
    monkeypatch.setattr(loss_module, "_CHUNK_BYTES", 4 * 4 * VOCAB)  # 4 tokens at a time
    head = nn.Linear(16, VOCAB, bias=False)
    hidden = torch.randn(3, 7, 16)
    _, labels = _logits_and_labels(torch.float32)
    with RowsMade(VOCAB) as made:
        got = HeadLoss(hidden, head, labels, 0.25, ForwardScales(logits=2.5, softcap=0.5), need_grad=need_grad)
    if need_grad:
        assert got.grad.shape == (21, VOCAB)
        assert sorted(made.rows)[-2:] == [4, 21]  # a chunk's; the kept gradient
    else:
        assert max(made.rows) == 4


def _watched_heads():
    """Heads on which HeadLoss must stand aside, each with what watches it (or makes it differ)."""
    def head():
        return nn.Linear(16, VOCAB, bias=False)

    cases = {"bias": nn.Linear(16, VOCAB), "subclass": type("MyLinear", (nn.Linear,), {})(16, VOCAB, bias=False)}
    frozen = cases["frozen"] = head()
    frozen.weight.requires_grad_(False)
    cases["forward-hook"] = head()
    cases["forward-hook"].register_forward_hook(lambda m, i, o: None)
    cases["forward-pre-hook"] = head()
    cases["forward-pre-hook"].register_forward_pre_hook(lambda m, i: None)
    cases["backward-hook"] = head()
    cases["backward-hook"].register_full_backward_hook(lambda m, gi, go: None)
    cases["backward-pre-hook"] = head()
    cases["backward-pre-hook"].register_full_backward_pre_hook(lambda m, go: None)
    cases["weight-hook"] = head()
    cases["weight-hook"].weight.register_hook(lambda g: g)
    cases["weight-post-accumulate-hook"] = head()
    cases["weight-post-accumulate-hook"].weight.register_post_accumulate_grad_hook(lambda p: None)
    cases["sparse-grad"] = head()
    cases["sparse-grad"].weight.grad = torch.zeros(VOCAB, 16).to_sparse()
    return cases


_SEEN_IN_EVALUATION = {"bias", "subclass", "forward-hook", "forward-pre-hook"}  # what an evaluation's call would see


@pytest.mark.parametrize("case", list(_watched_heads()))
def test_head_loss_stands_aside_where_someone_would_see_it(case):
    """In training for every watcher; in evaluation (no gradient) only for those of the head's call."""
    assert head_loss_applies(nn.Linear(16, VOCAB, bias=False))
    assert not head_loss_applies(_watched_heads()[case])
    assert head_loss_applies(_watched_heads()[case], training=False) == (case not in _SEEN_IN_EVALUATION)


@pytest.mark.parametrize("chunk_rows", [None, 4], ids=["all-tokens-at-once", "4-token-chunks"])
def test_head_loss_without_gradient_gives_the_loss_alone(chunk_rows, monkeypatch):
    """Evaluation's loss, in chunks as in training, equals the head and loss called whole; nothing is kept."""
    if chunk_rows:
        monkeypatch.setattr(loss_module, "_CHUNK_BYTES", chunk_rows * 4 * VOCAB)
    torch.manual_seed(0)
    head, hidden = nn.Linear(16, VOCAB, bias=False), torch.randn(3, 7, 16)
    _, labels = _logits_and_labels(torch.float32)
    scales = ForwardScales(logits=2.5, softcap=0.5)
    with torch.no_grad():
        want = loss_sum(scales.scale_logits(head(hidden)), labels) * 0.25
        got = HeadLoss(hidden, head, labels, 0.25, scales, need_grad=False)
    torch.testing.assert_close(got.loss, want, atol=1e-6, rtol=1e-6)
    assert got.grad is None and got.tokens is None and head.weight.grad is None


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_head_loss_stands_aside_for_a_global_module_hook(kind):
    register = {"forward": nn.modules.module.register_module_forward_hook,
                "backward": nn.modules.module.register_module_full_backward_hook}[kind]
    handle = register(lambda *args: None)
    try:
        assert not head_loss_applies(nn.Linear(16, VOCAB, bias=False))
    finally:
        handle.remove()
    assert head_loss_applies(nn.Linear(16, VOCAB, bias=False))
