"""GRPO maths: group-relative advantages and the clipped policy-gradient losses, in plain torch.

Choices: the loss is token-level (DAPO / Dr. GRPO style: every trainable token of the batch weighs the same, no
1/|o_i| length term); the reduction divides by a caller-given token count so micro-batches add up to the full
batch; KL is the k3 estimator added to the loss (beta * KL, as GRPO and ART 0.3), off by default (beta -> 0 trend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def group_advantages(rewards: Sequence[float], scale_rewards: bool = True) -> list[float]:
    """A_i = R_i - mean(R), divided by (population std + 1e-6) when `scale_rewards` (Dr. GRPO: False)."""
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):
        return [0.0] * n  # exact zeros: the mean of equal floats can round, and 1e-11 is not "no signal"
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_rewards:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + 1e-6) for c in centred]


def policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_fn: str = "cispo",
    epsilon: float,
    epsilon_high: float,
    ref_logprobs: Tensor | None = None,
    kl_penalty_coef: float = 0.0,
    truncated_importance_sampling: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss over per-token tensors of one shape, e.g. [B, T], already aligned (logprob of token t given < t).

    With r_t = exp(new_t - old_t) and A_t the advantage:
      ppo:   L_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t)
      cispo: L_t = -clip(stopgrad(r_t), max(0, 1 - epsilon), 1 + epsilon_high) A_t new_t
    `old_logprobs` NaN (unknown sampling logprob) -> the detached new logprob, so r_t = 1 (plain REINFORCE).
    kl_penalty_coef k > 0 with `ref_logprobs`: L_t += k (exp(ref_t - new_t) - (ref_t - new_t) - 1)  (k3 estimator).
    truncated_importance_sampling U: L_t *= stopgrad(min(exp(new_t - old_t), U)) where old_t is known, which
    down-weights tokens the trainer finds much likelier than the engine did (engine/trainer mismatch).
    Returns (sum(L_t mask_t) / denominator, metrics); the denominator defaults to sum(mask). A trainer that splits
    a batch into micro-batches passes the whole batch's trainable-token count, so the micro-batch losses (and their
    gradients, and `policy_loss`) add up exactly to the full-batch ones. `kl`, `clip_fraction` (share of masked
    tokens whose ratio lies outside the clip range) and `ratio_mean` are means over this call's masked tokens.

    >>> import torch
    >>> new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, m = policy_loss(new, torch.tensor([[-1.0, float("nan")]]), torch.tensor([[1.0, 1.0]]),
    ...                       torch.tensor([[1.0, 1.0]]), epsilon=1.0, epsilon_high=4.0)
    >>> round(loss.item(), 3), m["ratio_mean"]
    (1.5, 1.0)
    """
    if loss_fn not in ("cispo", "ppo"):
        raise ValueError(f"loss_fn {loss_fn!r} is unknown; use 'cispo' or 'ppo'")
    weight = mask.to(new_logprobs.dtype)
    selected = weight != 0
    if denominator is None:
        denominator = weight.sum().item() or 1.0  # an empty mask gives a zero loss, not NaN
    elif denominator <= 0:
        raise ValueError(f"denominator is {denominator}; pass the (positive) number of trainable tokens")

    # Neutral values off the mask, so NaN/inf on padding reach neither the sum nor the gradient.
    zeros = torch.zeros_like(new_logprobs)
    new_logprobs = torch.where(selected, new_logprobs, zeros)
    advantages = torch.where(selected, advantages.to(new_logprobs.dtype), zeros)
    known = ~torch.isnan(old_logprobs) & selected
    old = torch.where(known, old_logprobs.to(new_logprobs.dtype), new_logprobs.detach())
    ratio = torch.exp(new_logprobs - old)
    low, high = max(0.0, 1.0 - epsilon), 1.0 + epsilon_high
    if loss_fn == "ppo":
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    else:
        per_token = -ratio.detach().clamp(low, high) * advantages * new_logprobs

    if truncated_importance_sampling is not None:
        is_weight = torch.exp(new_logprobs.detach() - old).clamp(max=truncated_importance_sampling)
        per_token = per_token * torch.where(known, is_weight, torch.ones_like(is_weight))

    def reduce(values: Tensor) -> Tensor:
        return (values * weight).sum() / denominator

    loss = reduce(per_token)
    count = max(int(selected.sum().item()), 1)
    with torch.no_grad():
        clipped = ((ratio < low) | (ratio > high)) & selected
        metrics = {
            "policy_loss": loss.item(),
            "clip_fraction": clipped.sum().item() / count,
            "ratio_mean": (ratio * selected).sum().item() / count,
        }
    if kl_penalty_coef > 0 and ref_logprobs is not None:
        log_ref_over_new = (
            torch.where(selected, ref_logprobs.to(new_logprobs.dtype), new_logprobs.detach()) - new_logprobs
        )
        kl = torch.exp(log_ref_over_new) - log_ref_over_new - 1
        loss = loss + kl_penalty_coef * reduce(kl)
        metrics["kl"] = (kl.detach() * selected).sum().item() / count
    return loss, metrics
