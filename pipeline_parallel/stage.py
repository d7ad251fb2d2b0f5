"""One pipeline stage: forward and backward of microbatches, holding what backward needs until then."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .models.decoder import DecoderParts

IGNORE_INDEX = -100


class PipelineStage:
    """Runs `parts` on microbatches; the last stage also computes the scaled loss.

    `forward` keeps the microbatch's input and output (the autograd graph between them) until
    `backward` consumes them, so peak memory is set by how many microbatches a schedule keeps
    in flight. Inputs that arrive from another stage become leaves that require grad: their
    `.grad` is the gradient the previous stage needs.
    """

    def __init__(self, parts: DecoderParts, stage_idx: int, num_stages: int, autocast_dtype=None):
        self.parts = parts
        self.stage_idx = stage_idx
        self.num_stages = num_stages
        self.is_first = stage_idx == 0
        self.is_last = stage_idx == num_stages - 1
        self.autocast_dtype = autocast_dtype
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, mb: int, x: torch.Tensor, labels=None, loss_scale: float = 1.0, training: bool = True):
        """Forward microbatch `mb`; returns the output to hand on (the detached loss on the last stage).

        With `training=False` no graph is built or kept (evaluation).
        """
        if not self.is_first and training:
            x = x.detach().requires_grad_()
        with self._autocast(x), torch.set_grad_enabled(training):
            out = self.parts.forward(x)
            if self.is_last:
                out = loss_sum(out, labels) * loss_scale
        if training:
            self._saved[mb] = (x, out)
        return out.detach()

    def backward(self, mb: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward microbatch `mb`: accumulates weight grads, returns the input's grad (None on stage 0)."""
        x, out = self._saved.pop(mb)
        torch.autograd.backward(out, grad_output)
        return None if self.is_first else x.grad

    @property
    def num_saved(self) -> int:
        """Microbatches whose activations are held for backward."""
        return len(self._saved)

    def clear(self) -> None:
        """Drop saved activations (after an aborted step)."""
        self._saved.clear()

    def _autocast(self, x: torch.Tensor):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=self.autocast_dtype)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (fp32 logits, -100 ignored); callers scale it to the mean they want."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
