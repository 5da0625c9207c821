"""Learning-rate schedule with Megatron's OptimizerParamScheduler semantics (warmup from 0)."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, decay_steps: int, style: str) -> float:
    """LR for optimizer step `step` (0-based count of steps already taken), as Megatron computes it."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    if step > decay_steps:
        return min_lr
    span = max(decay_steps - warmup, 1)
    ratio = (step - warmup) / span
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (lr - min_lr)
