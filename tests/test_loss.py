"""loss_sum: value and gradient equal F.cross_entropy's in every dtype, with ignored rows and extreme logits."""

import pytest
import torch
import torch.nn.functional as F

from pipeline_parallel.loss import IGNORE_INDEX, loss_sum

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
