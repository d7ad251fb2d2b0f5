"""The last stage's loss: summed token cross-entropy, with its gradient made in the forward pass."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (taken in at least fp32, -100 ignored); callers scale it to the mean they want.

    Equals `F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")`
    in value and gradient, in fewer passes over the logits (see `_CrossEntropySum`).
    """
    return _CrossEntropySum.apply(logits.flatten(0, 1), labels.flatten())


class _CrossEntropySum(torch.autograd.Function):
    """Cross-entropy over [tokens, vocab] logits whose one softmax serves the loss and its gradient.

    The logits are the largest tensor of a step. `F.cross_entropy` takes log_softmax, then in
    backward fills a zero gradient and runs log_softmax's backward, which takes exp again. Here the
    forward takes one softmax, which is the gradient up to the targets' -1 (zero on ignored rows);
    backward only scales it, which saves a pass or two over the logits (README, "How it works", has
    the times measured). The log-sum-exp the loss needs comes
    from each row's largest logit, whose probability is at least 1/vocab and so never underflows.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        probs = torch.softmax(logits, dim=-1, dtype=dtype)
        # A row's largest probability is that of its largest logit: exp(top - log_sum_exp).
        log_sum_exp = logits.amax(-1, keepdim=True).to(dtype) - probs.amax(-1, keepdim=True).log()
        valid = (labels != IGNORE_INDEX).unsqueeze(-1)
        targets = labels.unsqueeze(-1).where(valid, 0)
        loss = (log_sum_exp - logits.gather(-1, targets).to(dtype)).where(valid, 0).sum()
        if ctx.needs_input_grad[0]:
            weight = valid.to(dtype)  # 1 on the rows whose loss counts, 0 on ignored ones
            probs.scatter_add_(-1, targets, weight.neg()).mul_(weight)
            ctx.save_for_backward(probs)
            ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        # Scaled in place: the graph is run once. A second run would fail on the changed tensor.
        return grad.mul_(grad_loss).to(ctx.logits_dtype), None
