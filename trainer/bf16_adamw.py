"""AdamW for parameters kept in bf16, which keeps the small steps that RL fine-tuning takes.

AdamW moves a weight by about the learning rate per step: 1e-6 to 1e-4 in RL fine-tuning. bf16 has 8
bits of mantissa, so for a weight of magnitude 0.05 its neighbours are 2.4e-4 apart, and a step
rounded to the nearest bf16 value is, for most weights, no step at all (torch's AdamW on bf16
parameters does that: the model does not learn). fp32 master weights fix it at 4 more bytes per
parameter plus fp32 moments, which a 4B model on one 80 GiB GPU has no room for. Here the update is
computed in fp32 and written back to the bf16 parameter (and moments) with stochastic rounding: up
or down at random, with probabilities that make the expected result the exact fp32 value, so
steps far below bf16's spacing still move the weights by the right amount on average, at no memory
beyond the bf16 moments themselves.

    stochastic_round_to_bf16(x)     fp32 -> bf16, unbiased
    StochasticRoundingAdamW         torch.optim.Optimizer over bf16 parameters

On CUDA each parameter's step is one compiled kernel (torch.compile); elsewhere it runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BF16_DROPPED_BITS = 16  # an fp32's low half, which bf16 does not keep
_HIGH_HALF = -(1 << BF16_DROPPED_BITS)  # 0xFFFF0000 as an int32


def stochastic_round_to_bf16(x: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """`x` (fp32) as bf16, rounded away from zero with probability equal to the dropped fraction of
    an ulp, else toward zero: E[result] = x exactly for every finite x that bf16 can hold.
    `uniform` (values in [0, 1), x's shape) supplies the randomness; drawn here when None."""
    if uniform is None:
        uniform = torch.rand_like(x)
    noise = (uniform * (1 << BF16_DROPPED_BITS)).to(torch.int32)
    # Adding to the bit pattern carries into the kept half exactly when the dropped half plus the
    # noise passes one ulp (the magnitude's bits, so for negative values too); the mask then drops
    # the low half, which bf16 conversion keeps unchanged.
    bits = (x.view(torch.int32) + noise) & _HIGH_HALF
    return bits.view(torch.float32).to(torch.bfloat16)


def _adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    weight_decay: torch.Tensor,
    bias_correction1: torch.Tensor,
    bias_correction2: torch.Tensor,
) -> None:
    """One AdamW step of one bf16 parameter, in fp32, written back with stochastic rounding."""
    g = grad.float()
    m = exp_avg.float().mul_(beta1).add_(g * (1 - beta1))
    v = exp_avg_sq.float().mul_(beta2).add_(g * g * (1 - beta2))
    p = param.float()
    p = p * (1 - lr * weight_decay) - lr * (m / bias_correction1) / ((v / bias_correction2).sqrt() + eps)
    param.copy_(stochastic_round_to_bf16(p))
    exp_avg.copy_(stochastic_round_to_bf16(m))
    exp_avg_sq.copy_(stochastic_round_to_bf16(v))


_compiled_step = None


def _step_function(device: torch.device):
    global _compiled_step
    if device.type != "cuda":
        return _adamw_step
    if _compiled_step is None:
        # Shapes differ per parameter: dynamic, so one compilation serves them all.
        _compiled_step = torch.compile(_adamw_step, dynamic=True)
    return _compiled_step


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, as torch.optim.AdamW) for bf16
    parameters: moments kept in bf16, every write stochastically rounded (see the module)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for param in group["params"]:
                if param.dtype != torch.bfloat16:
                    raise TypeError(f"StochasticRoundingAdamW is for bf16 parameters, got {param.dtype}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            scalars_by_step: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                step = state["step"]
                if (step, param.device) not in scalars_by_step:
                    scalars = [
                        group["lr"],
                        beta1,
                        beta2,
                        group["eps"],
                        group["weight_decay"],
                        1 - beta1**step,
                        1 - beta2**step,
                    ]
                    # As 0-d tensors: a compiled step specialises on Python numbers, which change every step.
                    scalars_by_step[step, param.device] = torch.tensor(scalars, device=param.device).unbind()
                values = scalars_by_step[step, param.device]
                _step_function(param.device)(param, param.grad, state["exp_avg"], state["exp_avg_sq"], *values)
        return loss
