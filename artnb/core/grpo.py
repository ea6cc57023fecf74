"""GRPO maths: group-relative advantages and the clipped policy-gradient losses, in plain torch.

Choices: the loss is token-level (DAPO / Dr. GRPO style: every trainable token of the batch weighs the same, no
1/|o_i| length term); the reduction divides by a caller-given token count so micro-batches add up to the full
batch; KL is the k3 estimator added to the loss (beta * KL, as GRPO and ART 0.3), off by default (beta -> 0 trend).

Importance-sampling level (ART's and TRL's `importance_sampling_level`): "token" uses each token's ratio r_t;
"sequence" is GSPO (arXiv 2507.18071): s = exp(mean of log r_t over the sequence's trainable tokens), the
geometric mean of its token ratios, given to every token of the sequence. A sequence is one row of the [B, T]
tensors. Departure from the paper: the loss stays a token mean, so a sequence weighs by its trainable-token count
(as in ART) instead of 1/G each. "average" and "geometric_average" mix the two as ART does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "average", "geometric_average")


def group_advantages(rewards: Sequence[float], scale_rewards: bool = True) -> list[float]:
    """A_i = R_i - mean(R), divided by (population std + 1e-6) when `scale_rewards` (Dr. GRPO: False)."""
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):
        return [0.0] * n  # exact zeros: the mean of equal floats can round, and 1e-11 is not "no signal"
    # Divided by the largest |reward| first, so that huge rewards neither overflow the sum nor the squares; the
    # scale is multiplied back in, and divides out again when scaled by the spread.
    scale = max(abs(r) for r in rewards)
    unit = [r / scale for r in rewards]
    mean = math.fsum(unit) / n
    centred = [u - mean for u in unit]
    if not scale_rewards:
        return [c * scale for c in centred]
    std = math.sqrt(math.fsum(c * c for c in centred) / n)  # in units of `scale`
    return [c / (std + 1e-6 / scale) for c in centred]


def balance_advantage(advantage: float, balance: float) -> float:
    """ART's `advantage_balance` b in [-1, 1]: b > 0 scales negative advantages by 1 - b (b = 1 trains only on
    positive ones), b < 0 scales positive advantages by 1 + b.

    >>> balance_advantage(-2.0, 0.25), balance_advantage(2.0, 0.25), balance_advantage(2.0, -1.0)
    (-1.5, 2.0, 0.0)
    """
    if not -1.0 <= balance <= 1.0:
        raise ValueError(f"advantage_balance is {balance}; it must lie in [-1, 1]")
    if balance > 0 and advantage < 0:
        return advantage * (1.0 - balance)
    if balance < 0 and advantage > 0:
        return advantage * (1.0 + balance)
    return advantage


def importance_ratio(log_ratio: Tensor, selected: Tensor, level: str = "token") -> Tensor:
    """Per-token importance ratio from per-token log ratios d_t = new_t - old_t, at `level`.

    token: exp(d_t). sequence (GSPO): exp(mean of d over the row's `selected` tokens), broadcast to the row.
    average: (token + sequence) / 2. geometric_average: sqrt(token * sequence). Rows are sequences (last dim).

    >>> d = torch.tensor([[math.log(2.0), math.log(8.0)]])
    >>> importance_ratio(d, torch.tensor([[True, True]]), "sequence")  # geometric mean of 2 and 8
    tensor([[4., 4.]])
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level {level!r} is unknown; use one of {IMPORTANCE_SAMPLING_LEVELS}"
        )
    if level == "token":
        return torch.exp(log_ratio)
    chosen = selected.to(log_ratio.dtype)
    count = chosen.sum(-1, keepdim=True).clamp(min=1)
    sequence_log = ((log_ratio * chosen).sum(-1, keepdim=True) / count).expand_as(log_ratio)
    if level == "sequence":
        return torch.exp(sequence_log)
    if level == "average":
        return (torch.exp(log_ratio) + torch.exp(sequence_log)) / 2
    return torch.exp((log_ratio + sequence_log) / 2)


@dataclass(frozen=True)
class LossSettings:
    """What shapes the GRPO loss besides the tensors: one object, built from a step's config by
    `TrainConfig.loss_settings()` (see `policy_loss` for what each field does)."""

    epsilon: float
    epsilon_high: float
    loss_fn: str = "cispo"
    importance_sampling_level: str = "token"
    max_negative_advantage_importance_sampling_weight: float | None = None
    mask_prob_ratio: bool = False
    kimi_k2_tau: float | None = None
    kl_penalty_coef: float = 0.0
    truncated_importance_sampling: float | None = None


def policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings,
    *,
    ref_logprobs: Tensor | None = None,
    sampling_logprobs: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO loss over per-token tensors of one shape, e.g. [B, T], already aligned (logprob of token t given < t).

    With r_t the importance ratio at `importance_sampling_level` (see `importance_ratio`; exp(new_t - old_t) at
    "token") and A_t the advantage:
      ppo:   L_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t)
      cispo: L_t = -clip(stopgrad(r_t), max(0, 1 - epsilon), 1 + epsilon_high) A_t new_t
    At "sequence" level ppo is GSPO's clipped objective, and cispo weights the gradient of the sequence's
    log-likelihood, sum_t new_t, by its clipped, stopped geometric-mean ratio (one IS weight per sequence).
    `old_logprobs` NaN (unknown sampling logprob) -> the detached new logprob, so d_t = 0 (plain REINFORCE at
    "token"; at "sequence" the token still counts in the mean with d_t = 0).
    Before the loss, as ART does: `max_negative_advantage_importance_sampling_weight` c caps r_t at c (for every
    token; under ppo it only bites where A_t < 0, where the min keeps the unclipped r_t A_t); `kimi_k2_tau` tau
    gives A_t <- A_t - tau stopgrad(new_t - old_t). `mask_prob_ratio` drops tokens whose ratio lies outside the
    clip range (L_t = 0, no gradient) instead of clipping them; ART zeroes their ratio, which is the same
    gradient except for cispo with epsilon < 1, where its clip would lift the zero back to 1 - epsilon.
    kl_penalty_coef k > 0 with `ref_logprobs`: L_t += k (exp(ref_t - new_t) - (ref_t - new_t) - 1)  (k3 estimator).
    truncated_importance_sampling U: L_t *= stopgrad(min(rho_t, U)) on tokens with a known sampling logprob,
    which down-weights tokens the trainer finds much likelier than the engine did (engine/trainer mismatch).
    rho_t is r_t; when `sampling_logprobs` (the engine's) are given because `old_logprobs` are the trainer's own
    (ART's precalculate_logprobs), rho_t is the ratio of old to sampling logprobs, at the same level.
    Returns (sum(L_t mask_t) / denominator, metrics); the denominator defaults to sum(mask). A trainer that splits
    a batch into micro-batches passes the whole batch's trainable-token count, so the micro-batch losses (and their
    gradients, and `policy_loss`) add up exactly to the full-batch ones; a sequence must not be split. `kl`,
    `clip_fraction` (share of masked tokens whose ratio lies outside the clip range) and `ratio_mean` are means
    over this call's masked tokens.

    >>> import torch
    >>> new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    >>> loss, m = policy_loss(new, torch.tensor([[-1.0, float("nan")]]), torch.tensor([[1.0, 1.0]]),
    ...                       torch.tensor([[1.0, 1.0]]), LossSettings(epsilon=1.0, epsilon_high=4.0))
    >>> round(loss.item(), 3), m["ratio_mean"]
    (1.5, 1.0)
    """
    loss_fn, epsilon, epsilon_high = settings.loss_fn, settings.epsilon, settings.epsilon_high
    kimi_k2_tau, kl_penalty_coef = settings.kimi_k2_tau, settings.kl_penalty_coef
    truncated_importance_sampling = settings.truncated_importance_sampling
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
    log_ratio = new_logprobs - old
    ratio = importance_ratio(log_ratio, selected, settings.importance_sampling_level)
    ratio_mean = (ratio.detach() * selected).sum().item()
    ratio_square_sum = (ratio.detach() ** 2 * selected).sum().item()
    cap = settings.max_negative_advantage_importance_sampling_weight
    if cap is not None:
        ratio = ratio.clamp(max=cap)
    low, high = max(0.0, 1.0 - epsilon), 1.0 + epsilon_high
    outside = ((ratio < low) | (ratio > high)).detach()
    if kimi_k2_tau:
        advantages = advantages - kimi_k2_tau * log_ratio.detach()
    if loss_fn == "ppo":
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    else:
        per_token = -ratio.detach().clamp(low, high) * advantages * new_logprobs
    if settings.mask_prob_ratio:
        per_token = torch.where(outside, zeros, per_token)

    if truncated_importance_sampling is not None:
        if sampling_logprobs is None:
            rho, rho_known = ratio.detach(), known
        else:
            rho_known = ~torch.isnan(sampling_logprobs) & selected
            sampled = torch.where(rho_known, sampling_logprobs.to(old.dtype), old)
            rho = importance_ratio(old.detach() - sampled, selected, settings.importance_sampling_level)
        is_weight = rho.clamp(max=truncated_importance_sampling)
        per_token = per_token * torch.where(rho_known, is_weight, torch.ones_like(is_weight))

    def reduce(values: Tensor) -> Tensor:
        return (values * weight).sum() / denominator

    loss = reduce(per_token)
    count = max(int(selected.sum().item()), 1)
    metrics = {
        "policy_loss": loss.item(),
        "clip_fraction": (outside & selected).sum().item() / count,
        "ratio_mean": ratio_mean / count,
        "ratio_square_mean": ratio_square_sum
        / count,  # with ratio_mean: the ratio's spread (trainers sum both)
    }
    if kl_penalty_coef > 0 and ref_logprobs is not None:
        log_ref_over_new = (
            torch.where(selected, ref_logprobs.to(new_logprobs.dtype), new_logprobs.detach()) - new_logprobs
        )
        kl = torch.exp(log_ref_over_new) - log_ref_over_new - 1
        loss = loss + kl_penalty_coef * reduce(kl)
        metrics["kl"] = (kl.detach() * selected).sum().item() / count
    return loss, metrics
