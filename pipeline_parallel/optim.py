"""AdamW without weight decay on norms and biases, and the linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters (one stage's); matrices decay, vectors (norms, biases) and biases
    of any shape (an MoE's per-expert biases, as gpt_oss has) do not.

    The group a parameter falls in depends only on its shape and its name in the whole model, so
    every pipeline split builds the same groups and optimizer state keyed by parameter name loads
    across splits.
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decays = [p.dim() >= 2 and not name.endswith("bias") for name, p in params]
    groups = [{"params": [p for (_, p), d in zip(params, decays) if d]},
              {"params": [p for (_, p), d in zip(params, decays) if not d]}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    set_hyperparameters(optimizer, cfg)
    return optimizer


def set_hyperparameters(optimizer: torch.optim.AdamW, cfg: OptimConfig) -> None:
    """Give `build_optimizer`'s two groups the configured betas, eps and weight decay (matrices only);
    after loading a checkpoint too, whose saved values would otherwise override the config."""
    for group, weight_decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):
        group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=weight_decay)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr, cosine to min_lr, then min_lr.

    Counted as the run logs and saves steps, from 1 (as torchtitan counts): lr at step warmup_steps,
    min_lr at step lr_decay_steps (by default max_steps, the last). A pure function of the step, so a
    resumed run needs to restore nothing but the step.
    """
    number = step + 1
    if number <= cfg.warmup_steps:
        return cfg.lr * number / cfg.warmup_steps
    decay_steps = cfg.lr_decay_steps or max_steps
    if number >= decay_steps:
        return cfg.min_lr
    progress = (number - cfg.warmup_steps) / (decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def scale_grads_(params, factor: float) -> None:
    """Multiply every gradient by `factor` (turns a sum over accumulation steps into their mean)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)
