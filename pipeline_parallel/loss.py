"""The last stage's loss: summed token cross-entropy, with its gradient made in the forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .models.families import ForwardScales

IGNORE_INDEX = -100
_CHUNK_BYTES = 256 * 2**20  # HeadLoss takes as many tokens at once as make this much float32 softmax


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (taken in at least fp32, -100 ignored); callers scale it to the mean they want.

    Equals `F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")`
    in value and gradient, in fewer passes over the logits (see `_CrossEntropySum`).
    """
    return _CrossEntropySum.apply(logits.flatten(0, 1), labels.flatten())


class HeadLoss:
    """`loss_sum(scales.scale_logits(head(hidden)), labels) * scale`, whose backward through the head runs
    outside autograd.

    The gradient of the logits is known once the loss is, so the forward keeps it instead of a
    graph. The backward is then two matmuls: `input_grad` gives the gradient of `hidden`, and
    `add_weight_grad` adds the head's weight gradient into `.grad` in place (addmm), where autograd
    would make a vocab x hidden gradient for every microbatch and then add it. They stay apart
    so that a schedule can make the weight gradient later, like any other (`I` and `W`). Under
    autocast the matmuls take the dtype the head's own call would. Only for a head whose call and
    gradient no one watches (`stage.head_loss_applies`).

    With `need_grad=False` (evaluation) it makes the loss alone, in the same chunks.

    The forward takes the tokens a chunk at a time (`_CHUNK_BYTES`), so that of the tokens x vocab
    tensors only the kept gradient exists whole: the logits and their float32 softmax (as large as
    it, and in bfloat16 twice as large), made for all tokens at once, would add two or three times its size.
    """

    def __init__(self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, scale: float,
                 scales: ForwardScales, need_grad: bool = True):
        self.weight, self.shape, self.dtype = head.weight, hidden.shape, hidden.dtype
        with torch.no_grad():
            tokens, labels = hidden.detach().flatten(0, -2), labels.flatten()
            rows = max(1, _CHUNK_BYTES // (4 * self.weight.shape[0]))
            starts = range(0, max(len(tokens), 1), rows)
            self.loss, self.grad = 0.0, None
            for start in starts:
                chunk = slice(start, start + rows)
                logits = F.linear(tokens[chunk], self.weight)  # in autocast's dtype under autocast, as head(hidden)
                scaled = scales.scale_logits(logits)  # what the family's forward returns (`logits` for most)
                loss, grad = _loss_and_logits_grad(scaled, labels[chunk], scale, need_grad)
                self.loss = self.loss + loss
                if not need_grad:  # evaluation: the loss alone
                    continue
                grad = scales.head_grad_(grad, scaled)
                # The backward's operands in the dtype the forward's matmul took them.
                if len(starts) == 1:
                    self.grad = grad.to(logits.dtype)
                else:
                    if self.grad is None:
                        self.grad = logits.new_empty(len(tokens), logits.shape[-1])
                    self.grad[chunk] = grad
            self.tokens = tokens.to(logits.dtype) if need_grad else None

    def input_grad(self) -> torch.Tensor:
        """The gradient of `hidden`."""
        with torch.no_grad():
            return (self.grad @ self.weight.to(self.grad.dtype)).to(self.dtype).view(self.shape)

    def add_weight_grad(self) -> None:
        """Add the head weight's gradient into its `.grad` (made if missing)."""
        with torch.no_grad():
            grad = self.weight.grad
            if grad is None or grad.is_sparse:  # sparse: the part of a tied embedding made sparse, added first
                product = (self.grad.t() @ self.tokens).to(self.weight.dtype)
                self.weight.grad = product if grad is None else product.add_(grad)
            elif grad.dtype == self.grad.dtype:
                grad.addmm_(self.grad.t(), self.tokens)
            else:  # autocast: the product is made in its dtype, as autograd would
                grad.add_(self.grad.t() @ self.tokens)


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
        loss, grad = _loss_and_logits_grad(logits, labels, 1.0, ctx.needs_input_grad[0])
        if grad is not None:
            ctx.save_for_backward(grad)
            ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        # Scaled in place: the graph is run once. A second run would fail on the changed tensor.
        return grad.mul_(grad_loss).to(ctx.logits_dtype), None


def _loss_and_logits_grad(logits: torch.Tensor, labels: torch.Tensor, scale: float, need_grad: bool = True):
    """`scale` x the summed cross-entropy of [tokens, vocab] `logits`, and its gradient (None unless
    `need_grad`) in at least float32, made from the one softmax."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits, dim=-1, dtype=dtype)
    # A row's largest probability is that of its largest logit: exp(top - log_sum_exp).
    log_sum_exp = logits.amax(-1, keepdim=True).to(dtype) - probs.amax(-1, keepdim=True).log()
    valid = (labels != IGNORE_INDEX).unsqueeze(-1)
    targets = labels.unsqueeze(-1).where(valid, 0)
    loss = (log_sum_exp - logits.gather(-1, targets).to(dtype)).where(valid, 0).sum() * scale
    if not need_grad:
        return loss, None
    weight = valid.to(dtype)  # 1 on the rows whose loss counts, 0 on ignored ones
    probs.scatter_add_(-1, targets, weight.neg()).mul_(weight * scale)
    return loss, probs
