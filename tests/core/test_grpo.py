"""GRPO maths checked against numbers worked out by hand in each test (not by re-running the formula)."""

import math

import pytest
import torch

from artnb.core.grpo import group_advantages, policy_loss

NAN = float("nan")


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64, requires_grad=True)


def row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def old_for_ratios(new: list[float], ratios: list[float]) -> torch.Tensor:
    """Old logprobs such that exp(new - old) equals each given ratio."""
    return row([n - math.log(r) for n, r in zip(new, ratios, strict=True)])


# --- advantages ---------------------------------------------------------------------------------------------


def test_advantages_scaled_by_group_std():
    # mean 2.5, centred [-1.5, -0.5, 0.5, 1.5], population variance (2.25+0.25+0.25+2.25)/4 = 1.25
    std = 1.25**0.5
    assert group_advantages([1, 2, 3, 4]) == pytest.approx([c / (std + 1e-6) for c in (-1.5, -0.5, 0.5, 1.5)])
    assert group_advantages([0, 1]) == pytest.approx([-0.999998, 0.999998], abs=1e-7)


def test_advantages_unscaled_are_centred_rewards():
    assert group_advantages([1, 2, 3, 4], scale_rewards=False) == [-1.5, -0.5, 0.5, 1.5]


def test_advantages_of_equal_rewards_are_zero():
    assert group_advantages([3, 3, 3]) == [0, 0, 0]
    assert group_advantages([]) == []


# --- PPO ----------------------------------------------------------------------------------------------------


def test_ppo_clips_on_both_sides_for_both_signs():
    new = [-1.0, -2.0, -0.5, -1.0, -2.0, -0.5]
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5, 1.1]
    adv = row([1, 1, 1, -1, -1, -1])
    new_t = leaf(new)
    loss, metrics = policy_loss(
        new_t,
        old_for_ratios(new, ratios),
        adv,
        torch.ones(1, 6),
        loss_fn="ppo",
        epsilon=0.2,
        epsilon_high=0.2,
    )
    # A=+1: r=1.5 -> min(1.5, 1.2) = 1.2; r=0.5 -> min(0.5, 0.8) = 0.5; r=1.1 -> 1.1   => L = -1.2, -0.5, -1.1
    # A=-1: r=1.5 -> min(-1.5, -1.2) = -1.5; r=0.5 -> min(-0.5, -0.8) = -0.8; r=1.1 -> -1.1 => L = 1.5, 0.8, 1.1
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.1 + 1.5 + 0.8 + 1.1) / 6)
    loss.backward()
    # the clipped branch has no gradient; elsewhere dL/dnew = -A r
    assert new_t.grad[0].tolist() == pytest.approx([0, -0.5 / 6, -1.1 / 6, 1.5 / 6, 0, 1.1 / 6])
    assert metrics["clip_fraction"] == pytest.approx(4 / 6)  # 1.5 and 0.5 lie outside [0.8, 1.2]
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) * 2 / 6)
    assert metrics["policy_loss"] == pytest.approx(loss.item())
    assert "kl" not in metrics


def test_ppo_asymmetric_epsilon_high():
    new = [-1.0, -1.0]
    old = old_for_ratios(new, [1.25, 1.5])
    ones = torch.ones(1, 2)
    loss, _ = policy_loss(leaf(new), old, ones, ones, loss_fn="ppo", epsilon=0.2, epsilon_high=0.28)
    # upper bound 1.28: r=1.25 stays, r=1.5 is clipped to 1.28
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2)
    symmetric, _ = policy_loss(leaf(new), old, ones, ones, loss_fn="ppo", epsilon=0.2, epsilon_high=0.2)
    assert symmetric.item() == pytest.approx(-(1.2 + 1.2) / 2)


# --- CISPO --------------------------------------------------------------------------------------------------


def test_cispo_value_and_gradient():
    new = [-0.5, -1.0, -2.0]
    new_t = leaf(new)
    adv = row([1.0, 1.0, -2.0])
    loss, metrics = policy_loss(
        new_t, old_for_ratios(new, [2.0, 8.0, 0.5]), adv, torch.ones(1, 3), epsilon=1.0, epsilon_high=4.0
    )
    # IS weights clipped to [0, 5]: 2, 5, 0.5.  L = -w A new: -2*1*(-0.5)=1, -5*1*(-1)=5, -0.5*(-2)*(-2)=-2
    assert loss.item() == pytest.approx((1 + 5 - 2) / 3)
    loss.backward()
    # gradient = -clip(r) A / denominator (the weight is a constant)
    assert new_t.grad[0].tolist() == pytest.approx([-2 / 3, -5 / 3, 1 / 3])
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_cispo_lower_clip():
    # epsilon 0.2 -> weights clipped to [0.8, 5]: r=0.5 becomes 0.8
    new = [-1.0]
    loss, _ = policy_loss(
        leaf(new), old_for_ratios(new, [0.5]), row([1.0]), row([1.0]), epsilon=0.2, epsilon_high=4
    )
    assert loss.item() == pytest.approx(-0.8 * 1 * -1.0)


# --- unknown old logprobs, KL, truncated IS -----------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_nan_old_logprobs_mean_ratio_one(loss_fn):
    new_t = leaf([-0.7, -3.0])
    loss, metrics = policy_loss(
        new_t, row([NAN, NAN]), row([2.0, 2.0]), row([1, 1]), loss_fn=loss_fn, epsilon=0.2, epsilon_high=0.2
    )
    if loss_fn == "ppo":  # L = -r A = -2
        assert loss.item() == pytest.approx(-2.0)
    else:  # L = -1 * A * new = -2 * (-0.7), -2 * (-3)
        assert loss.item() == pytest.approx((1.4 + 6.0) / 2)
    loss.backward()
    assert new_t.grad[0].tolist() == pytest.approx([-1.0, -1.0])  # REINFORCE: -A / 2 on each token
    assert metrics["ratio_mean"] == 1.0
    assert metrics["clip_fraction"] == 0.0


def test_kl_k3_value_and_gradient():
    new_t = leaf([-1.0])
    loss, metrics = policy_loss(
        new_t,
        row([-1.0]),
        row([0.0]),
        row([1.0]),
        epsilon=1.0,
        epsilon_high=4.0,
        ref_logprobs=row([-1.5]),
        kl_penalty_coef=0.1,
    )
    # ref - new = -0.5: exp(-0.5) - (-0.5) - 1 = 0.6065307 + 0.5 - 1 = 0.1065307
    assert metrics["kl"] == pytest.approx(0.1065307, abs=1e-6)
    assert loss.item() == pytest.approx(0.01065307, abs=1e-7)
    loss.backward()
    # d/dnew [exp(ref-new) - (ref-new) - 1] = 1 - exp(ref-new) = 0.3934693
    assert new_t.grad.item() == pytest.approx(0.1 * 0.3934693, abs=1e-7)


def test_kl_needs_a_positive_coefficient():
    _, metrics = policy_loss(
        leaf([-1.0]),
        row([-1.0]),
        row([0.0]),
        row([1.0]),
        epsilon=1.0,
        epsilon_high=4.0,
        ref_logprobs=row([-2.0]),
    )
    assert "kl" not in metrics


def test_truncated_importance_sampling_weight():
    new = [-1.0, -1.0, -1.0]
    old = row([-1.0 - math.log(3.0), -1.0 - math.log(1.5), NAN])
    loss, _ = policy_loss(
        leaf(new),
        old,
        row([1, 1, 1]),
        row([1, 1, 1]),
        epsilon=1.0,
        epsilon_high=4.0,
        truncated_importance_sampling=2.0,
    )
    # cispo terms -clip(r) A new = 3, 1.5, 1; IS weights min(r, 2) = 2, 1.5 and 1 where old is unknown
    assert loss.item() == pytest.approx((2 * 3 + 1.5 * 1.5 + 1 * 1) / 3)


def test_truncated_importance_sampling_leaves_unknown_tokens_alone_even_below_one():
    loss, _ = policy_loss(
        leaf([-1.0]),
        row([NAN]),
        row([1]),
        row([1]),
        epsilon=1.0,
        epsilon_high=4.0,
        truncated_importance_sampling=0.5,
    )
    assert loss.item() == pytest.approx(1.0)


# --- reduction ----------------------------------------------------------------------------------------------


def test_mask_excludes_padding_even_with_nan_and_inf():
    new_t = leaf([-1.0, -2.0, -float("inf")])
    loss, _ = policy_loss(
        new_t, row([-1.0, NAN, NAN]), row([1.0, 1.0, NAN]), row([1, 1, 0]), epsilon=1, epsilon_high=4
    )
    assert loss.item() == pytest.approx((1.0 + 2.0) / 2)
    loss.backward()
    assert new_t.grad[0].tolist() == [-0.5, -0.5, 0.0]


def test_empty_mask_gives_zero_loss():
    loss, metrics = policy_loss(leaf([-1.0]), row([NAN]), row([1.0]), row([0]), epsilon=1.0, epsilon_high=4.0)
    assert loss.item() == 0.0
    assert metrics["ratio_mean"] == 0.0


def test_denominator_makes_micro_batches_add_up():
    new = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]]
    old = [[-1.1, NAN, -0.2], [-0.3, -1.0, NAN]]
    adv = [[1.5, 1.5, 1.5], [-0.5, -0.5, -0.5]]
    mask = [[1, 1, 0], [1, 1, 1]]  # 5 trainable tokens
    full_new = torch.tensor(new, requires_grad=True)
    full, _ = policy_loss(
        full_new,
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        loss_fn="ppo",
        epsilon=0.2,
        epsilon_high=0.2,
    )
    full.backward()

    parts, grads = [], []
    for i in range(2):
        part_new = torch.tensor([new[i]], requires_grad=True)
        part, _ = policy_loss(
            part_new,
            torch.tensor([old[i]]),
            torch.tensor([adv[i]]),
            torch.tensor([mask[i]]),
            loss_fn="ppo",
            epsilon=0.2,
            epsilon_high=0.2,
            denominator=5,
        )
        part.backward()
        parts.append(part.item())
        grads.append(part_new.grad[0].tolist())
    assert sum(parts) == pytest.approx(full.item())
    assert grads[0] + grads[1] == pytest.approx(full_new.grad.flatten().tolist())
    # by hand: row 0 token 0 r = exp(0.1) = 1.10517 inside [0.8, 1.2] -> -1.5 * 1.10517; token 1 r = 1 -> -1.5
    # row 1: r = 1, exp(-0.2) = 0.81873, 1 (unknown) with A = -0.5 -> 0.5 * (1 + 0.81873 + 1)
    assert full.item() == pytest.approx((-1.5 * math.exp(0.1) - 1.5 + 0.5 * (2 + math.exp(-0.2))) / 5)


def test_bad_arguments_raise():
    one = row([1.0])
    with pytest.raises(ValueError, match="loss_fn"):
        policy_loss(one, one, one, one, loss_fn="grpo", epsilon=0.2, epsilon_high=0.2)
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(one, one, one, one, epsilon=0.2, epsilon_high=0.2, denominator=0)


def test_equal_float_rewards_give_exact_zero_advantages():
    # the mean of [0.1, 0.1, 0.1] rounds to 0.1000000000000000055..., which must not leave a ~1e-11 signal
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.1, 0.1, 0.1], scale_rewards=False) == [0.0, 0.0, 0.0]
