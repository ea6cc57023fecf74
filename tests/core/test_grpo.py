"""GRPO maths checked against numbers worked out by hand in each test (not by re-running the formula)."""

import math

import pytest
import torch

from artnb.core import grpo
from artnb.core.grpo import LossSettings, balance_advantage, group_advantages, importance_ratio

NAN = float("nan")


def policy_loss(
    new, old, advantages, mask, *, ref_logprobs=None, sampling_logprobs=None, denominator=None, **settings
):
    """`grpo.policy_loss` with its LossSettings given as keywords, as the cases below read best."""
    return grpo.policy_loss(
        new,
        old,
        advantages,
        mask,
        LossSettings(**settings),
        ref_logprobs=ref_logprobs,
        sampling_logprobs=sampling_logprobs,
        denominator=denominator,
    )


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
    # huge rewards neither overflow nor lose their order (art.explain calls this on any rewards)
    assert group_advantages([1e308, -1e308]) == pytest.approx([1.0, -1.0])
    assert group_advantages([1e308, 0.0], scale_rewards=False) == pytest.approx([5e307, -5e307])
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


# --- importance-sampling level (GSPO, arXiv 2507.18071) -------------------------------------------------------


def test_importance_ratio_levels_by_hand():
    d = row([math.log(2.0), math.log(8.0)])
    both = torch.tensor([[True, True]])
    # token ratios 2 and 8; their geometric mean is sqrt(16) = 4
    assert importance_ratio(d, both, "token")[0].tolist() == pytest.approx([2, 8])
    assert importance_ratio(d, both, "sequence")[0].tolist() == pytest.approx([4, 4])
    assert importance_ratio(d, both, "average")[0].tolist() == pytest.approx([(2 + 4) / 2, (8 + 4) / 2])
    assert importance_ratio(d, both, "geometric_average")[0].tolist() == pytest.approx([8**0.5, 32**0.5])
    # only selected tokens enter the mean: the second token alone gives exp(ln 8) = 8
    assert importance_ratio(d, torch.tensor([[False, True]]), "sequence")[0, 1].item() == pytest.approx(8)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_ratio(d, both, "group")


def test_gspo_ppo_clips_whole_sequences():
    # row 0: d = [0.1, 0.3] -> s = exp(0.2) = 1.221403 > 1.2, A = +1 -> clipped: L = -1.2 on both tokens, no gradient
    # row 1: d = [-0.1, 0, -0.2] -> s = exp(-0.1) = 0.904837, A = -1 -> unclipped: L = +0.904837 on each token
    new = [[-1.0, -2.0, -float("inf")], [-0.5, -1.0, -1.5]]
    old = [[-1.1, -2.3, NAN], [-0.4, -1.0, -1.3]]
    new_t = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        new_t,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64),
        torch.tensor([[1, 1, 0], [1, 1, 1]]),
        loss_fn="ppo",
        epsilon=0.2,
        epsilon_high=0.2,
        importance_sampling_level="sequence",
    )
    s1 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.2 * 2 + s1 * 3) / 5)
    loss.backward()
    # row 1: each of its 3 terms -A s has d/dnew_t = -A s / 3, so dL/dnew_t = 3 * s / 3 = s, over the denominator 5
    assert new_t.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert new_t.grad[1].tolist() == pytest.approx([s1 / 5] * 3)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((2 * math.exp(0.2) + 3 * s1) / 5)


def test_gspo_with_the_papers_tiny_epsilons():
    # epsilon 3e-4, epsilon_high 4e-4 -> range [0.9997, 1.0004]; d = [1e-4, 9e-4], A = +1
    new = [-1.0, -2.0]
    old = row([-1.0 - 1e-4, -2.0 - 9e-4])
    args = dict(loss_fn="ppo", epsilon=3e-4, epsilon_high=4e-4)
    seq_new, tok_new = leaf(new), leaf(new)
    seq, _ = policy_loss(seq_new, old, row([1, 1]), row([1, 1]), importance_sampling_level="sequence", **args)
    tok, _ = policy_loss(tok_new, old, row([1, 1]), row([1, 1]), **args)
    # sequence: s = exp(5e-4) = 1.000500 > 1.0004 -> both tokens clipped, L = -1.0004 each, no gradient
    assert seq.item() == pytest.approx(-1.0004, abs=1e-12)
    # token: r = 1.000100 stays (gradient -r / 2), r = 1.000900 is clipped to 1.0004
    assert tok.item() == pytest.approx(-(math.exp(1e-4) + 1.0004) / 2, abs=1e-12)
    seq.backward()
    tok.backward()
    assert seq_new.grad[0].tolist() == [0.0, 0.0]
    assert tok_new.grad[0].tolist() == pytest.approx([-math.exp(1e-4) / 2, 0.0])


def test_gspo_cispo_weights_the_sequence_by_its_clipped_geometric_mean_ratio():
    new = [-1.0, -0.5]
    old = old_for_ratios(new, [2.0, 8.0])
    seq_new, tok_new = leaf(new), leaf(new)
    args = dict(epsilon=1.0, epsilon_high=4.0)
    seq, metrics = policy_loss(
        seq_new, old, row([1, 1]), row([1, 1]), importance_sampling_level="sequence", **args
    )
    tok, _ = policy_loss(tok_new, old, row([1, 1]), row([1, 1]), **args)
    # sequence: weight 4 on both: L = -4 * 1 * (-1) = 4 and -4 * (-0.5) = 2 -> mean 3; gradient -4 / 2
    assert seq.item() == pytest.approx(3.0)
    # token: weights 2 and min(8, 5) = 5: L = 2 and 2.5 -> mean 2.25
    assert tok.item() == pytest.approx(2.25)
    seq.backward()
    tok.backward()
    assert seq_new.grad[0].tolist() == pytest.approx([-2.0, -2.0])
    assert tok_new.grad[0].tolist() == pytest.approx([-1.0, -2.5])
    assert metrics["clip_fraction"] == 0.0
    # a sequence with ratios 4 and 16 has s = 8, clipped to 5 for both tokens: L = -5 * 1 * new
    clipped, metrics = policy_loss(
        leaf(new),
        old_for_ratios(new, [4.0, 16.0]),
        row([1, 1]),
        row([1, 1]),
        importance_sampling_level="sequence",
        **args,
    )
    assert clipped.item() == pytest.approx((5 * 1.0 + 5 * 0.5) / 2)
    assert metrics["clip_fraction"] == 1.0


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_token_and_sequence_levels_agree_when_a_sequences_ratios_are_equal(loss_fn):
    new = [[-1.0, -0.2, -3.0], [-0.7, -1.4, -2.0], [-0.1, -0.9, -0.3]]
    ratios = [[1.5, 1.5, 1.5], [0.7, 0.7, 1.0], [1.05, 1.05, 1.05]]  # row 1's last token is padding
    old = torch.tensor(
        [[n - math.log(r) for n, r in zip(a, b, strict=True)] for a, b in zip(new, ratios, strict=True)]
    )
    adv = torch.tensor([[0.8] * 3, [-1.3] * 3, [-0.4] * 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    results = []
    for level in ("token", "sequence", "average", "geometric_average"):
        new_t = torch.tensor(new, requires_grad=True)
        loss, metrics = policy_loss(
            new_t,
            old,
            adv,
            mask,
            loss_fn=loss_fn,
            epsilon=0.2,
            epsilon_high=0.28,
            importance_sampling_level=level,
        )
        loss.backward()
        results.append((loss.item(), new_t.grad.flatten().tolist(), metrics["clip_fraction"]))
    for loss, grad, clip in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-6)
        assert grad == pytest.approx(results[0][1], rel=1e-5, abs=1e-7)
        assert clip == results[0][2]


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_sequence_level_gradient_raises_positive_and_lowers_negative_sequences(loss_fn):
    new = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.8]]
    old = torch.tensor([[-1.05, -1.9, -0.5], [-0.35, -1.2, -0.7]])  # sequence ratios within the clip range
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    new_t = torch.tensor(new, requires_grad=True)
    loss, metrics = policy_loss(
        new_t,
        old,
        adv,
        torch.ones(2, 3),
        loss_fn=loss_fn,
        epsilon=0.2,
        epsilon_high=0.2,
        importance_sampling_level="sequence",
    )
    loss.backward()
    assert metrics["clip_fraction"] == 0.0
    assert (new_t.grad[0] < 0).all()  # descent raises every logprob of the positive sequence
    assert (new_t.grad[1] > 0).all()  # and lowers those of the negative one
    # under ppo every token of a sequence gets -A s / denominator (|o| terms, each with ds/dnew_t = s / |o|)
    if loss_fn == "ppo":
        s0 = math.exp((0.05 - 0.1 + 0.0) / 3)
        assert new_t.grad[0].tolist() == pytest.approx([-s0 / 6] * 3)
    stepped, _ = policy_loss(
        (new_t - 0.1 * new_t.grad).detach(),
        old,
        adv,
        torch.ones(2, 3),
        loss_fn=loss_fn,
        epsilon=0.2,
        epsilon_high=0.2,
        importance_sampling_level="sequence",
    )
    if loss_fn == "ppo":  # cispo's value is not its objective (the weight is a constant); ppo's is
        assert stepped.item() < loss.item()


# --- ART's other ratio knobs ----------------------------------------------------------------------------------


def test_max_negative_advantage_importance_sampling_weight_caps_the_ratio():
    new = [-1.0, -1.0]
    old = old_for_ratios(new, [3.0, 3.0])
    args = dict(loss_fn="ppo", epsilon=0.2, epsilon_high=0.2)
    # A = -1, r = 3: L = -min(-3, -1.2) = 3; A = +1, r = 3: L = -min(3, 1.2) = -1.2
    plain, _ = policy_loss(leaf(new), old, row([-1, 1]), row([1, 1]), **args)
    assert plain.item() == pytest.approx((3 - 1.2) / 2)
    # cap 2: the negative token's r becomes 2 (L = 2); the positive one stays clipped at 1.2
    capped, _ = policy_loss(
        leaf(new),
        old,
        row([-1, 1]),
        row([1, 1]),
        max_negative_advantage_importance_sampling_weight=2.0,
        **args,
    )
    assert capped.item() == pytest.approx((2 - 1.2) / 2)


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_mask_prob_ratio_drops_tokens_outside_the_range(loss_fn):
    new = [-1.0, -1.0]
    new_t = leaf(new)
    loss, metrics = policy_loss(
        new_t,
        old_for_ratios(new, [1.5, 1.1]),
        row([1, 1]),
        row([1, 1]),
        loss_fn=loss_fn,
        epsilon=0.2,
        epsilon_high=0.2,
        mask_prob_ratio=True,
    )
    # r = 1.5 lies outside [0.8, 1.2] -> the token is dropped: L = 0 and no gradient (clipping would give
    # cispo a weight of 1.2); r = 1.1: ppo L = -1.1, cispo L = -1.1 * 1 * (-1) = 1.1
    assert loss.item() == pytest.approx((-1.1 if loss_fn == "ppo" else 1.1) / 2)
    loss.backward()
    assert new_t.grad[0, 0].item() == 0.0
    assert new_t.grad[0, 1].item() == pytest.approx(-1.1 / 2)
    assert metrics["clip_fraction"] == 0.5


def test_kimi_k2_tau_shifts_the_advantage():
    new = [-1.0]
    # d = 0.5, tau = 0.2: A = 1 - 0.2 * 0.5 = 0.9; cispo weight exp(0.5) = 1.648721: L = -1.648721 * 0.9 * (-1)
    loss, _ = policy_loss(
        leaf(new), row([-1.5]), row([1.0]), row([1.0]), epsilon=1.0, epsilon_high=4.0, kimi_k2_tau=0.2
    )
    assert loss.item() == pytest.approx(math.exp(0.5) * 0.9)


def test_truncated_importance_sampling_with_precalculated_old_logprobs():
    # old = the trainer's own logprobs (ratio 1); the engine sampled at old - ln 3, unknown, and old + ln 2
    new = [-1.0, -1.0, -1.0]
    sampling = row([-1.0 - math.log(3.0), NAN, -1.0 + math.log(2.0)])
    loss, metrics = policy_loss(
        leaf(new),
        row(new),
        row([1, 1, 1]),
        row([1, 1, 1]),
        epsilon=1.0,
        epsilon_high=4.0,
        truncated_importance_sampling=2.0,
        sampling_logprobs=sampling,
    )
    # cispo terms -1 * 1 * (-1) = 1; weights min(3, 2) = 2, 1 (no engine logprob), min(0.5, 2) = 0.5
    assert loss.item() == pytest.approx((2 + 1 + 0.5) / 3)
    assert metrics["ratio_mean"] == 1.0


def test_truncated_importance_sampling_at_sequence_level_uses_the_sequence_ratio():
    new = [-1.0, -1.0]
    loss, _ = policy_loss(
        leaf(new),
        old_for_ratios(new, [2.0, 8.0]),
        row([1, 1]),
        row([1, 1]),
        epsilon=1.0,
        epsilon_high=4.0,
        importance_sampling_level="sequence",
        truncated_importance_sampling=3.0,
    )
    # s = 4 on both tokens: cispo L = 4 * 1 = 4 each, times min(4, 3) = 3
    assert loss.item() == pytest.approx(12.0)


def test_balance_advantage_by_hand():
    assert balance_advantage(-2.0, 0.25) == -1.5  # negative scaled by 1 - 0.25
    assert balance_advantage(2.0, 0.25) == 2.0
    assert balance_advantage(2.0, -0.5) == 1.0  # positive scaled by 1 - 0.5
    assert balance_advantage(-2.0, -0.5) == -2.0
    assert balance_advantage(-2.0, 1.0) == 0.0  # b = 1: only better-than-average trajectories teach
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        balance_advantage(1.0, 1.5)
