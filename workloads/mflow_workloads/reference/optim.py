"""AdamW for the reference engine: torch.optim.AdamW's single-tensor step on CPU, op for op.

torch.optim imports torch._dynamo (and sympy) on the first call of an optimizer method, about
1.4 s of CPU per rank at every start, for a step that is a handful of tensor ops here. This class
runs the same ops with the same Python-float arguments in the same order, so its updates are
bit for bit torch's (workloads/tests/test_reference_optim.py checks it against torch), and keeps
torch's `param_groups` and `state` layout, which checkpoints read and write.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class AdamW:
    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, **g} for g in groups]
        for g in self.param_groups:
            g["params"] = list(g["params"])
        self.state: defaultdict = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                step_t += 1
                if wd != 0:
                    param.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)


def _scalar_dtype() -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype for a non-fused step
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
